"""The timing harness shared by the benchmark scripts: the model profile they time,
repetitions, GPU timing with events behind a GPU sleep, host timing, the random fill of
buffers, and where a run writes its files.  No kvbm_ext here: what is timed comes from
the callers."""

import argparse
import math
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

# The Llama-3.1-70B KV cache every script times: layers, outer chunks (K and V), KV heads,
# head dim, and NT tokens per block where a script does not sweep it (kvbench.py's --nt).
NL, NO, NH, HD = 80, 2, 8, 128
NT = 16

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP_FACTOR = 1.2                      # GPU sleep before a timed call, in units of its host time
SLEEP_MARGIN_US = 50.0
STEADY_REPS, STEADY_BATCH = 100, 10     # back-to-back calls for a steady host time
RNG = np.random.default_rng()


# ----------------------------------------------------------------------------- arguments and output

def int_list(text):
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,64, got {text!r}")
    return values


def inside(path, folder):
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def output_dir(requested, name):
    """Where a run writes its files: `requested` (--out), created if needed; else
    ./<name>-results in the current directory when that is outside this source tree, else
    a new temporary directory.  A run never writes into the checkout unless asked to."""
    if requested:
        os.makedirs(requested, exist_ok=True)
        return os.path.abspath(requested)
    if not inside(os.getcwd(), REPO_ROOT):
        folder = os.path.join(os.getcwd(), f"{name}-results")
        os.makedirs(folder, exist_ok=True)
        return folder
    return tempfile.mkdtemp(prefix=f"{name}-")


def slug(name):
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def run_stem(folder, name, gpu_name, date):
    """folder/<name>-<gpu>-<date>, with -2, -3, ... when a run of the same day is there (its
    log or CSV)."""
    stem = os.path.join(folder, f"{name}-{slug(gpu_name)}-{date}")
    candidate, n = stem, 1
    while any(os.path.exists(candidate + ext) for ext in (".csv", ".log")):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


class Tee:
    """A text stream that writes to the console and to the log file."""

    def __init__(self, console, log):
        self.console, self.log = console, log

    def write(self, text):
        self.console.write(text)
        self.log.write(text)
        self.log.flush()             # a run that dies keeps its log

    def flush(self):
        self.console.flush()
        self.log.flush()


# ----------------------------------------------------------------------------- timing

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


def steady_host_us(calls, reps=STEADY_REPS, batch=STEADY_BATCH, between=None, synchronize=None):
    """Median host time of GPU calls issued back to back, as a serving worker issues them
    (the host_us of time_gpu_calls times each call right after a synchronize, from an idle
    device).  The stream is synchronized every `batch` calls, outside the timed calls, so
    that the queue stays short, and `between()` (if given) runs after each synchronize,
    untimed: a worker's poll that reports the jobs just finished.  `synchronize` (default
    torch.cuda.synchronize) is what synchronizes."""
    synchronize = synchronize or torch.cuda.synchronize
    samples = []
    for i in range(reps):
        if i % batch == 0:
            synchronize()
            if between is not None:
                between()
        start = time.perf_counter()
        calls[i % len(calls)]()
        samples.append(time.perf_counter() - start)
    synchronize()
    return statistics.median(samples) * 1e6


def spin_us(us):
    """Keeps the CPU busy for `us` microseconds."""
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


def median_host_us(calls, reps):
    """Median wall time of a host-only call (rotating)."""
    samples = []
    for i in range(reps):
        start = time.perf_counter()
        calls[i % len(calls)]()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def calibrate_sleep_cycles_per_us(stream=None):
    """GPU clock cycles per microsecond of torch.cuda._sleep, from events around one sleep
    on `stream` (default: the current stream)."""
    stream = stream or torch.cuda.current_stream()
    cycles = 20_000_000
    samples = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            torch.cuda._sleep(cycles)
            end.record(stream)
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


# ----------------------------------------------------------------------------- data

def fill_random_(tensor, gen_device):
    """Overwrite tensor with random bits (every pattern, NaNs included), generated on gen_device."""
    bits = tensor.view(torch.int16)
    if gen_device.type == "cuda":
        fresh = torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int16, device=gen_device)
    else:
        fresh = torch.from_numpy(RNG.integers(-2**15, 2**15, size=bits.shape, dtype=np.int16))
    bits.copy_(fresh)
