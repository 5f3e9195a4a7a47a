"""PagedKVCache.to_cache: blocks of one cache into blocks of another, by two id lists.

Every pair of engine layouts (tests/support/engines.py) on the CPU and device to device;
device caches to and from pinned host pools (the staged copy-engine path, and the kernel);
ids on the host and the device; CUDA graph capture and replay with new ids; the caller's
stream busy before the call; errors before any write. The reference moves rows through
plain-torch views of each engine's documented shape, on CPU copies of the memory, and the
whole destination memory (blocks, layers and heads not moved included) is compared.
"""

import logging
import re

import numpy as np
import pytest
import torch

import kvbm_ext
from support.engines import ENGINES, HOST_POOLS, Dims
from support.references import selected
from support.asserts import assert_bitwise_equal, path_regex, poison_
from support.builders import random_tensor
from support.devices import SLEEP_CYCLES, sync
from support.references import as_int

D = Dims(nl=3, nh=2, nt=4, hd=8, blocks=7)
KV = [n for n, e in ENGINES.items() if e.no == 2]  # every layout with K and V (not MLA)
# Pools a device cache offloads into, and engine layouts in pinned memory: K/V pairs, per-layer
# arrays whose K and V of a block are apart (units per layer and K/V) or together (per layer).
PINNED = HOST_POOLS + ["transformers", "vllm_flash_attn", "vllm_packed"]


def snapshot(memory):
    return [as_int(x.detach()).cpu().clone() for x in memory]


def make(name, gen, device="cpu", pin=False, d=D, dtype=torch.bfloat16):
    e = ENGINES[name]
    memory = e.allocate(d, dtype, gen, device, pin)
    return e, memory, e.build(memory, d)


def reference(src, dst, src_before, dst_want, src_ids, dst_ids, d_src=D, d_dst=D, layers=None, heads=None,
              layer_offset=0, head_offset=0):
    """dst row (dst_ids[b], l + layer_offset, o, t, head_offset + j) = src row (src_ids[b], l, o, t, heads[j])."""
    src_rows = src.rows(src_before, d_src)
    dst_rows = dst.rows(dst_want, d_dst)
    nh = src.dims(d_src).nh
    for s, t in zip(src_ids, dst_ids):
        for l in selected(d_src.nl, layers):
            for o in range(src.no):
                for j, h in enumerate(selected(nh, heads)):
                    dst_rows[l + layer_offset][o][t][:, head_offset + j] = src_rows[l][o][s][:, h]


def run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, src_ids, dst_ids, d_src=D, d_dst=D,
                  call_ids=None, after=sync, **kwargs):
    """Poison dst, run to_cache, compare every byte of both caches' memory with the reference."""
    poison_(dst_mem)
    sync()
    src_before, want = snapshot(src_mem), snapshot(dst_mem)
    args = call_ids if call_ids is not None else (src_ids, dst_ids)
    returned = src_cache.to_cache(dst_cache, *args, **kwargs)
    if kwargs.get("defer"):
        assert isinstance(returned, kvbm_ext.Deferred), returned
    else:
        assert returned is None, returned
    after()
    if kwargs.get("defer"):
        assert returned.result(10) is None and returned.done()
    reference(src, dst, src_before, want, src_ids, dst_ids, d_src, d_dst, **{
        k: v for k, v in kwargs.items() if k in ("layers", "heads", "layer_offset", "head_offset")})
    for i, (got, w) in enumerate(zip(dst_mem, want)):
        assert_bitwise_equal(as_int(got), w, f"dst memory #{i}")
    for i, (got, w) in enumerate(zip(src_mem, src_before)):
        assert_bitwise_equal(as_int(got), w, f"src memory #{i}")
    return returned


def random_ids(gen, nb=4, blocks=D.blocks):
    """Source ids may repeat (a block read twice); destination ids are distinct."""
    src_ids = torch.randint(0, blocks, (nb,), generator=gen).tolist()
    dst_ids = torch.randperm(blocks, generator=gen)[:nb].tolist()
    return src_ids, dst_ids


# ==========================================================================
# Host to host, on the CPU.
# ==========================================================================


@pytest.mark.parametrize("dst_name", KV)
@pytest.mark.parametrize("src_name", KV)
def test_host_every_pair_of_layouts(src_name, dst_name, gen):
    src, src_mem, src_cache = make(src_name, gen)
    dst, dst_mem, dst_cache = make(dst_name, gen)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, *random_ids(gen))


def test_host_mla(gen):
    src, src_mem, src_cache = make("mla", gen, dtype=torch.float8_e4m3fn)
    dst, dst_mem, dst_cache = make("mla", gen, dtype=torch.float8_e4m3fn)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, *random_ids(gen, nb=7))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("pool", ["universal_pool", "hicache_page_first"])
def test_host_sglang_page_sizes_round_trip(page_size, pool, gen):
    """SGLang's MHATokenToKVPool at page_size 1 and 16 into a host pool and back."""
    d = Dims(nl=2, nh=2, nt=page_size, hd=16, blocks=9)
    src, src_mem, src_cache = make("sglang_mha", gen, d=d, dtype=torch.float16)
    mid, mid_mem, mid_cache = make(pool, gen, d=d, dtype=torch.float16)
    back, back_mem, back_cache = make("sglang_mha", gen, d=d, dtype=torch.float16)
    ids = [8, 1, 4]
    run_and_check(src, src_mem, src_cache, mid, mid_mem, mid_cache, ids, [0, 2, 5], d, d)
    run_and_check(mid, mid_mem, mid_cache, back, back_mem, back_cache, [0, 2, 5], [3, 6, 7], d, d)


SELECTIONS = {
    "layers slice": dict(layers=slice(1, 3)),
    "layers backwards": dict(layers=slice(None, None, -1)),
    "one layer, offset": dict(layers=1, layer_offset=2),
    "range of layers, offset": dict(layers=range(0, 3, 2), layer_offset=1),
    "heads reversed": dict(heads=slice(None, None, -1)),
    "one head, offset": dict(heads=1, head_offset=3),
    "everything": dict(layers=range(2, -1, -1), layer_offset=2, heads=range(1, -1, -1), head_offset=1),
}


@pytest.mark.parametrize("case", list(SELECTIONS))
@pytest.mark.parametrize("dst_name", ["universal_pool", "transformers", "hicache_layer_first"])
def test_host_selection_and_offsets(dst_name, case, gen):
    """layers=/heads= select on the source; layer_offset/head_offset place them in a larger
    destination, as to_universal numbers them; the rest of the destination is untouched."""
    d_dst = Dims(nl=5, nh=4, nt=4, hd=8, blocks=6)
    src, src_mem, src_cache = make("vllm_packed", gen)
    dst, dst_mem, dst_cache = make(dst_name, gen, d=d_dst)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, [6, 0, 3], [5, 1, 2], D, d_dst,
                  **SELECTIONS[case])


def test_host_ids_as_arrays(gen):
    """Ids as NumPy and torch int32/int64 arrays on the host."""
    src, src_mem, src_cache = make("vllm_flash_attn", gen)
    dst, dst_mem, dst_cache = make("trtllm_pool", gen)
    for s, t in [(np.array([1, 2], np.int64), torch.tensor([6, 0], dtype=torch.int32)),
                 (torch.tensor([5, 5]), np.array([3, 4], np.int32))]:
        run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, s.tolist(), t.tolist(), call_ids=(s, t))


def test_host_no_blocks_does_nothing(gen):
    src, src_mem, src_cache = make("vllm_packed", gen)
    dst, dst_mem, dst_cache = make("universal_pool", gen)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, [], [])


def test_dst_version_counters_bumped_and_requires_grad_refused(gen):
    src, src_mem, src_cache = make("vllm_flash_attn", gen)
    dst_mem = [random_tensor((2, 7, 4, 2, 8), torch.bfloat16, generator=gen) for _ in range(3)]
    dst_cache = kvbm_ext.PagedKVCache(dst_mem, "kbthd")
    src_versions = [x._version for x in src_mem]
    versions = [x._version for x in dst_mem]
    src_cache.to_cache(dst_cache, [1], [2], layers=slice(0, 2))
    assert [x._version for x in dst_mem] == [versions[0] + 1, versions[1] + 1, versions[2]]
    assert [x._version for x in src_mem] == src_versions
    dst_mem[1].requires_grad_(True)
    with pytest.raises(ValueError, match=path_regex(r"layers\[1\]")):
        src_cache.to_cache(dst_cache, [1], [2])


def test_without_autograd_checks_writes_neither_refuse_nor_bump(gen):
    """autograd_checks=False: a layer that requires grad is written (to_cache and
    from_universal alike), no version counter moves, and the bytes are the source's."""
    src, src_mem, src_cache = make("vllm_flash_attn", gen)
    dst_mem = [random_tensor((2, 7, 4, 2, 8), torch.bfloat16, generator=gen) for _ in range(3)]
    want = [x.clone() for x in dst_mem]
    dst_mem[1].requires_grad_(True)
    dst_cache = kvbm_ext.PagedKVCache(dst_mem, "kbthd", autograd_checks=False)
    versions = [x._version for x in dst_mem]
    src_cache.to_cache(dst_cache, [1], [2])
    universal = [random_tensor((2, 3, 2, 4, 8), torch.bfloat16, generator=gen)]     # [nh, nl, no, nt, hd]
    src_cache.to_universal([4], universal)
    dst_cache.from_universal(universal, [5])
    assert [x._version for x in dst_mem] == versions
    for layer, (got, w, s) in enumerate(zip(dst_mem, want, src_mem)):
        w[:, 2], w[:, 5] = s[:, 1], s[:, 4]
        assert_bitwise_equal(got.detach(), w, f"dst layer {layer}")
    # The default still refuses the layer that requires grad, before writing anything.
    with pytest.raises(ValueError, match=path_regex(r"layers\[1\]")):
        src_cache.to_cache(kvbm_ext.PagedKVCache(dst_mem, "kbthd"), [1], [2])


@pytest.mark.parametrize("bad", [1, None, "no", 1.0])
def test_autograd_checks_takes_only_a_bool(bad):
    with pytest.raises(TypeError, match="autograd_checks: expected True or False"):
        kvbm_ext.PagedKVCache([random_tensor((2, 7, 4, 2, 8), torch.bfloat16)], "kbthd", autograd_checks=bad)


# --------------------------------------------------------------------------
# Errors: raised before any byte is written, naming the argument.
# --------------------------------------------------------------------------


def other(layout, shape, dtype=torch.bfloat16, n=3, **kwargs):
    return kvbm_ext.PagedKVCache([random_tensor(shape, dtype) for _ in range(n)], layout, **kwargs)


def shared_memory_pair():
    """Two caches over one buffer, blocks 0-4 and blocks 2-6: they share blocks 2-4."""
    base = random_tensor((2, 7, 4, 2, 8), torch.bfloat16)
    return kvbm_ext.PagedKVCache([base[:, :5]], "kbthd"), kvbm_ext.PagedKVCache([base[:, 2:]], "kbthd")


class BadIndex:
    def __index__(self):
        raise RuntimeError("no index")


ERRORS = {
    "dst not a cache": (lambda s: torch.zeros(3), [1], [1], {}, TypeError, "dst", "PagedKVCache"),
    "tokens differ": (lambda s: other("kbthd", (2, 7, 8, 2, 8)), [1], [1], {}, ValueError, "dst",
                      "block_size 8"),
    "head dim differs": (lambda s: other("kbthd", (2, 7, 4, 2, 16)), [1], [1], {}, ValueError, "dst", "head_dim 16"),
    "no K/V split": (lambda s: other("bthd", (7, 4, 2, 8)), [1], [1], {}, ValueError, "dst", "num_outer 1"),
    "dtype differs": (lambda s: other("kbthd", (2, 7, 4, 2, 8), torch.float16), [1], [1], {}, TypeError, "dst",
                      "element type float16"),
    "too few layers": (lambda s: other("kbthd", (2, 7, 4, 2, 8), n=2), [1], [1], {}, ValueError, "layer_offset",
                       "dst has layers 0 to 1"),
    "layer offset too far": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1], [1], {"layers": 2, "layer_offset": 1},
                             ValueError, "layer_offset", "land on dst layers 3 to 3"),
    "too few heads": (lambda s: other("kbthd", (2, 7, 4, 1, 8)), [1], [1], {}, ValueError, "head_offset",
                      "exceed dst's 1 heads"),
    "src id out of range": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1, 7], [1, 2], {}, ValueError,
                            r"src_ids\[1\]", "out of range [0, 7)"),
    "dst id out of range": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1, 2], [1, -1], {}, ValueError,
                            r"dst_ids\[1\]", "out of range"),
    "dst id repeated": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1, 2, 3], [4, 5, 4], {}, ValueError,
                        r"dst_ids\[2\]", "repeats dst_ids[0]"),
    "counts differ": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1, 2], [3], {}, ValueError, "dst_ids",
                      "src_ids has 2"),
    "the same cache": (lambda s: s, [1], [2], {}, ValueError, r"dst\.layers\[0\]", "shares memory"),
    "caches sharing memory": (None, [0], [4], {}, ValueError, r"dst\.layers\[0\]", "shares memory"),
    "an id that fails": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1, BadIndex()], [1, 2], {}, TypeError,
                         r"src_ids\[1\]", "no index"),
    "a bool id": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1], [True], {}, TypeError, r"dst_ids\[0\]", "bool"),
    "bad backend": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1], [1], {"backend": "nope"}, ValueError,
                    "backend", "auto"),
    "bad layers": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1], [1], {"layers": 3}, ValueError, "layers",
                   "outside"),
    "unknown keyword": (lambda s: other("kbthd", (2, 7, 4, 2, 8)), [1], [1], {"inner": "NHD"}, TypeError,
                        "to_cache", "unexpected keyword"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_host_errors_before_any_write(case, gen):
    make_dst, src_ids, dst_ids, kwargs, exc, path, words = ERRORS[case]
    if make_dst is None:
        src_cache, dst_cache = shared_memory_pair()
    else:
        src_cache = kvbm_ext.PagedKVCache([random_tensor((2, 7, 4, 2, 8), torch.bfloat16, generator=gen)
                                           for _ in range(3)], "kbthd")
        dst_cache = make_dst(src_cache)
    dst_arrays = [x for x in getattr(dst_cache, "layers", [])] if isinstance(dst_cache, kvbm_ext.PagedKVCache) else []
    poison_(dst_arrays)
    before = snapshot(dst_arrays)
    with pytest.raises(exc, match=path_regex(path)) as info:
        src_cache.to_cache(dst_cache, src_ids, dst_ids, **kwargs)
    assert re.search(re.escape(words), str(info.value)), str(info.value)
    for i, (got, was) in enumerate(zip(dst_arrays, before)):
        assert_bitwise_equal(as_int(got), was, f"dst memory #{i} after a refused call")


def test_host_ids_whose_index_changes_the_call(gen):
    """Reading an id runs Python code: it may empty the caller's other id list or drop its
    own list; the call works on what it read, or refuses, and never crashes."""
    src, src_mem, src_cache = make("vllm_flash_attn", gen)
    dst, dst_mem, dst_cache = make("universal_pool", gen)
    dst_ids = [4, 5]

    class EmptiesDstIds:
        def __index__(self):
            dst_ids.clear()
            return 2

    poison_(dst_mem)
    before = snapshot(dst_mem)
    with pytest.raises(ValueError, match=path_regex("dst_ids")):
        src_cache.to_cache(dst_cache, [1, EmptiesDstIds()], dst_ids)
    assert_bitwise_equal(as_int(dst_mem[0]), before[0], "dst memory after a refused call")
    src_ids = [1, 2]

    class EmptiesSrcIds:
        def __index__(self):
            src_ids.clear()
            return 6

    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, [1, 2], [3, 6],
                  call_ids=(src_ids, [3, EmptiesSrcIds()]))


def test_host_read_only_dst_refused(gen):
    src_cache = kvbm_ext.PagedKVCache([random_tensor((2, 7, 4, 2, 8), torch.float16, generator=gen).numpy()],
                                      "kbthd")
    frozen = np.zeros((2, 7, 4, 2, 8), np.float16)
    frozen.setflags(write=False)
    dst_cache = kvbm_ext.PagedKVCache([frozen], "kbthd")
    with pytest.raises(ValueError, match=path_regex("dst")) as info:
        src_cache.to_cache(dst_cache, [1], [2])
    assert "read-only" in str(info.value)
    assert not frozen.any()


# ==========================================================================
# GPU.
# ==========================================================================


def device_ids(ids, dtype):
    return torch.tensor(ids, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dst_name", KV)
@pytest.mark.parametrize("src_name", KV)
def test_gpu_device_to_device_every_pair(src_name, dst_name, gen):
    """One launch for every layer and block; ids on the host, or on the device (int32 or
    int64, by pair)."""
    src, src_mem, src_cache = make(src_name, gen, "cuda")
    dst, dst_mem, dst_cache = make(dst_name, gen, "cuda")
    src_ids, dst_ids = random_ids(gen)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, src_ids, dst_ids)
    dtype = torch.int32 if (KV.index(src_name) + KV.index(dst_name)) % 2 else torch.int64
    src_ids, dst_ids = random_ids(gen)
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, src_ids, dst_ids,
                  call_ids=(device_ids(src_ids, dtype), device_ids(dst_ids, dtype)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engines", "async"])
@pytest.mark.parametrize("pool", PINNED)
@pytest.mark.parametrize("device_name", ["vllm_packed", "vllm_flash_attn", "flashinfer_hnd", "vllm_cross_layer",
                                         "transformers", "sglang_mha"])
def test_gpu_device_and_pinned_both_directions(device_name, pool, backend, gen):
    """Offload into a pinned pool and onload back into other blocks, with a selection."""
    dev, dev_mem, dev_cache = make(device_name, gen, "cuda")
    host, host_mem, host_cache = make(pool, gen, pin=True)
    src_ids, dst_ids = random_ids(gen, nb=5)
    run_and_check(dev, dev_mem, dev_cache, host, host_mem, host_cache, src_ids, dst_ids, backend=backend)
    back_ids = torch.randperm(D.blocks, generator=gen)[:5].tolist()
    run_and_check(host, host_mem, host_cache, dev, dev_mem, dev_cache, dst_ids, back_ids, backend=backend)
    run_and_check(dev, dev_mem, dev_cache, host, host_mem, host_cache, [2], [6], backend=backend,
                  layers=slice(1, 3), heads=1, head_offset=1, num_ctas=3)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["universal_pool", "hicache_page_first", "transformers"])
def test_gpu_pinned_many_blocks_cross_pieces(pool, gen):
    """Enough blocks (Llama-like rows, 64 blocks of 1.5 MiB) that the staged move runs in
    several pieces, the first ones parts of a block, both directions, device ids on the
    device side."""
    d = Dims(nl=24, nh=8, nt=16, hd=128, blocks=80)
    dev, dev_mem, dev_cache = make("vllm_packed", gen, "cuda", d=d)
    host, host_mem, host_cache = make(pool, gen, pin=True, d=d)
    src_ids, dst_ids = random_ids(gen, nb=64, blocks=80)
    run_and_check(dev, dev_mem, dev_cache, host, host_mem, host_cache, src_ids, dst_ids, d, d,
                  call_ids=(device_ids(src_ids, torch.int64), dst_ids))
    back = torch.randperm(80, generator=gen)[:64].tolist()
    run_and_check(host, host_mem, host_cache, dev, dev_mem, dev_cache, dst_ids, back, d, d,
                  call_ids=(dst_ids, device_ids(back, torch.int32)))


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [576, 580, 578], ids=["16B-vectors", "8B-vectors", "4B-vectors"])
@pytest.mark.parametrize("place,backend", [("device", "auto"), ("pinned", "kernel"), ("pinned", "copy_engines")])
def test_gpu_chunks_of_several_tiles(hd, place, backend, gen):
    """MLA rows of DeepSeek's width: a block's 16 tokens of one layer (18 KiB and more) span
    more than one full tile, and the kernels cut such a chunk into equal smaller tiles; both
    directions, every byte compared."""
    d = Dims(nl=3, nh=1, nt=16, hd=hd, blocks=9)
    dev, dev_mem, dev_cache = make("mla", gen, "cuda", d=d)
    other, other_mem, other_cache = make("mla", gen, "cuda" if place == "device" else "cpu",
                                         pin=place == "pinned", d=d)
    src_ids, dst_ids = random_ids(gen, nb=6, blocks=d.blocks)
    run_and_check(dev, dev_mem, dev_cache, other, other_mem, other_cache, src_ids, dst_ids, d, d, backend=backend)
    back = torch.randperm(d.blocks, generator=gen)[:6].tolist()
    run_and_check(other, other_mem, other_cache, dev, dev_mem, dev_cache, dst_ids, back, d, d, backend=backend)


# (pinned pool, dims, nb, pieces, largest piece in MiB) of a staged offload and onload through
# the default 48 MiB lanes.  A universal pool's 5 MiB Llama-70B block is cut by heads, as the
# paged path cuts it: a 0.6 MiB lead, the 4.4 MiB rest of the block on the edge CTAs, then
# pieces doubling up to half a lane.  MLA blocks of 1.41 MiB do not divide the 4 MiB ramp: it
# ends at two blocks, and pieces double from there (1, 2, 4, 8, 16, 17, 16 blocks) instead of
# staying at two blocks on the edge CTAs.  Llama-8B's 2 MiB blocks at nb = 8: 1 + 1 MiB, 2
# blocks, then the last 5 blocks as one piece rather than 4 and a remnant of 1.
LLAMA_70B = Dims(nl=80, nh=8, nt=16, hd=128, blocks=64)
LLAMA_8B = Dims(nl=32, nh=8, nt=16, hd=128, blocks=64)
MLA_70B = Dims(nl=80, nh=1, nt=16, hd=576, blocks=64)
STAGED_PLANS = [("universal_pool", LLAMA_70B, 1, 2, "4.38"), ("universal_pool", LLAMA_70B, 8, 5, "20.00"),
                ("universal_pool", LLAMA_70B, 64, 19, "20.00"), ("mla", MLA_70B, 64, 7, "23.91"),
                ("universal_pool", LLAMA_8B, 8, 4, "10.00")]


@pytest.mark.gpu
@pytest.mark.parametrize("pool,d,nb,pieces,largest", STAGED_PLANS,
                         ids=[f"{p[0]}-nl{p[1].nl}-nb{p[2]}" for p in STAGED_PLANS])
def test_gpu_staged_pieces_lead_ramp_then_double(pool, d, nb, pieces, largest, gen, caplog, monkeypatch):
    assert kvbm_ext.staging_info()["lane_bytes"] == 48 << 20, kvbm_ext.staging_info()
    dev, dev_mem, dev_cache = make("mla" if pool == "mla" else "vllm_flash_attn", gen, "cuda", d=d)
    host, host_mem, host_cache = make(pool, gen, pin=True, d=d)
    src_ids, dst_ids = random_ids(gen, nb=nb, blocks=d.blocks)
    back = torch.randperm(d.blocks, generator=gen)[:nb].tolist()
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        run_and_check(dev, dev_mem, dev_cache, host, host_mem, host_cache, src_ids, dst_ids, d, d)
        run_and_check(host, host_mem, host_cache, dev, dev_mem, dev_cache, dst_ids, back, d, d)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext" and "path staged" in r.getMessage()]
    assert len(lines) == 2, lines
    for line in lines:
        assert re.search(rf"; {pieces} pieces of up to {largest} MiB on lane \d, permute on at most 8 CTAs, 32 for "
                         rf"the short pieces at the ends,", line), line


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["offload", "onload"])
def test_gpu_auto_stages_pinned_moves(direction, gen, caplog, monkeypatch):
    """backend="auto" with a pinned pool and host ids for it: the staged path (the debug
    line says so); pinned ids on the device: the kernel, saying why."""
    dev, dev_mem, dev_cache = make("vllm_packed", gen, "cuda")
    host, host_mem, host_cache = make("hicache_layer_first", gen, pin=True)
    a, b = (dev_cache, host_cache) if direction == "offload" else (host_cache, dev_cache)
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        a.to_cache(b, [1, 2], [3, 4])
        a.to_cache(b, device_ids([1, 2], torch.int64), device_ids([3, 4], torch.int64))
        sync()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("PagedKVCache.to_cache: path staged"), lines[0]
    assert lines[1].startswith("PagedKVCache.to_cache: path kernel") and "on the device" in lines[1], lines[1]


GRAPH_ID_SETS = [([5, 1, 2], [0, 6, 3]), ([6, 6, 0], [1, 2, 4]), ([3, 4, 5], [5, 4, 3])]


@pytest.mark.gpu
@pytest.mark.parametrize("dst_place", ["device", "pinned"])
def test_gpu_cuda_graph_capture_and_replay_with_new_ids(dst_place, gen):
    """Device ids: warm up, capture one call, then for new ids written into the same id
    tensors and new source data, every replay moves the current ids' blocks."""
    src, src_mem, src_cache = make("transformers", gen, "cuda")
    dst, dst_mem, dst_cache = make("universal_pool", gen, "cuda" if dst_place == "device" else "cpu",
                                   pin=dst_place == "pinned")
    s_ids, d_ids = device_ids([0, 1, 2], torch.int64), device_ids([2, 1, 0], torch.int32)
    stream = torch.cuda.current_stream()
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, [0, 1, 2], [2, 1, 0], call_ids=(s_ids, d_ids),
                  stream=stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        src_cache.to_cache(dst_cache, s_ids, d_ids, stream=torch.cuda.current_stream())
    sync()
    for new_src, new_dst in GRAPH_ID_SETS:
        s_ids.copy_(torch.tensor(new_src))
        d_ids.copy_(torch.tensor(new_dst, dtype=torch.int32))
        for m in src_mem:
            m.copy_(random_tensor(m.shape, m.dtype, "cuda", gen))
        poison_(dst_mem)
        sync()
        src_before, want = snapshot(src_mem), snapshot(dst_mem)
        g.replay()
        sync()
        reference(src, dst, src_before, want, new_src, new_dst)
        for i, (got, w) in enumerate(zip(dst_mem, want)):
            assert_bitwise_equal(as_int(got), w, f"dst memory #{i} after a replay")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "kernel"])
@pytest.mark.parametrize("route", ["device to device", "offload", "onload"])
def test_gpu_waits_for_work_queued_on_the_callers_stream(route, backend, gen):
    """After a warm-up (module loading blocks the host on its first launch), a long kernel
    then a rewrite of the source on the caller's stream: the call returns while that
    stream still sleeps, and moves the rewritten bytes."""
    pinned = {"device to device": False, "offload": True, "onload": True}[route]
    dev, dev_mem, dev_cache = make("vllm_packed", gen, "cuda")
    other_dev = "cpu" if pinned else "cuda"
    oth, oth_mem, oth_cache = make("universal_pool", gen, other_dev, pin=pinned)
    src, src_mem, src_cache, dst, dst_mem, dst_cache = (
        (oth, oth_mem, oth_cache, dev, dev_mem, dev_cache) if route == "onload"
        else (dev, dev_mem, dev_cache, oth, oth_mem, oth_cache))
    run_and_check(src, src_mem, src_cache, dst, dst_mem, dst_cache, [1, 2], [3, 4], backend=backend)  # warm-up
    s = torch.cuda.Stream()
    fresh = [random_tensor(m.shape, m.dtype, "cpu", gen) for m in src_mem]
    staged = [f.to("cuda") for f in fresh]
    poison_(dst_mem)
    sync()
    want = snapshot(dst_mem)
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for m, f in zip(src_mem, staged):
            m.copy_(f, non_blocking=True)
        src_cache.to_cache(dst_cache, [6, 0, 5], [2, 5, 1], backend=backend)
        assert not s.query(), "the call waited for the stream (or the sleep was too short)"
    s.synchronize()
    sync()
    reference(src, dst, [as_int(f) for f in fresh], want, [6, 0, 5], [2, 5, 1])
    for i, (got, w) in enumerate(zip(dst_mem, want)):
        assert_bitwise_equal(as_int(got), w, f"dst memory #{i}")


@pytest.mark.gpu
def test_gpu_pageable_host_cache_refused_before_any_write(gen):
    dev, dev_mem, dev_cache = make("vllm_flash_attn", gen, "cuda")
    host, host_mem, host_cache = make("hicache_layer_first", gen)  # pageable
    poison_(host_mem)
    before = snapshot(host_mem)
    with pytest.raises(ValueError, match=path_regex(r"dst\.layers")) as info:
        dev_cache.to_cache(host_cache, [1], [2])
    assert "pageable" in str(info.value)
    assert_bitwise_equal(as_int(host_mem[0]), before[0], "pageable pool")
    with pytest.raises(ValueError, match=path_regex(r"layers")):
        host_cache.to_cache(dev_cache, [1], [2])


@pytest.mark.gpu
def test_gpu_device_ids_with_host_caches_refused(gen):
    src, src_mem, src_cache = make("vllm_flash_attn", gen)
    dst, dst_mem, dst_cache = make("universal_pool", gen)
    with pytest.raises(ValueError, match=path_regex("src_ids")):
        src_cache.to_cache(dst_cache, device_ids([1], torch.int64), [2])


@pytest.mark.gpu(count=2)
def test_gpu_caches_on_two_devices_refused(gen):
    a = kvbm_ext.PagedKVCache([random_tensor((2, 7, 4, 2, 8), torch.bfloat16, "cuda:0", gen)], "kbthd")
    b = kvbm_ext.PagedKVCache([random_tensor((2, 7, 4, 2, 8), torch.bfloat16, "cuda:1", gen)], "kbthd")
    with pytest.raises(ValueError, match=path_regex("dst")) as info:
        a.to_cache(b, [1], [2])
    assert "cuda:1" in str(info.value)
