"""When each part of one Resharder call runs on the GPU: benchmarks/reshard.py's ranks and
caches (Llama-3.1-70B blocks on two GPUs, NCCL through TorchTransport's own communicators),
one direction and nb, check=False.  After warm-up calls, each rank makes one call from an
idle device, with CUDA events recorded around its local packs, each piece's pack, the header
swap (its host times; the events on the call's stream), each NCCL post (on the post stream:
its end event completes when the group did), each piece's unpack and the local unpacks; it
prints them in microseconds from an event recorded as the call
began, with the host's own times of the same points.  --rounds calls, one after another.

    python3 benchmarks/probes/reshard_timeline.py [--direction 1to2] [--nb 64] [--rounds 3]
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reshard as bench  # noqa: E402


class Timeline:
    """Events on the GPU, and the host's time, at named points of one call."""

    def __init__(self):
        self.points = []        # (name, event, host seconds)
        self.active = False

    def mark(self, name, stream):
        if self.active:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.points.append((name, event, time.perf_counter()))

    def around(self, name, stream, run):
        self.mark(name + " >", stream)
        run()
        self.mark(name + " <", stream)

    def report(self, rank):
        torch.cuda.synchronize()
        (_, first, host0) = self.points[0]
        lines = [f"rank {rank}: {'point':28s} {'GPU us':>8s} {'host us':>8s}"]
        for name, event, host in self.points:
            lines.append(f"rank {rank}: {name:28s} {first.elapsed_time(event) * 1e3:8.1f} {(host - host0) * 1e6:8.1f}")
        self.points = []
        return "\n".join(lines)


class TimedComm:
    """A payload communicator whose posts are bracketed by events on their stream."""

    def __init__(self, comm, timeline):
        self.comm, self.timeline, self.posts = comm, timeline, 0

    def post(self, stream, ops):
        on = torch.cuda.ExternalStream(stream)
        name = f"post {self.posts} ({sum(op[3] for op in ops) >> 20} MiB)"
        self.posts += 1
        self.timeline.around(name, on, lambda: self.comm.post(stream, ops))

    def swap(self, peers, records, timeout):
        # On the communicator's own stream, out of reach: the host's times, and the call stream's.
        stream = torch.cuda.current_stream()
        received = [None]

        def run():
            received[0] = self.comm.swap(peers, records, timeout)

        self.timeline.around("header swap", stream, run)
        return received[0]

    def __getattr__(self, name):
        return getattr(self.comm, name)


def instrument(timeline):
    """Wraps the hooks of every Exchange, and the local packs of Resharder._exchange."""
    from kvbm_ext import _pieces, _reshard

    made = _pieces.Exchange.__init__

    def timed_init(self, **kwargs):
        pack, unpack, local = kwargs["pack"], kwargs["unpack"], kwargs["local"]
        kwargs["pack"] = lambda i, p, on: timeline.around(f"pack send {i} piece {p}", on, lambda: pack(i, p, on))
        kwargs["unpack"] = lambda j, p, on: timeline.around(f"unpack recv {j} piece {p}", on,
                                                            lambda: unpack(j, p, on))
        kwargs["local"] = lambda on: timeline.around("local unpacks", on, lambda: local(on))
        made(self, **kwargs)

    _pieces.Exchange.__init__ = timed_init
    exchange = _reshard.Resharder._exchange

    def timed_exchange(self, *args):
        stream = args[-2]
        timeline.mark("local packs >", stream)
        out = exchange(self, *args)
        timeline.mark("local packs <", stream)
        return out

    _reshard.Resharder._exchange = timed_exchange


def child(rank, mine, args, folder):
    timeline = Timeline()
    instrument(timeline)
    me = bench.Rank(rank, args, folder)
    src, dst = bench.DIRECTIONS[mine.direction]
    resharder = bench.kvbm_ext.Resharder(bench.NH, args.layers, src, dst)
    nccl = resharder.transport._nccl
    if nccl is None:
        raise SystemExit("TorchTransport did not open NCCL communicators of its own")
    resharder.transport._nccl = (TimedComm(nccl[0], timeline), TimedComm(nccl[1], timeline))
    call = bench.probe_call(me, resharder, (src, dst), mine.nb)
    for _ in range(mine.rounds):
        me.sync()
        dist.barrier()
        stream = torch.cuda.current_stream()
        timeline.active = True
        timeline.mark("call", stream)
        call()
        timeline.mark("returned", stream)
        timeline.active = False
        text = timeline.report(rank)
        for r in range(bench.WORLD):
            dist.barrier()
            if r == rank:
                print(text, flush=True)
    dist.destroy_process_group()


def main():
    bench.timeline_probe(__doc__, child, "nccl")


if __name__ == "__main__":
    main()
