"""benchmarks/kvbench.py on the CPU at a tiny size: its files (CSV, PNGs, log) go where they
should, rows say "verified" and a separate PASS/MISS against their target, --compare
prints each row's change and --fail-on-regression sets the exit status; report.py's
comparison on its own."""

import csv
import os
import re
import subprocess
import sys

import pytest

from support import REPO_ROOT


BENCH = os.path.join(REPO_ROOT, "benchmarks")
KVBENCH = os.path.join(BENCH, "kvbench.py")
# nt=1: 327,680-byte blocks, so a run takes a few seconds.
TINY = ["--device", "cpu", "--cpu-nt", "1", "--cpu-nb", "1,2", "--quick"]


def kvbench(*args, cwd, preamble=""):
    """Runs kvbench.py as `python3 benchmarks/kvbench.py ARGS` would, after `preamble` (Python
    run first in the same interpreter)."""
    code = (f"{preamble}\nimport runpy, sys\nsys.argv = {[KVBENCH, *args]!r}\nsys.path.insert(0, {BENCH!r})\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def printed_path(stdout, kind):
    match = re.search(rf"^{kind}: (.*)$", stdout, re.MULTILINE)
    assert match, stdout
    return match.group(1)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def list_run(tmp_path_factory):
    """One tiny run of the list group's CPU cases into --out."""
    out = tmp_path_factory.mktemp("list-run")
    run = kvbench(*TINY, "--out", str(out), cwd=out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run, out


@pytest.mark.slow
def test_run_writes_its_files_into_out(list_run):
    run, out = list_run
    stem = os.path.join(out, f"kvbench-cpu-{read_rows(printed_path(run.stdout, 'CSV'))[0]['date']}")
    assert printed_path(run.stdout, "CSV") == stem + ".csv"
    assert printed_path(run.stdout, "log") == stem + ".log"
    with open(stem + ".log") as f:
        log = f.read()
    assert "rows: 4 of 4 verified bit-exact" in log and "CSV: " + stem + ".csv" in log, log[-2000:]


@pytest.mark.slow
def test_rows_are_verified_and_judged_against_their_target(list_run):
    run, _ = list_run
    rows = read_rows(printed_path(run.stdout, "CSV"))
    assert [(r["direction"], r["nb"]) for r in rows] == [("b2u", "1"), ("u2b", "1"), ("b2u", "2"), ("u2b", "2")]
    for row in rows:
        assert row["status"] == "verified", row
        assert row["target"] == "ratio_vs_memcpy <= 3x", row
        assert row["verdict"] == ("PASS" if float(row["ratio_vs_memcpy"]) <= 3 else "MISS"), row
    assert re.search(r"\[verified\]$", run.stdout.splitlines()[2]), run.stdout
    assert re.search(r"^  (PASS|MISS)  CPU list API, time over one memcpy of the same bytes: [\d.]+x "
                     r"\(ratio_vs_memcpy <= 3x; worst of 4: ", run.stdout, re.MULTILINE), run.stdout


@pytest.mark.slow
def test_png_of_the_run(list_run):
    pytest.importorskip("matplotlib", reason="kvbench draws its PNG with matplotlib")
    run, _ = list_run
    png = printed_path(run.stdout, "PNG")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    assert os.path.getsize(png) > 10_000


@pytest.mark.slow
def test_png_from_a_csv(list_run, tmp_path):
    """figures.py draws the PNGs of an earlier run from its CSV (for a run made without
    matplotlib): the same picture the run drew."""
    pytest.importorskip("matplotlib", reason="kvbench draws its PNG with matplotlib")
    run, _ = list_run
    csv_copy = tmp_path / "run.csv"
    csv_copy.write_bytes(open(printed_path(run.stdout, "CSV"), "rb").read())
    replot = subprocess.run([sys.executable, os.path.join(BENCH, "figures.py"), str(csv_copy)],
                            capture_output=True, text=True, timeout=300)
    assert replot.returncode == 0 and replot.stdout == f"PNG: {tmp_path / 'run-cpu.png'}\n", \
        replot.stdout + replot.stderr
    with open(tmp_path / "run-cpu.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    original = os.path.getsize(printed_path(run.stdout, "PNG"))
    assert abs(os.path.getsize(tmp_path / "run-cpu.png") - original) < original // 5


@pytest.mark.slow
def test_without_matplotlib_the_run_says_so(tmp_path):
    run = kvbench(*TINY, "--cpu-nb", "1", "--out", str(tmp_path), cwd=tmp_path,
                  preamble="import sys; sys.modules['matplotlib'] = None  # import matplotlib fails")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PNG: no PNG: matplotlib is not installed (pip install matplotlib)" in run.stdout, run.stdout
    assert not list(tmp_path.glob("*.png")) and len(list(tmp_path.glob("*.csv"))) == 1


@pytest.mark.slow
def test_default_output_outside_the_source_tree(tmp_path):
    """Run from elsewhere: ./kvbench-results there.  Run from the checkout: a temporary
    directory, never the source tree."""
    run = kvbench(*TINY, "--cpu-nb", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert os.path.dirname(printed_path(run.stdout, "CSV")) == str(tmp_path / "kvbench-results")

    before = sorted(os.listdir(BENCH))
    run = kvbench(*TINY, "--cpu-nb", "1", cwd=BENCH)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    folder = os.path.dirname(printed_path(run.stdout, "CSV"))
    assert os.path.commonpath([os.path.realpath(folder), os.path.realpath(REPO_ROOT)]) != os.path.realpath(REPO_ROOT)
    assert sorted(os.listdir(BENCH)) == before
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)


def doctored(rows, path, factors):
    """The rows as an older run's CSV whose GB/s were factors[direction] times this run's."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(dict(row, gbps=f"{float(row['gbps']) * factors[row['direction']]:.3f}"))


@pytest.mark.slow
@pytest.mark.parametrize("threshold,status,regressed", [("10", 3, 1), ("95", 0, 0)])
def test_compare_and_fail_on_regression(list_run, tmp_path, threshold, status, regressed):
    """Against an older run 4x as fast in b2u and 4x as slow in u2b: b2u lost about 75 %
    (whatever the noise between two runs), a regression beyond 10 % but not beyond 95 %."""
    run, _ = list_run
    old = tmp_path / "old.csv"
    doctored(read_rows(printed_path(run.stdout, "CSV")), old, {"b2u": 4.0, "u2b": 0.25})
    again = kvbench(*TINY, "--cpu-nb", "1", "--out", str(tmp_path), "--compare", str(old),
                    "--fail-on-regression", threshold, cwd=tmp_path)
    assert again.returncode == status, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"compared with {old}: GB/s of the 2 rows timed in both runs" in again.stdout, again.stdout
    changes = re.findall(r"^cpu (b2u|u2b) host NHD\s+1\s+1\s+[\d.]+\s+[\d.]+\s+([+-][\d.]+)%( +<- regression)?$",
                         again.stdout, re.MULTILINE)
    assert [(direction, bool(flag)) for direction, _, flag in changes] == [("b2u", regressed == 1), ("u2b", False)]
    assert float(changes[0][1]) < -10 and float(changes[1][1]) > 10, changes
    assert f"regressions beyond {threshold} %: {regressed} of 2 rows" in again.stdout, again.stdout
    assert "not compared: 0 timed row(s) only in this run, 2 only in" in again.stdout, again.stdout


@pytest.mark.parametrize("args,message", [
    (["--fail-on-regression", "5"], "--fail-on-regression needs --compare OLD.csv"),
    (["--compare", "no-such.csv"], "--compare no-such.csv: [Errno 2] No such file or directory"),
])
def test_comparison_options_checked_before_the_run(tmp_path, args, message):
    run = kvbench(*TINY, *args, cwd=tmp_path)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "CPU section" not in run.stdout


# --------------------------------------------------------------------------
# report.py's comparison, in process.
# --------------------------------------------------------------------------

@pytest.fixture
def report():
    sys.path.insert(0, BENCH)
    try:
        import report as module
    finally:
        sys.path.remove(BENCH)
    return module


def row(report, **fields):
    base = {column: "" for column in report.COLUMNS}
    base.update(mode="gpu", api="paged", function="PagedKVCache.to_universal", direction="b2u",
                placement="d2d", layout="NHD", backend="device_ids", nt=16, nb=64, num_ctas="None",
                status=report.VERIFIED)
    base.update(fields)
    return base


def test_compare_matches_rows_by_what_names_them(report):
    new = [row(report, gbps=3900.0), row(report, nb=256, gbps=4000.0), row(report, backend="host_ids", gbps=10.0),
           row(report, direction="u2b", gbps=float("nan")), row(report, nb=1, gbps=500.0, status="MISMATCH")]
    # An older CSV: text cells, status "ok", one row this run lacks.
    old = [{**{k: str(v) for k, v in row(report).items()}, "gbps": "4000.0", "status": "ok"},
           {**{k: str(v) for k, v in row(report, nb=256).items()}, "gbps": "3200.0", "status": "ok"},
           {**{k: str(v) for k, v in row(report, nb=8).items()}, "gbps": "3000.0", "status": "ok"},
           {**{k: str(v) for k, v in row(report, nb=1).items()}, "gbps": "450.0", "status": "ok"}]
    changes, only_new, only_old = report.compare(old, new)
    assert [(c.row["nb"], round(c.pct, 1)) for c in changes] == [(64, -2.5), (256, 25.0)]
    assert (only_new, only_old) == (1, 2)     # host_ids is new; nb=8 and the failed nb=1 are the old run's only
    assert [c.row["nb"] for c in report.regressions(changes, 2)] == [64]
    assert report.regressions(changes, 2.5) == []


def test_read_csv_refuses_what_is_not_a_kvbench_csv(report, tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a kvbench CSV"):
        report.read_csv(str(path))


def test_committed_results_still_compare(report):
    """The CSVs under benchmarks/results/ (status "ok") read and match themselves."""
    results = os.path.join(BENCH, "results")
    paths = [os.path.join(results, name) for name in sorted(os.listdir(results))
             if name.startswith("kvbench-") and name.endswith(".csv")] if os.path.isdir(results) else []
    if not paths:
        pytest.skip("no committed kvbench results here")
    rows = report.read_csv(paths[0])
    changes, only_new, only_old = report.compare(rows, rows)
    assert changes and only_new == only_old == 0 and all(c.pct == 0 for c in changes)


# --------------------------------------------------------------------------
# The other scripts' options.
# --------------------------------------------------------------------------

def test_host_time_build_needs_a_label():
    run = subprocess.run([sys.executable, os.path.join(BENCH, "host_time.py"), "--build", "nolabel"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--build: expected LABEL=ROOT" in run.stderr, run.stderr


def test_kvbench_help():
    run = subprocess.run([sys.executable, KVBENCH, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    for option in ("--out", "--compare", "--fail-on-regression", "--device"):
        assert option in run.stdout, run.stdout


def test_kvbench_help_imports_neither_torch_nor_kvbm_ext():
    """--help answers before the seconds-long imports: the options are parsed first."""
    code = (f"import runpy, sys\nsys.argv = {[KVBENCH, '--help']!r}\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'kvbm_ext', 'numpy') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--fail-on-regression" in run.stdout, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "heavy: []", run.stdout[-500:]


def pivot_rows(values):
    """CPU rows of the printed tables: one label, a host time (us) per nb."""
    return [{"mode": "cpu", "api": "list", "direction": "u2b", "placement": "host", "layout": "NHD",
             "granularity": "", "backend": "", "function": "universal_to_block", "num_ctas": "",
             "nt": 16, "nb": nb, "status": "verified", "host_us": us} for nb, us in values]


def test_table_columns_never_run_together(report, capsys):
    """A cell as wide as its column (1.25 s of host time, a long label, a 0.549x speedup)
    still has a space before it, and numbers have no exponent."""
    rows = pivot_rows([(1, 17_200.0), (8, 1_250_000.0), (64, 123_456_789.0)])
    report.print_pivot("host ms", rows, report.label, report.nb_only, ("nb",), report.host_cell, 8)
    long_label = {**rows[0], "layout": "NHD" + "x" * 40, "speedup_vs_torch": 0.549}
    short_label = {**rows[1], "speedup_vs_torch": 12.5}
    report.print_pivot("speedup", [long_label, short_label], report.label, report.nt_nb, ("nt", "nb"),
                       report.speedup_cell, 6)
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("host ms") + 1:lines.index("speedup") - 1]
    assert table[-1].split() == ["cpu", "u2b", "host", "NHD", "17.2", "1250", "123457"], table
    assert all("e+" not in line for line in lines), lines
    speedups = lines[lines.index("speedup") + 1:]
    assert speedups[-2].split() == ["cpu", "u2b", "host", "NHD" + "x" * 40, "0.549x"], speedups
    assert speedups[-1].split() == ["cpu", "u2b", "host", "NHD", "12.5x"], speedups
    for table_lines in (table, speedups):   # every cell ends where its heading ends
        assert len({len(line) for line in table_lines}) == 1, table_lines


# --------------------------------------------------------------------------
# engines.py: its references, written from each engine's own shape.
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines():
    sys.path.insert(0, BENCH)
    try:
        import engines as module
    finally:
        sys.path.pop(0)
    return module


def engine_element(name, tensors, layers, dims, block, layer, outer, head, token):
    """One [hd] row of a block, indexed as the engine documents its cache."""
    hd = dims.hd
    if name == "vllm_packed":        # [num_blocks, nt, nh, 2*hd]: K then V in the last dim
        return layers[layer][block, token, head, outer * hd:(outer + 1) * hd]
    if name == "vllm_flash":         # [2, num_blocks, nt, nh, hd]
        return layers[layer][outer, block, token, head]
    if name == "flashinfer_hnd":     # stored [num_blocks, 2, nh, nt, hd] (HND stride order)
        return tensors[layer][block, outer, head, token]
    if name == "mla":                # [num_blocks, nt, hd]
        return layers[layer][block, token]
    return layers[layer][outer][block * dims.nt + token, head]     # K / V pairs [rows, nh, hd]


@pytest.mark.parametrize("name", ["vllm_packed", "vllm_flash", "flashinfer_hnd", "sglang_pairs",
                                  "transformers_pairs", "mla"])
def test_engines_reference_gathers_each_engine_as_documented(engines, name, gen):
    import torch
    dims = engines.Dims(3, 1, 1, 5, 8) if name == "mla" else engines.Dims(3, 2, 4, 5, 6)
    tensors, layers, layout, _, chunks, usable = engines.allocate(name, dims, 7, torch.device("cpu"))
    for tensor in tensors:
        tensor.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tensor.shape, dtype=torch.int16, generator=gen))
    engine = engines.Engine(name, layout, dims, None, chunks, list(usable))
    ids = [5, 2, 3]
    universal = engines.gathered(engine, torch.tensor(ids))
    assert universal.shape == (3, dims.nh, dims.nl, dims.no, dims.nt, dims.hd)
    for i, block in enumerate(ids):
        for layer in range(dims.nl):
            for outer in range(dims.no):
                for head in range(dims.nh):
                    for token in range(dims.nt):
                        want = engine_element(name, tensors, layers, dims, block, layer, outer, head, token)
                        got = universal[i, head, layer, outer, token]
                        assert torch.equal(got.view(torch.int16), want.view(torch.int16))   # NaN bits too
    engines.poison_engine_blocks(engine, torch.tensor(ids))
    assert bool((engines.gathered(engine, torch.tensor(ids)).view(torch.int16) == engines.POISON_INT16).all())
    assert not bool((engines.gathered(engine, torch.tensor([0, 4])).view(torch.int16) == engines.POISON_INT16).any())


def test_engines_usable_blocks_leave_out_the_spares(engines):
    import torch
    dims = engines.Dims(1, 2, 1, 2, 2)
    usable = {name: list(engines.allocate(name, dims, 6, torch.device("cpu"))[5]) for name in engines.ENGINES}
    assert usable["sglang_pairs"] == [1, 2, 3, 4, 5]               # page 0: SGLang's padding page
    assert usable["transformers_pairs"] == [0, 1, 2, 3]            # the last two: read and write trash
    assert usable["vllm_flash"] == list(range(6))


def test_engines_refuses_unknown_names():
    run = subprocess.run([sys.executable, os.path.join(BENCH, "engines.py"), "--engines", "vllm_flash,trt"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--engines: unknown engine 'trt'" in run.stderr, run.stderr
