/* kvbm_ext.PagedKVCache: memory its layers share with each other, with
 * another cache or with a call's flat blocks.  See paged_internal.h.
 *
 * A cache is a set of regions alike but for their address: one per layer
 * (per K and per V of a (K, V) pair), each the lattice of its blocks,
 * tokens, heads and head dim (and K/V where they share an array).  Whether
 * two regions share a byte is decided exactly (overlap.h), not from their
 * hulls, so that views of one buffer along an inner dimension (block
 * halves, even and odd blocks, one head of every layer) are moved as any
 * others.  The exact check runs where hulls meet: a cache's own layers once
 * at construction, two caches or a cache and a flat block only when a call
 * finds their hulls overlapping. */
#include "paged_internal.h"

#include <stdio.h>
#include <string.h>

#include "lock.h"

/* Steps one exact check may take (overlap.h): layouts whose strides nest
 * take a few per pair of regions, so only pathological strides reach it. */
#define ALIAS_BUDGET (1 << 20)

/* The lattice of one region: the selected heads of every block, K/V where
 * an array holds both. */
static kv_lattice region_lattice(const kv_paged_cache *c, const kv_selection *heads)
{
    const kv_lattice g = {
        5,
        {c->kv_pairs ? 1 : c->no, c->num_blocks, c->nt, heads->count, c->hd},
        {c->stride[DIM_K], c->stride[DIM_B], c->stride[DIM_T], c->stride[DIM_H] * heads->step, c->stride[DIM_D]},
        c->itemsize};
    return g;
}

/* The regions of the selected layers and heads, labelled by layer, or by
 * 2 * layer + K/V for (K, V) pairs; out->placed is the caller's to free. */
static int cache_regions(const kv_paged_cache *c, const kv_selection *layers, const kv_selection *heads,
                         kv_regions *out)
{
    const int64_t per_layer = c->kv_pairs ? 2 : 1;
    out->lattice = region_lattice(c, heads);
    out->count = layers->count * per_layer;
    out->placed = PyMem_Malloc((size_t)(out->count > 0 ? out->count : 1) * sizeof *out->placed);
    if (out->placed == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const uint64_t head_offset = (uint64_t)(heads->first * c->stride[DIM_H]);
    for (int64_t k = 0; k < layers->count; k++) {
        const int64_t l = layers->first + k * layers->step;
        for (int64_t o = 0; o < per_layer; o++) {
            kv_placed *p = &out->placed[k * per_layer + o];
            p->label = l * per_layer + o;
            p->address = c->layer_addresses[l * per_layer + o] + head_offset;
        }
    }
    return 0;
}

/* A region named in an error: "layers[3]", "layers[3][1]" ((K, V) pairs)
 * or "layers (layer 3)" (one array holding every layer), with `name` for
 * "layers". */
static void format_region(const kv_paged_cache *c, int64_t label, const char *name, char *buf, size_t size)
{
    kv_path path = kv_paged_layer_path(c, c->narrays == 1 ? 0 : (Py_ssize_t)label);
    path.name = name;
    char where[64];
    kv_path_format(&path, where, sizeof where);
    if (path.depth == 0)
        snprintf(buf, size, "%s (layer %lld)", where, (long long)label);
    else
        snprintf(buf, size, "%s", where);
}

/* Two regions of one cache in its own messages: "layers 2 and 5", or
 * "layer 2's V and layer 5's K" for (K, V) pairs. */
static void format_layers(const kv_paged_cache *c, int64_t first, int64_t second, char *buf, size_t size)
{
    const int64_t a = first < second ? first : second, b = first < second ? second : first;
    if (c->kv_pairs)
        snprintf(buf, size, "layer %lld's %s and layer %lld's %s", (long long)(a / 2), a % 2 ? "V" : "K",
                 (long long)(b / 2), b % 2 ? "V" : "K");
    else
        snprintf(buf, size, "layers %lld and %lld", (long long)a, (long long)b);
}

#define UNDECIDED                                                                                                      \
    ": their strides do not nest, and deciding whether they share a byte took more than %d steps, so the call is "     \
    "refused as if they did"

/* 1 when the selected layers share a byte, within one region (its own
 * elements overlap: *first == *second) or between two; 0; -1 undecided;
 * -2 with MemoryError. */
static int shared_layers(const kv_paged_cache *self, const kv_selection *layers, int64_t *first, int64_t *second)
{
    const kv_selection every_head = {0, 1, self->nh};
    kv_regions regions;
    if (cache_regions(self, layers, &every_head, &regions) < 0)
        return -2;
    int64_t budget = ALIAS_BUDGET;
    int meet = layers->count > 0 ? kv_lattice_overlaps_itself(&regions.lattice, &budget) : 0;
    if (meet != 0)
        *first = *second = regions.placed[0].label;
    else
        meet = kv_regions_meet(&regions, &regions, first, second, &budget);
    PyMem_Free(regions.placed);
    return meet;
}

int kv_paged_find_aliasing(kv_paged_cache *self)
{
    const kv_selection every = {0, 1, self->nl};
    int64_t first, second;
    const int meet = shared_layers(self, &every, &first, &second);
    /* Reading layers that share memory is harmless (one layer given for
     * every layer); a call writing them checks its selection. */
    self->aliased = meet != 0;
    return meet == -2 ? -1 : 0;
}

/* The layers a call writes, as the aliasing check's fixed memory
 * (overlap.h, kv_alias_check). */
typedef struct {
    const kv_paged_cache *cache;
    const kv_selection *layers;
    const char *name;
} kv_written_layers;

static int written_layers_shared(const void *written)
{
    const kv_written_layers *w = written;
    const kv_paged_cache *self = w->cache;
    const kv_selection *layers = w->layers;
    const char *name = w->name;
    int64_t first = 0, second = 0;
    const int meet = self->aliased ? shared_layers(self, layers, &first, &second) : 0;
    if (meet == 0 || meet == -2)
        return meet == 0 ? 0 : -1;
    char which[96];
    format_layers(self, first, second, which, sizeof which);
    if (meet < 0)
        return kv_error(PyExc_ValueError, "%s: cache %s may share memory" UNDECIDED, name, which, ALIAS_BUDGET);
    if (first == second)
        return kv_error(PyExc_ValueError,
                        "%s: the elements of a cache layer overlap one another (its strides reach a byte twice), "
                        "so a call cannot write it",
                        name);
    return kv_error(PyExc_ValueError,
                    "%s: cache %s share memory, so a call cannot write both (give each layer memory of its "
                    "own, or select at most one of them with layers=)",
                    name, which);
}

int kv_paged_check_written(const kv_paged_cache *self, const kv_selection *layers, const char *name)
{
    const kv_written_layers written = {self, layers, name};
    const kv_alias_check check = {.call = &written, .fixed = written_layers_shared};
    return kv_check_aliasing(&check);
}

/* Whether any of `c`'s arrays' hulls meets span s: the cache's whole hull
 * first, then a binary search in its sorted spans. */
static int hulls_meet(const kv_paged_cache *c, const kv_span *s)
{
    if (s->start == s->end || s->end <= c->spans[0].start || s->start >= c->reach[c->narrays - 1])
        return 0;
    return kv_span_overlaps(c->spans, c->reach, c->narrays, s) >= 0;
}

/* "destination: destination shares memory with other", or may share. */
static int shared_error(const char *destination, const char *other, int meet)
{
    if (meet < 0)
        return kv_error(PyExc_ValueError, "%s: destination may share memory with %s" UNDECIDED, destination, other,
                        ALIAS_BUDGET);
    return kv_error(PyExc_ValueError,
                    "%s: destination shares memory with %s; a destination may not overlap a source or another "
                    "destination",
                    destination, other);
}

/* Whether this call's caches and selections are the ones src last found
 * sharing no byte. */
static int known_disjoint(kv_paged_cache *src, const kv_paged_cache *dst, const kv_selection *selections)
{
    kv_lock_acquire(&src->shared_lock);
    const int known =
        src->shared_none_dst == (PyObject *)dst && memcmp(src->shared_none, selections, sizeof src->shared_none) == 0;
    kv_lock_release(&src->shared_lock);
    return known;
}

static void remember_disjoint(kv_paged_cache *src, const kv_paged_cache *dst, const kv_selection *selections)
{
    PyObject *kept = Py_NewRef((PyObject *)dst);
    kv_lock_acquire(&src->shared_lock);
    PyObject *old = src->shared_none_dst;
    src->shared_none_dst = kept;
    memcpy(src->shared_none, selections, sizeof src->shared_none);
    kv_lock_release(&src->shared_lock);
    Py_XDECREF(old); /* may run Python code: outside the lock */
}

int kv_paged_check_caches(kv_paged_cache *src, const kv_selection *src_layers, const kv_selection *src_heads,
                          const kv_paged_cache *dst, const kv_selection *dst_layers, const kv_selection *dst_heads)
{
    /* dst's whole hull, then its spans (sorted at construction) one by one. */
    const kv_span whole = {dst->spans[0].start, dst->reach[dst->narrays - 1], 0, 1};
    if (!hulls_meet(src, &whole))
        return 0;
    int meet = dst->narrays == 1;
    for (Py_ssize_t i = 0; !meet && i < dst->narrays; i++)
        meet = hulls_meet(src, &dst->spans[i]);
    const kv_selection selections[4] = {*src_layers, *src_heads, *dst_layers, *dst_heads};
    if (!meet || known_disjoint(src, dst, selections))
        return 0;
    kv_regions read, written;
    if (cache_regions(src, src_layers, src_heads, &read) < 0)
        return -1;
    if (cache_regions(dst, dst_layers, dst_heads, &written) < 0) {
        PyMem_Free(read.placed);
        return -1;
    }
    int64_t budget = ALIAS_BUDGET, w = 0, r = 0;
    meet = kv_regions_meet(&written, &read, &w, &r, &budget);
    PyMem_Free(read.placed);
    PyMem_Free(written.placed);
    if (meet == 0) {
        /* The caches' memory is fixed at construction (a move is refused
         * before this check), so the answer holds for the next call alike. */
        remember_disjoint(src, dst, selections);
        return 0;
    }
    char destination[96], source[96];
    format_region(dst, w, "dst.layers", destination, sizeof destination);
    format_region(src, r, "layers", source, sizeof source);
    return shared_error(destination, source, meet);
}

int kv_paged_check_flat(const kv_paged_cache *cache, const kv_selection *layers, const kv_selection *heads,
                        const kv_array *flat, const kv_path *path, int to_flat)
{
    const kv_span s = kv_span_of(flat, 0, 0);
    if (!hulls_meet(cache, &s))
        return 0;
    kv_placed at = {(uint64_t)(uintptr_t)flat->data, 0};
    kv_regions regions, one = {{flat->ndim, {0}, {0}, flat->itemsize}, &at, 1};
    memcpy(one.lattice.extent, flat->shape, (size_t)flat->ndim * sizeof(int64_t));
    memcpy(one.lattice.stride, flat->strides, (size_t)flat->ndim * sizeof(int64_t));
    if (cache_regions(cache, layers, heads, &regions) < 0)
        return -1;
    int64_t budget = ALIAS_BUDGET, unused, label = 0;
    const int meet = kv_regions_meet(&one, &regions, &unused, &label, &budget);
    PyMem_Free(regions.placed);
    if (meet == 0)
        return 0;
    char layer[96], where[96];
    format_region(cache, label, "layers", layer, sizeof layer);
    kv_path_format(path, where, sizeof where);
    return to_flat ? shared_error(where, layer, meet) : shared_error(layer, where, meet);
}
