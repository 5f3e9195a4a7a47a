"""The pictures of every benchmark's runs, one PNG per question a reader asks, drawn from
the run's rows (a kvbench run's own, or any run's CSV): each measured value a bar, grouped
by what was measured (blocks per call, a case), next to the reference it is held against
(plots.py draws them).  `python3 benchmarks/figures.py RUN.csv` draws the figures of a CSV
of kvbench.py, engines.py (and its --transformers part), reshard.py, vllm_offload.py or
disk.py; `--table` prints instead the README's table of PagedKVCache rates (paged_table),
every figure in it read from the CSV it names."""

import csv
import math
import os
import re
from dataclasses import dataclass, field
from functools import partial

from plots import (BACK, NO_MATPLOTLIB, REFERENCE_GRAYS, Bars, Limit, Points, grouped_bars, measured_points,
                   median_by, new_figure, number, pyplot, read_rows, save)
from report import TARGET_NT, is_swept, rate

PROFILE = "Llama-3.1-70B KV cache, bf16"
GBPS = "GB/s (bytes moved, each counted once)"
NB_AXIS = "blocks per call (nb), as measured"
WAY = {"d2h": "GPU to host", "h2d": "host to GPU"}
WAY_GRAY = {"d2h": REFERENCE_GRAYS[0], "h2d": REFERENCE_GRAYS[1]}   # the pinned memcpy's bars, by way
NO_ROWS = "no PNG: no row was timed"


# ----------------------------------------------------------------------------- kvbench

@dataclass
class Series:
    label: str
    select: object            # row -> whether the row is a value of these bars
    color: str
    hatch: str = ""           # BACK for the way back


@dataclass
class Panel:
    title: str
    series: list
    limit: str                # "device", "pcie" or "cpu": the reference drawn (see references)
    ways: tuple = ("d2h", "h2d")   # pcie: the way over PCIe of each series (or of them all)


@dataclass
class Figure:
    name: str                 # the PNG is <stem>-<name>.png
    question: str             # its title
    panels: list = field(default_factory=list)


def gpu_row(api, function, placement, backend=None):
    """row -> whether it is a GPU row of this group, function and placement (and backend),
    outside the num_ctas sweep."""
    def select(row):
        return (row["mode"] == "gpu" and row["api"] == api and row["function"] == function
                and row["placement"] == placement and not is_swept(row)
                and (backend is None or row["backend"] == backend))
    return select


def cpu_row(function):
    return lambda row: row["mode"] == "cpu" and row["function"] == function


def limit_of(placement):
    return "device" if placement == "d2d" else "pcie"


ON_GPU = ("d2d", "on the GPU: device memory to device memory")
OVER_PCIE = ("pinned", "to and from pinned host memory, over PCIe")


def there_and_back(api, functions, labels, placement, backend=None, color="C0"):
    """A move and the move back (hatched) of one group and placement."""
    return [Series(labels[0], gpu_row(api, functions[0], placement, backend), color),
            Series(labels[1], gpu_row(api, functions[1], placement, backend), color, BACK)]


def paged_series(placement):
    if placement == "d2d":
        labels = ("to_universal: cache to universal blocks", "from_universal: universal blocks to cache")
    else:
        labels = ("offload: to_universal, cache to pinned host", "onload: from_universal, pinned host to cache")
    return there_and_back("paged", ("PagedKVCache.to_universal", "PagedKVCache.from_universal"), labels, placement,
                          "device_ids")


def torch_series(placement):
    return paged_series(placement) + there_and_back(
        "paged", ("TorchLoop.to_universal", "TorchLoop.from_universal"),
        ("PyTorch loop, to universal", "PyTorch loop, from universal"), placement, color="C3")


def list_series(placement):
    return there_and_back("list", ("block_to_universal", "universal_to_block"),
                          ("block_to_universal: chunks to universal blocks",
                           "universal_to_block: universal blocks to chunks"), placement)


def universal_operational_series(placement):
    return there_and_back("operational", ("universal_to_operational", "operational_to_universal"),
                          ("universal_to_operational: universal to operational blocks",
                           "operational_to_universal: operational to universal blocks"), placement)


def pair_panels(series_of, ways=("d2h", "h2d")):
    """A panel on the GPU and one over PCIe, each of a move and the move back (over PCIe,
    `ways`)."""
    return [Panel(title, series_of(placement), limit_of(placement), ways) for placement, title in (ON_GPU, OVER_PCIE)]


OPERATIONAL_BACKENDS = (
    ("auto", "auto (the default)", "C0"),
    ("kernel", "kernel: SMs move every byte", "C2"),
    ("batch", "batch: copy engines, cudaMemcpyBatchAsync", "C4"),
    ("async", "async: copy engines, a cudaMemcpyAsync per chunk", "C1"),
)


def operational_panels():
    """Per placement and way, a bar per backend."""
    panels = []
    for placement, where in (("d2d", "on the GPU"), ("pinned", "pinned host")):
        for function, what, way in (("block_to_operational", "blocks to operational blocks", "d2h"),
                                    ("operational_to_block", "operational blocks to blocks", "h2d")):
            title = f"{where}: {what}" + (f" ({WAY[way]})" if placement == "pinned" else "")
            panels.append(Panel(title, [Series(label, gpu_row("operational", function, placement, backend), color)
                                        for backend, label, color in OPERATIONAL_BACKENDS],
                                limit_of(placement), (way,)))
    return panels


RAW_COPIES = (
    ("vectorized_copy", "host_list", "vectorized_copy, addresses in a host list", "C0"),
    ("vectorized_copy", "device_list", "vectorized_copy, addresses in a GPU array", "C2"),
    ("memcpy_batch", "batched_with_fallback", "memcpy_batch: cudaMemcpyBatchAsync", "C4"),
    ("memcpy_batch", "fallback_only", "memcpy_batch fallback_only: a cudaMemcpyAsync per pair", "C1"),
)


def raw_copy_panels():
    """Per granularity and way, a bar per function."""
    def select(function, backend, granularity, way):
        return lambda row: (row["mode"] == "gpu" and row["api"] == "copy" and row["function"] == function
                            and row["backend"] == backend and row["granularity"] == granularity
                            and row["direction"] == way)
    return [Panel(f"{what}, {WAY[way]}", [Series(label, select(function, backend, granularity, way), color)
                                          for function, backend, label, color in RAW_COPIES], "pcie", (way,))
            for granularity, what in (("chunk", "32 KB chunks: 160 pairs per block"),
                                      ("block", "whole blocks: one pair per block"))
            for way in ("d2h", "h2d")]


def cpu_panels():
    return [Panel(f"host memory to host memory: {title}",
                  [Series("list API", cpu_row(list_function), "C2"),
                   Series("PagedKVCache, host ids", cpu_row(f"PagedKVCache.{paged}"), "C0"),
                   Series("PyTorch loop (torch copy_ on torch's threads)", cpu_row(f"TorchLoop.{paged}"), "C3")],
                  "cpu")
            for title, list_function, paged in (("blocks to universal", "block_to_universal", "to_universal"),
                                                ("universal to blocks", "universal_to_block", "from_universal"))]


TORCH_LOOP = "PyTorch loop: index_select, permute and copy_, layer by layer"

FIGURES = (
    Figure("paged", "PagedKVCache: how close to the hardware's copy rate?", pair_panels(paged_series)),
    Figure("torch", "PagedKVCache or a plain PyTorch loop: which moves blocks faster on the GPU?",
           [Panel(f"{ON_GPU[1]}\n{TORCH_LOOP}", torch_series("d2d"), "device")]),
    Figure("list", "List API: how close to the hardware's copy rate?", pair_panels(list_series)),
    Figure("operational", "Blocks to and from operational blocks: which backend is fastest?", operational_panels()),
    Figure("universal-operational", "Universal to and from operational blocks in one pass: how close to the "
           "hardware's copy rate?", pair_panels(universal_operational_series, ("h2d", "d2h"))),
    Figure("copies", "Raw copies between the GPU and pinned host memory: which function is fastest?",
           raw_copy_panels()),
    Figure("cpu", "On the CPU: how close to one memcpy of the same bytes?", cpu_panels()),
)


def shown_nt(rows):
    """The nt every figure shows: 16 when it was run, else the smallest."""
    nts = {row["nt"] for row in rows if isinstance(row["nt"], int)}
    return TARGET_NT if TARGET_NT in nts or not nts else min(nts)


def ceiling(rows, direction):
    return next((row for row in rows if row["mode"] == "ceiling" and row["nt"] == "" and row["direction"] == direction
                 and rate(row)), None)


def gib(row):
    return f"{row['bytes'] / 2**30:g} GiB" if isinstance(row["bytes"], (int, float)) else "large"


def references(rows, panel, nt, drawn):
    """What the panel's bars are held against: the device copy (a line); over PCIe, a
    pinned memcpy of exactly each call's bytes each way (gray bars) and of 1 GiB (a line);
    on the CPU, one memcpy of each call's bytes (gray bars).  Returns (bars, limits)."""
    if panel.limit == "device":
        row = ceiling(rows, "d2d")
        return [], [Limit(f"ceiling: device copy of {gib(row)} (torch copy_), {number(rate(row))} GB/s",
                          (rate(row),))] if row else []
    if panel.limit == "pcie":
        bars = []
        for way in panel.ways:
            same = median_by((row["nb"], rate(row)) for row in rows if row["mode"] == "ceiling" and row["nt"] == nt
                             and row["direction"] == way and rate(row))
            if same:
                bars.append(Bars(f"pinned memcpy of the same bytes, {WAY[way]}", same, WAY_GRAY[way]))
        found = [(way, row) for way, row in ((way, ceiling(rows, way)) for way in panel.ways) if row]
        if not found:
            return bars, []
        text = ", ".join(f"{number(rate(row))} GB/s {WAY[way]}" for way, row in found)
        return bars, [Limit(f"ceiling: {gib(found[0][1])} pinned memcpy, {text}", tuple(rate(row) for _, row in found))]
    # The single-threaded memcpy of kvbm_ext's rows; the torch loop's rows have their own
    # ceiling (torch copy_ on torch's threads: benchmarks/README.md, CPU cases).
    memcpy = median_by((row["nb"], row["ceiling_gbps"]) for row in drawn
                       if row["backend"] != "torch" and isinstance(row["ceiling_gbps"], float)
                       and not math.isnan(row["ceiling_gbps"]))
    if not memcpy:
        return [], []
    return [Bars("one memcpy of the same bytes (numpy.copyto, one thread)", memcpy, REFERENCE_GRAYS[0])], []


def panel_rows(rows, series, nt):
    return [row for row in rows if row["nt"] == nt and series.select(row) and rate(row)]


def draw_panel(ax, rows, panel, nt):
    bars, drawn = [], []
    for series in panel.series:
        mine = panel_rows(rows, series, nt)
        if mine:
            bars.append(Bars(series.label, median_by((row["nb"], rate(row)) for row in mine), series.color,
                             series.hatch))
            drawn += mine
    nbs = sorted({row["nb"] for row in drawn})
    reference_bars, limits = references(rows, panel, nt, drawn)
    if len(reference_bars) == len(bars) > 1:        # each move next to the memcpy of its way
        bars = [b for pair in zip(bars, reference_bars) for b in pair]
    else:
        bars += reference_bars
    grouped_bars(ax, [(nb, str(nb)) for nb in nbs], bars, limits, panel.title, NB_AXIS, GBPS)


def kvbench_figure(figure, plt, rows, where):
    nt = shown_nt(rows)
    panels = [panel for panel in figure.panels if any(panel_rows(rows, series, nt) for series in panel.series)]
    if not panels:
        return None
    fig, axes = new_figure(plt, len(panels), 2, figure.question, f"{where}; {PROFILE}, {nt} tokens per block")
    for ax, panel in zip(axes, panels):
        draw_panel(ax, rows, panel, nt)
    return fig


def read_kvbench(path):
    from report import COLUMNS, read_csv
    return [dict({column: "" for column in COLUMNS}, **row) for row in read_csv(path)]


# ----------------------------------------------------------------------------- engines.py

NB_COLORS = ("C0", "C1", "C2", "C4", "C5", "C6")
ENGINE_DIRECTIONS = {"offload": "offload: engine cache to pool", "onload": "onload: pool to engine cache"}
ENGINE_PATHS = {
    # path: (question, what moves, the column, its reference)
    "pinned": ("Staged path: does each engine's cache layout move at a pinned memcpy's rate?",
               "to_cache between each engine's cache and a universal pool in pinned host memory",
               "pct_same_size_memcpy", "a pinned memcpy of the same bytes"),
    "d2d": ("On the GPU: how close does each engine's cache layout come to the device copy?",
            "to_cache between each engine's cache and a universal pool in device memory",
            "pct_of_ceiling", "the 1 GiB device copy"),
}


def ordered(values):
    return list(dict.fromkeys(values))


def engines_figure(path, plt, rows, where):
    """Per model and direction, each engine's % of the path's reference, a bar per nb."""
    question, what, column, reference = ENGINE_PATHS[path]
    cases = [row for row in rows if row["path"] == path and row["model"] and not row["engine"].startswith("memcpy")
             and isinstance(row[column], float)]
    if not cases:
        return None
    panels = [(model, direction) for model in ordered(row["model"] for row in cases)
              for direction in ordered(row["direction"] for row in cases)]
    fig, axes = new_figure(plt, len(panels), 2, question, f"{where}; {what}, bf16, 16 tokens per block")
    engines = ordered(row["engine"] for row in cases)
    nbs = sorted({row["nb"] for row in cases})
    device_copy = next((row["gbps"] for row in rows if row["engine"] == "memcpy" and not row["model"]), None)
    if path == "d2d" and device_copy:
        reference += f", {number(device_copy)} GB/s"
    for ax, (model, direction) in zip(axes, panels):
        mine = [row for row in cases if (row["model"], row["direction"]) == (model, direction)]
        bars = [Bars(f"{nb} block{'s' if nb > 1 else ''} per call", {row["engine"]: row[column] for row in mine
                                                                    if row["nb"] == nb}, NB_COLORS[i % len(NB_COLORS)])
                for i, nb in enumerate(nbs)]
        grouped_bars(ax, [(engine, engine.replace("_", "\n")) for engine in engines], bars,
                     [Limit(f"100 % = {reference}", (100.0,))],
                     f"{model}, {ENGINE_DIRECTIONS.get(direction, direction)}",
                     "the engine's cache layout", f"% of {reference.split(',')[0]}")
    return fig


# ----------------------------------------------------------------------------- engines.py --transformers

TRANSFORMERS_MODES = {
    "soft_reset": ("soft reset,\nno offloading", "C7"),
    "transformers_offload": ("transformers'\nown CPU offloading", "C1"),
    "kvbm_offload": ("kvbm_ext\noffloading", "C0"),
}
SUBJECT = "transformers continuous batching, a model of Llama-3.1-8B's shape"


def tokens_figure(plt, rows, where):
    """Tokens/s of each mode under pressure, against the run without pressure."""
    runs = {row["mode"]: row["tokens_per_s"] for row in rows if row["kind"] == "run"
            and isinstance(row["tokens_per_s"], float)}
    modes = [mode for mode in TRANSFORMERS_MODES if mode in runs]
    if not modes:
        return None
    fig, (ax,) = new_figure(plt, 1, 1, "Under GPU-cache pressure, which offloading generates the most tokens/s?",
                            f"{where}; {SUBJECT}", width=8)
    bars = [Bars("", {mode: runs[mode]}, TRANSFORMERS_MODES[mode][1]) for mode in modes]   # named by the ticks
    limits = [Limit(f"no cache pressure (every request fits): {number(runs['no_pressure'])} tokens/s",
                    (runs["no_pressure"],))] if "no_pressure" in runs else []
    grouped_bars(ax, [(mode, TRANSFORMERS_MODES[mode][0]) for mode in modes], bars, limits,
                 "the fastest run of each mode; the offloading manager's construction left out", "",
                 "generated tokens/s")
    return fig


def calls_figure(plt, rows, where):
    """Each offload and restore call, % of a pinned memcpy of its bytes, against its size."""
    calls = [row for row in rows if row["kind"] in ("offload", "restore") and isinstance(row["pct_same_size_memcpy"],
                                                                                          float)]
    if not calls:
        return None
    fig, (ax,) = new_figure(plt, 1, 1, "Each offload and restore call: how close to a pinned memcpy of the same "
                            "bytes?", f"{where}; {SUBJECT}", width=8)
    points = [Points(f"{TRANSFORMERS_MODES[mode][0].replace(chr(10), ' ')}: {kind}",
                     [(row["bytes"] / 2**20, row["pct_same_size_memcpy"]) for row in calls
                      if (row["mode"], row["kind"]) == (mode, kind)], TRANSFORMERS_MODES[mode][1], marker)
              for mode in ("transformers_offload", "kvbm_offload") for kind, marker in (("offload", "o"),
                                                                                          ("restore", "^"))]
    measured_points(ax, [p for p in points if p.xy],
                    [Limit("100 % = a pinned memcpy of the same bytes, timed the same way", (100.0,))],
                    "a marker per call (CUDA events around the call)", "MiB per call",
                    "% of a pinned memcpy of the same bytes")
    return fig


# ----------------------------------------------------------------------------- reshard.py

RESHARD_METHODS = (
    ("reshard", "Resharder call, blocking", "C0"),
    ("reshard-async", "Resharder call, wait=False", "C1"),
    ("reshard-check", "Resharder call, check=True", "C2"),
    ("fragments", "a send or NIXL descriptor per layer, K/V and block", "C3"),
    ("one-buffer", "one buffer of the same bytes (one send or NIXL WRITE)", REFERENCE_GRAYS[0]),
)
RESHARD_DIRECTIONS = {"1to2": "prefill TP 1 -> decode TP 2", "2to1": "prefill TP 2 -> decode TP 1"}


def reshard_figure(plt, rows, where):
    """Per transport and direction, link GB/s of each method, a group per nb."""
    rows = [row for row in rows if isinstance(row.get("link_gbps"), float)]
    panels = ordered((row["transport"], row["direction"]) for row in rows)
    if not panels:
        return None
    block = next(row["bytes"] / row["nb"] / 2**20 for row in rows)
    fig, axes = new_figure(plt, len(panels), 2, "Resharder: how close to one buffer of the same bytes between the "
                           "ranks?", f"{where}; KV cache blocks of {block:.3g} MiB, bf16")
    for ax, (transport, direction) in zip(axes, panels):
        mine = [row for row in rows if (row["transport"], row["direction"]) == (transport, direction)]
        bars = [Bars(label, {row["nb"]: row["link_gbps"] for row in mine if row["method"] == method}, color)
                for method, label, color in RESHARD_METHODS]
        grouped_bars(ax, [(nb, str(nb)) for nb in sorted({row["nb"] for row in mine})], bars, (),
                     f"{transport}: {RESHARD_DIRECTIONS.get(direction, direction)}", NB_AXIS,
                     "GB/s between the ranks (link bytes)")
    return fig


# ----------------------------------------------------------------------------- vllm_offload.py

VLLM_BARS = (
    ("worker_gbps", "kvbm_ext worker, one job", "C0"),
    ("loop_gbps", "torch copy_ per block and layer", "C3"),
    ("memcpy_gbps", "pinned memcpy of the same bytes", REFERENCE_GRAYS[0]),
)
VLLM_DIRECTIONS = {"store": "store: GPU to pinned host", "load": "load: pinned host to GPU"}


def vllm_figure(plt, rows, where):
    """Per model and direction, GB/s of a job, a torch loop and a memcpy, a group per nb."""
    panels = ordered((row["model"], row["direction"]) for row in rows)
    if not panels:
        return None
    fig, axes = new_figure(plt, len(panels), 2, "vLLM offloading jobs: does one kvbm_ext job move at a pinned "
                           "memcpy's rate?", f"{where}; vLLM's K|V-packed cache, bf16, 16 tokens per block")
    for ax, (model, direction) in zip(axes, panels):
        mine = [row for row in rows if (row["model"], row["direction"]) == (model, direction)]
        bars = [Bars(label, {row["nb"]: row[column] for row in mine}, color) for column, label, color in VLLM_BARS]
        grouped_bars(ax, [(nb, str(nb)) for nb in sorted({row["nb"] for row in mine})], bars, (),
                     f"{model}, {VLLM_DIRECTIONS.get(direction, direction)}", "blocks per job, as measured", GBPS)
    return fig


# ----------------------------------------------------------------------------- disk.py

DISK_SOURCES = {"gpu": "GPU cache", "pinned": "pinned host pool", "host": "host cache", "pool": "host pool"}


def disk_figure(plt, rows, where):
    """Stores and loads, checksums on and off, next to dd of the same bytes, a group per
    source and size."""
    cases = [row for row in rows if row["kind"] in ("store", "load") and str(row["durable"]) == "False"]
    if not cases:
        return None
    block = cases[0]["bytes"] / cases[0]["blocks"] / 2**20
    fig, axes = new_figure(plt, 2, 2, "kvbm_ext.disk: do stores and loads reach dd's rate on the same file?",
                           f"{where}; Llama-3.1-70B blocks of {block:.1f} MiB")
    groups = sorted({(row["source"], row["blocks"]) for row in cases}, key=lambda key: (key[0], key[1]))
    for ax, kind in zip(axes, ("store", "load")):
        mine = [row for row in cases if row["kind"] == kind]

        def values(checksums, column):
            return {(row["source"], row["blocks"]): row[column] for row in mine
                    if row["checksums"] == checksums and isinstance(row[column], float)}

        reference = next((row["reference"] for row in mine if row["reference"]), "dd")
        bars = [Bars("kvbm_ext.disk, checksums on", values("on", "gbs"), "C0"),
                Bars("kvbm_ext.disk, checksums off", values("off", "gbs"), "C2"),
                Bars(f"{reference} of the same bytes (O_DIRECT, 1 MiB)", values("on", "reference_gbs"),
                     REFERENCE_GRAYS[0])]
        grouped_bars(ax, [(key, f"{DISK_SOURCES.get(key[0], key[0])}\n{key[1]} blocks") for key in groups], bars, (),
                     f"{kind}: kvbm_ext.disk against {reference}", "", GBPS)
    return fig


# ----------------------------------------------------------------------------- any run's CSV

@dataclass
class Benchmark:
    name: str
    columns: tuple            # the columns that tell its CSV apart
    figures: tuple            # (name, function(plt, rows, where) -> figure or None); "" draws <stem>.png
    read: object = read_rows


BENCHMARKS = (
    Benchmark("kvbench", ("api", "status"),
              tuple((figure.name, partial(kvbench_figure, figure)) for figure in FIGURES), read_kvbench),
    Benchmark("engines --transformers", ("tokens_per_s",), (("tokens", tokens_figure), ("calls", calls_figure))),
    Benchmark("engines", ("engine", "path"), tuple((path, partial(engines_figure, path)) for path in ENGINE_PATHS)),
    Benchmark("reshard", ("transport", "link_gbps"), (("", reshard_figure),)),
    Benchmark("vllm_offload", ("worker_gbps", "memcpy_gbps"), (("", vllm_figure),)),
    Benchmark("disk", ("checksums", "reference_gbs"), (("", disk_figure),)),
)
KVBENCH = BENCHMARKS[0]
FIGURE_NAMES = tuple(dict.fromkeys(name for benchmark in BENCHMARKS for name, _ in benchmark.figures if name))


def benchmark_of(path):
    """The benchmark whose CSV `path` is; ValueError when none is."""
    with open(path, newline="") as f:
        header = set(next(csv.reader(f), []))
    for benchmark in BENCHMARKS:
        if set(benchmark.columns) <= header:
            return benchmark
    raise ValueError(f"{path} is a CSV of none of " + ", ".join(b.name for b in BENCHMARKS))


RUN_NAME = re.compile(r"(\d+x[^/]+?|cpu)-(\d{4}-\d{2}-\d{2})(?:-\d+)?$")


def where_of(rows, path=""):
    """The run's GPU (or CPU) and date: from its rows, else from its file's name."""
    first = rows[0] if rows else {}
    name, date = first.get("gpu_name") or (first.get("device") if "date" in first else ""), first.get("date", "")
    if not name and path:
        found = RUN_NAME.search(os.path.splitext(os.path.basename(path))[0])
        if found:
            name, date = found.group(1).replace("x", " x ", 1) if found.group(1) != "cpu" else "cpu", found.group(2)
    return f"{'CPU' if name in ('none', 'cpu', '') else name}, {date}"


def draw_rows(benchmark, rows, stem, where, names=None):
    """The PNGs of a run: <stem>-<figure>.png for each figure whose rows are there (of those
    named, when names), or <stem>.png for a benchmark of one figure.  Returns (paths, why
    none was written or None)."""
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    paths = []
    for name, make in benchmark.figures:
        if not name or names is None or name in names:
            fig = make(plt, rows, where)
            if fig is not None:
                paths.append(f"{stem}-{name}.png" if name else f"{stem}.png")
                save(fig, paths[-1])
    return paths, None if paths else NO_ROWS


def draw(rows, stem, names=None):
    """A kvbench run's PNGs, from its rows (see draw_rows)."""
    return draw_rows(KVBENCH, rows, stem, where_of(rows), names)


def draw_file(path, out=None, names=None):
    """The PNGs of a run from its CSV, next to it or in `out` (see draw_rows)."""
    benchmark = benchmark_of(path)
    rows = benchmark.read(path)
    stem = os.path.splitext(path)[0]
    if out:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, os.path.basename(stem))
    return draw_rows(benchmark, rows, stem, where_of(rows, path), names)


# ----------------------------------------------------------------------------- the README's table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_NBS = (1, 64)              # the README's rows: one block a call, and a batch
TABLE_FUNCTIONS = ("PagedKVCache.to_universal", "PagedKVCache.from_universal")
TABLE_HEADER = ("| nb | device to device, to / from universal | % of the device copy | pinned host, to / from "
                "| % of a same-size pinned memcpy |")


def source_name(path):
    """The CSV as the table names it: relative to the checkout when inside it."""
    relative = os.path.relpath(os.path.abspath(path), REPO_ROOT)
    return path if relative.startswith("..") else relative


def table_row(rows, function, placement, nt, nb):
    """The one verified row of PagedKVCache `function` with device ids (num_ctas None) at
    this placement, nt and nb; ValueError naming the case when the run has none or several."""
    found = [row for row in rows if gpu_row("paged", function, placement, "device_ids")(row)
             and row["nt"] == nt and row["nb"] == nb and rate(row)]
    if len(found) != 1:
        raise ValueError(f"{len(found)} verified rows of {function}, {placement}, device ids, nt={nt}, nb={nb} "
                         "(the table needs one)")
    return found[0]


def paged_table(rows, source, nbs=TABLE_NBS):
    """The README's table of a kvbench paged run (rows as report.read_csv gives them, from the
    CSV `source`): PagedKVCache with device ids, to and from universal blocks, at each nb:
    GB/s device to device with its % of the run's device copy (pct_of_ceiling), and to and
    from pinned host memory with its % of a pinned memcpy of the same bytes
    (pct_same_size_memcpy); then the run's ceilings.  Lines of Markdown; every figure is
    the CSV's, rounded (rates counted once, as report.read_csv reads any CSV)."""
    nt = shown_nt(rows)
    where = where_of(rows)
    lines = [f"{where}, {PROFILE}, {nt} tokens per block, device ids "
             f"(`{source_name(source)}`; GB/s count each byte moved once):", "",
             TABLE_HEADER, "|---:|---|---|---|---|"]
    for nb in nbs:
        cells = [str(nb)]
        for placement, pct in (("d2d", "pct_of_ceiling"), ("pinned", "pct_same_size_memcpy")):
            pair = [table_row(rows, function, placement, nt, nb) for function in TABLE_FUNCTIONS]
            cells.append(" / ".join(number(rate(row)) for row in pair) + " GB/s")
            cells.append(" / ".join(f"{row[pct]:.1f}" for row in pair))
        lines.append("| " + " | ".join(cells) + " |")
    limits = {direction: ceiling(rows, direction) for direction in ("d2d", "h2d", "d2h")}
    if None in limits.values():
        raise ValueError("the run has no " + ", ".join(d for d, row in limits.items() if row is None) + " ceiling")
    lines += ["", f"Ceilings of the same run: device copy {number(rate(limits['d2d']))} GB/s, 1 GiB pinned "
                  f"memcpy {number(rate(limits['h2d']))} (host to device) and "
                  f"{number(rate(limits['d2h']))} GB/s (device to host)."]
    return lines


def main(argv=None):
    """python3 benchmarks/figures.py RUN.csv [--out DIR]: the PNGs of an earlier run, drawn
    from its CSV (a run made where matplotlib was missing, or one of benchmarks/results/):
    a CSV of kvbench.py, engines.py, reshard.py, vllm_offload.py or disk.py; with --table,
    the README's table of a kvbench run instead."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("csv", metavar="RUN.csv", help="a benchmark's CSV (of any kvbench version)")
    parser.add_argument("--out", help="directory for the PNGs (default: next to the CSV)")
    parser.add_argument("--figure", action="append", choices=FIGURE_NAMES,
                        help="draw only this figure (repeatable; default: every figure the run has rows for)")
    parser.add_argument("--table", action="store_true",
                        help="print the README's Markdown table of the run's PagedKVCache rates (a paged run at "
                             f"nb = {' and '.join(map(str, TABLE_NBS))}) instead of drawing")
    args = parser.parse_args(argv)
    try:
        if args.table:
            print("\n".join(paged_table(read_kvbench(args.csv), args.csv)))
            return
        paths, why_not = draw_file(args.csv, args.out, args.figure)
    except ValueError as error:
        raise SystemExit(f"figures: {args.csv}: {error}")
    if why_not:
        raise SystemExit(f"figures: {why_not}")
    for path in paths:
        print(f"PNG: {path}")


if __name__ == "__main__":
    main()
