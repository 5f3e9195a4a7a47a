"""Host-memory conversions: torch CPU tensors, NumPy arrays and every interop path.

Every destination is poisoned (0xA5) before the call and compared byte for byte
with the pure-torch reference afterwards; sources are checked unchanged.
"""

import array

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import assert_all_bitwise_equal, assert_bitwise_equal, b2u_and_check, poison_, u2b_and_check
from support.builders import (
    NUMPY_DTYPES,
    SHAPES,
    TORCH_DTYPES,
    clone_all,
    dtype_id,
    make_case,
    misaligned,
    random_tensor,
    read_only_copy,
    shape_id,
    to_numpy,
    torch_dtype_of,
)
from support.producers import ArrayInterfaceOnly, DLPackOnly, DLPackWithDecoyArrayInterface, LegacyDLPackOnly, wrap
from support.references import block_to_universal_ref, expected_blocks, expected_universals, universal_to_block_ref

LAYOUTS = ["NHD", "HND"]


# --------------------------------------------------------------------------
# torch CPU tensors: full dtype x layout x shape matrix.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
def test_block_to_universal_torch(dtype, layout, shape, gen):
    nb, nl, no, nh, nt, hd = shape
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    b2u_and_check(blocks, universals, layout, no)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
def test_universal_to_block_torch(dtype, layout, shape, gen):
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    u2b_and_check(universals, blocks, layout)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
def test_round_trips_torch(dtype, layout, shape, gen):
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    original_blocks, original_universals = clone_all(blocks), clone_all(universals)

    # blocks -> universals -> fresh blocks
    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals, layout)
    fresh_blocks = poison_(clone_all(blocks))
    kvbm_ext.universal_to_block(universals, fresh_blocks, layout)
    assert_all_bitwise_equal(fresh_blocks, original_blocks, "blocks after round trip")

    # universals -> blocks -> fresh universals
    universals = clone_all(original_universals)
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks, layout)
    fresh_universals = poison_(clone_all(universals))
    kvbm_ext.block_to_universal(blocks, fresh_universals, layout)
    assert_all_bitwise_equal(fresh_universals, original_universals, "universals after round trip")


@pytest.mark.parametrize("layout", ["nhd", "hnd", "Hnd", "nHd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_layout_is_case_insensitive(dtype, layout, gen):
    shape = (2, 2, 2, 3, 4, 5)  # nt != nh: NHD and HND chunks differ in shape
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    b2u_and_check(blocks, universals, layout, no=2)
    u2b_and_check(universals, blocks, layout)


def test_default_layout_is_nhd(gen):
    shape = (2, 2, 2, 3, 4, 5)
    blocks, universals = make_case(*shape, torch.float16, "NHD", generator=gen)
    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals)
    assert_all_bitwise_equal(universals, expected_universals(blocks, 2, "NHD"))
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks)
    assert_all_bitwise_equal(blocks, expected_blocks(universals, "NHD"))


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e5m2],
    ids=dtype_id,
)
def test_other_element_types_of_supported_size(dtype, gen):
    """The spec: any element type of size 1, 2, 4 or 8 bytes is copied exactly."""
    shape = (2, 2, 2, 3, 4, 5)
    for layout in LAYOUTS:
        blocks, universals = make_case(*shape, dtype, layout, generator=gen)
        b2u_and_check(blocks, universals, layout, no=2)
        u2b_and_check(universals, blocks, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float64], ids=dtype_id)
def test_large_head_dim_and_misaligned_pointers(dtype, layout, gen):
    """hd=128 (vector-friendly) and arrays starting one element past an allocation."""
    shape = (3, 2, 2, 2, 4, 128)
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    b2u_and_check(blocks, universals, layout, no=2)
    u2b_and_check(universals, blocks, layout)
    blocks = [[misaligned(c) for c in chunks] for chunks in blocks]
    universals = [misaligned(u) for u in universals]
    b2u_and_check(blocks, universals, layout, no=2)
    u2b_and_check(universals, blocks, layout)


# --------------------------------------------------------------------------
# NumPy arrays.
# --------------------------------------------------------------------------


def numpy_case(shape, np_dtype, layout, gen):
    blocks, universals = make_case(*shape, torch_dtype_of(np_dtype), layout, generator=gen)
    blocks, universals = to_numpy(blocks), to_numpy(universals)
    assert all(isinstance(u, np.ndarray) and u.dtype == np_dtype for u in universals)
    return blocks, universals


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=dtype_id)
def test_block_to_universal_numpy(np_dtype, layout, shape, gen):
    blocks, universals = numpy_case(shape, np_dtype, layout, gen)
    b2u_and_check(blocks, universals, layout, no=shape[2])


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=dtype_id)
def test_universal_to_block_numpy(np_dtype, layout, shape, gen):
    blocks, universals = numpy_case(shape, np_dtype, layout, gen)
    u2b_and_check(universals, blocks, layout)


@pytest.mark.parametrize("layout", ["NHD", "hnd"])
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=dtype_id)
def test_round_trips_numpy(np_dtype, layout, gen):
    blocks, universals = numpy_case((3, 2, 2, 3, 4, 7), np_dtype, layout, gen)
    original_blocks = clone_all(blocks)
    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals, layout)
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks, layout)
    assert_all_bitwise_equal(blocks, original_blocks, "blocks after round trip")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_numpy_and_torch_in_one_call(layout, gen):
    shape = (3, 2, 2, 3, 4, 5)
    blocks, universals = make_case(*shape, torch.float32, layout, generator=gen)
    np_universals = to_numpy(universals)  # numpy universals, torch blocks
    b2u_and_check(blocks, np_universals, layout, no=2)
    np_blocks = [to_numpy(chunks) if b % 2 else chunks for b, chunks in enumerate(blocks)]  # alternate kinds
    u2b_and_check(universals, np_blocks, layout)


# --------------------------------------------------------------------------
# nb = 1 as a single 5-D array, nb = 0, tuples.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_5d_universal_means_one_block(kind, layout, gen):
    shape = (1, 2, 2, 3, 4, 5)
    blocks, universals = make_case(*shape, torch.float16, layout, generator=gen)
    if kind == "numpy":
        blocks, universals = to_numpy(blocks), to_numpy(universals)
    chunks, universal = blocks[0], universals[0]

    poison_(universal)
    assert kvbm_ext.block_to_universal([chunks], universal, layout) is None
    assert_bitwise_equal(universal, block_to_universal_ref(chunks, 2, layout), "universal")

    poison_(chunks)
    assert kvbm_ext.universal_to_block(universal, [chunks], layout) is None
    assert_all_bitwise_equal(chunks, universal_to_block_ref(universal, layout), "chunks")


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_zero_blocks_is_a_no_op(empty):
    assert kvbm_ext.block_to_universal(empty, empty) is None
    assert kvbm_ext.universal_to_block(empty, empty) is None
    assert kvbm_ext.block_to_universal(empty, empty, "HND") is None
    assert kvbm_ext.universal_to_block(empty, empty, "hnd", stream=None) is None


def test_tuples_are_sequences(gen):
    shape = (3, 2, 2, 2, 3, 5)
    blocks, universals = make_case(*shape, torch.bfloat16, "HND", generator=gen)
    tuple_blocks = tuple(tuple(chunks) for chunks in blocks)
    b2u_and_check(tuple_blocks, tuple(universals), "HND", no=2)
    u2b_and_check(tuple(universals), tuple_blocks, "HND")


def test_stream_none_accepted_on_host(gen):
    blocks, universals = make_case(2, 2, 2, 2, 3, 5, torch.float32, "NHD", generator=gen)
    b2u_and_check(blocks, universals, "NHD", no=2, stream=None)
    u2b_and_check(universals, blocks, "NHD", stream=None)


# --------------------------------------------------------------------------
# Interop: wrappers that offer exactly one protocol.
# --------------------------------------------------------------------------


def round_trip_wrapped(blocks, universals, w_blocks, w_universals, layout):
    """block_to_universal then universal_to_block through the wrappers (w_*) of
    blocks and universals, each direction checked against the reference."""
    poison_(universals)
    kvbm_ext.block_to_universal(w_blocks, w_universals, layout)
    assert_all_bitwise_equal(universals, expected_universals(blocks, 2, layout), "universals")

    original = clone_all(universals)
    poison_(blocks)
    kvbm_ext.universal_to_block(w_universals, w_blocks, layout)
    assert_all_bitwise_equal(blocks, expected_blocks(original, layout), "blocks")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=dtype_id)
def test_dlpack_versioned_only(dtype, layout, gen):
    blocks, universals = make_case(2, 2, 2, 3, 4, 5, dtype, layout, generator=gen)
    w_blocks, w_universals = wrap(blocks, DLPackOnly), wrap(universals, DLPackOnly)
    round_trip_wrapped(blocks, universals, w_blocks, w_universals, layout)

    # The library asked for a versioned capsule (it must retry without max_version only for old producers).
    calls = [c for w in w_universals + [x for ws in w_blocks for x in ws] for c in w.calls]
    assert calls, "__dlpack__ was never called"
    assert all(c["max_version"] is not None and tuple(c["max_version"])[0] >= 1 for c in calls), calls


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float64], ids=dtype_id)
def test_dlpack_legacy_only(dtype, layout, gen):
    """__dlpack__(self, stream=None): passing max_version raises TypeError; the library must retry."""
    blocks, universals = make_case(2, 2, 2, 3, 4, 5, dtype, layout, generator=gen)
    w_blocks, w_universals = wrap(blocks, LegacyDLPackOnly), wrap(universals, LegacyDLPackOnly)
    round_trip_wrapped(blocks, universals, w_blocks, w_universals, layout)
    assert all(w.calls >= 2 for w in w_universals), "each legacy __dlpack__ should have produced a capsule per call"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=dtype_id)
def test_array_interface_only(np_dtype, layout, gen):
    blocks, universals = numpy_case((2, 2, 2, 3, 4, 5), np_dtype, layout, gen)
    w_blocks, w_universals = wrap(blocks, ArrayInterfaceOnly), wrap(universals, ArrayInterfaceOnly)
    assert not hasattr(w_universals[0], "__dlpack__")
    round_trip_wrapped(blocks, universals, w_blocks, w_universals, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES + [np.int64], ids=dtype_id)
def test_buffer_protocol_only_memoryview(np_dtype, layout, gen):
    blocks, universals = numpy_case((2, 2, 2, 3, 4, 5), np_dtype, layout, gen)
    w_blocks, w_universals = wrap(blocks, memoryview), wrap(universals, memoryview)
    assert w_universals[0].ndim == 5 and not w_universals[0].readonly
    round_trip_wrapped(blocks, universals, w_blocks, w_universals, layout)


def _bytearray_view(t):
    """A writable memoryview over a bytearray holding t's bytes, cast to t's shape (uint8)."""
    buf = bytearray(t.numpy().tobytes())
    return buf, memoryview(buf).cast("B", t.shape)


def _array_array_view(t):
    """A writable memoryview over an array.array('f') holding t's float32 values, cast to t's shape."""
    arr = array.array("f", t.numpy().tobytes())
    return arr, memoryview(arr).cast("B").cast("f", t.shape)


@pytest.mark.parametrize(
    "maker,dtype", [(_bytearray_view, torch.uint8), (_array_array_view, torch.float32)], ids=["bytearray", "array.array"]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffer_protocol_only_python_containers(maker, dtype, layout, gen):
    blocks, universals = make_case(2, 2, 2, 3, 4, 5, dtype, layout, generator=gen)
    b_views = [[maker(c) for c in chunks] for chunks in blocks]
    u_views = [maker(u) for u in universals]
    mv_blocks = [[mv for _, mv in views] for views in b_views]
    mv_universals = [mv for _, mv in u_views]

    def read(mv, like):  # the bytes now in the container, as a torch tensor shaped like `like`
        return torch.frombuffer(bytearray(mv.tobytes()), dtype=dtype).reshape(like.shape)

    for mv in mv_universals:
        mv.cast("B")[:] = b"\xa5" * mv.nbytes
    kvbm_ext.block_to_universal(mv_blocks, mv_universals, layout)
    want = expected_universals(blocks, 2, layout)
    assert_all_bitwise_equal([read(mv, u) for mv, u in zip(mv_universals, want)], want, "universals")

    for views in mv_blocks:
        for mv in views:
            mv.cast("B")[:] = b"\xa5" * mv.nbytes
    kvbm_ext.universal_to_block(mv_universals, mv_blocks, layout)
    want_b = expected_blocks(want, layout)
    got_b = [[read(mv, c) for mv, c in zip(views, ws)] for views, ws in zip(mv_blocks, want_b)]
    assert_all_bitwise_equal(got_b, want_b, "blocks")


def test_dlpack_is_preferred_over_array_interface(gen):
    """An object offering DLPack and an __array_interface__ of a different array: DLPack wins."""
    shape = (2, 2, 2, 3, 4, 5)
    blocks, universals = make_case(*shape, torch.float32, "NHD", generator=gen)
    decoy_blocks, decoy_universals = make_case(*shape, torch.float32, "NHD", generator=gen)
    w_blocks = [
        [DLPackWithDecoyArrayInterface(c, d.numpy()) for c, d in zip(cs, ds)] for cs, ds in zip(blocks, decoy_blocks)
    ]
    w_universals = [DLPackWithDecoyArrayInterface(u, d.numpy()) for u, d in zip(universals, decoy_universals)]
    poison_(universals)
    poison_(decoy_universals)
    kvbm_ext.block_to_universal(w_blocks, w_universals, "NHD")
    assert_all_bitwise_equal(universals, expected_universals(blocks, 2, "NHD"), "universals")


# --------------------------------------------------------------------------
# Read-only sources.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.uint8], ids=dtype_id)
def test_read_only_numpy_universal_as_source(np_dtype, layout, gen):
    blocks, universals = numpy_case((3, 2, 2, 3, 4, 5), np_dtype, layout, gen)
    ro = [read_only_copy(u) for u in universals]
    u2b_and_check(ro, blocks, layout)
    # nb = 1 as a single read-only 5-D array
    u2b_and_check(ro[0], [blocks[0]], layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_only_numpy_blocks_as_source(layout, gen):
    blocks, universals = numpy_case((3, 2, 2, 3, 4, 5), np.float32, layout, gen)
    ro_blocks = [[read_only_copy(c) for c in chunks] for chunks in blocks]
    b2u_and_check(ro_blocks, universals, layout, no=2)


def test_read_only_array_interface_as_source(gen):
    blocks, universals = numpy_case((2, 2, 2, 3, 4, 5), np.float16, "HND", gen)
    ro = [ArrayInterfaceOnly(read_only_copy(u)) for u in universals]
    assert ro[0].__array_interface__["data"][1] is True
    poison_(blocks)
    kvbm_ext.universal_to_block(ro, blocks, "HND")
    assert_all_bitwise_equal(blocks, expected_blocks(universals, "HND"), "blocks")


def test_read_only_buffer_as_source(gen):
    blocks, universals = numpy_case((2, 2, 2, 3, 4, 5), np.float32, "NHD", gen)
    ro = [memoryview(read_only_copy(u)) for u in universals]
    assert ro[0].readonly
    poison_(blocks)
    kvbm_ext.universal_to_block(ro, blocks, "NHD")
    assert_all_bitwise_equal(blocks, expected_blocks(universals, "NHD"), "blocks")


def test_repeated_calls_reuse_arrays(gen):
    """Calling many times on the same arrays with fresh data each time (no stale caching)."""
    shape = (4, 2, 2, 2, 3, 5)
    blocks, universals = make_case(*shape, torch.bfloat16, "NHD", generator=gen)
    for _ in range(3):
        for chunks in blocks:
            for c in chunks:
                c.copy_(random_tensor(c.shape, c.dtype, generator=gen))
        b2u_and_check(blocks, universals, "NHD", no=2)


# --------------------------------------------------------------------------
# Universals as one [nb, nh, nl, no, nt, hd] array, as PagedKVCache takes them.
# --------------------------------------------------------------------------

STACK_SHAPE = (3, 2, 2, 3, 4, 5)  # nb, nl, no, nh, nt, hd (nt != nh)


def stack_of(universals, kind, spacing=None):
    """One [nb, ...] array holding the universals, torch or NumPy; `spacing`: a leading
    stride of that many blocks' worth of elements plus 7 (the blocks are still each
    contiguous, with gaps between them)."""
    stack = torch.stack(universals)
    if spacing is not None:
        block = universals[0].numel()
        room = torch.empty(len(universals), block * spacing + 7, dtype=stack.dtype)
        poison_(room)
        spaced = room[:, :block].view(stack.shape)
        spaced.copy_(stack)
        assert spaced.stride(0) == block * spacing + 7 and spaced[0].is_contiguous()
        stack = spaced
    return stack.numpy() if kind == "numpy" else stack


@pytest.mark.parametrize("spacing", [None, 1, 2], ids=["packed", "gap-7", "gap-block+7"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_universals_as_one_stacked_array(layout, kind, spacing, gen):
    nb, nl, no, nh, nt, hd = STACK_SHAPE
    blocks, universals = make_case(*STACK_SHAPE, torch.float16, layout, generator=gen)
    if kind == "numpy":
        blocks = to_numpy(blocks)
    stack = stack_of(universals, kind, spacing)
    poison_(list(stack))
    kvbm_ext.block_to_universal(blocks, stack, layout)
    assert_all_bitwise_equal(list(stack), expected_universals(blocks, no, layout), "universals")

    fresh = poison_(clone_all(blocks))
    kvbm_ext.universal_to_block(stack, fresh, layout)
    assert_all_bitwise_equal(fresh, expected_blocks(list(stack), layout), "blocks")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stacked_source_with_any_leading_stride(layout, gen):
    """A source's blocks may repeat (leading stride 0) or run backwards (NumPy [::-1])."""
    nb, nl, no, nh, nt, hd = STACK_SHAPE
    blocks, universals = make_case(*STACK_SHAPE, torch.float32, layout, generator=gen)
    repeated = universals[1].unsqueeze(0).expand(nb, *universals[1].shape)
    assert repeated.stride(0) == 0
    poison_(blocks)
    kvbm_ext.universal_to_block(repeated, blocks, layout)
    assert_all_bitwise_equal(blocks, expected_blocks([universals[1]] * nb, layout), "blocks")

    backwards = np.stack(to_numpy(universals))[::-1]
    assert backwards.strides[0] < 0
    poison_(blocks)
    kvbm_ext.universal_to_block(backwards, blocks, layout)
    assert_all_bitwise_equal(blocks, expected_blocks(list(universals[::-1]), layout), "blocks")


def test_stacked_universals_of_one_block_and_none(gen):
    """[1, ...] is one block like a 5-D array; [0, ...] with no blocks does nothing."""
    blocks, universals = make_case(1, 2, 2, 3, 4, 5, torch.bfloat16, "NHD", generator=gen)
    stack = torch.stack(universals)
    poison_(stack)
    kvbm_ext.block_to_universal(blocks, stack)
    assert_all_bitwise_equal(list(stack), expected_universals(blocks, 2, "NHD"), "universals")
    empty = torch.empty(0, 3, 2, 2, 4, 5, dtype=torch.bfloat16)
    kvbm_ext.block_to_universal([], empty)
    kvbm_ext.universal_to_block(empty, [])


def test_stacked_universals_through_every_protocol(gen):
    """The one-array form through DLPack (versioned and legacy), __array_interface__ and
    the buffer protocol alike."""
    blocks, universals = make_case(*STACK_SHAPE, torch.float32, "HND", generator=gen)
    for make in (lambda s: DLPackOnly(s), lambda s: LegacyDLPackOnly(s), lambda s: ArrayInterfaceOnly(s.numpy()),
                 lambda s: memoryview(s.numpy())):
        stack = torch.stack(universals)
        poison_(stack)
        kvbm_ext.block_to_universal(blocks, make(stack), "HND")
        assert_all_bitwise_equal(list(stack), expected_universals(blocks, 2, "HND"), "universals")
