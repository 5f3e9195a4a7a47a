"""A pytest plugin for running the suite on an interpreter without torch (free-threaded
CPython, which torch has no wheel for): tools/free_threaded.sh runs

    python -m pytest -p without_torch --noconftest tests      # PYTHONPATH=tools

tests/conftest.py imports torch, so it is not loaded (--noconftest); a stand-in module
`conftest` gives the test files what they import from it that needs no torch
(REPO_ROOT, the CUDA markers, which skip: no torch, no GPU test).  A test file that
cannot be imported for want of torch (it imports torch, or a helper of the suite that
does, or a name of conftest the stand-in lacks) is reported as skipped with that
reason; every other failure stays a failure.  On a free-threaded build, the session
stops at once if importing kvbm_ext turned the GIL on.
"""

import os
import sys
import sysconfig
import types

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TORCH = "needs torch, which this interpreter does not have"


def _missing(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise pytest.skip.Exception(f"{NO_TORCH} (conftest.{name} comes from tests/conftest.py, which imports torch)",
                                allow_module_level=True)


def _stand_in():
    module = types.ModuleType("conftest", "The parts of tests/conftest.py that need no torch.")
    module.REPO_ROOT = REPO_ROOT
    module.requires_cuda = pytest.mark.skip(reason=f"{NO_TORCH} (and a CUDA GPU)")
    module.requires_two_gpus = pytest.mark.skip(reason=f"{NO_TORCH} (and 2 CUDA GPUs)")
    module.__getattr__ = _missing
    return module


@pytest.fixture
def gen():
    pytest.skip(f"{NO_TORCH} (the gen fixture is a torch.Generator)")


def pytest_collection_modifyitems(items):
    """tests/conftest.py skips a test marked gpu where no GPU is visible; here none is."""
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=f"{NO_TORCH} (and a CUDA GPU)"))


def pytest_configure(config):
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    sys.modules.setdefault("conftest", _stand_in())


def pytest_sessionstart(session):
    import kvbm_ext  # noqa: F401 - imported for its effect on the GIL

    if sysconfig.get_config_var("Py_GIL_DISABLED") and sys._is_gil_enabled():
        pytest.exit("importing kvbm_ext turned the GIL on", returncode=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module) and "No module named 'torch'" in str(report.longrepr):
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: {NO_TORCH} (the file imports it)")
