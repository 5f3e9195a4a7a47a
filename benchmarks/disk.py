#!/usr/bin/env python3
"""The disk tier (kvbm_ext.disk): stores and loads of Llama-3.1-70B blocks against the
same-size O_DIRECT sequential write and read of the same disk, what the checksums cost, and
a model running beside a store.

For each size (--blocks, default 64 and 512 blocks of 5.24 MB) and each source, a pool file
in --dir (default /tmp) with a slot per block:

  gpu      a vLLM cache on the GPU (per layer [num_blocks, nt, nh, 2*hd], K|V packed)
  pinned   a pinned universal pool [N, nh, nl, 2, nt, hd] (kvbm_ext.pinned_empty), the host tier
           (--device cpu: `host`, the same vLLM cache in host memory, and `pool`, unpinned)

  store    blocks 0..n-1 into slots 0..n-1: GB/s of payload from the call until its handle is
           done (the file written), median of --reps;
  load     slots 0..n-1 into blocks n..2n-1 (poisoned first, checked bit for bit after the
           first): from the call until its handle is done (the blocks written);
  dd       `dd bs=1M oflag=direct` from /dev/zero into a file beside the pool, and `dd bs=1M
           iflag=direct` back, of the same bytes, in rounds alternating with the stores and
           loads: the reference (fio at iodepth 32 too, where fio is installed).

Then: the same stores and loads with checksums off (kvbm_ext.disk's crc32c replaced by a
constant, to price them: not an option of the pool), stores with durable=True (O_DSYNC),
and crc32c alone on one core.  On a GPU, each store also says when the caller's stream was
free again (an event recorded after the call) against when the file was written.  Beside:
--gemms bf16 GEMMs of --gemm-n cubed on their own stream, timed with events (their launches
queued behind a GPU sleep, so the events time their GPU work), alone and while another
thread stores --beside-blocks blocks back to back from the GPU cache; the slowdown.

Targets (PASS / MISS): store and load >= 90 % of dd's write and read with checksums on; the
GEMMs beside stores slowed <= 2 %; the caller's stream free before the disk finishes; every
load bit-exact.  Output: a CSV, a PNG and a log in --out (default: see harness.output_dir);
the pool and dd files are deleted at the end.  The log also gives the longest NIXL call (each
holds the GIL) during the stores and loads.  See benchmarks/README.md ("disk.py").
"""

import argparse
import csv
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")    # NIXL prints INFO lines on stdout otherwise
import kvbm_ext  # noqa: E402
from kvbm_ext import disk  # noqa: E402
from figures import draw_file  # noqa: E402
from harness import (HD, NH, NL, NT, Tee, calibrate_sleep_cycles_per_us, fill_random_, int_list,  # noqa: E402
                     output_dir, run_stem)

MIB = 1 << 20
TARGET_PCT = 90.0               # store and load, % of dd's write and read of the same bytes
TARGET_SLOWDOWN_PCT = 2.0       # the GEMMs beside stores
POISON = 0x5A5A
COLUMNS = ["device", "date", "kind", "source", "blocks", "bytes", "checksums", "durable", "reps", "median_s",
           "gbs", "reference", "reference_gbs", "pct_of_reference", "stream_free_s", "verified", "note"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--blocks", type=int_list, help="blocks a call (default 64,512; cpu: 8,32)")
    parser.add_argument("--layers", type=int, help="layers of a block (default 80; cpu: 8)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per case (default 3)")
    parser.add_argument("--dir", default="/tmp", help="where the pool and dd files go (default /tmp)")
    parser.add_argument("--gemms", type=int, help="GEMMs in the model's loop (default 200; cpu: 20)")
    parser.add_argument("--gemm-n", type=int, help="GEMM size (default 8192; cpu: 512)")
    parser.add_argument("--beside-blocks", type=int, help="blocks a store beside the GEMMs (default 64; cpu: 8)")
    parser.add_argument("--quick", action="store_true", help="one rep, no checksum-off or durable rows")
    parser.add_argument("--out", help="where the CSV, PNG and log go (default: see harness.output_dir)")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = dict(blocks=[64, 512] if gpu else [8, 32], layers=NL if gpu else 8, gemms=200 if gpu else 20,
                    gemm_n=8192 if gpu else 512, beside_blocks=64 if gpu else 8)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.reps = 1
    if args.reps < 1:
        parser.error("--reps: expected a positive count")
    return args


class Run:
    def __init__(self, args, device_name, date):
        self.args, self.device_name, self.date, self.rows = args, device_name, date, []
        self.exact = True

    def row(self, **cells):
        self.rows.append({"device": self.device_name, "date": self.date, **cells})


def gbs(nbytes, seconds):
    return nbytes / seconds / 1e9


def dd(direction, path, nbytes):
    """Seconds of one dd of nbytes (1 MiB blocks, O_DIRECT), from /dev/zero into `path` or
    from `path` to /dev/null."""
    count = f"count={nbytes // MIB}"
    args = (["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"] if direction == "write"
            else [f"if={path}", "of=/dev/null", "iflag=direct"])
    start = time.perf_counter()
    subprocess.run(["dd", "bs=1M", count, *args], check=True, capture_output=True)
    return time.perf_counter() - start


def fio(direction, path, nbytes):
    """Seconds of one fio sequential job (1 MiB, O_DIRECT, libaio at iodepth 32), or None."""
    if shutil.which("fio") is None:
        return None
    start = time.perf_counter()
    subprocess.run(["fio", "--name=ref", f"--filename={path}", f"--rw={direction}", "--bs=1M", "--direct=1",
                    "--ioengine=libaio", "--iodepth=32", f"--size={nbytes}", "--output=/dev/null"], check=True,
                   capture_output=True)
    return time.perf_counter() - start


class Sources:
    """The caches blocks move from and into: 2 * max(blocks) blocks each, random bytes."""

    def __init__(self, args):
        n, self.gpu = 2 * max(args.blocks), args.device == "cuda"
        self.nl = args.layers
        shape = (n, NT, NH, 2 * HD)
        device = torch.device("cuda" if self.gpu else "cpu")
        self.layers = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(self.nl)]
        for layer in self.layers:
            fill_random_(layer, device)
        self.pool_buffer = kvbm_ext.pinned_empty((n, NH, self.nl, 2, NT, HD), "bfloat16")
        self.pool = torch.from_dlpack(self.pool_buffer)
        # The blocks stored are random; those loaded into are poisoned before each load.
        for block in self.pool[:n // 2]:
            fill_random_(block, device)     # on the GPU where there is one: quicker than the host's RNG
        self.caches = {("gpu" if self.gpu else "host"): (kvbm_ext.PagedKVCache(self.layers, "bth(kd)"), self.layers),
                       ("pinned" if self.gpu else "pool"): (kvbm_ext.PagedKVCache(self.pool, "bhlktd"), [self.pool])}
        if self.gpu:
            torch.cuda.synchronize()

    @staticmethod
    def poison(memory, n):
        for m in memory:
            m[n:2 * n].view(torch.int16).fill_(POISON)

    @staticmethod
    def loaded_exactly(memory, n):
        return all(torch.equal(m[n:2 * n].view(torch.int16), m[:n].view(torch.int16)) for m in memory)


def stream_free(store, gpu):
    """Calls store(); (handle, None) on the host, else (handle, (seconds until the caller's
    stream passed the call, whether the store was still writing the file then)): an event
    recorded right after the call, polled until it completes."""
    if not gpu:
        return store(), None
    start = time.perf_counter()
    h = store()
    marker = torch.cuda.Event()
    marker.record()
    while not marker.query():
        time.sleep(20e-6)
    return h, (time.perf_counter() - start, not h.done())


def timed(call):
    """(handle, seconds from the call until its handle is done)."""
    start = time.perf_counter()
    h = call()
    h.wait(600)
    return h, time.perf_counter() - start


def measure_source(run, pool, source, sources, n, dd_path, checksums=True, durable=False):
    """Stores and loads of n blocks of one source, alternating with dd writes and reads."""
    args, gpu = run.args, sources.gpu and source == "gpu"
    cache, memory = sources.caches[source]
    nbytes = n * pool.slot_bytes
    ids, slots, back = list(range(n)), list(range(n)), list(range(n, 2 * n))
    stores, loads, frees, writes, reads, verified = [], [], [], [], [], True
    pool.store(cache, ids, slots).wait(600)                 # a warm-up: the slots' extents are written once
    for rep in range(args.reps):
        start = time.perf_counter()
        h, free = stream_free(lambda: pool.store(cache, ids, slots), gpu)
        h.wait(600)
        stores.append(time.perf_counter() - start)
        if free is not None:
            frees.append(free)
        if durable:
            continue
        if checksums:
            writes.append(dd("write", dd_path, nbytes))
        sources.poison(memory, n)
        _, seconds = timed(lambda: pool.load(slots, cache, back))
        loads.append(seconds)
        if rep == 0:
            verified = sources.loaded_exactly(memory, n)
            run.exact = run.exact and verified
        if checksums:
            reads.append(dd("read", dd_path, nbytes))
    rows = {}
    for kind, samples, ref_kind, ref in (("store", stores, "dd write", writes), ("load", loads, "dd read", reads)):
        if durable and kind == "load":
            continue
        median = statistics.median(samples)
        ref_gbs = gbs(nbytes, statistics.median(ref)) if ref else None
        pct = 100 * gbs(nbytes, median) / ref_gbs if ref_gbs else None
        free_s = statistics.median(f for f, _ in frees) if kind == "store" and frees else None
        run.row(kind=kind, source=source, blocks=n, bytes=nbytes, checksums="on" if checksums else "off",
                durable=durable, reps=len(samples), median_s=f"{median:.4f}", gbs=f"{gbs(nbytes, median):.3f}",
                reference=ref_kind if ref else "", reference_gbs=f"{ref_gbs:.3f}" if ref_gbs else "",
                pct_of_reference=f"{pct:.1f}" if pct else "",
                stream_free_s=f"{free_s:.4f}" if free_s is not None else "",
                verified=verified if kind == "load" else "",
                note="stream free before the file was written" if kind == "store" and frees and all(
                    ok for _, ok in frees) else "")
        rows[kind] = (gbs(nbytes, median), ref_gbs, pct, free_s, frees if kind == "store" else [])
        what = f"{kind:5s} {source:6s} {n:4d} blocks ({nbytes / 1e6:.0f} MB), checksums {'on ' if checksums else 'off'}" \
               f"{', durable' if durable else ''}: {gbs(nbytes, median):6.2f} GB/s"
        if ref_gbs:
            spread = "-".join(f"{gbs(nbytes, t):.2f}" for t in (max(ref), min(ref)))
            what += f"  ({ref_kind} {ref_gbs:.2f} GB/s, {spread} over {len(ref)}: {pct:.0f} %)"
        if free_s is not None:
            what += f"; caller's stream free after {free_s * 1e3:.1f} ms"
        if kind == "load":
            what += f"; bit-exact {verified}"
        print(what, flush=True)
    return rows


def measure_fio(run, n, nbytes, dd_path):
    for direction, label in (("write", "fio write"), ("read", "fio read")):
        samples = [fio(direction, dd_path, nbytes) for _ in range(run.args.reps)]
        if samples[0] is None:
            print("fio: not installed, no fio reference", flush=True)
            return
        median = statistics.median(samples)
        run.row(kind=label, source="", blocks=n, bytes=nbytes, reps=len(samples), median_s=f"{median:.4f}",
                gbs=f"{gbs(nbytes, median):.3f}", note="1 MiB, O_DIRECT, libaio, iodepth 32")
        print(f"{label:10s} {n:4d} blocks: {gbs(nbytes, median):6.2f} GB/s (1 MiB, iodepth 32)", flush=True)


class EngineCalls:
    """The seconds of every NIXL call the pool makes (post, poll) while it is installed: NIXL's
    Python calls hold the GIL, so the longest is the longest a Python thread beside the
    pool can be kept waiting by it."""

    def __init__(self):
        self.seconds, self.real = [], {name: getattr(disk._Engine, name) for name in ("post", "done")}
        for name, real in self.real.items():
            setattr(disk._Engine, name, self.timed(real))

    def timed(self, real):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)
        return call

    def report(self, run):
        for name, real in self.real.items():
            setattr(disk._Engine, name, real)
        if not self.seconds:
            return
        ordered = sorted(self.seconds)
        longest, p99 = ordered[-1], ordered[int(0.99 * (len(ordered) - 1))]
        run.row(kind="engine call", source="", reps=len(ordered), median_s=f"{statistics.median(ordered):.6f}",
                note=f"longest {longest * 1e3:.2f} ms, p99 {p99 * 1e3:.3f} ms (NIXL holds the GIL)")
        print(f"NIXL calls (post, poll) during the stores and loads: {len(ordered)}, longest {longest * 1e3:.2f} ms, "
              f"p99 {p99 * 1e3:.3f} ms (each holds the GIL)", flush=True)


def measure_crc(run, slot_bytes):
    block = torch.empty(slot_bytes, dtype=torch.uint8)
    fill_random_(block.view(torch.int16), torch.device("cpu"))
    array = block.numpy()
    kvbm_ext.crc32c(array)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(16):
            kvbm_ext.crc32c(array)
        samples.append(time.perf_counter() - start)
    rate = gbs(16 * slot_bytes, statistics.median(samples))
    run.row(kind="crc32c", source="", blocks=16, bytes=16 * slot_bytes, reps=5,
            median_s=f"{statistics.median(samples):.4f}", gbs=f"{rate:.3f}", note="one core")
    print(f"crc32c alone, one core: {rate:.2f} GB/s", flush=True)


def measure_beside(run, pool, sources):
    """The GEMM loop alone and beside stores run back to back from another thread."""
    args, gpu = run.args, sources.gpu
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(args.gemm_n, args.gemm_n, device=device, dtype=dtype)
    b, c = torch.randn_like(a), torch.empty_like(a)
    model = torch.cuda.Stream() if gpu else None
    # The launches queue behind a GPU sleep, so the events time the GEMMs' GPU work alone.
    hide = int(20e3 * calibrate_sleep_cycles_per_us(model)) if gpu else 0
    source = "gpu" if gpu else "host"
    cache, _ = sources.caches[source]
    n = min(args.beside_blocks, pool.num_slots)
    ids = list(range(n))

    def loop():
        if not gpu:
            start = time.perf_counter()
            for _ in range(args.gemms):
                torch.mm(a, b, out=c)
            return time.perf_counter() - start
        with torch.cuda.stream(model):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(hide)
            start.record()
            for _ in range(args.gemms):
                torch.mm(a, b, out=c)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    loop()
    stop, stored, failed = threading.Event(), [], []

    def storing():
        stream = torch.cuda.Stream() if gpu else None
        try:
            while not stop.is_set():
                if gpu:
                    with torch.cuda.stream(stream):
                        h = pool.store(cache, ids, ids)
                else:
                    h = pool.store(cache, ids, ids)
                h.wait(600)
                stored.append(h.nbytes)
        except BaseException as error:  # noqa: BLE001 - raised in the main thread
            failed.append(error)

    alone, beside = [], []
    for _ in range(max(3, args.reps)):
        alone.append(loop())
        thread = threading.Thread(target=storing)
        thread.start()
        while not stored and not failed:
            time.sleep(0.001)
        beside.append(loop())
        stop.set()
        thread.join()
        if failed:
            raise failed[0]
        stop.clear()
        stored.clear()
    slowdown = 100 * (statistics.median(beside) / statistics.median(alone) - 1)
    what = f"{args.gemms} GEMMs {args.gemm_n}^3 {str(dtype).removeprefix('torch.')}"
    run.row(kind="gemm alone", source="", blocks=0, reps=len(alone), median_s=f"{statistics.median(alone):.4f}",
            note=what)
    run.row(kind="gemm beside stores", source=source, blocks=n, reps=len(beside),
            median_s=f"{statistics.median(beside):.4f}", pct_of_reference=f"{100 + slowdown:.1f}",
            reference="gemm alone", note=f"{what}; slowed {slowdown:+.1f} %")
    print(f"{what}: {statistics.median(alone) * 1e3:.1f} ms alone, {statistics.median(beside) * 1e3:.1f} ms beside "
          f"stores of {n} blocks: slowed {slowdown:+.1f} %", flush=True)
    return slowdown


def judge(run, results, slowdown):
    print("\ntargets:")
    ok = True
    for (source, n, kind), (rate, ref, pct, free_s, frees) in sorted(results.items()):
        if pct is None:
            continue
        passed = pct >= TARGET_PCT
        ok = ok and passed
        print(f"  {kind} {source} {n} blocks >= {TARGET_PCT:.0f} % of dd: {pct:.0f} % {'PASS' if passed else 'MISS'}")
        if frees:
            free = all(f for _, f in frees)
            print(f"  {kind} {source} {n} blocks: the caller's stream free before the file was written: "
                  f"{'PASS' if free else 'MISS'} ({free_s * 1e3:.1f} ms)")
    passed = slowdown <= TARGET_SLOWDOWN_PCT
    print(f"  GEMMs beside stores slowed <= {TARGET_SLOWDOWN_PCT:.0f} %: {slowdown:+.1f} % {'PASS' if passed else 'MISS'}")
    print(f"  every load bit-exact: {'yes' if run.exact else 'NO'}")
    return ok and passed and run.exact


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        from kvbm_ext._no_gpu import require_gpu

        require_gpu("disk")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    stem = run_stem(output_dir(args.out, "disk"), "disk", device_name, date)
    started = time.monotonic()
    run = Run(args, device_name, date)
    pool_path = os.path.join(args.dir, f"kvbm-disk-bench-{os.getpid()}.pool")
    dd_path = os.path.join(args.dir, f"kvbm-disk-bench-{os.getpid()}.dd")
    with open(stem + ".log", "w") as log:
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
        try:
            if args.device == "cuda":
                kvbm_ext.reserve_staging()
            sources = Sources(args)
            like = sources.caches["gpu" if sources.gpu else "host"][0]
            most = max(args.blocks)
            bounce = most * (4096 + args.layers * 2 * NT * NH * HD * 2)     # a header and a payload a slot
            pool = disk.DiskPool(pool_path, most, like, create=True, bounce_bytes=bounce)
            free = shutil.disk_usage(args.dir)
            print(f"device={device_name} torch={torch.__version__} kvbm_ext={kvbm_ext.__version__} "
                  f"({os.path.dirname(kvbm_ext.__file__)}); {os.cpu_count()} CPUs", flush=True)
            print(f"pool: {pool.path}, {most} slots of {pool.slot_bytes} bytes ({args.layers} layers), "
                  f"{'O_DIRECT' if pool.direct else 'buffered: ' + pool.direct_reason}, {pool.engine}; GDS: "
                  f"{pool.gds}; {args.dir}: {free.free / 1e9:.0f} GB free\n", flush=True)
            with open(dd_path, "wb"):
                pass
            dd("write", dd_path, most * pool.slot_bytes)            # the reference file's blocks, allocated once
            results = {}
            calls = EngineCalls()
            for n in args.blocks:
                for source in sources.caches:
                    for kind, row in measure_source(run, pool, source, sources, n, dd_path).items():
                        results[(source, n, kind)] = row
                measure_fio(run, n, n * pool.slot_bytes, dd_path)
            calls.report(run)
            if not args.quick:
                real = disk.crc32c
                disk.crc32c = lambda data, value=0: 0
                try:
                    for n in args.blocks:
                        measure_source(run, pool, next(iter(sources.caches)), sources, n, dd_path, checksums=False)
                finally:
                    disk.crc32c = real
                pool.close()
                pool = disk.DiskPool(pool_path, durable=True, bounce_bytes=bounce)
                measure_source(run, pool, next(iter(sources.caches)), sources, most, dd_path, durable=True)
            measure_crc(run, pool.slot_bytes)
            slowdown = measure_beside(run, pool, sources)
            pool.close()
            passed = judge(run, results, slowdown)
            with open(stem + ".csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
                writer.writeheader()
                writer.writerows(run.rows)
            pngs, no_png = draw_file(stem + ".csv")
            print(f"\n{time.monotonic() - started:.0f} s ({'all targets met' if passed else 'a target missed'})")
            print(f"CSV: {stem}.csv")
            for png in pngs or [no_png]:
                print(f"PNG: {png}")
            print(f"log: {stem}.log")
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            for path in (pool_path, dd_path):
                if os.path.exists(path):
                    os.remove(path)
    return 0 if run.exact else 1


if __name__ == "__main__":
    sys.exit(main())
