"""transformers' continuous batching, offloading and restoring through kvbm_ext.

    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from kvbm_ext.integrations.transformers import kvbm_offloading

    config = ContinuousBatchingConfig(page_size=32, num_blocks=600, cpu_offload_space=4.0)
    with kvbm_offloading() as run:
        outputs = model.generate_batch(prompts, generation_config=generation_config,
                                       continuous_batching_config=config)
    pool = run.managers[0].pool        # [num_pool_blocks, nh, nl, 2, tokens_per_block, hd], pinned

(transformers 5.17 calls page_size block_size.)  When the GPU cache runs out,
transformers' OffloadingManager picks victims, copies their blocks into a pinned host pool
and restores them when they are scheduled again.  Inside `kvbm_offloading()` every
continuous-batching manager created gets a KvbmOffloadingManager instead, which changes how
the bytes move and nothing else:

- transformers' own methods still decide everything: which requests are evicted, which
  go to the pool and which are soft reset, which pool blocks they get, when and where
  they come back.  The subclass lets them run without their copies and moves the blocks
  their bookkeeping names;
- the GPU cache is described once, as a PagedKVCache (see describe_layer_cache and
  describe_sector_cache for the two forms of transformers' cache);
- the pool is one pinned array from kvbm_ext.pinned_empty, in universal order
  `[num_pool_blocks, nh, nl, 2, tokens_per_block, hd]`: each block's heads lead, so an
  engine with another tensor-parallel size can read the heads it needs as one contiguous
  slice;
- on a GPU, kvbm_ext.reserve_staging() readies the device's staging memory and loads the
  kernels when the manager is made, so that the first offload waits for neither;
- an offload is one `to_cache` call (GPU blocks into pool blocks) and a restore one call
  back, both on the stream transformers computes on, so a block freed by an offload is
  read before the next forward pass writes it, and a restored block is written before
  the forward pass that reads it.

transformers' manager comes in two forms, and the subclass follows the one installed:

- 5.17 (LAYER_POOLS): per-layer key_cache / value_cache tensors and per-layer pinned
  pools, a list of free pool blocks.  transformers' copy loops run over the pool lists,
  which the subclass leaves empty: what remains of them is the upload of a small id tensor
  and, at a restore, an unused staging allocation from torch's caching allocator;
- 5.24 (SECTOR_POOL, since 5.18): one byte tensor cut into sectors of blocks, one pinned
  pool cut the same way and tracked by a CachePool.  Each method does all its bookkeeping
  first and then enters `_stream_ctx()` only to copy, so the subclass's `_stream_ctx()`
  raises SkipCopies, which it catches: transformers' bookkeeping runs whole and its copies
  not at all.

Why a context manager that replaces the class: transformers builds its manager in
ContinuousBatchProcessor.__init__ from the module-level name
`continuous_api.OffloadingManager`, and no ContinuousBatchingConfig field chooses the
class.  The name is replaced while the block runs and restored after it; managers created
inside keep their KvbmOffloadingManager afterwards (a persistent manager too).  Any
continuous batching that another thread starts inside the block gets it as well.

With tensor parallelism each rank's pool holds that rank's heads.  Written against
transformers 5.17.0 and 5.24.0 (TESTED_VERSIONS); entering kvbm_offloading() raises
RuntimeError where transformers lacks what this module uses, and warns on another version,
naming what it checks and what it cannot know.
"""

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np

try:
    import torch
    import transformers
except ModuleNotFoundError as error:
    if error.name not in ("torch", "transformers"):
        raise
    raise ImportError(f"kvbm_ext.integrations.transformers needs {error.name}, which is not installed: "
                      'pip install "kvbm_ext[transformers]"') from error
transformers_version = transformers.__version__

MANAGER_IMPORT_ERROR: ImportError | None = None
try:
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
except ImportError as error:
    # A transformers without continuous batching's offloading manager: this module still imports,
    # and kvbm_offloading() raises RuntimeError naming this error before any manager is made.
    continuous_api, OffloadingManager = None, object  # type: ignore[assignment,misc]
    MANAGER_IMPORT_ERROR = error

import kvbm_ext

__all__ = ["TESTED_VERSIONS", "KvbmOffloading", "KvbmOffloadingManager", "kvbm_offloading"]

TESTED_VERSIONS = ("5.17.0", "5.24.0")
POOL_LAYOUT = "bhlktd"          # universal blocks: [N, nh, nl, 2, tokens_per_block, hd]

log = logging.getLogger("kvbm_ext")


@dataclass(frozen=True)
class ManagerForm:
    """One form of transformers' OffloadingManager and what this module uses of it beyond
    transformers' public API: `methods` are checked at entry, the rest is named by the
    warning on an untested version."""

    version: str            # the transformers release this form was written against
    methods: tuple          # OffloadingManager methods called or overridden; the first sizes the pool
    state: tuple            # the manager's attributes read or set
    cache: str              # what of the cache is read, and how it is checked when a manager is made
    skipped: str            # how transformers' own copies are kept from running


LAYER_POOLS = ManagerForm(
    "5.17.0", ("_compute_num_cpu_blocks", "_offload_to_cpu", "restore_scheduled_requests", "_stream_ctx"),
    ("_cpu_key_cache", "_cpu_value_cache", "_gpu_key_views", "_gpu_value_views", "_free_cpu_blocks",
     "_request_id_to_cpu_blocks", "_request_id_to_group_block_counts", "_num_cpu_blocks", "_compute_stream"),
    "the cache's key_cache / value_cache, checked to be [(num_blocks + 2) * block_size, num_kv_heads, head_dim], "
    "and its group_cache_managers' block_table",
    "its copy loops run over the pool lists _cpu_key_cache and _cpu_value_cache, left empty")
SECTOR_POOL = ManagerForm(
    "5.24.0", ("_compute_num_cpu_sectors", "_offload_to_cpu", "restore_scheduled_requests", "_stream_ctx"),
    ("_cpu_pool", "_request_id_to_cpu_blocks", "_num_cpu_sectors", "_compute_stream"),
    "the cache's one allocator in cache_allocators, checked to be a FullAttentionCacheAllocator whose _copy_view "
    "blocks hold [layer, K/V, token, head, dim] (the offsets of its _kv_token_views), and its block_table",
    "_offload_to_cpu and restore_scheduled_requests enter _stream_ctx() only to copy, after all their bookkeeping")
FORMS = (LAYER_POOLS, SECTOR_POOL)


class SkipCopies(Exception):
    """Raised by KvbmOffloadingManager._stream_ctx (SECTOR_POOL), where transformers is about
    to copy the blocks kvbm_ext moves instead."""


# OffloadingManager is `object` where transformers lacks it; kvbm_offloading() then refuses.
class KvbmOffloadingManager(OffloadingManager):
    """transformers' OffloadingManager with its pool allocated by kvbm_ext.pinned_empty and
    its copies made by one PagedKVCache.to_cache call per offload and per restore.

    Attributes once the pool exists (num_pool_blocks > 0): `gpu_cache` and `pool_cache`
    (the PagedKVCache descriptions), `pool` (a torch view of the pinned pool), `pool_buffer`
    (kvbm_ext's HostBuffer under it) and `pool_seconds` (the time to reserve the device's
    staging memory and load the kernels where the cache is on a GPU, allocate the pool and
    describe it).  Counters: `offloaded_requests`, `offloaded_blocks`, `restored_requests`,
    `restored_blocks`.  `form`: LAYER_POOLS or SECTOR_POOL, the form of transformers' manager
    it follows."""

    def __init__(self, cache, scheduler, cpu_offload_space_gib, safety_threshold, compute_stream,
                 distributed_helper):
        # transformers' __init__ with no space sets every bookkeeping default and pins nothing.
        super().__init__(cache, scheduler, 0.0, safety_threshold, compute_stream, distributed_helper)
        self.form = manager_form()
        self.gpu_cache = self.pool_cache = self.pool = self.pool_buffer = None
        self.pool_seconds = 0.0
        self.offloaded_requests = self.offloaded_blocks = self.restored_requests = self.restored_blocks = 0
        # Pool blocks (LAYER_POOLS) or sectors (SECTOR_POOL), as transformers sizes its own pool.
        units = getattr(self, self.form.methods[0])(cpu_offload_space_gib, safety_threshold)
        units = torch.tensor(units, dtype=torch.int32, device="cpu")
        units = int(distributed_helper.tp_all_reduce_min(units, on_cpu=True).item())
        if units == 0:
            if cpu_offload_space_gib is not None and cpu_offload_space_gib > 0:
                log.warning("kvbm_offloading: cpu_offload_space=%.3g GiB holds no block: no CPU offloading",
                            cpu_offload_space_gib)
            return
        if self.form is LAYER_POOLS:
            self.gpu_cache, dtype = describe_layer_cache(cache), cache.dtype
            num_blocks = self._num_cpu_blocks = units
        else:
            self.gpu_cache, allocator = describe_sector_cache(cache)
            dtype = allocator.cache_dtype
            self._num_cpu_sectors = units
            num_blocks = units * allocator.blocks_per_sector
        started = time.perf_counter()
        device = torch.device(self.gpu_cache.device_name)
        if device.type == "cuda":
            # Staging memory and kernels ready now: the first offload waits for neither.
            kvbm_ext.reserve_staging(device.index)
        self.pool_buffer, self.pool = allocate_pool(num_blocks, self.gpu_cache, dtype)
        self.pool_cache = kvbm_ext.PagedKVCache(self.pool, POOL_LAYOUT)
        self.pool_seconds = time.perf_counter() - started
        if self.form is LAYER_POOLS:
            self._free_cpu_blocks = list(range(num_blocks))
        else:
            # transformers' own pool bookkeeping over kvbm_ext's pool: the same sectors of the same blocks.
            from transformers.generation.continuous_batching.cache_allocators import CachePool
            self._cpu_pool = CachePool(units, len(cache.cache_allocators), num_reserved_sectors=0)
            self._cpu_pool.set_blocks_per_sector(allocator.index, allocator.blocks_per_sector)
        log.info("kvbm_offloading: pool of %d blocks (%.2f GiB, pinned=%s) in %.3f s", num_blocks,
                 self.pool.nbytes / 2**30, self.pool_buffer.pinned, self.pool_seconds)

    def _stream_ctx(self):
        if self.form is SECTOR_POOL:
            raise SkipCopies
        return super()._stream_ctx()

    def _offload_to_cpu(self, victims, *victim_block_tables):
        # SECTOR_POOL passes the victims' block tables, their GPU blocks already freed: none is
        # allocated again before this returns, and the forward pass that may write one is queued after the copy.
        try:
            offloaded = super()._offload_to_cpu(victims, *victim_block_tables)
        except SkipCopies:
            offloaded = {state.request_id for state in victims if state.is_cpu_offloaded}
        if offloaded:
            gpu_ids, pool_ids = [], []
            for state in victims:
                if state.request_id in offloaded:
                    gpu_ids += self._held_blocks(state.request_id, *victim_block_tables)
                    pool_ids += self._pool_blocks(state.request_id)
            # On the compute stream, before the next forward pass, which may write the blocks.
            self.gpu_cache.to_cache(self.pool_cache, gpu_ids, pool_ids, stream=self._compute_stream)
            self.offloaded_requests += len(offloaded)
            self.offloaded_blocks += len(gpu_ids)
        return offloaded

    def restore_scheduled_requests(self, requests_in_batch):
        pool_ids, gpu_ids = [], []
        restored = [future.state.request_id for future in requests_in_batch if future.state.is_cpu_offloaded]
        for request_id in restored:
            pool, gpu = self._restored_blocks(request_id)
            pool_ids += pool
            gpu_ids += gpu
        if pool_ids:
            # Queued before any later offload can reuse these pool blocks (transformers
            # frees them below) and before the forward pass that reads the GPU blocks.
            self.pool_cache.to_cache(self.gpu_cache, pool_ids, gpu_ids, stream=self._compute_stream)
            self.restored_requests += len(restored)
            self.restored_blocks += len(gpu_ids)
        with contextlib.suppress(SkipCopies):
            super().restore_scheduled_requests(requests_in_batch)

    def _held_blocks(self, request_id, *victim_block_tables):
        """The GPU blocks of an offloaded request, in the order of its pool blocks."""
        if self.form is LAYER_POOLS:
            return [block for manager in self.cache.group_cache_managers
                    for block in manager.block_table.get(request_id, [])]
        tables = victim_block_tables[0][request_id]
        return [block for name in self._request_id_to_cpu_blocks[request_id] for block in tables[name]]

    def _pool_blocks(self, request_id):
        """The pool blocks transformers reserved for an offloaded request (SECTOR_POOL: allocator
        after allocator)."""
        blocks = self._request_id_to_cpu_blocks[request_id]
        return blocks if self.form is LAYER_POOLS else [block for ids in blocks.values() for block in ids]

    def _restored_blocks(self, request_id):
        """(pool blocks, GPU blocks) restore_scheduled_requests copies for a request: per group
        or allocator, the first blocks of the new block table, as many as were offloaded
        (SECTOR_POOL: and no more than the new table holds)."""
        if self.form is LAYER_POOLS:
            counts = self._request_id_to_group_block_counts[request_id]
            return self._request_id_to_cpu_blocks[request_id], [
                block for manager, count in zip(self.cache.group_cache_managers, counts)
                for block in manager.block_table.get(request_id, [])[:count]]
        pool_ids, gpu_ids = [], []
        for name, ids in self._request_id_to_cpu_blocks[request_id].items():
            table = self.cache.cache_allocators[name].block_table.get(request_id, [])
            count = min(len(ids), len(table))
            pool_ids += ids[:count]
            gpu_ids += table[:count]
        return pool_ids, gpu_ids


def describe_layer_cache(cache):
    """transformers 5.17: one PagedKVCache over the per-layer K and V tensors (no copy)."""
    expected = ((cache.num_blocks + 2) * cache.block_size, cache.num_key_value_heads, cache.head_dim)
    for name in ("key_cache", "value_cache"):
        for index, tensor in enumerate(getattr(cache, name)):
            if tuple(tensor.shape) != expected:
                raise RuntimeError(f"kvbm_offloading: cache.{name}[{index}] has shape {tuple(tensor.shape)}, "
                                   f"expected {expected} ([(num_blocks + 2) * block_size, num_kv_heads, "
                                   f"head_dim], as in transformers {LAYER_POOLS.version})")
    return kvbm_ext.PagedKVCache(list(zip(cache.key_cache, cache.value_cache)), "(bt)hd",
                                 block_size=cache.block_size)


def describe_sector_cache(cache):
    """transformers 5.24: (a PagedKVCache over the blocks of the cache's allocator, the
    allocator).  Its blocks are the rows of `allocator._copy_view` (the bytes transformers'
    own offloading copies), each `[layer, K/V, token, head, dim]` ("blkthd")."""
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    if len(cache.cache_allocators) != 1:
        raise RuntimeError(f"kvbm_offloading: the cache has {len(cache.cache_allocators)} allocators "
                           f"({', '.join(cache.cache_allocators)}), expected 1: with transformers "
                           f"{SECTOR_POOL.version} it offloads the cache of a model whose layers all use one "
                           "kind of attention")
    (name, allocator), = cache.cache_allocators.items()
    if not isinstance(allocator, FullAttentionCacheAllocator):
        raise RuntimeError(f"kvbm_offloading: the cache's {name!r} allocator is a {type(allocator).__name__}, "
                           "expected a FullAttentionCacheAllocator (full or sliding attention)")
    layers, tokens, heads, head_dim = (allocator.pages_per_block, allocator.tokens_per_page,
                                       allocator.num_key_value_heads, allocator.head_dim)
    chunk = tokens * heads * head_dim * allocator.cache_dtype.itemsize       # one layer's K (or V) in a block
    blocks = allocator._copy_view
    expected = [(2 * i * chunk, (2 * i + 1) * chunk, (heads, head_dim)) for i in range(layers)]
    found = [(k.data_ptr() - blocks.data_ptr(), v.data_ptr() - blocks.data_ptr(), tuple(k.shape[1:]))
             for k, v in (allocator._kv_token_views[layer] for layer in allocator.layer_indices)]
    if blocks.shape[1] != 2 * layers * chunk or found != expected:
        raise RuntimeError(f"kvbm_offloading: the cache's {name!r} blocks are {blocks.shape[1]} bytes with "
                           f"(K offset, V offset, [head, dim]) per layer {found}, expected {2 * layers * chunk} "
                           f"bytes with {expected} ([layer, K/V, token, head, dim], as in transformers "
                           f"{SECTOR_POOL.version})")
    shape = (-1, layers, 2, tokens, heads, head_dim)
    return kvbm_ext.PagedKVCache(blocks.view(allocator.cache_dtype).view(shape), "blkthd"), allocator


def allocate_pool(num_blocks, gpu_cache, dtype):
    """(HostBuffer, torch view [num_blocks, nh, nl, 2, tokens_per_block, hd]) of pinned memory
    (pageable where no GPU is visible).  Allocated as bytes and viewed by torch, so that any
    element type torch has works."""
    shape = (num_blocks, gpu_cache.num_heads, gpu_cache.num_layers, 2, gpu_cache.block_size,
             gpu_cache.head_dim)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffer = kvbm_ext.pinned_empty((nbytes,), np.uint8)
    return buffer, torch.from_dlpack(buffer).view(dtype).view(shape)


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


def manager_form():
    """The ManagerForm of the installed transformers' OffloadingManager (by the method that
    sizes its pool), or None."""
    return next((form for form in FORMS if hasattr(OffloadingManager, form.methods[0])), None)


def check_transformers():
    """Raises RuntimeError where transformers lacks what this module uses; on a version other
    than TESTED_VERSIONS, warns what it checked and what it cannot know."""
    written = f"this integration was written against transformers {', '.join(TESTED_VERSIONS)}"
    if MANAGER_IMPORT_ERROR is not None:
        raise RuntimeError(f"kvbm_offloading: transformers {transformers_version} has no "
                           "transformers.generation.continuous_batching.offloading_manager.OffloadingManager "
                           f"({MANAGER_IMPORT_ERROR}); {written}")
    form = manager_form()
    if form is None:
        missing = [" or ".join(f"OffloadingManager.{form.methods[0]} ({form.version})" for form in FORMS)]
    else:
        missing = [f"OffloadingManager.{name}" for name in form.methods if not hasattr(OffloadingManager, name)]
    constructed = getattr(continuous_api, "OffloadingManager", None)
    if not (isinstance(constructed, type) and issubclass(constructed, OffloadingManager)):
        missing.append("continuous_api.OffloadingManager (the class continuous batching constructs)")
    if missing:
        raise RuntimeError(f"kvbm_offloading: transformers {transformers_version} has no "
                           f"{', '.join(missing)}; {written}")
    if transformers_version not in TESTED_VERSIONS:
        warnings.warn(
            f"kvbm_offloading: written against transformers {', '.join(TESTED_VERSIONS)}, this is "
            f"{transformers_version}, whose OffloadingManager has the methods of {form.version}'s. Checked: "
            "continuous batching builds its manager from continuous_api.OffloadingManager, which has "
            + ", ".join(form.methods) + f"; checked when a manager is made: {form.cache}. Not known: whether "
            "this version keeps its pool and bookkeeping in " + ", ".join(form.state) + " with the same meaning, "
            f"whether {form.skipped}, and whether its offload and restore move the blocks of each request's "
            "block_table in the same order (the first blocks up to the offloaded count); compare its tokens with "
            "transformers' own offloading before relying on it.",
            RuntimeWarning, stacklevel=4)
