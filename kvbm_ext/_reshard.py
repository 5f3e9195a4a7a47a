"""Moving KV blocks between engines of different tensor / pipeline parallel sizes.

A prefill engine and a decode engine (or any two engines) split the same model's
KV cache differently: TP rank r of T holds a slice of the KV heads, PP stage s of
P a range of the layers.  `Resharder` plans, once, which part of its heads x layers
every source rank owes every destination rank; each call then moves a batch of
blocks with one contiguous message per (source rank, destination rank) pair that
shares data: the sender packs the receiver's heads and layers of every block into
one `[nb, nh_sel, nl_sel, no, nt, hd]` buffer with one `PagedKVCache.to_universal`
call, the transport carries it, and the receiver scatters it with one
`from_universal` call.  A rank that holds both a source and a destination position
copies its own share locally, without a message.

torch is imported when a Resharder is built, not when kvbm_ext is imported.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from . import PagedKVCache

if TYPE_CHECKING:
    import torch


def _count(value: object, name: str, minimum: int = 1) -> int:
    """An int argument (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be at least {minimum}, got {value}")
    return value


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
    """

    tp_size: int
    pp_size: int = 1
    ranks: Sequence[int] | None = None
    layer_ranges: Sequence[range | tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        tp = _count(self.tp_size, "tp_size")
        pp = _count(self.pp_size, "pp_size")
        ranks = range(tp * pp) if self.ranks is None else self.ranks
        if not isinstance(ranks, Sequence) or isinstance(ranks, (str, bytes)):
            raise TypeError(f"ranks: expected a sequence of ints, got {type(ranks).__name__}")
        ranks = tuple(_count(r, f"ranks[{i}]", 0) for i, r in enumerate(ranks))
        if len(ranks) != tp * pp:
            raise ValueError(f"ranks: expected {tp * pp} ranks (tp_size {tp} x pp_size {pp}), got {len(ranks)}")
        if len(set(ranks)) != len(ranks):
            first = next(r for i, r in enumerate(ranks) if r in ranks[:i])
            raise ValueError(f"ranks: rank {first} holds two positions of the layout")
        object.__setattr__(self, "ranks", ranks)
        if self.layer_ranges is not None:
            object.__setattr__(self, "layer_ranges", self._checked_layer_ranges(self.layer_ranges, pp))

    @staticmethod
    def _checked_layer_ranges(given: object, pp: int) -> tuple[range, ...]:
        if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
            raise TypeError(f"layer_ranges: expected a sequence of ranges, got {type(given).__name__}")
        if len(given) != pp:
            raise ValueError(f"layer_ranges: expected one range per PP stage ({pp}), got {len(given)}")
        ranges: list[range] = []
        for s, item in enumerate(given):
            if isinstance(item, tuple) and len(item) == 2:
                item = range(_count(item[0], f"layer_ranges[{s}][0]", 0), _count(item[1], f"layer_ranges[{s}][1]", 0))
            if not isinstance(item, range):
                raise TypeError(f"layer_ranges[{s}]: expected a range or a (start, stop) pair, got {item!r}")
            if item.step != 1 or len(item) == 0:
                raise ValueError(f"layer_ranges[{s}]: expected a non-empty range of step 1, got {item!r}")
            expected_start = ranges[-1].stop if ranges else 0
            if item.start != expected_start:
                raise ValueError(f"layer_ranges[{s}]: starts at layer {item.start}, expected {expected_start} "
                                 "(stages hold contiguous layer ranges, in order, from layer 0)")
            ranges.append(item)
        return tuple(ranges)

    @property
    def size(self) -> int:
        """Number of positions (ranks): tp_size * pp_size."""
        return self.tp_size * self.pp_size

    def rank_of(self, pp_stage: int, tp_rank: int) -> int:
        """The rank that holds position (pp_stage, tp_rank)."""
        assert self.ranks is not None  # set by __post_init__
        return self.ranks[pp_stage * self.tp_size + tp_rank]

    def position_of(self, rank: int) -> tuple[int, int] | None:
        """(pp_stage, tp_rank) held by `rank`, or None when the rank is not in the layout."""
        assert self.ranks is not None
        if rank not in self.ranks:
            return None
        return divmod(self.ranks.index(rank), self.tp_size)

    def heads_of(self, tp_rank: int, num_heads: int) -> range:
        """The model's KV heads that TP rank `tp_rank` holds (see the class docstring)."""
        tp = self.tp_size
        self._check_heads(num_heads)
        if tp <= num_heads:
            per_rank = num_heads // tp
            return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        head = tp_rank // (tp // num_heads)
        return range(head, head + 1)

    def tp_ranks_holding(self, head: int, num_heads: int) -> range:
        """The TP ranks that hold `head`: one when tp_size <= num_heads, tp_size / num_heads replicas otherwise."""
        tp = self.tp_size
        self._check_heads(num_heads)
        if tp <= num_heads:
            rank = head // (num_heads // tp)
            return range(rank, rank + 1)
        replicas = tp // num_heads
        return range(head * replicas, (head + 1) * replicas)

    def layers_of(self, pp_stage: int, num_layers: int) -> range:
        """The model layers that PP stage `pp_stage` holds."""
        pp = self.pp_size
        if self.layer_ranges is None:
            if num_layers < pp:
                raise ValueError(f"num_layers {num_layers} is smaller than pp_size {pp}: a stage would hold no layer")
            return range(pp_stage * num_layers // pp, (pp_stage + 1) * num_layers // pp)
        last = self.layer_ranges[-1]
        assert isinstance(last, range)  # normalized by __post_init__
        if last.stop != num_layers:
            raise ValueError(f"layer_ranges: end at layer {last.stop}, but the model has {num_layers} layers")
        stage = self.layer_ranges[pp_stage]
        assert isinstance(stage, range)
        return stage

    def _check_heads(self, num_heads: int) -> None:
        tp = self.tp_size
        if (tp <= num_heads and num_heads % tp) or (tp > num_heads and tp % num_heads):
            raise ValueError(f"tp_size {tp} and {num_heads} KV heads: one must divide the other "
                             "(each rank holds an equal share of the heads, or one replicated head)")


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


def plan_reshard(num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout) -> tuple[ReshardTransfer, ...]:
    """Every (source rank, destination rank) pair that shares data, and what it moves.

    Each destination position receives each of its (head, layer) cells exactly once.
    Where a head is replicated on several source TP ranks, the source chosen is the
    replica on the destination's own rank if there is one (a local copy, no message),
    else the replicas are taken in turn by the destinations that need the head, so
    the senders share the load.  The result depends only on the arguments, so every
    rank computes the same plan.
    """
    _count(num_heads, "num_heads")
    _count(num_layers, "num_layers")
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, EngineLayout):
            raise TypeError(f"{name}: expected a kvbm_ext.EngineLayout, got {type(layout).__name__}")
        try:
            layout.heads_of(0, num_heads)
            layout.layers_of(0, num_layers)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None

    transfers = []
    turns: dict[tuple[int, int], int] = {}      # (source stage, head) -> destinations served so far
    for d_stage in range(dst.pp_size):
        d_layers = dst.layers_of(d_stage, num_layers)
        for d_tp in range(dst.tp_size):
            d_rank = dst.rank_of(d_stage, d_tp)
            d_heads = dst.heads_of(d_tp, num_heads)
            for s_stage in range(src.pp_size):
                s_layers = src.layers_of(s_stage, num_layers)
                layers = range(max(d_layers.start, s_layers.start), min(d_layers.stop, s_layers.stop))
                if not layers:
                    continue
                chosen: dict[int, list[int]] = {}   # source TP rank -> heads it sends, ascending
                for head in d_heads:
                    holders = src.tp_ranks_holding(head, num_heads)
                    local = [t for t in holders if src.rank_of(s_stage, t) == d_rank]
                    turn = turns.get((s_stage, head), 0)
                    turns[(s_stage, head)] = turn + 1
                    s_tp = local[0] if local else holders[turn % len(holders)]
                    chosen.setdefault(s_tp, []).append(head)
                for s_tp, heads_list in sorted(chosen.items()):
                    # Contiguous: without replication a source rank's share of d_heads is the
                    # intersection of two ranges; with it, a source rank holds a single head.
                    heads = range(heads_list[0], heads_list[-1] + 1)
                    s_owned = src.heads_of(s_tp, num_heads)
                    transfers.append(ReshardTransfer(
                        src_rank=src.rank_of(s_stage, s_tp), dst_rank=d_rank, heads=heads, layers=layers,
                        src_heads=_shift(heads, s_owned.start), src_layers=_shift(layers, s_layers.start),
                        dst_heads=_shift(heads, d_heads.start), dst_layers=_shift(layers, d_layers.start)))
    return tuple(transfers)


def _shift(r: range, origin: int) -> range:
    return range(r.start - origin, r.stop - origin)


class Transport(Protocol):
    """What a `Resharder` needs from the engine that carries its messages.

    `TorchTransport` implements it over a torch.distributed process group (NCCL for
    GPU caches, gloo for host caches).  Another engine (NIXL, UCX, ...) plugs in by
    implementing these four members; `Resharder(..., transport=...)` takes it.

    - `rank`, `world_size`: this process's rank and the number of ranks, in the
      numbering the `EngineLayout`s use.
    - `all_gather_object(obj)`: a small picklable object from every rank, as a list
      indexed by rank (collective over every rank).  Used once per checked call to
      validate the call on every rank before anything moves.
    - `start(sends, recvs)`: post every message of one call at once: `sends` and
      `recvs` are `(peer rank, tensor)` pairs, each tensor contiguous, at most one
      per peer and direction; the sizes of a matching send and receive are equal.
      Returns a callable that completes them: for device tensors, it makes the
      caller's current stream wait for the messages (no host synchronization);
      for host tensors, it returns once they are done.  Work enqueued on the
      current stream before `start` (the packing) must be finished before a send
      reads its tensor.
    """

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def start(self, sends: Sequence[tuple[int, torch.Tensor]],
              recvs: Sequence[tuple[int, torch.Tensor]]) -> Callable[[], None]: ...


class TorchTransport:
    """`Transport` over a torch.distributed process group (None: the default group),
    through `torch.distributed.batch_isend_irecv`.  Ranks are ranks of `group`.

    GPU caches need a group with an NCCL backend; host caches one with gloo.  With
    `init_process_group(backend="cpu:gloo,cuda:nccl")` one group does both, and the
    call's check exchanges its description over gloo without touching the GPU; with
    an NCCL-only group that exchange goes through the GPU and waits for it.  With
    NCCL, as for any `batch_isend_irecv`, the first NCCL operation on the group must
    involve all its ranks (e.g. a warm-up `all_reduce`).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "first (or pass transport=)")
        self.group = group
        self._global_ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        self._rank = dist.get_rank(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def start(self, sends: Sequence[tuple[int, torch.Tensor]],
              recvs: Sequence[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, tensor, self._global_ranks[peer], self.group) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._global_ranks[peer], self.group) for peer, tensor in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> None:
            for work in works:
                work.wait()

        return wait


class _CallError(Exception):
    """A problem with one rank's arguments, raised on every rank after the exchange."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Resharder:
    """Moves batches of KV blocks from one engine's layout to another's.

    `Resharder(num_heads, num_layers, src, dst, group=None)`: the model's KV heads
    and layers, the source and destination `EngineLayout`s, and the process group
    (or `transport=`, any `Transport`) whose ranks the layouts name.  Building it
    plans the transfer (`plan`: the whole plan, the same on every rank) and does
    not communicate.

    Each call `resharder(src_cache, src_block_ids, dst_cache, dst_block_ids)` moves
    block `src_block_ids[i]` of the source engine to block `dst_block_ids[i]` of the
    destination engine, for every i.  Every rank of the group calls it (a
    collective): a rank holding a source position passes its `PagedKVCache` and the
    batch's block ids on that side, a rank holding a destination position likewise,
    a rank holding both passes both, and the other arguments are None.  Every
    source rank passes the same number of ids as every destination rank.  (With
    `check=False` the call communicates only between the ranks that share data, and
    a rank of the group that holds no position need not call.)

    Staging: each call packs this rank's outgoing share into buffers of the caches'
    device (one per message or local copy, `[nb, heads, layers, no, nt, hd]`), and
    receives into one per incoming message.  They are allocated by the first call,
    grown when a call moves more blocks, and otherwise reused (`staging_nbytes`).
    """

    def __init__(self, num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout, *,
                 group: Any = None, transport: Transport | None = None) -> None:
        self.plan = plan_reshard(num_heads, num_layers, src, dst)
        if transport is None:
            transport = TorchTransport(group)
        elif group is not None:
            raise ValueError("pass group= or transport=, not both")
        for name, layout in (("src", src), ("dst", dst)):
            assert layout.ranks is not None
            if max(layout.ranks) >= transport.world_size:
                raise ValueError(f"{name}: rank {max(layout.ranks)} is not in the group "
                                 f"(world size {transport.world_size})")
        self.num_heads, self.num_layers, self.src, self.dst = num_heads, num_layers, src, dst
        self.transport = transport
        self.rank = transport.rank
        self.num_messages = sum(not t.is_local for t in self.plan)
        self._sends = [t for t in self.plan if t.src_rank == self.rank and not t.is_local]
        self._recvs = [t for t in self.plan if t.dst_rank == self.rank and not t.is_local]
        self._locals = [t for t in self.plan if t.src_rank == self.rank and t.is_local]
        src_pos, dst_pos = src.position_of(self.rank), dst.position_of(self.rank)
        # What this rank's caches must hold: (heads, layers) of its positions, None when it has none.
        self._src_share = None if src_pos is None else (src.heads_of(src_pos[1], num_heads),
                                                        src.layers_of(src_pos[0], num_layers))
        self._dst_share = None if dst_pos is None else (dst.heads_of(dst_pos[1], num_heads),
                                                        dst.layers_of(dst_pos[0], num_layers))
        # Compared across ranks by every checked call: the same model and layouts everywhere.
        self._fingerprint = (num_heads, num_layers, _layout_key(src, num_layers), _layout_key(dst, num_layers))
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        # Caches over a layer range of the caches last passed, for messages that start past their layer 0.
        self._views: dict[tuple[str, ReshardTransfer], tuple[PagedKVCache, PagedKVCache]] = {}
        self._done: Any = None          # CUDA event after the previous call's last use of the staging

    def __repr__(self) -> str:
        return (f"Resharder(num_heads={self.num_heads}, num_layers={self.num_layers}, src={self.src!r}, "
                f"dst={self.dst!r}, rank={self.rank}, transfers={len(self.plan)}, messages={self.num_messages})")

    @property
    def staging_nbytes(self) -> int:
        """Bytes of staging buffers this rank holds (kept and reused across calls)."""
        return sum(buffer.numel() for buffer in self._staging.values())

    def __call__(self, src_cache: PagedKVCache | None, src_block_ids: Any, dst_cache: PagedKVCache | None,
                 dst_block_ids: Any, *, stream: Any = None, check: bool = True) -> ReshardStats:
        """Move the blocks; returns what this rank sent, received and copied.

        `block_ids`: a sequence of ints or a 1-D int32/int64 tensor, on the host or
        on the cache's device (device ids are not read on the host: no
        synchronization, and they are not range-checked here).

        `stream` (GPU caches): a torch.cuda.Stream or an int cudaStream_t; None is
        torch's current stream.  The call enqueues everything on it and returns
        without waiting: packing runs on it, the messages wait for the packing and
        the stream waits for the messages (NCCL), unpacking runs on it.  Work
        queued on the stream afterwards sees the moved blocks.  Host caches: the
        call returns when the blocks are in place.

        `check` (collective: the same on every rank): exchange a description of
        every rank's arguments first, and raise the same error on every rank,
        before any message or write, when they do not fit together (model
        dimensions, element types, block counts, a rank's caches against its
        position, block ids out of range or repeated on the destination).  With
        `check=False` a rank only checks its own arguments, without
        communicating, and mismatches across ranks are not detected.
        """
        import torch

        if not isinstance(check, bool):
            raise TypeError(f"check: expected a bool, got {type(check).__name__}")
        description: tuple[Any, Any] = (None, None)
        device, cuda_stream = "cpu", None
        problem = None
        try:
            description = (self._describe("src", self._src_share, src_cache, src_block_ids),
                           self._describe("dst", self._dst_share, dst_cache, dst_block_ids))
            if description[0] and description[1] and description[0][0] != description[1][0]:
                raise _CallError(ValueError, f"rank {self.rank}: src_block_ids has {description[0][0]} ids and "
                                             f"dst_block_ids {description[1][0]}: one id per moved block on each side")
            device = self._device(src_cache, dst_cache)
            cuda_stream = self._stream(stream, device, description != (None, None))
        except _CallError as error:
            problem = error
        nb = next((desc[0] for desc in description if desc is not None), 0)
        with _on_stream(device, cuda_stream):
            if cuda_stream is not None and self._done is not None:
                cuda_stream.wait_event(self._done)      # the previous call's use of the staging, on any stream
            try:
                packed = None
                if problem is None and nb > 0:
                    # Packing only writes this rank's staging buffers, so it runs before the
                    # check: an argument the kernel call refuses is reported on every rank too.
                    try:
                        packed = self._pack(src_cache, src_block_ids, nb, device, cuda_stream)
                    except (TypeError, ValueError) as error:
                        problem = _CallError(type(error), f"rank {self.rank}: {error}")
                if problem is not None and not check:
                    raise problem.kind(str(problem))
                if check:
                    # Every rank's description meets every other before anything is sent or
                    # written: all ranks see the same list, so all raise alike.
                    error_info = None if problem is None else (problem.kind.__name__, str(problem))
                    self._validate(self.transport.all_gather_object((self._fingerprint, error_info, description)))
                if packed is None:
                    return ReshardStats()
                return self._transfer(packed, dst_cache, dst_block_ids, nb, device, cuda_stream)
            finally:
                if cuda_stream is not None:
                    # Also after an error: the next call must not touch staging a pack still writes.
                    if self._done is None:
                        self._done = torch.cuda.Event()
                    self._done.record(cuda_stream)

    # ---------------------------------------------------------------- checks

    def _describe(self, side: str, share: tuple[range, range] | None, cache: Any, block_ids: Any) -> tuple | None:
        """(nb, num_outer, tokens_per_block, head_dim, dtype, device kind) of one side's
        arguments on this rank after checking them against the rank's position; None
        when the rank holds no position on that side.  Raises _CallError."""
        where = f"{side}_cache on rank {self.rank}"
        if share is None:
            if cache is not None or block_ids is not None:
                raise _CallError(ValueError, f"rank {self.rank} holds no {side} position: {side}_cache and "
                                             f"{side}_block_ids must be None")
            return None
        if not isinstance(cache, PagedKVCache):
            raise _CallError(TypeError, f"{where}: expected a kvbm_ext.PagedKVCache, got {type(cache).__name__}")
        heads, layers = share
        if cache.num_heads != len(heads) or cache.num_layers != len(layers):
            raise _CallError(ValueError, f"{where}: holds {cache.num_heads} heads x {cache.num_layers} layers, but "
                                         f"its position holds heads [{heads.start}, {heads.stop}) x layers "
                                         f"[{layers.start}, {layers.stop}) of the model ({len(heads)} x "
                                         f"{len(layers)})")
        _torch_dtype(cache, where)
        nb = _check_block_ids(block_ids, f"{side}_block_ids", self.rank, cache, distinct=side == "dst")
        return (nb, cache.num_outer, cache.tokens_per_block, cache.head_dim, cache.dtype, cache.device.split(":")[0])

    def _device(self, src_cache: Any, dst_cache: Any) -> str:
        devices = {cache.device for cache in (src_cache, dst_cache) if cache is not None}
        if len(devices) > 1:
            raise _CallError(ValueError, f"rank {self.rank}: src_cache is on {src_cache.device} and dst_cache on "
                                         f"{dst_cache.device}; a rank's caches must share one device")
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
                raise ValueError(f"rank {rank} built its Resharder for (num_heads, num_layers, src, dst) = "
                                 f"{fingerprint}, rank 0 for {gathered[0][0]}: every rank must plan the same "
                                 "transfer")
        errors = [(kind, message) for _, error, _ in gathered if error is not None for kind, message in [error]]
        if errors:
            kind = TypeError if errors[0][0] == "TypeError" else ValueError
            raise kind("; ".join(message for _, message in errors))
        fields = ("number of block ids", "num_outer", "tokens_per_block", "head_dim", "dtype", "device type")
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
                                 "blocks, and the caches of both engines share num_outer, tokens_per_block, "
                                 "head_dim, dtype and device type")

    # ---------------------------------------------------------------- the move

    def _buffer(self, key: tuple[str, int], cache: PagedKVCache, nb: int, transfer: ReshardTransfer,
                device: str) -> torch.Tensor:
        """The staging buffer `key` as [nb, nh_sel, nl_sel, no, nt, hd] of the cache's element type.

        Buffers are kept across calls and reallocated only to grow or to follow the caches to another device."""
        import torch

        shape = (nb, len(transfer.heads), len(transfer.layers), cache.num_outer, cache.tokens_per_block,
                 cache.head_dim)
        nbytes = cache.itemsize
        for extent in shape:
            nbytes *= extent
        buffer = self._staging.get(key)
        if buffer is None or buffer.numel() < nbytes or buffer.device != torch.device(device):
            if buffer is not None and buffer.is_cuda:
                # Freed now, reused by the allocator only after the work queued so far on this stream,
                # which waits for every earlier use of it.
                buffer.record_stream(torch.cuda.current_stream(buffer.device))
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._staging[key] = buffer
        return buffer[:nbytes].view(_torch_dtype(cache, "")).view(shape)

    def _pack(self, src_cache: Any, src_ids: Any, nb: int, device: str,
              stream: Any) -> list[tuple[ReshardTransfer, torch.Tensor]]:
        """Pack every message this rank sends and every local copy it makes into its staging."""
        packed = []
        for key, transfers in (("send", self._sends), ("local", self._locals)):
            for i, t in enumerate(transfers):
                buffer = self._buffer((key, i), src_cache, nb, t, device)
                cache, layers = self._layer_view("src", t, src_cache, t.src_layers)
                cache.to_universal(src_ids, buffer, layers=layers, heads=_whole_or(t.src_heads, cache.num_heads),
                                   stream=stream)
                packed.append((t, buffer))
        return packed

    def _layer_view(self, side: str, t: ReshardTransfer, cache: PagedKVCache,
                    layers: range) -> tuple[PagedKVCache, range | None]:
        """A cache and a layer selection whose universal layers start at 0.

        A universal call puts cache layer l at universal layer l + layer_offset, with
        layer_offset >= 0, so a message holding only layers [a, b) of a cache needs a
        cache whose layer 0 is layer a: one over the same memory, built on first use
        and kept while the calls pass the same cache."""
        if layers.start == 0:
            return cache, _whole_or(layers, cache.num_layers)
        kept = self._views.get((side, t))
        if kept is None or kept[0] is not cache:
            arrays: Any = cache.layers         # one array when the layout has "l", else one per layer (or pair)
            layout = cache.dims
            if "l" in layout:
                # One token per array dimension: letters in parentheses share one.
                axes = re.findall(r"\([^)]*\)|[a-z]", layout)
                axis = next(i for i, token in enumerate(axes) if "l" in token)
                if axes[axis] != "l":
                    raise ValueError(f"layout {layout!r}: layers [{layers.start}, {layers.stop}) of a cache whose "
                                     "'l' shares an array dimension cannot be moved apart")
                view = arrays[(slice(None),) * axis + (slice(layers.start, layers.stop),)]
            else:
                view = list(arrays)[layers.start:layers.stop]
            kept = (cache, PagedKVCache(view, layout, block_size=cache.tokens_per_block))
            self._views[(side, t)] = kept
        return kept[1], None

    def _transfer(self, packed: list[tuple[ReshardTransfer, torch.Tensor]], dst_cache: Any, dst_ids: Any, nb: int,
                  device: str, stream: Any) -> ReshardStats:
        """Send the packed messages, receive this rank's, and unpack them and the local copies."""
        def unpack(t: ReshardTransfer, buffer: torch.Tensor) -> None:
            cache, layers = self._layer_view("dst", t, dst_cache, t.dst_layers)
            cache.from_universal(buffer, dst_ids, layers=layers, heads=_whole_or(t.dst_heads, cache.num_heads),
                                 stream=stream)

        # The transport sees bytes: any element type travels (fp8 included) whatever the transport supports.
        sends = [(t.dst_rank, _bytes_of(buffer)) for t, buffer in packed if not t.is_local]
        local = [(t, buffer) for t, buffer in packed if t.is_local]
        received = [(t, self._buffer(("recv", i), dst_cache, nb, t, device)) for i, t in enumerate(self._recvs)]
        wait = self.transport.start(sends, [(t.src_rank, _bytes_of(buffer)) for t, buffer in received])
        # Unpacked after the messages were posted, so that they run while the messages travel.
        for t, buffer in local:
            unpack(t, buffer)
        wait()
        for t, buffer in received:
            unpack(t, buffer)
        return ReshardStats(messages_sent=len(sends), messages_received=len(received),
                            bytes_sent=sum(b.nbytes for _, b in sends), bytes_received=sum(b.nbytes for _, b in received),
                            local_copies=len(local), bytes_copied=sum(b.nbytes for _, b in local))


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


def _bytes_of(buffer: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer as a 1-D uint8 tensor over the same memory."""
    import torch

    return buffer.reshape(-1).view(torch.uint8)


def _torch_dtype(cache: PagedKVCache, where: str) -> torch.dtype:
    """The torch dtype of the cache's elements (staging buffers must have the same)."""
    import torch

    dtype = getattr(torch, cache.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise _CallError(TypeError, f"{where}: element type {cache.dtype} has no torch equivalent for the staging "
                                    "buffers")
    return dtype


def _whole_or(selection: range, extent: int) -> range | None:
    """None (everything) when `selection` covers the whole extent, else the range."""
    return None if selection == range(extent) else selection


def _layout_key(layout: EngineLayout, num_layers: int) -> tuple:
    return (layout.tp_size, layout.pp_size, tuple(layout.ranks or ()),
            tuple((r.start, r.stop) for r in (layout.layers_of(s, num_layers) for s in range(layout.pp_size))))


def _check_block_ids(block_ids: Any, name: str, rank: int, cache: PagedKVCache, distinct: bool) -> int:
    """Number of ids; host ids are checked for range (and repeats when written)."""
    import torch

    where = f"{name} on rank {rank}"
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise _CallError(ValueError, f"{where}: expected a 1-D tensor, got {block_ids.dim()}-D")
        if block_ids.dtype not in (torch.int32, torch.int64):
            raise _CallError(TypeError, f"{where}: expected int32 or int64 ids, got {block_ids.dtype}")
        if block_ids.device.type != "cpu":
            if str(block_ids.device) != cache.device:
                raise _CallError(ValueError, f"{where}: on {block_ids.device}, but the cache is on {cache.device}")
            return block_ids.shape[0]           # device ids: not read on the host
        values = block_ids.tolist()
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
        values = list(block_ids)
    else:
        raise _CallError(TypeError, f"{where}: expected a sequence of ints or a 1-D int tensor, got "
                                    f"{type(block_ids).__name__}")
    seen: dict[int, int] = {}
    for i, value in enumerate(values):
        try:
            value = operator.index(value)
        except TypeError:
            raise _CallError(TypeError, f"{name}[{i}] on rank {rank}: expected an int, got "
                                        f"{type(value).__name__}") from None
        if not 0 <= value < cache.num_blocks:
            raise _CallError(ValueError, f"{name}[{i}] on rank {rank}: block id {value} is out of range "
                                         f"[0, {cache.num_blocks})")
        if distinct and value in seen:
            raise _CallError(ValueError, f"{name}[{i}] on rank {rank}: block id {value} repeats "
                                         f"{name}[{seen[value]}]; a block can be written once per call")
        seen[value] = i
    return len(values)


def reshard(src_cache: PagedKVCache | None, src_block_ids: Any, dst_cache: PagedKVCache | None, dst_block_ids: Any,
            *, num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout, group: Any = None,
            transport: Transport | None = None, stream: Any = None, check: bool = True) -> ReshardStats:
    """One-shot `Resharder(num_heads, num_layers, src, dst, group=..., transport=...)(src_cache,
    src_block_ids, dst_cache, dst_block_ids, stream=..., check=...)`.

    It plans and allocates staging buffers on every call: to move blocks repeatedly,
    build a `Resharder` once and call it (it keeps its plan and its buffers)."""
    resharder = Resharder(num_heads, num_layers, src, dst, group=group, transport=transport)
    return resharder(src_cache, src_block_ids, dst_cache, dst_block_ids, stream=stream, check=check)
