"""One Resharder call over NIXL, as a `kvbm_ext._driver` job (kvbm_ext/nixl.py).

Made on the caller's thread: the staging is registered where it is new, every piece of
every send is packed (on the call's stream, an event after each piece, for device
caches), and each receive gets a nonce, a random number that tags every notification of
this call for it.  Then `step()`, on the driver thread, without blocking:

- receiver: sends each sender READY (its header record, refused arguments if any, and
  its receive buffer) once the previous call's unpacks of that buffer are done; takes
  DATA (piece p is in place) and MISMATCH with its nonces, comparing the sender's header
  at the first; unpacks each arrived piece once every pair's headers were compared and
  all agreed (`Exchange.allow_writes`), on the side stream or on the host.
- sender: takes the latest READY of each receiver, compares the headers (MISMATCH with
  its own header instead of data where they disagree), then posts piece p as one
  prepared WRITE with a DATA notification as soon as the piece is packed, and polls the
  WRITEs until DONE (NIXL sends the notification only then).

A peer that fails (NIXL raises or reports ERR, or the deadline passes before it
finished) stops the pairs with it; the other pairs go on, and the job then fails with
PeerError naming it.  `abandon` cancels the WRITEs still in flight and tells the
senders still awaited that this call gave up (ABORT).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from . import _nixl_wire as wire
from ._driver import DONE, MOVED, WAITING, Handle
from ._transport import _side_stream

# The driver's own deadline comes this long after the call's: the job raises PeerError at
# the call's deadline itself, naming the peers it waits for.
_BACKSTOP_S = 5.0


class NixlCall:
    def __init__(self, transport: Any, call: Any) -> None:
        self.t, self.call = transport, call
        self.handle = Handle(f"rank {call.rank}: reshard over NIXL", sum(m.nbytes for m in call.sends + call.recvs))
        self._until = time.monotonic() + call.timeout
        self.deadline: float | None = self._until + _BACKSTOP_S
        self._stream = None
        if call.stream is not None:
            # Unpacks are enqueued from the driver thread, on a stream of their own that starts
            # after what the caller queued before this call (the destination's earlier readers).
            self._stream = _side_stream(call.device)
            self._stream.wait_stream(call.stream)
        self._send_regs = [None if m.buffer is None else transport._registered(call.owner, m) for m in call.sends]
        self._recv_regs = [None if m.buffer is None else transport._registered(call.owner, m) for m in call.recvs]
        self._events = [call.events(i, len(m.pieces)) if call.stream is not None else []
                        for i, m in enumerate(call.sends)]
        for p in range(max((len(m.pieces) for m in call.sends), default=0)):
            for i, message in enumerate(call.sends):
                if p < len(message.pieces):
                    call.pack(i, p, call.stream)
                    if call.stream is not None:
                        self._events[i][p].record(call.stream)
        self._nonces = [secrets.randbits(63) for _ in call.recvs]
        for nonce in self._nonces:
            transport._listen(nonce)
        self._told: list[int | None] = [None] * len(call.recvs)   # the peer generation READY went to
        self._arrived: list[set[int]] = [set() for _ in call.recvs]
        self._unpacked: list[set[int]] = [set() for _ in call.recvs]
        self._ready: list[wire.Note | None] = [None] * len(call.sends)
        self._handles: list[list[Any]] = [[] for _ in call.sends]
        self._posted = [0] * len(call.sends)
        self._done: list[set[int]] = [set() for _ in call.sends]
        self._failed: dict[int, str] = {}       # peer -> what this rank saw
        self._cause: BaseException | None = None    # the NIXL error behind the first failure, if any
        self._writes: bool | None = None
        self._errors = transport._errors

    # ------------------------------------------------------------ the driver's

    def step(self) -> str:
        with self._on_device():
            return self._step()

    def _step(self) -> str:
        call, t = self.call, self.t
        moved = False
        t._pump()
        for j, message in enumerate(call.recvs):
            if message.peer not in self._failed:
                moved |= self._tell(j, message)
                moved |= self._receive(j, message)
        for i, message in enumerate(call.sends):
            if message.peer not in self._failed and message.peer not in call.refused:
                moved |= self._send(i, message)
        if self._writes is None and call.settled():
            self._writes = call.allow_writes(self._stream)
        if self._writes:
            for j, message in enumerate(call.recvs):
                for p in sorted(self._arrived[j] - self._unpacked[j]):
                    call.unpack(j, p, self._stream)
                    self._unpacked[j].add(p)
                    moved = True
        waiting = self._waiting()
        if not waiting:
            self._finish()
            if self._failed:
                raise self._error()
            return DONE
        if time.monotonic() > self._until:
            for peer in waiting:
                self._failed.setdefault(peer, f"no answer within the timeout ({call.timeout} s)")
            raise self._error()
        return MOVED if moved else WAITING

    def abandon(self, error: BaseException) -> None:
        with self._on_device():
            self._abandon(error)

    def _on_device(self) -> Any:
        """The driver thread's current CUDA device: the caches' (UCX's CUDA transports work
        in the thread's current context); nothing for host caches."""
        import contextlib

        if self._stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self._stream.device)

    def _abandon(self, error: BaseException) -> None:
        """Cancels the WRITEs in flight, tells the senders still awaited that this call gave
        up, and marks the peers it failed with for a new connection."""
        call, t = self.call, self.t
        for i, message in enumerate(call.sends):
            if self._posted[i] > len(self._done[i]):
                t._drop_writes(call.owner, message.slot, message.peer)     # release cancels what is in flight
        for j, message in enumerate(call.recvs):
            if len(self._arrived[j]) < len(message.pieces) or not call.compared(message.peer):
                try:        # a sender that is alive drops the READY of this call, or stops sending
                    t._agent.send_notif(t._peers[message.peer].name,
                                        wire.abort(call.rank, call.channel, self._nonces[j]))
                except self._errors:
                    pass
        t._lost(getattr(error, "peers", ()) or [m.peer for m in call.sends + call.recvs if m.peer in self._failed])
        self._finish()

    # ------------------------------------------------------------ receiving

    def _tell(self, j: int, message: Any) -> bool:
        """READY to the sender of recv j, once its buffer is free and again if the sender was
        loaded anew (a new incarnation) since."""
        peer = self.t._peers.get(message.peer)
        if peer is None or peer.record is None or self._told[j] == peer.generation:
            return False
        free = self.t._free.get((id(self.call.owner), message.slot))
        if free is not None and not free.query():
            return False
        self._meet(message.peer)
        registration = self._recv_regs[j]
        buffer = None if registration is None else wire.Buffer(
            registration.address, registration.nbytes, registration.device_id, registration.id, registration.memory,
            registration.metadata)
        call = self.call
        note = wire.ready(call.rank, call.channel, self._nonces[j], call.headers[message.peer], call.reason, buffer)
        if self._notify(message.peer, note):
            self._told[j] = peer.generation
        return True

    def _receive(self, j: int, message: Any) -> bool:
        notes = self.t._notes(self._nonces[j])
        for note in notes:
            if note.rank != message.peer or note.header is None:
                continue
            if note.kind == wire.MISMATCH:
                self.call.compare(message.peer, note.header, note.reason)
            elif self.call.compare(message.peer, note.header) and note.piece is not None \
                    and 0 <= note.piece < len(message.pieces):
                self._arrived[j].add(note.piece)
        return bool(notes)

    # ------------------------------------------------------------ sending

    def _send(self, i: int, message: Any) -> bool:
        call, t = self.call, self.t
        moved = False
        ready = self._ready[i]
        if ready is None:
            ready = t._take_ready(message.peer, call.channel)
            if ready is None:
                return False
            moved = True
            self._meet(message.peer)
            if not call.compare(message.peer, ready.header, ready.reason):
                self._notify(message.peer, wire.mismatch(call.rank, call.channel, ready.nonce,
                                                          call.headers[message.peer], call.reason))
                return True
            if ready.buffer is None or ready.buffer.nbytes < message.nbytes:
                self._fail(message.peer, f"its READY describes a receive buffer of "
                                         f"{0 if ready.buffer is None else ready.buffer.nbytes} bytes, short of "
                                         f"{message.nbytes}")
                return True
            try:
                self._handles[i] = t._writes(call.owner, message, self._send_regs[i], t._peers[message.peer],
                                             ready.buffer)
            except self._errors as error:
                self._fail(message.peer, f"preparing the WRITEs failed: {type(error).__name__}: {error}", error)
                return True
            self._ready[i] = ready
        if (message.peer, ready.nonce) in t._aborted:
            self._fail(message.peer, "it gave up on this call (ABORT)")
            return True
        handles, events = self._handles[i], self._events[i]
        try:
            while self._posted[i] < len(handles) and (not events or events[self._posted[i]].query()):
                p = self._posted[i]
                note = wire.data(call.rank, call.channel, ready.nonce, p, call.headers[message.peer])
                if t._agent.transfer(handles[p], note) == "ERR":
                    raise RuntimeError(f"posting piece {p} returned ERR")
                self._posted[i] += 1
                moved = True
            for p in range(self._posted[i]):
                if p not in self._done[i]:
                    state = t._agent.check_xfer_state(handles[p])
                    if state == "DONE":
                        self._done[i].add(p)
                        moved = True
                    elif state != "PROC":
                        raise RuntimeError(f"the WRITE of piece {p} reported {state}")
        except (RuntimeError, *self._errors) as error:
            self._fail(message.peer, f"the WRITE of a piece failed: {type(error).__name__}: {error}", error)
            return True
        return moved

    # ------------------------------------------------------------ bookkeeping

    def _meet(self, rank: int) -> None:
        """Before a pair compares: a peer that is another incarnation than the one this
        Resharder last met restarted, and counts its calls from 0 again (so does the pair)."""
        incarnation = self.t._peers[rank].record.incarnation
        key = (id(self.call.owner), rank)
        if self.t._met.get(key, incarnation) != incarnation:
            self.call.renew(rank)
        self.t._met[key] = incarnation

    def _notify(self, rank: int, note: bytes) -> bool:
        peer = self.t._peers.get(rank)
        try:
            self.t._agent.send_notif(peer.name, note)
            return True
        except self._errors as error:
            self._fail(rank, f"a notification to it failed: {type(error).__name__}: {error}", error)
            return False

    def _fail(self, peer: int, what: str, error: BaseException | None = None) -> None:
        if peer not in self._failed:
            self._failed[peer] = what
            self.call.lost(peer)
            if error is not None and self._cause is None:
                self._cause = error

    def _waiting(self) -> list[int]:
        """The peers this call still waits for."""
        call = self.call
        peers = set()
        for i, message in enumerate(call.sends):
            if message.peer in self._failed or message.peer in call.refused:
                continue
            if self._ready[i] is None or len(self._done[i]) < len(message.pieces):
                peers.add(message.peer)
        for j, message in enumerate(call.recvs):
            if message.peer in self._failed or message.peer in call.refused:
                continue
            if not call.compared(message.peer) or (self._writes is not False and
                                                   len(self._unpacked[j]) < len(message.pieces)):
                peers.add(message.peer)
        return sorted(peers)

    def _error(self) -> BaseException:
        peers = [(rank, self.t._peers[rank].name if rank in self.t._peers else "?") for rank in self._failed]
        seen = "; ".join(f"rank {rank}: {what}" for rank, what in sorted(self._failed.items()))
        error = wire.PeerError(peers, seen)
        error.__cause__ = self._cause
        return error

    def _finish(self) -> None:
        """After the last unpack (or a failure): the receive buffers are free again once
        the unpacks enqueued so far ran; the nonces stop listening."""
        import torch

        for nonce in self._nonces:
            self.t._unlisten(nonce)
        if self._stream is not None and self.handle._gpu_done is None:
            event = torch.cuda.Event()
            event.record(self._stream)
            for message in self.call.recvs:
                self.t._free[(id(self.call.owner), message.slot)] = event
            self.handle.gpu_enqueued(event)
