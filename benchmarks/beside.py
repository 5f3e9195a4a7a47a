#!/usr/bin/env python3
"""KV-block transfers beside a running forward pass: what each transfer path costs the model.

In a serving run, KV blocks move between the GPU's paged cache and pinned host memory
(offload, onload) while the model's forward pass runs on another stream.  A transfer that
is fast alone but holds the SMs is slow where it counts: it stretches the forward pass.
This script measures, for the Llama-3.1-70B KV cache (nl=80 no=2 nh=8 hd=128 bf16, nt=16,
5,242,880 bytes per block; vLLM per-layer caches [2, num_blocks, nt, nh, hd], "kbthd";
pinned universals [nb, nh, nl, no, nt, hd]):

  ceilings   pinned memcpys in the same run: 1 GiB each way, both ways at once on two
             streams (the bidirectional ceiling), and a memcpy of exactly nb blocks' bytes;
  alone      each transfer path and direction by itself (GB/s);
  beside     each path and direction while a stand-in of the forward pass runs on its own
             stream: how much the stand-in slows down, and the GB/s the transfer keeps;
  curve      the staged path's num_ctas (and staging size) against the slowdown it causes;
  host       host time of one staged PagedKVCache.to_universal call, issued back to back.

Paths: "auto" (the default backend: a permute kernel into device staging, copy engines
over PCIe, on the default CTA count), "staged" (backend="copy_engines" with num_ctas=32: the
faster, more intrusive point of the trade-off), "kernel_all" / "kernel_few" (the SM kernel
reading or writing pinned memory directly, on every SM / on 8 CTAs), and
"copy_engines_plain": one copy-engine memcpy of the same number of bytes between a
contiguous device buffer and the pinned buffer, no permute: the reference for what copy
engines reach beside the model (a memcpy_batch of the 10,240 32 KiB chunks of nb=64
would be bound by the host's cost per chunk, not by the engines).  Directions:
offload (cache -> pinned), onload (pinned -> cache), both (one of each at once on two
streams, disjoint blocks).  Stand-ins: "gemm" (bf16 8192^3 GEMMs, compute-bound) and
"sweep" (add_ over a 4 GiB tensor, memory-bound).

Every path is checked bit for bit against pure torch before anything is timed.  Output:
a CSV and a log in --out (default: ./beside-results outside the source tree, else a new
temporary directory), PASS/MISS per target at the end.  The timing primitives and the
output location are harness.py's, shared with kvbench.py.  See benchmarks/README.md
("beside.py").
"""

import argparse
import csv
import datetime
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402
from kvbm_ext._no_gpu import require_gpu  # noqa: E402
from harness import (HD, NH, NL, NO, NT, STEADY_REPS, Tee, calibrate_sleep_cycles_per_us,  # noqa: E402
                     fill_random_, int_list, output_dir, run_stem, steady_host_us)
from report import csv_cells, fmt  # noqa: E402

DTYPE = torch.bfloat16
CHUNK_BYTES = NT * NH * HD * DTYPE.itemsize    # one contiguous [nt, nh, hd] chunk: 32 KiB
BLOCK_BYTES = NL * NO * CHUNK_BYTES            # 5,242,880
MIB, GIB = 1 << 20, 1 << 30

# The pure-torch gather of nb blocks is [nl, no, nb, nt, nh, hd]; the pinned buffer of a
# path holds it in this order: universals [nb, nh, nl, no, nt, hd], or the plain copy's
# chunks [nb, nl, no, nt, nh, hd] (chunk (b, l, o) at offset ((b*nl + l)*no + o) * 32 KiB).
UNIVERSAL_ORDER = (2, 4, 0, 1, 3, 5)
POISON = 0xA5                                  # destinations are filled with this byte
POISON_INT16 = 0xA5A5 - 0x10000                # the same bytes as one int16 value

DIRECTIONS = ("offload", "onload", "both")
LANE_DIRECTIONS = {"offload": ("offload",), "onload": ("onload",), "both": ("offload", "onload")}
MIN_NUM_BLOCKS = 256
ID_SEED = 2026                    # the block ids are the same in every run
VERIFY_NB = 3                     # verified at this nb and at every timed one
HOST_NBS = (1, 64)                # host time of a staged call at these nb
KERNEL_FEW_CTAS = 8
STAGED_CTAS = 32                  # the "staged" path's num_ctas
CURVE_NB = 64                     # the curve's nb (the largest --nb when 64 is not in it)
CURVE_STAGING = (96 * MIB, 256 * MIB)

GEMM_N = 8192                     # stand-in "gemm": bf16 [N, N] @ [N, N]
SWEEP_BYTES = 4 * GIB             # stand-in "sweep": add_(1) over a float32 tensor this size
STANDIN_MS = {"gemm": 60.0, "sweep": 80.0}
QUICK_STANDIN_MS = 30.0
CALIBRATION_ITERS = 10            # kernels in the stand-in run that sets its length
FIRST_ENQUEUE_US = 2000.0         # gate for a stand-in before its enqueue time is known

MIN_TIMED_MS = 20.0               # an alone timing loops k transfers for at least this long
PCIE_GUESS_GBPS = 55.0            # sets k; a slower path just runs longer
IN_FLIGHT = 3                     # transfers queued per stream beside a stand-in
GATE_BASE_US, GATE_FACTOR = 300.0, 1.5
# Every stand-in run, alone or beside, starts after the GPU has idled this long, because how
# fast the GEMM loop runs depends on how long the GPU rested before it.  Without it, a beside
# run at nb=64 left up to 18 ms of transfers queued after the stand-in's end, the alone run
# that followed started rested and took 64-65 ms against 69-70 ms everywhere else, and every
# path beside it, plain copy engines included, read as 7-9 % slower
# (results/beside-NVIDIA-H200-2026-11-23-3.log); with it, plain copy engines read -2.5 to
# +2.9 % (-4.log).
REST_S = 0.05

BUDGET_S = 330.0                  # the curve stops when the run has taken this long
QUICK_BUDGET_S = 110.0

TARGET_ALONE_PCT = 97.0           # auto alone, % of the same-size memcpy, nb >= 8
TARGET_ALONE_NB1_PCT = 90.0       # ... at nb = 1
TARGET_SLOWDOWN_PCT = 2.0         # beside: stand-in slowed by at most this
TARGET_PLAIN_RATIO = 0.95         # ... while auto keeps this share of the plain copy's GB/s
TARGET_BOTH_PCT = 95.0            # auto both ways, % of the bidirectional ceiling
TARGET_HOST_US = {64: 150.0, 1: 30.0}

COLUMNS = [
    "gpu_name", "date", "group", "path", "direction", "nb", "bytes", "standin", "num_ctas",
    "staging_bytes", "reps", "transfers", "call_host_us",
    "transfer_gbps_alone", "transfer_gbps_beside",
    "standin_ms_alone", "standin_ms_beside", "slowdown_pct", "standin_alone_spread_pct",
    "ratio_to_plain_copy_engines_beside",
    "same_size_memcpy_gbps", "pct_same_size_memcpy", "ceiling_gbps", "pct_of_ceiling",
    "host_steady_us", "note",
]
REQUIRED = ("PagedKVCache", "memcpy_batch", "is_memcpy_batch_available", "set_staging",
            "staging_info")


# ----------------------------------------------------------------------------- arguments

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time KV-block transfers between a vLLM paged cache and pinned host "
                    "memory alone and beside forward-pass stand-ins (Llama-3.1-70B, nt=16).")
    parser.add_argument("--nb", type=int_list, default=None,
                        help="blocks per transfer (default 8,64; 64 with --quick)")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions of each measurement, medians reported "
                             "(default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: nb 64, 1 repetition, ~30 ms stand-ins, curve with "
                             "num_ctas 8,32 only (under 2 minutes on an H200)")
    parser.add_argument("--out", default=None,
                        help="directory for beside-<gpu>-<date>.csv and .log (default: "
                             "./beside-results when the current directory is outside this "
                             "source tree, else a new temporary directory; printed at the end)")
    parser.add_argument("--skip-curve", action="store_true",
                        help="leave out the num_ctas / staging-size curve")
    args = parser.parse_args(argv)
    if args.nb is None:
        args.nb = [64] if args.quick else [8, 64]
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.standin_ms = ({name: QUICK_STANDIN_MS for name in STANDIN_MS} if args.quick
                       else dict(STANDIN_MS))
    args.curve_ctas = (8, 32) if args.quick else (4, 8, 16, 32, 64)
    args.budget_s = QUICK_BUDGET_S if args.quick else BUDGET_S
    return args


# ----------------------------------------------------------------------------- output

class Results:
    """The rows measured so far, each written to the CSV (and printed) as it comes, so
    that a run cut short keeps what it measured."""

    def __init__(self, csv_path, gpu_name, date, started):
        self.csv_path, self.gpu_name, self.date, self.started = csv_path, gpu_name, date, started
        self.rows = []
        self.file = open(csv_path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS)
        self.writer.writeheader()

    def say(self, text):
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def add(self, **fields):
        row = {column: "" for column in COLUMNS}
        row.update(gpu_name=self.gpu_name, date=self.date)
        row.update(fields)
        self.rows.append(row)
        self.writer.writerow(csv_cells(row))
        self.file.flush()
        self.say(describe(row))
        return row

    def find(self, **match):
        """The last row whose fields equal `match`, else None."""
        for row in reversed(self.rows):
            if all(row[k] == v for k, v in match.items()):
                return row
        return None


def describe(row):
    """One progress line for a row: what it is and its figures."""
    what = " ".join(str(row[k]) for k in ("group", "path", "direction") if row[k] != "")
    for key in ("nb", "standin", "num_ctas"):
        if row[key] != "":
            what += f" {key}={row[key]}"
    if row["staging_bytes"] != "":
        what += f" staging={row['staging_bytes'] // MIB}MiB"
    figures = [("transfer_gbps_alone", "alone GB/s"), ("transfer_gbps_beside", "beside GB/s"),
               ("pct_same_size_memcpy", "% same-size"), ("pct_of_ceiling", "% ceiling"),
               ("standin_ms_alone", "stand-in alone ms"), ("standin_ms_beside", "beside ms"),
               ("slowdown_pct", "slowed %"), ("ratio_to_plain_copy_engines_beside", "x plain"),
               ("call_host_us", "host us/call"), ("host_steady_us", "host us steady")]
    shown = [f"{name} {fmt(row[key], 2 if key.startswith('ratio') else 1)}"
             for key, name in figures if row[key] != ""]
    note = f" ({row['note']})" if row["note"] else ""
    return f"{what}: {', '.join(shown)}{note}"


# ----------------------------------------------------------------------------- GPU timing

def new_event():
    return torch.cuda.Event(enable_timing=True)


def record_event(stream):
    event = new_event()
    event.record(stream)
    return event


def timed_call(call):
    """Host seconds spent in call()."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def gbps(nbytes, ms):
    return nbytes / (ms * 1e6) if ms > 0 else 0.0


def gate_us(host_us_to_fill):
    """A gate long enough for the host to enqueue host_us_to_fill of work behind it."""
    return GATE_BASE_US + GATE_FACTOR * host_us_to_fill


@dataclass
class Lane:
    """One stream's share of a measurement: the call that enqueues one transfer on it."""
    stream: object
    call: object
    nbytes: int


@dataclass
class StandIn:
    """A forward-pass stand-in: `iters` kernels back to back on its own stream."""
    name: str
    stream: object
    step: object                         # enqueues one kernel on the current stream
    iters: int = CALIBRATION_ITERS
    enqueue_us: float = FIRST_ENQUEUE_US  # host time to enqueue one run

    def enqueue(self, origin):
        """One run behind the gate event `origin`; returns its (start, end) events."""
        self.stream.wait_event(origin)
        host_start = time.perf_counter()
        with torch.cuda.stream(self.stream):
            start = record_event(self.stream)
            for _ in range(self.iters):
                self.step()
            end = record_event(self.stream)
        self.enqueue_us = (time.perf_counter() - host_start) * 1e6
        return start, end


@dataclass
class Beside:
    """One run of a stand-in with transfers looping beside it."""
    standin_ms: float
    gbps: float          # of the transfers that finished within the stand-in's run
    transfers: int       # how many did
    host_s: list         # host seconds of each transfer call


# ----------------------------------------------------------------------------- setup

def gpu_device():
    return torch.device("cuda", torch.cuda.current_device())


def pinned_empty(shape, dtype):
    return torch.empty(shape, dtype=dtype, pin_memory=True)


@dataclass
class Side:
    """nb cache blocks one transfer moves, and the pinned buffer they go to or come from."""
    ids: list                 # distinct block ids
    ids_dev: torch.Tensor     # the same ids, int64 on the device
    pinned: torch.Tensor      # pinned universals [nb, nh, nl, no, nt, hd]

    @property
    def nb(self):
        return len(self.ids)


@dataclass
class Bench:
    """What every measurement uses: the cache, pinned pools, streams, the run's results."""
    args: object
    device: torch.device
    results: Results
    caches: list              # per layer [no, num_blocks, nt, nh, hd]
    cache: object             # kvbm_ext.PagedKVCache(caches, "kbthd")
    block_order: list         # a fixed random permutation of the cache's blocks
    capacity: int             # the most blocks one side holds
    pools: dict               # direction -> pinned universals [capacity, nh, nl, no, nt, hd]
    scratch: dict             # direction -> device bytes for the same-size memcpy
    streams: dict             # direction -> the stream its transfers run on
    gate_stream: object
    cycles_per_us: float
    sms: int
    sides: dict = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)   # direction -> 1 GiB memcpy GB/s

    def side(self, direction, nb):
        """Offloads read blocks order[:nb] into pool "offload"; onloads write blocks
        order[capacity:capacity+nb] from pool "onload": disjoint, so both run at once."""
        if (direction, nb) not in self.sides:
            first = 0 if direction == "offload" else self.capacity
            ids = self.block_order[first:first + nb]
            ids_dev = torch.tensor(ids, dtype=torch.int64, device=self.device)
            self.sides[direction, nb] = Side(ids, ids_dev, self.pools[direction][:nb])
        return self.sides[direction, nb]

    def lanes(self, path, direction, nb):
        return [Lane(self.streams[d], path.bind(self.side(d, nb), d, self.streams[d]),
                     nb * BLOCK_BYTES)
                for d in LANE_DIRECTIONS[direction]]

    def open_gate(self, streams, us):
        """Hold the streams behind a GPU sleep of `us` so that what the host enqueues on
        them next starts together, with their queues filled; returns the event where they
        start, the time origin of the measurement."""
        with torch.cuda.stream(self.gate_stream):
            torch.cuda._sleep(int(us * self.cycles_per_us))
        origin = record_event(self.gate_stream)
        for stream in streams:
            stream.wait_event(origin)
        return origin

    def over_budget(self):
        return time.monotonic() - self.results.started > self.args.budget_s


def make_bench(args, device, results):
    capacity = max(max(args.nb), max(HOST_NBS), CURVE_NB)
    num_blocks = max(MIN_NUM_BLOCKS, 2 * capacity)
    caches = [torch.empty((NO, num_blocks, NT, NH, HD), dtype=DTYPE, device=device)
              for _ in range(NL)]
    for layer in caches:
        fill_random_(layer, device)
    block_order = random.Random(ID_SEED).sample(range(num_blocks), num_blocks)
    pools = {d: pinned_empty((capacity, NH, NL, NO, NT, HD), DTYPE)
             for d in LANE_DIRECTIONS["both"]}
    for pool in pools.values():
        fill_random_(pool, device)
    scratch = {d: torch.empty(capacity * BLOCK_BYTES, dtype=torch.uint8, device=device)
               for d in LANE_DIRECTIONS["both"]}
    for buffer in scratch.values():
        fill_random_(buffer, device)
    streams = {d: torch.cuda.Stream(device) for d in LANE_DIRECTIONS["both"]}
    gate_stream = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    return Bench(args, device, results, caches, kvbm_ext.PagedKVCache(caches, "kbthd"),
                 block_order, capacity, pools, scratch, streams, gate_stream,
                 calibrate_sleep_cycles_per_us(gate_stream),
                 torch.cuda.get_device_properties(device).multi_processor_count)


# ----------------------------------------------------------------------------- paths

@dataclass(frozen=True)
class Path:
    """A way to move blocks: bind(side, direction, stream) returns a call that enqueues
    one transfer of the side's blocks on the stream."""
    name: str
    pinned_order: tuple        # how the pinned buffer holds the gathered blocks
    bind: object
    num_ctas: object = ""      # for the rows: what the path passes as num_ctas
    uses_staging: bool = False
    matches: object = None     # matches(bench, side, direction) -> bool; None: pinned_matches


def paged_path(name, cache, uses_staging, **options):
    """PagedKVCache.to_universal / from_universal with device ids and these options
    (none: the default call a server makes)."""
    def bind(side, direction, stream):
        if direction == "offload":
            return partial(cache.to_universal, side.ids_dev, side.pinned, stream=stream, **options)
        return partial(cache.from_universal, side.pinned, side.ids_dev, stream=stream, **options)
    return Path(name, UNIVERSAL_ORDER, bind, options.get("num_ctas", "default"), uses_staging)


def plain_path(bench):
    """One copy-engine memcpy of the same bytes between a contiguous device buffer and the
    side's pinned buffer, no permute."""
    def buffers(side, direction):
        pinned = side.pinned.view(torch.uint8).view(-1)
        return bench.scratch[direction][:pinned.numel()], pinned

    def bind(side, direction, stream):
        device, pinned = buffers(side, direction)
        src, dst = (device, pinned) if direction == "offload" else (pinned, device)

        def call():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        return call

    def matches(bench_, side, direction):
        device, pinned = buffers(side, direction)
        return torch.equal(device, pinned.to(device.device))

    return Path("copy_engines_plain", UNIVERSAL_ORDER, bind, matches=matches)


def auto_path(cache):
    return paged_path("auto", cache, True)


def staged_path(cache, **num_ctas):
    return paged_path("staged", cache, True, backend="copy_engines", **num_ctas)


def kernel_path(name, cache, num_ctas):
    return paged_path(name, cache, False, backend="kernel", num_ctas=num_ctas)


def main_paths(bench):
    """The paths of the main grid, the plain copy first: it is the reference of the
    others' beside rows."""
    cache = bench.cache
    return [plain_path(bench), auto_path(cache), staged_path(cache, num_ctas=STAGED_CTAS),
            kernel_path("kernel_all", cache, bench.sms),
            kernel_path("kernel_few", cache, KERNEL_FEW_CTAS)]


def staging_bytes():
    return kvbm_ext.staging_info()["size_bytes"]


# ----------------------------------------------------------------------------- verification

def gathered(caches, ids_dev):
    """Pure torch: the blocks ids_dev of the cache as [nl, no, nb, nt, nh, hd]."""
    return torch.stack([layer.index_select(1, ids_dev) for layer in caches])


def pinned_matches(caches, side, order):
    """Whether the side's pinned buffer, read in `order`, equals its cache blocks bit for
    bit (offload: U[b][h, l, o, t, :] == caches[l][o, ids[b], t, h, :]; after an onload
    the cache blocks equal U the same way)."""
    expected = gathered(caches, side.ids_dev).permute(order)
    actual = side.pinned.view(expected.shape).to(expected.device)
    return torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def poison_destination(bench, side, direction):
    """0xA5 bytes over what a transfer writes; fresh random bits in what an onload reads."""
    if direction == "offload":
        side.pinned.view(torch.uint8).fill_(POISON)
    else:
        fill_random_(side.pinned, bench.device)
        for layer in bench.caches:
            layer.view(torch.int16).index_fill_(1, side.ids_dev, POISON_INT16)


def verify(bench, path, directions, nbs):
    """Run the path once per direction and nb on poisoned destinations and compare with
    pure torch; returns the first problem, or None."""
    for nb in nbs:
        for direction in directions:
            lane_directions = LANE_DIRECTIONS[direction]
            for d in lane_directions:
                poison_destination(bench, bench.side(d, nb), d)
            torch.cuda.synchronize()
            try:
                for lane in bench.lanes(path, direction, nb):
                    lane.call()
                torch.cuda.synchronize()
            except Exception as error:  # report which path and case raised, then abort
                return f"{direction} nb={nb}: {type(error).__name__}: {error}"
            for d in lane_directions:
                side = bench.side(d, nb)
                ok = (path.matches(bench, side, d) if path.matches
                      else pinned_matches(bench.caches, side, path.pinned_order))
                if not ok:
                    what = "the pinned buffer" if d == "offload" else "the cache blocks"
                    return f"{direction} nb={nb}: {what} differ from the torch reference"
    return None


def verify_or_exit(bench, path, directions, nbs):
    problem = verify(bench, path, directions, nbs)
    label = path.name
    if path.uses_staging:
        label += f" (num_ctas={path.num_ctas}, staging {staging_bytes() // MIB} MiB)"
    if problem:
        bench.results.say(f"MISMATCH {label}: {problem}")
        sys.exit(f"beside: {label} is not bit-exact ({problem}); nothing timed after it")
    bench.results.say(f"verified {label}: {', '.join(directions)} at nb="
                      f"{','.join(str(nb) for nb in nbs)}")


# ----------------------------------------------------------------------------- measurements

def warm_up(lanes):
    """Each lane's call once from an idle device; returns their host microseconds summed."""
    total_s = 0.0
    for lane in lanes:
        torch.cuda.synchronize()
        total_s += timed_call(lane.call)
    torch.cuda.synchronize()
    return total_s * 1e6


def transfers_per_timing(lanes):
    """k transfers per lane make a timing of at least MIN_TIMED_MS at PCIE_GUESS_GBPS."""
    ms_each = lanes[0].nbytes / (PCIE_GUESS_GBPS * 1e6)
    return max(2, math.ceil(MIN_TIMED_MS / ms_each))


def time_alone(bench, lanes, k, first_call_us):
    """k transfers back to back on every lane, all lanes at once: (GB/s = all bytes over
    the wall time from their common start until the last ends, host seconds per call)."""
    torch.cuda.synchronize()
    origin = bench.open_gate([lane.stream for lane in lanes], gate_us(first_call_us))
    host_s = [timed_call(lane.call) for _ in range(k) for lane in lanes]
    ends = [record_event(lane.stream) for lane in lanes]
    torch.cuda.synchronize()
    wall_ms = max(origin.elapsed_time(end) for end in ends)
    return gbps(k * sum(lane.nbytes for lane in lanes), wall_ms), host_s


@dataclass
class Alone:
    gbps: float
    host_us: float       # median host time per call
    transfers: int       # per timing, all lanes
    first_call_us: float


def measure_alone(bench, lanes):
    """Median GB/s of --reps timings of the lanes by themselves (after a warm-up)."""
    first_call_us = warm_up(lanes)
    k = transfers_per_timing(lanes)
    timings = [time_alone(bench, lanes, k, first_call_us) for _ in range(bench.args.reps)]
    host_s = [s for _, samples in timings for s in samples]
    return Alone(statistics.median(rate for rate, _ in timings),
                 statistics.median(host_s) * 1e6, k * len(lanes), first_call_us)


def rest():
    """Wait for the device, then let it idle REST_S."""
    torch.cuda.synchronize()
    time.sleep(REST_S)


def standin_alone_ms(bench, standin):
    rest()
    origin = bench.open_gate([standin.stream], gate_us(standin.enqueue_us))
    start, end = standin.enqueue(origin)
    end.synchronize()
    return start.elapsed_time(end)


def lane_gbps(end_times_ms, nbytes):
    """A lane's rate from the end times of its transfers (ms from the common start): from
    the first end to the last, so that neither the gate's head start for the first call nor
    its ramp counts; from the start when only one transfer ended."""
    if len(end_times_ms) == 1:
        return gbps(nbytes, end_times_ms[0])
    return gbps((len(end_times_ms) - 1) * nbytes, end_times_ms[-1] - end_times_ms[0])


def run_beside(bench, standin, lanes, first_call_us):
    """One stand-in run with transfers looping beside it: the host keeps IN_FLIGHT
    transfers queued on every lane until the stand-in's end event has completed.  A lane's
    GB/s counts the transfers that finished within the stand-in's run (lane_gbps); with
    two lanes ("both") the two rates add up."""
    rest()
    origin = bench.open_gate([standin.stream] + [lane.stream for lane in lanes],
                             gate_us(standin.enqueue_us + first_call_us))
    start, end = standin.enqueue(origin)
    issued = [[] for _ in lanes]          # per lane, the end event of every transfer
    retired = [0] * len(lanes)            # per lane, how many of them are known done
    host_s = []
    while not end.query():
        for i, lane in enumerate(lanes):
            events = issued[i]
            while retired[i] < len(events) and events[retired[i]].query():
                retired[i] += 1
            if len(events) - retired[i] < IN_FLIGHT:
                host_s.append(timed_call(lane.call))
                events.append(record_event(lane.stream))
    torch.cuda.synchronize()
    window_ms = origin.elapsed_time(end)
    rate, count = 0.0, 0
    for lane, events in zip(lanes, issued):
        within = [t for t in (origin.elapsed_time(e) for e in events) if t <= window_ms]
        if within:
            rate += lane_gbps(within, lane.nbytes)
            count += len(within)
    return Beside(start.elapsed_time(end), rate, count, host_s)


def measure_beside(bench, standin, lanes, first_call_us):
    """--reps beside runs, each followed by a run of the stand-in alone (and one before
    the first), so that the alone figure is the median of runs near in time."""
    alone_ms = [standin_alone_ms(bench, standin)]
    runs = []
    for _ in range(bench.args.reps):
        runs.append(run_beside(bench, standin, lanes, first_call_us))
        alone_ms.append(standin_alone_ms(bench, standin))
    return alone_ms, runs


def beside_fields(alone_ms, runs):
    alone = statistics.median(alone_ms)
    beside = statistics.median(run.standin_ms for run in runs)
    host_s = [s for run in runs for s in run.host_s]
    return dict(standin_ms_alone=alone, standin_ms_beside=beside,
                slowdown_pct=100 * (beside - alone) / alone,
                standin_alone_spread_pct=100 * (max(alone_ms) - min(alone_ms)) / alone,
                transfer_gbps_beside=statistics.median(run.gbps for run in runs),
                transfers=statistics.median(run.transfers for run in runs),
                call_host_us=statistics.median(host_s) * 1e6 if host_s else "")


def path_fields(path, direction, nb):
    fields = dict(path=path.name, direction=direction, nb=nb,
                  bytes=nb * BLOCK_BYTES * len(LANE_DIRECTIONS[direction]),
                  num_ctas=path.num_ctas)
    if path.uses_staging:
        fields["staging_bytes"] = staging_bytes()
    return fields


def host_bound_note(bench, host_us, lanes, direction):
    """A note when the host takes longer to issue one transfer per lane than a lane's
    transfer takes at the 1 GiB memcpy rate: then the path cannot reach that rate, the
    GPU waits for the host."""
    if host_us == "":
        return ""
    lane_gbps = bench.ceilings[direction] / len(lanes)
    ceiling_us = lanes[0].nbytes / (lane_gbps * 1e3)
    host_cycle_us = host_us * len(lanes)
    if host_cycle_us <= ceiling_us:
        return ""
    return (f"host-bound: {host_cycle_us:.0f} us of calls per transfer, "
            f"{ceiling_us:.0f} us at the memcpy ceiling")


def add_beside_row(bench, group, path, direction, nb, standin, lanes, alone):
    """Measure the lanes beside the stand-in and add the row."""
    alone_ms, runs = measure_beside(bench, standin, lanes, alone.first_call_us)
    fields = beside_fields(alone_ms, runs)
    plain = bench.results.find(group="beside", path="copy_engines_plain", direction=direction,
                               nb=nb, standin=standin.name)
    if plain and plain["transfer_gbps_beside"]:
        fields["ratio_to_plain_copy_engines_beside"] = (fields["transfer_gbps_beside"]
                                                        / plain["transfer_gbps_beside"])
    note = host_bound_note(bench, fields["call_host_us"], lanes, direction)
    if not fields["transfers"]:
        note = "no transfer finished within the stand-in's run"
    bench.results.add(group=group, standin=standin.name, reps=bench.args.reps,
                      transfer_gbps_alone=alone.gbps, note=note,
                      **path_fields(path, direction, nb), **fields)


def copy_lane(stream, dst, src, nbytes):
    """A torch copy_ (one cudaMemcpyAsync) enqueued on the stream."""
    def call():
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    return Lane(stream, call, nbytes)


def memcpy_lanes(bench, direction, device_bytes, pinned_bytes):
    """Lanes of plain memcpys: offload device_bytes[d] -> pinned_bytes[d], onload back."""
    lanes = {"offload": copy_lane(bench.streams["offload"], pinned_bytes["offload"],
                                  device_bytes["offload"], device_bytes["offload"].numel()),
             "onload": copy_lane(bench.streams["onload"], device_bytes["onload"],
                                 pinned_bytes["onload"], device_bytes["onload"].numel())}
    return [lanes[d] for d in LANE_DIRECTIONS[direction]]


def measure_ceilings(bench):
    """1 GiB pinned memcpys each way and both ways at once, into bench.ceilings."""
    both = LANE_DIRECTIONS["both"]
    device_bytes = {d: torch.empty(GIB, dtype=torch.uint8, device=bench.device) for d in both}
    pinned_bytes = {d: pinned_empty(GIB, torch.uint8) for d in both}
    for direction in DIRECTIONS:
        lanes = memcpy_lanes(bench, direction, device_bytes, pinned_bytes)
        alone = measure_alone(bench, lanes)
        bench.ceilings[direction] = alone.gbps
        bench.results.add(group="ceiling", path="memcpy_1GiB", direction=direction,
                          bytes=GIB * len(lanes), reps=bench.args.reps, transfers=alone.transfers,
                          transfer_gbps_alone=alone.gbps)


def measure_same_size(bench, nb):
    """A pinned memcpy of exactly nb blocks' bytes, each way and both; direction -> GB/s."""
    nbytes = nb * BLOCK_BYTES
    device_bytes = {d: bench.scratch[d][:nbytes] for d in bench.scratch}
    pinned_bytes = {d: bench.side(d, nb).pinned.view(torch.uint8).view(-1) for d in bench.scratch}
    same_size = {}
    for direction in DIRECTIONS:
        alone = measure_alone(bench, memcpy_lanes(bench, direction, device_bytes, pinned_bytes))
        same_size[direction] = alone.gbps
        bench.results.add(group="ceiling", path="memcpy_same_size", direction=direction, nb=nb,
                          bytes=nbytes * len(LANE_DIRECTIONS[direction]), reps=bench.args.reps,
                          transfers=alone.transfers, transfer_gbps_alone=alone.gbps,
                          ceiling_gbps=bench.ceilings[direction],
                          pct_of_ceiling=100 * alone.gbps / bench.ceilings[direction])
    return same_size


def add_alone_row(bench, path, direction, nb, lanes, alone, same_size):
    bench.results.add(group="alone", reps=bench.args.reps, transfers=alone.transfers,
                      call_host_us=alone.host_us, transfer_gbps_alone=alone.gbps,
                      same_size_memcpy_gbps=same_size[direction],
                      pct_same_size_memcpy=100 * alone.gbps / same_size[direction],
                      ceiling_gbps=bench.ceilings[direction],
                      pct_of_ceiling=100 * alone.gbps / bench.ceilings[direction],
                      note=host_bound_note(bench, alone.host_us, lanes, direction),
                      **path_fields(path, direction, nb))


def gemm_standin(device):
    a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    b = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(a)
    return StandIn("gemm", torch.cuda.Stream(device), partial(torch.matmul, a, b, out=out))


def sweep_standin(device):
    x = torch.zeros(SWEEP_BYTES // 4, dtype=torch.float32, device=device)
    return StandIn("sweep", torch.cuda.Stream(device), partial(x.add_, 1.0))


def calibrate_standin(bench, standin, target_ms):
    """Set the stand-in's kernel count so that one run takes about target_ms alone, then
    add its row (the median of --reps runs, at least 3)."""
    for _ in range(3):                      # load the kernels, let cuBLAS pick its own
        with torch.cuda.stream(standin.stream):
            standin.step()
    torch.cuda.synchronize()
    standin.iters = CALIBRATION_ITERS
    ms_per_iter = standin_alone_ms(bench, standin) / CALIBRATION_ITERS
    standin.iters = max(1, round(target_ms / ms_per_iter))
    standin.enqueue_us *= standin.iters / CALIBRATION_ITERS
    runs = [standin_alone_ms(bench, standin) for _ in range(max(3, bench.args.reps))]
    bench.results.add(group="standin", standin=standin.name, reps=len(runs),
                      standin_ms_alone=statistics.median(runs),
                      standin_alone_spread_pct=100 * (max(runs) - min(runs))
                      / statistics.median(runs),
                      note=f"{standin.iters} kernels per run, "
                           f"{standin.enqueue_us:.0f} us to enqueue")


def run_main_grid(bench, paths, standins):
    """Per nb: the same-size memcpys, then every path and direction alone and beside each
    stand-in."""
    for nb in bench.args.nb:
        same_size = measure_same_size(bench, nb)
        for path in paths:
            for direction in DIRECTIONS:
                lanes = bench.lanes(path, direction, nb)
                alone = measure_alone(bench, lanes)
                add_alone_row(bench, path, direction, nb, lanes, alone, same_size)
                for standin in standins:
                    add_beside_row(bench, "beside", path, direction, nb, standin, lanes, alone)


def measure_host_time(bench):
    """Host time of the default (staged) to_universal call at nb = 1 and 64."""
    path = auto_path(bench.cache)
    for nb in HOST_NBS:
        (lane,) = bench.lanes(path, "offload", nb)
        warm_up([lane])
        bench.results.add(group="host", host_steady_us=steady_host_us([lane.call]),
                          reps=STEADY_REPS, **path_fields(path, "offload", nb))


def set_staging(bench, size):
    """kvbm_ext.set_staging between measurements, with the device idle."""
    torch.cuda.synchronize()
    kvbm_ext.set_staging(size)
    bench.results.say(f"staging: {kvbm_ext.staging_info()}")


def curve_point(bench, path, direction, nb, standins):
    lanes = bench.lanes(path, direction, nb)
    alone = measure_alone(bench, lanes)
    for standin in standins:
        add_beside_row(bench, "curve", path, direction, nb, standin, lanes, alone)


def curve_ctas(bench, direction, nb, standins, staging_note):
    """The staged path at each --curve num_ctas, verified, then timed alone and beside."""
    for num_ctas in bench.args.curve_ctas:
        if bench.over_budget():
            bench.results.say(f"curve: time budget of {bench.args.budget_s:.0f} s spent, "
                              f"skipping {direction} {staging_note} num_ctas={num_ctas}")
            continue
        path = staged_path(bench.cache, num_ctas=num_ctas)
        verify_or_exit(bench, path, (direction,), (nb,))
        curve_point(bench, path, direction, nb, standins)


def run_curve(bench, standins):
    """The staged path's num_ctas at CURVE_NB, beside each stand-in: offload at each
    staging size, then both directions at once at the default size (each of the two calls
    on num_ctas: what a bound shared by two concurrent calls would leave each); then
    kernel_few for comparison.  The staging size is restored after."""
    nb = CURVE_NB if CURVE_NB in bench.args.nb else max(bench.args.nb)
    original = staging_bytes()
    for size in CURVE_STAGING:
        set_staging(bench, size)
        curve_ctas(bench, "offload", nb, standins, f"staging {size // MIB} MiB")
    set_staging(bench, original)
    curve_ctas(bench, "both", nb, standins, f"staging {original // MIB} MiB")
    curve_point(bench, kernel_path("kernel_few", bench.cache, KERNEL_FEW_CTAS), "offload", nb, standins)


# ----------------------------------------------------------------------------- summary

def cell(row, keys):
    """A table cell: the row's figures for keys, "-" without a row, "?" without a figure."""
    if row is None:
        return "-"
    if any(row[key] == "" for key in keys):
        return "?"
    return " ".join(cell_figure(key, row[key]) for key in keys)


def cell_figure(key, value):
    if key == "slowdown_pct":
        return f"{value:+.1f}"
    if key == "ratio_to_plain_copy_engines_beside":
        return f"{100 * value:.0f}%"
    return f"{value:.1f}"


def print_table(title, labels, columns, lookup, width=16):
    """labels: tuples, printed joined by spaces; columns: (heading, key) pairs;
    lookup(label, key) is the text of a cell."""
    print()
    print(title)
    print(f"{'':<32}" + "".join(f"{heading:>{width}}" for heading, _ in columns))
    for label in labels:
        print(f"{' '.join(label):<32}"
              + "".join(f"{lookup(label, key):>{width}}" for _, key in columns))


def print_summary(results, args, paths, standins):
    rows = results.rows
    ceilings = [r for r in rows if r["group"] == "ceiling" and r["nb"] == ""]
    print()
    print("ceilings, 1 GiB pinned memcpy: "
          + ", ".join(f"{r['direction']} {fmt(r['transfer_gbps_alone'])} GB/s" for r in ceilings)
          + " (both: the two streams' bytes over the wall time)")
    for s in standins:
        row = results.find(group="standin", standin=s.name)
        print(f"stand-in {s.name}: {fmt(row['standin_ms_alone'])} ms alone ({row['note']})")
    labels = [(p.name, d) for p in paths for d in DIRECTIONS]
    nb_columns = [(f"nb={nb}", nb) for nb in args.nb]

    def alone_cell(label, nb):
        name, direction = label
        if name == "memcpy_same_size":
            return cell(results.find(group="ceiling", path=name, direction=direction, nb=nb),
                        ("transfer_gbps_alone",))
        return cell(results.find(group="alone", path=name, direction=direction, nb=nb),
                    ("transfer_gbps_alone", "pct_same_size_memcpy"))

    print_table("alone: GB/s, % of the same-size memcpy",
                [("memcpy_same_size", d) for d in DIRECTIONS] + labels, nb_columns, alone_cell)
    for s in standins:
        print_table(f"beside {s.name}: transfer GB/s, stand-in slowdown %", labels, nb_columns,
                    lambda label, nb, s=s: cell(
                        results.find(group="beside", path=label[0], direction=label[1], nb=nb,
                                     standin=s.name),
                        ("transfer_gbps_beside", "slowdown_pct")))
    print_curve(results, standins)
    hosts = [r for r in rows if r["group"] == "host"]
    if hosts:
        print()
        print("host time of a staged to_universal call, back to back: "
              + ", ".join(f"nb={r['nb']} {fmt(r['host_steady_us'])} us" for r in hosts))


def print_curve(results, standins):
    curve = [r for r in results.rows if r["group"] == "curve"]
    if not curve:
        return

    def curve_cell(label, standin):
        rows = [r for r in curve if curve_label(r) == label]
        if standin is None:
            return cell(rows[0], ("transfer_gbps_alone",))
        row = next((r for r in rows if r["standin"] == standin), None)
        return cell(row, ("transfer_gbps_beside", "slowdown_pct",
                          "ratio_to_plain_copy_engines_beside"))

    print_table(f"curve, nb={curve[0]['nb']}: GB/s alone; beside: GB/s, slowdown %, "
                "% of the plain copy engines' GB/s beside",
                list(dict.fromkeys(curve_label(r) for r in curve)),
                [("alone", None)] + [(s.name, s.name) for s in standins], curve_cell, width=22)


def curve_label(row):
    staging = (f"{row['staging_bytes'] // MIB}MiB",) if row["staging_bytes"] != "" else ()
    return (row["path"], row["direction"], f"ctas={row['num_ctas']}") + staging


def verdict(ok):
    return "PASS" if ok else "MISS"


def figure_of(row, key):
    return row[key] if row else ""


def alone_target_lines(results, nbs):
    """auto alone, offload and onload: % of the same-size memcpy (nb >= 8, and nb = 1)."""
    lines = []
    for direction in ("offload", "onload"):
        for nb in (nb for nb in nbs if nb == 1 or nb >= 8):
            goal = TARGET_ALONE_NB1_PCT if nb == 1 else TARGET_ALONE_PCT
            pct = figure_of(results.find(group="alone", path="auto", direction=direction,
                                         nb=nb), "pct_same_size_memcpy")
            lines.append(f"{verdict(pct != '' and pct >= goal)}  auto {direction} alone nb={nb}: "
                         f"{fmt(pct)} % of the same-size pinned memcpy (>= {goal:.0f} %)")
    return lines


def beside_target_line(results, standin, direction, nb):
    """auto beside a stand-in: the slowdown, and auto's GB/s against the plain copy's.  The
    plain copy's own slowdown is printed beside auto's: a stand-in that slows beside copy
    engines, which take no SM, measures what PCIe and HBM traffic cost it, a floor no path
    moving the same bytes goes under."""
    auto = results.find(group="beside", path="auto", direction=direction, nb=nb,
                        standin=standin)
    plain = results.find(group="beside", path="copy_engines_plain", direction=direction,
                         nb=nb, standin=standin)
    slowed = figure_of(auto, "slowdown_pct")
    ratio = figure_of(auto, "ratio_to_plain_copy_engines_beside")
    ok = (slowed != "" and ratio != "" and slowed <= TARGET_SLOWDOWN_PCT
          and ratio >= TARGET_PLAIN_RATIO)
    caveat = " [plain host-bound]" if plain and plain["note"].startswith("host-bound") else ""
    return (f"{verdict(ok)}  beside {standin}, auto {direction} nb={nb}: slowed "
            f"{fmt(slowed)} % (<= {TARGET_SLOWDOWN_PCT:.0f}; plain copy engines, no SM: "
            f"{fmt(figure_of(plain, 'slowdown_pct'))} %); auto "
            f"{fmt(figure_of(auto, 'transfer_gbps_beside'))} vs plain copy engines "
            f"{fmt(figure_of(plain, 'transfer_gbps_beside'))} GB/s = "
            f"{fmt(100 * ratio if ratio != '' else '')} % (>= {100 * TARGET_PLAIN_RATIO:.0f})"
            f"{caveat}")


def both_target_lines(results, nbs):
    """auto both ways at once: % of the bidirectional 1 GiB ceiling."""
    lines = []
    for nb in nbs:
        row = results.find(group="alone", path="auto", direction="both", nb=nb)
        pct = figure_of(row, "pct_of_ceiling")
        lines.append(f"{verdict(pct != '' and pct >= TARGET_BOTH_PCT)}  auto both ways at once "
                     f"nb={nb}: {fmt(figure_of(row, 'transfer_gbps_alone'))} GB/s = "
                     f"{fmt(pct)} % of the bidirectional ceiling (>= {TARGET_BOTH_PCT:.0f} %)")
    return lines


def host_target_lines(results):
    lines = []
    for nb, goal in TARGET_HOST_US.items():
        us = figure_of(results.find(group="host", nb=nb), "host_steady_us")
        lines.append(f"{verdict(us != '' and us <= goal)}  host time of a staged call nb={nb}: "
                     f"{fmt(us)} us (<= {goal:.0f} us)")
    return lines


def target_lines(results, args, standins):
    """Every target as lines 'PASS|MISS  what: figures (goal)'; a missing figure is MISS."""
    return (alone_target_lines(results, args.nb)
            + [beside_target_line(results, s.name, direction, nb)
               for s in standins for direction in DIRECTIONS for nb in args.nb]
            + both_target_lines(results, args.nb)
            + host_target_lines(results))


def print_targets(results, args, standins):
    lines = target_lines(results, args, standins)
    print()
    print(f"targets (nt={NT}, Llama-3.1-70B; figures are medians of {args.reps} run(s)):")
    for line in lines:
        print("  " + line)
    passed = sum(line.startswith("PASS") for line in lines)
    print(f"targets: {passed} PASS, {len(lines) - passed} MISS")


# ----------------------------------------------------------------------------- main

def check_build():
    missing = [name for name in REQUIRED if not hasattr(kvbm_ext, name)]
    if missing:
        sys.exit(f"beside: this kvbm_ext build has no {', '.join(missing)} "
                 "(the staged API of kvbm_ext 0.4.0): rebuild it")


def environment_line(gpu_name, bench):
    info = kvbm_ext.build_info()
    return (f"gpu={gpu_name} sms={bench.sms} torch={torch.__version__} "
            f"kvbm_ext={info.get('version')} ({os.path.dirname(kvbm_ext.__file__)}) "
            f"cuda={info.get('cuda_version')} memcpy_batch={kvbm_ext.is_memcpy_batch_available()} "
            f"staging={kvbm_ext.staging_info()} sleep={bench.cycles_per_us:.0f} cycles/us")


def open_outputs(args, gpu_name, date, started):
    """The CSV (Results) and the log, which gets everything printed from here on."""
    stem = run_stem(output_dir(args.out, "beside"), "beside", gpu_name, date)
    log = open(stem + ".log", "w")
    sys.stdout = Tee(sys.__stdout__, log)
    sys.stderr = Tee(sys.__stderr__, log)
    return Results(stem + ".csv", gpu_name, date, started), stem


def main(argv=None):
    args = parse_args(argv)
    require_gpu("beside")
    check_build()
    started = time.monotonic()
    device = gpu_device()
    gpu_name = torch.cuda.get_device_name(device)
    results, stem = open_outputs(args, gpu_name, datetime.date.today().isoformat(), started)
    results.say(f"beside: nb={args.nb} reps={args.reps} quick={args.quick} "
                f"curve={'off' if args.skip_curve else args.curve_ctas}")
    bench = make_bench(args, device, results)
    results.say(environment_line(gpu_name, bench))

    paths = main_paths(bench)
    for path in paths:
        verify_or_exit(bench, path, DIRECTIONS, sorted({VERIFY_NB, *args.nb}))
    measure_ceilings(bench)
    standins = [gemm_standin(device), sweep_standin(device)]
    for standin in standins:
        calibrate_standin(bench, standin, args.standin_ms[standin.name])
    run_main_grid(bench, paths, standins)
    measure_host_time(bench)
    if not args.skip_curve:
        run_curve(bench, standins)

    print_summary(results, args, paths, standins)
    print_targets(results, args, standins)
    print()
    print(f"all paths verified bit-exact; {len(results.rows)} rows in "
          f"{time.monotonic() - started:.0f} s")
    print(f"CSV: {stem}.csv")
    print(f"log: {stem}.log")
    print(f"output directory: {os.path.dirname(stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
