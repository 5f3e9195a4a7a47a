"""kvbm_ext.disk with GPU caches (marked gpu): Llama-3.1-70B blocks (8 of its 80 layers) to
a pool file and back, bit for bit; the stream-ordering traps: a store reads the blocks as
the caller's stream has them when the call returns (a kernel overwriting them right after
the call does not reach the file), a load writes them after the caller's stream's work at
the call and reports done only once the blocks are written, a load's handle orders a
stream after its write (wait_stream); a load whose slot fails leaves that block untouched.
"""

import pytest
import torch

import kvbm_ext
from kvbm_ext.disk import DiskPool, SlotError
from support.asserts import assert_poisoned
from support.devices import SLEEP_CYCLES, sync
from support.disk import expect_round_trip, file_slot_as, make, needs_nixl, poisoned_copy, snapshot, universal_rows
from support.engines import ENGINES, Dims

pytestmark = [needs_nixl, pytest.mark.gpu]

LLAMA = Dims(nl=8, nh=8, nt=16, hd=128, blocks=24)     # Llama-3.1-70B's block, 8 layers of its 80


@pytest.fixture
def gpu_pool(tmp_path, gen):
    """A vLLM packed-K|V cache on the GPU, random bytes, and a 32-slot pool for it; the
    device's staging memory and kernels loaded first (a kernel's first launch waits for an
    idle device, which would hide the ordering under test)."""
    kvbm_ext.reserve_staging()
    e, memory, cache = make("vllm_packed", gen, d=LLAMA, device="cuda")
    sync()
    with DiskPool(tmp_path / "gpu.pool", 32, cache) as pool:
        pool.store(cache, [0], [31]).wait(60)
        pool.load([31], cache, [0]).wait(60)
        yield e, memory, cache, pool


def stored_and_a_poisoned_cache(gpu_pool, gen, blocks, slots):
    """Blocks `blocks` of the GPU pool's cache stored in `slots` (waited for), and a poisoned
    vLLM packed-K|V cache on the GPU to load them into, the device idle: (engine, the pool,
    the source's bytes before, the destination's memory, cache and expected bytes)."""
    e, memory, cache, pool = gpu_pool
    before = snapshot(memory)
    pool.store(cache, blocks, slots).wait(60)
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, d=LLAMA, device="cuda")
    sync()
    return e, pool, before, dst_mem, dst_cache, dst_want


def test_round_trip_bit_exact(gpu_pool, gen):
    e, memory, cache, pool = gpu_pool
    before = snapshot(memory)
    src = torch.tensor([3, 17, 5, 22, 0, 9], device="cuda")          # ids on the device
    h = pool.store(cache, src, [0, 1, 2, 3, 4, 5])
    h.wait(60)
    assert h.error is None and h.nbytes == 6 * 8 * 8 * 2 * 16 * 128 * 2
    for b, s in zip(src.tolist(), range(6)):
        want = universal_rows(e, before, LLAMA, b)
        assert torch.equal(file_slot_as(pool, s, want), want), f"slot {s} in the file"
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, d=LLAMA, device="cuda")
    h = pool.load([5, 4, 3, 2, 1, 0], dst_cache, [0, 1, 2, 3, 4, 23])
    h.wait(60)
    expect_round_trip(e, before, e, dst_mem, dst_want, [9, 0, 22, 5, 17, 3], [0, 1, 2, 3, 4, 23], LLAMA, LLAMA)
    # and into a host cache, from the same slots
    _, host_mem, host_cache, host_want = poisoned_copy("transformers", gen, d=LLAMA)
    pool.load([0, 1], host_cache, [7, 8]).wait(60)
    expect_round_trip(e, before, ENGINES["transformers"], host_mem, host_want, [3, 17], [7, 8], LLAMA, LLAMA)


def test_a_store_sees_the_blocks_as_the_callers_stream_leaves_them(gpu_pool, gen):
    """The caller's stream sleeps, writes fresh blocks, calls store, and overwrites the
    blocks at once: the file gets the fresh blocks (the copy is ordered after the writes and
    before the overwrite, on the caller's stream), and the call does not wait for the GPU."""
    e, memory, cache, pool = gpu_pool
    fresh = [torch.randint(-2**15, 2**15, m.shape, dtype=torch.int16, device="cuda").view(m.dtype) for m in memory]
    sync()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        for m, f in zip(memory, fresh):
            m.copy_(f)
        h = pool.store(cache, [2, 11], [6, 7])
        assert not stream.query(), "the store call waited for the caller's stream"
        for m in memory:
            m.fill_(0)                                   # the trap: reuse the blocks at once
    h.wait(60)
    sync()
    want = snapshot(fresh)
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, d=LLAMA, device="cuda")
    pool.load([6, 7], dst_cache, [20, 21]).wait(60)
    expect_round_trip(e, want, e, dst_mem, dst_want, [2, 11], [20, 21], LLAMA, LLAMA)


def test_a_load_is_ordered_after_the_callers_stream_and_done_once_written(gpu_pool, gen):
    """The caller's stream sleeps, then writes the destination blocks, then calls load: the
    load's write lands after that write (the blocks end up loaded), and the handle is done
    only once they are written (a stream with no other wait reads them at once)."""
    e, pool, before, dst_mem, dst_cache, dst_want = stored_and_a_poisoned_cache(gpu_pool, gen, [4, 8], [10, 11])
    caller, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)
        for m in dst_mem:
            m.view(torch.int16).fill_(0x0A5A)             # the caller's last write before the load
        h = pool.load([10, 11], dst_cache, torch.tensor([5, 6], device="cuda"))
    h.wait(60)
    with torch.cuda.stream(other):
        at_done = [m.clone() for m in dst_mem]
    sync()
    filled = [torch.full_like(w, 0x0A5A) for w in dst_want]
    for got, what in ((at_done, "when the handle was done"), (dst_mem, "at the end")):
        expect_round_trip(e, before, e, got, [f.clone() for f in filled], [4, 8], [5, 6], LLAMA, LLAMA, what=what)


def test_wait_stream_orders_a_stream_after_the_load(gpu_pool, gen):
    """A stream ordered by handle.wait_stream reads the loaded blocks, though the write is
    queued behind the caller's sleeping stream."""
    e, pool, before, dst_mem, dst_cache, dst_want = stored_and_a_poisoned_cache(gpu_pool, gen, [7, 9], [20, 21])
    caller, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)
        h = pool.load([20, 21], dst_cache, [2, 3])
    h.wait_stream(reader)
    with torch.cuda.stream(reader):
        seen = [m.clone() for m in dst_mem]
    reader.synchronize()
    h.wait(60)
    expect_round_trip(e, before, e, seen, dst_want, [7, 9], [2, 3], LLAMA, LLAMA)


def test_a_failing_slot_leaves_its_block_untouched(gpu_pool, gen):
    e, memory, cache, pool = gpu_pool
    before = snapshot(memory)
    pool.store(cache, [1, 2, 3], [12, 13, 14]).wait(60)
    at = pool._geometry.payload_offset(13) + 4099
    with open(pool.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x80]))
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, d=LLAMA, device="cuda")
    h = pool.load([12, 13, 14], dst_cache, torch.tensor([4, 5, 6], device="cuda"))
    with pytest.raises(SlotError, match="slot 13: its payload fails its checksum"):
        h.wait(60)
    assert len(pool._free) == pool.bounce_slots            # the failed load gave its bounce slots back
    sync()
    rows = e.rows(dst_mem, LLAMA)
    for layer in rows:
        for outer in layer:
            assert_poisoned(outer[5], "block 5, whose slot failed")
    expect_round_trip(e, before, e, dst_mem, dst_want, [1, 3], [4, 6], LLAMA, LLAMA)
