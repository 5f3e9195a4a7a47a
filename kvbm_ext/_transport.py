"""How a `Resharder`'s messages travel: the `Transport` protocol, and `TorchTransport` over
a torch.distributed process group.  torch is imported when a transport is built."""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import torch


class Transport(Protocol):
    """What a `Resharder` needs from the engine that carries its messages.

    `TorchTransport` implements it over a torch.distributed process group (NCCL for
    GPU caches, gloo for host caches).  Another engine (NIXL, UCX, ...) plugs in by
    implementing these four members; `Resharder(..., transport=...)` takes it.

    - `rank`, `world_size`: this process's rank and the number of ranks, in the
      numbering the `EngineLayout`s use.
    - `all_gather_object(obj, timeout)`: a small picklable object from every rank, as a
      list indexed by rank (collective over every rank).  Used once when a Resharder is
      built and once per checked call, to validate on every rank before anything
      moves.  Raises TimeoutError when the other ranks did not all take part within
      `timeout` seconds.
    - `start(sends, recvs, timeout)`: post every message of one call at once: `sends`
      and `recvs` are `(peer rank, tensor)` pairs, each tensor contiguous, at most one
      per peer and direction; the sizes of a matching send and receive are equal.
      Returns a callable that completes them: for device tensors, it makes the
      caller's current stream wait for the messages (no host synchronization; the
      engine's own timeout applies); for host tensors, it returns once they are done,
      or raises TimeoutError after `timeout` seconds.  Work enqueued on the current
      stream before `start` (the packing) must be finished before a send reads its
      tensor.  The tensors of one `start` are all on the host or all on one device.

    Headers: a call with `check=False` first calls `start` with one fixed-size header
    per peer and direction (`kvbm_ext._reshard.HEADER`: 128 bytes, as a host int64
    tensor over the record's bytes) and waits for them, before it posts any payload:
    a transport carries host tensors even when the payloads are device tensors.  The
    Resharder builds, compares and acts on the headers; the transport only delivers
    them.  (A transport that cannot carry host tensors sets `_carries_host_tensors =
    False`, and `check=False` is then refused.)
    """

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]: ...
    def start(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
              timeout: float) -> Callable[[], None]: ...


class TorchTransport:
    """`Transport` over a torch.distributed process group (None: the default group),
    through `torch.distributed.batch_isend_irecv`.  Ranks are ranks of `group`.

    GPU caches need a group with an NCCL backend; host caches one with gloo.  With
    `init_process_group(backend="cpu:gloo,cuda:nccl")` one group does both, and the
    exchanges that check a Resharder and its calls go over gloo without touching the
    GPU: `check=True`'s exchange of descriptions and `check=False`'s per-pair headers.
    With an NCCL-only group `check=True`'s exchange goes through the GPU and waits for
    it, and `check=False` is refused (its headers would have to be read back from the
    GPU, a host synchronization per call).  With NCCL, as for any `batch_isend_irecv`,
    the first NCCL operation on the group must involve all its ranks (e.g. a warm-up
    `all_reduce`).

    A TimeoutError (the other ranks did not take part in time) leaves operations of
    the group pending with no peer to complete them: torch.distributed gives no way
    to cancel them, so the group is unusable afterwards (destroy it and build another).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "first (or pass transport=)")
        self.group = group
        self._global_ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        self._rank = dist.get_rank(group)
        # Host tensors (all_gather_object's, check=False's headers) need gloo in the group.
        self._carries_host_tensors = "gloo" in str(dist.get_backend(group))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]:
        """As torch.distributed.all_gather_object, with every wait bounded by `timeout`
        seconds in all: the sizes of the pickled objects, then the objects."""
        import torch
        import torch.distributed as dist

        deadline = time.monotonic() + timeout
        device = self._object_device()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), deadline, timeout, "exchange")
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(dist.all_gather(pieces, padded, group=self.group, async_op=True), deadline, timeout, "exchange")
        return [pickle.loads(piece[:n].cpu().numpy().tobytes()) for piece, n in zip(pieces, lengths)]

    def start(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
              timeout: float) -> Callable[[], None]:
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, tensor, self._global_ranks[peer], self.group) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._global_ranks[peer], self.group) for peer, tensor in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        on_host = all(tensor.device.type == "cpu" for _, tensor in list(sends) + list(recvs))

        def wait() -> None:
            deadline = time.monotonic() + timeout
            for work in works:
                if on_host:
                    self._wait(work, deadline, timeout, "messages")
                else:
                    work.wait()     # the current stream waits; the host does not

        return wait

    def _object_device(self) -> Any:
        """Where all_gather_object's tensors live: the host with a gloo backend (alone or
        beside NCCL), else the current CUDA device."""
        import torch

        if self._carries_host_tensors:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

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
            raise TimeoutError(f"rank {self._rank}: the other ranks did not complete the {what} within {timeout} s "
                               "(timeout=): every rank of the group must take part, each with the same check; the "
                               f"group is unusable now ({error})") from error
