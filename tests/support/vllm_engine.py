"""vLLM's real Scheduler and worker-role OffloadingConnectors, stepped by hand on host (or
CUDA) caches with a fake forward pass, for tests/test_vllm_offload.py.

The forward pass writes, for every token a step computes, a row of bytes that depends
only on the token prefix up to it, the layer and the head: a block holds the same bytes
whoever computes it, so a loaded block can be checked against the prefix it holds, and a
block holding anything else (stale bytes, another position's) fails.  Loaded tokens are
never written by it; the destination blocks of every load are poisoned just before the
load is submitted, so a load that writes nothing fails too."""

import os
from collections import Counter, defaultdict

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvbm_ext.integrations import vllm as kvbm_vllm  # noqa: E402

EOS = 2
POISON = 0x5A
MIX = np.uint64(0x9E3779B97F4A7C15)


def write_model_config(folder, *, num_layers=2, num_kv_heads=4, head_dim=32):
    """A local Llama config.json (no weights: nothing is loaded), as vLLM reads it offline."""
    import json
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8 * head_dim,
        "intermediate_size": 16 * head_dim, "num_attention_heads": 8, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 10000.0, "bos_token_id": 1,
        "eos_token_id": EOS, "tie_word_embeddings": False}))
    return str(folder)


def token_seeds(token_ids):
    """One 64-bit value per token, a function of the prefix up to it."""
    seeds = np.empty(len(token_ids), np.uint64)
    value = 0x12345
    for i, token in enumerate(token_ids):
        value = hash((value, token)) & 0xFFFFFFFFFFFFFFFF
        seeds[i] = value
    return seeds


def rows(seeds, layer, row_bytes):
    """[len(seeds), row_bytes] uint8: splitmix64 of (seed, layer, byte index)."""
    x = (seeds[:, None] + np.uint64(layer) * MIX + np.arange(row_bytes // 8, dtype=np.uint64)[None, :] * MIX)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return x.view(np.uint8).reshape(len(seeds), row_bytes)


class Engine:
    """A VllmConfig from a local model config, vLLM's Scheduler and one worker-role
    OffloadingConnector per tensor-parallel rank, each over its own caches (its heads):
    per layer [num_blocks, nh / tp, block_size, 2 * head_dim] (vLLM's HND page with K|V
    packed), on `device`."""

    def __init__(self, model_dir, *, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=32, num_layers=2,
                 groups=1, tp=1, extra=None, device="cpu", max_batched_tokens=256):
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        self.tp, self.heads = tp, num_kv_heads // tp
        model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        if hasattr(cache, "kv_cache_layout"):
            # 0.33: the engine core resolves it before the connectors are made (0.26 at run time).
            cache.kv_cache_layout = "LBHNC"
        extra = {"spec_name": "KvbmOffloadingSpec", "spec_module_path": "kvbm_ext.integrations.vllm",
                 "kvbm_num_slots": 16, **(extra or {})}
        kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        self.config = VllmConfig(
            model_config=model, cache_config=cache, device_config=DeviceConfig("cpu"),
            # "mp" named: left to choose, vLLM refuses more TP ranks than GPUs on a CUDA machine.
            parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None),
            scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_batched_tokens,
                                             max_model_len=4096, is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra),
            kv_events_config=kv_events)
        self.config.cache_config.num_gpu_blocks = num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=self.heads, head_size=head_dim,
                                 dtype=torch.bfloat16)
        # groups > 1: the layers split into groups of their own tensors, as a hybrid model's:
        # full attention, then sliding windows longer than any request here.
        per_group = [names[g::groups] for g in range(groups)]
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=self.heads, head_size=head_dim,
                                   dtype=torch.bfloat16, sliding_window=4096)
        specs = [spec] + [window] * (groups - 1)
        self.layer_of = {name: i for i, name in enumerate(names)}
        # vLLM 0.26 counts a worker's bytes per block from its tensors (one per layer);
        # 0.33 from the groups' specs when it is given none.
        tensors = [] if not kvbm_vllm.VLLM_VERSION.startswith("0.26") else [
            KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=[name]) for name in names]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                                        kv_cache_groups=[KVCacheGroupSpec(n, g) for n, g in zip(per_group, specs)])
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=block_size, log_stats=True)
        self.row_bytes = self.heads * 2 * head_dim * 2
        self.caches, self.workers = [], []
        for rank in range(tp):
            self.config.parallel_config.rank = rank
            with set_current_vllm_config(self.config):
                worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
                caches = {name: torch.zeros(num_blocks, self.heads, block_size, 2 * head_dim, dtype=torch.bfloat16,
                                            device=self.device) for name in names}
                worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append([caches[name] for name in names])
        self.config.parallel_config.rank = 0
        self.group_layers = [[self.layer_of[n] for n in group] for group in per_group]
        self.manager = self.scheduler.connector.connector_scheduler.manager
        self.spec_workers = [w.connector_worker.worker for w in self.workers]
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.next_id = 0
        self.submitted, self.reported = Counter(), Counter()
        self.failed = []
        self.loaded_blocks = self.checked_blocks = 0
        self._pending_loads, self._load_requests = {}, {}
        self._recving = Counter()        # request -> the ranks that reported its load finished
        self._context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        for worker in self.spec_workers:
            self._watch(worker)
        self.evicted, self.kv_events = 0, []
        prepare_store, take_events = self.manager.prepare_store, self.scheduler.connector.take_events

        def store(keys, req_context):
            output = prepare_store(keys, req_context)
            self.evicted += len(output.evicted_keys) if output is not None else 0
            return output

        def events():
            taken = list(take_events())
            self.kv_events += taken
            return taken

        self.manager.prepare_store, self.scheduler.connector.take_events = store, events

    def _watch(self, worker):
        """Counts every job submitted and reported; poisons each load's destination blocks
        before the load; remembers what each load must write."""
        submit_store, submit_load, get_finished = worker.submit_store, worker.submit_load, worker.get_finished

        def store(job_id, src_spec, dst_spec):
            self.submitted[job_id] += 1
            return submit_store(job_id, src_spec, dst_spec)

        def load(job_id, src_spec, dst_spec, expedited=False):
            self.submitted[job_id] += 1
            rank = self.spec_workers.index(worker)
            ids = torch.as_tensor(dst_spec.block_ids.astype(np.int64), device=self.device)
            for layer in self.caches[rank]:
                layer.view(torch.uint8)[ids] = POISON
            self._pending_loads.setdefault(job_id, []).append((rank, dst_spec))
            return submit_load(job_id, src_spec, dst_spec, expedited)

        def finished():
            results = get_finished()
            for result in results:
                self.reported[result.job_id] += 1
                if not result.success:
                    self.failed.append(result.job_id)
            return results

        worker.submit_store, worker.submit_load, worker.get_finished = store, load, finished

    def add_request(self, token_ids, max_tokens=4):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id=str(self.next_id), prompt_token_ids=list(token_ids), sampling_params=params,
                          pooling_params=None, block_hasher=self.hasher)
        self.next_id += 1
        self.scheduler.add_request(request)
        return request

    def step(self):
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self._load_requests.update((job_id, job.req_id) for job_id, job in meta.load_jobs.items())
        for worker in self.workers:
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(self._context)
        self._forward(output)
        if output.total_num_scheduled_tokens > 0:
            for worker in self.workers:
                worker.wait_for_save()
        worker_meta = None
        for worker in self.workers:
            _, done = worker.get_finished(output.finished_req_ids)
            self._recving.update(done or ())
            meta_w = worker.build_connector_worker_meta()
            if meta_w is not None:
                worker_meta = meta_w if worker_meta is None else worker_meta.aggregate(meta_w)
            worker.clear_connector_metadata()
        # As vLLM's KVOutputAggregator: a request's load is finished once every rank said so
        # (ranks whose tiers complete in the background say it at different steps).
        recving = {req for req, ranks in self._recving.items() if ranks == self.tp}
        for req in recving:
            del self._recving[req]
        self._check_loads()
        running = [r for r in self.scheduler.running if output.num_scheduled_tokens.get(r.request_id)]
        # A token is sampled only once the prompt is computed, as a model runner does: a
        # request mid chunked prefill samples nothing.
        sampled = [[7 + int(r.request_id) % 900] if r.num_computed_tokens >= r.num_tokens else [] for r in running]
        running = [r.request_id for r in running]
        runner = ModelRunnerOutput(req_ids=running, req_id_to_index={r: i for i, r in enumerate(running)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(finished_sending=set(),
                                                                         finished_recving=recving,
                                                                         kv_connector_worker_meta=worker_meta))
        self.scheduler.update_from_output(output, runner)
        return output

    def _forward(self, output):
        """Writes the rows of every token computed this step, and of no other."""
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            table = [list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(req_id)]
            start = request.num_computed_tokens - count      # schedule() has already advanced it
            tokens = request.all_token_ids[:start + count]
            seeds = token_seeds(tokens)[start:]
            positions = np.arange(start, start + count)
            for group, layers in enumerate(self.group_layers):
                block_ids = np.asarray(table[group])[positions // self.block_size]
                for layer in layers:
                    data = torch.from_numpy(rows(seeds, layer, self.row_bytes * self.tp))
                    for rank in range(self.tp):
                        part = data[:, rank * self.row_bytes:(rank + 1) * self.row_bytes]
                        self._write(rank, layer, block_ids, positions % self.block_size, part)

    def _write(self, rank, layer, block_ids, offsets, data):
        cache = self.caches[rank][layer].view(torch.uint8)      # [nb, nh, nt, 2 * hd * 2]
        data = data.view(len(block_ids), self.heads, -1).to(self.device)
        cache[torch.as_tensor(block_ids, device=self.device), :, torch.as_tensor(offsets, device=self.device)] = data

    def expected(self, rank, layer, token_ids, block_index):
        """What block `block_index` of a request with `token_ids` holds on `rank`, as
        [nh, nt, row] uint8."""
        seeds = token_seeds(token_ids[:(block_index + 1) * self.block_size])[block_index * self.block_size:]
        data = torch.from_numpy(rows(seeds, layer, self.row_bytes * self.tp))
        part = data[:, rank * self.row_bytes:(rank + 1) * self.row_bytes]
        return part.reshape(self.block_size, self.heads, -1).transpose(0, 1)

    def _check_loads(self):
        """Every finished load's blocks, page by page, against the prefix they hold."""
        for job_id in [j for j in self._pending_loads if self.reported[j] == self.tp]:
            req_id = self._load_requests.pop(job_id)
            request = self.scheduler.requests[req_id]
            for rank, spec in self._pending_loads.pop(job_id):
                self.wait_device()
                offset = 0
                for group, (size, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
                    for i in range(size):
                        block = int(spec.block_ids[offset + i])
                        for layer in self.group_layers[group]:
                            got = self.caches[rank][layer].view(torch.uint8)[block].cpu()
                            want = self.expected(rank, layer, request.all_token_ids, first + i)
                            assert torch.equal(got, want), (f"job {job_id} rank {rank} layer {layer}: block {block} "
                                                            f"(request {req_id}, index {first + i}) differs")
                            self.checked_blocks += 1
                    offset += size

    def wait_device(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, max_steps=100000):
        steps = 0
        while self.scheduler.has_requests() and steps < max_steps:
            self.step()
            steps += 1
        return steps

    def drain(self):
        """Steps until no job is in flight, and checks that each was reported once by
        every rank."""
        for _ in range(1000):
            if all(self.reported[j] >= n for j, n in self.submitted.items()) and not self._pending_loads:
                break
            self.wait_device()
            self.step()
        twice = {j: n for j, n in self.reported.items() if n > self.submitted[j]}
        lost = {j: n for j, n in self.submitted.items() if self.reported[j] < n}
        return lost, twice

    def pool_block(self, rank, slot_block, layer):
        """The tier's copy of one block of one layer on one rank, as [nh, nt, row] uint8."""
        pool = self.spec_workers[rank].tier.pool       # [blocks, nh, n_tensors, 2, nt, hd]
        block = pool[slot_block, :, layer].view(torch.uint8)   # [nh, 2, nt, hd * 2]
        return torch.cat([block[:, 0], block[:, 1]], dim=-1).cpu()
