"""PagedKVCache's layers= and heads= selections: one rule for both.

None (every entry), an index (Python's rules for a negative one), a slice (Python's rules
for negative bounds and steps, but a bound outside the cache is an error rather than
clipped) or a range of indices; never empty. A slice bound whose __index__ raises is a
TypeError naming the argument with the caller's exception as its cause. Layers keep their
cache index (universal layer = cache layer + layer_offset) while heads are renumbered from
head_offset; layer_offset may be negative down to minus the lowest layer moved, so that a
run of layers packs into a universal block of exactly that many layers. With
pack_layers=True layers are renumbered as heads are (the j-th selected layer is universal,
operational or dst layer layer_offset + j, layer_offset >= 0), so any selection, stepped
or reversed, packs into exactly len(layers) layers; every method and to_cache, on the CPU
and the GPU (device flats: the kernel; pinned flats: the staged path too).

Every call's destination is poisoned and compared byte for byte with the torch reference
(support/references.py, and to_cache's below); every refused call is checked to have
written nothing.
"""

import logging

import numpy as np
import pytest
import torch

from support.asserts import assert_bitwise_equal, expect_rejected, invoke, path_regex, poison_, run_and_check
from support.builders import CacheCase, METHODS, block_buffers, random_tensor, snapshot
from support.devices import sync
from support.references import as_int, cache_rows, paged_reference, selected


NL, NB, NO, NH, NT, HD = 4, 7, 2, 4, 3, 5
IDS = [5, 0, 3]
UNIVERSAL = ["to_universal", "from_universal"]


class Boom:
    """A slice bound whose __index__ raises."""

    def __index__(self):
        raise ZeroDivisionError("boom from __index__")


def cache_case(gen, layout="kbthd", device="cpu", nl=NL, pin=False):
    case = CacheCase(layout, nl, NB, NO, NH, NT, HD, torch.bfloat16, gen, device, pin=pin)
    return case, case.build()


def other(case, method, gen, nb=len(IDS), NH=None, NL=None, form="list", pin=False):
    shape = case.universal_shape(NH, NL) if "universal" in method else case.operational_shape()
    return block_buffers(form, nb, shape, case.dtype, gen, case.device, pin)


def refused(case, cache, method, gen, exc, path, *words, buf=None, **kwargs):
    """The call raises `exc` naming `path`, writing no destination byte; returns the exception.
    `buf`: the universals or operationals (default: every layer and head of the cache)."""
    arg = (buf or other(case, method, gen)).arg
    src, dst = (case.buf.bases, arg) if method.startswith("to_") else (arg, case.buf.bases)
    caught = []

    def call():
        try:
            invoke(cache, method, IDS, arg, **kwargs)
        except Exception as error:
            caught.append(error)
            raise

    expect_rejected(call, src, dst, exc, path, words)
    return caught[0]


# --------------------------------------------------------------------------
# Outside the cache, empty, or unreadable: errors, nothing written.
# --------------------------------------------------------------------------

OUTSIDE = [slice(1, 100), slice(5, 9), slice(2, 9), slice(-5, None), slice(None, -5, -1), slice(4, None, -1),
           slice(0, 2**64), slice(-(2**64), None), slice(None, 2**70, 2)]


@pytest.mark.parametrize("value", OUTSIDE, ids=repr)
@pytest.mark.parametrize("method", METHODS)
def test_layers_slice_reaching_outside_is_an_error(method, value, gen):
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "layers", "reaches outside the cache's 4 layers", repr(value),
            layers=value)


@pytest.mark.parametrize("value", OUTSIDE, ids=repr)
@pytest.mark.parametrize("method", UNIVERSAL)
def test_heads_slice_reaching_outside_is_an_error(method, value, gen):
    """heads=slice(2, 9) was clipped to heads 2 and 3: now refused, as heads=range(2, 9) is."""
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "heads", "reaches outside the cache's 4 heads", repr(value),
            heads=value)


@pytest.mark.parametrize("method", UNIVERSAL)
def test_range_reaching_outside_is_an_error(method, gen):
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "heads", "selects head 8", heads=range(2, 9))
    refused(case, cache, method, gen, ValueError, "layers", "selects layer 4", layers=range(2, 5))


EMPTY = [slice(2, 2), range(0), slice(3, 1), slice(1, 3, -1), range(3, 1), slice(4, None), slice(0, 0, -1)]


@pytest.mark.parametrize("value", EMPTY, ids=repr)
@pytest.mark.parametrize("method", METHODS)
def test_empty_layer_selection_is_an_error(method, value, gen):
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "layers", "selects no layer", layers=value)


@pytest.mark.parametrize("value", EMPTY, ids=repr)
@pytest.mark.parametrize("method", UNIVERSAL)
def test_empty_head_selection_is_an_error(method, value, gen):
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "heads", "selects no head", heads=value)


@pytest.mark.parametrize("name", ["layers", "heads"])
@pytest.mark.parametrize("method", UNIVERSAL)
def test_slice_bound_whose_index_raises_keeps_the_cause(method, name, gen):
    case, cache = cache_case(gen)
    for value in (slice(Boom(), None), slice(None, Boom()), slice(0, 2, Boom())):
        error = refused(case, cache, method, gen, TypeError, name, "whose __index__ failed", "ZeroDivisionError",
                        **{name: value})
        assert isinstance(error.__cause__, ZeroDivisionError), repr(error.__cause__)
        assert "step 0" not in str(error)


@pytest.mark.parametrize("value,got", [(slice(None, "a"), "str"), (slice(1.5), "float"), (slice(0, 2, 1.0), "float"),
                                       (slice(True, None), "bool")], ids=repr)
@pytest.mark.parametrize("name", ["layers", "heads"])
def test_slice_bound_that_is_not_an_int_is_a_type_error(name, value, got, gen):
    case, cache = cache_case(gen)
    error = refused(case, cache, "from_universal", gen, TypeError, name, "ints or None as the slice's start", got,
                    **{name: value})
    assert "step 0" not in str(error)


@pytest.mark.parametrize("name", ["layers", "heads"])
def test_slice_step_zero_is_still_a_value_error(name, gen):
    case, cache = cache_case(gen)
    refused(case, cache, "to_universal", gen, ValueError, name, "has step 0", **{name: slice(0, 2, 0)})


# --------------------------------------------------------------------------
# Valid slices at the edges: Python's meaning, bit for bit.
# --------------------------------------------------------------------------

EDGES = [slice(0, 4), slice(-4, None), slice(None, None, -1), slice(3, None, -1), slice(3, -5 + 1, -1),
         slice(None, None, -(2**70)), slice(-1, -4, -2), slice(np.int64(1), np.int64(3)), slice(1, 4, 2**70)]


@pytest.mark.parametrize("value", EDGES, ids=repr)
@pytest.mark.parametrize("method", UNIVERSAL)
def test_edge_slices_select_as_python_does(method, value, gen):
    case, cache = cache_case(gen)
    heads = selected(NH, value)
    assert heads, value
    run_and_check(case, cache, method, IDS, other(case, method, gen, NH=len(heads), NL=NL + 1), heads=value,
                  layers=value, layer_offset=1)


# --------------------------------------------------------------------------
# Negative layer_offset: a run of layers packs into exactly that many layers.
# --------------------------------------------------------------------------

PACKED = [range(1, 4), slice(1, None), slice(3, 0, -1), slice(2, 3), 3, -2, range(0, 2)]


@pytest.mark.parametrize("layout", ["kbthd", "kbthd_shared", "blkthd", "lkbthd"])
@pytest.mark.parametrize("layers", PACKED, ids=repr)
@pytest.mark.parametrize("method", UNIVERSAL)
def test_run_of_layers_packs_into_exactly_that_many(method, layers, layout, gen):
    case, cache = cache_case(gen, layout)
    chosen = selected(NL, layers)
    lowest = min(chosen)
    assert max(chosen) - lowest + 1 == len(chosen)
    for form in ("list", "array"):
        run_and_check(case, cache, method, IDS, other(case, method, gen, NL=len(chosen), form=form), layers=layers,
                      layer_offset=-lowest)


@pytest.mark.parametrize("method", UNIVERSAL)
def test_stepped_selection_keeps_its_gaps_with_a_negative_offset(method, gen):
    """Layers keep their cache index: layers 1 and 3 at layer_offset -1 are universal layers
    0 and 2; universal layer 1 is not touched (still poisoned for to_universal)."""
    case, cache = cache_case(gen)
    run_and_check(case, cache, method, IDS, other(case, method, gen, NL=3), layers=range(1, 4, 2), layer_offset=-1)
    run_and_check(case, cache, method, IDS, other(case, method, gen, NL=4, NH=2), layers=slice(None, None, -2),
                  layer_offset=-1, heads=slice(1, 3), head_offset=0)


@pytest.mark.parametrize("method", UNIVERSAL)
def test_layer_offset_below_minus_the_lowest_layer_is_an_error(method, gen):
    case, cache = cache_case(gen)
    refused(case, cache, method, gen, ValueError, "layer_offset", "at least -1", "cache layer 1 at universal layer -1",
            layers=range(1, 4), layer_offset=-2)
    refused(case, cache, method, gen, ValueError, "layer_offset", "at least 0", layer_offset=-1)
    refused(case, cache, method, gen, ValueError, "layer_offset", "at least -2", layers=slice(3, 1, -1),
            layer_offset=-3)
    refused(case, cache, method, gen, ValueError, "layer_offset", "expected an int from", layer_offset=-(2**31))


@pytest.mark.parametrize("method", UNIVERSAL)
def test_packed_universals_one_layer_short_are_refused(method, gen):
    case, cache = cache_case(gen)
    arg = other(case, method, gen, NL=2).arg
    src, dst = (case.buf.bases, arg) if method.startswith("to_") else (arg, case.buf.bases)
    expect_rejected(lambda: invoke(cache, method, IDS, arg, layers=range(1, 4), layer_offset=-1), src, dst,
                    ValueError, r"universals\[0\]", ["NL >= 3"])


# --------------------------------------------------------------------------
# The same rule on a GPU cache (device and pinned universals).
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True], ids=["device", "pinned"])
@pytest.mark.parametrize("layout", ["kbthd", "blkthd"])
def test_gpu_run_of_layers_packs_into_exactly_that_many(layout, pin, gen):
    case, cache = cache_case(gen, layout, device="cuda")
    for method in UNIVERSAL:
        for layers in (range(1, 4), slice(3, 0, -1), 2):
            chosen = selected(NL, layers)
            for form in ("list", "array"):
                run_and_check(case, cache, method, IDS,
                              other(case, method, gen, NL=len(chosen), form=form, pin=pin),
                              layers=layers, layer_offset=-min(chosen), heads=slice(3, 0, -2))


@pytest.mark.gpu
def test_gpu_selection_errors_write_nothing(gen):
    case, cache = cache_case(gen, device="cuda")
    for method in UNIVERSAL:
        refused(case, cache, method, gen, ValueError, "heads", "reaches outside", heads=slice(2, 9))
        refused(case, cache, method, gen, ValueError, "layers", "selects no layer", layers=range(0))
        refused(case, cache, method, gen, TypeError, "heads", "whose __index__ failed", heads=slice(Boom(), None))
        refused(case, cache, method, gen, ValueError, "layer_offset", "at least -1", layers=range(1, 4),
                layer_offset=-2)


# --------------------------------------------------------------------------
# pack_layers=True: the j-th selected layer lands on layer layer_offset + j.
# --------------------------------------------------------------------------

PACK_NL = 7
# Steps 2, 3, -1 and -2, a step -3 range, ints, and a run: each packs into len(layers) layers.
PACKS = [range(1, 7, 2), slice(None, None, 3), slice(None, None, -1), slice(5, 0, -2), range(6, -1, -3), 4, -2,
         range(2, 5)]
SRC_IDS, DST_IDS = [5, 0, 3, 5], [1, 6, 2, 4]


def packed(case, method, gen, nl, form="list", pin=False, NH=None):
    """Universals [NH, nl, no, nt, hd] or operationals [nl, no, nt*nh*hd] of the call's blocks."""
    shape = case.universal_shape(NH, nl) if "universal" in method else (nl, case.no, case.nt * case.nh * case.hd)
    return block_buffers(form, len(IDS), shape, case.dtype, gen, case.device, pin)


def pack_calls(method, layers):
    """(layer_offset, form, kwargs) of the calls a packed selection is tried with: universal
    blocks from layer 0 and from layer 2, operational blocks (no layer_offset) in both
    chunk orders; a list of blocks and one array."""
    if method in UNIVERSAL:
        return [(offset, form, dict(layers=layers, pack_layers=True, layer_offset=offset))
                for offset in (0, 2) for form in ("list", "array")]
    return [(0, form, dict(layers=layers, pack_layers=True, layout=layout))
            for form, layout in (("list", "NHD"), ("array", "HND"))]


def test_packed_reference_is_the_kept_one_gathered(gen):
    """The reference's pack_layers against its keep-index numbering: a packed to_universal
    holds, from layer_offset on, the keep-index one's selected layers in the order selected,
    and nothing below layer_offset."""
    rows = [random_tensor((NB, NO, NT, NH, HD), torch.int16, generator=gen) for _ in range(PACK_NL)]
    for layers in PACKS:
        chosen = selected(PACK_NL, layers)
        kept = poison_([torch.empty((NH, PACK_NL, NO, NT, HD), dtype=torch.int16) for _ in IDS])
        packs = poison_([torch.empty((NH, 2 + len(chosen), NO, NT, HD), dtype=torch.int16) for _ in IDS])
        paged_reference("to_universal", rows, kept, IDS, chosen)
        paged_reference("to_universal", rows, packs, IDS, chosen, layer_offset=2, pack_layers=True)
        for k, p in zip(kept, packs):
            assert torch.equal(p[:, 2:], k[:, chosen]), layers
            assert torch.equal(p[:, :2], poison_(torch.empty_like(p[:, :2]))), layers


@pytest.mark.parametrize("layout", ["kbthd", "blkthd", "lkbthd"])
@pytest.mark.parametrize("layers", PACKS, ids=repr)
@pytest.mark.parametrize("method", METHODS)
def test_pack_layers_fills_exactly_len_layers(method, layers, layout, device, gen):
    """Blocks of exactly layer_offset + len(layers) layers (len(layers) operational), every
    byte checked: layers below layer_offset still poisoned."""
    case, cache = cache_case(gen, layout, device, nl=PACK_NL)
    count = len(selected(PACK_NL, layers))
    for offset, form, kwargs in pack_calls(method, layers):
        run_and_check(case, cache, method, IDS, packed(case, method, gen, offset + count, form), **kwargs)


@pytest.mark.parametrize("method", UNIVERSAL)
def test_pack_layers_with_heads_and_spare_layers(method, device, gen):
    """Layers packed and heads renumbered together, in universals larger than the move: the
    heads and layers not moved are not touched."""
    case, cache = cache_case(gen, "kbthd_padded", device, nl=PACK_NL)
    for layers in (slice(None, None, -2), range(0, 7, 3)):
        count = len(selected(PACK_NL, layers))
        run_and_check(case, cache, method, IDS, packed(case, method, gen, 1 + count + 2, NH=NH + 1), layers=layers,
                      pack_layers=True, layer_offset=1, heads=slice(3, 0, -2), head_offset=2)


@pytest.mark.parametrize("layers", [range(1, 7, 2), slice(None, None, -1), 3], ids=repr)
@pytest.mark.parametrize("method", METHODS)
def test_pack_layers_false_is_the_default(method, layers, device, gen):
    """pack_layers=False keeps the cache index exactly as leaving it out does: a stepped
    selection keeps its gaps (operational layers not selected, universal layers between
    the selected ones, still poisoned)."""
    case, cache = cache_case(gen, "blkthd", device, nl=PACK_NL)
    extra = dict(layer_offset=-min(selected(PACK_NL, layers))) if method in UNIVERSAL else {}
    nl = PACK_NL - min(selected(PACK_NL, layers)) if method in UNIVERSAL else PACK_NL
    for flag in ({}, {"pack_layers": False}):
        run_and_check(case, cache, method, IDS, packed(case, method, gen, nl), layers=layers, **extra, **flag)


# --------------------------------------------------------------------------
# pack_layers errors: before any byte is written.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", UNIVERSAL)
def test_pack_layers_with_a_negative_layer_offset_is_an_error(method, device, gen):
    """Packed layers start at layer_offset: from 0 on, whatever the lowest layer moved (which
    allows -1 without pack_layers)."""
    case, cache = cache_case(gen, device=device, nl=PACK_NL)
    for layers in (range(1, 7, 2), slice(None, None, -1), 3):
        refused(case, cache, method, gen, ValueError, "layer_offset", "-1 is negative", "pack_layers=True",
                "at least 0", layers=layers, layer_offset=-1, pack_layers=True)


@pytest.mark.parametrize("method", METHODS)
def test_pack_layers_blocks_one_layer_short_are_refused(method, device, gen):
    """Sizes are checked against the packed numbering: one layer short is refused naming the
    blocks and the layers they need; operational blocks must hold exactly len(layers)
    layers, so the cache's every layer is refused too."""
    case, cache = cache_case(gen, device=device, nl=PACK_NL)
    layers = slice(5, 0, -2)  # 3 layers
    if method in UNIVERSAL:
        for offset in (0, 2):
            refused(case, cache, method, gen, ValueError, r"universals\[0\]", f"NL >= {offset + 3}", "3 layers moved",
                    "packed", buf=packed(case, method, gen, offset + 2), layers=layers, layer_offset=offset,
                    pack_layers=True)
    else:
        for nl in (2, 4, PACK_NL):
            refused(case, cache, method, gen, ValueError, r"operationals\[0\]", "[3, 2, 60]", "[len(layers)",
                    buf=packed(case, method, gen, nl), layers=layers, pack_layers=True)


class RaisingBool:
    """A pack_layers value whose truth cannot be taken: never asked."""

    asked = 0

    def __bool__(self):
        RaisingBool.asked += 1
        raise ZeroDivisionError("boom from __bool__")


@pytest.mark.parametrize("value", [1, 0, None, "yes", np.bool_(True), RaisingBool()], ids=repr)
@pytest.mark.parametrize("method", METHODS)
def test_pack_layers_takes_true_or_false_only(method, value, gen):
    case, cache = cache_case(gen, nl=PACK_NL)
    refused(case, cache, method, gen, TypeError, "pack_layers", "expected True or False", type(value).__name__,
            layers=range(1, 7, 2), pack_layers=value)
    assert RaisingBool.asked == 0


# --------------------------------------------------------------------------
# to_cache with pack_layers: source layers packed into dst.
# --------------------------------------------------------------------------


def to_cache_and_check(src, src_cache, dst, dst_cache, src_ids=SRC_IDS, dst_ids=DST_IDS, **kwargs):
    """Poison dst, move, compare every byte of both caches' memory with the reference: dst row
    (dst_ids[b], d, o, t, head_offset + j) = src row (src_ids[b], l, o, t, heads[j]) for the
    k-th selected layer l, d = layer_offset + (k with pack_layers, else l)."""
    poison_(dst.buf.bases)
    sync()
    src_before, want = snapshot(src.buf.bases), snapshot(dst.buf.bases)
    assert src_cache.to_cache(dst_cache, src_ids, dst_ids, **kwargs) is None
    sync()
    src_rows, dst_rows = cache_rows(src.buf.make(src_before), src.dims), cache_rows(dst.buf.make(want), dst.dims)
    offset, head_offset = kwargs.get("layer_offset", 0), kwargs.get("head_offset", 0)
    for s, t in zip(src_ids, dst_ids):
        for k, l in enumerate(selected(src.nl, kwargs.get("layers"))):
            d = offset + (k if kwargs.get("pack_layers") else l)
            for j, h in enumerate(selected(src.nh, kwargs.get("heads"))):
                dst_rows[d][t][:, :, head_offset + j] = src_rows[l][s][:, :, h]
    for i, (got, w) in enumerate(zip(dst.buf.bases, want)):
        assert_bitwise_equal(as_int(got), w, f"dst memory #{i}")
    for i, (got, w) in enumerate(zip(src.buf.bases, src_before)):
        assert_bitwise_equal(as_int(got), w, f"src memory #{i}")


def two_caches(gen, src_layout, dst_layout, dst_nl, device="cpu", src_pin=False, dst_pin=False):
    src, src_cache = cache_case(gen, src_layout, device, nl=PACK_NL, pin=src_pin)
    dst, dst_cache = cache_case(gen, dst_layout, device, nl=dst_nl, pin=dst_pin)
    return src, src_cache, dst, dst_cache


# (source layout, dst layout, the call's selection and offsets)
TO_CACHE_PACKS = [
    ("kbthd", "blkthd", dict(layers=range(1, 7, 2))),
    ("blkthd", "kbthd", dict(layers=slice(None, None, -1))),
    ("lkbthd", "kbthd_shared", dict(layers=slice(5, 0, -2), layer_offset=1, heads=slice(3, 0, -2), head_offset=1)),
    ("kbthd", "lkbthd", dict(layers=-2, layer_offset=2)),
    ("kbthd_hnd", "kbthd", dict(layers=range(6, -1, -3), layer_offset=1)),
    ("blkthd", "blkthd", dict(layers=slice(None, None, 3))),
]


@pytest.mark.parametrize("spare", [0, 1], ids=["exact", "one spare layer"])
@pytest.mark.parametrize("src_layout,dst_layout,kwargs", TO_CACHE_PACKS,
                         ids=[f"{s}-to-{d}-{k['layers']!r}" for s, d, k in TO_CACHE_PACKS])
def test_to_cache_packs_layers(src_layout, dst_layout, kwargs, spare, device, gen):
    """dst has exactly layer_offset + len(layers) layers (or one more, not touched)."""
    count = len(selected(PACK_NL, kwargs["layers"]))
    src, src_cache, dst, dst_cache = two_caches(gen, src_layout, dst_layout,
                                                kwargs.get("layer_offset", 0) + count + spare, device)
    to_cache_and_check(src, src_cache, dst, dst_cache, pack_layers=True, **kwargs)


def test_to_cache_keeps_the_index_by_default(device, gen):
    """Without pack_layers, a stepped selection keeps its gaps in dst, with pack_layers=False
    as without it."""
    src, src_cache, dst, dst_cache = two_caches(gen, "kbthd", "blkthd", PACK_NL + 1, device)
    for flag in ({}, {"pack_layers": False}):
        to_cache_and_check(src, src_cache, dst, dst_cache, layers=range(1, 7, 2), layer_offset=1, **flag)
        to_cache_and_check(src, src_cache, dst, dst_cache, layers=slice(None, None, -2), **flag)


def to_cache_refused(src_cache, dst, dst_cache, exc, path, *words, **kwargs):
    """The call raises `exc` naming `path` with `words`, and dst's memory is still poisoned."""
    poison_(dst.buf.bases)
    sync()
    before = snapshot(dst.buf.bases)
    with pytest.raises(exc, match=path_regex(path)) as info:
        src_cache.to_cache(dst_cache, SRC_IDS, DST_IDS, **kwargs)
    sync()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    for i, (got, w) in enumerate(zip(dst.buf.bases, before)):
        assert_bitwise_equal(as_int(got), w, f"dst memory #{i} after a refused call")


def test_to_cache_pack_layers_errors_write_nothing(device, gen):
    src, src_cache, dst, dst_cache = two_caches(gen, "kbthd", "blkthd", 3, device)
    to_cache_refused(src_cache, dst, dst_cache, ValueError, "layer_offset", "at least 0", layers=range(1, 7, 2),
                     layer_offset=-1, pack_layers=True)
    to_cache_refused(src_cache, dst, dst_cache, ValueError, "layer_offset", "land on dst layers 1 to 3 (packed)",
                     "dst has layers 0 to 2", layers=range(1, 7, 2), layer_offset=1, pack_layers=True)
    to_cache_refused(src_cache, dst, dst_cache, ValueError, "layer_offset", "land on dst layers 0 to 3 (packed)",
                     layers=slice(None, None, -2), pack_layers=True)
    to_cache_refused(src_cache, dst, dst_cache, TypeError, "pack_layers", "expected True or False", pack_layers=1)
    # Without pack_layers the same selection keeps its index: layer 5 is past dst's 3 layers.
    to_cache_refused(src_cache, dst, dst_cache, ValueError, "layer_offset", "land on dst layers 1 to 5, but",
                     layers=range(1, 7, 2))


# --------------------------------------------------------------------------
# GPU: pinned blocks and caches, staged and by the kernel.
# --------------------------------------------------------------------------


def debug_paths(caplog, monkeypatch, run):
    """The paths KVBM_EXT_DEBUG names for the calls run() makes (staged, kernel, ...)."""
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        run()
    monkeypatch.delenv("KVBM_EXT_DEBUG")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext" and ": path " in r.getMessage()]
    return [line.split(": path ", 1)[1].split(" ", 1)[0] for line in lines]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,path", [("auto", "staged"), ("copy_engines", "staged"), ("kernel", "kernel")])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_pack_layers_with_pinned_blocks(method, backend, path, gen, caplog, monkeypatch):
    """A device cache and pinned universals or operationals: the copy engines stage the
    packed layers (the staged path's unit stride is the packed layer's), or the kernel
    reads and writes pinned memory; both exact."""
    case, cache = cache_case(gen, "blkthd", "cuda", nl=PACK_NL)
    for layers in (range(1, 7, 2), slice(None, None, -1), slice(5, 0, -2), 4):
        count = len(selected(PACK_NL, layers))
        for offset, form, kwargs in pack_calls(method, layers):
            buf = packed(case, method, gen, offset + count, form, pin=True)
            seen = debug_paths(caplog, monkeypatch, lambda: run_and_check(case, cache, method, IDS, buf,
                                                                         backend=backend, **kwargs))
            assert seen == [path], (layers, offset, form, seen)


# Every head moved: the pinned cache's rows of a block and layer stay one run, which staging needs.
PINNED_PACKS = [
    ("kbthd", "blkthd", dict(layers=range(1, 7, 2))),
    ("blkthd", "kbthd", dict(layers=slice(None, None, -1))),
    ("blkthd", "lkbthd", dict(layers=slice(5, 0, -2), layer_offset=1)),
    ("kbthd", "blkthd", dict(layers=-2, layer_offset=2)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,path", [("auto", "staged"), ("kernel", "kernel")])
@pytest.mark.parametrize("pinned", ["dst", "src"])
@pytest.mark.parametrize("src_layout,dst_layout,kwargs", PINNED_PACKS,
                         ids=[f"{s}-to-{d}-{k['layers']!r}" for s, d, k in PINNED_PACKS])
def test_gpu_to_cache_packs_layers_with_a_pinned_cache(src_layout, dst_layout, kwargs, pinned, backend, path, gen,
                                                       caplog, monkeypatch):
    """One cache on the device, the other in pinned host memory, ids on the host: staged
    (the pinned dst's layer stride is the packed one) or the kernel; both exact."""
    count = len(selected(PACK_NL, kwargs["layers"]))
    src, src_cache, dst, dst_cache = two_caches(gen, src_layout, dst_layout, kwargs.get("layer_offset", 0) + count,
                                                "cuda", src_pin=pinned == "src", dst_pin=pinned == "dst")
    seen = debug_paths(caplog, monkeypatch, lambda: to_cache_and_check(src, src_cache, dst, dst_cache,
                                                                        pack_layers=True, backend=backend, **kwargs))
    assert seen == [path], seen


@pytest.mark.gpu
def test_gpu_to_cache_packs_layers_with_device_ids(gen):
    """Device to device with the ids on the device (int32 and int64): one kernel launch."""
    src, src_cache, dst, dst_cache = two_caches(gen, "kbthd", "blkthd", 3, "cuda")
    for dtype in (torch.int32, torch.int64):
        poison_(dst.buf.bases)
        sync()
        src_before, want = snapshot(src.buf.bases), snapshot(dst.buf.bases)
        src_cache.to_cache(dst_cache, torch.tensor(SRC_IDS, dtype=dtype, device="cuda"),
                           torch.tensor(DST_IDS, dtype=dtype, device="cuda"), layers=slice(None, None, -3),
                           pack_layers=True)
        sync()
        src_rows, dst_rows = cache_rows(src.buf.make(src_before), src.dims), cache_rows(dst.buf.make(want), dst.dims)
        for s, t in zip(SRC_IDS, DST_IDS):
            for k, l in enumerate(selected(PACK_NL, slice(None, None, -3))):
                dst_rows[k][t].copy_(src_rows[l][s])
        for i, (got, w) in enumerate(zip(dst.buf.bases, want)):
            assert_bitwise_equal(as_int(got), w, f"dst memory #{i} ({dtype})")
