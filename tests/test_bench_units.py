"""One meaning of GB/s in the benchmarks (bytes moved, counted once) and the figures drawn
from their CSVs: a run's rows count bytes once, an older CSV's read + written rates are
halved on reading, and the figures of the committed runs are one question each, measured
values only (no line joins two measured points), with a few plainly named bars."""

import csv
import math
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO_ROOT, "benchmarks")
RESULTS = os.path.join(BENCH, "results")
ALL_GROUPS_RUN = os.path.join(RESULTS, "kvbench-NVIDIA-H200-2026-11-23.csv")
PAGED_RUN = os.path.join(RESULTS, "kvbench-paged-nt16-final-NVIDIA-H200-2026-11-23.csv")
MAX_LEGEND_ENTRIES = 6


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        import figures
        import report
    finally:
        sys.path.remove(BENCH)
    return report, figures


def write_rows(path, rows, columns):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def old_row(mode, placement, direction, gbps, ceiling="", per_sm=""):
    return {"mode": mode, "api": "paged" if mode == "gpu" else "", "placement": placement,
            "direction": direction, "nt": "16", "nb": "64", "gbps": gbps, "ceiling_gbps": ceiling,
            "gbps_per_sm": per_sm, "pct_of_ceiling": "50.0", "status": "ok"}


OLD_COLUMNS = list(old_row("gpu", "d2d", "b2u", "1"))


def test_old_csv_rates_read_as_bytes_moved_once(bench_modules, tmp_path):
    """A CSV without gbps_counts: device-to-device rows, the device copy ceiling and CPU rows
    counted read + written and are halved (gbps, ceiling_gbps, gbps_per_sm); PCIe rows
    counted once and stay; percentages stay."""
    report, _ = bench_modules
    path = tmp_path / "old.csv"
    write_rows(path, [old_row("gpu", "d2d", "b2u", "4000.0", "8000.0", "30.0"),
                      old_row("ceiling", "device", "d2d", "8000.0"),
                      old_row("cpu", "host", "b2u", "24.0", "48.0"),
                      old_row("gpu", "pinned", "b2u", "54.5", "55.0"),
                      old_row("ceiling", "pinned", "h2d", "55.0")], OLD_COLUMNS)
    rows = report.read_csv(str(path))
    assert [(r["gbps"], r["ceiling_gbps"], r["gbps_per_sm"]) for r in rows] == [
        (2000.0, 4000.0, 15.0), (4000.0, "", ""), (12.0, 24.0, ""), (54.5, 55.0, ""), (55.0, "", "")]
    assert all(r["pct_of_ceiling"] == 50.0 and r["gbps_counts"] == "once" for r in rows)


def test_new_csv_rates_are_read_as_written(bench_modules, tmp_path):
    report, _ = bench_modules
    path = tmp_path / "new.csv"
    row = dict(old_row("gpu", "d2d", "b2u", "2000.0", "4000.0", "15.0"), gbps_counts="once")
    write_rows(path, [row], list(row))
    (read,) = report.read_csv(str(path))
    assert (read["gbps"], read["ceiling_gbps"], read["gbps_per_sm"]) == (2000.0, 4000.0, 15.0)


def test_an_old_run_compares_with_a_new_one_of_the_same_speed(bench_modules, tmp_path):
    """The same case at the same speed, once written read + written and once bytes once:
    no change (before the halving it read as -50 %)."""
    report, _ = bench_modules
    old, new = tmp_path / "old.csv", tmp_path / "new.csv"
    identity = {column: "" for column in report.IDENTITY}
    base = dict(identity, mode="gpu", api="paged", placement="d2d", direction="b2u", nt="16", nb="64",
                status="verified")
    write_rows(old, [dict(base, gbps="4000.0")], list(base) + ["gbps"])
    write_rows(new, [dict(base, gbps="2000.0", gbps_counts="once")], list(base) + ["gbps", "gbps_counts"])
    changes, only_new, only_old = report.compare(report.read_csv(str(old)), report.read_csv(str(new)))
    assert [round(change.pct, 6) for change in changes] == [0.0] and only_new == only_old == 0


def test_a_cpu_run_counts_bytes_once(tmp_path):
    """kvbench on the CPU: GB/s = bytes / time, the memcpy ceiling too, and the percentage of
    the ceiling is their ratio."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, os.path.join(BENCH, "kvbench.py"), "--device", "cpu", "--cpu-nt", "1",
                          "--cpu-nb", "1", "--quick", "--out", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    with open(tmp_path / path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        once = float(row["bytes"]) / (float(row["host_us"]) * 1e3)
        assert row["gbps_counts"] == "once" and math.isclose(float(row["gbps"]), once, rel_tol=1e-3), row
        memcpy_us = float(row["host_us"]) * float(row["pct_of_ceiling"]) / 100
        assert math.isclose(float(row["ceiling_gbps"]), float(row["bytes"]) / (memcpy_us * 1e3), rel_tol=1e-3), row


def test_every_panel_has_a_few_named_bars_and_a_reference(bench_modules):
    _, figures = bench_modules
    references = {"device": 1, "cpu": 1}
    for figure in figures.FIGURES:
        assert figure.question.endswith("?"), figure.question
        for panel in figure.panels:
            labels = [series.label for series in panel.series if series.label]
            assert panel.limit in ("device", "pcie", "cpu"), (figure.name, panel.title)
            entries = len(labels) + references.get(panel.limit, 1 + len(panel.ways))
            assert 0 < entries <= MAX_LEGEND_ENTRIES, (figure.name, labels)
            assert all(" " in label for label in labels), labels     # words, not codes like "op b2o pin"


def figure_faults(figure):
    """What keeps a drawn figure from answering one question with measured values only: a
    line from one measured point to another (only horizontal reference lines may cross a
    panel), a title that asks nothing, a panel without a y label or with a long legend."""
    faults = []
    if not figure._suptitle or not figure._suptitle.get_text().splitlines()[0].endswith("?"):
        faults.append("the title asks no question")
    for ax in figure.axes:
        for line in ax.get_lines():
            if line.get_linestyle() not in ("None", "", " ") and len(set(line.get_ydata())) > 1:
                faults.append(f"{ax.get_title()!r}: a line joins measured points {list(line.get_xydata())}")
        if not ax.get_ylabel():
            faults.append(f"{ax.get_title()!r}: no y label")
        entries = len(ax.get_legend().get_texts()) if ax.get_legend() else 0
        if entries > MAX_LEGEND_ENTRIES:
            faults.append(f"{ax.get_title()!r}: {entries} legend entries")
    return faults


def test_a_line_between_measured_points_is_a_fault():
    """The check below sees a line drawn from nb 1 to nb 64, as if the values between had
    been measured; a reference line across the panel passes."""
    plt = pytest.importorskip("matplotlib.pyplot", reason="the figures are drawn with matplotlib")
    figure, ax = plt.subplots()
    figure.suptitle("How fast?")
    ax.set_ylabel("GB/s")
    ax.axhline(2139)
    assert figure_faults(figure) == []
    ax.plot([1, 64], [671, 1987], marker="o")
    assert [fault for fault in figure_faults(figure) if "a line joins measured points" in fault]
    plt.close(figure)


FIGURE_RUNS = [
    "kvbench-NVIDIA-H200-2026-11-23.csv", "engines-NVIDIA-H200-2026-11-25.csv",
    "engines-transformers-NVIDIA-H200-2026-11-25.csv", "reshard-2xNVIDIA-H200-2026-11-27.csv",
    "vllm_offload-NVIDIA-H200-2026-11-27.csv", "disk-NVIDIA-H200-2026-11-27.csv", "disk-cpu-2026-11-27.csv"]


@pytest.mark.parametrize("name", FIGURE_RUNS)
def test_each_benchmarks_figures_show_measured_values_only(bench_modules, name, monkeypatch, tmp_path):
    """Every figure of a committed run of each benchmark, as figures.py draws it from the
    CSV: a question for a title, no line joining measured points, short legends."""
    plt = pytest.importorskip("matplotlib.pyplot", reason="the figures are drawn with matplotlib")
    _, figures = bench_modules
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not in this tree")
    drawn = []
    monkeypatch.setattr(figures, "save", lambda figure, png: drawn.append((figure, png)))
    paths, why_not = figures.draw_file(path, str(tmp_path))
    assert why_not is None and paths == [png for _, png in drawn] and paths, (why_not, paths)
    for figure, png in drawn:
        assert figure_faults(figure) == [], png
        plt.close(figure)


def test_every_committed_png_is_a_figure_of_a_committed_csv(bench_modules):
    """Each PNG of benchmarks/results/ (and the README's, in docs/images/) is one that
    figures.py draws from a CSV beside it: <run>-<figure>.png, or <run>.png for a benchmark
    of one figure; no picture of an older drawing is left."""
    _, figures = bench_modules
    if not os.path.isdir(RESULTS):
        pytest.skip("benchmarks/results/ is not in this tree (the sdist leaves it out)")
    images = [name for folder in (RESULTS, os.path.join(REPO_ROOT, "docs", "images")) if os.path.isdir(folder)
              for name in os.listdir(folder) if name.endswith(".png")]
    for name in images:
        stem = name[:-len(".png")]
        runs = [csv_name[:-len(".csv")] for csv_name in os.listdir(RESULTS) if csv_name.endswith(".csv")
                and (stem == csv_name[:-len(".csv")] or stem.startswith(csv_name[:-len(".csv")] + "-"))]
        assert runs, f"{name}: no CSV of results/ it is drawn from"
        run = max(runs, key=len)
        benchmark = figures.benchmark_of(os.path.join(RESULTS, run + ".csv"))
        figure_name = stem[len(run) + 1:]
        assert figure_name in [name for name, _ in benchmark.figures], (name, benchmark.name)


@pytest.mark.parametrize("run,names", [
    (ALL_GROUPS_RUN, ["paged", "torch", "list", "operational", "universal-operational", "copies", "cpu"]),
    (PAGED_RUN, ["paged", "torch", "cpu"]),
], ids=["all-groups", "paged"])
def test_figures_of_the_committed_runs(run, names, tmp_path):
    pytest.importorskip("matplotlib", reason="the figures are drawn with matplotlib")
    if not os.path.exists(run):
        pytest.skip(f"{run} is not in this tree")
    drawn = subprocess.run([sys.executable, os.path.join(BENCH, "figures.py"), run, "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    stem = os.path.splitext(os.path.basename(run))[0]
    expected = [str(tmp_path / f"{stem}-{name}.png") for name in names]
    assert drawn.stdout.splitlines() == [f"PNG: {path}" for path in expected], drawn.stdout
    for path in expected:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path



README_TABLE = re.compile(r"^<!-- table: generated by python3 benchmarks/figures.py (\S+\.csv) --table .*-->$", re.M)


def test_the_readme_table_is_what_figures_prints_from_its_csv():
    """The README's performance figures are a table that `figures.py RUN.csv --table` prints
    from the committed run its marker names, verbatim (regenerate it with that command);
    docs/performance.md's table of the same run has the same rows."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = f.read()
    (source,) = README_TABLE.findall(readme)
    if not os.path.exists(os.path.join(REPO_ROOT, source)):
        pytest.skip(f"{source} is not in this tree (the sdist leaves benchmarks/results/ out)")
    printed = subprocess.run([sys.executable, os.path.join(BENCH, "figures.py"), source, "--table"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stdout + printed.stderr
    table = printed.stdout.splitlines()
    assert f"`{source}`" in table[0], table[0]
    after = readme[README_TABLE.search(readme).end():].lstrip("\n").splitlines()
    assert after[:len(table)] == table, "README.md's table differs from what figures.py prints: regenerate it"
    rows = [line for line in table if line.startswith("|")]
    with open(os.path.join(REPO_ROOT, "docs", "performance.md")) as f:
        assert "\n".join(rows) in f.read(), "docs/performance.md's table of the run differs from README.md's"


def test_the_table_names_a_case_the_run_lacks(bench_modules):
    """A run without the table's rows (here: no pinned rows at nb = 64) is refused, naming the case."""
    report, figures = bench_modules
    if not os.path.exists(PAGED_RUN):
        pytest.skip(f"{PAGED_RUN} is not in this tree")
    rows = [dict({column: "" for column in report.COLUMNS}, **row) for row in report.read_csv(PAGED_RUN)
            if not (row["placement"] == "pinned" and row["nb"] == 64)]
    with pytest.raises(ValueError, match=r"PagedKVCache.to_universal, pinned, device ids, nt=16, nb=64"):
        figures.paged_table(rows, PAGED_RUN)
