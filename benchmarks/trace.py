#!/usr/bin/env python3
"""Where a staged call's time goes: the GPU timeline of a few back-to-back calls.

PagedKVCache.to_universal / from_universal over the Llama-3.1-70B KV cache (nl=80 no=2
nh=8 hd=128 bf16, nt=16, 5 MiB a block) into or out of pinned universals, on a side
stream, recorded with torch.profiler (CUPTI).  For each nb the log lists every permute
kernel and copy of --calls back-to-back calls, in microseconds from the first one's
start, with the idle time before each activity on its engine's side: the hand-offs
between the copy engines and the permute, the gaps between pieces' copies, and what a
call pays beyond a same-size memcpy (timed the same way first).

--beside-gemm K runs K bf16 8192^3 GEMMs on another stream at the same time and lists
them too, so that one sees which of the GEMMs' gaps the permutes get (beside.py measures
what that costs each side).

Output: a log (and the profiler's JSON trace of each case) in --out.
"""

import argparse
import datetime
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

# Trace the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402
from kvbm_ext._no_gpu import require_gpu  # noqa: E402
from harness import HD, NH, NL, NO, NT, Tee, int_list, output_dir, run_stem  # noqa: E402

NUM_BLOCKS = 256
GEMM_N = 8192
LEAD_SLEEP_CYCLES = 2_000_000      # a GPU sleep before the calls, so that the host queues them all


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nb", type=int_list, default=[1, 8], help="blocks per call (default 1,8)")
    parser.add_argument("--calls", type=int, default=3, help="back-to-back calls traced (default 3)")
    parser.add_argument("--beside-gemm", type=int, default=0, metavar="K",
                        help="K GEMMs on another stream during the calls (default 0: alone)")
    parser.add_argument("--out", help="directory for trace-<gpu>-<date>.log and the JSON traces")
    return parser.parse_args(argv)


def activities(path):
    """The profiler's kernels and copies, sorted by start: (start us, duration us, name)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    found = [(e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    return sorted(found)


def engine(name):
    if name.startswith("Memcpy"):
        return "copy"
    if "paged_kernel" in name:
        return "permute"
    return "other"


def print_timeline(label, found):
    """Each activity after the lead sleep, from the first one's start, with the idle time
    on its engine since the previous activity there ended."""
    found = [a for a in found if "spin_kernel" not in a[2]]
    if not found:
        print(f"--- {label}: no activity recorded")
        return
    origin = found[0][0]
    ended = {}
    print(f"--- {label}: {len(found)} activities")
    for start, duration, name in found:
        side = engine(name)
        idle = start - ended[side] if side in ended else None
        ended[side] = start + duration
        idle_text = f"{idle:8.1f}" if idle is not None else "       -"
        print(f"  {start - origin:9.1f} +{duration:8.1f}  idle {idle_text}  {side:<7} {name[:60]}")
    last = max(start + duration for start, duration, _ in found)
    print(f"  span {last - origin:.1f} us")


def trace(label, calls, stream, beside, stem):
    """Profiles calls (each enqueues one transfer) behind a GPU sleep on `stream`, with
    `beside` (enqueues the stand-in) on its own stream at the same time; the profiler's
    JSON goes next to the log (stem-<label>.json)."""
    for call in calls[:2]:
        call()                             # warm-up: staging, first launches
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LEAD_SLEEP_CYCLES)
        if beside is not None:
            beside(stream)
        for call in calls:
            call()
        torch.cuda.synchronize()
    path = f"{stem}-{label.replace(' ', '-').replace('=', '')}.json"
    prof.export_chrome_trace(path)
    print_timeline(label, activities(path))


def gemm_loop(count, device):
    a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    gemm_stream = torch.cuda.Stream(device)

    def enqueue(transfer_stream):
        gemm_stream.wait_stream(transfer_stream)     # start with the calls, behind the sleep
        with torch.cuda.stream(gemm_stream):
            for _ in range(count):
                torch.matmul(a, b, out=out)
    return enqueue


def main(argv=None):
    args = parse_args(argv)
    require_gpu("trace")
    device = torch.device("cuda", torch.cuda.current_device())
    gpu_name = torch.cuda.get_device_name(device)
    folder = output_dir(args.out, "trace")
    stem = run_stem(folder, "trace", gpu_name, datetime.date.today().isoformat())
    sys.stdout = Tee(sys.__stdout__, open(stem + ".log", "w"))
    print(f"trace: gpu={gpu_name} torch={torch.__version__} kvbm_ext={kvbm_ext.build_info().get('version')} "
          f"nb={args.nb} calls={args.calls} beside_gemm={args.beside_gemm} staging={kvbm_ext.staging_info()}")

    gen = torch.Generator(device=device)
    gen.manual_seed(2026)
    layers = [torch.randint(-2**15, 2**15, (NO, NUM_BLOCKS, NT, NH, HD), dtype=torch.int16, device=device,
                            generator=gen).view(torch.bfloat16) for _ in range(NL)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    stream = torch.cuda.Stream(device)
    beside = gemm_loop(args.beside_gemm, device) if args.beside_gemm else None
    for nb in args.nb:
        ids = torch.randperm(NUM_BLOCKS, device=device)[:nb]
        pinned = torch.empty(nb, NH, NL, NO, NT, HD, dtype=torch.bfloat16, pin_memory=True)
        scratch = torch.empty(pinned.numel(), dtype=torch.bfloat16, device=device)

        def memcpy():
            with torch.cuda.stream(stream):
                pinned.view(-1).copy_(scratch, non_blocking=True)

        cases = {"memcpy d2h": memcpy,
                 "to_universal": lambda: cache.to_universal(ids, pinned, stream=stream),
                 "from_universal": lambda: cache.from_universal(pinned, ids, stream=stream)}
        for name, call in cases.items():
            trace(f"{name} nb={nb}", [call] * args.calls, stream, beside, stem)
    print(f"log: {stem}.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
