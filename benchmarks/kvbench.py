#!/usr/bin/env python3
"""Benchmark kvbm_ext on a Llama-3.1-70B KV cache.

Profile: nl=80 layers, no=2 (K, V), nh=8 KV heads, hd=128, bf16.  Blocks are held
vLLM-style: one cache [no, num_blocks, *chunk] per layer, and each block is passed as the
list of its nl*no chunk views ([nt, nh, hd] for NHD, [nh, nt, hd] for HND).  Universals
[nh, nl, no, nt, hd] and operationals [nl, no, nt*nh*hd] are contiguous per block.

--api picks the groups timed in GPU mode:
  list         block_to_universal / universal_to_block (and a small CPU section)
  operational  block_to_operational / operational_to_block per backend, and
               universal_to_operational / operational_to_universal
  copy         vectorized_copy and memcpy_batch on address lists
  paged        PagedKVCache over the per-layer caches ("kbthd"): to/from universals with
               host and device block ids, next to the list API and a plain-PyTorch loop on
               the same blocks; to/from operationals; a num_ctas sweep (and a CPU section)
with every array on the device ("d2d") or one side in pinned host memory ("pinned"),
next to copy ceilings measured in the same run: a device copy, a 1 GiB pinned memcpy
each way, and a pinned memcpy of exactly the bytes of each size.  CPU mode times the
host implementation of the list API (and of PagedKVCache) against a single-threaded
memcpy.  Every case is checked bit for bit against a pure-torch reference before it is
timed.  See benchmarks/README.md.
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
from functools import partial

import numpy as np
import torch

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402

NL, NO, NH, HD = 80, 2, 8, 128          # Llama-3.1-70B KV cache
DTYPE = torch.bfloat16
APIS = ("list", "operational", "copy", "paged")
CPU_APIS = ("list", "paged")            # the groups with a CPU section

# (direction, kvbm_ext function, whether it writes side b of the pairing)
LIST_DIRECTIONS = (("b2u", "block_to_universal", True), ("u2b", "universal_to_block", False))
BLOCK_OP_DIRECTIONS = (("b2o", "block_to_operational", True),
                       ("o2b", "operational_to_block", False))
UNIVERSAL_OP_DIRECTIONS = (("u2o", "universal_to_operational", True),
                           ("o2u", "operational_to_universal", False))
COPY_DIRECTIONS = (("d2h", True), ("h2d", False))      # side a on the device, side b pinned
# PagedKVCache methods (and TorchLoop's): side a is the cache, side b the universals / operationals
PAGED_DIRECTIONS = (("b2u", "to_universal", True), ("u2b", "from_universal", False))
PAGED_OP_DIRECTIONS = (("b2o", "to_operational", True), ("o2b", "from_operational", False))
PAGED_DIMS = {"NHD": "kbthd", "HND": "kbhtd"}          # a per-layer cache [no, num_blocks, *chunk]
ID_KINDS = ("host_ids", "device_ids")    # block_ids as a list of ints, as an int64 CUDA tensor
ID_SEED = 2026                           # the spread block ids are the same in every run
CTAS_SWEEP = (8, 16, 32)                 # num_ctas swept at CTAS_NB, next to None (all SMs)
CTAS_NB = 64                             # (the largest --nb when 64 is not in it)
BANDWIDTH_MIN_NB = 64                    # the paged bandwidth targets hold from this nb on
BACKENDS = ("kernel", "async", "batch", "auto")
MEMCPY_BATCH_MODES = ("batched_with_fallback", "fallback_only", "batch_without_fallback")
# Backends that may put one copy per chunk on the copy engines (memcpy_batch does, in every
# mode): more operations than a stream queues, so timing takes them as "fed" at once.
QUEUE_BOUND = ("async", "batch", "auto")
AUTO_TOLERANCE = 1.05                      # auto is fine within 5% of the fastest backend
REQUIRED = {
    "list": ("block_to_universal", "universal_to_block"),
    "operational": ("block_to_operational", "operational_to_block", "universal_to_operational",
                    "operational_to_universal", "is_memcpy_batch_available"),
    "copy": ("vectorized_copy", "memcpy_batch", "is_memcpy_batch_available"),
    "paged": ("PagedKVCache", "block_to_universal", "universal_to_block"),
}
BACKEND_APIS = ("operational", "copy")   # whose variants are compared by annotate_backends

MIB = 1 << 20
GPU_L2_FALLBACK = 60 * MIB
CPU_L3_FALLBACK = 32 * MIB
CACHE_MULTIPLE = 3                      # rotate buffers until the working set is 3x the cache
MAX_SETS = 64
CAP_TARGETS = 4                         # a case times at most 4 targets (RepPolicy.cap_s)
SLEEP_FACTOR = 1.2                      # GPU sleep before a timed call, in units of its host time
SLEEP_MARGIN_US = 50.0
STEADY_REPS, STEADY_BATCH = 100, 10      # back-to-back calls for the steady host time (paged)
STEADY_MAX_NB = 64                       # ... measured up to this nb (larger calls take long)
TARGET_NT = 16                           # the targets are stated for nt = 16

COLUMNS = [
    "gpu_name", "date", "mode", "api", "function", "direction", "placement", "layout",
    "backend", "granularity", "nt", "nb", "pairs", "bytes", "gpu_us", "host_us", "gbps",
    "ceiling_gbps", "pct_of_ceiling", "same_size_memcpy_gbps", "pct_same_size_memcpy",
    "best_backend", "auto_vs_best", "auto_within_5pct", "ratio_vs_memcpy",
    "reps", "sets", "uncovered_reps", "gpu_timing", "status",
    "num_ctas", "sms", "gbps_per_sm", "speedup_vs_torch", "host_steady_us",   # paged rows
]

SHORT = {  # names in the printed tables
    "operational": "op", "pinned": "pin", "ceiling": "ceil",
    "vectorized_copy": "vc", "memcpy_batch": "mb", "host_list": "host", "device_list": "dev",
    "batched_with_fallback": "bwf", "fallback_only": "loop", "batch_without_fallback": "batch",
    "host_ids": "hostid", "device_ids": "devid",
}
LABEL_WIDTH = 28
MAX_FAILURES_SHOWN = 8

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
        description="Time kvbm_ext on a Llama-3.1-70B KV cache (nl=80 no=2 nh=8 hd=128 bf16).")
    parser.add_argument("--api", choices=APIS + ("all",), default="list",
                        help="GPU groups: list (block_to_universal / universal_to_block, plus "
                             "the CPU section), operational (block/universal <-> operational), "
                             "copy (vectorized_copy, memcpy_batch), paged (PagedKVCache next to "
                             "the list API and a torch loop, plus its CPU section), or all "
                             "(default list)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: ceilings and GPU cases (and the CPU sections of the list "
                             "and paged groups); cpu: CPU cases of the list or paged group only; "
                             "auto (default): cuda when available")
    parser.add_argument("--nt", type=int_list, default=[16, 32, 64],
                        help="tokens per block for GPU cases (default 16,32,64)")
    parser.add_argument("--nb", type=int_list, default=[1, 8, 64, 256],
                        help="blocks per call for GPU cases (default 1,8,64,256)")
    parser.add_argument("--layouts", type=layout_list, default=["NHD"],
                        help="chunk layouts of the list API, of universal <-> operational and "
                             "of the paged caches (NHD: dims kbthd, HND: kbhtd), NHD and/or HND "
                             "(default NHD)")
    parser.add_argument("--cpu-nt", type=int_list, default=[16],
                        help="tokens per block for CPU cases (default 16)")
    parser.add_argument("--cpu-nb", type=int_list, default=[1, 8],
                        help="blocks per call for CPU cases (default 1,8)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="timing budget per case in ms, sets the repetitions "
                             "(default 100, 20 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: GPU nt 16, nb 1,8, few repetitions, small ceilings")
    parser.add_argument("--csv", default=None,
                        help="CSV file or existing directory to write into "
                             "(default benchmarks/results/kvbench-<gpu>-<date>.csv)")
    args = parser.parse_args()
    if args.quick:
        args.nt, args.nb = [16], [1, 8]
    if args.target_ms is None:
        args.target_ms = 20.0 if args.quick else 100.0
    args.apis = APIS if args.api == "all" else (args.api,)
    return args


@dataclass
class RepPolicy:
    """How many repetitions a case gets: target_s of timing, within [min_reps, max_reps];
    but a case never times more than cap_s, so a call slower than cap_s / min_reps gets
    fewer (at least one)."""
    target_s: float
    min_reps: int
    max_reps: int
    cap_s: float

    def reps_for(self, seconds_per_rep):
        seconds = max(seconds_per_rep, 1e-7)
        wanted = max(self.min_reps, min(self.max_reps, int(self.target_s / seconds)))
        return max(1, min(wanted, int(self.cap_s / seconds)))


def rep_policy(args):
    target_s = args.target_ms / 1e3
    return RepPolicy(target_s, 3, 10 if args.quick else 200, CAP_TARGETS * target_s)


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


def arena_shape(num_blocks, nt):
    """num_blocks operational blocks [nl, no, nt*nh*hd]; the other forms are views of it."""
    return (num_blocks, NL, NO, nt * NH * HD)


def new_arena(num_blocks, nt, device):
    return torch.empty(arena_shape(num_blocks, nt), dtype=DTYPE, device=device)


def pinned_arena(pool, num_blocks, nt):
    """The front of the pinned pool as an arena (the pool is allocated once: pinning is slow)."""
    return pool[:num_blocks * block_bytes(nt)].view(DTYPE).view(arena_shape(num_blocks, nt))


def layer_caches(arena, nt, layout):
    """An arena seen as a vLLM block stack: per layer, a cache [no, num_blocks, *chunk]."""
    stack = arena.view((NL, NO, arena.shape[0]) + chunk_shape(nt, layout))
    return list(stack.unbind(0))


def as_universals(arena, nt):
    return arena.view(arena.shape[0], NH, NL, NO, nt, HD)


def block_views(caches, block_ids):
    """The `blocks` argument: per block, its nl*no chunk views in [layer][outer] order."""
    return [[caches[l][o, b] for l in range(NL) for o in range(NO)] for b in block_ids]


def rotation_sets(working_set_bytes, cache_bytes):
    """Buffer sets to rotate through so repeated calls do not run out of the cache."""
    return max(1, min(MAX_SETS, math.ceil(CACHE_MULTIPLE * cache_bytes / working_set_bytes)))


def set_slices(arena, nb, nsets):
    """Rotation set s: blocks [s*nb, (s+1)*nb) of the arena, as one tensor."""
    return [arena[s * nb:(s + 1) * nb] for s in range(nsets)]


def tensor_sets(arena, nb, nsets):
    """Per rotation set, its nb blocks as separate tensors."""
    return [list(blocks.unbind(0)) for blocks in set_slices(arena, nb, nsets)]


def block_sets(caches, nb, nsets):
    """Per rotation set, the chunk views of its nb blocks."""
    return [block_views(caches, range(s * nb, (s + 1) * nb)) for s in range(nsets)]


def spread_ids(nb, nsets):
    """Per rotation set, nb block ids out of nsets*nb blocks: a random permutation (fixed
    seed) cut into nsets parts, so the sets are disjoint and each is spread over the cache."""
    order = np.random.default_rng(ID_SEED).permutation(nsets * nb)
    return [order[s * nb:(s + 1) * nb].tolist() for s in range(nsets)]


def chunk_pointers(blocks):
    """Addresses of every chunk of the blocks, in block, layer, outer order."""
    return np.array([chunk.data_ptr() for chunks in blocks for chunk in chunks], dtype=np.uint64)


def operational_chunk_pointers(operationals):
    """Addresses of every chunk [l, o, :] of operational blocks, in the same order."""
    offsets = np.arange(NL * NO, dtype=np.uint64) * np.uint64(operationals[0][0, 0].nbytes)
    return np.concatenate([np.uint64(op.data_ptr()) + offsets for op in operationals])


def block_pointers(tensors):
    return np.array([t.data_ptr() for t in tensors], dtype=np.uint64)


def on_device(pointers, device):
    """A host address list as a torch int64 tensor on the device."""
    return torch.from_numpy(pointers.view(np.int64)).to(device)


# ----------------------------------------------------------------------------- correctness

def reference_universal(chunks, layout):
    """Pure-torch universal [nh, nl, no, nt, hd] of one block's chunks."""
    stacked = torch.stack(chunks)
    stacked = stacked.view((NL, NO) + tuple(stacked.shape[1:]))
    order = (3, 0, 1, 2, 4) if layout == "NHD" else (2, 0, 1, 3, 4)
    return stacked.permute(order)


def reference_operational(chunks):
    """Pure-torch operational [nl, no, inner] of one block's chunks."""
    return torch.stack(chunks).view(NL, NO, -1)


def operational_of_universal(universal, layout):
    """Pure-torch operational of a universal, [nl, no, nt, nh, hd] (NHD) or [nl, no, nh, nt, hd]."""
    return universal.permute((1, 2, 3, 0, 4) if layout == "NHD" else (1, 2, 0, 3, 4))


def bitwise_equal(actual, expected):
    """Same bits, compared on expected's device; actual is reshaped to expected's shape."""
    actual = actual.to(expected.device).reshape(expected.shape)
    return torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def chunks_match_universal(chunks, universal, layout):
    return bitwise_equal(universal, reference_universal(chunks, layout))


def chunks_match_operational(chunks, operational):
    return bitwise_equal(operational, reference_operational(chunks))


def universal_matches_operational(universal, operational, layout):
    expected = operational_of_universal(universal.to(operational.device), layout)
    return bitwise_equal(operational, expected)


def same_block(device_block, other):
    return bitwise_equal(other, device_block)


@dataclass
class Pairing:
    """Two sides that hold the same blocks in two forms, per rotation set (a block is a list
    of chunk views or one tensor), and the bitwise relation between block i of side a and
    block i of side b that a call converting either side into the other establishes."""
    a: list
    b: list
    relation: object


@dataclass
class Case:
    fields: dict          # the row fields that name the case
    link: str             # d2d, d2h or h2d (pinned: the way over PCIe), host (CPU)
    calls: list           # one per rotation set
    pairing: Pairing
    writes_b: bool        # the call writes side b (else side a)
    queue_bound: bool     # may enqueue more operations than a stream queues (QUEUE_BOUND)


def checked_ids(nb):
    """Blocks verified per case: first, middle, last."""
    return sorted({0, nb // 2, nb - 1})


def block_tensors(block):
    """The tensors of one block of a side: its chunk views, or its own tensor."""
    return block if isinstance(block, list) else [block]


def verify(case, synchronize, gen_device):
    """Poison the destination of the checked blocks of rotation set 0 with fresh random bits,
    run the call on it once from an idle device (the timing's warm-up) and check the relation
    on those blocks.  Returns (exact, run_once's times)."""
    a, b = case.pairing.a[0], case.pairing.b[0]
    ids = checked_ids(len(a))
    for i in ids:
        for tensor in block_tensors(b[i] if case.writes_b else a[i]):
            fill_random_(tensor, gen_device)
    first = run_once(case.calls[0], synchronize)
    return all(case.pairing.relation(a[i], b[i]) for i in ids), first


# ----------------------------------------------------------------------------- timing

@dataclass
class Timing:
    host_us: float
    gpu_us: float        # nan on the CPU path
    reps: int
    uncovered: int       # GPU attempts whose host work outran the sleep
    method: str          # "hidden" or "fed" (see sleep_hidden_times), "" on the CPU path


def cuda_synchronize():
    torch.cuda.synchronize()


def no_synchronize():
    pass


def run_once(call, synchronize):
    """One call from an idle device: (seconds in the call, seconds until its work is done)."""
    synchronize()
    start = time.perf_counter()
    call()
    host_s = time.perf_counter() - start
    synchronize()
    return host_s, time.perf_counter() - start


def steady_host_us(calls, reps=STEADY_REPS, batch=STEADY_BATCH):
    """Median host time of GPU calls issued back to back, as a serving worker issues them
    (the host_us of time_gpu_calls times each call right after a synchronize, from an idle
    device).  The stream is synchronized every `batch` calls, outside the timed calls, so
    that the queue stays short."""
    samples = []
    for i in range(reps):
        if i % batch == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        calls[i % len(calls)]()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def median_host_us(calls, reps):
    """Median wall time of a host-only call (rotating)."""
    samples = []
    for i in range(reps):
        start = time.perf_counter()
        calls[i % len(calls)]()
        samples.append(time.perf_counter() - start)
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


def sleep_hidden_times(calls, reps, sleep_us, cycles_per_us, queue_bound):
    """GPU time of the calls (rotating), with the host times of the covered attempts.

    Each attempt enqueues a GPU sleep of sleep_us, records the start event, makes the call
    and records the end event.  The sleep keeps the GPU busy while the host prepares the
    call, so the events bracket only its GPU work ("hidden").  An attempt whose host work
    outran the sleep is uncovered; the first one doubles the sleep.  A call uncovered again
    (at once when queue_bound) waits for the GPU, as one that enqueues more operations than
    a stream queues (about a thousand) does: its uncovered attempts are then the samples
    ("fed"), the GPU time from the sleep's end while the host keeps the queue full.
    Returns (median GPU us, "hidden" or "fed", covered host seconds, uncovered count)."""
    hidden, fed, host = [], [], []
    doublings = 0 if queue_bound else 1
    waits_for_gpu = False
    attempt = 0
    while len(hidden) < reps and not (waits_for_gpu and len(fed) >= reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_us * cycles_per_us))
        slept_from = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call_start = time.perf_counter()
        calls[attempt % len(calls)]()
        call_s = time.perf_counter() - call_start
        end.record()
        if (time.perf_counter() - slept_from) * 1e6 < sleep_us:
            hidden.append((start, end))
            host.append(call_s)
        else:
            fed.append((start, end))
            waits_for_gpu = doublings == 0
            if doublings:
                doublings -= 1
                sleep_us *= 2
        attempt += 1
    torch.cuda.synchronize()
    samples, method = (hidden, "hidden") if hidden else (fed, "fed")
    gpu_us = statistics.median(start.elapsed_time(end) * 1e3 for start, end in samples)
    return gpu_us, method, host, len(fed)


def time_gpu_calls(calls, policy, cycles_per_us, first, queue_bound=False):
    """Time the calls after a first run (run_once's times, the warm-up): the GPU sleep covers
    SLEEP_FACTOR times its host time, the repetitions follow the policy.  The host time is
    the median of the covered attempts, else (fed) the first run's, made with the GPU idle."""
    host_s, wall_s = first
    sleep_us = SLEEP_FACTOR * host_s * 1e6 + SLEEP_MARGIN_US
    reps = policy.reps_for(sleep_us * 1e-6 + wall_s - host_s)
    gpu_us, method, host, uncovered = sleep_hidden_times(calls, reps, sleep_us, cycles_per_us,
                                                         queue_bound)
    host_us = statistics.median(host) * 1e6 if host else host_s * 1e6
    return Timing(host_us, gpu_us, reps, uncovered, method)


def time_cpu_calls(calls, policy, first):
    """The median wall time of the calls (rotating) after a first run (the warm-up)."""
    reps = policy.reps_for(first[1])
    return Timing(median_host_us(calls, reps), math.nan, reps, 0, "")


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


def timed_fields(timing, counted_bytes, ceiling_gbps=None, memcpy_gbps=None):
    """Row fields of a GPU timing; percentages of the ceiling and of the same-size memcpy."""
    rate = gbps(counted_bytes, timing.gpu_us)
    fields = dict(gpu_us=timing.gpu_us, host_us=timing.host_us, gbps=rate, reps=timing.reps,
                  uncovered_reps=timing.uncovered, gpu_timing=timing.method)
    if ceiling_gbps is not None:
        fields.update(ceiling_gbps=ceiling_gbps, pct_of_ceiling=100 * rate / ceiling_gbps)
    if memcpy_gbps is not None:
        fields.update(same_size_memcpy_gbps=memcpy_gbps,
                      pct_same_size_memcpy=100 * rate / memcpy_gbps)
    return fields


def run_checked(row, case, synchronize, gen_device, measure):
    """Verify the case, then fill the row with measure(first run's times).  A mismatch or an
    exception goes into the row's status instead.  Prints and returns the row."""
    try:
        exact, first = verify(case, synchronize, gen_device)
        if exact:
            row.update(measure(first))
        else:
            row["status"] = "MISMATCH"
    except Exception as exc:  # report the case and go on with the others
        row["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
    print_progress(row)
    return row


def fmt(value, digits=1):
    if value == "" or value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def short(name):
    return SHORT.get(name, name)


def variant(row):
    """What a backend row times: the backend, or function:backend for raw copies."""
    return f"{row['function']}:{row['backend']}" if row["api"] == "copy" else row["backend"]


def short_variant(name):
    return ":".join(short(part) for part in name.split(":"))


def label(row, with_variant=True):
    """A row's short name in the printed tables, e.g. 'op b2o pin kernel'."""
    kind = row["api"] if row["mode"] == "gpu" else row["mode"]
    parts = [short(kind), row["direction"], short(row["placement"]), row["layout"],
             row["granularity"]]
    if with_variant:
        parts.append(short_variant(variant(row)))
        if is_swept(row):
            parts.append(f"c{row['num_ctas']}")
    return " ".join(part for part in parts if part)


def print_progress(row):
    figures = [(row["gpu_us"], "us gpu"), (row["host_us"], "us host"), (row["gbps"], "GB/s"),
               (row["pct_of_ceiling"], "% of ceiling"),
               (row["pct_same_size_memcpy"], "% of same-size memcpy")]
    shown = ", ".join(f"{fmt(value)} {unit}" for value, unit in figures if value != "")
    size = f" nt={row['nt']} nb={row['nb']}" if row["nt"] != "" else ""
    fed = " (fed)" if row["gpu_timing"] == "fed" else ""
    print(f"  {label(row)}{size}: {shown}{fed} [{row['status']}]", flush=True)


# ----------------------------------------------------------------------------- ceilings

def time_copy_row(ctx, cycles_per_us, fields, calls, counted_bytes, ceiling_gbps=None):
    """A ceiling row: torch copy_ calls, timed after a warm-up run."""
    first = run_once(calls[0], cuda_synchronize)
    timing = time_gpu_calls(calls, ctx.policy, cycles_per_us, first)
    row = make_row(ctx, mode="ceiling", function="copy_", **fields,
                   **timed_fields(timing, counted_bytes, ceiling_gbps))
    print_progress(row)
    return row


def measure_ceilings(ctx, device, quick, cycles_per_us):
    """Copy ceilings: device-to-device (bytes read + written), pinned H2D and D2H."""
    d2d_bytes = (256 if quick else 2048) * MIB
    host_bytes = (64 if quick else 1024) * MIB

    src = torch.empty(d2d_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fill_random_(src, device)
    fill_random_(dst, device)
    rows = {"d2d": time_copy_row(ctx, cycles_per_us,
                                 dict(direction="d2d", placement="device", bytes=d2d_bytes, sets=1),
                                 [lambda: dst.copy_(src, non_blocking=True)], 2 * d2d_bytes)}
    del src, dst

    pinned = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)
    fill_random_(pinned, device)
    fill_random_(dev, device)
    fields = dict(placement="pinned", bytes=host_bytes, sets=1)
    rows["h2d"] = time_copy_row(ctx, cycles_per_us, dict(fields, direction="h2d"),
                                [lambda: dev.copy_(pinned, non_blocking=True)], host_bytes)
    rows["d2h"] = time_copy_row(ctx, cycles_per_us, dict(fields, direction="d2h"),
                                [lambda: pinned.copy_(dev, non_blocking=True)], host_bytes)
    del pinned, dev
    torch.cuda.empty_cache()
    return rows


def measure_same_size_memcpys(ctx, gpu, shape):
    """A pinned memcpy of exactly one call's bytes each way, rotating over the shape's sets."""
    fields = dict(placement="pinned", nt=shape.nt, nb=shape.nb, bytes=shape.nbytes,
                  sets=shape.nsets)
    device = set_slices(shape.device_a, shape.nb, shape.nsets)
    pinned = set_slices(shape.pinned, shape.nb, shape.nsets)
    calls = {"d2h": [partial(h.copy_, d, non_blocking=True) for d, h in zip(device, pinned)],
             "h2d": [partial(d.copy_, h, non_blocking=True) for d, h in zip(device, pinned)]}
    return {link: time_copy_row(ctx, gpu.cycles_per_us, dict(fields, direction=link),
                                calls[link], shape.nbytes, gpu.ceilings[link]["gbps"])
            for link in ("d2h", "h2d")}


# ----------------------------------------------------------------------------- GPU cases

@dataclass
class Gpu:
    device: torch.device
    stream: object
    cycles_per_us: float
    ceilings: dict       # d2d, h2d, d2h -> ceiling row
    batch: bool          # kvbm_ext.is_memcpy_batch_available()
    sms: int             # multiprocessors (kvbm_ext.cuda_devices())
    ctas_nb: int         # nb of the paged group's num_ctas sweep


@dataclass
class Shape:
    """One (nt, nb) of the GPU cases: nsets rotation sets of nb blocks, in four random-filled
    arenas of nsets*nb blocks each."""
    nt: int
    nb: int
    nsets: int
    stack: torch.Tensor      # device, seen as the vLLM block stack (layer_caches)
    device_a: torch.Tensor   # device operationals; universals of the list API's d2d cases
    device_b: torch.Tensor   # device universals of universal <-> operational d2d cases
    pinned: torch.Tensor     # pinned host operationals or universals
    blocks: dict             # layout -> per rotation set, the chunk views of its blocks

    @property
    def nbytes(self):
        return self.nb * block_bytes(self.nt)


def l2_bytes(device):
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or GPU_L2_FALLBACK


def shape_sets(nt, nb, device):
    return rotation_sets(2 * nb * block_bytes(nt), l2_bytes(device))


def make_shape(nt, nb, layouts, device, pool):
    nsets = shape_sets(nt, nb, device)
    arenas = [new_arena(nsets * nb, nt, device) for _ in range(3)]
    arenas.append(pinned_arena(pool, nsets * nb, nt))
    for arena in arenas:
        fill_random_(arena, device)
    blocks = {layout: block_sets(layer_caches(arenas[0], nt, layout), nb, nsets)
              for layout in layouts}
    return Shape(nt, nb, nsets, *arenas, blocks)


def shape_fields(shape, **fields):
    return dict(mode="gpu", nt=shape.nt, nb=shape.nb, bytes=shape.nbytes, sets=shape.nsets,
                **fields)


def link_for(placement, writes_pinned):
    if placement != "pinned":
        return placement
    return "d2h" if writes_pinned else "h2d"


def binder(*args, **kwargs):
    """bind(function, sources, destinations) -> the call with these further arguments."""
    return lambda function, sources, destinations: partial(function, sources, destinations,
                                                            *args, **kwargs)


def function_name(owner, name):
    """A function's name in the rows: kvbm_ext's by name, methods as Type.method."""
    return name if owner is kvbm_ext else f"{type(owner).__name__}.{name}"


def conversion_cases(fields, placement, pinned_side, pairing, directions, bind,
                     queue_bound=False, owner=kvbm_ext, sides=None):
    """One case per direction of a conversion between the pairing's sides: owner's function
    of each direction, called with the per-set arguments that stand for sides a and b
    (sides; by default the pairing's own)."""
    a, b = sides or (pairing.a, pairing.b)
    cases = []
    for direction, name, writes_b in directions:
        function = getattr(owner, name)
        sources, destinations = (a, b) if writes_b else (b, a)
        calls = [bind(function, s, d) for s, d in zip(sources, destinations)]
        link = link_for(placement, writes_b == (pinned_side == "b"))
        cases.append(Case(dict(fields, function=function_name(owner, name), direction=direction,
                               placement=placement),
                          link, calls, pairing, writes_b, queue_bound))
    return cases


def placements(device_arena, pinned):
    return (("d2d", device_arena), ("pinned", pinned))


def list_cases(gpu, shape, layouts):
    """block_to_universal / universal_to_block: universals on the device or pinned."""
    cases = []
    for layout in layouts:
        for placement, arena in placements(shape.device_a, shape.pinned):
            universals = tensor_sets(as_universals(arena, shape.nt), shape.nb, shape.nsets)
            pairing = Pairing(shape.blocks[layout], universals,
                              partial(chunks_match_universal, layout=layout))
            cases += conversion_cases(shape_fields(shape, api="list", layout=layout), placement,
                                      "b", pairing, LIST_DIRECTIONS,
                                      binder(layout, stream=gpu.stream))
    return cases


def backends(batch):
    return [backend for backend in BACKENDS if batch or backend != "batch"]


def block_operational_cases(gpu, shape, layouts):
    """block_to_operational / operational_to_block per backend: operationals on the device
    or pinned.  Chunks are copied as they are, so one layout's views serve."""
    cases = []
    for placement, arena in placements(shape.device_a, shape.pinned):
        pairing = Pairing(shape.blocks[layouts[0]], tensor_sets(arena, shape.nb, shape.nsets),
                          chunks_match_operational)
        for backend in backends(gpu.batch):
            cases += conversion_cases(shape_fields(shape, api="operational", backend=backend),
                                      placement, "b", pairing, BLOCK_OP_DIRECTIONS,
                                      binder(backend=backend, stream=gpu.stream),
                                      backend in QUEUE_BOUND)
    return cases


def universal_operational_cases(gpu, shape, layouts):
    """universal_to_operational / operational_to_universal: operationals on the device,
    universals on the device or pinned."""
    operationals = tensor_sets(shape.device_a, shape.nb, shape.nsets)
    cases = []
    for layout in layouts:
        for placement, arena in placements(shape.device_b, shape.pinned):
            universals = tensor_sets(as_universals(arena, shape.nt), shape.nb, shape.nsets)
            pairing = Pairing(universals, operationals,
                              partial(universal_matches_operational, layout=layout))
            cases += conversion_cases(shape_fields(shape, api="operational", layout=layout),
                                      placement, "a", pairing, UNIVERSAL_OP_DIRECTIONS,
                                      binder(layout, stream=gpu.stream))
    return cases


def memcpy_batch_modes(batch):
    return [mode for mode in MEMCPY_BATCH_MODES if batch or mode != "batch_without_fallback"]


def copy_variants(gpu, size):
    """(function, backend, bind(src_ptrs, dst_ptrs) -> call, queue_bound) per raw copy."""
    def vectorized(src, dst):
        return partial(kvbm_ext.vectorized_copy, src, dst, size, stream=gpu.stream)

    def vectorized_device_list(src, dst):
        return vectorized(on_device(src, gpu.device), on_device(dst, gpu.device))

    def memcpy_batch(mode, src, dst):
        return partial(kvbm_ext.memcpy_batch, src, dst, size, mode=mode, stream=gpu.stream)

    variants = [("vectorized_copy", "host_list", vectorized, False),
                ("vectorized_copy", "device_list", vectorized_device_list, False)]
    variants += [("memcpy_batch", mode, partial(memcpy_batch, mode), True)
                 for mode in memcpy_batch_modes(gpu.batch)]
    return variants


def copy_cases(gpu, shape, layouts):
    """vectorized_copy and memcpy_batch between the device and pinned host: per-layer chunks
    of the block stack <-> pinned operationals ("chunk"), device operationals <-> pinned
    ones ("block")."""
    pinned = tensor_sets(shape.pinned, shape.nb, shape.nsets)
    chunk_bytes = shape.nt * NH * HD * DTYPE.itemsize
    granularities = (
        ("chunk", Pairing(shape.blocks[layouts[0]], pinned, chunks_match_operational),
         chunk_pointers, operational_chunk_pointers, chunk_bytes),
        ("block", Pairing(tensor_sets(shape.device_a, shape.nb, shape.nsets), pinned, same_block),
         block_pointers, block_pointers, block_bytes(shape.nt)),
    )
    cases = []
    for granularity, pairing, a_pointers, b_pointers, size in granularities:
        a = [a_pointers(blocks) for blocks in pairing.a]
        b = [b_pointers(blocks) for blocks in pairing.b]
        fields = shape_fields(shape, api="copy", placement="pinned", granularity=granularity,
                              pairs=len(a[0]))
        for direction, writes_b in COPY_DIRECTIONS:
            sources, destinations = (a, b) if writes_b else (b, a)
            for function, backend, bind, queue_bound in copy_variants(gpu, size):
                calls = [bind(s, d) for s, d in zip(sources, destinations)]
                cases.append(Case(dict(fields, function=function, direction=direction,
                                       backend=backend),
                                  direction, calls, pairing, writes_b, queue_bound))
    return cases


@dataclass
class TorchLoop:
    """The plain-PyTorch baseline, with PagedKVCache's universal methods: per layer, the
    blocks gathered with index_select on the cache's block dimension, permuted and copied
    into the universals' layer slice (index_copy_ back)."""
    caches: list         # per layer [no, num_blocks, *chunk]
    layout: str

    def order(self):
        """The gathered blocks' dimensions, [no, nb, *chunk], in universal order."""
        return (1, 3, 0, 2, 4) if self.layout == "NHD" else (1, 2, 0, 3, 4)

    def to_universal(self, block_ids, universals):
        order = self.order()
        for l, cache in enumerate(self.caches):
            universals[:, :, l].copy_(cache.index_select(1, block_ids).permute(order))

    def from_universal(self, universals, block_ids):
        order = self.order()
        inverse = tuple(order.index(d) for d in range(5))
        for l, cache in enumerate(self.caches):
            cache.index_copy_(1, block_ids, universals[:, :, l].permute(inverse))


@dataclass
class PagedSetup:
    """A stack of nsets*nb blocks as a worker holds it: a vLLM cache per layer, described once
    as a PagedKVCache, and per rotation set the spread ids of its nb blocks."""
    nt: int
    nb: int
    layout: str
    caches: list         # per layer [no, num_blocks, *chunk] (layer_caches)
    cache: object        # kvbm_ext.PagedKVCache(caches, PAGED_DIMS[layout])
    ids: list            # per rotation set, its block ids (ints)
    id_tensors: list     # per rotation set, its block ids as an int64 tensor on the caches' device
    blocks: list         # per rotation set, the chunk views of its blocks (the list API's argument)

    def id_sets(self, kinds):
        """(kind, ids per set) for the kinds of block_ids asked for that the cache takes
        (device_ids: a GPU cache's)."""
        by_kind = {"host_ids": self.ids, "device_ids": self.id_tensors}
        on_gpu = self.id_tensors[0].is_cuda
        return [(kind, by_kind[kind]) for kind in kinds if on_gpu or kind == "host_ids"]


def paged_setup(stack, nt, nb, nsets, layout):
    caches = layer_caches(stack, nt, layout)
    ids = spread_ids(nb, nsets)
    return PagedSetup(nt, nb, layout, caches, kvbm_ext.PagedKVCache(caches, PAGED_DIMS[layout]),
                      ids, [torch.tensor(s, dtype=torch.int64, device=stack.device) for s in ids],
                      [block_views(caches, s) for s in ids])


def universal_pairing(setup, arena):
    """The setup's blocks and, per rotation set, one universal array [nb, nh, nl, no, nt, hd],
    a slice of the arena."""
    universals = set_slices(as_universals(arena, setup.nt), setup.nb, len(setup.ids))
    return Pairing(setup.blocks, universals, partial(chunks_match_universal, layout=setup.layout))


def operational_pairing(setup, arena):
    """The setup's blocks and, per rotation set, one operational array [nb, nl, no, inner]."""
    return Pairing(setup.blocks, set_slices(arena, setup.nb, len(setup.ids)),
                   chunks_match_operational)


def ctas_fields(num_ctas, sms):
    """The row fields of a GPU PagedKVCache call: num_ctas as passed, the SMs it can use."""
    return dict(num_ctas="None" if num_ctas is None else num_ctas,
                sms=sms if num_ctas is None else min(num_ctas, sms))


def paged_kv_cases(fields, placement, setup, pairing, directions, stream, sms=None,
                   num_ctas=None, kinds=ID_KINDS, **kwargs):
    """PagedKVCache calls between the cache and side b of the pairing, per kind of ids."""
    cases = []
    for kind, ids in setup.id_sets(kinds):
        kind_fields = dict(fields, backend=kind)
        if sms is not None:
            kind_fields.update(ctas_fields(num_ctas, sms))
        cases += conversion_cases(kind_fields, placement, "b", pairing, directions,
                                  binder(num_ctas=num_ctas, stream=stream, **kwargs),
                                  owner=setup.cache, sides=(ids, pairing.b))
    return cases


def paged_universal_cases(fields, placement, setup, pairing, stream, sms=None):
    """Cache <-> universals, the same blocks three ways: PagedKVCache (each kind of ids), the
    list API on the blocks' chunk views and nb universals, and (not pinned) the torch loop."""
    cases = paged_kv_cases(fields, placement, setup, pairing, PAGED_DIRECTIONS, stream, sms)
    universals = [list(u.unbind(0)) for u in pairing.b]
    cases += conversion_cases(dict(fields, backend="list"), placement, "b", pairing,
                              LIST_DIRECTIONS, binder(setup.layout, stream=stream),
                              sides=(pairing.a, universals))
    if placement != "pinned":
        cases += conversion_cases(dict(fields, backend="torch"), placement, "b", pairing,
                                  PAGED_DIRECTIONS, binder(),
                                  owner=TorchLoop(setup.caches, setup.layout),
                                  sides=(setup.id_tensors, pairing.b))
    return cases


def paged_cases(gpu, shape, layouts):
    """PagedKVCache over the stack seen as vLLM's per-layer caches: to/from universals on the
    device or pinned (next to the list API and the torch loop), the num_ctas sweep of
    to_universal at gpu.ctas_nb, and to/from operationals on the device or pinned."""
    cases = []
    for layout in layouts:
        setup = paged_setup(shape.stack, shape.nt, shape.nb, shape.nsets, layout)
        fields = shape_fields(shape, api="paged", layout=layout)
        for placement, arena in placements(shape.device_a, shape.pinned):
            pairing = universal_pairing(setup, arena)
            cases += paged_universal_cases(fields, placement, setup, pairing, gpu.stream, gpu.sms)
            if shape.nb == gpu.ctas_nb:
                for num_ctas in CTAS_SWEEP:
                    cases += paged_kv_cases(fields, placement, setup, pairing,
                                            PAGED_DIRECTIONS[:1], gpu.stream, gpu.sms,
                                            num_ctas, kinds=("device_ids",))
        for placement, arena in placements(shape.device_b, shape.pinned):
            cases += paged_kv_cases(fields, placement, setup, operational_pairing(setup, arena),
                                    PAGED_OP_DIRECTIONS, gpu.stream, gpu.sms, inner=layout)
    return cases


GROUPS = {
    "list": (list_cases,),
    "operational": (block_operational_cases, universal_operational_cases),
    "copy": (copy_cases,),
    "paged": (paged_cases,),
}


def run_gpu_case(ctx, gpu, case, memcpys):
    """Verify, then time one case against the ceiling of its link and the same-size memcpy."""
    nbytes = case.fields["bytes"]
    counted = 2 * nbytes if case.link == "d2d" else nbytes
    ceiling = gpu.ceilings[case.link]["gbps"]
    memcpy = memcpys[case.link]["gbps"] if case.link in memcpys else None

    def measure(first):
        timing = time_gpu_calls(case.calls, ctx.policy, gpu.cycles_per_us, first,
                                case.queue_bound)
        fields = timed_fields(timing, counted, ceiling, memcpy)
        if case.fields["api"] == "paged" and case.fields["nb"] <= STEADY_MAX_NB:
            fields["host_steady_us"] = steady_host_us(case.calls)
        return fields

    return run_checked(make_row(ctx, **case.fields), case, cuda_synchronize, gpu.device, measure)


def run_shape(ctx, gpu, args, nt, nb, pool):
    """The same-size memcpys and every case of the selected groups for one (nt, nb)."""
    shape = make_shape(nt, nb, args.layouts, gpu.device, pool)
    memcpys = measure_same_size_memcpys(ctx, gpu, shape)
    rows = list(memcpys.values())
    for api in args.apis:
        for group in GROUPS[api]:
            for case in group(gpu, shape, args.layouts):
                rows.append(run_gpu_case(ctx, gpu, case, memcpys))
    return rows


def run_gpu_cases(ctx, gpu, args):
    pool_bytes = max(shape_sets(nt, nb, gpu.device) * nb * block_bytes(nt)
                     for nt in args.nt for nb in args.nb)
    pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
    rows = []
    for nt in args.nt:
        for nb in args.nb:
            rows += run_shape(ctx, gpu, args, nt, nb, pool)
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
    return time_cpu_calls(calls, policy, run_once(calls[0], no_synchronize))


def run_cpu_case(ctx, case, memcpy):
    nbytes = case.fields["bytes"]

    def measure(first):
        timing = time_cpu_calls(case.calls, ctx.policy, first)
        return dict(host_us=timing.host_us, gbps=gbps(2 * nbytes, timing.host_us),
                    pct_of_ceiling=100 * memcpy.host_us / timing.host_us,
                    ratio_vs_memcpy=timing.host_us / memcpy.host_us, reps=timing.reps)

    row = make_row(ctx, **case.fields, ceiling_gbps=gbps(2 * nbytes, memcpy.host_us))
    return run_checked(row, case, no_synchronize, torch.device("cpu"), measure)


def cpu_arenas(nt, nb, nsets):
    """Two random-filled host arenas of nsets*nb blocks: the block stack and universals."""
    cpu = torch.device("cpu")
    arenas = new_arena(nsets * nb, nt, cpu), new_arena(nsets * nb, nt, cpu)
    for arena in arenas:
        fill_random_(arena, cpu)
    return arenas


def cpu_fields(api, nt, nb, layout, nsets):
    return dict(mode="cpu", api=api, layout=layout, nt=nt, nb=nb, bytes=nb * block_bytes(nt),
                sets=nsets)


def cpu_list_cases(nt, nb, layout, nsets):
    """The list API between the block stack and nb universals per set, in host memory."""
    stack, universals = cpu_arenas(nt, nb, nsets)
    pairing = Pairing(block_sets(layer_caches(stack, nt, layout), nb, nsets),
                      tensor_sets(as_universals(universals, nt), nb, nsets),
                      partial(chunks_match_universal, layout=layout))
    return conversion_cases(cpu_fields("list", nt, nb, layout, nsets), "host", "b", pairing,
                            LIST_DIRECTIONS, binder(layout, stream=None))


def cpu_paged_cases(nt, nb, layout, nsets):
    """PagedKVCache on host caches (host ids) next to the list API and the torch loop."""
    stack, universals = cpu_arenas(nt, nb, nsets)
    setup = paged_setup(stack, nt, nb, nsets, layout)
    return paged_universal_cases(cpu_fields("paged", nt, nb, layout, nsets), "host", setup,
                                 universal_pairing(setup, universals), None)


CPU_GROUPS = {"list": cpu_list_cases, "paged": cpu_paged_cases}


def run_cpu_cases(ctx, apis, nts, nbs, layouts):
    """The CPU sections of the groups in apis (CPU_APIS), each against the same memcpy."""
    print(f"CPU section: torch.get_num_threads()={torch.get_num_threads()}, "
          f"os.cpu_count()={os.cpu_count()}, L3={l3_bytes() // MIB} MiB, "
          "memcpy baseline = numpy.copyto (single thread)", flush=True)
    rows = []
    for nt in nts:
        for nb in nbs:
            nbytes = nb * block_bytes(nt)
            nsets = rotation_sets(2 * nbytes, l3_bytes())
            memcpy = time_memcpy(nbytes, nsets, ctx.policy)
            for api in apis:
                for layout in layouts:
                    rows += [run_cpu_case(ctx, case, memcpy)
                             for case in CPU_GROUPS[api](nt, nb, layout, nsets)]
    return rows


# ----------------------------------------------------------------------------- output

def is_timed(row):
    gpu_us = row["gpu_us"]
    return row["status"] == "ok" and isinstance(gpu_us, float) and not math.isnan(gpu_us)


def annotate_backends(rows):
    """On backend rows (operational backends, raw copy variants): the fastest variant of the
    same size by GPU time, auto left out; on auto rows, auto's GPU time over the fastest."""
    groups = {}
    for row in rows:
        if row["mode"] == "gpu" and row["backend"] and row["api"] in BACKEND_APIS:
            key = tuple(row[k] for k in ("api", "direction", "placement", "layout",
                                         "granularity", "nt", "nb"))
            groups.setdefault(key, []).append(row)
    for group in groups.values():
        timed = [row for row in group if row["backend"] != "auto" and is_timed(row)]
        if not timed:
            continue
        best = min(timed, key=lambda row: row["gpu_us"])
        for row in group:
            row["best_backend"] = variant(best)
            if row["backend"] == "auto" and is_timed(row):
                ratio = row["gpu_us"] / best["gpu_us"]
                row.update(auto_vs_best=ratio,
                           auto_within_5pct="yes" if ratio <= AUTO_TOLERANCE else "no")


def call_us(row):
    """What back-to-back calls cost per call: the host or the GPU time, whichever is longer
    (the host time on the CPU path)."""
    gpu_us = row["gpu_us"]
    return row["host_us"] if gpu_us == "" or math.isnan(gpu_us) else max(row["host_us"], gpu_us)


def paged_key(row):
    return tuple(row[k] for k in ("mode", "direction", "placement", "layout", "nt", "nb"))


def annotate_paged(rows):
    """On paged rows: GB/s per SM used (GPU PagedKVCache rows), and the speedup over the
    torch loop of the same direction, placement and size by call_us."""
    paged = [row for row in rows if row["api"] == "paged" and row["status"] == "ok"]
    loops = {paged_key(row): row for row in paged if row["backend"] == "torch"}
    for row in paged:
        if row["sms"] != "":
            row["gbps_per_sm"] = row["gbps"] / row["sms"]
        loop = loops.get(paged_key(row))
        if loop is not None and loop is not row and not is_swept(row):
            row["speedup_vs_torch"] = call_us(loop) / call_us(row)


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


def batch_available():
    return hasattr(kvbm_ext, "is_memcpy_batch_available") and kvbm_ext.is_memcpy_batch_available()


def environment_line(gpu_name):
    info = kvbm_ext.build_info()
    return (f"gpu={gpu_name} torch={torch.__version__} kvbm_ext={info.get('version')} "
            f"({os.path.dirname(kvbm_ext.__file__)}) "
            f"cuda={info.get('cuda_version')} archs={','.join(info.get('cuda_archs') or [])} "
            f"stubs={kvbm_ext.is_using_stubs()} memcpy_batch={batch_available()} "
            f"torch_threads={torch.get_num_threads()}")


def header_lines(names, columns, width):
    """Column headings, a line per part of the column tuples; an outer part is shown where
    it changes."""
    lines = []
    for level, name in enumerate(names):
        cells = []
        for i, column in enumerate(columns):
            shown = (level == len(names) - 1 or i == 0
                     or columns[i - 1][:level + 1] != column[:level + 1])
            cells.append(f"{column[level] if shown else '':>{width}}")
        lines.append(f"{name:>{LABEL_WIDTH}}" + "".join(cells))
    return lines


def print_pivot(title, rows, label_of, column_of, names, cell, width):
    """A line per label_of(row), a column per column_of(row) (a tuple, its parts named by
    names); cell(the rows of one line and column) -> text."""
    if not rows:
        return
    columns = sorted({column_of(row) for row in rows})
    cells = {}
    for row in rows:
        cells.setdefault((label_of(row), column_of(row)), []).append(row)
    print()
    print(title)
    for line in header_lines(names, columns, width):
        print(line)
    for name in dict.fromkeys(label_of(row) for row in rows):
        texts = [cell(cells[name, c]) if (name, c) in cells else "" for c in columns]
        print(f"{name:{LABEL_WIDTH}}" + "".join(f"{text:>{width}}" for text in texts))


def nt_nb(row):
    return (row["nt"], row["nb"])


def nb_only(row):
    return (row["nb"],)


def failed_cell(row):
    return "ERR" if row["status"].startswith("error") else "MIS"


def pct_cell(rows):
    row = rows[0]
    if row["status"] != "ok":
        return failed_cell(row)
    value = row["pct_same_size_memcpy"]
    value = row["pct_of_ceiling"] if value == "" else value
    text = "999+" if value >= 999.5 else fmt(value, 0)
    return text + ("f" if row["gpu_timing"] == "fed" else "")


def host_cell(rows):
    values = [row["host_us"] for row in rows if row["status"] == "ok"]
    return f"{statistics.median(values) / 1e3:.3g}" if values else "ERR"


def best_cell(rows):
    return short_variant(rows[0]["best_backend"])


def auto_cell(rows):
    row = rows[0]
    if row["auto_vs_best"] == "":
        return ""
    return f"{row['auto_vs_best']:.2f}" + ("*" if row["auto_within_5pct"] == "no" else "")


def is_swept(row):
    """A row of the num_ctas sweep (num_ctas an int; None rows are the group's own)."""
    return isinstance(row["num_ctas"], int)


def is_paged_kv(row):
    """A GPU row of PagedKVCache itself with num_ctas None (not the sweep, list API or torch)."""
    return (row["mode"] == "gpu" and row["api"] == "paged" and not is_swept(row)
            and row["function"].startswith("PagedKVCache."))


def figure(value):
    """Three significant digits, no exponent."""
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def host_times_cell(rows):
    row = rows[0]
    return f"{figure(row['host_us'])}/{figure(row['host_steady_us'])}"


def speedup_cell(rows):
    return f"{figure(rows[0]['speedup_vs_torch'])}x"


def ctas_label(row):
    """e.g. 'b2u pin NHD ctas=8 8SM'."""
    return (f"{row['direction']} {short(row['placement'])} {row['layout']} "
            f"ctas={row['num_ctas']} {row['sms']}SM")


def ctas_cell(rows):
    row = rows[0]
    if row["status"] != "ok":
        return failed_cell(row)
    return f"{fmt(row['gbps'], 0)} {fmt(row['gbps_per_sm'])}"


def ctas_order(row):
    return (row["layout"], row["placement"], row["num_ctas"] if is_swept(row) else math.inf)


def print_ctas_sweep(rows):
    """The num_ctas sweep of to_universal (device ids) with its num_ctas None rows."""
    nbs = {row["nb"] for row in rows if is_swept(row)}
    swept = sorted((row for row in rows if row["num_ctas"] != "" and row["nb"] in nbs
                    and row["function"] == "PagedKVCache.to_universal"
                    and row["backend"] == "device_ids"), key=ctas_order)
    print_pivot("paged num_ctas: PagedKVCache.to_universal, device ids; GB/s, GB/s per SM used",
                swept, ctas_label, nt_nb, ("nt", "nb"), ctas_cell, 12)


@dataclass
class Target:
    """One of the issue's targets: the worst figure of the rows it selects must pass."""
    text: str
    select: object      # row -> whether the target covers it
    value: object       # row -> its figure, in unit
    unit: str           # as printed after the figure: " us", "x"
    goal: float
    at_most: bool       # the figure must stay under goal (else reach it)

    def passes(self, value):
        return value < self.goal if self.at_most else value >= self.goal

    def line(self, rows):
        covered = [row for row in rows if self.select(row)]
        goal = f"target {'<' if self.at_most else '>='} {fmt(float(self.goal), 0)}{self.unit}"
        if not covered:
            return f"  n/a   {self.text} ({goal}): not measured"
        bad = [row for row in covered if row["status"] != "ok" or self.value(row) == ""]
        if bad:
            return (f"  MISS  {self.text} ({goal}): {len(bad)} of {len(covered)} rows "
                    "without a figure")
        worst = (max if self.at_most else min)(covered, key=self.value)
        value = self.value(worst)
        return (f"  {'PASS' if self.passes(value) else 'MISS'}  {self.text}: "
                f"{figure(value)}{self.unit} ({goal}; worst of "
                f"{len(covered)}: {label(worst)} nt={worst['nt']} nb={worst['nb']})")


def paged_targets():
    """The issue's targets, for nt = TARGET_NT.  Host times are those of calls issued back
    to back (host_steady_us); the from-idle figures are in the tables."""
    def host_time_at(kind, nb):
        # Device to device: one launch a call.  With pinned memory a call is staged in
        # pieces (benchmarks/beside.py times those against their own target).
        return lambda row: (is_paged_kv(row) and row["backend"] == kind and row["nb"] == nb
                            and row["nt"] == TARGET_NT and row["placement"] == "d2d")

    def list_at(nb):
        return lambda row: (row["mode"] == "gpu" and row["api"] == "paged" and row["nt"] == TARGET_NT
                            and row["backend"] == "list" and row["nb"] == nb)

    def speedup_at(nb):
        return lambda row: (is_paged_kv(row) and row["placement"] == "d2d" and row["nb"] == nb
                            and row["direction"] in ("b2u", "u2b") and row["nt"] == TARGET_NT)

    def bandwidth_of(placement):
        return lambda row: (is_paged_kv(row) and row["placement"] == placement
                            and row["nb"] >= BANDWIDTH_MIN_NB and row["nt"] == TARGET_NT)

    return [
        Target("PagedKVCache host time per call, back to back, d2d, nb=64, host ids",
               host_time_at("host_ids", 64), lambda row: row["host_steady_us"], " us", 15, True),
        Target("PagedKVCache host time per call, back to back, d2d, nb=64, device ids",
               host_time_at("device_ids", 64), lambda row: row["host_steady_us"], " us", 15, True),
        Target("list API host time per call, back to back, nb=64", list_at(64),
               lambda row: row["host_steady_us"] / 1e3, " ms", 3, True),
        Target("PagedKVCache speedup over the torch loop, d2d, nb=1", speedup_at(1),
               lambda row: row["speedup_vs_torch"], "x", 100, False),
        Target("PagedKVCache speedup over the torch loop, d2d, nb=256", speedup_at(256),
               lambda row: row["speedup_vs_torch"], "x", 6, False),
        Target(f"PagedKVCache d2d, nb>={BANDWIDTH_MIN_NB}, % of the device copy ceiling",
               bandwidth_of("d2d"), lambda row: row["pct_of_ceiling"], "%", 90, False),
        Target(f"PagedKVCache pinned, nb>={BANDWIDTH_MIN_NB}, % of the same-size pinned memcpy",
               bandwidth_of("pinned"), lambda row: row["pct_same_size_memcpy"], "%", 90, False),
    ]


def print_paged_summary(rows):
    """The paged group: speedups over the torch loop, the num_ctas sweep, the targets."""
    paged = [row for row in rows if row["api"] == "paged"]
    if not paged:
        return
    print_pivot("paged speedup over the torch loop, time per call = max(host, GPU) "
                "(cpu: host)", [row for row in paged if row["speedup_vs_torch"] != ""],
                label, nt_nb, ("nt", "nb"), speedup_cell, 6)
    print_pivot("paged host time per call, us: from an idle device / back to back",
                [row for row in paged if row["host_steady_us"] != ""], label, nt_nb, ("nt", "nb"),
                host_times_cell, 11)
    print_ctas_sweep(paged)
    print()
    print(f"paged targets (PASS/MISS on the worst row; GPU rows at nt={TARGET_NT}, num_ctas None)")
    for target in paged_targets():
        print(target.line(paged))


def print_failures(rows):
    failed = [row for row in rows if row["status"] != "ok"]
    if not failed:
        return
    print()
    print(f"not ok: {len(failed)}")
    for row in failed[:MAX_FAILURES_SHOWN]:
        print(f"  {label(row)} nt={row['nt']} nb={row['nb']}: {row['status']}"[:120])
    if len(failed) > MAX_FAILURES_SHOWN:
        print(f"  ... and {len(failed) - MAX_FAILURES_SHOWN} more in the CSV")


def print_summary(rows, gpu_name):
    """Compact tables (the lent GPU machine returns only the last 12,000 characters)."""
    print(environment_line(gpu_name))
    ceilings = [row for row in rows if row["mode"] == "ceiling" and row["nt"] == ""]
    if ceilings:
        print("ceilings: " + ", ".join(f"{row['direction']} {fmt(row['gbps'])} GB/s"
                                       for row in ceilings) + " (d2d: read + written)")
    sized = [row for row in rows if row["nt"] != ""]
    print_pivot("% of ceiling (pin: same-size memcpy; d2d: device copy; ceil: 1 GiB memcpy; "
                "cpu: memcpy time / ours; f: fed timing)",
                sized, label, nt_nb, ("nt", "nb"), pct_cell, 5)
    print_pivot("host ms per call (median over nt)", sized, label, nb_only, ("nb",), host_cell, 8)
    with_best = [row for row in rows if row["best_backend"]]
    print_pivot("fastest by GPU time (auto left out)", with_best,
                partial(label, with_variant=False), nt_nb, ("nt", "nb"), best_cell, 9)
    autos = [row for row in with_best if row["backend"] == "auto"]
    print_pivot("auto / fastest, GPU time (*: beyond 5%)", autos,
                partial(label, with_variant=False), nt_nb, ("nt", "nb"), auto_cell, 6)
    print_paged_summary(rows)
    print_failures(rows)


# ----------------------------------------------------------------------------- main

def resolve_device(choice):
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("kvbench: --device cuda but torch.cuda.is_available() is False")
    return choice


def check_required(apis):
    missing = [name for api in apis for name in REQUIRED[api] if not hasattr(kvbm_ext, name)]
    if missing:
        sys.exit(f"kvbench: this kvbm_ext build has no {', '.join(dict.fromkeys(missing))}: "
                 "rebuild it, or use --api list")


def multiprocessors(device):
    return next(d["multiprocessors"] for d in kvbm_ext.cuda_devices()
                if d["index"] == device.index)


def cpu_apis(apis):
    return [api for api in apis if api in CPU_APIS]


def run_gpu_mode(ctx, args):
    if kvbm_ext.is_using_stubs():
        sys.exit("kvbench: kvbm_ext was built without CUDA (is_using_stubs()); "
                 "rebuild with nvcc or use --device cpu")
    check_required(args.apis)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    with torch.cuda.stream(torch.cuda.Stream(device)):
        cycles_per_us = calibrate_sleep_cycles_per_us()
        print(f"torch.cuda._sleep: {cycles_per_us:.0f} cycles/us", flush=True)
        ceilings = measure_ceilings(ctx, device, args.quick, cycles_per_us)
        rows += ceilings.values()
        gpu = Gpu(device, torch.cuda.current_stream(device), cycles_per_us, ceilings,
                  batch_available(), multiprocessors(device),
                  CTAS_NB if CTAS_NB in args.nb else max(args.nb))
        rows += run_gpu_cases(ctx, gpu, args)
    if cpu_apis(args.apis):
        rows += run_cpu_cases(ctx, cpu_apis(args.apis), args.cpu_nt, args.cpu_nb, args.layouts)
    return rows


def main():
    args = parse_args()
    device = resolve_device(args.device)
    if device == "cpu" and cpu_apis(args.apis) != list(args.apis):
        sys.exit("kvbench: CPU mode times the list and paged groups only (--api list or paged)")
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else "none"
    ctx = Context(gpu_name, datetime.date.today().isoformat(), rep_policy(args))
    print(environment_line(gpu_name), flush=True)

    if device == "cuda":
        rows = run_gpu_mode(ctx, args)
    else:
        check_required(args.apis)
        rows = run_cpu_cases(ctx, args.apis, args.cpu_nt, args.cpu_nb, args.layouts)
    annotate_backends(rows)
    annotate_paged(rows)

    path = csv_path(args.csv, gpu_name, ctx.date)
    write_csv(path, rows)
    print()
    print_summary(rows, gpu_name)
    print(f"CSV: {path}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"kvbench: {len(failed)} case(s) not ok", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
