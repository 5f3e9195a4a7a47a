#!/usr/bin/env python3
"""Pinned host memory for the KV tier: seconds to a usable pinned array, and copies into it.

A server allocates its host tier (tens to hundreds of GiB of pinned memory) when it
starts.  This script measures, for each size (default 1, 8 and 32 GiB, those that fit in
the memory available), the seconds from the call to a pinned array ready for copies:

  pinned_empty         kvbm_ext.pinned_empty(n, uint8): mmap, transparent huge pages,
                       first touch by one thread per CPU, cudaHostRegister;
  torch_empty_pinned   torch.empty(n, dtype=uint8, pin_memory=True) (cudaHostAlloc in
                       torch's caching host allocator);
  pin_memory           .pin_memory() of a pageable torch.empty(n) (allocation and copy);
  cuda_host_alloc      cudaHostAlloc itself, through cupy.cuda.PinnedMemory (skipped
                       without CuPy);

the seconds to free each (the last reference dropped), and the D2H and H2D rate of a
1 GiB torch copy between the GPU and the first GiB of each (CUDA events, median of 10,
verified bit for bit).  Then pinned_empty against its thread count (--curve-threads, at
--curve-gib), and with huge_pages="none" at the most threads, and whether releasing a pinned_empty
buffer (cudaHostUnregister, then munmap) waits for unrelated GPU work queued on another
stream.

Each (method, size) runs in a child process of its own, so that one method's memory
(torch caches freed pinned blocks) never weighs on the next, and every child warms up
CUDA before it times anything.  Before them, one pinned_empty of the largest size is timed
apart ("first use"): on a virtual machine, memory the guest has not used since it started
is backed by the host at its first touch, which costs every method the same once per
machine, and the first method measured would pay it alone.  Targets (printed PASS / MISS): 8 GiB pinned_empty in
<= 1.0 s, 32 GiB in <= 4 s, copy rates into it within 2 % of cudaHostAlloc memory both
ways.  Output: a CSV and a log in --out (default: see harness.output_dir).  Exit status 1
when a copy was not bit-exact.
"""

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from harness import REPO_ROOT, Tee, calibrate_sleep_cycles_per_us, int_list, output_dir, run_stem

GIB = 1 << 30
METHODS = ("pinned_empty", "torch_empty_pinned", "pin_memory", "cuda_host_alloc")
COPY_REPS = 10
TARGET_S = {8: 1.0, 32: 4.0}          # GiB: seconds
COPY_TOLERANCE = 0.02
COLUMNS = ["gpu_name", "date", "kind", "method", "size_bytes", "threads", "reps", "median_s", "min_s",
           "free_median_s", "d2h_gbs", "h2d_gbs", "pinned", "huge_pages", "numa_node", "verified", "note"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int_list, default=[1, 8, 32], help="GiB (default 1,8,32)")
    parser.add_argument("--reps", type=int, default=3, help="allocations per method and size up to 8 GiB "
                                                             "(default 3; larger sizes get 1)")
    parser.add_argument("--curve-gib", type=int, default=8, help="size of the thread-count curve (default 8)")
    parser.add_argument("--curve-threads", type=int_list, default=[1, 2, 4, 8, 16],
                        help="thread counts of the curve (default 1,2,4,8,16)")
    parser.add_argument("--quick", action="store_true", help="1 GiB only, one allocation each, a short curve")
    parser.add_argument("--out", help="where the CSV and log go (default: see harness.output_dir)")
    parser.add_argument("--worker", nargs=5, metavar=("METHOD", "BYTES", "REPS", "THREADS", "JSON"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.curve_gib, args.curve_threads = [1], 1, 1, [1, 2, 4]
    if args.reps < 1:
        parser.error("--reps: expected a positive count")
    return args


# ----------------------------------------------------------------------------- one method, one size (a child)

def import_kvbm_ext():
    """The checkout's kvbm_ext (an in-place build in the repository root)."""
    sys.path.insert(0, REPO_ROOT)
    import kvbm_ext
    return kvbm_ext


def allocate(method, nbytes, threads):
    """(a uint8 tensor of the pinned memory, the object owning it, facts about it)."""
    if method in ("pinned_empty", "pinned_empty_nohuge"):
        kvbm_ext = import_kvbm_ext()
        buf = kvbm_ext.pinned_empty(nbytes, "uint8", threads=threads or None,
                                    huge_pages="none" if method == "pinned_empty_nohuge" else "transparent")
        facts = {"pinned": buf.pinned, "huge_pages": buf.huge_pages, "numa_node": buf.numa_node,
                 "threads": buf.threads}
        return torch.from_dlpack(buf), buf, facts
    if method == "torch_empty_pinned":
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return tensor, tensor, {}
    if method == "pin_memory":
        tensor = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return tensor, tensor, {}
    import cupy
    import numpy as np
    memory = cupy.cuda.PinnedMemory(nbytes)
    array = np.frombuffer(cupy.cuda.PinnedMemoryPointer(memory, 0), np.uint8, nbytes)
    return torch.from_numpy(array), memory, {}


def warm_up(method):
    """CUDA contexts and the allocator's first call, outside the timing."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    tensor, owner, _ = allocate(method, 1 << 21, 0)
    del tensor, owner
    torch.cuda.synchronize()


def copy_rates(host):
    """(D2H GB/s, H2D GB/s, bit-exact) of 1 GiB between the GPU and host[:1 GiB]."""
    host = host[:GIB]
    source = torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    host.copy_(source, non_blocking=True)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    verified = torch.equal(host.to("cuda"), source) and torch.equal(target, source)
    rates = []
    for copy in (lambda: host.copy_(source, non_blocking=True), lambda: target.copy_(host, non_blocking=True)):
        samples = []
        for _ in range(COPY_REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        rates.append(host.numel() / statistics.median(samples) / 1e9)
    return rates[0], rates[1], verified


def host_cache_emptier():
    """torch's call that frees the pinned blocks its caching host allocator keeps, or None
    (its name has changed across torch versions)."""
    accelerator = getattr(torch, "accelerator", None)
    for found in (getattr(accelerator, "empty_host_cache", None),
                  getattr(torch._C, "_accelerator_emptyHostCache", None), getattr(torch._C, "_host_emptyCache", None)):
        if found is not None:
            return found
    return None


def run_worker(method, nbytes, reps, threads):
    """Times `reps` allocations and frees, then the copies into the last one.  torch keeps
    freed pinned blocks for its next allocation: they are freed too (part of the free time),
    or, where this torch cannot, one allocation is timed."""
    warm_up(method)
    emptier = host_cache_emptier() if method in ("torch_empty_pinned", "pin_memory") else (lambda: None)
    note = ""
    if emptier is None:
        reps, note = 1, "this torch cannot free its cached pinned blocks: one allocation"
    seconds, frees, facts = [], [], {}
    for rep in range(reps):
        start = time.perf_counter()
        tensor, owner, facts = allocate(method, nbytes, threads)
        seconds.append(time.perf_counter() - start)
        if rep == reps - 1 and threads == 0:
            facts["d2h_gbs"], facts["h2d_gbs"], facts["verified"] = copy_rates(tensor)
        start = time.perf_counter()
        del tensor, owner
        emptier()
        frees.append(time.perf_counter() - start)
    return dict(facts, seconds=seconds, frees=frees, note=note)


def release_wait(sleep_s):
    """Seconds to close a 1 GiB pinned_empty buffer alone, then with `sleep_s` of unrelated
    GPU work queued on another stream."""
    kvbm_ext = import_kvbm_ext()
    warm_up("pinned_empty")
    cycles_per_us = calibrate_sleep_cycles_per_us()
    times = []
    for busy in (False, True):
        buf = kvbm_ext.pinned_empty(GIB, "uint8")
        side = torch.cuda.Stream()
        if busy:
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(sleep_s * 1e6 * cycles_per_us))
        start = time.perf_counter()
        buf.close()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return {"alone_s": times[0], "busy_s": times[1], "sleep_s": sleep_s}


def child(method, nbytes, reps, threads):
    """Runs one measurement in a child process; its JSON, or {"error": ...}."""
    handle, path = tempfile.mkstemp(suffix=".json", prefix="host_pools-")
    os.close(handle)
    try:
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", method, str(nbytes), str(reps),
                              str(threads), path], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            return {"error": (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]}
        with open(path) as f:
            return json.load(f)
    finally:
        os.remove(path)


# ----------------------------------------------------------------------------- the run

def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Run:
    """The rows and the printed lines of one run."""

    def __init__(self, gpu_name, date, out):
        self.gpu_name, self.date, self.out, self.rows = gpu_name, date, out, []

    def say(self, text):
        print(text, file=self.out)

    def row(self, kind, method, nbytes, result, threads=0, note=""):
        seconds, frees = result.get("seconds", []), result.get("frees", [])
        cells = {"gpu_name": self.gpu_name, "date": self.date, "kind": kind, "method": method, "size_bytes": nbytes,
                 "threads": result.get("threads", threads), "reps": len(seconds),
                 "median_s": f"{statistics.median(seconds):.4f}" if seconds else "",
                 "min_s": f"{min(seconds):.4f}" if seconds else "",
                 "free_median_s": f"{statistics.median(frees):.4f}" if frees else "",
                 "d2h_gbs": f"{result['d2h_gbs']:.2f}" if "d2h_gbs" in result else "",
                 "h2d_gbs": f"{result['h2d_gbs']:.2f}" if "h2d_gbs" in result else "",
                 "pinned": result.get("pinned", ""), "huge_pages": result.get("huge_pages", ""),
                 "numa_node": result.get("numa_node", ""), "verified": result.get("verified", ""),
                 "note": result.get("error", result.get("note", note))}
        self.rows.append(cells)
        return cells


def measure_first_use(args, run):
    """One pinned_empty of the largest size that fits, before anything else touches the memory."""
    fitting = [gib for gib in args.sizes if (gib + 4) * GIB <= mem_available()]
    if not fitting:
        return None
    gib = max(fitting)
    result = child("pinned_empty", gib * GIB, 1, 0)
    cells = run.row("first_use", "pinned_empty", gib * GIB, result,
                    note="the run's first allocation: memory the machine may not have used since it started")
    run.say(f"{gib:3d} GiB pinned_empty first use of the machine's memory: "
            + (f"not run: {result['error']}" if "error" in result else f"{cells['median_s']} s"))
    return gib, result


def measure_sizes(args, run):
    """The allocation rows, {(method, GiB): result}."""
    results = {}
    for gib in args.sizes:
        if (gib + 4) * GIB > mem_available():
            run.say(f"{gib} GiB: skipped, {mem_available() / GIB:.1f} GiB of memory available")
            continue
        reps = args.reps if gib <= 8 else 1
        for method in METHODS:
            result = child(method, gib * GIB, reps, 0)
            results[(method, gib)] = result
            cells = run.row("alloc", method, gib * GIB, result)
            if "error" in result:
                run.say(f"{gib:3d} GiB {method:20s} not run: {result['error']}")
                continue
            run.say(f"{gib:3d} GiB {method:20s} {cells['median_s']:>8s} s (min {cells['min_s']}, {reps} reps), "
                    f"free {cells['free_median_s']} s; D2H {cells['d2h_gbs']} GB/s, H2D {cells['h2d_gbs']} GB/s, "
                    f"bit-exact {cells['verified']}"
                    + (f"; {result['threads']} threads, huge pages {result['huge_pages']}, node "
                       f"{result['numa_node']}" if method == "pinned_empty" else ""))
    return results


def measure_curve(args, run):
    nbytes = args.curve_gib * GIB
    if (args.curve_gib + 4) * GIB > mem_available():
        run.say(f"thread curve: skipped, {mem_available() / GIB:.1f} GiB of memory available")
        return
    run.say(f"\npinned_empty of {args.curve_gib} GiB against its threads (one allocation each):")
    points = [("pinned_empty", threads) for threads in args.curve_threads]
    points.append(("pinned_empty_nohuge", max(args.curve_threads)))
    for method, threads in points:
        result = child(method, nbytes, 1, threads)
        cells = run.row("threads", method, nbytes, result, threads)
        label = "huge pages none" if method.endswith("nohuge") else "transparent"
        run.say(f"  {label:16s} threads={threads:3d}: "
                + (f"not run: {result['error']}" if "error" in result else f"{cells['median_s']} s"))


def measure_release(run):
    result = child("release_wait", GIB, 1, 0)
    if "error" in result:
        run.say(f"\nrelease: not run: {result['error']}")
        return
    waits = result["busy_s"] > result["alone_s"] + 0.5 * result["sleep_s"]
    run.say(f"\nrelease of 1 GiB (cudaHostUnregister + munmap): {result['alone_s']:.3f} s alone, "
            f"{result['busy_s']:.3f} s with {result['sleep_s']:.1f} s of GPU work queued on another stream: "
            + ("it waits for the device" if waits else "it does not wait for the device"))
    for seconds, note in ((result["alone_s"], "alone"),
                          (result["busy_s"], f"with {result['sleep_s']} s of GPU work queued on another stream")):
        run.rows.append({"gpu_name": run.gpu_name, "date": run.date, "kind": "release", "method": "pinned_empty",
                         "size_bytes": GIB, "reps": 1, "median_s": f"{seconds:.4f}", "min_s": f"{seconds:.4f}",
                         "note": note})


def judge(results, first_use, run):
    """The PASS / MISS lines; False when a copy was not bit-exact."""
    run.say("\ntargets:")
    if first_use and first_use[1].get("seconds"):
        seconds = first_use[1]["seconds"][0]
        limit = TARGET_S.get(first_use[0])
        run.say(f"  first use of the machine's memory, {first_use[0]} GiB: {seconds:.3f} s"
                + (f" ({'within' if seconds <= limit else 'over'} the {limit} s below)" if limit else ""))
    for gib, limit in TARGET_S.items():
        result = results.get(("pinned_empty", gib), {})
        if not result.get("seconds"):
            run.say(f"  {gib} GiB pinned in <= {limit} s: not run")
            continue
        seconds = statistics.median(result["seconds"])
        run.say(f"  {gib} GiB pinned in <= {limit} s: {seconds:.3f} s {'PASS' if seconds <= limit else 'MISS'}")
    measured = {method for (method, _), result in results.items() if "d2h_gbs" in result}
    reference = "cuda_host_alloc" if "cuda_host_alloc" in measured else "torch_empty_pinned"
    for direction in ("d2h_gbs", "h2d_gbs"):
        ours = [r[direction] for (m, _), r in results.items() if m == "pinned_empty" and direction in r]
        theirs = [r[direction] for (m, _), r in results.items() if m == reference and direction in r]
        if not ours or not theirs:
            run.say(f"  {direction[:3].upper()} within 2 % of {reference}: not run")
            continue
        change = statistics.median(ours) / statistics.median(theirs) - 1
        run.say(f"  {direction[:3].upper()} within 2 % of {reference}: {statistics.median(ours):.2f} against "
                f"{statistics.median(theirs):.2f} GB/s ({change * 100:+.1f} %) "
                f"{'PASS' if change >= -COPY_TOLERANCE else 'MISS'}")
    exact = all(r.get("verified", True) for r in results.values())
    run.say(f"  every copy bit-exact: {'yes' if exact else 'NO'}")
    return exact


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        method, nbytes, reps, threads, path = args.worker
        result = (release_wait(0.5) if method == "release_wait"
                  else run_worker(method, int(nbytes), int(reps), int(threads)))
        with open(path, "w") as f:
            json.dump(result, f)
        return 0
    kvbm_ext = import_kvbm_ext()
    from kvbm_ext._no_gpu import require_gpu
    require_gpu("host_pools")
    started = time.monotonic()
    gpu_name, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    stem = run_stem(output_dir(args.out, "host_pools"), "host_pools", gpu_name, date)
    with open(stem + ".log", "w") as log:
        run = Run(gpu_name, date, Tee(sys.stdout, log))
        run.say(f"# {gpu_name}, {date}, torch {torch.__version__}, kvbm_ext {kvbm_ext.__version__} "
                f"({os.path.dirname(kvbm_ext.__file__)}), {len(os.sched_getaffinity(0))} CPUs, "
                f"{mem_available() / GIB:.1f} GiB available")
        first_use = measure_first_use(args, run)
        results = measure_sizes(args, run)
        measure_curve(args, run)
        measure_release(run)
        exact = judge(results, first_use, run)
        run.say(f"\n{time.monotonic() - started:.0f} s")
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(run.rows)
    print(f"wrote {stem}.csv and {stem}.log")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
