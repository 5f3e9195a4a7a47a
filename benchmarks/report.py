"""The report of a kvbench run: the rows and their columns, the tables printed at the end,
the targets (a PASS/MISS verdict per row), the CSV and the comparison with an older run's
CSV (figures.py draws the PNGs).  Plain Python: it reads and writes rows, it times nothing."""

import csv
import math
import operator
import statistics
from dataclasses import dataclass
from functools import partial

VERIFIED = "verified"            # status of a row whose case matched the reference bit for bit
LABEL_WIDTH = 28
MAX_FAILURES_SHOWN = 8
AUTO_TOLERANCE = 1.05            # auto is fine within 5% of the fastest backend
BACKEND_APIS = ("operational", "copy")   # whose variants are compared by annotate_backends
TARGET_NT = 16                   # the GPU targets are stated for nt = 16
BANDWIDTH_MIN_NB = 64            # the paged bandwidth targets hold from this nb on


# ----------------------------------------------------------------------------- rows

COLUMNS = [
    "gpu_name", "date", "mode", "api", "function", "direction", "placement", "layout",
    "backend", "granularity", "nt", "nb", "pairs", "bytes", "gpu_us", "host_us", "gbps",
    "ceiling_gbps", "pct_of_ceiling", "same_size_memcpy_gbps", "pct_same_size_memcpy",
    "best_backend", "auto_vs_best", "auto_within_5pct", "ratio_vs_memcpy",
    "reps", "sets", "uncovered_reps", "gpu_timing", "status",
    "num_ctas", "sms", "gbps_per_sm", "speedup_vs_torch", "host_steady_us",   # paged rows
    "target", "verdict",      # rows a target covers: the goal, PASS or MISS
    "gbps_counts",            # "once": GB/s count the bytes moved once (see read_csv)
]
GBPS_COUNTS = "once"

SHORT = {  # names in the printed tables
    "operational": "op", "pinned": "pin", "ceiling": "ceil",
    "vectorized_copy": "vc", "memcpy_batch": "mb", "host_list": "host", "device_list": "dev",
    "batched_with_fallback": "bwf", "fallback_only": "loop", "batch_without_fallback": "batch",
    "host_ids": "hostid", "device_ids": "devid",
}


def make_row(ctx, **fields):
    """A row of the CSV: every column, the run's GPU name and date, status "verified" until
    the case says otherwise."""
    row = {column: "" for column in COLUMNS}
    row.update(gpu_name=ctx.gpu_name, date=ctx.date, status=VERIFIED, gbps_counts=GBPS_COUNTS)
    row.update(fields)
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


def ceiling_name(row):
    """What a row's pct_of_ceiling is a percentage of, as printed."""
    if row["mode"] != "cpu":
        return "ceiling"
    # CPU rows: a copy of the same bytes on as many threads as the row uses (cases.run_cpu_cases)
    return "ceiling (torch copy_)" if row["backend"] == "torch" else "ceiling (1-thread memcpy)"


def print_progress(row):
    figures = [(row["gpu_us"], "us gpu"), (row["host_us"], "us host"), (row["gbps"], "GB/s"),
               (row["pct_of_ceiling"], f"% of {ceiling_name(row)}"),
               (row["pct_same_size_memcpy"], "% of same-size memcpy")]
    shown = ", ".join(f"{fmt(value)} {unit}" for value, unit in figures if value != "")
    size = f" nt={row['nt']} nb={row['nb']}" if row["nt"] != "" else ""
    fed = " (fed)" if row["gpu_timing"] == "fed" else ""
    print(f"  {label(row)}{size}: {shown}{fed} [{row['status']}]", flush=True)


def is_timed(row):
    gpu_us = row["gpu_us"]
    return row["status"] == VERIFIED and isinstance(gpu_us, float) and not math.isnan(gpu_us)


# ----------------------------------------------------------------------------- annotations

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
    paged = [row for row in rows if row["api"] == "paged" and row["status"] == VERIFIED]
    loops = {paged_key(row): row for row in paged if row["backend"] == "torch"}
    for row in paged:
        if row["sms"] != "":
            row["gbps_per_sm"] = row["gbps"] / row["sms"]
        loop = loops.get(paged_key(row))
        if loop is not None and loop is not row and not is_swept(row):
            row["speedup_vs_torch"] = call_us(loop) / call_us(row)


# ----------------------------------------------------------------------------- tables

def header_lines(names, columns, widths, label_width):
    """Column headings, a line per part of the column tuples; an outer part is shown where
    it changes."""
    lines = []
    for level, name in enumerate(names):
        cells = []
        for i, column in enumerate(columns):
            shown = (level == len(names) - 1 or i == 0
                     or columns[i - 1][:level + 1] != column[:level + 1])
            cells.append(f"{column[level] if shown else '':>{widths[i]}}")
        lines.append(f"{name:>{label_width}}" + "".join(cells))
    return lines


def print_pivot(title, rows, label_of, column_of, names, cell, width):
    """A line per label_of(row), a column per column_of(row) (a tuple, its parts named by
    names); cell(the rows of one line and column) -> text.  A column is `width` wide, or
    wider where a text needs it, and a space always comes before a text: no two columns
    run together."""
    if not rows:
        return
    columns = sorted({column_of(row) for row in rows})
    cells = {}
    for row in rows:
        cells.setdefault((label_of(row), column_of(row)), []).append(row)
    labels = list(dict.fromkeys(label_of(row) for row in rows))
    texts = {name: [cell(cells[name, c]) if (name, c) in cells else "" for c in columns]
             for name in labels}
    widths = [max([width] + [len(str(part)) + 1 for part in column]
                  + [len(texts[name][i]) + 1 for name in labels])
              for i, column in enumerate(columns)]
    label_width = max([LABEL_WIDTH] + [len(name) + 1 for name in labels])
    print()
    print(title)
    for line in header_lines(names, columns, widths, label_width):
        print(line)
    for name in labels:
        print(f"{name:{label_width}}" + "".join(f"{text:>{w}}" for text, w in zip(texts[name], widths)))


def nt_nb(row):
    return (row["nt"], row["nb"])


def nb_only(row):
    return (row["nb"],)


def failed_cell(row):
    return "ERR" if row["status"].startswith("error") else "MIS"


def pct_cell(rows):
    row = rows[0]
    if row["status"] != VERIFIED:
        return failed_cell(row)
    value = row["pct_same_size_memcpy"]
    value = row["pct_of_ceiling"] if value == "" else value
    text = "999+" if value >= 999.5 else fmt(value, 0)
    return text + ("f" if row["gpu_timing"] == "fed" else "")


def host_cell(rows):
    values = [row["host_us"] for row in rows if row["status"] == VERIFIED]
    return figure(statistics.median(values) / 1e3) if values else "ERR"


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
    if row["status"] != VERIFIED:
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


# ----------------------------------------------------------------------------- targets

PASSES = {"<": operator.lt, "<=": operator.le, ">=": operator.ge}


@dataclass
class Target:
    """A goal rows are held to.  Each row it covers gets the goal in its `target` column and
    PASS or MISS in `verdict`; the summary names the worst row.  A row that was not
    verified, or has no figure, misses."""
    text: str           # what it covers, for the summary
    api: str            # the group whose runs it belongs to (its summary line shows then)
    select: object      # row -> whether the target covers it
    column: str         # the row's figure
    op: str             # "<", "<=" or ">="
    goal: float
    unit: str           # as printed after the figure: " us", "x", "%"

    def goal_text(self):
        return f"{self.column} {self.op} {figure(self.goal)}{self.unit}"

    def met_by(self, row):
        value = row[self.column]
        return (row["status"] == VERIFIED and isinstance(value, (int, float)) and not math.isnan(value)
                and PASSES[self.op](value, self.goal))

    def line(self, rows):
        covered = [row for row in rows if self.select(row)]
        if not covered:
            return f"  n/a   {self.text} ({self.goal_text()}): not measured"
        bad = [row for row in covered if row["status"] != VERIFIED or row[self.column] == ""]
        if bad:
            return f"  MISS  {self.text} ({self.goal_text()}): {len(bad)} of {len(covered)} rows without a figure"
        worst = (min if self.op == ">=" else max)(covered, key=lambda row: row[self.column])
        return (f"  {'PASS' if self.met_by(worst) else 'MISS'}  {self.text}: "
                f"{figure(worst[self.column])}{self.unit} ({self.goal_text()}; worst of "
                f"{len(covered)}: {label(worst)} nt={worst['nt']} nb={worst['nb']})")


def targets():
    """The goals of the list and paged groups; GPU goals are for nt = TARGET_NT.  Host times
    are those of calls issued back to back (host_steady_us); the from-idle figures are in
    the tables."""
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

    def cpu_list(row):
        return row["mode"] == "cpu" and row["api"] == "list"

    return [
        Target("CPU list API, time over one memcpy of the same bytes", "list", cpu_list,
               "ratio_vs_memcpy", "<=", 3, "x"),
        Target("PagedKVCache host time per call, back to back, d2d, nb=64, host ids", "paged",
               host_time_at("host_ids", 64), "host_steady_us", "<", 15, " us"),
        Target("PagedKVCache host time per call, back to back, d2d, nb=64, device ids", "paged",
               host_time_at("device_ids", 64), "host_steady_us", "<", 15, " us"),
        Target("list API host time per call, back to back, nb=64", "paged", list_at(64),
               "host_steady_us", "<", 3000, " us"),
        Target("PagedKVCache speedup over the torch loop, d2d, nb=1", "paged", speedup_at(1),
               "speedup_vs_torch", ">=", 100, "x"),
        Target("PagedKVCache speedup over the torch loop, d2d, nb=256", "paged", speedup_at(256),
               "speedup_vs_torch", ">=", 6, "x"),
        Target(f"PagedKVCache d2d, nb>={BANDWIDTH_MIN_NB}, % of the device copy ceiling", "paged",
               bandwidth_of("d2d"), "pct_of_ceiling", ">=", 90, "%"),
        Target(f"PagedKVCache pinned, nb>={BANDWIDTH_MIN_NB}, % of the same-size pinned memcpy", "paged",
               bandwidth_of("pinned"), "pct_same_size_memcpy", ">=", 90, "%"),
    ]


def apply_targets(rows, goals):
    """Fill the target and verdict columns of every row a goal covers (MISS if any of its
    goals is missed)."""
    for row in rows:
        mine = [goal for goal in goals if goal.select(row)]
        if mine:
            row["target"] = "; ".join(goal.goal_text() for goal in mine)
            row["verdict"] = "PASS" if all(goal.met_by(row) for goal in mine) else "MISS"


def print_targets(rows, goals):
    ran = {row["api"] for row in rows}
    lines = [goal.line(rows) for goal in goals if goal.api in ran]
    if not lines:
        return
    print()
    print(f"targets (GPU rows at nt={TARGET_NT}, num_ctas None; each row a target covers has PASS or MISS "
          "in the CSV's verdict column, the worst of them is named here)")
    for line in lines:
        print(line)


def print_paged_summary(rows):
    """The paged group: speedups over the torch loop, host times, the num_ctas sweep."""
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


def print_failures(rows):
    failed = [row for row in rows if row["status"] != VERIFIED]
    if not failed:
        return
    print()
    print(f"not verified: {len(failed)}")
    for row in failed[:MAX_FAILURES_SHOWN]:
        print(f"  {label(row)} nt={row['nt']} nb={row['nb']}: {row['status']}"[:120])
    if len(failed) > MAX_FAILURES_SHOWN:
        print(f"  ... and {len(failed) - MAX_FAILURES_SHOWN} more in the CSV")


def print_summary(rows, goals):
    """Compact tables of the run, then the targets and the cases that failed."""
    ceilings = [row for row in rows if row["mode"] == "ceiling" and row["nt"] == ""]
    if ceilings:
        print("ceilings: " + ", ".join(f"{row['direction']} {fmt(row['gbps'])} GB/s"
                                       for row in ceilings) + " (GB/s: bytes moved, counted once)")
    sized = [row for row in rows if row["nt"] != ""]
    print_pivot("% of ceiling (pin: same-size memcpy; d2d: device copy; ceil: 1 GiB memcpy; "
                "cpu: memcpy time / ours, the torch loop's memcpy on torch's threads; f: fed timing)",
                sized, label, nt_nb, ("nt", "nb"), pct_cell, 5)
    print_pivot("host ms per call (median over nt)", sized, label, nb_only, ("nb",), host_cell, 8)
    with_best = [row for row in rows if row["best_backend"]]
    print_pivot("fastest by GPU time (auto left out)", with_best,
                partial(label, with_variant=False), nt_nb, ("nt", "nb"), best_cell, 9)
    autos = [row for row in with_best if row["backend"] == "auto"]
    print_pivot("auto / fastest, GPU time (*: beyond 5%)", autos,
                partial(label, with_variant=False), nt_nb, ("nt", "nb"), auto_cell, 6)
    print_paged_summary(rows)
    print_targets(rows, goals)
    print_failures(rows)
    verified = sum(row["status"] == VERIFIED for row in rows)
    verdicts = [row["verdict"] for row in rows if row["verdict"]]
    print(f"\nrows: {verified} of {len(rows)} verified bit-exact; targets: {verdicts.count('PASS')} rows PASS, "
          f"{verdicts.count('MISS')} MISS")


# ----------------------------------------------------------------------------- CSV


def csv_cells(row):
    """A row as CSV text: floats with three decimals."""
    return {key: fmt(value, 3) if isinstance(value, float) else value for key, value in row.items()}


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(csv_cells(row) for row in rows)


INT_COLUMNS = {"nt", "nb", "pairs", "bytes", "reps", "sets", "uncovered_reps", "sms", "num_ctas"}


def cell_value(column, text):
    """A CSV cell as the run had it: ints, floats (nan too), else the text ("" stays "")."""
    if column in INT_COLUMNS and text.isdigit():
        return int(text)
    try:
        return float(text) if column not in INT_COLUMNS else text
    except ValueError:
        return text


# Rates that CSVs without a gbps_counts column counted read + written on some rows.
RATES_ONCE_WRITTEN_TWICE = ("gbps", "ceiling_gbps", "gbps_per_sm")


def counted_read_and_written(row):
    """Whether a row of a CSV without gbps_counts counted its bytes read + written: device
    to device rows, the device copy ceiling and the CPU rows did; PCIe rows counted once."""
    return (row.get("mode") == "cpu" or (row.get("mode") == "ceiling" and row.get("direction") == "d2d")
            or (row.get("mode") == "gpu" and row.get("placement") == "d2d"))


def counted_once(row):
    """A row of a CSV written before gbps_counts, with its rates as bytes moved once."""
    if counted_read_and_written(row):
        for column in RATES_ONCE_WRITTEN_TWICE:
            if isinstance(row.get(column), float):
                row[column] /= 2
    row["gbps_counts"] = GBPS_COUNTS
    return row


def read_csv(path):
    """The rows of a kvbench CSV, with the values a run has (an older run's CSV, with fewer
    columns and status "ok", reads too; its read + written rates are halved to bytes moved
    once, so that every run compares and plots alike)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"gbps", "status"} <= set(reader.fieldnames):
            raise ValueError(f"{path} is not a kvbench CSV: it has no gbps and status columns")
        rows = [{column: cell_value(column, text) for column, text in row.items()} for row in reader]
    if "gbps_counts" not in reader.fieldnames:
        rows = [counted_once(row) for row in rows]
    return rows


# ----------------------------------------------------------------------------- comparison

# The columns that name a row; a row of another run with the same values is the same case.
IDENTITY = ("mode", "api", "function", "direction", "placement", "layout", "backend", "granularity", "nt", "nb",
            "num_ctas")
VERIFIED_BEFORE = (VERIFIED, "ok")   # older kvbench CSVs say "ok"


def row_key(row):
    return tuple(str(row.get(column, "")) for column in IDENTITY)


def rate(row):
    """A row's GB/s as a positive float, or None (not verified, not timed)."""
    if row.get("status") not in VERIFIED_BEFORE:
        return None
    try:
        value = float(row["gbps"])
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None      # nan > 0 is False


@dataclass
class Change:
    row: dict           # the row of this run
    old: float          # GB/s in the older run
    new: float          # GB/s in this run

    @property
    def pct(self):
        return 100 * (self.new - self.old) / self.old


def compare(old_rows, new_rows):
    """(a Change per row timed in both runs, in this run's order; the number of this run's
    timed rows the older run lacks; the number of the older run's timed rows this one lacks)."""
    old = {row_key(row): rate(row) for row in old_rows}
    old = {key: value for key, value in old.items() if value is not None}
    changes, only_new = [], 0
    seen = set()
    for row in new_rows:
        new = rate(row)
        if new is None:
            continue
        key = row_key(row)
        seen.add(key)
        if key in old:
            changes.append(Change(row, old[key], new))
        else:
            only_new += 1
    return changes, only_new, len(set(old) - seen)


def regressions(changes, pct):
    """The changes that lose more than pct percent of the older run's GB/s."""
    return [change for change in changes if change.pct < -pct]


def print_comparison(old_path, changes, only_new, only_old, threshold):
    print()
    print(f"compared with {old_path}: GB/s of the {len(changes)} rows timed in both runs, "
          "change = new / old - 1")
    print(f"{'':{LABEL_WIDTH}}{'nt':>4}{'nb':>5}{'old GB/s':>11}{'new GB/s':>11}{'change':>9}")
    for change in changes:
        row = change.row
        flag = "  <- regression" if threshold is not None and change.pct < -threshold else ""
        print(f"{label(row):{LABEL_WIDTH}}{fmt(row['nt']):>4}{fmt(row['nb']):>5}{figure(change.old):>11}"
              f"{figure(change.new):>11}{change.pct:>+8.1f}%{flag}")
    if only_new or only_old:
        print(f"not compared: {only_new} timed row(s) only in this run, {only_old} only in {old_path}")
