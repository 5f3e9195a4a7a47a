"""Fixtures of the kvbm_ext tests, and the `gpu` marker's skip where no GPU is visible.
Shared helpers live in tests/support (see tests/README.md)."""

import os
import sys
import zlib

import pytest
import torch

# Import kvbm_ext from the repository root (built in place) whatever the cwd.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from support.devices import DEVICES, missing_gpus  # noqa: E402


# Markers the quick selection leaves out: their tests take seconds each (tests/README.md).
NOT_QUICK = ("slow", "build", "multiprocess")
# ... but for these: one gloo run of two ranks (about 7 s) that takes Resharder.reshard and
# TorchTransport through headers, mismatches and moves on the CPU.
QUICK_MULTIPROCESS = ("tests/test_reshard_headers.py::test_gloo_pairs_agree_before_any_payload",)
# Parameters whose every value the quick selection covers: each is a separate code path
# (an element size, a layout, a direction of a move).  Other parameters take their first value.
QUICK_FAMILIES = ("dtype", "np_dtype", "layout", "direction")


def value_name(value):
    """A parameter value's name where it has a plain one (a number, a string, a dtype, a
    class), else None.  No repr of other objects: some tests pass values whose methods
    raise on purpose."""
    if type(value) in (int, float, str, bool, type(None), torch.dtype):
        return repr(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return None


def parameter_values(item):
    """The named (parameter, value) pairs of a parametrized case (see value_name)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    pairs = {(name, value_name(value)) for name, value in callspec.params.items()}
    return {pair for pair in pairs if pair[1] is not None}


def mark_quick(items):
    """Marks `quick`, per test function and in collection order, its first case and every
    case that brings a value of a QUICK_FAMILIES parameter (a dtype, a layout, a direction)
    no earlier quick case of the function had; CPU and GPU cases (marked gpu) are counted
    apart.  So every test function runs once, and each dtype, layout and direction it takes
    once, instead of their cross product.  Tests marked slow, build or multiprocess are
    never quick, but for QUICK_MULTIPROCESS (not slow or build)."""
    seen = {}
    for item in items:
        function = item.nodeid.split("[")[0]
        if function not in QUICK_MULTIPROCESS and any(item.get_closest_marker(name) for name in NOT_QUICK):
            continue
        key = (function, item.get_closest_marker("gpu") is not None)
        values = {pair for pair in parameter_values(item) if pair[0] in QUICK_FAMILIES}
        first = key not in seen
        known = seen.setdefault(key, set())
        if first or values - known:
            known |= values
            item.add_marker(pytest.mark.quick)


def pytest_collection_modifyitems(config, items):
    """A test marked gpu(count=n) is skipped, with the reason, where torch sees fewer GPUs;
    the quick selection is marked (mark_quick)."""
    for item in items:
        counts = [mark.kwargs.get("count", 1) for mark in item.iter_markers("gpu")]
        reason = missing_gpus(max(counts)) if counts else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    mark_quick(items)


@pytest.fixture
def gen(request):
    """A fresh torch.Generator per test, seeded from the test id (printed: shown on failure)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"generator seed={seed} for {request.node.nodeid}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture(params=DEVICES)
def device(request):
    """'cpu', and 'cuda' (marked gpu) where a GPU is visible: one test, both devices."""
    return request.param
