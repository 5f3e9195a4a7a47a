"""The plan of a reshard: how an engine splits the model (`EngineLayout`), and which heads
x layers every source rank owes every destination rank (`plan_reshard`).  Plain Python:
no torch, no communication.

Every argument is checked as the C functions check theirs: any integer with `__index__`
(NumPy and torch integer scalars) but not a bool, in range, and sizes bounded before
anything proportional to them is built (a layout's ranks, a plan's transfers), so that a
wrong argument is a TypeError or ValueError naming it, never an OverflowError, a
ZeroDivisionError, a MemoryError or a call that does not return.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence, SupportsIndex, cast

# Bounds on the arguments (far above any engine's): positions of one layout (tp_size x
# pp_size), KV heads, layers (as PagedKVCache's layer_offset), ranks of a process group,
# and the steps of planning, (src.pp_size + dst.pp_size) x the largest of num_heads and
# the two TP sizes.
MAX_POSITIONS = 1 << 16
MAX_HEADS = 1 << 16
MAX_LAYERS = (1 << 31) - 1
MAX_RANK = (1 << 31) - 1
MAX_PLAN_STEPS = 1 << 22


def _as_int(value: object, name: str) -> int:
    """An int argument: an int or any object with __index__, but not a bool.  An __index__
    that raises becomes the cause of the TypeError."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    try:
        return operator.index(cast(SupportsIndex, value))
    except MemoryError:
        raise
    except Exception as error:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}, whose __index__ failed "
                        f"({type(error).__name__}: {error})") from error


def _index(value: object, name: str, minimum: int, maximum: int) -> int:
    """_as_int, from `minimum` to `maximum`."""
    index = _as_int(value, name)
    if index < minimum:
        raise ValueError(f"{name}: must be at least {minimum}, got {index}")
    if index > maximum:
        raise ValueError(f"{name}: must be at most {maximum}, got {index}")
    return index


def _length(given: object, name: str, expected: str) -> int:
    """The length of a sequence argument (not a str), read without iterating it."""
    if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
        raise TypeError(f"{name}: expected {expected}, got {type(given).__name__}")
    try:
        return len(given)
    except MemoryError:
        raise
    except Exception as error:  # e.g. OverflowError: a range longer than sys.maxsize
        raise ValueError(f"{name}: its length cannot be read ({type(error).__name__}: {error})") from error


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How one engine splits the model: `tp_size` TP ranks x `pp_size` PP stages.

    `ranks`: the transport's rank (for `TorchTransport`, the rank in its process
    group) that holds each position, stage-major: position (pp_stage, tp_rank) is
    `ranks[pp_stage * tp_size + tp_rank]`.  Default: `range(tp_size * pp_size)`.

    `layer_ranges`: the model layers each PP stage holds, one `range` (step 1) or
    `(start, stop)` pair per stage, contiguous and in order from layer 0 to the
    last.  Default: an even split, stage s holding `[s*L//P, (s+1)*L//P)`.

    Heads: with T TP ranks and H KV heads, rank r holds heads `[r*H/T, (r+1)*H/T)`
    when T <= H (H divisible by T), and the single head `r // (T/H)` when T > H
    (T divisible by H: each head is replicated on T/H ranks, as for GQA models run
    at a TP size above their KV head count, or MLA's single latent head).

    Sizes and indices are ints (or any `__index__` integer, stored as int); a layout
    has at most 65,536 positions, ranks are from 0 to 2**31 - 1 and layers below 2**31.
    """

    tp_size: int
    pp_size: int = 1
    ranks: Sequence[int] | None = None
    layer_ranges: Sequence[range | tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        tp = _index(self.tp_size, "tp_size", 1, MAX_POSITIONS)
        pp = _index(self.pp_size, "pp_size", 1, MAX_POSITIONS)
        if tp * pp > MAX_POSITIONS:
            raise ValueError(f"tp_size {tp} x pp_size {pp}: a layout has at most {MAX_POSITIONS} positions")
        object.__setattr__(self, "tp_size", tp)
        object.__setattr__(self, "pp_size", pp)
        object.__setattr__(self, "ranks", self._checked_ranks(self.ranks, tp * pp))
        if self.layer_ranges is not None:
            object.__setattr__(self, "layer_ranges", self._checked_layer_ranges(self.layer_ranges, pp))

    @staticmethod
    def _checked_ranks(given: object, count: int) -> tuple[int, ...]:
        if given is None:
            return tuple(range(count))
        length = _length(given, "ranks", "a sequence of ints")
        if length != count:
            raise ValueError(f"ranks: expected {count} ranks (tp_size x pp_size), got {length}")
        ranks = tuple(_index(given[i], f"ranks[{i}]", 0, MAX_RANK) for i in range(count))  # type: ignore[index]
        first: dict[int, int] = {}
        for i, rank in enumerate(ranks):
            if first.setdefault(rank, i) != i:
                raise ValueError(f"ranks: rank {rank} holds two positions of the layout")
        return ranks

    @staticmethod
    def _checked_layer_ranges(given: object, pp: int) -> tuple[range, ...]:
        length = _length(given, "layer_ranges", "a sequence of ranges")
        if length != pp:
            raise ValueError(f"layer_ranges: expected one range per PP stage ({pp}), got {length}")
        ranges: list[range] = []
        for s in range(pp):
            item = given[s]  # type: ignore[index]
            name = f"layer_ranges[{s}]"
            if isinstance(item, tuple) and len(item) == 2:
                start = _index(item[0], f"{name}[0]", 0, MAX_LAYERS)
                stop = _index(item[1], f"{name}[1]", 0, MAX_LAYERS)
            elif isinstance(item, range) and item.step == 1:
                start = _index(item.start, f"{name}.start", 0, MAX_LAYERS)
                stop = _index(item.stop, f"{name}.stop", 0, MAX_LAYERS)
            elif isinstance(item, range):
                raise ValueError(f"{name}: expected a non-empty range of step 1, got {item!r}")
            else:
                raise TypeError(f"{name}: expected a range or a (start, stop) pair, got {item!r}")
            if stop <= start:
                raise ValueError(f"{name}: expected a non-empty range of step 1, got range({start}, {stop})")
            expected_start = ranges[-1].stop if ranges else 0
            if start != expected_start:
                raise ValueError(f"{name}: starts at layer {start}, expected {expected_start} "
                                 "(stages hold contiguous layer ranges, in order, from layer 0)")
            ranges.append(range(start, stop))
        return tuple(ranges)

    @property
    def size(self) -> int:
        """Number of positions (ranks): tp_size * pp_size."""
        return self.tp_size * self.pp_size

    def rank_of(self, pp_stage: int, tp_rank: int) -> int:
        """The rank that holds position (pp_stage, tp_rank)."""
        pp_stage = _index(pp_stage, "pp_stage", 0, self.pp_size - 1)
        return self._rank(pp_stage, _index(tp_rank, "tp_rank", 0, self.tp_size - 1))

    def position_of(self, rank: int) -> tuple[int, int] | None:
        """(pp_stage, tp_rank) held by `rank`, or None when the rank is not in the layout."""
        rank = _as_int(rank, "rank")
        assert self.ranks is not None  # set by __post_init__
        if rank not in self.ranks:
            return None
        return divmod(self.ranks.index(rank), self.tp_size)

    def heads_of(self, tp_rank: int, num_heads: int) -> range:
        """The model's KV heads that TP rank `tp_rank` holds (see the class docstring)."""
        num_heads = self._checked_heads(num_heads)
        return self._heads(_index(tp_rank, "tp_rank", 0, self.tp_size - 1), num_heads)

    def tp_ranks_holding(self, head: int, num_heads: int) -> range:
        """The TP ranks that hold `head`: one when tp_size <= num_heads, tp_size / num_heads replicas otherwise."""
        num_heads = self._checked_heads(num_heads)
        return self._holders(_index(head, "head", 0, num_heads - 1), num_heads)

    def layers_of(self, pp_stage: int, num_layers: int) -> range:
        """The model layers that PP stage `pp_stage` holds."""
        num_layers = self._checked_layers(num_layers)
        return self._layers(_index(pp_stage, "pp_stage", 0, self.pp_size - 1), num_layers)

    # Checked once, then used unchecked by the planner's loops.

    def _checked_heads(self, num_heads: object) -> int:
        heads = _index(num_heads, "num_heads", 1, MAX_HEADS)
        tp = self.tp_size
        if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
            raise ValueError(f"tp_size {tp} and {heads} KV heads: one must divide the other "
                             "(each rank holds an equal share of the heads, or one replicated head)")
        return heads

    def _checked_layers(self, num_layers: object) -> int:
        layers = _index(num_layers, "num_layers", 1, MAX_LAYERS)
        if self.layer_ranges is None:
            if layers < self.pp_size:
                raise ValueError(f"num_layers {layers} is smaller than pp_size {self.pp_size}: a stage would hold "
                                 "no layer")
            return layers
        last = self.layer_ranges[-1]
        assert isinstance(last, range)  # normalized by __post_init__
        if last.stop != layers:
            raise ValueError(f"layer_ranges: end at layer {last.stop}, but the model has {layers} layers")
        return layers

    def _rank(self, pp_stage: int, tp_rank: int) -> int:
        assert self.ranks is not None
        return self.ranks[pp_stage * self.tp_size + tp_rank]

    def _heads(self, tp_rank: int, num_heads: int) -> range:
        tp = self.tp_size
        if tp <= num_heads:
            per_rank = num_heads // tp
            return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        head = tp_rank // (tp // num_heads)
        return range(head, head + 1)

    def _holders(self, head: int, num_heads: int) -> range:
        tp = self.tp_size
        if tp <= num_heads:
            rank = head // (num_heads // tp)
            return range(rank, rank + 1)
        replicas = tp // num_heads
        return range(head * replicas, (head + 1) * replicas)

    def _layers(self, pp_stage: int, num_layers: int) -> range:
        if self.layer_ranges is None:
            pp = self.pp_size
            return range(pp_stage * num_layers // pp, (pp_stage + 1) * num_layers // pp)
        stage = self.layer_ranges[pp_stage]
        assert isinstance(stage, range)  # normalized by __post_init__
        return stage


@dataclasses.dataclass(frozen=True)
class ReshardTransfer:
    """One (source rank, destination rank) pair of a plan: the model's `heads` x `layers`
    that `src_rank` sends (or, when the ranks are equal, copies) to `dst_rank` for every
    block.  `src_heads` / `src_layers` and `dst_heads` / `dst_layers` are the same heads
    and layers as indices into the source's and the destination's own caches."""

    src_rank: int
    dst_rank: int
    heads: range
    layers: range
    src_heads: range
    src_layers: range
    dst_heads: range
    dst_layers: range

    @property
    def is_local(self) -> bool:
        """True when one rank holds both ends: a local copy, no message."""
        return self.src_rank == self.dst_rank


def plan_reshard(num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout) -> tuple[ReshardTransfer, ...]:
    """Every (source rank, destination rank) pair that shares data, and what it moves.

    Each destination position receives each of its (head, layer) cells exactly once.
    Where a head is replicated on several source TP ranks, the source chosen is the
    replica on the destination's own rank if there is one (a local copy, no message),
    else the replicas are taken in turn by the destinations that need the head, so
    the senders share the load.  The result depends only on the arguments, so every
    rank computes the same plan.  Planning takes (src.pp_size + dst.pp_size) x the
    largest of num_heads and the TP sizes steps, at most 2**22 (ValueError beyond).
    """
    num_heads = _index(num_heads, "num_heads", 1, MAX_HEADS)
    num_layers = _index(num_layers, "num_layers", 1, MAX_LAYERS)
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, EngineLayout):
            raise TypeError(f"{name}: expected a kvbm_ext.EngineLayout, got {type(layout).__name__}")
        try:
            layout._checked_heads(num_heads)
            layout._checked_layers(num_layers)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    steps = (src.pp_size + dst.pp_size) * max(num_heads, src.tp_size, dst.tp_size)
    if steps > MAX_PLAN_STEPS:
        raise ValueError(f"num_heads {num_heads} between a {src.tp_size} x {src.pp_size} and a {dst.tp_size} x "
                         f"{dst.pp_size} layout: planning would take {steps} steps, more than {MAX_PLAN_STEPS}")
    src_stages = [src._layers(s, num_layers) for s in range(src.pp_size)]
    transfers: list[ReshardTransfer] = []
    turns: dict[tuple[int, int], int] = {}      # (source stage, head) -> destinations served so far
    first = 0                                   # the first source stage a destination stage may share
    for d_stage in range(dst.pp_size):
        d_layers = dst._layers(d_stage, num_layers)
        while src_stages[first].stop <= d_layers.start:
            first += 1
        sharing = first
        while sharing < src.pp_size and src_stages[sharing].start < d_layers.stop:
            sharing += 1
        for d_tp in range(dst.tp_size):
            for s_stage in range(first, sharing):
                transfers += _transfers_to(num_heads, src, dst, s_stage, src_stages[s_stage], d_stage, d_tp,
                                           d_layers, turns)
    return tuple(transfers)


def _transfers_to(num_heads: int, src: EngineLayout, dst: EngineLayout, s_stage: int, s_layers: range, d_stage: int,
                  d_tp: int, d_layers: range, turns: dict[tuple[int, int], int]) -> list[ReshardTransfer]:
    """What source stage `s_stage` sends destination position (d_stage, d_tp), by source TP rank."""
    d_rank = dst._rank(d_stage, d_tp)
    d_heads = dst._heads(d_tp, num_heads)
    layers = range(max(d_layers.start, s_layers.start), min(d_layers.stop, s_layers.stop))
    chosen: dict[int, list[int]] = {}   # source TP rank -> heads it sends, ascending
    for head in d_heads:
        holders = src._holders(head, num_heads)
        local = [t for t in holders if src._rank(s_stage, t) == d_rank]
        turn = turns.get((s_stage, head), 0)
        turns[(s_stage, head)] = turn + 1
        s_tp = local[0] if local else holders[turn % len(holders)]
        chosen.setdefault(s_tp, []).append(head)
    transfers = []
    for s_tp, heads_list in sorted(chosen.items()):
        # Contiguous: without replication a source rank's share of d_heads is the
        # intersection of two ranges; with it, a source rank holds a single head.
        heads = range(heads_list[0], heads_list[-1] + 1)
        s_owned = src._heads(s_tp, num_heads)
        transfers.append(ReshardTransfer(
            src_rank=src._rank(s_stage, s_tp), dst_rank=d_rank, heads=heads, layers=layers,
            src_heads=_shift(heads, s_owned.start), src_layers=_shift(layers, s_layers.start),
            dst_heads=_shift(heads, d_heads.start), dst_layers=_shift(layers, d_layers.start)))
    return transfers


def _shift(r: range, origin: int) -> range:
    return range(r.start - origin, r.stop - origin)


def layout_key(layout: EngineLayout, num_layers: int) -> tuple:
    """What every rank must agree on about a layout: its sizes, ranks and stages' layers."""
    return (layout.tp_size, layout.pp_size, tuple(layout.ranks or ()),
            tuple((r.start, r.stop) for r in (layout._layers(s, num_layers) for s in range(layout.pp_size))))
