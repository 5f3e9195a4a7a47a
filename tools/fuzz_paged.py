"""What tools/fuzz.py checks PagedKVCache calls against, in NumPy: the selection rule of
layers= and heads=, the moves to and from universal and operational blocks, and which
layers share bytes.  Nothing here calls kvbm_ext."""

import operator

import numpy as np

INT32_MAX = 2**31 - 1

# Cache layouts: dims, whether one array holds every layer, and the base shape from
# (nl, NB, no, nh, nt, hd); `make` turns the bases into the constructor's argument.
LAYOUTS = {
    "kbthd": ("kbthd", False, lambda nl, NB, no, nh, nt, hd: (no, NB, nt, nh, hd)),
    "bkthd": ("bkthd", False, lambda nl, NB, no, nh, nt, hd: (NB, no, nt, nh, hd)),
    "kbhtd": ("kbhtd", False, lambda nl, NB, no, nh, nt, hd: (no, NB, nh, nt, hd)),
    "btd": ("btd", False, lambda nl, NB, no, nh, nt, hd: (NB, nt, hd)),
    "lkbthd": ("lkbthd", True, lambda nl, NB, no, nh, nt, hd: (nl, no, NB, nt, nh, hd)),
    "blkthd": ("blkthd", True, lambda nl, NB, no, nh, nt, hd: (NB, nl, no, nt, nh, hd)),
}


def _index(value):
    """operator.index for what PagedKVCache takes as an int (not a bool), else None."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001 - a raising __index__ is refused
        return None


def selection(n, sel):
    """The indices `sel` selects among n under PagedKVCache's rule, in order, or None when
    the rule refuses it: None is all; an index by Python's rules; a slice by Python's rules
    but no bound outside the entries; a range of entries; never empty."""
    if sel is None:
        return list(range(n))
    if isinstance(sel, slice):
        parts = [None if b is None else _index(b) for b in (sel.start, sel.stop, sel.step)]
        if any(p is None and b is not None for p, b in zip(parts, (sel.start, sel.stop, sel.step))):
            return None
        start, stop, step = parts
        step = 1 if step is None else step
        if step == 0:
            return None
        top = n if step > 0 else n - 1
        for bound in (start, stop):
            if bound is not None and not 0 <= (bound + n if bound < 0 else bound) <= top:
                return None
        return list(range(n)[slice(start, stop, step)]) or None
    if isinstance(sel, range):
        if not sel or not (0 <= sel[0] < n and 0 <= sel[-1] < n):
            return None
        return list(sel)
    index = _index(sel)
    if index is None or not -n <= index < n:
        return None
    return [index + n if index < 0 else index]


def draw_selection(rng, n, hostile):
    """A layers= or heads= argument for n entries: mostly in the rule, sometimes not."""
    b = lambda: rng.choice([None, rng.randint(-n - 2, n + 2), rng.randint(0, n)])  # noqa: E731
    kind = rng.randrange(10)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([rng.randint(-n - 1, n), np.int64(rng.randint(-n, n - 1)), True])
    if kind in (2, 3, 4):
        return slice(b(), b(), rng.choice([None, 1, 1, 2, -1, -2, 3, 0, 2**70, -(2**70)]))
    if kind in (5, 6):
        start = rng.randint(-1, n)
        return range(start, rng.randint(-1, n + 1), rng.choice([1, 1, 2, -1, -2]))
    if kind == 7:
        return slice(rng.choice([0, -n, n, 2**64, -(2**64)]), rng.choice([None, n, 2**64]))
    return rng.choice(hostile) if hostile else None


def rows(layers, dims):
    """Views [NB, no, nt, nh, hd] of each layer (or of each layer of one array)."""
    order = ("l" if "l" in dims else "") + "bkthd"
    if "l" in dims:
        whole = _canonical(layers, dims, order)
        return [whole[l] for l in range(whole.shape[0])]
    return [_canonical(a, dims, order) for a in layers]


def _canonical(a, dims, order):
    present = [c for c in order if c in dims]
    view = a.transpose([dims.index(c) for c in present])
    for i, c in enumerate(order):
        if c not in dims:
            view = np.expand_dims(view, i)
    return view


def apply(method, cache_rows, flats, ids, layers, heads, layer_offset=0, head_offset=0, inner="NHD"):
    """The move of `method` on NumPy views: for to_* the cache rows are read and the flat
    blocks written, for from_* the reverse."""
    for b, i in enumerate(ids):
        for l in layers:
            r = cache_rows[l][i]  # [no, nt, nh, hd]
            no, nt, nh, hd = r.shape
            if method == "to_universal":
                for j, h in enumerate(heads):
                    flats[b][head_offset + j, layer_offset + l] = r[:, :, h]
            elif method == "from_universal":
                for j, h in enumerate(heads):
                    r[:, :, h] = flats[b][head_offset + j, layer_offset + l]
            elif method == "to_operational":
                src = r if inner == "NHD" else r.transpose(0, 2, 1, 3)
                flats[b][l] = src.reshape(no, nt * nh * hd)
            elif inner == "NHD":
                r[...] = flats[b][l].reshape(no, nt, nh, hd)
            else:
                r[...] = flats[b][l].reshape(no, nh, nt, hd).transpose(0, 2, 1, 3)


def byte_sets(arrays):
    """The set of byte addresses each array covers."""
    sets = []
    for a in arrays:
        offsets = np.zeros(1, dtype=np.int64)
        for extent, stride in zip(a.shape, a.strides):
            offsets = (offsets[:, None] + np.arange(extent, dtype=np.int64)[None, :] * stride).reshape(-1)
        offsets = (offsets[:, None] + np.arange(a.itemsize, dtype=np.int64)[None, :]).reshape(-1)
        sets.append(set((offsets + a.__array_interface__["data"][0]).tolist()))
    return sets


def share_bytes(layer_arrays, chosen):
    """Whether two of the chosen layers share a byte."""
    sets = byte_sets([layer_arrays[l] for l in chosen])
    return any(sets[i] & sets[j] for i in range(len(sets)) for j in range(i + 1, len(sets)))


def offset_ok(value, bottom):
    """Whether layer_offset `value` is taken with `bottom` the lowest layer moved."""
    index = _index(value)
    return index is not None and -bottom <= index <= INT32_MAX


def outer_rows(layers, dims, pairs):
    """Views [NB, nt, nh, hd] of each layer's K and V ([layer][outer]): of (K, V) pairs
    described by `dims`, or of rows() of the other layouts."""
    if pairs:
        return [[_canonical(x, dims, "bthd") for x in pair] for pair in layers]
    return [[r[:, o] for o in range(r.shape[1])] for r in rows(layers, dims)]


def apply_to_cache(src_rows, dst_rows, src_ids, dst_ids, layers, heads, landing, head_offset):
    """to_cache on NumPy views: dst row (dst_ids[b], landing[k], o, t, head_offset + j) =
    src row (src_ids[b], layers[k], o, t, heads[j])."""
    values = [[[src_rows[l][o][s][:, heads].copy() for o in range(len(src_rows[l]))] for l in layers]
              for s in src_ids]
    for b, d in enumerate(dst_ids):
        for k, l in enumerate(landing):
            for o, value in enumerate(values[b][k]):
                dst_rows[l][o][d][:, head_offset: head_offset + len(heads)] = value


def pieces_share_bytes(written, read):
    """Whether a written array's own elements overlap, two written arrays share a byte, or a
    written and a read one do."""
    w, r = byte_sets(written), byte_sets(read)
    if any(len(bytes_) < a.size * a.itemsize for bytes_, a in zip(w, written)):
        return True
    return any(w[i] & w[j] for i in range(len(w)) for j in range(i + 1, len(w))) or any(a & b for a in w for b in r)
