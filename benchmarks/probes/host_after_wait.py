"""How fast the host runs right after the calling thread waited: the same fixed piece of
host work (Python and NumPy only: no kvbm_ext, no CUDA call inside it) timed back to back,
and right after waits of several lengths, each of four kinds: torch.cuda.synchronize()
behind a GPU sleep (what a benchmark does before timing one submission), the same behind
a copy from device memory into pinned host memory that lasts as long (what a store job
ends with: the copy engines writing host memory), time.sleep (the thread off the CPU),
and a busy loop on the CPU.  Where the work after a wait is slower than back to back, and
slower the longer the wait, a submission timed there measures the machine's wake-up (or
its caches refilling), not the submission.  Medians of --reps.

    python3 benchmarks/probes/host_after_wait.py [--reps 64]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from harness import calibrate_sleep_cycles_per_us, spin_us  # noqa: E402

WAITS_US = (0, 100, 1000, 5000)
PCIE_BYTES_PER_US = 50_000      # near an H200's pinned copy rate: sizes the copy to the wait


def make_work():
    ids = list(range(1000, 1064))
    table = np.zeros(64 * 80, dtype=np.uint64)
    lookup = {i: i * 3 for i in range(256)}

    def work():
        # A submission's kind of host work: ids read into an array, a table filled, dict
        # and attribute lookups; about 10-20 us back to back.
        a = np.asarray(ids, dtype=np.int64)
        table[: a.size] = a
        total = 0
        for i in ids:
            total += lookup[i & 255]
        return total + int(table[:64].sum())
    return work


def timed(work, before, reps):
    samples = []
    for _ in range(reps):
        before()
        began = time.perf_counter()
        work()
        samples.append((time.perf_counter() - began) * 1e6)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=64)
    args = parser.parse_args()
    cycles_per_us = calibrate_sleep_cycles_per_us()
    work = make_work()
    for _ in range(200):
        work()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"host us of the same work, medians of {args.reps}")
    device_bytes = torch.empty(max(WAITS_US) * PCIE_BYTES_PER_US, dtype=torch.uint8, device="cuda")
    host_bytes = torch.empty_like(device_bytes, device="cpu", pin_memory=True)
    print(f"{'wait us':>8} {'after GPU sleep + synchronize':>30} {'after a copy to pinned + synchronize':>37} "
          f"{'after time.sleep':>17} {'after a busy loop':>18}")
    for wait in WAITS_US:
        def gpu_wait():
            if wait:
                torch.cuda._sleep(int(wait * cycles_per_us))
            torch.cuda.synchronize()

        def copy_wait():
            n = wait * PCIE_BYTES_PER_US
            if n:
                host_bytes[:n].copy_(device_bytes[:n], non_blocking=True)
            torch.cuda.synchronize()
        row = [timed(work, gpu_wait, args.reps),
               timed(work, copy_wait, args.reps),
               timed(work, lambda: time.sleep(wait * 1e-6), args.reps),
               timed(work, lambda: spin_us(wait), args.reps)]
        print(f"{wait:>8} {row[0]:>30.1f} {row[1]:>37.1f} {row[2]:>17.1f} {row[3]:>18.1f}")


if __name__ == "__main__":
    main()
