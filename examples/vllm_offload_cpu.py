#!/usr/bin/env python3
"""vLLM's scheduler loop offloading through kvbm_ext, on the CPU, with no model weights.

What `vllm serve ... --kv-transfer-config` sets up (docs/vllm.md), stepped by hand: a
VllmConfig from a local 2-layer Llama config.json (nothing downloaded: HF_HUB_OFFLINE=1),
vLLM's own Scheduler with the OffloadingConnector loading `KvbmOffloadingSpec` from
`kvbm_ext.integrations.vllm` by spec_module_path, and a worker-role OffloadingConnector
over host tensors shaped as vLLM allocates them (per layer [num_blocks, nh, block_size,
2 * head_dim], K and V packed).  A stand-in forward pass writes, for each token it
computes, bytes that depend on the token prefix alone.

  1. a request with a 96-token prompt runs; its 6 full blocks are stored in the tier;
  2. other requests push it out of the small GPU cache;
  3. a request with the same prompt gets a prefix hit from the tier: the blocks are
     loaded into other GPU blocks, and checked bit for bit against the prefix.

Run (vLLM installed: tests/requirements-vllm.txt; kvbm_ext built in place, repository
root on PYTHONPATH):

    python3 examples/vllm_offload_cpu.py
"""

import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK, GPU_BLOCKS = 2, 4, 32, 16, 24

model_dir = tempfile.mkdtemp()
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": HEADS,
               "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 1024,
               "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "eos_token_id": 2}, f)

cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
config = VllmConfig(
    model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096),
    cache_config=cache_config, device_config=DeviceConfig("cpu"),
    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096,
                                     is_encoder_decoder=False),
    kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                        kv_connector_extra_config={
                                            "spec_name": "KvbmOffloadingSpec",
                                            "spec_module_path": "kvbm_ext.integrations.vllm",
                                            "kvbm_num_slots": 256}))
config.cache_config.num_gpu_blocks = GPU_BLOCKS
names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
# vLLM 0.26's worker finds each layer's tensor in kv_cache_tensors; 0.33 needs none listed here.
tensors = ([KVCacheTensor(size=spec.page_size_bytes * GPU_BLOCKS, shared_by=[name]) for name in names]
           if vllm.__version__.startswith("0.26") else [])
kv_cache_config = KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_tensors=tensors,
                                kv_cache_groups=[KVCacheGroupSpec(names, spec)])
scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, block_size=BLOCK,
                      structured_output_manager=StructuredOutputManager(config))
# The worker process builds its connector inside vLLM's config context, where the spec
# reads the model's heads and head size (so the tier holds universal blocks).
with set_current_vllm_config(config):
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    caches = [torch.zeros(GPU_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in names]
    worker.register_kv_caches(dict(zip(names, caches)))
tier = worker.connector_worker.worker.tier
print(f"tier: {tier.name}, pool {tuple(tier.pool.shape)} {tier.pool.dtype}")


def token_bytes(token_ids, layer):
    """[len(token_ids), HEADS, 2 * HEAD_DIM] bf16 bytes, each row a function of the prefix up to it."""
    prefix = np.cumsum(np.asarray(token_ids, np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(layer))
    rows = prefix[:, None] * np.uint64(0xBF58476D1CE4E5B9) + np.arange(HEADS * HEAD_DIM // 2, dtype=np.uint64)
    return torch.from_numpy((rows ^ (rows >> np.uint64(29))).view(np.int16).copy()).view(torch.bfloat16).view(
        len(token_ids), HEADS, 2 * HEAD_DIM)


init_none_hash(sha256)
hasher = get_request_block_hasher(BLOCK, sha256)
context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
loads = []


def step():
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    loads.extend((job.req_id, job.dst_spec) for job in meta.load_jobs.values())
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(context)                  # loads first, then last step's stores
    for req_id, count in output.num_scheduled_tokens.items():   # the stand-in forward pass
        request = scheduler.requests[req_id]
        start = request.num_computed_tokens - count
        positions = np.arange(start, start + count)
        blocks = np.asarray(scheduler.kv_cache_manager.get_block_ids(req_id)[0])[positions // BLOCK]
        for layer, cache in enumerate(caches):
            rows = token_bytes(request.all_token_ids[:start + count], layer)[start:]
            cache[torch.as_tensor(blocks), :, torch.as_tensor(positions % BLOCK)] = rows
    worker.wait_for_save()
    _, recving = worker.get_finished(output.finished_req_ids)
    worker_meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    running = [r for r in scheduler.running if output.num_scheduled_tokens.get(r.request_id)]
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=[r.request_id for r in running], req_id_to_index={r.request_id: i for i, r in enumerate(running)},
        sampled_token_ids=[[5] if r.num_computed_tokens >= r.num_tokens else [] for r in running],
        kv_connector_output=KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta)))


def run(request_id, token_ids):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    scheduler.add_request(Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                                  pooling_params=None, block_hasher=hasher))
    while scheduler.has_requests():
        step()


rng = np.random.default_rng(0)
prompt = rng.integers(3, 1000, 96).tolist()
run("first", prompt)
manager = scheduler.connector.connector_scheduler.manager
print(f"after the first request: {manager.num_stored} chunks stored")
for i in range(4):
    run(f"other-{i}", rng.integers(3, 1000, 96).tolist())
run("again", prompt + [7])
assert loads, "the second request found no prefix in the tier"
for req_id, spec in loads:
    for i, block in enumerate(spec.block_ids.tolist()):
        index = spec.block_indices[0] + i
        for layer, cache in enumerate(caches):
            want = token_bytes(prompt[:(index + 1) * BLOCK], layer)[index * BLOCK:]
            assert torch.equal(cache[block].transpose(0, 1).view(torch.int16), want.view(torch.int16)), (req_id, block)
    print(f"{req_id}: {len(spec.block_ids)} blocks loaded into GPU blocks {spec.block_ids.tolist()}, bit-exact")
worker.shutdown()
