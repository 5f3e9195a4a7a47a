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


def pytest_collection_modifyitems(config, items):
    """A test marked gpu(count=n) is skipped, with the reason, where torch sees fewer GPUs."""
    for item in items:
        counts = [mark.kwargs.get("count", 1) for mark in item.iter_markers("gpu")]
        reason = missing_gpus(max(counts)) if counts else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


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
