"""One meaning of GB/s in the benchmarks (bytes moved, counted once) and the figures drawn
from kvbench CSVs: a run's rows count bytes once, an older CSV's read + written rates are
halved on reading, and the figures of the committed runs are one question each with few,
plainly named lines."""

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
MAX_LEGEND_ENTRIES = 8


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


def test_every_panel_has_a_few_named_lines_and_a_limit(bench_modules):
    _, figures = bench_modules
    for figure in figures.FIGURES:
        for panel in figure.panels:
            labels = [line.label for line in panel.lines if line.label]
            assert 0 < len(labels) + 2 <= MAX_LEGEND_ENTRIES, (figure.name, labels)
            assert panel.limit in ("device", "pcie", "cpu"), (figure.name, panel.title)
            assert all(" " in label for label in labels), labels     # words, not codes like "op b2o pin"


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
