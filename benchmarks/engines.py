#!/usr/bin/env python3
"""Every engine's KV cache, described once, moved cache to cache by kvbm_ext.

Each engine's cache is built the way the engine holds it (as the registry of engine caches
the tests use describes it: tests/support/engines.py) and described once as a
kvbm_ext.PagedKVCache; blocks move with PagedKVCache.to_cache into a universal pool
[N, nh, nl, no, nt, hd] and back, in pinned host memory (the staged copy-engine path) and
on the device (D2D):

  vllm_packed         vLLM, K|V packed in the last dim: per layer [num_blocks, nt, nh, 2*hd]
                      in memory (the logical (num_blocks, nh, nt, 2*hd) has NHD stride order)
  vllm_flash          vLLM FlashAttention before it: per layer [2, num_blocks, nt, nh, hd]
  flashinfer_hnd      vLLM FlashInfer: per layer (num_blocks, 2, nt, nh, hd), HND stride order
  sglang_pairs        SGLang MHATokenToKVPool: k_buffer[l], v_buffer[l], each
                      [size + page_size, nh, hd] (page 0 is its padding page)
  transformers_pairs  transformers PagedAttentionCache: key_cache[l], value_cache[l], each
                      [(num_blocks + 2) * block_size, nh, hd] (two spare blocks at the end)
  mla                 vLLM MLA: per layer [num_blocks, nt, 576] (no = 1, nh = 1)

at Llama-3.1-70B dims (nl=80, nh=8, hd=128, bf16, nt=16) and Llama-3.1-8B dims (nl=32);
MLA keeps the model's layer count with DeepSeek-V3's 576-element latent.  Ids are int64
tensors on the device.  Measured in the same run: for each pinned case, a memcpy of exactly
its bytes between its own pool and the device, timed in rounds alternating with the case
(its reference); per model and nb, those memcpys each way once more, the same-size device
copy and a 1 GiB device copy (the copy ceiling of the D2D rows); GB/s count the bytes moved
once.  The
host time of one D2D call at nb=64 is timed back to back.  Every case is checked bit for
bit against a plain torch gather of the engine's tensors before it is timed.

--transformers runs the end-to-end part instead (benchmarks/transformers_e2e.py):
transformers' continuous batching under GPU-cache pressure with its own CPU offloading and
with kvbm_ext's (kvbm_ext.integrations.transformers).

Output: a CSV, PNGs (figures.py, from the CSV) and a log in --out (default: see
harness.output_dir), PASS/MISS per target at the end.  See benchmarks/README.md ("engines.py").
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
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

# Benchmark the checkout: an in-place build in the repository root comes first; the engines'
# caches are those of the tests' registry (tests/support/engines.py).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import kvbm_ext  # noqa: E402
from kvbm_ext._no_gpu import require_gpu  # noqa: E402
from harness import (HD, NH, NT, RepPolicy, Tee, Timing, calibrate_sleep_cycles_per_us,  # noqa: E402
                     cuda_synchronize, fill_random_, int_list, output_dir, run_once, run_stem, steady_host_us,
                     time_gpu_calls)
from figures import draw_file  # noqa: E402
from report import csv_cells, fmt  # noqa: E402
from support import engines as registry  # noqa: E402
import transformers_e2e  # noqa: E402

DTYPE = torch.bfloat16
MODELS = {"70b": ("Llama-3.1-70B", 80), "8b": ("Llama-3.1-8B", 32)}    # name, layers (nh=8, hd=128)
MLA_HD = 576                     # DeepSeek-V3: kv_lora_rank 512 + rope 64, one "head" per token
MIB, GIB = 1 << 20, 1 << 30
POISON_INT16 = 0xA5A5 - 0x10000  # destinations are filled with the bytes 0xA5
ID_SEED = 2026                   # the block ids are the same in every run
ROTATION_BYTES = 192 * MIB       # D2D calls rotate over id sets until they touch this much (> L2)
MAX_SETS = 16
ROUNDS = 3                       # a pinned case alternates with its reference memcpy, a round each
HOST_NB = 64

TARGET_STAGED_PCT = 97.0         # pinned, nb >= 8: % of the same-size pinned memcpy
TARGET_STAGED_MIN_NB = 8
TARGET_D2D_PCT = 90.0            # D2D, nb = 64: % of the 1 GiB device copy
TARGET_D2D_NB = 64
TARGET_HOST_US = 30.0            # host time of one D2D call at nb = 64, device ids

COLUMNS = ["gpu_name", "date", "model", "engine", "layout", "path", "direction", "nb", "bytes", "sets",
           "reps", "gpu_us", "host_us", "gbps", "same_size_memcpy_gbps", "pct_same_size_memcpy",
           "ceiling_gbps", "pct_of_ceiling", "host_steady_us", "note"]


# ----------------------------------------------------------------------------- engines

@dataclass(frozen=True)
class Dims:
    """A cache as kvbm_ext sees it: layers, outer chunks (K/V), heads, tokens, head dim."""
    nl: int
    no: int
    nh: int
    nt: int
    hd: int

    @property
    def block_bytes(self):
        return self.nl * self.no * self.nh * self.nt * self.hd * DTYPE.itemsize

    @property
    def pool_layout(self):
        """The universal pool's letters: h and k only where the cache has them."""
        return "b" + ("h" if self.nh > 1 else "") + "l" + ("k" if self.no > 1 else "") + "td"


@dataclass
class Engine:
    name: str
    layout: str
    dims: Dims
    cache: object             # kvbm_ext.PagedKVCache over the engine's own tensors
    chunks: list              # [nl][no]: views [num_blocks, nt, nh, hd] of those tensors (the reference)
    usable: list              # the block ids the engine hands out


# The engines timed, by the names of their rows, and their caches in the registry of engine
# caches the tests use too (tests/support/engines.py, docs/engines.md).
ENGINES = {"vllm_packed": "vllm_packed_memory", "vllm_flash": "vllm_flash_attn", "flashinfer_hnd": "flashinfer_hnd",
           "sglang_pairs": "sglang_mha", "transformers_pairs": "transformers", "mla": "mla"}


def allocate(name, dims, num_blocks, device):
    """Engine `name`'s cache as the registry describes it, num_blocks blocks (its spares
    included), uninitialised: (its tensors, PagedKVCache's `layers` argument, layout,
    options, chunks [nl][no] of views [num_blocks, nt, nh, hd], the block ids it hands out)."""
    described = registry.ENGINES[ENGINES[name]]
    d = described.dims(registry.Dims(dims.nl, dims.nh, dims.nt, dims.hd, num_blocks))
    tensors = [torch.empty(shape, dtype=DTYPE, device=device) for shape in described.shapes(d)]
    options = {"block_size": d.nt} if described.block_size else {}
    return (tensors, described.arg(tensors, d), described.layout, options, described.views(tensors, d),
            described.usable(d))


def engine_dims(engine, layers):
    return Dims(layers, 1, 1, NT, MLA_HD) if engine == "mla" else Dims(layers, 2, NH, NT, HD)


def build_engine(name, dims, num_blocks, device):
    """The engine's tensors (random bits), described once; num_blocks includes its spares."""
    tensors, layers, layout, options, chunks, usable = allocate(name, dims, num_blocks, device)
    for tensor in tensors:
        fill_random_(tensor, device)
    return Engine(name, layout, dims, kvbm_ext.PagedKVCache(layers, layout, **options), chunks, list(usable))


# ----------------------------------------------------------------------------- pools and references

@dataclass
class Pool:
    """Universal blocks [capacity, nh, nl, no, nt, hd] (`blocks`), their bytes and their description."""
    blocks: torch.Tensor
    raw: torch.Tensor
    cache: object
    seconds: float            # to allocate it
    buffer: object = None     # the kvbm_ext.HostBuffer under a pinned pool


def make_pool(dims, capacity, device, pinned):
    """Random universal blocks on the device, or in pinned memory from kvbm_ext.pinned_empty."""
    shape = (capacity, dims.nh, dims.nl, dims.no, dims.nt, dims.hd)
    nbytes = capacity * dims.block_bytes
    started = time.perf_counter()
    buffer = kvbm_ext.pinned_empty((nbytes,), np.uint8) if pinned else None
    raw = torch.from_dlpack(buffer) if pinned else torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = time.perf_counter() - started
    blocks = raw.view(DTYPE).view(shape)
    fill_random_(blocks, device)
    described = blocks.view([n for n, letter in zip(shape, "bhlktd") if letter in dims.pool_layout])
    return Pool(blocks, raw, kvbm_ext.PagedKVCache(described, dims.pool_layout), seconds, buffer)


def gathered(engine, ids):
    """Plain torch: the engine's blocks `ids` as universal blocks [n, nh, nl, no, nt, hd]."""
    stacked = torch.stack([torch.stack([chunk.index_select(0, ids) for chunk in pair]) for pair in engine.chunks])
    return stacked.permute(2, 4, 0, 1, 3, 5)          # from [nl, no, n, nt, nh, hd]


def poison_engine_blocks(engine, ids):
    for pair in engine.chunks:
        for chunk in pair:
            chunk.view(torch.int16).index_fill_(0, ids, POISON_INT16)


def bitwise_equal(a, b):
    return torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


# ----------------------------------------------------------------------------- cases

@dataclass
class IdSet:
    engine_ids: torch.Tensor  # int64, on the host for pinned cases, else on the device
    pool_ids: torch.Tensor


def id_sets(engine, nb, sets, capacity, device):
    """`sets` disjoint sets of nb engine blocks and nb pool blocks, at random (fixed seed)."""
    rng = random.Random(ID_SEED + nb)
    engine_ids = rng.sample(engine.usable, nb * sets)
    pool_ids = rng.sample(range(capacity), nb * sets)
    as_tensor = partial(torch.tensor, dtype=torch.int64, device=device)
    return [IdSet(as_tensor(engine_ids[s * nb:(s + 1) * nb]), as_tensor(pool_ids[s * nb:(s + 1) * nb]))
            for s in range(sets)]


def transfer(engine, pool, direction, ids, stream):
    """The call of one case: offload (engine -> pool) or onload (pool -> engine)."""
    if direction == "offload":
        return partial(engine.cache.to_cache, pool.cache, ids.engine_ids, ids.pool_ids, stream=stream)
    return partial(pool.cache.to_cache, engine.cache, ids.pool_ids, ids.engine_ids, stream=stream)


def verify(engine, pool, direction, ids, stream):
    """One call on poisoned destinations, compared with the torch gather; the problem or None."""
    pool_ids, engine_ids = ids.pool_ids.to(pool.blocks.device), ids.engine_ids.cuda()
    torch.cuda.synchronize()
    if direction == "offload":
        pool.blocks.view(torch.int16).index_fill_(0, pool_ids, POISON_INT16)
    else:
        poison_engine_blocks(engine, engine_ids)
    torch.cuda.synchronize()
    transfer(engine, pool, direction, ids, stream)()
    torch.cuda.synchronize()
    engine_blocks = gathered(engine, engine_ids)
    pool_blocks = pool.blocks.index_select(0, pool_ids).to(engine_blocks.device)
    if not bitwise_equal(pool_blocks, engine_blocks):
        written = "pool" if direction == "offload" else "engine"
        return f"{direction}: the {written} blocks differ from the torch gather"
    return None


def sets_for(path, dims, nb, capacity):
    if path == "pinned":
        return 1
    return max(1, min(MAX_SETS, capacity // nb, math.ceil(ROTATION_BYTES / (nb * dims.block_bytes))))


def time_calls(calls, run):
    first = run_once(calls[0], cuda_synchronize)
    return time_gpu_calls(calls, run.policy, run.cycles_per_us, first)


def time_alternating(calls, reference, run):
    """The calls and a reference call timed in ROUNDS alternating rounds, each with a share
    of the policy, so that both see the same state of the host (a pinned transfer's rate
    follows it: probes/pcie_after_idle.py).  (the calls' Timing, the reference's GPU us),
    each the median of its rounds."""
    policy = replace(run.policy, target_s=run.policy.target_s / ROUNDS, cap_s=run.policy.cap_s / ROUNDS)
    first, reference_first = run_once(calls[0], cuda_synchronize), run_once(reference, cuda_synchronize)
    ours, theirs = [], []
    for _ in range(ROUNDS):
        theirs.append(time_gpu_calls([reference], policy, run.cycles_per_us, reference_first).gpu_us)
        ours.append(time_gpu_calls(calls, policy, run.cycles_per_us, first))
    timing = Timing(statistics.median(t.host_us for t in ours), statistics.median(t.gpu_us for t in ours),
                    sum(t.reps for t in ours), sum(t.uncovered for t in ours),
                    "/".join(sorted({t.method for t in ours})))
    return timing, statistics.median(theirs)


# ----------------------------------------------------------------------------- the run

@dataclass
class Run:
    args: object
    device: torch.device
    stream: object
    policy: RepPolicy
    cycles_per_us: float
    gpu_name: str
    date: str
    rows: list
    writer: object
    file: object

    def add(self, **fields):
        row = {column: "" for column in COLUMNS}
        row.update(gpu_name=self.gpu_name, date=self.date, **fields)
        self.rows.append(row)
        self.writer.writerow(csv_cells(row))
        self.file.flush()
        print(describe(row), flush=True)
        return row

    def find(self, **match):
        return next((row for row in reversed(self.rows) if all(row[k] == v for k, v in match.items())), None)


def describe(row):
    what = " ".join(str(row[k]) for k in ("model", "engine", "path", "direction") if row[k] != "")
    figures = [("gbps", "GB/s"), ("pct_same_size_memcpy", "% same-size memcpy"), ("pct_of_ceiling", "% ceiling"),
               ("host_us", "host us"), ("host_steady_us", "host us steady")]
    shown = ", ".join(f"{fmt(row[key])} {name}" for key, name in figures if row[key] != "")
    note = f" ({row['note']})" if row["note"] else ""
    return f"{what} nb={row['nb']}: {shown}{note}"


def gbps(nbytes, us):
    return nbytes / (us * 1e3)


def memcpy_row(run, model, label, path, direction, nb, dst, src, ceiling=None):
    """A copy_ of src into dst (one cudaMemcpyAsync), timed; GB/s of its bytes."""
    def call():
        dst.copy_(src, non_blocking=True)
    timing = time_calls([call], run)
    rate = gbps(src.numel(), timing.gpu_us)
    fields = dict(ceiling_gbps=ceiling, pct_of_ceiling=100 * rate / ceiling) if ceiling else {}
    return run.add(model=model, engine=label, path=path, direction=direction, nb=nb, bytes=src.numel(),
                   sets=1, reps=timing.reps, gpu_us=timing.gpu_us, host_us=timing.host_us, gbps=rate, **fields)


def memcpy_label(dims):
    """The memcpy rows of a block size: "memcpy", or "memcpy_mla" for MLA's smaller blocks."""
    return "memcpy" if dims.no == 2 else "memcpy_mla"


def memcpy_rows(run, model, dims, nb, pinned, on_device, ceiling):
    """Copies of exactly nb blocks' bytes: pinned each way (the dotted lines; each pinned case
    times its own reference), device to device; the device copy's GB/s."""
    nbytes = nb * dims.block_bytes
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    fill_random_(device_bytes, run.device)
    pinned_bytes, pool_bytes = pinned.raw[:nbytes], on_device.raw[:nbytes]
    row = partial(memcpy_row, run, model, memcpy_label(dims))
    row("pinned", "offload", nb, pinned_bytes, device_bytes)
    row("pinned", "onload", nb, device_bytes, pinned_bytes)
    return row("d2d", "copy", nb, pool_bytes, device_bytes, ceiling)["gbps"]


def pinned_memcpy(run, pool, direction, nbytes):
    """A pinned case's reference: one copy_ of its bytes between its own pool and a device
    buffer, in its direction."""
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    fill_random_(device_bytes, run.device)
    pinned_bytes = pool.raw[:nbytes]
    if direction == "offload":
        return partial(pinned_bytes.copy_, device_bytes, non_blocking=True)
    return partial(device_bytes.copy_, pinned_bytes, non_blocking=True)


def case_row(run, model, engine, pool, path, direction, nb, device_copy, ceiling):
    # An offload manager holds its pool's ids on the host, which lets the move be staged;
    # device to device, the ids live on the device (no host sync, graph-capturable).
    sets = id_sets(engine, nb, sets_for(path, engine.dims, nb, pool.blocks.shape[0]), pool.blocks.shape[0],
                   "cpu" if path == "pinned" else run.device)
    problem = verify(engine, pool, direction, sets[0], run.stream)
    if problem:
        sys.exit(f"engines: {model} {engine.name} {path} nb={nb}: {problem}; nothing timed after it")
    calls = [transfer(engine, pool, direction, ids, run.stream) for ids in sets]
    nbytes = nb * engine.dims.block_bytes
    if path == "pinned":
        timing, memcpy_us = time_alternating(calls, pinned_memcpy(run, pool, direction, nbytes), run)
        reference = gbps(nbytes, memcpy_us)
    else:
        timing = time_calls(calls, run)
        reference = device_copy
    rate = gbps(nbytes, timing.gpu_us)
    extra = dict(ceiling_gbps=ceiling, pct_of_ceiling=100 * rate / ceiling) if path == "d2d" else {}
    return run.add(model=model, engine=engine.name, layout=engine.layout, path=path, direction=direction, nb=nb,
                   bytes=nbytes, sets=len(sets), reps=timing.reps, gpu_us=timing.gpu_us, host_us=timing.host_us,
                   gbps=rate, same_size_memcpy_gbps=reference, pct_same_size_memcpy=100 * rate / reference,
                   note=timing.method, **extra)


def host_rows(run, model, engine, pool):
    """Host time of one D2D call at HOST_NB, issued back to back with device ids."""
    (ids,) = id_sets(engine, HOST_NB, 1, pool.blocks.shape[0], run.device)
    for direction in ("offload", "onload"):
        call = transfer(engine, pool, direction, ids, run.stream)
        call()
        run.add(model=model, engine=engine.name, layout=engine.layout, path="d2d_host", direction=direction,
                nb=HOST_NB, host_steady_us=steady_host_us([call]))


def run_model(run, key, ceiling):
    """Every engine of one model: pinned and D2D, both directions, every nb; host times.  The
    memcpy rows (and the same-size device copy of the D2D rows) are measured once per block
    size and nb, with the first engine of it; each pinned case times its own reference."""
    model, layers = MODELS[key]
    capacity = max(max(run.args.nb), HOST_NB)
    device_copy = {}
    for name in run.args.engines:
        dims = engine_dims(name, layers)
        pinned = make_pool(dims, capacity, run.device, pinned=True)
        on_device = make_pool(dims, capacity, run.device, pinned=False)
        print(f"{model} {name}: pools of {capacity} blocks of {dims.block_bytes / MIB:.2f} MiB; "
              f"pinned_empty took {pinned.seconds * 1e3:.1f} ms", flush=True)
        engine = build_engine(name, dims, 2 * capacity + 2, run.device)
        for nb in run.args.nb:
            if (dims, nb) not in device_copy:
                device_copy[dims, nb] = memcpy_rows(run, model, dims, nb, pinned, on_device, ceiling)
            for path, pool in (("pinned", pinned), ("d2d", on_device)):
                for direction in ("offload", "onload"):
                    case_row(run, model, engine, pool, path, direction, nb, device_copy[dims, nb], ceiling)
        host_rows(run, model, engine, on_device)
        del engine, pinned, on_device
        torch.cuda.empty_cache()


def device_ceiling(run):
    """A 1 GiB device-to-device copy: the copy ceiling, bytes moved once."""
    src = torch.empty(GIB, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    fill_random_(src, run.device)
    return memcpy_row(run, "", "memcpy", "d2d", "copy", "", dst, src)["gbps"]


# ----------------------------------------------------------------------------- targets and summary

def verdict(ok):
    return "PASS" if ok else "MISS"


def target_lines(run):
    lines = []
    for row in run.rows:
        if row["engine"].startswith("memcpy"):
            continue
        if row["path"] == "pinned" and row["nb"] >= TARGET_STAGED_MIN_NB:
            pct = row["pct_same_size_memcpy"]
            lines.append(f"{verdict(pct >= TARGET_STAGED_PCT)}  {row['model']} {row['engine']} {row['direction']} "
                         f"pinned nb={row['nb']}: {fmt(row['gbps'])} GB/s = {fmt(pct)} % of the same-size pinned "
                         f"memcpy (>= {TARGET_STAGED_PCT:.0f} %)")
        elif row["path"] == "d2d" and row["nb"] == TARGET_D2D_NB:
            pct = row["pct_of_ceiling"]
            lines.append(f"{verdict(pct >= TARGET_D2D_PCT)}  {row['model']} {row['engine']} {row['direction']} "
                         f"D2D nb={row['nb']}: {fmt(row['gbps'])} GB/s = {fmt(pct)} % of the 1 GiB device copy "
                         f"(>= {TARGET_D2D_PCT:.0f} %)")
        elif row["path"] == "d2d_host":
            us = row["host_steady_us"]
            lines.append(f"{verdict(us <= TARGET_HOST_US)}  {row['model']} {row['engine']} {row['direction']} "
                         f"D2D host time nb={row['nb']}, device ids: {fmt(us)} us (<= {TARGET_HOST_US:.0f} us)")
    return lines


def print_summary(run):
    """Per model and path: a line per engine and direction, GB/s (% of the reference) per nb."""
    for model in dict.fromkeys(row["model"] for row in run.rows if row["model"]):
        for path, key in (("pinned", "pct_same_size_memcpy"), ("d2d", "pct_of_ceiling")):
            reference = "same-size pinned memcpy" if path == "pinned" else "1 GiB device copy"
            print(f"\n{model}, {path}: GB/s (% of the {reference}) at nb = {', '.join(map(str, run.args.nb))}")
            for name in run.args.engines:
                for direction in ("offload", "onload"):
                    cells = []
                    for nb in run.args.nb:
                        row = run.find(model=model, engine=name, path=path, direction=direction, nb=nb)
                        cells.append(f"{fmt(row['gbps']):>8} ({fmt(row[key]):>5} %)" if row else f"{'':>17}")
                    print(f"  {name:20s} {direction:8s}" + "".join(cells))


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="70b,8b", type=lambda text: text.split(","),
                        help="models whose dims are timed, out of 70b,8b (default both)")
    parser.add_argument("--engines", default=",".join(ENGINES), type=lambda text: text.split(","),
                        help=f"engine descriptions (default all: {','.join(ENGINES)})")
    parser.add_argument("--nb", type=int_list, default=[1, 8, 64], help="blocks per call (default 1,8,64)")
    parser.add_argument("--target-ms", type=float, default=100.0, help="timing budget per case (default 100)")
    parser.add_argument("--transformers", action="store_true",
                        help="run the transformers end-to-end part instead (options: --tf-*)")
    parser.add_argument("--out", help="where the CSV, PNG and log go (default: see harness.output_dir)")
    transformers_e2e.add_arguments(parser)
    args = parser.parse_args(argv)
    for name in args.engines:
        if name not in ENGINES:
            parser.error(f"--engines: unknown engine {name!r}, expected some of {','.join(ENGINES)}")
    for key in args.models:
        if key not in MODELS:
            parser.error(f"--models: unknown model {key!r}, expected some of {','.join(MODELS)}")
    return args


def check_build():
    if kvbm_ext.is_using_stubs():
        sys.exit("engines: kvbm_ext was built without CUDA (is_using_stubs()); rebuild with nvcc")
    present = {"pinned_empty": hasattr(kvbm_ext, "pinned_empty"),
               "PagedKVCache.to_cache": hasattr(kvbm_ext.PagedKVCache, "to_cache")}
    missing = [name for name, there in present.items() if not there]
    if missing:
        sys.exit(f"engines: this kvbm_ext build has no {', '.join(missing)}: rebuild it")


def run_grid(args, gpu_name, date, stem):
    device = torch.device("cuda", torch.cuda.current_device())
    with open(stem + ".csv", "w", newline="") as file, torch.cuda.stream(torch.cuda.Stream(device)):
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        target_s = args.target_ms / 1e3
        run = Run(args, device, torch.cuda.current_stream(device), RepPolicy(target_s, 5, 200, 4 * target_s),
                  calibrate_sleep_cycles_per_us(), gpu_name, date, [], writer, file)
        ceiling = device_ceiling(run)
        for key in args.models:
            run_model(run, key, ceiling)
    print_summary(run)
    lines = target_lines(run)
    print(f"\ntargets (nt={NT}, bf16; device ids):")
    for line in lines:
        print("  " + line)
    print(f"targets: {sum(line.startswith('PASS') for line in lines)} PASS, "
          f"{sum(line.startswith('MISS') for line in lines)} MISS")
    print(f"all {sum(not row['engine'].startswith('memcpy') and row['path'] != 'd2d_host' for row in run.rows)} "
          "cases verified bit-exact before they were timed")


def main(argv=None):
    args = parse_args(argv)
    require_gpu("engines --transformers" if args.transformers else "engines")
    check_build()
    gpu_name, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    name = "engines-transformers" if args.transformers else "engines"
    stem = run_stem(output_dir(args.out, name), name, gpu_name, date)
    started = time.monotonic()
    with open(stem + ".log", "w") as log:
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
        try:
            info = kvbm_ext.build_info()
            print(f"gpu={gpu_name} torch={torch.__version__} kvbm_ext={info.get('version')} "
                  f"({os.path.dirname(kvbm_ext.__file__)}) cuda={info.get('cuda_version')}", flush=True)
            run_part = transformers_e2e.run if args.transformers else run_grid
            run_part(args, gpu_name, date, stem)
            pngs, no_png = draw_file(stem + ".csv")
            print(f"\n{time.monotonic() - started:.0f} s")
            print(f"CSV: {stem}.csv")
            for png in pngs or [no_png]:
                print(f"PNG: {png}")
            print(f"log: {stem}.log")
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return 0


if __name__ == "__main__":
    sys.exit(main())
