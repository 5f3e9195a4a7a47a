"""Poison, byte-for-byte comparison, and the helpers that call the library and check the
outcome: results against the references (destinations poisoned before the call, sources
unchanged after it) and rejections (the exception names the argument, no byte written)."""

import re

import numpy as np
import pytest
import torch

from support.builders import arrays_in, clone_all, snapshot
from support.devices import sync
from support.references import (
    as_int,
    as_list,
    cache_rows,
    expected_blocks,
    expected_op,
    expected_universals,
    ids_list,
    paged_reference,
    per_block,
    selected,
)

POISON_BYTE = 0xA5


# --------------------------------------------------------------------------
# Poison and comparison.
# --------------------------------------------------------------------------


def _itemsize(x):
    return x.itemsize if isinstance(x, np.ndarray) else x.element_size()


def poison_(x):
    """Fill every byte of x (torch tensor on any device or NumPy array, contiguous or not,
    or a nested list of them) with 0xA5."""
    if isinstance(x, (list, tuple)):
        for v in x:
            poison_(v)
        return x
    size = _itemsize(x)
    if isinstance(x, np.ndarray):
        if size not in (1, 2, 4, 8):
            size = 1  # e.g. complex128: a uint8 view (needs a contiguous last axis)
        x.view(f"u{size}")[...] = int.from_bytes(bytes([POISON_BYTE]) * size, "little")
        return x
    ints = as_int(x)
    ints.fill_(int.from_bytes(bytes([POISON_BYTE]) * ints.element_size(), "little", signed=ints.dtype != torch.uint8))
    return x


def poison_even_if_read_only(a):
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a.setflags(write=True)
        poison_(a)
        a.setflags(write=False)
    else:
        poison_(a)


def _bytes_for_compare(x):
    """Flat uint8 CPU copy of the bytes of x (torch on any device, or NumPy), in logical order."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x).copy())
    x = as_int(x.detach()).contiguous()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.reshape(-1).view(torch.uint8)


def assert_bitwise_equal(out, ref, what="array"):
    """Exact byte equality (NaN-safe, no tolerance). Works on torch (any device) and NumPy."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert _itemsize(out) == _itemsize(ref), f"{what}: itemsize {_itemsize(out)} != {_itemsize(ref)}"
    if isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor):
        assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    a, b = _bytes_for_compare(out), _bytes_for_compare(ref)
    if not torch.equal(a, b):
        bad = (a != b).nonzero().flatten()
        poisoned = int((a[bad] == POISON_BYTE).sum())
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} bytes differ "
            f"(first at byte {int(bad[0])}: got {int(a[bad[0]]):#04x}, want {int(b[bad[0]]):#04x}; "
            f"{poisoned} differing bytes still hold the poison 0xA5)"
        )


def assert_all_bitwise_equal(outs, refs, what="array"):
    assert len(outs) == len(refs), f"{what}: {len(outs)} arrays != {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(o, (list, tuple)):
            assert_all_bitwise_equal(o, r, f"{what}[{i}]")
        else:
            assert_bitwise_equal(o, r, f"{what}[{i}]")


def assert_poisoned(x, what="array"):
    """Every byte of x (or of every array in a nested list) still holds 0xA5."""
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            assert_poisoned(v, f"{what}[{i}]")
        return
    b = _bytes_for_compare(x)
    written = int((b != POISON_BYTE).sum())
    assert written == 0, f"{what}: {written} of {b.numel()} bytes were written"


def peek_still_poisoned(arrays, busy, what="destination"):
    """While stream `busy` still sleeps, every array must still be poisoned: each is cloned
    on an independent non-blocking stream (host arrays directly) and checked.  Returns
    False, judging nothing, when the sleep ended before the clones did."""
    peek = torch.cuda.Stream()  # independent of `busy` and of the legacy default stream
    with torch.cuda.stream(peek):
        copies = [a.clone() for a in arrays]
    peek.synchronize()
    if busy.query():
        return False
    for i, c in enumerate(copies):
        assert_poisoned(c, f"{what} #{i} while its stream was still busy")
    return True


def assert_message_has(msg, words):
    """Every entry of `words` occurs in `msg`: a str as a substring, a compiled regex
    through search()."""
    for w in words:
        if isinstance(w, re.Pattern):
            assert w.search(msg), f"{w.pattern!r} not in message {msg!r}"
        else:
            assert w in msg, f"{w!r} not in message {msg!r}"


def path_regex(path):
    """^path not followed by a further index or word character."""
    return "^" + path + r"(?![\[\w])"


def expect_rejected(invoke, src, dst, exc, path, words):
    """Runs invoke() with the arrays in `dst` poisoned: it must raise `exc` with a message
    starting with `path` (a regex) and containing `words` (str or compiled regex), write
    no destination byte and change no source. Returns the message."""
    dest_arrays, src_arrays = list(arrays_in(dst)), list(arrays_in(src))
    for a in dest_arrays:
        poison_even_if_read_only(a)
    snapshots = clone_all(src_arrays)
    sync()
    with pytest.raises(exc, match=path_regex(path)) as info:
        invoke()
    sync()
    msg = str(info.value)
    assert_message_has(msg, words)
    for i, a in enumerate(dest_arrays):
        assert_poisoned(a, f"destination array #{i}")
    for i, (a, s) in enumerate(zip(src_arrays, snapshots)):
        assert_bitwise_equal(a, s, f"source array #{i}")
    return msg


# --------------------------------------------------------------------------
# Block <-> universal.
# --------------------------------------------------------------------------


def call(direction, blocks, universals, layout="NHD", **kwargs):
    """direction 'b2u' -> block_to_universal(blocks, universals, ...); 'u2b' -> universal_to_block(universals, blocks, ...)."""
    import kvbm_ext

    if direction == "b2u":
        return kvbm_ext.block_to_universal(blocks, universals, layout, **kwargs)
    return kvbm_ext.universal_to_block(universals, blocks, layout, **kwargs)


def b2u_and_check(blocks, universals, layout, no, **kwargs):
    """Poison universals, convert, compare with the reference; sources must be unchanged."""
    before = clone_all(blocks)
    poison_(as_list(universals))
    sync()
    assert call("b2u", blocks, universals, layout, **kwargs) is None
    sync()
    assert_all_bitwise_equal(as_list(universals), expected_universals(before, no, layout), "universals")
    assert_all_bitwise_equal(blocks, before, "blocks (source)")


def u2b_and_check(universals, blocks, layout, **kwargs):
    """Poison blocks, convert, compare with the reference; sources must be unchanged."""
    before = clone_all(as_list(universals))
    poison_(blocks)
    sync()
    assert call("u2b", blocks, universals, layout, **kwargs) is None
    sync()
    assert_all_bitwise_equal(blocks, expected_blocks(before, layout), "blocks")
    assert_all_bitwise_equal(as_list(universals), before, "universals (source)")


def check_rejected(direction, blocks, universals, exc, path, *words, layout="NHD", **kwargs):
    """Call with bad arguments: check the exception type, a message starting with `path`
    (a regex) and containing `words` (str or compiled regex), no destination byte written,
    every source unchanged. Returns the message."""
    dest, src = (universals, blocks) if direction == "b2u" else (blocks, universals)
    return expect_rejected(lambda: call(direction, blocks, universals, layout, **kwargs), src, dest, exc, path, words)


# --------------------------------------------------------------------------
# Operational.
# --------------------------------------------------------------------------

# direction code -> kvbm_ext function; every function takes (source, destination, ...).
OP_FUNCTIONS = {
    "b2o": "block_to_operational",
    "o2b": "operational_to_block",
    "u2o": "universal_to_operational",
    "o2u": "operational_to_universal",
}


def call_op(direction, src, dst, *args, **kwargs):
    """'b2o' -> block_to_operational(src, dst, ...), 'o2b', 'u2o', 'o2u' likewise."""
    import kvbm_ext

    return getattr(kvbm_ext, OP_FUNCTIONS[direction])(src, dst, *args, **kwargs)


def _dest_list(direction, dst):
    return dst if direction == "o2b" else as_list(dst)


def op_and_check(direction, src, dst, *args, after=None, **kwargs):
    """Poison the destinations, call, wait (`after`, default: the whole device), compare with
    the reference byte for byte; the sources must be unchanged. args/kwargs go to the call
    (layout for u2o/o2u, backend=, stream=)."""
    before = clone_all(src)
    poison_(list(arrays_in(dst)))
    sync()
    assert call_op(direction, src, dst, *args, **kwargs) is None
    (after or sync)()
    layout = args[0] if args else kwargs.get("layout", "NHD")
    want = expected_op(direction, before, dst, layout)
    assert_all_bitwise_equal(_dest_list(direction, dst), want, "destinations")
    assert_all_bitwise_equal(list(arrays_in(src)), list(arrays_in(before)), "sources")


def check_op_rejected(direction, src, dst, exc, path, *words, args=(), **kwargs):
    """Like check_rejected for the operational functions: exception type, message starting
    with `path` (a regex) and containing `words`, destinations still poisoned, sources
    unchanged. Returns the message."""
    return expect_rejected(lambda: call_op(direction, src, dst, *args, **kwargs), src, dst, exc, path, words)


# --------------------------------------------------------------------------
# PagedKVCache.
# --------------------------------------------------------------------------


def invoke(cache, method, ids, other, **kwargs):
    """cache.<method> with the argument order of the spec."""
    if method.startswith("to_"):
        return getattr(cache, method)(ids, other, **kwargs)
    return getattr(cache, method)(other, ids, **kwargs)


def expected_after(case, method, ids, other_buf, cache_bases, other_bases, kwargs):
    """The expected destination bases of a call, computed on CPU copies: `cache_bases` /
    `other_bases` are the snapshots taken before the call."""
    sel = selected(case.nl, kwargs.get("layers"))
    common = dict(layer_offset=kwargs.get("layer_offset", 0), head_offset=kwargs.get("head_offset", 0),
                  inner=kwargs.get("layout", kwargs.get("inner", "NHD")), heads=selected(case.nh, kwargs.get("heads")),
                  pack_layers=kwargs.get("pack_layers", False))
    if method in ("to_operational", "from_operational"):
        assert common["layer_offset"] == 0 and common["head_offset"] == 0
    rows = cache_rows(case.buf.make(cache_bases), case.dims)
    blocks = per_block(other_buf.make(other_bases))
    paged_reference(method, rows, blocks, ids_list(ids), sel, **common)
    return cache_bases if method.startswith("from_") else other_bases


def run_and_check(case, cache, method, ids, other_buf, after=sync, before=None, **kwargs):
    """Poison the destination (other_buf for to_*, the cache for from_*), run `before` (if
    given), call `cache.<method>`, wait (`after`), then compare EVERY byte of the destination's memory
    with the reference applied to a copy of it (moved rows written, everything else still
    poisoned) and the source's memory with its snapshot."""
    to = method.startswith("to_")
    dst, src = (other_buf, case.buf) if to else (case.buf, other_buf)
    poison_(dst.bases)
    sync()
    cache_before, other_before = snapshot(case.buf.bases), snapshot(other_buf.bases)
    src_before = cache_before if to else other_before
    src_before = [b.clone() for b in src_before]
    if before is not None:
        before()
    assert invoke(cache, method, ids, other_buf.arg, **kwargs) is None
    after()
    want = expected_after(case, method, ids, other_buf, cache_before, other_before, kwargs)
    what = "universals" if "universal" in method else "operationals"
    dst_name, src_name = (what, "cache") if to else ("cache", what)
    for i, (got, exp) in enumerate(zip(dst.bases, want)):
        assert_bitwise_equal(as_int(got), exp, f"{method}: destination ({dst_name}) memory #{i}")
    for i, (got, exp) in enumerate(zip(src.bases, src_before)):
        assert_bitwise_equal(as_int(got), exp, f"{method}: source ({src_name}) memory #{i}")
