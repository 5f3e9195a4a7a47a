"""Staged transfers (notes/STAGED_API.md, kvbm_ext 0.4.0): `backend=` and `num_ctas=` on every
conversion, the per-device staging memory (set_staging / reserve_staging / staging_info) and
the copy-engine paths through it.

With pinned host memory in a call, backends "auto", "copy_engines", "batch" and "async" move
every byte that crosses PCIe with the copy engines: a kernel permutes into / out of device
staging slots, piece by piece, on internal streams forked from and joined back to the
caller's stream; "kernel" reads and writes the pinned memory directly. Whatever the path the
bytes are the references' (tests/support/references.py): every destination
is poisoned (0xA5) before a call and compared byte for byte afterwards (moved bytes written,
everything else still poisoned), sources are checked unchanged, and errors are raised before
any byte is written. After a call only the CALLER'S stream is synchronized before checking
(not the whole device), so a missing join shows up as wrong bytes.

Sections:
  1. host (runs everywhere): the checking helper; backend / num_ctas read and validated on
     host arrays and host caches, where only their defaults run (the CPU takes no GPU
     option), and validated (marked gpu) with pinned memory in a GPU call;
     set_staging / staging_info / reserve_staging arguments
  2. GPU: every conversion with pinned memory and every backend (list API, PagedKVCache),
     layers and offsets, mixed placements, stream forms, transfers needing many pieces
  3. GPU: a small staging (slots wrap many times; blocks larger than the staging)
  4. GPU: calls from several threads on their own streams
  5. GPU: CUDA graph capture and replay; a fresh process: staging allocated on first need,
     capture refused without reserve_staging
  6. GPU: fork / join ordering with the caller's stream
  7. GPU: a staged call's error in its last block writes nothing
  8. GPU: KVBM_EXT_DEBUG names the path
  9. GPU: staging_info; num_ctas gives the same bytes
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import kvbm_ext
from support.asserts import (
    assert_all_bitwise_equal,
    assert_bitwise_equal,
    expect_rejected,
    invoke,
    peek_still_poisoned,
    poison_,
    run_and_check,
)
from support.builders import (
    METHODS,
    Buffers,
    CacheCase,
    arrays_in,
    block_buffers,
    clone_all,
    dtype_id,
    make_generator,
    pick_ids,
    place,
    random_tensor,
    snapshot,
    split,
)
from support.devices import DEFAULT_STAGING, SLEEP_CYCLES, cuda_case, sync
from support.references import (
    as_int,
    as_list,
    cache_rows,
    chunk_shape,
    expected_blocks,
    expected_op,
    expected_universals,
    paged_reference,
    per_block,
    selected,
)

MiB = 1 << 20

BACKENDS = ["auto", "copy_engines", "batch", "async", "kernel"]
STAGED_BACKENDS = ["auto", "copy_engines", "batch", "async"]

# List API: direction code -> function; every function takes (source, destination, ...).
LIST_FUNCTIONS = {
    "b2u": "block_to_universal",
    "u2b": "universal_to_block",
    "u2o": "universal_to_operational",
    "o2u": "operational_to_universal",
    "b2o": "block_to_operational",
    "o2b": "operational_to_block",
}
LIST_DIRECTIONS = list(LIST_FUNCTIONS)
# (source, destination) argument names of each direction.
ROLES = {
    "b2u": ("blocks", "universals"),
    "u2b": ("universals", "blocks"),
    "u2o": ("universals", "operationals"),
    "o2u": ("operationals", "universals"),
    "b2o": ("blocks", "operationals"),
    "o2b": ("operationals", "blocks"),
}
# (source placement, destination placement) with pinned host memory on one side; the first
# entry has the "universal" / "operational" side pinned (the offload / onload of a server).
LIST_PLACEMENTS = {
    "b2u": [("device", "pinned"), ("pinned", "device"), ("device", "mixed")],
    "u2b": [("pinned", "device"), ("device", "pinned"), ("mixed", "device")],
    "u2o": [("pinned", "device"), ("device", "pinned")],
    "o2u": [("pinned", "device"), ("device", "pinned")],
    "b2o": [("device", "pinned"), ("pinned", "device")],
    "o2b": [("pinned", "device"), ("device", "pinned")],
}

# PagedKVCache method codes: inner order of the operational after the colon.
PAGED_DIRECTIONS = ["to_universal", "from_universal", "to_operational:NHD", "to_operational:HND",
                    "from_operational:NHD", "from_operational:HND"]
FOUR_DIRECTIONS = ["to_universal", "from_universal", "to_operational:HND", "from_operational:HND"]


def case_id(v):
    if isinstance(v, torch.dtype):
        return dtype_id(v)
    if isinstance(v, (slice, range)):
        return repr(v).replace(" ", "")
    if v is None:
        return "None"
    return None


# ==========================================================================
# Helpers.
# ==========================================================================


def takes_layout(direction):
    """block <-> operational take no layout argument (the chunks keep their own order)."""
    return direction not in ("b2o", "o2b")


def list_call(direction, src, dst, layout="NHD", **kwargs):
    fn = getattr(kvbm_ext, LIST_FUNCTIONS[direction])
    if takes_layout(direction):
        return fn(src, dst, layout, **kwargs)
    return fn(src, dst, **kwargs)


def list_arrays(direction, shape, dtype, layout, gen, src_at, dst_at):
    """(source, destination) arguments of `direction`: random bytes, placed `src_at` /
    `dst_at` ('device', 'pinned', 'pageable', or 'mixed': alternately device and pinned)."""
    nb, nl, no, nh, nt, hd = shape

    def make(role, where):
        if role == "blocks":
            cshape = chunk_shape(nh, nt, hd, layout)
            return [[place(random_tensor(cshape, dtype, generator=gen), where, b + i) for i in range(nl * no)]
                    for b in range(nb)]
        if role == "universals":
            return [place(random_tensor((nh, nl, no, nt, hd), dtype, generator=gen), where, b) for b in range(nb)]
        return [place(random_tensor((nl, no, nt * nh * hd), dtype, generator=gen), where, b) for b in range(nb)]

    src_role, dst_role = ROLES[direction]
    return make(src_role, src_at), make(dst_role, dst_at)


def single(direction, src, dst):
    """The nb = 1 forms: one 5-D universal / one 3-D operational instead of a list of one."""
    assert len(src) == 1 and len(dst) == 1
    src_role, dst_role = ROLES[direction]
    return (src if src_role == "blocks" else src[0]), (dst if dst_role == "blocks" else dst[0])


def list_expected(direction, src, dst, layout):
    """Reference destinations of `direction` from sources `src` (shapes taken from `dst`)."""
    if direction == "b2u":
        return expected_universals(src, as_list(dst)[0].shape[2], layout)
    if direction == "u2b":
        return expected_blocks(as_list(src), layout)
    return expected_op(direction, src, dst, layout)


def list_destinations(direction, dst):
    return dst if ROLES[direction][1] == "blocks" else as_list(dst)


def stream_and_wait(form):
    """The `stream` argument for `form` and a function waiting for THAT stream only."""
    if form is None:
        return None, torch.cuda.default_stream().synchronize  # the legacy default stream
    s = torch.cuda.Stream()
    if form == "int":
        return s.cuda_stream, s.synchronize
    assert form == "Stream", form
    return s, s.synchronize


def list_check(direction, src, dst, layout="NHD", stream_form="Stream", **kwargs):
    """Poison the destinations, call `direction` (on a stream of `stream_form`; "host": no
    stream, host arrays), wait for that stream only, then compare every destination byte
    with the reference and every source with its snapshot."""
    src_before = clone_all(src)
    poison_(list(arrays_in(dst)))
    sync()
    if stream_form == "host":
        stream, wait = None, (lambda: None)
    else:
        stream, wait = stream_and_wait(stream_form)
    assert list_call(direction, src, dst, layout, stream=stream, **kwargs) is None
    wait()
    name = LIST_FUNCTIONS[direction]
    want = list_expected(direction, src_before, dst, layout)
    assert_all_bitwise_equal(list_destinations(direction, dst), want, f"{name}: {ROLES[direction][1]}")
    assert_all_bitwise_equal(list(arrays_in(src)), list(arrays_in(src_before)), f"{name}: {ROLES[direction][0]} (source)")


def paged_other(case, method, nb, gen, where="pinned", form="array", NH=None, NL=None, dtype=None):
    """Universals or operationals for `method`: 'pinned', 'device', 'host' (pageable) or
    'mixed' (a list, alternately pinned and device)."""
    shape = case.universal_shape(NH, NL) if "universal" in method else case.operational_shape()
    dtype = dtype or case.dtype
    if where == "mixed":
        bases = [random_tensor(shape, dtype, "cuda" if b % 2 else "cpu", gen, pin=b % 2 == 0) for b in range(nb)]
        return Buffers(bases, lambda bs: list(bs))
    return block_buffers(form, nb, shape, dtype, gen, "cuda" if where == "device" else "cpu", where == "pinned")


def paged_check(case, cache, direction, ids, gen, where="pinned", form="array", NH=None, NL=None,
                stream_form="Stream", **kwargs):
    """run_and_check of support/asserts.py on fresh universals / operationals, the call on a
    stream of `stream_form` ("host": none) and only that stream waited for."""
    method, extra = split(direction)
    other = paged_other(case, method, len(ids), gen, where, form, NH, NL)
    if stream_form == "host":
        run_and_check(case, cache, method, ids, other, **extra, **kwargs)
        return
    stream, wait = stream_and_wait(stream_form)
    run_and_check(case, cache, method, ids, other, after=wait, stream=stream, **extra, **kwargs)


def paged_reject(case, cache, method, ids, other, exc, path, *words, **kwargs):
    """The call raises `exc` with a message starting with `path`; the destination (other
    for to_*, the cache for from_*) still poisoned, the source unchanged."""
    src, dst = (case.buf.bases, other) if method.startswith("to_") else (other, case.buf.bases)
    return expect_rejected(lambda: invoke(cache, method, ids, other, **kwargs), src, dst, exc, path, words)


@pytest.fixture
def staging():
    """staging(size_bytes, lanes): set_staging for one test; the defaults are restored after."""

    def use(size_bytes, lanes):
        sync()
        assert kvbm_ext.set_staging(size_bytes, lanes=lanes) is None

    yield use
    sync()
    if hasattr(kvbm_ext, "set_staging"):
        kvbm_ext.set_staging(DEFAULT_STAGING[0], lanes=DEFAULT_STAGING[1])


# ==========================================================================
# 1. Host (runs everywhere).
# ==========================================================================


def _fake_block_to_universal(bug):
    """block_to_universal written in Python on host arrays, with one bug."""

    def f(blocks, universals, layout="NHD", **kwargs):
        if bug == "nothing":
            return None
        want = expected_universals(blocks, universals[0].shape[2], layout)
        for u, w in zip(universals, want):
            u.copy_(w.flip(0) if bug == "heads-reversed" else w)
        if bug == "last-byte":
            universals[-1].view(torch.uint8).view(-1)[-1] ^= 0xFF
        if bug == "touch-source":
            blocks[0][0].view(torch.uint8).view(-1)[0] ^= 1
        return None

    return f


@pytest.mark.parametrize("bug", ["nothing", "last-byte", "heads-reversed", "touch-source"])
def test_list_check_catches_wrong_implementations(bug, monkeypatch, gen):
    """list_check passes a correct implementation and fails one that writes nothing, one
    byte wrong, the heads in the wrong order, or writes into its source."""
    src, dst = list_arrays("b2u", (2, 2, 2, 3, 4, 5), torch.bfloat16, "NHD", gen, "pageable", "pageable")
    monkeypatch.setattr(kvbm_ext, "block_to_universal", _fake_block_to_universal("none"))
    list_check("b2u", src, dst, "NHD", stream_form="host")
    monkeypatch.setattr(kvbm_ext, "block_to_universal", _fake_block_to_universal(bug))
    with pytest.raises(AssertionError):
        list_check("b2u", src, dst, "NHD", stream_form="host")


HOST_SHAPE = (3, 2, 2, 3, 4, 5)  # nb, nl, no, nh, nt, hd (nt != nh: NHD and HND differ)


@pytest.mark.parametrize("backend", BACKENDS + ["COPY_ENGINES", "Auto", "kerNEL", "Batch", "ASYNC"])
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_host_list_every_backend_value(direction, backend, gen):
    """Every backend value (any case) is read on host arrays: "auto" runs on the CPU with the
    reference's bytes; the others, which pick how a GPU moves the bytes, are refused naming
    the backend read, before any byte is written."""
    src, dst = list_arrays(direction, HOST_SHAPE, torch.bfloat16, "HND", gen, "pageable", "pageable")
    if backend.lower() == "auto":
        list_check(direction, src, dst, "HND", stream_form="host", backend=backend)
    else:
        expect_rejected(lambda: list_call(direction, src, dst, "HND", backend=backend), src, dst, ValueError,
                        "backend", (f'"{backend.lower()}" picks how a GPU',))


@pytest.mark.parametrize("num_ctas", [None, 1, 8, 1000])
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_host_list_num_ctas_none_runs_a_bound_is_refused(direction, num_ctas, gen):
    src, dst = list_arrays(direction, HOST_SHAPE, torch.float16, "NHD", gen, "pageable", "pageable")
    if num_ctas is None:
        list_check(direction, src, dst, "NHD", stream_form="host", num_ctas=num_ctas)
    else:
        expect_rejected(lambda: list_call(direction, src, dst, "NHD", num_ctas=num_ctas), src, dst, ValueError,
                        "num_ctas", (f"num_ctas: {num_ctas} bounds the CUDA blocks",))


BAD_BACKENDS = [("copy-engine", ValueError), ("copy engines", ValueError), ("", ValueError),
                ("staged", ValueError), (1, TypeError), (None, TypeError), (b"auto", TypeError)]
BAD_NUM_CTAS = [(0, ValueError), (-3, ValueError), (True, TypeError), (False, TypeError), (1.5, TypeError),
                ("8", TypeError)]


def bad_id(v):
    return repr(v) if not isinstance(v, type) else v.__name__


BAD_ARGUMENTS = [("backend", *b) for b in BAD_BACKENDS] + [("num_ctas", *b) for b in BAD_NUM_CTAS]
# Host arrays, and where a GPU is visible pinned memory on one side of a GPU call.
WHERE = ["host", cuda_case("pinned")]


@pytest.mark.parametrize("argument,bad,exc", BAD_ARGUMENTS, ids=bad_id)
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
@pytest.mark.parametrize("where", WHERE)
def test_list_bad_backend_or_num_ctas(direction, argument, bad, exc, where, gen):
    src_at, dst_at = ("pageable", "pageable") if where == "host" else LIST_PLACEMENTS[direction][0]
    src, dst = list_arrays(direction, HOST_SHAPE, torch.bfloat16, "NHD", gen, src_at, dst_at)
    expect_rejected(lambda: list_call(direction, src, dst, "NHD", **{argument: bad}), src, dst, exc, argument, ())


@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_host_list_backend_and_num_ctas_are_keyword_only(direction, gen):
    """A positional argument after the layout (or after the destination, for block <->
    operational) is refused: backend and num_ctas are keyword-only."""
    src, dst = list_arrays(direction, HOST_SHAPE, torch.bfloat16, "NHD", gen, "pageable", "pageable")
    fn = getattr(kvbm_ext, LIST_FUNCTIONS[direction])
    args = ("NHD", "auto") if takes_layout(direction) else ("auto",)
    expect_rejected(lambda: fn(src, dst, *args), src, dst, TypeError, ".*", ())


def host_cache(gen, layout="kbthd"):
    case = CacheCase(layout, 3, 9, 2, 3, 4, 5, torch.bfloat16, gen)
    return case, case.build()


@pytest.mark.parametrize("backend", BACKENDS + ["COPY_ENGINES", "Kernel"])
@pytest.mark.parametrize("direction", PAGED_DIRECTIONS)
def test_host_cache_every_backend_value(direction, backend, gen):
    """A host cache runs on the CPU: "auto" moves the reference's bytes, the other backends
    (GPU only) are refused naming the backend read."""
    case, cache = host_cache(gen)
    if backend.lower() == "auto":
        kwargs = {"NH": case.nh + 1, "head_offset": 1} if "universal" in direction else {}
        paged_check(case, cache, direction, [7, 0, 4], gen, where="host", form="list", stream_form="host",
                    backend=backend, **kwargs)
        return
    method, _ = split(direction)
    other = paged_other(case, method, 3, gen, where="host", form="list").arg
    paged_reject(case, cache, method, [4, 0, 7], other, ValueError, "backend", f'"{backend.lower()}" picks how a GPU',
                 backend=backend)


@pytest.mark.parametrize("argument,bad,exc", BAD_ARGUMENTS, ids=bad_id)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", WHERE)
def test_cache_bad_backend_or_num_ctas(method, argument, bad, exc, where, gen):
    """On a host cache, and on a GPU cache with pinned universals / operationals."""
    case = CacheCase("kbthd", 3, 9, 2, 3, 4, 5, torch.bfloat16, gen, "cpu" if where == "host" else "cuda")
    form = "list" if where == "host" else "array"
    other = paged_other(case, method, 3, gen, where=where, form=form).arg
    paged_reject(case, case.build(), method, [4, 0, 7], other, exc, argument, **{argument: bad})


# set_staging(size_bytes=None, *, lanes=None): (args, kwargs, exception, argument named)
BAD_SET_STAGING = {
    "size-negative": ((-1,), {}, ValueError, "size_bytes"),
    "size-zero": ((0,), {}, ValueError, "size_bytes"),
    "size-below-1MiB": ((MiB - 1,), {}, ValueError, "size_bytes"),
    "size-str": (("x",), {}, TypeError, "size_bytes"),
    "size-float": ((float(64 * MiB),), {}, TypeError, "size_bytes"),
    "size-keyword-str": ((), {"size_bytes": "64M"}, TypeError, "size_bytes"),
    "lanes-zero": ((64 * MiB,), {"lanes": 0}, ValueError, "lanes"),
    "lanes-negative": ((64 * MiB,), {"lanes": -1}, ValueError, "lanes"),
    "lanes-17": ((64 * MiB,), {"lanes": 17}, ValueError, "lanes"),
    "lanes-zero-size-None": ((None,), {"lanes": 0}, ValueError, "lanes"),
    "lanes-str": ((64 * MiB,), {"lanes": "2"}, TypeError, "lanes"),
    "lanes-float": ((64 * MiB,), {"lanes": 2.0}, TypeError, "lanes"),
    "lanes-positional": ((64 * MiB, 2), {}, TypeError, None),
}


@pytest.mark.parametrize("bad", list(BAD_SET_STAGING))
def test_set_staging_bad_arguments(bad):
    """ValueError out of range, TypeError for non-ints, the message naming the argument;
    the staging (on a GPU machine: staging_info()) is unchanged."""
    args, kwargs, exc, name = BAD_SET_STAGING[bad]
    before = kvbm_ext.staging_info() if torch.cuda.is_available() else None
    with pytest.raises(exc) as info:
        kvbm_ext.set_staging(*args, **kwargs)
    if name is not None:
        assert name in str(info.value), f"{name!r} not in message {str(info.value)!r}"
    if before is not None:
        assert kvbm_ext.staging_info() == before


def test_set_staging_valid_values_return_none(staging):
    """Valid calls return None (also without a CUDA device: there is nothing to free)."""
    assert kvbm_ext.set_staging() is None
    assert kvbm_ext.set_staging(None, lanes=None) is None
    assert kvbm_ext.set_staging(MiB, lanes=16) is None
    assert kvbm_ext.set_staging(lanes=1) is None
    assert kvbm_ext.set_staging(size_bytes=3 * MiB + 7) is None
    assert kvbm_ext.set_staging(*DEFAULT_STAGING[:1], lanes=DEFAULT_STAGING[1]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
@pytest.mark.parametrize("name", ["staging_info", "reserve_staging"])
def test_staging_functions_without_a_cuda_device(name):
    """RuntimeError for the current device; an explicit index that does not exist may also
    be refused as a bad `device` argument (ValueError naming it)."""
    with pytest.raises(RuntimeError):
        getattr(kvbm_ext, name)()
    with pytest.raises((RuntimeError, ValueError)) as info:
        getattr(kvbm_ext, name)(0)
    if info.type is ValueError:
        assert str(info.value).startswith("device"), str(info.value)


# ==========================================================================
# 2. GPU: every conversion with pinned memory, every backend.
# ==========================================================================

# (shape, dtype): a realistic-ish one, and 7-byte rows with nh, nt odd.
LIST_SHAPES = [((3, 2, 2, 4, 8, 64), torch.bfloat16), ((2, 3, 2, 3, 5, 7), torch.float8_e4m3fn)]
LIST_GRID = [(d, s, t, layout) for d, pairs in LIST_PLACEMENTS.items() for s, t in pairs
             for layout in (["NHD", "HND"] if takes_layout(d) else ["NHD"])]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction,src_at,dst_at,layout", LIST_GRID,
                         ids=[f"{d}-{s}_to_{t}-{layout}" for d, s, t, layout in LIST_GRID])
def test_gpu_list_with_pinned_memory(direction, src_at, dst_at, layout, backend, gen):
    for shape, dtype in LIST_SHAPES:
        src, dst = list_arrays(direction, shape, dtype, layout, gen, src_at, dst_at)
        list_check(direction, src, dst, layout, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "copy_engines"])
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_gpu_list_many_pieces(direction, backend, staging, gen):
    """64 MiB of universals in pinned memory (32 blocks of 2 MiB): more than a default lane (48 MiB)."""
    staging(*DEFAULT_STAGING)
    src_at, dst_at = LIST_PLACEMENTS[direction][0]
    src, dst = list_arrays(direction, (32, 32, 2, 8, 16, 128), torch.bfloat16, "NHD", gen, src_at, dst_at)
    list_check(direction, src, dst, "NHD", backend=backend)


# (shape (nl, NB, no, nh, nt, hd), dtype, universals/operationals form)
PAGED_SHAPES = [((2, 8, 2, 4, 16, 64), torch.bfloat16, "array"), ((3, 9, 2, 3, 5, 13), torch.float16, "list")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", PAGED_DIRECTIONS)
@pytest.mark.parametrize("layout", ["kbthd", "kbhtd", "btd"])
def test_gpu_paged_with_pinned_memory(layout, direction, backend, gen):
    """vLLM NHD ("kbthd"), HND ("kbhtd") and MLA ("btd") caches, universals / operationals
    in pinned host memory (one array, and a list)."""
    for shape, dtype, form in PAGED_SHAPES:
        case = CacheCase(layout, *shape, dtype, gen, device="cuda")
        paged_check(case, case.build(), direction, pick_ids(case.NB, 4, gen), gen, form=form, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", FOUR_DIRECTIONS)
def test_gpu_paged_device_ids_and_pinned_memory(direction, backend, gen):
    case = CacheCase("kbthd", 3, 12, 2, 4, 8, 32, torch.bfloat16, gen, device="cuda")
    ids = torch.tensor([11, 0, 7, 3], dtype=torch.int32, device="cuda")
    paged_check(case, case.build(), direction, ids, gen, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", FOUR_DIRECTIONS)
def test_gpu_paged_mixed_pinned_and_device(direction, backend, gen):
    """A list of universals / operationals alternately in pinned host memory and on the device."""
    case = CacheCase("kbthd", 3, 10, 2, 4, 8, 32, torch.bfloat16, gen, device="cuda")
    paged_check(case, case.build(), direction, [9, 2, 5, 0, 7], gen, where="mixed", backend=backend)


LAYER_SELECTIONS = [None, slice(1, 3), slice(None, None, -1), slice(3, 0, -2), range(0, 4, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", LAYER_SELECTIONS, ids=case_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_gpu_paged_layers_and_offsets(method, layers, backend, gen):
    """Pinned universals with NH = nh + 3, NL = nl + 3, head_offset 1, layer_offset 2: the
    universal heads 0, 4, 5 and layers outside [2, 2 + nl) are never touched (still poisoned)."""
    case = CacheCase("kbhtd", 4, 8, 2, 3, 8, 32, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    for form in ("array", "list"):
        paged_check(case, cache, method, [6, 1, 4], gen, form=form, NH=case.nh + 3, NL=case.nl + 3,
                    layers=layers, layer_offset=2, head_offset=1, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [slice(1, 3), slice(None, None, -1), 2, range(3, -1, -2)], ids=case_id)
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_gpu_paged_heads(method, heads, backend, gen):
    """Pinned universals holding a selection of the cache's heads at head_offset 1, with
    layers selected too: staged pieces cut across the selected heads alone."""
    case = CacheCase("kbthd", 4, 8, 2, 4, 8, 32, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    count = len(selected(case.nh, heads))
    for form in ("array", "list"):
        paged_check(case, cache, method, [6, 1, 4], gen, form=form, NH=count + 2, NL=case.nl,
                    layers=slice(1, None), heads=heads, head_offset=1, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", STAGED_BACKENDS)
@pytest.mark.parametrize("layers", [slice(None, None, -2), slice(1, 3)], ids=case_id)
@pytest.mark.parametrize("direction", ["to_operational:HND", "from_operational:NHD"])
def test_gpu_paged_operational_layers(direction, layers, backend, gen):
    """Operational layers outside `layers` are not touched."""
    case = CacheCase("kbthd", 4, 8, 2, 3, 8, 32, torch.bfloat16, gen, device="cuda")
    paged_check(case, case.build(), direction, [6, 1, 4], gen, layers=layers, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_form", [None, "int", "Stream"], ids=["None", "int", "Stream"])
@pytest.mark.parametrize("backend", STAGED_BACKENDS)
def test_gpu_staged_stream_forms(backend, stream_form, gen):
    """The legacy default stream, an int handle, a torch stream: only that stream is waited for."""
    for direction in ("b2u", "u2b"):
        src_at, dst_at = LIST_PLACEMENTS[direction][0]
        src, dst = list_arrays(direction, (3, 2, 2, 4, 8, 64), torch.bfloat16, "NHD", gen, src_at, dst_at)
        list_check(direction, src, dst, "NHD", stream_form=stream_form, backend=backend)
    case = CacheCase("kbthd", 3, 8, 2, 4, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    for direction in FOUR_DIRECTIONS:
        paged_check(case, cache, direction, [7, 2, 4], gen, stream_form=stream_form, backend=backend)


PAGED_LARGE = [("to_universal", "auto"), ("from_universal", "copy_engines"), ("to_operational:HND", "async"),
               ("from_operational:HND", "auto")]


@pytest.mark.gpu
@pytest.mark.parametrize("direction,backend", PAGED_LARGE)
def test_gpu_paged_many_pieces(direction, backend, staging, gen):
    """80 MiB in pinned memory (40 blocks of 2 MiB): two and a half default lanes' worth."""
    staging(*DEFAULT_STAGING)
    case = CacheCase("kbthd", 32, 44, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    paged_check(case, case.build(), direction, pick_ids(case.NB, 40, gen), gen, backend=backend)


# ==========================================================================
# 3. GPU: a small staging.
# ==========================================================================

# (size_bytes, lanes): one 1 MiB lane; three lanes of about 1 MiB from a size that is not a
# multiple of anything.
SMALL_STAGINGS = [(MiB, 1), (3 * MiB + 4099, 3)]


def staging_id(v):
    return f"{v[0]}B-{v[1]}lanes"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["copy_engines", "async"])
@pytest.mark.parametrize("size_lanes", SMALL_STAGINGS, ids=staging_id)
@pytest.mark.parametrize("direction", FOUR_DIRECTIONS)
def test_gpu_small_staging_one_block(direction, size_lanes, backend, staging, gen):
    """nb = 1, one block of 5.6 MiB through about 1 MiB of staging: pieces smaller than a
    block, the slots reused many times in one call."""
    staging(*size_lanes)
    case = CacheCase("kbthd", 45, 4, 2, 8, 32, 128, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    paged_check(case, cache, direction, [2], gen, backend=backend)
    extra = {}
    if "universal" in direction:  # a strided destination slice of the universal: layers 1..nl of nl + 2
        extra = dict(NL=case.nl + 2, layer_offset=1, layers=slice(None, None, -1))
    paged_check(case, cache, direction, torch.tensor([3], device="cuda"), gen, form="list", backend=backend, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["to_universal", "from_universal", "to_operational:NHD", "from_operational:HND"])
def test_gpu_small_staging_odd_rows(direction, staging, gen):
    """Rows of 26 bytes (hd = 13 fp16), nh = 3: pieces end at odd places (2.4 MiB block)."""
    staging(MiB, 1)
    case = CacheCase("kbthd", 64, 3, 2, 3, 256, 13, torch.float16, gen, device="cuda")
    paged_check(case, case.build(), direction, [1], gen, backend="copy_engines")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "async"])
@pytest.mark.parametrize("direction", FOUR_DIRECTIONS)
def test_gpu_small_staging_blocks_bigger_than_staging(direction, backend, staging, gen):
    """nb = 3 blocks of 1.6 MiB each through a 1 MiB staging."""
    staging(MiB, 1)
    case = CacheCase("kbthd", 13, 6, 2, 8, 32, 128, torch.bfloat16, gen, device="cuda")
    paged_check(case, case.build(), direction, [4, 0, 5], gen, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("nb", [1, 3])
@pytest.mark.parametrize("size_lanes", SMALL_STAGINGS, ids=staging_id)
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2u"])
def test_gpu_small_staging_list(direction, size_lanes, nb, staging, gen):
    """List API through a small staging: nb = 1 (one 5.6 MiB block, given as one 5-D
    universal / 3-D operational) and nb = 3 blocks of 1.6 MiB."""
    staging(*size_lanes)
    shape = (1, 45, 2, 8, 32, 128) if nb == 1 else (3, 13, 2, 8, 32, 128)
    src_at, dst_at = LIST_PLACEMENTS[direction][0] if direction != "u2o" else LIST_PLACEMENTS[direction][1]
    src, dst = list_arrays(direction, shape, torch.bfloat16, "HND", gen, src_at, dst_at)
    if nb == 1:
        src, dst = single(direction, src, dst)
    list_check(direction, src, dst, "HND", backend="copy_engines")


# ==========================================================================
# 4. GPU: several threads, each on its own stream.
# ==========================================================================

# (threads, staging size, lanes, backend): one lane per thread; two threads sharing one lane;
# three threads on two lanes.
THREAD_CASES = [(2, 2 * MiB, 2, "auto"), (2, MiB, 1, "auto"), (3, 2 * MiB, 2, "async")]
THREAD_ITERATIONS = 20


@pytest.mark.gpu
@pytest.mark.parametrize("threads,size,lanes,backend", THREAD_CASES,
                         ids=[f"{t}threads-{s >> 20}MiB-{l}lanes-{b}" for t, s, l, b in THREAD_CASES])
def test_gpu_concurrent_threads_on_their_own_streams(threads, size, lanes, backend, staging, gen):
    """Each thread: its own stream, pinned universals and block ids of one shared cache;
    20 rounds of fresh rows -> to_universal -> check, fresh universals -> from_universal ->
    check (read back on its stream), only its own stream synchronized. Blocks nobody owns
    stay unchanged."""
    staging(size, lanes)
    nl, per, no, nh, nt, hd, dtype = 8, 4, 2, 8, 16, 128, torch.bfloat16  # 512 KiB a block, 2 MiB a call
    case = CacheCase("kbthd", nl, threads * per + 2, no, nh, nt, hd, dtype, gen, device="cuda")
    cache = case.build()
    order = pick_ids(case.NB, case.NB, gen)
    id_sets = [order[k * per: (k + 1) * per] for k in range(threads)]
    unowned = order[threads * per:]
    seeds = [int(torch.randint(0, 2**31 - 1, (), generator=gen)) for _ in range(threads)]
    print(f"thread seeds {seeds}, block ids {id_sets}, unowned {unowned}")
    before = snapshot(case.buf.bases)
    layers = [as_int(x) for x in case.layers]  # [no, NB, nt, nh, hd] integer views
    barrier = threading.Barrier(threads)

    def rounds(k):
        g, ids, s = make_generator(seeds[k]), id_sets[k], torch.cuda.Stream()
        U = random_tensor((per, nh, nl, no, nt, hd), dtype, generator=g, pin=True)
        barrier.wait(timeout=120)
        for it in range(THREAD_ITERATIONS):
            where = f"thread {k} round {it} (ids {ids})"
            # offload: fresh rows written into this thread's blocks on s, then to_universal on s
            fresh = as_int(random_tensor((per, nl, no, nt, nh, hd), dtype, generator=g))
            poison_(U)
            with torch.cuda.stream(s):
                fresh_dev = fresh.to("cuda")
                for b, i in enumerate(ids):
                    for l in range(nl):
                        layers[l][:, i].copy_(fresh_dev[b, l])
            cache.to_universal(ids, U, stream=s, backend=backend)
            s.synchronize()
            assert_bitwise_equal(as_int(U), fresh.permute(0, 4, 1, 2, 3, 5), f"{where}: universals")
            # onload: fresh universals, this thread's blocks poisoned on s, from_universal on s
            as_int(U).copy_(as_int(random_tensor(U.shape, dtype, generator=g)))
            source = as_int(U).clone()
            with torch.cuda.stream(s):
                for i in ids:
                    for l in range(nl):
                        poison_(layers[l][:, i])
            cache.from_universal(U, ids, stream=s, backend=backend)
            with torch.cuda.stream(s):
                got = torch.stack([torch.stack([layers[l][:, i] for l in range(nl)]) for i in ids])
            s.synchronize()
            assert_bitwise_equal(got, source.permute(0, 2, 3, 4, 1, 5), f"{where}: cache blocks")
            assert_bitwise_equal(as_int(U), source, f"{where}: universals (source)")

    def worker(k):
        try:
            rounds(k)
        except BaseException:
            barrier.abort()
            raise

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(worker, k) for k in range(threads)]
        errors = [f.exception() for f in futures]
    # the first real failure (the other threads then see a broken barrier)
    errors = sorted((e for e in errors if e is not None), key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]
    sync()
    rows_before, rows_now = cache_rows(case.buf.make(before), case.dims), case.rows()
    for i in unowned:
        for l in range(nl):
            assert_bitwise_equal(rows_now[l][i], rows_before[l][i], f"unowned cache block {i} layer {l}")


# ==========================================================================
# 5. GPU: CUDA graphs.
# ==========================================================================


class Replayer:
    """Stands in for the cache in run_and_check: every method call replays the graph."""

    def __init__(self, graph):
        self.graph = graph

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.graph.replay()


GRAPH_CASES = [
    ("to_universal", "auto", torch.int64),
    ("from_universal", "auto", torch.int64),
    ("to_universal", "copy_engines", torch.int32),
    ("from_universal", "async", torch.int32),
    ("to_operational:HND", "auto", torch.int64),
    ("from_operational:HND", "auto", torch.int32),
]
GRAPH_ID_SETS = [[5, 9, 2, 15], [15, 14, 13, 12], [7, 0, 3, 11], [1, 2, 3, 4]]


@pytest.mark.gpu
@pytest.mark.parametrize("small", [False, True], ids=["default-staging", "1MiB-staging"])
@pytest.mark.parametrize("direction,backend,id_dtype", GRAPH_CASES,
                         ids=[f"{d}-{b}-{dtype_id(t)}" for d, b, t in GRAPH_CASES])
def test_gpu_graph_capture_and_replay_staged(direction, backend, id_dtype, small, staging, gen):
    """After reserve_staging(): a call with device ids and one pinned array is captured in a
    torch.cuda.CUDAGraph; for new ids (ids.copy_) and new source data every replay gives the
    reference's bytes (1 MiB blocks: with the 1 MiB staging, several pieces per replay)."""
    staging(*((MiB, 1) if small else DEFAULT_STAGING))
    assert kvbm_ext.reserve_staging() is None
    assert kvbm_ext.staging_info()["capture_reserved"] is True
    method, extra = split(direction)
    case = CacheCase("kbthd", 16, 16, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    kwargs = dict(extra, backend=backend)
    if "universal" in method:
        kwargs.update(head_offset=1, layer_offset=1)
        other = paged_other(case, method, 4, gen, NH=case.nh + 1, NL=case.nl + 1)
    else:
        other = paged_other(case, method, 4, gen)
    ids = torch.tensor([0, 1, 2, 3], dtype=id_dtype, device="cuda")
    current = torch.cuda.current_stream()
    run_and_check(case, cache, method, ids, other, after=current.synchronize, stream=current, **kwargs)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        invoke(cache, method, ids, other.arg, stream=torch.cuda.current_stream(), **kwargs)
    sync()
    for new in GRAPH_ID_SETS:
        ids.copy_(torch.tensor(new, dtype=id_dtype))
        for b in case.buf.bases if method.startswith("to_") else other.bases:  # fresh source data
            b.copy_(random_tensor(b.shape, b.dtype, b.device, gen))
        sync()
        run_and_check(case, Replayer(graph), method, new, other, after=current.synchronize, **kwargs)


# A fresh interpreter: the staging is allocated on the first staged call (not by a device to
# device call); capturing a staged call before reserve_staging() raises RuntimeError naming
# reserve_staging and writes nothing; after reserve_staging() the capture works and replays.
LIFECYCLE_SCRIPT = r"""
import json, torch, kvbm_ext

def report(key, value):
    print("RESULT " + json.dumps([key, value]), flush=True)

POISON = int.from_bytes(b"\xa5\xa5", "little", signed=True)
g = torch.Generator().manual_seed(20261122)
nl, NB, nh, nt, hd = 3, 8, 4, 16, 64
layers = [torch.randint(-2**15, 2**15, (2, NB, nt, nh, hd), dtype=torch.int16, generator=g).view(torch.bfloat16).cuda()
          for _ in range(nl)]
cache = kvbm_ext.PagedKVCache(layers, "kbthd")
id_list = [5, 0, 7]
ids = torch.tensor(id_list, dtype=torch.int64, device="cuda")
# U[b][h, l, o, t, :] = layers[l][o, ids[b], t, h, :]
want = torch.stack([torch.stack([layers[l][:, i].view(torch.int16).cpu() for l in range(nl)])
                    for i in id_list]).permute(0, 4, 1, 2, 3, 5)

def poisoned(U):
    return bool((U.view(torch.int16) == POISON).all())

def correct(U):
    return torch.equal(U.view(torch.int16).cpu(), want)

shape = (len(id_list), nh, nl, 2, nt, hd)
report("info_fresh", kvbm_ext.staging_info())
U_dev = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
U_dev.view(torch.int16).fill_(POISON)
cache.to_universal(ids, U_dev)  # device to device: the kernel, nothing staged
torch.cuda.synchronize()
report("device_call_correct", correct(U_dev))
report("info_after_device_call", kvbm_ext.staging_info())
U = torch.empty(shape, dtype=torch.bfloat16).pin_memory()
U.view(torch.int16).fill_(POISON)
cache.to_universal(ids, U)  # pinned host memory: staged
torch.cuda.synchronize()
report("staged_call_correct", correct(U))
report("info_after_staged_call", kvbm_ext.staging_info())
U.view(torch.int16).fill_(POISON)
error = None
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    try:
        cache.to_universal(ids, U, stream=torch.cuda.current_stream())
    except RuntimeError as e:
        error = str(e)
torch.cuda.synchronize()
report("capture_error", error)
report("poisoned_after_refused_capture", poisoned(U))
report("info_after_refused_capture", kvbm_ext.staging_info())
kvbm_ext.reserve_staging()
report("info_after_reserve", kvbm_ext.staging_info())
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    cache.to_universal(ids, U, stream=torch.cuda.current_stream())
torch.cuda.synchronize()
report("poisoned_after_capture", poisoned(U))
graph.replay()
torch.cuda.synchronize()
report("replay_correct", correct(U))
"""


@pytest.fixture(scope="module")
def lifecycle():
    """Runs LIFECYCLE_SCRIPT once: ({key: value, "returncode": rc}, report for messages)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvbm_ext.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KVBM_EXT_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", LIFECYCLE_SCRIPT], capture_output=True, text=True,
                            timeout=300, env=env, cwd=root)
    found = dict(json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found["returncode"] = result.returncode
    return found, f"rc={result.returncode} stdout={result.stdout[-3000:]!r} stderr={result.stderr[-3000:]!r}"


def lifecycle_value(lifecycle, key):
    found, report = lifecycle
    assert key in found, f"the script stopped before {key!r}: {report}"
    return found[key], report


@pytest.mark.gpu
def test_gpu_fresh_process_staging_allocated_on_first_staged_call(lifecycle):
    info, report = lifecycle_value(lifecycle, "info_fresh")
    assert info == {"device": 0, "size_bytes": 96 * MiB, "lanes": 2, "lane_bytes": 48 * MiB,
                    "allocated": False, "capture_reserved": False}, report
    assert lifecycle_value(lifecycle, "device_call_correct")[0] is True, report
    assert lifecycle_value(lifecycle, "info_after_device_call")[0]["allocated"] is False, report
    assert lifecycle_value(lifecycle, "staged_call_correct")[0] is True, report
    info, _ = lifecycle_value(lifecycle, "info_after_staged_call")
    assert info["allocated"] is True and info["capture_reserved"] is False, (info, report)


@pytest.mark.gpu
def test_gpu_fresh_process_capture_without_reserve_raises(lifecycle):
    error, report = lifecycle_value(lifecycle, "capture_error")
    assert error is not None, f"a staged call was captured without reserve_staging(): {report}"
    assert "reserve_staging" in error, (error, report)
    assert lifecycle_value(lifecycle, "poisoned_after_refused_capture")[0] is True, report
    assert lifecycle_value(lifecycle, "info_after_refused_capture")[0]["capture_reserved"] is False, report


@pytest.mark.gpu
def test_gpu_fresh_process_capture_after_reserve(lifecycle):
    info, report = lifecycle_value(lifecycle, "info_after_reserve")
    assert info["allocated"] is True and info["capture_reserved"] is True, (info, report)
    assert lifecycle_value(lifecycle, "poisoned_after_capture")[0] is True, report
    assert lifecycle_value(lifecycle, "replay_correct")[0] is True, report
    assert lifecycle_value(lifecycle, "returncode")[0] == 0, report


FIRST_CALLS_SCRIPT = r"""
import json, sys, time
import torch, kvbm_ext
reserve = sys.argv[1] == "1"
torch.manual_seed(7)
source = torch.randn(6, 4, 3, 2, 16, 64, dtype=torch.bfloat16, device="cuda")    # [N, nh, nl, 2, nt, hd]
targets = {"device": torch.empty_like(source), "pinned": torch.empty(source.shape, dtype=source.dtype).pin_memory()}
torch.cuda.synchronize()
if reserve:
    kvbm_ext.reserve_staging()
cache = kvbm_ext.PagedKVCache(source, "bhlktd")
side, mine = torch.cuda.Stream(), torch.cuda.Stream()
found = {}
for name, target in targets.items():
    target.view(torch.int16).fill_(-7)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        torch.cuda._sleep(400_000_000)
        end.record()
    began = time.perf_counter()
    cache.to_cache(kvbm_ext.PagedKVCache(target, "bhlktd"), [4, 0, 5], [1, 3, 2], stream=mine)
    host_ms = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    moved = all(torch.equal(target[d].cpu(), source[s].cpu()) for s, d in ((4, 1), (0, 3), (5, 2)))
    found[name] = {"host_ms": host_ms, "sleep_ms": start.elapsed_time(end), "moved": moved,
                   "untouched": bool((target[[0, 4, 5]].view(torch.int16) == -7).all())}
print("RESULT " + json.dumps(found))
"""


def first_calls(reserve):
    """The first device-to-device and device-to-pinned to_cache calls of a fresh process
    (lazy module loading on), each made while another stream sleeps ~0.2 s."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvbm_ext.__file__)))
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KVBM_EXT_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", FIRST_CALLS_SCRIPT, "1" if reserve else "0"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=root)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.gpu
@pytest.mark.parametrize("reserve", [False, True], ids=["first_launch_waits", "reserved"])
def test_gpu_reserve_staging_loads_the_kernels(reserve):
    found = first_calls(reserve)
    for name, call in found.items():
        assert call["moved"] and call["untouched"], (name, call)
        assert call["sleep_ms"] > 100, (name, call)
        if reserve:   # nothing left to load: the call does not wait for the other stream
            assert call["host_ms"] < 0.25 * call["sleep_ms"], (name, call)
    if not reserve:   # the control: without it, CUDA's first launch waits for the device
        assert found["device"]["host_ms"] > 0.5 * found["device"]["sleep_ms"], found


# ==========================================================================
# 6. GPU: fork / join with the caller's stream.
# ==========================================================================
#
# The caller's stream s sleeps (~0.25 s), then rewrites the call's SOURCES on s; the call is
# made on s, and right after it a copy of the DESTINATION is queued on s. Correct only if the
# internal streams start after s's writes (fork) and s's next work waits for them (join).
# Nothing may be written while s still sleeps; the call must not wait for s on the host.
# 64 MiB a call: the copy queued after the call would read poison if it did not wait.


def fork_join_case(gen):
    """kbthd cache of 2 MiB blocks (nl = 32, nh = 8, nt = 16, hd = 128 bf16), 32 ids (64 MiB)."""
    case = CacheCase("kbthd", 32, 40, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    return case, case.build(), pick_ids(case.NB, 32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "copy_engines", "async"])
def test_gpu_fork_join_offload(backend, gen):
    case, cache, ids = fork_join_case(gen)
    U = block_buffers("array", len(ids), case.universal_shape(), case.dtype, gen, pin=True)
    cache.to_universal(ids, U.arg, backend=backend)  # warm-up: kernels loaded, staging allocated
    sync()
    fresh = [random_tensor(b.shape, b.dtype, "cuda", gen) for b in case.buf.bases]
    poison_(U.bases)
    sync()
    want = snapshot(U.bases)  # poisoned
    paged_reference("to_universal", cache_rows(case.buf.make([f.cpu() for f in fresh]), case.dims),
              per_block(U.make(want)), ids, list(range(case.nl)))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for b, f in zip(case.buf.bases, fresh):
            b.copy_(f)  # the sources, rewritten on s before the call
    cache.to_universal(ids, U.arg, backend=backend, stream=s)
    with torch.cuda.stream(s):
        seen = U.bases[0].to("cuda", non_blocking=True)  # queued on s right after the call
    assert not s.query(), "the call waited for its stream on the host (or the sleep was too short)"
    judged = peek_still_poisoned(U.bases, s, "universals")
    s.synchronize()
    assert_bitwise_equal(as_int(seen), want[0], "universals as read on the caller's stream right after the call")
    assert_bitwise_equal(as_int(U.bases[0]), want[0], "universals")
    if not judged:
        pytest.skip("the sleep ended before the peek finished; 'nothing written while the stream sleeps' not judged")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "copy_engines", "async"])
def test_gpu_fork_join_onload(backend, gen):
    case, cache, ids = fork_join_case(gen)
    U = block_buffers("array", len(ids), case.universal_shape(), case.dtype, gen, pin=True)
    cache.from_universal(U.arg, ids, backend=backend)  # warm-up
    sync()
    fresh = random_tensor(U.bases[0].shape, case.dtype, "cuda", gen)
    poison_(case.buf.bases)
    sync()
    want = snapshot(case.buf.bases)  # poisoned
    paged_reference("from_universal", cache_rows(case.buf.make(want), case.dims), per_block(U.make([fresh.cpu()])), ids,
              list(range(case.nl)))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        U.bases[0].copy_(fresh, non_blocking=True)  # the source (pinned), rewritten on s before the call
    cache.from_universal(U.arg, ids, backend=backend, stream=s)
    with torch.cuda.stream(s):
        seen = [b.clone() for b in case.buf.bases]  # queued on s right after the call
    assert not s.query(), "the call waited for its stream on the host (or the sleep was too short)"
    judged = peek_still_poisoned(case.buf.bases, s, "cache")
    s.synchronize()
    for i, (got, w) in enumerate(zip(seen, want)):
        assert_bitwise_equal(as_int(got), w, f"cache layer {i} as read on the caller's stream right after the call")
    for i, (got, w) in enumerate(zip(case.buf.bases, want)):
        assert_bitwise_equal(as_int(got), w, f"cache layer {i}")
    if not judged:
        pytest.skip("the sleep ended before the peek finished; 'nothing written while the stream sleeps' not judged")


def copy_on_device(x):
    """Device copies of a (nested list of) tensors, queued on the current stream."""
    if isinstance(x, (list, tuple)):
        return [copy_on_device(v) for v in x]
    return x.to("cuda", non_blocking=True) if x.device.type == "cpu" else x.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2u"])
def test_gpu_fork_join_list(direction, gen):
    """The same for the list API (backend auto), 16 blocks of 1 MiB, pinned universals /
    operationals."""
    src_at, dst_at = LIST_PLACEMENTS[direction][0] if direction != "u2o" else LIST_PLACEMENTS[direction][1]
    src, dst = list_arrays(direction, (16, 16, 2, 8, 16, 128), torch.bfloat16, "NHD", gen, src_at, dst_at)
    list_call(direction, src, dst, "NHD")  # warm-up
    sync()
    fresh = [random_tensor(a.shape, a.dtype, "cuda", gen) for a in arrays_in(src)]
    poison_(list(arrays_in(dst)))
    sync()
    fresh_struct = [[fresh[b * len(src[0]) + i] for i in range(len(src[0]))] for b in range(len(src))] \
        if ROLES[direction][0] == "blocks" else fresh
    want = list_expected(direction, fresh_struct, dst, "NHD")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for a, f in zip(arrays_in(src), fresh):
            a.copy_(f, non_blocking=True)  # the sources, rewritten on s before the call
    list_call(direction, src, dst, "NHD", stream=s)
    with torch.cuda.stream(s):
        seen = copy_on_device(list_destinations(direction, dst))  # queued on s right after the call
    assert not s.query(), "the call waited for its stream on the host (or the sleep was too short)"
    judged = peek_still_poisoned(list(arrays_in(dst)), s, ROLES[direction][1])
    s.synchronize()
    assert_all_bitwise_equal(seen, want, f"{ROLES[direction][1]} as read on the caller's stream right after the call")
    assert_all_bitwise_equal(list_destinations(direction, dst), want, ROLES[direction][1])
    if not judged:
        pytest.skip("the sleep ended before the peek finished; 'nothing written while the stream sleeps' not judged")


# ==========================================================================
# 7. GPU: a staged call's error in its last block writes nothing.
# ==========================================================================

def wider(t, gen):
    """A random array like t (same placement) with a last dimension one element longer."""
    new = random_tensor(tuple(t.shape[:-1]) + (t.shape[-1] + 1,), t.dtype, generator=gen)
    return new.pin_memory() if t.device.type == "cpu" else new.to(t.device)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2u"])
def test_gpu_list_staged_error_in_the_last_block_writes_nothing(direction, staging, gen):
    """6 blocks of 512 KiB through a 1 MiB staging, the last destination array of the wrong
    shape: ValueError naming it, and no piece of the earlier blocks written."""
    staging(MiB, 1)
    src_at, dst_at = LIST_PLACEMENTS[direction][0] if direction != "u2o" else LIST_PLACEMENTS[direction][1]
    src, dst = list_arrays(direction, (6, 8, 2, 8, 16, 128), torch.bfloat16, "NHD", gen, src_at, dst_at)
    role = ROLES[direction][1]
    if role == "blocks":
        dst[5][15] = wider(dst[5][15], gen)
        path = r"blocks\[5\]\[15\]"
    else:
        dst[5] = wider(dst[5], gen)
        path = rf"{role}\[5\]"
    expect_rejected(lambda: list_call(direction, src, dst, "NHD", backend="copy_engines"), src, dst, ValueError, path,
                    ("shape",))


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_paged_staged_error_in_the_last_block_writes_nothing(method, staging, gen):
    """The last of 6 pinned universals / operationals has the wrong element type."""
    staging(MiB, 1)
    case = CacheCase("kbthd", 8, 8, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    other = paged_other(case, method, 6, gen, form="list").arg
    other[5] = random_tensor(other[5].shape, torch.float16, generator=gen, pin=True)
    name = "universals" if "universal" in method else "operationals"
    paged_reject(case, case.build(), method, [7, 0, 3, 5, 1, 6], other, TypeError, rf"{name}\[5\]",
                 backend="copy_engines")


# ==========================================================================
# 8. GPU: KVBM_EXT_DEBUG names the path.
# ==========================================================================


def one_debug_line(capfd, run):
    capfd.readouterr()
    run()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvbm_ext: ")]
    assert len(lines) == 1, f"want one 'kvbm_ext: ' line, stderr was {err!r}"
    return lines[0]


# (direction, source placement, destination placement, backend, path named)
DEBUG_LIST_CASES = [
    ("b2u", "device", "pinned", "auto", "staged"),
    ("u2b", "pinned", "device", "auto", "staged"),
    ("u2o", "device", "pinned", "auto", "staged"),
    ("o2u", "pinned", "device", "auto", "staged"),
    ("b2u", "device", "pinned", "copy_engines", "staged"),
    ("u2b", "pinned", "device", "batch", "staged"),
    ("u2o", "pinned", "device", "async", "staged"),
    ("b2o", "device", "pinned", "auto", "copy_engines"),
    ("o2b", "pinned", "device", "auto", "copy_engines"),
    ("b2o", "device", "pinned", "copy_engines", "copy_engines"),
    ("b2u", "device", "pinned", "kernel", "kernel"),
    ("u2b", "pinned", "device", "kernel", "kernel"),
    ("o2b", "pinned", "device", "kernel", "kernel"),
    ("b2u", "device", "device", "auto", "kernel"),
    ("o2u", "device", "device", "auto", "kernel"),
    ("b2o", "device", "device", "auto", "kernel"),
    ("u2b", "device", "device", "copy_engines", "kernel"),  # nothing crosses PCIe: nothing to stage
]


@pytest.mark.gpu
@pytest.mark.parametrize("direction,src_at,dst_at,backend,path", DEBUG_LIST_CASES,
                         ids=[f"{d}-{s}_to_{t}-{b}" for d, s, t, b, _ in DEBUG_LIST_CASES])
def test_gpu_debug_names_the_path_list(direction, src_at, dst_at, backend, path, monkeypatch, capfd, gen):
    src, dst = list_arrays(direction, (2, 2, 2, 4, 8, 64), torch.bfloat16, "HND", gen, src_at, dst_at)
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    list_check(direction, src, dst, "HND", backend=backend)  # warm-up: first-use messages
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    line = one_debug_line(capfd, lambda: list_check(direction, src, dst, "HND", backend=backend))
    assert re.match(rf"kvbm_ext: {LIST_FUNCTIONS[direction]}: path {path}\b", line), line


DEBUG_PAGED_CASES = [
    ("to_universal", "pinned", "auto", "staged"),
    ("from_universal", "pinned", "auto", "staged"),
    ("to_operational:HND", "pinned", "auto", "staged"),
    ("from_operational:HND", "pinned", "copy_engines", "staged"),
    ("from_universal", "pinned", "async", "staged"),
    ("to_universal", "pinned", "kernel", "kernel"),
    ("from_universal", "pinned", "kernel", "kernel"),
    ("to_universal", "device", "auto", "kernel"),
    ("from_operational:HND", "device", "auto", "kernel"),
    ("to_universal", "device", "copy_engines", "kernel"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("direction,where,backend,path", DEBUG_PAGED_CASES,
                         ids=[f"{d}-{w}-{b}" for d, w, b, _ in DEBUG_PAGED_CASES])
def test_gpu_debug_names_the_path_paged(direction, where, backend, path, monkeypatch, capfd, gen):
    case = CacheCase("kbthd", 2, 8, 2, 4, 8, 64, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    method, _ = split(direction)
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    paged_check(case, cache, direction, [7, 2, 4], gen, where=where, backend=backend)  # warm-up
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    line = one_debug_line(capfd, lambda: paged_check(case, cache, direction, [7, 2, 4], gen, where=where,
                                                     backend=backend))
    assert re.match(rf"kvbm_ext: (PagedKVCache\.)?{method}: path {path}\b", line), line


# (nb, pieces, largest piece in MiB) of a staged call over Llama-70B blocks at nt=16 (5 MiB)
# through the default 48 MiB lanes, as staging.c cuts it: a 0.6 MiB lead (one head of a
# block) and a 4.4 MiB ramp piece (the rest of it) on the edge CTAs, then pieces doubling
# up to half a lane (four blocks, 20 MiB).  Fewer pieces cost less host time; a lead that
# is not small keeps the copy engines waiting.
PIECE_PLANS = [(1, 2, "4.38"), (8, 5, "20.00"), (64, 19, "20.00")]


@pytest.mark.gpu
@pytest.mark.parametrize("nb,pieces,largest", PIECE_PLANS, ids=[f"nb{p[0]}" for p in PIECE_PLANS])
@pytest.mark.parametrize("direction", ["to_universal", "from_universal"])
def test_gpu_debug_staged_pieces_lead_ramp_then_double(nb, pieces, largest, direction, staging, monkeypatch,
                                                       capfd, gen):
    staging(96 * MiB, 2)
    case = CacheCase("kbthd", 80, 64, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    ids = pick_ids(64, nb, gen)
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    paged_check(case, cache, direction, ids, gen)  # warm-up: first-use messages
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    line = one_debug_line(capfd, lambda: paged_check(case, cache, direction, ids, gen))
    assert re.search(rf"path staged \(.*; {pieces} pieces of up to {largest} MiB on lane \d, permute on at most "
                     rf"8 CTAs, 32 for the short pieces at the ends,", line), line


# ==========================================================================
# 9. GPU: staging_info; num_ctas gives the same bytes.
# ==========================================================================


@pytest.mark.gpu
def test_gpu_reserve_staging_and_staging_info(staging):
    staging(*DEFAULT_STAGING)
    assert kvbm_ext.reserve_staging() is None
    info = kvbm_ext.staging_info()
    assert set(info) == {"device", "size_bytes", "lanes", "lane_bytes", "allocated", "capture_reserved"}, info
    assert info["device"] == torch.cuda.current_device()
    assert info["allocated"] is True and info["capture_reserved"] is True, info
    assert (info["size_bytes"], info["lanes"]) == DEFAULT_STAGING, info
    assert info["lane_bytes"] * info["lanes"] == info["size_bytes"], info
    assert kvbm_ext.staging_info(torch.cuda.current_device()) == info
    assert kvbm_ext.staging_info(None) == info
    assert kvbm_ext.reserve_staging(torch.cuda.current_device()) is None  # again: nothing changes
    assert kvbm_ext.staging_info() == info


@pytest.mark.gpu
def test_gpu_staging_info_follows_set_staging(staging):
    staging(8 * MiB, 4)
    info = kvbm_ext.staging_info()
    assert (info["size_bytes"], info["lanes"], info["lane_bytes"]) == (8 * MiB, 4, 2 * MiB), info
    kvbm_ext.set_staging(None, lanes=2)  # None keeps the size
    info = kvbm_ext.staging_info()
    assert (info["size_bytes"], info["lanes"], info["lane_bytes"]) == (8 * MiB, 2, 4 * MiB), info
    kvbm_ext.set_staging(2 * MiB)  # lanes kept
    info = kvbm_ext.staging_info()
    assert (info["size_bytes"], info["lanes"], info["lane_bytes"]) == (2 * MiB, 2, MiB), info
    with pytest.raises(ValueError):
        kvbm_ext.set_staging(None, lanes=0)
    assert kvbm_ext.staging_info() == info
    kvbm_ext.reserve_staging()
    info = kvbm_ext.staging_info()
    assert info["allocated"] is True and info["capture_reserved"] is True, info
    assert (info["size_bytes"], info["lanes"], info["lane_bytes"]) == (2 * MiB, 2, MiB), info


NUM_CTAS_VALUES = [None, 1, 2, 8]
# (backend, where the universals / operationals are)
NUM_CTAS_PATHS = [("copy_engines", "pinned"), ("kernel", "pinned"), ("auto", "device")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,where", NUM_CTAS_PATHS, ids=[f"{b}-{w}" for b, w in NUM_CTAS_PATHS])
@pytest.mark.parametrize("direction", FOUR_DIRECTIONS)
def test_gpu_paged_num_ctas_same_bytes(direction, backend, where, staging, gen):
    """num_ctas None, 1, 2, 8 on the same sources: each gives the reference's bytes, all the
    same (8 MiB a call through 1 MiB lanes: several pieces)."""
    staging(2 * MiB, 2)
    case = CacheCase("kbthd", 8, 24, 2, 8, 16, 128, torch.bfloat16, gen, device="cuda")
    cache = case.build()
    ids = pick_ids(case.NB, 16, gen)
    method, extra = split(direction)
    other = paged_other(case, method, len(ids), gen, where)
    dst = other if method.startswith("to_") else case.buf
    results = []
    for num_ctas in NUM_CTAS_VALUES:
        s = torch.cuda.Stream()
        run_and_check(case, cache, method, ids, other, after=s.synchronize, stream=s, backend=backend,
                      num_ctas=num_ctas, **extra)
        results.append(snapshot(dst.bases))
    for num_ctas, got in zip(NUM_CTAS_VALUES[1:], results[1:]):
        for i, (a, b) in enumerate(zip(got, results[0])):
            assert_bitwise_equal(a, b, f"num_ctas={num_ctas} against None: destination memory #{i}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,where", NUM_CTAS_PATHS, ids=[f"{b}-{w}" for b, w in NUM_CTAS_PATHS])
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2u"])
def test_gpu_list_num_ctas_same_bytes(direction, backend, where, staging, gen):
    staging(2 * MiB, 2)
    if where == "device":
        src_at = dst_at = "device"
    else:
        src_at, dst_at = LIST_PLACEMENTS[direction][0]
    src, dst = list_arrays(direction, (8, 8, 2, 8, 16, 128), torch.bfloat16, "HND", gen, src_at, dst_at)
    results = []
    for num_ctas in NUM_CTAS_VALUES:
        list_check(direction, src, dst, "HND", backend=backend, num_ctas=num_ctas)
        results.append(clone_all(list(arrays_in(dst))))
    for num_ctas, got in zip(NUM_CTAS_VALUES[1:], results[1:]):
        assert_all_bitwise_equal(got, results[0], f"num_ctas={num_ctas} against None")
