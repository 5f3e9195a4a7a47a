"""One Resharder call as its transport sees it: messages cut into pieces, and the hooks
that pack, unpack and compare headers (`Exchange`).

A message's staging buffer is `[nb, heads, layers, no, nt, hd]`, so a range of blocks is a
contiguous range of its bytes.  `cut` splits a call's nb blocks into a few such ranges,
from nb and the message's bytes per block alone, so that both ranks of a message cut it
alike without telling each other.  A transport moves piece p as soon as it is packed and
has the receiver unpack it while the next one crosses: only the first pack and the last
unpack are not hidden behind the wire, which is why the first and last pieces are small.

A transport never calls PagedKVCache itself: it calls `Exchange.pack` and
`Exchange.unpack`, and hands every peer's header to `Exchange.compare`.  Nothing is
unpacked before `Exchange.allow_writes` says every pair agreed.

torch is not imported here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Hashable

if TYPE_CHECKING:
    import torch

# A message of at most this many bytes travels whole: each piece costs the host a pack, a
# post and an event (over NIXL a notification too), and while a call's host work outlasts
# its GPU work, overlapping the GPU work wins nothing back (benchmarks/README.md, "Pieces").
SINGLE_PIECE_BYTES = 256 << 20
# The middle pieces' size: the receiver unpacks one while the next crosses, so a middle
# piece must unpack faster than the last piece crosses (unpacking runs at device-memory
# speed, crossing at link speed); and at most MAX_MIDDLE of them, which bounds the posts
# and notifications of a call whatever its size.
PIECE_BYTES = 32 << 20
MAX_MIDDLE = 2
# The first and the last piece hold 1/EDGE_DIVISOR of the blocks (at least one): the wire
# waits for the first pack, the call for the last unpack.
EDGE_DIVISOR = 16


def cut(nb: int, block_bytes: int) -> tuple[tuple[int, int], ...]:
    """The pieces of a message of `nb` blocks of `block_bytes` bytes each, as block ranges
    (start, stop): in order, covering [0, nb), none empty.  The same on every rank."""
    if nb <= 0:
        return ()
    if nb == 1 or nb * block_bytes <= SINGLE_PIECE_BYTES:
        return ((0, nb),)
    edge = -(-nb // EDGE_DIVISOR)
    if nb <= 2 * edge:
        return ((0, edge), (edge, nb))
    middle = nb - 2 * edge
    count = min(MAX_MIDDLE, middle, max(1, -(-middle * block_bytes // PIECE_BYTES)))
    bounds = [edge + middle * k // count for k in range(count + 1)]
    return ((0, edge), *zip(bounds, bounds[1:]), (nb - edge, nb))


@dataclasses.dataclass(eq=False)
class Message:
    """One message of a call, to or from `peer`: `buffer` is this rank's staging of it (a
    contiguous 1-D uint8 tensor), `pieces` its byte ranges (start, stop), in order and the
    same on both ranks, and `slot` names the staging buffer across the calls of its
    Resharder (a transport that registers memory registers a slot's buffer once).  A rank
    that refused its own arguments moves nothing: its messages have no buffer and no
    piece, and say only with whom it exchanges headers, and which way."""

    peer: int
    buffer: torch.Tensor | None
    pieces: tuple[tuple[int, int], ...]
    slot: Hashable
    chunks: tuple[torch.Tensor, ...] = ()      # buffer[start:stop] of each piece

    @property
    def nbytes(self) -> int:
        return self.pieces[-1][1] if self.pieces else 0


class Exchange:
    """What a transport moves in one Resharder call, and the hooks it calls.

    - `sends`, `recvs`: this rank's `Message`s, at most one per peer and direction.
    - `headers`: this rank's header record (bytes of `kvbm_ext._reshard.HEADER`) for each
      peer of a message, by peer; None when the call exchanges none (a checked call over
      a collective transport, whose exchange of descriptions compared everything).  The
      transport delivers each peer's record to `compare` before it moves any payload
      between the two.  `reason`: this rank's own refused arguments, (kind, message), which
      a pairwise transport carries beside its record so that peers raise the reason itself.
    - `pack(i, p, stream)`: packs piece p of send i (enqueued on `stream` for device
      caches; done when it returns on the host).  `unpack(j, p, stream)`: unpacks piece p of
      recv j, only after `allow_writes()` returned True.
    - `allow_writes()`: once every peer's record was compared: True when all agreed (the
      call's local copies, packed when the call was made, are unpacked then, on `stream`),
      False when a pair was refused (`refused`, by peer: nothing may be written).
      `local_bytes`: the bytes they copy.
    - `owner`: the Resharder, whose lifetime bounds its slots' buffers; `channel`: the
      plan's digest, which separates the messages of Resharders sharing a transport;
      `renew(peer)`: the peer is a new incarnation (it restarted, and counts its calls from
      0): this rank does too, and `headers[peer]` is rewritten, before the pair compares;
      `events(i, count)`: CUDA events for the pieces of send i, kept by the Resharder
      across calls; `device` ("cpu" or "cuda:N"), `stream` (the call's torch stream on a
      GPU, else None), `timeout` (seconds).
    """

    def __init__(self, *, owner: Any, channel: int, rank: int, sends: tuple[Message, ...],
                 recvs: tuple[Message, ...], headers: dict[int, bytes] | None, reason: tuple[str, str] | None,
                 pack: Callable[[int, int, Any], None], unpack: Callable[[int, int, Any], None],
                 compare: Callable[[int, bytes, tuple[str, str] | None], tuple[type[Exception], str] | None],
                 local: Callable[[Any], None], renew: Callable[[int], None],
                 events: Callable[[int, int], list[Any]], local_bytes: int, device: str, stream: Any,
                 timeout: float) -> None:
        self.owner, self.channel, self.rank = owner, channel, rank
        self.sends, self.recvs = sends, recvs
        self.headers, self.reason = headers, reason
        self._pack, self._unpack, self._compare, self._local = pack, unpack, compare, local
        self.local_bytes = local_bytes
        self.renew = renew
        self.events = events
        self.device, self.stream, self.timeout = device, stream, timeout
        self.refused: dict[int, tuple[type[Exception], str]] = {}
        self._compared: set[int] = set()
        self._writes: bool | None = None

    def pack(self, i: int, p: int, stream: Any) -> None:
        self._pack(i, p, stream)

    def compare(self, peer: int, record: bytes, reason: tuple[str, str] | None = None) -> bool:
        """Compare `peer`'s header record with this rank's (once per peer; later calls
        return the first answer): True when the pair may move its payloads."""
        if peer not in self._compared:
            self._compared.add(peer)
            found = self._compare(peer, record, reason)
            if found is not None:
                self.refused[peer] = found
        return peer not in self.refused

    def compared(self, peer: int) -> bool:
        """Whether `peer`'s record was compared (or the peer was lost)."""
        return peer in self._compared

    def lost(self, peer: int) -> None:
        """`peer` failed before its record came: nothing of it will be unpacked, and the
        other pairs are no longer held up by its verdict."""
        self._compared.add(peer)

    def settled(self) -> bool:
        """Whether every peer's record was compared (always, without headers)."""
        return self.headers is None or len(self._compared) == len(self.headers)

    def allow_writes(self, stream: Any) -> bool:
        """True once every pair agreed: the local copies are unpacked (on `stream`) at the
        first call.  False when a pair was refused.  Only after every record came."""
        assert self.settled(), "allow_writes before every header was compared"
        if self._writes is None:
            self._writes = not self.refused
            if self._writes:
                self._local(stream)
        return self._writes

    def unpack(self, j: int, p: int, stream: Any) -> None:
        assert self._writes, "unpack before allow_writes() returned True"
        self._unpack(j, p, stream)
