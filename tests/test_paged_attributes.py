"""PagedKVCache's attributes as the caller's framework names them: `dtype` and `device` in the
types of the arrays' producer (torch.dtype / torch.device for torch tensors, numpy.dtype for
NumPy arrays, the names for every other producer), `dtype_name` / `device_name` always the
strings, `layout` and `block_size` read back as the constructor takes them (`dims` and
`tokens_per_block` their deprecated aliases), and a repr whose every `name=value` is
`name=repr(cache.name)`.  The types are made once, at construction, from what the array's
protocol reported: a layer whose own dtype or device attribute raises or changes cannot
change or break them."""

import gc
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kvbm_ext
from support.builders import dtype_id
from support.devices import cuda_case, cupy_or_skip
from support.producers import ArrayInterfaceOnly, CudaArrayInterfaceOnly, DLPackOnly

# (nl, NB, no, nh, nt, hd) of a "kbthd" layer: [no, NB, nt, nh, hd].
NL, NB, NO, NH, NT, HD = 2, 5, 2, 3, 4, 8
SHAPE = (NO, NB, NT, NH, HD)
TORCH_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64,
                torch.bool]
NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint16, np.int64, np.complex64]


def torch_layers(dtype=torch.float16, device="cpu", pin=False):
    layers = [torch.zeros(SHAPE, dtype=dtype, device=device) for _ in range(NL)]
    return [x.pin_memory() for x in layers] if pin else layers


def numpy_layers(dtype=np.float16):
    return [np.zeros(SHAPE, dtype=dtype) for _ in range(NL)]


def repr_fields(cache):
    """The name=value pairs of repr(cache), in order (values may hold parentheses and commas)."""
    text = repr(cache)
    assert text.startswith("PagedKVCache(") and text.endswith(")"), text
    fields, depth, start = [], 0, len("PagedKVCache(")
    for i, c in enumerate(text[start:-1] + ",", start):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            name, _, value = text[start:i].strip().partition("=")
            assert re.fullmatch(r"[a-z_]+", name), (name, text)
            fields.append((name, value))
            start = i + 1
    return fields


def assert_repr_round_trips(cache):
    """Every value in the repr is repr() of the attribute of that name, the constructor's
    names (layout, block_size) included and the deprecated ones absent."""
    fields = repr_fields(cache)
    names = [name for name, _ in fields]
    assert names[:2] == ["layout", "block_size"], names
    assert "tokens_per_block" not in names and "dims" not in names, names
    assert {"num_layers", "num_blocks", "num_outer", "num_heads", "head_dim", "dtype", "device"} <= set(names)
    for name, value in fields:
        assert value == repr(getattr(cache, name)), (name, value, repr(cache))


def assert_aliases(cache):
    with pytest.deprecated_call(match=r"PagedKVCache\.tokens_per_block is deprecated, read PagedKVCache\.block_size"):
        assert cache.tokens_per_block == cache.block_size
    with pytest.deprecated_call(match=r"PagedKVCache\.dims is deprecated, read PagedKVCache\.layout"):
        assert cache.dims == cache.layout


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device,pin", [pytest.param("cpu", False, id="cpu"), cuda_case("cuda", False, id="cuda"),
                                        cuda_case("cuda", True, id="cuda-pinned")])
def test_torch_cache_has_torch_dtype_and_device(dtype, device, pin):
    layers = torch_layers(dtype, "cpu" if pin else device, pin)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    assert isinstance(cache.dtype, torch.dtype) and cache.dtype is dtype is layers[0].dtype
    assert isinstance(cache.device, torch.device) and cache.device == layers[0].device
    made = torch.empty(4, dtype=cache.dtype, device=cache.device)
    assert (made.dtype, made.device) == (layers[0].dtype, layers[0].device)
    assert cache.dtype_name == str(dtype).removeprefix("torch.")
    assert cache.device_name == str(layers[0].device)
    assert cache.device_name == str(cache.device)  # str() of the torch.device is the old string
    assert_repr_round_trips(cache)


@pytest.mark.parametrize("form", ["pairs", "one array"])
def test_torch_cache_of_pairs_or_one_array(form):
    if form == "pairs":
        flat = (NB * NT, NH, HD)
        layers = [(torch.zeros(flat, dtype=torch.bfloat16), torch.zeros(flat, dtype=torch.bfloat16)) for _ in range(NL)]
        cache = kvbm_ext.PagedKVCache(layers, "(bt)hd", block_size=NT)
    else:
        cache = kvbm_ext.PagedKVCache(torch.zeros((NB, NL, NO, NT, NH, HD), dtype=torch.bfloat16), "blkthd")
    assert (cache.dtype, cache.device, cache.block_size) == (torch.bfloat16, torch.device("cpu"), NT)
    torch.empty(4, dtype=cache.dtype, device=cache.device)
    assert_repr_round_trips(cache)


# --------------------------------------------------------------------------
# NumPy and the other producers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_cache_has_numpy_dtype(dtype):
    layers = numpy_layers(dtype)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    assert isinstance(cache.dtype, np.dtype) and cache.dtype == layers[0].dtype
    assert cache.device == "cpu" == cache.device_name  # NumPy's own ndarray.device is the string "cpu"
    made = np.empty(4, dtype=cache.dtype)
    assert made.dtype == layers[0].dtype
    assert cache.dtype_name == np.dtype(dtype).name
    assert_repr_round_trips(cache)


def test_numpy_cache_leaves_torch_unimported():
    """A cache of NumPy arrays never imports torch, to construct it or to read its attributes."""
    code = (
        "import sys, numpy as np, kvbm_ext\n"
        "c = kvbm_ext.PagedKVCache([np.zeros((2, 3, 4, 2, 8), np.float16)], 'kbthd')\n"
        "assert isinstance(c.dtype, np.dtype) and c.device == 'cpu', (c.dtype, c.device)\n"
        "repr(c); c.dtype_name; c.device_name; c.layout; c.block_size\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo)


@pytest.mark.parametrize("producer", ["dlpack-only", "array-interface-only", "buffer"])
def test_other_host_producers_keep_the_names(producer):
    t = torch.zeros(SHAPE, dtype=torch.float16)
    layer = {"dlpack-only": lambda: DLPackOnly(t), "array-interface-only": lambda: ArrayInterfaceOnly(t.numpy()),
             "buffer": lambda: memoryview(t.numpy())}[producer]()
    cache = kvbm_ext.PagedKVCache([layer], "kbthd")
    assert (cache.dtype, cache.device) == ("float16", "cpu")
    assert (cache.dtype_name, cache.device_name) == ("float16", "cpu")
    assert np.empty(4, dtype=cache.dtype).dtype == np.float16  # a name NumPy, CuPy and JAX take
    assert_repr_round_trips(cache)


@pytest.mark.gpu
def test_cuda_array_interface_producer_keeps_the_names():
    cache = kvbm_ext.PagedKVCache([CudaArrayInterfaceOnly(torch.zeros(SHAPE, dtype=torch.float32, device="cuda"))],
                                  "kbthd")
    assert (cache.dtype, cache.device) == ("float32", "cuda:0")
    assert_repr_round_trips(cache)


@pytest.mark.gpu
def test_cupy_cache_keeps_the_names():
    cp = cupy_or_skip()
    cache = kvbm_ext.PagedKVCache([cp.zeros(SHAPE, dtype=cp.float16)], "kbthd")
    assert (cache.dtype, cache.device) == ("float16", f"cuda:{cp.cuda.Device().id}")
    assert cp.empty(4, dtype=cache.dtype).dtype == cp.float16
    assert_repr_round_trips(cache)


@pytest.mark.gpu
class NoSyncRefused(DLPackOnly):
    """Raises on __dlpack__(stream=-1), as JAX does on CUDA (CUDA_ERROR_INVALID_HANDLE)."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if stream == -1:
            self.calls.append({"stream": stream})
            raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_INVALID_HANDLE: invalid resource handle")
        return super().__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)


@pytest.mark.gpu
def test_a_producer_refusing_no_synchronization_is_asked_again():
    """The constructor asks for stream=-1 (only addresses are taken); a producer that raises
    there is asked again with None, and the cache moves its bytes."""
    torch.manual_seed(11)
    source = torch.randn(SHAPE, device="cuda").to(torch.bfloat16)
    layer = NoSyncRefused(source)
    cache = kvbm_ext.PagedKVCache([layer], "kbthd")
    assert [c["stream"] for c in layer.calls] == [-1, None], layer.calls
    assert (cache.dtype, cache.device) == ("bfloat16", "cuda:0")
    dst = torch.full_like(source, 7.0)
    cache.to_cache(kvbm_ext.PagedKVCache([dst], "kbthd"), [3, 0], [1, 2])
    torch.cuda.synchronize()
    want = torch.full_like(source, 7.0)
    want[:, [1, 2]] = source[:, [3, 0]]
    assert torch.equal(dst, want)


def test_jax_cache_keeps_the_names():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend: {e}")
    import jax.numpy as jnp

    cache = kvbm_ext.PagedKVCache([jax.device_put(np.zeros(SHAPE, np.float16), gpu)], "kbthd")
    assert (cache.dtype, cache.device) == ("float16", f"cuda:{gpu.local_hardware_id}")
    assert jnp.empty(4, dtype=cache.dtype).dtype == jnp.float16
    assert_repr_round_trips(cache)


# --------------------------------------------------------------------------
# The constructor's names
# --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [torch_layers, numpy_layers], ids=["torch", "numpy"])
def test_layout_and_block_size_read_back_as_the_constructor_takes_them(make):
    cache = kvbm_ext.PagedKVCache(make(), "KbThD")
    assert (cache.layout, cache.block_size) == ("kbthd", NT)
    assert_aliases(cache)
    again = kvbm_ext.PagedKVCache(cache.layers, cache.layout, block_size=cache.block_size)
    assert repr(again) == repr(cache)


def test_block_size_given_is_read_back():
    flat = [(torch.zeros(NB * NT, NH, HD), torch.zeros(NB * NT, NH, HD)) for _ in range(NL)]
    cache = kvbm_ext.PagedKVCache(flat, "(BT)HD", block_size=NT)
    assert (cache.layout, cache.block_size, cache.num_blocks) == ("(bt)hd", NT, NB)
    assert_aliases(cache)
    assert_repr_round_trips(cache)
    assert repr(kvbm_ext.PagedKVCache(cache.layers, cache.layout, block_size=cache.block_size)) == repr(cache)


def test_the_new_names_do_not_warn():
    cache = kvbm_ext.PagedKVCache(torch_layers(), "kbthd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (cache.layout, cache.block_size, cache.dtype, cache.device, cache.dtype_name, cache.device_name, repr(cache))


def test_an_alias_warning_turned_error_raises_cleanly():
    cache = kvbm_ext.PagedKVCache(torch_layers(), "kbthd")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning, match="block_size"):
            cache.tokens_per_block
        with pytest.raises(DeprecationWarning, match="layout"):
            cache.dims


# --------------------------------------------------------------------------
# Hostile layers: their own dtype / device attributes are never what the cache reports
# --------------------------------------------------------------------------


class RaisingTensor(torch.Tensor):
    @property
    def dtype(self):
        raise RuntimeError("dtype of a hostile tensor")

    @property
    def device(self):
        raise RuntimeError("device of a hostile tensor")


class ChangingTensor(torch.Tensor):
    reads = 0

    @property
    def dtype(self):
        ChangingTensor.reads += 1
        return torch.float32 if ChangingTensor.reads % 2 else torch.int8

    @property
    def device(self):
        ChangingTensor.reads += 1
        return torch.device("meta") if ChangingTensor.reads % 2 else torch.device("cpu")


class RaisingArray(np.ndarray):
    @property
    def dtype(self):
        raise RuntimeError("dtype of a hostile array")


class ChangingArray(np.ndarray):
    reads = 0

    @property
    def dtype(self):
        ChangingArray.reads += 1
        return np.dtype(np.int8 if ChangingArray.reads % 2 else np.float64)


class PretendsToBeTorch:
    """A buffer-protocol layer whose __class__ and dtype claim torch: its type is what counts."""

    def __init__(self, a):
        self._a = a

    def __buffer__(self, flags):
        return memoryview(self._a)

    @property
    def __class__(self):
        return torch.Tensor

    @property
    def dtype(self):
        raise RuntimeError("dtype of a hostile object")


@pytest.mark.parametrize("cls", [RaisingTensor, ChangingTensor])
def test_torch_layer_whose_dtype_raises_or_changes(cls):
    layers = [x.as_subclass(cls) for x in torch_layers(torch.float16)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    for _ in range(3):
        assert cache.dtype is torch.float16 and cache.device == torch.device("cpu")
    assert_repr_round_trips(cache)
    torch.empty(4, dtype=cache.dtype, device=cache.device)


@pytest.mark.parametrize("cls", [RaisingArray, ChangingArray])
def test_numpy_layer_whose_dtype_raises_or_changes(cls):
    layers = [x.view(cls) for x in numpy_layers(np.float16)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    for _ in range(3):
        assert cache.dtype == np.dtype(np.float16) and cache.device == "cpu"
    assert_repr_round_trips(cache)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="__buffer__ in Python needs 3.12")
def test_a_layer_that_claims_to_be_torch_is_not():
    cache = kvbm_ext.PagedKVCache([PretendsToBeTorch(np.zeros(SHAPE, np.float16))], "kbthd")
    assert (cache.dtype, cache.device) == ("float16", "cpu")
    assert_repr_round_trips(cache)


def test_a_layer_that_claims_to_be_torch_through_array_interface_is_not():
    class Claims(ArrayInterfaceOnly):
        __class__ = property(lambda self: torch.Tensor)
        dtype = property(lambda self: 1 / 0)

    cache = kvbm_ext.PagedKVCache([Claims(np.zeros(SHAPE, np.float16))], "kbthd")
    assert (cache.dtype, cache.device) == ("float16", "cpu")
    assert_repr_round_trips(cache)


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------


@pytest.mark.parametrize("make,dtype", [(torch_layers, torch.bfloat16), (numpy_layers, np.dtype(np.float16))],
                         ids=["torch", "numpy"])
def test_attributes_hold_and_leak_no_reference(make, dtype):
    layers = make(dtype)
    kvbm_ext.PagedKVCache(layers, "kbthd")  # warm: a first construction may cache what it found
    gc.collect()
    before = [sys.getrefcount(x) for x in (dtype, *layers)]
    for _ in range(50):
        cache = kvbm_ext.PagedKVCache(layers, "kbthd")
        for _ in range(3):
            cache.dtype, cache.device, cache.dtype_name, cache.device_name, cache.layout, cache.block_size, repr(cache)
        del cache
    gc.collect()
    assert [sys.getrefcount(x) for x in (dtype, *layers)] == before


# --------------------------------------------------------------------------
# Internal users take the strings
# --------------------------------------------------------------------------


@pytest.mark.parametrize("make,dtype", [(torch_layers, torch.bfloat16), (numpy_layers, np.float16)],
                         ids=["torch", "numpy"])
def test_disk_pool_layout_of_a_cache_is_strings(make, dtype):
    """The disk tier's slot layout (written into the pool file's header as JSON) of a cache:
    the dtype's name and tokens_per_block, whatever type cache.dtype has, with no warning."""
    from kvbm_ext.disk import DiskPool, _layout

    cache = kvbm_ext.PagedKVCache(make(dtype), "kbthd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = _layout(cache, "bhlktd")
        assert DiskPool._caller_stream(cache, None) is None  # a host cache: no stream
    assert layout["dtype"] == cache.dtype_name and type(layout["dtype"]) is str
    assert layout["tokens_per_block"] == cache.block_size == NT
