"""transformers' continuous batching, offloading and restoring through kvbm_ext.

    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from kvbm_ext.integrations.transformers import kvbm_offloading

    config = ContinuousBatchingConfig(block_size=32, num_blocks=600, cpu_offload_space=4.0)
    with kvbm_offloading() as run:
        outputs = model.generate_batch(prompts, generation_config=generation_config,
                                       continuous_batching_config=config)
    pool = run.managers[0].pool        # [num_pool_blocks, nh, nl, 2, block_size, hd], pinned

When the GPU cache runs out, transformers' OffloadingManager picks victims, copies their
blocks into a pinned host pool and restores them when they are scheduled again.  Inside
`kvbm_offloading()` every continuous-batching manager created gets a KvbmOffloadingManager
instead, which changes how the bytes move and nothing else:

- transformers' own methods still decide everything: which requests are evicted, which
  go to the pool and which are soft reset, which pool blocks they get, when and where
  they come back.  The subclass lets them run, with their copy loops over no layers, and
  moves the blocks their bookkeeping names;
- the GPU cache is described once: a PagedKVCache over the key_cache / value_cache
  pairs, each `[(num_blocks + 2) * block_size, num_kv_heads, head_dim]` ("(bt)hd");
- the pool is one pinned array from kvbm_ext.pinned_empty, in universal order
  `[num_pool_blocks, nh, nl, 2, block_size, hd]`: each block's heads lead, so an engine
  with another tensor-parallel size can read the heads it needs as one contiguous slice;
- when the manager is made, kvbm_ext.reserve_staging() readies the device's staging
  memory and loads the kernels, so that the first offload waits for neither;
- an offload is one `to_cache` call (GPU blocks into pool blocks) and a restore one call
  back, both on the stream transformers computes on, so a block freed by an offload is
  read before the next forward pass writes it, and a restored block is written before
  the forward pass that reads it (transformers copies per layer and per K/V, 2 * nl
  gathers and copies per offload, on the same stream);
- what remains of transformers' copy loops is the upload of a small id tensor and, at a
  restore, an unused staging allocation from torch's caching allocator.

Why a context manager that replaces the class: transformers 5.17 builds its manager in
ContinuousBatchProcessor.__init__ from the module-level name
`continuous_api.OffloadingManager`, and no ContinuousBatchingConfig field chooses the
class.  The name is replaced while the block runs and restored after it; managers created
inside keep their KvbmOffloadingManager afterwards (a persistent manager too).  Any
continuous batching that another thread starts inside the block gets it as well.

With tensor parallelism each rank's pool holds that rank's heads.  Written against
transformers 5.17.0 (TESTED_VERSIONS); on another version, entering kvbm_offloading()
warns, naming what it checks and what it cannot know.
"""

import contextlib
import logging
import time
import warnings

import numpy as np
import torch
from transformers import __version__ as transformers_version
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

import kvbm_ext

__all__ = ["TESTED_VERSIONS", "KvbmOffloading", "KvbmOffloadingManager", "kvbm_offloading"]

TESTED_VERSIONS = ("5.17.0",)
GPU_LAYOUT = "(bt)hd"           # key_cache[l] / value_cache[l]: [(num_blocks + 2) * block_size, nh, hd]
POOL_LAYOUT = "bhlktd"          # universal blocks: [N, nh, nl, 2, block_size, hd]

# What this module uses of transformers beyond its public API, checked before a run.
MANAGER_METHODS = ("_compute_num_cpu_blocks", "_offload_to_cpu", "restore_scheduled_requests")
MANAGER_STATE = ("_cpu_key_cache", "_cpu_value_cache", "_gpu_key_views", "_gpu_value_views", "_free_cpu_blocks",
                 "_request_id_to_cpu_blocks", "_request_id_to_group_block_counts", "_num_cpu_blocks",
                 "_compute_stream")

log = logging.getLogger("kvbm_ext")


class KvbmOffloadingManager(OffloadingManager):
    """transformers' OffloadingManager with its pool allocated by kvbm_ext.pinned_empty and
    its copies made by one PagedKVCache.to_cache call per offload and per restore.

    Attributes once the pool exists (num_pool_blocks > 0): `gpu_cache` and `pool_cache`
    (the PagedKVCache descriptions), `pool` (a torch view of the pinned pool), `pool_buffer`
    (kvbm_ext's HostBuffer under it) and `pool_seconds` (the time to reserve the device's
    staging memory and load the kernels, allocate the pool and describe it).  Counters: `offloaded_requests`, `offloaded_blocks`, `restored_requests`,
    `restored_blocks`."""

    def __init__(self, cache, scheduler, cpu_offload_space_gib, safety_threshold, compute_stream,
                 distributed_helper):
        # transformers' __init__ with no space sets every bookkeeping default and pins nothing.
        super().__init__(cache, scheduler, 0.0, safety_threshold, compute_stream, distributed_helper)
        self.gpu_cache = self.pool_cache = self.pool = self.pool_buffer = None
        self.pool_seconds = 0.0
        self.offloaded_requests = self.offloaded_blocks = self.restored_requests = self.restored_blocks = 0
        num_blocks = self._compute_num_cpu_blocks(cpu_offload_space_gib, safety_threshold)
        num_blocks = torch.tensor(num_blocks, dtype=torch.int32, device="cpu")
        self._num_cpu_blocks = int(distributed_helper.tp_all_reduce_min(num_blocks, on_cpu=True).item())
        if self._num_cpu_blocks == 0:
            if cpu_offload_space_gib is not None and cpu_offload_space_gib > 0:
                log.warning("kvbm_offloading: cpu_offload_space=%.3g GiB holds no block: no CPU offloading",
                            cpu_offload_space_gib)
            return
        self.gpu_cache = describe_gpu_cache(cache)
        started = time.perf_counter()
        # Staging memory and kernels ready now: the first offload waits for neither.
        kvbm_ext.reserve_staging(cache.key_cache[0].device.index)
        self.pool_buffer, self.pool = allocate_pool(self._num_cpu_blocks, cache)
        self.pool_cache = kvbm_ext.PagedKVCache(self.pool, POOL_LAYOUT)
        self.pool_seconds = time.perf_counter() - started
        self._free_cpu_blocks = list(range(self._num_cpu_blocks))
        log.info("kvbm_offloading: pool of %d blocks (%.2f GiB, pinned=%s) in %.3f s", self._num_cpu_blocks,
                 self.pool.nbytes / 2**30, self.pool_buffer.pinned, self.pool_seconds)

    def _offload_to_cpu(self, victims):
        offloaded = super()._offload_to_cpu(victims)
        if offloaded:
            gpu_ids, pool_ids = [], []
            for state in victims:
                if state.request_id in offloaded:
                    gpu_ids += self._held_blocks(state.request_id)
                    pool_ids += self._request_id_to_cpu_blocks[state.request_id]
            # Before the caller frees the blocks: the next forward pass, which may write
            # them, is queued after this read on the same stream.
            self.gpu_cache.to_cache(self.pool_cache, gpu_ids, pool_ids, stream=self._compute_stream)
            self.offloaded_requests += len(offloaded)
            self.offloaded_blocks += len(gpu_ids)
        return offloaded

    def restore_scheduled_requests(self, requests_in_batch):
        pool_ids, gpu_ids = [], []
        restored = [future.state.request_id for future in requests_in_batch if future.state.is_cpu_offloaded]
        for request_id in restored:
            pool_ids += self._request_id_to_cpu_blocks[request_id]
            gpu_ids += self._restored_blocks(request_id)
        if pool_ids:
            # Queued before any later offload can reuse these pool blocks (transformers
            # frees them below) and before the forward pass that reads the GPU blocks.
            self.pool_cache.to_cache(self.gpu_cache, pool_ids, gpu_ids, stream=self._compute_stream)
            self.restored_requests += len(restored)
            self.restored_blocks += len(gpu_ids)
        super().restore_scheduled_requests(requests_in_batch)

    def _held_blocks(self, request_id):
        """The GPU blocks of a request, group after group, as _offload_to_cpu lists them."""
        return [block for manager in self.cache.group_cache_managers
                for block in manager.block_table.get(request_id, [])]

    def _restored_blocks(self, request_id):
        """The GPU blocks restore_scheduled_requests fills: per group, the first as many blocks
        of the request's new table as it offloaded."""
        counts = self._request_id_to_group_block_counts[request_id]
        return [block for manager, count in zip(self.cache.group_cache_managers, counts)
                for block in manager.block_table.get(request_id, [])[:count]]


def describe_gpu_cache(cache):
    """One PagedKVCache over transformers' per-layer K and V tensors (no copy)."""
    expected = ((cache.num_blocks + 2) * cache.block_size, cache.num_key_value_heads, cache.head_dim)
    for name in ("key_cache", "value_cache"):
        for index, tensor in enumerate(getattr(cache, name)):
            if tuple(tensor.shape) != expected:
                raise RuntimeError(f"kvbm_offloading: cache.{name}[{index}] has shape {tuple(tensor.shape)}, "
                                   f"expected {expected} ([(num_blocks + 2) * block_size, num_kv_heads, "
                                   f"head_dim], as in transformers {TESTED_VERSIONS[-1]})")
    return kvbm_ext.PagedKVCache(list(zip(cache.key_cache, cache.value_cache)), GPU_LAYOUT,
                                 block_size=cache.block_size)


def allocate_pool(num_blocks, cache):
    """(HostBuffer, torch view [num_blocks, nh, nl, 2, block_size, hd]) of pinned memory.
    Allocated as bytes and viewed by torch, so that any element type torch has works."""
    shape = (num_blocks, cache.num_key_value_heads, len(cache.key_cache), 2, cache.block_size, cache.head_dim)
    nbytes = int(np.prod(shape)) * cache.dtype.itemsize
    buffer = kvbm_ext.pinned_empty((nbytes,), np.uint8)
    return buffer, torch.from_dlpack(buffer).view(cache.dtype).view(shape)


class KvbmOffloading:
    """What kvbm_offloading() yields: `managers`, every KvbmOffloadingManager created
    inside the block, in order."""

    def __init__(self):
        self.managers = []


@contextlib.contextmanager
def kvbm_offloading():
    """Inside the block, transformers' continuous batching offloads and restores KV blocks
    through kvbm_ext (see the module docstring).  Yields a KvbmOffloading.  Blocks nest: a
    manager is recorded by the innermost block it is created in."""
    check_transformers()
    run = KvbmOffloading()
    outer = continuous_api.OffloadingManager

    class RunManager(KvbmOffloadingManager):
        """A KvbmOffloadingManager recorded in this block's run.managers."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            run.managers.append(self)

    continuous_api.OffloadingManager = RunManager
    try:
        yield run
    finally:
        continuous_api.OffloadingManager = outer


def check_transformers():
    """Raises RuntimeError where transformers lacks what this module uses; on a version other
    than TESTED_VERSIONS, warns what it checked and what it cannot know."""
    missing = [f"OffloadingManager.{name}" for name in MANAGER_METHODS if not hasattr(OffloadingManager, name)]
    constructed = getattr(continuous_api, "OffloadingManager", None)
    if not (isinstance(constructed, type) and issubclass(constructed, OffloadingManager)):
        missing.append("continuous_api.OffloadingManager (the class continuous batching constructs)")
    if missing:
        raise RuntimeError(f"kvbm_offloading: transformers {transformers_version} has no {', '.join(missing)}; "
                           f"this integration was written against transformers {', '.join(TESTED_VERSIONS)}")
    if transformers_version not in TESTED_VERSIONS:
        warnings.warn(
            f"kvbm_offloading: written against transformers {', '.join(TESTED_VERSIONS)}, this is "
            f"{transformers_version}. Checked: continuous batching builds its manager from "
            "continuous_api.OffloadingManager, which has " + ", ".join(MANAGER_METHODS) + "; checked at "
            "construction: the cache's key_cache / value_cache are [(num_blocks + 2) * block_size, num_kv_heads, "
            "head_dim]. Not known: whether this version keeps its pool and bookkeeping in "
            + ", ".join(MANAGER_STATE) + " with the same meaning, and whether its offload and restore move "
            "the blocks of each request's block_table in the same order (per group, the first blocks up to the "
            "offloaded count); compare its tokens with transformers' own offloading before relying on it.",
            RuntimeWarning, stacklevel=3)
