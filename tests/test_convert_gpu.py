"""Device conversions (every test needs CUDA): device/pinned placements, streams and
their ordering, multi-GPU placement, and CuPy / JAX / CAI inputs.

Destinations are poisoned before every call and compared byte for byte afterwards.
"""

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
    SHAPES,
    TORCH_DTYPES,
    arrays_in,
    clone_all,
    dtype_id,
    make_case,
    misaligned,
    placed_case,
    random_tensor,
    shape_id,
)
from support.devices import SLEEP_CYCLES, rewrite_sources_behind_sleep, sync
from support.producers import STREAM_FORMS, CudaArrayInterfaceOnly, DLPackOnly, wrap
from support.references import expected_blocks, expected_universals

pytestmark = pytest.mark.gpu

LAYOUTS = ["NHD", "HND"]
DIRECTIONS = ["b2u", "u2b"]


def device_case(shape, dtype, layout, gen, device="cuda"):
    return make_case(*shape, dtype, layout, device=device, generator=gen)


def sources_and_destinations(direction, blocks, universals):
    return (blocks, universals) if direction == "b2u" else (universals, blocks)


def expected_for(direction, blocks, universals, layout, no):
    """Reference output of `direction` computed from the current sources."""
    if direction == "b2u":
        return expected_universals(blocks, no, layout)
    return expected_blocks(universals, layout)


def check(direction, blocks, universals, layout, no, **kwargs):
    if direction == "b2u":
        b2u_and_check(blocks, universals, layout, no, **kwargs)
    else:
        u2b_and_check(universals, blocks, layout, **kwargs)


# --------------------------------------------------------------------------
# Device to device: full matrix.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_to_device(direction, dtype, layout, shape, gen):
    blocks, universals = device_case(shape, dtype, layout, gen)
    check(direction, blocks, universals, layout, shape[2])


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[6]], ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
def test_device_round_trips(dtype, layout, shape, gen):
    blocks, universals = device_case(shape, dtype, layout, gen)
    original_blocks, original_universals = clone_all(blocks), clone_all(universals)

    poison_(universals)
    kvbm_ext.block_to_universal(blocks, universals, layout)
    fresh_blocks = poison_(clone_all(blocks))
    kvbm_ext.universal_to_block(universals, fresh_blocks, layout)
    sync()
    assert_all_bitwise_equal(fresh_blocks, original_blocks, "blocks after round trip")

    universals = clone_all(original_universals)
    poison_(blocks)
    kvbm_ext.universal_to_block(universals, blocks, layout)
    fresh_universals = poison_(clone_all(universals))
    kvbm_ext.block_to_universal(blocks, fresh_universals, layout)
    sync()
    assert_all_bitwise_equal(fresh_universals, original_universals, "universals after round trip")


@pytest.mark.parametrize("layout", ["nhd", "hnd", "Hnd"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_layout_is_case_insensitive(direction, layout, gen):
    blocks, universals = device_case((2, 2, 2, 3, 4, 5), torch.bfloat16, layout, gen)
    check(direction, blocks, universals, layout, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_realistic_sizes(direction, dtype, layout, gen):
    """hd=128, nt=16, nh=8, nl=4, no=2 over 64 blocks (vectorised paths)."""
    blocks, universals = device_case((64, 4, 2, 8, 16, 128), dtype, layout, gen)
    check(direction, blocks, universals, layout, 2)


@pytest.mark.parametrize("shape", [(3, 2, 2, 2, 4, 128), (3, 2, 2, 3, 5, 7)], ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_misaligned_pointers(direction, dtype, shape, gen):
    blocks, universals = device_case(shape, dtype, "NHD", gen)
    blocks = [[misaligned(c) for c in chunks] for chunks in blocks]
    universals = [misaligned(u) for u in universals]
    check(direction, blocks, universals, "NHD", shape[2])


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_single_5d_universal(direction, gen):
    blocks, universals = device_case((1, 2, 2, 3, 4, 5), torch.float16, "HND", gen)
    check(direction, blocks, universals[0], "HND", 2)


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


@pytest.mark.parametrize("blocks_where,universals_where", PLACEMENTS, ids=lambda v: v)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8], ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pinned_host_memory(direction, dtype, layout, blocks_where, universals_where, gen):
    shape = (5, 2, 2, 3, 4, 13)
    blocks, universals = placed_case(shape, dtype, layout, gen, blocks_where, universals_where)
    check(direction, blocks, universals, layout, 2)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pinned_universals_realistic_sizes(direction, gen):
    blocks, universals = placed_case((16, 4, 2, 8, 16, 128), torch.bfloat16, "NHD", gen, "device", "pinned")
    check(direction, blocks, universals, "NHD", 2)


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


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_pageable_chunk_among_device_arrays_rejected(direction, gen):
    blocks, universals = placed_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pinned")
    blocks[1][2] = blocks[1][2].cpu()
    assert not blocks[1][2].is_pinned()
    check_rejected(direction, blocks, universals, ValueError, r"blocks\[1\]\[2\]", "pinned")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_pageable_universal_among_pinned_rejected(direction, gen):
    blocks, universals = placed_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pinned")
    universals[2] = torch.empty(universals[2].shape, dtype=universals[2].dtype).copy_(universals[2])  # pageable
    assert not universals[2].is_pinned()
    check_rejected(direction, blocks, universals, ValueError, r"universals\[2\]", "pinned")


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


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_default_stream_none(direction, gen):
    blocks, universals = device_case((4, 2, 2, 4, 8, 16), torch.float16, "HND", gen)
    check(direction, blocks, universals, "HND", 2, stream=None)


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
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, layout, 2)
    poison_(dests)
    sync()
    call(direction, arg_blocks, arg_universals, layout)
    sync()
    assert_all_bitwise_equal(dests, want, "destinations")


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


def _cupy():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # pragma: no cover - environment dependent
        pytest.skip(f"cupy has no usable CUDA: {e}")
    return cp


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8, torch.uint8], ids=dtype_id)
@pytest.mark.parametrize("cai_only", [False, True], ids=["cupy", "cupy-cai-only"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cupy_arrays(direction, layout, cai_only, dtype, gen):
    cp = _cupy()
    blocks, universals = device_case((3, 2, 2, 3, 4, 7), dtype, layout, gen)
    # CuPy views of the same device memory: the library sees CuPy, the test checks via torch.
    cp_blocks = [[cp.from_dlpack(c) for c in chunks] for chunks in blocks]
    cp_universals = [cp.from_dlpack(u) for u in universals]
    assert cp_universals[0].data.ptr == universals[0].data_ptr()
    if cai_only:
        cp_blocks, cp_universals = wrap(cp_blocks, CudaArrayInterfaceOnly), wrap(cp_universals, CudaArrayInterfaceOnly)
        cai = cp_universals[0].__cuda_array_interface__
        assert cai["version"] == 3 and "stream" in cai
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, layout, 2)
    poison_(dests)
    sync()
    call(direction, cp_blocks, cp_universals, layout)
    sync()
    assert_all_bitwise_equal(dests, want, "destinations")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cupy_cai_v3_stream_is_waited_for(direction, gen):
    """Sources rewritten by CuPy on its stream behind a long sleep; the CAI v3 `stream` of the
    sources names that stream; the conversion runs on another stream and must wait for it."""
    cp = _cupy()
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
    sources, dests = sources_and_destinations(direction, blocks, universals)
    want = expected_for(direction, blocks, universals, layout, 2)
    to_jax = lambda t: jax.device_put(t.cpu().numpy(), gpu)  # noqa: E731
    if direction == "b2u":
        arg_blocks, arg_universals = [[to_jax(c) for c in chunks] for chunks in blocks], universals
    else:
        arg_blocks, arg_universals = blocks, [to_jax(u) for u in universals]
    poison_(dests)
    sync()
    call(direction, arg_blocks, arg_universals, layout)
    sync()
    assert_all_bitwise_equal(dests, want, "destinations")
    # The JAX sources still hold the original bytes (compared through NumPy).
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


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_universals_on_another_device_kind_rejected(direction, gen):
    """A pageable stack among device chunks is refused like a pageable universal."""
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    check_rejected(direction, blocks, torch.stack(universals).cpu(), ValueError, "universals", "pageable")


def test_meta_universals_on_a_gpu_call(gen):
    blocks, universals = device_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen)
    meta = [u.to("meta") if i == 1 else u for i, u in enumerate(universals)]
    poison_(blocks)
    sync()
    with pytest.raises(ValueError, match=r"^universals\[1\]: on device meta"):
        kvbm_ext.universal_to_block(meta, blocks)
    sync()
    assert_poisoned(blocks, "blocks")
