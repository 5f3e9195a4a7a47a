"""python -m kvbm_ext: --help and --version answer without running anything, --device and
the length options are honoured, results say what they compare with, and a device that
cannot be had is a clear error (exit status 2)."""

import os
import re
import subprocess
import sys

import pytest

import kvbm_ext
from support import REPO_ROOT


def cli(*args, timeout=300):
    """python -m kvbm_ext with these arguments, from the checkout (its in-place build)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "kvbm_ext", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_options_and_runs_nothing():
    run = cli("--help")
    assert run.returncode == 0, run.stderr
    for option in ("--version", "--device", "--nb", "--repeats", "--quick"):
        assert option in run.stdout, f"--help does not mention {option}:\n{run.stdout}"
    assert "self-check" not in run.stdout and "benchmark on" not in run.stdout, run.stdout


def test_version_prints_the_build_and_runs_nothing():
    run = cli("--version")
    assert run.returncode == 0, run.stderr
    info = kvbm_ext.build_info()
    assert run.stdout.startswith(f"kvbm_ext {kvbm_ext.__version__}: CUDA "), run.stdout
    assert (info["cuda_version"] or "not compiled in") in run.stdout, run.stdout
    assert "self-check" not in run.stdout and len(run.stdout.splitlines()) == 1, run.stdout


def test_cpu_quick_run_checks_and_states_its_results_plainly():
    run = cli("--device", "cpu", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "self-check cpu: ok (bit-exact)" in run.stdout, run.stdout
    assert "benchmark on the CPU" in run.stdout and "best of 2" in run.stdout, run.stdout
    timed = re.findall(r"cpu  (block_to_universal|universal_to_block) nb=1: [\d.]+ ms, [\d.]+ GB/s moved; "
                       r"([\d.]+)x the time of one memcpy of the same bytes", run.stdout)
    assert [name for name, _ in timed] == ["block_to_universal", "universal_to_block"], run.stdout
    assert re.search(r"one memcpy of the same 5\.2 MB \(numpy\.copyto\): [\d.]+ ms", run.stdout), run.stdout


def test_nb_and_repeats_set_the_length():
    run = cli("--device", "cpu", "--nb", "2", "--repeats", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "best of 1" in run.stdout and "block_to_universal nb=2:" in run.stdout, run.stdout
    assert "one memcpy of the same 10.5 MB" in run.stdout, run.stdout


@pytest.mark.parametrize("args,message", [
    (["--nb", "0"], "argument --nb: expected a positive integer, got '0'"),
    (["--repeats", "x"], "argument --repeats: expected a positive integer, got 'x'"),
    (["--device", "gpu"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_options(args, message):
    run = cli(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_unavailable_device_is_a_clear_error():
    index = len(kvbm_ext.cuda_devices())     # one past the last device, or cuda:0 without any
    run = cli("--device", f"cuda:{index}")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--device cuda:{index}:" in run.stderr and "self-check" not in run.stdout, run.stderr
    assert re.search(r"built without CUDA|no CUDA device is visible|only \d+ CUDA device|torch cannot use CUDA",
                     run.stderr), run.stderr


def test_auto_without_a_usable_gpu_runs_on_the_cpu():
    if kvbm_ext.cuda_devices() and not kvbm_ext.is_using_stubs():
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("a GPU is usable here: auto picks it")
    run = cli("--quick")
    assert run.returncode == 0 and "benchmark on the CPU" in run.stdout, run.stdout + run.stderr


@pytest.mark.gpu
def test_gpu_quick_run():
    if kvbm_ext.is_using_stubs():
        pytest.skip("this build has no CUDA")
    run = cli("--device", "cuda:0", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "self-check cuda:0: ok (bit-exact)" in run.stdout, run.stdout
    assert re.search(r"cuda:0  block_to_universal nb=1: [\d.]+ us GPU time, [\d,]+ GB/s moved = "
                     r"\d+ % of the device copy's rate", run.stdout), run.stdout
