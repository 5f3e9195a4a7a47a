"""How a `Resharder`'s messages travel: the `Transport` protocol, and `TorchTransport` over
a torch.distributed process group.  torch is imported when a transport is built."""

from __future__ import annotations

import pickle
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ._driver import DONE, WAITING, Handle, submit

if TYPE_CHECKING:
    import torch

    from ._pieces import Exchange


class Transport(Protocol):
    """What a `Resharder` needs from the engine that carries its messages.

    `TorchTransport` implements it over a torch.distributed process group (NCCL for
    GPU caches, gloo for host caches), `kvbm_ext.nixl.NixlTransport` over NIXL between
    engines that share no process group.  `Resharder(..., transport=...)` takes any
    object with these members:

    - `rank`, `world_size`: this process's rank and the number of ranks, in the
      numbering the `EngineLayout`s use.
    - `all_gather_object(obj, timeout)`: a small picklable object from every rank, as a
      list indexed by rank (collective over every rank).  Used once when a Resharder is
      built and once per checked call, to validate on every rank before anything
      moves.  Raises TimeoutError when the other ranks did not all take part within
      `timeout` seconds.  Not called on a pairwise transport (below).
    - `exchange(call, background)`: moves one call's messages (`kvbm_ext._pieces.Exchange`:
      its messages cut into pieces, this rank's header for each peer, and the hooks that
      pack a piece, unpack a piece and compare a peer's header) and returns a
      `kvbm_ext._driver.Handle`.  The transport delivers each peer's header to
      `call.compare` before it moves any payload between the two, moves only the pairs
      that agree, packs a piece before sending it and unpacks a received piece only after
      it arrived, and only once `call.allow_writes()` returned True.  `background=False`:
      it may finish the exchange before it returns (a finished handle; device work
      enqueued on `call.stream`).  `background=True`: it returns at once, the exchange
      goes on (`kvbm_ext._driver`), and `handle.wait_stream(stream)` orders a stream after
      its device work.  Bounded by `call.timeout` either way (TimeoutError).

    Optional: `prepare(timeout)`: called collectively on every rank once a Resharder built
    on a collective transport agreed on its plan, before its first call (TorchTransport
    opens its NCCL communicators there).  `pairwise` (default False): True for a transport whose ranks share no
    collective (engines that start and restart on their own): a Resharder built on it
    gathers nothing, and each of its calls, checked or not, compares its headers pair by
    pair (`call.headers`).  `staging_device(device)` (default `device`): where the staging
    of caches on `device` lives ("cpu" for pinned host memory).  `carries_headers`
    (default True): False where the transport cannot carry the pair headers of
    `check=False` (`call.headers`), which is then refused on every rank with a message; a
    Resharder reads it once `prepare` ran.
    """

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]: ...
    def exchange(self, call: Exchange, background: bool) -> Handle: ...


# The NCCL communicators of each (group, device), kept for the life of the process.
_communicators: dict[tuple[Any, int], tuple[Any, Any]] = {}

# all_gather_object sends each rank's pickled object in a slot of this many bytes, one
# round; only an object that does not fit costs a second round at the largest size.
_GATHER_SLOT = 4096
_LENGTH = struct.Struct("<q")


class TorchTransport:
    """`Transport` over a torch.distributed process group (None: the default group),
    through `torch.distributed.batch_isend_irecv`.  Ranks are ranks of `group`.

    GPU caches need a group with an NCCL backend; host caches one with gloo.  With
    `init_process_group(backend="cpu:gloo,cuda:nccl")` one group does both.  The
    exchanges that check a call, `check=True`'s exchange of descriptions and
    `check=False`'s per-pair headers, cross on the transport's own NCCL header
    communicator where it opened one (below), without waiting for the caller's stream;
    else over gloo, without touching the GPU.  Without either (an NCCL-only group and
    `own_nccl=False`, or NCCL that could not be loaded) `check=True`'s exchange goes
    through the GPU and waits for it, and `check=False` is refused (`carries_headers`
    is False: its headers would have to be read back from the GPU, a host
    synchronization per call).  With NCCL, as for any `batch_isend_irecv`,
    the first NCCL operation on the group must involve all its ranks (e.g. a warm-up
    `all_reduce`).

    Pieces: a message crosses as one `batch_isend_irecv` per piece, all pairs of the
    call together.  On a GPU each piece's sends wait only for the packing of that piece
    (they are posted from a stream that waits for it), and the receiver's stream unpacks
    piece p as soon as it arrived, while the next one crosses.  On the host every piece
    arrives before anything is unpacked, and the call returns when the blocks are in
    place, also with `wait=False`.  A GPU call in the background (`wait=False`) has its
    headers waited for by a thread of the transport and its pieces posted from the
    driver thread (`kvbm_ext._driver`): the group must then carry nothing else from
    other threads.

    NCCL of its own (`own_nccl=True`, the default): where the group has an NCCL backend,
    GPU messages go over two NCCL communicators of the group's ranks, posted from C
    rather than through batch_isend_irecv, whose host time (about 60 us a post) would
    outweigh a call's GPU work: one carries the payloads, the other the exchanges that
    check a call, which the host waits for without waiting behind a payload.  They are
    opened on the current CUDA device by the first Resharder built over the group
    (collectively, as its construction is), shared by every later one, and kept until
    the process ends: a communicator's teardown frees device memory, which waits for the
    whole device.  The caches of a GPU call must be on their device.  Where NCCL cannot
    be loaded, torch's path serves (`KVBM_EXT_DEBUG` says which).  A header that does
    not come in time aborts both: every later call over them raises, and the next
    Resharder built over the group opens new ones.  `own_nccl=False`: torch's path
    always (nothing to open, as for a one-shot `reshard()`).

    A TimeoutError (the other ranks did not take part in time) leaves operations of
    the group pending with no peer to complete them: torch.distributed gives no way
    to cancel them, so the group is unusable afterwards (destroy it and build another).
    """

    pairwise = False

    def __init__(self, group: Any = None, *, own_nccl: bool = True) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "first (or pass transport=)")
        self.group = group
        self._global_ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        self._rank = dist.get_rank(group)
        # Host tensors (all_gather_object's, check=False's headers on torch's path) need gloo in the group.
        self._gloo = "gloo" in str(dist.get_backend(group))
        self._post_streams: dict[Any, Any] = {}     # per device: the stream pieces are posted from
        self._waiter_pool: Any = None
        self._nccl: tuple[Any, Any] | None = None   # our communicators (payloads, headers), see prepare
        self._nccl_device = ""
        self._nccl_tried = not own_nccl

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    @property
    def carries_headers(self) -> bool:
        """Whether `check=False`'s pair headers can cross (the `Transport` protocol's
        `carries_headers`): over the group's gloo, or over our NCCL header communicator once
        `prepare` opened it (GPU caches).  False over a group without gloo where torch's path
        serves, as a header there would have to be read back from the GPU."""
        return self._gloo or self._nccl is not None

    def prepare(self, timeout: float) -> None:
        """Finds or opens the NCCL communicators of the group on the current device, once per
        transport; collective over every rank of the group (the `Transport` protocol's
        `prepare`, which a Resharder's construction calls).  Nothing where the group has no
        NCCL backend; torch's batch_isend_irecv serves where a rank cannot load NCCL."""
        import torch
        import torch.distributed as dist

        if self._nccl_tried or "nccl" not in str(dist.get_backend(self.group)) or not torch.cuda.is_available():
            return
        self._nccl_tried = True
        import importlib

        from ._debug import emit, enabled

        native = importlib.import_module(f"{__package__}._C")     # _NcclComm is private: not in the stub
        device = torch.cuda.current_device()
        key = (dist.group.WORLD if self.group is None else self.group, device)
        held = _communicators.get(key)
        try:
            native._NcclComm.load()
            why = None
        except RuntimeError as error:
            why = f"rank {self._rank}: {error}"
        # Every rank decides alike: reuse where every rank's pair is whole, else open anew.
        gathered = self.all_gather_object((why, held is not None and not any(c.aborted for c in held)), timeout)
        refused = [why for why, _ in gathered if why is not None]
        if refused:
            if enabled():
                emit(f"reshard: rank {self._rank} posts through torch's batch_isend_irecv ({'; '.join(refused)})")
            return
        if not all(whole for _, whole in gathered):
            held = _communicators[key] = self._open(native, device, timeout)
        self._nccl, self._nccl_device = held, f"cuda:{device}"
        if enabled():
            emit(f"reshard: rank {self._rank} posts through NCCL communicators of its own on cuda:{device}")

    def _open(self, native: Any, device: int, timeout: float) -> tuple[Any, Any]:
        """Two new communicators over the group (collective): payloads, then headers."""
        comm = native._NcclComm
        ids = self.all_gather_object((comm.unique_id(), comm.unique_id()) if self._rank == 0 else None, timeout)[0]
        # Blocks until every rank opened its own: all reached this point together.
        opened = (comm(ids[0], self.world_size, self._rank, device), comm(ids[1], self.world_size, self._rank, device))
        # NCCL connects a pair at its first operation, and waits for the peer on the host there:
        # connected now, while every rank is here, a call's wait is only ever for its records.
        others = tuple(rank for rank in range(self.world_size) if rank != self._rank)
        for one in opened:
            if others:
                one.swap(others, bytes(len(others)), timeout)
        return opened

    def check_device(self, device: str) -> None:
        """Refuses, as a rank's own argument error, caches on a device other than our
        communicators' (NCCL moves a device's memory on that device's communicator)."""
        if self._nccl is not None and device.startswith("cuda") and device != self._nccl_device:
            raise ValueError(f"the caches are on {device}, but this transport's NCCL "
                             f"communicators on {self._nccl_device}, the current device when its first Resharder "
                             "was built: build it with the caches' device current (torch.cuda.set_device), or "
                             "pass transport=TorchTransport(group, own_nccl=False)")

    def _abort_nccl(self) -> None:
        if self._nccl is not None:
            for comm in self._nccl:
                comm.abort()

    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]:
        """As torch.distributed.all_gather_object, with every wait bounded by `timeout`
        seconds in all: one exchange of a fixed-size slot (its length first), and a
        second one at the largest size only when an object does not fit.  Once `prepare`
        opened our NCCL communicators (on every rank alike), the slots cross on the header
        communicator, which neither waits for the caller's stream nor goes through gloo's
        sockets; before, and for the rare second exchange, torch's all_gather."""
        import torch
        import torch.distributed as dist

        deadline = time.monotonic() + timeout
        data = pickle.dumps(obj)
        slot = bytearray(_LENGTH.size + _GATHER_SLOT)
        _LENGTH.pack_into(slot, 0, len(data))
        if len(data) <= _GATHER_SLOT:
            slot[_LENGTH.size:_LENGTH.size + len(data)] = data
        if self._nccl is not None:
            own = bytes(slot)
            others = [rank for rank in range(self.world_size) if rank != self._rank]
            theirs = self._swap_records(dict.fromkeys(others, own), deadline, timeout, "exchange") if others else {}
            raw = [own if rank == self._rank else theirs[rank] for rank in range(self.world_size)]
        else:
            mine = torch.frombuffer(slot, dtype=torch.uint8).to(self._object_device())
            slots = [torch.empty_like(mine) for _ in range(self.world_size)]
            self._wait(dist.all_gather(slots, mine, group=self.group, async_op=True), deadline, timeout, "exchange")
            raw = [bytes(s.cpu().numpy()) for s in slots]
        lengths = [_LENGTH.unpack_from(r)[0] for r in raw]
        if max(lengths) <= _GATHER_SLOT:
            return [pickle.loads(r[_LENGTH.size:_LENGTH.size + n]) for r, n in zip(raw, lengths)]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self._object_device())
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(dist.all_gather(pieces, padded, group=self.group, async_op=True), deadline, timeout, "exchange")
        return [pickle.loads(piece[:n].cpu().numpy().tobytes()) for piece, n in zip(pieces, lengths)]

    def _swap_records(self, records: dict[int, bytes], deadline: float, timeout: float,
                      what: str) -> dict[int, bytes]:
        """Through our header communicator, records[peer] to each peer (all of one size) and
        one of that size from each, by peer: check=False's headers, a checked call's
        description slots.  A timeout aborts both communicators (every later call over them
        raises) and says the `what` did not complete."""
        assert self._nccl is not None
        peers = tuple(records)
        try:
            received = self._nccl[1].swap(peers, b"".join(records.values()), max(deadline - time.monotonic(), 0.001))
        except TimeoutError as error:
            self._abort_nccl()
            raise self._timeout_error(timeout, what, error) from error
        size = len(received) // len(peers)
        return {peer: received[i * size:(i + 1) * size] for i, peer in enumerate(peers)}

    def exchange(self, call: Exchange, background: bool) -> Handle:
        # gloo's operations progress only inside their wait (their is_completed() stays False),
        # and a wait that times out closes the connection: the host waits for them whole.  A
        # call on host caches therefore finishes here; one on a GPU in the background hands
        # the wait for its headers to a thread of its own and posts from the driver.
        background = background and call.stream is not None
        job = _TorchCall(self, call, background)
        if background:
            return submit(job)
        while job.step() != DONE:
            pass
        job.handle.finish()
        return job.handle

    def _waiter(self) -> Any:
        """The thread that waits for the headers of calls in the background."""
        if self._waiter_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._waiter_pool = ThreadPoolExecutor(1, thread_name_prefix="kvbm_ext-headers")
        return self._waiter_pool

    def _post_stream(self, device: Any) -> Any:
        import torch

        stream = self._post_streams.get(device)
        if stream is None:
            stream = self._post_streams[device] = torch.cuda.Stream(device)
        return stream

    def _object_device(self) -> Any:
        """Where all_gather_object's tensors live: the host with a gloo backend (alone or
        beside NCCL), else the current CUDA device."""
        import torch

        if self._gloo:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _timeout_error(self, timeout: float, what: str, error: Any = None) -> TimeoutError:
        return TimeoutError(f"rank {self._rank}: the other ranks did not complete the {what} within {timeout} s "
                            "(timeout=): every rank of the group must take part, each with the same check; the "
                            "group is unusable now" + (f" ({error})" if error is not None else ""))

    def _wait(self, work: Any, deadline: float, timeout: float, what: str) -> None:
        # Imported here, not with the package: CPython 3.12's _datetime cannot load in an
        # isolated subinterpreter, where kvbm_ext itself can.
        import datetime

        started = time.monotonic()
        left = max(deadline - started, 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as error:
            if time.monotonic() - started < 0.9 * left:
                raise       # failed before its time was up: not a timeout
            raise self._timeout_error(timeout, what, error) from error


class _TorchCall:
    """One call's exchange over a process group, as a `kvbm_ext._driver` job.

    Made on the caller's thread: the headers are posted (host tensors over gloo), then
    every piece of every send is packed on the call's stream, each piece followed by an
    event, so the headers' round trip runs while the packs are enqueued.  `step()` then
    compares the headers once they came, and posts the pieces of the pairs that agree:
    on a GPU all of them at once, each from the post stream after it waited for its
    piece's event, with the unpack stream waiting for each piece's messages before
    unpacking it; on the host it waits for every message before unpacking.  Only a call
    in the background returns WAITING (its headers, waited for by the transport's
    waiter thread); otherwise step() waits on the host, bounded by the deadline."""

    def __init__(self, transport: TorchTransport, call: Exchange, background: bool) -> None:
        import torch
        import torch.distributed as dist

        self.transport, self.call = transport, call
        self.handle = Handle(f"rank {call.rank}: reshard messages",
                             sum(m.nbytes for m in call.sends + call.recvs))
        self._until = time.monotonic() + call.timeout
        self.deadline: float | None = self._until
        self._gpu = call.stream is not None
        self._unpack_stream = call.stream
        if background:
            self._unpack_stream = _side_stream(call.device)
            # The unpacks write the destination: after what the caller queued before this call.
            self._unpack_stream.wait_stream(call.stream)
        self._received: dict[int, bytes | bytearray] = {}
        self._nccl = transport._nccl if self._gpu else None
        header_works: list[Any] = []
        if call.headers is not None and self._nccl is None:
            ops = []
            for peer, record in call.headers.items():
                into = self._received[peer] = bytearray(len(record))
                ops.append(dist.P2POp(dist.isend, torch.frombuffer(bytearray(record), dtype=torch.int64),
                                      transport._global_ranks[peer], transport.group))
                ops.append(dist.P2POp(dist.irecv, torch.frombuffer(into, dtype=torch.int64),
                                      transport._global_ranks[peer], transport.group))
            header_works = dist.batch_isend_irecv(ops)
        # On a GPU: the events the post stream waits for, an event after what the caller queued
        # before the call, then one after the packs of each piece.
        pieces = self._packed = max((len(m.pieces) for m in call.sends), default=0)
        self._events: list[Any] = call.events(-1, pieces + 1) if self._gpu else []
        if self._gpu:
            self._events[0].record(call.stream)
        for p in range(pieces):
            for i, message in enumerate(call.sends):
                if p < len(message.pieces):
                    call.pack(i, p, call.stream)
            if self._gpu:
                self._events[p + 1].record(call.stream)
        # Our own communicator's headers cross on the host's wait, after the packs are queued.
        wait: Callable[[], None] = (lambda: self._wait_all(header_works)) if self._nccl is None else self._swap
        self._headers: Any = None
        if call.headers is not None and background:
            self._headers = transport._waiter().submit(wait)
        elif call.headers is not None:
            wait()

    def _swap(self) -> None:
        """check=False's headers over our header communicator; a timeout aborts both."""
        assert self.call.headers is not None
        self._received.update(self.transport._swap_records(self.call.headers, self._until, self.call.timeout,
                                                           "messages"))

    def step(self) -> str:
        if self._headers is not None:
            if not self._headers.done():
                if time.monotonic() > self._until:
                    raise self.transport._timeout_error(self.call.timeout, "messages")
                return WAITING
            self._headers.result()      # raises what the wait raised
        for peer, into in self._received.items():
            self.call.compare(peer, bytes(into))
        if self._gpu:
            import torch

            with torch.cuda.device(torch.device(self.call.device)):     # also from the driver thread
                self._post()
            return DONE
        self._wait_all(self._post())
        if self.call.allow_writes(None):
            for j, message in enumerate(self.call.recvs):
                if message.peer not in self.call.refused:
                    for p in range(len(message.pieces)):
                        self.call.unpack(j, p, None)
        return DONE

    def abandon(self, error: BaseException) -> None:
        """torch.distributed cannot cancel a posted operation: nothing to release."""

    def _wait_all(self, works: list[Any]) -> None:
        for work in works:
            self.transport._wait(work, self._until, self.call.timeout, "messages")

    def _post(self) -> list[Any]:
        """Posts every piece of the pairs that agree; on a GPU, enqueues their unpacks.
        Returns the host works."""
        import torch
        import torch.distributed as dist

        call, transport = self.call, self.transport
        sends = [m for m in call.sends if m.peer not in call.refused]
        recvs = [(j, m) for j, m in enumerate(call.recvs) if m.peer not in call.refused]
        pieces = max((len(m.pieces) for m in sends + [m for _, m in recvs]), default=0)
        writes = call.allow_writes(self._unpack_stream) if self._gpu else False
        post = transport._post_stream(torch.device(call.device)) if self._gpu else None
        if self._nccl is not None:
            self._post_nccl(sends, recvs, pieces, writes, post)
            return []
        batches = []
        for p in range(pieces):
            ops = [dist.P2POp(dist.isend, m.chunks[p], transport._global_ranks[m.peer], transport.group)
                   for m in sends if p < len(m.pieces)]
            ops += [dist.P2POp(dist.irecv, m.chunks[p], transport._global_ranks[m.peer], transport.group)
                    for _, m in recvs if p < len(m.pieces)]
            if post is not None:
                # NCCL orders its stream after the current one when posted: the post stream,
                # which waits for this piece's packs (and what preceded the call) only.
                post.wait_event(self._events[min(p + 1, self._packed)])
                with torch.cuda.stream(post):
                    batches.append(dist.batch_isend_irecv(ops) if ops else [])
            else:
                batches.append(dist.batch_isend_irecv(ops) if ops else [])
        if not self._gpu:
            return [work for works in batches for work in works]

        def arrived(p: int) -> None:
            for work in batches[p]:
                work.wait()     # the current stream, the unpack stream, waits for the piece's messages, sends included

        with torch.cuda.stream(self._unpack_stream):
            self._unpack_pieces(recvs, pieces, writes, arrived)
        return []

    def _post_nccl(self, sends: list[Any], recvs: list[Any], pieces: int, writes: bool, post: Any) -> None:
        """The pieces over our payload communicator: piece p's group is posted on the post
        stream once its packs are done, and the unpack stream unpacks it once the group
        (its sends included, whose staging the next call rewrites) completed."""
        call, payloads = self.call, self._nccl
        assert payloads is not None
        arrived = call.events(-2, pieces)
        bases = [(m, m.buffer.data_ptr(), 1) for m in sends] + [(m, m.buffer.data_ptr(), 0) for _, m in recvs]
        for p in range(pieces):
            ops = tuple((m.peer, send, base + m.pieces[p][0], m.pieces[p][1] - m.pieces[p][0])
                        for m, base, send in bases if p < len(m.pieces))
            post.wait_event(self._events[min(p + 1, self._packed)])
            if ops:
                payloads[0].post(post.cuda_stream, ops)
            arrived[p].record(post)
        self._unpack_pieces(recvs, pieces, writes, lambda p: self._unpack_stream.wait_event(arrived[p]))

    def _unpack_pieces(self, recvs: list[Any], pieces: int, writes: bool, arrived: Callable[[int], None]) -> None:
        """Enqueues on the unpack stream the unpacks of each piece p of every recv (where
        `writes`), each after `arrived(p)` made the stream wait for that piece's messages; then,
        for a call in the background, the event its handle orders streams after."""
        import torch

        for p in range(pieces):
            arrived(p)
            if writes:
                for j, message in recvs:
                    if p < len(message.pieces):
                        self.call.unpack(j, p, self._unpack_stream)
        if self._unpack_stream is not self.call.stream:
            event = torch.cuda.Event()
            event.record(self._unpack_stream)
            self.handle.gpu_enqueued(event)


_side_streams: dict[str, Any] = {}


def _side_stream(device: str) -> Any:
    """The stream of `device` that work enqueued from the driver thread runs on."""
    import torch

    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(torch.device(device))
    return stream
