"""transformers' continuous batching offloading through kvbm_ext
(kvbm_ext.integrations.transformers).

A Llama model built from a config (random weights, GQA; nothing downloaded) runs one
generate_batch workload on a GPU cache too small for it, twice: with transformers' own CPU
offloading, then inside kvbm_offloading().  Both runs must make the same decisions (the
same requests offloaded and restored, from and into the same GPU and pool blocks, in the
same order), at least 20 requests must go to the pool and come back, and the generated
tokens must be identical.  In the kvbm_ext run, after each offload the pool blocks hold the
GPU blocks' bytes, and after each restore the GPU blocks (poisoned first) hold the pool
blocks' bytes, compared with a plain torch gather of transformers' own per-layer views.

On the GPU: bf16, 8 layers, the real kvbm_ext calls, with and without transformers'
asynchronous batching.  On the CPU: a small model, the same checks.  Both forms of
transformers' offloading manager (5.17's per-layer pools, 5.24's sector pool) run the same
tests.  Without transformers, the import and entry checks are tested; the rest is skipped.
"""

import random
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import kvbm_ext.integrations
from support.asserts import assert_bitwise_equal, poison_

try:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api, offloading_manager
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
except ImportError as error:
    MISSING = ("needs transformers with continuous batching's offloading manager, "
               f'pip install "kvbm_ext[transformers]" ({error})')
else:
    MISSING = None
    from kvbm_ext.integrations import transformers as integration
    from kvbm_ext.integrations.transformers import KvbmOffloadingManager, kvbm_offloading

needs_transformers = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
# transformers 5.24's manager (one cache tensor cut into sectors, a CachePool) rather than 5.17's.
SECTORS = MISSING is None and hasattr(OffloadingManager, "_compute_num_cpu_sectors")

MIN_REQUESTS_OFFLOADED = 20


@dataclass
class Workload:
    model: dict                   # LlamaConfig arguments
    dtype: torch.dtype
    device: str
    prompts: int
    prompt_tokens: tuple          # (shortest, longest)
    new_tokens: int
    cache: dict                   # ContinuousBatchingConfig arguments, tokens_per_block for page_size
    seed: int = 0
    async_batching: bool = False


GPU_MODEL = dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, vocab_size=8192)
CPU_MODEL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)
GPU_CACHE = dict(tokens_per_block=16, num_blocks=60, max_batch_tokens=512, cpu_offload_space=0.25)
CPU_CACHE = dict(tokens_per_block=16, num_blocks=30, max_batch_tokens=256, cpu_offload_space=0.01)


def gpu_workload(async_batching):
    return Workload(GPU_MODEL, torch.bfloat16, "cuda", 64, (16, 64), 96, GPU_CACHE, seed=11,
                    async_batching=async_batching)


CPU_WORKLOAD = Workload(CPU_MODEL, torch.bfloat16, "cpu", 32, (16, 48), 96, CPU_CACHE, seed=7)


# ----------------------------------------------------------------------------- running a workload

def build_model(workload):
    torch.manual_seed(workload.seed)
    # "sdpa": continuous batching's own in 5.24; 5.17 turns it into its paged|sdpa.
    config = LlamaConfig(**workload.model, attn_implementation="sdpa")
    with torch.device(workload.device):
        model = LlamaForCausalLM(config)
    return model.to(workload.dtype).eval()


def make_prompts(workload):
    rng = random.Random(workload.seed)
    shortest, longest = workload.prompt_tokens
    vocab = workload.model["vocab_size"]
    return [[rng.randrange(vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(workload.prompts)]


def cache_config(workload):
    arguments = dict(workload.cache)
    # 5.24 calls a block's tokens page_size (block_size is deprecated there); 5.17 block_size.
    tokens = "page_size" if hasattr(ContinuousBatchingConfig, "page_size") else "block_size"
    arguments[tokens] = arguments.pop("tokens_per_block")
    return ContinuousBatchingConfig(**arguments, use_cuda_graph=False, use_async_batching=workload.async_batching)


def generate(model, workload, prompts):
    """The generated tokens of every prompt, in prompt order."""
    generation = GenerationConfig(max_new_tokens=workload.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = list(model.generate_batch(prompts, generation_config=generation,
                                        continuous_batching_config=cache_config(workload),
                                        progress_bar=False).values())
    assert len(outputs) == len(prompts)
    errors = [output.error for output in outputs if output.error is not None]
    assert not errors, f"{len(errors)} requests failed, the first with: {errors[0]}"
    assert [len(output.generated_tokens) for output in outputs] == [workload.new_tokens] * len(prompts)
    return [list(output.generated_tokens) for output in outputs]


# ----------------------------------------------------------------------------- what the managers do

def offloaded_moves(manager, victims, victim_block_tables, offloaded):
    """(request id, GPU blocks, pool blocks) of each offloaded victim, as transformers'
    _offload_to_cpu pairs them: 5.17 reads the block tables (not yet freed), group after
    group; 5.24 is handed them, and pairs them per allocator."""
    moves = []
    for state in victims:
        if state.request_id not in offloaded:
            continue
        pool = manager._request_id_to_cpu_blocks[state.request_id]
        if SECTORS:
            tables = victim_block_tables[0][state.request_id]
            moves.append((state.request_id, [b for name in pool for b in tables[name]],
                          [b for name in pool for b in pool[name]]))
        else:
            moves.append((state.request_id, [b for group in manager.cache.group_cache_managers
                                             for b in group.block_table.get(state.request_id, [])], list(pool)))
    return moves


def restored_moves(manager, batch):
    """(request id, GPU blocks, pool blocks) that transformers' restore_scheduled_requests
    copies: per group (5.17) or allocator (5.24), the first blocks of the request's new block
    table, as many as were offloaded (5.24: and no more than the table holds)."""
    moves = []
    for future in batch:
        request_id = future.state.request_id
        if not future.state.is_cpu_offloaded:
            continue
        pool = manager._request_id_to_cpu_blocks[request_id]
        if SECTORS:
            gpu_ids, pool_ids = [], []
            for name, ids in pool.items():
                table = manager.cache.cache_allocators[name].block_table.get(request_id, [])
                count = min(len(ids), len(table))
                gpu_ids += table[:count]
                pool_ids += ids[:count]
            moves.append((request_id, gpu_ids, pool_ids))
        else:
            counts = manager._request_id_to_group_block_counts[request_id]
            moves.append((request_id, [b for group, n in zip(manager.cache.group_cache_managers, counts)
                                       for b in group.block_table.get(request_id, [])[:n]], list(pool)))
    return moves


def layer_pages(cache):
    """[(K, V) of each layer], each [num_blocks, tokens_per_block, nh, hd] indexed by block id,
    from transformers' own views: 5.17's key_cache / value_cache; 5.24's page views (the
    paged kernels' block tables, a block id times block_physical_stride // tokens_per_page)."""
    if not SECTORS:
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        return [(k.view(shape), v.view(shape)) for k, v in zip(cache.key_cache, cache.value_cache)]
    (allocator,) = cache.cache_allocators.values()
    stride = allocator.block_physical_stride // allocator.tokens_per_page
    return [tuple(pages[::stride] for pages in allocator.get_cache_for_block_table(layer))
            for layer in allocator.layer_indices]


def universal_blocks(cache, ids):
    """GPU blocks `ids` of transformers' cache as universal blocks [n, nh, nl, 2, bs, hd] on
    the CPU: a plain torch gather."""
    pages = layer_pages(cache)
    index = torch.tensor(ids, device=pages[0][0].device)
    per_layer = [torch.stack([k[index], v[index]], 1) for k, v in pages]       # [n, 2, bs, nh, hd]
    return torch.stack(per_layer, 1).permute(0, 4, 1, 2, 3, 5).cpu()           # [n, nh, nl, 2, bs, hd]


def poison_gpu_blocks(manager, ids):
    """Fill GPU blocks `ids` with the poison, on the stream transformers computes on."""
    stream = manager._compute_stream
    with torch.cuda.stream(stream) if stream is not None else torch.no_grad():
        for k, v in layer_pages(manager.cache):
            for block in ids:
                poison_(k[block])
                poison_(v[block])


def synchronize(manager):
    if manager._compute_stream is not None:
        torch.cuda.synchronize()


class Schedule:
    """Wraps `cls`'s offload and restore methods and records each event: ("offload" or
    "restore", [(request id, GPU blocks, pool blocks), ...]).  With check_bytes (a
    KvbmOffloadingManager), compares the pool with the GPU cache after each event."""

    def __init__(self, monkeypatch, cls, check_bytes):
        self.events = []
        self.check_bytes = check_bytes
        self.poisoned_pools = set()
        offload, restore = cls._offload_to_cpu, cls.restore_scheduled_requests
        monkeypatch.setattr(cls, "_offload_to_cpu",
                            lambda manager, victims, *tables: self.offload(offload, manager, victims, tables))
        monkeypatch.setattr(cls, "restore_scheduled_requests",
                            lambda manager, batch: self.restore(restore, manager, batch))

    def requests(self, kind):
        return sum(len(moves) for event, moves in self.events if event == kind)

    def blocks(self, kind):
        return sum(len(gpu) for event, moves in self.events if event == kind for _, gpu, _ in moves)

    def offload(self, original, manager, victims, tables):
        if self.check_bytes and id(manager) not in self.poisoned_pools:
            poison_(manager.pool)
            self.poisoned_pools.add(id(manager))
        offloaded = original(manager, victims, *tables)
        moves = offloaded_moves(manager, victims, tables, offloaded)
        if moves:
            self.events.append(("offload", moves))
            if self.check_bytes:
                self.check(manager, moves, "offload")
        return offloaded

    def restore(self, original, manager, batch):
        moves = restored_moves(manager, batch)
        if moves and self.check_bytes:
            poison_gpu_blocks(manager, [b for _, gpu, _ in moves for b in gpu])
        result = original(manager, batch)
        if moves:
            self.events.append(("restore", moves))
            if self.check_bytes:
                self.check(manager, moves, "restore")
        return result

    def check(self, manager, moves, event):
        synchronize(manager)
        gpu_ids = [b for _, gpu, _ in moves for b in gpu]
        pool_ids = [b for _, _, pool in moves for b in pool]
        assert len(gpu_ids) == len(pool_ids), moves
        number = sum(1 for kind, _ in self.events if kind == event)
        assert_bitwise_equal(manager.pool[pool_ids], universal_blocks(manager.cache, gpu_ids),
                             f"{event} {number}: pool blocks {pool_ids} against GPU blocks {gpu_ids}")


class UnpinnedTorch:
    """torch as transformers' offloading_manager sees it where no CUDA is: its pool is
    allocated unpinned (torch refuses pin_memory=True there), everything else unchanged."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


# ----------------------------------------------------------------------------- the tests

def offload_like_transformers(monkeypatch, workload):
    """Runs the workload with transformers' own offloading, then with kvbm_ext's, and checks
    that both did the same and that the kvbm_ext pool held the right bytes throughout."""
    model = build_model(workload)
    prompts = make_prompts(workload)
    with monkeypatch.context() as scoped:
        own = Schedule(scoped, OffloadingManager, check_bytes=False)
        own_tokens = generate(model, workload, prompts)
    kvbm = Schedule(monkeypatch, KvbmOffloadingManager, check_bytes=True)
    with kvbm_offloading() as run:
        kvbm_tokens = generate(model, workload, prompts)

    print(f"offloaded {own.requests('offload')} requests in {len(own.events)} events")
    assert own.requests("offload") >= MIN_REQUESTS_OFFLOADED
    assert own.requests("restore") >= MIN_REQUESTS_OFFLOADED
    assert len(run.managers) == 1 and run.managers[0].pool is not None
    assert kvbm.events == own.events, "kvbm_ext's run did not make transformers' decisions"
    manager = run.managers[0]
    assert (manager.offloaded_requests, manager.offloaded_blocks, manager.restored_requests,
            manager.restored_blocks) == (kvbm.requests("offload"), kvbm.blocks("offload"),
                                         kvbm.requests("restore"), kvbm.blocks("restore"))
    mismatched = [i for i, (a, b) in enumerate(zip(own_tokens, kvbm_tokens)) if a != b]
    assert not mismatched, f"requests {mismatched} generated other tokens"
    return manager


@pytest.mark.gpu
@needs_transformers
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_gpu_offloading_reproduces_transformers(monkeypatch, async_batching):
    manager = offload_like_transformers(monkeypatch, gpu_workload(async_batching))
    assert manager.pool.is_pinned() and manager.pool_buffer.pinned


@needs_transformers
def test_cpu_offloading_reproduces_transformers(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(offloading_manager, "torch", UnpinnedTorch())
    offload_like_transformers(monkeypatch, CPU_WORKLOAD)


# ----------------------------------------------------------------------------- the entry point

@needs_transformers
def test_the_class_is_replaced_only_inside_the_block():
    with pytest.raises(KeyError):
        with kvbm_offloading() as outer:
            assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            with kvbm_offloading() as inner:
                assert inner is not outer
                assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            raise KeyError("leaves the block")
    assert continuous_api.OffloadingManager is OffloadingManager


@needs_transformers
def test_another_transformers_version_is_warned_about(monkeypatch):
    monkeypatch.setattr(integration, "transformers_version", "5.99.0")
    with pytest.warns(RuntimeWarning) as warned:
        with kvbm_offloading():
            pass
    assert warned[0].filename == __file__, "the warning names the caller's with statement"
    message = str(warned[0].message)
    form = integration.SECTOR_POOL if SECTORS else integration.LAYER_POOLS
    for words in ("5.17.0", "5.24.0", "5.99.0", "continuous_api.OffloadingManager", *form.methods, *form.state,
                  "cache_allocators" if SECTORS else "key_cache", form.skipped, "Not known"):
        assert words in message, words


@needs_transformers
def test_a_transformers_without_what_is_used_is_refused(monkeypatch):
    monkeypatch.delattr(OffloadingManager, "restore_scheduled_requests")
    with pytest.raises(RuntimeError, match="OffloadingManager.restore_scheduled_requests"):
        with kvbm_offloading():
            pytest.fail("entered the block")


@needs_transformers
def test_a_manager_of_neither_form_is_refused(monkeypatch):
    monkeypatch.delattr(OffloadingManager, "_compute_num_cpu_sectors" if SECTORS else "_compute_num_cpu_blocks")
    with pytest.raises(RuntimeError, match=r"has no OffloadingManager._compute_num_cpu_blocks \(5.17.0\) or "
                                           r"OffloadingManager._compute_num_cpu_sectors \(5.24.0\)"):
        with kvbm_offloading():
            pytest.fail("entered the block")


@needs_transformers
def test_a_cache_of_another_shape_is_refused():
    class Cache:
        num_blocks, block_size, num_key_value_heads, head_dim = 4, 8, 2, 16
        key_cache = [torch.zeros(6 * 8, 2, 16), torch.zeros(6 * 8, 2, 16)]
        value_cache = [torch.zeros(6 * 8, 2, 16), torch.zeros(4 * 8, 2, 16)]
    with pytest.raises(RuntimeError, match=r"cache.value_cache\[1\] has shape \(32, 2, 16\), expected \(48, 2, 16\)"):
        integration.describe_layer_cache(Cache())


def sector_allocator(layers=(0, 1), index=0):
    """A transformers 5.24 full-attention allocator over a small cache of its own."""
    from transformers.generation.continuous_batching.cache_allocators import CachePool, FullAttentionCacheAllocator
    config = LlamaConfig(**CPU_MODEL)
    allocator = FullAttentionCacheAllocator(index=index, config=config, num_key_value_heads=2,
                                            cache_dtype=torch.bfloat16, page_size=16, layer_indices=list(layers),
                                            allow_block_sharing=False)
    sectors, sector_bytes = 4, allocator.bytes_per_block
    allocator.register_cache_tensor(sector_bytes, sectors * sector_bytes,
                                    torch.zeros((sectors + 2) * sector_bytes, dtype=torch.uint8),
                                    CachePool(sectors, index + 1))
    return allocator


@needs_transformers
@pytest.mark.skipif(not SECTORS, reason="transformers 5.24's cache allocators")
def test_a_cache_of_another_layout_is_refused():
    allocator = sector_allocator()
    k, v = allocator._kv_token_views[1]
    allocator._kv_token_views[1] = (v, k)
    cache = types.SimpleNamespace(cache_allocators={"full_attention": allocator})
    with pytest.raises(RuntimeError, match=r"'full_attention' blocks are 4096 bytes with \(K offset, V offset, "
                                           r"\[head, dim\]\) per layer \[\(0, 1024, \(2, 16\)\), "
                                           r"\(3072, 2048, \(2, 16\)\)\], expected 4096 bytes"):
        integration.describe_sector_cache(cache)


@needs_transformers
@pytest.mark.skipif(not SECTORS, reason="transformers 5.24's cache allocators")
def test_a_cache_of_two_attention_kinds_is_refused():
    cache = types.SimpleNamespace(cache_allocators={"sliding_attention": sector_allocator([0], 0),
                                                    "full_attention": sector_allocator([1], 1)})
    with pytest.raises(RuntimeError, match=r"the cache has 2 allocators \(sliding_attention, full_attention\), "
                                           "expected 1"):
        integration.describe_sector_cache(cache)


# ----------------------------------------------------------------------------- without transformers

@pytest.fixture
def reimport(monkeypatch):
    """Imports kvbm_ext.integrations.transformers anew; the module in use comes back after."""
    name = "kvbm_ext.integrations.transformers"
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(kvbm_ext.integrations, "transformers", None, raising=False)
    return lambda: __import__(name, fromlist=["kvbm_offloading"])


def test_without_transformers_the_import_names_the_extra(monkeypatch, reimport):
    monkeypatch.setitem(sys.modules, "transformers", None)         # `import transformers` fails
    with pytest.raises(ImportError, match=r'needs transformers, which is not installed: '
                                          r'pip install "kvbm_ext\[transformers\]"') as raised:
        reimport()
    assert type(raised.value) is ImportError and raised.value.__cause__.name == "transformers"


def test_a_transformers_without_the_offloading_manager_is_refused_at_entry(monkeypatch, reimport):
    """An older transformers (here one without its generation package) imports, and
    kvbm_offloading() raises the documented RuntimeError."""
    for name in [name for name in sys.modules if name.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    old = types.ModuleType("transformers")
    old.__version__ = "4.46.0"
    monkeypatch.setitem(sys.modules, "transformers", old)
    module = reimport()
    with pytest.raises(RuntimeError, match=r"kvbm_offloading: transformers 4.46.0 has no transformers.generation."
                                           r"continuous_batching.offloading_manager.OffloadingManager \(.*\); "
                                           r"this integration was written against transformers 5.17.0, 5.24.0"):
        with module.kvbm_offloading():
            pytest.fail("entered the block")
