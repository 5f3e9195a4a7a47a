"""Moving KV blocks between engines of different tensor / pipeline parallel sizes.

A prefill engine and a decode engine (or any two engines) split the same model's
KV cache differently: TP rank r of T holds a slice of the KV heads, PP stage s of
P a range of the layers.  `Resharder` plans, once, which part of its heads x layers
every source rank owes every destination rank (kvbm_ext/_plan.py); each call then
moves a batch of blocks with one contiguous message per (source rank, destination
rank) pair that shares data: the sender packs the receiver's heads and layers of
every block into one `[nb, nh_sel, nl_sel, no, nt, hd]` buffer with one
`PagedKVCache.to_universal` call, the transport (kvbm_ext/_transport.py) carries it,
and the receiver scatters it with one `from_universal` call.  A rank that holds both
a source and a destination position copies its own share locally, without a message.

The error contract: every argument is checked on every rank before any collective,
and any exception on one rank (a bad type, a raising __index__, a construction that
fails, a destination that cannot be written) becomes the same error on every rank,
naming the rank and the argument, with nothing sent and nothing written.  What no
check can see without communicating (a rank that does not call, or calls with
another `check`) ends in a TimeoutError after `timeout` seconds.

With check=False the ranks skip that exchange, but the two ranks of every message
still exchange a fixed-size header first (`HEADER`: what each will send and expects
to receive), compare the same two records with the same function
(`_compare_headers`) and, where they disagree, raise the same error before any
payload is posted or any byte written.  The header is plain bytes, so any transport
can carry it; the comparison lives here, not in the transport.  Block ids are read
once per call, into a list (or, on the device, a tensor) the call owns, which every
later step uses.

torch is imported when a Resharder is built, not when kvbm_ext is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import PagedKVCache
from ._plan import EngineLayout, ReshardTransfer, _as_int, layout_key, plan_reshard
from . import _pieces
from ._debug import emit, enabled
from ._driver import Handle
from ._transport import TorchTransport, Transport

if TYPE_CHECKING:
    import torch

# Seconds a rank waits for the others in one exchange or one call's host messages: well
# under torch.distributed's own timeouts (10 minutes for NCCL, 30 for gloo).
DEFAULT_TIMEOUT = 120.0

# ---------------------------------------------------------------- the pair header
#
# With check=False every call begins, for each peer this rank exchanges a message with
# (either way), with one record sent to the peer and one received from it, posted
# together.  A record is HEADER_FIELDS as little-endian int64 words (HEADER.size = 128
# bytes, whatever the plan: two ranks that disagree on everything still exchange equal
# sizes).  `sends` / `expects` are the payload bytes the writer will send to the peer /
# expects from it (0 where there is no message that way); the other fields describe the
# writer's call.  `status` is 0, or the code of the error that refused the writer's own
# arguments (then the writer sends no payload, and its peers raise at once).
HEADER_FIELDS = ("magic", "version", "plan", "writer", "peer", "call", "status", "dtype", "itemsize", "nb",
                 "num_outer", "tokens_per_block", "head_dim", "device", "sends", "expects")
HEADER = struct.Struct(f"<{len(HEADER_FIELDS)}q")
HEADER_MAGIC = int.from_bytes(b"KVBM-RSH", "big")
HEADER_VERSION = 1
_F = {name: i for i, name in enumerate(HEADER_FIELDS)}
# What both records of a pair must hold alike, in the order a disagreement is reported, and its words.
_AGREED = (("version", "header version"), ("plan", "plan"), ("call", "call number"), ("dtype", "dtype"),
           ("itemsize", "itemsize"), ("nb", "number of blocks"), ("num_outer", "num_outer"),
           ("tokens_per_block", "tokens_per_block"), ("head_dim", "head_dim"), ("device", "device type"))
_HINTS = {"plan": " (the plan's digest: the ranks called Resharders built for different transfers)",
          "call": " (the calls of this Resharder that the pair completed: the ranks called different Resharders "
                  "of one plan, or one rank made a call that the other did not)"}
_STATUS: dict[type[Exception], int] = {TypeError: 1, ValueError: 2, RuntimeError: 3}
_STATUS_KIND = {code: kind for kind, code in _STATUS.items()}
# Element types by code (a code is stable across versions: append only); others by a hash of the name.
_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
           "float8_e5m2fnuz", "float8_e8m0fnu", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
           "uint64", "bool", "complex64", "complex128", "complex32")
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(_DTYPES)}
_DEVICE_CODE = {"cpu": 1, "cuda": 2}


# check=False on a transport that cannot carry the headers (its carries_headers is False:
# TorchTransport over an NCCL-only group without NCCL communicators of its own): refused alike on
# every rank of a pair, before anything is sent.
NO_HOST_HEADERS = (f"check=False: the ranks of each pair compare a {HEADER.size}-byte header on the host before any "
                   "payload, and this transport cannot carry it (TorchTransport over a group without gloo, such as "
                   "an NCCL-only group, and without NCCL communicators of its own: own_nccl=False, or NCCL could "
                   "not be loaded; reading a received header back would wait for the GPU): create the group with "
                   "backend=\"cpu:gloo,cuda:nccl\", leave own_nccl=True, or call with check=True")


def _code(name: str, table: dict[str, int]) -> int:
    """A name's code in `table`, else a stable 62-bit hash of it (never a table code)."""
    code = table.get(name)
    if code is None:
        code = (int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 2) | (1 << 61)
    return code


def _render(field: str, value: int) -> str:
    """A header value as the error text shows it."""
    if field == "dtype":
        return _DTYPES[value - 1] if 1 <= value <= len(_DTYPES) else f"dtype code {value}"
    if field == "device":
        return next((name for name, code in _DEVICE_CODE.items() if code == value), f"device code {value}")
    if field == "plan":
        return f"digest {value & (2**64 - 1):016x}"
    return str(value)


def _compare_headers(low: tuple[int, ...], high: tuple[int, ...], rank_low: int,
                     rank_high: int) -> tuple[type[Exception], str] | None:
    """Why the messages between `rank_low` < `rank_high` cannot go ahead, given the record
    each wrote (`low`, `high`); None when they agree.  Both ranks call it with the same
    arguments, so both raise the same error."""
    pair = f"rank {rank_low} and rank {rank_high}"
    nothing = "; nothing was sent between them and neither wrote any block"
    for rank, peer, record in ((rank_low, rank_high, low), (rank_high, rank_low, high)):
        if (record[_F["magic"]], record[_F["writer"]], record[_F["peer"]]) != (HEADER_MAGIC, rank, peer):
            return RuntimeError, (f"{pair}: the header from rank {rank} is not a Resharder header from rank {rank} to "
                                  f"rank {peer} (magic {record[_F['magic']] & (2**64 - 1):016x}, writer "
                                  f"{record[_F['writer']]}, peer {record[_F['peer']]}){nothing}")
    for rank, record in ((rank_low, low), (rank_high, high)):
        if record[_F["status"]]:
            kind = _STATUS_KIND.get(record[_F["status"]], RuntimeError)
            return kind, (f"rank {rank} refused its own arguments in this call (it raised a {kind.__name__} with "
                          f"the reason; check=True raises the reason on every rank): nothing was sent between "
                          f"{pair} and neither wrote any block")
    for field, words in _AGREED:
        i = _F[field]
        if low[i] != high[i]:
            return ValueError, (f"{pair} disagree on the {words}: {_render(field, low[i])} on rank {rank_low}, "
                                f"{_render(field, high[i])} on rank {rank_high}{_HINTS.get(field, '')}{nothing}")
    sends, expects = _F["sends"], _F["expects"]
    if low[sends] != high[expects] or low[expects] != high[sends]:
        return ValueError, (f"{pair} disagree on the size of their messages: rank {rank_low} sends {low[sends]} "
                            f"bytes and rank {rank_high} expects {high[expects]}, rank {rank_high} sends "
                            f"{high[sends]} and rank {rank_low} expects {low[expects]}{nothing}")
    return None


def _first_difference(low: tuple[int, ...], high: tuple[int, ...]) -> str | None:
    """The first field both records must hold alike that they do not."""
    return next((field for field, _ in _AGREED if low[_F[field]] != high[_F[field]]), None)


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """What one `Resharder` call moved on this rank: the messages it sent and received and
    the local copies it made, each with its bytes of KV data."""

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    local_copies: int = 0
    bytes_copied: int = 0


class _CallError(Exception):
    """A problem with one rank's arguments, raised on every rank after the exchange: its
    kind (TypeError, ValueError or RuntimeError), message and cause (on this rank)."""

    KINDS = {kind.__name__: kind for kind in (TypeError, ValueError, RuntimeError)}

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @classmethod
    def of(cls, error: Exception, rank: int) -> _CallError:
        """Any exception raised while checking or packing on `rank`, named by its rank."""
        if isinstance(error, _CallError):
            return error
        kind = TypeError if isinstance(error, TypeError) else ValueError if isinstance(error, ValueError) else None
        message = f"rank {rank}: {error}" if kind else f"rank {rank}: {type(error).__name__}: {error}"
        problem = cls(kind or RuntimeError, message)
        problem.__cause__ = error
        return problem

    @property
    def info(self) -> tuple[str, str]:
        """What the other ranks receive."""
        return (self.kind.__name__, str(self))


def _raise_agreed(errors: Sequence[tuple[str, str] | None], own: _CallError | None) -> None:
    """Raise, identically on every rank, the errors of every rank (None where a rank had
    none), joined; on a rank that had one, with its own as the cause."""
    found = [error for error in errors if error is not None]
    if not found:
        return
    kind = _CallError.KINDS.get(found[0][0], RuntimeError)
    raise kind("; ".join(message for _, message in found)) from (own.__cause__ or own if own else None)


def _timeout(value: object) -> float:
    """A timeout= argument: seconds, finite and positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"timeout: expected seconds as an int or a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout: expected a finite number of seconds above 0, got {value!r}")
    return float(value)


class ReshardHandle:
    """A Resharder call that goes on in the background (`wait=False`).

    `done()` says whether it finished (never raises); `wait(timeout=None)` blocks until
    it finished and returns its `ReshardStats`, or raises what the call raised (the same
    errors as a blocking call) or TimeoutError when `timeout` seconds pass first (the call
    goes on); `wait_stream(stream=None)` makes a CUDA stream (None: torch's current one)
    wait for the call's GPU work, blocking the host only until that work is enqueued, and
    raises the call's error if it failed first.  Work queued on a stream after
    `wait_stream` sees the moved blocks.  `stats`: what the call moves on this rank."""

    def __init__(self, inner: Handle | None, stats: ReshardStats, problem: _CallError | None = None,
                 refused: dict[int, tuple[type[Exception], str]] | None = None) -> None:
        self._inner, self.stats, self._problem, self._refused = inner, stats, problem, refused

    def __repr__(self) -> str:
        return f"<kvbm_ext reshard call: {'done' if self.done() else 'pending'}, {self.stats}>"

    def done(self) -> bool:
        return self._inner is None or self._inner.done()

    def wait(self, timeout: float | None = None) -> ReshardStats:
        if self._inner is not None:
            try:
                self._inner.wait(timeout)
            except Exception:
                if self._problem is None or not self._inner.done():
                    raise
        self._raise()
        return self.stats

    def wait_stream(self, stream: Any = None, timeout: float | None = None) -> None:
        if self._inner is not None:
            try:
                self._inner.wait_stream(stream, timeout)
            except Exception:
                if self._problem is None or not self._inner.done():
                    raise
        self._raise()

    def _raise(self) -> None:
        """This rank's own refused arguments first, else the pairs that were refused."""
        if self._problem is not None:
            _raise_agreed([self._problem.info], self._problem)
        if self._refused:
            found = [self._refused[peer] for peer in sorted(self._refused)]
            raise found[0][0]("; ".join(message for _, message in found))


class _Route:
    """One transfer as this rank's calls move it: the staging slot of its message (or local
    copy), its peer, and the cache selections its pack and unpack use."""

    def __init__(self, transfer: ReshardTransfer, side: str, index: int, src_share: Any, dst_share: Any) -> None:
        self.transfer, self.slot = transfer, (side, index)
        self.peer = transfer.dst_rank if side == "send" else transfer.src_rank
        # (layers, heads) of the caches, which hold exactly their position's heads and layers.
        self.src: tuple[range | None, range | None] = (None, None)
        self.dst: tuple[range | None, range | None] = (None, None)
        if src_share is not None:
            self.src = (_whole_or(transfer.src_layers, len(src_share[1])), _whole_or(transfer.src_heads,
                                                                                     len(src_share[0])))
        if dst_share is not None:
            self.dst = (_whole_or(transfer.dst_layers, len(dst_share[1])), _whole_or(transfer.dst_heads,
                                                                                     len(dst_share[0])))
        self._key: Any = None
        self._views: tuple[Any, ...] = ()

    def views(self, base: torch.Tensor, shape: tuple[int, ...], dtype: Any) -> tuple[Any, ...]:
        """(bytes used, typed view, block pieces, byte pieces, piece views, piece bytes) of
        the staging buffer `base` for a call of `shape` (nb first): kept while neither
        changes, so that a steady call builds none of them."""
        key = (base.data_ptr(), base.device, shape, dtype)
        if key != self._key:
            nb = shape[0]
            used = base[:math.prod(shape) * dtype.itemsize]
            view = used.view(dtype).view(shape)
            block_bytes = used.numel() // nb
            blocks = _pieces.cut(nb, block_bytes)
            self._key = key
            pieces = tuple((a * block_bytes, b * block_bytes) for a, b in blocks)
            self._views = (used, view, blocks, pieces, tuple(view[a:b] for a, b in blocks),
                           tuple(used[a:b] for a, b in pieces))
            if self.slot[0] != "local" and enabled():
                sends = self.slot[0] == "send"
                me = self.transfer.src_rank if sends else self.transfer.dst_rank
                emit(f"reshard: rank {me} {'sends' if sends else 'receives'} {nb} blocks of {block_bytes} bytes "
                     f"{'to' if sends else 'from'} rank {self.peer} in "
                     f"{len(blocks)} pieces of {', '.join(str(b - a) for a, b in blocks)} blocks "
                     f"({', '.join(str((b - a) * block_bytes) for a, b in blocks)} bytes), staging on {base.device}"
                     f"{' (pinned)' if base.device.type == 'cpu' and base.is_pinned() else ''}")
        return self._views


class Resharder:
    """Moves batches of KV blocks from one engine's layout to another's.

    `Resharder(num_heads, num_layers, src, dst, group=None, timeout=120)`: the model's
    KV heads and layers, the source and destination `EngineLayout`s, and the process
    group (or `transport=`, any `Transport`) whose ranks the layouts name.  Building it
    is collective: every rank of the group builds it, the ranks check that they plan
    the same transfer (`plan`: the whole plan, the same on every rank), and an error on
    any rank (an argument it refuses) is raised on every rank, naming that rank.  A
    rank that cannot even reach the others (its transport fails) raises alone, and the
    others raise TimeoutError after `timeout` seconds.  Over a pairwise transport
    (`kvbm_ext.nixl.NixlTransport`: engines that start and restart on their own) nothing
    is gathered: each rank builds its own, and the pairs compare their plans' digests in
    the headers of every call.

    Each call `resharder(src_cache, src_block_ids, dst_cache, dst_block_ids)` moves
    block `src_block_ids[i]` of the source engine to block `dst_block_ids[i]` of the
    destination engine, for every i.  Every rank of the group calls it (a
    collective): a rank holding a source position passes its `PagedKVCache` and the
    batch's block ids on that side, a rank holding a destination position likewise,
    a rank holding both passes both, and the other arguments are None.  Every
    source rank passes the same number of ids as every destination rank.  (With
    `check=False`, or over a pairwise transport, the call communicates only between the
    ranks that share data, and a rank that holds no position need not call.)

    One call at a time per Resharder: a call made while another thread is in a call
    of the same Resharder raises RuntimeError at once, without communicating; a call
    made while the previous one goes on in the background (`wait=False`) waits for it
    first (bounded by its timeout).

    Staging: each call packs this rank's outgoing share into buffers of the caches'
    device, or of pinned host memory where the transport says so (one per message or
    local copy, `[nb, heads, layers, no, nt, hd]`), and receives into one per incoming
    message.  They are allocated by the first call, grown when a call moves more
    blocks, and otherwise reused (`staging_nbytes`).  A message crosses in a few pieces
    (ranges of its blocks, `kvbm_ext._pieces.cut`): each piece is sent once packed and
    unpacked once arrived, while the next one crosses.
    """

    def __init__(self, num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout, *,
                 group: Any = None, transport: Transport | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        given = transport
        self.transport = TorchTransport(group) if transport is None else transport
        self.rank = self.transport.rank
        self._lock = threading.Lock()
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self._probes: dict[tuple[Any, ...], torch.Tensor] = {}
        self._done: Any = None          # CUDA event after the previous call's last use of the staging
        self._events: dict[int, list[Any]] = {}     # per send: an event per piece, recorded by each call
        self._last: ReshardHandle | None = None     # the previous call, which may go on in the background
        # A pairwise transport has no collective: nothing is gathered, every call compares headers.
        self._pairwise = getattr(self.transport, "pairwise", False) is True
        problem, fingerprint, seconds = None, None, DEFAULT_TIMEOUT
        try:
            seconds = _timeout(timeout)
            if given is not None and group is not None:
                raise ValueError("pass group= or transport=, not both")
            self._plan(num_heads, num_layers, src, dst)
            fingerprint = self._fingerprint
        except Exception as error:
            problem = _CallError.of(error, self.rank)
        if self._pairwise:
            _raise_agreed([problem.info if problem is not None else None], problem)
        else:
            gathered = self.transport.all_gather_object((fingerprint, problem and problem.info), seconds)
            _raise_agreed([error for _, error in gathered], problem)
            for rank, (theirs, _) in enumerate(gathered):
                if theirs != gathered[0][0]:
                    raise ValueError(f"rank {rank} built its Resharder for (num_heads, num_layers, src, dst) = "
                                     f"{theirs}, rank 0 for {gathered[0][0]}: every rank must plan the same transfer")
            prepare = getattr(self.transport, "prepare", None)
            if prepare is not None:
                prepare(seconds)     # collective, as this construction is
        # Read once prepared: TorchTransport carries them over NCCL only once prepare opened its communicators.
        self._carries_headers = getattr(self.transport, "carries_headers", True) is not False

    def _plan(self, num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout) -> None:
        """Plans the transfer and what this rank's part of it is."""
        self.plan = plan_reshard(num_heads, num_layers, src, dst)
        world = _as_int(self.transport.world_size, "the transport's world_size")
        for name, layout in (("src", src), ("dst", dst)):
            assert layout.ranks is not None
            if max(layout.ranks) >= world:
                raise ValueError(f"{name}: rank {max(layout.ranks)} is not in the group (world size {world})")
        self.num_heads = _as_int(num_heads, "num_heads")
        self.num_layers = _as_int(num_layers, "num_layers")
        self.src, self.dst = src, dst
        self.num_messages = sum(not t.is_local for t in self.plan)
        self._sends = [t for t in self.plan if t.src_rank == self.rank and not t.is_local]
        self._recvs = [t for t in self.plan if t.dst_rank == self.rank and not t.is_local]
        self._locals = [t for t in self.plan if t.src_rank == self.rank and t.is_local]
        src_pos, dst_pos = src.position_of(self.rank), dst.position_of(self.rank)
        # What this rank's caches must hold: (heads, layers) of its positions, None when it has none.
        self._src_share = None if src_pos is None else (src.heads_of(src_pos[1], self.num_heads),
                                                        src.layers_of(src_pos[0], self.num_layers))
        self._dst_share = None if dst_pos is None else (dst.heads_of(dst_pos[1], self.num_heads),
                                                        dst.layers_of(dst_pos[0], self.num_layers))
        # Compared across ranks: the same model and layouts everywhere.
        self._fingerprint = (self.num_heads, self.num_layers, layout_key(src, self.num_layers),
                             layout_key(dst, self.num_layers))
        # The headers' plan: 8 bytes of a hash of the fingerprint.
        self._digest = int.from_bytes(hashlib.blake2b(repr(self._fingerprint).encode(), digest_size=8).digest(),
                                      "little", signed=True)
        # The ranks this one exchanges a message with (either way), and the (head, layer) cells of
        # one block it sends to and receives from each.
        cells: dict[int, list[int]] = {}
        for t in self._sends:
            cells.setdefault(t.dst_rank, [0, 0])[0] += len(t.heads) * len(t.layers)
        for t in self._recvs:
            cells.setdefault(t.src_rank, [0, 0])[1] += len(t.heads) * len(t.layers)
        self._peers = sorted(cells)
        self._peer_cells = [tuple(cells[peer]) for peer in self._peers]
        # Per peer: the calls of this Resharder whose headers the two ranks compared and found
        # agreeing.  Both ranks count the same calls (they compare the same records), so the
        # next header of a pair in step carries the same number on both sides.  A pair that
        # disagrees on the number starts again from 0 on both ranks (both see the same two
        # records), as does a pair whose peer was lost in a call (its replacement starts at 0).
        self._pair_calls = [0] * len(self._peers)
        self._peer_index = {peer: i for i, peer in enumerate(self._peers)}
        self._sends_routes = [_Route(t, "send", i, self._src_share, None) for i, t in enumerate(self._sends)]
        self._recvs_routes = [_Route(t, "recv", i, None, self._dst_share) for i, t in enumerate(self._recvs)]
        self._locals_routes = [_Route(t, "local", i, self._src_share, self._dst_share)
                               for i, t in enumerate(self._locals)]

    def __repr__(self) -> str:
        return (f"Resharder(num_heads={self.num_heads}, num_layers={self.num_layers}, src={self.src!r}, "
                f"dst={self.dst!r}, rank={self.rank}, transfers={len(self.plan)}, messages={self.num_messages})")

    @property
    def staging_nbytes(self) -> int:
        """Bytes of staging buffers this rank holds (kept and reused across calls)."""
        return sum(buffer.numel() for buffer in self._staging.values())

    def __call__(self, src_cache: PagedKVCache | None, src_block_ids: Any, dst_cache: PagedKVCache | None,
                 dst_block_ids: Any, *, stream: Any = None, check: bool = True, timeout: float = DEFAULT_TIMEOUT,
                 wait: bool = True) -> Any:
        """Move the blocks; returns what this rank sent, received and copied.

        `block_ids`: a sequence of ints (or `__index__` integers) or a 1-D int32/int64
        tensor, on the host or on the cache's device (device ids are not read on the
        host: no synchronization, and they are not range-checked here).

        `stream` (GPU caches): a torch.cuda.Stream or an int cudaStream_t; None is
        torch's current stream.  Packing runs on it; work queued on the stream after the
        call sees the moved blocks.  Over a process group (NCCL) the call enqueues
        everything on it and returns without waiting for the GPU: the messages wait for
        the packing, the stream waits for the messages, unpacking runs on it.  Over a
        transport whose far side the host drives (NIXL), the host waits until every piece
        arrived and its unpack was enqueued (`wait=False` returns before).  Host caches:
        the call returns when the blocks are in place.

        `wait` (default True): False returns a `ReshardHandle` at once instead of the
        stats: the call goes on in the background (`done()`, `wait(timeout)`,
        `wait_stream(stream)`; work on a stream sees the moved blocks only after
        `wait_stream`).  The next call of this Resharder waits for it first.

        Each ids argument is read once (`_snapshot_ids`): host ids into a list of ints
        the call owns, which the check, the packing and every unpack use.

        `check` (the same on every rank): exchange a description of every rank's
        arguments first, and raise the same error on every rank, before any message
        or write, when any rank's arguments are wrong or they do not fit together
        (model dimensions, element types, block counts, a rank's caches against its
        position, block ids out of range or repeated on the destination, a
        destination cache that cannot be written).  With `check=False` a rank checks
        its own arguments without communicating, and the two ranks of every message
        exchange a 128-byte header before it (`HEADER`: plan digest, call number,
        dtype, itemsize, blocks, geometry, bytes each way): where they disagree, or
        one refused its own arguments, both raise at once, before any payload,
        writing nothing (the same error, but for a rank raising its own).  A rank
        with a refused pair still completes the messages of its other pairs, writes
        no block, and raises; ranks that exchange no message are not compared.  A
        `check` that is not a bool is reported as a TypeError on every rank.  Over a
        pairwise transport both compare headers pair by pair; `check=True` also carries
        a rank's refused arguments to its peers, which raise the reason itself.

        `timeout`: seconds this rank waits for the others in the check's exchange
        and for host messages (gloo, NIXL); past it, TimeoutError.  A rank that does
        not call, or calls with another `check`, is found this way.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"rank {self.rank}: this Resharder is in a call on another thread; a Resharder makes "
                               "one call at a time (its staging is its own): wait for that call, or use one "
                               "Resharder per thread")
        try:
            return self._call(src_cache, src_block_ids, dst_cache, dst_block_ids, stream, check, timeout, wait)
        finally:
            self._lock.release()

    def _call(self, src_cache: Any, src_block_ids: Any, dst_cache: Any, dst_block_ids: Any, stream: Any,
              check: object, timeout: object, wait: object) -> Any:
        import torch

        description: tuple[Any, Any] = (None, None)
        src_ids: Any = None
        dst_ids: Any = None     # the ids as this call read them, once: every later step uses these
        device, cuda_stream, seconds = "cpu", None, DEFAULT_TIMEOUT
        checked = not isinstance(check, bool) or check     # not a bool: reported through the exchange
        background = wait is False
        problem = None
        # Collective transports check a call by gathering every rank's description; the others
        # compare each pair's headers, where the transport can carry them.
        gather = checked and not self._pairwise
        headers = not gather and bool(self._peers) and self._carries_headers
        try:
            seconds = _timeout(timeout)
        except Exception as error:
            problem = _CallError.of(error, self.rank)
        # The previous call (wait=False) and the peers' connections come before anything else
        # of this call: they fail this rank alone, as they are, with nothing sent.
        previous = self._finish_previous(seconds)
        connect = getattr(self.transport, "connect", None)
        if connect is not None and self._peers:
            connect(self._peers, seconds)
        try:
            if problem is not None:
                raise problem
            if not isinstance(check, bool):
                raise TypeError(f"check: expected a bool, got {type(check).__name__}")
            if not isinstance(wait, bool):
                raise TypeError(f"wait: expected a bool, got {type(wait).__name__}")
            if not gather and self._peers and not self._carries_headers:
                raise _CallError(ValueError, NO_HOST_HEADERS)     # alike on every rank with a message
            src_desc, src_ids = self._describe("src", self._src_share, src_cache, src_block_ids)
            dst_desc, dst_ids = self._describe("dst", self._dst_share, dst_cache, dst_block_ids)
            description = (src_desc, dst_desc)
            if src_desc and dst_desc and src_desc[0] != dst_desc[0]:
                raise _CallError(ValueError, f"rank {self.rank}: src_block_ids has {src_desc[0]} ids and "
                                             f"dst_block_ids {dst_desc[0]}: one id per moved block on each side")
            device = self._device(src_cache, dst_cache)
            check_device = getattr(self.transport, "check_device", None)
            if check_device is not None and description != (None, None):
                check_device(device)
            cuda_stream = self._stream(stream, device, description != (None, None))
            # Whatever a pack or an unpack would refuse, found now, before anything is sent.
            if dst_desc is not None:
                self._check_destination(dst_cache, device)
            if src_desc is not None:
                self._check_source(src_cache, device)
            if headers and src_desc and dst_desc:
                _same_caches(src_desc, dst_desc, self.rank)    # a header describes one kind of cache
        except Exception as error:
            problem = _CallError.of(error, self.rank)
        nb = next((desc[0] for desc in description if desc is not None), 0) if problem is None else 0
        with _on_stream(device, cuda_stream):
            if cuda_stream is not None:
                # The previous call's use of the staging: its packs (on any stream) and, where it
                # went on in the background, its unpacks.
                for event in (self._done, previous):
                    if event is not None:
                        cuda_stream.wait_event(event)
            try:
                buffers = None
                if nb > 0:
                    try:        # a failed allocation is reported as any argument error
                        buffers = self._prepare(src_cache, dst_cache, nb, device)
                    except Exception as error:
                        problem = _CallError.of(error, self.rank)
                if gather:
                    # Every rank's description meets every other before anything is sent or
                    # written: all ranks see the same list, so all raise alike.
                    gathered = self.transport.all_gather_object(
                        (self._fingerprint, problem and problem.info, description), seconds)
                    _raise_agreed([error for _, error, _ in gathered], problem)
                    self._validate(gathered)
                elif problem is not None and not headers:
                    _raise_agreed([problem.info], problem)
                if buffers is None and not headers:
                    return ReshardStats() if not background else ReshardHandle(None, ReshardStats())
                cache = src_cache if description[0] is not None else dst_cache
                call = self._exchange(buffers or {}, src_cache, src_ids, dst_cache, dst_ids, description, cache, nb,
                                      problem, headers, checked, device, cuda_stream, seconds)
                inner = self.transport.exchange(call, background)
                stats = ReshardStats(
                    messages_sent=len(call.sends), messages_received=len(call.recvs),
                    bytes_sent=sum(m.nbytes for m in call.sends), bytes_received=sum(m.nbytes for m in call.recvs),
                    local_copies=len(self._locals) if buffers else 0, bytes_copied=call.local_bytes)
                self._last = ReshardHandle(inner, stats, problem, call.refused)
                if background:
                    return self._last
                # a margin over the exchange's own deadline, which ends it
                self._last.wait(seconds + 30)
                if cuda_stream is not None:
                    self._last.wait_stream(cuda_stream)
                return stats
            finally:
                if cuda_stream is not None:
                    # Also after an error: the next call must not touch staging a pack still writes.
                    if self._done is None:
                        self._done = torch.cuda.Event()
                    self._done.record(cuda_stream)

    def _piece_events(self, i: int, count: int) -> list[Any]:
        """CUDA events recorded after each piece of send i is packed: made once, recorded
        again by every call (a call starts once the previous one no longer needs them)."""
        import torch

        events = self._events.get(i)
        if events is None or len(events) < count:
            events = self._events[i] = [torch.cuda.Event() for _ in range(count)]
        return events

    def _finish_previous(self, seconds: float) -> Any:
        """Waits for the previous call if it goes on in the background: its messages read
        and write this Resharder's staging.  Its outcome was that call's to report.  Returns
        the CUDA event after its last GPU work (None: none, or waited for already)."""
        last = self._last
        if last is None or last._inner is None:
            return None
        if not last._inner._finished.wait(seconds):
            raise TimeoutError(f"rank {self.rank}: the previous call of this Resharder (wait=False) did not finish "
                               f"within {seconds} s (timeout=); wait for its handle before the next call")
        self._last = None
        # A peer lost in that call: the pair counts its calls from 0 again, as its next incarnation does.
        self._lost(getattr(last._inner.error, "peers", ()))
        return last._inner._gpu_done

    def _lost(self, peers: Sequence[int]) -> None:
        """Pairs whose peer was lost in a call start counting calls again (its next
        incarnation, or the same peer after it failed too, starts from 0)."""
        for peer in peers:
            i = self._peer_index.get(peer)
            if i is not None:
                self._pair_calls[i] = 0

    def _records(self, description: tuple[Any, Any], cache: Any, nb: int,
                 problem: _CallError | None) -> Callable[[int], bytes]:
        """What writes this call's header record for a peer of its messages: what this
        rank sends and expects, or the status of its own refused arguments."""
        desc = next((d for d in description if d is not None), None)
        if problem is not None or desc is None:
            status = _STATUS.get(problem.kind, 3) if problem is not None else 0
            common = (status, 0, 0, 0, 0, 0, 0, 0)
            unit = 0
        else:
            _, num_outer, tokens, head_dim, dtype, device = desc
            common = (0, _code(dtype, _DTYPE_CODE), cache.itemsize, nb, num_outer, tokens, head_dim,
                      _code(device, _DEVICE_CODE))
            unit = nb * num_outer * tokens * head_dim * cache.itemsize  # bytes of one (head, layer) cell of every block

        def record(peer: int) -> bytes:
            i = self._peer_index[peer]
            cells_out, cells_in = self._peer_cells[i]
            return HEADER.pack(HEADER_MAGIC, HEADER_VERSION, self._digest, self.rank, peer, self._pair_calls[i] + 1,
                               *common, cells_out * unit, cells_in * unit)

        return record

    def _compare(self, peer: int, record: bytes, reason: tuple[str, str] | None, checked: bool,
                 mine: bytes) -> tuple[type[Exception], str] | None:
        """Why the pair with `peer` cannot go ahead in this call (None: it can), from the two
        records; counts an agreeing pair's call."""
        i = self._peer_index[peer]
        theirs = HEADER.unpack(record) if len(record) == HEADER.size else (0,) * len(HEADER_FIELDS)
        own = HEADER.unpack(mine)
        low, high = (own, theirs) if self.rank < peer else (theirs, own)
        found = _compare_headers(low, high, min(self.rank, peer), max(self.rank, peer))
        if found is None:
            self._pair_calls[i] += 1
            return None
        if checked and reason is not None and theirs[_F["status"]]:
            # A checked call over a pairwise transport: the peer's refused arguments, as it raises them.
            found = (_CallError.KINDS.get(reason[0], RuntimeError), reason[1])
        if not low[_F["status"]] and not high[_F["status"]] and _first_difference(low, high) == "call":
            self._pair_calls[i] = 0
        return found

    def _exchange(self, buffers: dict[tuple[str, int], torch.Tensor], src_cache: Any, src_ids: Any, dst_cache: Any,
                  dst_ids: Any, description: tuple[Any, Any], cache: Any, nb: int, problem: _CallError | None,
                  headers: bool, checked: bool, device: str, stream: Any, seconds: float) -> _pieces.Exchange:
        """This call as its transport moves it: messages in pieces, headers and hooks."""
        dtype = _torch_dtype(cache, "") if buffers else None
        sends: list[_pieces.Message] = []
        recvs: list[_pieces.Message] = []
        send_views: list[Any] = []
        recv_views: list[Any] = []
        local_views: list[Any] = []
        for routes, messages, views in ((self._sends_routes, sends, send_views),
                                        (self._recvs_routes, recvs, recv_views),
                                        (self._locals_routes, None, local_views)):
            for route in routes:
                if not buffers:     # this rank refused its own arguments: its peers still get its header
                    if messages is not None:
                        messages.append(_pieces.Message(route.peer, None, (), route.slot))
                    continue
                t = route.transfer
                shape = (nb, len(t.heads), len(t.layers), cache.num_outer, cache.block_size, cache.head_dim)
                used, view, blocks, pieces, piece_views, chunks = route.views(buffers[route.slot], shape, dtype)
                if messages is not None:
                    messages.append(_pieces.Message(route.peer, used, pieces, route.slot, chunks))
                views.append((route, blocks, piece_views, view))

        def pack(i: int, p: int, on: Any) -> None:
            route, blocks, piece_views, _ = send_views[i]
            a, b = blocks[p]
            layers, heads = route.src
            src_cache.to_universal(src_ids[a:b], piece_views[p], layers=layers, heads=heads, pack_layers=True,
                                   stream=on)

        def unpack(j: int, p: int, on: Any) -> None:
            route, blocks, piece_views, _ = recv_views[j]
            a, b = blocks[p]
            layers, heads = route.dst
            dst_cache.from_universal(piece_views[p], dst_ids[a:b], layers=layers, heads=heads, pack_layers=True,
                                     stream=on)

        # The local copies are packed now, on the call's stream, as the messages are: work the
        # caller queues after the call may overwrite the source blocks.
        for route, _, _, view in local_views:
            layers, heads = route.src
            src_cache.to_universal(src_ids, view, layers=layers, heads=heads, pack_layers=True, stream=stream)

        def local(on: Any) -> None:
            for route, _, _, view in local_views:
                layers, heads = route.dst
                dst_cache.from_universal(view, dst_ids, layers=layers, heads=heads, pack_layers=True, stream=on)

        record = self._records(description, cache, nb, problem) if headers else None
        records = {peer: record(peer) for peer in self._peers} if record is not None else None

        def renew(peer: int) -> None:
            """The peer is a new incarnation (it restarted): the pair counts from 0 again."""
            self._pair_calls[self._peer_index[peer]] = 0
            if records is not None and record is not None:
                records[peer] = record(peer)

        def compare(peer: int, theirs: bytes, reason: tuple[str, str] | None) -> tuple[type[Exception], str] | None:
            assert records is not None, "a call without headers compares none"
            return self._compare(peer, theirs, reason, checked, records[peer])

        return _pieces.Exchange(
            owner=self, channel=self._digest, rank=self.rank, sends=tuple(sends), recvs=tuple(recvs),
            headers=records, reason=problem.info if problem is not None else None, pack=pack, unpack=unpack,
            compare=compare, local=local, renew=renew, events=self._piece_events,
            local_bytes=sum(view.numel() * view.element_size() for *_, view in local_views),
            device=device, stream=stream, timeout=seconds)

    # ---------------------------------------------------------------- checks

    def _describe(self, side: str, share: tuple[range, range] | None, cache: Any,
                  block_ids: Any) -> tuple[tuple | None, Any]:
        """(nb, num_outer, block_size, head_dim, dtype name, device kind) of one side's
        arguments on this rank after checking them against the rank's position, and the
        block ids as read, once (`_snapshot_ids`); (None, None) when the rank holds no
        position on that side.  Raises _CallError."""
        where = f"{side}_cache on rank {self.rank}"
        if share is None:
            if cache is not None or block_ids is not None:
                raise _CallError(ValueError, f"rank {self.rank} holds no {side} position: {side}_cache and "
                                             f"{side}_block_ids must be None")
            return None, None
        if not isinstance(cache, PagedKVCache):
            raise _CallError(TypeError, f"{where}: expected a kvbm_ext.PagedKVCache, got {type(cache).__name__}")
        heads, layers = share
        if cache.num_heads != len(heads) or cache.num_layers != len(layers):
            raise _CallError(ValueError, f"{where}: holds {cache.num_heads} heads x {cache.num_layers} layers, but "
                                         f"its position holds heads [{heads.start}, {heads.stop}) x layers "
                                         f"[{layers.start}, {layers.stop}) of the model ({len(heads)} x "
                                         f"{len(layers)})")
        _torch_dtype(cache, where)
        ids = _snapshot_ids(block_ids, f"{side}_block_ids", self.rank, cache, distinct=side == "dst")
        return (len(ids), cache.num_outer, cache.block_size, cache.head_dim, cache.dtype_name,
                cache.device_name.split(":")[0]), ids

    def _check_destination(self, cache: PagedKVCache, device: str) -> None:
        """What would refuse this rank's writes once the messages arrived, found now: a
        layer tensor that requires grad, and whatever from_universal refuses of the cache
        itself (read-only, layers sharing memory, a layer whose memory moved), asked with
        no block of each unpack this rank will make."""
        where = f"dst_cache on rank {self.rank}"
        arrays = cache.layers
        for i, layer in enumerate(arrays if isinstance(arrays, tuple) else (arrays,)):
            if getattr(layer, "requires_grad", False) is True:
                raise _CallError(ValueError, f"{where}: layers[{i}]: destination tensor requires grad, and autograd "
                                             "cannot see this write; build the cache from x.detach() (same memory) "
                                             "to write it anyway")
        for i, route in enumerate(self._recvs_routes + self._locals_routes):
            layers, heads = route.dst
            try:
                cache.from_universal(self._probe(i, "dst", route, cache, device, where), [], layers=layers,
                                     heads=heads, pack_layers=True)
            except (TypeError, ValueError) as error:
                raise _CallError(type(error), f"{where}: {error}") from error

    def _check_source(self, cache: PagedKVCache, device: str) -> None:
        """What would refuse this rank's packs, found now: whatever to_universal refuses of
        the cache (a layer whose memory moved, ...), asked with no block of each pack."""
        where = f"src_cache on rank {self.rank}"
        for i, route in enumerate(self._sends_routes + self._locals_routes):
            layers, heads = route.src
            try:
                cache.to_universal([], self._probe(i, "src", route, cache, device, where), layers=layers,
                                   heads=heads, pack_layers=True)
            except (TypeError, ValueError) as error:
                raise _CallError(type(error), f"{where}: {error}") from error

    def _probe(self, i: int, side: str, route: _Route, cache: PagedKVCache, device: str, where: str) -> Any:
        """A universal buffer of no block for a route's pack or unpack, of the cache's kind."""
        import torch

        t = route.transfer
        shape = (0, len(t.heads), len(t.layers), cache.num_outer, cache.block_size, cache.head_dim)
        key = (side, i, device, cache.dtype_name, shape)       # a later call may pass caches of another kind
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = torch.empty(shape, dtype=_torch_dtype(cache, where), device=device)
        return probe

    def _device(self, src_cache: Any, dst_cache: Any) -> str:
        devices = {cache.device_name for cache in (src_cache, dst_cache) if cache is not None}
        if len(devices) > 1:
            raise _CallError(ValueError, f"rank {self.rank}: src_cache is on {src_cache.device_name} and dst_cache on "
                                         f"{dst_cache.device_name}; a rank's caches must share one device")
        return devices.pop() if devices else "cpu"

    def _stream(self, stream: Any, device: str, has_caches: bool) -> Any:
        """The torch stream of a call on `device` (None on the host, or when this rank has nothing to move)."""
        import torch

        if not has_caches:
            return None
        if not device.startswith("cuda"):
            if stream is not None:
                raise _CallError(ValueError, f"stream: rank {self.rank}'s caches are in host memory; "
                                             "pass stream=None")
            return None
        if stream is None:
            return torch.cuda.current_stream(device)
        if isinstance(stream, torch.cuda.Stream):
            if stream.device != torch.device(device):
                raise _CallError(ValueError, f"stream: on {stream.device}, but rank {self.rank}'s caches are on "
                                             f"{device}")
            return stream
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=device)
        raise _CallError(TypeError, f"stream: expected None, a torch.cuda.Stream or an int cudaStream_t, got "
                                    f"{type(stream).__name__}")

    def _validate(self, gathered: list[Any]) -> None:
        """Raise, identically on every rank, if the ranks' descriptions do not fit together."""
        for rank, (fingerprint, _, _) in enumerate(gathered):
            if fingerprint != gathered[0][0]:
                raise ValueError(f"rank {rank} calls a Resharder planned for (num_heads, num_layers, src, dst) = "
                                 f"{fingerprint}, rank 0 one for {gathered[0][0]}: every rank must call the same "
                                 "transfer")
        fields = ("number of block ids", "num_outer", "block_size", "head_dim", "dtype", "device type")
        for i, field in enumerate(fields):
            holders: dict[Any, list[str]] = {}      # value -> the arguments that have it
            for rank, (_, _, description) in enumerate(gathered):
                for side, desc in zip(("src", "dst"), description):
                    if desc is not None:
                        what = f"{side}_block_ids" if i == 0 else f"{side}_cache"
                        holders.setdefault(desc[i], []).append(f"{what} on rank {rank}")
            if len(holders) > 1:
                values = ", ".join(f"{value} ({', '.join(names)})" for value, names in holders.items())
                raise ValueError(f"{field} differs across the ranks: {values}; every rank moves the same number of "
                                 "blocks, and the caches of both engines share num_outer, block_size, "
                                 "head_dim, dtype and device type")

    # ---------------------------------------------------------------- the move

    def _prepare(self, src_cache: Any, dst_cache: Any, nb: int, device: str) -> dict[tuple[str, int], torch.Tensor]:
        """The staging buffer of every message and local copy of a call moving nb blocks,
        by slot: whole buffers, kept across calls (a call uses their first bytes)."""
        buffers = {}
        for routes, cache in ((self._sends_routes, src_cache), (self._recvs_routes, dst_cache),
                              (self._locals_routes, src_cache)):
            for route in routes:
                buffers[route.slot] = self._buffer(route, cache, nb, device)
        return buffers

    def _buffer(self, route: _Route, cache: PagedKVCache, nb: int, device: str) -> torch.Tensor:
        """The staging buffer of `route` for nb blocks of the cache's kind: where the transport
        wants a message's staging (the caches' device, or pinned host memory), a local copy's
        on the caches' device.  Reallocated only to grow or to move."""
        import torch

        t = route.transfer
        nbytes = nb * len(t.heads) * len(t.layers) * cache.num_outer * cache.block_size * cache.head_dim * \
            cache.itemsize
        where = device
        placement = getattr(self.transport, "staging_device", None)
        if route.slot[0] != "local" and placement is not None:
            where = placement(device, route.peer)
        buffer = self._staging.get(route.slot)
        if buffer is None or buffer.numel() < nbytes or buffer.device != torch.device(where):
            if buffer is not None and buffer.is_cuda:
                # Freed now, reused by the allocator only after the work queued so far on this stream,
                # which waits for every earlier use of it.
                buffer.record_stream(torch.cuda.current_stream(buffer.device))
            pinned = where == "cpu" and device != "cpu"
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=where, pin_memory=pinned)
            self._staging[route.slot] = buffer
        return buffer

def _on_stream(device: str, stream: Any) -> Any:
    """A context running torch's CUDA work on `stream` of `device`; nothing on the host."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _torch_dtype(cache: PagedKVCache, where: str) -> torch.dtype:
    """The torch dtype of the cache's elements (staging buffers must have the same)."""
    import torch

    dtype = getattr(torch, cache.dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise _CallError(TypeError, f"{where}: element type {cache.dtype_name} has no torch equivalent for the staging "
                                    "buffers")
    return dtype


def _whole_or(selection: range, extent: int) -> range | None:
    """None (everything) when `selection` covers the whole extent, else the range."""
    return None if selection == range(extent) else selection


def _snapshot_ids(block_ids: Any, name: str, rank: int, cache: PagedKVCache, distinct: bool) -> Any:
    """The block ids as this call reads them, once: every later use (the range check, the
    packing, each unpack) takes what this returns, never the argument again.

    Host ids (a sequence, or a host tensor) become a list of ints that the call owns: the
    sequence is copied once (its length and items), each item's __index__ is called once,
    and each id is checked for range (and for repeats when the side is written).  Device
    ids become a plain tensor over the same memory (taken once; the GPU reads it in stream
    order, the host never does, and they are not range-checked here).  Raises _CallError."""
    import torch

    where = f"{name} on rank {rank}"
    if isinstance(block_ids, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            ids = block_ids.detach()     # one read of the argument; a plain torch.Tensor from here on
        if ids.dim() != 1:
            raise _CallError(ValueError, f"{where}: expected a 1-D tensor, got {ids.dim()}-D")
        if ids.dtype not in (torch.int32, torch.int64):
            raise _CallError(TypeError, f"{where}: expected int32 or int64 ids, got {ids.dtype}")
        if ids.device.type != "cpu":
            if str(ids.device) != cache.device_name:
                raise _CallError(ValueError, f"{where}: on {ids.device}, but the cache is on {cache.device_name}")
            return ids
        values = ids.tolist()
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
        values = list(block_ids)
    else:
        raise _CallError(TypeError, f"{where}: expected a sequence of ints or a 1-D int tensor, got "
                                    f"{type(block_ids).__name__}")
    num_blocks = cache.num_blocks
    # Plain ints in range (and distinct where written): checked by C loops; anything else
    # goes through the loop below, which names the first id that is wrong.
    if values and set(map(type, values)) == {int} and 0 <= min(values) and max(values) < num_blocks \
            and (not distinct or len(set(values)) == len(values)):
        return values
    seen: dict[int, int] = {}
    for i, value in enumerate(values):
        if type(value) is not int:
            try:
                value = values[i] = _as_int(value, f"{name}[{i}] on rank {rank}")
            except TypeError as error:
                raise _CallError(TypeError, str(error)) from error.__cause__
        if not 0 <= value < num_blocks:
            raise _CallError(ValueError, f"{name}[{i}] on rank {rank}: block id {value} is out of range "
                                         f"[0, {num_blocks})")
        if distinct:
            if value in seen:
                raise _CallError(ValueError, f"{name}[{i}] on rank {rank}: block id {value} repeats "
                                             f"{name}[{seen[value]}]; a block can be written once per call")
            seen[value] = i
    return values


def _same_caches(src: tuple, dst: tuple, rank: int) -> None:
    """A rank's two caches hold the same kind of block (with check=False its header describes one)."""
    for i, field in enumerate(("num_outer", "block_size", "head_dim", "dtype"), start=1):
        if src[i] != dst[i]:
            raise _CallError(ValueError, f"rank {rank}: src_cache has {field} {src[i]} and dst_cache {dst[i]}; the "
                                         "caches of both engines share num_outer, block_size, head_dim and dtype")


def reshard(src_cache: PagedKVCache | None, src_block_ids: Any, dst_cache: PagedKVCache | None, dst_block_ids: Any,
            *, num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout, group: Any = None,
            transport: Transport | None = None, stream: Any = None, check: bool = True,
            timeout: float = DEFAULT_TIMEOUT) -> ReshardStats:
    """One-shot `Resharder(num_heads, num_layers, src, dst, group=..., transport=...,
    timeout=...)(src_cache, src_block_ids, dst_cache, dst_block_ids, stream=...,
    check=..., timeout=...)`.

    It plans and allocates staging buffers on every call: to move blocks repeatedly,
    build a `Resharder` once and call it (it keeps its plan and its buffers)."""
    if transport is None:       # torch's path: communicators of its own would cost more than the call
        transport, group = TorchTransport(group, own_nccl=False), None
    resharder = Resharder(num_heads, num_layers, src, dst, group=group, transport=transport, timeout=timeout)
    return resharder(src_cache, src_block_ids, dst_cache, dst_block_ids, stream=stream, check=check, timeout=timeout)
