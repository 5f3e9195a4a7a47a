"""Where the host time of one PagedKVCache.to_cache call goes, back to back and right after
a synchronize: host timestamps at 16 points along the call (argument reading, checks, the
table, the route, the device's lock, the staging's lane, the deferred job's copy, its
event, its stream wait, the hand-over to the enqueue thread, the lock's release, the
Deferred), from a build with to_cache_stamps.patch, which records them (clock_gettime)
and writes them at exit.  Jobs as vllm_offload.py's Case makes them (vLLM's packed K|V
pages, a pinned universal tier), Llama-3.1-8B and 70B dims, nb = 1, 8, 64, deferred and
not; modes: back to back (a synchronize every 8), right after a synchronize ("idle"), and
after a synchronize behind a GPU sleep.  Prints the medians of each segment and how often
the calling thread changed CPU between calls.  Needs vLLM's kv_offload files.

    git apply benchmarks/probes/to_cache_stamps.patch && python3 setup.py build_ext --inplace
    python3 benchmarks/probes/to_cache_stamps.py [--reps 48]
    git checkout -- csrc && git clean -f csrc/common/stamps.*   # and rebuild
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SEGMENTS = ["parse+read", "checks+mark", "table", "stream", "plan_stg", "route", "dev_enter", "lane+cut",
            "job_copy", "ev_record", "wait_val", "queue", "dev_leave", "ret", "deferred_new", "staged_all",
            "total_c"]
POINTS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11), (11, 12),
          (12, 13), (13, 14), (14, 15), (8, 12), (0, 14)]
MODES = ("warm", "b2b", "idle", "idle+gpusleep", "idle+nodefer", "b2b+nodefer")
CPU = 16  # the column the patch writes the caller's CPU into


def probe(reps, calls_path):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from harness import calibrate_sleep_cycles_per_us
    from vllm.v1.kv_offload import base
    from vllm_offload import MODELS, Case

    from kvbm_ext.integrations import vllm as integration
    torch.cuda.set_device(0)
    cycles = int(300 * calibrate_sleep_cycles_per_us())
    log = []    # (label, host us, first of a batch) per to_cache call, in order
    for name, nl in MODELS.values():
        case = Case(nl, 64, torch.device("cuda", 0), integration, base)
        for direction in ("store", "load"):
            for nb in (1, 8, 64):
                stream = case.stream(direction)
                src, dst, src_ids, dst_ids = case.to_cache_args(direction, nb, slots_array=True)
                for mode in MODES:
                    for i in range(8 if mode == "warm" else reps):
                        b2b = mode.startswith("b2b")
                        if not b2b or i % 8 == 0:
                            torch.cuda.synchronize()
                            case.worker.get_finished()
                        if mode == "idle+gpusleep":
                            with torch.cuda.stream(stream):
                                torch.cuda._sleep(cycles)
                        began = time.perf_counter()
                        src.to_cache(dst, src_ids, dst_ids, stream=stream, defer=not mode.endswith("nodefer"))
                        log.append((f"{name} {direction} {nb} {mode}", (time.perf_counter() - began) * 1e6,
                                    b2b and i % 8 == 0))
                torch.cuda.synchronize()
        case.worker.shutdown()
        del case
    with open(calls_path, "w") as f:
        json.dump(log, f)


def report(calls_path, stamps_path):
    with open(calls_path) as f:
        log = json.load(f)
    with open(stamps_path) as f:
        rows = [list(map(int, line.split())) for line in f]
    if len(rows) != len(log):
        raise SystemExit(f"{len(rows)} stamped calls for {len(log)} timed ones: is the patch applied?")
    groups, moved, previous = collections.OrderedDict(), collections.Counter(), None
    for (label, us, first), row in zip(log, rows):
        moved[label] += previous is not None and row[CPU] != previous
        previous = row[CPU]
        if not (label.endswith("warm") or first):
            groups.setdefault(label, []).append((us, row))
    print(f"{'call':<34} {'CPU moved':>9} {'host us':>7} " + " ".join(f"{s[:10]:>10}" for s in SEGMENTS))
    for label, items in groups.items():
        cols = []
        for a, b in POINTS:
            deltas = [(row[b] - row[a]) / 1e3 for _, row in items if row[a] and row[b]]
            cols.append(f"{statistics.median(deltas):10.1f}" if deltas else f"{'-':>10}")
        share = 100 * moved[label] / (len(items) + 1)
        print(f"{label:<34} {share:>8.0f}% {statistics.median(u for u, _ in items):7.1f} " + " ".join(cols))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=48)
    parser.add_argument("--probe", help=argparse.SUPPRESS)   # the child's calls file
    args = parser.parse_args()
    if args.probe:
        return probe(args.reps, args.probe)
    with tempfile.TemporaryDirectory() as folder:
        calls, stamps = os.path.join(folder, "calls.json"), os.path.join(folder, "stamps.txt")
        # The stamps are written when the process ends: a child of its own.
        subprocess.run([sys.executable, __file__, "--reps", str(args.reps), "--probe", calls],
                       env={**os.environ, "KV_STAMPS": stamps}, check=True)
        report(calls, stamps)


if __name__ == "__main__":
    main()
