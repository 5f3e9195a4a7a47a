/* Aliasing between a call's arguments.  See overlap.h. */
#include "overlap.h"

#include <string.h>

kv_span kv_span_of(const kv_array *a, Py_ssize_t index, int destination)
{
    kv_span s = {0, 0, index, destination};
    if (kv_array_elements(a) == 0)
        return s;
    /* Extents and strides were checked to fit in int64 (kv_array_from_object). */
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

/* Sorts by start: a radix sort, 11 bits a pass, so that a call of 20,000
 * chunks costs tens of microseconds rather than a comparison sort's
 * milliseconds. */
static int sort_by_start(kv_span *spans, Py_ssize_t count)
{
    enum { BITS = 11, BUCKETS = 1 << BITS };
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
    if (sort_by_start(spans, count) < 0)
        return -1;
    /* Sweep in start order, remembering the span reaching furthest and the
     * destination reaching furthest: a destination overlaps something
     * earlier exactly when the first reaches past its start, a source
     * overlaps an earlier destination when the second does. */
    const kv_span *furthest = NULL, *furthest_destination = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        const kv_span *s = &spans[i];
        if (s->end == s->start)
            continue;
        const kv_span *hit = s->destination ? furthest : furthest_destination;
        if (hit != NULL && hit->end > s->start) {
            *first = s->destination ? s->index : hit->index;
            *second = s->destination ? hit->index : s->index;
            return 1;
        }
        if (furthest == NULL || s->end > furthest->end)
            furthest = s;
        if (s->destination && (furthest_destination == NULL || s->end > furthest_destination->end))
            furthest_destination = s;
    }
    return 0;
}
