"""transformers' continuous batching offloading through kvbm_ext
(kvbm_ext.integrations.transformers).

A Llama model built from a config (random weights, GQA; nothing downloaded) runs one
generate_batch workload on a GPU cache too small for it, twice: with transformers' own CPU
offloading, then inside kvbm_offloading().  Both runs must make the same decisions (the
same requests offloaded and restored, from and into the same GPU and pool blocks, in the
same order), at least 20 requests must go to the pool and come back, and the generated
tokens must be identical.  In the kvbm_ext run, after each offload the pool blocks hold the
GPU blocks' bytes, and after each restore the GPU blocks (poisoned first) hold the pool
blocks' bytes, compared with a plain torch gather of the cache.

On the GPU: bf16, 8 layers, the real kvbm_ext calls, with and without transformers'
asynchronous batching.  On the CPU: a small model.  Skipped without transformers.
"""

import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import offloading_manager  # noqa: E402
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager  # noqa: E402

import kvbm_ext  # noqa: E402
from support import REPO_ROOT
from kvbm_ext.integrations import transformers as integration  # noqa: E402
from kvbm_ext.integrations.transformers import KvbmOffloadingManager, kvbm_offloading  # noqa: E402
from support.asserts import assert_bitwise_equal, poison_

MIN_REQUESTS_OFFLOADED = 20


@dataclass
class Workload:
    model: dict                   # LlamaConfig arguments
    dtype: torch.dtype
    device: str
    prompts: int
    prompt_tokens: tuple          # (shortest, longest)
    new_tokens: int
    cache: dict                   # ContinuousBatchingConfig arguments
    seed: int = 0
    async_batching: bool = False


GPU_MODEL = dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, vocab_size=8192)
CPU_MODEL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)
GPU_CACHE = dict(block_size=16, num_blocks=60, max_batch_tokens=512, cpu_offload_space=0.25)
CPU_CACHE = dict(block_size=16, num_blocks=30, max_batch_tokens=256, cpu_offload_space=0.01)


def gpu_workload(async_batching):
    return Workload(GPU_MODEL, torch.bfloat16, "cuda", 64, (16, 64), 96, GPU_CACHE, seed=11,
                    async_batching=async_batching)


CPU_WORKLOAD = Workload(CPU_MODEL, torch.bfloat16, "cpu", 32, (16, 48), 96, CPU_CACHE, seed=7)


# ----------------------------------------------------------------------------- running a workload

def build_model(workload):
    torch.manual_seed(workload.seed)
    config = LlamaConfig(**workload.model, attn_implementation="paged|sdpa")
    with torch.device(workload.device):
        model = LlamaForCausalLM(config)
    return model.to(workload.dtype).eval()


def make_prompts(workload):
    rng = random.Random(workload.seed)
    shortest, longest = workload.prompt_tokens
    vocab = workload.model["vocab_size"]
    return [[rng.randrange(vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(workload.prompts)]


def generate(model, workload, prompts):
    """The generated tokens of every prompt, in prompt order."""
    generation = GenerationConfig(max_new_tokens=workload.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(**workload.cache, use_cuda_graph=False,
                                      use_async_batching=workload.async_batching)
    outputs = list(model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config,
                                        progress_bar=False).values())
    assert len(outputs) == len(prompts)
    errors = [output.error for output in outputs if output.error is not None]
    assert not errors, f"{len(errors)} requests failed, the first with: {errors[0]}"
    assert [len(output.generated_tokens) for output in outputs] == [workload.new_tokens] * len(prompts)
    return [list(output.generated_tokens) for output in outputs]


# ----------------------------------------------------------------------------- what the managers do

def held_blocks(manager, request_id):
    """A request's GPU blocks, group after group, as transformers' _offload_to_cpu gathers them."""
    return [b for group in manager.cache.group_cache_managers for b in group.block_table.get(request_id, [])]


def restored_blocks(manager, request_id):
    """The GPU blocks transformers' restore_scheduled_requests fills for a request."""
    counts = manager._request_id_to_group_block_counts[request_id]
    return [b for group, n in zip(manager.cache.group_cache_managers, counts)
            for b in group.block_table.get(request_id, [])[:n]]


def universal_blocks(cache, ids):
    """GPU blocks `ids` of transformers' cache as universal blocks [n, nh, nl, 2, bs, hd] on
    the CPU: a plain torch gather of key_cache / value_cache."""
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    index = torch.tensor(ids, device=cache.key_cache[0].device)
    per_layer = [torch.stack([k.view(shape)[index], v.view(shape)[index]], 1)      # [n, 2, bs, nh, hd]
                 for k, v in zip(cache.key_cache, cache.value_cache)]
    return torch.stack(per_layer, 1).permute(0, 4, 1, 2, 3, 5).cpu()                # [n, nh, nl, 2, bs, hd]


def poison_gpu_blocks(manager, ids):
    """Fill GPU blocks `ids` with the poison, on the stream transformers computes on."""
    shape = (-1, manager.cache.block_size, manager.cache.num_key_value_heads, manager.cache.head_dim)
    stream = manager._compute_stream
    with torch.cuda.stream(stream) if stream is not None else torch.no_grad():
        for part in manager.cache.key_cache + manager.cache.value_cache:
            for block in ids:
                poison_(part.view(shape)[block])


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
        monkeypatch.setattr(cls, "_offload_to_cpu", lambda manager, victims: self.offload(offload, manager, victims))
        monkeypatch.setattr(cls, "restore_scheduled_requests",
                            lambda manager, batch: self.restore(restore, manager, batch))

    def requests(self, kind):
        return sum(len(moves) for event, moves in self.events if event == kind)

    def offload(self, original, manager, victims):
        if self.check_bytes and id(manager) not in self.poisoned_pools:
            poison_(manager.pool)
            self.poisoned_pools.add(id(manager))
        offloaded = original(manager, victims)
        moves = [(state.request_id, held_blocks(manager, state.request_id),
                  list(manager._request_id_to_cpu_blocks[state.request_id]))
                 for state in victims if state.request_id in offloaded]
        if moves:
            self.events.append(("offload", moves))
            if self.check_bytes:
                self.check(manager, moves, "offload")
        return offloaded

    def restore(self, original, manager, batch):
        moves = [(f.state.request_id, restored_blocks(manager, f.state.request_id),
                  list(manager._request_id_to_cpu_blocks[f.state.request_id]))
                 for f in batch if f.state.is_cpu_offloaded]
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
    mismatched = [i for i, (a, b) in enumerate(zip(own_tokens, kvbm_tokens)) if a != b]
    assert not mismatched, f"requests {mismatched} generated other tokens"
    return run.managers[0]


@pytest.mark.gpu
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_gpu_offloading_reproduces_transformers(monkeypatch, async_batching):
    manager = offload_like_transformers(monkeypatch, gpu_workload(async_batching))
    assert manager.pool.is_pinned() and manager.pool_buffer.pinned


def test_cpu_offloading_reproduces_transformers(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(offloading_manager, "torch", UnpinnedTorch())
    offload_like_transformers(monkeypatch, CPU_WORKLOAD)


# ----------------------------------------------------------------------------- the entry point

def test_the_class_is_replaced_only_inside_the_block():
    from transformers.generation.continuous_batching import continuous_api
    with pytest.raises(KeyError):
        with kvbm_offloading() as outer:
            assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            with kvbm_offloading() as inner:
                assert inner is not outer
                assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            assert issubclass(continuous_api.OffloadingManager, KvbmOffloadingManager)
            raise KeyError("leaves the block")
    assert continuous_api.OffloadingManager is OffloadingManager


def test_another_transformers_version_is_warned_about(monkeypatch):
    monkeypatch.setattr(integration, "transformers_version", "5.99.0")
    with pytest.warns(RuntimeWarning) as warned:
        with kvbm_offloading():
            pass
    message = str(warned[0].message)
    for words in ("5.17.0", "5.99.0", "continuous_api.OffloadingManager", "_offload_to_cpu",
                  "restore_scheduled_requests", "key_cache", "_request_id_to_cpu_blocks", "Not known"):
        assert words in message, words


def test_a_transformers_without_what_is_used_is_refused(monkeypatch):
    monkeypatch.delattr(OffloadingManager, "restore_scheduled_requests")
    with pytest.raises(RuntimeError, match="OffloadingManager.restore_scheduled_requests"):
        with kvbm_offloading():
            pytest.fail("entered the block")


def test_a_cache_of_another_shape_is_refused():
    class Cache:
        num_blocks, block_size, num_key_value_heads, head_dim = 4, 8, 2, 16
        key_cache = [torch.zeros(6 * 8, 2, 16), torch.zeros(6 * 8, 2, 16)]
        value_cache = [torch.zeros(6 * 8, 2, 16), torch.zeros(4 * 8, 2, 16)]
    with pytest.raises(RuntimeError, match=r"cache.value_cache\[1\] has shape \(32, 2, 16\), expected \(48, 2, 16\)"):
        integration.describe_gpu_cache(Cache())


def test_doc_example_runs(monkeypatch):
    """docs/transformers.md's example, as written."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    import readme
    sys.path.pop(0)
    path = os.path.join(REPO_ROOT, "docs", "transformers.md")
    code = readme.examples(readme.read(path))["transformers"]
    exec(compile(code, path, "exec"), {"__name__": "docs_transformers_example"})
