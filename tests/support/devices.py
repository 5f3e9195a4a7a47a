"""The device a test runs on, and what device work needs: the `device` parameter
("cpu" everywhere, "cuda" marked `gpu`: skipped where torch sees no GPU), waiting for the
GPU, a producer stream held busy behind a long sleep (stream-ordering tests), and the
staging defaults the tests assume."""

import time

import pytest
import torch

from support.builders import random_tensor

# ~0.25 s at H200 clocks: long enough that "not finished right after the call" is robust.
SLEEP_CYCLES = 500_000_000

# kvbm_ext's staging defaults (set_staging): 96 MiB per device in 2 lanes; a test that
# changes them restores these.
DEFAULT_STAGING = (96 << 20, 2)


def cuda_case(*values, id=None):
    """A parametrize entry that needs a CUDA GPU (marked `gpu`)."""
    return pytest.param(*values, marks=pytest.mark.gpu, id=id)


# The params of the `device` fixture (conftest.py); also usable in parametrize.
DEVICES = ["cpu", cuda_case("cuda")]


def missing_gpus(count=1):
    """Why a test needing `count` CUDA GPUs cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU visible to torch"
    if torch.cuda.device_count() < count:
        return f"needs {count} CUDA GPUs visible to torch"
    return None


def cupy_or_skip():
    """CuPy, or the test skipped with the reason: not installed, or no usable CUDA."""
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # pragma: no cover - environment dependent
        pytest.skip(f"cupy has no usable CUDA: {e}")
    return cp


def sync():
    """Wait for all device work (no-op without a GPU)."""
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def rewrite_sources_behind_sleep(source_list, gen, invoke, fresh=None):
    """Producer/consumer stream ordering: with a new stream s1 current, a long sleep, then
    every tensor in `source_list` is overwritten (on s1) with `fresh` (default: random bytes
    from `gen`), then invoke(stream=s2) runs on a second new stream s2 with no manual sync.
    s2 must not have finished right after the call (else the library did not order s1
    before s2, or synchronised the host). Both streams are then synchronised. Returns the
    fresh tensors: the sources now hold them only if s1 was ordered before s2."""
    if fresh is None:
        fresh = [random_tensor(t.shape, t.dtype, t.device, gen) for t in source_list]
    assert len(fresh) == len(source_list)
    sync()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t, new in zip(source_list, fresh):
            t.copy_(new)
        t0 = time.perf_counter()
        invoke(stream=s2)
        elapsed = time.perf_counter() - t0
        assert not s2.query(), "s2 finished while s1 was still sleeping: no ordering, or a host sync"
    s2.synchronize()
    s1.synchronize()
    print(f"call took {elapsed * 1e3:.2f} ms")
    return fresh
