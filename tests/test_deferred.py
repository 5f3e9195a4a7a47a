"""PagedKVCache.to_cache(..., defer=True): the staged pieces enqueued by the device's enqueue
thread after the call returned, the caller's stream made to wait for them (kvbm_ext.Deferred
says when they are enqueued, or why that failed).

On the CPU: the argument and the Deferred object.  On the GPU: bytes against the plain-torch
reference of test_cache_to_cache.py, both directions, from one block to many pieces; a GPU
sleep before the call, so that reading the result after the caller's stream alone (no device
synchronize) would catch a stream that went on before the pieces ran; bursts on two streams
beside calls their caller enqueues; set_staging while deferred calls wait; the debug line.
"""

import logging

import pytest
import torch

import kvbm_ext
from support.asserts import assert_bitwise_equal, poison_
from support.devices import SLEEP_CYCLES, sync
from support.engines import Dims
from support.references import as_int
from test_cache_to_cache import D, make, random_ids, reference, run_and_check, snapshot

# Llama-like rows: a 1.5 MiB block, so that 64 blocks run in many pieces.
ROWS = Dims(nl=24, nh=8, nt=16, hd=128, blocks=80)


# ==========================================================================
# On the CPU.
# ==========================================================================


def test_defer_on_the_cpu_returns_a_done_deferred(gen):
    src, src_mem, src_cache = make("vllm_packed", gen)
    dst, dst_mem, dst_cache = make("universal_pool", gen)
    src_ids, dst_ids = random_ids(gen)
    deferred = run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, src_ids, dst_ids, defer=True)
    assert deferred.done() and deferred.result() is None and deferred.result(0) is None
    assert deferred.result(timeout=0.5) is None
    assert repr(deferred) == "<kvbm_ext.Deferred done>"


def test_defer_false_returns_none(gen):
    src, src_mem, src_cache = make("vllm_packed", gen)
    dst, dst_mem, dst_cache = make("universal_pool", gen)
    src_ids, dst_ids = random_ids(gen)
    assert run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, src_ids, dst_ids, defer=False) is None


@pytest.mark.parametrize("bad", [1, 0, "yes", None, torch.tensor(True)])
def test_defer_takes_only_a_bool_and_writes_nothing(bad, gen):
    _, src_mem, src_cache = make("vllm_packed", gen)
    _, dst_mem, dst_cache = make("universal_pool", gen)
    poison_(dst_mem)
    before = snapshot(dst_mem)
    with pytest.raises(TypeError, match=r"^defer: expected True or False"):
        src_cache.to_cache(dst_cache, [0, 1], [2, 3], defer=bad)
    for got, want in zip(dst_mem, before):
        assert_bitwise_equal(as_int(got), want, "dst memory")


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (float("nan"), ValueError), (-0.5, ValueError),
                                     ("1", TypeError), ([1], TypeError)])
def test_deferred_result_refuses_a_bad_timeout(bad, exc, gen):
    _, _, src_cache = make("vllm_packed", gen)
    _, _, dst_cache = make("universal_pool", gen)
    deferred = src_cache.to_cache(dst_cache, [0], [1], defer=True)
    with pytest.raises(exc, match=r"^timeout: expected"):
        deferred.result(bad)
    with pytest.raises(TypeError):
        deferred.result(1, 2)
    with pytest.raises(TypeError):
        deferred.result(seconds=1)


def test_deferred_is_not_made_from_python():
    with pytest.raises(TypeError):
        kvbm_ext.Deferred()


# ==========================================================================
# On the GPU.
# ==========================================================================


def staged_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "kvbm_ext" and "path staged" in r.getMessage()]


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["universal_pool", "vllm_packed", "hicache_layer_first"])
@pytest.mark.parametrize("nb", [1, 8, 64])
def test_gpu_defer_offload_and_onload_behind_a_busy_stream(pool, nb, gen, caplog, monkeypatch):
    """The caller's stream sleeps before the call; afterwards only that stream is waited
    for, so bytes read then are right only if it waited for the pieces the thread enqueued
    (64 blocks take milliseconds to cross PCIe after the sleep)."""
    dev, dev_mem, dev_cache = make("vllm_flash_attn", gen, "cuda", d=ROWS)
    host, host_mem, host_cache = make(pool, gen, pin=True, d=ROWS)
    src_ids, dst_ids = random_ids(gen, nb=nb, blocks=ROWS.blocks)
    back = torch.randperm(ROWS.blocks, generator=gen)[:nb].tolist()
    stream = torch.cuda.Stream()
    # Warm-up: the first deferred call of a staging starts its thread and loads the kernels,
    # which waits for the device.
    dev_cache.to_cache(host_cache, src_ids[:1], dst_ids[:1], stream=stream.cuda_stream, defer=True).result(10)
    stream.synchronize()
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        for src, src_mem, src_cache, dst, dst_mem, dst_cache, ids in (
                (dev, dev_mem, dev_cache, host, host_mem, host_cache, (src_ids, dst_ids)),
                (host, host_mem, host_cache, dev, dev_mem, dev_cache, (dst_ids, back))):
            with torch.cuda.stream(stream):
                poison_(dst_mem)
            stream.synchronize()
            src_before, want = snapshot(src_mem), snapshot(dst_mem)
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # on the current stream, which `stream` follows
            stream.wait_stream(torch.cuda.current_stream())
            deferred = src_cache.to_cache(dst_cache, *ids, stream=stream.cuda_stream, defer=True)
            assert not stream.query()
            stream.synchronize()
            got = snapshot(dst_mem)  # now: the reference takes longer than the pieces would
            assert deferred.result(10) is None
            reference(src, dst, src_before, want, *ids, ROWS, ROWS)
            for i, (g, w) in enumerate(zip(got, want)):
                assert_bitwise_equal(g, w, f"dst memory #{i}")
    lines = staged_lines(caplog)
    assert len(lines) == 2 and all("enqueued by the device's enqueue thread" in line for line in lines), lines


@pytest.mark.gpu
def test_gpu_defer_without_staging_runs_during_the_call(gen, caplog, monkeypatch):
    """Ids of the pinned cache on the device: the kernel alone, enqueued by the call itself;
    the Deferred is done when it returns."""
    dev, dev_mem, dev_cache = make("vllm_packed", gen, "cuda")
    host, host_mem, host_cache = make("universal_pool", gen, pin=True)
    src_ids, dst_ids = random_ids(gen)
    ids = (torch.tensor(src_ids, device="cuda"), torch.tensor(dst_ids, device="cuda"))
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        deferred = run_and_check(dev, dev_mem, dev_cache, host, host_mem, host_cache, src_ids, dst_ids,
                                 call_ids=ids, defer=True)
    assert deferred.done() and repr(deferred) == "<kvbm_ext.Deferred done>"
    assert not staged_lines(caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("timeout", [float("inf"), 1e300])
def test_gpu_deferred_result_with_a_boundless_timeout_waits(timeout, gen):
    """A timeout past any clock waits unbounded (asked before the thread can have run the
    call: such a deadline once overflowed into the past and timed out at once)."""
    dev, dev_mem, dev_cache = make("vllm_packed", gen, "cuda", d=ROWS)
    host, host_mem, host_cache = make("universal_pool", gen, pin=True, d=ROWS)
    src_ids, dst_ids = random_ids(gen, nb=64, blocks=ROWS.blocks)
    dev_cache.to_cache(host_cache, src_ids[:1], dst_ids[:1], defer=True).result(10)  # the thread started
    for _ in range(8):
        assert dev_cache.to_cache(host_cache, src_ids, dst_ids, defer=True).result(timeout) is None
    sync()


@pytest.mark.gpu
def test_gpu_defer_bursts_on_two_streams_beside_calls_the_caller_enqueues(gen):
    """Stores on one stream, loads of what they stored on another (after an event), every
    third call enqueued by its caller: the lanes see the calls in the order they were made,
    and every byte lands."""
    dev, dev_mem, dev_cache = make("vllm_flash_attn", gen, "cuda", d=ROWS)
    out, out_mem, out_cache = make("vllm_flash_attn", gen, "cuda", d=ROWS)
    host, host_mem, host_cache = make("universal_pool", gen, pin=True, d=ROWS)
    poison_(host_mem)
    poison_(out_mem)
    sync()
    dev_before, host_want, out_want = snapshot(dev_mem), snapshot(host_mem), snapshot(out_mem)
    stores, loads = torch.cuda.Stream(), torch.cuda.Stream()
    slots = torch.randperm(ROWS.blocks, generator=gen).tolist()
    targets = torch.randperm(ROWS.blocks, generator=gen).tolist()
    deferred, first = [], 0
    for k, nb in enumerate([1, 8, 3, 16, 2, 24, 5, 12]):
        src_ids = torch.randint(0, ROWS.blocks, (nb,), generator=gen).tolist()
        dst_ids, back = slots[first:first + nb], targets[first:first + nb]
        first += nb
        defer = k % 3 != 2
        deferred.append(dev_cache.to_cache(host_cache, src_ids, dst_ids, stream=stores.cuda_stream, defer=defer))
        stored = torch.cuda.Event()
        stored.record(stores)
        loads.wait_event(stored)
        deferred.append(host_cache.to_cache(out_cache, dst_ids, back, stream=loads.cuda_stream, defer=defer))
        reference(dev, host, dev_before, host_want, src_ids, dst_ids, ROWS, ROWS)
        reference(host, out, host_want, out_want, dst_ids, back, ROWS, ROWS)
    loads.synchronize()
    stores.synchronize()
    for d in deferred:
        assert d is None or d.result(10) is None
    for got, want in zip(host_mem, host_want):
        assert_bitwise_equal(as_int(got), want, "pinned pool")
    for got, want in zip(out_mem, out_want):
        assert_bitwise_equal(as_int(got), want, "loaded cache")


@pytest.mark.gpu
def test_gpu_set_staging_while_deferred_calls_wait(gen, monkeypatch):
    """set_staging frees the staging and its thread once every deferred call handed to it is
    enqueued: calls waiting behind a GPU sleep still land, and later calls use the new
    staging."""
    defaults = kvbm_ext.staging_info()
    dev, dev_mem, dev_cache = make("vllm_flash_attn", gen, "cuda", d=ROWS)
    host, host_mem, host_cache = make("universal_pool", gen, pin=True, d=ROWS)
    try:
        for lanes in (3, 1):
            poison_(host_mem)
            sync()
            dev_before, want = snapshot(dev_mem), snapshot(host_mem)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES // 10)
            deferred = []
            for part in range(4):
                src_ids = torch.randint(0, ROWS.blocks, (16,), generator=gen).tolist()
                dst_ids = list(range(part * 16, part * 16 + 16))
                deferred.append(dev_cache.to_cache(host_cache, src_ids, dst_ids, stream=stream.cuda_stream,
                                                   defer=True))
                reference(dev, host, dev_before, want, src_ids, dst_ids, ROWS, ROWS)
            kvbm_ext.set_staging(64 << 20, lanes=lanes)
            stream.synchronize()
            for d in deferred:
                assert d.result(10) is None
            for got, w in zip(host_mem, want):
                assert_bitwise_equal(as_int(got), w, "pinned pool")
            assert kvbm_ext.staging_info()["lanes"] == lanes
    finally:
        sync()
        kvbm_ext.set_staging(defaults["size_bytes"], lanes=defaults["lanes"])
