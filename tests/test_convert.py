"""block_to_universal / universal_to_block on every device: the dtype x layout x shape
matrix, round trips, alignment and argument forms written once for the CPU and the GPU;
then host-only inputs (NumPy, every interop protocol, read-only sources, stacked
universals) and GPU-only ones (pinned placements, streams and their ordering, several
GPUs, CuPy / JAX / CAI, stacked universals on the device and in pinned memory).

Every destination is poisoned (0xA5) before the call and compared byte for byte with
the pure-torch reference afterwards; sources are checked unchanged.
"""

import array

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_all_bitwise_equal,
    assert_poisoned,
    b2u_and_check,
    call,
    check_rejected,
    peek_still_poisoned,
    poison_,
    u2b_and_check,
)
from support.builders import (
    LAYOUTS,
    NUMPY_DTYPES,
    SHAPES,
    TORCH_DTYPES,
    arrays_in,
    clone_all,
    dtype_id,
    make_case,
    misaligned,
    placed_case,
    random_tensor,
    read_only_copy,
    shape_id,
    to_numpy,
    torch_dtype_of,
)
from support.devices import SLEEP_CYCLES, cuda_case, cupy_or_skip, rewrite_sources_behind_sleep, sync
from support.producers import (
    STREAM_FORMS,
    ArrayInterfaceOnly,
    CudaArrayInterfaceOnly,
    DLPackOnly,
    DLPackWithDecoyArrayInterface,
    LegacyDLPackOnly,
    wrap,
)
from support.references import expected_blocks, expected_universals

DIRECTIONS = ["b2u", "u2b"]


def sources_and_destinations(direction, blocks, universals):
    return (blocks, universals) if direction == "b2u" else (universals, blocks)


def expected_for(direction, blocks, universals, layout, no):
    """Reference output of `direction` computed from the current sources."""
    if direction == "b2u":
        return expected_universals(blocks, no, layout)
    return expected_blocks(universals, layout)


def check_through(direction, blocks, universals, layout, arg_blocks, arg_universals):
    """Converts through other views (arg_blocks, arg_universals) of the torch `blocks` and
    `universals`, checked on the torch destinations against the reference."""
    _, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, layout, 2)
    poison_(dests)
    sync()
    call(direction, arg_blocks, arg_universals, layout)
    sync()
    assert_all_bitwise_equal(dests, want, "destinations")


def check(direction, blocks, universals, layout, no, **kwargs):
    if direction == "b2u":
        b2u_and_check(blocks, universals, layout, no, **kwargs)
    else:
        u2b_and_check(universals, blocks, layout, **kwargs)


def check_both(blocks, universals, layout, no, **kwargs):
    """block_to_universal, then universal_to_block, each checked against the reference."""
    b2u_and_check(blocks, universals, layout, no, **kwargs)
    u2b_and_check(universals, blocks, layout, **kwargs)


# ==========================================================================
# 1. Every device (torch tensors on the CPU, and on the GPU where there is one).
# ==========================================================================


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_dtype_layout_shape_matrix(direction, dtype, layout, shape, device, gen):
    blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
    check(direction, blocks, universals, layout, shape[2])


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[6]], ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
def test_round_trips(dtype, layout, shape, device, gen):
    blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
    original_blocks, original_universals = clone_all(blocks), clone_all(universals)

    # blocks -> universals -> fresh blocks
    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals, layout)
    fresh_blocks = poison_(clone_all(blocks))
    kvbm_ext.universal_to_block(universals, fresh_blocks, layout)
    sync()
    assert_all_bitwise_equal(fresh_blocks, original_blocks, "blocks after round trip")

    # universals -> blocks -> fresh universals
    universals = clone_all(original_universals)
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks, layout)
    fresh_universals = poison_(clone_all(universals))
    kvbm_ext.block_to_universal(blocks, fresh_universals, layout)
    sync()
    assert_all_bitwise_equal(fresh_universals, original_universals, "universals after round trip")


@pytest.mark.parametrize("layout", ["nhd", "hnd", "Hnd", "nHd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_layout_is_case_insensitive(dtype, layout, device, gen):
    shape = (2, 2, 2, 3, 4, 5)  # nt != nh: NHD and HND chunks differ in shape
    blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
    check_both(blocks, universals, layout, no=2)


def test_default_layout_is_nhd(device, gen):
    shape = (2, 2, 2, 3, 4, 5)
    blocks, universals = make_case(*shape, torch.float16, "NHD", device=device, generator=gen)
    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals)
    sync()
    assert_all_bitwise_equal(universals, expected_universals(blocks, 2, "NHD"))
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks)
    sync()
    assert_all_bitwise_equal(blocks, expected_blocks(universals, "NHD"))


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e5m2],
    ids=dtype_id,
)
def test_other_element_types_of_supported_size(dtype, device, gen):
    """The spec: any element type of size 1, 2, 4 or 8 bytes is copied exactly."""
    shape = (2, 2, 2, 3, 4, 5)
    for layout in LAYOUTS:
        blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
        check_both(blocks, universals, layout, no=2)


@pytest.mark.parametrize("shape", [(3, 2, 2, 2, 4, 128), (3, 2, 2, 3, 5, 7)], ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float64], ids=dtype_id)
def test_misaligned_pointers(dtype, layout, shape, device, gen):
    """hd = 128 (vector-friendly) and hd = 7, then every array starting one element past
    its allocation."""
    blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
    check_both(blocks, universals, layout, no=2)
    blocks = [[misaligned(c) for c in chunks] for chunks in blocks]
    universals = [misaligned(u) for u in universals]
    check_both(blocks, universals, layout, no=2)


@pytest.mark.parametrize("device,kind", [("cpu", "torch"), ("cpu", "numpy"), cuda_case("cuda", "torch")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_5d_universal_means_one_block(layout, device, kind, gen):
    blocks, universals = make_case(1, 2, 2, 3, 4, 5, torch.float16, layout, device=device, generator=gen)
    if kind == "numpy":
        blocks, universals = to_numpy(blocks), to_numpy(universals)
    check_both(blocks, universals[0], layout, no=2)


def test_tuples_are_sequences(device, gen):
    blocks, universals = make_case(3, 2, 2, 2, 3, 5, torch.bfloat16, "HND", device=device, generator=gen)
    tuple_blocks = tuple(tuple(chunks) for chunks in blocks)
    b2u_and_check(tuple_blocks, tuple(universals), "HND", no=2)
    u2b_and_check(tuple(universals), tuple_blocks, "HND")


@pytest.mark.parametrize("layout,dtype", [("NHD", torch.float32), ("HND", torch.float16)], ids=str)
def test_stream_none(layout, dtype, device, gen):
    """stream=None: the legacy default stream on the GPU, nothing on the host."""
    blocks, universals = make_case(4, 2, 2, 4, 8, 16, dtype, layout, device=device, generator=gen)
    check_both(blocks, universals, layout, no=2, stream=None)


def test_repeated_calls_reuse_arrays(device, gen):
    """Calling many times on the same arrays with fresh data each time (no stale caching)."""
    blocks, universals = make_case(4, 2, 2, 2, 3, 5, torch.bfloat16, "NHD", device=device, generator=gen)
    for _ in range(3):
        for chunks in blocks:
            for c in chunks:
                c.copy_(random_tensor(c.shape, c.dtype, generator=gen))
        b2u_and_check(blocks, universals, "NHD", no=2)


# ==========================================================================
# 2. Host arrays: NumPy, every interop protocol, read-only sources, stacked universals.
# ==========================================================================

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
# nb = 0.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_zero_blocks_is_a_no_op(empty):
    assert kvbm_ext.block_to_universal(empty, empty) is None
    assert kvbm_ext.universal_to_block(empty, empty) is None
    assert kvbm_ext.block_to_universal(empty, empty, "HND") is None
    assert kvbm_ext.universal_to_block(empty, empty, "hnd", stream=None) is None


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


# ==========================================================================
# 3. GPU only: realistic sizes, pinned placements, streams, several GPUs, other producers.
# ==========================================================================


def device_case(shape, dtype, layout, gen, device="cuda"):
    return make_case(*shape, dtype, layout, device=device, generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_realistic_sizes(direction, dtype, layout, gen):
    """hd=128, nt=16, nh=8, nl=4, no=2 over 64 blocks (vectorised paths)."""
    blocks, universals = device_case((64, 4, 2, 8, 16, 128), dtype, layout, gen)
    check(direction, blocks, universals, layout, 2)


@pytest.mark.gpu
def test_device_zero_blocks_with_stream():
    s = torch.cuda.Stream()
    assert kvbm_ext.block_to_universal([], [], stream=s) is None
    assert kvbm_ext.universal_to_block([], [], "HND", stream=s.cuda_stream) is None


# --------------------------------------------------------------------------
# Pinned host memory.
# --------------------------------------------------------------------------


PLACEMENTS = [
    ("device", "pinned"),
    ("pinned", "device"),
    ("device", "mixed"),
    ("mixed", "device"),
    ("mixed", "mixed"),
    ("pinned", "pinned"),  # all host: CPU implementation
    ("pinned", "pageable"),  # all host: CPU implementation
]


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_where,universals_where", PLACEMENTS, ids=lambda v: v)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8], ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pinned_host_memory(direction, dtype, layout, blocks_where, universals_where, gen):
    shape = (5, 2, 2, 3, 4, 13)
    blocks, universals = placed_case(shape, dtype, layout, gen, blocks_where, universals_where)
    check(direction, blocks, universals, layout, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pinned_universals_realistic_sizes(direction, gen):
    blocks, universals = placed_case((16, 4, 2, 8, 16, 128), torch.bfloat16, "NHD", gen, "device", "pinned")
    check(direction, blocks, universals, "NHD", 2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "blocks_where,universals_where,path",
    [
        ("device", "pageable", r"universals\[0\]"),
        ("pageable", "device", r"blocks\[0\]\[0\]"),
    ],
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pageable_mixed_with_device_rejected(direction, blocks_where, universals_where, path, gen):
    blocks, universals = placed_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, blocks_where, universals_where)
    check_rejected(direction, blocks, universals, ValueError, path, "pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_pageable_chunk_among_device_arrays_rejected(direction, gen):
    blocks, universals = placed_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pinned")
    blocks[1][2] = blocks[1][2].cpu()
    assert not blocks[1][2].is_pinned()
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[1\]\[2\]", "pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_pageable_universal_among_pinned_rejected(direction, gen):
    blocks, universals = placed_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pinned")
    universals[2] = torch.empty(universals[2].shape, dtype=universals[2].dtype).copy_(universals[2])  # pageable
    assert not universals[2].is_pinned()
    check_rejected(direction, blocks, universals, ValueError, r"universals\[2\]", "pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_errors_leave_device_destinations_untouched(direction, gen):
    """Validation of device arrays also happens before anything is launched."""
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    blocks[2][3] = random_tensor((3, 4, 5), torch.float32, "cuda", gen)  # HND shape in an NHD call
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[2\]\[3\]", "expected", "(4, 3, 5)")
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    universals[1] = random_tensor((3, 2, 2, 4, 10), torch.float32, "cuda", gen)[..., ::2]
    check_rejected(direction, blocks, universals, ValueError, r"universals\[1\]", "contiguous")


# --------------------------------------------------------------------------
# Streams.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(STREAM_FORMS))
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_work_is_enqueued_on_the_given_stream(direction, form, gen):
    """With the stream busy (a long sleep), the call returns at once and nothing is written
    until the stream gets to it: the work went onto THAT stream, without a host sync."""
    blocks, universals = device_case((4, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen)
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, "NHD", 2)
    poison_(dests)
    sync()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
    call(direction, blocks, universals, "NHD", stream=STREAM_FORMS[form](s))
    assert not s.query(), "the call waited for the stream (or the sleep was too short)"

    if not peek_still_poisoned(list(arrays_in(dests)), s):
        pytest.skip("the sleep ended before the peek finished; cannot judge")

    s.synchronize()
    assert_all_bitwise_equal(dests, want, "destinations")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_producer_work_is_ordered_before_the_conversion(direction, gen):
    """Sources are rewritten on s1 behind a long sleep; the call runs on s2. Correct only if
    the library passes its stream to the producers (DLPack stream=) so s2 waits for s1."""
    blocks, universals = device_case((4, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen)
    sources, dests = sources_and_destinations(direction, blocks, universals)
    source_list = list(arrays_in(sources))
    poison_(dests)
    fresh = rewrite_sources_behind_sleep(
        source_list, gen, lambda stream: call(direction, blocks, universals, "NHD", stream=stream))

    want = expected_for(direction, blocks, universals, "NHD", 2)  # sources now hold `fresh`
    assert_all_bitwise_equal(source_list, fresh, "sources")
    assert_all_bitwise_equal(dests, want, "destinations")


# --------------------------------------------------------------------------
# Several GPUs.
# --------------------------------------------------------------------------


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("with_stream", [False, True])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_launch_runs_on_the_arrays_device(direction, with_stream, gen):
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "HND", gen, device="cuda:1")
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, "HND", 2)
    poison_(dests)
    sync()
    kwargs = {"stream": torch.cuda.Stream(device=1)} if with_stream else {}
    with torch.cuda.device(0):
        call(direction, blocks, universals, "HND", **kwargs)
        assert torch.cuda.current_device() == 0, "the call changed the caller's current device"
    sync()
    assert_all_bitwise_equal(dests, want, "destinations")


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_arrays_on_two_gpus_rejected(direction, gen):
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen, device="cuda:0")
    universals[1] = universals[1].to("cuda:1")
    check_rejected(direction, blocks, universals, ValueError, r"universals\[1\]", "device")
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen, device="cuda:0")
    blocks[2][1] = blocks[2][1].to("cuda:1")
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[2\]\[1\]", "device")


# --------------------------------------------------------------------------
# Other producers: torch CAI, CuPy, JAX.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("wrapped", ["all", "universals", "blocks"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_torch_cuda_array_interface_only_float16(direction, layout, wrapped, gen):
    """torch exports CAI version 2 without a stream."""
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float16, layout, gen)
    cai = CudaArrayInterfaceOnly(universals[0]).__cuda_array_interface__
    assert cai["version"] >= 2 and cai["typestr"] == "<f2"
    arg_blocks = wrap(blocks, CudaArrayInterfaceOnly) if wrapped in ("all", "blocks") else blocks
    arg_universals = wrap(universals, CudaArrayInterfaceOnly) if wrapped in ("all", "universals") else universals
    check_through(direction, blocks, universals, layout, arg_blocks, arg_universals)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_dlpack_only_wrapper_on_device_receives_a_stream(direction, gen):
    blocks, universals = device_case((2, 2, 2, 3, 4, 5), torch.bfloat16, "NHD", gen)
    w_blocks, w_universals = wrap(blocks, DLPackOnly), wrap(universals, DLPackOnly)
    s = torch.cuda.Stream()
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, "NHD", 2)
    poison_(dests)
    sync()
    call(direction, w_blocks, w_universals, "NHD", stream=s)
    s.synchronize()
    assert_all_bitwise_equal(dests, want, "destinations")
    calls = [c for w in w_universals for c in w.calls]
    assert calls and all(c["stream"] == s.cuda_stream for c in calls), calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8, torch.uint8], ids=dtype_id)
@pytest.mark.parametrize("cai_only", [False, True], ids=["cupy", "cupy-cai-only"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cupy_arrays(direction, layout, cai_only, dtype, gen):
    cp = cupy_or_skip()
    blocks, universals = device_case((3, 2, 2, 3, 4, 7), dtype, layout, gen)
    # CuPy views of the same device memory: the library sees CuPy, the test checks via torch.
    cp_blocks = [[cp.from_dlpack(c) for c in chunks] for chunks in blocks]
    cp_universals = [cp.from_dlpack(u) for u in universals]
    assert cp_universals[0].data.ptr == universals[0].data_ptr()
    if cai_only:
        cp_blocks, cp_universals = wrap(cp_blocks, CudaArrayInterfaceOnly), wrap(cp_universals, CudaArrayInterfaceOnly)
        cai = cp_universals[0].__cuda_array_interface__
        assert cai["version"] == 3 and "stream" in cai
    check_through(direction, blocks, universals, layout, cp_blocks, cp_universals)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cupy_cai_v3_stream_is_waited_for(direction, gen):
    """Sources rewritten by CuPy on its stream behind a long sleep; the CAI v3 `stream` of the
    sources names that stream; the conversion runs on another stream and must wait for it."""
    cp = cupy_or_skip()
    blocks, universals = device_case((3, 2, 2, 3, 4, 8), torch.float32, "NHD", gen)
    sources, dests = sources_and_destinations(direction, blocks, universals)
    source_list = list(arrays_in(sources))
    fresh = [random_tensor(t.shape, t.dtype, "cuda", gen) for t in source_list]
    cp_fresh = [cp.from_dlpack(f) for f in fresh]
    cp_blocks = wrap([[cp.from_dlpack(c) for c in chunks] for chunks in blocks], CudaArrayInterfaceOnly)
    cp_universals = wrap([cp.from_dlpack(u) for u in universals], CudaArrayInterfaceOnly)
    poison_(dests)
    sync()

    producer = cp.cuda.Stream(non_blocking=True)
    s2 = torch.cuda.Stream()
    with producer:
        with torch.cuda.stream(torch.cuda.ExternalStream(producer.ptr)):
            torch.cuda._sleep(SLEEP_CYCLES)
        for t, new in zip(source_list, cp_fresh):
            cp.from_dlpack(t)[...] = new  # enqueued on `producer`
        assert cp_universals[0].__cuda_array_interface__["stream"] == producer.ptr
        call(direction, cp_blocks, cp_universals, "NHD", stream=s2)
        assert not s2.query(), "s2 did not wait for the producer stream"
    s2.synchronize()
    producer.synchronize()

    want = expected_for(direction, blocks, universals, "NHD", 2)
    assert_all_bitwise_equal(source_list, fresh, "sources")
    assert_all_bitwise_equal(dests, want, "destinations")


def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend: {e}")
    return jax, gpus[0]


@pytest.mark.gpu
@pytest.mark.parametrize("np_dtype", [np.float16, np.float32, np.int8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_jax_arrays_as_sources(direction, layout, np_dtype, gen):
    """JAX arrays are read-only: used as sources, converting into torch device arrays."""
    jax, gpu = _jax_gpu()
    dtype = torch.from_numpy(np.empty(0, np_dtype)).dtype
    # JAX may leave another GPU current on a multi-GPU machine: name JAX's device.
    device = torch.device("cuda", gpu.local_hardware_id)
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), dtype, layout, gen, device=device)
    to_jax = lambda t: jax.device_put(t.cpu().numpy(), gpu)  # noqa: E731
    if direction == "b2u":
        arg_blocks, arg_universals = [[to_jax(c) for c in chunks] for chunks in blocks], universals
    else:
        arg_blocks, arg_universals = blocks, [to_jax(u) for u in universals]
    check_through(direction, blocks, universals, layout, arg_blocks, arg_universals)
    # The JAX sources still hold the original bytes (compared through NumPy).
    sources, _ = sources_and_destinations(direction, blocks, universals)
    jax_sources = arg_blocks if direction == "b2u" else arg_universals
    flat_jax = [a for x in jax_sources for a in (x if isinstance(x, list) else [x])]
    assert_all_bitwise_equal([np.asarray(a) for a in flat_jax], list(arrays_in(sources)), "JAX sources")


# --------------------------------------------------------------------------
# Universals as one [nb, nh, nl, no, nt, hd] array on the device or in pinned memory,
# with every backend (the staged path reads one array's blocks by its leading stride).
# --------------------------------------------------------------------------


def stack_on(universals, where, spacing):
    """One [nb, ...] array of the universals, "device" or "pinned"; `spacing` extra
    elements between blocks (0: packed)."""
    flat = torch.stack([u.cpu() for u in universals])
    block = universals[0].numel()
    room = torch.empty(len(universals), block + spacing, dtype=flat.dtype)
    room = room.pin_memory() if where == "pinned" else room.cuda()
    poison_(room)
    stack = room[:, :block].view(flat.shape)
    stack.copy_(flat)
    return stack


@pytest.mark.gpu
@pytest.mark.parametrize("spacing", [0, 24], ids=["packed", "gaps"])
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engines"])
@pytest.mark.parametrize("where", ["device", "pinned"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals(direction, where, backend, spacing, gen):
    shape = (5, 3, 2, 4, 16, 128)
    blocks, universals = device_case(shape, torch.bfloat16, "NHD", gen)
    stack = stack_on(universals, where, spacing)
    if direction == "b2u":
        poison_(stack)
        sync()
        kvbm_ext.block_to_universal(blocks, stack, backend=backend)
        sync()
        assert_all_bitwise_equal(list(stack), expected_universals(blocks, shape[2], "NHD"), "universals")
    else:
        poison_(blocks)
        sync()
        kvbm_ext.universal_to_block(stack, blocks, backend=backend)
        sync()
        assert_all_bitwise_equal(blocks, expected_blocks(list(stack), "NHD"), "blocks")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_on_another_device_kind_rejected(direction, gen):
    """A pageable stack among device chunks is refused like a pageable universal."""
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    check_rejected(direction, blocks, torch.stack(universals).cpu(), ValueError, "universals", "pageable")


@pytest.mark.gpu
def test_meta_universals_on_a_gpu_call(gen):
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    meta = [u.to("meta") if i == 1 else u for i, u in enumerate(universals)]
    poison_(blocks)
    sync()
    with pytest.raises(ValueError, match=r"^universals\[1\]: on device meta"):
        kvbm_ext.universal_to_block(meta, blocks)
    sync()
    assert_poisoned(blocks, "blocks")
