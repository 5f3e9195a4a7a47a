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
 * usually come in address order), else a radix sort, 11 bits a pass, whose
 * cost grows linearly with the spans: a list call passes nb*nl*no chunks,
 * tens of thousands for a large model, and a comparison sort would make
 * n log n calls of its comparison function. */
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

/* Two elements share a byte when the difference of their offsets, a sum of
 * stride * index over both arrays' dimensions, falls in a window as wide
 * as their element sizes: a bounded integer equation, solved by a
 * depth-first search over the terms, largest coefficient first, that only
 * tries the multiples which leave the rest of the sum able to reach the
 * window.  Where the strides nest (every layout of distinct elements an
 * engine makes) each term has one or two such multiples: a few steps. */
enum {
    MAX_TERMS = 2 * KV_MAX_NDIM
};

typedef struct {
    int n;
    __int128 c[MAX_TERMS], lo[MAX_TERMS], hi[MAX_TERMS]; /* sum of c[k] * m, lo[k] <= m <= hi[k], c[k] > 0 */
    __int128 least[MAX_TERMS + 1], most[MAX_TERMS + 1];  /* what the terms from k on can add */
    int64_t *budget;
} equation;

/* Adds c * m, m in [lo, hi]; one coefficient's terms merge into one, so
 * that two arrays alike in a dimension cost one term, not a product. */
static void add_term(equation *e, __int128 c, __int128 lo, __int128 hi)
{
    if (c == 0 || (lo == 0 && hi == 0))
        return;
    if (c < 0) {
        const __int128 swap = lo;
        c = -c, lo = -hi, hi = -swap;
    }
    int k = 0;
    for (; k < e->n && e->c[k] > c; k++)
        ;
    if (k < e->n && e->c[k] == c) {
        e->lo[k] += lo, e->hi[k] += hi;
        return;
    }
    for (int j = e->n++; j > k; j--)
        e->c[j] = e->c[j - 1], e->lo[j] = e->lo[j - 1], e->hi[j] = e->hi[j - 1];
    e->c[k] = c, e->lo[k] = lo, e->hi[k] = hi;
}

static void sum_ranges(equation *e)
{
    e->least[e->n] = e->most[e->n] = 0;
    for (int k = e->n - 1; k >= 0; k--) {
        e->least[k] = e->least[k + 1] + e->c[k] * e->lo[k];
        e->most[k] = e->most[k + 1] + e->c[k] * e->hi[k];
    }
}

static __int128 floor_div(__int128 a, __int128 b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
static __int128 ceil_div(__int128 a, __int128 b) { return -floor_div(-a, b); }

/* Whether value + the terms from k on can land in [low, high], with some
 * multiple nonzero when `nonzero` (all those chosen so far were zero).
 * 1, 0, or -1 once the budget is spent. */
static int solve(equation *e, int k, __int128 value, __int128 low, __int128 high, int nonzero)
{
    if (k == e->n)
        return value >= low && value <= high && !nonzero;
    if (--*e->budget < 0)
        return -1;
    const __int128 c = e->c[k];
    __int128 first = ceil_div(low - value - e->most[k + 1], c), last = floor_div(high - value - e->least[k + 1], c);
    first = first > e->lo[k] ? first : e->lo[k];
    last = last < e->hi[k] ? last : e->hi[k];
    for (__int128 m = first; m <= last; m++) {
        const int found = solve(e, k + 1, value + m * c, low, high, nonzero && m == 0);
        if (found != 0)
            return found;
    }
    return 0;
}

/* The terms of g's element offsets, each index from 0 to extent - 1, with
 * `sign`. */
static void add_lattice(equation *e, const kv_lattice *g, int sign)
{
    for (int i = 0; i < g->ndim; i++)
        if (g->extent[i] > 1)
            add_term(e, (__int128)sign * g->stride[i], 0, g->extent[i] - 1);
}

int kv_lattices_meet(const kv_lattice *g, uint64_t a, const kv_lattice *h, uint64_t b, int64_t *budget)
{
    for (int i = 0; i < g->ndim; i++)
        if (g->extent[i] == 0)
            return 0;
    for (int i = 0; i < h->ndim; i++)
        if (h->extent[i] == 0)
            return 0;
    /* a + X and b + Y share a byte when -g.itemsize < (a + X) - (b + Y) < h.itemsize. */
    equation e = {.n = 0, .budget = budget};
    add_lattice(&e, g, 1);
    add_lattice(&e, h, -1);
    sum_ranges(&e);
    const __int128 delta = (__int128)b - (__int128)a;
    return solve(&e, 0, 0, delta - g->itemsize + 1, delta + h->itemsize - 1, 0);
}

int kv_lattice_overlaps_itself(const kv_lattice *g, int64_t *budget)
{
    equation e = {.n = 0, .budget = budget};
    for (int i = 0; i < g->ndim; i++) {
        if (g->extent[i] <= 1)
            continue;
        /* Two dimensions of one stride (or one of stride 0) reach one element twice. */
        for (int k = 0; k < e.n; k++)
            if (e.c[k] == (g->stride[i] < 0 ? -(__int128)g->stride[i] : g->stride[i]))
                return 1;
        if (g->stride[i] == 0)
            return 1;
        add_term(&e, g->stride[i], -(g->extent[i] - 1), g->extent[i] - 1);
    }
    sum_ranges(&e);
    return solve(&e, 0, 0, -g->itemsize + 1, g->itemsize - 1, 1);
}

/* ------------------------------------------------------------- regions */

/* The bytes [first, last] one element-lattice reaches from its address. */
static void lattice_hull(const kv_lattice *g, int64_t *first, int64_t *last)
{
    int64_t low = 0, high = g->itemsize - 1;
    for (int i = 0; i < g->ndim; i++) {
        const int64_t reach = g->extent[i] > 0 ? g->stride[i] * (g->extent[i] - 1) : 0;
        if (reach < 0)
            low += reach;
        else
            high += reach;
    }
    *first = low, *last = high;
}

static int by_address(const void *a, const void *b)
{
    const uint64_t x = ((const kv_placed *)a)->address, y = ((const kv_placed *)b)->address;
    return (x > y) - (x < y);
}

/* Whether pair (a, b) of labels comes before (x, y). */
static int labels_before(int64_t a, int64_t b, int64_t x, int64_t y) { return a < x || (a == x && b < y); }

/* Both sorted by address: b's regions reaching a's region i are a run, the
 * regions of one set being translates.  Every pair whose hulls meet is
 * asked, so that the pair named is the first by label whatever the
 * addresses. */
int kv_regions_meet(const kv_regions *a, const kv_regions *b, int64_t *first, int64_t *second, int64_t *budget)
{
    int64_t a_low, a_high, b_low, b_high;
    lattice_hull(&a->lattice, &a_low, &a_high);
    lattice_hull(&b->lattice, &b_low, &b_high);
    const int same = a == b;
    qsort(a->placed, (size_t)a->count, sizeof *a->placed, by_address);
    if (!same)
        qsort(b->placed, (size_t)b->count, sizeof *b->placed, by_address);
    int verdict = 0;
    int64_t start = 0;
    for (int64_t i = 0; i < a->count; i++) {
        const __int128 from = (__int128)a->placed[i].address + a_low, to = (__int128)a->placed[i].address + a_high;
        /* b's regions ending before region i starts end before the next one's too. */
        while (start < b->count && (__int128)b->placed[start].address + b_high < from)
            start++;
        for (int64_t j = same ? (i + 1 > start ? i + 1 : start) : start;
             j < b->count && (__int128)b->placed[j].address + b_low <= to; j++) {
            int64_t x = a->placed[i].label, y = b->placed[j].label;
            if (same && y < x)
                x = b->placed[j].label, y = a->placed[i].label;
            if (verdict > 0 && !labels_before(x, y, *first, *second))
                continue; /* cannot name an earlier pair */
            const int meet =
                kv_lattices_meet(&a->lattice, a->placed[i].address, &b->lattice, b->placed[j].address, budget);
            /* A shared byte outranks an undecided pair; among equals, the earlier labels. */
            if (meet != 0
                && (verdict == 0 || meet > verdict || (meet == verdict && labels_before(x, y, *first, *second)))) {
                *first = x, *second = y;
                verdict = meet;
            }
            if (*budget < 0)
                return verdict;
        }
    }
    return verdict;
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

int kv_check_aliasing(const kv_alias_check *c)
{
    if (c->fixed != NULL && c->fixed(c->call) < 0)
        return -1;
    for (Py_ssize_t i = 0; c->against_fixed != NULL && i < c->count; i++)
        if (c->against_fixed(c->call, i) < 0)
            return -1;
    /* Without a destination, or a second array, nothing can overlap. */
    int writes = 0;
    for (Py_ssize_t i = 0; c->writes != NULL && i < c->count && !writes; i++)
        writes = c->writes(c->call, i);
    if (!writes || c->count < 2)
        return 0;
    kv_span *spans = PyMem_Malloc((size_t)c->count * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < c->count; i++)
        spans[i] = kv_span_of(&c->arrays[i], i, c->writes(c->call, i));
    Py_ssize_t first, second;
    const int rc = kv_find_overlap(spans, c->count, &first, &second);
    PyMem_Free(spans);
    if (rc <= 0)
        return rc;
    const kv_path destination = c->path(c->call, first), other = c->path(c->call, second);
    return kv_overlap_error(&destination, &other);
}
