"""Every error of the spec's Errors section, on host arrays (runs without a GPU).

Each bad call is checked for: the exception type, a message that STARTS with the
argument path (e.g. "blocks[1][3]"), the spec's key words, every destination
array still fully poisoned (no byte written) and every source array unchanged.
The bad item is never the first array, so a library that validates lazily while
copying would already have written earlier blocks.
"""

import re

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_poisoned,
    b2u_and_check,
    call,
    check_rejected,
    expect_rejected,
    path_regex,
    poison_,
    poison_even_if_read_only,
    u2b_and_check,
)
from support.builders import make_case, random_tensor, read_only_copy
from support.producers import ArrayInterfaceOnly
from support.references import chunk_shape

DIRECTIONS = ["b2u", "u2b"]

# nt != nh so that NHD and HND chunk shapes differ.
NB, NL, NO, NH, NT, HD = 3, 2, 2, 3, 4, 5


def case(gen, layout="NHD", dtype=torch.float32, nb=NB):
    return make_case(nb, NL, NO, NH, NT, HD, dtype, layout, generator=gen)


# --------------------------------------------------------------------------
# TypeError: containers and non-arrays.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, None, object(), 2.5], ids=["int", "None", "object", "float"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_blocks_not_a_sequence(direction, bad, gen):
    _, universals = case(gen)
    check_rejected(direction, bad, universals, TypeError, "blocks")


@pytest.mark.parametrize("bad", [7, None, object()], ids=["int", "None", "object"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_inner_blocks_not_a_sequence(direction, bad, gen):
    blocks, universals = case(gen)
    blocks[1] = bad
    check_rejected(direction, blocks, universals, TypeError, r"blocks\[1\]")


@pytest.mark.parametrize("bad", [5, None, object()], ids=["int", "None", "object"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_universals_neither_array_nor_sequence(direction, bad, gen):
    blocks, _ = case(gen)
    check_rejected(direction, blocks, bad, TypeError, "universals")


@pytest.mark.parametrize(
    "where,bad,path",
    [
        ("block", "abc", r"blocks\[1\]\[2\]"),
        ("block", None, r"blocks\[1\]\[2\]"),
        ("block", 3, r"blocks\[1\]\[2\]"),
        ("universal", 3, r"universals\[1\]"),
        ("universal", "abc", r"universals\[1\]"),
        ("universal", None, r"universals\[1\]"),
    ],
    ids=["block-str", "block-None", "block-int", "universal-int", "universal-str", "universal-None"],
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_array_object(direction, where, bad, path, gen):
    blocks, universals = case(gen)
    if where == "block":
        blocks[1][2] = bad
    else:
        universals[1] = bad
    check_rejected(direction, blocks, universals, TypeError, path)


# --------------------------------------------------------------------------
# ValueError: counts.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n_blocks,n_universals", [(3, 2), (2, 3), (0, 1), (1, 0)])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_outer_count_mismatch(direction, n_blocks, n_universals, gen):
    blocks, universals = case(gen)
    check_rejected(
        direction, blocks[:n_blocks], universals[:n_universals], ValueError, "(blocks|universals)"
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_outer_count_mismatch_single_5d_universal(direction, gen):
    blocks, universals = case(gen)
    check_rejected(direction, blocks[:2], universals[0], ValueError, "(blocks|universals)")


@pytest.mark.parametrize("delta", [-1, +1, -3], ids=["one-missing", "one-extra", "only-one"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_inner_count_mismatch(direction, delta, gen):
    blocks, universals = case(gen)
    if delta < 0:
        blocks[1] = blocks[1][:delta]
    else:
        blocks[1] = blocks[1] + [torch.empty_like(blocks[1][0])]
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[1\]")


# --------------------------------------------------------------------------
# ValueError: shapes.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_chunk_of_the_other_layout(direction, layout, gen):
    blocks, universals = case(gen, layout)
    other = "HND" if layout == "NHD" else "NHD"
    expected, wrong = chunk_shape(NH, NT, HD, layout), chunk_shape(NH, NT, HD, other)
    blocks[1][3] = random_tensor(wrong, torch.float32, generator=gen)
    check_rejected(
        direction, blocks, universals, ValueError, r"blocks\[1\]\[3\]",
        "expected", str(expected), "got", str(wrong), layout=layout,
    )


@pytest.mark.parametrize(
    "wrong",
    [(NT, NH, HD + 1), (NT + 1, NH, HD), (NT, NH - 1, HD), (NT, NH * HD), (1, NT, NH, HD)],
    ids=["hd+1", "nt+1", "nh-1", "2d", "4d"],
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_chunk_wrong_shape_nhd(direction, wrong, gen):
    blocks, universals = case(gen, "NHD")
    blocks[2][1] = random_tensor(wrong, torch.float32, generator=gen)
    check_rejected(
        direction, blocks, universals, ValueError, r"blocks\[2\]\[1\]",
        "expected", str((NT, NH, HD)), "got", str(wrong), layout="NHD",
    )


@pytest.mark.parametrize(
    "wrong", [(NH, NT, HD - 1), (NH + 1, NT, HD), (NH, NT * HD)], ids=["hd-1", "nh+1", "2d"]
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_chunk_wrong_shape_hnd(direction, wrong, gen):
    blocks, universals = case(gen, "HND")
    blocks[1][0] = random_tensor(wrong, torch.float32, generator=gen)
    check_rejected(
        direction, blocks, universals, ValueError, r"blocks\[1\]\[0\]",
        "expected", str((NH, NT, HD)), "got", str(wrong), layout="HND",
    )


@pytest.mark.parametrize(
    "wrong",
    [(NH, NL, NO, NT + 1, HD), (NH, NL, NO, NT, HD + 2), (NH + 1, NL, NO, NT, HD), (NH, NL, NO * NT, HD)],
    ids=["nt+1", "hd+2", "nh+1", "4d"],
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_universals_of_different_shapes(direction, wrong, gen):
    blocks, universals = case(gen)  # blocks match universals[0]: universals[2] is the odd one out
    universals[2] = random_tensor(wrong, torch.float32, generator=gen)
    check_rejected(direction, blocks, universals, ValueError, r"universals\[2\]")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_first_universal_not_5d(direction, gen):
    blocks, universals = case(gen)
    universals[0] = random_tensor((NH, NL * NO, NT, HD), torch.float32, generator=gen)
    check_rejected(direction, blocks, universals, ValueError, r"universals\[0\]")


# --------------------------------------------------------------------------
# TypeError: element types.
# --------------------------------------------------------------------------

MIXED_TYPES = [
    (torch.bfloat16, torch.float16, [re.compile(r"bf16|bfloat16"), re.compile(r"(?<!b)(f16|float16|half)")]),
    (torch.float32, torch.int32, [re.compile(r"f32|float32"), re.compile(r"i32|int32")]),
    (torch.int8, torch.uint8, []),
    (torch.float8_e4m3fn, torch.int8, []),
    (torch.float64, torch.int64, []),
]


@pytest.mark.parametrize("common,odd,names", MIXED_TYPES, ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else "")
@pytest.mark.parametrize("where", ["block", "universal"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixed_element_types(direction, where, common, odd, names, gen):
    blocks, universals = case(gen, dtype=common)
    if where == "block":
        blocks[1][2] = random_tensor(blocks[1][2].shape, odd, generator=gen)
        path = r"blocks\[1\]\[2\]"
    else:
        universals[1] = random_tensor(universals[1].shape, odd, generator=gen)
        path = r"universals\[1\]"
    check_rejected(direction, blocks, universals, TypeError, path, *names)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixed_element_types_numpy(direction, gen):
    blocks, universals = case(gen, dtype=torch.float16)
    blocks = [[c.numpy() for c in chunks] for chunks in blocks]
    universals = [u.numpy() for u in universals]
    blocks[2][3] = blocks[2][3].view(np.int16)  # same size, other type
    check_rejected(direction, blocks, universals, TypeError, r"blocks\[2\]\[3\]")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unsupported_element_size_complex128(direction, gen):
    """complex128 has itemsize 16; the spec allows sizes 1, 2, 4, 8 only."""
    blocks, universals = case(gen, dtype=torch.complex128)
    assert universals[0].element_size() == 16
    check_rejected(direction, blocks, universals, TypeError, r"(blocks\[0\]\[0\]|universals\[0\])")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unsupported_element_size_numpy_complex128(direction, gen):
    blocks, universals = case(gen, dtype=torch.complex128)
    blocks = [[c.numpy() for c in chunks] for chunks in blocks]
    universals = [u.numpy() for u in universals]
    check_rejected(direction, blocks, universals, TypeError, r"(blocks\[0\]\[0\]|universals\[0\])")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unsupported_element_size_3_bytes(direction, gen):
    """A 3-byte element ('|V3') offered through __array_interface__."""

    def v3(shape):
        raw = random_tensor(tuple(shape[:-1]) + (shape[-1] * 3,), torch.uint8, generator=gen).numpy()
        a = raw.view("V3")
        assert a.shape == tuple(shape) and a.itemsize == 3
        return a

    arrays_b = [[v3(chunk_shape(NH, NT, HD, "NHD")) for _ in range(NL * NO)] for _ in range(NB)]
    arrays_u = [v3((NH, NL, NO, NT, HD)) for _ in range(NB)]
    blocks = [[ArrayInterfaceOnly(a) for a in chunks] for chunks in arrays_b]
    universals = [ArrayInterfaceOnly(a) for a in arrays_u]
    dest_raw = arrays_u if direction == "b2u" else [a for chunks in arrays_b for a in chunks]
    for a in dest_raw:
        a.view(np.uint8)[...] = 0xA5
    with pytest.raises(TypeError, match=path_regex(r"(blocks\[0\]\[0\]|universals\[0\])")):
        call(direction, blocks, universals)
    for a in dest_raw:
        assert (a.view(np.uint8) == 0xA5).all()


# --------------------------------------------------------------------------
# ValueError: contiguity.
# --------------------------------------------------------------------------


def _transposed_chunk(gen):
    """Shape (NT, NH, HD) but strides of a transposed (NH, NT, HD) tensor."""
    t = random_tensor((NH, NT, HD), torch.float32, generator=gen).transpose(0, 1)
    assert t.shape == (NT, NH, HD) and not t.is_contiguous()
    return t


def _strided_chunk(gen):
    """Shape (NT, NH, HD) taken with step 2 along the last dim."""
    t = random_tensor((NT, NH, 2 * HD), torch.float32, generator=gen)[..., ::2]
    assert t.shape == (NT, NH, HD) and not t.is_contiguous()
    return t


def _numpy_strided_chunk(gen):
    a = random_tensor((2 * NT, NH, HD), torch.float32, generator=gen).numpy()[::2]
    assert a.shape == (NT, NH, HD) and not a.flags.c_contiguous
    return a


@pytest.mark.parametrize("maker", [_transposed_chunk, _strided_chunk, _numpy_strided_chunk], ids=["transposed", "step2", "numpy-step2"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_contiguous_chunk(direction, maker, gen):
    blocks, universals = case(gen, "NHD")
    blocks[1][2] = maker(gen)
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[1\]\[2\]", "contiguous")


@pytest.mark.parametrize("kind", ["step2", "permuted", "numpy-step2"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_contiguous_universal(direction, kind, gen):
    blocks, universals = case(gen)
    shape = (NH, NL, NO, NT, HD)
    if kind == "step2":
        u = random_tensor((NH, NL, NO, NT, 2 * HD), torch.float32, generator=gen)[..., ::2]
    elif kind == "permuted":
        u = random_tensor((NL, NH, NO, NT, HD), torch.float32, generator=gen).transpose(0, 1)
    else:
        u = random_tensor((NH, NL, NO, 2 * NT, HD), torch.float32, generator=gen).numpy()[:, :, :, ::2]
    assert tuple(u.shape) == shape
    universals[1] = u
    check_rejected(direction, blocks, universals, ValueError, r"universals\[1\]", "contiguous")


# --------------------------------------------------------------------------
# ValueError: read-only destination.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["numpy", "array_interface", "memoryview"])
def test_read_only_destination_block(protocol, gen):
    blocks, universals = case(gen)
    ro = read_only_copy(blocks[1][1])
    blocks[1][1] = ro
    if protocol == "array_interface":
        blocks[1][1] = ArrayInterfaceOnly(ro)
    elif protocol == "memoryview":
        blocks[1][1] = memoryview(ro)
    poison_even_if_read_only(ro)
    check_rejected("u2b", blocks, universals, ValueError, r"blocks\[1\]\[1\]", "read-only")
    assert_poisoned(ro)


@pytest.mark.parametrize("protocol", ["numpy", "array_interface", "memoryview"])
def test_read_only_destination_universal(protocol, gen):
    blocks, universals = case(gen)
    ro = read_only_copy(universals[1])
    universals[1] = ro
    if protocol == "array_interface":
        universals[1] = ArrayInterfaceOnly(ro)
    elif protocol == "memoryview":
        universals[1] = memoryview(ro)
    poison_even_if_read_only(ro)
    check_rejected("b2u", blocks, universals, ValueError, r"universals\[1\]", "read-only")
    assert_poisoned(ro)


def test_read_only_single_5d_destination(gen):
    blocks, universals = case(gen, nb=1)
    ro = read_only_copy(universals[0])
    poison_even_if_read_only(ro)
    check_rejected("b2u", blocks, ro, ValueError, r"universals(\[0\])?", "read-only")


# --------------------------------------------------------------------------
# layout.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["XYZ", "", "NDH", "NHD ", "HN"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unknown_layout(direction, bad, gen):
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, ValueError, "layout", "NHD", "HND", layout=bad)


@pytest.mark.parametrize("bad", [1, None, b"NHD", ["NHD"]], ids=["int", "None", "bytes", "list"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_layout_not_a_str(direction, bad, gen):
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, TypeError, "layout", layout=bad)


# --------------------------------------------------------------------------
# stream.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["abc", 1.5, object(), [1]], ids=["str", "float", "object", "list"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_bad_stream_argument(direction, bad, gen):
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, TypeError, "stream", stream=bad)


class IndexOnly:
    """An int-like object: nothing but __index__."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


STREAM_INTS = {"np.uint64(0)": np.uint64(0), "np.uint64(2**64-2)": np.uint64(2**64 - 2), "np.int64(7)": np.int64(7),
               "np.int32(1)": np.int32(1), "__index__": IndexOnly(3)}


@pytest.mark.parametrize("stream", STREAM_INTS.values(), ids=STREAM_INTS.keys())
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stream_with_index_is_a_handle_like_an_int(direction, stream, gen):
    """A stream handle given as an object with __index__ (NumPy integer scalars) is taken
    as the int it stands for: host calls, which run on the CPU, then refuse it as an
    option only a GPU move takes (a value that is no handle is refused as such)."""
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, ValueError, "stream", "orders a GPU move", stream=stream)


def test_paged_stream_with_index_is_a_handle_like_an_int(gen):
    layers = [torch.randn((2, 4, NT, NH, HD), generator=gen) for _ in range(NL)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    universals = [torch.full((NH, NL, 2, NT, HD), -3.5) for _ in range(2)]
    with pytest.raises(ValueError, match=path_regex("stream")) as info:
        cache.to_universal([3, 0], universals, stream=np.uint64(0))
    assert "orders a GPU move" in str(info.value), str(info.value)
    assert all(torch.equal(u, torch.full_like(u, -3.5)) for u in universals)


@pytest.mark.parametrize("bad,exc", [(IndexOnly(2**64), ValueError), (IndexOnly(-1), ValueError),
                                     (np.uint64(2**64 - 1), ValueError), (True, TypeError), (np.float64(1.0), TypeError)],
                         ids=["2**64", "-1", "2**64-1", "bool", "np.float64"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stream_index_out_of_range_or_not_an_int(direction, bad, exc, gen):
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, exc, "stream", stream=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stream_is_keyword_only(direction, gen):
    blocks, universals = case(gen)
    poison_(universals if direction == "b2u" else blocks)
    if direction == "b2u":
        with pytest.raises(TypeError):
            kvbm_ext.block_to_universal(blocks, universals, "NHD", None)
        assert_poisoned(universals)
    else:
        with pytest.raises(TypeError):
            kvbm_ext.universal_to_block(universals, blocks, "NHD", None)
        assert_poisoned(blocks)


# --------------------------------------------------------------------------
# Universals as one [nb, nh, nl, no, nt, hd] array: its leading dimension is nb.
# --------------------------------------------------------------------------


def stacked_case(gen, layout="NHD", dtype=torch.float32):
    blocks, universals = case(gen, layout, dtype)
    return blocks, torch.stack(universals)


@pytest.mark.parametrize("leading", [NB - 1, NB + 1, 0])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_leading_dimension_not_nb(direction, leading, gen):
    blocks, stack = stacked_case(gen)
    wrong = torch.cat([stack, stack])[:leading]
    msg = check_rejected(direction, blocks, wrong, ValueError, "universals", "leading dimension")
    assert f"has {leading} blocks" in msg and f"blocks has {NB}" in msg, msg


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_universals_of_seven_dimensions(direction, gen):
    blocks, stack = stacked_case(gen)
    check_rejected(direction, blocks, stack.unsqueeze(0), ValueError, "universals", "6-D", "[nb, nh, nl, no, nt, hd]")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_blocks_not_contiguous(direction, gen):
    blocks, stack = stacked_case(gen)
    swapped = stack.transpose(4, 5).contiguous().transpose(4, 5)
    assert not swapped[0].is_contiguous()
    check_rejected(direction, blocks, swapped, ValueError, "universals", "C-contiguous")


@pytest.mark.parametrize(
    "kind", ["repeated", "half-overlap", "numpy-backwards"],
)
def test_stacked_destination_blocks_overlap_or_run_backwards(kind, gen):
    blocks, stack = stacked_case(gen)
    block = stack[0].numel()
    if kind == "repeated":
        dst, word = stack[0].unsqueeze(0).expand(stack.shape), "overlap"
    elif kind == "half-overlap":
        room = torch.empty(block * NB)
        dst, word = room.as_strided(stack.shape, (block // 2,) + stack[0].stride()), "overlap"
    else:
        dst, word = stack.numpy()[::-1], "run backwards"
    check_rejected("b2u", blocks, dst, ValueError, "universals", word)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_of_another_element_type(direction, gen):
    blocks, stack = stacked_case(gen)
    check_rejected(direction, blocks, stack.to(torch.int32), TypeError, r"blocks\[0\]\[0\]", "differs")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_overlapping_a_chunk(direction, gen):
    blocks, stack = stacked_case(gen)
    blocks[1][2] = stack[2].reshape(-1)[: blocks[1][2].numel()].view(blocks[1][2].shape)
    check_rejected(direction, blocks, stack, ValueError, "(universals|blocks\\[1\\]\\[2\\])", "shares memory")


# --------------------------------------------------------------------------
# Devices that cannot be read, named with their argument.
# --------------------------------------------------------------------------


class OtherDevice:
    """A DLPack producer on a device kvbm_ext cannot read (DLPack device type `type`)."""

    def __init__(self, t, type):
        self.t, self.type = t, type

    def __dlpack__(self, **kwargs):
        raise AssertionError("__dlpack__ of an unreadable device called")

    def __dlpack_device__(self):
        return (self.type, 0)


@pytest.mark.parametrize("where", ["blocks", "universals"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_meta_tensor_named_with_its_argument(direction, where, gen):
    blocks, universals = case(gen)
    args_blocks, args_universals = [list(chunks) for chunks in blocks], list(universals)
    if where == "blocks":
        args_blocks[1][2] = torch.empty(blocks[1][2].shape, device="meta")
        path = r"blocks\[1\]\[2\]"
    else:
        args_universals[1] = torch.empty(universals[1].shape, device="meta")
        path = r"universals\[1\]"
    src, dst = (blocks, universals) if direction == "b2u" else (universals, blocks)
    msg = expect_rejected(lambda: call(direction, args_blocks, args_universals), src, dst, ValueError, path,
                          ("on device meta", "cannot read"))
    assert "Unknown device type" not in msg.split("(")[0], msg


def test_meta_stack_and_meta_address_list(gen):
    blocks, stack = stacked_case(gen)
    meta = torch.empty(stack.shape, device="meta")
    expect_rejected(lambda: call("b2u", blocks, meta), blocks, [], ValueError, "universals", ("on device meta",))
    with pytest.raises(ValueError, match=path_regex("src_ptrs") + ".*on device meta"):
        kvbm_ext.vectorized_copy(torch.empty(2, dtype=torch.int64, device="meta"), [1, 2], 8)


@pytest.mark.parametrize("type,name", [(4, "OpenCL"), (10, "ROCm"), (14, "oneAPI"), (99, "99")])
def test_other_dlpack_device_named(type, name, gen):
    blocks, universals = case(gen)
    universals[2] = OtherDevice(universals[2], type)
    msg = check_rejected("u2b", blocks, universals, ValueError, r"universals\[2\]", "cannot read")
    assert name in msg, msg


# --------------------------------------------------------------------------
# Ints: anything with __index__ (np.int64 ...), never a bool.
# --------------------------------------------------------------------------


class Index:
    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


class RaisingIndex:
    def __index__(self):
        raise ZeroDivisionError("hostile __index__")


@pytest.mark.parametrize("value", [np.int64(3), np.uint8(3), np.int32(3), torch.tensor(3), Index(3)],
                         ids=["np.int64", "np.uint8", "np.int32", "torch-0d", "__index__"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_num_ctas_takes_any_index_int(direction, value, gen):
    """Read as the int it stands for (the message gives it back): host calls, which run on
    the CPU, then refuse it as an option only a GPU move takes."""
    blocks, universals = case(gen)
    check_rejected(direction, blocks, universals, ValueError, "num_ctas", "num_ctas: 3 bounds the CUDA blocks",
                   num_ctas=value)


@pytest.mark.parametrize("bad,exc", [(True, TypeError), (np.True_, TypeError), (2.0, TypeError),
                                     (np.float32(2), TypeError), (RaisingIndex(), TypeError), (0, ValueError),
                                     (np.uint64(2**64 - 1), ValueError)],
                         ids=["True", "np.True_", "float", "np.float32", "raising-index", "zero", "2**64-1"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_num_ctas_rejects_bools_floats_and_out_of_range(direction, bad, exc, gen):
    blocks, universals = case(gen)
    msg = check_rejected(direction, blocks, universals, exc, "num_ctas", num_ctas=bad)
    if isinstance(bad, RaisingIndex):
        assert "ZeroDivisionError: hostile __index__" in msg, msg


def test_raising_index_is_the_cause(gen):
    blocks, universals = case(gen)
    with pytest.raises(TypeError, match=path_regex("num_ctas")) as info:
        kvbm_ext.block_to_universal(blocks, universals, num_ctas=RaisingIndex())
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_staging_settings_take_any_index_int():
    """Ends on the defaults (96 MiB, 2 lanes), which the other tests assume."""
    kvbm_ext.set_staging(np.int64(64 << 20), lanes=np.int32(3))
    kvbm_ext.set_staging(Index(96 << 20), lanes=Index(2))
    with pytest.raises(TypeError, match=path_regex("lanes")):
        kvbm_ext.set_staging(lanes=True)
    with pytest.raises(ValueError, match=path_regex("size_bytes")):
        kvbm_ext.set_staging(np.int64(1))
    if kvbm_ext.cuda_devices():
        info = kvbm_ext.staging_info()
        assert (info["size_bytes"], info["lanes"]) == (96 << 20, 2)


# --------------------------------------------------------------------------
# Raw copies: the lists' ints, and what happens without a GPU.
# --------------------------------------------------------------------------

RAW = ["vectorized_copy", "memcpy_batch"]


@pytest.mark.parametrize("fn", RAW)
def test_raw_copy_list_entries_of_the_wrong_kind(fn):
    a, b = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    f = getattr(kvbm_ext, fn)
    for bad, exc, path in [(True, TypeError, r"dst_ptrs\[1\]"), (np.True_, TypeError, r"dst_ptrs\[1\]"),
                           (1.0, TypeError, r"dst_ptrs\[1\]"), (-1, ValueError, r"dst_ptrs\[1\]"),
                           (np.int64(-8), ValueError, r"dst_ptrs\[1\]"), (2**64, ValueError, r"dst_ptrs\[1\]"),
                           (RaisingIndex(), TypeError, r"dst_ptrs\[1\]")]:
        with pytest.raises(exc, match=path_regex(path)):
            f([a.ctypes.data, a.ctypes.data + 8], [b.ctypes.data, bad], 8)
    with pytest.raises(TypeError, match=path_regex("sizes")):
        f([a.ctypes.data], [b.ctypes.data], True)
    with pytest.raises(TypeError, match=path_regex("sizes")):
        f([a.ctypes.data], [b.ctypes.data], np.float64(8))
    with pytest.raises(ValueError, match=path_regex("sizes")):
        f([a.ctypes.data], [b.ctypes.data], np.int64(-8))
    with pytest.raises(ValueError, match=path_regex("sizes")):
        f([a.ctypes.data], [b.ctypes.data], np.array([8, 8], np.int64))
    assert not b.any()


@pytest.mark.skipif(bool(kvbm_ext.cuda_devices()), reason="a GPU is visible")
@pytest.mark.parametrize(
    "forms", ["ints", "np.int64 items", "np.uint64 items", "arrays", "np scalar size"],
)
@pytest.mark.parametrize("fn", RAW)
def test_raw_copy_without_a_gpu_says_a_device_is_needed(fn, forms):
    a, b = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    src = np.array([a.ctypes.data, a.ctypes.data + 32], np.uint64)
    dst = np.array([b.ctypes.data, b.ctypes.data + 32], np.uint64)
    sizes = 16
    if forms == "ints":
        src, dst = [int(x) for x in src], [int(x) for x in dst]
    elif forms == "np.int64 items":
        src, dst = list(src.astype(np.int64)), list(dst.astype(np.int64))
    elif forms == "np.uint64 items":
        src, dst = list(src), list(dst)
    elif forms == "np scalar size":
        src, dst, sizes = list(src), list(dst), np.int64(16)
    with pytest.raises(RuntimeError, match=f"^{fn} needs a CUDA device") as info:
        getattr(kvbm_ext, fn)(src, dst, sizes)
    built = "built without CUDA" if kvbm_ext.is_using_stubs() else "none is visible"
    assert built in str(info.value) and "cannot query" not in str(info.value)
    assert not b.any()
