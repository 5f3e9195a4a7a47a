"""Every engine's cache described once (tests/support/engines.py, docs/engines.md), moved to
and from universal blocks bit for bit.

The reference moves rows through plain-torch views written from each engine's documented
shape, on CPU copies of the engine's memory; the whole memory (spare blocks and every byte
the call must not touch included) and the whole universal array are compared. Destinations
are poisoned; ids are random; GPU cases run where torch sees a GPU, on device universals
and on pinned ones (the staged copy-engine path).
"""

import re

import pytest
import torch

import kvbm_ext
from support.engines import ENGINES, Dims, by_stride_order
from support.references import selected
from support.asserts import assert_bitwise_equal, path_regex, poison_
from support.builders import random_tensor
from support.devices import sync
from support.references import as_int

D = Dims(nl=3, nh=2, nt=4, hd=8, blocks=7)
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32, torch.int8]
NAMES = list(ENGINES)
WHERE = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda+pinned", marks=pytest.mark.gpu)]


def dtype_of(name):
    return DTYPES[NAMES.index(name) % len(DTYPES)]


def dims_for(name):
    """SGLang at page_size 1 and 16 besides the default 4."""
    return {"sglang_mha": Dims(nt=16, blocks=5)}.get(name, D)


def snapshot(memory):
    return [as_int(x.detach()).cpu().clone() for x in memory]


def universal_shape(e, d, nb):
    x = e.dims(d)
    return (nb, x.nh, x.nl, e.no, x.nt, x.hd)


def universals(e, d, nb, dtype, gen, where, poisoned):
    device = "cpu" if where == "cpu" else "cuda"
    u = random_tensor(universal_shape(e, d, nb), dtype, device, gen, pin=where == "cuda+pinned")
    return poison_(u) if poisoned else u


def ref_to_universal(e, d, memory, ids, want):
    rows = e.rows(memory, d)
    for b, i in enumerate(ids):
        for l in range(d.nl):
            for o in range(e.no):
                want[b, :, l, o] = rows[l][o][i].transpose(0, 1)


def ref_from_universal(e, d, memory, ids, source):
    rows = e.rows(memory, d)
    for b, i in enumerate(ids):
        for l in range(d.nl):
            for o in range(e.no):
                rows[l][o][i].copy_(source[b, :, l, o].transpose(0, 1))


def setup(name, where, gen):
    e, d = ENGINES[name], dims_for(name)
    memory = e.allocate(d, dtype_of(name), gen, "cpu" if where == "cpu" else "cuda")
    return e, d, memory, e.build(memory, d)


@pytest.mark.parametrize("name", NAMES)
def test_described_from_the_engines_own_tensors(name, gen):
    e, d, memory, cache = setup(name, "cpu", gen)
    x = e.dims(d)
    got = (cache.num_layers, cache.num_outer, cache.num_heads, cache.block_size, cache.head_dim,
           cache.num_blocks)
    assert got == (x.nl, e.no, x.nh, x.nt, x.hd, x.blocks)
    assert cache.layout == e.layout
    arg = e.arg(memory, x)
    if isinstance(arg, list) and isinstance(arg[0], tuple):
        assert all(k is a and v is b for (k, v), (a, b) in zip(cache.layers, arg)), "the pairs are not kept as given"
    # No copy: bytes written into the engine's memory now are what the next call reads.
    for m in memory:
        m.copy_(random_tensor(m.shape, m.dtype, generator=gen))
    u = universals(e, d, 2, m.dtype, gen, "cpu", poisoned=True)
    cache.to_universal([1, x.blocks - 1], u)
    want = poison_(as_int(u.clone()))
    ref_to_universal(e, d, snapshot(memory), [1, x.blocks - 1], want)
    assert_bitwise_equal(as_int(u), want, "universals")


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", NAMES)
def test_to_universal(name, where, gen):
    e, d, memory, cache = setup(name, where, gen)
    before = snapshot(memory)
    ids = torch.randint(0, e.dims(d).blocks, (5,), generator=gen).tolist()  # repeats read twice: fine
    u = universals(e, d, len(ids), memory[0].dtype, gen, where, poisoned=True)
    cache.to_universal(ids, u)
    sync()
    want = poison_(as_int(u.cpu().clone()))
    ref_to_universal(e, d, before, ids, want)
    assert_bitwise_equal(as_int(u), want, "universals")
    for i, (got, was) in enumerate(zip(memory, before)):
        assert_bitwise_equal(as_int(got), was, f"source memory #{i}")


@pytest.mark.parametrize("ids_on", ["host", "device"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", NAMES)
def test_from_universal(name, where, ids_on, gen):
    """Ids in a host list, or on the device (int32): no host read, the same bytes."""
    if ids_on == "device" and where == "cpu":
        pytest.skip("device ids need a device cache")
    e, d, memory, cache = setup(name, where, gen)
    poison_(memory)
    sync()
    want = snapshot(memory)
    ids = torch.randperm(e.dims(d).blocks, generator=gen)[:4].tolist()
    u = universals(e, d, len(ids), memory[0].dtype, gen, where, poisoned=False)
    source = as_int(u.cpu().clone())
    cache.from_universal(u, ids if ids_on == "host" else torch.tensor(ids, dtype=torch.int32, device="cuda"))
    sync()
    ref_from_universal(e, d, want, ids, source)
    for i, (got, w) in enumerate(zip(memory, want)):
        assert_bitwise_equal(as_int(got), w, f"cache memory #{i}")
    assert_bitwise_equal(as_int(u), source, "universals (source)")


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", NAMES)
def test_repeated_destination_ids_refused(name, where, gen):
    e, d, memory, cache = setup(name, where, gen)
    before = snapshot(memory)
    u = universals(e, d, 3, memory[0].dtype, gen, where, poisoned=False)
    with pytest.raises(ValueError, match=path_regex(r"block_ids\[2\]")) as info:
        cache.from_universal(u, [4, 1, 4])
    assert "repeats block_ids[0]" in str(info.value)
    sync()
    for i, (got, was) in enumerate(zip(memory, before)):
        assert_bitwise_equal(as_int(got), was, f"cache memory #{i} after a refused call")


@pytest.mark.parametrize("where", WHERE)
def test_pairs_give_the_canonical_universal_of_the_same_data_in_kbthd(where, gen):
    """K and V as separate tensors per layer: the universal form is the canonical
    [nh, nl, 2, nt, hd], byte for byte what the same data in a "kbthd" cache gives."""
    device = "cpu" if where == "cpu" else "cuda"
    nl, blocks, nt, nh, hd = 3, 6, 4, 2, 16
    kbthd = [random_tensor((2, blocks, nt, nh, hd), torch.bfloat16, device, gen) for _ in range(nl)]
    pairs = [(x[0].flatten(0, 1).clone(), x[1].flatten(0, 1).clone()) for x in kbthd]
    a = kvbm_ext.PagedKVCache(kbthd, "kbthd")
    b = kvbm_ext.PagedKVCache(pairs, "(bt)hd", block_size=nt)
    ids = [5, 0, 3]
    ua, ub = (poison_(random_tensor((3, nh, nl, 2, nt, hd), torch.bfloat16, device, gen, pin=where == "cuda+pinned"))
              for _ in range(2))
    a.to_universal(ids, ua)
    b.to_universal(ids, ub)
    sync()
    assert_bitwise_equal(as_int(ub), as_int(ua), "universal of the pairs against that of kbthd")


def test_vllm_views_have_the_engines_stride_order():
    """The helper builds vLLM's logical views as vLLM does (allocate in physical order,
    permute back): check them against the shapes and stride orders vLLM's backends give."""
    nb, bs, nkv, hs = 5, 16, 4, 8
    packed = by_stride_order(torch.empty(nb, bs, nkv, 2 * hs), (0, 2, 1, 3))
    assert tuple(packed.shape) == (nb, nkv, bs, 2 * hs)  # get_kv_cache_shape
    assert packed.permute(0, 2, 1, 3).is_contiguous()
    flashinfer = by_stride_order(torch.empty(nb, 2, nkv, bs, hs), (0, 1, 3, 2, 4))
    assert tuple(flashinfer.shape) == (nb, 2, bs, nkv, hs)
    assert flashinfer.permute(0, 1, 3, 2, 4).is_contiguous()
    cross = by_stride_order(torch.empty(nb, 3, bs, nkv, 2 * hs), (1, 0, 3, 2, 4))
    assert tuple(cross.shape) == (3, nb, nkv, bs, 2 * hs)
    assert cross.permute(1, 0, 3, 2, 4).is_contiguous()


def kv(n=3, rows=12, dtype=torch.float16):
    return [(random_tensor((rows, 2, 8), dtype), random_tensor((rows, 2, 8), dtype)) for _ in range(n)]


def error_cases():
    per_layer = [random_tensor((6, 4, 2, 16), torch.float16) for _ in range(2)]
    return {
        "no block_size": (lambda: kv(), "(bt)hd", {}, ValueError, "block_size", "block_size="),
        "block_size does not divide": (lambda: kv(), "(bt)hd", {"block_size": 5}, ValueError, "block_size",
                                       "does not fit"),
        "block_size differs from t": (lambda: per_layer, "bthd", {"block_size": 3}, ValueError, "block_size",
                                      "has 4 tokens"),
        "two unknown letters": (lambda: per_layer, "(bh)tkd", {}, ValueError, "layout", "not known"),
        "odd packed dimension": (lambda: [random_tensor((6, 4, 2, 15), torch.float16)], "bth(kd)", {},
                                 ValueError, r"layers\[0\]", "not a multiple of 2"),
        "pairs with k": (lambda: kv(), "(bt)khd", {"block_size": 4}, ValueError, "layout", "(K, V) pairs"),
        "pairs with l": (lambda: kv(), "l(bt)hd", {"block_size": 4}, ValueError, "layout", "(K, V) pairs"),
        "a pair of three": (lambda: [kv()[0] + (kv()[0][0],)], "(bt)hd", {"block_size": 4}, ValueError,
                            r"layers\[0\]", "2 arrays"),
        "an array among pairs": (lambda: kv(2) + [kv()[0][0]], "(bt)hd", {"block_size": 4}, TypeError,
                                 r"layers\[2\]", "pair"),
        "K and V shapes differ": (lambda: [(kv()[0][0], random_tensor((8, 2, 8), torch.float16))], "(bt)hd",
                                  {"block_size": 4}, ValueError, r"layers\[0\]\[1\]", "shape"),
        "K and V types differ": (lambda: [(kv()[0][0], random_tensor((12, 2, 8), torch.int16))], "(bt)hd",
                                 {"block_size": 4}, TypeError, r"layers\[0\]\[1\]", "element type"),
        "nested group": (lambda: per_layer, "bt(h(kd))", {}, ValueError, "layout", "nest"),
        "unclosed group": (lambda: per_layer, "bth(kd", {}, ValueError, "layout", "not closed"),
        "stray parenthesis": (lambda: per_layer, "bth)kd", {}, ValueError, "layout", "closes no group"),
        "empty group": (lambda: per_layer, "bth()kd", {}, ValueError, "layout", "empty"),
        "block_size zero": (lambda: kv(), "(bt)hd", {"block_size": 0}, ValueError, "block_size", "expected"),
        "block_size a float": (lambda: kv(), "(bt)hd", {"block_size": 4.0}, TypeError, "block_size", "int"),
    }


@pytest.mark.parametrize("case", list(error_cases()))
def test_description_errors_name_the_argument(case):
    make, layout, kwargs, exc, path, words = error_cases()[case]
    with pytest.raises(exc, match=path_regex(path)) as info:
        kvbm_ext.PagedKVCache(make(), layout, **kwargs)
    assert re.search(re.escape(words), str(info.value)), str(info.value)


def test_pairs_are_snapshotted(gen):
    """The caller's lists may change afterwards: the cache keeps the pairs it read."""
    pairs = [list(p) for p in kv()]
    cache = kvbm_ext.PagedKVCache(pairs, "(bt)hd", block_size=4)
    kept = cache.layers
    pairs[0][0] = random_tensor((12, 2, 8), torch.float16, generator=gen)
    pairs.clear()
    assert isinstance(kept, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in kept)
    u = poison_(torch.empty((1, 2, 3, 2, 4, 8), dtype=torch.float16))
    cache.to_universal([2], u)
    assert_bitwise_equal(as_int(u[0, :, 0, 0]), as_int(kept[0][0][8:12].transpose(0, 1)), "K of layer 0, block 2")


@pytest.mark.parametrize("layers", [slice(0, 2), range(2, -1, -2), 1])
def test_pairs_layer_selection_and_offsets(layers, gen):
    """layers= and layer_offset/head_offset address (K, V) pairs as they address layers."""
    d = Dims(nl=3, nh=2, nt=4, hd=8, blocks=6)
    e = ENGINES["transformers"]
    memory = e.allocate(d, torch.float16, gen)
    cache = e.build(memory, d)
    u = poison_(torch.empty((2, 3, 4, 2, 4, 8), dtype=torch.float16))
    cache.to_universal([3, 5], u, layers=layers, layer_offset=1, head_offset=1)
    want = poison_(as_int(u.clone()))
    rows = e.rows(snapshot(memory), d)
    for b, i in enumerate([3, 5]):
        for l in selected(3, layers):
            for o in range(2):
                want[b, 1:3, l + 1, o] = rows[l][o][i].transpose(0, 1)
    assert_bitwise_equal(as_int(u), want, "universals")
