"""What the disk tier's tests share (tests/test_disk*.py): whether NIXL is here, engine
caches built from tests/support/engines.py, the plain-torch reference of a round trip
through a pool (universal slots written from an engine's rows), the bytes of a slot in
the file, and a driver held still so that a transfer stays pending.
"""

import os
import threading

import pytest
import torch

from support.asserts import assert_bitwise_equal, poison_
from support.engines import ENGINES, Dims
from support.references import as_int

# NIXL's Python logger prints INFO lines on stdout when an agent is made.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _nixl_missing():
    from kvbm_ext import disk

    try:
        disk._import_nixl()
    except ImportError as error:
        return str(error)
    return None


NIXL_MISSING = _nixl_missing()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"needs NIXL: {NIXL_MISSING}")

D = Dims(nl=3, nh=2, nt=4, hd=8, blocks=7)


def make(name, gen, d=D, dtype=torch.bfloat16, device="cpu", pin=False):
    """(engine, memory, PagedKVCache) of engine `name`, random bytes."""
    e = ENGINES[name]
    memory = e.allocate(d, dtype, gen, device, pin)
    return e, memory, e.build(memory, d)


def snapshot(memory):
    return [as_int(x.detach()).cpu().clone() for x in memory]


def universal_rows(engine, memory, d, block):
    """Block `block` of an engine cache in universal order [nh, nl, no, nt, hd] (integers)."""
    rows = engine.rows([x.cpu() for x in memory], d)
    return torch.stack([torch.stack([rows[l][o][block].transpose(0, 1) for o in range(engine.no)], 1)
                        for l in range(d.nl)], 1)


def slot_bytes_in_file(pool, slot):
    """The payload of `slot` as the file holds it (read through a plain descriptor)."""
    with open(pool.path, "rb") as f:
        f.seek(pool._geometry.payload_offset(slot))
        return f.read(pool.slot_bytes)


def file_slot_as(pool, slot, like):
    """The file's payload of `slot` viewed as `like` (a tensor of the slot's shape)."""
    raw = torch.frombuffer(bytearray(slot_bytes_in_file(pool, slot)), dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape)


def expect_round_trip(src, src_before, dst, dst_mem, dst_want, src_ids, dst_ids, d_src=D, d_dst=D, layers=None,
                      heads=None, layer_offset=0, head_offset=0, pack_layers=False, what="dst memory"):
    """dst memory == dst_want with rows (dst_ids[b], l', o, t, head_offset + j) set from src rows
    (src_ids[b], l, o, t, heads[j]), layers numbered as to_cache numbers them; every byte compared."""
    from support.references import selected

    src_rows = src.rows(src_before, d_src)
    want_rows = dst.rows(dst_want, d_dst)
    chosen = selected(d_src.nl, layers)
    for s, t in zip(src_ids, dst_ids):
        for j_layer, l in enumerate(chosen):
            target = layer_offset + (j_layer if pack_layers else l)
            for o in range(src.no):
                for j, h in enumerate(selected(src.dims(d_src).nh, heads)):
                    want_rows[target][o][t][:, head_offset + j] = src_rows[l][o][s][:, h]
    for i, (got, want) in enumerate(zip(dst_mem, dst_want)):
        assert_bitwise_equal(as_int(got), want, f"{what} #{i}")


def poisoned_copy(name, gen, d=D, dtype=torch.bfloat16, device="cpu"):
    """An engine cache whose memory is all poison, with a CPU snapshot of it."""
    e, memory, cache = make(name, gen, d, dtype, device)
    poison_(memory)
    return e, memory, cache, snapshot(memory)


class HeldDriver:
    """Holds the background driver thread inside a job's step until released, so that every
    transfer submitted meanwhile stays pending (the driver steps its jobs one at a time)."""

    def __init__(self):
        from kvbm_ext import _driver

        self.release, self.entered = threading.Event(), threading.Event()
        driver = self

        class Hold:
            deadline = None
            handle = _driver.Handle("held driver")

            def step(self):
                driver.entered.set()
                driver.release.wait(60)
                return _driver.DONE

            def abandon(self, error):
                pass

        self.handle = _driver.submit(Hold())
        assert self.entered.wait(10), "the driver did not take the holding job"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.handle.wait(10)


# ----------------------------------------------------------------------------- child processes
#
# The integrity tests run these in a child (`python -c`, see run_child): a process killed
# mid-store, one under RLIMIT_FSIZE, one in a mount namespace of its own, one that is not
# root.  Each prints one JSON line of what it saw, last.

CRASH_DIMS = dict(num_heads=8, num_layers=64, num_outer=2, tokens_per_block=16, head_dim=128, dtype="bfloat16")
CRASH_SLOTS, CRASH_KEPT = 16, 4       # the last CRASH_KEPT slots are stored once, before the loop


def crash_blocks(round_):
    """The blocks the crash child stores in round `round_` ([CRASH_SLOTS, nh, nl, 2, nt, hd]
    int16): fixed random bytes, each block's first row stamped with the round and slot."""
    d = CRASH_DIMS
    g = torch.Generator().manual_seed(1234)
    blocks = torch.randint(-2**15, 2**15, (CRASH_SLOTS, d["num_heads"], d["num_layers"], 2, d["tokens_per_block"],
                                           d["head_dim"]), dtype=torch.int16, generator=g)
    blocks[:, 0, 0, 0, 0, 0] = round_
    blocks[:, 0, 0, 0, 0, 1] = torch.arange(CRASH_SLOTS)
    return blocks


def run_child(code, *args, prefix=(), timeout=120, env=None):
    """Runs `code` (Python) in a child with the repository and tests/ importable; returns
    the CompletedProcess."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")])
    full_env = dict(os.environ, PYTHONPATH=path, **(env or {}))
    return subprocess.run([*prefix, sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def child_store_loop(path):
    """Stores CRASH_KEPT slots once, then rounds of the other slots until killed, printing
    'start R' before each store and 'done R' once it completed."""
    import kvbm_ext
    from kvbm_ext.disk import DiskPool

    pool = DiskPool(path, create=False)
    round_ = 0
    blocks = crash_blocks(round_)
    cache = kvbm_ext.PagedKVCache(blocks.view(torch.bfloat16), "bhlktd")
    kept = list(range(CRASH_SLOTS - CRASH_KEPT, CRASH_SLOTS))
    pool.store(cache, kept, kept, keys=[b"0"] * CRASH_KEPT).wait(60)
    looped = list(range(CRASH_SLOTS - CRASH_KEPT))
    while True:
        round_ += 1
        blocks[:, 0, 0, 0, 0, 0] = round_
        print(f"start {round_}", flush=True)
        pool.store(cache, looped, looped, keys=[str(round_).encode()] * len(looped)).wait(60)
        print(f"done {round_}", flush=True)
