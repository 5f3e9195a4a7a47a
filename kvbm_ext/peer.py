"""A peer tier: KV blocks in another process's memory, over NIXL (UCX).

A serving process -- a memory node, or any process with memory to spare -- holds a
region of host memory and publishes it under a name; engines store blocks into it and
load them back, each through a pool of checksummed slots, as kvbm_ext.disk does with a
file:

    # the serving side (or: python -m kvbm_ext.peer --name mem0 --bytes 64G --store host:port)
    memory = PeerMemory("mem0", 64 << 30, store)        # allocated, registered, published

    # an engine
    pool = PeerPool("mem0", store, num_slots=100_000, like=cache)
    h = pool.store(cache, block_ids, slot_ids)          # returns at once; h.done(), h.wait()
    h = pool.load(slot_ids, cache, other_block_ids)

The design: one pool logic, two far sides.  kvbm_ext.disk's `_SlotPool` holds the slots'
layout and header table, the pinned bounce buffer, the store and load jobs the driver
(kvbm_ext._driver) advances, and the verification of each slot (header and CRC-32C)
before a load writes its block.  DiskPool's far side is a file (NIXL POSIX); PeerPool's
is the serving process's memory, laid out exactly as the file is (superblock, header
table, payloads, kvbm_ext/_disk_format.py), from `offset` on, and reached with NIXL READs
and WRITEs between the local bounce buffer and the peer's registered DRAM (one-sided: the
serving process takes no part in a transfer).  Several pools may share one region at
different offsets (kvbm_ext.integrations.vllm lays a worker's pools one after another);
nothing stops two pools from being opened over the same bytes, which the caller avoids.

Rendezvous: `store` is a torch.distributed.TCPStore or any object with set(key, bytes)
and a blocking get(key) (and check(keys), where it has one, to poll without blocking),
as kvbm_ext.nixl takes; the serving side sets `{prefix}/{name}` to its record (its NIXL
agent's name and metadata, host, incarnation, the region's address and size).  Without a
store, pass the record's bytes (`memory.record`) as `store`.

Faults, all bounded: a peer whose record does not appear within `connect_timeout`, a
NIXL error on a transfer (a peer that died: UCX reports the disconnect), or a job of
which nothing completes within `timeout` seconds (a peer that hangs) fails with
`PeerLostError` naming the peer (its name, NIXL agent and host); a load that fails
writes none of the blocks whose slots were not read and verified.  The pool then looks
the peer up again at its next store or load: a peer that restarted has another
incarnation and fresh memory (it reads as zeros), where the pool writes its superblock
again, and where every slot stored before fails verification ("never written") rather
than being read as data; stores and loads then work again.  A new PeerPool over the
same name may also be opened at any time (create=None makes a pool where the memory
holds none).

NIXL (`nixl-cu13`, the extra [nixl]) and torch are needed; never imported by
`import kvbm_ext`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import operator
import os
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

from . import pinned_empty
from ._disk_format import ALIGN, new_geometry, pack_superblock, parse_superblock
from .disk import DiskHandle, SlotError, _layout, _log, _SlotPool

__all__ = ["PeerLostError", "PeerMemory", "PeerPool", "PeerRecord", "SlotError", "main", "open_store"]

DEFAULT_PREFIX = "kvbm_ext/peer"
CONNECT_TIMEOUT_S = 30.0        # for the peer's record to appear, and for a transfer while opening
TRANSFER_TIMEOUT_S = 30.0       # a job of which nothing completes for this long fails
PROGRESS_DELAY_US = 1000        # the agent's progress thread's wait between polls (kvbm_ext.nixl's)
SCRATCH_BYTES = 4 << 20         # the registered buffer of the reads and writes made while opening
POLL_S = 0.01

_MAGIC = b"KVPM"
_RECORD = struct.Struct("<4sIQQQ")      # magic, version, incarnation, address, bytes
_LENGTH = struct.Struct("<I")
_VERSION = 1
_agents = itertools.count()


class PeerLostError(ConnectionError):
    """A peer tier's peer did not answer: its record is missing, a transfer with it failed
    (NIXL reported an error: it died or disconnected), or nothing of a job completed within
    the pool's timeout.  `peer`: its name; the message names its NIXL agent and host too.
    The pool looks the peer up again at its next call."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


@dataclasses.dataclass(frozen=True)
class PeerRecord:
    """What a client needs to reach a peer's memory: its NIXL agent's name and metadata,
    host, incarnation (a number drawn when the memory was published: a restarted peer has
    another), and the region's address and size."""

    name: str
    agent: str
    host: str
    incarnation: int
    address: int
    nbytes: int
    metadata: bytes

    def encode(self) -> bytes:
        blobs = b"".join(_LENGTH.pack(len(b)) + b for b in (self.name.encode(), self.agent.encode(),
                                                             self.host.encode(), self.metadata))
        return _RECORD.pack(_MAGIC, _VERSION, self.incarnation, self.address, self.nbytes) + blobs

    @classmethod
    def decode(cls, data: bytes) -> PeerRecord:
        data = bytes(data)
        if len(data) < _RECORD.size:
            raise ValueError(f"not a kvbm_ext.peer record ({len(data)} bytes)")
        magic, version, incarnation, address, nbytes = _RECORD.unpack_from(data)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"not a kvbm_ext.peer record of version {_VERSION} (magic {magic!r}, version {version})")
        at, blobs = _RECORD.size, []
        for _ in range(4):
            if at + _LENGTH.size > len(data):
                raise ValueError("a kvbm_ext.peer record cut short")
            (n,) = _LENGTH.unpack_from(data, at)
            at += _LENGTH.size
            if at + n > len(data):
                raise ValueError("a kvbm_ext.peer record cut short")
            blobs.append(data[at:at + n])
            at += n
        return cls(blobs[0].decode(), blobs[1].decode(), blobs[2].decode(), incarnation, address, nbytes, blobs[3])


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}"


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name: expected a non-empty str without '/', got {name!r}")
    return name


def _check_store(store: Any, allow_bytes: bool) -> None:
    if allow_bytes and isinstance(store, (bytes, bytearray, memoryview)):
        return
    if not (callable(getattr(store, "set", None)) and callable(getattr(store, "get", None))):
        raise TypeError(f"store: expected an object with set(key, bytes) and get(key) (a torch.distributed "
                        f"TCPStore){' or the bytes of a peer record' if allow_bytes else ''}, got "
                        f"{type(store).__name__}")


def _make_agent(name: str, delay_us: int) -> tuple[Any, tuple[type[BaseException], ...]]:
    from ._nixl_agent import make_agent, nixl_errors

    try:
        return make_agent(name, delay_us), nixl_errors()
    except ImportError as error:
        raise ImportError("kvbm_ext.peer needs NIXL: pip install \"kvbm_ext[nixl]\" (nixl-cu13 1.5.1)") from error


def open_store(address: str, *, master: bool = False, timeout: float = CONNECT_TIMEOUT_S) -> Any:
    """A torch.distributed.TCPStore at "host:port" (master=True hosts it)."""
    import datetime

    import torch.distributed as dist

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store address: expected 'host:port', got {address!r}")
    return dist.TCPStore(host, int(port), None, master, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


class PeerMemory:
    """Host memory this process serves to peer pools: `nbytes` (rounded up to 4 KiB) from
    kvbm_ext.pinned_empty (pinned where CUDA is, reads as zeros), registered with a NIXL
    agent (UCX) and published under `name` in `store` (key `{prefix}/{name}`), or, with
    store=None, handed out as `record` bytes.  Clients read and write it one-sidedly: this
    process only has to stay alive.  numa_node: where the memory lives (pinned_empty's).
    close() unregisters it and blanks the published record."""

    def __init__(self, name: str, nbytes: int, store: Any = None, *, prefix: str = DEFAULT_PREFIX,
                 numa_node: int | None = None, progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        self.name = _check_name(name)
        nbytes = operator.index(nbytes)
        if nbytes < ALIGN:
            raise ValueError(f"nbytes: expected at least {ALIGN}, got {nbytes}")
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if store is not None:
            _check_store(store, allow_bytes=False)
        self.store, self.prefix = store, prefix
        self.incarnation = secrets.randbits(63)
        self.buffer = pinned_empty(nbytes, "uint8", numa_node=numa_node)
        self._array = np.asarray(self.buffer)
        self.address, self.nbytes = self._array.ctypes.data, nbytes
        agent_name = f"kvbm_ext.peer-{name}-{self.incarnation:016x}"
        self._agent, _ = _make_agent(agent_name, progress_delay_us)
        self._registration = self._agent.register_memory([(self.address, nbytes, 0, "")], "DRAM")
        self.record = PeerRecord(name, agent_name, socket.gethostname(), self.incarnation, self.address, nbytes,
                                 self._agent.get_agent_metadata()).encode()
        self.agent = agent_name
        self.closed = False
        if store is not None:
            store.set(_key(prefix, name), self.record)
        _log(f"peer memory {name!r}: {nbytes} bytes at {self.address:#x}{' (pinned)' if self.buffer.pinned else ''}, "
             f"NIXL agent {agent_name!r}")

    def view(self) -> np.ndarray:
        """The served bytes (uint8), as clients see them."""
        return self._array

    def close(self) -> None:
        """Blanks the published record (clients then find no peer), unregisters and frees
        the memory.  Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.store is not None:
            try:
                self.store.set(_key(self.prefix, self.name), b"")
            except Exception:  # the store may be gone first at shutdown
                pass
        self._agent.deregister_memory(self._registration)
        del self._array
        self.buffer.close()

    def __enter__(self) -> PeerMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvbm_ext.peer.PeerMemory {self.name!r}: {self.nbytes} bytes, agent {self.agent!r}>"


class _PeerEngine:
    """The pool's far side: READ and WRITE between the bounce buffer (registered with the
    pool's agent) and the peer's DRAM at the pool's offset.  Adjacent pieces are merged
    (each descriptor costs microseconds, REFERENCE.md section 7)."""

    def __init__(self, pool: PeerPool) -> None:
        self.pool = pool
        self.agent = pool._agent
        self.bounce_addr = pool._bounce_addr
        self.dram = self.agent.register_memory([(pool._bounce_addr, pool._bounce.nbytes, 0, "")], "DRAM")

    @property
    def description(self) -> str:
        r = self.pool._record
        return f"NIXL UCX to peer {r.name!r} (agent {r.agent!r} on {r.host})"

    def post(self, op: str, pieces: list[tuple[int, int, int]], far: Any) -> Any:
        record, remote = far
        merged: list[list[int]] = []
        for at, n, offset in sorted(pieces, key=lambda p: p[2]):
            if merged and merged[-1][0] + merged[-1][1] == at and merged[-1][2] + merged[-1][1] == offset:
                merged[-1][1] += n
            else:
                merged.append([at, n, offset])
        base = record.address + self.pool.offset
        local = self.agent.get_xfer_descs([(self.bounce_addr + at, n, 0) for at, n, _ in merged], "DRAM")
        far_side = self.agent.get_xfer_descs([(base + offset, n, 0) for _, n, offset in merged], "DRAM")
        handle = self.agent.initialize_xfer(op, local, far_side, remote)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL refused to post the {op}")
        return handle

    def done(self, handle: Any) -> bool:
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise ConnectionError("NIXL reports the transfer failed")
        return state == "DONE"

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.agent.deregister_memory(self.dram)


class PeerPool(_SlotPool):
    """`num_slots` slots of KV blocks in the memory a PeerMemory named `name` serves, from
    byte `offset` on (a multiple of 4096), each one block in the layout `dims` of the sizes
    of `like`; moved to and from PagedKVCaches by `store` and `load`, with DiskPool's
    arguments, handles (kvbm_ext.disk.DiskHandle) and verification (SlotError).

    store: the rendezvous (a TCPStore, any set/get object, or the record's bytes).
    create: None makes a pool where the peer's memory at `offset` holds none and opens the
    one there otherwise; True makes a new one (slots stored before fail verification:
    another pool id); False opens the one there.  timeout: seconds a job may go without
    any of its transfers completing before it fails (PeerLostError); connect_timeout: for
    the peer's record and each transfer while opening.  bounce_bytes: as DiskPool's."""

    _kind = "PeerPool"
    _scan_bytes = SCRATCH_BYTES

    def __init__(self, name: str, store: Any, num_slots: int | None = None, like: Any = None, *,
                 dims: str = "bhlktd", create: bool | None = None, offset: int = 0, bounce_bytes: int | None = None,
                 prefix: str = DEFAULT_PREFIX, timeout: float = TRANSFER_TIMEOUT_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S, progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        self.name = _check_name(name)
        self._where = f"peer {name!r}"
        _check_store(store, allow_bytes=True)
        if not (create is None or create is True or create is False):
            raise TypeError(f"create: expected None, True or False, got {create!r}")
        self.offset = operator.index(offset)
        if self.offset < 0 or self.offset % ALIGN:
            raise ValueError(f"offset: expected a non-negative multiple of {ALIGN}, got {self.offset}")
        for what, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{what}: expected a positive number of seconds, got {value!r}")
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        layout, num_slots = self._expected(like, dims, num_slots)
        self._store, self._prefix = store, prefix
        self._agent, self._errors = _make_agent(f"kvbm_ext.peerpool-{os.getpid()}-{next(_agents)}-"
                                                f"{secrets.token_hex(4)}", progress_delay_us)
        self._loaded: list[str] = []        # remote agents loaded into ours
        self._stale = False
        self._lock = threading.Lock()       # the connection (record, remote agent)
        self._scratch = pinned_empty(SCRATCH_BYTES, "uint8")
        self._scratch_np = np.asarray(self._scratch)
        self._scratch_reg = self._agent.register_memory([(self._scratch_np.ctypes.data, SCRATCH_BYTES, 0, "")],
                                                        "DRAM")
        try:
            self._connect(self._fetch(time.monotonic() + self.connect_timeout))
            if create is None:
                create = bytes(self._read_far(0, ALIGN)) == bytes(ALIGN)
            if create:
                self._need_shape(layout, num_slots)
            self._open_slots(create, layout, num_slots, bounce_bytes)
        except BaseException:
            self._release_resources()
            raise
        self._init_state()
        _log(f"peer pool {self._where} at offset {self.offset}: {self.num_slots} slots of {self.slot_bytes} bytes, "
             f"{self.engine}; bounce {self.bounce_slots} slots{' (pinned)' if self._bounce.pinned else ''}; "
             f"{sum(1 for g in self._generation if g)} slots stored")

    @staticmethod
    def bytes_needed(like: Any, num_slots: int, dims: str = "bhlktd") -> int:
        """The bytes of the peer's memory a pool of `num_slots` slots of `like` takes
        (superblock, header table, payloads), a multiple of 4096."""
        return new_geometry(_layout(like, dims), operator.index(num_slots)).file_bytes

    # ------------------------------------------------------------------ the peer

    @property
    def peer(self) -> str:
        """The peer's NIXL agent now."""
        return self._record.agent

    @property
    def incarnation(self) -> int:
        """The incarnation of the peer's memory now (another after it restarted)."""
        return self._record.incarnation

    def _peer_words(self) -> str:
        r = getattr(self, "_record", None)
        return f"peer {self.name!r}" + (f" (NIXL agent {r.agent!r} on {r.host})" if r is not None else "")

    def _fetch(self, deadline: float) -> PeerRecord:
        """The peer's record from the store, polled until `deadline`."""
        if isinstance(self._store, (bytes, bytearray, memoryview)):
            return PeerRecord.decode(bytes(self._store))
        key = _key(self._prefix, self.name)
        seen = b""
        while True:
            if not hasattr(self._store, "check") or self._store.check([key]):
                try:
                    seen = bytes(self._store.get(key))
                except (LookupError, RuntimeError, TimeoutError):   # a store without check(): not there yet
                    seen = b""
                if seen:
                    return PeerRecord.decode(seen)
            if time.monotonic() > deadline:
                state = "is blank (the peer closed)" if hasattr(self._store, "check") and self._store.check([key]) \
                    else "is not there"
                raise PeerLostError(self.name, f"PeerPool: no peer {self.name!r}: the store's key {key!r} {state} "
                                               f"after {self.connect_timeout} s")
            time.sleep(POLL_S)

    def _connect(self, record: PeerRecord) -> None:
        if record.name != self.name:
            raise ValueError(f"store: the record of peer {record.name!r}, not {self.name!r}")
        try:
            remote = self._agent.add_remote_agent(record.metadata)
        except self._errors as error:
            raise PeerLostError(self.name, f"PeerPool: loading the record of peer {self.name!r} (agent "
                                           f"{record.agent!r} on {record.host}) failed: {error}") from error
        self._loaded.append(record.agent)
        self._record, self._remote = record, remote.decode() if isinstance(remote, bytes) else remote
        self._stale = False

    def _far_now(self) -> tuple[PeerRecord, str]:
        return self._record, self._remote

    def _reconnect(self) -> None:
        """After a failure: the peer's record again; a peer that restarted (another
        incarnation, fresh memory) gets this pool's superblock again, its slots' headers
        being blank (a load of one fails verification)."""
        with self._lock:
            if not self._stale:
                return
            old = self._record
            record = self._fetch(time.monotonic() + self.connect_timeout)
            if record.incarnation == old.incarnation:
                self._stale = False     # the same memory: its transfers are tried again
                return
            self._connect(record)
            self._check_room(self._geometry.file_bytes)
            head = bytes(self._read_far(0, ALIGN))
            if head == bytes(ALIGN):
                self._write_far(0, pack_superblock(self._geometry))
                _log(f"peer pool {self._where}: the peer restarted (incarnation {old.incarnation:x} -> "
                     f"{record.incarnation:x}): its memory is fresh, every slot stored before is lost")
                return
            found = parse_superblock(head, self._where)
            if found.pool_id != self._geometry.pool_id:
                self._stale = True
                raise PeerLostError(self.name, f"PeerPool: {self._peer_words()} restarted and its memory at offset "
                                               f"{self.offset} holds another pool now; open a new PeerPool")

    def _check_room(self, nbytes: int) -> None:
        if self.offset + nbytes > self._record.nbytes:
            raise ValueError(f"{self._where}: the pool takes bytes {self.offset} to {self.offset + nbytes} of the "
                             f"peer's memory, which has {self._record.nbytes}")

    # ------------------------------------------------------------------ the far side's

    def _sync(self, op: str, offset: int, nbytes: int) -> None:
        """One transfer between the scratch buffer and the peer's memory, waited for."""
        local = self._agent.get_xfer_descs([(self._scratch_np.ctypes.data, nbytes, 0)], "DRAM")
        remote = self._agent.get_xfer_descs([(self._record.address + self.offset + offset, nbytes, 0)], "DRAM")
        handle = None
        try:
            handle = self._agent.initialize_xfer(op, local, remote, self._remote)
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.connect_timeout
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise PeerLostError(self.name, f"PeerPool: a {op} of {nbytes} bytes with {self._peer_words()} "
                                                   f"did not complete within {self.connect_timeout} s")
                time.sleep(20e-6)
                state = self._agent.check_xfer_state(handle)
        except self._errors as error:
            self._stale = True
            raise PeerLostError(self.name, f"PeerPool: a {op} with {self._peer_words()} failed: "
                                           f"{type(error).__name__}: {error}") from error
        finally:
            if handle is not None:
                try:
                    self._agent.release_xfer_handle(handle)
                except self._errors:
                    pass
        if state == "ERR":
            self._stale = True
            raise PeerLostError(self.name, f"PeerPool: a {op} with {self._peer_words()} failed (NIXL: ERR)")

    def _read_far(self, offset: int, nbytes: int) -> memoryview:
        if offset + nbytes > self._record.nbytes - self.offset:
            nbytes = max(0, self._record.nbytes - self.offset - offset)
        out = bytearray(nbytes)
        for at in range(0, nbytes, SCRATCH_BYTES):
            n = min(SCRATCH_BYTES, nbytes - at)
            self._sync("READ", offset + at, n)
            out[at:at + n] = self._scratch_np[:n].tobytes()
        return memoryview(out)

    def _write_far(self, offset: int, data: bytes | bytearray) -> None:
        self._scratch_np[:len(data)] = np.frombuffer(bytes(data), np.uint8)
        self._sync("WRITE", offset, len(data))

    def _format(self) -> None:
        self._check_room(self._geometry.file_bytes)
        self._write_far(0, pack_superblock(self._geometry))

    def _check_expected(self, layout: Any, num_slots: int | None) -> None:
        super()._check_expected(layout, num_slots)
        self._check_room(self._geometry.file_bytes)

    def _make_engine(self) -> _PeerEngine:
        return _PeerEngine(self)

    def _job_deadline(self) -> float | None:
        return time.monotonic() + self.timeout

    def _stalled(self, job: Any) -> BaseException:
        self._stale = True
        return PeerLostError(self.name, f"{job.handle.what}: nothing of it completed within {self.timeout} s: "
                                        f"{self._peer_words()} does not answer (hung, or unreachable); blocks whose "
                                        "slots were not read and verified were not written")

    def _explain(self, op: str, pieces: list[tuple[int, int, int]], slots: list[int],
                 failure: BaseException) -> BaseException:
        self._stale = True
        verb = "store" if op == "WRITE" else "load"
        tail = ("the source blocks are untouched, and the slots hold no completed store" if op == "WRITE"
                else "their blocks were not written")
        return PeerLostError(self.name, f"PeerPool.{verb}: slots {slots} on {self._peer_words()}: the {op} failed "
                                        f"({type(failure).__name__}: {failure}): the peer died or disconnected; "
                                        f"{tail}; the next call looks the peer up again")

    def _close_far(self) -> None:
        if getattr(self, "_scratch_reg", None) is not None:
            self._agent.deregister_memory(self._scratch_reg)
            self._scratch_reg = None
            del self._scratch_np
            self._scratch.close()
        for agent in self._loaded:
            try:
                self._agent.remove_remote_agent(agent)
            except self._errors:
                pass
        self._loaded = []

    # ------------------------------------------------------------------ store and load

    def store(self, cache: Any, block_ids: Any, slot_ids: Any, **options: Any) -> DiskHandle:
        """DiskPool.store's arguments and meaning; first looks the peer up again where an
        earlier transfer with it failed."""
        self._check_usable("store")
        self._reconnect()
        return super().store(cache, block_ids, slot_ids, **options)

    def load(self, slot_ids: Any, cache: Any, block_ids: Any, **options: Any) -> DiskHandle:
        """DiskPool.load's arguments and meaning; first looks the peer up again where an
        earlier transfer with it failed."""
        self._check_usable("load")
        self._reconnect()
        return super().load(slot_ids, cache, block_ids, **options)

    def __repr__(self) -> str:
        return (f"<kvbm_ext.peer.PeerPool {self.name!r} at {self.offset}: {self.num_slots} slots of "
                f"{self.slot_bytes} bytes, {'closed' if self.closed else self.engine}>")


# ---------------------------------------------------------------------- python -m kvbm_ext.peer


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbm_ext.peer", description=(
        "Serve host memory to kvbm_ext.peer.PeerPool clients (the vLLM spec's 'peer' tier) over NIXL (UCX), "
        "published under each --name in a TCPStore, until SIGINT or SIGTERM."))
    parser.add_argument("--name", action="append", required=True, help="the region's name (repeat for several)")
    parser.add_argument("--bytes", required=True, type=_size, help="each region's size: bytes, or 64G, 512M, ...")
    parser.add_argument("--store", required=True, help="the TCPStore's host:port")
    parser.add_argument("--store-master", action="store_true", help="host the TCPStore in this process")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="the store keys' prefix")
    parser.add_argument("--numa-node", type=int, default=None, help="the NUMA node of the memory")
    args = parser.parse_args(argv)
    store = open_store(args.store, master=args.store_master)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    memories = [PeerMemory(name, args.bytes, store, prefix=args.prefix, numa_node=args.numa_node)
                for name in args.name]
    for memory in memories:
        print(f"kvbm_ext.peer: serving {memory.name!r}: {memory.nbytes} bytes, NIXL agent {memory.agent!r}, "
              f"key {_key(args.prefix, memory.name)!r} of the store at {args.store}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for memory in memories:
            memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
