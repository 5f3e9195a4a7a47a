"""PagedKVCache layers that share memory, and the repeated-id check of a huge cache.

A cache may be built over layers that share memory (`[t, t]`, `[kv] * nl`, views of one
buffer that overlap, one array whose layer stride is shorter than a layer): reading them
is well defined and moves the right bytes, but a call that writes two of them would write
the same bytes twice (layer 0 read back as layer 1), so from_universal and
from_operational refuse, naming both layers, before any byte is written. Layers whose
spans interleave without sharing a byte (views of one buffer along an inner dimension)
are written as any others. The check is exact: byte lattices, not hulls.

The repeated-id check of a call that writes the cache is sized by the ids, not by the
cache: a cache of 2**40 blocks takes host ids without a MemoryError.
"""

import os

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import invoke, run_and_check
from support.builders import CacheCase, block_buffers
from support.asserts import assert_bitwise_equal, expect_rejected
from support.builders import random_tensor


NL, NB, NO, NH, NT, HD = 4, 6, 2, 3, 4, 8
IDS = [4, 1, 5]
WRITERS = ["from_universal", "from_operational"]


def other(case, method, gen, pin=False):
    shape = case.universal_shape() if "universal" in method else case.operational_shape()
    return block_buffers("list", len(IDS), shape, case.dtype, gen, case.device, pin)


def shared(layout, make, base_shape, gen, device="cpu", nl=NL, dtype=torch.float16):
    """A CacheCase over one base tensor and layers made from it by `make`."""
    base = random_tensor(base_shape, dtype, device, gen)
    return CacheCase(layout, nl, NB, NO, NH, NT, HD, dtype, gen, device, bases=[base], make=make)


def same_tensor(gen, device="cpu", nl=NL):
    """`[kv] * nl`: every layer is one tensor."""
    return shared("kbthd", lambda bs: [bs[0]] * nl, (NO, NB, NT, NH, HD), gen, device, nl)


def overlapping(gen, shift, device="cpu"):
    """Layer l is the contiguous [NO, NB, NT, NH, HD] starting `shift * l` elements into one
    flat buffer: neighbours overlap when shift is below a layer's size."""
    size = NO * NB * NT * NH * HD
    return shared("kbthd", lambda bs: [bs[0][l * shift: l * shift + size].view(NO, NB, NT, NH, HD)
                                       for l in range(NL)], (size + shift * (NL - 1),), gen, device)


def interleaved_by_layer(gen, device="cpu"):
    """Layers are `buf[:, l]` of one [NB, nl, NO, NT, NH, HD] buffer ("bkthd" views): their
    hulls overlap, their bytes do not."""
    return shared("bkthd", lambda bs: list(bs[0].unbind(1)), (NB, NL, NO, NT, NH, HD), gen, device)


def interleaved_by_head(gen, device="cpu"):
    """Layers are heads l, l + nl, ... of one [NO, NB, NT, NH * nl, HD] buffer."""
    return shared("kbthd", lambda bs: [bs[0][:, :, :, l::NL] for l in range(NL)], (NO, NB, NT, NH * NL, HD), gen,
                  device)


def strided_layers(gen, device="cpu"):
    """One array "lkbthd" whose layer stride equals its block stride: layer l's block b + 1
    is layer l + 1's block b."""
    block = NT * NH * HD

    def make(bs):
        return bs[0].as_strided((NL, NO, NB, NT, NH, HD), (block, (NB + NL) * block, block, NH * HD, HD, 1))

    return shared("lkbthd", make, (NO * (NB + NL) * block,), gen, device)


ALIASED = {
    "[t, t]": lambda gen, device="cpu": same_tensor(gen, device, nl=2),
    "[kv] * nl": same_tensor,
    "half-overlapping views": lambda gen, device="cpu": overlapping(gen, NO * NB * NT * NH * HD // 2, device),
    "views one element apart": lambda gen, device="cpu": overlapping(gen, 1, device),
    "one array, layer stride of a block": strided_layers,
}
DISJOINT = {
    "interleaved by layer": interleaved_by_layer,
    "interleaved by head": interleaved_by_head,
    "touching views": lambda gen, device="cpu": overlapping(gen, NO * NB * NT * NH * HD, device),
}


def refused(case, cache, method, gen, *words, **kwargs):
    arg = other(case, method, gen).arg
    expect_rejected(lambda: invoke(cache, method, IDS, arg, **kwargs), arg, case.buf.bases, ValueError, "layers",
                    ["share memory", "cannot write both", *words])


@pytest.mark.parametrize("name", ALIASED)
@pytest.mark.parametrize("method", WRITERS)
def test_writing_layers_that_share_memory_is_refused(method, name, gen):
    case = ALIASED[name](gen)
    cache = case.build()
    refused(case, cache, method, gen, "cache layers 0 and 1")


@pytest.mark.parametrize("name", ALIASED)
@pytest.mark.parametrize("method", ["to_universal", "to_operational"])
def test_reading_layers_that_share_memory_moves_their_bytes(method, name, gen):
    case = ALIASED[name](gen)
    run_and_check(case, case.build(), method, IDS, other(case, method, gen))


@pytest.mark.parametrize("name", DISJOINT)
@pytest.mark.parametrize("method", ["from_universal", "from_operational", "to_universal"])
def test_layers_whose_spans_interleave_are_written(method, name, gen):
    case = DISJOINT[name](gen)
    run_and_check(case, case.build(), method, IDS, other(case, method, gen))


def test_round_trip_of_one_tensor_given_twice_is_refused_not_wrong(gen):
    """from_universal then to_universal over [t, t] returned layer 0 as layer 1: now the
    write is refused and the cache keeps its bytes."""
    case = same_tensor(gen, nl=2)
    cache = case.build()
    universals = other(case, "from_universal", gen)
    before = case.buf.bases[0].clone()
    with pytest.raises(ValueError, match=r"^layers: cache layers 0 and 1 share memory"):
        cache.from_universal(universals.arg, IDS)
    assert_bitwise_equal(case.buf.bases[0], before, "the cache")


@pytest.mark.parametrize("method", WRITERS)
def test_a_selection_that_writes_one_of_the_aliased_layers_is_written(method, gen):
    case = same_tensor(gen)
    cache = case.build()
    for layers in (0, 3, range(2, 3), slice(-1, None)):
        run_and_check(case, cache, method, IDS, other(case, method, gen), layers=layers)
    refused(case, cache, method, gen, "cache layers 0 and 2", layers=slice(0, 4, 2))


def test_partial_overlap_refuses_only_the_pairs_that_overlap(gen):
    """Half-overlapping views: layers 0 and 2 share nothing, layers 0 and 1 do."""
    case = ALIASED["half-overlapping views"](gen)
    cache = case.build()
    run_and_check(case, cache, "from_universal", IDS, other(case, "from_universal", gen), layers=range(0, 4, 2))
    refused(case, cache, "from_universal", gen, "cache layers 2 and 3", layers=range(2, 4))
    refused(case, cache, "from_operational", gen, "cache layers 1 and 2", layers=slice(2, 0, -1))


def test_numpy_layers_given_twice(gen):
    a = random_tensor((NO, NB, NT, NH, HD), torch.float32, "cpu", gen).numpy()
    cache = kvbm_ext.PagedKVCache([a, a], "kbthd")
    u = np.full((NH, 2, NO, NT, HD), -1.0, np.float32)
    with pytest.raises(ValueError, match="cache layers 0 and 1 share memory"):
        cache.from_universal([u], [0])
    cache.to_universal([2], [u])
    bits = u.view(np.uint32)
    assert np.array_equal(bits[:, 0], bits[:, 1])
    assert np.array_equal(bits[:, 0], a[:, 2].transpose(2, 0, 1, 3).view(np.uint32))


# --------------------------------------------------------------------------
# The repeated-id check is sized by the ids.
# --------------------------------------------------------------------------


def huge_cache(blocks, nb=64):
    """A "btd" uint8 cache of `blocks` one-byte blocks whose block stride is one byte: only
    the first 64 blocks lie in real memory (a NumPy view with no bounds of its own), so
    calls use ids below 64; and nb one-byte universals, placed below the cache's memory,
    outside its span."""
    buffer = np.random.default_rng(blocks % 1000).integers(1, 255, nb + 64, dtype=np.uint8)
    universals, memory = buffer[:nb].reshape(nb, 1, 1, 1, 1, 1), buffer[nb:]
    layer = np.lib.stride_tricks.as_strided(memory, (blocks, 1, 1), (1, 1, 1))
    return memory, universals, kvbm_ext.PagedKVCache([layer], "btd")


@pytest.mark.parametrize("blocks", [2**40, 2**62, 2**26, 64])
def test_repeated_ids_in_a_huge_cache(blocks):
    memory, universals, cache = huge_cache(blocks, nb=3)
    assert cache.num_blocks == blocks
    universals[:, 0, 0, 0, 0, 0] = [1, 2, 3]
    before = memory.copy()
    with pytest.raises(ValueError, match=r"^block_ids\[2\]: block id 5 repeats block_ids\[0\]"):
        cache.from_universal(universals, [5, 9, 5])
    assert np.array_equal(memory, before), "a refused call wrote the cache"
    cache.from_universal(universals, [5, 9, 63])
    want = before.copy()
    want[[5, 9, 63]] = [1, 2, 3]
    assert np.array_equal(memory, want)
    memory[[5, 63]] = [201, 203]
    cache.to_universal([63, 5, 5], universals)       # a read may repeat ids
    assert universals.reshape(-1).tolist() == [203, 201, 201]


@pytest.mark.parametrize("blocks", [2**40, 2**20])
def test_first_error_in_id_order_for_every_size(blocks):
    """The first bad entry is reported, a repeat or an id out of range, whichever comes first,
    whether the check sorts a copy of the ids or marks bits."""
    memory, universals, cache = huge_cache(blocks, nb=40)
    ids = np.random.default_rng(3).permutation(60)[:40].tolist()
    before = memory.copy()
    repeated = ids[:30] + [ids[12]] + ids[31:]
    with pytest.raises(ValueError, match=r"^block_ids\[30\]: block id \d+ repeats block_ids\[12\]"):
        cache.from_universal(universals, repeated)
    bad = repeated[:20] + [-1] + repeated[21:]
    with pytest.raises(ValueError, match=r"^block_ids\[20\]: block id -1 is out of range"):
        cache.from_universal(universals, bad)
    twice = ids[:5] + [ids[1], ids[1]] + ids[7:]
    with pytest.raises(ValueError, match=r"^block_ids\[5\]: block id \d+ repeats block_ids\[1\]"):
        cache.from_universal(universals, twice)
    assert np.array_equal(memory, before), "a refused call wrote the cache"


def test_huge_cache_in_a_child_under_a_memory_limit():
    """With the address space capped 2 GiB above the child's imports, a 2**40-block cache still takes its ids (the
    check allocates nothing proportional to the cache; before, a MemoryError)."""
    import subprocess
    import sys

    # AddressSanitizer (tools/sanitize.sh) reserves terabytes of address space for its shadow
    # memory: there the limit is left out, and the call still must not raise MemoryError.
    limit = "libasan" not in os.environ.get("LD_PRELOAD", "")
    # The cap is 2 GiB above what the child has mapped once its imports are done (torch's
    # libraries alone map more than 2 GiB where torch is a CUDA build).
    code = (f"import resource, sys\n"
            f"sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}]\n"
            "import test_paged_aliasing as t\n"
            "mapped = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize:')).split()[1]) << 10\n"
            f"{limit} and resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), mapped + (2 << 30)))\n"
            "memory, universals, cache = t.huge_cache(2**40, nb=50)\n"
            "cache.from_universal(universals, list(range(50)))\n"
            "assert (memory[:50] == universals.reshape(-1)).all()\n"
            "print('OK')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------
# On a GPU.
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["[kv] * nl", "views one element apart", "one array, layer stride of a block"])
def test_gpu_writing_layers_that_share_memory_is_refused(name, gen):
    case = ALIASED[name](gen, "cuda")
    cache = case.build()
    for method in WRITERS:
        refused(case, cache, method, gen, "cache layers 0 and 1")
    run_and_check(case, cache, "to_universal", IDS, other(case, "to_universal", gen))


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True], ids=["device", "pinned"])
@pytest.mark.parametrize("name", DISJOINT)
def test_gpu_layers_whose_spans_interleave_are_written(name, pin, gen):
    case = DISJOINT[name](gen, "cuda")
    cache = case.build()
    for method in ("from_universal", "from_operational"):
        run_and_check(case, cache, method, IDS, other(case, method, gen, pin=pin))
