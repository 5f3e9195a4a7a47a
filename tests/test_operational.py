"""The operational layout (API_SPEC v0.2): block_to_operational, operational_to_block,
universal_to_operational, operational_to_universal.

operational block: one C-contiguous [nl, no, inner] array, inner = nt*nh*hd;
  operational[l, o, :] == chunk[l*no + o].reshape(-1)                       (block <-> operational)
  operational[l, o].view(nt, nh, hd)[t, h, :] == universal[h, l, o, t, :]   (NHD)
  operational[l, o].view(nh, nt, hd)[h, t, :] == universal[h, l, o, t, :]   (HND)

Every destination is poisoned (0xA5) before a call and compared byte for byte with the
pure-torch references of support/references.py afterwards; sources are checked unchanged.
Errors are checked to be raised before any byte is written. Tests taking `device` run on
the CPU and, where one is visible, on a GPU. Sections:
  1. the references themselves (no kvbm_ext) and the checking helpers (can they fail?)
  2. results: the dtype x layout x shape matrix, alignment and round trips on every device;
     NumPy, nb = 1 / 0, backend names on the host
  3. errors: shapes, element types, contiguity and backend names on every device; the rest
     on host arrays
  4. GPU only (marked gpu): placements, backends, streams, sizes, errors, debug log
"""

import re

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_all_bitwise_equal,
    assert_bitwise_equal,
    assert_poisoned,
    call_op,
    check_op_rejected,
    op_and_check,
    peek_still_poisoned,
    poison_,
    poison_even_if_read_only,
)
from support.builders import (
    NUMPY_DTYPES,
    SHAPES,
    TORCH_DTYPES,
    arrays_in,
    clone_all,
    dtype_id,
    make_op_case,
    make_operationals,
    misaligned,
    place,
    random_tensor,
    read_only_copy,
    shape_id,
    to_numpy,
    torch_dtype_of,
)
from support.devices import SLEEP_CYCLES, cuda_case, sync
from support.references import (
    block_to_operational_ref,
    block_to_universal_ref,
    chunk_shape,
    expected_blocks,
    expected_op,
    expected_universals,
    operational_to_block_ref,
    operational_to_universal_ref,
    universal_to_block_ref,
    universal_to_operational_ref,
)

LAYOUTS = ["NHD", "HND"]
DIRECTIONS = ["b2o", "o2b", "u2o", "o2u"]
BLOCK_DIRECTIONS = ["b2o", "o2b"]  # block <-> operational: backend=, no layout
UNIVERSAL_DIRECTIONS = ["u2o", "o2u"]  # universal <-> operational: layout
OP_BACKENDS = ["kernel", "async", "batch", "auto"]
# Every spelling of a backend the tests pass (the spec: case-insensitive).
BACKEND_NAMES = OP_BACKENDS + ["KERNEL", "Batch"]


def src_dst(direction, blocks, universals, operationals):
    """(source, destination) arguments of `direction` from a case."""
    return {
        "b2o": (blocks, operationals),
        "o2b": (operationals, blocks),
        "u2o": (universals, operationals),
        "o2u": (operationals, universals),
    }[direction]


def layout_args(direction, layout):
    """The positional layout argument: only universal <-> operational take one."""
    return (layout,) if direction in UNIVERSAL_DIRECTIONS else ()


# A backend per direction (None: no backend argument; universal <-> operational take none).
BACKEND_CASES = [(d, b) for d in BLOCK_DIRECTIONS for b in OP_BACKENDS] + [(d, None) for d in UNIVERSAL_DIRECTIONS]


def backend_kwargs(backend):
    return {} if backend is None else {"backend": backend}


def check_direction(direction, blocks, universals, operationals, layout, **kwargs):
    """Run `direction` on a case (layout: of the chunks for b2o/o2b, the argument for u2o/o2u)."""
    src, dst = src_dst(direction, blocks, universals, operationals)
    op_and_check(direction, src, dst, *layout_args(direction, layout), **kwargs)


def dest_list(direction, dst):
    if direction == "o2b":
        return dst
    return list(dst) if isinstance(dst, (list, tuple)) else [dst]


def case_ids(v):
    if isinstance(v, torch.dtype):
        return dtype_id(v)
    if isinstance(v, tuple) and len(v) == 6:
        return shape_id(v)
    return None


# ==========================================================================
# 1. The references (no kvbm_ext) and the checking helpers.
# ==========================================================================


def test_ref_universal_operational_hand_example_hd1():
    # nh=2, nl=1, no=2, nt=3, hd=1: universal[h, 0, o, t, 0] = 6h + 3o + t
    universal = torch.arange(12, dtype=torch.int64).reshape(2, 1, 2, 3, 1)
    nhd = torch.tensor([[[0, 6, 1, 7, 2, 8], [3, 9, 4, 10, 5, 11]]])  # (t, h) order
    hnd = torch.tensor([[[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]])  # (h, t) order
    assert_bitwise_equal(universal_to_operational_ref(universal, "NHD"), nhd, "u2o NHD")
    assert_bitwise_equal(universal_to_operational_ref(universal, "hnd"), hnd, "u2o HND")
    assert_bitwise_equal(operational_to_universal_ref(nhd, 2, 3, 1, "NHD"), universal, "o2u NHD")
    assert_bitwise_equal(operational_to_universal_ref(hnd, 2, 3, 1, "HND"), universal, "o2u HND")


def test_ref_universal_operational_hand_example_hd2():
    # nh=2, nl=1, no=1, nt=2, hd=2: universal[h, 0, 0, t, d] = 4h + 2t + d
    universal = torch.arange(8, dtype=torch.int16).reshape(2, 1, 1, 2, 2)
    nhd = torch.tensor([[[0, 1, 4, 5, 2, 3, 6, 7]]], dtype=torch.int16)  # t0h0 t0h1 t1h0 t1h1
    hnd = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7]]], dtype=torch.int16)  # h0t0 h0t1 h1t0 h1t1
    assert_bitwise_equal(universal_to_operational_ref(universal, "NHD"), nhd, "u2o NHD")
    assert_bitwise_equal(universal_to_operational_ref(universal, "HND"), hnd, "u2o HND")
    assert_bitwise_equal(operational_to_universal_ref(nhd, 2, 2, 2, "NHD"), universal, "o2u NHD")
    assert_bitwise_equal(operational_to_universal_ref(hnd, 2, 2, 2, "HND"), universal, "o2u HND")


def test_ref_block_operational_hand_example():
    # nl=2, no=2; chunk i (any 3-D shape, here (2, 1, 2)) holds 10i + [0, 1, 2, 3] in C order.
    chunks = [torch.tensor([[[10 * i, 10 * i + 1]], [[10 * i + 2, 10 * i + 3]]], dtype=torch.int32) for i in range(4)]
    want = torch.tensor(
        [[[0, 1, 2, 3], [10, 11, 12, 13]], [[20, 21, 22, 23], [30, 31, 32, 33]]], dtype=torch.int32
    )
    assert_bitwise_equal(block_to_operational_ref(chunks, 2), want, "b2o")
    back = operational_to_block_ref(want, (2, 1, 2))
    assert len(back) == 4
    for i, (got, c) in enumerate(zip(back, chunks)):
        assert_bitwise_equal(got, c, f"o2b chunk {i}")
    # no = 1: the same four chunks become [4, 1, 4]
    assert_bitwise_equal(block_to_operational_ref(chunks, 1), want.reshape(4, 1, 4), "b2o no=1")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("nl,no,nh,nt,hd", [(2, 2, 3, 4, 5), (3, 1, 1, 2, 3), (1, 2, 2, 1, 1)])
def test_ref_matches_spec_index_formula(layout, nl, no, nh, nt, hd):
    """The spec's formulas, element by element, on unique values."""
    universal = torch.arange(nh * nl * no * nt * hd, dtype=torch.int64).reshape(nh, nl, no, nt, hd)
    op = universal_to_operational_ref(universal, layout)
    assert tuple(op.shape) == (nl, no, nt * nh * hd) and op.is_contiguous()
    for l in range(nl):
        for o in range(no):
            view = op[l, o].view(nt, nh, hd) if layout == "NHD" else op[l, o].view(nh, nt, hd)
            for h in range(nh):
                for t in range(nt):
                    got = view[t, h] if layout == "NHD" else view[h, t]
                    assert torch.equal(got, universal[h, l, o, t]), (l, o, h, t)
    assert_bitwise_equal(operational_to_universal_ref(op, nh, nt, hd, layout), universal, "o2u")
    # block <-> operational: operational[l, o, :] == chunk[l*no + o].reshape(-1)
    chunks = universal_to_block_ref(universal, layout)
    op_b = block_to_operational_ref(chunks, no)
    for l in range(nl):
        for o in range(no):
            assert torch.equal(op_b[l, o], chunks[l * no + o].reshape(-1)), (l, o)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float64], ids=dtype_id)
def test_ref_consistent_with_block_universal_refs(dtype, layout, gen):
    """u -> operational equals u -> chunks -> operational (and back), on random bytes."""
    nh, nl, no, nt, hd = 3, 2, 2, 4, 5
    u = random_tensor((nh, nl, no, nt, hd), dtype, generator=gen)
    op = universal_to_operational_ref(u, layout)
    assert_bitwise_equal(op, block_to_operational_ref(universal_to_block_ref(u, layout), no), "u2o vs b2o(u2b)")
    assert_bitwise_equal(operational_to_universal_ref(op, nh, nt, hd, layout), u, "o2u(u2o)")
    chunks = operational_to_block_ref(op, chunk_shape(nh, nt, hd, layout))
    assert_bitwise_equal(block_to_universal_ref(chunks, no, layout), u, "b2u(o2b)")
    # NHD and HND really differ here (nh, nt > 1): a swapped layout cannot pass.
    other = "HND" if layout == "NHD" else "NHD"
    assert not torch.equal(op.view(torch.uint8), universal_to_operational_ref(u, other).view(torch.uint8))


def _fake(behaviour):
    """A stand-in for a kvbm_ext function with a given (wrong) behaviour."""

    def f(src, dst, *args, **kwargs):
        dsts = list(arrays_in(dst))
        if behaviour == "nothing":
            return None
        if behaviour == "one-byte-short":
            want = expected_op("u2o", src, dst, args[0] if args else "NHD")
            for d, w in zip(dsts, want):
                d.copy_(w)
            dsts[-1].view(torch.uint8).view(-1)[-1] = 0xA5
            return None
        if behaviour == "wrong-layout":
            want = expected_op("u2o", src, dst, "HND")
            for d, w in zip(dsts, want):
                d.copy_(w)
            return None
        if behaviour == "touch-source":
            want = expected_op("u2o", src, dst, "NHD")
            for d, w in zip(dsts, want):
                d.copy_(w)
            next(arrays_in(src)).view(torch.uint8).view(-1)[0] ^= 1
            return None
        if behaviour == "write-then-raise":
            dsts[0].view(torch.uint8).fill_(0)
            raise ValueError("universals[1]: expected shape")
        raise AssertionError(behaviour)

    return f


@pytest.mark.parametrize("behaviour", ["nothing", "one-byte-short", "wrong-layout", "touch-source"])
def test_op_and_check_catches_wrong_results(behaviour, monkeypatch, gen):
    """The checking helper fails on a library that writes nothing, too little, the wrong
    layout or writes into a source."""
    _, universals, ops = make_op_case(2, 2, 2, 3, 4, 5, torch.bfloat16, generator=gen)
    monkeypatch.setattr(kvbm_ext, "universal_to_operational", _fake(behaviour), raising=False)
    with pytest.raises(AssertionError):
        op_and_check("u2o", universals, ops, "NHD")


def test_check_op_rejected_catches_writes_before_the_error(monkeypatch, gen):
    _, universals, ops = make_op_case(2, 2, 2, 3, 4, 5, torch.bfloat16, generator=gen)
    monkeypatch.setattr(kvbm_ext, "universal_to_operational", _fake("write-then-raise"), raising=False)
    with pytest.raises(AssertionError, match="bytes were written"):
        check_op_rejected("u2o", universals, ops, ValueError, r"universals\[1\]", "expected shape")


# ==========================================================================
# 2. Results.
# ==========================================================================

# Blocks and universals to operationals: every dtype, layout and shape. The reverse
# directions: every shape in bf16, every dtype on five shapes (hd = 13 among them).
REVERSE_CASES = [(torch.bfloat16, s) for s in SHAPES] + [
    (d, s) for d in TORCH_DTYPES if d != torch.bfloat16 for s in (SHAPES[5], SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[6])
]
MATRIX = [(d, dtype, s) for d in ("b2o", "u2o") for dtype in TORCH_DTYPES for s in SHAPES]
MATRIX += [(d, dtype, s) for d in ("o2b", "o2u") for dtype, s in REVERSE_CASES]


@pytest.mark.parametrize("direction,dtype,shape", MATRIX, ids=case_ids)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtype_layout_shape_matrix(direction, dtype, layout, shape, device, gen):
    """layout: of the chunks for block <-> operational, the argument for universal <-> operational."""
    check_direction(direction, *make_op_case(*shape, dtype, layout, device=device, generator=gen), layout)


def numpy_op_case(shape, np_dtype, layout, gen):
    blocks, universals, ops = make_op_case(*shape, torch_dtype_of(np_dtype), layout, generator=gen)
    blocks, universals, ops = to_numpy(blocks), to_numpy(universals), to_numpy(ops)
    assert all(isinstance(o, np.ndarray) and o.dtype == np_dtype for o in ops)
    return blocks, universals, ops


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_numpy(direction, np_dtype, layout, gen):
    blocks, universals, ops = numpy_op_case((3, 3, 2, 2, 3, 7), np_dtype, layout, gen)
    check_direction(direction, blocks, universals, ops, layout)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixed_numpy_and_torch_in_one_call(direction, gen):
    blocks, universals, ops = make_op_case(3, 2, 2, 3, 4, 5, torch.float32, "HND", generator=gen)
    ops = [o.numpy() if b % 2 else o for b, o in enumerate(ops)]  # alternate kinds
    blocks = [to_numpy(chunks) if b % 2 == 0 else chunks for b, chunks in enumerate(blocks)]
    universals = [u.numpy() if b == 1 else u for b, u in enumerate(universals)]
    check_direction(direction, blocks, universals, ops, "HND")


@pytest.mark.parametrize("chunk_shape_", [(5, 4, 3), (1, 60, 1), (60, 1, 1), (12, 1, 5)], ids=str)
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_any_3d_chunk_shape(direction, chunk_shape_, gen):
    """block <-> operational copies chunk bytes as they are: any 3-D shape of inner elements."""
    nb, nl, no, inner = 3, 2, 2, 60
    blocks = [[random_tensor(chunk_shape_, torch.float16, generator=gen) for _ in range(nl * no)] for _ in range(nb)]
    ops = make_operationals(nb, nl, no, inner, torch.float16, generator=gen)
    src, dst = (blocks, ops) if direction == "b2o" else (ops, blocks)
    op_and_check(direction, src, dst)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_backend_names_on_host(direction, backend, gen):
    """All-host arrays: every backend name is read (any case); "auto" runs on the CPU with
    the reference's result, the others, which pick how a GPU moves the bytes, are refused
    naming the backend read, before any byte is written."""
    blocks, universals, ops = make_op_case(3, 2, 2, 3, 4, 13, torch.bfloat16, "NHD", generator=gen)
    if backend.lower() == "auto":
        check_direction(direction, blocks, universals, ops, "NHD", backend=backend)
    else:
        reject(direction, blocks, universals, ops, ValueError, "backend", f'"{backend.lower()}" picks how a GPU',
               backend=backend)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "Hnd", "nHd"])
@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_layout_is_case_insensitive(direction, layout, gen):
    blocks, universals, ops = make_op_case(2, 2, 2, 3, 4, 5, torch.bfloat16, generator=gen)
    check_direction(direction, blocks, universals, ops, layout)


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_default_layout_is_nhd_and_layout_keyword(direction, gen):
    _, universals, ops = make_op_case(2, 2, 2, 3, 4, 5, torch.float16, generator=gen)  # nt != nh
    src, dst = src_dst(direction, None, universals, ops)
    # Without a layout the result is NHD (the HND result differs on this data).
    assert not torch.equal(
        universal_to_operational_ref(universals[0], "NHD").view(torch.int16),
        universal_to_operational_ref(universals[0], "HND").view(torch.int16),
    )
    op_and_check(direction, src, dst)
    op_and_check(direction, src, dst, layout="HND")
    op_and_check(direction, src, dst, layout="NHD")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("direction,backend", BACKEND_CASES + [(d, None) for d in BLOCK_DIRECTIONS], ids=lambda v: v)
def test_misaligned_pointers(direction, backend, dtype, device, gen):
    """hd = 128 and hd = 7, every array starting one element past its allocation.  The CPU
    takes only the default backend (test_options.py checks the refusal of the others)."""
    if device == "cpu" and backend not in (None, "auto"):
        backend = "auto"
    for shape in [(3, 2, 2, 2, 4, 128), (3, 2, 2, 3, 5, 7)]:
        blocks, universals, ops = make_op_case(*shape, dtype, "NHD", device=device, generator=gen)
        blocks = [[misaligned(c) for c in chunks] for chunks in blocks]
        universals = [misaligned(u) for u in universals]
        ops = [misaligned(o) for o in ops]
        check_direction(direction, blocks, universals, ops, "NHD", **backend_kwargs(backend))


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e5m2],
    ids=dtype_id,
)
def test_other_element_types_of_supported_size(dtype, gen):
    blocks, universals, ops = make_op_case(2, 2, 2, 3, 4, 5, dtype, "HND", generator=gen)
    for direction in DIRECTIONS:
        check_direction(direction, blocks, universals, ops, "HND")


# --------------------------------------------------------------------------
# nb = 1 as a single 3-D operational, nb = 0, tuples, stream=None, read-only sources.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_single_3d_operational_means_one_block(direction, kind, gen):
    blocks, universals, ops = make_op_case(1, 2, 2, 3, 4, 5, torch.float16, "HND", generator=gen)
    if kind == "numpy":
        blocks, universals, ops = to_numpy(blocks), to_numpy(universals), to_numpy(ops)
    check_direction(direction, blocks, universals, ops[0], "HND")


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_single_3d_operational_and_single_5d_universal(direction, gen):
    _, universals, ops = make_op_case(1, 3, 2, 2, 3, 5, torch.float32, generator=gen)
    for layout in LAYOUTS:
        src, dst = src_dst(direction, None, universals[0], ops[0])
        op_and_check(direction, src, dst, layout)


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_zero_blocks_is_a_no_op(empty):
    assert kvbm_ext.block_to_operational(empty, empty) is None
    assert kvbm_ext.operational_to_block(empty, empty) is None
    assert kvbm_ext.universal_to_operational(empty, empty) is None
    assert kvbm_ext.operational_to_universal(empty, empty) is None
    for backend in BACKEND_NAMES:
        assert kvbm_ext.block_to_operational(empty, empty, backend=backend, stream=None) is None
        assert kvbm_ext.operational_to_block(empty, empty, backend=backend) is None
    assert kvbm_ext.universal_to_operational(empty, empty, "HND", stream=None) is None
    assert kvbm_ext.operational_to_universal(empty, empty, layout="hnd") is None


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_tuples_are_sequences(direction, gen):
    blocks, universals, ops = make_op_case(3, 2, 2, 2, 3, 5, torch.bfloat16, "HND", generator=gen)
    check_direction(direction, tuple(tuple(c) for c in blocks), tuple(universals), tuple(ops), "HND")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stream_none_accepted_on_host(direction, gen):
    blocks, universals, ops = make_op_case(2, 2, 2, 2, 3, 5, torch.float32, generator=gen)
    check_direction(direction, blocks, universals, ops, "NHD", stream=None)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_read_only_numpy_sources(direction, gen):
    blocks, universals, ops = numpy_op_case((3, 2, 2, 3, 4, 5), np.float16, "NHD", gen)
    if direction == "b2o":
        blocks = [[read_only_copy(c) for c in chunks] for chunks in blocks]
    elif direction == "u2o":
        universals = [read_only_copy(u) for u in universals]
    else:
        ops = [read_only_copy(o) for o in ops]
    check_direction(direction, blocks, universals, ops, "NHD")


def test_repeated_calls_reuse_arrays(gen):
    """Same arrays, fresh data each time (no stale caching of addresses or contents)."""
    blocks, universals, ops = make_op_case(4, 2, 2, 2, 3, 5, torch.bfloat16, "NHD", generator=gen)
    for _ in range(3):
        for u in universals:
            u.copy_(random_tensor(u.shape, u.dtype, generator=gen))
        op_and_check("u2o", universals, ops, "NHD")
        op_and_check("o2b", ops, blocks)


# --------------------------------------------------------------------------
# Round trips (through the library only; the last comparison is with the reference).
# --------------------------------------------------------------------------


def fresh_like(x):
    """Poisoned arrays like x (same kinds, shapes, dtypes, devices; pinned stays pinned)."""
    if isinstance(x, (list, tuple)):
        return [fresh_like(v) for v in x]
    if isinstance(x, np.ndarray):
        return poison_(np.empty_like(x))
    t = torch.empty_like(x)
    if x.device.type == "cpu" and x.is_pinned():
        t = t.pin_memory()
    return poison_(t)


def _chain(direction, src, dst, layout):
    assert call_op(direction, src, dst, *layout_args(direction, layout)) is None


def check_round_trips(blocks, universals, ops, layout):
    """Poisoned fresh arrays everywhere; the paths through the operational layout give the
    bytes of the direct v0.1 conversions and of the references."""
    o_blocks, o_universals, o_ops = clone_all(blocks), clone_all(universals), clone_all(ops)
    # universal -> operational -> block  ==  universal -> block
    via_op, direct = fresh_like(blocks), fresh_like(blocks)
    tmp_ops = fresh_like(ops)
    _chain("u2o", universals, tmp_ops, layout)
    _chain("o2b", tmp_ops, via_op, layout)
    kvbm_ext.universal_to_block(universals, direct, layout)
    sync()
    assert_all_bitwise_equal(via_op, direct, "u2o+o2b vs u2b")
    assert_all_bitwise_equal(via_op, expected_blocks(o_universals, layout), "u2o+o2b vs reference")
    # block -> operational -> universal  ==  block -> universal
    via_op, direct = fresh_like(universals), fresh_like(universals)
    tmp_ops = fresh_like(ops)
    _chain("b2o", blocks, tmp_ops, layout)
    _chain("o2u", tmp_ops, via_op, layout)
    kvbm_ext.block_to_universal(blocks, direct, layout)
    sync()
    assert_all_bitwise_equal(via_op, direct, "b2o+o2u vs b2u")
    assert_all_bitwise_equal(via_op, expected_universals(o_blocks, len(blocks[0]) // ops[0].shape[0], layout))
    # universal -> operational  ==  universal -> block -> operational
    a, b = fresh_like(ops), fresh_like(ops)
    tmp_blocks = fresh_like(blocks)
    _chain("u2o", universals, a, layout)
    kvbm_ext.universal_to_block(universals, tmp_blocks, layout)
    _chain("b2o", tmp_blocks, b, layout)
    sync()
    assert_all_bitwise_equal(a, b, "u2o vs u2b+b2o")
    # identities: operational -> block -> operational, operational -> universal -> operational
    for mid, there, back in ((blocks, "o2b", "b2o"), (universals, "o2u", "u2o")):
        tmp, again = fresh_like(mid), fresh_like(ops)
        _chain(there, ops, tmp, layout)
        _chain(back, tmp, again, layout)
        sync()
        assert_all_bitwise_equal(again, o_ops, f"operationals after {there}+{back}")
    # identities: block -> operational -> block, universal -> operational -> universal
    for start, there, back in ((blocks, "b2o", "o2b"), (universals, "u2o", "o2u")):
        tmp, again = fresh_like(ops), fresh_like(start)
        _chain(there, start, tmp, layout)
        _chain(back, tmp, again, layout)
        sync()
        assert_all_bitwise_equal(again, start, f"after {there}+{back}")
    # the sources were never written
    assert_all_bitwise_equal(blocks, o_blocks, "blocks")
    assert_all_bitwise_equal(universals, o_universals, "universals")
    assert_all_bitwise_equal(ops, o_ops, "operationals")


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4], (5, 2, 2, 3, 4, 13)], ids=shape_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64], ids=dtype_id)
def test_round_trips(dtype, layout, shape, device, gen):
    check_round_trips(*make_op_case(*shape, dtype, layout, device=device, generator=gen), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.int8], ids=dtype_id)
def test_round_trips_numpy(np_dtype, layout, gen):
    check_round_trips(*numpy_op_case((3, 2, 2, 3, 4, 7), np_dtype, layout, gen), layout)


# ==========================================================================
# 3. Errors (all before any write).
# ==========================================================================

# nt != nh (NHD and HND chunks differ), nl != no (a swapped [no, nl, inner] differs).
NB, NL, NO, NH, NT, HD = 3, 3, 2, 3, 4, 5
INNER = NT * NH * HD  # 60
OP_SHAPE = (NL, NO, INNER)


def ecase(gen, dtype=torch.float32, layout="NHD", nb=NB, device="cpu"):
    return make_op_case(nb, NL, NO, NH, NT, HD, dtype, layout, device=device, generator=gen)


def reject(direction, blocks, universals, ops, exc, path, *words, layout=None, **kwargs):
    src, dst = src_dst(direction, blocks, universals, ops)
    args = layout_args(direction, "NHD" if layout is None else layout)
    return check_op_rejected(direction, src, dst, exc, path, *words, args=args, **kwargs)


# --------------------------------------------------------------------------
# Shapes and counts.
# --------------------------------------------------------------------------

WRONG_OP_SHAPES = [
    (NL, NO, INNER - 1),
    (NL, NO, INNER + 1),
    (NL + 1, NO, INNER),
    (NO, NL, INNER),
    (NL, NO, NT * NH, HD),
    (NL * NO, INNER),
]


@pytest.mark.parametrize("wrong", WRONG_OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_operational_wrong_shape(direction, wrong, device, gen):
    blocks, universals, ops = ecase(gen, device=device)
    ops[1] = random_tensor(wrong, torch.float32, device, gen)
    reject(
        direction, blocks, universals, ops, ValueError, r"operationals\[1\]",
        "expected shape", str(OP_SHAPE), "got", str(wrong),
    )


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_all_operationals_with_wrong_inner_for_the_universals(direction, gen):
    """Every operational [nl, no, inner + nh*hd]: consistent with each other, not with the universals."""
    blocks, universals, ops = ecase(gen)
    ops = [random_tensor((NL, NO, INNER + NH * HD), torch.float32, generator=gen) for _ in range(NB)]
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[0\]", "expected shape", str(OP_SHAPE))


@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_inner_size_not_matching_chunk_elements(direction, gen):
    """Every operational [nl, no, inner + 5]: consistent with each other, not with the chunks."""
    blocks, universals, _ = ecase(gen)
    ops = make_operationals(NB, NL, NO, INNER + 5, torch.float32, generator=gen)
    # The message gives both sides: the operationals' inner size and the chunks' size (or shape).
    reject(
        direction, blocks, universals, ops, ValueError, r"(operationals\[0\]|blocks\[0\]\[0\])",
        str(INNER + 5), re.compile(rf"\b{INNER}\b|{re.escape(str((NT, NH, HD)))}"),
    )


@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_nl_no_not_matching_the_chunk_count(direction, gen):
    """Every operational [nl + 1, no, inner]: blocks have nl*no chunks, not (nl+1)*no."""
    blocks, universals, _ = ecase(gen)
    ops = make_operationals(NB, NL + 1, NO, INNER, torch.float32, generator=gen)
    reject(direction, blocks, universals, ops, ValueError, r"(operationals\[0\]|blocks\[0\])")


@pytest.mark.parametrize("delta", [-1, +1], ids=["one-missing", "one-extra"])
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_block_with_wrong_chunk_count(direction, delta, gen):
    blocks, universals, ops = ecase(gen)
    blocks[1] = blocks[1][:delta] if delta < 0 else blocks[1] + [torch.empty_like(blocks[1][0])]
    reject(direction, blocks, universals, ops, ValueError, r"blocks\[1\]")


@pytest.mark.parametrize("n_src,n_dst", [(3, 2), (2, 3), (0, 1), (1, 0)])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_count_mismatch(direction, n_src, n_dst, gen):
    blocks, universals, ops = ecase(gen)
    src, dst = src_dst(direction, blocks, universals, ops)
    other = "blocks" if direction in BLOCK_DIRECTIONS else "universals"
    check_op_rejected(
        direction, src[:n_src], dst[:n_dst], ValueError, f"({other}|operationals)",
        str(n_src), str(n_dst), args=layout_args(direction, "NHD"),
    )


def test_count_mismatch_message_example(gen):
    blocks, universals, ops = ecase(gen)
    msg = check_op_rejected("b2o", blocks, ops[:2], ValueError, "(blocks|operationals)")
    assert re.search(r"\b3\b", msg) and re.search(r"\b2\b", msg), msg


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_count_mismatch_single_3d_operational(direction, gen):
    blocks, universals, ops = ecase(gen)
    other = "blocks" if direction in BLOCK_DIRECTIONS else "universals"
    src, dst = src_dst(direction, blocks[:2], universals[:2], ops[0])
    check_op_rejected(direction, src, dst, ValueError, f"({other}|operationals)", args=layout_args(direction, "NHD"))


@pytest.mark.parametrize("kind", ["other-layout", "hd+1", "2d", "4d"])
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_chunk_shape_differs_from_first(direction, kind, gen):
    blocks, universals, ops = ecase(gen, layout="NHD")
    wrong = {
        "other-layout": (NH, NT, HD),  # same element count, other shape
        "hd+1": (NT, NH, HD + 1),
        "2d": (NT * NH, HD),
        "4d": (1, NT, NH, HD),
    }[kind]
    blocks[2][1] = random_tensor(wrong, torch.float32, generator=gen)
    reject(
        direction, blocks, universals, ops, ValueError, r"blocks\[2\]\[1\]",
        "expected", str((NT, NH, HD)), "got", str(wrong),
    )


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_universals_of_different_shapes(direction, gen):
    blocks, universals, ops = ecase(gen)
    universals[2] = random_tensor((NH, NL, NO, NT, HD + 1), torch.float32, generator=gen)
    reject(direction, blocks, universals, ops, ValueError, r"universals\[2\]")


# --------------------------------------------------------------------------
# Element types.
# --------------------------------------------------------------------------

MIXED_TYPES = [
    (torch.bfloat16, torch.float16, [re.compile(r"bf16|bfloat16"), re.compile(r"(?<!b)(f16|float16|half)")]),
    (torch.float32, torch.int32, [re.compile(r"f32|float32"), re.compile(r"i32|int32")]),
    (torch.float8_e4m3fn, torch.int8, []),
]


@pytest.mark.parametrize(
    "common,odd,names", MIXED_TYPES, ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else ""
)
@pytest.mark.parametrize("where", ["operational", "other"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixed_element_types(direction, where, common, odd, names, device, gen):
    blocks, universals, ops = ecase(gen, dtype=common, device=device)
    if where == "operational":
        ops[1] = random_tensor(ops[1].shape, odd, device, gen)
        path = r"operationals\[1\]"
    elif direction in BLOCK_DIRECTIONS:
        blocks[1][2] = random_tensor(blocks[1][2].shape, odd, device, gen)
        path = r"blocks\[1\]\[2\]"
    else:
        universals[1] = random_tensor(universals[1].shape, odd, device, gen)
        path = r"universals\[1\]"
    reject(direction, blocks, universals, ops, TypeError, path, *names)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixed_element_types_numpy(direction, gen):
    blocks, universals, ops = ecase(gen, dtype=torch.float16)
    blocks, universals, ops = to_numpy(blocks), to_numpy(universals), to_numpy(ops)
    ops[2] = ops[2].view(np.int16)  # same size, other type
    reject(direction, blocks, universals, ops, TypeError, r"operationals\[2\]")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unsupported_element_size_complex128(direction, gen):
    blocks, universals, ops = ecase(gen, dtype=torch.complex128)
    assert ops[0].element_size() == 16
    reject(direction, blocks, universals, ops, TypeError, r"(blocks\[0\]\[0\]|universals\[0\]|operationals\[0\])")


# --------------------------------------------------------------------------
# Contiguity, read-only destinations.
# --------------------------------------------------------------------------


def _op_step2(gen, device="cpu"):
    t = random_tensor((NL, NO, 2 * INNER), torch.float32, device, gen)[..., ::2]
    assert tuple(t.shape) == OP_SHAPE and not t.is_contiguous()
    return t


def _op_permuted(gen, device="cpu"):
    t = random_tensor((NO, NL, INNER), torch.float32, device, gen).transpose(0, 1)
    assert tuple(t.shape) == OP_SHAPE and not t.is_contiguous()
    return t


def _op_numpy_step2(gen, device="cpu"):
    a = random_tensor((2 * NL, NO, INNER), torch.float32, generator=gen).numpy()[::2]
    assert a.shape == OP_SHAPE and not a.flags.c_contiguous
    return a


NON_CONTIGUOUS = {"step2": _op_step2, "permuted": _op_permuted, "numpy-step2": _op_numpy_step2}


@pytest.mark.parametrize("device,maker", [("cpu", m) for m in NON_CONTIGUOUS] + [cuda_case("cuda", "step2"),
                                                                                 cuda_case("cuda", "permuted")])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_contiguous_operational(direction, device, maker, gen):
    blocks, universals, ops = ecase(gen, device=device)
    ops[1] = NON_CONTIGUOUS[maker](gen, device)
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[1\]", "contiguous")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_contiguous_single_3d_operational(direction, gen):
    blocks, universals, _ = ecase(gen, nb=1)
    reject(direction, blocks, universals, _op_step2(gen), ValueError, r"operationals(\[0\])?", "contiguous")


@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_non_contiguous_chunk(direction, gen):
    blocks, universals, ops = ecase(gen)
    blocks[1][2] = random_tensor((NT, NH, 2 * HD), torch.float32, generator=gen)[..., ::2]
    reject(direction, blocks, universals, ops, ValueError, r"blocks\[1\]\[2\]", "contiguous")


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_non_contiguous_universal(direction, gen):
    blocks, universals, ops = ecase(gen)
    universals[1] = random_tensor((NL, NH, NO, NT, HD), torch.float32, generator=gen).transpose(0, 1)
    reject(direction, blocks, universals, ops, ValueError, r"universals\[1\]", "contiguous")


@pytest.mark.parametrize("protocol", ["numpy", "memoryview"])
@pytest.mark.parametrize("direction", ["b2o", "u2o"])
def test_read_only_destination_operational(direction, protocol, gen):
    blocks, universals, ops = ecase(gen)
    ops = to_numpy(ops)
    ro = ops[1].copy()
    ro.setflags(write=False)
    ops[1] = memoryview(ro) if protocol == "memoryview" else ro
    poison_even_if_read_only(ro)
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[1\]", "read-only")
    assert_poisoned(ro)


@pytest.mark.parametrize("direction", ["b2o", "u2o"])
def test_read_only_single_3d_destination(direction, gen):
    blocks, universals, ops = ecase(gen, nb=1)
    ro = read_only_copy(ops[0])
    poison_even_if_read_only(ro)
    reject(direction, blocks, universals, ro, ValueError, r"operationals(\[0\])?", "read-only")


def test_read_only_destination_chunk(gen):
    blocks, universals, ops = ecase(gen)
    ro = read_only_copy(blocks[1][1])
    blocks[1][1] = ro
    poison_even_if_read_only(ro)
    reject("o2b", blocks, universals, ops, ValueError, r"blocks\[1\]\[1\]", "read-only")


def test_read_only_destination_universal(gen):
    blocks, universals, ops = ecase(gen)
    ro = read_only_copy(universals[1])
    universals[1] = ro
    poison_even_if_read_only(ro)
    reject("o2u", blocks, universals, ops, ValueError, r"universals\[1\]", "read-only")


# --------------------------------------------------------------------------
# backend, layout, stream arguments.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "fast", "kernel ", "kern", "cuda", "memcpy", "batched", "cudaMemcpy"])
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_unknown_backend(direction, bad, device, gen):
    """Validated on every device (all-host arrays, which take the CPU path, too)."""
    blocks, universals, ops = ecase(gen, device=device)
    reject(direction, blocks, universals, ops, ValueError, "backend", *OP_BACKENDS, backend=bad)


@pytest.mark.parametrize("bad", [1, None, b"kernel", ["kernel"]], ids=["int", "None", "bytes", "list"])
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_backend_not_a_str(direction, bad, device, gen):
    blocks, universals, ops = ecase(gen, device=device)
    reject(direction, blocks, universals, ops, TypeError, "backend", backend=bad)


# Python's own argument errors start with the function name: any message (".*") will do.
ANY_MESSAGE = ".*"


@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_backend_and_stream_are_keyword_only(direction, gen):
    """block <-> operational take no layout: a third positional argument is refused."""
    blocks, universals, ops = ecase(gen)
    src, dst = src_dst(direction, blocks, universals, ops)
    for extra in (("kernel",), ("NHD",), ("auto", None)):
        check_op_rejected(direction, src, dst, TypeError, ANY_MESSAGE, args=extra)


@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_stream_and_backend_are_keyword_only(direction, gen):
    blocks, universals, ops = ecase(gen)
    src, dst = src_dst(direction, blocks, universals, ops)
    check_op_rejected(direction, src, dst, TypeError, ANY_MESSAGE, args=("NHD", None))
    check_op_rejected(direction, src, dst, TypeError, ANY_MESSAGE, args=("NHD", "kernel"))


@pytest.mark.parametrize("bad", ["XYZ", "", "NDH", "NHD ", "HN"])
@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_unknown_layout(direction, bad, gen):
    blocks, universals, ops = ecase(gen)
    reject(direction, blocks, universals, ops, ValueError, "layout", "NHD", "HND", layout=bad)


@pytest.mark.parametrize("bad", [1, None, b"NHD", ["NHD"]], ids=["int", "None", "bytes", "list"])
@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_layout_not_a_str(direction, bad, gen):
    blocks, universals, ops = ecase(gen)
    src, dst = src_dst(direction, blocks, universals, ops)
    check_op_rejected(direction, src, dst, TypeError, "layout", args=(bad,))


@pytest.mark.parametrize("bad", ["abc", 1.5, object(), [1]], ids=["str", "float", "object", "list"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_bad_stream_argument(direction, bad, gen):
    blocks, universals, ops = ecase(gen)
    reject(direction, blocks, universals, ops, TypeError, "stream", stream=bad)


# --------------------------------------------------------------------------
# Objects that are not arrays.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, None, object()], ids=["int", "None", "object"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_operationals_neither_array_nor_sequence(direction, bad, gen):
    blocks, universals, _ = ecase(gen)
    reject(direction, blocks, universals, bad, TypeError, "operationals")


@pytest.mark.parametrize("bad", ["abc", None, 3], ids=["str", "None", "int"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_non_array_operational(direction, bad, gen):
    blocks, universals, ops = ecase(gen)
    ops[1] = bad
    reject(direction, blocks, universals, ops, TypeError, r"operationals\[1\]")


@pytest.mark.parametrize(
    "where,path",
    [("blocks", "blocks"), ("block", r"blocks\[1\]"), ("chunk", r"blocks\[1\]\[2\]")],
    ids=["blocks", "block", "chunk"],
)
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_non_array_blocks(direction, where, path, gen):
    blocks, universals, ops = ecase(gen)
    if where == "blocks":
        blocks = 5
    elif where == "block":
        blocks[1] = 7
    else:
        blocks[1][2] = None
    reject(direction, blocks, universals, ops, TypeError, path)


@pytest.mark.parametrize("where,path", [("all", "universals"), ("one", r"universals\[1\]")], ids=["universals", "universal"])
@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_non_array_universals(direction, where, path, gen):
    blocks, universals, ops = ecase(gen)
    if where == "all":
        universals = None
    else:
        universals[1] = 3
    reject(direction, blocks, universals, ops, TypeError, path)


# ==========================================================================
# 4. GPU only.
# ==========================================================================


def placed_op_case(shape, dtype, layout, gen, other_where, ops_where):
    """blocks and universals placed `other_where`, operationals `ops_where`."""
    blocks, universals, ops = make_op_case(*shape, dtype, layout, generator=gen)
    blocks = [[place(c, other_where, b * 7 + i) for i, c in enumerate(chunks)] for b, chunks in enumerate(blocks)]
    universals = [place(u, other_where, i) for i, u in enumerate(universals)]
    ops = [place(o, ops_where, i + 1) for i, o in enumerate(ops)]
    return blocks, universals, ops


def device_op_case(shape, dtype, layout, gen, device="cuda"):
    return make_op_case(*shape, dtype, layout, device=device, generator=gen)


# (blocks/universals placement, operationals placement)
OP_PLACEMENTS = [
    ("device", "device"),
    ("device", "pinned"),
    ("pinned", "device"),
    ("mixed", "mixed"),
    ("pinned", "pinned"),  # all host: CPU path
    ("pinned", "pageable"),  # all host: CPU path
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("placement", OP_PLACEMENTS, ids=lambda p: f"{p[0]}-ops_{p[1]}")
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_gpu_backends_and_placements(direction, placement, backend, gen):
    """Every backend where a device array takes part; all in host memory the call runs on
    the CPU, which takes "auto" and refuses the others (GPU only) before any write."""
    blocks, universals, ops = placed_op_case((3, 2, 2, 3, 4, 13), torch.bfloat16, "HND", gen, *placement)
    all_host = "device" not in placement and "mixed" not in placement
    if all_host and backend.lower() != "auto":
        reject(direction, blocks, universals, ops, ValueError, "backend", f'"{backend.lower()}" picks how a GPU',
               backend=backend)
    else:
        check_direction(direction, blocks, universals, ops, "HND", backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("placement", [("device", "device"), ("device", "pinned"), ("pinned", "device")], ids=lambda p: f"{p[0]}-ops_{p[1]}")
@pytest.mark.parametrize("direction", BLOCK_DIRECTIONS)
def test_gpu_backends_large_chunks(direction, placement, backend, gen):
    """Chunks of exactly 1 MiB (float32), every backend name, device and pinned placements."""
    shape = (2, 2, 2, 16, 256, 64)  # chunk (256, 16, 64) float32 = 1 MiB
    blocks, universals, ops = placed_op_case(shape, torch.float32, "NHD", gen, *placement)
    assert blocks[0][0].numel() * 4 == 1 << 20
    check_direction(direction, blocks, universals, ops, "NHD", backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", OP_PLACEMENTS[1:], ids=lambda p: f"{p[0]}-ops_{p[1]}")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("direction", UNIVERSAL_DIRECTIONS)
def test_gpu_universal_placements(direction, dtype, layout, placement, gen):
    blocks, universals, ops = placed_op_case((5, 2, 2, 3, 4, 13), dtype, layout, gen, *placement)
    check_direction(direction, blocks, universals, ops, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("direction,backend", BACKEND_CASES, ids=lambda v: v)
def test_gpu_created_stream(direction, backend, gen):
    """On a torch.cuda.Stream; only that stream is synchronised before checking."""
    blocks, universals, ops = device_op_case((4, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen)
    s = torch.cuda.Stream()
    check_direction(direction, blocks, universals, ops, "NHD", stream=s, after=s.synchronize, **backend_kwargs(backend))
    blocks, universals, ops = placed_op_case((4, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen, "device", "pinned")
    check_direction(
        direction, blocks, universals, ops, "NHD", stream=s.cuda_stream, after=s.synchronize, **backend_kwargs(backend)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("direction,backend", BACKEND_CASES, ids=lambda v: v)
def test_gpu_legacy_default_stream(direction, backend, gen):
    blocks, universals, ops = device_op_case((4, 2, 2, 4, 8, 16), torch.float16, "HND", gen)
    legacy = torch.cuda.default_stream()
    check_direction(direction, blocks, universals, ops, "HND", stream=None, after=legacy.synchronize, **backend_kwargs(backend))
    blocks, universals, ops = placed_op_case((4, 2, 2, 4, 8, 16), torch.float16, "HND", gen, "pinned", "device")
    check_direction(direction, blocks, universals, ops, "HND", after=legacy.synchronize, **backend_kwargs(backend))


@pytest.mark.gpu
@pytest.mark.parametrize("direction,backend", BACKEND_CASES, ids=lambda v: v)
def test_gpu_work_is_enqueued_on_the_given_stream(direction, backend, gen):
    """With the stream busy (a long sleep) the call returns at once and nothing is written
    until the stream gets to it: the work went onto THAT stream, without a host sync."""
    blocks, universals, ops = device_op_case((4, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen)
    src, dst = src_dst(direction, blocks, universals, ops)
    want = expected_op(direction, src, dst, "NHD")
    poison_(list(arrays_in(dst)))
    sync()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
    call_op(direction, src, dst, *layout_args(direction, "NHD"), stream=s, **backend_kwargs(backend))
    assert not s.query(), "the call waited for the stream (or the sleep was too short)"

    if not peek_still_poisoned(list(arrays_in(dst)), s):
        pytest.skip("the sleep ended before the peek finished; cannot judge")

    s.synchronize()
    assert_all_bitwise_equal(dest_list(direction, dst), want, "destinations")


@pytest.mark.gpu
@pytest.mark.parametrize("direction,backend", BACKEND_CASES, ids=lambda v: v)
def test_gpu_misaligned_pinned_operationals(direction, backend, gen):
    blocks, universals, ops = placed_op_case((3, 2, 2, 2, 4, 128), torch.bfloat16, "NHD", gen, "device", "pinned")
    blocks = [[misaligned(c, 3) for c in chunks] for chunks in blocks]
    ops = [misaligned(o) for o in ops]
    assert ops[0].is_pinned()
    check_direction(direction, blocks, universals, ops, "NHD", **backend_kwargs(backend))


REALISTIC = (4, 8, 2, 8, 16, 128)  # nb=4, nl=8, no=2, nh=8, nt=16, hd=128: 32 KiB bf16 chunks


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [("device", "device"), ("device", "pinned")], ids=lambda p: f"{p[0]}-ops_{p[1]}")
@pytest.mark.parametrize("direction,backend", BACKEND_CASES + [("b2o", "KERNEL")], ids=lambda v: v)
def test_gpu_realistic_sizes(direction, backend, placement, gen):
    for layout in LAYOUTS if backend is None else ["NHD"]:
        blocks, universals, ops = placed_op_case(REALISTIC, torch.bfloat16, layout, gen, *placement)
        check_direction(direction, blocks, universals, ops, layout, **backend_kwargs(backend))


@pytest.mark.gpu
def test_gpu_round_trips_pinned_operationals(gen):
    check_round_trips(*placed_op_case(REALISTIC, torch.bfloat16, "HND", gen, "device", "pinned"), "HND")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_single_3d_operational(direction, gen):
    blocks, universals, ops = placed_op_case((1, 2, 2, 3, 4, 5), torch.float16, "HND", gen, "device", "pinned")
    check_direction(direction, blocks, universals, ops[0], "HND")
    check_direction(direction, blocks, universals, ops[0].cuda(), "HND")


@pytest.mark.gpu
def test_gpu_zero_blocks_with_stream():
    s = torch.cuda.Stream()
    assert kvbm_ext.block_to_operational([], [], backend="batch", stream=s) is None
    assert kvbm_ext.operational_to_block([], [], stream=s.cuda_stream) is None
    assert kvbm_ext.universal_to_operational([], [], "HND", stream=s) is None
    assert kvbm_ext.operational_to_universal([], [], stream=s) is None
    s.synchronize()


# --------------------------------------------------------------------------
# GPU errors.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_pageable_operational_mixed_with_device_rejected(direction, gen):
    blocks, universals, ops = placed_op_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pinned")
    ops[1] = torch.empty(ops[1].shape, dtype=ops[1].dtype).copy_(ops[1])  # pageable
    assert not ops[1].is_pinned()
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[1\]", "pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_all_pageable_operationals_with_device_rejected(direction, gen):
    blocks, universals, ops = placed_op_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "device", "pageable")
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[0\]", "pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_pageable_chunk_or_universal_with_device_operationals_rejected(direction, gen):
    blocks, universals, ops = placed_op_case((3, 2, 2, 3, 4, 5), torch.float16, "NHD", gen, "pinned", "device")
    blocks[1][2] = torch.empty(blocks[1][2].shape, dtype=torch.float16).copy_(blocks[1][2])
    universals[1] = torch.empty(universals[1].shape, dtype=torch.float16).copy_(universals[1])
    path = r"blocks\[1\]\[2\]" if direction in BLOCK_DIRECTIONS else r"universals\[1\]"
    reject(direction, blocks, universals, ops, ValueError, path, "pinned")


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_operationals_on_two_gpus_rejected(direction, gen):
    blocks, universals, ops = device_op_case((3, 2, 2, 3, 4, 5), torch.float32, "NHD", gen, device="cuda:0")
    ops[1] = ops[1].to("cuda:1")
    reject(direction, blocks, universals, ops, ValueError, r"operationals\[1\]", "device")


# --------------------------------------------------------------------------
# KVBM_EXT_DEBUG.
# --------------------------------------------------------------------------


def _debug_lines(err):
    return [line for line in err.splitlines() if line.startswith("kvbm_ext: ")]


def _run_and_capture(capfd, direction, src, dst, **kwargs):
    capfd.readouterr()
    op_and_check(direction, src, dst, **kwargs)
    return capfd.readouterr().err


@pytest.mark.gpu
def test_gpu_debug_log(monkeypatch, capfd, gen):
    blocks, _, ops = device_op_case((2, 2, 2, 3, 4, 16), torch.bfloat16, "NHD", gen)
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    op_and_check("b2o", blocks, ops, backend="auto")  # warm-up: first-use messages of torch or CUDA
    err = _run_and_capture(capfd, "b2o", blocks, ops, backend="auto")
    assert err == "", f"wrote to stderr without KVBM_EXT_DEBUG: {err!r}"

    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")  # read at every call
    err = _run_and_capture(capfd, "b2o", blocks, ops, backend="auto")
    lines = _debug_lines(err)
    assert len(lines) == 1, f"want one 'kvbm_ext: ' line, stderr was {err!r}"
    assert "block_to_operational" in lines[0] and "kernel" in lines[0], lines[0]

    err = _run_and_capture(capfd, "o2b", ops, blocks, backend="kernel")
    lines = _debug_lines(err)
    assert len(lines) == 1 and "operational_to_block" in lines[0] and "kernel" in lines[0], err

    err = _run_and_capture(capfd, "b2o", blocks, ops, backend="async")
    lines = _debug_lines(err)
    assert len(lines) == 1 and "block_to_operational" in lines[0] and "async" in lines[0], err

    err = _run_and_capture(capfd, "o2b", ops, blocks, backend="batch")
    lines = _debug_lines(err)
    assert len(lines) == 1 and "operational_to_block" in lines[0], err
    ran_batch = "batch" in lines[0]
    fell_back = "async" in lines[0] and re.search(r"cudaError\w+|not available", lines[0])
    assert ran_batch or fell_back, lines[0]

    monkeypatch.delenv("KVBM_EXT_DEBUG")
    err = _run_and_capture(capfd, "b2o", blocks, ops, backend="auto")
    assert err == "", f"wrote to stderr after KVBM_EXT_DEBUG was unset: {err!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["b2o", "o2b"])
def test_gpu_debug_log_auto_over_pcie(direction, monkeypatch, capfd, gen):
    """auto with pinned host operationals runs the copy engines (batch) where the
    batch API exists, the kernel otherwise; device to device it runs the kernel."""
    blocks, _, ops = placed_op_case((2, 2, 2, 4, 8, 16), torch.bfloat16, "NHD", gen, "device", "pinned")
    src, dst = (blocks, ops) if direction == "b2o" else (ops, blocks)
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    err = _run_and_capture(capfd, direction, src, dst, backend="auto")
    lines = _debug_lines(err)
    assert len(lines) == 1, err
    want = "batch" if kvbm_ext.is_memcpy_batch_available() else "kernel"
    assert re.search(rf"backend {want}\b", lines[0]), lines[0]
    assert "falling back" not in lines[0], lines[0]


# ==========================================================================
# Operationals (and universals) as one array with a leading nb dimension,
# [nb, nl, no, nt*nh*hd] and [nb, nh, nl, no, nt, hd], as PagedKVCache takes them.
# ==========================================================================

STACK_CASE = (3, 2, 2, 3, 4, 5)  # nb, nl, no, nh, nt, hd


def as_stack(arrays, where="cpu"):
    """One array holding `arrays` along a new leading dimension, on the host, the
    device ("cuda") or in pinned host memory ("pinned")."""
    stack = torch.stack(arrays)
    if where == "pinned":
        return stack.pin_memory()
    return stack.to(where)


def stacked_check(direction, src, dst, layout, after=sync, **kwargs):
    """Poisons dst, runs `direction` with src/dst as given (lists or stacks), compares
    every destination block with the reference computed block by block."""
    per_block = lambda x: list(x) if isinstance(x, (list, tuple, torch.Tensor, np.ndarray)) else x  # noqa: E731
    before = clone_all(per_block(src))
    poison_(list(arrays_in(per_block(dst))))
    sync()
    call_op(direction, src, dst, *layout_args(direction, layout), **kwargs)
    after()
    want = expected_op(direction, before, per_block(dst), layout)
    assert_all_bitwise_equal(per_block(dst), want, "destinations")
    assert_all_bitwise_equal(per_block(src), before, "sources")


@pytest.mark.parametrize("stacked", ["operationals", "universals", "both"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_operationals_and_universals(direction, layout, stacked, gen):
    if stacked != "operationals" and direction in BLOCK_DIRECTIONS:
        pytest.skip("block <-> operational has no universals")
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.bfloat16, layout, generator=gen)
    if stacked in ("operationals", "both"):
        ops = as_stack(ops)
    if stacked in ("universals", "both"):
        universals = as_stack(universals)
    src, dst = src_dst(direction, blocks, universals, ops)
    stacked_check(direction, src, dst, layout)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_operationals_numpy_with_gaps(direction, gen):
    """NumPy stacks whose blocks sit apart (leading stride of two blocks)."""
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.float16, "NHD", generator=gen)
    blocks, universals, ops = to_numpy(blocks), to_numpy(universals), to_numpy(ops)
    room = np.stack(ops + ops)[::2]
    room[...] = np.stack(ops)
    assert room.strides[0] == 2 * ops[0].nbytes
    src, dst = src_dst(direction, blocks, universals, room)
    stacked_check(direction, src, dst, "NHD")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_operationals_leading_dimension_not_nb(direction, gen):
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.float32, "NHD", generator=gen)
    extra = make_operationals(1, 2, 2, 4 * 3 * 5, torch.float32, generator=gen)
    src, dst = src_dst(direction, blocks, universals, as_stack(ops + extra))
    msg = check_op_rejected(direction, src, dst, ValueError, "operationals", "leading dimension",
                            args=layout_args(direction, "NHD"))
    assert "4 blocks" in msg, msg


def test_stacked_operationals_and_universals_disagree(gen):
    """Both sides as stacks: the operationals' count is checked against the universals'."""
    _, universals, ops = make_op_case(*STACK_CASE, torch.float32, "HND", generator=gen)
    check_op_rejected("u2o", as_stack(universals), as_stack(ops[:2]), ValueError, "operationals",
                      "2 blocks (its leading dimension) but universals has 3", args=("HND",))


@pytest.mark.parametrize("direction", ["u2o", "o2u"])
def test_stacked_operationals_of_the_wrong_block_shape(direction, gen):
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.float32, "NHD", generator=gen)
    wrong = torch.stack([o[:, :, :-1].contiguous() for o in ops])
    src, dst = src_dst(direction, blocks, universals, wrong)
    check_op_rejected(direction, src, dst, ValueError, "operationals", "(3, 2, 2, 59)", args=("NHD",))


@pytest.mark.parametrize("direction", ["b2o", "u2o"])
def test_stacked_operational_destination_blocks_may_not_overlap(direction, gen):
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.float32, "NHD", generator=gen)
    repeated = ops[0].unsqueeze(0).expand(3, *ops[0].shape)
    src, _ = src_dst(direction, blocks, universals, ops)
    check_op_rejected(direction, src, repeated, ValueError, "operationals", "overlap",
                      args=layout_args(direction, "NHD"))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stacked_operationals_blocks_must_be_contiguous(direction, gen):
    blocks, universals, ops = make_op_case(*STACK_CASE, torch.float32, "NHD", generator=gen)
    transposed = torch.stack([o.transpose(0, 1).contiguous() for o in ops]).transpose(1, 2)
    assert transposed.shape == (3, 2, 2, 60) and not transposed[0].is_contiguous()
    src, dst = src_dst(direction, blocks, universals, transposed)
    check_op_rejected(direction, src, dst, ValueError, "operationals", "C-contiguous",
                      args=layout_args(direction, "NHD"))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [("device", "device"), ("device", "pinned"), ("pinned", "device")],
                         ids=["device", "ops-pinned", "ops-device"])
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engines"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_stacked_operationals(direction, backend, placement, gen):
    other_where, ops_where = placement
    blocks, universals, ops = placed_op_case(STACK_CASE, torch.bfloat16, "NHD", gen, other_where, ops_where)
    ops = as_stack(ops, "pinned" if ops_where == "pinned" else "cuda")
    if direction in UNIVERSAL_DIRECTIONS:
        universals = as_stack(universals, "pinned" if other_where == "pinned" else "cuda")
    src, dst = src_dst(direction, blocks, universals, ops)
    stacked_check(direction, src, dst, "NHD", backend=backend)
