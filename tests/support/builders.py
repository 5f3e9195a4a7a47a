"""Random cases for the tests: dtypes and shapes with their ids, random bytes, blocks /
universals / operationals, placements (device, pinned, pageable), and PagedKVCache caches
with the buffers they are moved to and from.

Every buffer handed to PagedKVCache calls is a `Buffers`: the memory the test owns
(`bases`, contiguous torch tensors) and a function building the argument from the bases
(`make`). A check applies the reference to a CPU copy of the destination's bases through
the same views and compares the WHOLE memory: written rows, rows that must stay untouched
and the gaps between rows alike.
"""

import zlib

import numpy as np
import torch

from support.references import as_int, cache_rows, chunk_shape, per_block

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

LAYOUTS = ["NHD", "HND"]


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


def to_numpy(x):
    """NumPy view of a CPU torch tensor (shares memory); lists are mapped."""
    if isinstance(x, (list, tuple)):
        return [to_numpy(v) for v in x]
    return x.numpy()


def read_only_copy(x):
    """A read-only NumPy copy of a NumPy array or a CPU torch tensor."""
    a = (x.numpy() if isinstance(x, torch.Tensor) else x).copy()
    a.setflags(write=False)
    return a


def arrays_in(x):
    """The torch tensors / NumPy arrays inside a (nested) argument; other objects are skipped."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from arrays_in(v)


def clone_all(x):
    """Deep copy of a (nested list of) torch tensors / NumPy arrays."""
    if isinstance(x, (list, tuple)):
        return [clone_all(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.copy()
    return as_int(x).clone().view(x.dtype)  # bit-exact for every dtype, keeps the strides


# --------------------------------------------------------------------------
# Random bytes.
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


# --------------------------------------------------------------------------
# Blocks, universals, operationals.
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


def placed_case(shape, dtype, layout, gen, blocks_where, universals_where):
    """make_case with the chunks placed `blocks_where` and the universals `universals_where`
    ('device', 'pinned', 'pageable' or 'mixed')."""
    blocks, universals = make_case(*shape, dtype, layout, generator=gen)
    blocks = [[place(c, blocks_where, b * 7 + i) for i, c in enumerate(chunks)] for b, chunks in enumerate(blocks)]
    universals = [place(u, universals_where, i) for i, u in enumerate(universals)]
    return blocks, universals


# --------------------------------------------------------------------------
# PagedKVCache: buffers, the catalogue of cache layouts, caches.
# --------------------------------------------------------------------------


def snapshot(bases):
    """CPU integer copies of the bases (a different allocation, same bytes)."""
    return [as_int(b.detach()).to("cpu", copy=True) for b in bases]


class Buffers:
    def __init__(self, bases, make, to_arg=None):
        self.bases = list(bases)
        self.make = make
        self.struct = make(self.bases)  # torch views
        self.arg = to_arg(self.struct) if to_arg else self.struct  # what the library gets


def _numpy_views(struct):
    if isinstance(struct, list):
        return [x.numpy() for x in struct]
    if isinstance(struct, tuple):
        return tuple(x.numpy() for x in struct)
    return struct.numpy()


# name -> (dims, per_layer, base shape from (nl, NB, no, nh, nt, hd), views from the bases).
# "Per layer": one base per layer; else one base for all layers.
CACHE_LAYOUTS = {
    # vLLM FlashAttention: nl arrays [2, NB, nt, nh, hd]
    "kbthd": ("kbthd", True, lambda nl, NB, no, nh, nt, hd: (no, NB, nt, nh, hd), lambda bs: list(bs)),
    # FlashInfer: nl arrays [NB, 2, nt, nh, hd]
    "bkthd": ("bkthd", True, lambda nl, NB, no, nh, nt, hd: (NB, no, nt, nh, hd), lambda bs: list(bs)),
    # MLA: nl arrays [NB, nt, hd] (no = nh = 1)
    "btd": ("btd", True, lambda nl, NB, no, nh, nt, hd: (NB, nt, hd), lambda bs: list(bs)),
    # logical HND per layer: nl arrays [2, NB, nh, nt, hd]
    "kbhtd": ("kbhtd", True, lambda nl, NB, no, nh, nt, hd: (no, NB, nh, nt, hd), lambda bs: list(bs)),
    # "kbthd" views whose memory is [2, NB, nh, nt, hd] (strided HND physical order)
    "kbthd_hnd": (
        "kbthd", True, lambda nl, NB, no, nh, nt, hd: (no, NB, nh, nt, hd),
        lambda bs: [b.permute(0, 1, 3, 2, 4) for b in bs],
    ),
    # "kbthd" views of a padded pool: blocks 2..NB+1 of NB+3, head dim 1..hd of hd+3
    # (gaps between rows and blocks, an unaligned start)
    "kbthd_padded": (
        "kbthd", True, lambda nl, NB, no, nh, nt, hd: (no, NB + 3, nt, nh, hd + 3),
        lambda bs: [b[:, 2 : b.shape[1] - 1, :, :, 1 : b.shape[4] - 2] for b in bs],
    ),
    # per-layer views of ONE allocation [nl, 2, NB, nt, nh, hd]
    "kbthd_shared": (
        "kbthd", False, lambda nl, NB, no, nh, nt, hd: (nl, no, NB, nt, nh, hd), lambda bs: list(bs[0].unbind(0)),
    ),
    # logical order with d first (stride 1 all the same): memory [2, NB, nt, nh, hd]
    "dtbkh": (
        "dtbkh", True, lambda nl, NB, no, nh, nt, hd: (no, NB, nt, nh, hd),
        lambda bs: [b.permute(4, 2, 1, 0, 3) for b in bs],
    ),
    # cross-layer: one array [NB, nl, 2, nt, nh, hd]
    "blkthd": ("blkthd", False, lambda nl, NB, no, nh, nt, hd: (NB, nl, no, nt, nh, hd), lambda bs: bs[0]),
    # one array [nl, 2, NB, nt, nh, hd]
    "lkbthd": ("lkbthd", False, lambda nl, NB, no, nh, nt, hd: (nl, no, NB, nt, nh, hd), lambda bs: bs[0]),
    # one array without k (no = 1): [nl, NB, nt, nh, hd]
    "lbthd": ("lbthd", False, lambda nl, NB, no, nh, nt, hd: (nl, NB, nt, nh, hd), lambda bs: bs[0]),
    # "blkthd" view of memory [NB, nl, 2, nh, nt, hd]
    "blkthd_hnd": (
        "blkthd", False, lambda nl, NB, no, nh, nt, hd: (NB, nl, no, nh, nt, hd),
        lambda bs: bs[0].permute(0, 1, 2, 4, 3, 5),
    ),
}

METHODS = ["to_universal", "from_universal", "to_operational", "from_operational"]


class CacheCase:
    """A cache's memory (Buffers), its dims and sizes. `layers` is the constructor argument.
    `pin`: the memory in pinned host memory (`device` is then ignored)."""

    def __init__(self, layout, nl, NB, no, nh, nt, hd, dtype, gen, device="cpu", numpy=False, bases=None, make=None,
                 pin=False):
        dims, per_layer, base_shape, default_make = CACHE_LAYOUTS[layout]
        make = make or default_make
        if "k" not in dims:
            no = 1
        if "h" not in dims:
            nh = 1
        self.layout, self.dims = layout, dims
        self.nl, self.NB, self.no, self.nh, self.nt, self.hd = nl, NB, no, nh, nt, hd
        self.dtype, self.device = dtype, device
        shape = base_shape(nl, NB, no, nh, nt, hd)
        if bases is None:
            count = nl if per_layer else 1
            bases = [random_tensor(shape, dtype, device, gen, pin) for _ in range(count)]
        self.buf = Buffers(bases, make, _numpy_views if numpy else None)
        rows = self.rows()
        assert len(rows) == nl and all(tuple(r.shape) == (NB, no, nt, nh, hd) for r in rows), (
            layout, [tuple(r.shape) for r in rows])

    @property
    def layers(self):
        return self.buf.arg

    def rows(self, bases=None):
        return cache_rows(self.buf.make(self.buf.bases if bases is None else bases), self.dims)

    def build(self):
        import kvbm_ext

        return kvbm_ext.PagedKVCache(self.layers, self.dims)

    def universal_shape(self, NH=None, NL=None):
        return (self.nh if NH is None else NH, self.nl if NL is None else NL, self.no, self.nt, self.hd)

    def operational_shape(self):
        return (self.nl, self.no, self.nt * self.nh * self.hd)


BLOCK_FORMS = ["list", "tuple", "array", "pool[1::2]", "numpy-list", "numpy-array"]


def block_buffers(form, nb, shape, dtype, gen, device="cpu", pin=False):
    """nb per-block arrays of `shape`: a list, a tuple, one array [nb, *shape], a strided
    slice pool[1::2] of a [2nb+1, *shape] pool, or NumPy versions of list / array."""
    shape = tuple(shape)
    rnd = lambda s: random_tensor(s, dtype, device, gen, pin)  # noqa: E731
    to_arg = _numpy_views if form.startswith("numpy") else None
    if form in ("list", "tuple", "numpy-list"):
        bases = [rnd(shape) for _ in range(nb)]
        make = (lambda bs: tuple(bs)) if form == "tuple" else (lambda bs: list(bs))
    elif form in ("array", "numpy-array"):
        bases = [rnd((nb,) + shape)]
        make = lambda bs: bs[0]  # noqa: E731
    elif form == "pool[1::2]":
        bases = [rnd((2 * nb + 1,) + shape)]
        make = lambda bs: bs[0][1::2]  # noqa: E731
    else:
        raise ValueError(form)
    buf = Buffers(bases, make, to_arg)
    assert len(per_block(buf.struct)) == nb
    return buf


def split(direction):
    """A PagedKVCache method code 'to_operational:HND' -> ('to_operational', {'layout': 'HND'})."""
    method, _, layout = direction.partition(":")
    return method, ({"layout": layout} if layout else {})


def pick_ids(NB, nb, gen):
    """nb distinct block ids in [0, NB), in random order."""
    return torch.randperm(NB, generator=gen)[:nb].tolist()
