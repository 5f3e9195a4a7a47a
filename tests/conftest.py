"""Shared fixtures and markers for the kvbm_ext tests."""

import os
import sys
import zlib

import pytest
import torch

# Import kvbm_ext from the repository root (built in place) whatever the cwd.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch")

requires_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@pytest.fixture
def gen(request):
    """A fresh torch.Generator per test, seeded from the test id (printed: shown on failure)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"generator seed={seed} for {request.node.nodeid}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# Dynamo's own test file is kept as it is upstream, and one of its tests moves a tensor to
# the GPU without checking for one first.
UPSTREAM_TESTS_NEEDING_CUDA = {("test_dynamo_compat_upstream.py", "test_non_cuda_tensor_error")}


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    for item in items:
        if (item.path.name, item.name) in UPSTREAM_TESTS_NEEDING_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU visible to torch (calls .cuda())"))
