#!/usr/bin/env python3
"""A seeded fuzzer over every entry point of kvbm_ext, on the CPU.

Each case draws, from its own seed, an entry point and its arguments: valid
small arrays (NumPy), hostile objects (array getters that clear, rewrite or
shorten the caller's lists; interface dicts whose entries' __index__ rewrites
the dict; lying extents, strides, data pointers and typestrs), odd strings
(embedded NUL, non-ASCII, surrogates), odd ints (huge, negative, bool, NumPy
scalars), odd streams, universals and operationals as one stacked [nb, ...]
array (wrong leading dimension, blocks read backwards), and devices DLPack
cannot describe.  A case passes when the call returns, or raises ValueError,
TypeError or RuntimeError (the CPU build, or no GPU, for device work); any
other exception fails it, and so does a destination written by a call that
raised.  Valid block <-> universal calls are also checked bit for bit against
a NumPy reference.

Cases run in worker processes; a worker that dies (a crash) is reported with
the seed of the case it was running, and the command that replays it:

    python3 tools/fuzz.py --cases 100000            # from seed 0, all CPU cores
    python3 tools/fuzz.py --cases 2000 --first 7    # seeds 7 .. 2006
    python3 tools/fuzz.py --replay 1234             # one case, in this process
"""

import argparse
import os
import random
import subprocess
import sys
import time

import numpy as np

ALLOWED = (ValueError, TypeError, RuntimeError)
POISON = 0xA5
WORKER_FAILED = 3  # a worker's exit status when a case failed; any other but 0 is a crash


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
    that a raising call must leave as they were; `check()` verifies a success."""

    def __init__(self):
        self.written = []
        self.check = None


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


def run_case(seed, kvbm_ext):
    """Draws and runs case `seed`; returns None, or what went wrong."""
    rng = random.Random(seed)
    draw = rng.choice([case_list_api, case_list_api, case_paged, case_paged, case_other])
    case = draw(rng, kvbm_ext)
    try:
        case.run()
    except ALLOWED:
        for after, before in case.written:
            if not np.array_equal(after.view(np.uint8), before.view(np.uint8)):
                return "a call that raised wrote its destination"
        return None
    except BaseException as error:  # noqa: BLE001 - any other type is the finding
        return f"{type(error).__name__}: {error}"
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

    failures = 0
    for seed in range(first, first + count):
        print(f"case {seed}", flush=True)
        problem = run_case(seed, kvbm_ext)
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
        out, _ = proc.communicate()
        lines = out.splitlines()
        failed += [line for line in lines if line.startswith("FAIL")]
        started = [int(line.split()[1]) for line in lines if line.startswith("case ")]
        if proc.returncode not in (0, WORKER_FAILED) or "done" not in lines:
            last = started[-1] if started else first
            crashed.append(last)
            print(f"CRASH (exit status {proc.returncode}) in case {last}: replay with "
                  f"python3 tools/fuzz.py --replay {last}", flush=True)
            print("\n".join(lines[-20:]), flush=True)
            if last + 1 < first + count:  # go on after the crashing case
                pending.append((last + 1, first + count - last - 1))
    for line in failed[:50]:
        print(line)
    print(f"fuzz: {args.cases} cases from seed {args.first}: {len(crashed)} crashes, {len(failed)} failures "
          f"({time.time() - start:.0f} s)")
    sys.exit(1 if crashed or failed else 0)


if __name__ == "__main__":
    main()
