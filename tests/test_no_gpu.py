"""Where a GPU is asked for and none can be used, `python -m kvbm_ext` and every benchmark
script say why in the same words, "PROGRAM: no GPU to run on: REASON" on stderr, exit with
status 2, and write nothing.  The situations are made with public names patched (the
build's is_using_stubs and cuda_devices, torch.cuda), so the same checks hold on a machine
with a GPU."""

import os
import runpy
import subprocess
import sys

import pytest
import torch

import kvbm_ext

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO_ROOT, "benchmarks")
EXIT_NO_GPU = 2
NO_DEVICE = "no CUDA device is visible"


def device(index):
    return {"index": index, "name": "stand-in", "capability": (9, 0), "total_memory": 1 << 30,
            "multiprocessors": 132}


# name: (is_using_stubs, cuda_devices, torch.version.cuda, torch.cuda.is_available, device_count)
SITUATIONS = {
    "stub build": (True, [], "13.0", False, 0),
    "no device": (False, [], "13.0", False, 0),
    "torch without CUDA": (False, [device(0)], None, False, 0),
    "torch sees no device": (False, [device(0)], "13.0", False, 0),
    "one device of two": (False, [device(0)], "13.0", True, 1),
}
# (situation, --device, the reason said)
REASONS = [
    ("stub build", "cuda", "this kvbm_ext was built without CUDA (kvbm_ext.is_using_stubs() is True)"),
    ("no device", "cuda", NO_DEVICE),
    ("torch without CUDA", "cuda", "torch cannot use CUDA here (this torch is a build without CUDA)"),
    ("torch sees no device", "cuda:0", NO_DEVICE),
    ("one device of two", "cuda:1", "only 1 CUDA device(s) visible, 2 needed"),
]


def patch_situation(monkeypatch, name):
    stubs, devices, torch_cuda, available, count = SITUATIONS[name]
    monkeypatch.setattr(kvbm_ext, "is_using_stubs", lambda: stubs)
    monkeypatch.setattr(kvbm_ext, "cuda_devices", lambda: list(devices))
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def run_module_main(monkeypatch, capsys, *args):
    """`python -m kvbm_ext ARGS` in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kvbm_ext", *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("kvbm_ext", run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("situation,choice,reason", REASONS, ids=[r[0] for r in REASONS])
def test_each_reason_in_the_one_message(monkeypatch, capsys, situation, choice, reason):
    patch_situation(monkeypatch, situation)
    status, out, err = run_module_main(monkeypatch, capsys, "--device", choice)
    assert status == EXIT_NO_GPU, (status, out, err)
    assert err == f"python -m kvbm_ext --device {choice}: no GPU to run on: {reason}\n", err
    assert out == "", out


def test_without_torch_the_reason_says_so(monkeypatch, capsys):
    patch_situation(monkeypatch, "one device of two")
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch fails
    status, _, err = run_module_main(monkeypatch, capsys, "--device", "cuda")
    assert status == EXIT_NO_GPU
    assert err == ("python -m kvbm_ext --device cuda: no GPU to run on: torch is not installed, and the GPU "
                   "work allocates its arrays with torch\n"), err


def test_auto_takes_the_cpu_and_says_why_when_devices_are_visible(monkeypatch, capsys):
    patch_situation(monkeypatch, "torch sees no device")
    status, out, err = run_module_main(monkeypatch, capsys, "--quick")
    assert status == 0, out + err
    assert f"  (no GPU to run on: {NO_DEVICE}: checking the CPU path only)\n" in out, out
    assert "benchmark on the CPU" in out, out


# Every script, as its user runs it, in the "no device" situation: (argv, program named).
SCRIPTS = [
    (["-m", "kvbm_ext", "--device", "cuda"], "python -m kvbm_ext --device cuda"),
    (["kvbench.py", "--device", "cuda"], "kvbench --api list --device cuda"),
    (["kvbench.py", "--api", "copy"], "kvbench --api copy --device auto"),
    (["beside.py", "--quick"], "beside"),
    (["trace.py", "--beside-gemm", "4"], "trace"),
    (["host_time.py", "--build", f"here={REPO_ROOT}"], "host_time"),
    (["reshard.py", "--device", "cuda"], "reshard --device cuda"),
    (["engines.py", "--nb", "1,8"], "engines"),
    (["host_pools.py", "--quick"], "host_pools"),
    (["engines.py", "--transformers", "--tf-layers", "2"], "engines --transformers"),
]

PREAMBLE = f"""
import runpy, sys
sys.path.insert(0, {REPO_ROOT!r})
import kvbm_ext, torch
kvbm_ext.is_using_stubs = lambda: False
kvbm_ext.cuda_devices = lambda: []
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: False
torch.cuda.device_count = lambda: 0
"""


def run_script(argv, cwd):
    """The script (or -m kvbm_ext) in a fresh interpreter, after PREAMBLE."""
    if argv[0] == "-m":
        start = f"sys.argv = {['kvbm_ext', *argv[2:]]!r}\nrunpy.run_module('kvbm_ext', run_name='__main__')"
    else:
        path = os.path.join(BENCH, argv[0])
        start = (f"sys.argv = {[path, *argv[1:]]!r}\nsys.path.insert(0, {BENCH!r})\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", PREAMBLE + start], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv,program", SCRIPTS, ids=[" ".join(argv[:2]) for argv, _ in SCRIPTS])
def test_every_script_says_it_alike_and_writes_nothing(argv, program, tmp_path):
    run = run_script(argv, tmp_path)
    assert run.returncode == EXIT_NO_GPU, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.splitlines()[-1] == f"{program}: no GPU to run on: {NO_DEVICE}", run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert os.listdir(tmp_path) == []


def test_a_gpu_hidden_from_the_process(tmp_path):
    """Unpatched, with CUDA_VISIBLE_DEVICES empty: whatever the machine, the message and the
    status (the reason depends on the build and on torch)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-m", "kvbm_ext", "--device", "cuda"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == EXIT_NO_GPU, run.stdout + run.stderr
    prefix = "python -m kvbm_ext --device cuda: no GPU to run on: "
    assert run.stderr.startswith(prefix) and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr[len(prefix):-1] in {reason for _, _, reason in REASONS}, run.stderr


def test_kvbench_cpu_with_a_gpu_only_group_is_a_bad_option(tmp_path):
    run = run_script(["kvbench.py", "--device", "cpu", "--api", "copy"], tmp_path)
    assert run.returncode == 2, run.stderr
    assert "error: --device cpu times the list and paged groups only (--api list or paged)" in run.stderr
    assert os.listdir(tmp_path) == []
