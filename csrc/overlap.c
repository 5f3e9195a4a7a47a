/* Aliasing between a call's arguments.  See overlap.h. */
#include "overlap.h"

#include <stdlib.h>
#include <string.h>

kv_span kv_span_of(const kv_array *a, Py_ssize_t index, int destination)
{
    kv_span s = {0, 0, index, destination};
    if (kv_array_elements(a) == 0)
        return s;
    /* Extents and strides were checked to fit in int64 (kv_array_read). */
    int64_t low = 0, high = a->itemsize;
    for (int i = 0; i < a->ndim; i++) {
        const int64_t reach = a->strides[i] * (a->shape[i] - 1);
        if (reach < 0)
            low += reach;
        else
            high += reach;
    }
    s.start = (uint64_t)(uintptr_t)a->data + (uint64_t)low;
    s.end = (uint64_t)(uintptr_t)a->data + (uint64_t)high;
    return s;
}

/* Sorts by start: an insertion sort for a few spans (the arrays of a call
 * usually come in address order), else a radix sort, 11 bits a pass, so
 * that a call of 20,000 chunks costs tens of microseconds rather than a
 * comparison sort's milliseconds. */
static int sort_by_start(kv_span *spans, Py_ssize_t count)
{
    enum {
        BITS = 11,
        BUCKETS = 1 << BITS,
        FEW = 256
    };
    if (count <= FEW) {
        for (Py_ssize_t i = 1; i < count; i++) {
            const kv_span s = spans[i];
            Py_ssize_t j = i;
            for (; j > 0 && spans[j - 1].start > s.start; j--)
                spans[j] = spans[j - 1];
            spans[j] = s;
        }
        return 0;
    }
    kv_span *other = PyMem_Malloc((size_t)count * sizeof *other);
    if (other == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    kv_span *from = spans, *to = other;
    for (int shift = 0; shift < 64; shift += BITS) {
        Py_ssize_t counts[BUCKETS + 1];
        memset(counts, 0, sizeof counts);
        for (Py_ssize_t i = 0; i < count; i++)
            counts[((from[i].start >> shift) & (BUCKETS - 1)) + 1]++;
        /* Addresses share their high bits: a digit every span has in
         * common orders nothing. */
        if (counts[((from[0].start >> shift) & (BUCKETS - 1)) + 1] == count)
            continue;
        for (int b = 0; b < BUCKETS; b++)
            counts[b + 1] += counts[b];
        for (Py_ssize_t i = 0; i < count; i++)
            to[counts[(from[i].start >> shift) & (BUCKETS - 1)]++] = from[i];
        kv_span *swap = from;
        from = to;
        to = swap;
    }
    if (from != spans)
        memcpy(spans, from, (size_t)count * sizeof *spans);
    PyMem_Free(other);
    return 0;
}

int kv_find_overlap(kv_span *spans, Py_ssize_t count, Py_ssize_t *first, Py_ssize_t *second)
{
    /* Destinations first (a call usually has few of one kind: 64 universals
     * against 10,240 chunks), sorted; each source is then a binary search. */
    Py_ssize_t ndest = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (spans[i].destination) {
            const kv_span s = spans[ndest];
            spans[ndest++] = spans[i];
            spans[i] = s;
        }
    }
    uint64_t *reach = PyMem_Malloc((size_t)(ndest > 0 ? ndest : 1) * sizeof *reach);
    if (reach == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = kv_sort_spans(spans, ndest, reach);
    /* Two destinations overlap when one reaches past the next one's start. */
    for (Py_ssize_t i = 1; rc == 0 && i < ndest; i++) {
        if (spans[i].end != spans[i].start) {
            const Py_ssize_t hit = kv_span_overlaps(spans, reach, i, &spans[i]);
            if (hit >= 0) {
                *first = spans[i].index;
                *second = hit;
                rc = 1;
            }
        }
    }
    for (Py_ssize_t i = ndest; rc == 0 && i < count; i++) {
        const Py_ssize_t hit = kv_span_overlaps(spans, reach, ndest, &spans[i]);
        if (hit >= 0) {
            *first = hit;
            *second = spans[i].index;
            rc = 1;
        }
    }
    PyMem_Free(reach);
    return rc;
}

int kv_sort_spans(kv_span *spans, Py_ssize_t count, uint64_t *reach)
{
    if (sort_by_start(spans, count) < 0)
        return -1;
    uint64_t furthest = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        furthest = spans[i].end > furthest ? spans[i].end : furthest;
        reach[i] = furthest;
    }
    return 0;
}

Py_ssize_t kv_span_overlaps(const kv_span *spans, const uint64_t *reach, Py_ssize_t count, const kv_span *s)
{
    if (s->end == s->start)
        return -1;
    /* The last span starting before s ends; one up to it reaching past s's
     * start overlaps s. */
    Py_ssize_t lo = 0, hi = count;
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (spans[mid].start < s->end)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (Py_ssize_t k = lo - 1; k >= 0 && reach[k] > s->start; k--)
        if (spans[k].end > s->start && spans[k].end != spans[k].start)
            return spans[k].index;
    return -1;
}

/* ------------------------------------------------------------ lattices */

/* The dimensions that move (extent above 1), strides made positive (the
 * difference of two offsets is symmetric) and sorted largest first. */
static kv_lattice sorted_lattice(const kv_lattice *g)
{
    kv_lattice s = {0, {0}, {0}, g->itemsize};
    for (int i = 0; i < g->ndim; i++) {
        if (g->extent[i] <= 1)
            continue;
        const int64_t stride = g->stride[i] < 0 ? -g->stride[i] : g->stride[i];
        int k = s.ndim++;
        for (; k > 0 && s.stride[k - 1] < stride; k--) {
            s.stride[k] = s.stride[k - 1];
            s.extent[k] = s.extent[k - 1];
        }
        s.stride[k] = stride;
        s.extent[k] = g->extent[i];
    }
    return s;
}

/* Whether delta = sum of stride[j] * m[j] + r over dimensions k.., for some
 * |m[j]| < extent[j] and |r| < itemsize.  Only the multiples of stride[k]
 * that leave the rest within `reach` of the smaller dimensions are tried:
 * at most two where each stride exceeds the reach of the smaller ones (any
 * layout of distinct elements, sorted).  Past `*budget` steps, which only
 * layouts that do not nest reach, the answer is yes: undecided is taken as
 * shared. */
static int meets_from(const kv_lattice *g, const __int128 *reach, int k, __int128 delta, int *budget)
{
    if (k == g->ndim)
        return delta > -g->itemsize && delta < g->itemsize;
    if (--*budget < 0)
        return 1;
    const __int128 s = g->stride[k], r = reach[k + 1];
    if (s == 0)
        return meets_from(g, reach, k + 1, delta, budget);
    __int128 lo = delta - r, hi = delta + r;
    lo = lo >= 0 ? (lo + s - 1) / s : -((-lo) / s); /* ceil(lo / s) */
    hi = hi >= 0 ? hi / s : -((-hi + s - 1) / s);   /* floor(hi / s) */
    const __int128 most = g->extent[k] - 1;
    for (__int128 m = lo < -most ? -most : lo; m <= (hi > most ? most : hi); m++)
        if (meets_from(g, reach, k + 1, delta - m * s, budget))
            return 1;
    return 0;
}

static int by_address(const void *a, const void *b)
{
    const uint64_t x = ((const kv_placed *)a)->address, y = ((const kv_placed *)b)->address;
    return (x > y) - (x < y);
}

/* Sorted by address, each array is compared with those that start within
 * its hull. */
int kv_find_meeting(const kv_lattice *given, kv_placed *placed, int64_t count, int64_t *first, int64_t *second)
{
    const kv_lattice g = sorted_lattice(given);
    __int128 reach[KV_MAX_NDIM + 1];
    reach[g.ndim] = g.itemsize - 1;
    for (int k = g.ndim - 1; k >= 0; k--)
        reach[k] = reach[k + 1] + (__int128)g.stride[k] * (g.extent[k] - 1);
    qsort(placed, (size_t)count, sizeof *placed, by_address);
    for (int64_t i = 0; i < count; i++) {
        for (int64_t j = i + 1; j < count && (__int128)(placed[j].address - placed[i].address) <= reach[0]; j++) {
            int budget = 1 << 16;
            if (meets_from(&g, reach, 0, (__int128)(placed[j].address - placed[i].address), &budget)) {
                *first = placed[i].index < placed[j].index ? placed[i].index : placed[j].index;
                *second = placed[i].index < placed[j].index ? placed[j].index : placed[i].index;
                return 1;
            }
        }
    }
    return 0;
}

int kv_overlap_error(const kv_path *destination, const kv_path *other)
{
    char where[96];
    kv_path_format(other, where, sizeof where);
    return kv_path_error(PyExc_ValueError, destination,
                         "destination shares memory with %s; a destination may not "
                         "overlap a source or another destination",
                         where);
}
