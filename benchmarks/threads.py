"""Calls per second from several threads: small host-to-host PagedKVCache moves.

    python3 benchmarks/threads.py [--threads 1,2] [--seconds 2] [--rounds 5] [--cache shared]

Each thread moves one block (nb = 1) of a small host cache to a universal block of its own
and back (to_universal, then from_universal, into blocks no other thread touches), as fast
as it can, for --seconds; a round runs each thread count in turn, and the figure is each
count's median over --rounds of the calls per second of all its threads together.  The
blocks are small (a few KiB), so a call's time is its host work (reading and checking
arguments) more than its copy: with a GIL, threads take turns for nearly all of it; on
free-threaded CPython they run in parallel.  --cache shared: one cache that every thread
moves blocks of (the serving worker's case); private: a cache per thread.  The moved bytes
are checked against NumPy after the timing.

Columns: calls per second (median, min and max over the rounds) and the median over the
rounds of its ratio to the first thread count's in the same round; calls per CPU-second of
the threads (the same for every count when threads do not slow each other down); the CPUs
the threads got (fewer than the count on a busy machine); and "bare loop": the same loop
with len() in place of the two calls, timed in every round too, whose ratio is what the
interpreter itself scales to on the machine at the time.  NumPy only (no torch): it runs on free-threaded interpreters, whose
torch wheels may be missing.  The log goes to stdout; benchmarks/results/ keeps runs
(threads-<cpu>-<date>.log).
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import sysconfig
import threading
import time

# NumPy's BLAS threads have nothing to do here: keep them off the CPUs the timed threads need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import kvbm_ext  # noqa: E402

# A small cache: nl layers of [no, num_blocks, nt, nh, hd] ("kbthd"), float16; a block of
# every layer is NL * NO * NT * NH * HD * 2 bytes.
NL, NO, NT, NH, HD = 4, 2, 4, 2, 16
BLOCKS_PER_THREAD = 8


def cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def gil_state():
    enabled = getattr(sys, "_is_gil_enabled", lambda: True)()
    build = "free-threaded build" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL build"
    return f"{build}, GIL {'enabled' if enabled else 'disabled'}"


def make_cache(num_blocks, rng):
    layers = [rng.integers(0, 2**16, (NO, num_blocks, NT, NH, HD), dtype=np.uint16).view(np.float16)
              for _ in range(NL)]
    return kvbm_ext.PagedKVCache(layers, "kbthd"), layers


class Worker:
    """One thread's blocks: `ids` of `cache`, and a universal block of its own."""

    def __init__(self, cache, layers, first_block, rng):
        self.cache, self.layers = cache, layers
        self.ids = [first_block + int(i) for i in rng.permutation(BLOCKS_PER_THREAD)]
        self.universal = np.empty((1, NH, NL, NO, NT, HD), np.float16)     # nb = 1
        self.calls, self.cpu_s = 0, 0.0

    def run(self, start, stop_at, bare):
        """Moves blocks until stop_at; `bare`: the same loop with len() for the two calls."""
        start.wait()
        calls, cache, universal = 0, self.cache, self.universal
        cpu_start = time.thread_time()
        while time.perf_counter() < stop_at:
            block = [self.ids[calls // 2 % BLOCKS_PER_THREAD]]
            if bare:
                len(block), len(universal)
            else:
                cache.to_universal(block, universal)
                cache.from_universal(universal, block)
            calls += 2
        self.calls, self.cpu_s = calls, time.thread_time() - cpu_start

    def check(self):
        """The last round's universal block holds the cache's block, bitwise (NumPy permute)."""
        block = self.ids[(self.calls - 2) // 2 % BLOCKS_PER_THREAD]
        expected = np.stack([layer[:, block] for layer in self.layers])      # [nl, no, nt, nh, hd]
        expected = expected.transpose(3, 0, 1, 2, 4)                         # [nh, nl, no, nt, hd]
        if not np.array_equal(expected.view(np.uint16), self.universal[0].view(np.uint16)):
            raise SystemExit(f"wrong bytes in block {block}'s universal copy")


def workers_for(count, shared, rng):
    if shared:
        cache, layers = make_cache(count * BLOCKS_PER_THREAD, rng)
        return [Worker(cache, layers, k * BLOCKS_PER_THREAD, rng) for k in range(count)]
    return [Worker(*make_cache(BLOCKS_PER_THREAD, rng), 0, rng) for _ in range(count)]


def calls_per_second(workers, seconds, bare=False):
    """Calls per second of all threads together, calls per CPU-second of the threads, and
    the CPUs they got (their CPU seconds per second)."""
    start = threading.Barrier(len(workers) + 1)
    stop_at = time.perf_counter() + seconds + 0.05
    threads = [threading.Thread(target=w.run, args=(start, stop_at, bare)) for w in workers]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    for w in workers:
        if not bare:
            w.check()
    calls, cpu_s = sum(w.calls for w in workers), sum(w.cpu_s for w in workers)
    return calls / elapsed, calls / cpu_s, cpu_s / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per count and round (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    parser.add_argument("--cache", choices=("shared", "private"), default="shared")
    args = parser.parse_args()
    counts = [int(c) for c in args.threads.split(",")]
    rng = np.random.default_rng(20261124)
    pools = {c: workers_for(c, args.cache == "shared", rng) for c in counts}

    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {datetime.date.today()}")
    print(f"# Python {platform.python_version()} ({gil_state()}), NumPy {np.__version__}, "
          f"kvbm_ext {kvbm_ext.__version__} ({'CPU-only build' if kvbm_ext.is_using_stubs() else 'CUDA build'})")
    print(f"# PagedKVCache to_universal + from_universal, nb = 1, {NL * NO * NT * NH * HD * 2} bytes a block, "
          f"{args.cache} cache, {args.seconds:g} s x {args.rounds} rounds")
    runs, bare = {c: [] for c in counts}, {c: [] for c in counts}
    for _ in range(args.rounds):
        for c in counts:
            runs[c].append(calls_per_second(pools[c], args.seconds))
            bare[c].append(calls_per_second(pools[c], args.seconds / 4, bare=True)[0])
    first = counts[0]
    print(f"{'threads':>7}  {'calls/s median':>14}  {'min':>9}  {'max':>9}  {'vs ' + str(first):>6}  "
          f"{'calls/CPU-s':>11}  {'CPUs used':>9}  {'bare loop vs ' + str(first):>16}")
    for c in counts:
        rates = [rate for rate, _, _ in runs[c]]
        # Ratios within each round, whose counts ran seconds apart: a slow spell of the
        # machine falls on both sides of a ratio.
        ratios = [rate / runs[first][r][0] for r, rate in enumerate(rates)]
        bare_ratios = [b / bare[first][r] for r, b in enumerate(bare[c])]
        per_cpu = statistics.median(p for _, p, _ in runs[c])
        cpus = statistics.median(u for _, _, u in runs[c])
        print(f"{c:>7}  {statistics.median(rates):>14,.0f}  {min(rates):>9,.0f}  {max(rates):>9,.0f}  "
              f"{statistics.median(ratios):>5.2f}x  {per_cpu:>11,.0f}  {cpus:>9.2f}  "
              f"{statistics.median(bare_ratios):>15.2f}x")
        if c != first:
            rounds = ", ".join(f"{k:.2f}/{b:.2f}" for k, b in zip(ratios, bare_ratios))
            print(f"         each round, calls / bare loop vs {first}: {rounds}")


if __name__ == "__main__":
    main()
