"""Memory that caches share, caches whose memory moved, and the caches a call may mix.

A call writing a cache refuses, before any byte is written, to write two of its layers
(or the K and V of one (K, V) pair) that share a byte, and to write a byte another cache
or a flat block of the call reads: on every writing path (from_universal,
from_operational, to_cache), by the bytes actually shared, not by address hulls, so that
caches over disjoint parts of one buffer (block halves, even and odd blocks, head halves)
move as any others. Every path that reads a cache first checks that the memory it was
built over has not moved (one-array torch caches at every call, per-layer arrays under
KVBM_EXT_DEBUG=1). The layers a cache keeps are seen by the garbage collector, so a
cycle through them is collected. Host arrays of every protocol mix in one cache.
"""

import gc
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import assert_bitwise_equal, path_regex, poison_
from support.builders import random_tensor
from support.producers import ArrayInterfaceOnly, DLPackOnly
from support.references import as_int

NL, NB, NT, NH, HD = 3, 6, 4, 2, 8
DT = torch.bfloat16


def rand(shape, gen, dtype=DT):
    return random_tensor(shape, dtype, "cpu", gen)


def vllm_like(gen, nl=NL):
    """A cache of distinct per-layer [2, NB, NT, NH, HD] tensors, and its memory."""
    memory = [rand((2, NB, NT, NH, HD), gen) for _ in range(nl)]
    return memory, kvbm_ext.PagedKVCache(memory, "kbthd")


def snapshot(memory):
    return [as_int(x).clone() for x in memory]


def assert_unchanged(memory, before, what):
    for i, (got, was) in enumerate(zip(memory, before)):
        assert_bitwise_equal(as_int(got), was, f"{what} #{i} after a refused call")


def refused(call, memory, exc, path, *words):
    """call() raises exc naming `path`, with each of `words`, and leaves `memory` as it was."""
    poison_(memory)
    before = snapshot(memory)
    with pytest.raises(exc, match=path_regex(re.escape(path))) as info:
        call()
    for word in words:
        assert re.search(re.escape(word), str(info.value)), str(info.value)
    assert_unchanged(memory, before, "memory")


# --------------------------------------------------------------------------
# Layers of one cache that share memory, on every writing path.
# --------------------------------------------------------------------------


def pairs(gen, k_is_v=False, same_pair=False, overlap=0):
    """(K, V) pairs [NB, NT, NH, HD]; layer 0's K is its V, layer 1 is layer 0's pair, or
    layer 0's V starts `overlap` elements before its K ends (views of one buffer)."""
    size = NB * NT * NH * HD
    base = rand((2 * size,), gen)
    k0, v0 = base[:size].view(NB, NT, NH, HD), base[size - overlap: 2 * size - overlap].view(NB, NT, NH, HD)
    if k_is_v:
        v0 = k0
    layers = [(k0, v0)]
    layers.append(layers[0] if same_pair else (rand((NB, NT, NH, HD), gen), rand((NB, NT, NH, HD), gen)))
    layers.append((rand((NB, NT, NH, HD), gen), rand((NB, NT, NH, HD), gen)))
    memory = [base] + [x for pair in layers[1:] for x in pair]
    return memory, kvbm_ext.PagedKVCache(layers, "bthd")


ALIASED_PAIRS = {
    "K is V": (dict(k_is_v=True), "layer 0's K and layer 0's V"),
    "a pair given twice": (dict(same_pair=True), "layer 0's K and layer 1's K"),
    "K and V overlapping by one element": (dict(overlap=1), "layer 0's K and layer 0's V"),
}


def writers(cache, gen):
    """Each way of writing every layer of `cache`: from_universal, from_operational, to_cache."""
    universal = rand((1, NH, NL, 2, NT, HD), gen)
    operational = rand((1, NL, 2, NT * NH * HD), gen)
    _, src = vllm_like(gen)
    return {
        "from_universal": lambda: cache.from_universal(universal, [2]),
        "from_operational": lambda: cache.from_operational(operational, [2]),
        "to_cache": lambda: src.to_cache(cache, [1], [2]),
    }


@pytest.mark.parametrize("method", ["from_universal", "from_operational", "to_cache"])
@pytest.mark.parametrize("name", ALIASED_PAIRS)
def test_kv_pairs_sharing_memory_are_refused_naming_the_layers(name, method, gen):
    kwargs, which = ALIASED_PAIRS[name]
    memory, cache = pairs(gen, **kwargs)
    path = "dst.layers" if method == "to_cache" else "layers"
    refused(writers(cache, gen)[method], memory, ValueError, path, f"cache {which} share memory")


def test_kv_pairs_reading_shared_memory_moves_its_bytes(gen):
    memory, cache = pairs(gen, k_is_v=True)
    out = torch.empty(1, NH, NL, 2, NT, HD, dtype=DT)
    poison_(out)
    cache.to_universal([3], out)
    k0 = cache.layers[0][0]
    assert_bitwise_equal(as_int(out[0, :, 0, 0]), as_int(k0[3].transpose(0, 1)), "layer 0's K")
    assert_bitwise_equal(as_int(out[0, :, 0, 1]), as_int(k0[3].transpose(0, 1)), "layer 0's V (the same memory)")


def test_kv_pairs_interleaved_without_sharing_are_written(gen):
    """K is every even head, V every odd head of one buffer: hulls overlap, bytes do not."""
    base = rand((NL, NB, NT, 2 * NH, HD), gen)
    layers = [(base[l, :, :, 0::2], base[l, :, :, 1::2]) for l in range(NL)]
    cache = kvbm_ext.PagedKVCache(layers, "bthd")
    universal = rand((1, NH, NL, 2, NT, HD), gen)
    cache.from_universal(universal, [4])
    for l in range(NL):
        for o in range(2):
            assert_bitwise_equal(as_int(layers[l][o][4]), as_int(universal[0, :, l, o].transpose(0, 1)), f"{l},{o}")


@pytest.mark.parametrize("method", ["to_cache", "from_universal"])
def test_layers_given_twice_refused_as_a_to_cache_destination(method, gen):
    """[kv] * nl as dst: to_cache wrote every layer into the same memory, the last one
    winning; now it refuses as from_universal does."""
    kv = rand((2, NB, NT, NH, HD), gen)
    cache = kvbm_ext.PagedKVCache([kv] * NL, "kbthd")
    path = "dst.layers" if method == "to_cache" else "layers"
    refused(writers(cache, gen)[method], [kv], ValueError, path, "cache layers 0 and 1 share memory")


def test_to_cache_writes_one_of_the_layers_given_twice(gen):
    kv = rand((2, NB, NT, NH, HD), gen)
    dst = kvbm_ext.PagedKVCache([kv] * NL, "kbthd")
    memory, src = vllm_like(gen)
    src.to_cache(dst, [1, 5], [0, 3], layers=2, layer_offset=-1)
    for o in range(2):
        assert_bitwise_equal(as_int(kv[o, [0, 3]]), as_int(memory[2][o, [1, 5]]), f"outer {o}")


def test_a_layer_whose_elements_overlap_cannot_be_written(gen):
    """Blocks one token apart: block b's token 1 is block b + 1's token 0."""
    buffer = rand((NB + NT, NH, HD), gen)
    layer = buffer.as_strided((NB, NT, NH, HD), (NH * HD, NH * HD, HD, 1))
    cache = kvbm_ext.PagedKVCache([layer], "bthd")
    universal = rand((1, NH, 1, 1, NT, HD), gen)
    refused(lambda: cache.from_universal(universal, [0]), [buffer], ValueError, "layers",
            "elements of a cache layer overlap one another")
    out = torch.empty_like(universal)
    cache.to_universal([1], out)        # reading them is well defined
    assert_bitwise_equal(as_int(out[0, :, 0, 0]), as_int(layer[1].transpose(0, 1)), "block 1")


# --------------------------------------------------------------------------
# Two caches over one buffer: refused only where a byte is shared.
# --------------------------------------------------------------------------


def one_buffer(gen, nb=2 * NB):
    return rand((NL, 2, nb, NT, NH, HD), gen)


DISJOINT = {
    "block halves": lambda b: (b[:, :, :NB], b[:, :, NB:]),
    "even and odd blocks": lambda b: (b[:, :, 0::2], b[:, :, 1::2]),
    "head halves": lambda b: (b[:, :, :NB, :, :1], b[:, :, :NB, :, 1:]),
    "K of one, V of the other": lambda b: (b[:, 0:1, :NB], b[:, 1:2, :NB]),
}
SHARING = {
    "halves overlapping by a block": (lambda b: (b[:, :, : NB + 1], b[:, :, NB:]), "dst.layers (layer 0)"),
    "every block and the odd ones": (lambda b: (b[:, :, 0::2], b[:, :, 0::4]), "dst.layers (layer 0)"),
}


def two_caches(split, buffer):
    a, b = split(buffer)
    dims = "lkbthd"
    return kvbm_ext.PagedKVCache(a, dims), kvbm_ext.PagedKVCache(b, dims), a, b


@pytest.mark.parametrize("name", DISJOINT)
def test_caches_over_disjoint_parts_of_one_buffer_move(name, gen):
    buffer = one_buffer(gen)
    src, dst, a, b = two_caches(DISJOINT[name], buffer)
    nb = min(a.shape[2], b.shape[2])
    src_ids, dst_ids = [nb - 1, 0], [1, nb - 2]
    want = as_int(b).clone()
    want[:, :, dst_ids] = as_int(a)[:, :, src_ids]
    keep = as_int(a).clone()
    src.to_cache(dst, src_ids, dst_ids)
    assert_bitwise_equal(as_int(b), want, "dst")
    assert_bitwise_equal(as_int(a), keep, "src")
    dst.to_cache(src, [0], [1])         # and back, the other cache now the destination


@pytest.mark.parametrize("name", SHARING)
def test_caches_sharing_bytes_of_one_buffer_are_refused(name, gen):
    split, path = SHARING[name]
    buffer = one_buffer(gen)
    src, dst, _, _ = two_caches(split, buffer)
    refused(lambda: src.to_cache(dst, [0], [1]), [buffer], ValueError, path, "destination shares memory with layers")


def test_a_cache_into_itself_is_refused(gen):
    memory, cache = vllm_like(gen)
    refused(lambda: cache.to_cache(cache, [1], [2]), memory, ValueError, "dst.layers[0]", "shares memory")


def test_to_cache_heads_of_one_cache_into_its_other_heads(gen):
    """Heads 0 of one cache into heads 1 of the same memory described again: no byte shared."""
    memory, src = vllm_like(gen)
    dst = kvbm_ext.PagedKVCache(memory, "kbthd")
    want = [as_int(m).clone() for m in memory]
    for l in range(NL):
        want[l][:, [3, 4], :, 1] = want[l][:, [0, 5], :, 0]
    src.to_cache(dst, [0, 5], [3, 4], heads=0, head_offset=1)
    for l in range(NL):
        assert_bitwise_equal(as_int(memory[l]), want[l], f"layer {l}")


def test_a_verdict_is_kept_only_for_its_selection(gen):
    """The exact check's verdict is remembered per pair of caches and selections: head 0 of
    one view into a view of head 1 moves; head 1 into it shares bytes, and is refused after."""
    buffer = rand((NL, 2, NB, NT, 2, HD), gen)
    src = kvbm_ext.PagedKVCache(buffer, "lkbthd")
    dst = kvbm_ext.PagedKVCache(buffer[:, :, :, :, 1:], "lkbthd")
    for _ in range(2):
        want = as_int(buffer).clone()
        want[:, :, 2, :, 1] = want[:, :, 0, :, 0]
        src.to_cache(dst, [0], [2], heads=0)
        assert_bitwise_equal(as_int(buffer), want, "buffer")
    refused(lambda: src.to_cache(dst, [0], [2], heads=1), [buffer], ValueError, "dst.layers (layer 0)",
            "destination shares memory with layers (layer 0)")


def test_universals_in_the_gaps_of_a_cache_are_moved(gen):
    """A cache over the even blocks of a buffer and universals written into the odd ones."""
    buffer = rand((2 * NB, NT, NH, HD), gen)
    cache = kvbm_ext.PagedKVCache([buffer[0::2]], "bthd")
    gaps = buffer[1::2].view(NB, NH, 1, 1, NT, HD)       # each odd block as one universal block
    want = as_int(buffer).clone()
    cache.to_universal([0, 2], gaps[:2])
    rows = want[0::2][[0, 2]].transpose(1, 2)
    assert_bitwise_equal(as_int(gaps[:2]).reshape(2, -1), rows.reshape(2, -1), "universals")
    refused(lambda: cache.to_universal([0, 2], buffer[0:2].view(2, NH, 1, 1, NT, HD)), [buffer], ValueError,
            "universals", "destination shares memory with layers[0]")


# --------------------------------------------------------------------------
# Memory that moved since construction: every reading path checks it.
# --------------------------------------------------------------------------


def resized_one_array_cache(gen):
    memory = rand((NL, 2, NB, NT, NH, HD), gen)
    cache = kvbm_ext.PagedKVCache(memory, "lkbthd")
    memory.resize_(2 * memory.numel())          # reallocates: the cache's memory is freed
    return cache


@pytest.mark.parametrize("side", ["src", "dst"])
def test_to_cache_refuses_a_cache_whose_memory_moved(side, gen):
    """to_cache read and wrote freed memory (ASan: heap-use-after-free) where the list API
    and from/to_universal refused."""
    moved = resized_one_array_cache(gen)
    memory, other = vllm_like(gen)
    src, dst = (moved, other) if side == "src" else (other, moved)
    path = "layers" if side == "src" else "dst.layers"
    refused(lambda: src.to_cache(dst, [0], [1]), memory, ValueError, path, "its memory moved")


def test_to_cache_checks_per_layer_arrays_under_debug(gen):
    """Per-layer torch arrays are checked when KVBM_EXT_DEBUG=1 (one C call a layer): in a
    child, so that the debug log and the freed memory stay there."""
    code = ("import torch, kvbm_ext\n"
            "layers = [torch.ones(2, 6, 4, 2, 8) for _ in range(3)]\n"
            "cache = kvbm_ext.PagedKVCache(layers, 'kbthd')\n"
            "other = kvbm_ext.PagedKVCache([torch.zeros(2, 6, 4, 2, 8) for _ in range(3)], 'kbthd')\n"
            "layers[1].resize_(10**6)\n"
            "for src, dst in ((cache, other), (other, cache)):\n"
            "    try:\n"
            "        src.to_cache(dst, [0], [1])\n"
            "        print('moved')\n"
            "    except ValueError as e:\n"
            "        print('refused', e)\n")
    env = dict(os.environ, KVBM_EXT_DEBUG="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            cwd=root)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("moved", "refused"))]
    assert len(lines) == 2 and all("its memory moved" in line for line in lines), result.stdout + result.stderr


# --------------------------------------------------------------------------
# Host arrays of every protocol in one cache.
# --------------------------------------------------------------------------


def test_host_producers_of_every_kind_in_one_cache(gen):
    """DLPack (torch's C exchange API, a DLPack-only object), __array_interface__ and the
    buffer protocol: DLPack numbers host memory device 0, the others -1."""
    memory = [rand((2, NB, NT, NH, HD), gen, torch.float32) for _ in range(4)]
    given = [memory[0], DLPackOnly(memory[1]), ArrayInterfaceOnly(memory[2].numpy()),
             memoryview(memory[3].numpy())]
    for layers in (given, given[::-1]):
        cache = kvbm_ext.PagedKVCache(layers, "kbthd")
        out = torch.empty(1, NH, 4, 2, NT, HD)
        poison_(out)
        cache.to_universal([5], out)
        order = memory if layers is given else memory[::-1]
        for l, m in enumerate(order):
            assert_bitwise_equal(as_int(out[0, :, l]), as_int(m[:, 5].permute(2, 0, 1, 3)), f"layer {l}")


# --------------------------------------------------------------------------
# The layers a cache keeps, and the garbage collector.
# --------------------------------------------------------------------------


class Finalized:
    def __init__(self, log):
        self.log = log

    def __del__(self):
        self.log.append(1)


@pytest.mark.parametrize("kind", ["list of arrays", "list of (K, V) lists"])
def test_a_cycle_through_the_layers_a_cache_keeps_is_collected(kind):
    """cache -> its copy of `layers` -> a layer -> the cache: the copy was untracked, so the
    cycle (and its memory) was never collected."""
    log = []
    gc.collect()
    for _ in range(3):
        k, v = torch.zeros(NB, NT, NH, HD), torch.zeros(NB, NT, NH, HD)
        cache = (kvbm_ext.PagedKVCache([torch.stack([k, v])], "kbthd") if kind == "list of arrays"
                 else kvbm_ext.PagedKVCache([[k, v]], "bthd"))
        layer = cache.layers[0] if kind == "list of arrays" else cache.layers[0][0]
        layer.cache, layer.finalized = cache, Finalized(log)
        del cache, layer, k, v
        gc.collect()
    assert len(log) == 3, f"{3 - len(log)} of 3 cycles were not collected"


# --------------------------------------------------------------------------
# Sizes that overflow int64, and device names.
# --------------------------------------------------------------------------


class FakeHostArray:
    """An array interface over a made-up address (never read: every call here is refused)."""

    def __init__(self, shape, typestr="<f4"):
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (1 << 20, False), "version": 3}


OVERFLOWS = {
    "block_size past 2**62 in a grouped layout": (
        lambda: kvbm_ext.PagedKVCache([np.zeros((4, 8, 2, 8), np.float32)], "b(tk)hd", block_size=2**62 + 1),
        "block_size"),
    "compact strides of an empty array past int64": (
        lambda: kvbm_ext.block_to_universal([[FakeHostArray((2**40, 2**40, 0))]], [np.zeros((1, 1, 1, 1, 1),
                                                                                         np.float32)]),
        "blocks[0][0]"),
    "an empty pinned_empty whose strides pass int64": (
        lambda: kvbm_ext.pinned_empty((0, 2**61, 3), np.float32), "shape"),
}


@pytest.mark.parametrize("case", OVERFLOWS)
def test_sizes_past_int64_are_refused(case):
    call, path = OVERFLOWS[case]
    with pytest.raises(ValueError, match=path_regex(re.escape(path))):
        call()


@pytest.mark.parametrize("device", ["cuda\x00:7", "cuda:7\x00", "cuda:", "cuda:0x1"])
def test_pinned_empty_device_names_are_read_whole(device):
    with pytest.raises(ValueError, match=r"^device: expected None, an int, 'cuda' or 'cuda:N'.*got 'cuda"):
        kvbm_ext.pinned_empty((4,), np.float32, device=device)
