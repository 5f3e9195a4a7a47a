"""PagedKVCache's layers= and heads= selections: one rule for both.

None (every entry), an index (Python's rules for a negative one), a slice (Python's rules
for negative bounds and steps, but a bound outside the cache is an error rather than
clipped) or a range of indices; never empty. A slice bound whose __index__ raises is a
TypeError naming the argument with the caller's exception as its cause. Layers keep their
cache index (universal layer = cache layer + layer_offset) while heads are renumbered from
head_offset; layer_offset may be negative down to minus the lowest layer moved, so that a
run of layers packs into a universal block of exactly that many layers.

Every call's destination is poisoned and compared byte for byte with the torch reference
(paged_reference.py); every refused call is checked to have written nothing.
"""

import numpy as np
import pytest
import torch

from support.asserts import invoke, run_and_check
from support.builders import CacheCase, METHODS, block_buffers
from support.references import selected
from support.asserts import expect_rejected

pytest.mark.gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch")

NL, NB, NO, NH, NT, HD = 4, 7, 2, 4, 3, 5
IDS = [5, 0, 3]
UNIVERSAL = ["to_universal", "from_universal"]


class Boom:
    """A slice bound whose __index__ raises."""

    def __index__(self):
        raise ZeroDivisionError("boom from __index__")


def cache_case(gen, layout="kbthd", device="cpu"):
    case = CacheCase(layout, NL, NB, NO, NH, NT, HD, torch.bfloat16, gen, device)
    return case, case.build()


def other(case, method, gen, nb=len(IDS), NH=None, NL=None, form="list", pin=False):
    shape = case.universal_shape(NH, NL) if "universal" in method else case.operational_shape()
    return block_buffers(form, nb, shape, case.dtype, gen, case.device, pin)


def refused(case, cache, method, gen, exc, path, *words, **kwargs):
    """The call raises `exc` naming `path`, writing no destination byte; returns the exception."""
    arg = other(case, method, gen).arg
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
