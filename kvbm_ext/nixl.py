"""Resharding between engines that share no process group, over NIXL.

`NixlTransport` carries a `kvbm_ext.Resharder`'s messages between processes that only
know how to find each other: a prefill engine and a decode engine started separately,
either of which may start late or be restarted.  Each rank has one NIXL agent (UCX).
A message crosses in a few pieces (`kvbm_ext._pieces.cut`), each ONE NIXL WRITE from
the sender's registered staging into the receiver's registered staging at the same
offset, its notification telling the receiver that the piece is in place; the receiver
unpacks it while the next one crosses (docs/resharding.md, "Across engines: NIXL").

    import kvbm_ext
    from kvbm_ext.nixl import NixlTransport

    store = torch.distributed.TCPStore(host, port, is_master=False)     # or any set/get store, or None
    transport = NixlTransport(rank, world_size, name=f"decode-{rank}", store=store)
    resharder = kvbm_ext.Resharder(8, 80, prefill, decode, transport=transport)
    stats = resharder(None, None, dst_cache, dst_ids, check=False, timeout=10)

Finding peers (the rendezvous is the caller's): with `store=` (a
`torch.distributed.TCPStore`, or any object with `set(key, bytes)` and a blocking
`get(key)`; `check(keys)` when it has one) each rank publishes its record under
`{prefix}/{rank}` when its transport is made, overwriting what an earlier incarnation of
that rank left; without a store the caller's own control plane passes the bytes of
`transport.local_metadata()` to the others' `add_peer(rank, bytes)`.  A rank connects
to a peer at the first call that needs it (waiting for its record, within the call's
timeout), and again after a call in which the peer failed; a peer that restarted and
connects first is reloaded from the record it sends (HELLO).

Faults: a peer that disconnects, a NIXL error on the way to it, or a notification that
does not come within the call's `timeout` ends the call with `PeerError`, the same text
on every rank that was exchanging with that peer, naming it (rank and agent name); no
byte of a piece whose notification did not come is unpacked; the next call reconnects.

Staging: device memory (VRAM) where the link reaches it, pinned host memory (DRAM) where
it cannot (UCX_TLS naming no transport that reaches GPU memory, or a peer on another
host without an RDMA NIC here), chosen per peer and logged under KVBM_EXT_DEBUG=1;
`staging="device"` or `"pinned"` forces it.  Host caches use host memory.

Needs NIXL 1.5.1 (`pip install "kvbm_ext[nixl]"`, the `nixl-cu13` wheel): it reaches into
`nixl_cu13._api` to give the agent's progress thread a delay.  Never imported by
`import kvbm_ext`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any, Sequence

from . import _nixl_wire as wire
from ._nixl_wire import PeerError
from ._debug import emit, enabled
from ._driver import Handle, submit
from ._plan import _index

DEFAULT_PREFIX = "kvbm_ext/reshard"
# The progress thread's wait between polls (microseconds): NIXL's own default, 0, spins.
PROGRESS_DELAY_US = 1000
# How often a rank looks again for a peer's record that is not there yet.
POLL_S = 0.01
# UCX transports that read and write GPU memory across processes: NVLink/PCIe peers of one
# host (cuda_ipc), RDMA NICs (rc, dc, ib, gdr_copy).  "all" and exclusions ("^...") keep them.
_GPU_TRANSPORTS = ("cuda_ipc", "rc", "dc", "ib", "gdr_copy", "all")
_ABORTS_KEPT = 256


@dataclasses.dataclass
class _Peer:
    """A peer as this rank knows it: the record loaded into the agent (None: not yet), and
    whether to load it again at the next call (after a failure)."""

    rank: int
    record: wire.Record | None = None
    stale: bool = False
    generation: int = 0                 # bumped at every load: handles of an older one are not used
    metadata: set[int] = dataclasses.field(default_factory=set)    # its registrations whose metadata is loaded

    @property
    def name(self) -> str:
        return self.record.name if self.record is not None else "?"


@dataclasses.dataclass
class _Xfer:
    """The prepared WRITEs of one message to one receive buffer: a handle per piece."""

    key: tuple[Any, ...]
    local: Any
    remote: Any
    handles: list[Any]


class NixlTransport:
    """A `kvbm_ext.Transport` over NIXL (UCX): rank `rank` of `world_size`, its agent named
    `name` (unique among the engines, e.g. "prefill-0").  `store`: the rendezvous (see the
    module), or None to pass records with `add_peer`; `prefix`: its keys' namespace.
    `staging`: "auto", "device" or "pinned" (GPU caches).  `progress_delay_us`: the
    agent's progress thread's wait between polls.

    Pairwise (`pairwise = True`): a Resharder on it gathers nothing when built, and every
    call compares each pair's headers, carried by the notifications (no extra round trip).
    A call returns a handle the driver (`kvbm_ext._driver`) completes: `Resharder(...,
    wait=True)` waits for it on the host, `wait=False` returns it."""

    pairwise = True

    def __init__(self, rank: int, world_size: int, name: str, *, store: Any = None, prefix: str = DEFAULT_PREFIX,
                 staging: str = "auto", progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        self._rank = _index(rank, "rank", 0, (1 << 31) - 1)
        self._world = _index(world_size, "world_size", 1, 1 << 31)
        if self._rank >= self._world:
            raise ValueError(f"rank: {self._rank} is not below world_size {self._world}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name: expected a non-empty str (the NIXL agent's name), got {name!r}")
        if staging not in ("auto", "device", "pinned"):
            raise ValueError(f"staging: expected 'auto', 'device' or 'pinned', got {staging!r}")
        if store is not None and not (callable(getattr(store, "set", None)) and callable(getattr(store, "get", None))):
            raise TypeError(f"store: expected an object with set(key, bytes) and get(key), got {type(store).__name__}")
        delay = _index(progress_delay_us, "progress_delay_us", 0, 10_000_000)
        from ._nixl_agent import make_agent, nixl_errors

        try:
            self._errors = nixl_errors()
            self._agent = make_agent(name, delay)
        except ImportError as error:
            raise ImportError("kvbm_ext.nixl needs NIXL: pip install \"kvbm_ext[nixl]\" (nixl-cu13 1.5.1)") from error
        self.name, self._store, self._prefix, self._staging = name, store, prefix, staging
        self._lock = threading.RLock()      # peers, inbox, registrations, prepared transfers
        self._peers: dict[int, _Peer] = {}
        self._given: dict[int, wire.Record] = {}
        self._record = wire.encode_record(wire.Record(self._rank, name, socket.gethostname(), secrets.randbits(63),
                                                      self._agent.get_agent_metadata()))
        # the inbox: the latest READY per (peer, channel); DATA and MISMATCH by the nonce of
        # the receiving call that waits for them (any other is stale); recent ABORTs
        self._ready: dict[tuple[int, int], wire.Note] = {}
        self._by_nonce: dict[int, list[wire.Note]] = {}
        self._aborted: collections.deque[tuple[int, int]] = collections.deque(maxlen=_ABORTS_KEPT)
        self._registrations: dict[tuple[int, Any], Any] = {}
        self._xfers: dict[tuple[Any, ...], _Xfer] = {}
        self._free: dict[tuple[int, Any], Any] = {}     # receive slot -> event after its last unpacks (GPU)
        self._met: dict[tuple[int, int], int] = {}      # (Resharder, peer) -> the peer's incarnation it last met
        self._owners: set[int] = set()
        self._placement: dict[tuple[str, int], str] = {}
        self._closed = False
        if store is not None:
            store.set(self._key(self._rank), self._record)

    # ------------------------------------------------------------ public

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def local_metadata(self) -> bytes:
        """This rank's record (agent name, host, incarnation, NIXL metadata), for a control
        plane to pass to the other ranks' `add_peer`."""
        return self._record

    def add_peer(self, rank: int, metadata: bytes) -> None:
        """The record of peer `rank` (the bytes of its `local_metadata()`), e.g. again after it
        restarted: the next call that needs it connects with these."""
        rank = _index(rank, "rank", 0, self._world - 1)
        try:
            record = wire.decode_record(bytes(metadata))
        except (wire.WireError, UnicodeDecodeError, TypeError) as error:
            raise ValueError(f"metadata: not the local_metadata() of a kvbm_ext.nixl transport ({error})") from error
        if record.rank != rank:
            raise ValueError(f"metadata: the record of rank {record.rank}, given for rank {rank}")
        with self._lock:
            self._given[rank] = record
            peer = self._peers.get(rank)
            if peer is not None and peer.record is not None and peer.record.incarnation != record.incarnation:
                peer.stale = True

    def connect(self, peers: Sequence[int], timeout: float) -> None:
        """Loads every peer in `peers` not loaded yet, or lost in an earlier call, waiting
        for its record within `timeout` seconds (PeerError if none comes)."""
        deadline = time.monotonic() + timeout
        for rank in peers:
            while (peer := self._peers.get(rank)) is None or peer.record is None or peer.stale:
                record = self._fetch(rank, deadline, timeout)
                try:
                    self._load(record)
                except self._errors as error:
                    # The record of an incarnation that is gone: its next one may publish in time.
                    if time.monotonic() > deadline:
                        raise PeerError([(rank, record.name)], f"loading its record failed: "
                                                               f"{type(error).__name__}: {error}") from error
                    time.sleep(POLL_S)

    def staging_device(self, device: str, peer: int) -> str:
        """Where the staging of a message with `peer` lives for caches on `device`: the device,
        or "cpu" (pinned host memory) where the link cannot reach device memory."""
        if device == "cpu":
            return device
        key = (device, peer)
        where = self._placement.get(key)
        if where is None:
            where, why = self._place(device, peer)
            self._placement[key] = where
            if enabled():
                emit(f"nixl: rank {self._rank} stages its messages with rank {peer} in "
                     f"{'device memory' if where == device else 'pinned host memory'} ({why})")
        return where

    def exchange(self, call: Any, background: bool) -> Handle:
        from ._nixl_call import NixlCall

        if call.owner is not None and id(call.owner) not in self._owners:
            self._owners.add(id(call.owner))
            weakref.finalize(call.owner, self._forget, id(call.owner))
        # The first step on the caller's thread: the receiver's READY, which the sender waits
        # for, leaves now rather than once the driver thread took the job up.
        return submit(NixlCall(self, call), step_now=True)

    def close(self) -> None:
        """Releases the prepared transfers and registrations (calls must have finished)."""
        with self._lock:
            for xfer in self._xfers.values():
                self._release(xfer)
            self._xfers.clear()
            for registration in self._registrations.values():
                self._agent.deregister_memory(registration.handle)
            self._registrations.clear()
            self._closed = True

    def __repr__(self) -> str:
        return f"NixlTransport(rank={self._rank}, world_size={self._world}, name={self.name!r})"

    # ------------------------------------------------------------ peers

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _fetch(self, rank: int, deadline: float, timeout: float) -> wire.Record:
        """The record of `rank`: from the store (polled while it has none, where the store
        can be asked without blocking), else from add_peer."""
        while True:
            record = self._given.get(rank)
            if self._store is not None and (not hasattr(self._store, "check") or self._store.check([self._key(rank)])):
                record = wire.decode_record(bytes(self._store.get(self._key(rank))))
            if record is not None:
                return record
            if time.monotonic() > deadline:
                where = (f"under key {self._key(rank)!r} of the store" if self._store is not None
                         else "given by add_peer")
                raise PeerError([(rank, "?")], f"no record of rank {rank} {where} within {timeout} s")
            time.sleep(POLL_S)

    def _load(self, record: wire.Record) -> None:
        """Loads (or loads again) a peer's record into the agent and says HELLO to it."""
        with self._lock:
            peer = self._peers.setdefault(record.rank, _Peer(record.rank))
            if peer.record is not None:
                try:
                    self._agent.remove_remote_agent(peer.record.name)
                except self._errors:
                    pass        # already gone
                peer.record = None
            self._agent.add_remote_agent(record.metadata)
            peer.record, peer.stale, peer.generation = record, False, peer.generation + 1
            peer.metadata.clear()
            if enabled():
                emit(f"nixl: rank {self._rank} loaded rank {record.rank} (agent {record.name!r} on {record.host}, "
                     f"incarnation {record.incarnation:x})")
            try:
                self._agent.send_notif(record.name, wire.hello(self._rank, self._record))
            except self._errors:
                peer.stale = True       # not there (yet): found by the call that needs it

    def _lost(self, ranks: Sequence[int]) -> None:
        with self._lock:
            for rank in ranks:
                if rank in self._peers:
                    self._peers[rank].stale = True

    def _place(self, device: str, peer: int) -> tuple[str, str]:
        if self._staging == "device":
            return device, "staging='device'"
        if self._staging == "pinned":
            return "cpu", "staging='pinned'"
        tls = os.environ.get("UCX_TLS", "")
        if tls and not tls.startswith("^") and not any(t.strip().startswith(_GPU_TRANSPORTS) for t in tls.split(",")):
            return "cpu", f"UCX_TLS={tls} names no transport that reaches GPU memory"
        record = self._peers[peer].record if peer in self._peers else None
        host = socket.gethostname()
        if record is not None and record.host != host and not _rdma_devices():
            return "cpu", f"rank {peer} is on {record.host}, and {host} has no RDMA NIC: TCP cannot reach GPU memory"
        return device, "UCX reaches GPU memory: " + ("the same host" if record is None or record.host == host
                                                     else "an RDMA NIC")

    # ------------------------------------------------------------ the inbox

    def _pump(self) -> None:
        """Moves the agent's new notifications into the inbox (and loads a peer that says
        HELLO with another incarnation than the one loaded)."""
        with self._lock:
            try:
                notes = self._agent.get_new_notifs()
            except self._errors as error:
                raise RuntimeError(f"NIXL failed to read this rank's notifications: {type(error).__name__}: "
                                   f"{error}") from error
            for messages in notes.values():
                for message in messages:
                    try:
                        note = wire.decode(message)
                    except (wire.WireError, UnicodeDecodeError) as error:
                        if enabled():
                            emit(f"nixl: rank {self._rank} dropped a notification that is not kvbm_ext's ({error})")
                        continue
                    self._route(note)

    def _route(self, note: wire.Note) -> None:
        if note.kind == wire.HELLO:
            assert note.record is not None
            peer = self._peers.get(note.rank)
            if peer is None or peer.record is None or peer.record.incarnation != note.record.incarnation:
                try:
                    self._load(note.record)
                except self._errors:
                    self._peers[note.rank].stale = True      # the call that needs it loads it again
        elif note.kind == wire.READY:
            if (note.rank, note.nonce) not in self._aborted:
                self._ready[(note.rank, note.channel)] = note
        elif note.kind == wire.ABORT:
            self._aborted.append((note.rank, note.nonce))
            ready = self._ready.get((note.rank, note.channel))
            if ready is not None and ready.nonce == note.nonce:
                del self._ready[(note.rank, note.channel)]
        elif note.nonce in self._by_nonce:
            self._by_nonce[note.nonce].append(note)

    def _take_ready(self, rank: int, channel: int) -> wire.Note | None:
        with self._lock:
            return self._ready.pop((rank, channel), None)

    def _listen(self, nonce: int) -> None:
        with self._lock:
            self._by_nonce[nonce] = []

    def _notes(self, nonce: int) -> list[wire.Note]:
        with self._lock:
            notes = self._by_nonce.get(nonce, [])
            self._by_nonce[nonce] = []
            return notes

    def _unlisten(self, nonce: int) -> None:
        with self._lock:
            self._by_nonce.pop(nonce, None)

    # ------------------------------------------------------------ memory and transfers

    def _registered(self, owner: Any, message: Any) -> Any:
        """The registration of a message's staging (its whole allocation), made or renewed
        when the Resharder's buffer for that slot changed."""
        from ._nixl_agent import register

        storage = message.buffer.untyped_storage()
        key = (id(owner), message.slot)
        with self._lock:
            registration = self._registrations.get(key)
            if registration is not None and (registration.address, registration.nbytes) == (
                    storage.data_ptr(), storage.nbytes()):
                return registration
            if registration is not None:
                self._retire(lambda k: k[1] == registration.id)
                self._agent.deregister_memory(registration.handle)
            import torch

            whole = torch.empty(0, dtype=torch.uint8, device=message.buffer.device).set_(storage)
            try:
                registration = self._registrations[key] = register(self._agent, whole)
            except self._errors as error:
                raise RuntimeError(f"NIXL could not register {whole.numel()} bytes of staging on {whole.device}: "
                                   f"{type(error).__name__}: {error}") from error
            return registration

    def _writes(self, owner: Any, message: Any, registration: Any, peer: _Peer, buffer: wire.Buffer) -> list[Any]:
        """One prepared WRITE per piece of `message` into `buffer` of `peer`: made once per
        pair of buffers (and peer incarnation), re-posted by every call."""
        key = (id(owner), message.slot, peer.rank)
        full = (peer.generation, registration.id, buffer.registration, buffer.address, buffer.device_id,
                buffer.memory, message.pieces)
        with self._lock:
            xfer = self._xfers.get(key)
            if xfer is not None and xfer.key == full:
                return xfer.handles
            if xfer is not None:
                self._release(xfer)
            if buffer.registration not in peer.metadata:
                self._agent.add_remote_agent(buffer.metadata)
                peer.metadata.add(buffer.registration)
            pieces = message.pieces
            local = self._agent.prep_xfer_dlist(
                "", [(registration.address + a, b - a, registration.device_id) for a, b in pieces], registration.memory)
            remote = self._agent.prep_xfer_dlist(
                peer.name, [(buffer.address + a, b - a, buffer.device_id) for a, b in pieces], buffer.memory)
            handles = [self._agent.make_prepped_xfer("WRITE", local, [p], remote, [p]) for p in range(len(pieces))]
            self._xfers[key] = _Xfer(full, local, remote, handles)
            return handles

    def _drop_writes(self, owner: Any, slot: Any, rank: int) -> None:
        """Forgets a message's prepared WRITEs after a failure (their handles were released)."""
        with self._lock:
            xfer = self._xfers.pop((id(owner), slot, rank), None)
            if xfer is not None:
                self._release(xfer)

    def _retire(self, which: Any) -> None:
        """Releases the prepared transfers whose key matches (their calls have finished)."""
        for key in [k for k, xfer in self._xfers.items() if which(xfer.key)]:
            self._release(self._xfers.pop(key))

    def _release(self, xfer: _Xfer) -> None:
        for handle in xfer.handles:
            try:
                self._agent.release_xfer_handle(handle)
            except self._errors:
                pass            # a handle NIXL could not cancel: freed with the agent
        for dlist in (xfer.local, xfer.remote):
            try:
                self._agent.release_dlist_handle(dlist)
            except self._errors:
                pass

    def _forget(self, owner: int) -> None:
        """A Resharder was collected: its registrations and prepared transfers go."""
        with self._lock:
            if self._closed:
                return
            for key in [k for k in self._xfers if k[0] == owner]:
                self._release(self._xfers.pop(key))
            for key in [k for k in self._registrations if k[0] == owner]:
                self._agent.deregister_memory(self._registrations.pop(key).handle)
            for table in (self._free, self._met):
                for key in [k for k in table if k[0] == owner]:
                    del table[key]
            self._owners.discard(owner)


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []
