"""The DLPack C exchange fast path: every function that parses arrays first looks for
`type(obj).__dlpack_c_exchange_api__` (a "dlpack_exchange_api" capsule, torch 2.11+) and
fills the array through its C function, with no Python call; objects without it go through
`__dlpack__` and the other protocols as before. For CUDA arrays found that way the
producer's current work stream is ordered before the call's stream.

Observable: torch.Tensor subclasses whose Python `__dlpack__` (and `__dlpack_device__`)
raise still work. Every destination is poisoned before a call and compared byte for byte
with the pure-torch references afterwards.
"""

import ctypes

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_all_bitwise_equal,
    assert_bitwise_equal,
    assert_message_has,
    assert_poisoned,
    b2u_and_check,
    call,
    invoke,
    op_and_check,
    path_regex,
    poison_,
    run_and_check,
    u2b_and_check,
)
from support.builders import (
    Buffers,
    CacheCase,
    arrays_in,
    block_buffers,
    clone_all,
    dtype_id,
    make_case,
    make_op_case,
    random_tensor,
    snapshot,
)
from support.devices import SLEEP_CYCLES, cuda_case, rewrite_sources_behind_sleep, sync
from support.producers import DLPackOnly, wrap
from support.references import cache_rows, expected_blocks, expected_universals, paged_reference, per_block

HAS_EXCHANGE_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
requires_exchange_api = pytest.mark.skipif(
    not HAS_EXCHANGE_API, reason=f"torch {torch.__version__} has no __dlpack_c_exchange_api__"
)


class NoPythonDLPack(torch.Tensor):
    """A tensor whose Python DLPack method raises: only a consumer using the C exchange
    API (inherited from torch.Tensor's type) can read it."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("NoPythonDLPack.__dlpack__ called: the C exchange API was not used")


class NoPythonProtocols(NoPythonDLPack):
    """__dlpack_device__ and __cuda_array_interface__ raise as well: no Python call at all."""

    def __dlpack_device__(self, *args, **kwargs):
        raise AssertionError("NoPythonProtocols.__dlpack_device__ called")

    @property
    def __cuda_array_interface__(self):
        raise AssertionError("NoPythonProtocols.__cuda_array_interface__ read")


class NotACapsule(DLPackOnly):
    """A DLPack producer whose type has an __dlpack_c_exchange_api__ that is not a capsule:
    must be read through __dlpack__."""

    __dlpack_c_exchange_api__ = None


class IntInsteadOfCapsule(DLPackOnly):
    __dlpack_c_exchange_api__ = 42


def as_sub(x, cls):
    """Subclass views (same memory) of every tensor of a nested list."""
    if isinstance(x, (list, tuple)):
        return [as_sub(v, cls) for v in x]
    return x.as_subclass(cls)


# ==========================================================================
# torch exposes the capsule; the subclasses really refuse the Python protocol.
# ==========================================================================


@requires_exchange_api
def test_torch_tensor_type_has_the_exchange_capsule():
    api = type(torch.empty(1)).__dlpack_c_exchange_api__
    assert type(api).__name__ == "PyCapsule"
    assert '"dlpack_exchange_api"' in repr(api)
    assert NoPythonDLPack.__dlpack_c_exchange_api__ is api  # inherited by subclasses


def test_subclass_python_protocols_raise():
    t = torch.zeros(3).as_subclass(NoPythonProtocols)
    with pytest.raises(AssertionError):
        t.__dlpack__()
    with pytest.raises(AssertionError):
        t.__dlpack_device__()
    with pytest.raises(AssertionError):
        np.from_dlpack(t)
    # a consumer WITHOUT the fast path (NumPy) fails on them, so the tests below can fail
    u = torch.zeros(3).as_subclass(NoPythonDLPack)
    with pytest.raises(AssertionError):
        np.from_dlpack(u)


# ==========================================================================
# The list functions and PagedKVCache read subclasses through the C API (every device).
# ==========================================================================


@requires_exchange_api
@pytest.mark.parametrize("cls", [NoPythonDLPack, NoPythonProtocols])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_id)
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_list_conversions_read_subclasses_via_the_c_api(direction, dtype, layout, cls, device, gen):
    for shape in [(3, 2, 2, 3, 4, 5), (3, 2, 2, 3, 8, 64)]:
        blocks, universals = make_case(*shape, dtype, layout, device=device, generator=gen)
        blocks, universals = as_sub(blocks, cls), as_sub(universals, cls)
        if direction == "b2u":
            b2u_and_check(blocks, universals, layout, 2)
        else:
            u2b_and_check(universals, blocks, layout)


@requires_exchange_api
@pytest.mark.parametrize("direction", ["b2o", "o2b", "u2o", "o2u"])
def test_operational_functions_read_subclasses_via_the_c_api(direction, gen):
    blocks, universals, ops = make_op_case(3, 2, 2, 3, 4, 5, torch.float16, "NHD", generator=gen)
    blocks, universals, ops = (as_sub(x, NoPythonDLPack) for x in (blocks, universals, ops))
    src, dst = {"b2o": (blocks, ops), "o2b": (ops, blocks), "u2o": (universals, ops), "o2u": (ops, universals)}[direction]
    args = ("NHD",) if direction in ("u2o", "o2u") else ()
    op_and_check(direction, src, dst, *args)


@requires_exchange_api
def test_single_array_arguments_read_via_the_c_api(gen):
    """One 5-D universal (nb = 1) and one 3-D operational as subclasses."""
    blocks, universals, ops = make_op_case(1, 2, 2, 3, 4, 5, torch.int64, "HND", generator=gen)
    blocks = as_sub(blocks, NoPythonDLPack)
    u, op = universals[0].as_subclass(NoPythonDLPack), ops[0].as_subclass(NoPythonDLPack)
    b2u_and_check(blocks, u, "HND", 2)
    op_and_check("u2o", u, op, "HND")


@requires_exchange_api
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_mixed_subclass_plain_and_python_dlpack_in_one_call(direction, gen):
    """Fast path and fallback in one call: subclass, plain tensor and DLPack-only wrapper."""
    blocks, universals = make_case(3, 2, 2, 3, 4, 5, torch.float32, "NHD", generator=gen)
    blocks = [as_sub(chunks, NoPythonDLPack) if b == 0 else chunks for b, chunks in enumerate(blocks)]
    blocks[2] = [DLPackOnly(c) if i % 2 else c for i, c in enumerate(blocks[2])]
    universals = [universals[0].as_subclass(NoPythonDLPack), DLPackOnly(universals[1]), universals[2]]
    plain_blocks = [[c.tensor if isinstance(c, DLPackOnly) else c for c in chunks] for chunks in blocks]
    plain_universals = [u.tensor if isinstance(u, DLPackOnly) else u for u in universals]
    if direction == "b2u":
        before = clone_all(plain_blocks)
        poison_(plain_universals)
        call("b2u", blocks, universals, "NHD")
        assert_all_bitwise_equal(plain_universals, expected_universals(before, 2, "NHD"), "universals")
        assert_all_bitwise_equal(plain_blocks, before, "blocks (source)")
    else:
        before = clone_all(plain_universals)
        poison_(plain_blocks)
        call("u2b", blocks, universals, "NHD")
        assert_all_bitwise_equal(plain_blocks, expected_blocks(before, "NHD"), "blocks")
        assert_all_bitwise_equal(plain_universals, before, "universals (source)")
    assert universals[1].calls, "the DLPack-only wrapper was not read through __dlpack__"


# --------------------------------------------------------------------------
# PagedKVCache with subclasses: layers, ids, universals and operationals.
# --------------------------------------------------------------------------


def sub_cache_case(layout, gen, cls=NoPythonDLPack, device="cpu"):
    case = CacheCase(layout, 3, 9, 2, 3, 4, 16, torch.bfloat16, gen, device)
    make = case.buf.make
    case.buf = Buffers(case.buf.bases, make, lambda struct: as_sub(struct, cls) if isinstance(struct, list)
                       else struct.as_subclass(cls))
    return case


def sub_other(case, method, nb, gen, form, cls=NoPythonDLPack, pin=False):
    shape = case.universal_shape() if "universal" in method else case.operational_shape()
    buf = block_buffers(form, nb, shape, case.dtype, gen, case.device, pin)
    buf.arg = as_sub(buf.struct, cls) if isinstance(buf.struct, (list, tuple)) else buf.struct.as_subclass(cls)
    return buf


@requires_exchange_api
@pytest.mark.parametrize("cls", [NoPythonDLPack, NoPythonProtocols])
@pytest.mark.parametrize("form", ["list", "array"])
@pytest.mark.parametrize("layout", ["kbthd", "blkthd"])
@pytest.mark.parametrize("device,pin", [pytest.param("cpu", False, id="cpu"), cuda_case("cuda", False, id="cuda"),
                                        cuda_case("cuda", True, id="cuda-pinned")])
def test_paged_cache_of_subclasses(layout, form, cls, device, pin, gen):
    """Layers, block ids (int64 tensor on the cache's device) and universals/operationals
    (on that device, or pinned) all subclasses."""
    case = sub_cache_case(layout, gen, cls, device)
    cache = case.build()
    assert cache.device == torch.device("cuda:0" if device == "cuda" else "cpu")  # the subclass is torch's
    assert all(isinstance(x, cls) for x in (cache.layers if isinstance(cache.layers, (list, tuple)) else [cache.layers]))
    ids = torch.tensor([8, 0, 5], dtype=torch.int64, device=device).as_subclass(cls)
    for method in ("to_universal", "from_universal", "to_operational", "from_operational"):
        run_and_check(case, cache, method, ids, sub_other(case, method, 3, gen, form, cls, pin))


@pytest.mark.parametrize("cls", [DLPackOnly, NotACapsule, IntInsteadOfCapsule])
def test_paged_cache_through_python_dlpack(cls, gen):
    """Objects without the capsule (or with an attribute of that name that is not one)
    are read through __dlpack__: layers and universals as DLPack-only wrappers."""
    case = CacheCase("kbthd", 3, 9, 2, 3, 4, 5, torch.float16, gen)
    case.buf.arg = [cls(x) for x in case.buf.struct]
    cache = case.build()
    assert all(a is b for a, b in zip(cache.layers, case.buf.arg))
    assert all(w.calls for w in case.buf.arg), "layers not read through __dlpack__"
    for method in ("to_universal", "from_universal"):
        other = block_buffers("list", 3, case.universal_shape(), case.dtype, gen)
        other.arg = [cls(x) for x in other.struct]
        run_and_check(case, cache, method, [8, 0, 5], other)
        assert all(w.calls for w in other.arg), "universals not read through __dlpack__"


@pytest.mark.parametrize("cls", [DLPackOnly, NotACapsule, IntInsteadOfCapsule])
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_list_api_through_python_dlpack(direction, cls, gen):
    blocks, universals = make_case(3, 2, 2, 3, 4, 5, torch.bfloat16, "HND", generator=gen)
    w_blocks, w_universals = wrap(blocks, cls), wrap(universals, cls)
    if direction == "b2u":
        before = clone_all(blocks)
        poison_(universals)
        call("b2u", w_blocks, w_universals, "HND")
        assert_all_bitwise_equal(universals, expected_universals(before, 2, "HND"), "universals")
    else:
        before = clone_all(universals)
        poison_(blocks)
        call("u2b", w_blocks, w_universals, "HND")
        assert_all_bitwise_equal(blocks, expected_blocks(before, "HND"), "blocks")
    assert all(w.calls for w in w_universals) and all(w.calls for chunks in w_blocks for w in chunks)


# ==========================================================================
# GPU: the fast path on device arrays, and stream ordering through it.
# ==========================================================================


@pytest.mark.gpu
@requires_exchange_api
@pytest.mark.parametrize("fn,where", [("vectorized_copy", "host"), ("vectorized_copy", "device"),
                                      ("memcpy_batch", "host")])
def test_gpu_raw_copy_address_lists_via_the_c_api(fn, where, gen):
    """The address and size arrays of vectorized_copy / memcpy_batch as subclasses."""
    src = random_tensor((4096,), torch.uint8, "cuda", gen)
    dst = poison_(torch.empty(8192, dtype=torch.uint8, device="cuda"))
    offs_s, offs_d, sizes = [0, 17, 1000, 3000], [5000, 0, 2000, 7000], [17, 900, 1024, 1096]
    dev = "cpu" if where == "host" else "cuda"
    sp = torch.tensor([src.data_ptr() + o for o in offs_s], dtype=torch.int64, device=dev).as_subclass(NoPythonDLPack)
    dp = torch.tensor([dst.data_ptr() + o for o in offs_d], dtype=torch.int64, device=dev).as_subclass(NoPythonDLPack)
    sz = torch.tensor(sizes, dtype=torch.int64, device=dev).as_subclass(NoPythonDLPack)
    sync()
    getattr(kvbm_ext, fn)(sp, dp, sz)
    sync()
    want = poison_(torch.empty(8192, dtype=torch.uint8))
    for s, d, n in zip(offs_s, offs_d, sizes):
        want[d : d + n] = src[s : s + n].cpu()
    assert_bitwise_equal(dst, want, "dst")


def assert_list_call_result(direction, blocks, universals):
    """The destination of a "b2u" or "u2b" NHD call equals the reference of its source."""
    if direction == "b2u":
        assert_all_bitwise_equal(universals, expected_universals(blocks, 2, "NHD"), "universals")
    else:
        assert_all_bitwise_equal(blocks, expected_blocks(universals, "NHD"), "blocks")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["plain", "subclass"])
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_gpu_producer_stream_is_ordered_before_the_call_stream(direction, kind, gen):
    """The sources are rewritten on s1 (current) behind a long sleep; the call runs on s2
    with no manual sync. Correct only if the library orders s1 (the producer's current work
    stream) before s2. The subclass can only be read through the C API, so its case proves
    the fast path orders streams."""
    if kind == "subclass" and not HAS_EXCHANGE_API:
        pytest.skip("torch has no __dlpack_c_exchange_api__")
    blocks, universals = make_case(4, 2, 2, 4, 8, 64, torch.bfloat16, "NHD", device="cuda", generator=gen)
    if kind == "subclass":
        blocks, universals = as_sub(blocks, NoPythonDLPack), as_sub(universals, NoPythonDLPack)
    sources, dests = (blocks, universals) if direction == "b2u" else (universals, blocks)
    source_list = list(arrays_in(sources))
    poison_(dests)
    fresh = rewrite_sources_behind_sleep(
        source_list, gen, lambda stream: call(direction, blocks, universals, "NHD", stream=stream))
    assert_all_bitwise_equal(source_list, fresh, "sources")
    assert_list_call_result(direction, blocks, universals)


@pytest.mark.gpu
@requires_exchange_api
@pytest.mark.parametrize("method", ["from_universal", "from_operational"])
def test_gpu_paged_cache_orders_the_producer_stream_of_subclass_sources(method, gen):
    """Universals/operationals (subclasses) rewritten on s1 (current) behind a sleep;
    cache.from_* runs on s2: the cache must see the new data."""
    case = CacheCase("kbthd", 2, 8, 2, 2, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    other = sub_other(case, method, 4, gen, "list")
    ids = [7, 1, 4, 0]
    poison_(case.buf.bases)
    sync()
    want = snapshot(case.buf.bases)
    fresh = rewrite_sources_behind_sleep(
        other.bases, gen, lambda stream: getattr(cache, method)(other.arg, ids, stream=stream))
    paged_reference(method, cache_rows(case.buf.make(want), case.dims), per_block([f.cpu() for f in fresh]), ids,
              list(range(case.nl)))
    for i, (got, w) in enumerate(zip(case.buf.bases, want)):
        assert_bitwise_equal(got.view(torch.int16), w, f"cache memory #{i}")


# --------------------------------------------------------------------------
# stream=None runs where the arrays' own framework would: torch's current stream.
# --------------------------------------------------------------------------


def run_in_stream_context_behind_a_legacy_sleep(invoke, destinations):
    """Inside `with torch.cuda.stream(s)`, with a long sleep queued on the legacy default
    stream: call `invoke()` (stream=None) and clone the destinations on s right after. A
    call run on the legacy stream would wait behind the sleep while the clones, on s, read
    the poison: the clones equal the final bytes only if the call ran on s."""
    legacy = torch.cuda.default_stream()
    s = torch.cuda.Stream()  # non-blocking: nothing orders it after the legacy stream
    sync()
    with torch.cuda.stream(legacy):
        torch.cuda._sleep(SLEEP_CYCLES)
    with torch.cuda.stream(s):
        invoke()
        clones = [d.clone() for d in destinations]
    sync()
    return clones


@pytest.mark.gpu
@requires_exchange_api
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_gpu_stream_none_runs_on_the_current_torch_stream_list(direction, gen):
    blocks, universals = make_case(4, 2, 2, 4, 8, 64, torch.bfloat16, "NHD", device="cuda", generator=gen)
    call(direction, blocks, universals, "NHD")  # warm-up: the first launch loads the kernels and may synchronize
    dests = universals if direction == "b2u" else [c for b in blocks for c in b]
    poison_(dests)
    clones = run_in_stream_context_behind_a_legacy_sleep(lambda: call(direction, blocks, universals, "NHD"), dests)
    assert_all_bitwise_equal(clones, dests, "destinations cloned on the current stream right after the call")
    assert_list_call_result(direction, blocks, universals)


@pytest.mark.gpu
@requires_exchange_api
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_gpu_stream_none_runs_on_the_current_torch_stream_paged(where, gen):
    """Block ids as a host list: the only torch arrays of the call are the universals (and,
    pinned, not on the device) and the cache's own layers, whose framework is asked."""
    case = CacheCase("kbthd", 2, 8, 2, 2, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    ids = [7, 1, 4, 0]
    U = block_buffers("array", 4, case.universal_shape(), case.dtype, gen, "cuda" if where == "device" else "cpu",
                      where == "pinned")
    cache.to_universal(ids, U.arg)  # warm-up
    poison_(U.bases)
    sync()
    want = snapshot(U.bases)
    clones = run_in_stream_context_behind_a_legacy_sleep(lambda: cache.to_universal(ids, U.arg), U.bases)
    assert_all_bitwise_equal(clones, U.bases, "universals cloned on the current stream right after the call")
    paged_reference("to_universal", cache_rows(case.buf.make(snapshot(case.buf.bases)), case.dims), per_block(U.make(want)),
              ids, list(range(case.nl)))
    for i, (got, w) in enumerate(zip(U.bases, want)):
        assert_bitwise_equal(got.view(torch.int16), w, f"universals #{i}")


# ==========================================================================
# What torch's __dlpack__ refuses (or would export wrongly), the fast path refuses
# too: conjugate and negative views, whose bytes are not their values, and
# destinations that require grad.  Destinations written are bumped like an
# in-place op's.
# ==========================================================================

SHAPE = (3, 2, 2, 3, 4, 5)  # nb, nl, no, nh, nt, hd


def refused(invoke, written, read, exc, path, *words):
    """invoke() must raise `exc` with a message starting with `path` and holding `words`;
    the plain tensors `written` (poisoned first) keep the poison and `read` is unchanged."""
    poison_(written)
    before = clone_all(read)
    with pytest.raises(exc, match=path_regex(path)) as info:
        invoke()
    sync()
    assert_message_has(str(info.value), words)
    assert_poisoned(written, "destinations")
    assert_all_bitwise_equal(read, before, "sources")
    return info.value


def flagged(t, flag):
    """A view of plain tensor t (same memory) with `flag` set: "conj" (complex only),
    "neg" (the negative bit)."""
    return t.conj() if flag == "conj" else t._neg_view()


FLAG_DTYPES = {"conj": torch.complex64, "neg": torch.float32}


def flag_case(flag, gen, device="cpu"):
    blocks, universals = make_case(*SHAPE, FLAG_DTYPES[flag], "NHD", generator=gen, device=device)
    return blocks, universals


@pytest.mark.parametrize("where", ["blocks", "universals"])
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
@pytest.mark.parametrize("flag", ["conj", "neg"])
def test_conjugate_and_negative_views_refused(flag, direction, where, device, gen):
    blocks, universals = flag_case(flag, gen, device)
    assert flagged(universals[0], flag).data_ptr() == universals[0].data_ptr()
    args_blocks = [list(chunks) for chunks in blocks]
    args_universals = list(universals)
    if where == "blocks":
        args_blocks[1][2] = flagged(blocks[1][2], flag)
        path = r"blocks\[1\]\[2\]"
    else:
        args_universals[1] = flagged(universals[1], flag)
        path = r"universals\[1\]"
    written, read = (universals, blocks) if direction == "b2u" else (blocks, universals)
    word = "conjugate" if flag == "conj" else "negative"
    refused(lambda: call(direction, args_blocks, args_universals), written, read, ValueError, path, word,
            "resolve_" + flag)


@pytest.mark.parametrize("flag", ["conj", "neg"])
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_flagged_stack_of_universals_refused(direction, flag, gen):
    blocks, universals = flag_case(flag, gen)
    stack = torch.stack(universals)
    written, read = (stack, blocks) if direction == "b2u" else (blocks, stack)
    refused(lambda: call(direction, blocks, flagged(stack, flag)), written, read, ValueError, "universals",
            "conjugate" if flag == "conj" else "negative")


def test_imaginary_part_of_a_conjugate_view_refused(gen):
    """x.conj().imag has the negative bit: its bytes are x.imag's, its values their negation."""
    blocks, universals = make_case(1, 1, 1, 1, 1, 1, torch.complex64, "NHD", generator=gen)
    dst = [[torch.empty(1, 1, 1)]]
    imag = universals[0].conj().imag
    assert imag.is_neg()
    refused(lambda: kvbm_ext.universal_to_block(imag, dst), dst, [universals[0]], ValueError, "universals",
            "negative")


@pytest.mark.parametrize("flag", ["conj", "neg"])
@pytest.mark.parametrize("direction", ["b2o", "o2b", "u2o", "o2u"])
def test_flagged_operationals_refused(direction, flag, gen):
    blocks, universals, ops = make_op_case(*SHAPE, FLAG_DTYPES[flag], "NHD", generator=gen)
    plain = {"b2o": (blocks, ops), "o2b": (ops, blocks), "u2o": (universals, ops), "o2u": (ops, universals)}[direction]
    args = [list(ops) if x is ops else x for x in plain]
    which = 1 if direction in ("b2o", "u2o") else 0
    args[which][2] = flagged(ops[2], flag)
    layout = ("NHD",) if direction in ("u2o", "o2u") else ()
    refused(lambda: getattr(kvbm_ext, OP_NAMES[direction])(*args, *layout), plain[1], plain[0], ValueError,
            r"operationals\[2\]", "conjugate" if flag == "conj" else "negative")


OP_NAMES = {"b2o": "block_to_operational", "o2b": "operational_to_block", "u2o": "universal_to_operational",
            "o2u": "operational_to_universal"}


def test_flagged_tensor_through_python_dlpack_refused(gen):
    """A producer's __dlpack__ that refuses (torch: BufferError for a conjugate view) is a
    ValueError naming the argument, with the producer's error as its cause."""
    blocks, universals = flag_case("conj", gen)
    args = [DLPackOnly(u) for u in universals]
    args[1] = DLPackOnly(universals[1].conj())
    error = refused(lambda: kvbm_ext.universal_to_block(args, blocks), blocks, universals, ValueError,
                    r"universals\[1\]", "refused to export", "conjugate bit")
    assert isinstance(error.__cause__, BufferError)


@pytest.mark.parametrize("form", ["list", "stack"])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_destination_that_requires_grad_refused(leaf, form, gen):
    blocks, universals = make_case(*SHAPE, torch.float32, "HND", generator=gen)
    plain = torch.stack(universals) if form == "stack" else universals
    base = torch.zeros(plain.shape if form == "stack" else universals[1].shape, requires_grad=True)
    grad = base if leaf else base * 1
    assert grad.requires_grad and grad.is_leaf == leaf
    if form == "stack":
        args, path, written = grad, "universals", [base]
    else:
        args, path, written = [universals[0], grad, universals[2]], r"universals\[1\]", [base]
    with torch.no_grad():
        poison_(base)
    before = clone_all(blocks)
    with pytest.raises(ValueError, match=path_regex(path)) as info:
        kvbm_ext.block_to_universal(blocks, args, "HND")
    assert "requires grad" in str(info.value) and "detach()" in str(info.value)
    assert_poisoned([b.detach() for b in written], "destination")
    assert_all_bitwise_equal(blocks, before, "blocks (source)")
    # its detached alias, same memory, is written as asked
    if form == "stack":
        kvbm_ext.block_to_universal(blocks, base.detach(), "HND")
        assert_all_bitwise_equal(list(base.detach()), expected_universals(blocks, 2, "HND"), "universals")


def test_source_that_requires_grad_is_read(gen):
    """Reading needs no autograd: a source that requires grad is read as its detach() would be."""
    blocks, universals = make_case(*SHAPE, torch.float32, "NHD", generator=gen)
    sources = [u.clone().requires_grad_() for u in universals]
    poison_(blocks)
    kvbm_ext.universal_to_block(sources, blocks)
    assert_all_bitwise_equal(blocks, expected_blocks(universals, "NHD"), "blocks")


@pytest.mark.parametrize("form", ["list", "stack"])
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2b"])
def test_written_tensors_get_their_version_counter_bumped(direction, form, gen):
    """As an in-place op of torch would: each destination's _version grows, the
    sources' stays (views share their base's counter, so the base's grows too)."""
    blocks, universals, ops = make_op_case(*SHAPE, torch.bfloat16, "NHD", generator=gen)
    if form == "stack":
        universals, ops = torch.stack(universals), torch.stack(ops)
    src, dst = {"b2u": (blocks, universals), "u2b": (universals, blocks), "u2o": (universals, ops),
                "o2b": (ops, blocks)}[direction]
    dst_tensors = [dst] if isinstance(dst, torch.Tensor) else list(arrays_in(dst))
    src_tensors = [src] if isinstance(src, torch.Tensor) else list(arrays_in(src))
    before_dst = [t._version for t in dst_tensors]
    before_src = [t._version for t in src_tensors]
    if direction in ("b2u", "u2b"):
        call(direction, *((src, dst) if direction == "b2u" else (dst, src)))
    else:
        getattr(kvbm_ext, OP_NAMES[direction])(src, dst, *(("NHD",) if direction == "u2o" else ()))
    assert all(t._version > v for t, v in zip(dst_tensors, before_dst)), "a destination's version did not grow"
    assert [t._version for t in src_tensors] == before_src, "a source's version changed"


def test_version_bump_makes_autograd_notice_an_overwritten_saved_tensor(gen):
    """The point of the bump: a tensor saved for backward and then overwritten by a
    conversion makes backward raise instead of using the new values silently."""
    blocks, universals = make_case(1, 1, 1, 1, 2, 4, torch.float32, "NHD", generator=gen)
    w = torch.ones(1, 1, 1, 2, 4, requires_grad=True)
    saved = universals[0]
    loss = (w * saved).sum()  # saves `saved` for the gradient of w
    kvbm_ext.block_to_universal(blocks, [saved])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# PagedKVCache writes as the list functions do: from_* writes the cache's layer tensors (as
# given to the constructor), to_* its universals or operationals.

PAGED_IDS = [8, 0, 5]


def paged_case(layout, gen, dtype=torch.float32):
    """A host cache with 3 layers of 9 blocks (3 tensors for "kbthd", one for "blkthd"), and
    the layer tensors as the constructor got them."""
    case = CacheCase(layout, 3, 9, 2, 3, 4, 5, dtype, gen)
    layers = case.buf.arg if isinstance(case.buf.arg, list) else [case.buf.arg]
    return case, layers


def paged_other(case, method, gen, form="list"):
    shape = case.universal_shape() if "universal" in method else case.operational_shape()
    return block_buffers(form, len(PAGED_IDS), shape, case.dtype, gen)


@pytest.mark.parametrize("layout,path", [("kbthd", r"layers\[1\]"), ("blkthd", "layers")])
@pytest.mark.parametrize("method", ["from_universal", "from_operational"])
def test_paged_layer_that_requires_grad_is_not_written(method, layout, path, gen):
    """A layer tensor that requires grad is refused as a list function's destination is
    (ValueError naming it), with no byte of the cache written.  requires_grad is asked at
    each write: here it is set after construction.  Reading the cache stays allowed."""
    case, layers = paged_case(layout, gen)
    cache = case.build()
    layers[len(layers) // 2].requires_grad_()
    before = snapshot(case.buf.bases)
    other = paged_other(case, method, gen)
    sources = snapshot(other.bases)
    with pytest.raises(ValueError, match=path_regex(path)) as info:
        invoke(cache, method, PAGED_IDS, other.arg)
    assert "requires grad" in str(info.value) and "detach()" in str(info.value)
    assert_all_bitwise_equal(snapshot(case.buf.bases), before, "cache (destination)")
    assert_all_bitwise_equal(snapshot(other.bases), sources, "source")
    versions = [t._version for t in layers]
    cache.to_universal(PAGED_IDS, paged_other(case, "to_universal", gen).arg)
    assert [t._version for t in layers] == versions, "reading the cache changed a layer's version"


@pytest.mark.parametrize("form,path", [("list", r"universals\[1\]"), ("array", "universals")])
def test_paged_flat_destination_that_requires_grad_refused(form, path, gen):
    case, _ = paged_case("kbthd", gen)
    cache = case.build()
    other = paged_other(case, "to_universal", gen, form)
    poison_(other.bases)
    other.bases[len(other.bases) // 2].requires_grad_()
    with pytest.raises(ValueError, match=path_regex(path)) as info:
        cache.to_universal(PAGED_IDS, other.arg)
    assert "requires grad" in str(info.value)
    assert_poisoned([b.detach() for b in other.bases], "universals (destination)")


@pytest.mark.parametrize("layout", ["kbthd", "blkthd"])
@pytest.mark.parametrize("method", ["to_universal", "from_universal", "to_operational", "from_operational"])
def test_paged_written_tensors_get_their_version_counter_bumped(method, layout, gen):
    """from_* bumps the _version of every layer tensor given to the constructor (the cache
    reads a detached alias, which shares the counter), to_* that of every universal or
    operational destination; the sources' stay."""
    case, layers = paged_case(layout, gen, torch.bfloat16)
    cache = case.build()
    other = paged_other(case, method, gen)
    written, read = (other.arg, layers) if method.startswith("to_") else (layers, other.arg)
    before_written, before_read = [t._version for t in written], [t._version for t in read]
    invoke(cache, method, PAGED_IDS, other.arg)
    assert all(t._version > v for t, v in zip(written, before_written)), "a destination's version did not grow"
    assert [t._version for t in read] == before_read, "a source's version changed"


def test_paged_write_makes_autograd_notice_an_overwritten_saved_layer(gen):
    case, layers = paged_case("kbthd", gen)
    cache = case.build()
    w = torch.ones(layers[0].shape, requires_grad=True)
    loss = (w * layers[0]).sum()  # saves layers[0] for the gradient of w
    cache.from_universal(paged_other(case, "from_universal", gen).arg, PAGED_IDS)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("layout", ["kbthd", "kbthd_shared", "lkbthd"])
def test_paged_write_bumps_each_version_counter_once(layout, gen):
    """A write of every layer bumps each distinct counter once: separate layer tensors one
    each, views of one allocation (which share their base's counter) one in all, not one per
    layer."""
    case, layers = paged_case(layout, gen, torch.bfloat16)
    cache = case.build()
    owners = case.buf.bases
    before = [t._version for t in layers] + [b._version for b in owners]
    cache.from_universal(paged_other(case, "from_universal", gen).arg, PAGED_IDS)
    after = [t._version for t in layers] + [b._version for b in owners]
    assert [a - b for a, b in zip(after, before)] == [1] * len(after)


def test_paged_write_checks_and_bumps_only_the_layers_it_writes(gen):
    """layers= selects what from_* writes, and so what it checks and bumps: a layer left out
    may require grad and keeps its version; selecting it is refused, with nothing written."""
    case, layers = paged_case("kbthd", gen, torch.bfloat16)
    cache = case.build()
    layers[2].requires_grad_()
    universals = block_buffers("list", len(PAGED_IDS), case.universal_shape(NL=2), case.dtype, gen)
    versions = [t._version for t in layers]
    cache.from_universal(universals.arg, PAGED_IDS, layers=slice(0, 2))
    assert [t._version - v for t, v in zip(layers, versions)] == [1, 1, 0]
    written = torch.stack([u.transpose(0, 1) for u in universals.bases])  # [ids, nl, nh, no, nt, hd]
    for k in range(2):
        got = layers[k].detach()[:, PAGED_IDS].permute(1, 3, 0, 2, 4)  # [ids, nh, no, nt, hd]
        assert torch.equal(got.view(torch.int16), written[:, k].view(torch.int16)), f"layer {k}"
    before = snapshot(case.buf.bases)
    with pytest.raises(ValueError, match=path_regex(r"layers\[2\]")):
        cache.from_universal(paged_other(case, "from_universal", gen).arg, PAGED_IDS, layers=range(1, 3))
    assert_all_bitwise_equal(snapshot(case.buf.bases), before, "cache (destination)")


def test_paged_inference_layers_are_written_without_torch_calls(gen):
    """Inference tensors have no version counter, and autograd can never save one, so a write
    cannot change a gradient: from_* writes them even when requires_grad was set (possible
    inside inference mode) and asks torch nothing per call."""
    with torch.inference_mode():
        case, layers = paged_case("kbthd", gen, torch.bfloat16)
        layers[1].requires_grad_()
    cache = case.build()
    other = paged_other(case, "from_universal", gen)
    cache.from_universal(other.arg, PAGED_IDS)
    back = block_buffers("list", len(PAGED_IDS), case.universal_shape(), case.dtype, gen)
    cache.to_universal(PAGED_IDS, back.arg)
    assert_all_bitwise_equal(snapshot(back.bases), snapshot(other.bases), "universals read back")


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True], ids=["device", "pinned"])
def test_gpu_requires_grad_destination_refused_and_versions_bumped(pin, gen):
    blocks, universals = make_case(*SHAPE, torch.bfloat16, "NHD", generator=gen, device="cuda")
    stack = torch.stack(universals)
    stack = stack.cpu().pin_memory() if pin else stack
    grad = torch.zeros_like(stack).requires_grad_()
    with pytest.raises(ValueError, match=path_regex("universals")):
        kvbm_ext.block_to_universal(blocks, grad)
    poison_(stack)
    version = stack._version
    kvbm_ext.block_to_universal(blocks, stack)
    sync()
    assert stack._version > version
    assert_all_bitwise_equal(list(stack), expected_universals(blocks, 2, "NHD"), "universals")


# ==========================================================================
# torch tensors read through __dlpack__ (torch before 2.11 has no C exchange API), and
# producers whose C exchange API breaks its contract.
# ==========================================================================


class WithoutExchangeAPI(torch.Tensor):
    """A torch tensor read as torch before 2.11 is: through __dlpack__, whose capsule (not
    the tensor) then owns the borrow."""

    __dlpack_c_exchange_api__ = None


@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_destination_read_through_dlpack_gets_its_version_bumped(direction, gen):
    blocks, universals = make_case(*SHAPE, torch.bfloat16, "NHD", generator=gen)
    blocks = [[c.as_subclass(WithoutExchangeAPI) for c in row] for row in blocks]
    universals = [u.as_subclass(WithoutExchangeAPI) for u in universals]
    written = universals if direction == "b2u" else [c for row in blocks for c in row]
    poison_(written)
    before = [t._version for t in written]
    if direction == "b2u":
        kvbm_ext.block_to_universal(blocks, universals, "NHD")
        want = expected_universals(blocks, SHAPE[2], "NHD")
        assert_all_bitwise_equal(universals, want, "universals")
    else:
        sources = [u.clone().as_subclass(WithoutExchangeAPI) for u in universals]
        kvbm_ext.universal_to_block(sources, blocks, "NHD")
        assert_all_bitwise_equal([c for row in blocks for c in row],
                                 [c for row in expected_blocks(sources, "NHD") for c in row], "blocks")
    assert all(t._version > v for t, v in zip(written, before)), "a destination's version did not grow"


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_FROM_OBJECT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_DLTensor))
_CURRENT_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class _ExchangeAPI(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("managed_tensor_allocator", ctypes.c_void_p), ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", _FROM_OBJECT), ("current_work_stream", _CURRENT_STREAM)]


def producer_whose_stream_fails_silently():
    """A type whose C exchange API (ctypes callbacks: they run with the GIL, as a producer's
    C functions would) describes a [4] uint8 CUDA array at a made-up address, and whose
    current_work_stream returns -1 without setting an exception."""
    shape = (ctypes.c_int64 * 1)(4)

    def from_object(obj, out):
        out[0].data, out[0].device = 0x10000, _Device(2, 0)  # kDLCUDA, device 0
        out[0].ndim, out[0].dtype, out[0].shape, out[0].strides = 1, _DataType(1, 8, 1), shape, None
        return 0

    def stream(device_type, device_id, out):
        out[0] = None
        return -1

    keep = (shape, _FROM_OBJECT(from_object), _CURRENT_STREAM(stream))
    api = _ExchangeAPI(1, 3, None, None, None, None, keep[1], keep[2])
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(api), b"dlpack_exchange_api", None)
    # The class keeps the structure and callbacks alive for as long as its capsule.
    return type("LyingProducer", (), {"__dlpack_c_exchange_api__": capsule, "_keep": (api, keep)})


def test_producer_whose_current_stream_fails_silently_is_a_clean_error():
    """current_work_stream returning -1 without an exception: a RuntimeError saying so, not
    a SystemError (nor Python code run with an exception set)."""
    producer = producer_whose_stream_fails_silently()
    out = np.zeros(4, np.uint8)
    with pytest.raises(RuntimeError, match="current_work_stream") as info:
        kvbm_ext.block_to_universal([[producer()]], [out.reshape(1, 1, 1, 1, 4)], "NHD")
    assert not isinstance(info.value, SystemError)
    assert not out.any()
