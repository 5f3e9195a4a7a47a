"""kvbm_ext.PagedKVCache: a worker's paged KV cache described once (arrays + dims), moving
blocks to and from universal and operational blocks by block id.

Every call's destination memory is poisoned (0xA5) before the call and afterwards compared
byte for byte with the pure-torch reference of support/references.py applied to a copy of it:
moved rows written, everything else (other heads, other layers, other blocks, padding
between rows) still poisoned. Sources are checked unchanged. Errors are checked to be
raised before any byte is written. Tests taking `device` run on the CPU and, where one is
visible, on a GPU (PLACES: with universals / operationals on the device or pinned). Sections:
  1. the reference and the checking helper themselves (no kvbm_ext)
  2. construction: properties, references kept, construction errors
  3. results: every layout, reshard round trips, id and universal / operational forms on
     every device; on host caches (torch CPU, NumPy) layer selections and offsets, head
     offsets, nb = 0
  4. call errors: host ids on every device; the rest on host caches
  5. GPU only (marked gpu): placements, ids on the device (out-of-range skipped), CUDA graph
     capture and replay, num_ctas, streams, staging, errors
"""

import gc
import os
import re
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_bitwise_equal,
    assert_message_has,
    assert_poisoned,
    expect_rejected,
    invoke,
    path_regex,
    peek_still_poisoned,
    poison_,
    run_and_check,
)
from support.builders import (
    BLOCK_FORMS,
    CACHE_LAYOUTS,
    METHODS,
    Buffers,
    CacheCase,
    block_buffers,
    dtype_id,
    misaligned,
    pick_ids,
    random_tensor,
    read_only_copy,
    snapshot,
    split,
)
from support.devices import SLEEP_CYCLES, cuda_case, rewrite_sources_behind_sleep, sync
from support.references import as_int, cache_rows, canonical, paged_reference, per_block, selected

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.int64]
DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.uint8: "uint8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int64: "int64",
    torch.int8: "int8",
    torch.float64: "float64",
}
LAYOUTS = list(CACHE_LAYOUTS)
# (nl, NB, no, nh, nt, hd): nt != nh where both > 1, so NHD and HND differ.
SHAPES = [(3, 9, 2, 3, 4, 5), (2, 6, 2, 2, 16, 64), (4, 5, 2, 1, 1, 1), (1, 20, 2, 4, 3, 8)]
# Method codes of the data tests: inner order of the operational after the colon.
DIRECTIONS = ["to_universal", "from_universal", "to_operational:NHD", "to_operational:HND",
              "from_operational:NHD", "from_operational:HND"]


def shape_id(s):
    return "nl{}-NB{}-no{}-nh{}-nt{}-hd{}".format(*s)


def case_id(v):
    if isinstance(v, torch.dtype):
        return dtype_id(v)
    if isinstance(v, tuple) and len(v) == 6:
        return shape_id(v)
    if isinstance(v, (slice, range)):
        return repr(v).replace(" ", "")
    return None


def other_buffers(case, method, nb, gen, form="list", NH=None, NL=None, device=None, pin=False, dtype=None):
    """Universals (shape from the case, NH/NL overridable) or operationals for `method`."""
    shape = case.universal_shape(NH, NL) if "universal" in method else case.operational_shape()
    return block_buffers(form, nb, shape, dtype or case.dtype, gen, device or case.device, pin)


# Where a test's cache and the universals / operationals it moves live: the CPU, and where a
# GPU is visible a GPU cache with the other side on the device or in pinned host memory.
PLACES = [pytest.param("cpu", False, id="cpu"), cuda_case("cuda", False, id="cuda"),
          cuda_case("cuda", True, id="cuda-pinned")]


def check(case, cache, direction, ids, gen, form="list", NH=None, NL=None, pin=False, **kwargs):
    method, extra = split(direction)
    other = other_buffers(case, method, len(ids), gen, form, NH, NL, pin=pin)
    run_and_check(case, cache, method, ids, other, **extra, **kwargs)


# ==========================================================================
# 1. The reference and the checking helper (no kvbm_ext).
# ==========================================================================

# The spec's "cache(i, l, o, t, h)" written out for every layout of the catalogue, on the
# arrays the library is given (L: the list of per-layer arrays, or the single array).
HAND_INDEXING = {
    "kbthd": lambda L, i, l, o, t, h: L[l][o, i, t, h, :],
    "bkthd": lambda L, i, l, o, t, h: L[l][i, o, t, h, :],
    "btd": lambda L, i, l, o, t, h: L[l][i, t, :],
    "kbhtd": lambda L, i, l, o, t, h: L[l][o, i, h, t, :],
    "kbthd_hnd": lambda L, i, l, o, t, h: L[l][o, i, t, h, :],
    "kbthd_padded": lambda L, i, l, o, t, h: L[l][o, i, t, h, :],
    "kbthd_shared": lambda L, i, l, o, t, h: L[l][o, i, t, h, :],
    "dtbkh": lambda L, i, l, o, t, h: L[l][:, t, i, o, h],
    "blkthd": lambda L, i, l, o, t, h: L[i, l, o, t, h, :],
    "lkbthd": lambda L, i, l, o, t, h: L[l, o, i, t, h, :],
    "lbthd": lambda L, i, l, o, t, h: L[l, i, t, h, :],
    "blkthd_hnd": lambda L, i, l, o, t, h: L[i, l, o, t, h, :],
}


# The same rows located in the memory the test allocated (B: the bases), for the layouts
# whose memory order differs from their logical order.
PHYSICAL_INDEXING = {
    "kbthd_hnd": lambda B, i, l, o, t, h: B[l][o, i, h, t, :],
    "kbthd_padded": lambda B, i, l, o, t, h: B[l][o, i + 2, t, h, 1:-2],
    "kbthd_shared": lambda B, i, l, o, t, h: B[0][l, o, i, t, h, :],
    "dtbkh": lambda B, i, l, o, t, h: B[l][o, i, t, h, :],
    "blkthd_hnd": lambda B, i, l, o, t, h: B[0][i, l, o, h, t, :],
}


def test_hand_indexing_covers_every_layout():
    assert set(HAND_INDEXING) == set(CACHE_LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ref_rows_match_hand_indexing(layout, gen):
    case = CacheCase(layout, 2, 3, 2, 2, 3, 4, torch.int64, gen)
    for k, b in enumerate(case.buf.bases):  # unique values
        b.copy_(torch.arange(b.numel()).reshape(b.shape) + k * 1_000_000)
    rows = case.rows()
    L = case.layers
    for i in range(case.NB):
        for l in range(case.nl):
            for o in range(case.no):
                for t in range(case.nt):
                    for h in range(case.nh):
                        row = rows[l][i][o, t, h]
                        assert torch.equal(row, HAND_INDEXING[layout](L, i, l, o, t, h)), (i, l, o, t, h)
                        if layout in PHYSICAL_INDEXING:
                            want = PHYSICAL_INDEXING[layout](case.buf.bases, i, l, o, t, h)
                            assert torch.equal(row, want), ("memory", i, l, o, t, h)
    # the rows are views: writing one changes the cache memory
    before = snapshot(case.buf.bases)
    rows[case.nl - 1][case.NB - 1][case.no - 1, case.nt - 1, case.nh - 1].fill_(-7)
    assert int((HAND_INDEXING[layout](L, case.NB - 1, case.nl - 1, case.no - 1, case.nt - 1, case.nh - 1) == -7).sum()) == case.hd
    changed = sum(int((as_int(b) != s).sum()) for b, s in zip(case.buf.bases, before))
    assert changed == case.hd


@pytest.mark.parametrize("inner", ["NHD", "HND"])
@pytest.mark.parametrize("method", METHODS)
def test_ref_reference_matches_spec_formula(method, inner, gen):
    """paged_reference() against the spec's equalities written element by element."""
    nl, NB, no, nh, nt, hd = 3, 5, 2, 2, 3, 2
    case = CacheCase("kbthd", nl, NB, no, nh, nt, hd, torch.int64, gen)
    ids, sel = [3, 0, 4], [2, 0]
    uni = "universal" in method
    lo, ho = (1, 2) if uni else (0, 0)
    NH, NL = nh + 3, nl + 2
    shape = (NH, NL, no, nt, hd) if uni else (nl, no, nt * nh * hd)
    blocks = [random_tensor(shape, torch.int64, generator=gen) for _ in ids]
    rows = case.rows()
    want_blocks = [b.clone() for b in blocks]
    want_rows = [r.clone() for r in rows]
    for b, i in enumerate(ids):
        for l in sel:
            for o in range(no):
                for t in range(nt):
                    for h in range(nh):
                        if uni:
                            dst_u = want_blocks[b][ho + h, lo + l, o, t, :]
                        else:
                            view = want_blocks[b][l, o].view(nt, nh, hd) if inner == "NHD" else want_blocks[b][l, o].view(nh, nt, hd)
                            dst_u = view[t, h, :] if inner == "NHD" else view[h, t, :]
                        src_u = blocks[b][ho + h, lo + l, o, t, :] if uni else (
                            blocks[b][l, o].view(nt, nh, hd)[t, h, :] if inner == "NHD" else blocks[b][l, o].view(nh, nt, hd)[h, t, :])
                        if method.startswith("to_"):
                            dst_u.copy_(rows[l][i][o, t, h])
                        else:
                            want_rows[l][i][o, t, h].copy_(src_u)
    original_blocks, original_rows = [b.clone() for b in blocks], [r.clone() for r in rows]
    paged_reference(method, rows, blocks, ids, sel, layer_offset=lo, head_offset=ho, inner=inner)
    for b, (got, want) in enumerate(zip(blocks, want_blocks)):
        assert_bitwise_equal(got, want, f"block {b}")
    for l, (got, want) in enumerate(zip(case.rows(), want_rows)):
        assert_bitwise_equal(got, want, f"layer {l}")
    # the formula moved something: a no-op reference could not pass
    moved = blocks if method.startswith("to_") else case.rows()
    original = original_blocks if method.startswith("to_") else original_rows
    assert any(not torch.equal(a, b) for a, b in zip(moved, original))


def test_ref_selected():
    assert selected(4, None) == [0, 1, 2, 3]
    assert selected(4, 2) == [2]
    assert selected(4, -1) == [3]
    assert selected(4, np.int64(1)) == [1]
    assert selected(4, slice(-2, None)) == [2, 3]
    assert selected(4, slice(None, None, -1)) == [3, 2, 1, 0]
    assert selected(4, slice(10, 20)) == []
    assert selected(4, range(1, 4, 2)) == [1, 3]


def test_ref_canonical_missing_letters():
    x = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # "btd"
    c = canonical(x, "btd", "bkthd")
    assert tuple(c.shape) == (2, 1, 3, 1, 4)
    assert torch.equal(c[1, 0, 2, 0], x[1, 2])


class FakeCache:
    """A stand-in implementing the spec in Python on the live arrays, with one bug."""

    def __init__(self, case, bug):
        self.case, self.bug = case, bug

    def _run(self, method, ids, other, layers=None, layer_offset=0, head_offset=0, inner="NHD", heads=None, **_):
        case = self.case
        if self.bug == "nothing":
            return None
        sel = selected(case.nl, None if self.bug == "all-layers" else layers)
        if self.bug == "no-head-offset":
            head_offset = 0
        hs = selected(case.nh, None if self.bug == "all-heads" else heads)
        if self.bug == "wrong-inner":
            inner = "HND" if inner.upper() == "NHD" else "NHD"
        ids = list(ids)
        if self.bug == "one-block-less":
            ids[-1] = case.NB + 100  # skipped
        rows = cache_rows(case.buf.make(case.buf.bases), case.dims)
        paged_reference(method, rows, per_block(other), ids, sel, layer_offset, head_offset, inner, hs)
        if self.bug == "touch-source":
            src = case.buf.bases[0] if method.startswith("to_") else per_block(other)[0]
            src.view(torch.uint8).view(-1)[0] ^= 1
        if self.bug == "touch-padding":
            case.buf.bases[0].view(torch.uint8).view(-1)[0] ^= 0x0F
        return None

    def __getattr__(self, method):
        if method not in METHODS:
            raise AttributeError(method)
        if method.startswith("to_"):
            return lambda ids, other, **kw: self._run(method, ids, other, **kw)
        return lambda other, ids, **kw: self._run(method, ids, other, **kw)


@pytest.mark.parametrize(
    "bug,method,kwargs",
    [
        ("nothing", "to_universal", {}),
        ("nothing", "from_operational", {}),
        ("no-head-offset", "to_universal", {"head_offset": 1}),
        ("no-head-offset", "from_universal", {"head_offset": 1}),
        ("all-layers", "to_universal", {"layers": slice(0, 1)}),
        ("all-heads", "to_universal", {"heads": slice(1, 2)}),
        ("all-heads", "from_universal", {"heads": 0}),
        ("all-layers", "from_operational", {"layers": slice(1, None)}),
        ("wrong-inner", "to_operational", {"inner": "NHD"}),
        ("wrong-inner", "from_operational", {"inner": "HND"}),
        ("one-block-less", "to_operational", {}),
        ("one-block-less", "from_universal", {}),
        ("touch-source", "to_universal", {}),
        ("touch-source", "from_universal", {}),
        ("touch-padding", "from_universal", {}),
    ],
)
def test_checking_helper_catches_wrong_implementations(bug, method, kwargs, gen):
    case = CacheCase("kbthd_padded", 2, 6, 2, 2, 3, 4, torch.bfloat16, gen)
    NH = case.nh + 1 if "head_offset" in kwargs else None
    other = other_buffers(case, method, 3, gen, NH=NH)
    ids = [4, 0, 5]
    run_and_check(case, FakeCache(case, "none"), method, ids, other, **kwargs)  # the correct fake passes
    with pytest.raises(AssertionError):
        run_and_check(case, FakeCache(case, bug), method, ids, other, **kwargs)


# ==========================================================================
# 2. Construction.
# ==========================================================================


@pytest.mark.parametrize("layout", LAYOUTS)
def test_properties(layout, gen):
    nl, NB, no, nh, nt, hd = 3, 11, 2, 5, 7, 13
    case = CacheCase(layout, nl, NB, no, nh, nt, hd, torch.bfloat16, gen)
    cache = case.build()
    assert cache.num_layers == nl
    assert cache.num_blocks == NB
    assert cache.num_heads == (nh if "h" in case.dims else 1)
    assert cache.block_size == nt
    assert cache.head_dim == hd
    assert cache.num_outer == (no if "k" in case.dims else 1)
    assert cache.dtype is torch.bfloat16 and cache.dtype_name == "bfloat16"
    assert cache.itemsize == 2
    assert cache.device == torch.device("cpu") and cache.device_name == "cpu"
    assert cache.layout == case.dims
    if isinstance(case.layers, list):
        assert len(cache.layers) == nl and all(a is b for a, b in zip(cache.layers, case.layers))
    else:
        assert cache.layers is case.layers
    r = repr(cache)
    assert case.dims in r and "bfloat16" in r and "cpu" in r, r
    for v in (nl, NB, cache.num_outer, cache.num_heads, nt, hd):
        assert re.search(rf"(?<!\d){v}(?!\d)", r), (v, r)


@pytest.mark.parametrize("dtype", DTYPES + [torch.int8, torch.float64], ids=dtype_id)
def test_dtype_and_itemsize(dtype, gen):
    cache = CacheCase("kbthd", 2, 4, 2, 2, 3, 4, dtype, gen).build()
    assert cache.dtype is dtype and cache.dtype_name == DTYPE_NAMES[dtype]
    assert cache.itemsize == torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("np_dtype,name", [(np.float16, "float16"), (np.uint8, "uint8"), (np.int64, "int64")])
def test_numpy_cache_properties(np_dtype, name, gen):
    case = CacheCase("kbthd", 2, 4, 2, 2, 3, 4, torch.from_numpy(np.empty(0, np_dtype)).dtype, gen, numpy=True)
    assert all(isinstance(x, np.ndarray) and x.dtype == np_dtype for x in case.layers)
    cache = case.build()
    assert (cache.dtype, cache.device, cache.itemsize) == (np.dtype(np_dtype), "cpu", np.dtype(np_dtype).itemsize)
    assert isinstance(cache.dtype, np.dtype) and (cache.dtype_name, cache.device_name) == (name, "cpu")
    assert all(a is b for a, b in zip(cache.layers, case.layers))


@pytest.mark.parametrize("given", [list, tuple])
def test_layers_property_is_the_tuple_of_the_given_arrays(given, gen):
    """The spec: `cache.layers` returns the tuple of per-layer arrays (the arrays as given),
    also after the caller changes the list it passed."""
    case = CacheCase("kbthd", 3, 4, 2, 2, 3, 4, torch.float16, gen)
    arrays = list(case.layers)
    argument = given(arrays)
    cache = kvbm_ext.PagedKVCache(argument, case.dims)
    assert type(cache.layers) is tuple
    assert len(cache.layers) == 3 and all(a is b for a, b in zip(cache.layers, arrays))
    if given is list:
        argument.clear()
        argument.append(None)
        assert type(cache.layers) is tuple and all(a is b for a, b in zip(cache.layers, arrays))


def test_cache_keeps_arrays_alive_when_the_caller_empties_its_list(gen):
    """The arrays stay alive (and are the ones used) when the list passed is emptied."""
    nl, NB = 3, 8
    case = CacheCase("kbthd", nl, NB, 2, 2, 3, 16, torch.bfloat16, gen)
    argument = list(case.layers)
    cache = kvbm_ext.PagedKVCache(argument, case.dims)
    refs = [weakref.ref(a) for a in argument]
    content, make, dims, shape = snapshot(case.buf.bases), case.buf.make, case.dims, case.universal_shape()
    argument.clear()
    del case
    gc.collect()
    assert all(r() is not None for r in refs), "the cache let its arrays die"
    churn = [torch.full((NB * 2 * 3 * 2 * 16 * 2,), 7, dtype=torch.uint8) for _ in range(2 * nl)]  # reuse freed memory
    ids = [6, 1, 7, 0]
    U = block_buffers("array", len(ids), shape, torch.bfloat16, gen)
    poison_(U.bases)
    want = snapshot(U.bases)
    cache.to_universal(ids, U.arg)
    paged_reference("to_universal", cache_rows(make(content), dims), per_block(U.make(want)), ids, list(range(nl)))
    assert_bitwise_equal(as_int(U.bases[0]), want[0], "universals")
    del churn


@pytest.mark.parametrize("layout", ["kbthd", "blkthd"])
def test_cache_holds_references_to_its_arrays(layout, gen):
    case = CacheCase(layout, 3, 4, 2, 2, 3, 4, torch.float16, gen)
    arrays = list(case.layers) if isinstance(case.layers, list) else [case.layers]
    before = [sys.getrefcount(a) for a in arrays]
    cache = case.build()
    during = [sys.getrefcount(a) for a in arrays]
    assert all(d > b for d, b in zip(during, before)), (before, during)
    del cache
    gc.collect()
    assert [sys.getrefcount(a) for a in arrays] == before


def moves_the_bytes_it_was_given(cache, content, make, dims, shape, nb, gen):
    """After the caller let go of the cache's memory (and fresh allocations may have
    reused anything freed), to_universal still moves the bytes the cache was built on
    (`content`, a snapshot of its 8-block layers)."""
    churn = [torch.full((8 * 2 * 3 * 2 * 16 * 2,), 7, dtype=torch.uint8) for _ in range(12)]
    ids = [6, 1, 7, 0][:nb]
    U = block_buffers("array", nb, shape, torch.bfloat16, gen)
    poison_(U.bases)
    want = snapshot(U.bases)
    cache.to_universal(ids, U.arg)
    nl = shape[1]
    paged_reference("to_universal", cache_rows(make(content), dims), per_block(U.make(want)), ids, list(range(nl)))
    assert_bitwise_equal(as_int(U.bases[0]), want[0], "universals")
    del churn


@pytest.mark.parametrize("repoint", ["set_", "set_-other-storage"])
def test_cache_keeps_the_memory_of_a_repointed_layer(repoint, gen):
    """Re-pointing a layer tensor after construction (set_) drops its old storage as far
    as the caller's tensor is concerned; the cache keeps that storage through its own
    alias, so it keeps moving the memory it was given (its old bytes), never freed
    memory.  (resize_ is another matter: it reallocates the storage shared by every
    alias, in place; README, "PagedKVCache".)"""
    nl, NB, nb = 3, 8, 4
    case = CacheCase("kbthd", nl, NB, 2, 2, 3, 16, torch.bfloat16, gen)
    cache = case.build()
    content, make, dims = snapshot(case.buf.bases), case.buf.make, case.dims
    shape = case.universal_shape()
    for layer in case.layers:
        if repoint == "set_":
            layer.set_(torch.empty(0, dtype=layer.dtype))
        else:
            layer.set_(torch.zeros(layer.numel() * 2, dtype=layer.dtype).view(-1)[: layer.numel()].view(layer.shape))
    gc.collect()
    moves_the_bytes_it_was_given(cache, content, make, dims, shape, nb, gen)


@pytest.mark.parametrize("layout", ["kbthd", "kbthd_hnd", "blkthd"])
def test_cache_keeps_arrays_alive_when_the_caller_drops_them(layout, gen):
    nl, NB, nb = 3, 8, 4
    case = CacheCase(layout, nl, NB, 2, 2, 3, 16, torch.bfloat16, gen)
    cache = case.build()
    arrays = list(case.layers) if isinstance(case.layers, list) else [case.layers]
    refs = [weakref.ref(a) for a in arrays]
    content, make, dims = snapshot(case.buf.bases), case.buf.make, case.dims
    shape = case.universal_shape()
    del case, arrays
    gc.collect()
    assert all(r() is not None for r in refs), "the cache let its arrays die"
    moves_the_bytes_it_was_given(cache, content, make, dims, shape, nb, gen)
    del cache
    gc.collect()
    assert all(r() is None for r in refs), "the arrays outlived the cache"


# --------------------------------------------------------------------------
# Construction errors.
# --------------------------------------------------------------------------


def letter(c):
    """The dimension letter `c` as a token of its own in the message."""
    return re.compile(rf"(?<![A-Za-z]){c}(?![A-Za-z])")


def construct_rejected(layers, dims, exc, path, *words):
    with pytest.raises(exc, match=path_regex(path)) as info:
        kvbm_ext.PagedKVCache(layers, dims)
    msg = str(info.value)
    assert_message_has(msg, words)
    return msg


def per_layer(shape, nl=3, dtype=torch.float32):
    return [random_tensor(shape, dtype) for _ in range(nl)]


@pytest.mark.parametrize(
    "dims,shape,bad",
    [
        ("kbxhd", (2, 4, 3, 2, 5), "x"),  # unknown letter
        ("kbtHh", (2, 4, 3, 2, 5), "h"),  # repeated, in either case
        ("kbtbd", (2, 4, 3, 2, 5), "b"),  # repeated
        ("kbthh", (2, 4, 3, 2, 5), "h"),  # repeated
        ("kthd", (2, 3, 2, 5), "b"),  # b missing
        ("kbhd", (2, 4, 2, 5), "t"),  # t missing
        ("kbth", (2, 4, 3, 2), "d"),  # d missing
    ],
    ids=["unknown", "repeated-across-case", "repeated-b", "repeated-h", "no-b", "no-t", "no-d"],
)
def test_bad_dims_letters(dims, shape, bad):
    construct_rejected(per_layer(shape), dims, ValueError, "layout", letter(bad))


def test_l_with_a_list_of_layers():
    construct_rejected(per_layer((3, 2, 4, 3, 2, 5)), "lkbthd", ValueError, "(layout|layers)", letter("l"))


def test_no_l_with_a_single_array():
    construct_rejected(random_tensor((2, 4, 3, 2, 5), torch.float32), "kbthd", ValueError, "(layout|layers)", letter("l"))


@pytest.mark.parametrize(
    "layers_shape,dims,single",
    [((2, 4, 3, 2, 5), "kbtd", False), ((2, 4, 3, 2, 5), "kbthdl", False), ((3, 4, 2, 3, 5), "lkbthd", True),
     ((4, 3, 2, 5), "lbthd", True)],
    ids=["list-too-few", "list-too-many", "single-too-many", "single-too-few"],
)
def test_dims_length_differs_from_ndim(layers_shape, dims, single):
    layers = random_tensor(layers_shape, torch.float32) if single else per_layer(layers_shape)
    construct_rejected(layers, dims, ValueError, r"(layout|layers(\[0\])?)")


@pytest.mark.parametrize("bad", [5, None, b"kbthd", ["k", "b", "t", "h", "d"]], ids=["int", "None", "bytes", "list"])
def test_dims_not_a_str(bad):
    construct_rejected(per_layer((2, 4, 3, 2, 5)), bad, TypeError, "layout")


def test_head_dim_not_stride_1_per_layer():
    layers = [random_tensor((2, 4, 3, 2, 10), torch.float16)[..., ::2] for _ in range(3)]
    construct_rejected(layers, "kbthd", ValueError, r"layers\[0\]", letter("d"), "stride")


def test_head_dim_not_stride_1_single_array():
    layers = random_tensor((3, 2, 4, 3, 2, 10), torch.float16)[..., 1::2]
    construct_rejected(layers, "lkbthd", ValueError, "layers", letter("d"), "stride")


def test_head_dim_not_stride_1_permuted():
    """Logically "kbthd" but the memory is [.., hd, nh]: d has stride nh."""
    layers = [random_tensor((2, 4, 3, 5, 2), torch.float16).transpose(3, 4) for _ in range(2)]
    construct_rejected(layers, "kbthd", ValueError, r"layers\[0\]", letter("d"))


@pytest.mark.parametrize("where,axis", [("b", 1), ("t", 2), ("h", 3)])
def test_negative_stride(where, axis):
    base = np.zeros((2, 4, 3, 2, 5), dtype=np.float16)
    index = [slice(None)] * 5
    index[axis] = slice(None, None, -1)
    layers = [base[tuple(index)] for _ in range(2)]
    assert layers[0].strides[axis] < 0
    construct_rejected(layers, "kbthd", ValueError, r"layers\[0\]", letter(where))


@pytest.mark.parametrize("where,shape1", [("h", (2, 4, 3, 1, 5)), ("b", (2, 1, 3, 2, 5))])
def test_zero_stride_on_a_dimension_larger_than_1(where, shape1):
    full = (2, 4, 3, 2, 5)
    layers = [torch.zeros(shape1, dtype=torch.float32).expand(full) for _ in range(2)]
    assert 0 in layers[0].stride()
    construct_rejected(layers, "kbthd", ValueError, r"layers\[0\]", letter(where))


def test_mismatched_per_layer_shapes():
    layers = per_layer((2, 4, 3, 2, 5))
    layers[2] = random_tensor((2, 5, 3, 2, 5), torch.float32)
    construct_rejected(layers, "kbthd", ValueError, r"layers\[2\]", "shape")


def test_mismatched_per_layer_element_types():
    layers = per_layer((2, 4, 3, 2, 5))
    layers[1] = random_tensor((2, 4, 3, 2, 5), torch.int32)  # same size, other type
    construct_rejected(layers, "kbthd", TypeError, r"layers\[1\]")


def test_mismatched_per_layer_strides():
    layers = per_layer((2, 4, 3, 2, 5))
    layers[2] = random_tensor((2, 4, 2, 3, 5), torch.float32).transpose(2, 3)  # same shape, HND memory
    construct_rejected(layers, "kbthd", ValueError, r"layers\[2\]", "stride")


@pytest.mark.parametrize("single", [False, True])
def test_element_size_16_bytes(single):
    if single:
        construct_rejected(random_tensor((3, 2, 4, 3, 2, 5), torch.complex128), "lkbthd", TypeError, "layers")
    else:
        construct_rejected(per_layer((2, 4, 3, 2, 5), dtype=torch.complex128), "kbthd", TypeError, r"layers\[0\]")


@pytest.mark.parametrize("bad", ["abc", None, 3, object()], ids=["str", "None", "int", "object"])
def test_non_array_layer(bad):
    layers = per_layer((2, 4, 3, 2, 5))
    layers[1] = bad
    construct_rejected(layers, "kbthd", TypeError, r"layers\[1\]")


@pytest.mark.parametrize("dims", ["lkbthd", "kbthd"])
@pytest.mark.parametrize("bad", [None, 3, object()], ids=["None", "int", "object"])
def test_layers_not_an_array_or_sequence(bad, dims):
    construct_rejected(bad, dims, TypeError, "layers")


def test_layers_empty_sequence():
    construct_rejected([], "kbthd", ValueError, "layers")


def test_zero_stride_on_a_size_1_dimension_is_allowed(gen):
    """nh = 1 with head stride 0 (and an odd stride on the size-1 k dim of a no = 1 cache)."""
    nl, NB, nt, hd = 2, 5, 3, 4
    bases = [random_tensor((NB, nt, hd), torch.float16, generator=gen) for _ in range(nl)]
    views = lambda bs: [b.as_strided((1, NB, nt, 1, hd), (12345, nt * hd, hd, 0, 1)) for b in bs]  # noqa: E731
    case = CacheCase("kbthd", nl, NB, 1, 1, nt, hd, torch.float16, gen, bases=bases, make=views)
    assert case.layers[0].stride() == (12345, nt * hd, hd, 0, 1)
    cache = case.build()
    assert (cache.num_outer, cache.num_heads) == (1, 1)
    for direction in DIRECTIONS:
        check(case, cache, direction, [4, 0, 2], gen)


# ==========================================================================
# 3. Results.
# ==========================================================================

# Every layout with one dtype (rotating) and a shape (rotating); every dtype on two layouts.
DATA_CASES = [(layout, DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]) for i, layout in enumerate(LAYOUTS)]
DATA_CASES += [(layout, d, SHAPES[j % len(SHAPES)]) for layout in ("kbthd", "blkthd")
               for j, d in enumerate(DTYPES) if (layout, d) not in [(c[0], c[1]) for c in DATA_CASES]]
# The same rotation over eight layouts, and every dtype on one shape, as well.
ROTATED_LAYOUTS = ["kbthd", "bkthd", "btd", "kbthd_hnd", "kbthd_padded", "dtbkh", "blkthd", "lkbthd"]
ROTATED = [(layout, DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]) for i, layout in enumerate(ROTATED_LAYOUTS)]
ROTATED += [("kbthd", d, SHAPES[1]) for d in DTYPES if ("kbthd", d) not in [(c[0], c[1]) for c in ROTATED]]
DATA_CASES += [c for c in ROTATED if c not in DATA_CASES]


@pytest.mark.parametrize("layout,dtype,shape", DATA_CASES, ids=case_id)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device,pin", PLACES)
def test_every_layout(method, layout, dtype, shape, device, pin, gen):
    """Universals / operationals on the cache's device, or in pinned host memory."""
    case = CacheCase(layout, *shape, dtype, gen, device)
    cache = case.build()
    assert cache.device == torch.device("cuda:0" if device == "cuda" else "cpu")
    ids = pick_ids(case.NB, min(4, case.NB), gen)
    if method.endswith("operational"):
        check(case, cache, method + ":NHD", ids, gen, pin=pin)
        check(case, cache, method + ":HND", ids, gen, pin=pin)
    else:
        check(case, cache, method, ids, gen, pin=pin)


@pytest.mark.parametrize("np_dtype", [np.float16, np.uint8, np.int64, np.float32], ids=dtype_id)
@pytest.mark.parametrize("layout", ["kbthd", "kbthd_hnd", "blkthd"])
def test_host_numpy_cache(layout, np_dtype, gen):
    """Cache arrays given as NumPy arrays (universals/operationals NumPy too)."""
    dtype = torch.from_numpy(np.empty(0, np_dtype)).dtype
    case = CacheCase(layout, 3, 7, 2, 3, 4, 5, dtype, gen, numpy=True)
    cache = case.build()
    ids = [5, 0, 6]
    for direction in DIRECTIONS:
        method, extra = split(direction)
        other = other_buffers(case, method, len(ids), gen, form="numpy-array" if "to_" in method else "numpy-list")
        run_and_check(case, cache, method, ids, other, **extra)


# --------------------------------------------------------------------------
# Layer selections, layer_offset.
# --------------------------------------------------------------------------

LAYER_SELECTIONS = [
    None, slice(1, 3), slice(None, None, 2), slice(-2, None), slice(-3, -1), slice(None, None, -1),
    range(1, 4, 2), range(0, 4), range(2, 3), 2, -1, np.int64(3),
]


# Each selection with one (layout, layer_offset), rotating.
LAYER_CASES = [(sel, *[("kbthd", 0), ("kbthd", 2), ("blkthd", 1)][i % 3]) for i, sel in enumerate(LAYER_SELECTIONS)]


@pytest.mark.parametrize("layers,layout,layer_offset", LAYER_CASES, ids=case_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_layers_and_layer_offset(method, layers, layout, layer_offset, gen):
    """Universals with NL = layer_offset + nl + 1: layers outside the moved range untouched."""
    case = CacheCase(layout, 4, 6, 2, 2, 3, 5, torch.bfloat16, gen)
    check(case, case.build(), method, [3, 0, 5], gen, NL=layer_offset + case.nl + 1,
          layers=layers, layer_offset=layer_offset)


@pytest.mark.parametrize(
    "direction,layers",
    [(["to_operational:NHD", "from_operational:HND"][i % 2], sel) for i, sel in enumerate(LAYER_SELECTIONS)],
    ids=case_id,
)
def test_host_layers_operational(direction, layers, gen):
    """Operational layers not in `layers` are not touched (operationals always have nl layers)."""
    layout = "kbthd" if direction.startswith("to") else "lkbthd"
    case = CacheCase(layout, 4, 6, 2, 2, 3, 5, torch.float16, gen)
    check(case, case.build(), direction, [3, 0, 5], gen, layers=layers)


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_universal_with_just_enough_layers(method, gen):
    """NL = layer_offset + highest moved layer + 1 (fewer than layer_offset + nl)."""
    case = CacheCase("kbthd", 4, 6, 2, 2, 3, 5, torch.float32, gen)
    check(case, case.build(), method, [2, 5], gen, NL=3 + 2 + 1, layers=slice(0, 3, 2), layer_offset=3)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_host_pipeline_stage_layer_offset_default_layers(direction, gen):
    """layer_offset with every layer (only universal methods take it)."""
    case = CacheCase("bkthd", 2, 5, 2, 3, 2, 4, torch.bfloat16, gen)
    method, extra = split(direction)
    if "universal" in method:
        check(case, case.build(), direction, [1, 4], gen, NL=6, layer_offset=4)
    else:
        check(case, case.build(), direction, [1, 4], gen)


# --------------------------------------------------------------------------
# Head offsets; tensor- and pipeline-parallel resharding through universals.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("extra_heads", [0, 2])
@pytest.mark.parametrize("head_offset", [0, 1, 3])
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_head_offset(method, head_offset, extra_heads, gen):
    """NH = head_offset + nh + extra: heads outside [head_offset, head_offset + nh) untouched."""
    case = CacheCase("kbthd_hnd", 2, 6, 2, 2, 3, 5, torch.float16, gen)
    check(case, case.build(), method, [5, 2, 0], gen, NH=head_offset + case.nh + extra_heads,
          head_offset=head_offset)


@pytest.mark.parametrize("layout", ["blkthd", "lbthd"])
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_head_and_layer_offset_together(method, layout, gen):
    case = CacheCase(layout, 3, 5, 2, 2, 4, 3, torch.uint8, gen)
    check(case, case.build(), method, [0, 4, 2], gen, NH=5, NL=6, head_offset=2, layer_offset=2,
          layers=slice(1, None))


HEAD_SELECTIONS = [slice(1, 3), slice(None, None, -1), slice(0, 4, 2), range(3, 0, -2), 2, -1, np.int64(1)]


# Each selection with one (layout, head_offset), rotating; "btd" (nh = 1) takes head 0 only.
HEAD_CASES = [(sel, *[("kbthd", 0), ("kbthd_hnd", 1), ("blkthd", 2), ("bkthd", 0)][i % 4])
              for i, sel in enumerate(HEAD_SELECTIONS)]


@pytest.mark.parametrize("heads,layout,head_offset", HEAD_CASES, ids=case_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_heads(method, heads, layout, head_offset, gen):
    """A selection of the cache's heads lands at head_offset in universals with one head to
    spare: other universal heads, and the cache's other heads, untouched."""
    case = CacheCase(layout, 3, 6, 2, 4, 3, 5, torch.bfloat16, gen)
    count = len(selected(case.nh, heads))
    check(case, case.build(), method, [3, 0, 5], gen, NH=head_offset + count + 1, heads=heads,
          head_offset=head_offset)


@pytest.mark.parametrize("heads", [0, slice(None), range(0, 1)], ids=case_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_heads_of_a_single_head_cache(method, heads, gen):
    """MLA ("btd": nh = 1): head 0."""
    case = CacheCase("btd", 3, 6, 1, 1, 3, 8, torch.float16, gen)
    count = len(selected(case.nh, heads))
    check(case, case.build(), method, [4, 1], gen, NH=max(count, 1), heads=heads)


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_heads_layers_and_offsets_together(method, gen):
    """A receiver's share: heads 1..2 of 4 and layers 1..2 of 3 into [NH=3, NL=4] at offsets."""
    case = CacheCase("lkbthd", 3, 7, 2, 4, 2, 6, torch.int16, gen)
    check(case, case.build(), method, [6, 2, 0], gen, form="array", NH=3, NL=4, heads=slice(1, 3), head_offset=1,
          layers=range(1, 3), layer_offset=1)


def test_layout_is_case_insensitive(gen):
    case = CacheCase("kbthd", 2, 5, 2, 2, 3, 4, torch.float32, gen)
    cache = kvbm_ext.PagedKVCache(case.layers, "KbThD")
    assert cache.layout == "kbthd" and cache.num_heads == 2 and cache.num_outer == 2
    check(case, cache, "to_universal", [4, 1], gen)


def rows_of(case, ids):
    """[nb, nl, no, nt, nh, hd] integer copy of the cache rows of `ids`."""
    return torch.stack([torch.stack([r[i] for r in case.rows()]) for i in ids]).clone()


def reshard_round_trip(gen, device="cpu", pin=False):
    """Four caches (2 pipeline stages x 2 TP ranks: nl = 2, nh = 2 each) write their blocks
    into universals [NH = 4, NL = 4] with layer_offset 0/2 and head_offset 0/2; a cache with
    all layers and heads (nl = 4, nh = 4) reads them back. Then the reverse."""
    NB, nb, nt, hd, dtype = 7, 3, 3, 8, torch.bfloat16
    layouts = [["kbthd", "bkthd"], ["kbthd_hnd", "blkthd"]]  # [stage][rank]: any layouts mix
    parts = [[CacheCase(layouts[s][r], 2, NB, 2, 2, nt, hd, dtype, gen, device) for r in range(2)] for s in range(2)]
    full = CacheCase("lkbthd", 4, NB, 2, 4, nt, hd, dtype, gen, device)
    part_ids, full_ids = [6, 0, 3], [2, 5, 1]
    U = block_buffers("array", nb, (4, 4, 2, nt, hd), dtype, gen, device if not pin else "cpu", pin)
    poison_(U.bases)
    for s in range(2):
        for r in range(2):
            parts[s][r].build().to_universal(part_ids, U.arg, layer_offset=2 * s, head_offset=2 * r)
    sync()
    assert_poisoned_none(U.bases[0])
    poison_(full.buf.bases)
    full.build().from_universal(U.arg, full_ids)
    sync()
    # full[i] == concatenation over heads (TP) and layers (PP) of the parts' rows
    want = torch.cat([torch.cat([rows_of(parts[s][r], part_ids) for r in range(2)], dim=4) for s in range(2)], dim=1)
    assert_bitwise_equal(rows_of(full, full_ids), want, "full cache rows")
    others = [i for i in range(NB) if i not in full_ids]
    for i in others:
        for l, row in enumerate(full.rows()):
            assert_poisoned(row[i], f"full cache block {i} layer {l} (not in block_ids)")
    # reverse: the full cache writes, every part reads its layers and heads
    fresh = CacheCase("lkbthd", 4, NB, 2, 4, nt, hd, dtype, gen, device)
    cache = fresh.build()
    poison_(U.bases)
    cache.to_universal(full_ids, U.arg)
    for s in range(2):
        for r in range(2):
            poison_(parts[s][r].buf.bases)
            parts[s][r].build().from_universal(U.arg, part_ids, layer_offset=2 * s, head_offset=2 * r)
    sync()
    src = rows_of(fresh, full_ids)
    for s in range(2):
        for r in range(2):
            want = src[:, 2 * s : 2 * s + 2, :, :, 2 * r : 2 * r + 2]
            assert_bitwise_equal(rows_of(parts[s][r], part_ids), want, f"stage {s} rank {r}")


def assert_poisoned_none(x):
    """No element of x is still entirely poison (every universal row was written)."""
    rows = as_int(x).cpu().reshape(-1, x.shape[-1]).view(torch.uint8)
    assert not bool((rows == 0xA5).all(dim=1).any()), "a universal row was left unwritten"


@pytest.mark.parametrize("device,pin", PLACES)
def test_reshard_round_trip(device, pin, gen):
    reshard_round_trip(gen, device, pin)


# --------------------------------------------------------------------------
# Argument forms.
# --------------------------------------------------------------------------

ID_FORMS = {
    "list": lambda ids: list(ids),
    "tuple": lambda ids: tuple(ids),
    "numpy-int32": lambda ids: np.array(ids, dtype=np.int32),
    "numpy-int64": lambda ids: np.array(ids, dtype=np.int64),
    "torch-int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "torch-int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
}


# A GPU cache takes ids in pinned host memory and on its device too.
DEVICE_ID_FORMS = {
    "pinned-int64": lambda ids: torch.tensor(ids, dtype=torch.int64).pin_memory(),
    "cuda-int32": lambda ids: torch.tensor(ids, dtype=torch.int32, device="cuda"),
    "cuda-int64": lambda ids: torch.tensor(ids, dtype=torch.int64, device="cuda"),
}


@pytest.mark.parametrize("hd", [5, 16])
@pytest.mark.parametrize("device,form", [("cpu", f) for f in ID_FORMS] +
                         [cuda_case("cuda", f) for f in list(ID_FORMS) + list(DEVICE_ID_FORMS)])
def test_block_id_forms(device, form, hd, gen):
    case = CacheCase("kbthd", 2, 12, 2, 2, 3, hd, torch.float16, gen, device)
    cache = case.build()
    ids = {**ID_FORMS, **DEVICE_ID_FORMS}[form]([11, 0, 7, 3])
    for direction in ["to_universal", "from_universal", "to_operational:HND", "from_operational:NHD"]:
        method, extra = split(direction)
        run_and_check(case, cache, method, ids, other_buffers(case, method, 4, gen), **extra)


@pytest.mark.parametrize("device,pin,form", [("cpu", False, f) for f in BLOCK_FORMS] +
                         [cuda_case("cuda", pin, f) for pin in (False, True) for f in BLOCK_FORMS if "numpy" not in f])
@pytest.mark.parametrize("direction", ["to_universal", "from_universal", "to_operational:NHD", "from_operational:HND"])
def test_universal_and_operational_forms(direction, device, pin, form, gen):
    """list, tuple, one array, a strided slice pool[1::2] of a bigger pool (its other blocks
    untouched), NumPy list / array; on the cache's device or in pinned host memory."""
    for hd in (5, 32):
        case = CacheCase("bkthd", 3, 8, 2, 2, 4, hd, torch.int64 if "numpy" in form else torch.bfloat16, gen, device)
        check(case, case.build(), direction, [7, 2, 4], gen, form=form, pin=pin)


@pytest.mark.parametrize("direction", ["to_universal", "to_operational:NHD"])
def test_host_repeated_source_ids_are_allowed(direction, gen):
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.float32, gen)
    check(case, case.build(), direction, [2, 2, 5, 2], gen)


@pytest.mark.parametrize("direction", ["from_universal", "from_operational:HND"])
def test_host_read_only_numpy_sources(direction, gen):
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.float16, gen)
    method, extra = split(direction)
    other = other_buffers(case, method, 3, gen, form="numpy-list")
    for a in other.arg:
        a.setflags(write=False)
    run_and_check(case, case.build(), method, [4, 1, 5], other, **extra)


@pytest.mark.parametrize("form", ["list", "array", "numpy-array"])
def test_host_zero_blocks(form, gen):
    """nb = 0 does nothing (empty list, [0, ...] arrays, empty id arrays)."""
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.float16, gen)
    cache = case.build()
    for method in METHODS:
        other = other_buffers(case, method, 0, gen, form=form)
        for ids in ([], (), np.zeros(0, np.int64), torch.zeros(0, dtype=torch.int32)):
            run_and_check(case, cache, method, ids, other)


@pytest.mark.parametrize("num_ctas", [None, 1, 3, 1000])
def test_host_num_ctas_is_refused_unless_none(num_ctas, gen):
    """A host cache runs on the CPU: num_ctas=None runs, a bound (GPU only) is refused."""
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.bfloat16, gen)
    cache = case.build()
    for method in METHODS:
        if num_ctas is None:
            check(case, cache, method, [4, 1, 5], gen, num_ctas=num_ctas, stream=None)
        else:
            reject(case, cache, method, [4, 1, 5], good_other(case, method, gen), ValueError, "num_ctas",
                   f"num_ctas: {num_ctas} bounds the CUDA blocks", num_ctas=num_ctas)


@pytest.mark.parametrize("inner", ["nhd", "hnd", "Hnd", "nHD"])
@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_host_inner_is_case_insensitive(method, inner, gen):
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.bfloat16, gen)
    check(case, case.build(), f"{method}:{inner}", [4, 1, 5], gen)


def test_host_default_inner_is_nhd(gen):
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 5, torch.float16, gen)  # nt != nh: NHD and HND differ
    cache = case.build()
    other = other_buffers(case, "to_operational", 2, gen)
    run_and_check(case, cache, "to_operational", [4, 1], other)  # reference: inner="NHD"
    other = other_buffers(case, "from_operational", 2, gen)
    run_and_check(case, cache, "from_operational", [4, 1], other)


def test_host_cache_reused_for_many_calls(gen):
    """One cache, many calls with new ids, data and offsets (nothing stale)."""
    case = CacheCase("kbthd_padded", 3, 10, 2, 2, 3, 6, torch.bfloat16, gen)
    cache = case.build()
    for step in range(4):
        for b in case.buf.bases:
            b.copy_(random_tensor(b.shape, b.dtype, generator=gen))
        ids = pick_ids(case.NB, 3 + step, gen)
        check(case, cache, "to_universal", ids, gen, NH=3, head_offset=step % 2)
        check(case, cache, "from_operational:HND", ids, gen, layers=slice(step % 3, None))
        check(case, cache, "from_universal", ids[::-1], gen, NL=4, layer_offset=1)


@pytest.mark.parametrize("hd", [1, 7, 64, 129])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.int64], ids=dtype_id)
def test_host_head_dims(dtype, hd, gen):
    """Row lengths of 1 to 129 elements (16-byte vectors and their remainders)."""
    case = CacheCase("kbthd_padded", 2, 5, 2, 2, 3, hd, dtype, gen)
    cache = case.build()
    for direction in ("to_universal", "from_universal", "to_operational:HND", "from_operational:NHD"):
        check(case, cache, direction, [4, 0, 2], gen)


# ==========================================================================
# 4. Call errors (all before any write).
# ==========================================================================

NL, NB, NO, NH, NT, HD = 3, 9, 2, 3, 4, 5
IDS = [4, 0, 7]


def ecase(gen, layout="kbthd", dtype=torch.float32, device="cpu"):
    case = CacheCase(layout, NL, NB, NO, NH, NT, HD, dtype, gen, device)
    return case, case.build()


def reject(case, cache, method, ids, other, exc, path, *words, **kwargs):
    """The call raises `exc` with a message starting with `path` (regex) and containing
    `words`; the destination (other for to_*, the cache for from_*) is still poisoned and
    the source unchanged."""
    if method.startswith("to_"):
        src, dst = case.buf.bases, other
    else:
        src, dst = other, case.buf.bases
    return expect_rejected(lambda: invoke(cache, method, ids, other, **kwargs), src, dst, exc, path, words)


def good_other(case, method, gen, nb=3, form="list", **kw):
    return other_buffers(case, method, nb, gen, form, **kw).arg


@pytest.mark.parametrize("method", METHODS)
def test_block_id_out_of_range(method, device, gen):
    """Ids given on the host are checked on the host, whatever the cache's device."""
    case, cache = ecase(gen, device=device)
    for ids, index in ([4, 0, NB], 2), ([4, -1, 0], 1), ([NB + 1000, 0, 1], 0):
        reject(case, cache, method, ids, good_other(case, method, gen), ValueError, rf"block_ids\[{index}\]",
               "out of range", str(ids[index]))


@pytest.mark.parametrize("form", ["numpy-int32", "torch-int64"])
@pytest.mark.parametrize("method", ["to_universal", "from_operational"])
def test_host_block_id_out_of_range_in_an_array(method, form, gen):
    case, cache = ecase(gen)
    ids = ID_FORMS[form]([4, 0, NB + 3])
    reject(case, cache, method, ids, good_other(case, method, gen), ValueError, r"block_ids\[2\]",
           "out of range", str(NB + 3))


@pytest.mark.parametrize("form", ["list", "numpy-int64", "torch-int32"])
@pytest.mark.parametrize("method", ["from_universal", "from_operational"])
def test_repeated_destination_ids(method, form, device, gen):
    case, cache = ecase(gen, device=device)
    ids = ID_FORMS[form]([5, 1, 7, 1])
    reject(case, cache, method, ids, good_other(case, method, gen, nb=4), ValueError, r"block_ids\[3\]",
           "repeat", "block_ids[1]")


BAD_ID_TYPES = {
    "numpy-float32": lambda: np.array(IDS, dtype=np.float32),
    "numpy-float64": lambda: np.array(IDS, dtype=np.float64),
    "numpy-int16": lambda: np.array(IDS, dtype=np.int16),
    "torch-float32": lambda: torch.tensor(IDS, dtype=torch.float32),
    "torch-int16": lambda: torch.tensor(IDS, dtype=torch.int16),
    "torch-uint8": lambda: torch.tensor(IDS, dtype=torch.uint8),
    "list-with-float": lambda: [4, 0.5, 7],
    "list-with-str": lambda: [4, "0", 7],
    "int": lambda: 4,
    "None": lambda: None,
}


@pytest.mark.parametrize(
    "method,bad", [(["to_universal", "from_universal"][i % 2], bad) for i, bad in enumerate(BAD_ID_TYPES)]
)
def test_host_block_ids_wrong_type(method, bad, gen):
    case, cache = ecase(gen)
    reject(case, cache, method, BAD_ID_TYPES[bad](), good_other(case, method, gen), TypeError, r"block_ids(\[1\])?")


BAD_ID_ARRAYS = {
    "numpy-2d": lambda: np.array([IDS], dtype=np.int64).reshape(3, 1),
    "torch-2d": lambda: torch.tensor([IDS], dtype=torch.int32),
    "torch-0d": lambda: torch.tensor(4, dtype=torch.int64),
    "torch-strided": lambda: torch.tensor([4, 9, 0, 9, 7, 9], dtype=torch.int64)[::2],
    "numpy-strided": lambda: np.array([4, 9, 0, 9, 7, 9], dtype=np.int32)[::2],
}


@pytest.mark.parametrize("bad", list(BAD_ID_ARRAYS))
@pytest.mark.parametrize("method", ["to_universal", "from_operational"])
def test_host_block_ids_wrong_shape_or_layout(method, bad, gen):
    case, cache = ecase(gen)
    nb = 1 if bad == "torch-2d" else 3
    reject(case, cache, method, BAD_ID_ARRAYS[bad](), good_other(case, method, gen, nb=nb), ValueError, "block_ids")


@pytest.mark.parametrize("n_ids,n_other,form", [(3, 2, "list"), (2, 3, "array")])
@pytest.mark.parametrize("method", METHODS)
def test_host_count_mismatch(method, n_ids, n_other, form, gen):
    case, cache = ecase(gen)
    ids = [4, 0, 7][:n_ids]
    name = "universals" if "universal" in method else "operationals"
    reject(case, cache, method, ids, good_other(case, method, gen, nb=n_other, form=form), ValueError,
           f"({name}|block_ids)", re.compile(rf"\b{n_ids}\b"), re.compile(rf"\b{n_other}\b"))


# (kwargs of the call, shape of universals[1] (others fine), key word)
BAD_UNIVERSALS = {
    "NH<head_offset+nh": ({"head_offset": 1}, (NH, NL, NO, NT, HD), re.compile(r"(?i)shape|head")),
    "NH<nh": ({}, (NH - 1, NL, NO, NT, HD), re.compile(r"(?i)shape|head")),
    "NL<layer_offset+nl": ({"layer_offset": 1}, (NH, NL, NO, NT, HD), re.compile(r"(?i)shape|layer")),
    "NL<highest-layer": ({"layers": slice(1, 3)}, (NH, NL - 1, NO, NT, HD), re.compile(r"(?i)shape|layer")),
    "no-1": ({}, (NH, NL, NO - 1, NT, HD), "shape"),
    "nt+1": ({}, (NH, NL, NO, NT + 1, HD), "shape"),
    "hd-1": ({}, (NH, NL, NO, NT, HD - 1), "shape"),
    "4-D": ({}, (NH, NL * NO, NT, HD), "shape"),
    "6-D": ({}, (1, NH, NL, NO, NT, HD), "shape"),
}


def universals_with(case, bad_shape, good_shape, gen, dtype=None):
    us = [random_tensor(good_shape, case.dtype, generator=gen) for _ in range(3)]
    us[1] = random_tensor(bad_shape, dtype or case.dtype, generator=gen)
    return us


@pytest.mark.parametrize("bad", list(BAD_UNIVERSALS))
def test_host_universal_wrong_shape(bad, gen):
    kwargs, shape, word = BAD_UNIVERSALS[bad]
    case, cache = ecase(gen)
    good = (NH + 1, NL + 1, NO, NT, HD)  # enough for every offset used
    for method in ("to_universal", "from_universal"):
        reject(case, cache, method, IDS, universals_with(case, shape, good, gen), ValueError, r"universals\[1\]",
               word, **kwargs)


@pytest.mark.parametrize("bad", ["NH<head_offset+nh", "NL<layer_offset+nl", "nt+1", "5-D"])
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_single_universal_array_wrong_shape(method, bad, gen):
    """(A 5-D array may be read as a sequence of 4-D arrays: universals[0] then.)"""
    case, cache = ecase(gen)
    path = r"universals(\[0\])?" if bad == "5-D" else "universals"
    shape, kwargs = {
        "NH<head_offset+nh": ((3, NH, NL, NO, NT, HD), {"head_offset": 2}),
        "NL<layer_offset+nl": ((3, NH, NL, NO, NT, HD), {"layer_offset": 1}),
        "nt+1": ((3, NH, NL, NO, NT + 1, HD), {}),
        "5-D": ((3 * NH, NL, NO, NT, HD), {}),
    }[bad]
    reject(case, cache, method, IDS, random_tensor(shape, case.dtype, generator=gen), ValueError, path, **kwargs)


@pytest.mark.parametrize("odd", [torch.float16, torch.int32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_universal_wrong_element_type(method, odd, gen):
    case, cache = ecase(gen)
    good = case.universal_shape()
    reject(case, cache, method, IDS, universals_with(case, good, good, gen, dtype=odd), TypeError, r"universals\[1\]")


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_single_universal_array_wrong_element_type(method, gen):
    case, cache = ecase(gen)
    U = random_tensor((3,) + case.universal_shape(), torch.int32, generator=gen)
    reject(case, cache, method, IDS, U, TypeError, "universals")


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_non_contiguous_universal(method, gen):
    case, cache = ecase(gen)
    us = [random_tensor(case.universal_shape(), case.dtype, generator=gen) for _ in range(3)]
    us[1] = random_tensor((NL, NH, NO, NT, HD), case.dtype, generator=gen).transpose(0, 1)
    reject(case, cache, method, IDS, us, ValueError, r"universals\[1\]", "contiguous")


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_single_universal_array_inner_dims_not_contiguous(method, gen):
    case, cache = ecase(gen)
    U = random_tensor((3, NL, NH, NO, NT, HD), case.dtype, generator=gen).transpose(1, 2)
    reject(case, cache, method, IDS, U, ValueError, "universals", "contiguous")


@pytest.mark.parametrize("method", ["to_universal", "to_operational"])
def test_host_read_only_destination(method, gen):
    case, cache = ecase(gen)
    other = [x.numpy() for x in other_buffers(case, method, 3, gen).arg]
    other[1] = read_only_copy(other[1])
    name = "universals" if "universal" in method else "operationals"
    reject(case, cache, method, IDS, other, ValueError, rf"{name}\[1\]", "read-only")


@pytest.mark.parametrize("method", ["to_universal", "to_operational"])
def test_host_read_only_single_array_destination(method, gen):
    case, cache = ecase(gen)
    other = read_only_copy(other_buffers(case, method, 3, gen, form="array").arg)
    name = "universals" if "universal" in method else "operationals"
    reject(case, cache, method, IDS, other, ValueError, name, "read-only")


@pytest.mark.parametrize("method", METHODS)
def test_host_other_not_an_array_or_sequence(method, gen):
    case, cache = ecase(gen)
    name = "universals" if "universal" in method else "operationals"
    for bad in (5, None, object()):
        reject(case, cache, method, IDS, bad, TypeError, name)


@pytest.mark.parametrize("method", METHODS)
def test_host_non_array_in_the_list(method, gen):
    case, cache = ecase(gen)
    name = "universals" if "universal" in method else "operationals"
    for bad in ("abc", None, 3):
        other = list(good_other(case, method, gen))
        other[1] = bad
        reject(case, cache, method, IDS, other, TypeError, rf"{name}\[1\]")


INNER = NT * NH * HD
BAD_OPERATIONALS = {
    "nl+1": ({}, (NL + 1, NO, INNER)),
    "nl-1-with-layers": ({"layers": slice(0, NL - 1)}, (NL - 1, NO, INNER)),
    "no-1": ({}, (NL, NO - 1, INNER)),
    "inner+1": ({}, (NL, NO, INNER + 1)),
    "inner-split": ({}, (NL, NO, NT * NH, HD)),
    "2-D": ({}, (NL * NO, INNER)),
}


@pytest.mark.parametrize("bad", list(BAD_OPERATIONALS))
def test_host_operational_wrong_shape(bad, gen):
    kwargs, shape = BAD_OPERATIONALS[bad]
    case, cache = ecase(gen)
    for method in ("to_operational", "from_operational"):
        ops = universals_with(case, shape, case.operational_shape(), gen)
        reject(case, cache, method, IDS, ops, ValueError, r"operationals\[1\]", "shape", **kwargs)


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_host_single_operational_array_wrong_shape(method, gen):
    case, cache = ecase(gen)
    ops = random_tensor((3, NL, NO, INNER + 2), case.dtype, generator=gen)
    reject(case, cache, method, IDS, ops, ValueError, "operationals")


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_host_operational_wrong_element_type(method, gen):
    case, cache = ecase(gen)
    ops = universals_with(case, case.operational_shape(), case.operational_shape(), gen, dtype=torch.int32)
    reject(case, cache, method, IDS, ops, TypeError, r"operationals\[1\]")


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_host_non_contiguous_operational(method, gen):
    case, cache = ecase(gen)
    ops = list(good_other(case, method, gen))
    ops[1] = random_tensor((NO, NL, INNER), case.dtype, generator=gen).transpose(0, 1)
    reject(case, cache, method, IDS, ops, ValueError, r"operationals\[1\]", "contiguous")


@pytest.mark.parametrize("value,exc", [(-1, ValueError), (1.5, TypeError), ("1", TypeError), (None, TypeError)],
                         ids=["negative", "float", "str", "None"])
@pytest.mark.parametrize("name", ["layer_offset", "head_offset"])
def test_host_bad_offsets(name, value, exc, gen):
    case, cache = ecase(gen)
    for method in ("to_universal", "from_universal"):
        other = good_other(case, method, gen, NH=NH + 2, NL=NL + 2)
        reject(case, cache, method, IDS, other, exc, name, **{name: value})


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError)],
                         ids=["zero", "negative", "float", "str"])
def test_host_bad_num_ctas(value, exc, gen):
    case, cache = ecase(gen)
    for method in METHODS:
        reject(case, cache, method, IDS, good_other(case, method, gen), exc, "num_ctas", num_ctas=value)


@pytest.mark.parametrize("value", ["abc", [0, 1], True, 1.5, (0, 2)], ids=["str", "list", "bool", "float", "tuple"])
def test_host_bad_layers(value, gen):
    case, cache = ecase(gen)
    for method in METHODS:
        reject(case, cache, method, IDS, good_other(case, method, gen), TypeError, "layers", layers=value)


@pytest.mark.parametrize("value", [NL, -NL - 1, 2**70, slice(0, 2, 0), range(0, NL + 1)],
                         ids=["int-past-end", "int-before-start", "huge-int", "step-0", "range-past-end"])
def test_host_layers_out_of_range(value, gen):
    case, cache = ecase(gen)
    for method in METHODS:
        reject(case, cache, method, IDS, good_other(case, method, gen), ValueError, "layers", layers=value)


@pytest.mark.parametrize("value,exc", [(NH, ValueError), (-NH - 1, ValueError), (slice(0, 1, 0), ValueError),
                                       (range(-1, 1), ValueError), ("0", TypeError), (False, TypeError),
                                       ([0], TypeError)],
                         ids=["int-past-end", "int-before-start", "step-0", "range-negative", "str", "bool", "list"])
def test_host_bad_heads(value, exc, gen):
    case, cache = ecase(gen)
    for method in ("to_universal", "from_universal"):
        reject(case, cache, method, IDS, good_other(case, method, gen), exc, "heads", heads=value)


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_host_heads_only_on_universal_methods(method, gen):
    """Operational blocks always hold every head: heads= is not one of their keywords."""
    case, cache = ecase(gen)
    reject(case, cache, method, IDS, good_other(case, method, gen), TypeError,
           rf"{method}\(\) got an unexpected keyword argument", "'heads'", heads=0)


@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_host_universal_too_few_heads_for_the_selection(method, gen):
    """NH >= head_offset + len(heads): one head short is refused before any write."""
    case, cache = ecase(gen)
    other = good_other(case, method, gen, NH=2)
    reject(case, cache, method, IDS, other, ValueError, r"universals\[0\]", "NH >= 3", heads=slice(0, 2),
           head_offset=1)


@pytest.mark.parametrize("value,exc", [("XYZ", ValueError), ("", ValueError), ("NDH", ValueError), (5, TypeError)],
                         ids=["XYZ", "empty", "NDH", "int"])
def test_host_bad_inner(value, exc, gen):
    case, cache = ecase(gen)
    for method in ("to_operational", "from_operational"):
        reject(case, cache, method, IDS, good_other(case, method, gen), exc, "inner", inner=value)


@pytest.mark.parametrize("value", [range(0, NL + 1), range(-1, 2), range(NL, NL + 1)], ids=case_id)
def test_host_layers_range_outside_the_cache(value, gen):
    """A range must select layers of range(num_layers)."""
    case, cache = ecase(gen)
    for method in ("to_universal", "from_universal"):
        other = good_other(case, method, gen, NL=NL + 3)
        reject(case, cache, method, IDS, other, (ValueError, TypeError), "layers", layers=value)


@pytest.mark.parametrize("method", ["from_universal", "from_operational"])
def test_host_read_only_cache(method, gen):
    """A cache of read-only NumPy arrays can be read (to_*) but not written (from_*)."""
    case = CacheCase("kbthd", NL, NB, NO, NH, NT, HD, torch.float16, gen, numpy=True)
    for a in case.layers:
        a.setflags(write=False)
    cache = case.build()
    to = "to_" + method[len("from_"):]
    run_and_check(case, cache, to, IDS, other_buffers(case, to, 3, gen))
    # (poisoning the read-only cache goes through the torch view of its memory)
    reject(case, cache, method, IDS, good_other(case, method, gen), ValueError, "layers", "read-only")


@pytest.mark.parametrize("method", METHODS)
def test_host_options_are_keyword_only(method, gen):
    case, cache = ecase(gen)
    other = good_other(case, method, gen)
    first, second = (IDS, other) if method.startswith("to_") else (other, IDS)
    third = None if "universal" in method else "NHD"  # layers / inner given positionally
    expect_rejected(lambda: getattr(cache, method)(first, second, third),
                    *((case.buf.bases, other) if method.startswith("to_") else (other, case.buf.bases)),
                    TypeError, method, ())


def test_host_layers_slice_with_step_zero(gen):
    case, cache = ecase(gen)
    for method in METHODS:
        reject(case, cache, method, IDS, good_other(case, method, gen), ValueError, "layers",
               layers=slice(None, None, 0))


@pytest.mark.parametrize("bad", [2**63, -(2**63), 2**64 + 1], ids=["2^63", "-2^63", "2^64+1"])
def test_host_block_ids_beyond_int64(bad, gen):
    case, cache = ecase(gen)
    for method in ("to_universal", "from_universal"):
        reject(case, cache, method, [4, bad, 7], good_other(case, method, gen), ValueError, r"block_ids\[1\]")


@pytest.mark.parametrize("method", ["from_universal", "from_operational"])
def test_host_rejected_call_leaves_no_state_behind(method, gen):
    """After a call rejected for a repeated or out-of-range id, the same ids (once each)
    are accepted: the repeated-id check starts afresh every call."""
    case, cache = ecase(gen)
    reject(case, cache, method, [4, 0, 7, 0], good_other(case, method, gen, nb=4), ValueError, r"block_ids\[3\]",
           "repeat")
    reject(case, cache, method, [4, 0, 7, NB], good_other(case, method, gen, nb=4), ValueError, r"block_ids\[3\]",
           "out of range")
    reject(case, cache, method, [4, 0, 7], [good_other(case, method, gen)[0]] * 2 + [None], TypeError,
           rf"{'universals' if 'universal' in method else 'operationals'}\[2\]")
    for _ in range(2):
        run_and_check(case, cache, method, [4, 0, 7], other_buffers(case, method, 3, gen))


def test_host_repeated_ids_in_a_cache_past_the_stack_bits(gen):
    """A cache of 70,000 blocks, whose repeated-id bits (a call's own) live on the heap: a
    repeat at the far end is found with nothing written, and ids at both ends are written."""
    nblocks = 70_000
    layers = [random_tensor((nblocks, 2, 4), torch.int8, generator=gen) for _ in range(2)]  # "btd"
    cache = kvbm_ext.PagedKVCache(layers, "btd")
    universals = random_tensor((3, 1, 2, 1, 2, 4), torch.int8, generator=gen)  # [nb, nh, nl, no, nt, hd]
    before = [layer.clone() for layer in layers]
    with pytest.raises(ValueError, match=r"^block_ids\[2\]: block id 69999 repeats block_ids\[0\]"):
        cache.from_universal(universals, [nblocks - 1, 3, nblocks - 1])
    assert all(torch.equal(a, b) for a, b in zip(layers, before)), "a rejected call wrote the cache"
    ids = [nblocks - 1, 3, 0]
    cache.from_universal(universals, ids)
    for k, b in enumerate(ids):
        for l in range(2):
            assert torch.equal(layers[l][b], universals[k, 0, l, 0]), (k, l)


# The universal shape check must not overflow: head_offset + nh or layer_offset + nl past
# 2^63 must be rejected, not wrap around and send the copy far outside the universals
# (which corrupts memory). Run in a subprocess: a wrong library crashes it.
OVERFLOW_SCRIPT = r"""
import sys, torch, kvbm_ext
name, value, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layers = [torch.full((2, 4, 3, 2, 5), 1.5, device=device) for _ in range(2)]
cache = kvbm_ext.PagedKVCache(layers, "kbthd")
U = torch.full((1, 2, 2, 2, 3, 5), 2.5, device=device)
for method in ("to_universal", "from_universal"):
    args = ([1], U) if method == "to_universal" else (U, [1])
    try:
        getattr(cache, method)(*args, **{name: value})
        outcome = "accepted"
    except Exception as e:
        outcome = type(e).__name__ + ": " + str(e).replace(chr(10), " ")
    if device != "cpu":
        torch.cuda.synchronize()
    untouched = bool((U == 2.5).all()) and all(bool((l == 1.5).all()) for l in layers)
    print(method + " | " + ("untouched" if untouched else "WRITTEN") + " | " + outcome, flush=True)
"""


def run_overflow_script(name, value, device):
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvbm_ext.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT, name, str(value), device],
                            capture_output=True, text=True, timeout=120, env=env)
    lines = [l for l in result.stdout.splitlines() if " | " in l]
    report = f"rc={result.returncode} stdout={result.stdout!r} stderr={result.stderr[-2000:]!r}"
    assert result.returncode == 0 and len(lines) == 2, report
    for line in lines:
        method, state, outcome = line.split(" | ", 2)
        assert state == "untouched", f"{method}: memory written: {report}"
        assert re.match(rf"ValueError: (universals|{name})(?![\[\w])", outcome), f"{method}: {outcome} ({report})"


@pytest.mark.parametrize("name", ["head_offset", "layer_offset"])
def test_huge_offsets_rejected(name, device):
    run_overflow_script(name, 2**63 - 1, device)


@pytest.mark.parametrize("cache_layout", ["kbthd", "kbthd_padded"])
@pytest.mark.parametrize("layout", ["list", "array"])
@pytest.mark.parametrize("direction", ["to_universal", "from_universal", "to_operational:HND", "from_operational:NHD"])
@pytest.mark.parametrize("device,pin", PLACES)
def test_misaligned_universals_and_operationals(direction, layout, cache_layout, device, pin, gen):
    """Universals/operationals starting one element past a 16-byte boundary (hd = 64)."""
    case = CacheCase(cache_layout, 2, 6, 2, 2, 3, 64, torch.bfloat16, gen, device)
    method, extra = split(direction)
    other = other_buffers(case, method, 3, gen, form=layout, pin=pin)
    other = Buffers([misaligned(b) for b in other.bases], other.make)
    assert all(b.data_ptr() % 16 for b in other.bases)
    assert all(b.is_cuda == (device == "cuda" and not pin) for b in other.bases)
    run_and_check(case, case.build(), method, [5, 0, 3], other, **extra)


@pytest.mark.parametrize("method", ["to_universal", "from_operational"])
def test_host_errors_leave_a_padded_cache_untouched(method, gen):
    """A late error (the last universal/operational) with a padded cache: no byte of the
    cache memory (rows or gaps) or of the other blocks changes."""
    case = CacheCase("kbthd_padded", NL, NB, NO, NH, NT, HD, torch.bfloat16, gen)
    cache = case.build()
    other = list(good_other(case, method, gen, nb=3))
    other[2] = random_tensor(tuple(other[2].shape), torch.float16, generator=gen)
    name = "universals" if "universal" in method else "operationals"
    reject(case, cache, method, IDS, other, TypeError, rf"{name}\[2\]")


# ==========================================================================
# 5. GPU only.
# ==========================================================================

@pytest.mark.gpu
def test_gpu_properties(gen):
    case = CacheCase("blkthd", 3, 11, 2, 5, 7, 13, torch.float8_e4m3fn, gen, device="cuda")
    cache = case.build()
    assert (cache.num_layers, cache.num_blocks, cache.num_outer, cache.num_heads) == (3, 11, 2, 5)
    assert (cache.block_size, cache.head_dim, cache.dtype, cache.itemsize) == (7, 13, torch.float8_e4m3fn, 1)
    assert cache.dtype_name == "float8_e4m3fn"
    assert cache.device == torch.device("cuda:0") and cache.device_name == "cuda:0"
    assert "device(type='cuda', index=0)" in repr(cache)
    assert cache.layers is case.layers


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [None, slice(1, 3), slice(None, None, -2), range(3, 4), 2], ids=case_id)
def test_gpu_layers_and_offsets(layers, gen):
    case = CacheCase("kbthd_hnd", 4, 6, 2, 2, 3, 16, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    for method in ("to_universal", "from_universal"):
        check(case, cache, method, [3, 0, 5], gen, NH=5, NL=7, layers=layers, layer_offset=2, head_offset=1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,layout,head_offset", HEAD_CASES, ids=case_id)
def test_gpu_heads(heads, layout, head_offset, gen):
    case = CacheCase(layout, 3, 6, 2, 4, 3, 16, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    count = len(selected(case.nh, heads))
    for method in ("to_universal", "from_universal"):
        for form in ("array", "list"):
            check(case, cache, method, [3, 0, 5], gen, form=form, NH=head_offset + count + 1, heads=heads,
                  head_offset=head_offset, layers=slice(1, None))


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [slice(1, 3), range(1, 2)], ids=case_id)
@pytest.mark.parametrize("direction", ["to_operational:NHD", "from_operational:HND"])
def test_gpu_layers_operational(direction, layers, gen):
    case = CacheCase("blkthd", 4, 6, 2, 2, 3, 16, torch.float16, gen, device="cuda")
    check(case, case.build(), direction, [3, 0, 5], gen, layers=layers)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ctas", [None, 1, 2, 8, 1000])
def test_gpu_num_ctas_gives_identical_bytes(num_ctas, gen):
    """Every num_ctas gives the reference's bytes (so identical bytes between values)."""
    case = CacheCase("kbthd", 3, 40, 2, 4, 16, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    ids = pick_ids(case.NB, 24, gen)
    for direction in ["to_universal", "from_universal", "to_operational:HND", "from_operational:NHD"]:
        check(case, cache, direction, ids, gen, form="array", num_ctas=num_ctas)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("direction", ["to_universal", "from_universal", "to_operational:NHD", "from_operational:HND"])
def test_gpu_device_ids_out_of_range_are_skipped(direction, dtype, gen):
    """Device ids are not checked on the host: blocks with ids outside [0, NB) are skipped
    (their universals/operationals stay poisoned; no cache block is written for them)."""
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 16, torch.float16, gen, device="cuda")
    big = 2**31 - 1 if dtype == torch.int32 else 2**40
    ids = torch.tensor([0, case.NB + 5, 1, -1, case.NB, big, 2], dtype=dtype, device="cuda")
    check(case, case.build(), direction, ids, gen)


@pytest.mark.gpu
def test_gpu_device_ids_out_of_range_example(gen):
    """The spec's example: ids [0, NB + 5, 1]: universals[1] stays poisoned."""
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 16, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    U = other_buffers(case, "to_universal", 3, gen, form="array")
    poison_(U.bases)
    sync()
    cache.to_universal(torch.tensor([0, case.NB + 5, 1], dtype=torch.int64, device="cuda"), U.arg)
    sync()
    assert_poisoned(U.struct[1], "universals[1]")
    rows = case.rows()
    for b, i in ((0, 0), (2, 1)):
        for l in range(case.nl):
            assert_bitwise_equal(as_int(U.struct[b][:, l]).cpu(), rows[l][i].permute(2, 0, 1, 3).cpu(), f"universals[{b}]")


# --------------------------------------------------------------------------
# CUDA graphs.
# --------------------------------------------------------------------------


class Replayer:
    """Stands in for the cache in run_and_check: every method call replays the graph."""

    def __init__(self, graph):
        self.graph = graph

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.graph.replay()


GRAPH_ID_SETS = [[5, 9, 2, 15], [15, 14, 13, 12], [7, 0, 3, 11], [1, 2, 3, 4]]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "direction,id_dtype,form",
    [
        ("to_universal", torch.int64, "array"),
        ("to_universal", torch.int32, "array"),
        ("to_universal", torch.int64, "pool[1::2]"),
        ("from_universal", torch.int64, "array"),
        ("from_universal", torch.int32, "pool[1::2]"),
        ("to_operational:NHD", torch.int64, "array"),
        ("to_operational:HND", torch.int32, "array"),
        ("from_operational:NHD", torch.int64, "array"),
        ("from_operational:HND", torch.int64, "pool[1::2]"),
    ],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else None,
)
def test_gpu_cuda_graph_capture_and_replay(direction, id_dtype, form, gen):
    """Device ids + one universal/operational array: warm up, capture the call in a
    torch.cuda.CUDAGraph, then for new id sets (ids.copy_) and new source data replay it:
    every replay gives the reference's bytes for the CURRENT ids."""
    method, extra = split(direction)
    case = CacheCase("kbthd_hnd", 3, 16, 2, 2, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    kwargs = dict(extra)
    if method.endswith("universal"):
        kwargs.update(head_offset=1, layer_offset=1)
        other = other_buffers(case, method, 4, gen, form=form, NH=case.nh + 1, NL=case.nl + 1)
    else:
        other = other_buffers(case, method, 4, gen, form=form)
    ids = torch.tensor([0, 1, 2, 3], dtype=id_dtype, device="cuda")
    # warm up (checked too)
    run_and_check(case, cache, method, ids, other, stream=torch.cuda.current_stream(), **kwargs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        invoke(cache, method, ids, other.arg, stream=torch.cuda.current_stream(), **kwargs)
    sync()
    for new in GRAPH_ID_SETS:
        ids.copy_(torch.tensor(new, dtype=id_dtype))
        src = case.buf.bases if method.startswith("to_") else other.bases
        for b in src:  # fresh source data for every replay
            b.copy_(random_tensor(b.shape, b.dtype, "cuda", gen))
        run_and_check(case, Replayer(g), method, new, other, **kwargs)


@pytest.mark.gpu
def test_gpu_staged_table_works_and_refuses_graph_capture(gen):
    """5000 universals in a list need a staged pointer table: fine outside capture (and
    correct); during capture a RuntimeError naming graph capture, raised by the call itself."""
    case = CacheCase("kbthd", 1, 8, 2, 1, 1, 2, torch.float16, gen, device="cuda")
    cache = case.build()
    nb = 5000
    ids = [i % case.NB for i in range(nb)]  # to_universal: repeated source ids are fine
    U = other_buffers(case, "to_universal", nb, gen)
    run_and_check(case, cache, "to_universal", ids, U, stream=torch.cuda.current_stream())
    poison_(U.bases)
    sync()
    caught = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        try:
            cache.to_universal(ids, U.arg, stream=torch.cuda.current_stream())
        except RuntimeError as e:
            caught = e
    sync()
    assert caught is not None, "a call staging a table was accepted during graph capture"
    assert re.search(r"(?i)captur", str(caught)), str(caught)
    for i in (0, nb // 2, nb - 1):
        assert_poisoned(U.bases[i], f"universals[{i}]")


# --------------------------------------------------------------------------
# Streams.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("stream_form", ["torch.cuda.Stream", "int"])
@pytest.mark.parametrize("method", ["to_universal", "from_universal", "to_operational"])
def test_gpu_work_is_enqueued_on_the_given_stream(method, stream_form, gen):
    """With the stream busy (a long sleep) the call returns at once, nothing is written
    until the stream gets there; then the result is the reference's."""
    case = CacheCase("kbthd", 2, 8, 2, 2, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    other = other_buffers(case, method, 4, gen, form="array")
    ids = torch.tensor([7, 1, 4, 0], device="cuda")
    dst = other if method.startswith("to_") else case.buf
    s = torch.cuda.Stream()
    stream = s if stream_form == "torch.cuda.Stream" else s.cuda_stream
    state = {}

    def after():
        assert not s.query(), "the call waited for the stream (or the sleep was too short)"
        state["judged"] = peek_still_poisoned(dst.bases, s)
        s.synchronize()

    def busy():
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)

    run_and_check(case, cache, method, ids, other, before=busy, after=after, stream=stream)
    if not state["judged"]:
        pytest.skip("the sleep ended before the peek finished; cannot judge")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["from_universal", "from_operational", "to_universal"])
def test_gpu_producer_work_is_ordered_before_the_call(method, gen):
    """The source (universals/operationals, or the ids) is rewritten on s1 behind a long
    sleep; the call runs on s2 while s1 is current: correct only if s2 waits for s1."""
    case = CacheCase("kbthd", 2, 8, 2, 2, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    other = other_buffers(case, method, 4, gen, form="list")
    if method.startswith("from_"):
        ids = [7, 1, 4, 0]
        ids_arg = ids
        sources, fresh = other.bases, None  # fresh random bytes
    else:
        ids = [6, 2, 5, 3]
        ids_arg = torch.tensor([0, 0, 0, 0], dtype=torch.int64, device="cuda")
        sources, fresh = [ids_arg], [torch.tensor(ids, dtype=torch.int64, device="cuda")]
    dst = other if method.startswith("to_") else case.buf
    poison_(dst.bases)
    sync()
    cache_before, other_before = snapshot(case.buf.bases), None
    rewrite_sources_behind_sleep(
        sources, gen, lambda stream: invoke(cache, method, ids_arg, other.arg, stream=stream), fresh=fresh)
    other_before = snapshot(other.bases)
    if method.startswith("from_"):
        want = [b.clone() for b in cache_before]
        paged_reference(method, cache_rows(case.buf.make(want), case.dims), per_block(other.make(other_before)), ids,
                  list(range(case.nl)))
        got = case.buf.bases
    else:
        want = [b.clone() for b in other_before]
        poison_(want)
        paged_reference(method, cache_rows(case.buf.make(cache_before), case.dims), per_block(other.make(want)), ids,
                  list(range(case.nl)))
        got = other.bases
    for i, (g_, w) in enumerate(zip(got, want)):
        assert_bitwise_equal(as_int(g_), w, f"destination #{i}")


# --------------------------------------------------------------------------
# GPU errors.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["list", "array"])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_pageable_host_other_with_a_gpu_cache(method, form, gen):
    case, cache = ecase(gen, device="cuda")
    name = "universals" if "universal" in method else "operationals"
    if form == "list":
        other = [x.cuda() for x in good_other(case, method, gen)]
        other[1] = other[1].cpu()
        path = rf"{name}\[1\]"
    else:
        other = good_other(case, method, gen, form="array").cpu()
        path = name
    reject(case, cache, method, IDS, other, ValueError, path, "pageable")


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_device_other_with_a_host_cache(method, gen):
    case, cache = ecase(gen)
    other = list(good_other(case, method, gen))
    other[1] = other[1].cuda()
    name = "universals" if "universal" in method else "operationals"
    reject(case, cache, method, IDS, other, ValueError, rf"{name}\[1\]")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_gpu_device_ids_with_a_host_cache(method, gen):
    case, cache = ecase(gen)
    reject(case, cache, method, torch.tensor(IDS, device="cuda"), good_other(case, method, gen), ValueError,
           "block_ids")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bad,exc",
    [
        (lambda: torch.tensor(IDS, dtype=torch.int16, device="cuda"), TypeError),
        (lambda: torch.tensor(IDS, dtype=torch.float32, device="cuda"), TypeError),
        (lambda: torch.tensor([IDS], dtype=torch.int64, device="cuda").reshape(3, 1), ValueError),
        (lambda: torch.tensor([4, 9, 0, 9, 7, 9], dtype=torch.int64, device="cuda")[::2], ValueError),
    ],
    ids=["int16", "float32", "2-D", "strided"],
)
def test_gpu_bad_device_ids(bad, exc, gen):
    case, cache = ecase(gen, device="cuda")
    reject(case, cache, "to_universal", bad(), good_other(case, "to_universal", gen), exc, "block_ids")


@pytest.mark.gpu
def test_gpu_layers_on_host_and_device_rejected():
    layers = per_layer((2, 4, 3, 2, 5))
    layers = [layers[0].cuda(), layers[1], layers[2].cuda()]
    construct_rejected(layers, "kbthd", ValueError, r"layers\[1\]")


@pytest.mark.gpu(count=2)
def test_gpu_layers_on_two_gpus_rejected():
    layers = per_layer((2, 4, 3, 2, 5))
    layers = [layers[0].to("cuda:0"), layers[1].to("cuda:1"), layers[2].to("cuda:0")]
    construct_rejected(layers, "kbthd", ValueError, r"layers\[1\]")


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_gpu_ids_or_universals_on_another_gpu_rejected(method, gen):
    case, cache = ecase(gen, device="cuda:0")
    reject(case, cache, method, torch.tensor(IDS, device="cuda:1"), good_other(case, method, gen), ValueError,
           "block_ids")
    other = list(good_other(case, method, gen))
    other[1] = other[1].to("cuda:1")
    reject(case, cache, method, IDS, other, ValueError, r"universals\[1\]")


@pytest.mark.gpu(count=2)
def test_gpu_cache_on_the_second_gpu(gen):
    case = CacheCase("kbthd", 2, 6, 2, 2, 3, 16, torch.bfloat16, gen, device="cuda:1")
    cache = case.build()
    assert cache.device == torch.device("cuda:1") and cache.device_name == "cuda:1"
    for direction in ("to_universal", "from_operational:HND"):
        method, extra = split(direction)
        other = other_buffers(case, method, 3, gen)
        run_and_check(case, cache, method, torch.tensor([5, 0, 3], device="cuda:1"), other, **extra)
