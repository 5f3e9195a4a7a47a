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
