"""kvbm_ext.disk.DiskPool on the CPU: host caches of every engine layout to a pool file and
back, bit for bit; the slots' layout in the file; selections and offsets; handles; argument
errors before anything is written; concurrent stores; reopening; the buffered fallback.

The reference moves rows through plain-torch views of each engine's documented shape
(tests/support/engines.py); destinations are poisoned and compared whole.  The file's
payload of a slot is read back through a plain descriptor and compared with the universal
form of the block.  Integrity cases (crashes, corruption, full disks): test_disk_integrity.py.
"""

import errno
import hashlib
import logging
import os
import threading

import numpy as np
import pytest
import torch

import kvbm_ext
from kvbm_ext.disk import DiskPool, SlotError
from support.asserts import assert_bitwise_equal, poison_
from support.disk import (D, HeldDriver, expect_round_trip, file_slot_as, make, needs_nixl, poisoned_copy, snapshot,
                          universal_rows)
from support.engines import ENGINES, Dims

pytestmark = needs_nixl


def pool_for(tmp_path, like, num_slots=8, name="kv.pool", **kwargs):
    return DiskPool(tmp_path / name, num_slots, like, **kwargs)


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ==========================================================================
# Host caches to a pool file and back.
# ==========================================================================


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_round_trip(name, gen, tmp_path):
    """Blocks of each engine's cache into universal slots (the file holds exactly the
    universal form) and back into other blocks of the same layout."""
    e, memory, cache = make(name, gen, dtype=torch.float8_e4m3fn if name == "mla" else torch.bfloat16)
    before = snapshot(memory)
    with pool_for(tmp_path, cache) as pool:
        src_ids, slots, dst_ids = [6, 0, 3], [5, 1, 7], [2, 4, 0]
        h = pool.store(cache, src_ids, slots)
        h.wait(30)
        assert h.done() and h.error is None and h.seconds > 0 and h.nbytes == 3 * pool.slot_bytes
        for b, s in zip(src_ids, slots):
            want = universal_rows(e, before, D, b)
            assert_bitwise_equal(file_slot_as(pool, s, want), want, f"slot {s} in the file")
        _, dst_mem, dst_cache, dst_want = poisoned_copy(name, gen, dtype=memory[0].dtype)
        pool.load(slots, dst_cache, dst_ids).wait(30)
        expect_round_trip(e, before, e, dst_mem, dst_want, src_ids, dst_ids)
    for i, (got, was) in enumerate(zip(memory, before)):
        assert_bitwise_equal(torch.as_tensor(got).view(was.dtype), was, f"source memory #{i}")


@pytest.mark.parametrize("src_name,dst_name", [("vllm_packed", "transformers"), ("sglang_mha", "hicache_page_head"),
                                               ("flashinfer_hnd", "trtllm_pool"), ("universal_pool", "vllm_flash_attn")])
def test_across_engines(src_name, dst_name, gen, tmp_path):
    src, src_mem, src_cache = make(src_name, gen)
    before = snapshot(src_mem)
    with pool_for(tmp_path, src_cache) as pool:
        pool.store(src_cache, [1, 2, 6], [0, 3, 4]).wait(30)
        dst, dst_mem, dst_cache, dst_want = poisoned_copy(dst_name, gen)
        pool.load([4, 0, 3], dst_cache, [5, 0, 1]).wait(30)
    expect_round_trip(src, before, dst, dst_mem, dst_want, [6, 1, 2], [5, 0, 1])


@pytest.mark.parametrize("dims", ["blkhtd", "bkthld", "btlkhd"])
def test_slot_dims(dims, gen, tmp_path):
    """dims= orders the slot's payload: the file holds the universal block permuted to it."""
    e, memory, cache = make("vllm_flash_attn", gen)
    before = snapshot(memory)
    with pool_for(tmp_path, cache, dims=dims) as pool:
        assert pool.dims == dims
        pool.store(cache, [3], [2]).wait(30)
        universal = universal_rows(e, before, D, 3)                 # [h, l, k, t, d]
        want = universal.permute(*["hlktd".index(c) for c in dims[1:]])
        assert_bitwise_equal(file_slot_as(pool, 2, want.contiguous()), want.contiguous(), "slot 2")
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([2], dst_cache, [6]).wait(30)
    expect_round_trip(e, before, ENGINES["vllm_packed"], dst_mem, dst_want, [3], [6])


def test_numpy_cache_and_mapping_like(tmp_path):
    """A NumPy cache, and a pool described by a mapping of sizes."""
    rng = np.random.default_rng(5)
    layers = [rng.integers(-30000, 30000, (2, 6, 4, 2, 8)).astype(np.float16) for _ in range(3)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    like = dict(num_heads=2, num_layers=3, num_outer=2, tokens_per_block=4, head_dim=8, dtype="float16")
    with pool_for(tmp_path, like) as pool:
        pool.store(cache, [1, 4], [0, 1]).wait(30)
        out = [np.zeros_like(x) for x in layers]
        pool.load([1, 0], kvbm_ext.PagedKVCache(out, "kbthd"), [2, 3]).wait(30)
    for x, y in zip(layers, out):
        assert np.array_equal(y[:, 2], x[:, 4]) and np.array_equal(y[:, 3], x[:, 1])
        assert not y[:, [0, 1, 4, 5]].any()


# Loads read any part of a slot: a reader with another TP size takes its heads.
LOAD_SELECTIONS = {
    "tp rank 1 of 2": dict(d_dst=Dims(nl=3, nh=2, nt=4, hd=8, blocks=5), heads=slice(2, 4)),
    "heads reversed, offset": dict(d_dst=Dims(nl=3, nh=6, nt=4, hd=8, blocks=5), heads=slice(None, None, -1),
                                   head_offset=2),
    "layers slice, offset": dict(d_dst=Dims(nl=2, nh=4, nt=4, hd=8, blocks=5), layers=slice(1, 3), layer_offset=-1),
    "layers stepped, packed": dict(d_dst=Dims(nl=2, nh=4, nt=4, hd=8, blocks=5), layers=range(2, -1, -2),
                                   pack_layers=True),
    "one layer into a deeper cache": dict(d_dst=Dims(nl=5, nh=4, nt=4, hd=8, blocks=5), layers=1, layer_offset=3),
}


@pytest.mark.parametrize("case", list(LOAD_SELECTIONS))
def test_load_selections(case, gen, tmp_path):
    kwargs = dict(LOAD_SELECTIONS[case])
    d_dst = kwargs.pop("d_dst")
    d_src = Dims(nl=3, nh=4, nt=4, hd=8, blocks=6)
    e, memory, cache = make("vllm_packed", gen, d=d_src)
    before = snapshot(memory)
    with pool_for(tmp_path, cache) as pool:
        pool.store(cache, [5, 2], [3, 6]).wait(30)
        _, dst_mem, dst_cache, dst_want = poisoned_copy("transformers", gen, d=d_dst)
        pool.load([6, 3], dst_cache, [4, 0], **kwargs).wait(30)
    # The slot is the source: rows of slot 3 are cache block 5's, of slot 6 block 2's.
    expect_round_trip(e, before, ENGINES["transformers"], dst_mem, dst_want, [2, 5], [4, 0], d_src, d_dst, **kwargs)


STORE_SELECTIONS = {
    "a tp rank's heads": (Dims(nl=3, nh=4, nt=4, hd=8, blocks=6), dict(heads=slice(2, 4)), dict(nh=2)),
    "a pipeline stage's layers": (Dims(nl=5, nh=2, nt=4, hd=8, blocks=6), dict(layers=range(1, 4), layer_offset=-1),
                                  dict(nl=3)),
    "layers reversed, packed": (Dims(nl=3, nh=2, nt=4, hd=8, blocks=6), dict(layers=slice(None, None, -1),
                                                                            pack_layers=True), {}),
}


@pytest.mark.parametrize("case", list(STORE_SELECTIONS))
def test_store_selections_that_fill_slots(case, gen, tmp_path):
    d_src, kwargs, slot = STORE_SELECTIONS[case]
    e, memory, cache = make("vllm_flash_attn", gen, d=d_src)
    before = snapshot(memory)
    like = dict(num_heads=slot.get("nh", d_src.nh), num_layers=slot.get("nl", d_src.nl), num_outer=2,
                tokens_per_block=4, head_dim=8, dtype="bfloat16")
    d_slot = Dims(nl=like["num_layers"], nh=like["num_heads"], nt=4, hd=8, blocks=6)
    with pool_for(tmp_path, like) as pool:
        pool.store(cache, [4, 1], [0, 2], **kwargs).wait(30)
        _, dst_mem, dst_cache, dst_want = poisoned_copy("universal_pool", gen, d=d_slot)
        pool.load([0, 2], dst_cache, [3, 5]).wait(30)
    expect_round_trip(e, before, ENGINES["universal_pool"], dst_mem, dst_want, [4, 1], [3, 5], d_src, d_slot,
                      **kwargs)


# ==========================================================================
# Handles.
# ==========================================================================


def test_handles_report_and_bound_their_wait(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache) as pool:
        with HeldDriver():
            h = pool.store(cache, [1, 2], [3, 4], keys=[b"prefix-a", b"prefix-b"])
            assert not h.done() and h.error is None and h.seconds is None
            with pytest.raises(TimeoutError, match="goes on"):
                h.wait(0.05)
            assert h.slots == (3, 4) and len(h.generations) == 2 and h.nbytes == 2 * pool.slot_bytes
        h.wait(30)
        assert h.done() and h.error is None and h.seconds > 0
        assert pool.stored() == {3: (h.generations[0], b"prefix-a"), 4: (h.generations[1], b"prefix-b")}
        assert pool.generation(3) == h.generations[0] and pool.generation(0) == 0
        failed = pool.load([3, 0], cache, [5, 6])
        with pytest.raises(SlotError, match="slot 0: holds no completed store: never written") as raised:
            failed.wait(30)
        assert failed.done() and failed.error is raised.value and raised.value.reasons == {
            0: "holds no completed store: never written"}
        h.wait_stream(None)     # a host cache's transfer has no GPU side: nothing to wait for


def test_a_call_with_no_slot_is_done(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache) as pool:
        for h in (pool.store(cache, [], []), pool.load([], cache, [])):
            assert h.done() and h.error is None and h.nbytes == 0


def test_bounce_space_is_waited_for_and_bounded(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache, bounce_bytes=2 * (4096 + 4096)) as pool:
        assert pool.bounce_slots == 2
        with pytest.raises(ValueError, match="3 slots need 3 bounce slots, and the pool has 2"):
            pool.store(cache, [0, 1, 2], [0, 1, 2])
        with HeldDriver():
            first = pool.store(cache, [0, 1], [0, 1])
            with pytest.raises(TimeoutError, match=r"waited 0.1 s for 1 bounce slots \(0 of 2 free\)"):
                pool.store(cache, [2], [2], timeout=0.1)
            assert pool.generation(2) == 0
        first.wait(30)
        pool.store(cache, [2], [2], timeout=10).wait(30)
        assert set(pool.stored()) == {0, 1, 2}


def test_a_slot_in_flight_is_refused(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache) as pool:
        pool.store(cache, [0], [1]).wait(30)
        with HeldDriver():
            pending = pool.store(cache, [2], [2])
            with pytest.raises(ValueError, match="slot 2 has a store in flight"):
                pool.store(cache, [3], [2])
            with pytest.raises(ValueError, match="slot 2 has a store in flight"):
                pool.load([2], cache, [4])
            loading = pool.load([1], cache, [5])
            with pytest.raises(ValueError, match="slot 1 has a load in flight"):
                pool.store(cache, [3], [1])
        pending.wait(30)
        loading.wait(30)


# ==========================================================================
# Arguments: checked before anything is written.
# ==========================================================================


def refused_cases(cache, other_dtype, read_only):
    return {
        "slot out of range": (lambda p: p.store(cache, [0], [8]), ValueError, r"slot_ids\[0\]: slot 8 is outside"),
        "slot twice": (lambda p: p.store(cache, [0, 1], [2, 2]), ValueError, r"slot_ids\[1\]: slot 2 appears twice"),
        "block out of range": (lambda p: p.store(cache, [0, 7], [1, 2]), ValueError, r"block_ids\[1\]: block 7"),
        "lengths differ": (lambda p: p.store(cache, [0, 1], [1]), ValueError, "2 ids for 1 slot_ids"),
        "key too long": (lambda p: p.store(cache, [0], [1], keys=[b"x" * 1025]), ValueError, r"keys\[0\]"),
        "another dtype": (lambda p: p.store(other_dtype, [0], [1]), TypeError, "element type"),
        "heads outside": (lambda p: p.store(cache, [0], [1], heads=slice(0, 3)), ValueError,
                          r"DiskPool.store: heads: .* \(dst is the pool.s slots"),
        "part of a slot": (lambda p: p.store(cache, [0], [1], heads=0), ValueError,
                           "heads: a store writes whole slots"),
        "layers short of a slot": (lambda p: p.store(cache, [0], [1], layers=slice(0, 2)), ValueError,
                                   "layers: a store writes whole slots"),
        "a stream for a host cache": (lambda p: p.store(cache, [0], [1], stream=0), ValueError, "stream"),
        "not a cache": (lambda p: p.store(np.zeros(3), [0], [1]), TypeError, "cache: expected a kvbm_ext"),
        "load into one block twice": (lambda p: p.load([0, 0], cache, [3, 3]), ValueError,
                                      r"block_ids\[1\]: block 3 appears twice"),
        "load generations count": (lambda p: p.load([0], cache, [3], generations=[1, 2]), ValueError,
                                   "generations: 2 entries for 1 slots"),
        "load into a read-only cache": (lambda p: p.load([0], read_only, [3]), ValueError, "read-only"),
    }


@pytest.mark.parametrize("case", list(refused_cases(None, None, None)))
def test_refused_before_anything_is_written(case, gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen, dtype=torch.float16)
    _, _, other = make("vllm_packed", gen, dtype=torch.bfloat16)
    frozen = [x.numpy().copy() for x in memory]          # the same layout, read-only NumPy
    for x in frozen:
        x.setflags(write=False)
    read_only = kvbm_ext.PagedKVCache(frozen, "bth(kd)")
    with pool_for(tmp_path, cache) as pool:
        pool.store(cache, [6], [0]).wait(30)
        digest, before = file_digest(pool.path), snapshot(memory)
        call, exc, words = refused_cases(cache, other, read_only)[case]
        with pytest.raises(exc, match=words):
            call(pool)
        assert file_digest(pool.path) == digest
        for got, was in zip(memory, before):
            assert torch.equal(got.view(was.dtype), was)
        assert pool.stored().keys() == {0} and pool.bounce_slots == len(pool._free)


def test_a_load_the_copy_refuses_writes_no_block(gen, tmp_path):
    """What to_cache checks only when it writes (a destination that requires grad) fails
    the load's handle with its error, and no block is written."""
    e, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache) as pool:
        pool.store(cache, [6], [0]).wait(30)
        grad = [x.clone().requires_grad_() for x in memory]
        before = snapshot(grad)
        h = pool.load([0], e.build(grad, D), [3])
        with pytest.raises(ValueError, match="requires grad"):
            h.wait(30)
        for got, was in zip(grad, before):
            assert torch.equal(got.detach().view(was.dtype), was)
        pool.load([0], cache, [3]).wait(30)       # the bounce slot came back


def test_closed_pool_refuses(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    pool = pool_for(tmp_path, cache)
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError, match="is closed"):
        pool.store(cache, [0], [0])


def test_construction_errors(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    for kwargs, exc, words in [
        (dict(dims="bhlkt"), ValueError, "dims: expected the letters"),
        (dict(dims="hblktd"), ValueError, "b first"),
        (dict(dims="bhlkdt"), ValueError, "d last"),
        (dict(create=1), TypeError, "create"),
        (dict(engine="GDS"), ValueError, "engine: expected 'auto' or 'POSIX'"),
        (dict(bounce_bytes=100), ValueError, "bounce_bytes: 100 bytes hold no slot"),
        (dict(engine_params={"use_aio": True}), TypeError, "engine_params"),
    ]:
        with pytest.raises(exc, match=words):
            pool_for(tmp_path, cache, name=f"{len(kwargs)}.pool", **kwargs)
    with pytest.raises(ValueError, match="num_slots: expected at least 1"):
        DiskPool(tmp_path / "n.pool", 0, cache)
    with pytest.raises(ValueError, match="creating a pool needs num_slots and like"):
        DiskPool(tmp_path / "m.pool")
    with pytest.raises(TypeError, match="like: expected a PagedKVCache or a mapping"):
        DiskPool(tmp_path / "l.pool", 4, [1, 2])
    with pytest.raises(FileNotFoundError):
        DiskPool(tmp_path / "missing.pool", create=False)
    assert not [p for p in os.listdir(tmp_path) if p != "kv.pool"]


# ==========================================================================
# Threads, reopening, the buffered fallback, durability.
# ==========================================================================


def test_concurrent_stores_from_threads(gen, tmp_path):
    e, memory, cache = make("vllm_packed", gen, d=Dims(nl=3, nh=2, nt=4, hd=8, blocks=32))
    before = snapshot(memory)
    errors, handles = [], []
    with pool_for(tmp_path, cache, num_slots=32, bounce_bytes=12 * 8192) as pool:
        def worker(t):
            try:
                for r in range(4):
                    ids = [t * 8 + r * 2, t * 8 + r * 2 + 1]
                    handles.append(pool.store(cache, ids, ids, timeout=30))
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for h in handles:
            h.wait(30)
        generations = [g for h in handles for g in h.generations]
        assert sorted(generations) == list(range(1, 33))
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, d=Dims(nl=3, nh=2, nt=4, hd=8, blocks=32))
        for first in range(0, 32, 8):
            pool.load(list(range(first, first + 8)), dst_cache, list(range(31 - first, 23 - first, -1))).wait(30)
    d = Dims(nl=3, nh=2, nt=4, hd=8, blocks=32)
    expect_round_trip(e, before, e, dst_mem, dst_want, list(range(32)), list(range(31, -1, -1)), d, d)


def test_reopen_keeps_every_completed_store(gen, tmp_path):
    e, memory, cache = make("vllm_packed", gen)
    before = snapshot(memory)
    path = tmp_path / "kv.pool"
    with DiskPool(path, 8, cache) as pool:          # create=None: no file, so a new pool
        first = pool.store(cache, [0, 1, 2], [0, 1, 2], keys=[b"a", b"b", b"c"])
        first.wait(30)
        second = pool.store(cache, [3], [1])
        second.wait(30)
        stored = pool.stored()
        with pytest.raises(BlockingIOError, match="another DiskPool"):
            DiskPool(path)
    with DiskPool(path) as pool:                    # create=None: the file is there, so it is opened
        assert pool.stored() == stored == {0: (1, b"a"), 1: (4, b""), 2: (3, b"c")}
        assert pool.num_slots == 8 and pool.layout["dtype"] == "bfloat16"
        later = pool.store(cache, [4], [5])
        later.wait(30)
        assert later.generations == (5,)
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([0, 1, 2, 5], dst_cache, [6, 5, 4, 3]).wait(30)
    expect_round_trip(e, before, e, dst_mem, dst_want, [0, 3, 2, 4], [6, 5, 4, 3])
    _, _, other = make("vllm_packed", gen, d=Dims(nl=3, nh=4, nt=4, hd=8, blocks=7))
    with pytest.raises(ValueError, match="holds slots of dims 'bhlktd', 2 heads.*like describes dims 'bhlktd', 4 heads"):
        DiskPool(path, like=other)
    with pytest.raises(ValueError, match="num_slots: .* holds 8 slots, not 9"):
        DiskPool(path, 9)
    with DiskPool(path, 8, cache, create=True) as pool:      # create=True: a new, empty pool
        assert pool.stored() == {}
    (tmp_path / "not.pool").write_bytes(b"hello" * 1000)
    with pytest.raises(ValueError, match="not a kvbm_ext disk pool"):
        DiskPool(tmp_path / "not.pool")


def test_buffered_where_o_direct_is_refused(gen, tmp_path, monkeypatch, caplog):
    """A filesystem that refuses O_DIRECT at open (EINVAL: tmpfs before Linux 6.6) gets
    buffered I/O, said by pool.direct and the debug log; direct=True refuses it."""
    e, memory, cache = make("vllm_packed", gen)
    before = snapshot(memory)
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr("kvbm_ext.disk.os.open", refusing_open)
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        pool = pool_for(tmp_path, cache)
    assert not pool.direct and "EINVAL" in pool.direct_reason
    assert any("O_DIRECT refused" in r.getMessage() for r in caplog.records)
    assert any("buffered: the filesystem refuses O_DIRECT" in r.getMessage() and pool.engine in r.getMessage()
               for r in caplog.records)
    assert pool.gds.startswith("not tried: GDS needs O_DIRECT")
    with pool:
        pool.store(cache, [2, 5], [1, 3]).wait(30)
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([3, 1], dst_cache, [0, 6]).wait(30)
    expect_round_trip(e, before, e, dst_mem, dst_want, [5, 2], [0, 6])
    with pytest.raises(OSError, match="direct=True, but its filesystem refuses O_DIRECT"):
        pool_for(tmp_path, cache, name="d.pool", direct=True)


@pytest.mark.parametrize("direct", [True, False])
def test_durable_and_flush(direct, gen, tmp_path):
    e, memory, cache = make("vllm_packed", gen)
    before = snapshot(memory)
    with pool_for(tmp_path, cache, durable=True, direct=direct) as pool:
        assert pool.durable and pool.direct is direct
        pool.store(cache, [1], [2]).wait(30)
        pool.flush()
    with DiskPool(tmp_path / "kv.pool") as pool:
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([2], dst_cache, [0]).wait(30)
    expect_round_trip(e, before, e, dst_mem, dst_want, [1], [0])


def test_the_engine_is_named(gen, tmp_path):
    _, memory, cache = make("vllm_packed", gen)
    with pool_for(tmp_path, cache) as pool:
        assert pool.engine == "NIXL POSIX (Linux AIO)" and pool.direct and pool.gds
    with pool_for(tmp_path, cache, name="u.pool", engine="POSIX",
                  engine_params={"use_aio": "false", "use_uring": "true"}) as pool:
        assert pool.engine == "NIXL POSIX (io_uring)" and pool.gds == "not tried (engine='POSIX')"
        pool.store(cache, [0], [0]).wait(30)
        poison_(memory)
        pool.load([0], cache, [1]).wait(30)


# ==========================================================================
# The example and the benchmark, on the CPU.
# ==========================================================================


@pytest.mark.slow
def test_the_cpu_example_runs(tmp_path):
    from support.disk import run_child

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "disk_tier_cpu.py")
    result = run_child(f"import runpy, sys; sys.argv = [{script!r}, '--dir', {str(tmp_path)!r}]; "
                       "sys.exit(runpy.run_path(sys.argv[0], run_name='__main__'))")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-exact: True" in result.stdout and "corrupted slot refused" in result.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu(tmp_path):
    import csv

    from support.disk import run_child

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "disk.py")
    out, files = tmp_path / "out", tmp_path / "files"
    files.mkdir()
    result = run_child(f"import runpy, sys; sys.argv = [{bench!r}, '--device', 'cpu', '--quick', '--blocks', '2,4', "
                       f"'--gemms', '2', '--gemm-n', '64', '--dir', {str(files)!r}, '--out', {str(out)!r}]; "
                       f"sys.path.insert(0, {os.path.dirname(bench)!r}); "
                       "sys.exit(runpy.run_path(sys.argv[0], run_name='__main__'))")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (csv_path,) = [p for p in os.listdir(out) if p.endswith(".csv")]
    with open(out / csv_path) as f:
        rows = list(csv.DictReader(f))
    kinds = {(r["kind"], r["source"], r["blocks"]) for r in rows}
    for source in ("host", "pool"):
        for n in ("2", "4"):
            assert ("store", source, n) in kinds and ("load", source, n) in kinds
    assert all(r["verified"] == "True" for r in rows if r["kind"] == "load")
    assert all(float(r["reference_gbs"]) > 0 for r in rows if r["kind"] in ("store", "load"))
    assert {"crc32c", "gemm alone", "gemm beside stores"} <= {r["kind"] for r in rows}
    assert "every load bit-exact: yes" in result.stdout
    assert os.listdir(files) == []           # the pool and dd files are gone
