"""A PagedKVCache layer whose memory moves after construction is never read or written
through the old address.

- NumPy: the cache holds weak references to each layer and to the array owning its memory,
  so NumPy refuses `resize` (even with refcheck=False, which before let the next write
  land in freed memory and crash) for as long as the cache lives.
- torch, one array holding every layer: every call asks the tensor, through the C exchange
  API, where its memory is; after a `resize_` that grew its storage, or a resize of the
  storage itself, the call raises ValueError naming the layer and writes nothing.
- torch, per-layer arrays: the same check for every layer a call moves, under
  KVBM_EXT_DEBUG=1 (a C call per layer per call otherwise spared).
- Other producers: under KVBM_EXT_DEBUG=1, each layer a call moves is read again through
  its protocol and its address compared.
- `set_` on the caller's tensor does not move the cache's memory (the cache borrowed a
  detached alias): calls keep moving the memory the cache was built over.
"""

import gc

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import invoke, run_and_check
from support.builders import CacheCase, block_buffers
from support.asserts import expect_rejected
from support.builders import random_tensor


NL, NB, NO, NH, NT, HD = 3, 6, 2, 2, 4, 8
IDS = [4, 0, 5]
METHODS = ["to_universal", "from_universal", "to_operational", "from_operational"]


def other(case, method, gen, pin=False):
    shape = case.universal_shape() if "universal" in method else case.operational_shape()
    return block_buffers("list", len(IDS), shape, case.dtype, gen, case.device, pin)


def refused(cache, method, gen, case, path, **kwargs):
    """The call raises ValueError naming `path`, "memory moved", writing nothing.  The cache's
    own memory is not compared: it may be freed."""
    arg = other(case, method, gen).arg
    dst = arg if method.startswith("to_") else []
    src = [] if method.startswith("to_") else arg
    expect_rejected(lambda: invoke(cache, method, IDS, arg, **kwargs), src, dst, ValueError, path,
                    ["memory moved", "since the cache was built"])


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")


# --------------------------------------------------------------------------
# NumPy: resizing is refused while the cache lives.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("single", [False, True], ids=["per-layer", "one array"])
def test_numpy_layer_cannot_be_resized_under_the_cache(single, gen):
    """Arrays owning their memory (resizable when nothing refers to them)."""
    whole = random_tensor((NL, NO, NB, NT, NH, HD), torch.float32, "cpu", gen).numpy().copy()
    layers = whole if single else [whole[l].copy() for l in range(NL)]
    cache = kvbm_ext.PagedKVCache(layers, "lkbthd" if single else "kbthd")
    for layer in [layers] if single else layers:
        with pytest.raises(ValueError, match="cannot resize"):
            layer.resize((layer.size * 4,), refcheck=False)
    u = np.zeros((len(IDS), NH, NL, NO, NT, HD), np.float32)
    cache.to_universal(IDS, u)
    want = whole[:, :, IDS].transpose(2, 4, 0, 1, 3, 5)
    assert np.array_equal(u.view(np.uint32), want.view(np.uint32))
    u2 = np.random.default_rng(1).random(u.shape, np.float32)
    cache.from_universal(u2, IDS)
    got = layers[:, :, IDS] if single else np.stack(layers)[:, :, IDS]
    assert np.array_equal(got.transpose(2, 4, 0, 1, 3, 5).view(np.uint32), u2.view(np.uint32))
    del cache
    gc.collect()
    first = layers if single else layers[0]
    first.resize((first.size * 4,), refcheck=False)  # the cache is gone: allowed again


def test_numpy_base_of_view_layers_cannot_be_resized(gen):
    """Layers that are views of one array: resizing their base would free their memory."""
    base = random_tensor((NL, NO, NB, NT, NH, HD), torch.float32, "cpu", gen).numpy()
    cache = kvbm_ext.PagedKVCache([base[l] for l in range(NL)], "kbthd")
    with pytest.raises(ValueError, match="cannot resize"):
        base.resize((base.size * 4,), refcheck=False)
    u = np.zeros((1, NH, NL, NO, NT, HD), np.float32)
    cache.to_universal([2], u)
    assert np.array_equal(u[0].view(np.uint32), base[:, :, 2].transpose(3, 0, 1, 2, 4).view(np.uint32))


# --------------------------------------------------------------------------
# torch: one array holding every layer, checked at every call.
# --------------------------------------------------------------------------


def grow(t):
    t.resize_((t.numel() * 64,))


def shrink_storage(t):
    t.untyped_storage().resize_(0)


@pytest.mark.parametrize("move", [grow, shrink_storage], ids=["resize_", "storage.resize_(0)"])
@pytest.mark.parametrize("layout", ["lkbthd", "blkthd"])
@pytest.mark.parametrize("method", METHODS)
def test_torch_single_array_that_moved_is_refused(method, layout, move, gen):
    case = CacheCase(layout, NL, NB, NO, NH, NT, HD, torch.bfloat16, gen)
    cache = case.build()
    run_and_check(case, cache, method, IDS, other(case, method, gen))
    move(case.buf.bases[0])
    refused(cache, method, gen, case, "layers")


def test_torch_single_array_repointed_with_set_keeps_its_memory(gen):
    case = CacheCase("lkbthd", NL, NB, NO, NH, NT, HD, torch.float16, gen)
    cache = case.build()
    content = case.buf.bases[0].clone()
    case.layers.set_(torch.zeros(5, dtype=torch.float16))
    kept = CacheCase("lkbthd", NL, NB, NO, NH, NT, HD, torch.float16, gen, bases=[content])
    for method in ("to_universal", "to_operational"):
        run_and_check(kept, cache, method, IDS, other(kept, method, gen))


# --------------------------------------------------------------------------
# Per-layer arrays: checked under KVBM_EXT_DEBUG.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_torch_layer_that_moved_is_refused_under_debug(method, debug, gen):
    case = CacheCase("kbthd", NL, NB, NO, NH, NT, HD, torch.bfloat16, gen)
    cache = case.build()
    run_and_check(case, cache, method, IDS, other(case, method, gen))
    grow(case.layers[1])
    refused(cache, method, gen, case, r"layers\[1\]")


def test_torch_layer_repointed_with_set_is_not_reported_under_debug(debug, gen):
    """set_ re-points the caller's tensor, not the cache's alias: no error, the old memory."""
    case = CacheCase("kbthd", NL, NB, NO, NH, NT, HD, torch.float16, gen)
    cache = case.build()
    content = [b.clone() for b in case.buf.bases]
    for layer in case.layers:
        layer.set_(torch.zeros(3, dtype=torch.float16))
    kept = CacheCase("kbthd", NL, NB, NO, NH, NT, HD, torch.float16, gen, bases=content)
    run_and_check(kept, cache, "to_universal", IDS, other(kept, "to_universal", gen))


class Moving:
    """An __array_interface__ producer over `now`, which the test replaces: a producer whose
    memory moves between reads."""

    def __init__(self, now):
        self.now = now

    @property
    def __array_interface__(self):
        return self.now.__array_interface__


class RaisingBase(Moving):
    """A producer whose `base` attribute raises: nothing to guard, not an error."""

    @property
    def base(self):
        raise ZeroDivisionError("base")


def test_layer_whose_base_cannot_be_read_is_taken(gen):
    layer = random_tensor((NO, NB, NT, NH, HD), torch.float32, "cpu", gen).numpy()
    cache = kvbm_ext.PagedKVCache([RaisingBase(layer)], "kbthd")
    u = np.zeros((len(IDS), NH, 1, NO, NT, HD), np.float32)
    cache.to_universal(IDS, u)
    assert np.array_equal(u[:, :, 0].view(np.uint32), layer[:, IDS].transpose(1, 3, 0, 2, 4).view(np.uint32))


def test_other_producer_that_moved_is_refused_under_debug(monkeypatch, gen):
    first = random_tensor((NO, NB, NT, NH, HD), torch.float32, "cpu", gen).numpy()
    layers = [Moving(first), Moving(first.copy())]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    layers[0].now = first.copy()
    u = np.zeros((len(IDS), NH, 2, NO, NT, HD), np.float32)
    cache.to_universal(IDS, u)            # without KVBM_EXT_DEBUG: not read again
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    u[...] = -1
    with pytest.raises(ValueError, match=r"^layers\[0\]: its memory moved"):
        cache.to_universal(IDS, u)
    assert (u == -1).all()
    one = np.zeros((len(IDS), NH, 1, NO, NT, HD), np.float32)
    cache.to_universal(IDS, one, layers=1, layer_offset=-1)   # layer 1 did not move
    want = layers[1].now[:, IDS].transpose(1, 3, 0, 2, 4)
    assert np.array_equal(one[:, :, 0].view(np.uint32), want.view(np.uint32))


# --------------------------------------------------------------------------
# On a GPU.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True], ids=["device", "pinned"])
def test_gpu_single_array_that_moved_is_refused(pin, gen):
    case = CacheCase("blkthd", NL, NB, NO, NH, NT, HD, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    run_and_check(case, cache, "from_universal", IDS, other(case, "from_universal", gen, pin=pin))
    grow(case.buf.bases[0])
    for method in METHODS:
        refused(cache, method, gen, case, "layers")


@pytest.mark.gpu
def test_gpu_layer_that_moved_is_refused_under_debug(debug, gen):
    case = CacheCase("kbthd", NL, NB, NO, NH, NT, HD, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    shrink_storage(case.layers[2])
    for method in METHODS:
        refused(cache, method, gen, case, r"layers\[2\]")
