"""Pure-PyTorch references and case builders for kvbm_ext.PagedKVCache (tests/test_paged.py).

A cache is described by `dims` (one letter per array dimension, logical order):
l layer, k K/V outer (absent: no = 1), b block, t token, h head (absent: nh = 1), d head dim.
`cache_rows` turns the cache's arrays into nl integer VIEWS (sharing memory) of logical
shape [NB, no, nt, nh, hd], so `rows[l][i][o, t, h]` is "cache block i, layer l, outer o,
token t, head h" of the spec, whatever the physical order. The references below move those
rows with plain indexing / permute / copy_:

  to_universal:    universals[b][head_offset + h, layer_offset + l, o, t, :] = rows[l][ids[b]][o, t, h]
  to_operational:  operationals[b][l, o].view(nt, nh, hd)[t, h, :]           = rows[l][ids[b]][o, t, h]  (NHD)
                   operationals[b][l, o].view(nh, nt, hd)[h, t, :]           = rows[l][ids[b]][o, t, h]  (HND)
  from_*: the same equalities, written into the cache.

Every buffer the tests hand to the library is a `Buffers`: the memory the test owns (`bases`,
contiguous torch tensors) and a function building the argument from the bases (`make`). The
expected outcome of a call is computed by applying the reference to a CPU COPY of the
destination's bases (poisoned), through the same views, and then the WHOLE memory is
compared byte for byte: written rows, rows that must stay untouched (other heads, other
layers, other blocks) and gaps between rows (padding) alike.
"""

import numpy as np
import torch

from reference import _as_int, as_torch, assert_bitwise_equal, poison_, random_tensor, sync

METHODS = ["to_universal", "from_universal", "to_operational", "from_operational"]


# --------------------------------------------------------------------------
# Views in canonical order.
# --------------------------------------------------------------------------


def canonical(x, dims, order):
    """A view of torch tensor `x` (logical dimensions `dims`) with its dimensions permuted
    into `order`; letters of `order` missing from `dims` become size-1 dimensions. Integer
    view of the same element size (bit-exact)."""
    x = _as_int(as_torch(x))
    assert len(dims) == x.dim(), (dims, tuple(x.shape))
    present = [c for c in order if c in dims]
    assert sorted(present) == sorted(dims), (dims, order)
    y = x.permute(*[dims.index(c) for c in present])
    for i, c in enumerate(order):
        if c not in dims:
            y = y.unsqueeze(i)
    return y


def cache_rows(layers, dims):
    """nl integer views [NB, no, nt, nh, hd] of a cache given as a list of per-layer arrays
    (dims without 'l') or one array (dims with 'l')."""
    if isinstance(layers, (list, tuple)):
        return [canonical(x, dims, "bkthd") for x in layers]
    return list(canonical(layers, dims, "lbkthd").unbind(0))


def per_block(struct):
    """The per-block torch views of a universals/operationals argument (list, tuple or one
    array whose leading dimension is the block)."""
    if isinstance(struct, (list, tuple)):
        return [_as_int(as_torch(x)) for x in struct]
    return list(_as_int(as_torch(struct)).unbind(0))


def selected(n, sel):
    """The indices a `layers` or `heads` argument selects among n (Python semantics)."""
    if sel is None:
        return list(range(n))
    if isinstance(sel, slice):
        return list(range(n)[sel])
    if isinstance(sel, range):
        return list(sel)
    return [range(n)[sel.__index__()]]


def ids_list(ids):
    """Python ints of a block_ids argument (list, tuple, NumPy array, torch tensor)."""
    if isinstance(ids, torch.Tensor):
        return [int(v) for v in ids.cpu().tolist()]
    if isinstance(ids, np.ndarray):
        return [int(v) for v in ids.tolist()]
    return [int(v) for v in ids]


def reference(method, rows, blocks, ids, sel, layer_offset=0, head_offset=0, inner="NHD", heads=None):
    """Applies `method` with plain torch indexing: for to_* `rows` (the cache) is read and
    `blocks` (per-block universal/operational views) written; for from_* the reverse.
    `heads`: the cache heads moved, in order (None: all), universal heads from head_offset.
    Ids outside [0, NB) are skipped (device ids)."""
    inner = inner.upper()
    assert inner in ("NHD", "HND"), inner
    if not ids:
        return
    NB, no, nt, nh, hd = rows[0].shape
    hs = list(range(nh)) if heads is None else heads
    for b, i in enumerate(ids):
        if not 0 <= i < NB:
            continue
        for l in sel:
            r = rows[l][i]  # [no, nt, nh, hd]
            if method == "to_universal":
                for j, h in enumerate(hs):
                    blocks[b][head_offset + j, layer_offset + l].copy_(r[:, :, h])
            elif method == "from_universal":
                for j, h in enumerate(hs):
                    r[:, :, h].copy_(blocks[b][head_offset + j, layer_offset + l])
            elif method == "to_operational":
                src = r if inner == "NHD" else r.permute(0, 2, 1, 3)  # [no, nt, nh, hd] / [no, nh, nt, hd]
                blocks[b][l].copy_(src.reshape(no, nt * nh * hd))
            elif method == "from_operational":
                if inner == "NHD":
                    r.copy_(blocks[b][l].reshape(no, nt, nh, hd))
                else:
                    r.copy_(blocks[b][l].reshape(no, nh, nt, hd).permute(0, 2, 1, 3))
            else:
                raise ValueError(method)


# --------------------------------------------------------------------------
# Buffers: memory owned by the test plus the argument made from it.
# --------------------------------------------------------------------------


def snapshot(bases):
    """CPU integer copies of the bases (a different allocation, same bytes)."""
    return [_as_int(b.detach()).to("cpu", copy=True) for b in bases]


class Buffers:
    def __init__(self, bases, make, to_arg=None):
        self.bases = list(bases)
        self.make = make
        self.struct = make(self.bases)  # torch views
        self.arg = to_arg(self.struct) if to_arg else self.struct  # what the library gets


def _to_numpy(struct):
    if isinstance(struct, list):
        return [x.numpy() for x in struct]
    if isinstance(struct, tuple):
        return tuple(x.numpy() for x in struct)
    return struct.numpy()


# --------------------------------------------------------------------------
# Caches.
# --------------------------------------------------------------------------

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


class CacheCase:
    """A cache's memory (Buffers), its dims and sizes. `layers` is the constructor argument."""

    def __init__(self, layout, nl, NB, no, nh, nt, hd, dtype, gen, device="cpu", numpy=False, bases=None, make=None):
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
            bases = [random_tensor(shape, dtype, device, gen) for _ in range(count)]
        self.buf = Buffers(bases, make, _to_numpy if numpy else None)
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


# --------------------------------------------------------------------------
# Universals / operationals.
# --------------------------------------------------------------------------

BLOCK_FORMS = ["list", "tuple", "array", "pool[1::2]", "numpy-list", "numpy-array"]


def block_buffers(form, nb, shape, dtype, gen, device="cpu", pin=False):
    """nb per-block arrays of `shape`: a list, a tuple, one array [nb, *shape], a strided
    slice pool[1::2] of a [2nb+1, *shape] pool, or NumPy versions of list / array."""
    shape = tuple(shape)
    rnd = lambda s: random_tensor(s, dtype, device, gen, pin)  # noqa: E731
    to_arg = _to_numpy if form.startswith("numpy") else None
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


# --------------------------------------------------------------------------
# Calling and checking.
# --------------------------------------------------------------------------


def invoke(cache, method, ids, other, **kwargs):
    """cache.<method> with the argument order of the spec."""
    if method.startswith("to_"):
        return getattr(cache, method)(ids, other, **kwargs)
    return getattr(cache, method)(other, ids, **kwargs)


def expected_after(case, method, ids, other_buf, cache_bases, other_bases, kwargs):
    """(expected destination bases, destination Buffers) of a call, computed on CPU copies:
    `cache_bases`/`other_bases` are the snapshots taken before the call."""
    sel = selected(case.nl, kwargs.get("layers"))
    common = dict(layer_offset=kwargs.get("layer_offset", 0), head_offset=kwargs.get("head_offset", 0),
                  inner=kwargs.get("inner", "NHD"), heads=selected(case.nh, kwargs.get("heads")))
    if method in ("to_operational", "from_operational"):
        assert common["layer_offset"] == 0 and common["head_offset"] == 0
    rows = cache_rows(case.buf.make(cache_bases), case.dims)
    blocks = per_block(other_buf.make(other_bases))
    reference(method, rows, blocks, ids_list(ids), sel, **common)
    return cache_bases if method.startswith("from_") else other_bases


def run_and_check(case, cache, method, ids, other_buf, after=sync, before=None, **kwargs):
    """Poison the destination (other_buf for to_*, the cache for from_*), run `before` (if
    given), call `cache.<method>`, wait (`after`), then compare EVERY byte of the destination's memory
    with the reference applied to a copy of it (moved rows written, everything else still
    poisoned) and the source's memory with its snapshot."""
    to = method.startswith("to_")
    dst, src = (other_buf, case.buf) if to else (case.buf, other_buf)
    poison_(dst.bases)
    sync()
    cache_before, other_before = snapshot(case.buf.bases), snapshot(other_buf.bases)
    src_before = cache_before if to else other_before
    src_before = [b.clone() for b in src_before]
    if before is not None:
        before()
    assert invoke(cache, method, ids, other_buf.arg, **kwargs) is None
    after()
    want = expected_after(case, method, ids, other_buf, cache_before, other_before, kwargs)
    what = "universals" if "universal" in method else "operationals"
    dst_name, src_name = (what, "cache") if to else ("cache", what)
    for i, (got, exp) in enumerate(zip(dst.bases, want)):
        assert_bitwise_equal(_as_int(got), exp, f"{method}: destination ({dst_name}) memory #{i}")
    for i, (got, exp) in enumerate(zip(src.bases, src_before)):
        assert_bitwise_equal(_as_int(got), exp, f"{method}: source ({src_name}) memory #{i}")
