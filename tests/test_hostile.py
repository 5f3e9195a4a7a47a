"""Hostile but legal Python objects against every CPU entry point. No GPU needed.

Every scenario that could crash the process (list mutation, freed objects, lying array
interfaces, huge extents, NULL / wild pointers) runs in its own child interpreter
(`subprocess.run([sys.executable, "-c", ...])`, with `PYTHONMALLOC=debug` and faulthandler),
so a segfault or abort is reported as a failure of the test that names the scenario and
the call that was running (the child prints `CALL <label>` before each call), not as a
dead test run. The child executes the first part of this very file (numpy + kvbm_ext
only, no pytest or torch), so the hostile classes and scenarios are plain Python, not
code in strings. It prints one `OUTCOME label|kind|message` line per call and saves the
arrays of the call (sources before, destinations before and after) to an .npz file. The parent then checks, with the
torch references of support/references.py and `torch.equal` on integer
views (bitwise, no tolerance):
  - a call that succeeded wrote exactly the reference result for the arrays AS THEY WERE
    WHEN THE CALL STARTED (a snapshot), so reading a list after a getter changed it is a
    failure even when it does not crash;
  - a call that failed raised ValueError / TypeError (never SystemError, OverflowError,
    MemoryError, UnicodeError, AttributeError) whose message starts with the argument
    it is about (`universals[1]`, `blocks[0][2]`, `layers`, `dims`, ...), and every
    destination byte still holds the poison 0xA5.

Sections (numbered as the items of the brief):
  1. list mutation: an element's `__array_interface__` getter clears, shortens or rewrites
     the caller's list (or the outer list of `blocks`) while the call reads it:
     block_to_universal, universal_to_block, block_to_operational, operational_to_block,
     universal_to_operational, operational_to_universal, PagedKVCache construction (the
     per-layer list) and its to_/from_universal (and _operational) flat-block lists.
     No crash; a clean error or the snapshot result.
  2. a getter that drops the last reference to the item being read (the list holds the only
     reference to the wrapper, the wrapper the only reference to the array; later getters
     allocate junk of the same size to reuse freed memory). No crash, no use-after-free.
  3. `__array_interface__` dicts whose `shape` / `strides` / `data` entries have an
     `__index__` that replaces that dict entry while it is read (freeing the tuple being
     read); `__cuda_array_interface__` too (refused on the CPU build, without crashing).
  4. a NULL data pointer: non-empty shape -> ValueError naming the argument, nothing
     written; zero-size shape -> the call does nothing and succeeds.
  5. negative extents (an `__array_interface__` standing in for a DLPack producer with a
     negative extent), alone or consistent across every array of the call: ValueError.
  6. name arguments compared as whole strings: embedded NUL, non-ASCII letters, lone
     surrogates in `layout`, `backend`, `dims`, `inner`, `mode`: ValueError naming the
     argument, never OverflowError / UnicodeEncodeError (in-process: no memory is at risk).
  7. integers >= 2**64 or negative where sizes / addresses / offsets are taken (shape and
     stride entries, data pointers, products of extents, `layers=range(0, 2**64, 2**62)`,
     `head_offset` / `layer_offset` / `num_ctas` of 2**70, `stream=2**64`): ValueError
     (TypeError where the type is wrong) naming the argument; nothing written.
  8. `__dlpack_device__` returning items whose `__index__` raises, or other malformed
     device tuples (including a device id of 2**64): TypeError / ValueError naming the
     argument, never SystemError.
  9. honest empty NumPy arrays with huge extents (2**60 - 1, 2**61, 2**40) for the list API
     and PagedKVCache: no heap corruption (PYTHONMALLOC=debug), no MemoryError: the call
     does nothing and succeeds, or raises ValueError (universal <-> operational with
     2**40, a valid zero-byte pairing, must succeed).
 10. overlapping source and destination (views of one buffer), destinations overlapping each
     other, and a flat block inside the cache's memory: ValueError naming both, no byte
     written (in-process, torch and NumPy views). Non-overlapping (touching) views of one
     buffer, and sources that alias each other, work bitwise.
 11. a second thread pops and re-inserts entries of the lists (one entry, or the second
     half of a list) while block_to_universal reads them, every array behind a Python
     getter so the thread runs mid-walk (sys.setswitchinterval(1e-6), ~3 s; bitwise numpy
     check in the child, whose reference the parent checks against the torch one): no
     crash; every call either raised a clean error leaving the destinations poisoned, or
     wrote the exact result.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
for _p in (HERE, REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import kvbm_ext  # noqa: E402

POISON = 0xA5
JUNK_BYTE = 0x3C

# ==========================================================================
# Child side: hostile objects and scenarios (run in a fresh interpreter).
# ==========================================================================

_rng = None
_saved = {}
JUNK = []  # arrays allocated by getters to reuse freed memory; kept alive until exit


def rnd(shape, dtype=np.float32):
    """Random bytes viewed as `dtype`."""
    global _rng
    if _rng is None:
        _rng = np.random.default_rng(20261122)
    count = 1
    for s in shape:
        count *= s
    raw = _rng.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def poisoned(shape, dtype=np.float32):
    a = np.empty(shape, dtype)
    a.reshape(-1).view(np.uint8)[:] = POISON
    return a


def junk_like(a):
    j = np.empty_like(a)
    j.reshape(-1).view(np.uint8)[:] = JUNK_BYTE
    return j


def save(key, x):
    """Stores a copy of x (an array or a nested list of arrays) for the parent."""
    if isinstance(x, (list, tuple)):
        _saved[key + ".len"] = np.array(len(x))
        for i, v in enumerate(x):
            save(f"{key}.{i}", v)
    else:
        _saved[key] = np.array(x, copy=True)


def outcome(label, fn):
    """Runs fn(), printing what happened; returns its result or the exception."""
    print(f"CALL {label}", flush=True)
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges it
        print(f"OUTCOME {label}|{type(e).__name__}|{' '.join(str(e).split())}", flush=True)
        return e
    print(f"OUTCOME {label}|ok|{type(result).__name__}", flush=True)
    return result


def child_main(name, kwargs):
    globals()["scn_" + name](**kwargs)
    np.savez(os.path.join(os.environ["KVBM_HOSTILE_OUT"], "saved.npz"), **_saved)
    print("DONE", flush=True)


# --- array wrappers ---------------------------------------------------------------


class AI:
    """Exposes only the `__array_interface__` of a NumPy array. `hook`, if set, runs once,
    inside the getter, on the first read: it may mutate anything (the caller's list)."""

    def __init__(self, a, hook=None):
        self.a = a
        self.hook = hook

    @property
    def __array_interface__(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.a.__array_interface__


class FakeAI:
    """A hand-written `__array_interface__` (any shape, strides and data pointer); `keep`
    keeps the memory it points at alive."""

    def __init__(self, shape, data, typestr="<f4", strides=None, keep=None):
        self.keep = keep
        self.d = {"shape": tuple(shape), "typestr": typestr, "data": (data, False), "version": 3, "strides": strides}

    @property
    def __array_interface__(self):
        return dict(self.d)


def fake_of(a, shape=None, data=None, strides=None):
    """FakeAI describing NumPy array `a` (keeps it alive), with entries overridden."""
    return FakeAI(a.shape if shape is None else shape, a.__array_interface__["data"][0] if data is None else data,
                  a.__array_interface__["typestr"], strides, keep=a)


class RewritingIndex:
    """An int-like dict entry item: its first `__index__` replaces d[key] with `plain` (a
    fresh tuple of plain ints), which frees the tuple being read, and this object's
    siblings with it."""

    def __init__(self, value):
        self.value = value
        self.d = self.key = self.plain = None

    def __index__(self):
        d, self.d = self.d, None
        if d is not None:
            d[self.key] = self.plain
        return self.value


class DictRewritingAI:
    """`__array_interface__` (or `__cuda_array_interface__` with cai=True) of NumPy array `a`
    whose `key` entry ('shape', 'strides' or 'data') is made of RewritingIndex items."""

    def __init__(self, a, key, cai=False):
        self.a, self.key, self.cai = a, key, cai

    def _dict(self):
        d = dict(self.a.__array_interface__)
        if self.cai:  # a made-up device address: never to be dereferenced on the CPU build
            d = {"shape": d["shape"], "typestr": d["typestr"], "data": (0x10000, False), "version": 2, "strides": None}
        if self.key == "shape":
            plain = tuple(self.a.shape)
            items = tuple(RewritingIndex(v) for v in plain)
        elif self.key == "strides":
            plain = tuple(self.a.strides)
            items = tuple(RewritingIndex(v) for v in plain)
        else:  # data: (pointer, read_only)
            plain = d["data"]
            items = (RewritingIndex(plain[0]), plain[1])
        for it in items:
            if isinstance(it, RewritingIndex):
                it.d, it.key, it.plain = d, self.key, plain
        d[self.key] = items  # held only by d: replaced (and freed) by the first __index__
        return d

    @property
    def __array_interface__(self):
        if self.cai:
            raise AttributeError("__array_interface__")
        return self._dict()

    @property
    def __cuda_array_interface__(self):
        if not self.cai:
            raise AttributeError("__cuda_array_interface__")
        return self._dict()


class RaisingIndex:
    def __index__(self):
        raise RuntimeError("boom from __index__")


class HugeIndex:
    def __index__(self):
        return 2**70


class BadDevice:
    """DLPack of a NumPy array with a malformed `__dlpack_device__`."""

    DEVICES = {
        "index-raises": lambda: (RaisingIndex(), RaisingIndex()),
        "id-index-raises": lambda: (1, RaisingIndex()),
        "index-huge": lambda: (HugeIndex(), 0),
        "str-items": lambda: ("cpu", 0),
        "not-a-tuple": lambda: 5,
        "one-item": lambda: (1,),
        "device-id-2**64": lambda: (2, 2**64),
        "cpu-id-2**64": lambda: (1, 2**64),
        "negative-type": lambda: (-1, 0),
    }

    def __init__(self, a, kind):
        self.a, self.kind = a, kind

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.DEVICES[self.kind]()


# --- list API cases ---------------------------------------------------------------

FUNCS = {
    "b2u": "block_to_universal",
    "u2b": "universal_to_block",
    "b2o": "block_to_operational",
    "o2b": "operational_to_block",
    "u2o": "universal_to_operational",
    "o2u": "operational_to_universal",
}
ARG_NAMES = {"b": "blocks", "u": "universals", "o": "operationals"}
NB, NL, NO, NH, NT, HD = 2, 2, 2, 3, 4, 5


def chunk_shape(nh, nt, hd, layout="NHD"):
    return (nt, nh, hd) if layout.upper() == "NHD" else (nh, nt, hd)


def make_arg(letter, make, nb=NB, nl=NL, no=NO, nh=NH, nt=NT, hd=HD, layout="NHD"):
    if letter == "b":
        return [[make(chunk_shape(nh, nt, hd, layout)) for _ in range(nl * no)] for _ in range(nb)]
    if letter == "u":
        return [make((nh, nl, no, nt, hd)) for _ in range(nb)]
    return [make((nl, no, nt * nh * hd)) for _ in range(nb)]


def list_case(direction, **dims):
    """(sources, destinations) of `direction` as nested lists of NumPy float32 arrays:
    sources random, destinations poisoned."""
    return make_arg(direction[0], rnd, **dims), make_arg(direction[2], poisoned, **dims)


def convert(direction, src, dst, layout="NHD", **kwargs):
    f = getattr(kvbm_ext, FUNCS[direction])
    if direction in ("b2o", "o2b"):
        return f(src, dst, **kwargs)
    return f(src, dst, layout, **kwargs)


def wrap_all(x):
    """The same nested structure (new lists) of AI wrappers."""
    return [wrap_all(v) for v in x] if isinstance(x, list) else AI(x)


def leaves(x):
    for v in x:
        if isinstance(v, list):
            yield from leaves(v)
        else:
            yield v


def first_list(arg):
    """The list holding the first element read: arg[0] for blocks, arg itself otherwise."""
    return arg[0] if isinstance(arg[0], list) else arg


def make_hostile(arg, kind):
    """Installs the hook of `kind` on the first element of `arg` (a nested list of AI).

    clear / shorten / replace: that element's getter clears its list, deletes all but its
    first entry, or replaces every entry with a new array (same shape, junk bytes);
    outer: it clears the outer list of `blocks` (freeing the inner list being walked);
    del / drop: it deletes / replaces itself in its list, which held the only reference
    (the array is referenced only by the wrapper), and every other element's getter
    allocates junk of the same size to take the freed memory."""
    inner = first_list(arg)
    first = inner[0]
    if kind == "clear":
        first.hook = inner.clear
    elif kind == "shorten":
        first.hook = lambda: inner.__delitem__(slice(1, None))
    elif kind == "outer":
        assert inner is not arg
        first.hook = arg.clear
    elif kind == "replace":
        first.hook = lambda: inner.__setitem__(slice(None), [AI(junk_like(w.a)) for w in inner])
    elif kind in ("del", "drop"):
        nbytes, shape, dtype = first.a.nbytes, first.a.shape, first.a.dtype

        def junk():
            JUNK.extend(np.full(nbytes, JUNK_BYTE, np.uint8) for _ in range(3))

        for w in leaves(arg):
            if w is not first:
                w.hook = junk
        if kind == "del":
            first.hook = lambda: inner.__delitem__(0)
        else:
            first.hook = lambda: inner.__setitem__(0, AI(np.full(shape, 0, dtype)))
        del first
    else:
        raise ValueError(kind)


def scn_list_mutation(direction, role, kind):
    """Section 1: `role` ('src' or 'dst') of `direction` is a list of AI wrappers whose first
    element's getter mutates the list (make_hostile)."""
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": wrap_all(src_raw), "dst": wrap_all(dst_raw)}
    make_hostile(args[role], kind)
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def scn_drop_last_ref(direction, kind):
    """Section 2: the sources' arrays are referenced only by their wrappers, the wrappers
    only by the list; the first one's getter deletes (kind 'del') or replaces ('drop')
    itself in the list."""
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    src = wrap_all(src_raw)
    del src_raw
    dst = wrap_all(dst_raw)
    make_hostile(src, kind)
    for w in leaves(dst):  # destinations' getters allocate junk too
        w.hook = lambda: JUNK.extend(np.full(64, JUNK_BYTE, np.uint8) for _ in range(3))
    outcome("X", lambda: convert(direction, src, dst))
    src = None  # noqa: F841 - the wrappers (and their arrays) go now
    JUNK.extend(np.full(4096, JUNK_BYTE, np.uint8) for _ in range(8))
    save("X~dst", dst_raw)


def _replace_first(arg, make):
    inner = first_list(arg)
    inner[0] = make(inner[0])


def scn_dict_rewrite(direction, role, key):
    """Section 3: the first element of `role` is a DictRewritingAI of its array."""
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    _replace_first(args[role], lambda a: DictRewritingAI(a, key))
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def scn_cai_dict_rewrite(direction, role, key):
    """Section 3, __cuda_array_interface__: refused on a CPU build (no crash)."""
    src_raw, dst_raw = list_case(direction)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    _replace_first(args[role], lambda a: DictRewritingAI(a, key, cai=True))
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def _element(arg, index):
    """arg[index] for flat lists, arg[index][2] for blocks; returns (path suffix, list, i)."""
    if isinstance(arg[0], list):
        return f"[{index}][2]", arg[index], 2
    return f"[{index}]", arg, index


def scn_null_data(direction, role, empty):
    """Section 4: element 1 of `role` has data pointer 0 (its shape unchanged)."""
    dims = {"nt": 0} if empty else {}
    src_raw, dst_raw = list_case(direction, **dims)
    save("X~src", src_raw)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    _, lst, i = _element(args[role], 1)
    lst[i] = fake_of(lst[i], data=0)
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def _negate_nt(shape, letter):
    """The shape with its token extent negated (the whole inner extent of an operational)."""
    shape = list(shape)
    shape[{"b": 0, "u": 3, "o": 2}[letter]] *= -1
    return tuple(shape)


def scn_negative_extent(direction, role, consistent):
    """Section 5: element 1 of `role` (or, consistent=True, every array of the call) is
    described with a negative token extent over real memory."""
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    letters = {"src": direction[0], "dst": direction[2]}
    if consistent:
        for r, arg in args.items():
            for j, v in enumerate(arg):
                if isinstance(v, list):
                    arg[j] = [fake_of(a, shape=_negate_nt(a.shape, letters[r])) for a in v]
                else:
                    arg[j] = fake_of(v, shape=_negate_nt(v.shape, letters[r]))
    else:
        _, lst, i = _element(args[role], 1)
        lst[i] = fake_of(lst[i], shape=_negate_nt(lst[i].shape, letters[role]))
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


BIG_AI = {
    # name: (direction, role, what replaces element 1 of role: f(array) -> object)
    "shape-2**64": ("u2b", "src", lambda a: fake_of(a, shape=(2**64,) + a.shape[1:])),
    "shape-2**63": ("u2b", "src", lambda a: fake_of(a, shape=(2**63,) + a.shape[1:])),
    "shape-2**64-dst": ("b2u", "dst", lambda a: fake_of(a, shape=a.shape[:4] + (2**64,))),
    "shape-negative-2**64": ("u2b", "src", lambda a: fake_of(a, shape=(-(2**64),) + a.shape[1:])),
    "data-2**64": ("u2b", "src", lambda a: fake_of(a, data=2**64)),
    "data-2**64-dst": ("b2u", "dst", lambda a: fake_of(a, data=2**64 + a.__array_interface__["data"][0])),
    "data-negative": ("u2b", "src", lambda a: fake_of(a, data=-1)),
    "strides-2**64": ("u2b", "src", lambda a: fake_of(a, strides=(2**64,) + a.strides[1:])),
    "shape-index-2**70": ("u2b", "src", lambda a: fake_of(a, shape=(HugeIndex(),) + a.shape[1:])),
}


def scn_big_ai(name):
    """Section 7: an __array_interface__ with an integer >= 2**64 (or negative) in a size or
    address entry, as element 1 of one argument."""
    direction, role, make = BIG_AI[name]
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    _, lst, i = _element(args[role], 1)
    lst[i] = make(lst[i])
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def scn_product_overflow(direction):
    """Section 7: every extent fits in 32 bits, their product (and byte size) overflows 64:
    nb = nl = no = 1, nh = nt = hd = 2**31, every array a FakeAI over a small real buffer."""
    big = 2**31
    keep = poisoned((64,))
    ptr = keep.__array_interface__["data"][0]

    def fake(shape):
        return FakeAI(shape, ptr, keep=keep)

    src = make_arg(direction[0], fake, nb=1, nl=1, no=1, nh=big, nt=big, hd=big)
    dst = make_arg(direction[2], fake, nb=1, nl=1, no=1, nh=big, nt=big, hd=big)
    outcome("X", lambda: convert(direction, src, dst))
    save("X~keep", keep)


def scn_stream_big(value):
    src, dst = list_case("b2u")
    outcome("X", lambda: convert("b2u", src, dst, stream=value))
    save("X~dst", dst)


def scn_num_ctas_big(value):
    src, dst = list_case("u2b")
    outcome("X", lambda: convert("u2b", src, dst, num_ctas=value))
    save("X~dst", dst)


def scn_bad_device(kind, role):
    """Section 8: element 1 of universals (destination of b2u, or source of u2b) is a
    BadDevice over its NumPy array."""
    direction = "b2u" if role == "dst" else "u2b"
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": list(src_raw), "dst": list(dst_raw)}
    if direction == "u2b":
        args["dst"] = [list(v) for v in dst_raw]
    args[role][1] = BadDevice(args[role][1], kind)
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


def scn_paged_bad_device(kind):
    layers_raw = paged_layers(rnd)
    layers = list(layers_raw)
    layers[1] = BadDevice(layers[1], kind)
    outcome("Pc", lambda: kvbm_ext.PagedKVCache(layers, "kbthd"))


# --- PagedKVCache cases -----------------------------------------------------------

PNL, PNB = 2, 5
PIDS = [3, 0]
PDIMS = "kbthd"


def paged_layers(make):
    return [make((NO, PNB, NT, NH, HD)) for _ in range(PNL)]


def paged_others(method, make, nb=len(PIDS)):
    shape = (NH, PNL, NO, NT, HD) if "universal" in method else (PNL, NO, NT * NH * HD)
    return [make(shape) for _ in range(nb)]


def paged_call(cache, method, ids, other, **kwargs):
    if method.startswith("to_"):
        return getattr(cache, method)(ids, other, **kwargs)
    return getattr(cache, method)(other, ids, **kwargs)


def scn_paged(method, kind, hostility="list"):
    """Sections 1-3 and 5 for PagedKVCache. method 'construct': the per-layer list is
    hostile (then the cache, if built, moves blocks to universal); else the flat-block list
    of that method is. hostility 'list': make_hostile(kind); 'dict': DictRewritingAI
    (kind = key); 'null' / 'negative': element 1 described with data 0 / a negative
    block (or token) extent."""
    call = "to_universal" if method == "construct" else method
    to = call.startswith("to_")
    layers_raw = paged_layers(rnd if to else poisoned)
    other_raw = paged_others(call, poisoned if to else rnd)
    save("P~layers0", layers_raw)
    save("P~other0", other_raw)
    dropping = kind in ("del", "drop")
    if method == "construct":
        if hostility == "list":
            arg = wrap_all(layers_raw)
            if dropping:
                layers_raw = None  # the arrays now live only in their wrappers
            make_hostile(arg, kind)
        else:
            arg = hostile_element(list(layers_raw), hostility, kind, letter="layer")
        cache = outcome("Pc", lambda: kvbm_ext.PagedKVCache(arg, PDIMS))
        del arg
        JUNK.extend(np.full(4096, JUNK_BYTE, np.uint8) for _ in range(8))
        if isinstance(cache, kvbm_ext.PagedKVCache):
            outcome("P", lambda: cache.to_universal(PIDS, other_raw))
    else:
        cache = kvbm_ext.PagedKVCache(layers_raw, PDIMS)
        if hostility == "list":
            arg = wrap_all(other_raw)
            if dropping and not to:
                other_raw = None
            make_hostile(arg, kind)
        else:
            arg = hostile_element(list(other_raw), hostility, kind, letter="u" if "universal" in call else "o")
        outcome("P", lambda: paged_call(cache, call, PIDS, arg))
        del arg
    if layers_raw is not None:
        save("P~layers", layers_raw)
    if other_raw is not None:
        save("P~other", other_raw)


def hostile_element(lst, hostility, kind, letter):
    """lst with element 0 ('dict') or 1 ('null', 'negative') made hostile."""
    if hostility == "dict":
        lst[0] = DictRewritingAI(lst[0], kind)
    elif hostility == "null":
        lst[1] = fake_of(lst[1], data=0)
    elif hostility == "negative":
        a = lst[1]
        shape = list(a.shape)
        shape[{"layer": 1, "u": 3, "o": 2}[letter]] *= -1  # layer: the block extent
        lst[1] = fake_of(a, shape=tuple(shape))
    else:
        raise ValueError(hostility)
    return lst


PAGED_OPTIONS = {
    # name: (kwargs of to_universal, extra universal layers/heads)
    "layers=range(0,2**64,2**62)": {"layers": range(0, 2**64, 2**62)},
    "layers=range(2**64,2**64+2)": {"layers": range(2**64, 2**64 + 2)},
    "layers=range(-2**64,0)": {"layers": range(-(2**64), 0)},
    "layers=slice(0,2**64,2**62)": {"layers": slice(0, 2**64, 2**62)},  # Python: layer 0 only
    "layers=slice(-2**64,2**64)": {"layers": slice(-(2**64), 2**64)},  # Python: every layer
    "head_offset=2**70": {"head_offset": 2**70},
    "head_offset=2**64": {"head_offset": 2**64},
    "head_offset=-2**70": {"head_offset": -(2**70)},
    "layer_offset=2**70": {"layer_offset": 2**70},
    "layer_offset=2**64-1": {"layer_offset": 2**64 - 1},
    "num_ctas=2**70": {"num_ctas": 2**70},
    "stream=2**64": {"stream": 2**64},
    "block_id=2**64": {"ids": [3, 2**64]},
    "block_id=-2**64": {"ids": [-(2**64), 0]},
}


def scn_paged_option(name):
    """Section 7 for PagedKVCache.to_universal: huge or negative options."""
    kwargs = dict(PAGED_OPTIONS[name])
    ids = kwargs.pop("ids", PIDS)
    layers_raw = paged_layers(rnd)
    other_raw = paged_others("to_universal", poisoned)
    save("P~layers0", layers_raw)
    save("P~other0", other_raw)
    cache = kvbm_ext.PagedKVCache(layers_raw, PDIMS)
    outcome("P", lambda: cache.to_universal(ids, other_raw, **kwargs))
    save("P~layers", layers_raw)
    save("P~other", other_raw)


HUGE_EMPTY = {
    # name: a function making the call (honest empty NumPy arrays with huge extents)
    "u2b-2**60-no-chunks": lambda: kvbm_ext.universal_to_block(np.empty((1, 2**60 - 1, 1, 1, 0), np.float32), [[]]),
    "u2b-2**60-one-chunk": lambda: kvbm_ext.universal_to_block(
        np.empty((1, 2**60 - 1, 1, 1, 0), np.float32), [[np.empty((1, 1, 0), np.float32)]]),
    "u2b-2**60-list-of-2": lambda: kvbm_ext.universal_to_block(
        [np.empty((1, 2**60 - 1, 1, 1, 0), np.float32)] * 2, [[], []]),
    "b2u-2**60": lambda: kvbm_ext.block_to_universal([[np.empty((1, 1, 0), np.float32)]],
                                                     [np.empty((1, 2**60 - 1, 1, 1, 0), np.float32)]),
    "u2o-2**60": lambda: kvbm_ext.universal_to_operational(np.empty((1, 2**60 - 1, 1, 1, 0), np.float32),
                                                          np.empty((2**60 - 1, 1, 0), np.float32)),
    "o2u-2**60": lambda: kvbm_ext.operational_to_universal(np.empty((2**60 - 1, 1, 0), np.float32),
                                                          np.empty((1, 2**60 - 1, 1, 1, 0), np.float32)),
    "u2o-2**40": lambda: kvbm_ext.universal_to_operational(np.empty((1, 2**40, 1, 1, 0), np.float32),
                                                          np.empty((2**40, 1, 0), np.float32)),
    "o2u-2**40": lambda: kvbm_ext.operational_to_universal(np.empty((2**40, 1, 0), np.float32),
                                                          np.empty((1, 2**40, 1, 1, 0), np.float32)),
    "u2b-2**40": lambda: kvbm_ext.universal_to_block(np.empty((1, 2**40, 1, 1, 0), np.float32), [[]]),
    "b2o-2**40-nb": lambda: kvbm_ext.block_to_operational(
        [[np.empty((1, 1, 0), np.float32)]], np.empty((2**40, 1, 1, 0), np.float32)),
}

MUST_SUCCEED = {"u2o-2**40", "o2u-2**40"}


def scn_huge_empty(name):
    outcome("X", HUGE_EMPTY[name])


def scn_paged_huge_empty(n):
    """An empty all-layer array [n, 1, 1, 1, 0] ("lbthd"), then one block to universal."""
    layers = np.empty((n, 1, 1, 1, 0), np.uint8)
    cache = outcome("Pc", lambda: kvbm_ext.PagedKVCache(layers, "lbthd"))
    if isinstance(cache, kvbm_ext.PagedKVCache):
        outcome("P", lambda: cache.to_universal([0], np.empty((1, 1, n, 1, 1, 0), np.uint8)))
        outcome("P-from", lambda: cache.from_universal(np.empty((1, 1, n, 1, 1, 0), np.uint8), [0]))


def scn_stack_dict_rewrite(direction, role, key):
    """Section 3, one stacked array: the universals (or operationals) side of `direction`
    given as ONE [nb, ...] array whose interface dict's `key` entry rewrites itself while
    read."""
    src_raw, dst_raw = list_case(direction)
    save("X~src", src_raw)
    args = {"src": [list(v) if isinstance(v, list) else v for v in src_raw],
            "dst": [list(v) if isinstance(v, list) else v for v in dst_raw]}
    stack = np.stack(args[role])
    if role == "dst":
        dst_raw = list(stack)  # the call writes the stack: its blocks are the destinations
    args[role] = DictRewritingAI(stack, key)
    outcome("X", lambda: convert(direction, args["src"], args["dst"]))
    save("X~dst", dst_raw)


class ListClearingIndex:
    """An address whose __index__ empties the caller's address lists and allocates junk
    of their size (to reuse what a reader holding borrowed items would still read)."""

    def __init__(self, value, lists):
        self.value, self.lists = value, lists

    def __index__(self):
        lists, self.lists = self.lists, None
        for lst in lists or ():
            lst[:] = [object() for _ in lst]
            lst.clear()
        JUNK.extend(np.full(64, JUNK_BYTE, np.uint8) for _ in range(8))
        return self.value


def scn_address_list_mutation(fn):
    """Section 1, raw copies: an entry of dst_ptrs empties both address lists when its
    __index__ runs (np.int64 entries around it)."""
    a = rnd((64,), np.uint8)
    b = poisoned((64,), np.uint8)
    src = [np.int64(a.ctypes.data + 16 * i) for i in range(4)]
    dst = [np.uint64(b.ctypes.data + 16 * i) for i in range(4)]
    dst[1] = ListClearingIndex(b.ctypes.data + 16, [src, dst])
    outcome("X", lambda: getattr(kvbm_ext, fn)(src, dst, np.int64(8)))
    save("X~dst", b)


def scn_thread_mutation(seconds):
    """Section 11: a thread pops and re-inserts entries of blocks, blocks[k] and universals
    while the main thread calls block_to_universal in a loop. Every array is an AI wrapper,
    so the call runs Python code (the getters) at every element and the thread gets the
    GIL in the middle of the walk. The thread alternates popping one entry and inserting
    it back where it was, and popping the second half of a list and appending it back
    (which shrinks and regrows the list's item array)."""
    sys.setswitchinterval(1e-6)
    nb, nl, no = 8, 4, 2
    blocks_raw, unis_raw = list_case("b2u", nb=nb, nl=nl, no=no)
    # numpy reference (checked against the torch reference by the parent)
    want = [np.stack([np.stack(chunks[l * no:(l + 1) * no]) for l in range(nl)]).transpose(3, 0, 1, 2, 4)
            for chunks in blocks_raw]
    save("T~src", blocks_raw)
    save("T~want", want)
    blocks = [[AI(c) for c in chunks] for chunks in blocks_raw]
    universals = [AI(u) for u in unis_raw]
    stop = threading.Event()

    def mutate():
        lists = [blocks, universals] + blocks
        k = 0
        while not stop.is_set():
            lst = lists[k % len(lists)]
            if k % 2:
                i = (k // 2) % len(lst)
                x = lst.pop(i)
                lst.insert(i, x)
            else:
                half = len(lst) // 2
                tail = [lst.pop() for _ in range(len(lst) - half)]
                lst.extend(reversed(tail))
            k += 1

    t = threading.Thread(target=mutate)
    t.start()
    counts = {"ok": 0, "wrong": 0, "written_on_error": 0}
    kinds = set()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for u in unis_raw:
                u.reshape(-1).view(np.uint8)[:] = POISON
            try:
                kvbm_ext.block_to_universal(blocks, universals, "NHD")
            except Exception as e:  # noqa: BLE001
                kinds.add(f"{type(e).__name__}: {' '.join(str(e).split())[:80]}")
                if any((u.reshape(-1).view(np.uint8) != POISON).any() for u in unis_raw):
                    counts["written_on_error"] += 1
                continue
            counts["ok"] += 1
            if not all(np.array_equal(u.view(np.uint32), w.view(np.uint32)) for u, w in zip(unis_raw, want)):
                counts["wrong"] += 1
    finally:
        stop.set()
        t.join()
    print(f"THREAD {counts}", flush=True)
    for k in sorted(kinds):
        print(f"THREADERR {k}", flush=True)


# ==========================================================================
# PARENT SIDE. The child executes this file only up to the line above (no pytest, no
# torch: it starts in a fifth of the time); everything below runs under pytest.
# ==========================================================================

import pytest  # noqa: E402
import torch  # noqa: E402

from support.asserts import (  # noqa: E402
    assert_all_bitwise_equal,
    assert_poisoned,
    expect_rejected,
    path_regex,
    poison_,
)
from support.builders import clone_all, random_tensor  # noqa: E402
from support.references import (  # noqa: E402
    cache_rows,
    expected_blocks,
    expected_op,
    expected_universals,
    paged_reference,
    per_block,
)

PARENT_MARKER = "# PARENT " + "SIDE. The child executes this file only up to the line above"

CLEAN = ("ValueError", "TypeError")
ANY_ARG = r"(blocks|universals|operationals)(\[\d+\])*"


class Child:
    def __init__(self, out, outcomes, saved):
        self.out, self.outcomes, self.saved = out, outcomes, saved

    def tree(self, key):
        """A saved array or nested list."""
        if key in self.saved:
            return self.saved[key]
        if key + ".len" not in self.saved:
            return None
        return [self.tree(f"{key}.{i}") for i in range(int(self.saved[key + ".len"]))]

    def outcome(self, label):
        assert label in self.outcomes, f"no outcome for {label!r}:\n{self.out[-3000:]}"
        return self.outcomes[label]


def run_child(tmp_path, scenario, timeout=10, malloc_debug=True, **kwargs):
    """Runs scn_<scenario>(**kwargs) in a fresh interpreter (PYTHONMALLOC=debug, faulthandler):
    fails the test, naming the scenario and the running call, if it does not exit 0."""
    __tracebackhide__ = True
    env = dict(os.environ, KVBM_HOSTILE_OUT=str(tmp_path), PYTHONFAULTHANDLER="1")
    if malloc_debug:
        env["PYTHONMALLOC"] = "debug"
    code = (f"path = {__file__!r}; src = open(path).read().split({PARENT_MARKER!r})[0]; "
            f"ns = {{'__name__': 'hostile_child', '__file__': path}}; exec(compile(src, path, 'exec'), ns); "
            f"ns['child_main']({scenario!r}, {kwargs!r})")
    what = f"scenario {scenario}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{what} hung: no exit within {timeout} s\n{out[-3000:]}")
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        calls = [line[5:] for line in proc.stdout.splitlines() if line.startswith("CALL ")]
        during = f"during call {calls[-1]!r}" if calls else "before any call"
        rc = proc.returncode
        sig = f" ({signal.Signals(-rc).name})" if rc < 0 and -rc in signal.Signals._value2member_map_ else ""
        pytest.fail(f"{what} CRASHED {during}: exit status {rc}{sig}\n--- output ---\n{out[-5000:]}")
    assert "DONE" in proc.stdout, f"{what} did not finish:\n{out[-3000:]}"
    outcomes = {}
    for line in proc.stdout.splitlines():
        if line.startswith("OUTCOME "):
            label, kind, msg = line[len("OUTCOME "):].split("|", 2)
            outcomes[label] = (kind, msg)
    path = tmp_path / "saved.npz"
    saved = {}
    if path.exists():
        with np.load(path) as z:
            saved = {k: z[k] for k in z.files}
    return Child(out, outcomes, saved)


def assert_clean_error(kind, msg, allowed, path, label="call"):
    """The exception is one of `allowed` (names) and its message starts with `path` (regex)."""
    assert kind != "ok", f"{label}: expected {' or '.join(allowed)} naming {path!r}, but the call succeeded"
    assert kind in allowed, f"{label}: expected {' or '.join(allowed)}, got {kind}: {msg}"
    assert re.match(path_regex(path), msg), f"{label}: {kind} message does not start with {path!r}: {msg!r}"


def expected_list(direction, src, dst, layout="NHD"):
    if direction == "b2u":
        return expected_universals(src, dst[0].shape[2], layout)
    if direction == "u2b":
        return expected_blocks(src, layout)
    return expected_op(direction, src, dst, layout)


def check_list(child, direction, allowed=CLEAN, path=ANY_ARG, must_fail=False, label="X"):
    """Success: the destinations hold the reference result of the saved sources (the
    arrays as they were at the call). Failure: a clean exception naming an argument and
    every destination byte still poisoned."""
    kind, msg = child.outcome(label)
    dst = child.tree(f"{label}~dst")
    if kind == "ok" and not must_fail:
        src = child.tree(f"{label}~src")
        assert_all_bitwise_equal(dst, expected_list(direction, src, dst), f"{direction} destinations")
        return
    assert_clean_error(kind, msg, allowed, path, direction)
    assert_poisoned(dst, f"{direction} destinations after {kind}")


def paged_expected(method, layers0, other0, ids, sel=None, inner="NHD"):
    """Destination memory after `method` by the torch reference on copies of the saved arrays."""
    layers = [torch.from_numpy(np.array(x)) for x in layers0]
    others = [torch.from_numpy(np.array(x)) for x in other0]
    rows = cache_rows(layers, PDIMS)
    sel = list(range(len(layers))) if sel is None else sel
    paged_reference(method, rows, per_block(others), list(ids), sel, inner=inner)
    return layers if method.startswith("from_") else others


def check_paged(child, method, allowed=CLEAN, path=r"(universals|operationals|layers)(\[\d+\])*",
                ids=PIDS, sel=None, label="P"):
    kind, msg = child.outcome(label)
    dst_key = "P~layers" if method.startswith("from_") else "P~other"
    got = child.tree(dst_key)
    if kind == "ok":
        want = paged_expected(method, child.tree("P~layers0"), child.tree("P~other0"), ids, sel)
        assert_all_bitwise_equal(got, want, f"{method} destination")
        return
    assert_clean_error(kind, msg, allowed, path, method)
    if got is not None:
        assert_poisoned(got, f"{method} destination after {kind}")


# ==========================================================================
# 1. List mutation by an element's __array_interface__ getter.
# ==========================================================================

LIST_DIRECTIONS = list(FUNCS)


def _mutation_cases():
    for d in LIST_DIRECTIONS:
        for role in ("src", "dst"):
            letter = d[0] if role == "src" else d[2]
            kinds = ["clear", "replace"] + (["outer"] if letter == "b" else [])
            if d in ("b2u", "u2b"):
                kinds.append("shorten")
            for kind in kinds:
                yield pytest.param(d, role, kind, id=f"{d}-{role}-{kind}")


@pytest.mark.parametrize("direction,role,kind", list(_mutation_cases()))
def test_list_mutated_by_getter(direction, role, kind, tmp_path):
    child = run_child(tmp_path, "list_mutation", direction=direction, role=role, kind=kind)
    check_list(child, direction)


PAGED_METHODS = ["construct", "to_universal", "from_universal", "to_operational", "from_operational"]


@pytest.mark.parametrize("kind", ["clear", "shorten", "replace"])
@pytest.mark.parametrize("method", PAGED_METHODS)
def test_paged_list_mutated_by_getter(method, kind, tmp_path):
    child = run_child(tmp_path, "paged", method=method, kind=kind)
    check_paged_scenario(child, method)


def check_paged_scenario(child, method):
    if method == "construct":
        kind, msg = child.outcome("Pc")
        if kind != "ok":
            assert_clean_error(kind, msg, CLEAN, r"layers(\[\d+\])*", "PagedKVCache")
            return
        check_paged(child, "to_universal")  # the cache holds the layers as they were
    else:
        check_paged(child, method)


# ==========================================================================
# 2. A getter that drops the last reference to the item being read.
# ==========================================================================


@pytest.mark.parametrize("kind", ["del", "drop"])
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_getter_drops_last_reference(direction, kind, tmp_path):
    child = run_child(tmp_path, "drop_last_ref", direction=direction, kind=kind)
    check_list(child, direction)


@pytest.mark.parametrize("kind", ["del", "drop"])
@pytest.mark.parametrize("method", ["construct", "from_universal", "from_operational"])
def test_paged_getter_drops_last_reference(method, kind, tmp_path):
    child = run_child(tmp_path, "paged", method=method, kind=kind)
    check_paged_scenario(child, method)


# ==========================================================================
# 3. __index__ of shape / strides / data entries rewriting the dict being read.
# ==========================================================================


@pytest.mark.parametrize("key", ["shape", "strides", "data"])
@pytest.mark.parametrize("direction,role", [("b2u", "src"), ("b2u", "dst"), ("u2b", "src"), ("u2o", "dst"),
                                            ("o2b", "src")])
def test_index_rewrites_interface_dict(direction, role, key, tmp_path):
    child = run_child(tmp_path, "dict_rewrite", direction=direction, role=role, key=key)
    check_list(child, direction)


@pytest.mark.parametrize("key", ["shape", "strides"])
@pytest.mark.parametrize("method", ["construct", "to_universal", "from_universal"])
def test_paged_index_rewrites_interface_dict(method, key, tmp_path):
    child = run_child(tmp_path, "paged", method=method, kind=key, hostility="dict")
    check_paged_scenario(child, method)


@pytest.mark.parametrize("key", ["shape", "strides"])
def test_index_rewrites_cuda_array_interface_dict(key, tmp_path):
    """A device-array description on the CPU build: refused (RuntimeError: no CUDA, or a
    ValueError / TypeError naming it), never a crash."""
    child = run_child(tmp_path, "cai_dict_rewrite", direction="u2b", role="src", key=key)
    kind, msg = child.outcome("X")
    assert kind in ("RuntimeError",) + CLEAN, f"{kind}: {msg}"
    if kind in CLEAN:
        assert re.match(path_regex(r"universals(\[0\])?"), msg), msg
    assert_poisoned(child.tree("X~dst"), "blocks")


# ==========================================================================
# 4. NULL data pointer.
# ==========================================================================

NULL_CASES = [("b2u", "src"), ("b2u", "dst"), ("u2b", "src"), ("u2b", "dst"), ("u2o", "dst"), ("o2b", "src"),
              ("o2u", "src"), ("b2o", "dst")]


def _element_path(direction, role):
    letter = direction[0] if role == "src" else direction[2]
    return ARG_NAMES[letter] + (r"\[1\]\[2\]" if letter == "b" else r"\[1\]")


@pytest.mark.parametrize("direction,role", NULL_CASES, ids=[f"{d}-{r}" for d, r in NULL_CASES])
def test_null_data_pointer_non_empty(direction, role, tmp_path):
    child = run_child(tmp_path, "null_data", direction=direction, role=role, empty=False)
    check_list(child, direction, allowed=("ValueError",), path=_element_path(direction, role), must_fail=True)


@pytest.mark.parametrize("direction,role", NULL_CASES, ids=[f"{d}-{r}" for d, r in NULL_CASES])
def test_null_data_pointer_zero_size_is_a_no_op(direction, role, tmp_path):
    child = run_child(tmp_path, "null_data", direction=direction, role=role, empty=True)
    kind, msg = child.outcome("X")
    assert kind == "ok", f"a zero-byte call with a NULL zero-size array must succeed, got {kind}: {msg}"


def check_paged_array_rejected(method, hostility, tmp_path):
    """The second layer (construct) or flat block (a call) is a lying array: a ValueError
    naming it, nothing written."""
    child = run_child(tmp_path, "paged", method=method, kind=None, hostility=hostility)
    if method == "construct":
        assert_clean_error(*child.outcome("Pc"), ("ValueError",), r"layers\[1\]", "PagedKVCache")
    else:
        name = "universals" if "universal" in method else "operationals"
        check_paged(child, method, allowed=("ValueError",), path=rf"{name}\[1\]")
        assert child.outcome("P")[0] != "ok"


@pytest.mark.parametrize("method", ["construct", "to_universal", "from_universal", "to_operational"])
def test_paged_null_data_pointer(method, tmp_path):
    check_paged_array_rejected(method, "null", tmp_path)


# ==========================================================================
# 5. Negative extents.
# ==========================================================================


@pytest.mark.parametrize("direction,role", NULL_CASES, ids=[f"{d}-{r}" for d, r in NULL_CASES])
def test_negative_extent(direction, role, tmp_path):
    child = run_child(tmp_path, "negative_extent", direction=direction, role=role, consistent=False)
    check_list(child, direction, allowed=("ValueError",), path=_element_path(direction, role), must_fail=True)


@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_negative_extent_consistent_across_the_call(direction, tmp_path):
    """Every array agrees on the negative extent: no shape mismatch to catch it."""
    child = run_child(tmp_path, "negative_extent", direction=direction, role="src", consistent=True)
    check_list(child, direction, allowed=("ValueError",), must_fail=True)


@pytest.mark.parametrize("method", ["construct", "to_universal", "from_operational"])
def test_paged_negative_extent(method, tmp_path):
    check_paged_array_rejected(method, "negative", tmp_path)


# ==========================================================================
# 6. Name arguments: NUL, non-ASCII, lone surrogates (in-process).
# ==========================================================================

BAD_NAMES = {
    "NUL-inside": "{}\x00HND",
    "NUL-after": "{}\x00",
    "NUL-before": "\x00{}",
    "non-ascii": "{}\u00e9",
    "surrogate": "{}\ud800",
    "fullwidth": "\uff2e\uff28\uff24",  # 'ＮＨＤ'
}


def assert_value_error_naming(info, name):
    e = info.value
    assert not isinstance(e, UnicodeError), f"{name}: bare {type(e).__name__}: {e}"
    assert re.match(path_regex(name), str(e)), f"{type(e).__name__} does not name {name!r}: {e}"


def _expect_name_rejected(invoke, src, dst, name):
    """ValueError (not a UnicodeError) naming `name`, destinations still poisoned, sources unchanged."""
    def checked():
        try:
            invoke()
        except ValueError as e:
            assert not isinstance(e, UnicodeError), f"{name}: bare {type(e).__name__}: {e}"
            raise
    expect_rejected(checked, src, dst, ValueError, name, ())


def _torch_case(gen, layout="NHD"):
    blocks = [[random_tensor(chunk_shape(NH, NT, HD, layout), torch.float32, generator=gen)
               for _ in range(NL * NO)] for _ in range(NB)]
    universals = [random_tensor((NH, NL, NO, NT, HD), torch.float32, generator=gen) for _ in range(NB)]
    operationals = [random_tensor((NL, NO, NT * NH * HD), torch.float32, generator=gen) for _ in range(NB)]
    return {"b": blocks, "u": universals, "o": operationals}


@pytest.mark.parametrize("bad", list(BAD_NAMES))
@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2u"])
def test_layout_name_rejected(direction, bad, gen):
    arrays = _torch_case(gen)
    value = BAD_NAMES[bad].format("NHD")
    src, dst = arrays[direction[0]], arrays[direction[2]]
    f = getattr(kvbm_ext, FUNCS[direction])
    _expect_name_rejected(lambda: f(src, dst, value), src, dst, "layout")


@pytest.mark.parametrize("bad", list(BAD_NAMES))
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_backend_name_rejected(direction, bad, gen):
    arrays = _torch_case(gen)
    value = BAD_NAMES[bad].format("kernel") if bad != "fullwidth" else "\uff4b\uff45\uff52\uff4e\uff45\uff4c"
    src, dst = arrays[direction[0]], arrays[direction[2]]
    f = getattr(kvbm_ext, FUNCS[direction])
    _expect_name_rejected(lambda: f(src, dst, backend=value), src, dst, "backend")


def test_backend_name_rejected_even_with_zero_blocks():
    for direction in LIST_DIRECTIONS:
        with pytest.raises(ValueError) as info:
            getattr(kvbm_ext, FUNCS[direction])([], [], backend="kernel\x00x")
        assert_value_error_naming(info, "backend")


DIMS_CASES = [
    ("btd\x00", (5, 4, 1, 3)),  # 4-D arrays: the NUL must not be dropped or ignored
    ("bt\x00d", (5, 4, 1, 3)),
    ("bt\u00e9d", (5, 4, 1, 3)),
    ("bt\ud800d", (5, 4, 1, 3)),
    ("kbthd\x00", (2, 5, 4, 3, 3)),  # a valid prefix of the right length, then a NUL
    ("kbth\x00d", (2, 5, 4, 3, 3)),
    ("kbth\u0111", (2, 5, 4, 3, 3)),  # 'đ'
    ("\uff4b\uff42\uff54\uff48\uff44", (2, 5, 4, 3, 3)),  # fullwidth 'ｋｂｔｈｄ'
]


@pytest.mark.parametrize("dims,shape", DIMS_CASES, ids=[ascii(d) for d, _ in DIMS_CASES])
def test_dims_name_rejected(dims, shape, gen):
    layers = [random_tensor(shape, torch.float32, generator=gen) for _ in range(2)]
    with pytest.raises(ValueError) as info:
        kvbm_ext.PagedKVCache(layers, dims)
    assert_value_error_naming(info, "layout")


@pytest.mark.parametrize("dims", ["lbtd\x00", "lbt\u00e9d", "lbt\udfffd"], ids=ascii)
def test_dims_name_rejected_single_array(dims, gen):
    layers = random_tensor((2, 5, 4, 1, 3), torch.float32, generator=gen)
    with pytest.raises(ValueError) as info:
        kvbm_ext.PagedKVCache(layers, dims)
    assert_value_error_naming(info, "layout")


@pytest.mark.parametrize("bad", list(BAD_NAMES))
@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_inner_name_rejected(method, bad, gen):
    layers = [random_tensor((NO, 5, NT, NH, HD), torch.float32, generator=gen) for _ in range(NL)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    ops = [random_tensor((NL, NO, NT * NH * HD), torch.float32, generator=gen) for _ in range(2)]
    value = BAD_NAMES[bad].format("NHD")
    if method == "to_operational":
        _expect_name_rejected(lambda: cache.to_operational([3, 0], ops, inner=value), layers, ops, "inner")
    else:
        _expect_name_rejected(lambda: cache.from_operational(ops, [3, 0], inner=value), ops, layers, "inner")


@pytest.mark.parametrize("value", ["fallback_only\x00", "fallback_only\x00x", "fallback_onl\u00ff", "\ud800"],
                         ids=ascii)
def test_mode_name_rejected(value):
    with pytest.raises(ValueError) as info:
        kvbm_ext.memcpy_batch([], [], 0, mode=value)
    assert_value_error_naming(info, "mode")


# ==========================================================================
# 7. Integers >= 2**64 or negative where sizes, addresses and offsets are taken.
# ==========================================================================


@pytest.mark.parametrize("name", list(BIG_AI))
def test_big_or_negative_integer_in_array_interface(name, tmp_path):
    direction, role, _ = BIG_AI[name]
    child = run_child(tmp_path, "big_ai", name=name)
    check_list(child, direction, allowed=CLEAN, path=_element_path(direction, role), must_fail=True)


@pytest.mark.parametrize("direction", ["b2u", "u2b", "u2o", "o2b"])
def test_product_of_extents_overflows(direction, tmp_path):
    child = run_child(tmp_path, "product_overflow", direction=direction)
    assert_clean_error(*child.outcome("X"), ("ValueError",), ANY_ARG, direction)
    assert_poisoned(child.tree("X~keep"), "the memory behind every array")


@pytest.mark.parametrize("value", [2**64, 2**70, -1, -(2**64)], ids=["2**64", "2**70", "-1", "-2**64"])
def test_stream_out_of_range(value, tmp_path):
    child = run_child(tmp_path, "stream_big", value=value)
    check_list(child, "b2u", path="stream", must_fail=True)


@pytest.mark.parametrize("value", [2**70, 2**64, 2**32], ids=["2**70", "2**64", "2**32"])
def test_num_ctas_out_of_range(value, tmp_path):
    child = run_child(tmp_path, "num_ctas_big", value=value)
    check_list(child, "u2b", allowed=("ValueError",), path="num_ctas", must_fail=True)


@pytest.mark.parametrize("name", list(PAGED_OPTIONS))
def test_paged_option_out_of_range(name, tmp_path):
    child = run_child(tmp_path, "paged_option", name=name)
    opt = PAGED_OPTIONS[name]
    key = next(iter(opt))
    if key == "layers" and isinstance(opt[key], slice):  # Python semantics: a valid selection
        sel = list(range(PNL)[opt[key]])
        check_paged(child, "to_universal", path="layers", sel=sel)
        return
    path = {"ids": r"block_ids\[\d\]"}.get(key, key)
    check_paged(child, "to_universal", path=path, ids=opt.get("ids", PIDS))
    assert child.outcome("P")[0] != "ok", f"{name} was accepted"


# ==========================================================================
# 8. __dlpack_device__ returning malformed devices.
# ==========================================================================


@pytest.mark.parametrize("role", ["dst", "src"])
@pytest.mark.parametrize("kind", list(BadDevice.DEVICES))
def test_malformed_dlpack_device(kind, role, tmp_path):
    child = run_child(tmp_path, "bad_device", kind=kind, role=role)
    kind_, msg = child.outcome("X")
    direction = "b2u" if role == "dst" else "u2b"
    if kind == "cpu-id-2**64" and kind_ == "ok":  # a CPU device id may be ignored...
        check_list(child, direction)  # ...then the result must be right
        return
    check_list(child, direction, path=r"universals\[1\]", must_fail=True)


@pytest.mark.parametrize("kind", ["index-raises", "str-items", "device-id-2**64"])
def test_paged_malformed_dlpack_device(kind, tmp_path):
    child = run_child(tmp_path, "paged_bad_device", kind=kind)
    assert_clean_error(*child.outcome("Pc"), CLEAN, r"layers\[1\]", "PagedKVCache")


# ==========================================================================
# 9. Honest empty arrays with huge extents.
# ==========================================================================


@pytest.mark.parametrize("name", list(HUGE_EMPTY))
def test_huge_empty_arrays(name, tmp_path):
    child = run_child(tmp_path, "huge_empty", name=name)
    kind, msg = child.outcome("X")
    if name in MUST_SUCCEED:
        assert kind == "ok", f"{name}: a zero-byte call must do nothing and succeed, got {kind}: {msg}"
    elif kind != "ok":
        assert_clean_error(kind, msg, ("ValueError",), ANY_ARG, name)


@pytest.mark.parametrize("n", [2**61, 2**40], ids=["2**61", "2**40"])
def test_paged_huge_empty_all_layer_array(n, tmp_path):
    child = run_child(tmp_path, "paged_huge_empty", n=n)
    kind, msg = child.outcome("Pc")
    if kind != "ok":
        assert_clean_error(kind, msg, ("ValueError",), "layers", "PagedKVCache")
        return
    for label in ("P", "P-from"):
        kind, msg = child.outcome(label)
        if kind != "ok":
            assert_clean_error(kind, msg, ("ValueError",), r"universals(\[0\])?", label)


# ==========================================================================
# 10. Overlapping sources and destinations (in-process).
# ==========================================================================


class Arena:
    """One random byte buffer (torch or NumPy) handing out float32 views at byte offsets."""

    def __init__(self, nbytes, kind, gen):
        self.t = random_tensor((nbytes,), torch.uint8, generator=gen)
        self.kind = kind

    def view(self, offset, shape):
        n = 4
        for s in shape:
            n *= s
        assert offset % 4 == 0 and offset + n <= self.t.numel()
        v = self.t[offset:offset + n].view(torch.float32).view(shape)
        return v.numpy() if self.kind == "numpy" else v


def _shapes(letter, layout="NHD"):
    return make_arg(letter, lambda s: tuple(s), layout=layout)


def _nbytes(shape):
    n = 4
    for s in shape:
        n *= s
    return n


def _get(struct, path):
    for i in path:
        struct = struct[i]
    return struct


def _set(struct, path, value):
    for i in path[:-1]:
        struct = struct[i]
    struct[path[-1]] = value


def _build_in_arena(direction, kind, gen, pair=None, shift=4):
    """Sources and destinations of `direction`, all views of ONE arena, laid out end to end
    (touching). pair = ((role, path), (role, path)): the second array is placed `shift`
    bytes after the start of the first (overlapping it), at the end of the arena."""
    shapes = {"src": _shapes(direction[0]), "dst": _shapes(direction[2])}
    flat = []

    def walk(role, x, path):
        for i, v in enumerate(x):
            if isinstance(v, list):
                walk(role, v, path + (i,))
            else:
                flat.append((role, path + (i,)))

    walk("src", shapes["src"], ())
    walk("dst", shapes["dst"], ())
    special = list(pair) if pair else []
    order = [k for k in flat if k not in special] + special
    offsets, at = {}, 0
    for k in order:
        if pair and k == special[1]:
            offsets[k] = offsets[special[0]] + shift
        else:
            offsets[k] = at
        at = max(at, offsets[k] + _nbytes(_get(shapes[k[0]], k[1])))
    arena = Arena(at, kind, gen)
    out = {"src": _shapes(direction[0]), "dst": _shapes(direction[2])}
    for (role, path), off in offsets.items():
        _set(out[role], path, arena.view(off, _get(shapes[role], path)))
    return arena, out["src"], out["dst"]


def _path_name(role, path, direction):
    letter = direction[0] if role == "src" else direction[2]
    return ARG_NAMES[letter] + "".join(f"[{i}]" for i in path)


OVERLAPS = {
    # name: (direction, (role, path) of the first array, (role, path) of the one overlapping it)
    "b2u-src-dst": ("b2u", ("src", (0, 1)), ("dst", (1,))),
    "b2u-dst-dst": ("b2u", ("dst", (0,)), ("dst", (1,))),
    "u2b-src-dst": ("u2b", ("src", (1,)), ("dst", (1, 2))),
    "u2b-dst-dst": ("u2b", ("dst", (0, 0)), ("dst", (1, 3))),
    "u2o-src-dst": ("u2o", ("src", (0,)), ("dst", (0,))),
    "o2u-src-dst": ("o2u", ("src", (1,)), ("dst", (0,))),
    "b2o-src-dst": ("b2o", ("src", (1, 0)), ("dst", (0,))),
    "o2b-dst-dst": ("o2b", ("dst", (0, 0)), ("dst", (0, 1))),
    "o2b-src-dst": ("o2b", ("src", (0,)), ("dst", (1, 3))),
}


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("name", list(OVERLAPS))
def test_overlapping_arrays_rejected(name, kind, gen):
    direction, a, b = OVERLAPS[name]
    arena, src, dst = _build_in_arena(direction, kind, gen, pair=(a, b))
    before = arena.t.clone()
    names = [_path_name(role, path, direction) for role, path in (a, b)]
    with pytest.raises(ValueError) as info:
        convert(direction, src, dst)
    msg = str(info.value)
    assert any(re.match(path_regex(re.escape(n)), msg) for n in names), f"message names neither {names}: {msg!r}"
    for n in names:
        assert re.search(re.escape(n) + r"(?![\[\w])", msg), f"message does not name {n}: {msg!r}"
    assert torch.equal(arena.t, before), "bytes were written before the overlap was detected"


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("direction", LIST_DIRECTIONS)
def test_touching_views_of_one_buffer_work(direction, kind, gen):
    arena, src, dst = _build_in_arena(direction, kind, gen)
    src_before = clone_all(src)
    poison_(dst)
    convert(direction, src, dst)
    assert_all_bitwise_equal(dst, expected_list(direction, src_before, dst), "destinations")
    assert_all_bitwise_equal(src, src_before, "sources")


def test_aliasing_sources_work(gen):
    """Sources may overlap each other: the same universal read twice, the same chunk twice."""
    u = random_tensor((NH, NL, NO, NT, HD), torch.float32, generator=gen)
    blocks = [[torch.empty(chunk_shape(NH, NT, HD)) for _ in range(NL * NO)] for _ in range(2)]
    poison_(blocks)
    kvbm_ext.universal_to_block([u, u], blocks, "NHD")
    assert_all_bitwise_equal(blocks, expected_blocks([u, u], "NHD"), "blocks")
    chunk = random_tensor(chunk_shape(NH, NT, HD), torch.float32, generator=gen)
    src = [[chunk] * (NL * NO)]
    unis = poison_([torch.empty((NH, NL, NO, NT, HD))])
    kvbm_ext.block_to_universal(src, unis, "NHD")
    assert_all_bitwise_equal(unis, expected_universals(src, NO, "NHD"), "universals")


def _paged_in_arena(gen, kind, extra=0):
    """A "kbthd" cache whose 2 layers are views at the start of one arena, plus `extra`
    bytes after them for flat blocks."""
    layer_shape = (NO, 5, NT, NH, HD)
    n = _nbytes(layer_shape)
    arena = Arena(2 * n + extra, kind, gen)
    layers = [arena.view(i * n, layer_shape) for i in range(2)]
    return arena, layers, 2 * n


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("method,where", [("to_universal", "in-cache"), ("from_universal", "in-cache"),
                                          ("to_universal", "dst-dst"), ("to_operational", "in-cache"),
                                          ("from_operational", "in-cache")])
def test_paged_overlap_rejected(method, where, kind, gen):
    ushape = (NH, NL, NO, NT, HD) if "universal" in method else (NL, NO, NT * NH * HD)
    name = "universals" if "universal" in method else "operationals"
    un = _nbytes(ushape)
    arena, layers, end = _paged_in_arena(gen, kind, extra=2 * un + 4)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    if where == "in-cache":  # flat block 1 lies inside layer 1 of the cache
        others = [arena.view(end, ushape), arena.view(end // 2 + 16, ushape)]
        pattern = [rf"{name}\[1\]", r"(layers|cache)"]
    else:
        others = [arena.view(end, ushape), arena.view(end + 4, ushape)]
        pattern = [rf"{name}\[0\]", rf"{name}\[1\]"]
    before = arena.t.clone()
    with pytest.raises(ValueError) as info:
        if method.startswith("to_"):
            getattr(cache, method)([3, 0], others)
        else:
            getattr(cache, method)(others, [3, 0])
    msg = str(info.value)
    assert re.match(r"(layers|cache|" + name + ")", msg), msg
    for p in pattern:
        assert re.search(p, msg), f"message does not name {p!r}: {msg!r}"
    assert torch.equal(arena.t, before), "bytes were written before the overlap was detected"


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("method", ["to_universal", "from_universal"])
def test_paged_flat_blocks_beside_the_cache_in_one_buffer_work(method, kind, gen):
    ushape = (NH, NL, NO, NT, HD)
    un = _nbytes(ushape)
    arena, layers, end = _paged_in_arena(gen, kind, extra=2 * un)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    others = [arena.view(end, ushape), arena.view(end + un, ushape)]
    t_layers = [torch.as_tensor(x) for x in layers]
    t_others = [torch.as_tensor(x) for x in others]
    poison_(t_others if method == "to_universal" else t_layers)
    layers0 = [x.numpy().copy() for x in t_layers]
    others0 = [x.numpy().copy() for x in t_others]
    if method == "to_universal":
        cache.to_universal([3, 0], others)
    else:
        cache.from_universal(others, [3, 0])
    want = paged_expected(method, layers0, others0, [3, 0])
    got = t_layers if method.startswith("from_") else t_others
    assert_all_bitwise_equal(got, want, f"{method} destination")


# ==========================================================================
# 11. A second thread mutating the lists during block_to_universal.
# ==========================================================================


def test_thread_mutating_lists_during_calls(tmp_path):
    child = run_child(tmp_path, "thread_mutation", timeout=20, seconds=3.0)
    # the child's numpy reference is the torch reference
    src, want = child.tree("T~src"), child.tree("T~want")
    assert_all_bitwise_equal(want, expected_universals(src, 2, "NHD"), "child's reference")  # no = 2
    line = next((x for x in child.out.splitlines() if x.startswith("THREAD ")), None)
    assert line, child.out[-3000:]
    counts = eval(line[len("THREAD "):], {})  # a dict literal printed by the child
    errors = [x[len("THREADERR "):] for x in child.out.splitlines() if x.startswith("THREADERR ")]
    assert counts["wrong"] == 0, f"{counts['wrong']} successful calls wrote wrong bytes: {counts}"
    assert counts["written_on_error"] == 0, f"calls that raised had written bytes: {counts}"
    bad = [e for e in errors if not e.startswith(CLEAN)]
    assert not bad, f"exceptions other than ValueError / TypeError: {bad}"
    assert counts["ok"] > 0, f"no call succeeded in 3 s: {counts} {errors}"


# ==========================================================================
# One stacked array instead of a list, and raw copies' address lists, under the
# same hostility.
# ==========================================================================


@pytest.mark.parametrize("key", ["shape", "strides", "data"])
@pytest.mark.parametrize("direction,role", [("b2u", "dst"), ("u2b", "src"), ("u2o", "dst"), ("o2u", "src"),
                                            ("b2o", "dst"), ("o2b", "src")])
def test_stacked_array_whose_interface_rewrites_itself(direction, role, key, tmp_path):
    child = run_child(tmp_path, "stack_dict_rewrite", direction=direction, role=role, key=key)
    check_list(child, direction)


@pytest.mark.parametrize("fn", ["vectorized_copy", "memcpy_batch"])
def test_address_list_emptied_by_an_entrys_index(fn, tmp_path):
    """No crash; without a GPU a RuntimeError (a device is needed) with nothing written;
    with one, vectorized_copy's ValueError for pageable memory (memcpy_batch would copy
    asynchronously, with no way for the child to wait for it: not run there)."""
    if fn == "memcpy_batch" and kvbm_ext.cuda_devices():
        pytest.skip("the copy would be asynchronous")
    child = run_child(tmp_path, "address_list_mutation", fn=fn)
    kind, msg = child.outcome("X")
    dst = child.tree("X~dst")
    if kind == "RuntimeError":
        assert msg.startswith(f"{fn} needs a CUDA device"), msg
    else:
        assert_clean_error(kind, msg, ("ValueError",), r"(src|dst)_ptrs\[\d+\]", fn)
    assert_poisoned(dst, "dst")
