"""Plain PyTorch references of every move kvbm_ext makes.

Layouts (REFERENCE.md section 1):
  universal    [nh, nl, no, nt, hd]   (one per block)
  chunk NHD    [nt, nh, hd]           (nl*no per block, index l*no + o)
  chunk HND    [nh, nt, hd]
  operational  [nl, no, nt*nh*hd]     (one C-contiguous array per block)

  universal[h, l, o, t, :] == chunk[l*no + o][t, h, :]                     (NHD)
  universal[h, l, o, t, :] == chunk[l*no + o][h, t, :]                     (HND)
  operational[l, o, :] == chunk[l*no + o].reshape(-1)                      (block <-> operational)
  operational[l, o].view(nt, nh, hd)[t, h, :] == universal[h, l, o, t, :]  (NHD)
  operational[l, o].view(nh, nt, hd)[h, t, :] == universal[h, l, o, t, :]  (HND)

A PagedKVCache is described by `dims` (one letter per array dimension, logical order):
l layer, k K/V outer (absent: no = 1), b block, t token, h head (absent: nh = 1), d head
dim. `cache_rows` turns the cache's arrays into nl integer VIEWS (sharing memory) of
logical shape [NB, no, nt, nh, hd], so `rows[l][i][o, t, h]` is "cache block i, layer l,
outer o, token t, head h" whatever the physical order; `paged_reference` moves those rows:

  to_universal:    universals[b][head_offset + h, layer_offset + l, o, t, :] = rows[l][ids[b]][o, t, h]
  to_operational:  operationals[b][l, o].view(nt, nh, hd)[t, h, :]           = rows[l][ids[b]][o, t, h]  (NHD)
                   operationals[b][l, o].view(nh, nt, hd)[h, t, :]           = rows[l][ids[b]][o, t, h]  (HND)
  from_*: the same equalities, written into the cache.
  pack_layers=True: the j-th selected layer l is universal layer layer_offset + j
  (operational layer j) in place of layer_offset + l (l).

Every reference works on an integer view of the same element size, so every bit pattern
(NaN payloads, fp8 specials) is moved exactly.
"""

import numpy as np
import torch

# Same-size integer dtype used to move elements bit-exactly.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_torch(x):
    """A torch view (or copy, for read-only NumPy) of a torch tensor or NumPy array."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            x = x.copy()
        return torch.from_numpy(x)
    raise TypeError(f"as_torch: unsupported {type(x)!r}")


def as_int(t):
    """Same-size integer view (works on non-contiguous tensors too); for element sizes
    without an integer type (complex128) a uint8 view (needs a contiguous last dim)."""
    size = t.element_size()
    return t.view(_INT_OF_SIZE[size]) if size in _INT_OF_SIZE else t.view(torch.uint8)


def as_list(universals):
    """A single array (5-D universal, 3-D operational) means nb = 1."""
    return list(universals) if isinstance(universals, (list, tuple)) else [universals]


def _check_layout(layout):
    layout = layout.upper()
    if layout not in ("NHD", "HND"):
        raise ValueError(layout)
    return layout


def chunk_shape(nh, nt, hd, layout):
    return (nt, nh, hd) if _check_layout(layout) == "NHD" else (nh, nt, hd)


# --------------------------------------------------------------------------
# Block <-> universal.
# --------------------------------------------------------------------------


def block_to_universal_ref(chunks, no, layout):
    """nl*no chunks of one block -> universal [nh, nl, no, nt, hd] (torch, contiguous)."""
    layout = _check_layout(layout)
    chunks = [as_torch(c).cpu() for c in chunks]  # chunks may sit on several devices
    dtype = chunks[0].dtype
    assert len(chunks) % no == 0
    nl = len(chunks) // no
    ints = [as_int(c) for c in chunks]
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
    u = as_int(universal)
    nh, nl, no, nt, hd = u.shape
    chunks = []
    for l in range(nl):
        for o in range(no):
            chunk = u[:, l, o]  # [nh, nt, hd]
            if layout == "NHD":
                chunk = chunk.permute(1, 0, 2)
            chunks.append(chunk.contiguous().view(dtype))
    return chunks


def expected_universals(blocks, no, layout):
    return [block_to_universal_ref(chunks, no, layout) for chunks in blocks]


def expected_blocks(universals, layout):
    return [universal_to_block_ref(u, layout) for u in universals]


# --------------------------------------------------------------------------
# Operational.
# --------------------------------------------------------------------------


def block_to_operational_ref(chunks, no):
    """nl*no chunks of one block (any common shape) -> operational [nl, no, chunk numel]."""
    chunks = [as_torch(c).cpu() for c in chunks]
    dtype = chunks[0].dtype
    assert len(chunks) % no == 0
    nl = len(chunks) // no
    flat = [as_int(c).contiguous().reshape(-1) for c in chunks]
    return torch.stack(flat).reshape(nl, no, -1).view(dtype)


def operational_to_block_ref(operational, chunk_shape_):
    """operational [nl, no, inner] -> list of nl*no chunks shaped chunk_shape_ (contiguous)."""
    op = as_torch(operational).cpu()
    dtype = op.dtype
    ints = as_int(op)
    nl, no, inner = ints.shape
    chunk_shape_ = tuple(chunk_shape_)
    assert int(np.prod(chunk_shape_)) == inner
    return [ints[l, o].reshape(chunk_shape_).contiguous().view(dtype) for l in range(nl) for o in range(no)]


def universal_to_operational_ref(universal, layout):
    """universal [nh, nl, no, nt, hd] -> operational [nl, no, nt*nh*hd] (contiguous)."""
    layout = _check_layout(layout)
    u = as_torch(universal).cpu()
    dtype = u.dtype
    ints = as_int(u)
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
    ints = as_int(op)
    nl, no, inner = ints.shape
    assert inner == nt * nh * hd
    if layout == "NHD":
        u = ints.reshape(nl, no, nt, nh, hd).permute(3, 0, 1, 2, 4)
    else:
        u = ints.reshape(nl, no, nh, nt, hd).permute(2, 0, 1, 3, 4)
    return u.contiguous().view(dtype)


def expected_op(direction, src, dst, layout="NHD"):
    """Reference output of `direction` ('b2o', 'o2b', 'u2o', 'o2u') from the sources `src`;
    shapes the reference needs (no, chunk shape, nh/nt/hd) are taken from the destinations
    `dst`. Returns a list (one entry per block) shaped like the destination argument."""
    if direction == "b2o":
        return [block_to_operational_ref(chunks, op.shape[1]) for chunks, op in zip(src, as_list(dst))]
    if direction == "o2b":
        return [operational_to_block_ref(op, tuple(dst[0][0].shape)) for op in as_list(src)]
    if direction == "u2o":
        return [universal_to_operational_ref(u, layout) for u in as_list(src)]
    if direction == "o2u":
        return [
            operational_to_universal_ref(op, u.shape[0], u.shape[3], u.shape[4], layout)
            for op, u in zip(as_list(src), as_list(dst))
        ]
    raise ValueError(direction)


# --------------------------------------------------------------------------
# PagedKVCache: the cache's rows in canonical order, and the moves between them.
# --------------------------------------------------------------------------


def canonical(x, dims, order):
    """A view of torch tensor `x` (logical dimensions `dims`) with its dimensions permuted
    into `order`; letters of `order` missing from `dims` become size-1 dimensions. Integer
    view of the same element size (bit-exact)."""
    x = as_int(as_torch(x))
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
        return [as_int(as_torch(x)) for x in struct]
    return list(as_int(as_torch(struct)).unbind(0))


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


def paged_reference(method, rows, blocks, ids, sel, layer_offset=0, head_offset=0, inner="NHD", heads=None,
                    pack_layers=False):
    """Applies `method` with plain torch indexing: for to_* `rows` (the cache) is read and
    `blocks` (per-block universal/operational views) written; for from_* the reverse.
    `heads`: the cache heads moved, in order (None: all), universal heads from head_offset.
    `pack_layers`: the j-th layer of `sel` is flat layer layer_offset + j, not
    layer_offset + its cache index. Ids outside [0, NB) are skipped (device ids)."""
    inner = inner.upper()
    assert inner in ("NHD", "HND"), inner
    if not ids:
        return
    NB, no, nt, nh, hd = rows[0].shape
    hs = list(range(nh)) if heads is None else heads
    for b, i in enumerate(ids):
        if not 0 <= i < NB:
            continue
        for k, l in enumerate(sel):
            r = rows[l][i]  # [no, nt, nh, hd]
            f = layer_offset + (k if pack_layers else l)  # the flat layer
            if method == "to_universal":
                for j, h in enumerate(hs):
                    blocks[b][head_offset + j, f].copy_(r[:, :, h])
            elif method == "from_universal":
                for j, h in enumerate(hs):
                    r[:, :, h].copy_(blocks[b][head_offset + j, f])
            elif method == "to_operational":
                src = r if inner == "NHD" else r.permute(0, 2, 1, 3)  # [no, nt, nh, hd] / [no, nh, nt, hd]
                blocks[b][f].copy_(src.reshape(no, nt * nh * hd))
            elif method == "from_operational":
                if inner == "NHD":
                    r.copy_(blocks[b][f].reshape(no, nt, nh, hd))
                else:
                    r.copy_(blocks[b][f].reshape(no, nh, nt, hd).permute(0, 2, 1, 3))
            else:
                raise ValueError(method)
