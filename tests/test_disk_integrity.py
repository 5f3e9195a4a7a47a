"""kvbm_ext.disk: never a wrong byte.  A slot never written, written for another layout or
pool, misplaced, of another generation, torn by a crash (a child killed with SIGKILL
mid-store), corrupted on disk (a flipped byte in a payload or a header) or cut short by a
truncated file is an error naming the slot, and its block is never written; a full disk
(ENOSPC on a small tmpfs in a mount namespace of its own, EFBIG under RLIMIT_FSIZE) and a
read-only file are clear errors that leave the source blocks untouched; reopening after a
crash keeps every slot whose store completed.
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import kvbm_ext
from kvbm_ext.disk import DiskPool, SlotError
from support.asserts import assert_poisoned
from support.disk import (CRASH_DIMS, CRASH_KEPT, CRASH_SLOTS, D, crash_blocks, expect_round_trip, make, needs_nixl,
                          poisoned_copy, run_child, snapshot)
from support.engines import ENGINES, Dims

pytestmark = needs_nixl


def stored_pool(tmp_path, gen, name="kv.pool", d=D, slots=(1, 3), blocks=(6, 2)):
    """A pool with blocks of a vLLM cache stored in slots; (engine, source memory snapshot, pool)."""
    e, memory, cache = make("vllm_packed", gen, d=d)
    pool = DiskPool(tmp_path / name, 8, cache, create=True)
    pool.store(cache, list(blocks), list(slots)).wait(30)
    return e, snapshot(memory), pool


def patch_file(path, offset, data):
    """Writes bytes into the pool file behind the pool's back (a plain descriptor)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def read_file(path, offset, n):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def load_failing(pool, gen, slots, block_ids, reason):
    """Loads slots into a poisoned cache: SlotError naming each failing slot with `reason`
    (a regex per slot); those blocks stay poisoned, the others are written."""
    e, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
    h = pool.load(slots, dst_cache, block_ids)
    with pytest.raises(SlotError) as raised:
        h.wait(30)
    assert set(raised.value.reasons) == set(reason)
    for slot, words in reason.items():
        assert __import__("re").search(words, raised.value.reasons[slot]), raised.value.reasons[slot]
        assert f"slot {slot}: " in str(raised.value)
    failed = [b for s, b in zip(slots, block_ids) if s in reason]
    rows = e.rows(dst_mem, D)
    for b in failed:
        for layer in rows:
            for outer in layer:
                assert_poisoned(outer[b], f"block {b} of a slot that failed")
    assert len(pool._free) == pool.bounce_slots            # the failed load gave its bounce slots back
    return e, dst_mem, dst_want


def test_never_written(gen, tmp_path):
    e, before, pool = stored_pool(tmp_path, gen)
    with pool:
        _, dst_mem, dst_want = load_failing(pool, gen, [1, 0], [4, 5], {0: "never written"})
    expect_round_trip(e, before, e, dst_mem, dst_want, [6], [4])   # slot 1 was written, in the same call


def test_flipped_payload_byte(gen, tmp_path):
    e, before, pool = stored_pool(tmp_path, gen)
    with pool:
        at = pool._geometry.payload_offset(3) + 517
        patch_file(pool.path, at, bytes([read_file(pool.path, at, 1)[0] ^ 0x10]))
        _, dst_mem, dst_want = load_failing(pool, gen, [1, 3], [0, 2], {3: "payload fails its checksum"})
    expect_round_trip(e, before, e, dst_mem, dst_want, [6], [0])


@pytest.mark.parametrize("reopen", [False, True])
def test_flipped_header_byte(reopen, gen, tmp_path):
    _, _, pool = stored_pool(tmp_path, gen)
    at = pool._geometry.header_offset(3) + 44              # inside the generation
    patch_file(pool.path, at, bytes([read_file(pool.path, at, 1)[0] ^ 0x01]))
    if reopen:
        pool.close()
        pool = DiskPool(pool.path)
        assert 3 not in pool.stored()
    with pool:
        load_failing(pool, gen, [3], [1], {3: ("holds no completed store: " if reopen else "^") +
                                           r"its header fails its checksum \(torn by a crash mid-write, or corrupted"})


def test_header_overwritten(gen, tmp_path):
    _, _, pool = stored_pool(tmp_path, gen)
    with pool:
        patch_file(pool.path, pool._geometry.header_offset(1), b"garbage!")
        load_failing(pool, gen, [1], [1], {1: "not a slot header"})


def copy_slot(src_pool, src_slot, dst_path, dst_geometry, dst_slot):
    g = src_pool._geometry
    patch_file(dst_path, dst_geometry.header_offset(dst_slot), read_file(src_pool.path, g.header_offset(src_slot), 4096))
    patch_file(dst_path, dst_geometry.payload_offset(dst_slot), read_file(src_pool.path, g.payload_offset(src_slot),
                                                                           g.stride))


@pytest.mark.parametrize("source", ["another layout", "another pool", "another slot"])
def test_slot_from_elsewhere(source, gen, tmp_path):
    """A slot's bytes copied from another layout's pool (the same slot size), another pool
    of this layout, or another slot of this pool: the header says so."""
    _, _, pool = stored_pool(tmp_path, gen)
    with pool:
        geometry, path = pool._geometry, pool.path
        if source == "another slot":
            copy_slot(pool, 1, path, geometry, 5)
        else:
            d = Dims(nl=2, nh=3, nt=4, hd=8, blocks=7) if source == "another layout" else D
            _, _, other = stored_pool(tmp_path, gen, "other.pool", d=d)
            with other:
                assert other.slot_bytes == pool.slot_bytes
                copy_slot(other, 3, path, geometry, 5)
    with DiskPool(path) as pool:
        reason = {"another layout": "written for another layout", "another pool": "written by another pool file",
                  "another slot": "its header belongs to slot 1"}[source]
        load_failing(pool, gen, [5], [0], {5: "holds no completed store: " + reason})


def test_generations(gen, tmp_path):
    """A slot's old bytes put back behind the pool (a stale copy of a block): the generation
    tells it from the last store; generations= asks for a given store."""
    e, memory, cache = make("vllm_packed", gen)
    first = snapshot(memory)
    with DiskPool(tmp_path / "kv.pool", 8, cache) as pool:
        g = pool._geometry
        one = pool.store(cache, [2], [4])
        one.wait(30)
        old = read_file(pool.path, g.header_offset(4), 4096), read_file(pool.path, g.payload_offset(4), g.stride)
        two = pool.store(cache, [5], [4])
        two.wait(30)
        assert two.generations[0] > one.generations[0]
        h = pool.load([4], cache, [0], generations=one.generations)
        with pytest.raises(SlotError, match=f"slot 4: holds generation {two.generations[0]}, not the "
                                            f"{one.generations[0]} expected"):
            h.wait(30)
        patch_file(pool.path, g.header_offset(4), old[0])
        patch_file(pool.path, g.payload_offset(4), old[1])
        load_failing(pool, gen, [4], [0], {4: f"holds generation {one.generations[0]}, not the "
                                              f"{two.generations[0]} expected"})
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([4], dst_cache, [1], generations=one.generations).wait(30)
    expect_round_trip(e, first, e, dst_mem, dst_want, [2], [1])


def test_short_file(gen, tmp_path):
    e, before, pool = stored_pool(tmp_path, gen, slots=(1, 3, 6), blocks=(6, 2, 0))
    g = pool._geometry
    pool.close()
    os.truncate(pool.path, g.payload_offset(3) + 1000)
    with DiskPool(pool.path) as pool:
        _, dst_mem, dst_want = load_failing(pool, gen, [1, 3, 6], [0, 1, 2],
                                            {3: "the file ends at byte .*truncated", 6: "truncated"})
        pool.store(make("vllm_packed", gen)[2], [0], [3]).wait(30)       # a store rewrites the missing slot
    expect_round_trip(e, before, e, dst_mem, dst_want, [6], [0])
    os.truncate(pool.path, g.header_offset(5) + 100)
    with DiskPool(pool.path) as pool:
        assert set(pool.stored()) == {1, 3}
        load_failing(pool, gen, [6], [0], {6: "the file ends before its header"})


def test_a_crash_keeps_every_completed_store(tmp_path):
    """A child stores rounds of slots and is killed (SIGKILL) at a random moment; reopened,
    every slot holds exactly the last round stored in it (its key says which) or fails,
    never anything else; the slots stored before the loop all hold their bytes; at least
    one kill tore a store (some slot fails), so the torn case is tested."""
    path = tmp_path / "crash.pool"
    code = "import sys; from support.disk import child_store_loop; child_store_loop(sys.argv[1])"
    torn = 0
    rng = random.Random(7)
    for attempt in range(10):
        DiskPool(path, CRASH_SLOTS, CRASH_DIMS, create=True).close()
        tests = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests,
                                                           os.environ.get("PYTHONPATH", "")]))
        child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env)
        done = 0
        for line in child.stdout:
            word, number = line.split()
            if word == "done":
                done = int(number)
            elif int(number) >= 3:          # a few rounds complete; kill within the next store
                time.sleep(rng.uniform(0.002, 0.03))
                break
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        for line in child.stdout:
            if line.startswith("done"):
                done = int(line.split()[1])
        out = torch.empty((CRASH_SLOTS,) + tuple(crash_blocks(0).shape[1:]), dtype=torch.bfloat16)
        cache = kvbm_ext.PagedKVCache(out, "bhlktd")
        with DiskPool(path) as pool:
            stored = pool.stored()
            for slot in range(CRASH_SLOTS):
                out.view(torch.int16).fill_(-1)
                h = pool.load([slot], cache, [slot])
                try:
                    h.wait(30)
                except SlotError as error:
                    assert slot < CRASH_SLOTS - CRASH_KEPT, f"slot {slot}, stored before the loop, fails: {error}"
                    torn += 1
                    continue
                round_ = int(stored[slot][1])
                if slot >= CRASH_SLOTS - CRASH_KEPT:
                    assert round_ == 0
                else:
                    assert round_ in (done, done + 1), (slot, round_, done)
                assert torch.equal(out.view(torch.int16)[slot], crash_blocks(round_)[slot]), (slot, round_)
        if torn:
            break
    assert torn, "no kill landed inside a store in 10 attempts: the torn case was not tested"


EFBIG_CHILD = """
import errno, json, resource, sys, torch, kvbm_ext
from kvbm_ext.disk import DiskPool, SlotError
path, new_path = sys.argv[1], sys.argv[2]
pool = DiskPool(path)
g = pool._geometry
resource.setrlimit(resource.RLIMIT_FSIZE, (g.payload_offset(5), resource.RLIM_INFINITY))
src = torch.arange(3 * 7 * 4 * 2 * 16, dtype=torch.int16).view(3, 7, 4, 2, 16).view(torch.bfloat16)
cache = kvbm_ext.PagedKVCache(list(src), "bth(kd)")
before = src.clone()
seen = {}
try:
    pool.store(cache, [1, 2], [2, 6]).wait(30)
except OSError as e:
    seen["store"] = [e.errno, str(e)]
seen["source untouched"] = torch.equal(src.view(torch.int16), before.view(torch.int16))
h = pool.load([1, 6], cache, [3, 4])
try:
    h.wait(30)
except SlotError as e:
    seen["load"] = {str(k): v for k, v in e.reasons.items()}
seen["slot 2 generation"] = pool.generation(2)
try:
    DiskPool(new_path, 64, cache, create=True)
except OSError as e:
    seen["create"] = [e.errno, str(e)]
import os
seen["new file left"] = os.path.exists(new_path)
print(json.dumps(seen))
"""


def test_efbig(gen, tmp_path):
    """Under RLIMIT_FSIZE (a child): a store reaching past the limit is OSError EFBIG naming
    its slots, the source untouched, its slots no longer loadable; the slots stored before
    still load; a pool too large to create is refused at creation, leaving no file."""
    _, before, pool = stored_pool(tmp_path, gen)
    pool.close()
    result = run_child(EFBIG_CHILD, pool.path, tmp_path / "new.pool")
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    code, message = seen["store"]
    assert code == errno.EFBIG and "slots [2, 6]" in message and "File too large" in message, message
    assert "the source blocks are untouched" in message and seen["source untouched"]
    assert list(seen["load"]) == ["6"] and "its last store (generation 4) failed: [Errno 27]" in seen["load"]["6"]
    assert seen["slot 2 generation"] == 0
    code, message = seen["create"]
    assert code == errno.EFBIG and "cannot reserve" in message and not seen["new file left"]
    with DiskPool(pool.path) as pool:
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
        pool.load([1, 3], dst_cache, [0, 1]).wait(30)
        e = ENGINES["vllm_packed"]
    expect_round_trip(e, before, e, dst_mem, dst_want, [6, 2], [0, 1])


ENOSPC_CHILD = """
import ctypes, errno, json, os, subprocess, sys, torch, kvbm_ext
from kvbm_ext.disk import DiskPool, SlotError
root = sys.argv[1]
seen = {}
like = dict(num_heads=8, num_layers=8, num_outer=2, tokens_per_block=16, head_dim=64, dtype="bfloat16")  # 256 KiB
try:
    DiskPool(os.path.join(root, "big.pool"), 64, like)
except OSError as e:
    seen["create"] = [e.errno, str(e), os.path.exists(os.path.join(root, "big.pool"))]
pool = DiskPool(os.path.join(root, "kv.pool"), 4, like, bounce_bytes=4 * (4096 + 262144))
src = torch.randint(-2**15, 2**15, (4, 8, 8, 2, 16, 64), dtype=torch.int16)
cache = kvbm_ext.PagedKVCache(src.view(torch.bfloat16), "bhlktd")
pool.store(cache, [0], [0]).wait(30)
g = pool._geometry
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(pool.path, os.O_RDWR)
# Punch slot 1's payload out of the file (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE), as a
# filesystem that cannot keep a preallocation (copy-on-write) leaves it, then fill the disk.
assert libc.fallocate(fd, 3, ctypes.c_long(g.payload_offset(1)), ctypes.c_long(g.stride)) == 0
os.close(fd)
with open(os.path.join(root, "filler"), "wb") as f:
    try:
        while True:
            f.write(b"x" * 65536)
            f.flush()
    except OSError as e:
        seen["filled"] = e.errno
before = src.clone()
try:
    pool.store(cache, [1], [1]).wait(30)
except OSError as e:
    seen["store"] = [e.errno, str(e)]
seen["source untouched"] = torch.equal(src, before)
h = pool.load([0, 1], cache, [2, 3])
try:
    h.wait(30)
except SlotError as e:
    seen["load"] = {str(k): v for k, v in e.reasons.items()}
seen["slot 0 loaded"] = torch.equal(src[2], before[0])
pool.close()
subprocess.run(["mount", "-o", "remount,ro", root], check=True)
pool = DiskPool(os.path.join(root, "kv.pool"))
seen["read-only writable"] = pool.writable
try:
    pool.store(cache, [1], [1])
except OSError as e:
    seen["read-only store"] = [e.errno, str(e)]
src[3] = 0
pool.load([0], cache, [3]).wait(30)
seen["read-only load"] = torch.equal(src[3], before[0])
print(json.dumps(seen))
"""


def namespace_reason():
    """Why this machine cannot give a child a small tmpfs of its own, or None."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    trial = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True,
                           text=True)
    if trial.returncode != 0:
        return f"a mount namespace with a tmpfs is not allowed here: {trial.stderr.strip()}"
    return None


def test_enospc_and_a_read_only_filesystem():
    """On a 2 MiB tmpfs in a mount namespace of its own (a child): a pool larger than the
    filesystem is refused at creation (ENOSPC), leaving no file; a store into space the
    filesystem no longer holds (a punched hole, the disk full) is OSError ENOSPC naming its
    slot, the source untouched, and the other slots still load; remounted read-only
    (EROFS), the pool opens for loads and refuses stores, naming the errno."""
    reason = namespace_reason()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="kvbm-enospc-")
    try:
        result = run_child(ENOSPC_CHILD, root, prefix=(
            "unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=2m tmpfs "{root}" && exec "$@"', "sh"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    code, message, left = seen["create"]
    assert code == errno.ENOSPC and "cannot reserve" in message and "bytes free on its filesystem" in message
    assert not left
    assert seen["filled"] == errno.ENOSPC
    code, message = seen["store"]
    assert code == errno.ENOSPC and "slots [1]" in message and "No space left on device" in message, message
    assert seen["source untouched"] and seen["slot 0 loaded"]
    assert list(seen["load"]) == ["1"] and "failed: [Errno 28]" in seen["load"]["1"]
    assert seen["read-only writable"] is False
    code, message = seen["read-only store"]
    assert code == errno.EROFS and "open read-only" in message and "EROFS" in message
    assert seen["read-only load"]


READ_ONLY_CHILD = """
import ctypes, json, os, sys, torch, kvbm_ext
from kvbm_ext.disk import DiskPool
if os.geteuid() == 0:
    # Root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (capset): file modes apply to it.
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    data[0].effective &= ~0b110
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
pool = DiskPool(sys.argv[1])
seen = {"writable": pool.writable}
src = torch.zeros(3, 7, 4, 2, 16, dtype=torch.bfloat16)
cache = kvbm_ext.PagedKVCache(list(src), "bth(kd)")
try:
    pool.store(cache, [0], [0])
except OSError as e:
    seen["store"] = [e.errno, str(e)]
seen["stored"] = sorted(pool.stored())
print(json.dumps(seen))
"""


def test_a_read_only_file(gen, tmp_path):
    """A pool file the process may not write (mode 0444, and as root the child drops the
    capability that overrides file modes): it opens for loads, and a store is OSError
    EACCES saying why."""
    _, _, pool = stored_pool(tmp_path, gen)
    pool.close()
    os.chmod(pool.path, 0o444)
    result = run_child(READ_ONLY_CHILD, pool.path)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["writable"] is False and seen["stored"] == [1, 3]
    code, message = seen["store"]
    assert code == errno.EACCES and "open read-only" in message and "EACCES" in message
