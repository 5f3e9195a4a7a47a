"""The pictures of a kvbench run: one PNG per question a reader asks, each a GB/s against
blocks per call plot with a few plainly named lines and the limit it is measured against
drawn as a line.  A figure is drawn when its group ran; it reads the rows of report.py (a
run's, or a CSV's through report.read_csv).  `--table` prints instead the README's table of
PagedKVCache rates (paged_table), every figure in it read from the CSV it names."""

import math
import os
import statistics
from dataclasses import dataclass, field

from report import TARGET_NT, is_swept, rate

PROFILE = "Llama-3.1-70B KV cache, bf16"
GBPS = "GB/s (bytes moved, each counted once)"
TO, BACK = "-", "--"                     # line styles: to universal / operational / host, and back
MEMCPY_STYLE = dict(color="gray", linestyle=":", linewidth=1.5)
LIMIT_STYLE = dict(color="black", linewidth=1.2)
HEADROOM = 1.08                          # the y axis ends this far above the highest line


@dataclass
class Line:
    label: str
    select: object            # row -> whether the row is a point of this line
    color: str
    style: str = TO


@dataclass
class Panel:
    title: str
    lines: list
    limit: str                # "device", "pcie" or "cpu": the limit drawn (see draw_limits)
    note: str = ""            # a line under the title, e.g. what solid and dashed mean


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


def cpu_row(functions, backend=None):
    def select(row):
        return (row["mode"] == "cpu" and row["function"] in functions
                and (backend is None or row["backend"] == backend))
    return select


def paged_panels(placement_titles, lines_of):
    return [Panel(title, lines_of(placement), "device" if placement == "d2d" else "pcie")
            for placement, title in placement_titles]


ON_GPU = ("d2d", "on the GPU: device memory to device memory")
OVER_PCIE = ("pinned", "to and from pinned host memory, over PCIe")
SOLID_DASHED_OPERATIONAL = "solid: blocks to operational, dashed: back"
SOLID_DASHED_HOST = "solid: GPU to pinned host (offload), dashed: back (onload)"


def there_and_back(api, functions, labels, placement, backend=None):
    """A move (solid, C0) and the move back (dashed, C1) of one group and placement."""
    return [Line(labels[0], gpu_row(api, functions[0], placement, backend), "C0"),
            Line(labels[1], gpu_row(api, functions[1], placement, backend), "C1", BACK)]


def paged_lines(placement):
    if placement == "d2d":
        labels = ("to_universal: cache to universal blocks", "from_universal: universal blocks to cache")
    else:
        labels = ("offload: to_universal, cache to pinned host", "onload: from_universal, pinned host to cache")
    return there_and_back("paged", ("PagedKVCache.to_universal", "PagedKVCache.from_universal"), labels, placement,
                          "device_ids")


def torch_lines(placement):
    loop = "plain PyTorch loop (index_select, permute, copy_ per layer)"
    return paged_lines(placement) + [
        Line(f"{loop}, to universal", gpu_row("paged", "TorchLoop.to_universal", placement), "C3"),
        Line(f"{loop}, from universal", gpu_row("paged", "TorchLoop.from_universal", placement), "C3", BACK)]


def list_lines(placement):
    return there_and_back("list", ("block_to_universal", "universal_to_block"),
                          ("block_to_universal: chunks to universal blocks",
                           "universal_to_block: universal blocks to chunks"), placement)


OPERATIONAL_BACKENDS = (
    ("auto", "auto (the default)", "C0"),
    ("kernel", "kernel: SMs move every byte", "C2"),
    ("batch", "batch: copy engines, cudaMemcpyBatchAsync", "C4"),
    ("async", "async: copy engines, a cudaMemcpyAsync per chunk", "C3"),
)


def operational_backend_lines(placement):
    lines = []
    for backend, label, color in OPERATIONAL_BACKENDS:
        lines.append(Line(label, gpu_row("operational", "block_to_operational", placement, backend), color))
        lines.append(Line("", gpu_row("operational", "operational_to_block", placement, backend), color, BACK))
    return lines


def universal_operational_lines(placement):
    return there_and_back("operational", ("universal_to_operational", "operational_to_universal"),
                          ("universal_to_operational: universal to operational blocks",
                           "operational_to_universal: operational to universal blocks"), placement)


RAW_COPIES = (
    ("vectorized_copy", "host_list", "vectorized_copy, addresses in a host list", "C0"),
    ("vectorized_copy", "device_list", "vectorized_copy, addresses in a GPU array", "C2"),
    ("memcpy_batch", "batched_with_fallback", "memcpy_batch: cudaMemcpyBatchAsync", "C4"),
    ("memcpy_batch", "fallback_only", "memcpy_batch fallback_only: a cudaMemcpyAsync per pair", "C3"),
)


def raw_copy_lines(granularity):
    def select(function, backend, direction):
        return lambda row: (row["mode"] == "gpu" and row["api"] == "copy" and row["function"] == function
                            and row["backend"] == backend and row["granularity"] == granularity
                            and row["direction"] == direction)
    lines = []
    for function, backend, label, color in RAW_COPIES:
        lines.append(Line(label, select(function, backend, "d2h"), color))
        lines.append(Line("", select(function, backend, "h2d"), color, BACK))
    return lines


def cpu_lines():
    return [Line("list API, to universal", cpu_row(("block_to_universal",)), "C0"),
            Line("list API, from universal", cpu_row(("universal_to_block",)), "C0", BACK),
            Line("PagedKVCache, to universal", cpu_row(("PagedKVCache.to_universal",)), "C1"),
            Line("PagedKVCache, from universal", cpu_row(("PagedKVCache.from_universal",)), "C1", BACK),
            Line("plain PyTorch loop, to universal", cpu_row(("TorchLoop.to_universal",)), "C3"),
            Line("plain PyTorch loop, from universal", cpu_row(("TorchLoop.from_universal",)), "C3", BACK)]


FIGURES = (
    Figure("paged", "PagedKVCache: how close to the hardware's copy rate?",
           paged_panels((ON_GPU, OVER_PCIE), paged_lines)),
    Figure("torch", "PagedKVCache against a plain PyTorch loop, on the GPU",
           paged_panels((ON_GPU,), torch_lines)),
    Figure("list", "List API: how close to the hardware's copy rate?",
           paged_panels((ON_GPU, OVER_PCIE), list_lines)),
    Figure("operational", "Blocks to and from operational blocks: which backend?",
           [Panel(title, operational_backend_lines(placement), "device" if placement == "d2d" else "pcie",
                  SOLID_DASHED_OPERATIONAL) for placement, title in (ON_GPU, OVER_PCIE)]),
    Figure("universal-operational", "Universal to and from operational blocks, in one pass",
           paged_panels((ON_GPU, OVER_PCIE), universal_operational_lines)),
    Figure("copies", "Raw copies between the GPU and pinned host memory: which function?",
           [Panel("32 KB chunks: 160 pairs per block", raw_copy_lines("chunk"), "pcie", SOLID_DASHED_HOST),
            Panel("whole blocks: one pair per block", raw_copy_lines("block"), "pcie", SOLID_DASHED_HOST)]),
    Figure("cpu", "On the CPU: against one memcpy of the same bytes",
           [Panel("host memory to host memory", cpu_lines(), "cpu")]),
)


# ----------------------------------------------------------------------------- drawing

def shown_nt(rows):
    """The nt every figure shows: 16 when it was run, else the smallest."""
    nts = {row["nt"] for row in rows if isinstance(row["nt"], int)}
    return TARGET_NT if TARGET_NT in nts or not nts else min(nts)


def points(rows):
    """(nb, GB/s) of the rows, the median where several rows have one nb."""
    by_nb = {}
    for row in rows:
        by_nb.setdefault(row["nb"], []).append(rate(row))
    return sorted((nb, statistics.median(values)) for nb, values in by_nb.items())


def ceiling(rows, direction):
    return next((row for row in rows if row["mode"] == "ceiling" and row["nt"] == "" and row["direction"] == direction
                 and rate(row)), None)


def draw_limits(ax, rows, panel, nt, drawn):
    """The limit of the panel as black lines: the device copy, or the 1 GiB pinned memcpy each
    way (one legend entry), with a pinned memcpy of exactly each call's bytes dotted; on the
    CPU, a memcpy of the same bytes.  Returns the GB/s drawn."""
    values = []
    if panel.limit == "device":
        row = ceiling(rows, "d2d")
        if row:
            ax.axhline(rate(row), **LIMIT_STYLE, label=f"limit: GPU memory copy (torch copy_), {rate(row):,.0f} GB/s")
            values.append(rate(row))
    elif panel.limit == "pcie":
        found = [row for row in (ceiling(rows, "d2h"), ceiling(rows, "h2d")) if row]
        text = " / ".join(f"{rate(row):.1f}" for row in found)
        for i, row in enumerate(found):
            ax.axhline(rate(row), **LIMIT_STYLE, label=None if i else f"limit: 1 GiB pinned memcpy, {text} GB/s")
            values.append(rate(row))
        for i, direction in enumerate(("d2h", "h2d")):
            same = points([row for row in rows if row["mode"] == "ceiling" and row["nt"] == nt
                           and row["direction"] == direction and rate(row)])
            if same:
                ax.plot(*zip(*same), **MEMCPY_STYLE, label=None if i else "pinned memcpy of the same bytes")
                values += [gbps for _, gbps in same]
    elif panel.limit == "cpu":
        # The single-threaded memcpy of kvbm_ext's rows; the torch loop's rows have their own
        # ceiling (torch copy_ on torch's threads: benchmarks/README.md, CPU cases).
        memcpy = sorted({(row["nb"], row["ceiling_gbps"]) for row in drawn
                         if row["backend"] != "torch" and isinstance(row["ceiling_gbps"], float)
                         and not math.isnan(row["ceiling_gbps"])})
        if memcpy:
            ax.plot(*zip(*memcpy), **MEMCPY_STYLE, label="one memcpy of the same bytes (numpy.copyto)")
            values += [gbps for _, gbps in memcpy]
    return values


def draw_panel(ax, rows, panel, nt):
    drawn = []
    for line in panel.lines:
        mine = [row for row in rows if row["nt"] == nt and line.select(row) and rate(row)]
        if mine:
            ax.plot(*zip(*points(mine)), marker="o", markersize=4, color=line.color, linestyle=line.style,
                    label=line.label or None)
            drawn += mine
    highest = max([rate(row) for row in drawn] + draw_limits(ax, rows, panel, nt, drawn))
    nbs = sorted({row["nb"] for row in drawn})
    ax.set_xscale("log", base=2)
    ax.set_xticks(nbs, [str(nb) for nb in nbs])
    ax.minorticks_off()
    ax.set_ylim(0, HEADROOM * highest)
    ax.set_xlabel("blocks per call (nb)")
    ax.set_ylabel(GBPS)
    ax.set_title(panel.title + (f"\n{panel.note}" if panel.note else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.16), frameon=False)


def has_rows(rows, panel, nt):
    return any(row["nt"] == nt and line.select(row) and rate(row) for line in panel.lines for row in rows)


def draw_figure(plt, rows, figure, nt, path, where):
    panels = [panel for panel in figure.panels if has_rows(rows, panel, nt)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 6.2), squeeze=False,
                             constrained_layout=True)
    for ax, panel in zip(axes[0], panels):
        draw_panel(ax, rows, panel, nt)
    fig.suptitle(f"{figure.question}\n{where}; {PROFILE}, {nt} tokens per block", fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def where_of(rows):
    """The run's GPU (or CPU) and date, from its rows."""
    first = rows[0] if rows else {}
    gpu = first.get("gpu_name") or "none"
    return f"{'CPU' if gpu == 'none' else gpu}, {first.get('date', '')}"


def draw(rows, stem, names=None):
    """The PNGs of the run: <stem>-<figure>.png for each figure whose rows are there (of
    those named, when names).  Returns (paths, why none was written or None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "no PNG: matplotlib is not installed (pip install matplotlib)"
    nt = shown_nt(rows)
    paths = []
    for figure in FIGURES:
        if (names is None or figure.name in names) and any(has_rows(rows, panel, nt) for panel in figure.panels):
            path = f"{stem}-{figure.name}.png"
            draw_figure(plt, rows, figure, nt, path, where_of(rows))
            paths.append(path)
    return paths, None if paths else "no PNG: no row was timed"


# ----------------------------------------------------------------------------- the README's table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_NBS = (1, 64)              # the README's rows: one block a call, and a batch
TABLE_FUNCTIONS = ("PagedKVCache.to_universal", "PagedKVCache.from_universal")
TABLE_HEADER = ("| nb | device to device, to / from universal | % of the device copy | pinned host, to / from "
                "| % of a same-size pinned memcpy |")


def table_gbps(value):
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


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
            cells.append(" / ".join(table_gbps(rate(row)) for row in pair) + " GB/s")
            cells.append(" / ".join(f"{row[pct]:.1f}" for row in pair))
        lines.append("| " + " | ".join(cells) + " |")
    limits = {direction: ceiling(rows, direction) for direction in ("d2d", "h2d", "d2h")}
    if None in limits.values():
        raise ValueError("the run has no " + ", ".join(d for d, row in limits.items() if row is None) + " ceiling")
    lines += ["", f"Ceilings of the same run: device copy {table_gbps(rate(limits['d2d']))} GB/s, 1 GiB pinned "
                  f"memcpy {table_gbps(rate(limits['h2d']))} (host to device) and "
                  f"{table_gbps(rate(limits['d2h']))} GB/s (device to host)."]
    return lines


def main(argv=None):
    """python3 benchmarks/figures.py RUN.csv [--out DIR]: the PNGs of an earlier run, drawn
    from its CSV (a run made where matplotlib was missing, or one of benchmarks/results/);
    with --table, the README's table of the run instead."""
    import argparse

    from report import COLUMNS, read_csv

    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("csv", metavar="RUN.csv", help="a kvbench CSV (any kvbench version)")
    parser.add_argument("--out", help="directory for the PNGs (default: next to the CSV)")
    parser.add_argument("--figure", action="append", choices=[figure.name for figure in FIGURES],
                        help="draw only this figure (repeatable; default: every figure the run has rows for)")
    parser.add_argument("--table", action="store_true",
                        help="print the README's Markdown table of the run's PagedKVCache rates (a paged run at "
                             f"nb = {' and '.join(map(str, TABLE_NBS))}) instead of drawing")
    args = parser.parse_args(argv)
    rows = [dict({column: "" for column in COLUMNS}, **row) for row in read_csv(args.csv)]
    if args.table:
        try:
            print("\n".join(paged_table(rows, args.csv)))
        except ValueError as error:
            raise SystemExit(f"figures: {args.csv}: {error}")
        return
    stem = os.path.splitext(args.csv)[0]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, os.path.basename(stem))
    paths, why_not = draw(rows, stem, args.figure)
    if why_not:
        raise SystemExit(f"figures: {why_not}")
    for path in paths:
        print(f"PNG: {path}")


if __name__ == "__main__":
    main()
