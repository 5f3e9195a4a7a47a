"""Pure-PyTorch references and data helpers for the kvbm_ext tests.

Layout (see API_SPEC / REFERENCE.md section 1):
  universal  [nh, nl, no, nt, hd]   (one per block)
  chunk NHD  [nt, nh, hd]           (nl*no per block, index l*no + o)
  chunk HND  [nh, nt, hd]
  universal[h, l, o, t, :] == chunk[l*no + o][t, h, :]   (NHD)
  universal[h, l, o, t, :] == chunk[l*no + o][h, t, :]   (HND)

The references work on an integer view of the same element size, so every
bit pattern (NaN payloads, fp8 specials) is moved exactly.
"""

import re
import time
import zlib

import numpy as np
import pytest
import torch

POISON_BYTE = 0xA5

# ~0.25 s at H200 clocks: long enough that "not finished right after the call" is robust.
SLEEP_CYCLES = 500_000_000

# Same-size integer dtype used to move elements bit-exactly.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# dtypes the tests exercise on each side.
TORCH_DTYPES = [
    torch.float8_e4m3fn,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
]
NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8]

# (nb, nl, no, nh, nt, hd): small shapes with the awkward corners.
SHAPES = [
    (3, 2, 2, 4, 8, 16),  # ordinary
    (2, 3, 2, 2, 1, 8),  # nt = 1
    (2, 2, 2, 3, 5, 3),  # hd = 3
    (1, 1, 2, 2, 3, 5),  # hd = 5, nl = 1
    (4, 2, 1, 1, 4, 7),  # MLA-like: no = 1, nh = 1, hd = 7
    (3, 2, 2, 2, 3, 13),  # hd = 13
    (64, 2, 2, 2, 2, 13),  # nb = 64
    (2, 1, 1, 1, 1, 1),  # everything 1
]


def shape_id(shape):
    nb, nl, no, nh, nt, hd = shape
    return f"nb{nb}-nl{nl}-no{no}-nh{nh}-nt{nt}-hd{hd}"


def dtype_id(dtype):
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return np.dtype(dtype).name


def torch_dtype_of(np_dtype):
    """The torch dtype matching a NumPy dtype (np.float16 -> torch.float16, ...)."""
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


# --------------------------------------------------------------------------
# Conversions between the array kinds the tests use.
# --------------------------------------------------------------------------


def as_torch(x):
    """A torch view (or copy, for read-only NumPy) of a torch tensor or NumPy array."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            x = x.copy()
        return torch.from_numpy(x)
    raise TypeError(f"as_torch: unsupported {type(x)!r}")


def to_numpy(x):
    """NumPy view of a CPU torch tensor (shares memory); lists are mapped."""
    if isinstance(x, (list, tuple)):
        return [to_numpy(v) for v in x]
    return x.numpy()


def _as_int(t):
    """Same-size integer view (works on non-contiguous tensors too); for element sizes
    without an integer type (complex128) a uint8 view (needs a contiguous last dim)."""
    size = t.element_size()
    return t.view(_INT_OF_SIZE[size]) if size in _INT_OF_SIZE else t.view(torch.uint8)


# --------------------------------------------------------------------------
# References.
# --------------------------------------------------------------------------


def _check_layout(layout):
    layout = layout.upper()
    if layout not in ("NHD", "HND"):
        raise ValueError(layout)
    return layout


def block_to_universal_ref(chunks, no, layout):
    """nl*no chunks of one block -> universal [nh, nl, no, nt, hd] (torch, contiguous)."""
    layout = _check_layout(layout)
    chunks = [as_torch(c).cpu() for c in chunks]  # chunks may sit on several devices
    dtype = chunks[0].dtype
    assert len(chunks) % no == 0
    nl = len(chunks) // no
    ints = [_as_int(c) for c in chunks]
    if layout == "NHD":
        heads_first = [c.permute(1, 0, 2) for c in ints]  # [nh, nt, hd]
    else:
        heads_first = ints
    per_layer = [torch.stack(heads_first[l * no : (l + 1) * no]) for l in range(nl)]  # [no, nh, nt, hd]
    stacked = torch.stack(per_layer)  # [nl, no, nh, nt, hd]
    return stacked.permute(2, 0, 1, 3, 4).contiguous().view(dtype)


def universal_to_block_ref(universal, layout):
    """universal [nh, nl, no, nt, hd] -> list of nl*no chunks (torch, contiguous)."""
    layout = _check_layout(layout)
    universal = as_torch(universal).cpu()
    dtype = universal.dtype
    u = _as_int(universal)
    nh, nl, no, nt, hd = u.shape
    chunks = []
    for l in range(nl):
        for o in range(no):
            chunk = u[:, l, o]  # [nh, nt, hd]
            if layout == "NHD":
                chunk = chunk.permute(1, 0, 2)
            chunks.append(chunk.contiguous().view(dtype))
    return chunks


def chunk_shape(nh, nt, hd, layout):
    return (nt, nh, hd) if _check_layout(layout) == "NHD" else (nh, nt, hd)


# --------------------------------------------------------------------------
# Random data, poison, comparison.
# --------------------------------------------------------------------------


def seed_for(*params):
    """A deterministic seed derived from the parameters of a case."""
    return zlib.crc32(repr(params).encode())


def make_generator(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def random_tensor(shape, dtype, device="cpu", generator=None, pin=False):
    """Random BYTES viewed as `dtype`: every bit pattern (NaN, inf, fp8 specials) can occur
    (bool: bytes 0/1 only)."""
    shape = tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes_shape = shape[:-1] + (shape[-1] * itemsize,) if shape else (itemsize,)
    # bool: only 0/1 are valid torch bools (other bytes get normalised by torch copies).
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, nbytes_shape, dtype=torch.uint8, generator=generator)
    t = raw.view(dtype)
    if not shape:
        t = t.reshape(())
    assert tuple(t.shape) == shape
    if pin:
        t = t.pin_memory()
    elif str(device) != "cpu":
        t = t.to(device)
    return t


def poison_(x):
    """Fill every byte of x (torch tensor on any device or NumPy array, contiguous or not,
    or a nested list of them) with 0xA5."""
    if isinstance(x, (list, tuple)):
        for v in x:
            poison_(v)
        return x
    size = _itemsize(x)
    if isinstance(x, np.ndarray):
        if size not in (1, 2, 4, 8):
            size = 1  # e.g. complex128: a uint8 view (needs a contiguous last axis)
        x.view(f"u{size}")[...] = int.from_bytes(bytes([POISON_BYTE]) * size, "little")
        return x
    ints = _as_int(x)
    ints.fill_(int.from_bytes(bytes([POISON_BYTE]) * ints.element_size(), "little", signed=ints.dtype != torch.uint8))
    return x


def _bytes_for_compare(x):
    """Flat uint8 CPU copy of the bytes of x (torch on any device, or NumPy), in logical order."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x).copy())
    x = _as_int(x.detach()).contiguous()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.reshape(-1).view(torch.uint8)


def _itemsize(x):
    return x.itemsize if isinstance(x, np.ndarray) else x.element_size()


def assert_bitwise_equal(out, ref, what="array"):
    """Exact byte equality (NaN-safe, no tolerance). Works on torch (any device) and NumPy."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert _itemsize(out) == _itemsize(ref), f"{what}: itemsize {_itemsize(out)} != {_itemsize(ref)}"
    if isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor):
        assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    a, b = _bytes_for_compare(out), _bytes_for_compare(ref)
    if not torch.equal(a, b):
        bad = (a != b).nonzero().flatten()
        poisoned = int((a[bad] == POISON_BYTE).sum())
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} bytes differ "
            f"(first at byte {int(bad[0])}: got {int(a[bad[0]]):#04x}, want {int(b[bad[0]]):#04x}; "
            f"{poisoned} differing bytes still hold the poison 0xA5)"
        )


def assert_all_bitwise_equal(outs, refs, what="array"):
    assert len(outs) == len(refs), f"{what}: {len(outs)} arrays != {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(o, (list, tuple)):
            assert_all_bitwise_equal(o, r, f"{what}[{i}]")
        else:
            assert_bitwise_equal(o, r, f"{what}[{i}]")


def assert_poisoned(x, what="array"):
    """Every byte of x (or of every array in a nested list) still holds 0xA5."""
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            assert_poisoned(v, f"{what}[{i}]")
        return
    b = _bytes_for_compare(x)
    written = int((b != POISON_BYTE).sum())
    assert written == 0, f"{what}: {written} of {b.numel()} bytes were written"


def peek_still_poisoned(arrays, busy, what="destination"):
    """While stream `busy` still sleeps, every array must still be poisoned: each is cloned
    on an independent non-blocking stream (host arrays directly) and checked.  Returns
    False, judging nothing, when the sleep ended before the clones did."""
    peek = torch.cuda.Stream()  # independent of `busy` and of the legacy default stream
    with torch.cuda.stream(peek):
        snapshot = [a.clone() for a in arrays]
    peek.synchronize()
    if busy.query():
        return False
    for i, c in enumerate(snapshot):
        assert_poisoned(c, f"{what} #{i} while its stream was still busy")
    return True


def clone_all(x):
    """Deep copy of a (nested list of) torch tensors / NumPy arrays."""
    if isinstance(x, (list, tuple)):
        return [clone_all(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.copy()
    return _as_int(x).clone().view(x.dtype)  # bit-exact for every dtype, keeps the strides


# --------------------------------------------------------------------------
# Whole cases.
# --------------------------------------------------------------------------


def make_case(nb, nl, no, nh, nt, hd, dtype, layout, device="cpu", pin=False, generator=None):
    """Random blocks (nb lists of nl*no chunks) and universals (nb arrays), torch tensors.

    Without a generator a seed is derived from the parameters and printed
    (pytest shows it with the failure report).
    """
    if generator is None:
        seed = seed_for(nb, nl, no, nh, nt, hd, str(dtype), layout, str(device), pin)
        print(f"make_case seed={seed}")
        generator = make_generator(seed)
    print(f"make_case nb={nb} nl={nl} no={no} nh={nh} nt={nt} hd={hd} dtype={dtype} layout={layout} device={device} pin={pin}")
    cshape = chunk_shape(nh, nt, hd, layout)
    blocks = [
        [random_tensor(cshape, dtype, device, generator, pin) for _ in range(nl * no)] for _ in range(nb)
    ]
    universals = [random_tensor((nh, nl, no, nt, hd), dtype, device, generator, pin) for _ in range(nb)]
    return blocks, universals


def expected_universals(blocks, no, layout):
    return [block_to_universal_ref(chunks, no, layout) for chunks in blocks]


def expected_blocks(universals, layout):
    return [universal_to_block_ref(u, layout) for u in universals]


def misaligned(t, offset_elems=1):
    """A contiguous view equal to t whose data pointer is offset_elems elements past
    the start of its allocation (so not 16-byte aligned for itemsize < 16)."""
    flat = torch.empty(t.numel() + offset_elems, dtype=t.dtype, device=t.device)
    if t.device.type == "cpu" and t.is_pinned():
        flat = flat.pin_memory()
    view = flat[offset_elems:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


# --------------------------------------------------------------------------
# Wrappers that expose exactly ONE array protocol each.
# --------------------------------------------------------------------------


class DLPackOnly:
    """Forwards the (versioned-capable) DLPack protocol of a torch tensor; records the calls."""

    def __init__(self, t):
        self._t = t
        self.calls = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy})
        return self._t.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class LegacyDLPackOnly:
    """A pre-1.0 DLPack producer: __dlpack__ knows no max_version and returns a legacy capsule."""

    def __init__(self, t):
        self._t = t
        self.calls = 0

    def __dlpack__(self, stream=None):
        self.calls += 1
        return torch.utils.dlpack.to_dlpack(self._t)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class ArrayInterfaceOnly:
    """Exposes only NumPy's __array_interface__ (keeps the array alive)."""

    def __init__(self, a):
        self._a = a

    @property
    def __array_interface__(self):
        return self._a.__array_interface__


class CudaArrayInterfaceOnly:
    """Exposes only __cuda_array_interface__ of a device array (torch, CuPy...), kept alive."""

    def __init__(self, obj):
        self._obj = obj

    @property
    def __cuda_array_interface__(self):
        return self._obj.__cuda_array_interface__


class DLPackWithDecoyArrayInterface(DLPackOnly):
    """DLPack of one tensor plus an __array_interface__ describing a DIFFERENT array:
    a library that prefers DLPack (as specified) sees the tensor's bytes."""

    def __init__(self, t, decoy):
        super().__init__(t)
        self._decoy = decoy

    @property
    def __array_interface__(self):
        return self._decoy.__array_interface__


def wrap(x, cls):
    """Apply cls to every array of a nested list (or a single array)."""
    if isinstance(x, (list, tuple)):
        return [wrap(v, cls) for v in x]
    return cls(x)


def place(t, where, index):
    """'device', 'pinned', 'pageable', or 'mixed' (alternating pinned / device by index)."""
    if where == "mixed":
        where = "pinned" if index % 2 else "device"
    if where == "device":
        return t.cuda()
    host = t.cpu()
    if where == "pinned":
        host = host.pin_memory()
        assert host.is_pinned()
    return host


class FakeDeviceArray:
    """Only a __cuda_array_interface__ (v2, fp16) pointing at a made-up device address:
    enough to make a build without CUDA refuse it, never to be dereferenced."""

    def __init__(self, shape):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": "<f2", "data": (0x10000, False), "version": 2, "strides": None,
        }


# --------------------------------------------------------------------------
# Calling the library and checking the outcome (shared by the test files).
# --------------------------------------------------------------------------


def sync():
    """Wait for all device work (no-op without a GPU)."""
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def rewrite_sources_behind_sleep(source_list, gen, invoke, fresh=None):
    """Producer/consumer stream ordering: with a new stream s1 current, a long sleep, then
    every tensor in `source_list` is overwritten (on s1) with `fresh` (default: random bytes
    from `gen`), then invoke(stream=s2) runs on a second new stream s2 with no manual sync.
    s2 must not have finished right after the call (else the library did not order s1
    before s2, or synchronised the host). Both streams are then synchronised. Returns the
    fresh tensors: the sources now hold them only if s1 was ordered before s2."""
    if fresh is None:
        fresh = [random_tensor(t.shape, t.dtype, t.device, gen) for t in source_list]
    assert len(fresh) == len(source_list)
    sync()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t, new in zip(source_list, fresh):
            t.copy_(new)
        t0 = time.perf_counter()
        invoke(stream=s2)
        elapsed = time.perf_counter() - t0
        assert not s2.query(), "s2 finished while s1 was still sleeping: no ordering, or a host sync"
    s2.synchronize()
    s1.synchronize()
    print(f"call took {elapsed * 1e3:.2f} ms")
    return fresh


def call(direction, blocks, universals, layout="NHD", **kwargs):
    """direction 'b2u' -> block_to_universal(blocks, universals, ...); 'u2b' -> universal_to_block(universals, blocks, ...)."""
    import kvbm_ext

    if direction == "b2u":
        return kvbm_ext.block_to_universal(blocks, universals, layout, **kwargs)
    return kvbm_ext.universal_to_block(universals, blocks, layout, **kwargs)


def _as_list(universals):
    """A single 5-D array means nb = 1."""
    return list(universals) if isinstance(universals, (list, tuple)) else [universals]


def b2u_and_check(blocks, universals, layout, no, **kwargs):
    """Poison universals, convert, compare with the reference; sources must be unchanged."""
    before = clone_all(blocks)
    poison_(_as_list(universals))
    sync()
    assert call("b2u", blocks, universals, layout, **kwargs) is None
    sync()
    assert_all_bitwise_equal(_as_list(universals), expected_universals(before, no, layout), "universals")
    assert_all_bitwise_equal(blocks, before, "blocks (source)")


def u2b_and_check(universals, blocks, layout, **kwargs):
    """Poison blocks, convert, compare with the reference; sources must be unchanged."""
    before = clone_all(_as_list(universals))
    poison_(blocks)
    sync()
    assert call("u2b", blocks, universals, layout, **kwargs) is None
    sync()
    assert_all_bitwise_equal(blocks, expected_blocks(before, layout), "blocks")
    assert_all_bitwise_equal(_as_list(universals), before, "universals (source)")


def arrays_in(x):
    """The torch tensors / NumPy arrays inside a (nested) argument; other objects are skipped."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from arrays_in(v)


def poison_even_if_read_only(a):
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a.setflags(write=True)
        poison_(a)
        a.setflags(write=False)
    else:
        poison_(a)


def path_regex(path):
    """^path not followed by a further index or word character."""
    return "^" + path + r"(?![\[\w])"


def check_rejected(direction, blocks, universals, exc, path, *words, layout="NHD", **kwargs):
    """Call with bad arguments: check the exception type, a message starting with `path`
    (a regex) and containing `words` (str or compiled regex), no destination byte written,
    every source unchanged. Returns the message."""
    dest, src = (universals, blocks) if direction == "b2u" else (blocks, universals)
    return expect_rejected(lambda: call(direction, blocks, universals, layout, **kwargs), src, dest, exc, path, words)


def assert_message_has(msg, words):
    """Every entry of `words` occurs in `msg`: a str as a substring, a compiled regex
    through search()."""
    for w in words:
        if isinstance(w, re.Pattern):
            assert w.search(msg), f"{w.pattern!r} not in message {msg!r}"
        else:
            assert w in msg, f"{w!r} not in message {msg!r}"


def expect_rejected(invoke, src, dst, exc, path, words):
    """Runs invoke() with the arrays in `dst` poisoned: it must raise `exc` with a message
    starting with `path` (a regex) and containing `words` (str or compiled regex), write
    no destination byte and change no source. Returns the message."""
    dest_arrays, src_arrays = list(arrays_in(dst)), list(arrays_in(src))
    for a in dest_arrays:
        poison_even_if_read_only(a)
    snapshots = clone_all(src_arrays)
    sync()
    with pytest.raises(exc, match=path_regex(path)) as info:
        invoke()
    sync()
    msg = str(info.value)
    assert_message_has(msg, words)
    for i, a in enumerate(dest_arrays):
        assert_poisoned(a, f"destination array #{i}")
    for i, (a, s) in enumerate(zip(src_arrays, snapshots)):
        assert_bitwise_equal(a, s, f"source array #{i}")
    return msg


# ==========================================================================
# Operational layout
# ==========================================================================
#
# operational block: one C-contiguous [nl, no, inner] array, inner = nt*nh*hd.
#   operational[l, o, :] == chunk[l*no + o].reshape(-1)               (block <-> operational)
#   operational[l, o].view(nt, nh, hd)[t, h, :] == universal[h, l, o, t, :]   (NHD)
#   operational[l, o].view(nh, nt, hd)[h, t, :] == universal[h, l, o, t, :]   (HND)
# Like the references above, these work on a same-size integer view (bit-exact).

# direction code -> kvbm_ext function; every function takes (source, destination, ...).
OP_FUNCTIONS = {
    "b2o": "block_to_operational",
    "o2b": "operational_to_block",
    "u2o": "universal_to_operational",
    "o2u": "operational_to_universal",
}
OP_BACKENDS = ["kernel", "async", "batch", "auto"]


def operational_shape(nl, no, nh, nt, hd):
    return (nl, no, nt * nh * hd)


def block_to_operational_ref(chunks, no):
    """nl*no chunks of one block (any common shape) -> operational [nl, no, chunk numel]."""
    chunks = [as_torch(c).cpu() for c in chunks]
    dtype = chunks[0].dtype
    assert len(chunks) % no == 0
    nl = len(chunks) // no
    flat = [_as_int(c).contiguous().reshape(-1) for c in chunks]
    return torch.stack(flat).reshape(nl, no, -1).view(dtype)


def operational_to_block_ref(operational, chunk_shape_):
    """operational [nl, no, inner] -> list of nl*no chunks shaped chunk_shape_ (contiguous)."""
    op = as_torch(operational).cpu()
    dtype = op.dtype
    ints = _as_int(op)
    nl, no, inner = ints.shape
    chunk_shape_ = tuple(chunk_shape_)
    assert int(np.prod(chunk_shape_)) == inner
    return [ints[l, o].reshape(chunk_shape_).contiguous().view(dtype) for l in range(nl) for o in range(no)]


def universal_to_operational_ref(universal, layout):
    """universal [nh, nl, no, nt, hd] -> operational [nl, no, nt*nh*hd] (contiguous)."""
    layout = _check_layout(layout)
    u = as_torch(universal).cpu()
    dtype = u.dtype
    ints = _as_int(u)
    nh, nl, no, nt, hd = ints.shape
    if layout == "NHD":
        per_chunk = ints.permute(1, 2, 3, 0, 4)  # [nl, no, nt, nh, hd]
    else:
        per_chunk = ints.permute(1, 2, 0, 3, 4)  # [nl, no, nh, nt, hd]
    return per_chunk.contiguous().reshape(nl, no, nt * nh * hd).view(dtype)


def operational_to_universal_ref(operational, nh, nt, hd, layout):
    """operational [nl, no, nt*nh*hd] -> universal [nh, nl, no, nt, hd] (contiguous)."""
    layout = _check_layout(layout)
    op = as_torch(operational).cpu()
    dtype = op.dtype
    ints = _as_int(op)
    nl, no, inner = ints.shape
    assert inner == nt * nh * hd
    if layout == "NHD":
        u = ints.reshape(nl, no, nt, nh, hd).permute(3, 0, 1, 2, 4)
    else:
        u = ints.reshape(nl, no, nh, nt, hd).permute(2, 0, 1, 3, 4)
    return u.contiguous().view(dtype)


def make_operationals(nb, nl, no, inner, dtype, device="cpu", generator=None, pin=False):
    """nb random [nl, no, inner] arrays (random bytes, torch)."""
    return [random_tensor((nl, no, inner), dtype, device, generator, pin) for _ in range(nb)]


def make_op_case(nb, nl, no, nh, nt, hd, dtype, layout="NHD", device="cpu", pin=False, generator=None):
    """blocks (chunks of `layout`), universals and operationals, all random, torch."""
    if generator is None:
        seed = seed_for("op", nb, nl, no, nh, nt, hd, str(dtype), layout, str(device), pin)
        print(f"make_op_case seed={seed}")
        generator = make_generator(seed)
    blocks, universals = make_case(nb, nl, no, nh, nt, hd, dtype, layout, device, pin, generator)
    operationals = make_operationals(nb, nl, no, nt * nh * hd, dtype, device, generator, pin)
    return blocks, universals, operationals


def call_op(direction, src, dst, *args, **kwargs):
    """'b2o' -> block_to_operational(src, dst, ...), 'o2b', 'u2o', 'o2u' likewise."""
    import kvbm_ext

    return getattr(kvbm_ext, OP_FUNCTIONS[direction])(src, dst, *args, **kwargs)


def expected_op(direction, src, dst, layout="NHD"):
    """Reference output of `direction` from the sources `src`; shapes the reference needs
    (no, chunk shape, nh/nt/hd) are taken from the destinations `dst`. Returns a list
    (one entry per block) shaped like the destination argument."""
    if direction == "b2o":
        return [block_to_operational_ref(chunks, op.shape[1]) for chunks, op in zip(src, _as_list(dst))]
    if direction == "o2b":
        return [operational_to_block_ref(op, tuple(dst[0][0].shape)) for op in _as_list(src)]
    if direction == "u2o":
        return [universal_to_operational_ref(u, layout) for u in _as_list(src)]
    if direction == "o2u":
        return [
            operational_to_universal_ref(op, u.shape[0], u.shape[3], u.shape[4], layout)
            for op, u in zip(_as_list(src), _as_list(dst))
        ]
    raise ValueError(direction)


def _dest_list(direction, dst):
    return dst if direction == "o2b" else _as_list(dst)


def op_and_check(direction, src, dst, *args, after=None, **kwargs):
    """Poison the destinations, call, wait (`after`, default: the whole device), compare with
    the reference byte for byte; the sources must be unchanged. args/kwargs go to the call
    (layout for u2o/o2u, backend=, stream=)."""
    before = clone_all(src)
    poison_(list(arrays_in(dst)))
    sync()
    assert call_op(direction, src, dst, *args, **kwargs) is None
    (after or sync)()
    layout = args[0] if args else kwargs.get("layout", "NHD")
    want = expected_op(direction, before, dst, layout)
    assert_all_bitwise_equal(_dest_list(direction, dst), want, "destinations")
    assert_all_bitwise_equal(list(arrays_in(src)), list(arrays_in(before)), "sources")


def check_op_rejected(direction, src, dst, exc, path, *words, args=(), **kwargs):
    """Like check_rejected for the operational functions: exception type, message starting
    with `path` (a regex) and containing `words`, destinations still poisoned, sources
    unchanged. Returns the message."""
    return expect_rejected(lambda: call_op(direction, src, dst, *args, **kwargs), src, dst, exc, path, words)
