"""The seeded fuzzer (tools/fuzz.py) over every entry point, on the CPU: a few
thousand cases here, each reported with its seed if it crashes the process or ends
in anything but a clean ValueError/TypeError/RuntimeError with nothing written.
`python3 tools/fuzz.py --cases 100000` is the long run."""

import os
import subprocess
import sys

import pytest

from support import REPO_ROOT

pytestmark = pytest.mark.slow
FUZZ = os.path.join(REPO_ROOT, "tools", "fuzz.py")


@pytest.mark.parametrize("first", [0, 1_000_000])
def test_fuzz_every_entry_point(first):
    result = subprocess.run([sys.executable, FUZZ, "--cases", "3000", "--first", str(first), "--jobs", "2"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "3000 cases" in result.stdout and "0 crashes, 0 failures" in result.stdout, result.stdout[-2000:]


def test_fuzz_finds_a_hostile_getter_crash_in_a_broken_build(tmp_path):
    """The fuzzer reports a crashing case with its seed: run it against a stand-in
    module whose block_to_universal segfaults, through a sitecustomize-free shim."""
    shim = tmp_path / "kvbm_ext"
    shim.mkdir()
    (shim / "__init__.py").write_text(
        "import ctypes, sys\n"
        "from importlib.machinery import PathFinder\n"
        "spec = PathFinder.find_spec('kvbm_ext', [sys.argv[0].rsplit('/tools/', 1)[0]])\n"
        "import importlib.util\n"
        "real = importlib.util.module_from_spec(spec); spec.loader.exec_module(real)\n"
        "globals().update({k: getattr(real, k) for k in real.__all__})\n"
        "def block_to_universal(*args, **kwargs):\n"
        "    ctypes.string_at(0)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, FUZZ, "--cases", "40", "--jobs", "1"], cwd=str(tmp_path), env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "CRASH" in result.stdout and "--replay" in result.stdout, result.stdout[-2000:]
