/* Aliasing: whether a call's destinations share memory with its sources or
 * with each other.  A copy between overlapping ranges is undefined on the
 * CPU and a race on the GPU, so every entry point rejects it before any
 * write.  Plain interval arithmetic over the byte ranges a call touches, by
 * address (one address space: host, pinned and device memory alike). */
#ifndef KVBM_OVERLAP_H
#define KVBM_OVERLAP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "array.h"

/* The bytes [start, end) argument `index` touches (end == start: none). */
typedef struct {
    uint64_t start, end;
    Py_ssize_t index;
    int destination;
} kv_span;

/* The bytes an array touches, whatever its strides. */
kv_span kv_span_of(const kv_array *a, Py_ssize_t index, int destination);

/* Looks for two spans that overlap where one is a destination; reorders
 * `spans` on the way.  Returns 1 with their indexes in *first (always a
 * destination) and *second, 0 when there is none, or -1 with MemoryError. */
int kv_find_overlap(kv_span *spans, Py_ssize_t count, Py_ssize_t *first, Py_ssize_t *second);

/* For spans checked against many calls (a PagedKVCache's arrays): sorts
 * them by start and fills reach[i] with the furthest end among spans[0..i].
 * Returns 0, or -1 with MemoryError. */
int kv_sort_spans(kv_span *spans, Py_ssize_t count, uint64_t *reach);

/* The index of a span of sorted `spans` (with their `reach`) that overlaps
 * `s`, or -1: a binary search. */
Py_ssize_t kv_span_overlaps(const kv_span *spans, const uint64_t *reach, Py_ssize_t count, const kv_span *s);

/* The byte layout of one of several arrays that differ only by their
 * address (a cache's layers): its extents, strides in bytes (any sign) and
 * element size. */
typedef struct {
    int ndim;
    int64_t extent[KV_MAX_NDIM];
    int64_t stride[KV_MAX_NDIM];
    int64_t itemsize;
} kv_lattice;

/* One of those arrays: where it starts, and which it is. */
typedef struct {
    uint64_t address;
    int64_t index;
} kv_placed;

/* Two of `count` arrays laid out as `g` at placed[i].address that share a
 * byte: exact where their hulls overlap but their elements interleave
 * (views of one buffer), not a comparison of hulls.  Reorders `placed`.
 * Returns 1 with their indexes in *first < *second, or 0. */
int kv_find_meeting(const kv_lattice *g, kv_placed *placed, int64_t count, int64_t *first, int64_t *second);

/* Raises ValueError "destination: destination shares memory with other".
 * Returns -1. */
int kv_overlap_error(const kv_path *destination, const kv_path *other);

#endif /* KVBM_OVERLAP_H */
