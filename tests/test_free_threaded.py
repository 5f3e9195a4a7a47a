"""Many threads at once through every entry point, on shared and private NumPy arrays and
with hostile arguments: without the GIL on free-threaded CPython, with it elsewhere.

The stress runs in a child interpreter (this file run as a script), so that a crash is a
failed test that shows the child's faulthandler traceback, not a dead test run.  Each of
`--threads` workers (16) runs every operation in turn, in a random order, until the time is
up, and checks every result bitwise against a NumPy permute written here:
  - the six conversions, reading one set of sources that every worker shares (lists of
    arrays, or one array) into destinations of their own, poisoned before each call;
  - PagedKVCache: one cache that every worker reads (to_universal, to_operational over the
    blocks nobody writes and its own) and writes (from_*, into blocks of its own), and
    caches constructed over the shared layers while the others run;
  - the raw copies on host addresses (RuntimeError without a CUDA device; with one,
    memcpy_batch copies and vectorized_copy refuses pageable memory), set_staging,
    staging_info and the build queries;
  - hostile arguments: block ids whose __index__ has another thread rewrite the id list,
    and universals whose __array_interface__ getter has another thread empty or refill
    the argument lists while the call reads them (the result is that of the lists as the
    call found them: it reads snapshots); lists that another thread mutates all the time
    (a clean ValueError, destinations untouched, or the result of a list it held);
    array types beyond what the type cache holds, one of whose metaclass runs a call of
    its own while its facts are looked up.
The child prints one JSON line (calls per operation, failures) and exits non-zero on any
failure.  KVBM_EXT_STRESS_SECONDS sets how long (2 s here by default; the free-threaded CI
step, tools/free_threaded.sh, runs 30 s).  NumPy only: it runs on interpreters without torch.
"""

import argparse
import faulthandler
import json
import os
import queue
import random
import subprocess
import sys
import sysconfig
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import kvbm_ext  # noqa: E402

NL, NO, NH, NT, HD, NB = 2, 2, 2, 4, 8, 3
POISON = 0xA5A5
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

# ==========================================================================
# Child side: the workload.
# ==========================================================================


def random_array(rng, shape):
    return rng.integers(0, 2**16, shape, dtype=np.uint16)


def poison(arrays):
    for a in arrays:
        a[...] = POISON


def chunks_of(u, layout):
    """Universal block u [nh, nl, no, nt, hd] as its nl*no chunks, [nt, nh, hd] (NHD) or [nh, nt, hd]."""
    x = u.transpose(1, 2, 3, 0, 4) if layout == "NHD" else u.transpose(1, 2, 0, 3, 4)
    return [np.ascontiguousarray(x[l, o]) for l in range(NL) for o in range(NO)]


def operational_of(u, layout):
    """Universal block u as an operational block [nl, no, nt*nh*hd], chunks in `layout` order."""
    x = u.transpose(1, 2, 3, 0, 4) if layout == "NHD" else u.transpose(1, 2, 0, 3, 4)
    return np.ascontiguousarray(x).reshape(NL, NO, -1)


def paged_rows(layers, ids):
    """Blocks `ids` of "kbthd" layers [no, num_blocks, nt, nh, hd], as [nb, nl, no, nt, nh, hd]."""
    return np.stack([layer[:, ids] for layer in layers]).transpose(2, 0, 1, 3, 4, 5)


def paged_universal(layers, ids):
    return paged_rows(layers, ids).transpose(0, 4, 1, 2, 3, 5)


def paged_operational(layers, ids, inner):
    rows = paged_rows(layers, ids)
    rows = rows if inner == "NHD" else rows.transpose(0, 1, 2, 4, 3, 5)
    return np.ascontiguousarray(rows).reshape(len(ids), NL, NO, -1)


class Shared:
    """What every worker reads: one set of blocks in every form, a cache, a mutated list."""

    def __init__(self, rng, workers, blocks_each):
        self.u = random_array(rng, (NB, NH, NL, NO, NT, HD))
        self.u_list = [np.ascontiguousarray(b) for b in self.u]
        self.blocks = {layout: [chunks_of(b, layout) for b in self.u] for layout in ("NHD", "HND")}
        self.ops = {layout: np.stack([operational_of(b, layout) for b in self.u]) for layout in ("NHD", "HND")}
        self.readonly_blocks = 4
        self.blocks_each = blocks_each
        num_blocks = self.readonly_blocks + workers * blocks_each
        self.layers = [random_array(rng, (NO, num_blocks, NT, NH, HD)) for _ in range(NL)]
        self.cache = kvbm_ext.PagedKVCache(self.layers, "kbthd")
        # Universal blocks with distinct contents; the mutator thread keeps rewriting the list.
        self.pool = [random_array(rng, (NH, NL, NO, NT, HD)) for _ in range(2 * NB)]
        self.pool_ops = [operational_of(u, "NHD") for u in self.pool]
        self.mutated = list(self.pool[:NB])


class Mutations:
    """A thread that runs the mutations hostile arguments ask for, and another that mutates
    the shared list all the time."""

    def __init__(self, shared, stop):
        self.requests = queue.SimpleQueue()
        self.shared, self.stop = shared, stop
        self.threads = [threading.Thread(target=self.serve, daemon=True),
                        threading.Thread(target=self.churn, daemon=True)]

    def ask(self, mutation):
        """Runs mutation() on the serving thread and waits for it."""
        done = threading.Event()
        self.requests.put((mutation, done))
        if not done.wait(30):
            raise RuntimeError("the mutating thread did not answer within 30 s")

    def serve(self):
        while True:
            mutation, done = self.requests.get()
            if mutation is None:
                return
            mutation()
            done.set()

    def churn(self):
        """Replaces, removes and appends entries: the list holds NB - 1 to NB + 1 pool blocks."""
        rng = random.Random(7)
        lst, pool = self.shared.mutated, self.shared.pool
        while not self.stop.is_set():
            action = rng.randrange(4)
            if action == 0:
                lst[rng.randrange(len(lst))] = rng.choice(pool)
            elif action == 1 and len(lst) >= NB:
                del lst[rng.randrange(len(lst))]
            elif action == 2 and len(lst) <= NB:
                lst.insert(rng.randrange(len(lst) + 1), rng.choice(pool))
            else:
                lst.reverse()

    def close(self):
        self.requests.put((None, None))


class Interface:
    """Only the __array_interface__ of a NumPy array; `hook` runs once, on the first read."""

    def __init__(self, a, hook=None):
        self.a, self.hook = a, hook

    @property
    def __array_interface__(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.a.__array_interface__


# More wrapper types than the type cache holds, so that workers keep replacing each
# other's entries.
WRAPPER_TYPES = [type(f"Wrapper{k}", (Interface,), {}) for k in range(12)]


class CallingMeta(type):
    """A metaclass whose attribute misses (the type cache asking for the C exchange API)
    make a call of their own into kvbm_ext first."""

    def __getattr__(cls, name):
        source = np.arange(NL * NO * NT * NH * HD, dtype=np.uint16).reshape(NL, NO, -1)
        chunks = [np.empty((NT, NH, HD), np.uint16) for _ in range(NL * NO)]
        kvbm_ext.operational_to_block([source], [chunks])
        if not np.array_equal(np.stack(chunks).reshape(NL, NO, -1), source):
            raise AssertionError("the call made while a type's facts were looked up wrote wrong bytes")
        raise AttributeError(name)


class IndexAsking:
    """A block id whose __index__ first has another thread rewrite the id list."""

    def __init__(self, value, mutations, mutation):
        self.value, self.mutations, self.mutation = value, mutations, mutation

    def __index__(self):
        mutation, self.mutation = self.mutation, None
        if mutation is not None:
            self.mutations.ask(mutation)
        return self.value


class Failed(Exception):
    pass


def expect_equal(got, expected, what):
    if not np.array_equal(got, expected):
        raise Failed(f"{what}: wrong bytes")


def expect_error(call, kinds, what):
    try:
        call()
    except kinds:
        return
    raise Failed(f"{what}: expected {' or '.join(k.__name__ for k in kinds)}")


class Worker:
    def __init__(self, index, shared, mutations, seed):
        self.index, self.s, self.mutations = index, shared, mutations
        self.rng = np.random.default_rng(seed)
        self.random = random.Random(seed)
        self.u = np.empty((NB, NH, NL, NO, NT, HD), np.uint16)
        self.u_list = [np.empty((NH, NL, NO, NT, HD), np.uint16) for _ in range(NB)]
        self.ops = np.empty((NB, NL, NO, NT * NH * HD), np.uint16)
        self.chunks = {layout: [[np.empty(c.shape, np.uint16) for c in block] for block in shared.blocks[layout]]
                       for layout in ("NHD", "HND")}
        first = shared.readonly_blocks + index * shared.blocks_each
        self.own = list(range(first, first + shared.blocks_each))
        self.calls, self.failures = {}, []

    # --- conversions: shared sources, private destinations -------------------------

    def destination_u(self):
        return self.u if self.random.random() < 0.5 else self.u_list

    def check_u(self, dst, what):
        expect_equal(np.stack(dst) if isinstance(dst, list) else dst, self.s.u, what)

    def check_chunks(self, layout, what):
        for got, expected in zip(self.chunks[layout], self.s.blocks[layout]):
            for g, e in zip(got, expected):
                expect_equal(g, e, what)

    def op_block_to_universal(self):
        layout, dst = self.random.choice(("NHD", "HND")), self.destination_u()
        poison(dst if isinstance(dst, list) else [dst])
        kvbm_ext.block_to_universal(self.s.blocks[layout], dst, layout)
        self.check_u(dst, f"block_to_universal {layout}")

    def op_universal_to_block(self):
        layout = self.random.choice(("NHD", "HND"))
        poison(c for block in self.chunks[layout] for c in block)
        kvbm_ext.universal_to_block(self.random.choice((self.s.u, self.s.u_list)), self.chunks[layout], layout)
        self.check_chunks(layout, f"universal_to_block {layout}")

    def op_block_to_operational(self):
        layout = self.random.choice(("NHD", "HND"))
        poison([self.ops])
        kvbm_ext.block_to_operational(self.s.blocks[layout], self.ops)
        expect_equal(self.ops, self.s.ops[layout], f"block_to_operational {layout}")

    def op_operational_to_block(self):
        layout = self.random.choice(("NHD", "HND"))
        poison(c for block in self.chunks[layout] for c in block)
        kvbm_ext.operational_to_block(list(self.s.ops[layout]), self.chunks[layout])
        self.check_chunks(layout, f"operational_to_block {layout}")

    def op_universal_to_operational(self):
        layout = self.random.choice(("NHD", "HND"))
        poison([self.ops])
        kvbm_ext.universal_to_operational(self.s.u_list, self.ops, layout)
        expect_equal(self.ops, self.s.ops[layout], f"universal_to_operational {layout}")

    def op_operational_to_universal(self):
        layout, dst = self.random.choice(("NHD", "HND")), self.destination_u()
        poison(dst if isinstance(dst, list) else [dst])
        kvbm_ext.operational_to_universal(self.s.ops[layout], dst, layout)
        self.check_u(dst, f"operational_to_universal {layout}")

    # --- PagedKVCache: one cache, read by all, each worker writing its own blocks ------

    def some_ids(self):
        """Blocks nobody writes and this worker's own, in a random order."""
        pick = list(range(self.s.readonly_blocks)) + self.own
        self.random.shuffle(pick)
        return pick[:NB]

    def op_paged_to_universal(self):
        ids = self.some_ids()
        poison([self.u])
        self.s.cache.to_universal(ids, self.u)
        expect_equal(self.u, paged_universal(self.s.layers, ids), "PagedKVCache.to_universal")

    def op_paged_to_operational(self):
        ids, inner = self.some_ids(), self.random.choice(("NHD", "HND"))
        poison([self.ops])
        self.s.cache.to_operational(np.array(ids), list(self.ops), layout=inner)
        expect_equal(self.ops, paged_operational(self.s.layers, ids, inner), f"PagedKVCache.to_operational {inner}")

    def op_paged_from_universal(self):
        ids, source = self.random.sample(self.own, NB), random_array(self.rng, (NB, NH, NL, NO, NT, HD))
        self.s.cache.from_universal(list(source), ids)
        expect_equal(paged_universal(self.s.layers, ids), source, "PagedKVCache.from_universal")

    def op_paged_from_operational(self):
        ids, inner = self.random.sample(self.own, NB), self.random.choice(("NHD", "HND"))
        source = random_array(self.rng, (NB, NL, NO, NT * NH * HD))
        self.s.cache.from_operational(source, ids, layout=inner)
        expect_equal(paged_operational(self.s.layers, ids, inner), source, f"PagedKVCache.from_operational {inner}")

    def op_paged_construct(self):
        cache = kvbm_ext.PagedKVCache(self.s.layers, "KBTHD")
        if (cache.num_layers, cache.num_blocks, cache.layout) != (NL, self.s.layers[0].shape[1], "kbthd"):
            raise Failed(f"PagedKVCache: attributes {cache!r}")
        shared = self.s.cache  # read by every thread at once, as the new cache is made
        for c in (cache, shared):
            if (c.dtype, c.device, c.dtype_name, c.block_size) != (self.s.layers[0].dtype, "cpu", "uint16", NT) \
                    or not isinstance(c.dtype, np.dtype) or "dtype=dtype('uint16')" not in repr(c):
                raise Failed(f"PagedKVCache: dtype or device of {c!r}")
        ids = self.some_ids()[:1]
        poison([self.u[:1]])
        cache.to_universal(ids, self.u[:1])
        expect_equal(self.u[:1], paged_universal(self.s.layers, ids), "a new PagedKVCache's to_universal")

    # --- raw copies, staging, build queries ---------------------------------------------

    def op_raw_copies(self):
        source = random_array(self.rng, (4, 64))
        destination = np.full((4, 64), POISON, np.uint16)
        src = [source[i].ctypes.data for i in range(4)]
        dst = [destination[i].ctypes.data for i in range(4)]
        if not kvbm_ext.cuda_devices():
            expect_error(lambda: kvbm_ext.vectorized_copy(src, dst, 128), (RuntimeError,), "vectorized_copy")
            expect_error(lambda: kvbm_ext.memcpy_batch(src, dst, 128), (RuntimeError,), "memcpy_batch")
            expect_equal(destination, np.full((4, 64), POISON, np.uint16), "raw copies that raised")
            return
        expect_error(lambda: kvbm_ext.vectorized_copy(src, dst, 128), (ValueError,), "vectorized_copy (pageable)")
        # Host to host, cudaMemcpyAsync returns once the bytes are copied.
        kvbm_ext.memcpy_batch(src, dst, [128] * 4, mode="fallback_only")
        expect_equal(destination, source, "memcpy_batch host to host")

    def op_staging_and_queries(self):
        if kvbm_ext.is_using_stubs():
            # Nothing reads the settings back without CUDA: any value will do.
            kvbm_ext.set_staging(self.random.randrange(1, 64) << 20, lanes=self.random.randrange(1, 17))
        else:
            kvbm_ext.set_staging()  # keeps the settings
        if kvbm_ext.cuda_devices():
            if kvbm_ext.staging_info()["lanes"] < 1:
                raise Failed("staging_info: no lanes")
        else:
            expect_error(kvbm_ext.staging_info, (RuntimeError,), "staging_info without a CUDA device")
        build = kvbm_ext.build_info()
        if build["with_cuda"] == kvbm_ext.is_using_stubs() or not isinstance(kvbm_ext.is_memcpy_batch_available(), bool):
            raise Failed(f"build_info {build} disagrees with is_using_stubs()")

    # --- hostile arguments --------------------------------------------------------------

    def op_hostile_ids_index(self):
        """Ids whose first __index__ has another thread rewrite (or empty) the id list."""
        ids = self.some_ids()
        others = [self.own[0]] * NB if self.random.random() < 0.5 else []
        lst = []
        lst.extend(IndexAsking(v, self.mutations, None) for v in ids)
        lst[0].mutation = lambda: lst.__setitem__(slice(None), others)
        poison([self.u])
        self.s.cache.to_universal(lst, self.u)
        expect_equal(self.u, paged_universal(self.s.layers, ids), "to_universal with ids rewritten mid-call")

    def op_hostile_getter(self):
        """Universals whose first __array_interface__ read has another thread empty or
        refill both argument lists (the blocks' outer list, the universals' list)."""
        layout = self.random.choice(("NHD", "HND"))
        wrapper = self.random.choice(WRAPPER_TYPES)
        dst = [wrapper(u) for u in self.u_list]
        blocks = list(self.s.blocks[layout])
        junk = [wrapper(np.empty((NH, NL, NO, NT, HD), np.uint16)) for _ in range(NB)]
        refill = self.random.random() < 0.5

        def mutate():
            dst[:] = junk if refill else []
            blocks[:] = [blocks[0]] * NB if refill else []

        dst[0].hook = lambda: self.mutations.ask(mutate)
        poison(self.u_list)
        kvbm_ext.block_to_universal(blocks, dst, layout)
        self.check_u(self.u_list, "block_to_universal with lists emptied mid-call")

    def op_hostile_churned_list(self):
        """The shared list another thread keeps mutating: a clean count error with the
        destination untouched, or the result of some list of pool blocks it held."""
        poison([self.ops])
        try:
            kvbm_ext.universal_to_operational(self.s.mutated, self.ops, "NHD")
        except ValueError as error:
            if not str(error).startswith(("universals", "operationals")):
                raise Failed(f"universal_to_operational on a churned list: {error}") from None
            expect_equal(self.ops, np.full_like(self.ops, POISON), "a churned list's failed call")
            return
        for b in range(NB):
            if not any(np.array_equal(self.ops[b], expected) for expected in self.s.pool_ops):
                raise Failed(f"universal_to_operational on a churned list: block {b} is no pool block's")

    def op_hostile_type_lookup(self):
        """A fresh array type whose metaclass calls kvbm_ext while its facts are found."""
        wrapper = CallingMeta(f"Calling{self.index}", (Interface,), {})
        poison([self.ops])
        kvbm_ext.universal_to_operational([wrapper(u) for u in self.s.u_list], self.ops, "HND")
        expect_equal(self.ops, self.s.ops["HND"], "universal_to_operational through a calling metaclass")

    # --- the loop -------------------------------------------------------------------------

    def operations(self):
        return [getattr(self, name) for name in sorted(dir(self)) if name.startswith("op_")]

    def run(self, start, deadline):
        operations = self.operations()
        start.wait()
        while True:  # every operation at least once
            self.random.shuffle(operations)
            for operation in operations:
                name = operation.__name__[3:]
                try:
                    operation()
                except Failed as failure:
                    self.failures.append(f"worker {self.index}: {failure}")
                except Exception:  # noqa: BLE001 - every other exception is a failure to report
                    self.failures.append(f"worker {self.index}: {name}: {traceback.format_exc()}")
                self.calls[name] = self.calls.get(name, 0) + 1
            if time.monotonic() >= deadline:
                return


def stress(threads, seconds):
    """Runs the workers; returns {"calls": {operation: count}, "failures": [...], ...}."""
    rng = np.random.default_rng(20261124)
    shared = Shared(rng, threads, blocks_each=NB + 1)
    stop = threading.Event()
    mutations = Mutations(shared, stop)
    workers = [Worker(k, shared, mutations, 1000 + k) for k in range(threads)]
    start = threading.Barrier(threads + 1)
    deadline = time.monotonic() + seconds
    pool = [threading.Thread(target=w.run, args=(start, deadline), daemon=True) for w in workers]
    for t in mutations.threads + pool:
        t.start()
    start.wait()
    failures = []
    for t in pool:
        t.join(seconds + 60)
        if t.is_alive():
            failures.append(f"{t.name} still running 60 s after the deadline")
    stop.set()
    mutations.close()
    for t in mutations.threads:
        t.join(60)
    calls = {}
    for w in workers:
        failures += w.failures
        for name, n in w.calls.items():
            calls[name] = calls.get(name, 0) + n
    return {"threads": threads, "seconds": seconds, "calls": calls, "failures": failures,
            "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)()}


def child_main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    faulthandler.enable()
    faulthandler.dump_traceback_later(args.seconds + 120, exit=True)  # every thread's stack, should one hang
    if not FREE_THREADED:
        sys.setswitchinterval(1e-5)  # with a GIL, threads take turns as often as they can
    result = stress(args.threads, args.seconds)
    print(json.dumps(result))
    sys.exit(1 if result["failures"] else 0)


# ==========================================================================
# Parent side: the tests.
# ==========================================================================


def stress_seconds():
    return float(os.environ.get("KVBM_EXT_STRESS_SECONDS", "2"))


def run_child(args, timeout, env=None):
    return subprocess.run([sys.executable, "-X", "faulthandler", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_threads_through_every_entry_point():
    seconds = stress_seconds()
    proc = run_child([os.path.abspath(__file__), "--threads", "16", "--seconds", str(seconds)], timeout=seconds + 240)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child printed nothing (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1])
    assert not result["failures"], "\n".join(result["failures"][:20])
    assert proc.returncode == 0, proc.stderr[-6000:]
    operations = [name[3:] for name in dir(Worker) if name.startswith("op_")]
    assert sorted(result["calls"]) == sorted(operations), result["calls"]
    assert min(result["calls"].values()) >= 16, result["calls"]  # every worker ran every operation
    if FREE_THREADED and "PYTHON_GIL" not in os.environ:
        assert not result["gil_enabled"], "the GIL was on during the stress"


def host_copies(rng, nb, nh, nl, no, nt, hd):
    """Each CPU copy path as (name, call, the arrays it writes, what they must then hold):
    the list and universal conversions, a PagedKVCache move and to_cache between host caches."""
    source = random_array(rng, (nb, nh, nl, no, nt, hd))
    operational = np.ascontiguousarray(source.transpose(0, 2, 3, 4, 1, 5)).reshape(nb, nl, no, -1)
    chunks = [[np.ascontiguousarray(b.transpose(1, 2, 3, 0, 4)[l, o]) for l in range(nl) for o in range(no)]
              for b in source]
    layers = [np.ascontiguousarray(source[:, :, l].transpose(2, 0, 3, 1, 4)) for l in range(nl)]  # "kbthd"
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    copied = [np.empty_like(layer) for layer in layers]
    other = kvbm_ext.PagedKVCache(copied, "kbthd")
    ids = rng.permutation(nb)
    operationals, universal = [np.empty_like(operational) for _ in range(2)], np.empty_like(source)
    return [
        ("universal_to_operational", lambda: kvbm_ext.universal_to_operational(source, operationals[0], "NHD"),
         operationals[:1], [operational]),
        ("block_to_operational", lambda: kvbm_ext.block_to_operational(chunks, operationals[1]),
         operationals[1:], [operational]),
        ("PagedKVCache.to_universal", lambda: cache.to_universal(ids, universal), [universal], [source[ids]]),
        ("PagedKVCache.to_cache", lambda: cache.to_cache(other, ids, np.arange(nb)),
         copied, [layer[:, ids] for layer in layers]),
    ]


def test_large_host_copies_release_the_gil():
    """Every CPU copy path lets another Python thread run while it copies 64 MiB (copies
    under 64 KiB keep the GIL: giving it up would cost more than they take)."""
    import pytest

    if FREE_THREADED:
        pytest.skip("no GIL to release")
    rng = np.random.default_rng(64)
    copies = host_copies(rng, 32, 8, 16, 2, 16, 128)  # 64 MiB of uint16 a copy
    stamps, stop = [], threading.Event()

    def tick():  # wakes every millisecond, and needs the GIL to note it
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    missed = []
    try:
        for name, call, written, expected in copies:
            inside = 0  # the GIL held through the copy, the ticker could not note a time in its middle
            for _ in range(10):
                poison(written)
                start = time.perf_counter()
                call()
                end = time.perf_counter()
                quarter = (end - start) / 4
                inside = max(inside, sum(start + quarter < t < end - quarter for t in stamps))
                assert all(np.array_equal(got, want) for got, want in zip(written, expected)), name
                if inside:
                    break
            if not inside:
                missed.append(name)
    finally:
        stop.set()
        ticker.join()
    assert not missed, f"no other thread ran during the middle half of any of ten 64 MiB copies: {missed}"


def test_import_leaves_the_gil_off():
    import pytest

    if not FREE_THREADED:
        pytest.skip("a build with a GIL: there is no GIL to leave off")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    code = "import sys, kvbm_ext; print(sys._is_gil_enabled())"
    proc = run_child(["-W", "error::RuntimeWarning", "-c", code], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


if __name__ == "__main__":
    child_main()
