"""kvbm_ext.pinned_empty and HostBuffer: host memory for the offload tier.

CPU: allocation and its attributes, zero-copy interop with NumPy and torch (written through
one, read through the other), alignment, sizes refused before anything is mapped, bad
nodes, every way the memory is released (the address range is no longer mapped), no leak
over many allocations, close() with exports alive, hostile arguments, thread counts, and
kvbm_ext's own functions taking a HostBuffer as an array.  GPU: pinned as the driver sees
it, staged offload / onload through PagedKVCache bit-exact, torch's is_pinned(), nothing
registered after close, registration in pieces on whole leading items.
"""

import ctypes
import gc
import logging
import math
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kvbm_ext
from support import REPO_ROOT

MIB = 1 << 20
ALIGN = 2 * MIB
ON_GPU = torch.cuda.is_available() and not kvbm_ext.is_using_stubs()
requires_pinning = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and a CUDA build of kvbm_ext")
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


# --------------------------------------------------------------------------
# Helpers: what /proc says of the process.
# --------------------------------------------------------------------------


def mappings():
    """[(start, end)] of every mapping of this process."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]


def mapped_within(start, length):
    """Bytes of [start, start + length) that some mapping covers."""
    end = start + length
    return sum(max(0, min(end, b) - max(start, a)) for a, b in mappings())


def total_mapped():
    return sum(b - a for a, b in mappings())


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def address_of(buf):
    """The buffer's address, through the buffer protocol (a counted export, released here)."""
    return np.asarray(buf).ctypes.data


def map_bytes(buf):
    return max(ALIGN, (buf.nbytes + ALIGN - 1) // ALIGN * ALIGN)


def online_nodes():
    try:
        with open("/sys/devices/system/node/online") as f:
            text = f.read().strip()
    except OSError:
        return "0", {0}
    nodes = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        nodes.update(range(int(first), int(last or first) + 1))
    return text, nodes


def meminfo(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


@pytest.fixture
def debug_lines(monkeypatch):
    """The KVBM_EXT_DEBUG lines logged while the test runs."""
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("kvbm_ext")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def capsule_tensor(capsule):
    """(data address, device type, device id) of a DLPack capsule's tensor, read through
    ctypes: a DLTensor starts the legacy DLManagedTensor, and follows version, manager_ctx,
    deleter and flags (8 bytes each) in the versioned one."""
    versioned = "dltensor_versioned" in repr(capsule)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = get(capsule, b"dltensor_versioned" if versioned else b"dltensor") + (32 if versioned else 0)
    return struct.unpack("Pii", ctypes.string_at(tensor, 16))


def random_fill_(buf, gen):
    """Random bits into the buffer (through NumPy), and a copy of them."""
    view = np.asarray(buf).view(np.uint8).reshape(-1)
    bits = torch.randint(0, 256, (view.size,), dtype=torch.uint8, generator=gen).numpy()
    view[:] = bits
    return bits


# --------------------------------------------------------------------------
# Allocation and interop.
# --------------------------------------------------------------------------

DTYPE_SPELLINGS = [
    (torch.bfloat16, "bfloat16", 2),
    (torch.float16, "float16", 2),
    (torch.float8_e4m3fn, "float8_e4m3fn", 1),
    (torch.float8_e5m2, "float8_e5m2", 1),
    (torch.float32, "float32", 4),
    (torch.int64, "int64", 8),
    (torch.bool, "bool", 1),
    (np.float16, "float16", 2),
    (np.dtype("float16"), "float16", 2),
    (np.uint8, "uint8", 1),
    (np.dtype(np.int32), "int32", 4),
    (np.bool_, "bool", 1),
    ("bfloat16", "bfloat16", 2),
    ("uint8", "uint8", 1),
    ("float8_e8m0fnu", "float8_e8m0fnu", 1),
]


@pytest.mark.parametrize("dtype,name,itemsize", DTYPE_SPELLINGS, ids=[str(d[0]) for d in DTYPE_SPELLINGS])
def test_allocation_and_its_attributes(dtype, name, itemsize):
    buf = kvbm_ext.pinned_empty((3, 5, 7), dtype)
    assert isinstance(buf, kvbm_ext.HostBuffer)
    assert buf.shape == (3, 5, 7) and buf.dtype == name and buf.nbytes == 3 * 5 * 7 * itemsize
    assert buf.pinned is ON_GPU and buf.closed is False
    assert buf.registrations == (((0, ALIGN),) if ON_GPU else ())
    assert buf.huge_pages in ("transparent", "none")
    assert buf.threads >= 1 and buf.seconds > 0
    assert buf.numa_node is None or buf.numa_node in online_nodes()[1]
    assert "HostBuffer(shape=(3, 5, 7)" in repr(buf)
    assert not np.asarray(buf).view(np.uint8).any()     # fresh pages read as zeros


def test_registrations_read_only_and_empty_unpinned(monkeypatch):
    """3 MiB items, 2 MiB pieces asked: on a GPU a piece grows to whole items that end on
    2 MiB (6 MiB); unpinned, nothing is registered.  The record reads after close()."""
    monkeypatch.setenv("KVBM_EXT_HOST_REGISTER_PIECE", str(ALIGN))
    buf = kvbm_ext.pinned_empty((3, 3 * MIB), "uint8")
    expected = ((0, 6 * MIB), (6 * MIB, 4 * MIB)) if ON_GPU else ()
    assert buf.pinned is ON_GPU and buf.registrations == expected
    with pytest.raises(AttributeError):
        buf.registrations = ()
    buf.close()
    assert buf.registrations == expected


def test_an_int_shape_is_one_dimension():
    buf = kvbm_ext.pinned_empty(np.int64(10), torch.float16)
    assert buf.shape == (10,) and buf.nbytes == 20
    assert kvbm_ext.pinned_empty((), "int32").shape == ()
    assert kvbm_ext.pinned_empty((4, 0, 3), "int32").nbytes == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32, torch.float64])
def test_numpy_and_torch_share_its_memory(dtype, gen):
    buf = kvbm_ext.pinned_empty((4, 33, 16), dtype)
    array, tensor = np.asarray(buf), torch.from_dlpack(buf)
    assert tensor.dtype == dtype and tuple(tensor.shape) == buf.shape and not tensor.is_cuda
    assert array.ctypes.data == tensor.data_ptr() and array.ctypes.data % ALIGN == 0
    assert tensor.is_pinned() is ON_GPU
    bits = random_fill_(buf, gen)                           # written through NumPy
    assert torch.equal(tensor.view(torch.uint8).reshape(-1), torch.from_numpy(bits))
    fresh = torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8, generator=gen)
    tensor.view(torch.uint8).reshape(-1).copy_(fresh)       # written through torch
    assert np.array_equal(array.view(np.uint8).reshape(-1), fresh.numpy())
    assert bytes(memoryview(buf).cast("B")) == fresh.numpy().tobytes()


def test_numpy_reads_bfloat16_and_float8_as_their_bits():
    assert np.asarray(kvbm_ext.pinned_empty(3, torch.bfloat16)).dtype == np.uint16
    assert np.asarray(kvbm_ext.pinned_empty(3, torch.float8_e4m3fn)).dtype == np.uint8
    assert np.asarray(kvbm_ext.pinned_empty(3, torch.float16)).dtype == np.float16
    assert kvbm_ext.pinned_empty(3, torch.bfloat16).__array_interface__["typestr"] == "<u2"


def test_array_interface_shares_memory(gen):
    buf = kvbm_ext.pinned_empty((6, 10), np.float32)
    interface = buf.__array_interface__
    assert interface["shape"] == (6, 10) and interface["typestr"] == "<f4" and interface["version"] == 3
    assert interface["strides"] is None and interface["data"][1] is False

    class Holder:
        __array_interface__ = interface

    bits = random_fill_(buf, gen)
    assert np.array_equal(np.asarray(Holder()).view(np.uint8).reshape(-1), bits)


@pytest.mark.parametrize("huge_pages", ["transparent", "none", "TRANSPARENT"])
def test_alignment_and_huge_pages(huge_pages):
    buf = kvbm_ext.pinned_empty(3 * MIB + 5, "uint8", huge_pages=huge_pages)
    assert address_of(buf) % ALIGN == 0
    assert buf.huge_pages in (huge_pages.lower(), "none")


def test_dlpack_capsules():
    buf = kvbm_ext.pinned_empty((2, 3), torch.bfloat16)
    assert buf.__dlpack_device__() == ((3, 0) if ON_GPU else (1, 0))
    start = address_of(buf)
    assert "dltensor" in repr(buf.__dlpack__())
    assert capsule_tensor(buf.__dlpack__()) == (start, 1, 0)
    assert "dltensor_versioned" in repr(buf.__dlpack__(max_version=(1, 0)))
    capsule = buf.__dlpack__(max_version=(2, 7), dl_device=(1, 0), copy=False, stream=None)
    assert "dltensor_versioned" in repr(capsule) and capsule_tensor(capsule) == (start, 1, 0)
    assert torch.from_dlpack(buf.__dlpack__(max_version=(0, 8))).shape == (2, 3)
    with pytest.raises(BufferError, match="copy=True"):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"dl_device \(2, 0\)"):
        buf.__dlpack__(dl_device=(2, 0))
    if not ON_GPU:
        with pytest.raises(BufferError, match=r"dl_device \(3, 0\)"):
            buf.__dlpack__(dl_device=(3, 0))
    with pytest.raises(TypeError, match="stream"):
        buf.__dlpack__(stream="default")
    with pytest.raises(TypeError, match="max_version"):
        buf.__dlpack__(max_version=1)
    with pytest.raises(ValueError, match=r"max_version\[1\]"):
        buf.__dlpack__(max_version=(1, -1))
    with pytest.raises(TypeError):
        buf.__dlpack__(None)


# --------------------------------------------------------------------------
# Refusals: nothing mapped, nothing left.
# --------------------------------------------------------------------------


def test_a_size_beyond_memory_is_refused_before_mapping():
    before = total_mapped()
    with pytest.raises(MemoryError, match=r"^shape: \(35184372088832,\) of uint8 is 35184372088832 bytes.*available"):
        kvbm_ext.pinned_empty(1 << 45, "uint8")
    assert total_mapped() - before < 16 * MIB


def test_a_size_past_int64_is_refused():
    with pytest.raises(ValueError, match=r"^shape: \(4611686018427387904, 4\) of float32 holds more than 2\*\*63"):
        kvbm_ext.pinned_empty((1 << 62, 4), torch.float32)
    with pytest.raises(ValueError, match=r"^shape\[1\]: expected an int from 0"):
        kvbm_ext.pinned_empty((2, -1), "uint8")


@pytest.mark.skipif(UNDER_ASAN, reason="ASan's shadow memory does not run under an address-space limit")
def test_a_mapping_the_kernel_refuses_raises_with_errno_text(tmp_path):
    """Under an address-space limit mmap fails with ENOMEM: MemoryError with its text, and the
    failed attempt leaves no mapping (in a child process: the limit stays there)."""
    script = textwrap.dedent("""
        import resource, kvbm_ext
        def mapped():
            with open("/proc/self/maps") as f:
                return sum(int(b, 16) - int(a, 16) for a, b in (l.split()[0].split("-") for l in f))
        kvbm_ext.pinned_empty(16, "uint8")       # the CUDA driver loaded, where there is one
        before = mapped()
        resource.setrlimit(resource.RLIMIT_AS, (before + (64 << 20), resource.RLIM_INFINITY))
        try:
            kvbm_ext.pinned_empty(256 << 20, "uint8")
        except MemoryError as error:
            print("REFUSED", error)
        print("GREW", mapped() - before)
        """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused and "shape: (268435456,) of uint8: cannot map" in refused[0], run.stdout
    assert "Cannot allocate memory" in refused[0] and "nothing was mapped" in refused[0], run.stdout
    grew = int(run.stdout.split("GREW")[1])
    assert grew < 16 * MIB, run.stdout


def test_explicit_huge_pages_where_there_are_none():
    free = meminfo("HugePages_Free")
    if free:
        buf = kvbm_ext.pinned_empty(ALIGN, "uint8", huge_pages="explicit")
        assert buf.huge_pages == "explicit"
        return
    before = total_mapped()
    with pytest.raises(MemoryError, match=r"^huge_pages='explicit': cannot map .*MAP_HUGETLB.*Cannot allocate memory"):
        kvbm_ext.pinned_empty(64 * MIB, "uint8", huge_pages="explicit")
    assert total_mapped() - before < 16 * MIB


def test_a_node_that_does_not_exist():
    text, nodes = online_nodes()
    missing = max(nodes) + 1
    with pytest.raises(ValueError, match=rf"^numa_node: node {missing} does not exist; this machine's nodes: {text}$"):
        kvbm_ext.pinned_empty(16, "uint8", numa_node=missing)
    with pytest.raises(ValueError, match=r"^numa_node: expected an int from 0"):
        kvbm_ext.pinned_empty(16, "uint8", numa_node=-1)
    with pytest.raises(TypeError, match=r"^numa_node: expected an int or None, got str"):
        kvbm_ext.pinned_empty(16, "uint8", numa_node="0")
    first = min(nodes)
    assert kvbm_ext.pinned_empty(16, "uint8", numa_node=first).numa_node == first


def test_register_piece_variable_is_checked(monkeypatch):
    for bad in ("x", "-4", "0", "12k"):
        monkeypatch.setenv("KVBM_EXT_HOST_REGISTER_PIECE", bad)
        with pytest.raises(ValueError, match=rf"^KVBM_EXT_HOST_REGISTER_PIECE={bad}: expected a positive number"):
            kvbm_ext.pinned_empty(16, "uint8")


# --------------------------------------------------------------------------
# Release: the address range is unmapped once the last holder goes.
# --------------------------------------------------------------------------


def released_after(make, drop):
    """Makes a buffer (and whatever holds it) with make(), checks its range is mapped, runs
    drop(state); returns the bytes of the range still mapped afterwards."""
    state = make()
    buf = state["buf"]
    start, length = address_of(buf), map_bytes(buf)
    assert mapped_within(start, length) == length
    del buf
    drop(state)
    gc.collect()
    return mapped_within(start, length)


def fresh():
    return {"buf": kvbm_ext.pinned_empty((16, MIB), "uint8")}


def with_tensor():
    state = fresh()
    state["tensor"] = torch.from_dlpack(state["buf"])
    return state


def with_array():
    state = fresh()
    state["array"] = np.asarray(state["buf"])
    return state


def with_interface():
    state = fresh()
    state["interface"] = state["buf"].__array_interface__
    return state


RELEASES = {
    "del": (fresh, lambda s: s.clear()),
    "close": (fresh, lambda s: s["buf"].close()),
    "with": (fresh, lambda s: s["buf"].__exit__(None, None, None)),
    "close, then the tensor goes": (with_tensor, lambda s: (s["buf"].close(), s.clear())),
    "the tensor goes, then del": (with_tensor, lambda s: (s.pop("tensor"), s.clear())),
    "close, then the array goes": (with_array, lambda s: (s["buf"].close(), s.clear())),
    "interface read, close, del": (with_interface, lambda s: (s["buf"].close(), s.clear())),
    "an unconsumed capsule": (fresh, lambda s: (s["buf"].__dlpack__(max_version=(1, 3)), s.clear())),
}


@pytest.mark.parametrize("how", list(RELEASES))
def test_freeing_releases_the_mapping(how):
    make, drop = RELEASES[how]
    assert released_after(make, drop) == 0


def test_exports_keep_the_memory_after_close(gen):
    buf = kvbm_ext.pinned_empty((8, 4096), torch.int16)
    start, length = address_of(buf), map_bytes(buf)
    tensor, array = torch.from_dlpack(buf), np.asarray(buf)
    bits = random_fill_(buf, gen)
    buf.close()
    assert buf.closed and mapped_within(start, length) == length
    assert np.array_equal(array.view(np.uint8).reshape(-1), bits)     # still there, still the same bytes
    del array
    gc.collect()
    assert mapped_within(start, length) == length                       # the tensor holds it
    assert torch.equal(tensor.view(torch.uint8).reshape(-1), torch.from_numpy(bits))
    del tensor
    assert mapped_within(start, length) == 0


def test_close_refuses_further_exports_and_keeps_its_attributes():
    buf = kvbm_ext.pinned_empty((5, 6), torch.float16, threads=1)
    buf.close()
    buf.close()                                                          # idempotent
    for export in (lambda: buf.__dlpack__(), lambda: memoryview(buf), lambda: buf.__array_interface__,
                   lambda: np.asarray(buf), lambda: torch.from_dlpack(buf)):
        with pytest.raises(BufferError, match="this HostBuffer is closed"):
            export()
    assert (buf.shape, buf.dtype, buf.nbytes, buf.threads, buf.closed) == ((5, 6), "float16", 60, 1, True)
    assert repr(buf).endswith(", closed)")
    with pytest.raises(ValueError, match=r"^universals\[0\]: its producer refused to export it .*closed"):
        kvbm_ext.block_to_universal([[np.zeros((1, 1, 1), np.float16)]], [buf], "NHD")


def test_a_with_block_closes_it():
    with kvbm_ext.pinned_empty(64, "uint8") as buf:
        assert not buf.closed
    assert buf.closed


def test_no_leak_over_many_allocations():
    def cycle():
        buf = kvbm_ext.pinned_empty(4 * MIB, "uint8", threads=2)
        np.asarray(buf)[::4096] = 7
        if len(seen) % 2:
            buf.close()
        seen.append(buf.nbytes)

    seen = []
    for _ in range(20):
        cycle()
    gc.collect()
    rss, maps, mapped = rss_bytes(), len(mappings()), total_mapped()
    for _ in range(300):
        cycle()
    gc.collect()
    assert rss_bytes() - rss < 32 * MIB               # 300 x 4 MiB were touched
    assert len(mappings()) - maps < 8
    assert total_mapped() - mapped < 32 * MIB


# --------------------------------------------------------------------------
# Threads.
# --------------------------------------------------------------------------


def test_one_thread_and_many_give_the_same_buffer(gen):
    one = kvbm_ext.pinned_empty((24, MIB), "uint8", threads=1)
    many = kvbm_ext.pinned_empty((24, MIB), "uint8", threads=8)
    assert (one.threads, many.threads) == (1, 8)
    for buf in (one, many):
        assert buf.shape == (24, MIB) and buf.huge_pages == one.huge_pages
        assert not np.asarray(buf).any()                 # every page touched, none written
    bits = random_fill_(one, gen)
    np.asarray(many).reshape(-1)[:] = bits
    assert np.array_equal(np.asarray(one), np.asarray(many))


def test_threads_are_capped_by_the_memory():
    assert kvbm_ext.pinned_empty(3 * ALIGN, "uint8", threads=64).threads == 3
    assert kvbm_ext.pinned_empty(16, "uint8", threads=5).threads == 1
    assert kvbm_ext.pinned_empty(16, "uint8").threads == 1
    big = kvbm_ext.pinned_empty(64 * ALIGN, "uint8")
    assert big.threads == min(64, len(os.sched_getaffinity(0)))


# --------------------------------------------------------------------------
# Hostile arguments.
# --------------------------------------------------------------------------


class RaisingIndex:
    def __index__(self):
        raise RuntimeError("no index here")


class NamedDtype:
    def __init__(self, name):
        self._name = name

    @property
    def name(self):
        if isinstance(self._name, Exception):
            raise self._name
        return self._name


class LoudStr(str):
    def __repr__(self):
        raise AssertionError("repr of a dtype name ran")

    def __eq__(self, other):
        raise AssertionError("== of a dtype name ran")

    __hash__ = str.__hash__


def torch_dtype_spoof(text):
    """An object whose type is named like torch's dtype, its str() anything."""
    def __str__(self):
        if isinstance(text, Exception):
            raise text
        return text
    return type("torch.dtype", (), {"__str__": __str__})()


class MutatingShape(list):
    """A shape list whose items clear the list while they are read."""

    def __init__(self, values):
        super().__init__(self.Item(self, v) for v in values)

    class Item:
        def __init__(self, owner, value):
            self.owner, self.value = owner, value

        def __index__(self):
            self.owner.clear()
            return self.value


HOSTILE = [
    (dict(shape=(2, RaisingIndex())), TypeError, r"^shape\[1\]: expected an int, got RaisingIndex, whose __index__ "
                                                 r"failed \(RuntimeError: no index here\)"),
    (dict(shape=RaisingIndex()), TypeError, r"^shape: expected an int or a tuple of ints, got RaisingIndex"),
    (dict(shape="12"), TypeError, r"^shape: expected an int or a tuple of ints, got str"),
    (dict(shape=(True, 2)), TypeError, r"^shape\[0\]: expected an int, got bool"),
    (dict(shape=(1,) * 9), ValueError, r"^shape: 9 dimensions; at most 8"),
    (dict(shape=(2 ** 64,)), ValueError, r"^shape\[0\]: expected an int from 0"),
    (dict(dtype=NamedDtype(RuntimeError("no name"))), TypeError, r"^dtype: expected a torch dtype.*got NamedDtype"),
    (dict(dtype=NamedDtype(7)), TypeError, r"^dtype: expected a torch dtype"),
    (dict(dtype=NamedDtype("float16\0")), ValueError, r"^dtype: 'float16\\x00' is not an element type"),
    (dict(dtype=NamedDtype("\ud800")), ValueError, r"^dtype: '\\ud800' is not an element type"),
    (dict(dtype=NamedDtype("x" * 10000)), ValueError, r"^dtype: 'xxxx"),
    (dict(dtype=LoudStr("halfish")), ValueError, r"^dtype: 'halfish' is not an element type"),
    (dict(dtype=torch_dtype_spoof(RuntimeError("no str"))), TypeError, r"^dtype: expected a torch dtype"),
    (dict(dtype=torch_dtype_spoof("torch.")), ValueError, r"^dtype: 'torch\.' is not"),
    (dict(dtype=torch_dtype_spoof("numpy.float16")), ValueError, r"^dtype: 'numpy\.float16' is not"),
    (dict(dtype=float), ValueError, r"^dtype: 'float' is not an element type"),
    (dict(dtype=None), TypeError, r"^dtype: expected a torch dtype"),
    (dict(threads=0), ValueError, r"^threads: expected an int from 1 to 1024, got 0"),
    (dict(threads=True), TypeError, r"^threads: expected an int or None, got bool"),
    (dict(threads=RaisingIndex()), TypeError, r"^threads: expected an int or None, got RaisingIndex, whose"),
    (dict(huge_pages="explicit\0"), ValueError, r"^huge_pages: expected \"transparent\", \"explicit\" or \"none\""),
    (dict(huge_pages=1), TypeError, r"^huge_pages: expected a str"),
    (dict(device="cuda:x"), ValueError, r"^device: expected None, an int, 'cuda' or 'cuda:N'"),
    (dict(device="cuda:1234567890123"), ValueError, r"^device: expected None, an int"),
    (dict(device=-1), ValueError, r"^device: expected an int from 0"),
    (dict(device=1.0), ValueError, r"^device: expected None, an int, 'cuda' or 'cuda:N'.*got float"),
]


@pytest.mark.parametrize("change,exc,message", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_arguments(change, exc, message):
    kwargs = dict(shape=(4, 8), dtype="uint8") | change
    before = total_mapped()
    with pytest.raises(exc, match=message):
        kvbm_ext.pinned_empty(kwargs.pop("shape"), kwargs.pop("dtype"), **kwargs)
    assert total_mapped() - before < 16 * MIB


def test_a_shape_list_changed_while_read_is_read_as_given():
    buf = kvbm_ext.pinned_empty(MutatingShape([3, 4]), "uint8")
    assert buf.shape == (3, 4)


def test_positional_and_keyword_rules():
    with pytest.raises(TypeError, match=r"takes at most 2 positional arguments"):
        kvbm_ext.pinned_empty(4, "uint8", 0)
    with pytest.raises(TypeError, match="missing required argument 'dtype'"):
        kvbm_ext.pinned_empty(4)
    assert kvbm_ext.pinned_empty(shape=4, dtype="uint8").shape == (4,)
    with pytest.raises(TypeError, match="cannot create 'kvbm_ext.HostBuffer' instances"):
        kvbm_ext.HostBuffer()


# --------------------------------------------------------------------------
# kvbm_ext's functions take it as an array.
# --------------------------------------------------------------------------

# (layers, K/V, heads, tokens per block, head dim, blocks in the cache)
SMALL = (3, 2, 4, 8, 16, 12)
# 384 KiB universal blocks (3 x 128 KiB: neither divides 2 MiB nor is a multiple of it).
LARGE = (8, 2, 8, 12, 128, 48)
NL, NO = SMALL[:2]


def universal_reference(layers, ids):
    """U[b][h, l, o, t, :] = layers[l][o, ids[b], t, h, :], in plain torch."""
    return torch.stack([layer[:, ids] for layer in layers]).permute(2, 4, 0, 1, 3, 5).contiguous()


def random_layers(gen, device="cpu", dims=SMALL):
    nl, no, nh, nt, hd, num_blocks = dims
    return [torch.randint(-2 ** 15, 2 ** 15, (no, num_blocks, nt, nh, hd), dtype=torch.int16, generator=gen)
            .view(torch.bfloat16).to(device) for _ in range(nl)]


def poisoned_universals(n, dims=SMALL):
    nl, no, nh, nt, hd, _ = dims
    buf = kvbm_ext.pinned_empty((n, nh, nl, no, nt, hd), torch.bfloat16)
    np.asarray(buf).view(np.uint8)[...] = 0xA5
    return buf


def as_bits(x):
    return (x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)).view(torch.int16)


def test_paged_cache_offload_and_restore_through_a_host_buffer(gen):
    layers = random_layers(gen)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    ids = [7, 0, 11, 3]
    buf = poisoned_universals(len(ids))
    cache.to_universal(ids, buf)
    assert torch.equal(as_bits(buf), as_bits(universal_reference(layers, ids)))
    back = [layer.clone() for layer in layers]
    for layer in back:
        layer.view(torch.int16)[:, [1, 2, 5, 9]] = -0x5A5B
    restored = kvbm_ext.PagedKVCache(back, "kbthd")
    restored.from_universal(buf, [1, 2, 5, 9])
    expected = [layer.clone() for layer in layers]
    for layer, source in zip(expected, layers):
        layer[:, [1, 2, 5, 9]] = source[:, ids]
    for got, want in zip(back, expected):
        assert torch.equal(as_bits(got), as_bits(want))


def test_block_to_universal_writes_a_host_buffer(gen):
    layers = random_layers(gen)
    ids = [4, 10]
    blocks = [[layers[l][o, b] for l in range(NL) for o in range(NO)] for b in ids]
    buf = poisoned_universals(len(ids))
    kvbm_ext.block_to_universal(blocks, buf, "NHD")
    assert torch.equal(as_bits(buf), as_bits(universal_reference(layers, ids)))
    back = [[torch.full_like(chunk, -3.0) for chunk in chunks] for chunks in blocks]
    kvbm_ext.universal_to_block(buf, back, "NHD")
    for got, want in zip(back, blocks):
        assert all(torch.equal(as_bits(g), as_bits(w)) for g, w in zip(got, want))


def test_address_lists_in_host_buffers(gen):
    """memcpy_batch reads its address lists from HostBuffers: with a GPU it copies between
    two pinned buffers bit-exact; without one the lists are read and the copy refused."""
    src, dst = kvbm_ext.pinned_empty(MIB, "uint8"), kvbm_ext.pinned_empty(MIB, "uint8")
    bits = random_fill_(src, gen)
    np.asarray(dst)[:] = 0xA5
    lists = [kvbm_ext.pinned_empty(4, "uint64") for _ in range(3)]
    offsets = np.array([0, 4096, 300000, 700001], dtype=np.uint64)
    np.asarray(lists[0])[:] = address_of(src) + offsets
    np.asarray(lists[1])[:] = address_of(dst) + offsets[::-1]
    np.asarray(lists[2])[:] = [4096, 100, 5000, 77]
    empty = kvbm_ext.pinned_empty(0, "uint64")
    assert kvbm_ext.memcpy_batch(empty, empty, empty) is None
    if not ON_GPU:
        with pytest.raises(RuntimeError):
            kvbm_ext.memcpy_batch(*lists)
        assert not (np.asarray(dst) != 0xA5).any()
        return
    kvbm_ext.memcpy_batch(*lists)
    torch.cuda.synchronize()
    expected = np.full(MIB, 0xA5, np.uint8)
    for s_at, d_at, size in zip(offsets, offsets[::-1], [4096, 100, 5000, 77]):
        expected[int(d_at):int(d_at) + size] = bits[int(s_at):int(s_at) + size]
    assert np.array_equal(np.asarray(dst), expected)


# --------------------------------------------------------------------------
# The debug line, the example and the benchmark.
# --------------------------------------------------------------------------


def test_debug_line_says_how_the_memory_was_made(debug_lines):
    buf = kvbm_ext.pinned_empty((3, MIB), torch.float16, threads=2)
    [line] = [line for line in debug_lines if line.startswith("pinned_empty:")]
    assert line.startswith("pinned_empty: 6291456 bytes (0.01 GiB), huge pages ")
    assert f"huge pages {buf.huge_pages}" in line and ", 2 threads, " in line
    node_words = "(one node)" if len(online_nodes()[1]) == 1 else "node"
    assert node_words in line
    assert ("pinned for cuda:" in line) if ON_GPU else ("not pinned: " in line), line
    buf.close()
    assert debug_lines[-1] == "HostBuffer.close(): 6291456 bytes released"


def run_example(device):
    script = os.path.join(REPO_ROOT, "examples", "host_pool_offload.py")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    run = subprocess.run([sys.executable, script, "--device", device], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "blocks restored bit-exact from the pool" in run.stdout, run.stdout
    return run.stdout


def test_example_runs_on_the_cpu():
    assert "pinned=False" in run_example("cpu") or ON_GPU


@requires_pinning
def test_example_runs_on_the_gpu():
    assert "pinned=True" in run_example("cuda")


# --------------------------------------------------------------------------
# GPU: pinned as the driver sees it, staged transfers, registration in pieces.
# --------------------------------------------------------------------------


@requires_pinning
def test_pinned_as_the_driver_sees_it():
    buf = kvbm_ext.pinned_empty((5, MIB + 3), torch.bfloat16, device=torch.device("cuda", 0))
    start = address_of(buf)
    assert buf.pinned and buf.__dlpack_device__() == (3, 0)
    for address in (start, start + buf.nbytes - 1, start + map_bytes(buf) - 1):
        assert kvbm_ext.HostBuffer._pointer_kind(address) == "pinned"
    tensor = torch.from_dlpack(buf)
    assert tensor.is_pinned() and tensor.data_ptr() == start
    assert capsule_tensor(buf.__dlpack__(max_version=(1, 3), dl_device=(3, 0))) == (start, 3, 0)
    del tensor
    buf.close()
    assert kvbm_ext.HostBuffer._pointer_kind(start) == "pageable"
    assert mapped_within(start, map_bytes(buf)) == 0


@requires_pinning
def test_device_argument_on_a_gpu():
    count = torch.cuda.device_count()
    assert kvbm_ext.pinned_empty(8, "uint8", device=count - 1).pinned
    assert kvbm_ext.pinned_empty(8, "uint8", device="cuda").pinned
    with pytest.raises(ValueError, match=rf"^device: cuda:{count} does not exist \({count} CUDA devices\)"):
        kvbm_ext.pinned_empty(8, "uint8", device=count)


@requires_pinning
def test_copies_to_and_from_the_gpu_are_bit_exact(gen):
    buf = kvbm_ext.pinned_empty((64, MIB), "uint8")
    bits = torch.from_numpy(random_fill_(buf, gen))
    host = torch.from_dlpack(buf).reshape(-1)
    device = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), bits)
    fresh = torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen)
    host.copy_(fresh.cuda(), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, fresh)


# What the KVBM_EXT_DEBUG line of a move between a device cache and pinned memory says.
MOVE_PATHS = {"auto": "path staged (auto: pinned host memory takes part",
              "kernel": "path kernel (requested; pinned host memory read directly"}


def round_trip(gen, debug_lines, dims=SMALL, blocks=7, backend="auto"):
    """A GPU PagedKVCache offloaded into a pinned HostBuffer and restored into other blocks
    with `backend`: checked bit for bit against plain torch."""
    layers = random_layers(gen, "cuda", dims)
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    ids = torch.randperm(dims[-1], generator=gen)[:blocks].tolist()
    targets = torch.randperm(dims[-1], generator=gen)[:blocks].tolist()
    buf = poisoned_universals(blocks, dims)
    assert buf.pinned
    cache.to_universal(ids, buf, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(as_bits(buf), as_bits(universal_reference(layers, ids).cpu()))
    expected = [layer.clone() for layer in layers]
    for layer in expected:
        layer[:, targets] = layer[:, ids]
    for layer in layers:
        layer.view(torch.int16)[:, targets] = -0x5A5B
    cache.from_universal(buf, targets, backend=backend)
    torch.cuda.synchronize()
    for got, want in zip(layers, expected):
        assert torch.equal(as_bits(got), as_bits(want))
    moves = [line for line in debug_lines if "_universal: path" in line]
    assert len(moves) == 2 and all(MOVE_PATHS[backend] in line for line in moves), moves
    return buf


@requires_pinning
def test_staged_offload_and_onload_bit_exact(gen, debug_lines):
    buf = round_trip(gen, debug_lines)
    assert buf.registrations == ((0, map_bytes(buf)),)
    start = address_of(buf)
    del buf
    gc.collect()
    assert kvbm_ext.HostBuffer._pointer_kind(start) == "pageable"


@requires_pinning
def test_registration_in_pieces(gen, debug_lines, monkeypatch):
    """Pieces asked at 2 MiB for 384 KiB blocks: every boundary falls on whole blocks and
    2 MiB (6 MiB, 16 blocks), every piece pinned; kernels across the boundaries and one copy
    per block each way bit-exact; after close no piece is registered."""
    monkeypatch.setenv("KVBM_EXT_HOST_REGISTER_PIECE", str(ALIGN))
    buf = round_trip(gen, debug_lines, LARGE, blocks=40, backend="kernel")
    block = buf.nbytes // buf.shape[0]
    assert block == 384 * 1024 and map_bytes(buf) == 16 * MIB
    assert buf.registrations == ((0, 6 * MIB), (6 * MIB, 6 * MIB), (12 * MIB, 4 * MIB))
    ends = [offset + nbytes for offset, nbytes in buf.registrations]
    assert [offset for offset, _ in buf.registrations] == [0] + ends[:-1] and ends[-1] == map_bytes(buf)
    assert all(end % math.lcm(block, ALIGN) == 0 for end in ends[:-1])
    [made] = [line for line in debug_lines if line.startswith("pinned_empty:")]
    assert "pinned for cuda:0 (3 registrations)" in made, made
    start = address_of(buf)
    edges = [start + offset + end for offset, nbytes in buf.registrations for end in (0, nbytes - 1)]
    assert all(kvbm_ext.HostBuffer._pointer_kind(a) == "pinned" for a in edges)
    host = torch.from_dlpack(buf)
    bits = torch.from_numpy(random_fill_(buf, gen))
    device = torch.full(host.shape, -0x5A5B, dtype=torch.int16, device="cuda").view(host.dtype)
    for i in range(host.shape[0]):
        device[i].copy_(host[i])                                # one block inside one piece each
    torch.cuda.synchronize()
    assert torch.equal(as_bits(device).cpu().view(torch.uint8).reshape(-1), bits)
    fresh = torch.randint(-2 ** 15, 2 ** 15, host.shape, dtype=torch.int16, generator=gen)
    device.view(torch.int16).copy_(fresh)
    for i in range(host.shape[0]):
        host[i].copy_(device[i])
    torch.cuda.synchronize()
    assert torch.equal(as_bits(host), fresh)
    del host
    buf.close()
    assert buf.registrations[0] == (0, 6 * MIB)                # the record still reads
    assert all(kvbm_ext.HostBuffer._pointer_kind(a) == "pageable" for a in edges)
