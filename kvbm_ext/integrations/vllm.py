"""vLLM's KV offloading framework, moving blocks through kvbm_ext.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "KvbmOffloadingSpec",
            "spec_module_path": "kvbm_ext.integrations.vllm",
            "cpu_bytes_to_use": 68719476736}}'

vLLM's OffloadingConnector imports `spec_name` from `spec_module_path` and asks the spec
for a scheduler-side manager and a worker-side worker (docs/vllm.md):

- KvbmOffloadingManager: an LRU over the tier's slots.  A slot holds one offloaded chunk
  (blocks_per_chunk GPU blocks) of one KV cache group; lookup, prepare_load,
  prepare_store (evicting the least recently used ready, unpinned chunks),
  complete_store (a failed store frees its slots), complete_load, touch, reset_cache
  and the stored/removed events vLLM publishes;
- KvbmOffloadingWorker: one PagedKVCache.to_cache call per job and KV cache group,
  between a PagedKVCache over vLLM's cache tensors and one over the tier's pool, on
  its own stream per direction after the compute stream, completions polled through
  one CUDA event per job, from a pool (a job is never reported before its bytes are in
  place, each once, in submission order per direction);
- the tier is named by kv_connector_extra_config["kvbm_tier"]: "pinned" (the default,
  a pinned pool from kvbm_ext.pinned_empty), "disk" (files of checksummed slots,
  kvbm_ext.disk) or "peer" (the same slots in another process's memory over NIXL,
  kvbm_ext.peer: a memory node serving several engines).

Where vLLM's page layout is known (attention pages [H, N, 2*hd] or [N, H, 2*hd] with K
and V packed in the last dimension, MLA pages [N, hd]) the pool holds universal blocks,
[slot * blocks_per_chunk + j, nh, n_tensors, no, nt, hd]: heads first, so another
tensor-parallel size can read its own heads of a block as one contiguous slice.
Otherwise (pages with extra bytes such as quantization scales, Mamba state, no vLLM
config in reach) it holds vLLM's canonical pages byte for byte.  The tensor-parallel
workers of a TP-only engine share one pinned region (pinned_empty(..., shared=), as vLLM's
own CPU tier shares one /dev/shm region): each writes its heads of every universal block.

Written against vLLM 0.33.0 and 0.26.0 (TESTED_VERSIONS).  Importing this module checks
that vLLM has every class and method it uses and raises ImportError naming the first
missing one; on another version it warns.
"""

import logging
import os
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import torch

import kvbm_ext

__all__ = ["TESTED_VERSIONS", "KvbmLoadStoreSpec", "KvbmOffloadingManager", "KvbmOffloadingSpec",
           "KvbmOffloadingWorker", "DiskTier", "PeerTier", "PinnedTier", "Tier", "TransferHandle", "check_vllm"]

TESTED_VERSIONS = ("0.33.0", "0.26.0")

# What this module uses of vllm.v1.kv_offload.base: classes, and the methods it
# overrides or calls on them.  Checked at import, before any class below is defined.
REQUIRED = {
    "OffloadingSpec": ("get_manager", "get_worker"),
    "OffloadingManager": ("lookup", "prepare_load", "touch", "complete_load", "prepare_store",
                          "complete_store", "on_new_request", "take_events", "reset_cache"),
    "OffloadingWorker": ("submit_store", "submit_load", "get_finished", "wait", "shutdown"),
    "BlockIDsLoadStoreSpec": (),
    "GPULoadStoreSpec": (),
    "CanonicalKVCaches": (),
    "LookupResult": ("MISS", "HIT", "HIT_PENDING"),
    "OffloadingEvent": (),
    "PrepareStoreOutput": (),
    "RequestOffloadingContext": (),
    "TransferResult": (),
    "get_offload_group_idx": (),
}

log = logging.getLogger("kvbm_ext")


def check_vllm():
    """The installed vLLM's version.  Raises ImportError naming the first class or member
    of vllm.v1.kv_offload.base this module uses that it lacks; warns on a version other
    than TESTED_VERSIONS."""
    import vllm

    version = vllm.__version__
    try:
        from vllm.v1.kv_offload import base
    except ImportError as error:
        raise ImportError(f"kvbm_ext.integrations.vllm: vLLM {version} has no vllm.v1.kv_offload.base "
                          f"({error}); written against vLLM {', '.join(TESTED_VERSIONS)}") from error
    for name, members in REQUIRED.items():
        owner = getattr(base, name, None)
        missing = name if owner is None else next(
            (f"{name}.{member}" for member in members if not hasattr(owner, member)), None)
        if missing:
            raise ImportError(f"kvbm_ext.integrations.vllm: vLLM {version} has no "
                              f"vllm.v1.kv_offload.base.{missing}; written against vLLM "
                              f"{', '.join(TESTED_VERSIONS)}")
    if version not in TESTED_VERSIONS:
        warnings.warn(f"kvbm_ext.integrations.vllm: written against vLLM {', '.join(TESTED_VERSIONS)}, this is "
                      f"{version}: its kv_offload classes have every member used here, but their meaning may "
                      "have changed (the framework is experimental)", RuntimeWarning, stacklevel=2)
    return version


VLLM_VERSION = check_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402  (after the interface check, by design)
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
    TransferResult,
    get_offload_group_idx,
)

from vllm.config import get_current_vllm_config_or_none  # noqa: E402

# OffloadingEvent.medium: the Medium enum since 0.33, a string before.
try:
    from vllm.v1.kv_offload.base import Medium
    MEDIUM = Medium.CPU
except ImportError:
    MEDIUM = "CPU"

# vLLM's names for a page whose heads lead its tokens ([H, N, C]) or follow them.
HEADS_FIRST = ("HND", "LBHNC", "BLHNC", "LHBNC", "BHLNC")
TOKENS_FIRST = ("NHD", "LBNHC", "BLNHC")


class KvbmLoadStoreSpec(BlockIDsLoadStoreSpec):
    """The tier's side of a job: block_ids are tier slots, one per offloaded chunk."""


# ----------------------------------------------------------------------------------
# Scheduler side


@dataclass
class _Chunk:
    slot: int
    ready: bool = False
    readers: int = 0


class KvbmOffloadingManager(OffloadingManager):
    """An LRU over `num_slots` tier slots, one offloaded chunk each.

    A stored chunk becomes loadable at complete_store; a chunk being read (between
    prepare_load and complete_load) or written (between prepare_store and
    complete_store) is never evicted.  Eviction takes the least recently stored,
    loaded or touched chunks first.  With events on, take_events() yields the keys
    stored (at complete_store) and removed (at eviction), as vLLM publishes them."""

    def __init__(self, num_slots, *, enable_events=False):
        if num_slots < 1:
            raise ValueError(f"KvbmOffloadingManager: num_slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._chunks = OrderedDict()       # key -> _Chunk, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._events = [] if enable_events else None

    def lookup(self, key, req_context):
        chunk = self._chunks.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys, req_context):
        slots = []
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None or not chunk.ready:
                raise KeyError(f"KvbmOffloadingManager.prepare_load: key {key.hex()} is "
                               f"{'not offloaded' if chunk is None else 'still being stored'}")
            chunk.readers += 1
            self._chunks.move_to_end(key)
            slots.append(chunk.slot)
        return KvbmLoadStoreSpec(slots)

    def touch(self, keys, req_context):
        for key in keys:
            if key in self._chunks:
                self._chunks.move_to_end(key)

    def complete_load(self, keys, req_context):
        for key in keys:
            chunk = self._chunks[key]
            if chunk.readers == 0:
                raise RuntimeError(f"KvbmOffloadingManager.complete_load: key {key.hex()} was not being loaded")
            chunk.readers -= 1

    def prepare_store(self, keys, req_context):
        keys = list(keys)
        new_keys = list(dict.fromkeys(key for key in keys if key not in self._chunks))
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvbmLoadStoreSpec([]), evicted_keys=[])
        shortfall = len(new_keys) - len(self._free)
        evicted = []
        if shortfall > 0:
            protected = set(keys)
            evicted = [key for key, chunk in self._chunks.items()
                       if chunk.ready and chunk.readers == 0 and key not in protected][:shortfall]
            if len(evicted) < shortfall:
                return None
            for key in evicted:
                self._free.append(self._chunks.pop(key).slot)
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=evicted, medium=MEDIUM, removed=True))
        slots = []
        for key in new_keys:
            slot = self._free.pop()
            self._chunks[key] = _Chunk(slot)
            slots.append(slot)
        return PrepareStoreOutput(keys_to_store=new_keys, store_spec=KvbmLoadStoreSpec(slots), evicted_keys=evicted)

    def complete_store(self, keys, req_context, success=True):
        stored = []
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None or chunk.ready:
                continue
            if success:
                chunk.ready = True
                stored.append(key)
            else:
                # Never announced, so no removal event: the slot just goes back.
                self._free.append(self._chunks.pop(key).slot)
        if stored and self._events is not None:
            self._events.append(OffloadingEvent(keys=stored, medium=MEDIUM, removed=False))

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def take_events(self):
        if self._events:
            events, self._events = self._events, []
            yield from events

    def reset_cache(self):
        self._chunks.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_stored(self):
        """Chunks loadable now."""
        return sum(chunk.ready for chunk in self._chunks.values())


# ----------------------------------------------------------------------------------
# Tiers


class TransferHandle:
    """One tier transfer in flight, with the interface of kvbm_ext._driver.Handle (a tier
    whose far side the host drives, disk or a NIXL peer, returns the driver's handles as
    they are): `done()` says whether it ended, never blocks and never raises;
    `wait(timeout=None)` blocks the host until it ends and raises its error, or
    TimeoutError when `timeout` seconds pass first (the transfer goes on); `error` is
    the exception that failed it, else None."""

    __slots__ = ("error",)

    def __init__(self):
        self.error = None

    def done(self):
        raise NotImplementedError

    def wait(self, timeout=None):
        raise NotImplementedError


class EventHandle(TransferHandle):
    """A job's work enqueued on a CUDA stream, ended when `event` (recorded after it) has."""

    __slots__ = ("event",)

    def __init__(self, event):
        super().__init__()
        self.event = event

    def done(self):
        try:
            return self.event.query()
        except RuntimeError as error:      # a CUDA error of the stream's work
            self.error = error
            return True

    def wait(self, timeout=None):
        if timeout is None:
            try:
                self.event.synchronize()
            except RuntimeError as error:
                self.error = error
        else:
            deadline = time.monotonic() + timeout
            while not self.done():
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"CUDA transfer: not finished within {timeout} s (it goes on)")
                time.sleep(20e-6)
        if self.error is not None:
            raise self.error


class DoneHandle(TransferHandle):
    """A transfer that ran to its end during the call, with its `error` if it failed."""

    __slots__ = ()

    def done(self):
        return True

    def wait(self, timeout=None):
        if self.error is not None:
            raise self.error


class DeferredHandle(TransferHandle):
    """A to_cache(..., defer=True) call whose pieces kvbm_ext's enqueue thread enqueues after
    the call returned: ended once they are enqueued, failed where that failed.  Its bytes
    are the stream's: the job's event, recorded after it, covers them."""

    __slots__ = ("deferred",)

    def __init__(self, deferred):
        super().__init__()
        self.deferred = deferred

    def done(self):
        if not self.deferred.done():
            return False
        self._settle(None)
        return True

    def wait(self, timeout=None):
        self._settle(timeout)
        if self.error is not None:
            raise self.error

    def _settle(self, timeout):
        try:
            self.deferred.result(timeout)
        except RuntimeError as error:
            self.error = error


class Tier:
    """Where offloaded chunks live, in slots of `blocks_per_chunk` GPU blocks.

    A tier is attached once to the worker's caches (`attach(groups, num_slots,
    blocks_per_chunk)`, one GroupCaches per KV cache group: the PagedKVCache over vLLM's
    tensors of the group and what the tier needs to hold the same blocks) and then moves
    blocks by id:
    `store(group, src_ids, slot_block_ids, stream)` copies GPU blocks `src_ids` of the
    group into the tier's blocks `slot_block_ids` (slot * blocks_per_chunk + j),
    `load(group, slot_block_ids, dst_ids, stream)` the reverse.  Work on the GPU is
    enqueued on `stream` (None for host caches), which the worker has already ordered
    after vLLM's compute stream and after which it records one CUDA event per job; each
    returns None where that event covers all of its work (or, on host caches, the work
    is done), else a TransferHandle for the part it drives itself: a disk tier stages
    through pinned memory and answers with a handle over its I/O; a peer tier (NIXL)
    with one over its transfer."""

    name = "tier"

    def attach(self, groups, num_slots, blocks_per_chunk):
        raise NotImplementedError

    def store(self, group, src_ids, slot_block_ids, stream):
        raise NotImplementedError

    def load(self, group, slot_block_ids, dst_ids, stream):
        raise NotImplementedError

    def close(self):
        return


@dataclass
class GroupCaches:
    """One KV cache group on the worker: `index` (its place in vLLM's groups), `cache` (a
    PagedKVCache over vLLM's tensors of the group), `tensor_ids` (their indices in
    CanonicalKVCaches.tensors), `page_bytes` (the group's bytes of one GPU block, every
    tensor together) and `universal` (True where the pages were described in their own
    dims, False for raw pages)."""

    index: int
    cache: object
    tensor_ids: tuple
    page_bytes: int
    universal: bool


class PinnedTier(Tier):
    """A pinned host pool from kvbm_ext.pinned_empty (host memory when the caches are on
    the host), one array for every tensor of the worker:
    [num_slots * blocks_per_chunk, nh, n_tensors, no, nt, hd] (universal blocks) or
    [num_slots * blocks_per_chunk, n_tensors, page_bytes] (raw pages, byte for byte).  Each group moves
    through a PagedKVCache over its tensors' part of the pool.

    shared=(name, tp_rank, tp_size): the universal pool of every TP worker of the engine is
    one region, pinned_empty(..., shared=name) in /dev/shm: [blocks, tp_size * nh, n_tensors,
    no, nt, hd], of which this worker writes and reads its own heads (a contiguous run of
    each block, heads first), so a pool block holds the model's whole universal block."""

    name = "pinned"

    def __init__(self, shared=None):
        self.shared = shared
        self.buffer = self.pool = None
        self.pool_caches = []
        self.seconds = 0.0

    def attach(self, groups, num_slots, blocks_per_chunk):
        started = time.perf_counter()
        first = groups[0].cache
        num_tensors = 1 + max(t for group in groups for t in group.tensor_ids)
        device = torch.device(first.device_name)
        blocks = num_slots * blocks_per_chunk
        shared = self.shared if groups[0].universal else None
        ranks, rank = (1, 0) if shared is None else (shared[2], shared[1])
        if groups[0].universal:
            shape = (blocks, ranks * first.num_heads, num_tensors, first.num_outer, first.block_size, first.head_dim)
        else:
            shape = (blocks, num_tensors, max(group.cache.head_dim for group in groups))
        nbytes = int(np.prod(shape)) * first.itemsize
        if device.type == "cuda" or shared is not None:
            self.buffer = kvbm_ext.pinned_empty((nbytes,), np.uint8, device=device.index,
                                                shared=None if shared is None else shared[0])
            raw = torch.from_dlpack(self.buffer)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        dtype = first.layers[0].dtype
        self.pool = raw.view(dtype).view(shape)
        if shared is not None:
            self.pool = self.pool[:, rank * first.num_heads:(rank + 1) * first.num_heads]
        for group in groups:
            if group.universal and group.tensor_ids == tuple(range(num_tensors)):
                # Every tensor, in order: each pool block is one universal block of the group,
                # contiguous, which lets to_cache stage it whole through the copy engines.
                self.pool_caches.append(kvbm_ext.PagedKVCache(self.pool, "bhlktd", autograd_checks=False))
                continue
            if not group.universal:
                layers = [self.pool[:, t, None, :group.cache.head_dim] for t in group.tensor_ids]
                layout = "btd"
            elif first.num_outer == 2:
                layers, layout = [self.pool[:, :, t] for t in group.tensor_ids], "bhktd"
            else:
                layers, layout = [self.pool[:, :, t, 0] for t in group.tensor_ids], "bhtd"
            self.pool_caches.append(kvbm_ext.PagedKVCache(layers, layout, autograd_checks=False))
        self.seconds = time.perf_counter() - started

    # On CUDA caches the staged pieces are left to kvbm_ext's enqueue thread (defer=True),
    # so that a submission costs the serving loop a few microseconds whatever the job's size.
    def store(self, group, src_ids, slot_block_ids, stream):
        return _deferred(group.cache.to_cache(self.pool_caches[group.index], src_ids, slot_block_ids,
                                              stream=stream, defer=stream is not None))

    def load(self, group, slot_block_ids, dst_ids, stream):
        return _deferred(self.pool_caches[group.index].to_cache(group.cache, slot_block_ids, dst_ids,
                                                                stream=stream, defer=stream is not None))

    def close(self):
        self.pool_caches = []
        self.pool = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def _deferred(deferred):
    return None if deferred is None else DeferredHandle(deferred)


class _PoolTier(Tier):
    """A tier of one kvbm_ext.disk-style pool per KV cache group (`pools[group.index]`),
    whose store and load return the pool's handles.  `bounce_wait`: seconds a job waits at
    submission for bounce space (None: as long as it takes)."""

    bounce_wait = None

    def store(self, group, src_ids, slot_block_ids, stream):
        return self.pools[group.index].store(group.cache, src_ids, slot_block_ids, stream=stream,
                                             timeout=self.bounce_wait)

    def load(self, group, slot_block_ids, dst_ids, stream):
        return self.pools[group.index].load(slot_block_ids, group.cache, dst_ids, stream=stream,
                                            timeout=self.bounce_wait)

    def close(self):
        for pool in self.pools:
            pool.close()
        self.pools = []


class DiskTier(_PoolTier):
    """Files of slots through kvbm_ext.disk.DiskPool (NIXL's POSIX backend; each slot's
    header and checksum verified before its block is written back): one pool per KV cache
    group, `{directory}/kvbm-{worker}-group{index}.pool`, one GPU block a slot, in the
    group cache's universal order (or its raw pages).  The files are made anew when the
    worker attaches: the manager's LRU starts empty, so nothing an earlier engine left
    there is vLLM's to find.  Stores and loads answer with the pool's handles: a store
    ends when its slots are written, a load when its verified blocks are in vLLM's cache;
    a slot that fails verification fails its job, and its block is not written.  A job
    that finds the pool's pinned bounce buffer full waits at submission until earlier jobs
    release it: back-pressure rather than a failed job, which vLLM treats as fatal
    (bounce_bytes sizes the buffer)."""

    name = "disk"

    def __init__(self, directory, worker="dp0-rank0", bounce_bytes=None):
        from kvbm_ext.disk import DiskPool

        self._open = DiskPool
        self.directory, self.worker, self.bounce_bytes = os.fspath(directory), worker, bounce_bytes
        self.pools = []

    def attach(self, groups, num_slots, blocks_per_chunk):
        os.makedirs(self.directory, exist_ok=True)
        for group in groups:
            path = os.path.join(self.directory, f"kvbm-{self.worker}-group{group.index}.pool")
            self.pools.append(self._open(path, num_slots * blocks_per_chunk, like=group.cache, create=True,
                                         bounce_bytes=self.bounce_bytes))


class PeerTier(_PoolTier):
    """Slots in another process's memory through kvbm_ext.peer.PeerPool (NIXL UCX, one-sided
    READs and WRITEs; each slot's header and checksum verified before its block is written
    back): the memory a `python -m kvbm_ext.peer --name NAME --bytes N --store HOST:PORT`
    process serves (kvbm_ext.peer.PeerMemory), found through `store` (a TCPStore's
    "host:port", or a store object).  One pool per KV cache group, one GPU block a slot, in
    the group cache's universal order (or its raw pages), laid one after another in the
    peer's memory from byte `offset`; worker `worker_index`'s pools after those of the
    workers before it (the workers of a TP-only engine have pools of one size), so the
    workers of an engine, and engines given offsets apart, share one region.  The pools are
    made anew when the worker attaches (the manager's LRU starts empty).  Stores and loads
    answer with the pool's handles, as DiskTier's: a peer that dies or hangs fails the jobs
    in flight with kvbm_ext.peer.PeerLostError naming it, within `timeout` seconds, and a
    slot that fails verification (a restarted peer's fresh memory) fails its job without
    its block being written; the pool looks the peer up again at its next job.  A job that
    finds a pool's pinned bounce buffer full waits at submission (bounce_bytes), at most
    `timeout` seconds (a peer that hangs holds the bounce slots of its failed transfers
    until it dies or answers): then the job is not submitted."""

    name = "peer"

    def __init__(self, peer_name, store, worker_index=0, offset=0, bounce_bytes=None, timeout=None):
        from kvbm_ext.peer import TRANSFER_TIMEOUT_S, PeerPool

        self._open = PeerPool
        self.peer_name, self.rendezvous, self.worker_index = peer_name, store, int(worker_index)
        self.offset, self.bounce_bytes, self.timeout = int(offset), bounce_bytes, timeout
        self.bounce_wait = float(TRANSFER_TIMEOUT_S if timeout is None else timeout)
        self.pools = []

    def attach(self, groups, num_slots, blocks_per_chunk):
        from kvbm_ext.peer import open_store

        store = open_store(self.rendezvous) if isinstance(self.rendezvous, str) else self.rendezvous
        blocks = num_slots * blocks_per_chunk
        sizes = [self._open.bytes_needed(group.cache, blocks) for group in groups]
        at = self.offset + self.worker_index * sum(sizes)
        options = {} if self.timeout is None else {"timeout": float(self.timeout)}
        for group, size in zip(groups, sizes):
            self.pools.append(self._open(self.peer_name, store, blocks, like=group.cache, create=True, offset=at,
                                         bounce_bytes=self.bounce_bytes, **options))
            at += size


# The tiers, and the key each one's size is given in (bytes for the whole engine), beside kvbm_num_slots.
SIZE_KEYS = {"disk": "kvbm_disk_bytes", "peer": "kvbm_peer_bytes", "pinned": "cpu_bytes_to_use"}


# ----------------------------------------------------------------------------------
# Worker side


def describe_tensor(tensor, page_bytes, page):
    """A view of one canonical tensor's pages, (num_blocks, page_bytes) int8 with any
    block stride, in the page's own dims: `page` is None (raw bytes: one token of
    page_bytes, layout "btd"), or (dtype, heads_first, nh, nt, no, hd)."""
    pages = tensor[:, :page_bytes]
    if page is None:
        return pages.unsqueeze(1), "btd"
    dtype, heads_first, nh, nt, no, hd = page
    values = pages.view(dtype)
    if no == 1:
        return values.unflatten(1, (nt, hd)), "btd"
    if heads_first:
        return values.unflatten(1, (nh, nt, 2, hd)), "bhtkd"
    return values.unflatten(1, (nt, nh, 2, hd)), "bthkd"


def page_format(config, page_bytes):
    """How a page of `page_bytes` lies, from the vLLM config in reach: (dtype,
    heads_first, nh, nt, no, hd), or (None, why) where its bytes are kept raw."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None, "no vLLM config in reach"
    model = vllm_config.model_config
    # 0.26 passes the cache dtype setting, "auto" meaning the model's dtype.
    name = str(model.dtype).removeprefix("torch.") if config.model.dtype == "auto" else config.model.dtype
    dtype = cache_dtype(name)
    if dtype is None:
        return None, f"cache dtype {name!r} has no torch counterpart"
    tokens = {group.tokens_per_block for group in config.groups}
    if len(tokens) != 1:
        return None, f"groups of {sorted(tokens)} tokens a block"
    nt = tokens.pop()
    hd = model.get_head_size()
    if getattr(model, "use_mla", False):
        if page_bytes == nt * hd * dtype.itemsize:
            return (dtype, True, 1, nt, 1, hd), None
        return None, f"MLA page of {page_bytes} bytes is not [{nt}, {hd}] {dtype}"
    nh = model.get_num_kv_heads(vllm_config.parallel_config)
    layout = getattr(config, "kv_cache_layout", None) or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if layout is None:
        # Not resolved in the config (0.26 resolves it at run time): the layout this connector
        # makes vLLM use.
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        layout = OffloadingConnector.get_required_kvcache_layout(vllm_config)
    layout = getattr(layout, "name", layout)
    if layout not in HEADS_FIRST + TOKENS_FIRST:
        return None, f"KV cache layout {layout!r} is not one of {HEADS_FIRST + TOKENS_FIRST}"
    if page_bytes != nh * nt * 2 * hd * dtype.itemsize:
        return None, f"page of {page_bytes} bytes is not {nh} heads x {nt} tokens x K|V {hd} {dtype}"
    return (dtype, layout in HEADS_FIRST, nh, nt, 2, hd), None


def cache_dtype(name):
    """The torch dtype of vLLM's cache dtype name ("bfloat16", "float16", "fp8_e4m3", ...):
    1-byte types as uint8, whose bytes are copied as they are."""
    if name.startswith("fp8") or name.startswith("float8") or name in ("int8", "uint8"):
        return torch.uint8
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass
class _Job:
    job_id: int
    handles: list
    num_bytes: int
    started: float
    event: object = None    # the CUDA event after the job's stream work, back to the pool once reported


class _Direction:
    """The jobs of one direction, in submission order, on one stream (None on the host)."""

    def __init__(self, stream):
        self.stream = stream
        self.jobs = deque()


class KvbmOffloadingWorker(OffloadingWorker):
    """Moves vLLM's blocks to and from a Tier: per job, one to_cache call per KV cache
    group with blocks in the job.

    On CUDA, stores, loads and expedited loads each have their own stream, and their own
    lane of the device's staging (set_staging(lanes=3) where fewer are set, each lane's
    size kept: with fewer, a job would wait for another stream's job to free the slots).
    Each stream waits for vLLM's compute stream before every job (the KV written by the
    forward pass is what a store reads; a block the forward pass still reads or zeroes is
    not overwritten by a load before it).  Submission enqueues and returns; get_finished()
    reports, per direction and in submission order, each job whose CUDA event (and any
    handle of its tier's) has completed, once; wait() blocks the host until the named
    jobs have ended.  The CUDA events are made once and reused: one for the wait on the
    compute stream, and a pool of completion events, an event going back to it when its
    job is reported (a job's handles are not used after that)."""

    def __init__(self, kv_caches, *, tier, num_slots, blocks_per_chunk, page):
        self.tier = tier
        self.num_slots = num_slots
        self.blocks_per_chunk = blocks_per_chunk
        self._chunk_blocks = np.arange(blocks_per_chunk)
        self.groups = []
        tensors = kv_caches.tensors
        views = {}
        for index, refs in enumerate(kv_caches.group_data_refs):
            if not refs:
                raise ValueError(f"KvbmOffloadingWorker: kv_caches.group_data_refs[{index}] is empty")
            sizes = {ref.page_size_bytes for ref in refs}
            if len(sizes) != 1:
                raise ValueError(f"KvbmOffloadingWorker: kv_caches.group_data_refs[{index}] mixes page sizes "
                                 f"{sorted(sizes)}; one PagedKVCache needs one")
            layers, layout = [], None
            for ref in refs:
                if ref.tensor_idx not in views:
                    views[ref.tensor_idx] = describe_tensor(tensors[ref.tensor_idx].tensor, ref.page_size_bytes,
                                                            page)
                view, layout = views[ref.tensor_idx]
                layers.append(view)
            # Autograd never sees a KV cache: no requires_grad read and version bump per layer
            # and call (0.1 us each).
            self.groups.append(GroupCaches(index, kvbm_ext.PagedKVCache(layers, layout, autograd_checks=False),
                                           tuple(ref.tensor_idx for ref in refs), len(refs) * sizes.pop(),
                                           page is not None))
        device = torch.device(self.groups[0].cache.device_name)
        self._device = device.index
        # CUDA events are made once, not per job: the fence every job's stream waits on,
        # recorded anew each time, and the completion events of reported jobs.
        self._fence, self._idle_events = None, []
        if device.type == "cuda":
            streams = [torch.cuda.Stream(device) for _ in range(3)]
            # A staging lane per stream: a call whose stream owns no lane takes the least
            # recently used one and first waits for that lane's last call, so with the
            # default two an expedited load would wait for a store or a load in flight.
            staging = kvbm_ext.staging_info(device.index)
            if staging["lanes"] < len(streams):
                kvbm_ext.set_staging(staging["lane_bytes"] * len(streams), lanes=len(streams))
            # Staging memory and kernels ready now: the first job waits for neither.
            kvbm_ext.reserve_staging(device.index)
            self._fence = torch.cuda.Event()
        else:
            streams = [None] * 3
        self.store_jobs, self.load_jobs, self.expedited_jobs = self._directions = tuple(
            _Direction(s) for s in streams)
        tier.attach(self.groups, num_slots, blocks_per_chunk)

    def submit_store(self, job_id, src_spec, dst_spec):
        return self._submit(self.store_jobs, job_id, src_spec, dst_spec.block_ids, store=True)

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        direction = self.expedited_jobs if expedited else self.load_jobs
        return self._submit(direction, job_id, dst_spec, src_spec.block_ids, store=False)

    def _submit(self, direction, job_id, gpu_spec, slots, store):
        started = time.perf_counter()
        stream, event = direction.stream, None
        handles, num_bytes = [], 0
        try:
            if stream is not None:
                # A wait keeps the point the fence had when it was enqueued: recording it again is safe.
                self._fence.record(torch.cuda.current_stream(self._device))
                stream.wait_event(self._fence)
            bpc = self.blocks_per_chunk
            slots = np.asarray(slots, dtype=np.int64)
            gpu_ids = gpu_spec.block_ids        # int32 or int64: to_cache reads either
            gpu_offset = slot_offset = 0
            for group, size, first in zip(self.groups, gpu_spec.group_sizes, gpu_spec.block_indices):
                if size == 0:
                    continue
                skip = first % bpc
                num_chunks = -(-(size + skip) // bpc)
                chunk_slots = slots[slot_offset:slot_offset + num_chunks]
                if len(chunk_slots) != num_chunks:
                    raise ValueError(f"job {job_id}: {len(slots)} slots for group sizes {list(gpu_spec.group_sizes)}"
                                     f" and block_indices {list(gpu_spec.block_indices)} at {bpc} blocks a chunk")
                # The tier's blocks of these chunks, from the first block's offset in its chunk
                # (one block a chunk: the slots themselves, without numpy's per-operation cost).
                pool_ids = chunk_slots if bpc == 1 else (
                    chunk_slots[:, None] * bpc + self._chunk_blocks).ravel()[skip:skip + size]
                ids = gpu_ids[gpu_offset:gpu_offset + size]
                if store:
                    handle = self.tier.store(group, ids, pool_ids, stream)
                else:
                    handle = self.tier.load(group, pool_ids, ids, stream)
                if handle is not None:
                    handles.append(handle)
                num_bytes += size * group.page_bytes
                gpu_offset += size
                slot_offset += num_chunks
            if gpu_offset != len(gpu_ids) or slot_offset != len(slots):
                raise ValueError(f"job {job_id}: group sizes {list(gpu_spec.group_sizes)} cover {gpu_offset} of "
                                 f"{len(gpu_ids)} GPU blocks and {slot_offset} of {len(slots)} slots")
            if stream is not None:
                event = self._idle_events.pop() if self._idle_events else torch.cuda.Event()
                event.record(stream)
                handles.append(EventHandle(event))
        except Exception:
            log.exception("KvbmOffloadingWorker: %s job %d was not submitted", "store" if store else "load", job_id)
            return False
        direction.jobs.append(_Job(job_id, handles, num_bytes, started, event))
        return True

    def get_finished(self):
        results = []
        for direction in self._directions:
            jobs = direction.jobs
            while jobs and all(handle.done() for handle in jobs[0].handles):
                job = jobs.popleft()
                if job.event is not None:
                    self._idle_events.append(job.event)     # completed: free to be recorded again
                errors = [handle.error for handle in job.handles if handle.error is not None]
                for error in errors:
                    log.error("KvbmOffloadingWorker: job %d failed: %s", job.job_id, error)
                results.append(TransferResult(job_id=job.job_id, success=not errors, transfer_size=job.num_bytes,
                                              transfer_time=time.perf_counter() - job.started))
        return results

    def wait(self, job_ids):
        for direction in self._directions:
            for job in direction.jobs:
                if job.job_id in job_ids:
                    _wait_all(job.handles)

    def shutdown(self):
        for direction in self._directions:
            for job in direction.jobs:
                _wait_all(job.handles)
            direction.jobs.clear()
        self.tier.close()


def _wait_all(handles):
    """Blocks until every handle has ended.  A failed one keeps its error in `error`, which
    get_finished reports as the job's failure."""
    for handle in handles:
        try:
            handle.wait()
        except Exception:       # kept in handle.error: get_finished reports the job as failed
            pass


# ----------------------------------------------------------------------------------
# The spec vLLM loads


class KvbmOffloadingSpec(OffloadingSpec):
    """The OffloadingSpec vLLM's OffloadingConnector loads by
    kv_connector_extra_config {"spec_name": "KvbmOffloadingSpec", "spec_module_path":
    "kvbm_ext.integrations.vllm"}.  Its own keys there:

    - "kvbm_tier": "pinned" (default), "disk" or "peer";
    - its size: "cpu_bytes_to_use" (vLLM's CPU tier's key, the same meaning) for the
      pinned tier, "kvbm_disk_bytes" for the disk tier, "kvbm_peer_bytes" for the peer
      tier: bytes for the whole engine, every worker's share together; or, for any,
      "kvbm_num_slots": the chunks it holds;
    - for the disk tier, "kvbm_disk_path" (a directory, made if missing; each worker's
      files are its own) and optionally "kvbm_disk_bounce_bytes" (each pool's pinned
      bounce buffer; a job needs room for all its blocks at once: default 1 GiB, at most
      the pool's size);
    - for the peer tier, "kvbm_peer_name" (the name the serving process publishes its
      memory under) and "kvbm_peer_store" (the TCPStore's "host:port" it publishes in),
      optionally "kvbm_peer_offset" (where this engine's pools start in the peer's
      memory, for engines sharing it: default 0), "kvbm_peer_bounce_bytes" (as the disk
      tier's) and "kvbm_peer_timeout" (seconds a job may go without progress: default 30);
    - "kvbm_pool_layout": "auto" (default: universal blocks where vLLM's page layout is
      known) or "raw" (vLLM's pages byte for byte);
    - "kvbm_shared_pool": True (default: the TP workers of a TP-only engine share one
      pinned region of universal blocks, /dev/shm/kvbm-{engine_id}) or False (a pool each);
    - and vLLM's own: "blocks_per_chunk" or "block_size" (the offloaded chunk)."""

    def __init__(self, config):
        super().__init__(config)
        extra = self.extra_config
        tier = extra.get("kvbm_tier", "pinned")
        if tier not in SIZE_KEYS:
            raise ValueError(f"kv_connector_extra_config['kvbm_tier']: {tier!r}; expected one of "
                             f"{sorted(SIZE_KEYS)}")
        if tier == "disk" and not extra.get("kvbm_disk_path"):
            raise ValueError("kv_connector_extra_config: the disk tier needs 'kvbm_disk_path' (a directory for "
                             "its files)")
        if tier == "peer":
            missing = [key for key in ("kvbm_peer_name", "kvbm_peer_store") if not extra.get(key)]
            if missing:
                raise ValueError(f"kv_connector_extra_config: the peer tier needs {' and '.join(map(repr, missing))} "
                                 "(the name a `python -m kvbm_ext.peer` process serves its memory under, and the "
                                 "TCPStore's 'host:port' it publishes it in)")
        self.tier_name = tier
        self.pool_layout = extra.get("kvbm_pool_layout", "auto")
        if self.pool_layout not in ("auto", "raw"):
            raise ValueError(f"kv_connector_extra_config['kvbm_pool_layout']: expected 'auto' or 'raw', "
                             f"got {self.pool_layout!r}")
        self.num_slots = self._num_slots(config, extra, SIZE_KEYS[tier])
        self._manager = self._worker = None

    def _num_slots(self, config, extra, bytes_key):
        if extra.get("kvbm_num_slots") is not None:
            num_slots = int(extra["kvbm_num_slots"])
        elif extra.get(bytes_key):
            slot_bytes = config.worker_kv_bytes_per_block * config.parallel.world_size * self.blocks_per_chunk
            if slot_bytes <= 0:
                raise ValueError("KvbmOffloadingSpec: vLLM reported 0 KV bytes per block; give "
                                 f"kv_connector_extra_config['kvbm_num_slots'] instead of {bytes_key!r}")
            num_slots = int(extra[bytes_key]) // slot_bytes
        else:
            raise ValueError(f"kv_connector_extra_config: expected {bytes_key!r} (bytes for the whole engine) or "
                             "'kvbm_num_slots'")
        if num_slots < 1:
            raise ValueError(f"kv_connector_extra_config: the tier holds {num_slots} chunks; give it at least one")
        return num_slots

    def _shared_pool(self):
        """(name, tp_rank, tp_size) where the TP workers share one pinned region, else None
        with the reason logged: a TP-only engine whose config says who this worker is."""
        config, parallel = self.config, getattr(self.config, "parallel", None)
        if not self.extra_config.get("kvbm_shared_pool", True):
            why = "kvbm_shared_pool is false"
        elif parallel is None or not getattr(config, "engine_id", None):
            why = "vLLM's spec config names no engine and ranks (vLLM 0.26)"
        elif any(getattr(parallel, size, 1) != 1 for size in ("pp_size", "pcp_size", "dcp_size")):
            why = "the engine is not TP-only (pipeline or context parallel)"
        else:
            name = "kvbm-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in config.engine_id)
            return name[:255], parallel.rank % parallel.tp_size, parallel.tp_size
        log.info("KvbmOffloadingSpec: each worker's pinned pool is its own: %s", why)
        return None

    def _tier(self):
        """The worker's tier (made on the worker side only)."""
        if self.tier_name == "pinned":
            return PinnedTier(shared=self._shared_pool())
        # Whose files or bytes they are: this worker's data-parallel replica and rank (vLLM
        # 0.26's spec config has neither: one engine, one worker).
        parallel = getattr(self.config, "parallel", None)
        if self.tier_name == "peer":
            extra = self.extra_config
            index = (getattr(parallel, "data_parallel_index", 0) * getattr(parallel, "world_size", 1)
                     + getattr(parallel, "rank", 0))
            bounce, timeout = extra.get("kvbm_peer_bounce_bytes"), extra.get("kvbm_peer_timeout")
            return PeerTier(extra["kvbm_peer_name"], extra["kvbm_peer_store"], index,
                            int(extra.get("kvbm_peer_offset", 0)), None if bounce is None else int(bounce), timeout)
        worker = f"dp{getattr(parallel, 'data_parallel_index', 0)}-rank{getattr(parallel, 'rank', 0)}"
        bounce = self.extra_config.get("kvbm_disk_bounce_bytes")
        return DiskTier(self.extra_config["kvbm_disk_path"], worker, None if bounce is None else int(bounce))

    def get_manager(self):
        if self._manager is None:
            self._manager = KvbmOffloadingManager(self.num_slots,
                                                  enable_events=self.config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches):
        if self._worker is None:
            page, why = None, "kvbm_pool_layout is 'raw'"
            if self.pool_layout == "auto":
                page_bytes = {ref.page_size_bytes for refs in kv_caches.group_data_refs for ref in refs}
                if len(page_bytes) == 1:
                    page, why = page_format(self.config, page_bytes.pop())
                else:
                    why = f"pages of {sorted(page_bytes)} bytes"
            log.info("KvbmOffloadingSpec: %s tier of %d chunks of %d blocks, %s", self.tier_name, self.num_slots,
                     self.blocks_per_chunk, "universal blocks" if page is not None else f"raw pages ({why})")
            self._worker = KvbmOffloadingWorker(kv_caches, tier=self._tier(), num_slots=self.num_slots,
                                                blocks_per_chunk=self.blocks_per_chunk, page=page)
        return self._worker
