"""A disk tier: KV blocks to and from a file of slots, through NIXL's POSIX backend.

    pool = DiskPool("/nvme/kv.pool", num_slots=100_000, like=cache)   # universal slots
    h = pool.store(cache, block_ids, slot_ids)          # returns at once; h.done(), h.wait()
    h = pool.load(slot_ids, cache, other_block_ids)     # h.wait_stream(s): s sees the blocks

A pool is one file of `num_slots` slots, each holding one block in the pool's layout
(universal `[nh, nl, no, nt, hd]` by default), with a header naming the pool, layout, slot
and store (a generation) and the CRC-32C of the payload.  `store` and `load` move blocks
between any PagedKVCache (GPU or host) and slots by id, with the selections `to_cache`
takes; a store's GPU side is enqueued on the caller's stream at the call (the blocks may
be reused once the stream passes it), the file side completes in the background (the
handle of kvbm_ext._driver).  Blocks pass through a bounce buffer of the pool's (pinned
host memory from kvbm_ext.pinned_empty, registered with NIXL once), where their checksum
is computed; a load writes a block only once its slot has been read and verified.

The crash rules, the on-disk format and why NIXL POSIX: docs/disk.md; the format:
kvbm_ext/_disk_format.py.  torch is needed (it views the bounce buffer in the cache's
dtype); NIXL (`nixl-cu13`, the extra [nixl]) is imported when a pool is opened.
"""

from __future__ import annotations

import collections
import ctypes.util
import errno
import fcntl
import itertools
import mmap
import operator
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from . import PagedKVCache, _debug, _driver, crc32c, pinned_empty
from ._disk_format import (ALIGN, HEADER_BYTES, LAYOUT_KEYS, MAX_KEY, Geometry, Header, describe, new_geometry,
                           pack_header, pack_superblock, parse_header, parse_superblock)

if TYPE_CHECKING:
    import torch

__all__ = ["DiskHandle", "DiskPool", "SlotError"]

DEFAULT_BOUNCE_BYTES = 1 << 30
# A file request is cut into pieces of at most this many bytes: the engine keeps several in
# flight, which a disk needs to reach its rate (benchmarks/README.md, disk.py).
IO_PIECE_BYTES = 1 << 20
# A call moves its slots in groups of about this many bytes: a store writes a group while
# the next is copied into the bounce buffer, a load verifies and copies a group while the
# next is read (each group one engine transfer).
GROUP_BYTES = 32 << 20
# A pool posts no new group while this many bytes of its requests are in flight: beyond the
# device's queue, an engine call blocks in the kernel, holding the GIL (benchmarks/README.md).
IN_FLIGHT_BYTES = 128 << 20
SCAN_CHUNK_BYTES = 16 << 20         # header table bytes read at a time when a pool is opened
POSIX_DEFAULTS = {"use_aio": "true", "use_uring": "false", "use_posix_aio": "false"}

_agents = itertools.count()
_gds_missing: str | None = None     # why this process cannot create a GDS_MT backend, once known


class SlotError(Exception):
    """Slots whose content cannot be trusted: never written, written for another layout or
    pool, torn by a crash, corrupted, or of another generation than expected.  `reasons`
    maps each such slot to why; the load that raised it did not write their blocks (it
    wrote the others')."""

    def __init__(self, message: str, reasons: Mapping[int, str]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)


class DiskHandle(_driver.Handle):
    """A store or load in the background (kvbm_ext._driver.Handle: done(), wait(timeout),
    wait_stream(stream), error, nbytes: the slots' payload bytes, seconds), with `slots`
    and `generations`: for a store the generations it writes, for a load those it expects."""

    def __init__(self, what: str, nbytes: int, slots: Sequence[int], generations: Sequence[int]) -> None:
        super().__init__(what, nbytes)
        self.slots = tuple(slots)
        self.generations = tuple(generations)


def _debug_on() -> bool:
    return os.environ.get("KVBM_EXT_DEBUG", "") not in ("", "0")


def _log(message: str) -> None:
    if _debug_on():
        _debug.emit(message)


def _import_nixl() -> Any:
    """NIXL's Python API: nixl_cu13, nixl_cu12 or the meta package's nixl."""
    import importlib

    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("kvbm_ext.disk needs NIXL: pip install 'kvbm_ext[nixl]' (nixl-cu13==1.5.1; install torch "
                      "first, NIXL depends on it)")


def _named_ints(values: Any, what: str) -> list[int]:
    """A sequence of ints (or a host int array) as a list; TypeError naming `what`."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        device = getattr(values, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise TypeError(f"{what}: expected ints on the host, got an array on {device}")
        values = values.tolist()
    try:
        return [operator.index(v) for v in values]
    except TypeError as error:
        raise TypeError(f"{what}: expected a sequence of ints, got {values!r}") from error


def _selected(count: int, selection: Any) -> list[int]:
    """The indices a valid layers= / heads= selection names (to_cache has checked it)."""
    if selection is None:
        return list(range(count))
    if isinstance(selection, slice):
        return list(range(count)[selection])
    if isinstance(selection, range):
        return list(selection)
    index = operator.index(selection)
    return [index + count if index < 0 else index]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"like: dtype {name!r} is not a torch dtype")
    return dtype


def _layout(like: Any, dims: Any) -> dict[str, Any]:
    """The slots' layout: dims plus the sizes of a PagedKVCache or a mapping."""
    if not isinstance(dims, str) or dims[:1] != "b" or dims[-1:] != "d" or sorted(dims) != sorted("bhlktd"):
        raise ValueError(f"dims: expected the letters b, h, l, k, t, d once each, b first (the slot) and d last "
                         f"(head dim runs are contiguous), e.g. 'bhlktd' (universal), got {dims!r}")
    if isinstance(like, PagedKVCache):
        # The cache's names where they differ from the layout's keys; dtype_name: the
        # string (like.dtype is a torch.dtype or numpy.dtype for such caches).
        sizes = {k: getattr(like, "block_size" if k == "tokens_per_block" else k) for k in LAYOUT_KEYS[1:-2]}
        dtype: Any = like.dtype_name
    elif isinstance(like, Mapping):
        missing = [k for k in LAYOUT_KEYS[1:-1] if k not in like]
        if missing:
            raise ValueError(f"like: the mapping lacks {', '.join(missing)}")
        sizes = {k: like[k] for k in LAYOUT_KEYS[1:-2]}
        dtype = like["dtype"]
    else:
        raise TypeError(f"like: expected a PagedKVCache or a mapping of its sizes, got {type(like).__name__}")
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"like: {key} must be a positive int, got {value!r}")
    name = str(dtype).removeprefix("torch.")
    return {"dims": dims, **sizes, "dtype": name, "itemsize": _torch_dtype(name).itemsize}


def _slot_shape(layout: dict[str, Any]) -> tuple[int, ...]:
    size = {"h": layout["num_heads"], "l": layout["num_layers"], "k": layout["num_outer"],
            "t": layout["tokens_per_block"], "d": layout["head_dim"]}
    return tuple(size[letter] for letter in layout["dims"][1:])


class _Engine:
    """One NIXL agent for one pool file: its POSIX backend, the bounce buffer and the file
    registered with it.  Used from the driver thread only once the pool is open (posting
    and polling), and from the opening and closing thread before and after that."""

    def __init__(self, api: Any, fd: int, geometry: Geometry, bounce_addr: int, bounce_bytes: int, engine: str,
                 params: dict[str, str], direct: bool) -> None:
        self.fd = fd
        self.name = f"kvbm_ext.disk-{os.getpid()}-{next(_agents)}"
        # No progress thread: the POSIX backend advances its queue when polled, and the
        # driver polls; NIXL's own thread would spin a core.
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.gds = "not tried (engine='POSIX')" if engine == "POSIX" else self._probe_gds(geometry, direct)
        settings = {**POSIX_DEFAULTS, **params}
        self.agent.create_backend("POSIX", settings)
        queue = [name for name, on in (("io_uring", "use_uring"), ("POSIX AIO", "use_posix_aio")) if
                 settings.get(on) == "true"]
        self.description = f"NIXL POSIX ({queue[0] if queue else 'Linux AIO'})"
        self.dram = self.agent.register_memory([(bounce_addr, bounce_bytes, 0, "")], "DRAM", backends=["POSIX"])
        self.file = self.agent.register_memory([(0, geometry.file_bytes, fd, "")], "FILE", backends=["POSIX"])
        self.bounce_addr = bounce_addr

    def _probe_gds(self, geometry: Geometry, direct: bool) -> str:
        """Why GDS is not used here, tried rather than assumed: a GDS_MT backend that fails
        to register a file must not be left to carry bytes (ai-dynamo/dynamo 15079)."""
        global _gds_missing
        if not direct:
            return "not tried: GDS needs O_DIRECT, which this file is opened without"
        if _gds_missing is not None:
            return _gds_missing
        try:
            self.agent.create_backend("GDS_MT", {})
        except Exception as error:  # NIXL raises its own exception types
            found = ctypes.util.find_library("cufile")
            # Once a process: what the machine lacks does not change between pools.
            _gds_missing = (f"NIXL's GDS_MT backend cannot be created ({type(error).__name__}: {error}; libcufile "
                            f"{'found: ' + found if found else 'not found by the loader'})")
            return _gds_missing
        try:
            registration = self.agent.register_memory([(0, geometry.file_bytes, self.fd, "")], "FILE",
                                                      backends=["GDS_MT"])
        except Exception as error:
            return f"GDS_MT cannot register the file ({type(error).__name__}: {error})"
        self.agent.deregister_memory(registration, backends=["GDS_MT"])
        return ("GDS_MT registers the file, but is not used: each slot's checksum is computed on the host "
                "bytes of the bounce buffer, which GPUDirect Storage would not pass through")

    def post(self, op: str, pieces: list[tuple[int, int, int]], far: Any = None) -> Any:
        """Posts one transfer of (bounce offset, bytes, file offset) pieces; its NIXL handle."""
        dram = self.agent.get_xfer_descs([(self.bounce_addr + at, n, 0) for at, n, _ in pieces], "DRAM")
        file = self.agent.get_xfer_descs([(offset, n, self.fd) for _, n, offset in pieces], "FILE")
        handle = self.agent.initialize_xfer(op, dram, file, self.name, backends=["POSIX"])
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise OSError(errno.EIO, f"NIXL refused to post the {op}")
        return handle

    def done(self, handle: Any) -> bool:
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise OSError(errno.EIO, "NIXL reports the transfer failed")
        return state == "DONE"

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.agent.deregister_memory(self.file, backends=["POSIX"])
        self.agent.deregister_memory(self.dram, backends=["POSIX"])


class _Transfer:
    """One posted engine transfer and the slots it serves."""

    def __init__(self, pool: _SlotPool, op: str, pieces: list[tuple[int, int, int]], slots: list[int],
                 far: Any = None) -> None:
        self.pool, self.op, self.pieces, self.slots = pool, op, pieces, slots
        self.error: BaseException | None = None
        self.ended = False
        self.nbytes = sum(n for _, n, _ in pieces)
        try:
            self.handle = pool._engine.post(op, pieces, far)
        except Exception as failure:  # NIXL raises its own exception types
            self.handle, self.ended = None, True
            self.error = pool._explain(op, pieces, slots, failure)
            return
        pool._in_flight_bytes += self.nbytes

    def poll(self) -> bool:
        """Whether the transfer has ended (done or failed, and nothing of it in flight)."""
        if self.ended:
            return True
        if self.error is None:
            try:
                if not self.pool._engine.done(self.handle):
                    return False
            except Exception as failure:  # NIXL raises its own exception types
                self.error = failure
        try:
            self.pool._engine.release(self.handle)
        except Exception:  # NIXL could not cancel what is still in flight yet: poll again
            return False
        self.ended = True
        self.pool._in_flight_bytes -= self.nbytes
        if self.error is not None:
            self.error = self.pool._explain(self.op, self.pieces, self.slots, self.error)
        return True


class _Job:
    """What store and load jobs share: the pool, the handle, the call's slots, bounce units
    (`unit[i]` for the call's i-th slot), the transfers posted, and their errors."""

    deadline = None     # the driver's: none (a disk request ends by itself; a peer's job checks its own)

    def __init__(self, pool: _SlotPool, handle: DiskHandle, slots: list[int], units: dict[int, int]) -> None:
        self.pool, self.handle, self.slots, self.unit = pool, handle, slots, units
        self.transfers: list[_Transfer] = []
        self.stall_at = pool._job_deadline()    # fails when nothing of it ends before (None: never)
        self.far = pool._far_now()              # where its transfers go, for the job's life

    def _post(self, op: str, pieces: list[tuple[int, int, int]], indices: list[int]) -> _Transfer:
        t = _Transfer(self.pool, op, pieces, [self.slots[i] for i in indices], self.far)
        self.transfers.append(t)
        return t

    def _in_flight(self) -> bool:
        """Polls every transfer (each poll lets the engine queue more of it); a transfer
        that ended moves the job's stall deadline on."""
        was = [t.ended for t in self.transfers]
        busy = not all([t.poll() for t in self.transfers])
        if self.stall_at is not None and was != [t.ended for t in self.transfers]:
            self.stall_at = self.pool._job_deadline()
        return busy

    def _check_stall(self) -> None:
        """Fails the job where nothing of it ended by its stall deadline (a far side that
        stopped answering: a peer that hangs)."""
        if self.stall_at is not None and time.monotonic() > self.stall_at:
            raise self.pool._stalled(self)

    def _io_error(self) -> BaseException | None:
        return next((t.error for t in self.transfers if t.ended and t.error is not None), None)


class _StoreJob(_Job):
    """Per group of slots: copied into the bounce buffer (a CUDA event, or at once on the
    host) -> payloads posted, their checksums computed while they are written.  Once every
    payload has completed: every header in one transfer -> committed.  A header goes out
    only after its payload completed, and the store's slots commit together."""

    def __init__(self, pool: _SlotPool, handle: DiskHandle, slots: list[int], units: dict[int, int],
                 keys: list[bytes], groups: list[list[int]]) -> None:
        super().__init__(pool, handle, slots, units)
        self.keys, self.groups = keys, groups
        self.copied: list[Any] = []     # per group copied so far: its CUDA event, or None (copied on the host)
        self.aborted: BaseException | None = None   # set by the caller when a copy failed
        self.posted = 0                 # groups whose payloads are posted
        self.summed = 0                 # slots, in call order, whose checksum is in their header
        self.headers: _Transfer | None = None

    def step(self) -> str:
        self._check_stall()
        failure = self.aborted or self._io_error()
        moved = failure is None and self._advance()
        if self._in_flight() or not all(e is None or e.query() for e in self.copied):
            return _driver.MOVED if moved else _driver.WAITING
        failure = self.aborted or self._io_error()
        if failure is not None:
            raise failure
        if self.headers is None:
            if self.summed < len(self.slots):
                return _driver.MOVED if moved else _driver.WAITING
            indices = list(range(len(self.slots)))
            self.headers = self._post("WRITE", self.pool._header_pieces(self.unit, self.slots, indices), indices)
            return _driver.MOVED
        self.pool._stored(self, None)
        return _driver.DONE

    def _advance(self) -> bool:
        """One thing a step: post the next copied group's payloads, or sum the next slot."""
        if (self.posted < len(self.copied) and self.pool._room()
                and (self.copied[self.posted] is None or self.copied[self.posted].query())):
            group = self.groups[self.posted]
            self._post("WRITE", self.pool._payload_pieces(self.unit, self.slots, group), group)
            self.posted += 1
            return True
        if self.posted and self.summed <= self.groups[self.posted - 1][-1]:
            i, pool = self.summed, self.pool
            pack_header(pool._geometry, self.slots[i], self.handle.generations[i], crc32c(pool._payload(self.unit[i])),
                        self.keys[i], pool._header(self.unit[i]))
            self.summed += 1
            return True
        return False

    def abandon(self, error: BaseException) -> None:
        self.pool._stored(self, error)


class _LoadJob(_Job):
    """Each group's headers and payloads read (while the pool has room in flight) -> per
    group, in order: its slots verified (header and checksum), then the blocks of those
    that verified written (a GPU cache: on the pool's stream, after the caller's stream at
    submission).  A block whose slot fails is never written; the handle's error names each
    such slot, once the blocks written are in place."""

    def __init__(self, pool: _SlotPool, handle: DiskHandle, slots: list[int], units: dict[int, int],
                 cache: PagedKVCache, block_ids: Any, selection: dict[str, Any], after: Any,
                 refused: dict[int, str], groups: list[list[int]]) -> None:
        super().__init__(pool, handle, slots, units)
        self.cache, self.block_ids, self.selection, self.after = cache, block_ids, selection, after
        self.reasons = dict(refused)
        self.groups = groups
        self.reads: list[_Transfer] = []
        self.next_group = 0             # the group being verified, then written
        self.next_slot = 0              # its next slot to verify (a position in the group)
        self.written: Any = None        # the event after the last GPU write

    def step(self) -> str:
        self._check_stall()
        pool = self.pool
        in_flight = self._in_flight()
        if len(self.reads) < len(self.groups) and pool._room():
            group = self.groups[len(self.reads)]
            self.reads.append(self._post("READ", pool._header_pieces(self.unit, self.slots, group)
                                         + pool._payload_pieces(self.unit, self.slots, group), group))
            return _driver.MOVED
        if self.next_group < len(self.groups):
            return _driver.MOVED if self._advance() else _driver.WAITING
        if in_flight or (self.written is not None and not self.written.query()):
            return _driver.WAITING
        failure = self._io_error()
        if failure is not None:
            raise failure
        if self.reasons:
            raise pool._slot_error(self.reasons)
        pool._release(self)
        return _driver.DONE

    def _advance(self) -> bool:
        """One thing a step: verify the current group's next slot, or write its verified blocks."""
        if self.next_group == len(self.reads):
            return False
        group, read = self.groups[self.next_group], self.reads[self.next_group]
        if not read.ended:
            return False
        if read.error is None and self.next_slot < len(group):
            self._verify(group[self.next_slot])
            self.next_slot += 1
            return True
        good = [i for i in group if self.slots[i] not in self.reasons] if read.error is None else []
        if good:
            self._write(good)
        self.next_group += 1
        self.next_slot = 0
        if self.next_group == len(self.groups):
            self.handle.gpu_enqueued(self.written)
        return True

    def _verify(self, i: int) -> None:
        pool, slot, unit = self.pool, self.slots[i], self.unit[i]
        header = parse_header(pool._geometry, slot, pool._header(unit))
        if isinstance(header, str):
            self.reasons[slot] = header
            return
        expected = self.handle.generations[i]
        if header.generation != expected:
            self.reasons[slot] = (f"holds generation {header.generation}, not the {expected} expected (a store "
                                  f"this load did not expect, or a header that survived its payload)")
            return
        found = crc32c(pool._payload(unit))
        if found != header.payload_crc:
            self.reasons[slot] = (f"its payload fails its checksum (crc32c {found:#010x}, its header says "
                                  f"{header.payload_crc:#010x}): torn by a crash mid-store, or corrupted")

    def _write(self, indices: list[int]) -> None:
        pool = self.pool
        units = [self.unit[i] for i in indices]
        if self.after is None:
            pool._bounce_cache.to_cache(self.cache, units, _pick(self.block_ids, indices), **self.selection)
            return
        import torch

        stream = pool._stream(self.cache.device_name)
        if self.written is None:
            stream.wait_event(self.after)
        with torch.cuda.stream(stream):
            ids = _pick(self.block_ids, indices)
        pool._bounce_cache.to_cache(self.cache, units, ids, stream=stream, backend=pool._backend, **self.selection)
        self.written = torch.cuda.Event()
        self.written.record(stream)

    def abandon(self, error: BaseException) -> None:
        # A load that failed with its GPU writes done gives its bounce units back; one whose
        # event failed cannot know that its copies stopped reading them.
        try:
            idle = self.written is None or self.written.query()
        except Exception:  # the CUDA error that failed the job
            idle = False
        self.pool._release(self, reuse=idle)


class _Reclaim:
    """The bounce units of a failed job whose transfers the engine could not cancel yet
    (a peer that hangs): polled by the driver until they end, then given back; dropped
    when the pool closes.  The pool's lock is held while polling, so that close() never
    releases the engine under a poll."""

    deadline: float | None = None

    def __init__(self, pool: _SlotPool, job: _Job) -> None:
        self.pool, self.job = pool, job
        self.handle = _driver.Handle(f"the bounce slots of {job.handle.what}")

    def step(self) -> str:
        pool = self.pool
        with pool._cond:
            if pool._closed or pool.closed:
                return _driver.DONE
            if self.job._in_flight():
                return _driver.WAITING
            pool._give_back(list(self.job.unit.values()))
        _log(f"{pool._kind} {pool._where}: the bounce slots of {self.job.handle.what} are back")
        return _driver.DONE

    def abandon(self, error: BaseException) -> None:
        _log(f"{self.pool._kind} {self.pool._where}: {len(self.job.unit)} bounce slots stay out of use ({error})")


def _check_cache(cache: Any) -> None:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a kvbm_ext.PagedKVCache, got {type(cache).__name__}")


def _nothing(what: str, kind: str = "DiskPool") -> DiskHandle:
    """The handle of a call with no slot: done."""
    handle = DiskHandle(f"{kind}.{what} of no slot", 0, (), ())
    handle.finish()
    return handle


def _pick(ids: Any, indices: list[int]) -> Any:
    """ids[indices]: of device ids, a view where the indices are a run, else a gather on
    the current stream."""
    if isinstance(ids, list):
        return [ids[i] for i in indices]
    if indices == list(range(indices[0], indices[-1] + 1)):
        return ids[indices[0]:indices[-1] + 1]
    import torch

    return ids[torch.tensor(indices, device=ids.device)]


def _groups(indices: list[int], stride: int) -> list[list[int]]:
    """The call's slot indices in groups of about GROUP_BYTES."""
    per = max(1, GROUP_BYTES // stride)
    return [indices[i:i + per] for i in range(0, len(indices), per)]


class _SlotPool:
    """What a pool of slots is, whatever holds its bytes: the slots' layout and header
    table (kvbm_ext/_disk_format.py), the pinned bounce buffer, store and load jobs driven
    by kvbm_ext._driver, and the verification of every slot before a load writes its
    block.  Its far side -- the bytes laid out as the pool file is, superblock, header
    table and payloads -- is a subclass's: DiskPool (a file, NIXL POSIX) and
    kvbm_ext.peer.PeerPool (a serving process's registered memory, NIXL UCX).  A subclass
    opens its far side, calls `_open_slots`, and gives `_read_far` (synchronous reads while
    opening), `_format` (the superblock of a new pool), `_make_engine` (posts (bounce
    offset, bytes, far offset) pieces: post / done / release / close / description),
    `_explain` (the error of a failed transfer) and `_close_far`."""

    _kind = "pool"                      # the class's name in messages
    _scan_bytes = SCAN_CHUNK_BYTES      # header table bytes read at a time when a pool is opened
    _where = "?"                        # the far side in messages: a path, a peer
    _released = False

    @staticmethod
    def _expected(like: Any, dims: str, num_slots: int | None) -> tuple[dict[str, Any] | None, int | None]:
        """The slots' layout (from `like`) and count a caller asks for, checked; None where
        not given."""
        layout = _layout(like, dims) if like is not None else None
        if num_slots is not None:
            num_slots = operator.index(num_slots)
            if num_slots < 1:
                raise ValueError(f"num_slots: expected at least 1, got {num_slots}")
        return layout, num_slots

    def _need_shape(self, layout: dict[str, Any] | None, num_slots: int | None) -> None:
        """A new pool is made of num_slots slots of like's sizes: both must be given."""
        if layout is None or num_slots is None:
            raise ValueError(f"{self._where}: creating a pool needs num_slots and like")

    def _open_slots(self, create: bool, layout: dict[str, Any] | None, num_slots: int | None,
                    bounce_bytes: int | None) -> None:
        """The geometry (a new pool's, written; or the far side's superblock, checked against
        what the caller expects), the header table scanned, the bounce buffer, the engine."""
        if create:
            assert layout is not None and num_slots is not None
            self._geometry = new_geometry(layout, num_slots)
            self._format()
        else:
            self._geometry = parse_superblock(self._read_far(0, ALIGN), self._where)
            self._check_expected(layout, num_slots)
        self._scan(fresh=create)
        self._make_bounce(bounce_bytes)
        self._engine = self._make_engine()

    def _init_state(self) -> None:
        """What store and load share, once the pool is open."""
        self._cond = threading.Condition()
        self._free = list(range(self.bounce_slots - 1, -1, -1))
        self._storing: set[int] = set()
        self._loading: collections.Counter[int] = collections.Counter()
        self._jobs: set[_Job] = set()
        self._streams: dict[Any, Any] = {}
        self._in_flight_bytes = 0           # of the engine requests posted and not ended (the driver's)
        self._closed = False

    # ------------------------------------------------------------------ the far side's

    def _read_far(self, offset: int, nbytes: int) -> memoryview:
        raise NotImplementedError

    def _format(self) -> None:
        raise NotImplementedError

    def _make_engine(self) -> Any:
        raise NotImplementedError

    def _explain(self, op: str, pieces: list[tuple[int, int, int]], slots: list[int],
                 failure: BaseException) -> BaseException:
        raise NotImplementedError

    def _close_far(self) -> None:
        return

    def _check_writable(self) -> None:
        return

    def _beyond_end(self, slots: list[int]) -> dict[int, str]:
        """Slots the far side cannot hold whole (a truncated file), and why."""
        return {}

    def _far_now(self) -> Any:
        """What a job's transfers go to, taken when the job is made (the engine's post gets it)."""
        return None

    def _job_deadline(self) -> float | None:
        """When a job that has not moved since now fails (time.monotonic()), or None: a far
        side whose requests end by themselves (a disk's) needs none."""
        return None

    def _stalled(self, job: Any) -> BaseException:
        return TimeoutError(f"{job.handle.what}: no progress by its deadline")

    @property
    def closed(self) -> bool:
        """Whether close() has released the pool."""
        return self._released

    # ------------------------------------------------------------------ opening

    def _check_expected(self, layout: dict[str, Any] | None, num_slots: int | None) -> None:
        g = self._geometry
        if layout is not None and layout != g.layout:
            raise ValueError(f"like: {self._where} holds slots of {describe(g.layout)}; like describes "
                             f"{describe(layout)}")
        if num_slots is not None and num_slots != g.num_slots:
            raise ValueError(f"num_slots: {self._where} holds {g.num_slots} slots, not {num_slots}")

    def _scan(self, fresh: bool) -> None:
        """The generation and key of every slot whose header is valid; why the others hold
        nothing.  The table is read in one sequential pass."""
        g = self._geometry
        self._generation = [0] * g.num_slots
        self._keys: dict[int, bytes] = {}
        self._why: dict[int, str] = {}
        newest = 0
        if not fresh:
            per_chunk = self._scan_bytes // HEADER_BYTES
            for first in range(0, g.num_slots, per_chunk):
                count = min(per_chunk, g.num_slots - first)
                table = self._read_far(g.header_offset(first), count * HEADER_BYTES)
                table = table[:len(table) - len(table) % HEADER_BYTES]      # a header cut by the file's end
                rows = np.frombuffer(table, np.uint8).reshape(-1, HEADER_BYTES)
                for slot in range(first + len(rows), first + count):
                    self._why[slot] = "the file ends before its header (truncated)"
                for i in np.flatnonzero(rows.any(axis=1)):
                    slot = first + int(i)
                    header = parse_header(g, slot, table[int(i) * HEADER_BYTES:(int(i) + 1) * HEADER_BYTES])
                    if isinstance(header, Header):
                        self._generation[slot], self._keys[slot] = header.generation, header.key
                        newest = max(newest, header.generation)
                    else:
                        self._why[slot] = header
        self._next_generation = newest + 1

    def _make_bounce(self, bounce_bytes: int | None) -> None:
        import torch

        g = self._geometry
        unit = HEADER_BYTES + g.stride
        if bounce_bytes is None:
            units = min(g.num_slots, max(1, DEFAULT_BOUNCE_BYTES // unit))
        else:
            units = operator.index(bounce_bytes) // unit
            if units < 1:
                raise ValueError(f"bounce_bytes: {bounce_bytes} bytes hold no slot (one takes {unit}: its "
                                 f"{HEADER_BYTES}-byte header and {g.stride}-byte payload)")
        self.bounce_slots = units
        self._bounce = pinned_empty(units * unit, "uint8")
        # Through the buffer protocol, an export that close() sees go (a read of
        # __array_interface__ would keep the memory as long as the HostBuffer object).
        self._bounce_np = np.asarray(self._bounce)
        self._bounce_addr = self._bounce_np.ctypes.data
        # The kernel path where the buffer is registered in pieces: a copy-engine copy
        # cannot cross two registrations (docs/host_pools.md).
        self._backend = "kernel" if len(self._bounce.registrations) > 1 else "auto"
        payloads = torch.from_dlpack(self._bounce)[units * HEADER_BYTES:].view(units, g.stride)
        typed = payloads[:, :g.payload_bytes].view(_torch_dtype(g.layout["dtype"]))
        self._bounce_cache = PagedKVCache(typed.view((units,) + _slot_shape(g.layout)), g.layout["dims"])

    # ------------------------------------------------------------------ what a pool is

    @property
    def layout(self) -> dict[str, Any]:
        """The slots' layout: dims, num_heads, num_layers, num_outer, tokens_per_block,
        head_dim, dtype, itemsize."""
        return dict(self._geometry.layout)

    @property
    def num_slots(self) -> int:
        """The pool's slots."""
        return self._geometry.num_slots

    @property
    def num_heads(self) -> int:
        return self._geometry.layout["num_heads"]

    @property
    def num_layers(self) -> int:
        return self._geometry.layout["num_layers"]

    @property
    def num_outer(self) -> int:
        return self._geometry.layout["num_outer"]

    @property
    def tokens_per_block(self) -> int:
        return self._geometry.layout["tokens_per_block"]

    @property
    def head_dim(self) -> int:
        return self._geometry.layout["head_dim"]

    @property
    def dtype(self) -> str:
        """The element type's name, as PagedKVCache.dtype_name says it."""
        return self._geometry.layout["dtype"]

    @property
    def dims(self) -> str:
        """The slot's layout letters."""
        return self._geometry.layout["dims"]

    @property
    def slot_bytes(self) -> int:
        """The payload bytes of one slot."""
        return self._geometry.payload_bytes

    @property
    def file_bytes(self) -> int:
        """The pool file's size."""
        return self._geometry.file_bytes

    @property
    def engine(self) -> str:
        """The I/O engine moving the bytes, e.g. 'NIXL POSIX (Linux AIO)'."""
        return self._engine.description

    def generation(self, slot: int) -> int:
        """The generation of the last store of `slot` that completed (0: none)."""
        return self._generation[self._slot_index(slot, "slot")]

    def stored(self) -> dict[int, tuple[int, bytes]]:
        """{slot: (generation, key)} of every slot whose last store completed (as this process
        saw it, or as its header said when the pool was opened), none in flight."""
        with self._cond:
            return {s: (g, self._keys.get(s, b"")) for s, g in enumerate(self._generation)
                    if g and s not in self._storing}

    # ------------------------------------------------------------------ store and load

    def store(self, cache: PagedKVCache, block_ids: Any, slot_ids: Any, *, layers: Any = None, heads: Any = None,
              layer_offset: int = 0, head_offset: int = 0, pack_layers: bool = False,
              keys: Sequence[bytes] | None = None, stream: Any = None, timeout: float | None = None) -> DiskHandle:
        """Stores blocks `block_ids[i]` of `cache` into slots `slot_ids[i]`; returns at once.

        The selection (layers, heads, layer_offset, head_offset, pack_layers) is to_cache's,
        with the slot as dst, and must fill whole slots.  keys: a bytes value per slot (at
        most MAX_KEY), kept in its header and given back by stored().  stream: a GPU
        cache's stream (None: torch's current one), on which the blocks are copied into the
        bounce buffer before the call returns.  timeout: seconds to wait for bounce space
        (None: as long as it takes).  Every argument is checked before anything is written."""
        self._check_usable("store")
        self._check_writable()
        _check_cache(cache)
        slots = self._slot_list(slot_ids, distinct=True)
        n = self._count(block_ids, slots)
        ids = self._block_ids(cache, block_ids, distinct=False)
        key_list = self._key_list(keys, n)
        selection = dict(layers=layers, heads=heads, layer_offset=layer_offset, head_offset=head_offset,
                         pack_layers=pack_layers)
        caller = self._caller_stream(cache, stream)
        self._dry_run("store", cache, self._bounce_cache, caller, selection)
        self._check_whole_slots(cache, selection)
        if not n:
            return _nothing("store", self._kind)
        with self._cond:
            units = self._take(n, timeout, "store")
            busy = [s for s in slots if s in self._storing or self._loading[s]]
            if busy:
                self._give_back(units)
                raise ValueError(f"slot_ids: slot {busy[0]} has a {'store' if busy[0] in self._storing else 'load'} "
                                 "in flight: wait for its handle first")
            self._storing.update(slots)
            generations = list(range(self._next_generation, self._next_generation + n))
            self._next_generation += n
            for s in slots:
                self._generation[s] = 0
                self._why[s] = "a store of it is in flight"
        handle = DiskHandle(f"{self._kind}.store of {n} slots to {self._where}", n * self.slot_bytes, slots, generations)
        job = _StoreJob(self, handle, slots, dict(enumerate(units)), key_list,
                        _groups(list(range(n)), self._geometry.stride))
        self._submit(job)
        # Group by group, so that the first groups are written while the others are copied.
        options = dict(stream=caller, backend=self._backend) if caller is not None else {}
        if caller is not None:
            import torch
        try:
            for group in job.groups:
                run = slice(group[0], group[-1] + 1)
                cache.to_cache(self._bounce_cache, ids[run], units[run], **options, **selection)
                if caller is None:
                    job.copied.append(None)
                else:
                    copied = torch.cuda.Event()
                    copied.record(caller)
                    job.copied.append(copied)
        except BaseException as error:
            job.aborted = error
            handle._finished.wait()
            raise
        handle.gpu_enqueued(job.copied[-1])
        return handle

    def load(self, slot_ids: Any, cache: PagedKVCache, block_ids: Any, *, layers: Any = None, heads: Any = None,
             layer_offset: int = 0, head_offset: int = 0, pack_layers: bool = False,
             generations: Sequence[int] | None = None, stream: Any = None, timeout: float | None = None) -> DiskHandle:
        """Loads slots `slot_ids[i]` into blocks `block_ids[i]` of `cache`; returns at once.

        The selection is to_cache's, with the slot as the source.  generations: the
        generation each slot must hold (None: the last store of it this pool completed).
        stream: for a GPU cache, the stream whose work so far is ordered before the blocks
        are written (None: torch's current one); handle.wait_stream(s) orders s after the
        write.  A block is written only once its slot has been read and verified, whole; a
        slot that fails makes the handle's error a SlotError naming it, and its block is
        never written (the other blocks are).  timeout: seconds to wait for bounce space."""
        self._check_usable("load")
        _check_cache(cache)
        slots = self._slot_list(slot_ids, distinct=False)
        n = self._count(block_ids, slots)
        ids = self._block_ids(cache, block_ids, distinct=True)
        selection = dict(layers=layers, heads=heads, layer_offset=layer_offset, head_offset=head_offset,
                         pack_layers=pack_layers)
        caller = self._caller_stream(cache, stream)
        self._dry_run("load", self._bounce_cache, cache, caller, selection)
        if generations is not None:
            expected = _named_ints(generations, "generations")
            if len(expected) != n:
                raise ValueError(f"generations: {len(expected)} entries for {n} slots")
        if not n:
            return _nothing("load", self._kind)
        refused = self._beyond_end(slots)
        with self._cond:
            busy = [s for s in slots if s in self._storing]
            if busy:
                raise ValueError(f"slot_ids: slot {busy[0]} has a store in flight: wait for its handle first")
            refused.update({s: "holds no completed store: " + self._why.get(s, "never written") for s in slots
                            if not self._generation[s]})
            readable = [i for i, s in enumerate(slots) if s not in refused]
            units = self._take(len(readable), timeout, "load")
            if generations is None:
                expected = [self._generation[s] for s in slots]
            self._loading.update(slots)
        after = None
        if caller is not None:
            import torch

            after = torch.cuda.Event()
            after.record(caller)
        handle = DiskHandle(f"{self._kind}.load of {n} slots from {self._where}", n * self.slot_bytes, slots, expected)
        if caller is None:
            handle.gpu_enqueued(None)
        return self._submit(_LoadJob(self, handle, slots, dict(zip(readable, units)), cache, ids, selection, after,
                                     refused, _groups(readable, self._geometry.stride)))

    def close(self, timeout: float | None = None) -> None:
        """Waits for the pool's transfers (TimeoutError after `timeout` seconds, the pool left
        open), then releases the file, the engine and the bounce buffer.  Idempotent."""
        if self.closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            pending = [job.handle for job in self._jobs]
        for handle in pending:
            if not handle._finished.wait(timeout):
                raise TimeoutError(f"{self._kind}.close: {handle.what} did not finish within {timeout} s")
        self._release_resources()

    def __enter__(self) -> _SlotPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _release_resources(self) -> None:
        if hasattr(self, "_engine"):
            self._engine.close()
        if hasattr(self, "_bounce"):
            # The views go first: an export alive would keep the memory mapped past close().
            self.__dict__.pop("_bounce_cache", None)
            self.__dict__.pop("_bounce_np", None)
            self._bounce.close()
        self._close_far()
        self._released = True

    def _check_usable(self, what: str) -> None:
        if self.closed or self._closed:
            raise ValueError(f"{self._kind}.{what}: the pool {self._where} is closed")

    def _slot_index(self, slot: Any, what: str) -> int:
        s = operator.index(slot)
        if not 0 <= s < self.num_slots:
            raise ValueError(f"{what}: slot {s} is outside the pool's {self.num_slots} slots")
        return s

    def _slot_list(self, slot_ids: Any, distinct: bool) -> list[int]:
        slots = _named_ints(slot_ids, "slot_ids")
        seen: set[int] = set()
        for i, s in enumerate(slots):
            self._slot_index(s, f"slot_ids[{i}]")
            if distinct and s in seen:
                raise ValueError(f"slot_ids[{i}]: slot {s} appears twice (a store writes each slot once)")
            seen.add(s)
        return slots

    @staticmethod
    def _count(block_ids: Any, slots: list[int]) -> int:
        try:
            n = len(block_ids)
        except TypeError:
            raise TypeError(f"block_ids: expected a sequence or 1-D array of ids, got {type(block_ids).__name__}") \
                from None
        if n != len(slots):
            raise ValueError(f"block_ids: {n} ids for {len(slots)} slot_ids")
        return n

    @staticmethod
    def _key_list(keys: Sequence[bytes] | None, n: int) -> list[bytes]:
        if keys is None:
            return [b""] * n
        if isinstance(keys, (bytes, str)) or len(keys) != n:
            raise ValueError(f"keys: expected a sequence of {n} bytes values, got {keys!r}")
        out = []
        for i, key in enumerate(keys):
            if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) > MAX_KEY:
                raise ValueError(f"keys[{i}]: expected bytes of at most {MAX_KEY}, got {key!r:.80}")
            out.append(bytes(key))
        return out

    @staticmethod
    def _block_ids(cache: PagedKVCache, block_ids: Any, distinct: bool) -> Any:
        """Host ids as a list of ints, each in the cache (and once, for the ids a load
        writes); ids on a GPU as they are (never read on the host)."""
        device = getattr(block_ids, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            return block_ids
        ids = _named_ints(block_ids, "block_ids")
        seen: set[int] = set()
        for i, b in enumerate(ids):
            if not 0 <= b < cache.num_blocks:
                raise ValueError(f"block_ids[{i}]: block {b} is outside the cache's {cache.num_blocks} blocks")
            if distinct and b in seen:
                raise ValueError(f"block_ids[{i}]: block {b} appears twice (a load writes each block once)")
            seen.add(b)
        return ids

    @staticmethod
    def _caller_stream(cache: PagedKVCache, stream: Any) -> Any:
        """The caller's stream as a torch stream for a GPU cache; None for a host cache."""
        if cache.device_name == "cpu":
            if stream is not None:
                raise ValueError("stream: a host cache's blocks are copied on the CPU, with no stream; pass None")
            return None
        import torch

        device = torch.device(cache.device_name)
        if stream is None:
            return torch.cuda.current_stream(device)
        if isinstance(stream, torch.cuda.Stream):
            return stream
        if hasattr(stream, "__cuda_stream__"):
            handle = stream.__cuda_stream__()[1]
        else:
            handle = getattr(stream, "cuda_stream", stream)
        return torch.cuda.ExternalStream(operator.index(handle), device=device)

    def _dry_run(self, what: str, src: PagedKVCache, dst: PagedKVCache, stream: Any, selection: dict[str, Any]) -> None:
        """to_cache's own checks of the caches and the selection, with no block moved."""
        try:
            src.to_cache(dst, [], [], **({"stream": stream} if stream is not None else {}), **selection)
        except (TypeError, ValueError) as error:
            side = "dst" if what == "store" else "src"
            raise type(error)(f"{self._kind}.{what}: {error} ({side} is the pool's slots: {describe(self.layout)})") \
                from None

    def _check_whole_slots(self, cache: PagedKVCache, selection: dict[str, Any]) -> None:
        """A store writes whole slots: the selection must land on every layer and head of one."""
        chosen = _selected(cache.num_layers, selection["layers"])
        offset = operator.index(selection["layer_offset"])
        landed = sorted(offset + j for j in range(len(chosen))) if selection["pack_layers"] else \
            sorted(offset + layer for layer in chosen)
        if landed != list(range(self.num_layers)):
            raise ValueError(f"layers: a store writes whole slots, but the layers moved land on slot layers "
                             f"{landed[0]} to {landed[-1]} ({len(landed)} of them), not every one of the slot's "
                             f"{self.num_layers}")
        heads = len(_selected(cache.num_heads, selection["heads"]))
        if operator.index(selection["head_offset"]) != 0 or heads != self.num_heads:
            raise ValueError(f"heads: a store writes whole slots, but the {heads} heads moved land on slot heads "
                             f"{selection['head_offset']} on, not exactly the slot's {self.num_heads}")

    def _take(self, n: int, timeout: float | None, what: str) -> list[int]:
        """n bounce units (the lock held); waits while fewer are free."""
        if n > self.bounce_slots:
            raise ValueError(f"{self._kind}.{what}: {n} slots need {n} bounce slots, and the pool has "
                             f"{self.bounce_slots} (bounce_bytes)")
        if not n:
            return []
        if not self._cond.wait_for(lambda: len(self._free) >= n or self._closed, timeout):
            raise TimeoutError(f"{self._kind}.{what}: waited {timeout} s for {n} bounce slots ({len(self._free)} of "
                               f"{self.bounce_slots} free): earlier transfers still hold them")
        self._check_usable(what)
        return [self._free.pop() for _ in range(n)]

    def _give_back(self, units: list[int]) -> None:
        self._free.extend(units)
        self._cond.notify_all()

    def _submit(self, job: Any) -> DiskHandle:
        with self._cond:
            self._jobs.add(job)
        _driver.submit(job)
        return job.handle

    def _release(self, job: _Job, reuse: bool = True) -> None:
        """A job's end: its bounce units back, unless something may still use them: those
        of transfers the engine could not cancel come back once it reports them ended
        (_Reclaim, in the driver)."""
        pending = job._in_flight()
        if pending:
            _log(f"{self._kind} {self._where}: the engine could not cancel a failed transfer of {job.handle.what}; "
                 f"its {len(job.unit)} bounce slots come back once the engine ends it")
        elif not reuse:
            _log(f"{self._kind} {self._where}: {len(job.unit)} bounce slots stay out of use")
        with self._cond:
            self._jobs.discard(job)
            if isinstance(job, _LoadJob):
                self._loading.subtract(job.slots)
            if reuse and not pending:
                self._give_back(list(job.unit.values()))
        if reuse and pending:
            _driver.submit(_Reclaim(self, job))

    def _stored(self, job: _StoreJob, error: BaseException | None) -> None:
        with self._cond:
            for i, s in enumerate(job.slots):
                if error is None:
                    self._generation[s], self._keys[s] = job.handle.generations[i], job.keys[i]
                    self._why.pop(s, None)
                else:
                    self._why[s] = f"its last store (generation {job.handle.generations[i]}) failed: {error}"
            self._storing.difference_update(job.slots)
        if error is not None:
            _log(f"{self._kind} {self._where}: {job.handle.what} failed: {error}")
        self._release(job)

    def _room(self) -> bool:
        """Whether a job may post another group now (one always may, where none is in flight)."""
        return self._in_flight_bytes < IN_FLIGHT_BYTES

    def _stream(self, device: Any) -> Any:
        import torch

        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _header(self, unit: int) -> memoryview:
        return self._bounce_np[unit * HEADER_BYTES:(unit + 1) * HEADER_BYTES].data

    def _payload(self, unit: int) -> np.ndarray:
        start = self.bounce_slots * HEADER_BYTES + unit * self._geometry.stride
        return self._bounce_np[start:start + self._geometry.payload_bytes]

    def _payload_pieces(self, unit: dict[int, int], slots: list[int], indices: list[int]) -> list[tuple[int, int, int]]:
        g = self._geometry
        pieces = []
        for i in indices:
            at, offset = self.bounce_slots * HEADER_BYTES + unit[i] * g.stride, g.payload_offset(slots[i])
            for start in range(0, g.stride, IO_PIECE_BYTES):
                pieces.append((at + start, min(IO_PIECE_BYTES, g.stride - start), offset + start))
        return pieces

    def _header_pieces(self, unit: dict[int, int], slots: list[int], indices: list[int]) -> list[tuple[int, int, int]]:
        return [(unit[i] * HEADER_BYTES, HEADER_BYTES, self._geometry.header_offset(slots[i])) for i in indices]

    def _slot_error(self, reasons: Mapping[int, str]) -> SlotError:
        listed = "; ".join(f"slot {s}: {why}" for s, why in sorted(reasons.items()))
        return SlotError(f"{self._kind}.load from {self._where}: {len(reasons)} slot(s) cannot be loaded, and their blocks "
                         f"were not written: {listed}", reasons)


class DiskPool(_SlotPool):
    """A file of `num_slots` slots, each one KV block in the layout `dims` (universal
    `"bhlktd"` by default) of the sizes of `like`, moved to and from PagedKVCaches by
    `store` and `load` through NIXL's POSIX backend.  docs/disk.md says it all.

    path: the pool file.  num_slots: its slots (needed to create; checked when opening).
    like: a PagedKVCache, or a mapping of num_heads, num_layers, num_outer,
    tokens_per_block, head_dim and dtype, giving the slots' sizes (needed to create;
    checked when opening).  dims: the slot's layout letters, b first and d last.
    create: None opens the pool at `path` or creates one where no file is; True creates a
    new pool, replacing any file there; False opens an existing pool.
    direct: None uses O_DIRECT where the filesystem accepts it and buffered I/O where it
    does not (`pool.direct` says which, `pool.direct_reason` why); True requires it.
    durable: True opens the file O_DSYNC, so a store's handle reports done only once its
    slots are on stable storage; False (default) leaves that to `flush()`.
    bounce_bytes: the bounce buffer (default: 1 GiB, at most every slot's worth), in whole
    slots; a store or load needs room for all its slots at once.
    engine: "auto" (NIXL POSIX, after trying GDS_MT to say why it is not used: `pool.gds`)
    or "POSIX".  engine_params: parameters of NIXL's POSIX backend, over POSIX_DEFAULTS.
    """

    _kind = "DiskPool"

    def __init__(self, path: str | os.PathLike[str], num_slots: int | None = None, like: Any = None, *,
                 dims: str = "bhlktd", create: bool | None = None, direct: bool | None = None,
                 durable: bool = False, bounce_bytes: int | None = None, engine: str = "auto",
                 engine_params: Mapping[str, str] | None = None) -> None:
        self.path = self._where = os.fspath(path)
        for name, value in (("create", create), ("direct", direct)):
            if not (value is None or value is True or value is False):
                raise TypeError(f"{name}: expected None, True or False, got {value!r}")
        if not (durable is True or durable is False):
            raise TypeError(f"durable: expected True or False, got {durable!r}")
        if engine not in ("auto", "POSIX"):
            raise ValueError(f"engine: expected 'auto' or 'POSIX', got {engine!r}")
        params = dict(engine_params or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise TypeError(f"engine_params: expected a mapping of str to str, got {engine_params!r}")
        layout, num_slots = self._expected(like, dims, num_slots)
        if create is None:
            create = not os.path.exists(self.path)
        if create:
            self._need_shape(layout, num_slots)
        api = _import_nixl()     # before the file is touched
        self.durable = durable
        self._fd = -1
        self._open(create, direct)
        self._engine_args = (api, engine, params)
        try:
            self._open_slots(create, layout, num_slots, bounce_bytes)
        except BaseException:
            self._release_resources()
            if create:              # a pool this call made and could not open is no pool
                os.unlink(self.path)
            raise
        self._init_state()
        _log(f"disk pool {self.path}: {self.num_slots} slots of {self.slot_bytes} bytes ({describe(self.layout)}), "
             f"{'O_DIRECT' if self.direct else 'buffered: ' + self.direct_reason}, "
             f"{'durable (O_DSYNC)' if durable else 'not durable until flush()'}, {self.engine}; GDS: {self.gds}; "
             f"bounce {self.bounce_slots} slots{' (pinned)' if self._bounce.pinned else ''}; "
             f"{sum(1 for g in self._generation if g)} slots stored")

    def _open(self, create: bool, direct: bool | None) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_DSYNC if self.durable else 0)
        self.direct, self.direct_reason, self.writable = direct is not False, "", True
        self._refused_writing = 0           # the errno that made the pool read-only
        if direct is False:
            self.direct_reason = "direct=False"
        try:
            self._fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as error:
            if error.errno == errno.EINVAL and direct is None:
                self.direct, self.direct_reason = False, "the filesystem refuses O_DIRECT (EINVAL)"
                _log(f"disk pool {self.path}: O_DIRECT refused (EINVAL), buffered I/O instead")
            elif error.errno == errno.EINVAL and direct:
                raise OSError(errno.EINVAL, f"{self.path}: direct=True, but its filesystem refuses O_DIRECT") \
                    from None
            elif error.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and not create:
                self.writable, self._refused_writing = False, error.errno
                flags = os.O_RDONLY
            else:
                raise
            self._fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if self.writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise BlockingIOError(errno.EWOULDBLOCK, f"{self.path}: another DiskPool, in this process or another, "
                                  "has the file open (close it first)") from None

    def _format(self) -> None:
        g = self._geometry
        os.ftruncate(self._fd, 0)
        try:
            os.posix_fallocate(self._fd, 0, g.file_bytes)
        except OSError as error:
            free = os.statvfs(self.path)
            raise OSError(error.errno, f"{self.path}: cannot reserve {g.file_bytes} bytes for {g.num_slots} slots "
                          f"of {g.stride} bytes: {error.strerror} ({free.f_bavail * free.f_frsize} "
                          "bytes free on its filesystem)") from None
        block = mmap.mmap(-1, ALIGN)
        block[:] = pack_superblock(g)
        os.pwrite(self._fd, block, 0)
        os.fdatasync(self._fd)

    def _read_far(self, offset: int, nbytes: int) -> memoryview:
        """nbytes at offset (both multiples of ALIGN), into aligned memory; fewer at the file's end."""
        block = mmap.mmap(-1, nbytes)
        got = os.preadv(self._fd, [block], offset)
        return memoryview(block)[:got]

    def _make_engine(self) -> _Engine:
        api, engine, params = self._engine_args
        return _Engine(api, self._fd, self._geometry, self._bounce_addr, self._bounce.nbytes, engine, params,
                       self.direct)

    def _close_far(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_writable(self) -> None:
        if not self.writable:
            raise OSError(self._refused_writing, f"{self._kind}.store: {self._where} is open read-only: opening it for "
                          f"writing failed with {errno.errorcode[self._refused_writing]} "
                          f"({os.strerror(self._refused_writing)}); loads work, stores cannot")

    @property
    def closed(self) -> bool:
        """Whether close() has released the pool."""
        return self._fd < 0

    @property
    def gds(self) -> str:
        """Why GPUDirect Storage is not used."""
        return self._engine.gds

    def __repr__(self) -> str:
        return (f"<kvbm_ext.disk.DiskPool {self.path!r}: {self.num_slots} slots of {self.slot_bytes} bytes, "
                f"{'closed' if self.closed else self.engine}>")

    def flush(self) -> None:
        """Makes every completed store durable (fdatasync): what `durable=True` does per store."""
        self._check_usable("flush")
        os.fdatasync(self._fd)

    def __del__(self) -> None:
        # Jobs hold their pool, so none is pending here: only the file is left to close.
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)

    def _beyond_end(self, slots: list[int]) -> dict[int, str]:
        size = os.fstat(self._fd).st_size
        g = self._geometry
        return {s: f"the file ends at byte {size}, before its payload does (the file was truncated)"
                for s in slots if g.payload_offset(s) + g.stride > size}

    def _explain(self, op: str, pieces: list[tuple[int, int, int]], slots: list[int],
                 failure: BaseException) -> OSError:
        """An OSError naming the slots and, where a request of the failed transfer fails again
        alone, its errno: the engine reports only that an I/O failed.  The last block of each
        request is tried, synchronously (the end of a request is where a size limit or the end
        of the file bites); a write rewrites bytes it was writing anyway."""
        cause = None
        for at, n, offset in pieces:
            last = n - ALIGN
            try:
                if op == "WRITE":
                    os.pwrite(self._fd, self._bounce_np[at + last:at + n].data, offset + last)
                else:
                    scratch = mmap.mmap(-1, ALIGN)
                    if os.preadv(self._fd, [scratch], offset + last) < ALIGN:
                        cause = OSError(errno.EIO, f"the file ends before byte {offset + n} (truncated)")
                        break
            except OSError as error:
                cause = error
                break
        code = cause.errno if cause is not None and cause.errno else errno.EIO
        why = cause.strerror if cause is not None else (
            f"the I/O engine reports a failed {op.lower()} ({type(failure).__name__}: {failure}), and each request's "
            "last block, retried alone, succeeded")
        verb = "store" if op == "WRITE" else "load"
        tail = "; the source blocks are untouched" if op == "WRITE" else "; their blocks were not written"
        return OSError(code, f"DiskPool.{verb}: slots {slots} of {self.path}: {why}{tail}")
