"""The options every move takes, read the same way on both APIs: the chunk order is
`layout=` on every function (PagedKVCache's operational methods keep `inner=` as a
deprecated spelling), and a stream handle of 2**64 - 1 is refused.

References are plain PyTorch indexing; destinations are poisoned before each call and
compared byte for byte with torch.equal.
"""

import warnings

import numpy as np
import pytest
import torch

import kvbm_ext

NL, NO, NB, NT, NH, HD = 3, 2, 6, 4, 5, 8
POISON = -7.25


def make_cache(gen):
    """A host cache of NL per-layer arrays [no, num_blocks, nt, nh, hd] ("kbthd")."""
    layers = [torch.randn((NO, NB, NT, NH, HD), generator=gen) for _ in range(NL)]
    return layers, kvbm_ext.PagedKVCache(layers, "kbthd")


def expected_operational(layers, block_id, layout):
    """operationals[b][l, o] of cache block `block_id`: [nt, nh, hd] (NHD) or [nh, nt, hd] (HND)
    flattened."""
    rows = torch.stack([layer[:, block_id] for layer in layers])  # [nl, no, nt, nh, hd]
    if layout.upper() == "HND":
        rows = rows.permute(0, 1, 3, 2, 4)
    return rows.reshape(NL, NO, NT * NH * HD)


def poisoned_operationals(count):
    return [torch.full((NL, NO, NT * NH * HD), POISON) for _ in range(count)]


IDS = [4, 1, 5]


@pytest.mark.parametrize("layout", ["NHD", "HND", "hnd"])
def test_to_operational_takes_layout(layout, gen):
    layers, cache = make_cache(gen)
    ops = poisoned_operationals(len(IDS))
    cache.to_operational(IDS, ops, layout=layout)
    for b, block_id in enumerate(IDS):
        assert torch.equal(ops[b], expected_operational(layers, block_id, layout)), (layout, b)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_from_operational_takes_layout(layout, gen):
    layers, cache = make_cache(gen)
    sources = [torch.randn((NL, NO, NT * NH * HD), generator=gen) for _ in IDS]
    before = [layer.clone() for layer in layers]
    cache.from_operational(sources, IDS, layout=layout)
    for b, block_id in enumerate(IDS):
        assert torch.equal(expected_operational(layers, block_id, layout), sources[b]), (layout, b)
    untouched = [i for i in range(NB) if i not in IDS]
    for layer, old in zip(layers, before):
        assert torch.equal(layer[:, untouched], old[:, untouched])


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_inner_is_a_deprecated_spelling_of_layout(method, layout, gen):
    """inner= moves the same bytes as layout=, with a DeprecationWarning naming layout=."""
    layers, cache = make_cache(gen)
    if method == "to_operational":
        by_layout, by_inner = poisoned_operationals(len(IDS)), poisoned_operationals(len(IDS))
        cache.to_operational(IDS, by_layout, layout=layout)
        with pytest.warns(DeprecationWarning, match="layout="):
            cache.to_operational(IDS, by_inner, inner=layout)
        for a, b in zip(by_layout, by_inner):
            assert torch.equal(a, b)
        return
    sources = [torch.randn((NL, NO, NT * NH * HD), generator=gen) for _ in IDS]
    cache.from_operational(sources, IDS, layout=layout)
    by_layout = [layer.clone() for layer in layers]
    for layer in layers:
        layer.fill_(POISON)
    with pytest.warns(DeprecationWarning, match="layout="):
        cache.from_operational(sources, IDS, inner=layout)
    for b, block_id in enumerate(IDS):
        assert torch.equal(expected_operational(layers, block_id, layout), sources[b])
        assert torch.equal(expected_operational(by_layout, block_id, layout), sources[b])


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_layout_and_inner_together_are_refused(method, gen):
    layers, cache = make_cache(gen)
    ops = poisoned_operationals(len(IDS))
    before = [layer.clone() for layer in layers]
    args = (IDS, ops) if method == "to_operational" else (ops, IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(TypeError, match=rf"^{method}\(\) got both layout and inner"):
            getattr(cache, method)(*args, layout="NHD", inner="NHD")
    for op in ops:
        assert torch.equal(op, torch.full_like(op, POISON))
    for layer, old in zip(layers, before):
        assert torch.equal(layer, old)


@pytest.mark.parametrize("name", ["layout", "inner"])
@pytest.mark.parametrize("value,exc", [("NDH", ValueError), ("", ValueError), (5, TypeError)])
def test_a_bad_chunk_order_names_the_argument_given(name, value, exc, gen):
    _, cache = make_cache(gen)
    ops = poisoned_operationals(len(IDS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(exc, match=rf"^{name}: "):
            cache.to_operational(IDS, ops, **{name: value})
    for op in ops:
        assert torch.equal(op, torch.full_like(op, POISON))


def test_layout_is_in_the_signature():
    import inspect

    for method in ("to_operational", "from_operational"):
        parameters = inspect.signature(getattr(kvbm_ext.PagedKVCache, method)).parameters
        assert parameters["layout"].default == "NHD", method
        assert parameters["inner"].default is None, method
        assert parameters["layout"].kind == inspect.Parameter.KEYWORD_ONLY, method


@pytest.mark.parametrize("value", [2**64 - 1, np.uint64(2**64 - 1)], ids=["int", "np.uint64"])
def test_stream_handle_all_ones_is_refused(value, gen):
    """2**64 - 1 is no cudaStream_t; refused on both APIs before anything is read."""
    layers, cache = make_cache(gen)
    universals = [torch.full((NH, NL, NO, NT, HD), POISON) for _ in IDS]
    with pytest.raises(ValueError, match=r"^stream: 2\*\*64 - 1 is not a cudaStream_t handle"):
        cache.to_universal(IDS, universals, stream=value)
    blocks = [[torch.randn((NT, NH, HD), generator=gen) for _ in range(NL * NO)] for _ in IDS]
    with pytest.raises(ValueError, match=r"^stream: 2\*\*64 - 1 is not a cudaStream_t handle"):
        kvbm_ext.block_to_universal(blocks, universals, stream=value)
    for u in universals:
        assert torch.equal(u, torch.full_like(u, POISON))


# --------------------------------------------------------------------------
# What one launch can take (kvbm_fits_one_launch), checked before any byte
# is read.  The arrays below only describe their sizes (the call is refused
# before it would read them): their data is a small buffer.
# --------------------------------------------------------------------------


class Described:
    """An array that describes a shape of one-byte elements over a small buffer."""

    def __init__(self, shape):
        self._buffer = np.zeros(64, np.uint8)
        self.__array_interface__ = {"shape": tuple(shape), "typestr": "|u1", "version": 3,
                                    "data": (self._buffer.ctypes.data, False), "strides": None}


@pytest.mark.parametrize("nb,nh,nl,no,nt,hd", [(1, 1, 1, 1, 2**16, 2**16 + 1), (2**22, 1, 128, 2, 1, 1024)],
                         ids=["a chunk of 4 GiB", "2**31 tiles"])
def test_list_call_too_large_for_one_launch(nb, nh, nl, no, nt, hd):
    universals = Described((nb, nh, nl, no, nt, hd))
    operationals = Described((nb, nl, no, nt * nh * hd))
    with pytest.raises(ValueError, match=r"^universals: too much data for one call .*split it into several calls"):
        kvbm_ext.universal_to_operational(universals, operationals)


# --------------------------------------------------------------------------
# Options only a GPU move takes, on calls that run on the CPU (no array on a
# CUDA device): refused naming the option, unless left at their defaults.
# --------------------------------------------------------------------------

GPU_ONLY = [("backend", "kernel", '"kernel" picks how a GPU moves the bytes'),
            ("backend", "COPY_ENGINES", '"copy_engines" picks how a GPU moves the bytes'),
            ("backend", "async", '"async" picks how a GPU moves the bytes'),
            ("num_ctas", 8, "8 bounds the CUDA blocks of a GPU move"),
            ("stream", 0, "orders a GPU move"),
            ("stream", 1, "orders a GPU move")]
DEFAULTS = {"backend": "auto", "num_ctas": None, "stream": None}


def host_universal_call(gen):
    """block_to_universal on host arrays: (call, destinations, expected destinations)."""
    blocks = [[torch.randn((NT, NH, HD), generator=gen) for _ in range(NL * NO)] for _ in range(2)]
    universals = [torch.full((NH, NL, NO, NT, HD), POISON) for _ in range(2)]
    expected = [torch.stack(chunks).reshape(NL, NO, NT, NH, HD).permute(3, 0, 1, 2, 4) for chunks in blocks]
    return (lambda **kw: kvbm_ext.block_to_universal(blocks, universals, **kw)), universals, expected


@pytest.mark.parametrize("name,value,words", GPU_ONLY, ids=[f"{n}={v}" for n, v, _ in GPU_ONLY])
def test_gpu_only_option_on_host_arrays_is_refused(name, value, words, gen):
    call, universals, _ = host_universal_call(gen)
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        call(**{name: value})
    assert words in str(info.value) and "runs on the CPU" in str(info.value), str(info.value)
    for u in universals:
        assert torch.equal(u, torch.full_like(u, POISON))


def test_gpu_only_options_at_their_defaults_run_on_the_cpu(gen):
    call, universals, expected = host_universal_call(gen)
    call(**DEFAULTS)
    for u, e in zip(universals, expected):
        assert torch.equal(u, e)


@pytest.mark.parametrize("method", ["to_universal", "from_universal", "to_operational", "from_operational"])
@pytest.mark.parametrize("name,value,words", GPU_ONLY, ids=[f"{n}={v}" for n, v, _ in GPU_ONLY])
def test_gpu_only_option_on_a_host_cache_is_refused(method, name, value, words, gen):
    layers, cache = make_cache(gen)
    before = [layer.clone() for layer in layers]
    shape = (NH, NL, NO, NT, HD) if "universal" in method else (NL, NO, NT * NH * HD)
    fill = (lambda: torch.full(shape, POISON)) if method.startswith("to_") else (lambda: torch.randn(shape, generator=gen))
    flats = [fill() for _ in IDS]
    flats_before = [f.clone() for f in flats]
    args = (IDS, flats) if method.startswith("to_") else (flats, IDS)
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        getattr(cache, method)(*args, **{name: value})
    assert words in str(info.value) and "runs on the CPU" in str(info.value), str(info.value)
    for f, old in zip(flats, flats_before):
        assert torch.equal(f, old)
    for layer, old in zip(layers, before):
        assert torch.equal(layer, old)


@pytest.mark.parametrize("method", ["to_operational", "from_operational"])
def test_gpu_only_options_at_their_defaults_run_on_a_host_cache(method, gen):
    layers, cache = make_cache(gen)
    if method == "to_operational":
        ops = poisoned_operationals(len(IDS))
        cache.to_operational(IDS, ops, **DEFAULTS)
        for b, block_id in enumerate(IDS):
            assert torch.equal(ops[b], expected_operational(layers, block_id, "NHD"))
        return
    sources = [torch.randn((NL, NO, NT * NH * HD), generator=gen) for _ in IDS]
    cache.from_operational(sources, IDS, **DEFAULTS)
    for b, block_id in enumerate(IDS):
        assert torch.equal(expected_operational(layers, block_id, "NHD"), sources[b])


# --------------------------------------------------------------------------
# Without a CUDA device, the staging functions say so as the raw copies do.
# --------------------------------------------------------------------------


NEED_A_DEVICE = [("staging_info", ()), ("staging_info", (0,)), ("staging_info", (None,)), ("reserve_staging", ()),
                 ("reserve_staging", (0,)), ("reserve_staging", (None,)), ("vectorized_copy", "pairs")]


@pytest.mark.skipif(bool(kvbm_ext.cuda_devices()), reason="a CUDA device is visible")
@pytest.mark.parametrize("fn,args", NEED_A_DEVICE, ids=[f"{fn}{args}" for fn, args in NEED_A_DEVICE])
def test_without_a_device_the_message_says_one_is_needed(fn, args):
    a = np.arange(16, dtype=np.uint8)
    if args == "pairs":
        args = ([a.ctypes.data], [a.ctypes.data + 8], 8)
    with pytest.raises(RuntimeError, match=rf"^{fn} needs a CUDA device \(") as info:
        getattr(kvbm_ext, fn)(*args)
    message = str(info.value)
    if kvbm_ext.is_using_stubs():
        assert message.endswith("but kvbm_ext was built without CUDA (nvcc was not found at build time)"), message
    else:
        assert message.endswith("and none is visible: no GPU, or no usable driver"), message
    assert "insufficient" not in message and "CUDA error" not in message, message
    assert np.array_equal(a, np.arange(16, dtype=np.uint8))
