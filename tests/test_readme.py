"""README.md as written: its install and test commands are the two the CI runs verbatim
in a fresh venv (tools/readme.py fresh-venv, from .ci/run), and its examples run: the
CPU one here, the GPU one where torch sees a GPU."""

import os
import subprocess
import sys

import pytest

from support import REPO_ROOT
from support.devices import cuda_case

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import readme  # noqa: E402

sys.path.pop(0)
TEXT = readme.read(os.path.join(REPO_ROOT, "README.md"))


def test_two_commands_install_and_run_then_install_and_test():
    install_and_run, install_and_test = readme.commands(TEXT)
    assert install_and_run.startswith("pip install -e . && python -m kvbm_ext "), install_and_run
    assert install_and_test.startswith('pip install -e ".[test]" && python -m pytest tests '), install_and_test


def test_examples_are_there_and_check_their_results():
    found = readme.examples(TEXT)
    assert set(found) == {"cpu", "gpu"}, sorted(found)
    for name, code in found.items():
        assert "import kvbm_ext" in code and code.count("assert ") >= 2, f"example {name} checks nothing:\n{code}"


def run_example(name, tmp_path):
    """The example's code as a script outside the checkout, importing the checkout's build."""
    script = tmp_path / f"example_{name}.py"
    script.write_text(readme.examples(TEXT)[name])
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", ["cpu", cuda_case("gpu")])
def test_example_runs(name, tmp_path):
    import kvbm_ext
    if name == "gpu" and kvbm_ext.is_using_stubs():
        pytest.skip("this build has no CUDA")
    run = run_example(name, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_failing_example_is_noticed(tmp_path, monkeypatch):
    """The runner reports an example whose check fails (so test_example_runs can fail)."""
    monkeypatch.setitem(readme.__dict__, "examples",
                        lambda text: {"broken": "import kvbm_ext\nassert kvbm_ext.__version__ == 'no'\n"})
    run = run_example("broken", tmp_path)
    assert run.returncode != 0 and "AssertionError" in run.stderr
