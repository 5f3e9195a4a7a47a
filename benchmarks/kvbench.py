#!/usr/bin/env python3
"""Benchmark kvbm_ext block <-> universal conversions on a Llama-3.1-70B KV cache.

Profile: nl=80 layers, no=2 (K, V), nh=8 KV heads, hd=128, bf16.  Blocks are held
vLLM-style: one cache tensor per layer shaped [no, num_blocks, *chunk] and each block is
passed as the list of its nl*no chunk views ([nt, nh, hd] for NHD, [nh, nt, hd] for HND).
Universals are separate contiguous tensors [nh, nl, no, nt, hd].

GPU mode times both directions with every array on the device ("d2d") and with the
universals in pinned host memory ("pinned"), next to copy ceilings measured in the same
run, then runs a small CPU section.  CPU mode times the host implementation against a
single-threaded memcpy of the same bytes.  Every case is checked bit for bit against a
pure-torch reference before it is timed.  See benchmarks/README.md.
"""

import argparse
import csv
import datetime
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402

NL, NO, NH, HD = 80, 2, 8, 128          # Llama-3.1-70B KV cache
DTYPE = torch.bfloat16
DIRECTIONS = ("b2u", "u2b")             # block_to_universal, universal_to_block
PLACEMENTS = ("d2d", "pinned")

MIB = 1 << 20
GPU_L2_FALLBACK = 60 * MIB
CPU_L3_FALLBACK = 32 * MIB
CACHE_MULTIPLE = 3                      # rotate buffers until the working set is 3x the cache
MAX_SETS = 64
SLEEP_FACTOR = 2.0                      # GPU sleep before a timed call, in units of its host time
SLEEP_MARGIN_US = 20.0

COLUMNS = [
    "gpu_name", "date", "mode", "direction", "placement", "layout", "nt", "nb", "bytes",
    "gpu_us", "host_us", "gbps", "ceiling_gbps", "pct_of_ceiling", "ratio_vs_memcpy",
    "reps", "sets", "uncovered_reps", "status",
]

RNG = np.random.default_rng()


# ----------------------------------------------------------------------------- arguments

def int_list(text):
    """argparse type: comma-separated positive integers."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,64, got {text!r}")
    return values


def layout_list(text):
    """argparse type: comma-separated layouts out of NHD, HND."""
    values = [part.strip().upper() for part in text.split(",") if part.strip()]
    if not values or any(v not in ("NHD", "HND") for v in values):
        raise argparse.ArgumentTypeError(f"expected layouts out of NHD,HND, got {text!r}")
    return values


def parse_args():
    parser = argparse.ArgumentParser(
        description="Time kvbm_ext block_to_universal / universal_to_block on a "
                    "Llama-3.1-70B KV cache (nl=80 no=2 nh=8 hd=128 bf16).")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: GPU cases, copy ceilings and a small CPU section; "
                             "cpu: CPU cases only; auto (default): cuda when available")
    parser.add_argument("--nt", type=int_list, default=[16, 32],
                        help="tokens per block for GPU cases (default 16,32)")
    parser.add_argument("--nb", type=int_list, default=[1, 8, 64, 256],
                        help="blocks per call for GPU cases (default 1,8,64,256)")
    parser.add_argument("--layouts", type=layout_list, default=["NHD"],
                        help="chunk layouts, NHD and/or HND (default NHD)")
    parser.add_argument("--cpu-nt", type=int_list, default=[16],
                        help="tokens per block for CPU cases (default 16)")
    parser.add_argument("--cpu-nb", type=int_list, default=[1, 8],
                        help="blocks per call for CPU cases (default 1,8)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="timing budget per case in ms, sets the repetitions "
                             "(default 300, 20 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: GPU nt 16, nb 1,8, few repetitions, small ceilings")
    parser.add_argument("--csv", default=None,
                        help="CSV file or existing directory to write into "
                             "(default benchmarks/results/kvbench-<gpu>-<date>.csv)")
    args = parser.parse_args()
    if args.quick:
        args.nt, args.nb = [16], [1, 8]
    if args.target_ms is None:
        args.target_ms = 20.0 if args.quick else 300.0
    return args


@dataclass
class RepPolicy:
    """How many repetitions a case gets: target_s of timing, within [min_reps, max_reps]."""
    target_s: float
    min_reps: int
    max_reps: int

    def reps_for(self, seconds_per_rep):
        wanted = int(self.target_s / max(seconds_per_rep, 1e-7))
        return max(self.min_reps, min(self.max_reps, wanted))


def rep_policy(args):
    if args.quick:
        return RepPolicy(args.target_ms / 1e3, 3, 10)
    return RepPolicy(args.target_ms / 1e3, 5, 200)


# ----------------------------------------------------------------------------- data

def block_bytes(nt):
    return NL * NO * nt * NH * HD * DTYPE.itemsize


def chunk_shape(nt, layout):
    return (nt, NH, HD) if layout == "NHD" else (NH, nt, HD)


def fill_random_(tensor, gen_device):
    """Overwrite tensor with random bits (every pattern, NaNs included), generated on gen_device."""
    bits = tensor.view(torch.int16)
    if gen_device.type == "cuda":
        fresh = torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int16, device=gen_device)
    else:
        fresh = torch.from_numpy(RNG.integers(-2**15, 2**15, size=bits.shape, dtype=np.int16))
    bits.copy_(fresh)


def make_layer_caches(nt, num_blocks, layout, device, gen_device):
    """vLLM-style block stack: one cache [no, num_blocks, *chunk] per layer, random filled."""
    caches = []
    for _ in range(NL):
        cache = torch.empty((NO, num_blocks) + chunk_shape(nt, layout), dtype=DTYPE, device=device)
        fill_random_(cache, gen_device)
        caches.append(cache)
    return caches


def make_universals(nt, num_blocks, device, pin, gen_device):
    """num_blocks universals [nh, nl, no, nt, hd] in one random-filled allocation."""
    universals = torch.empty((num_blocks, NH, NL, NO, nt, HD), dtype=DTYPE, device=device,
                             pin_memory=pin)
    fill_random_(universals, gen_device)
    return universals


def block_views(caches, block_ids):
    """The `blocks` argument: per block, its nl*no chunk views in [layer][outer] order."""
    return [[caches[l][o, b] for l in range(NL) for o in range(NO)] for b in block_ids]


def rotation_sets(working_set_bytes, cache_bytes):
    """Buffer sets to rotate through so repeated calls do not run out of the cache."""
    return max(1, min(MAX_SETS, math.ceil(CACHE_MULTIPLE * cache_bytes / working_set_bytes)))


def split_sets(caches, universals, nb, nsets):
    """Per rotation set s: (blocks, universals) over block ids [s*nb, (s+1)*nb)."""
    sets = []
    for s in range(nsets):
        ids = range(s * nb, (s + 1) * nb)
        sets.append((block_views(caches, ids), list(universals[s * nb:(s + 1) * nb].unbind(0))))
    return sets


# ----------------------------------------------------------------------------- correctness

def reference_universal(chunks, layout):
    """Pure-torch universal [nh, nl, no, nt, hd] of one block's chunks."""
    stacked = torch.stack(chunks)
    stacked = stacked.view((NL, NO) + tuple(stacked.shape[1:]))
    order = (3, 0, 1, 2, 4) if layout == "NHD" else (2, 0, 1, 3, 4)
    return stacked.permute(order)


def checked_ids(nb):
    """Blocks verified per case: first, middle, last."""
    return sorted({0, nb // 2, nb - 1})


def poison_destination(direction, blocks, universals, ids, gen_device):
    """Fresh random bits in the destination of the checked blocks, so unwritten bytes show."""
    for b in ids:
        for tensor in (universals[b],) if direction == "b2u" else blocks[b]:
            fill_random_(tensor, gen_device)


def matches_reference(blocks, universals, layout, ids):
    """Bitwise: universal[h,l,o,t,:] == chunk[l*no+o][t,h,:] (NHD) for the checked blocks."""
    for b in ids:
        expected = reference_universal(blocks[b], layout).view(torch.int16)
        actual = universals[b].to(expected.device).view(torch.int16)
        if not torch.equal(actual, expected):
            return False
    return True


def make_call(direction, blocks, universals, layout, stream):
    if direction == "b2u":
        return lambda: kvbm_ext.block_to_universal(blocks, universals, layout, stream=stream)
    return lambda: kvbm_ext.universal_to_block(universals, blocks, layout, stream=stream)


def verify_case(direction, blocks, universals, layout, stream, gen_device, synchronize):
    """Poison, run once, compare a few blocks with the reference. Returns True when exact."""
    ids = checked_ids(len(blocks))
    poison_destination(direction, blocks, universals, ids, gen_device)
    synchronize()
    make_call(direction, blocks, universals, layout, stream)()
    synchronize()
    return matches_reference(blocks, universals, layout, ids)


# ----------------------------------------------------------------------------- timing

@dataclass
class Timing:
    host_us: float
    gpu_us: float        # nan on the CPU path, or when no repetition hid the host time
    reps: int
    uncovered: int       # GPU repetitions dropped because the host outran the sleep


def cuda_synchronize():
    torch.cuda.synchronize()


def no_synchronize():
    pass


def wall_seconds(call, synchronize):
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    return time.perf_counter() - start


def median_host_us(calls, reps, synchronize):
    """Median host time of a call; synchronization stays outside the measured region."""
    samples = []
    for i in range(reps):
        synchronize()
        start = time.perf_counter()
        calls[i % len(calls)]()
        samples.append(time.perf_counter() - start)
    synchronize()
    return statistics.median(samples) * 1e6


def calibrate_sleep_cycles_per_us():
    """GPU clock cycles per microsecond of torch.cuda._sleep, from events around one sleep."""
    cycles = 20_000_000
    torch.cuda._sleep(1_000_000)
    samples = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return cycles / statistics.median(samples)


def median_gpu_us(calls, reps, sleep_us, cycles_per_us):
    """Median CUDA-event time of a call.  A GPU sleep enqueued first keeps the stream busy
    while the host prepares the call, so the events bracket only the GPU work.  Repetitions
    whose host time outran the sleep are dropped, counted, and retried with twice the sleep
    (at most 3 * reps attempts in all)."""
    samples, uncovered = [], 0
    for attempt in range(3 * reps):
        if len(samples) == reps:
            break
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_us * cycles_per_us))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        start.record()
        calls[attempt % len(calls)]()
        end.record()
        if (time.perf_counter() - host_start) * 1e6 < sleep_us:
            samples.append((start, end))
        else:
            uncovered += 1
            sleep_us *= 2
    torch.cuda.synchronize()
    if not samples:
        return math.nan, uncovered
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in samples), uncovered


def time_gpu_calls(calls, policy, cycles_per_us):
    """Warm up, pick repetitions, then host time and GPU time of the calls (rotating)."""
    reps = policy.reps_for(3 * wall_seconds(calls[0], cuda_synchronize))
    host_us = median_host_us(calls, reps, cuda_synchronize)
    sleep_us = SLEEP_FACTOR * host_us + SLEEP_MARGIN_US
    gpu_us, uncovered = median_gpu_us(calls, reps, sleep_us, cycles_per_us)
    return Timing(host_us, gpu_us, reps, uncovered)


def time_cpu_calls(calls, policy):
    """Warm up, pick repetitions, then the median wall time of the calls (rotating)."""
    reps = policy.reps_for(wall_seconds(calls[0], no_synchronize))
    return Timing(median_host_us(calls, reps, no_synchronize), math.nan, reps, 0)


# ----------------------------------------------------------------------------- rows

@dataclass
class Context:
    gpu_name: str
    date: str
    policy: RepPolicy


def gbps(nbytes, us):
    return nbytes / (us * 1e3) if us and not math.isnan(us) else math.nan


def make_row(ctx, **fields):
    row = {column: "" for column in COLUMNS}
    row.update(gpu_name=ctx.gpu_name, date=ctx.date, status="ok")
    row.update(fields)
    return row


def fmt(value, digits=1):
    if value == "" or value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def print_progress(row):
    figures = [(row["gpu_us"], "us gpu"), (row["host_us"], "us host"), (row["gbps"], "GB/s"),
               (row["pct_of_ceiling"], "% of ceiling")]
    shown = ", ".join(f"{fmt(value)} {unit}" for value, unit in figures if value != "")
    print(f"  {row['mode']:7} {row['direction']:4} {row['placement']:6} {row['layout']:3} "
          f"nt={row['nt']} nb={row['nb']}: {shown} [{row['status']}]", flush=True)


# ----------------------------------------------------------------------------- ceilings

def measure_ceilings(ctx, device, quick, cycles_per_us):
    """Copy ceilings: device-to-device (bytes read + written), pinned H2D and D2H."""
    d2d_bytes = (256 if quick else 2048) * MIB
    host_bytes = (64 if quick else 1024) * MIB
    rows = {}

    src = torch.empty(d2d_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fill_random_(src, device)
    fill_random_(dst, device)
    timing = time_gpu_calls([lambda: dst.copy_(src, non_blocking=True)], ctx.policy, cycles_per_us)
    rows["d2d"] = ceiling_row(ctx, "d2d", "device", d2d_bytes, 2 * d2d_bytes, timing)
    del src, dst

    pinned = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)
    fill_random_(pinned, device)
    fill_random_(dev, device)
    timing = time_gpu_calls([lambda: dev.copy_(pinned, non_blocking=True)], ctx.policy, cycles_per_us)
    rows["h2d"] = ceiling_row(ctx, "h2d", "pinned", host_bytes, host_bytes, timing)
    timing = time_gpu_calls([lambda: pinned.copy_(dev, non_blocking=True)], ctx.policy, cycles_per_us)
    rows["d2h"] = ceiling_row(ctx, "d2h", "pinned", host_bytes, host_bytes, timing)
    del pinned, dev
    torch.cuda.empty_cache()
    return rows


def ceiling_row(ctx, direction, placement, nbytes, counted_bytes, timing):
    """nbytes: buffer size; counted_bytes: what the bandwidth counts (read + written for d2d)."""
    row = make_row(ctx, mode="ceiling", direction=direction, placement=placement,
                   bytes=nbytes, gpu_us=timing.gpu_us, host_us=timing.host_us,
                   gbps=gbps(counted_bytes, timing.gpu_us), reps=timing.reps, sets=1,
                   uncovered_reps=timing.uncovered)
    print_progress(row)
    return row


def ceiling_for(ceilings, direction, placement):
    if placement == "d2d":
        return ceilings["d2d"]["gbps"]
    return ceilings["d2h"]["gbps"] if direction == "b2u" else ceilings["h2d"]["gbps"]


# ----------------------------------------------------------------------------- GPU cases

def run_gpu_group(ctx, device, stream, nt, nb, layout, ceilings, cycles_per_us):
    """All directions and placements for one (nt, nb, layout); buffers freed on return."""
    nbytes = nb * block_bytes(nt)
    nsets = rotation_sets(2 * nbytes, l2_bytes(device))
    caches = make_layer_caches(nt, nsets * nb, layout, device, device)
    universals = {
        "d2d": make_universals(nt, nsets * nb, device, False, device),
        "pinned": make_universals(nt, nsets * nb, "cpu", True, device),
    }
    rows = []
    for placement in PLACEMENTS:
        sets = split_sets(caches, universals[placement], nb, nsets)
        for direction in DIRECTIONS:
            row = make_row(ctx, mode="gpu", direction=direction, placement=placement,
                           layout=layout, nt=nt, nb=nb, bytes=nbytes, sets=nsets)
            try:
                if not verify_case(direction, *sets[0], layout, stream, device, cuda_synchronize):
                    row["status"] = "MISMATCH"
                else:
                    calls = [make_call(direction, blocks, univs, layout, stream)
                             for blocks, univs in sets]
                    timing = time_gpu_calls(calls, ctx.policy, cycles_per_us)
                    counted = 2 * nbytes if placement == "d2d" else nbytes
                    ceiling = ceiling_for(ceilings, direction, placement)
                    rate = gbps(counted, timing.gpu_us)
                    row.update(gpu_us=timing.gpu_us, host_us=timing.host_us, gbps=rate,
                               ceiling_gbps=ceiling, pct_of_ceiling=100 * rate / ceiling,
                               reps=timing.reps, uncovered_reps=timing.uncovered)
            except Exception as exc:  # report the case and go on with the others
                row["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
            print_progress(row)
            rows.append(row)
    return rows


def l2_bytes(device):
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or GPU_L2_FALLBACK


def run_gpu_cases(ctx, args, device, ceilings, cycles_per_us):
    stream = torch.cuda.current_stream(device)
    rows = []
    for nt in args.nt:
        for nb in args.nb:
            for layout in args.layouts:
                rows += run_gpu_group(ctx, device, stream, nt, nb, layout, ceilings, cycles_per_us)
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- CPU cases

def l3_bytes():
    """Size of cpu0's last-level cache from sysfs (fallback 32 MiB)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
    except OSError:
        return CPU_L3_FALLBACK
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


def time_memcpy(nbytes, nsets, policy):
    """Single-threaded memcpy baseline: numpy.copyto of one contiguous buffer of nbytes."""
    src = torch.empty((nsets, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    fill_random_(src, torch.device("cpu"))
    fill_random_(dst, torch.device("cpu"))
    src_np, dst_np = src.numpy(), dst.numpy()
    calls = [lambda s=s: np.copyto(dst_np[s], src_np[s]) for s in range(nsets)]
    return time_cpu_calls(calls, policy)


def run_cpu_group(ctx, nt, nb, layout, nsets, memcpy):
    cpu = torch.device("cpu")
    nbytes = nb * block_bytes(nt)
    caches = make_layer_caches(nt, nsets * nb, layout, cpu, cpu)
    sets = split_sets(caches, make_universals(nt, nsets * nb, cpu, False, cpu), nb, nsets)
    memcpy_gbps = gbps(2 * nbytes, memcpy.host_us)
    rows = []
    for direction in DIRECTIONS:
        row = make_row(ctx, mode="cpu", direction=direction, placement="host", layout=layout,
                       nt=nt, nb=nb, bytes=nbytes, sets=nsets, ceiling_gbps=memcpy_gbps)
        try:
            if not verify_case(direction, *sets[0], layout, None, cpu, no_synchronize):
                row["status"] = "MISMATCH"
            else:
                calls = [make_call(direction, blocks, univs, layout, None) for blocks, univs in sets]
                timing = time_cpu_calls(calls, ctx.policy)
                row.update(host_us=timing.host_us, gbps=gbps(2 * nbytes, timing.host_us),
                           pct_of_ceiling=100 * memcpy.host_us / timing.host_us,
                           ratio_vs_memcpy=timing.host_us / memcpy.host_us, reps=timing.reps)
        except Exception as exc:  # report the case and go on with the others
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
        print_progress(row)
        rows.append(row)
    return rows


def run_cpu_cases(ctx, nts, nbs, layouts):
    print(f"CPU section: torch.get_num_threads()={torch.get_num_threads()}, "
          f"os.cpu_count()={os.cpu_count()}, L3={l3_bytes() // MIB} MiB, "
          "memcpy baseline = numpy.copyto (single thread)", flush=True)
    rows = []
    for nt in nts:
        for nb in nbs:
            nbytes = nb * block_bytes(nt)
            nsets = rotation_sets(2 * nbytes, l3_bytes())
            memcpy = time_memcpy(nbytes, nsets, ctx.policy)
            for layout in layouts:
                rows += run_cpu_group(ctx, nt, nb, layout, nsets, memcpy)
    return rows


# ----------------------------------------------------------------------------- output

def csv_path(arg, gpu_name, date):
    name = f"kvbench-{re.sub(r'[^A-Za-z0-9]+', '-', gpu_name).strip('-')}-{date}.csv"
    if arg is None:
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    return os.path.join(arg, name) if os.path.isdir(arg) else arg


def write_csv(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: fmt(v, 3) if isinstance(v, float) else v for k, v in row.items()})


def environment_line(gpu_name):
    info = kvbm_ext.build_info()
    return (f"gpu={gpu_name} torch={torch.__version__} kvbm_ext={info.get('version')} "
            f"({os.path.dirname(kvbm_ext.__file__)}) "
            f"cuda={info.get('cuda_version')} archs={','.join(info.get('cuda_archs') or [])} "
            f"stubs={kvbm_ext.is_using_stubs()} torch_threads={torch.get_num_threads()}")


def print_table(rows):
    header = (f"{'mode':7} {'dir':4} {'place':6} {'lay':3} {'nt':>3} {'nb':>4} {'MB':>8} "
              f"{'gpu_us':>9} {'host_us':>9} {'GB/s':>8} {'ceil':>7} {'%ceil':>6} "
              f"{'x_mcpy':>6} {'reps':>4} {'sets':>4} status")
    print(header)
    print("-" * len(header))
    for r in rows:
        mb = r["bytes"] / 1e6 if r["bytes"] != "" else ""
        print(f"{r['mode']:7} {r['direction']:4} {r['placement']:6} {r['layout']:3} "
              f"{r['nt']!s:>3} {r['nb']!s:>4} {fmt(mb, 2):>8} {fmt(r['gpu_us']):>9} "
              f"{fmt(r['host_us']):>9} {fmt(r['gbps']):>8} {fmt(r['ceiling_gbps'], 0):>7} "
              f"{fmt(r['pct_of_ceiling']):>6} {fmt(r['ratio_vs_memcpy'], 2):>6} "
              f"{r['reps']!s:>4} {r['sets']!s:>4} {r['status']}"
              + (f" (uncovered {r['uncovered_reps']})" if r["uncovered_reps"] else ""))


# ----------------------------------------------------------------------------- main

def resolve_device(choice):
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("kvbench: --device cuda but torch.cuda.is_available() is False")
    return choice


def run_gpu_mode(ctx, args):
    if kvbm_ext.is_using_stubs():
        sys.exit("kvbench: kvbm_ext was built without CUDA (is_using_stubs()); "
                 "rebuild with nvcc or use --device cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    with torch.cuda.stream(torch.cuda.Stream(device)):
        cycles_per_us = calibrate_sleep_cycles_per_us()
        print(f"torch.cuda._sleep: {cycles_per_us:.0f} cycles/us", flush=True)
        ceilings = measure_ceilings(ctx, device, args.quick, cycles_per_us)
        rows += ceilings.values()
        rows += run_gpu_cases(ctx, args, device, ceilings, cycles_per_us)
    rows += run_cpu_cases(ctx, args.cpu_nt, args.cpu_nb, args.layouts)
    return rows


def main():
    args = parse_args()
    device = resolve_device(args.device)
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else "none"
    ctx = Context(gpu_name, datetime.date.today().isoformat(), rep_policy(args))
    print(environment_line(gpu_name), flush=True)

    if device == "cuda":
        rows = run_gpu_mode(ctx, args)
    else:
        rows = run_cpu_cases(ctx, args.cpu_nt, args.cpu_nb, args.layouts)

    path = csv_path(args.csv, gpu_name, ctx.date)
    write_csv(path, rows)
    print()
    print(environment_line(gpu_name))
    print_table(rows)
    print(f"CSV: {path}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"kvbench: {len(failed)} case(s) not ok", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
