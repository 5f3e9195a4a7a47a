"""Where a Resharder call's host time goes: benchmarks/reshard.py's ranks and caches
(Llama-3.1-70B blocks on two GPUs, or small host caches on the CPU), one direction and nb,
rank 0's back-to-back calls timed after a warm-up (host time a call, and the calls' GPU
time on rank 0's stream), then under cProfile: the functions by their own time and by
cumulative time.  --whole sends each message as one piece (kvbm_ext._pieces.cut patched in
both ranks), to price the pieces.  --no-headers drops check=False's pair headers in both ranks
(a probe of what they cost, not a mode: nothing compares the ranks' calls then).

    python3 benchmarks/probes/reshard_host_profile.py [--transport nccl|nixl] [--direction 1to2]
        [--nb 64] [--check] [--whole] [--no-headers] [--profile-rank 0] [--calls 50] [--rows 22] [--progress-delay-us US] [--device auto|cuda|cpu]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reshard as bench  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="nccl", choices=["nccl", "nixl"])
    parser.add_argument("--direction", default="1to2", choices=sorted(bench.DIRECTIONS))
    parser.add_argument("--nb", type=int, default=64)
    parser.add_argument("--check", action="store_true", help="check=True (default: check=False)")
    parser.add_argument("--whole", action="store_true", help="every message as one piece")
    parser.add_argument("--no-headers", action="store_true", help="drop the pair headers (a probe, not a mode)")
    parser.add_argument("--profile-rank", type=int, default=0, help="the rank cProfile watches")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rows", type=int, default=22, help="functions printed in each order")
    parser.add_argument("--progress-delay-us", type=int, help="NixlTransport's progress_delay_us")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    mine = parser.parse_args()
    delay = [] if mine.progress_delay_us is None else ["--progress-delay-us", str(mine.progress_delay_us)]
    args = bench.parse_args(["--device", mine.device, "--transport", mine.transport, *delay])
    return mine, args


def child(rank, mine, args, folder):
    if mine.whole:
        from kvbm_ext import _pieces

        _pieces.cut = lambda nb, block_bytes: ((0, nb),) if nb > 0 else ()
    if mine.no_headers:
        from kvbm_ext import _pieces

        made = _pieces.Exchange.__init__

        def without_headers(self, **kwargs):
            made(self, **{**kwargs, "headers": None})

        _pieces.Exchange.__init__ = without_headers
    me = bench.Rank(rank, args, folder)
    src, dst = bench.DIRECTIONS[mine.direction]
    resharder = bench.kvbm_ext.Resharder(bench.NH, args.layers, src, dst,
                                         transport=me.nixl if mine.transport == "nixl" else None)
    call = bench.probe_call(me, resharder, (src, dst), mine.nb, check=mine.check)

    def calls(count):
        for _ in range(count):
            call()

    dist.barrier()
    me.sync()
    start = time.perf_counter()
    calls(mine.calls)
    host = time.perf_counter() - start
    me.sync()
    total = time.perf_counter() - start
    dist.barrier()
    print(f"rank {rank}: host {host / mine.calls * 1e6:.0f} us a call, until done {total / mine.calls * 1e6:.0f} us a call",
          flush=True)
    dist.barrier()
    profile = cProfile.Profile() if rank == mine.profile_rank else None
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    calls(mine.calls)
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - start
    me.sync()
    dist.barrier()
    if rank == mine.profile_rank:
        print(f"rank {rank}: {mine.transport} {mine.direction} nb={mine.nb} check={mine.check} whole={mine.whole} on {me.device}, "
              f"{mine.calls} calls: host {host / mine.calls * 1e6:.0f} us a call, until done {total / mine.calls * 1e6:.0f}"
              f" us a call; profiled: {wall / mine.calls * 1e6:.0f} us a call")
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats(order).print_stats(mine.rows)
            print(f"--- by {order} (seconds over {mine.calls} calls)")
            lines = text.getvalue().splitlines()
            first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
            print("\n".join(line for line in lines[first:] if line.strip()))
    dist.destroy_process_group()


def main():
    mine, args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(child, args=(mine, args, folder), nprocs=bench.WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
