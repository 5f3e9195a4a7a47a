"""Staged to_cache calls for compute-sanitizer, without torch (whose start under memcheck
outlasts any test: docs/internals.md, "Sanitizers").

CuPy device caches (vLLM's packed K|V, per layer [blocks, nt, nh, 2 * hd]) to and from a
pinned universal pool from kvbm_ext.pinned_empty, with staging cut small (1 MiB) so that
a call runs in many pieces through a ring of slots: stores and loads of 1 to 40 blocks,
deferred to the enqueue thread and enqueued by the caller, bursts on two streams sharing
one lane and on a lane each.  Every byte is checked against a NumPy reference; a mismatch
exits 1.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/memcheck_staged.py
"""
import sys

import cupy as cp
import numpy as np

import kvbm_ext

NL, NH, NT, HD, BLOCKS = 4, 2, 16, 64, 96


def device_cache(rng):
    layers = [cp.asarray(rng.integers(0, 1 << 16, (BLOCKS, NT, NH, 2 * HD), dtype=np.uint16)) for _ in range(NL)]
    return layers, kvbm_ext.PagedKVCache(layers, "bth(kd)")


def pinned_pool(rng):
    buffer = kvbm_ext.pinned_empty((BLOCKS, NH, NL, 2, NT, HD), np.uint16)
    pool = np.asarray(buffer)
    pool[...] = rng.integers(0, 1 << 16, pool.shape, dtype=np.uint16)
    return buffer, pool, kvbm_ext.PagedKVCache(pool, "bhlktd")


def as_universal(layers, ids):
    """[len(ids), NH, NL, 2, NT, HD] of the device blocks ids, by NumPy."""
    blocks = np.stack([cp.asnumpy(layer)[ids] for layer in layers], axis=1)    # [b, l, t, h, 2*hd]
    return blocks.reshape(len(ids), NL, NT, NH, 2, HD).transpose(0, 3, 1, 4, 2, 5)


def check(what, got, want):
    if not np.array_equal(got, want):
        print(f"memcheck_staged: {what}: bytes differ", file=sys.stderr)
        sys.exit(1)


def round_trip(rng, layers, cache, pool, pool_cache, streams, nb, defer):
    """Stores nb random blocks into random slots, then loads them into other blocks, one
    call a stream, alternating."""
    src, slots, dst = (rng.permutation(BLOCKS)[:nb] for _ in range(3))
    stream = streams[nb % len(streams)]
    want_pool = pool.copy()
    want_pool[slots] = as_universal(layers, src)
    done = cache.to_cache(pool_cache, src, slots, stream=stream, defer=defer)
    if done is not None:
        done.result(60)
    stream.synchronize()
    check(f"store of {nb} blocks, defer={defer}", pool, want_pool)
    want_layers = [cp.asnumpy(layer) for layer in layers]
    for l in range(NL):
        want_layers[l][dst] = pool[slots][:, :, l].transpose(0, 3, 1, 2, 4).reshape(nb, NT, NH, 2 * HD)
    done = pool_cache.to_cache(cache, slots, dst, stream=stream, defer=defer)
    if done is not None:
        done.result(60)
    stream.synchronize()
    for l in range(NL):
        check(f"load of {nb} blocks, defer={defer}, layer {l}", cp.asnumpy(layers[l]), want_layers[l])


def burst(rng, layers, cache, pool, pool_cache, streams):
    """Deferred stores on alternating streams, back to back, into disjoint slots, and one
    the caller enqueues among them; checked once all ended."""
    slots = rng.permutation(BLOCKS)
    want_pool = pool.copy()
    handles = []
    for k in range(8):
        src = rng.permutation(BLOCKS)[:12]
        into = slots[12 * k:12 * (k + 1)]
        want_pool[into] = as_universal(layers, src)
        handles.append(cache.to_cache(pool_cache, src, into, stream=streams[k % 2], defer=k != 5))
    for done in handles:
        if done is not None:
            done.result(60)
    for stream in streams:
        stream.synchronize()
    check("burst of stores", pool, want_pool)


def main():
    print("memcheck_staged: started", flush=True)
    rng = np.random.default_rng(20261129)
    layers, cache = device_cache(rng)
    buffer, pool, pool_cache = pinned_pool(rng)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    for lanes in (1, 2):
        kvbm_ext.set_staging(1 << 20, lanes=lanes)
        # The caller's own enqueue first: under compute-sanitizer a deferred call made before
        # any kernel of ours ever ran in the process hangs (reserve_staging() or not; seen on
        # an H200 on 2026-11-29, never without the sanitizer), and runs once one has.
        for defer in (False, True):
            for nb in (1, 5, 40):
                round_trip(rng, layers, cache, pool, pool_cache, streams, nb, defer)
                print(f"memcheck_staged: lanes={lanes} defer={defer} nb={nb}: every byte right", flush=True)
        burst(rng, layers, cache, pool, pool_cache, streams)
        print(f"memcheck_staged: lanes={lanes} burst: every byte right", flush=True)
    buffer.close()


if __name__ == "__main__":
    main()
