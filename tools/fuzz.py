#!/usr/bin/env python3
"""A seeded fuzzer over every entry point of kvbm_ext, on the CPU.

Each case draws, from its own seed, an entry point and its arguments: valid
small arrays (NumPy), hostile objects (array getters that clear, rewrite or
shorten the caller's lists; interface dicts whose entries' __index__ rewrites
the dict; lying extents, strides, data pointers and typestrs), odd strings
(embedded NUL, non-ASCII, surrogates), odd ints (huge, negative, bool, NumPy
scalars), odd streams, universals and operationals as one stacked [nb, ...]
array (wrong leading dimension, blocks read backwards), and devices DLPack
cannot describe; PagedKVCache selections (layers=, heads=, layer_offset,
head_offset, in and outside the rule, hostile slice bounds) checked against
the rule and, when they move, bit for bit against a NumPy reference
(tools/fuzz_paged.py); caches whose layers share bytes (one array given
twice, overlapping or interleaved views, one array whose layer stride is a
block): writes that would write shared bytes must be refused, every other call
is checked bit for bit; malformed DLPack producers built with ctypes (NULL
shape, NULL strides, any ndim, bad element types, devices and data pointers)
through the C exchange API and versioned and legacy capsules; and the
reshard planner's arguments (EngineLayout, plan_reshard, the layout
accessors).  A case passes when the call returns, or raises ValueError,
TypeError or RuntimeError (the CPU build, or no GPU, for device work; the
planner: ValueError or TypeError only); any other exception fails it (a
wrong exception type), and so does a destination written by a call that
raised (a write on error), a result that differs from the reference or a call
the rule says must fail that did not (a wrong result), and a case that runs
past 20 s (a hang).  Valid block <-> universal calls are also checked bit for
bit against a NumPy reference.

Cases run in worker processes; a worker that dies (a crash) is reported with
the seed of the case it was running, and the command that replays it:

    python3 tools/fuzz.py --cases 100000            # from seed 0, all CPU cores
    python3 tools/fuzz.py --cases 2000 --first 7    # seeds 7 .. 2006
    python3 tools/fuzz.py --replay 1234             # one case, in this process
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

try:
    import torch  # noqa: F401 - to_cache's moved-memory cases resize a torch tensor
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This tree's kvbm_ext (built in place) ahead of an installed one, after any PYTHONPATH
# entry; and the tests' stand-in DLPack producers.
sys.path.insert(1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), ROOT)
sys.path.append(os.path.join(ROOT, "tests"))

from support import dlpack_producers  # noqa: E402
import fuzz_paged  # noqa: E402

ALLOWED = (ValueError, TypeError, RuntimeError)
POISON = 0xA5
WORKER_FAILED = 3  # a worker's exit status when a case failed; any other but 0 is a crash
CASE_SECONDS = 20  # a case running longer is a hang
KINDS = {"hang": "hangs", "wrong exception type": "wrong exception types", "write on error": "writes on error",
         "wrong result": "wrong results"}


# ----------------------------------------------------------------------------- hostile objects

class Getter:
    """An array whose __array_interface__ runs `effect` (on the caller's lists) first."""

    def __init__(self, a, effect=None):
        self.a, self.effect = a, effect

    @property
    def __array_interface__(self):
        if self.effect is not None:
            effect, self.effect = self.effect, None
            effect()
        return self.a.__array_interface__


class Index:
    """An int whose __index__ runs `effect` first."""

    def __init__(self, value, effect=None):
        self.value, self.effect = value, effect

    def __index__(self):
        if self.effect is not None:
            effect, self.effect = self.effect, None
            effect()
        return self.value


class Interface:
    """A made-up __array_interface__ dict (lying shapes, strides, pointers, typestrs)
    over the memory of `owner`, which it keeps alive as a real producer would."""

    def __init__(self, d, owner):
        self.d, self.owner = d, owner

    @property
    def __array_interface__(self):
        return self.d


class BadDevice:
    """A DLPack producer whose __dlpack_device__ returns `device`, or raises it when it is
    an exception (as torch does for a meta tensor)."""

    def __init__(self, device):
        self.device = device

    def __dlpack__(self, *args, **kwargs):
        raise TypeError("no capsule")

    def __dlpack_device__(self):
        if isinstance(self.device, BaseException):
            raise self.device
        return self.device


class Raises:
    def __index__(self):
        raise ZeroDivisionError("hostile __index__")


# ----------------------------------------------------------------------------- drawing

def odd_string(rng, good):
    return rng.choice([good, good.lower(), good + "\x00x", good[:1] + "\u00e9" + good[1:], "\ud800", "", " " + good,
                       good * 2, 5, None, b"NHD"])


def odd_int(rng, good):
    return rng.choice([good, 0, -1, 1, 2**31, 2**63, 2**64, -2**70, True, 1.5, "1", None, Raises(), Index(good),
                       np.int64(good), np.uint64(good), np.int32(-1), np.True_, np.float64(good)])


def odd_stream(rng):
    return rng.choice([None, None, None, 0, 1, 2, -1, 2**64, "s", 1.0, Raises()])


def shape6(rng):
    """(nb, nl, no, nh, nt, hd), small."""
    return (rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 4),
            rng.choice([1, 2, 3, 8]))


def random_array(rng, shape, dtype):
    a = np.frombuffer(rng.randbytes(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype=dtype).reshape(shape)
    return a.copy()


def poisoned(shape, dtype):
    a = np.empty(shape, dtype=dtype)
    a.view(np.uint8)[...] = POISON
    return a


def mangle(rng, a, holder):
    """`a`, or a hostile stand-in for it; `holder` is the list it sits in."""
    kind = rng.randrange(14)
    if kind < 7:
        return a
    if kind == 7:
        return Getter(a, lambda: holder.clear())
    if kind == 8:
        return Getter(a, lambda: holder.__delitem__(slice(len(holder) // 2, None)))
    if kind == 9:
        return Getter(a, lambda: holder.__setitem__(slice(None), [np.zeros(1)] * len(holder)))
    d = dict(a.__array_interface__)
    if kind == 10:
        d["shape"] = tuple(Index(s, lambda: d.__setitem__("shape", (1,))) for s in d["shape"])
    elif kind == 11:
        d["shape"] = tuple(rng.choice([s, -s - 1, 2**62, 2**64]) for s in d["shape"])
    elif kind == 12:
        d["data"] = (rng.choice([0, 2**64, -8, d["data"][0]]), False)
    else:
        d["typestr"] = rng.choice(["<f2", "<V2", "|b1", ">f4", "<c8", "xyz", "<f0", 7])
    return Interface(d, a)


# ----------------------------------------------------------------------------- cases

class Case:
    """A drawn call: `run()` makes it; `written` lists (destination, snapshot) pairs
    that a raising call must leave as they were; `check()` verifies a success;
    `expect_error`: the rule says the call must raise (None: either may happen);
    `allowed`: the exception types a refusal may have."""

    def __init__(self):
        self.written = []
        self.check = None
        self.expect_error = None
        self.allowed = ALLOWED


class Hang(BaseException):
    """Raised by the alarm in a case that runs past CASE_SECONDS."""


def case_list_api(rng, kvbm_ext):
    nb, nl, no, nh, nt, hd = shape6(rng)
    layout = rng.choice(["NHD", "HND"])
    dtype = rng.choice([np.float16, np.int8, np.float32, np.float64])
    chunk = (nt, nh, hd) if layout == "NHD" else (nh, nt, hd)
    name = rng.choice(["block_to_universal", "universal_to_block", "block_to_operational", "operational_to_block",
                       "universal_to_operational", "operational_to_universal"])
    c = Case()
    blocks = [[random_array(rng, chunk, dtype) for _ in range(nl * no)] for _ in range(nb)]
    universals = [random_array(rng, (nh, nl, no, nt, hd), dtype) for _ in range(nb)]
    operationals = [random_array(rng, (nl, no, nt * nh * hd), dtype) for _ in range(nb)]
    src_kind, dst_kind = name.split("_to_")
    sides = {"block": blocks, "universal": universals, "operational": operationals}
    src, dst = sides[src_kind], sides[dst_kind]
    for arrays in (dst if dst_kind != "block" else [a for b in dst for a in b]):
        arrays.view(np.uint8)[...] = POISON
    hostile = rng.random() < 0.5
    if hostile:
        for group in ([src] if src_kind != "block" else src) + ([dst] if dst_kind != "block" else dst):
            for i in range(len(group)):
                group[i] = mangle(rng, group[i], group)
    # a flat side (universals, operationals) as one [nb, ...] array, as PagedKVCache takes it
    stack = {}
    for role, kind, side in (("src", src_kind, src), ("dst", dst_kind, dst)):
        if kind != "block" and all(isinstance(a, np.ndarray) for a in side) and rng.random() < 0.3:
            stack[role] = np.stack(side)
            if rng.random() < 0.2:  # a leading dimension that is not nb
                stack[role] = stack[role][: rng.randint(0, len(side) + 1)]
            if role == "src" and rng.random() < 0.2:  # blocks read backwards
                stack[role] = stack[role][::-1]
    src, dst = stack.get("src", src), stack.get("dst", dst)
    if isinstance(dst, np.ndarray):
        flat_dst = [dst]
    else:
        flat_dst = [a for a in (dst if dst_kind != "block" else [x for b in dst for x in b]) if isinstance(a, np.ndarray)]
    c.written = [(a, a.copy()) for a in flat_dst]
    kwargs = {}
    if rng.random() < 0.3:
        kwargs["stream"] = odd_stream(rng)
    if rng.random() < 0.3:
        kwargs["backend"] = odd_string(rng, rng.choice(["auto", "kernel", "copy_engines", "batch", "async"]))
    if rng.random() < 0.3:
        kwargs["num_ctas"] = odd_int(rng, 4)
    args = [src, dst]
    if "block" not in name or "universal" in name:
        if rng.random() < 0.5:
            args.append(odd_string(rng, layout) if hostile else layout)
    fn = getattr(kvbm_ext, name)
    c.run = lambda: fn(*args, **kwargs)
    if not hostile and name == "block_to_universal" and kwargs.get("stream") is None and len(args) == 3 and len(dst) == nb:
        def check():
            for b in range(nb):
                for l in range(nl):
                    for o in range(no):
                        ch = blocks[b][l * no + o]
                        want = ch.transpose(1, 0, 2) if layout == "NHD" else ch
                        assert np.array_equal(dst[b][:, l, o].view(np.uint8), want.view(np.uint8)), "wrong bytes"
        c.check = check
    return c


def case_paged(rng, kvbm_ext):
    nb, nl, no, nh, nt, hd = shape6(rng)
    NB = nb + rng.randint(0, 3)
    dims = rng.choice(["kbthd", "kbhtd", "btd", "bkthd"])
    shape = {"kbthd": (no, NB, nt, nh, hd), "kbhtd": (no, NB, nh, nt, hd), "btd": (NB, nt, hd),
             "bkthd": (NB, no, nt, nh, hd)}[dims]
    layers = [random_array(rng, shape, np.float16) for _ in range(nl)]
    c = Case()
    hostile = rng.random() < 0.5
    arg_layers = [mangle(rng, a, None) if hostile and rng.random() < 0.3 else a for a in layers]
    if hostile and rng.random() < 0.2:
        arg_layers[0] = Getter(layers[0], lambda: arg_layers.clear())
    arg_dims = odd_string(rng, dims) if hostile and rng.random() < 0.3 else dims
    method = rng.choice(["to_universal", "from_universal", "to_operational", "from_operational"])
    h = nh if "h" in dims else 1
    k = no if "k" in dims else 1
    flat_shape = (h, nl, k, nt, hd) if "universal" in method else (nl, k, nt * h * hd)
    flats = [poisoned(flat_shape, np.float16) if method.startswith("to_") else random_array(rng, flat_shape, np.float16)
             for _ in range(nb)]
    ids = rng.sample(range(NB), nb)
    arg_ids = [odd_int(rng, i) if hostile and rng.random() < 0.2 else i for i in ids]
    arg_flats = [mangle(rng, f, None) if hostile and rng.random() < 0.3 else f for f in flats]
    kwargs = {}
    if rng.random() < 0.3:
        kwargs["layers"] = rng.choice([None, slice(0, nl), slice(nl - 1, None, -1), range(0, 2**64, 2**62), slice(0, 5, 0),
                                       nl, "all"])
    if "universal" in method and rng.random() < 0.3:
        kwargs["head_offset"] = odd_int(rng, 0)
    if "operational" in method and rng.random() < 0.3:
        kwargs["inner"] = odd_string(rng, "NHD")
    if rng.random() < 0.2:
        kwargs["num_ctas"] = odd_int(rng, 2)
    if rng.random() < 0.2:
        kwargs["backend"] = odd_string(rng, "auto")
    c.written = [(a, a.copy()) for a in (flats if method.startswith("to_") else layers)]

    def run():
        cache = kvbm_ext.PagedKVCache(arg_layers, arg_dims)
        fn = getattr(cache, method)
        first, second = (arg_ids, arg_flats) if method.startswith("to_") else (arg_flats, arg_ids)
        fn(first, second, **kwargs)
    c.run = run
    return c


def case_other(rng, kvbm_ext):
    c = Case()
    name = rng.choice(["vectorized_copy", "memcpy_batch", "set_staging", "staging_info", "reserve_staging",
                       "bad_device"])
    if name in ("vectorized_copy", "memcpy_batch"):
        src, dst = random_array(rng, (64,), np.uint8), poisoned((64,), np.uint8)
        n = rng.randint(0, 3)
        sp = [odd_int(rng, src.ctypes.data + 8 * i) for i in range(n)]
        dp = [odd_int(rng, dst.ctypes.data + 8 * i) for i in range(n)]
        if rng.random() < 0.3 and all(type(v) is int and 0 <= v < 2**64 for v in sp):
            sp = list(np.array(sp, np.uint64))  # list(np_array): NumPy integer scalars
        sizes = odd_int(rng, 8) if rng.random() < 0.7 else [odd_int(rng, 8) for _ in range(n)]
        c.written = [(dst, dst.copy())]
        c.run = lambda: getattr(kvbm_ext, name)(sp, dp, sizes, stream=odd_stream(rng))
    elif name == "set_staging":
        size, lanes = odd_int(rng, 1 << 20), odd_int(rng, 2)
        c.run = lambda: kvbm_ext.set_staging(size, lanes=lanes)
    elif name == "bad_device":
        device = rng.choice([(1, Raises()), (Raises(), 0), (2**64, 0), (1,), "cpu", (1, 2**64), None, (14, 0),
                             (np.int64(1), np.int64(0)), ValueError("Unknown device type meta for Dlpack"),
                             BufferError("cannot export")])
        arrays = [[BadDevice(device)]]
        universals = [poisoned((1, 1, 1, 1, 1), np.float16)]
        c.written = [(universals[0], universals[0].copy())]
        c.run = lambda: kvbm_ext.block_to_universal(arrays, universals)
    else:
        device = odd_int(rng, 0)
        c.run = lambda: getattr(kvbm_ext, name)(device)
    return c


def paged_bases(rng, layout, nl, NB, no, nh, nt, hd, dtype):
    """A cache's bases (random bytes) and the constructor argument over them."""
    dims, single, base_shape = fuzz_paged.LAYOUTS[layout]
    no, nh = (no if "k" in dims else 1), (nh if "h" in dims else 1)
    shape = base_shape(nl, NB, no, nh, nt, hd)
    bases = [random_array(rng, shape, dtype) for _ in range(1 if single else nl)]
    return dims, no, nh, bases, (lambda bs: bs[0] if single else list(bs))


def flats_of(rng, shape, nb, poison, stack):
    """nb flat blocks: a list of arrays or one stacked array (random, or poisoned)."""
    make = (lambda s: poisoned(s, np.float16)) if poison else (lambda s: random_array(rng, s, np.float16))
    if stack:
        whole = make((nb,) + tuple(shape))
        return whole, [whole[b] for b in range(nb)], [whole]
    blocks = [make(tuple(shape)) for _ in range(nb)]
    return blocks, blocks, blocks


def paged_call(c, kvbm_ext, layers_arg, dims, method, ids, flats_arg, kwargs):
    def run():
        cache = kvbm_ext.PagedKVCache(layers_arg, dims)
        fn = getattr(cache, method)
        fn(*((ids, flats_arg) if method.startswith("to_") else (flats_arg, ids)), **kwargs)
    c.run = run


def expect_move(c, method, bases, make, dims, flats, flat_bases, ids, chosen_layers, chosen_heads, kwargs):
    """c.check: the move applied by the reference to copies of the destination's memory."""
    cache_before = [b.copy() for b in bases]
    flats_before = [b.copy() for b in flat_bases]

    def check():
        want_cache = [b.copy() for b in cache_before]
        want_flat = [b.copy() for b in flats_before]
        want_blocks = ([w[i] for w in want_flat for i in range(w.shape[0])] if len(want_flat) == 1
                       and len(flats) > 1 or (len(want_flat) == 1 and want_flat[0].ndim == flats[0].ndim + 1)
                       else want_flat)
        rows = fuzz_paged.rows(make(want_cache), dims)
        fuzz_paged.apply(method, rows, want_blocks, ids, chosen_layers, chosen_heads,
                         int(kwargs.get("layer_offset", 0)), int(kwargs.get("head_offset", 0)),
                         kwargs.get("inner", "NHD"))
        for got, want in zip(bases + flat_bases, want_cache + want_flat):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{method}: wrong bytes"
    c.check = check


def case_paged_select(rng, kvbm_ext):
    """layers=, heads=, layer_offset and head_offset in and outside the rule, on every
    layout; every accepted call checked against the reference."""
    nb, nl, no, nh, nt, hd = shape6(rng)
    nl, nh, NB = rng.randint(1, 4), rng.randint(1, 4), nb + rng.randint(0, 3)
    layout = rng.choice(list(fuzz_paged.LAYOUTS))
    dims, no, nh, bases, make = paged_bases(rng, layout, nl, NB, no, nh, nt, hd, np.float16)
    method = rng.choice(["to_universal", "from_universal", "to_universal", "from_universal", "to_operational",
                         "from_operational"])
    hostile = [slice(Raises(), None), slice(None, "a"), slice(1.5), slice(0, 2, Raises()), "all", [0], 1.0]
    kwargs = {"layers": fuzz_paged.draw_selection(rng, nl, hostile)}
    chosen_l = fuzz_paged.selection(nl, kwargs["layers"])
    ok, chosen_h, NH, NL = chosen_l is not None, [0], nh, nl
    if "universal" in method:
        kwargs["heads"] = fuzz_paged.draw_selection(rng, nh, hostile)
        chosen_h = fuzz_paged.selection(nh, kwargs["heads"])
        bottom = min(chosen_l) if chosen_l else 0
        kwargs["layer_offset"] = rng.choice([0, 1, -bottom, -bottom - 1, rng.randint(-3, 3), np.int64(-bottom),
                                             Raises(), 2**31, -(2**31), True])
        kwargs["head_offset"] = rng.choice([0, 0, 1, 2, -1, np.int64(1), Raises()])
        ok = ok and chosen_h is not None and fuzz_paged.offset_ok(kwargs["layer_offset"], bottom)
        ok = ok and fuzz_paged.offset_ok(kwargs["head_offset"], 0) and kwargs["head_offset"] is not True
        if ok:
            need_h = int(kwargs["head_offset"]) + len(chosen_h)
            need_l = int(kwargs["layer_offset"]) + max(chosen_l) + 1
            NH, NL = max(need_h + rng.choice([0, 0, 1, -1]), 1), max(need_l + rng.choice([0, 0, 1, -1]), 1)
            ok = NH >= need_h and NL >= need_l
        shape = (NH, NL, no, nt, hd)
    else:
        kwargs["inner"] = rng.choice(["NHD", "HND"])
        shape = (nl, no, nt * nh * hd)
    to = method.startswith("to_")
    arg, flats, flat_bases = flats_of(rng, shape, nb, to, rng.random() < 0.3)
    ids = rng.sample(range(NB), nb)
    c = Case()
    c.expect_error = not ok
    c.written = [(a, a.copy()) for a in (flat_bases if to else bases)]
    paged_call(c, kvbm_ext, make(bases), dims, method, ids, arg, kwargs)
    if ok:
        expect_move(c, method, bases, make, dims, flats, flat_bases, ids, chosen_l, chosen_h, kwargs)
    return c


def aliased_layers(rng, kind, nl, NB, no, nh, nt, hd):
    """(dims, bases, make) of a cache whose layers share bytes, or interleave without."""
    size = no * NB * nt * nh * hd
    if kind == "same":
        return "kbthd", [random_array(rng, (no, NB, nt, nh, hd), np.float16)], lambda bs: [bs[0]] * nl
    if kind == "overlap":
        shift = rng.choice([1, hd, size // 2 or 1, size - 1 or 1, size])
        return "kbthd", [random_array(rng, (size + shift * (nl - 1),), np.float16)], \
            lambda bs: [bs[0][l * shift: l * shift + size].reshape(no, NB, nt, nh, hd) for l in range(nl)]
    if kind == "interleaved":
        return "bkthd", [random_array(rng, (NB, nl, no, nt, nh, hd), np.float16)], \
            lambda bs: [bs[0][:, l] for l in range(nl)]
    block = nt * nh * hd
    layer_stride = rng.choice([block, 1, block * (NB + 1) * no, hd])

    def strided(bs):
        return np.lib.stride_tricks.as_strided(bs[0], (nl, no, NB, nt, nh, hd), (
            2 * layer_stride, 2 * block * (NB + nl + 1), 2 * block, 2 * nh * hd, 2 * hd, 2))
    return "lkbthd", [random_array(rng, (block * (no * (NB + nl + 1) + nl * (NB + 1) * no + 1),), np.float16)], strided


def case_paged_alias(rng, kvbm_ext):
    """A cache whose layers share bytes: a call writing two layers that do is refused, any
    other call is checked bit for bit."""
    nb, nl, no, nh, nt, hd = shape6(rng)
    nl, NB = rng.randint(2, 4), nb + rng.randint(0, 3)
    kind = rng.choice(["same", "overlap", "interleaved", "strided"])
    dims, bases, make = aliased_layers(rng, kind, nl, NB, no, nh, nt, hd)
    method = rng.choice(["to_universal", "from_universal", "to_operational", "from_operational"])
    valid = [None, 0, nl - 1, slice(0, nl, 2), slice(None, None, -1), range(1, nl), slice(-2, None)]
    kwargs = {"layers": rng.choice(valid)}
    chosen = fuzz_paged.selection(nl, kwargs["layers"])
    layer_views = make(bases)
    layer_views = [layer_views[l] for l in range(nl)]
    shape = (nh, nl, no, nt, hd) if "universal" in method else (nl, no, nt * nh * hd)
    to = method.startswith("to_")
    arg, flats, flat_bases = flats_of(rng, shape, nb, to, rng.random() < 0.3)
    ids = rng.sample(range(NB), nb)
    c = Case()
    c.expect_error = not to and fuzz_paged.share_bytes(layer_views, chosen)
    c.written = [(a, a.copy()) for a in (flat_bases if to else bases)]
    paged_call(c, kvbm_ext, make(bases), dims, method, ids, arg, kwargs)
    if not c.expect_error:
        expect_move(c, method, bases, make, dims, flats, flat_bases, ids, chosen, list(range(nh)), kwargs)
    return c


def cache_memory(rng, kind, nl, NB, no, nh, nt, hd, base=None):
    """(the constructor's layers, dims, whether they are (K, V) pairs) of a cache of `kind`
    over fresh random bytes, or over views of `base` (a [nl, 2, NB2, nt, NH2, hd] array)."""
    if base is not None:
        return base, "lkbthd", False
    if kind == "pairs":
        return [[random_array(rng, (NB, nt, nh, hd), np.float16) for _ in range(2)] for _ in range(nl)], "bthd", True
    if kind == "one array":
        return random_array(rng, (nl, no, NB, nt, nh, hd), np.float16), "lkbthd", False
    return [random_array(rng, (no, NB, nt, nh, hd), np.float16) for _ in range(nl)], "kbthd", False


def one_buffer_views(rng, nl, NB, nh, nt, hd):
    """Two views of one buffer for src and dst: disjoint (block halves, even and odd blocks,
    head halves) or sharing bytes (overlapping halves, one inside the other, the same)."""
    base = random_array(rng, (nl, 2, 2 * NB + 1, nt, 2 * nh, hd), np.float16)
    relation = rng.choice(["halves", "even odd", "heads", "overlap", "inside", "same"])
    a, b = {"halves": (base[:, :, :NB], base[:, :, NB: 2 * NB]),
            "even odd": (base[:, :, 0: 2 * NB: 2], base[:, :, 1: 2 * NB: 2]),
            "heads": (base[:, :, :NB, :, :nh], base[:, :, :NB, :, nh:]),
            "overlap": (base[:, :, :NB + 1], base[:, :, NB - 1: 2 * NB]),
            "inside": (base[:, :, 0: 2 * NB: 2], base[:, :, 0: 2 * NB: 4]),
            "same": (base[:, :, :NB], base[:, :, :NB])}[relation]
    return base, (a, b) if rng.random() < 0.5 else (b, a)


def aliased_dst(rng, layers, pairs):
    """dst's own layers sharing bytes: a layer given twice, K given as V, a pair twice."""
    if pairs:
        how = rng.choice(["K is V", "pair twice"])
        if how == "K is V":
            layers[0][1] = layers[0][0]
        else:
            layers[-1] = layers[0]
    elif isinstance(layers, list):
        layers[-1] = layers[0]
    return layers


def case_to_cache(rng, kvbm_ext):
    """to_cache between two caches, both hostile: layers that share bytes, (K, V) pairs
    aliasing, disjoint and overlapping views of one buffer, memory moved since the cache
    was built, selections and offsets.  Refused exactly when the rule says (a written
    layer's bytes shared within dst, or with a byte src reads), else checked bit for bit."""
    _, _, no, nh, nt, hd = shape6(rng)
    nl, NB, nh, no = rng.randint(1, 3), rng.randint(2, 5), rng.randint(1, 3), 2
    # Memory that moves needs torch's resize_: where torch is absent (free-threaded CPython),
    # the other relations are drawn.
    relation = rng.choice(["separate", "separate", "one buffer", "aliased dst"] + (["moved"] if HAVE_TORCH else []))
    src_kind, dst_kind = rng.choice(["per layer", "pairs", "one array"]), rng.choice(["per layer", "pairs", "one array"])
    c = Case()
    memory = []
    if relation == "one buffer":
        base, (a, b) = one_buffer_views(rng, nl, NB, nh, nt, hd)
        src_layers, src_dims, src_pairs = cache_memory(rng, None, nl, NB, no, nh, nt, hd, a)
        dst_layers, dst_dims, dst_pairs = cache_memory(rng, None, nl, NB, no, nh, nt, hd, b)
        memory = [base]
    else:
        src_layers, src_dims, src_pairs = cache_memory(rng, src_kind, nl, NB, no, nh, nt, hd)
        dst_layers, dst_dims, dst_pairs = cache_memory(rng, dst_kind, nl, NB, no, nh, nt, hd)
        if relation == "aliased dst":
            dst_layers = aliased_dst(rng, dst_layers, dst_pairs)
        memory = [x for layers in (src_layers, dst_layers) for x in (
            layers if isinstance(layers, np.ndarray) else [y for item in layers for y in (item if isinstance(item, list)
                                                                                          else [item])])]
    src_nb, dst_nb = (src_layers.shape[2] if src_dims == "lkbthd" else NB), (dst_layers.shape[2] if dst_dims == "lkbthd"
                                                                            else NB)
    src_nh = src_layers.shape[4] if src_dims == "lkbthd" else nh
    dst_nh = dst_layers.shape[4] if dst_dims == "lkbthd" else nh
    nb = rng.randint(1, min(src_nb, dst_nb))
    src_ids, dst_ids = [rng.randrange(src_nb) for _ in range(nb)], rng.sample(range(dst_nb), nb)
    count = rng.randint(1, min(src_nh, dst_nh))
    first = rng.randint(0, src_nh - count)
    heads, head_offset = slice(first, first + count), rng.randint(0, dst_nh - count)
    kwargs = {"heads": heads, "head_offset": head_offset}
    if rng.random() < 0.5:
        kwargs.update(layers=slice(nl - 1, None, -1), layer_offset=0, pack_layers=True)
    chosen = fuzz_paged.selection(nl, kwargs.get("layers"))
    landing = list(range(len(chosen))) if kwargs.get("pack_layers") else chosen
    c.written = [(x, x.copy()) for x in memory]
    src_rows = fuzz_paged.outer_rows(src_layers, src_dims, src_pairs)
    dst_rows = fuzz_paged.outer_rows(dst_layers, dst_dims, dst_pairs)
    written_whole = [dst_rows[l][o] for l in landing for o in range(no)]
    written = [dst_rows[l][o][:, :, head_offset: head_offset + count] for l in landing for o in range(no)]
    read = [src_rows[l][o][:, :, heads] for l in chosen for o in range(no)]
    c.expect_error = relation == "moved" or fuzz_paged.pieces_share_bytes(written_whole, []) or \
        fuzz_paged.pieces_share_bytes(written, read)
    src_arg, dst_arg = src_layers, dst_layers
    if relation == "moved":
        moved = torch.from_numpy(random_array(rng, (nl, no, NB, nt, nh, hd), np.float16)).clone()
        src_arg, src_dims = moved, "lkbthd"

    def run():
        src = kvbm_ext.PagedKVCache(src_arg, src_dims)
        dst = kvbm_ext.PagedKVCache(dst_arg, dst_dims)
        if relation == "moved":
            src_arg.resize_(src_arg.numel() * 2)     # the cache's memory is freed: refused, never read
        src.to_cache(dst, src_ids, dst_ids, **kwargs)
    c.run = run
    if not c.expect_error:
        before = [x.copy() for x in memory]

        def check():
            got = [x.copy() for x in memory]
            for x, was in zip(memory, before):
                x[...] = was        # the rows (views of memory) hold the bytes of before the call
            fuzz_paged.apply_to_cache(src_rows, dst_rows, src_ids, dst_ids, chosen, list(range(first, first + count)),
                                      landing, head_offset)
            for x, g in zip(memory, got):
                assert np.array_equal(g.view(np.uint8), x.view(np.uint8)), "to_cache: wrong bytes"
        c.check = check
    return c


def case_grouped_block_size(rng, kvbm_ext):
    """Layouts that group t with b or k with t, with block sizes up to and past int64."""
    dims = rng.choice(["(bt)hd", "b(tk)hd", "(bt)(kd)", "bth(kd)", "(bt)khd"])
    block_size = rng.choice([1, 2, 4, 2**31, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -1, 0, np.int64(2**62 + 1),
                             True, Raises(), Index(2**62 + 3)])
    shape = {"(bt)hd": (8, 2, 4), "b(tk)hd": (2, 8, 2, 4), "(bt)(kd)": (8, 8), "bth(kd)": (2, 4, 2, 8),
             "(bt)khd": (8, 2, 2, 4)}[dims]
    layer = random_array(rng, shape, np.float16)
    c = Case()
    universal = poisoned((1, 2, 1, 2, 4, 4), np.float16)
    c.written = [(universal, universal.copy())]

    def run():
        cache = kvbm_ext.PagedKVCache([layer], dims, block_size=block_size)
        cache.to_universal([0], universal)
    c.run = run
    return c


def case_pinned_empty(rng, kvbm_ext):
    """pinned_empty's shapes: empty with huge other extents, past 2**63 bytes, odd ints;
    every accepted buffer exports strides and a size that fit (nothing larger than 1 MiB is
    drawn that the machine could map)."""
    c = Case()
    pick = lambda: rng.choice([0, 0, 1, 3, 7, 2**20, 2**31, 2**61, 2**62, 2**63 - 1, 2**63, -1])  # noqa: E731
    shape = tuple(pick() for _ in range(rng.randint(0, 4)))
    total = 1
    for extent in shape:
        total *= extent
    if 0 < total * 8 <= 2**20 or min(shape, default=1) < 0 or 0 in shape or total * 8 >= 2**63:
        arg = rng.choice([shape, list(shape), shape[0] if len(shape) == 1 else shape])
    else:
        arg = (0,) + shape       # between 1 MiB and 2**63 bytes: made empty
    dtype = rng.choice([np.float32, np.float16, np.uint8, "bfloat16", "float64", "nope", np.complex64])

    def run():
        buf = kvbm_ext.pinned_empty(arg, dtype)
        view = memoryview(buf)
        span = sum(abs(st) * (n - 1) for st, n in zip(view.strides, view.shape) if n > 0)
        assert all(st >= 0 for st in view.strides) and span < 2**63, f"strides {view.strides}"
        buf.close()
    c.run = run
    c.allowed = ALLOWED + (MemoryError,)    # more bytes than the machine has: refused before mapping
    return c


def case_dlpack(rng, kvbm_ext):
    """A DLPack producer built with ctypes, well formed or not, as a source chunk, a
    destination universal or a PagedKVCache layer, through each route."""
    nt, nh, hd = rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 4, 8])
    chunk = random_array(rng, (nt, nh, hd), np.float16)
    universal = poisoned((nh, 1, 1, nt, hd), np.float16)
    kind = rng.choice(["null shape", "null strides", "ndim", "dtype", "device", "null data", "negative", "ok"])
    where = rng.choice(["chunk", "universal", "layer"])
    target = universal if where == "universal" else chunk.reshape(1, 1, nt, nh, hd) if where == "layer" else chunk
    keywords = {"null shape": {"shape": None}, "null strides": {"strides": None}, "ok": {},
                "ndim": {"ndim": rng.choice([-(2**31), -1, 0, 9, 64, 2**31 - 1])},
                "dtype": {"dtype": rng.choice([(2, 16, 2), (2, 0, 1), (2, 12, 1), (2, 16, 0), (99, 16, 1)])},
                "device": {"device": (rng.choice([4, 7, 10, 99, 2**31 - 1]), rng.choice([0, 1]))},
                "null data": {"data": 0}, "negative": {"shape": (-target.shape[0],) + target.shape[1:]}}[kind]
    if kind == "ndim" and rng.random() < 0.5 and target.ndim > 1:
        keywords = {"ndim": rng.randint(1, target.ndim - 1)}  # a prefix of the real shape: memory-safe
        kind = "fewer dimensions"
    producer = dlpack_producers.producers(dlpack_producers.Description(target, **keywords))[
        rng.choice(["exchange", "versioned", "legacy"])]
    c = Case()
    c.written = [(universal, universal.copy())]
    if where == "chunk":
        c.run = lambda: kvbm_ext.block_to_universal([[producer]], [universal], "NHD")
    elif where == "universal":
        c.run = lambda: kvbm_ext.block_to_universal([[chunk]], [producer], "NHD")
    else:
        c.run = lambda: kvbm_ext.PagedKVCache([producer], "kbthd").to_universal([0], [universal])
    c.expect_error = kind not in ("ok", "null strides", "fewer dimensions")
    if not c.expect_error and kind != "fewer dimensions":
        def check():
            want = chunk.transpose(1, 0, 2)
            assert np.array_equal(universal[:, 0, 0].view(np.uint16), want.view(np.uint16)), "wrong bytes"
        c.check = check
    elif kind == "fewer dimensions":
        c.expect_error = None   # refused as a wrong shape, unless the prefix happens to fit
    return c


def odd_count(rng, good):
    return rng.choice([good, good, good, 0, -1, 1, 2, 3, 2**16, 2**16 + 1, 2**31, 2**40, 2**64, True, 1.5, "1", None,
                       Raises(), Index(good), np.int64(good), np.uint64(max(good, 0)), np.int32(-1), np.True_,
                       np.float64(good)])


def case_plan(rng, kvbm_ext):
    """The reshard planner's arguments: ValueError or TypeError, or a plan, at once."""
    c = Case()
    c.allowed = (ValueError, TypeError)
    tp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3])
    ranks = rng.choice([None, None, list(range(tp * pp))[::-1], [odd_count(rng, i) for i in range(tp * pp)],
                        range(2**64), [0] * (tp * pp), "ab", 5])
    layer_ranges = rng.choice([None, None, [(s * 4, s * 4 + 4) for s in range(pp)],
                               [(odd_count(rng, s * 4), odd_count(rng, s * 4 + 4)) for s in range(pp)],
                               [range(0, 2**64)], [range(0, 8, 2)], [(0, 2**64)] * pp, "x"])
    heads, layers = odd_count(rng, rng.choice([1, 2, 8])), odd_count(rng, 4 * pp)
    args = [odd_count(rng, tp), odd_count(rng, pp)]
    call = rng.choice(["layout", "plan", "heads_of", "layers_of", "tp_ranks_holding", "rank_of", "position_of"])

    def run():
        layout = kvbm_ext.EngineLayout(*args, ranks=ranks, layer_ranges=layer_ranges)
        other = kvbm_ext.EngineLayout(rng.choice([1, 2, 4]), rng.choice([1, 2]))
        index = odd_count(rng, rng.randint(0, 3))
        if call == "plan":
            kvbm_ext.plan_reshard(heads, layers, layout, other) if rng.random() < 0.5 else \
                kvbm_ext.plan_reshard(heads, layers, other, layout)
        elif call == "heads_of":
            layout.heads_of(index, heads)
        elif call == "layers_of":
            layout.layers_of(index, layers)
        elif call == "tp_ranks_holding":
            layout.tp_ranks_holding(index, heads)
        elif call == "rank_of":
            layout.rank_of(index, odd_count(rng, 0))
        elif call == "position_of":
            layout.position_of(index)
    c.run = run
    return c


def run_case(seed, kvbm_ext):
    """Draws and runs case `seed`; returns None, or what went wrong (its kind first)."""
    rng = random.Random(seed)
    draw = rng.choice([case_list_api, case_list_api, case_paged, case_paged, case_other, case_paged_select,
                       case_paged_select, case_paged_alias, case_dlpack, case_plan, case_to_cache, case_to_cache,
                       case_grouped_block_size, case_pinned_empty])
    case = draw(rng, kvbm_ext)
    try:
        case.run()
    except Hang:
        return f"hang: past {CASE_SECONDS} s"
    except BaseException as error:  # noqa: BLE001 - the type is the finding
        if not isinstance(error, case.allowed):
            return f"wrong exception type: {type(error).__name__}: {error}"
        for after, before in case.written:
            if not np.array_equal(after.view(np.uint8), before.view(np.uint8)):
                return f"write on error: a call that raised ({type(error).__name__}: {error}) wrote its destination"
        if case.expect_error is False:
            return f"wrong result: a call the rule accepts raised {type(error).__name__}: {error}"
        return None
    if case.expect_error:
        return "wrong result: a call the rule refuses returned"
    if case.check is not None:
        try:
            case.check()
        except AssertionError as error:
            return f"wrong result: {error}"
    return None


# ----------------------------------------------------------------------------- driver

def worker(first, count):
    """Runs seeds first .. first+count-1, announcing each before it runs."""
    import kvbm_ext

    def alarm(signum, frame):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    failures = 0
    for seed in range(first, first + count):
        print(f"case {seed}", flush=True)
        signal.alarm(CASE_SECONDS)
        problem = run_case(seed, kvbm_ext)
        signal.alarm(0)
        if problem is not None:
            failures += 1
            print(f"FAIL {seed}: {problem}", flush=True)
    print("done", flush=True)
    return WORKER_FAILED if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--first", type=int, default=0, help="seed of the first case")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replay", type=int, default=None, help="run one case here, by seed")
    parser.add_argument("--worker", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        sys.exit(worker(*args.worker))
    if args.replay is not None:
        import kvbm_ext

        problem = run_case(args.replay, kvbm_ext)
        print(f"case {args.replay}: {problem or 'ok'}")
        sys.exit(1 if problem else 0)

    start = time.time()
    batch = 500
    pending = [(s, min(batch, args.first + args.cases - s)) for s in range(args.first, args.first + args.cases, batch)]
    running, failed, crashed = [], [], []
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    while pending or running:
        while pending and len(running) < args.jobs:
            first, count = pending.pop(0)
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(first), str(count)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((first, count, proc))
        first, count, proc = running.pop(0)
        hung = False
        try:  # a case stuck where the alarm cannot interrupt it
            out, _ = proc.communicate(timeout=count * CASE_SECONDS + 600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            hung = True
        lines = out.splitlines()
        failed += [line for line in lines if line.startswith("FAIL")]
        started = [int(line.split()[1]) for line in lines if line.startswith("case ")]
        if hung or proc.returncode not in (0, WORKER_FAILED) or "done" not in lines:
            last = started[-1] if started else first
            if hung:
                failed.append(f"FAIL {last}: hang: the worker stopped answering")
            else:
                crashed.append(last)
                print(f"CRASH (exit status {proc.returncode}) in case {last}: replay with "
                      f"python3 tools/fuzz.py --replay {last}", flush=True)
                print("\n".join(lines[-20:]), flush=True)
            if last + 1 < first + count:  # go on after that case
                pending.append((last + 1, first + count - last - 1))
    for line in failed[:50]:
        print(line)
    kinds = ", ".join(f"{sum(f': {kind}:' in line for line in failed)} {name}" for kind, name in KINDS.items())
    print(f"fuzz: {args.cases} cases from seed {args.first}: {len(crashed)} crashes, {len(failed)} failures ("
          f"{kinds}) ({time.time() - start:.0f} s)")
    sys.exit(1 if crashed or failed else 0)


if __name__ == "__main__":
    main()
