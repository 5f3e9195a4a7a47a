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

/* The elements of a strided array, relative to its address: extents,
 * strides in bytes (any sign) and element size.  A contiguous run of n
 * bytes is one element of n bytes. */
typedef struct {
    int ndim;
    int64_t extent[KV_MAX_NDIM];
    int64_t stride[KV_MAX_NDIM];
    int64_t itemsize;
} kv_lattice;

/* The exact questions below are bounded integer equations (NumPy's
 * shares_memory solves the same): each takes steps from *budget and
 * answers -1, undecided, once it is spent. */

/* Whether an element of g at address a and one of h at address b share a
 * byte: 1, 0 or -1. */
int kv_lattices_meet(const kv_lattice *g, uint64_t a, const kv_lattice *h, uint64_t b, int64_t *budget);

/* Whether two distinct elements of g share a byte: 1, 0 or -1. */
int kv_lattice_overlaps_itself(const kv_lattice *g, int64_t *budget);

/* Arrays alike but for their address (a cache's layers): one lattice at
 * each placed address, named by its label in errors. */
typedef struct {
    uint64_t address;
    int64_t label;
} kv_placed;

typedef struct {
    kv_lattice lattice;
    kv_placed *placed; /* reordered by kv_regions_meet */
    int64_t count;
} kv_regions;

/* Whether a region of `a` and one of `b` share a byte (a == b: two
 * distinct regions of one set), comparing only regions whose hulls meet:
 * 1 with their labels in *first and *second, 0, or -1 undecided with the
 * labels of an undecided pair. */
int kv_regions_meet(const kv_regions *a, const kv_regions *b, int64_t *first, int64_t *second, int64_t *budget);

/* Raises ValueError "destination: destination shares memory with other".
 * Returns -1. */
int kv_overlap_error(const kv_path *destination, const kv_path *other);

/* What a call's aliasing check walks, as the caller knows it at that
 * point: memory fixed before the call (a PagedKVCache's layers), checked
 * by the caller's hooks, which know its shape, and the call's own arrays,
 * checked by their spans.  A hook left NULL has nothing to check. */
typedef struct {
    const void *call;
    /* The fixed memory the call writes, against itself: 0, or -1 with its
     * error. */
    int (*fixed)(const void *call);
    /* The call's arrays; writes(call, i) says whether array i is written
     * (NULL: none is), path(call, i) where it sits in the arguments. */
    const kv_array *arrays;
    Py_ssize_t count;
    int (*writes)(const void *call, Py_ssize_t i);
    kv_path (*path)(const void *call, Py_ssize_t i);
    /* Array i against the fixed memory: 0, or -1 with its error. */
    int (*against_fixed)(const void *call, Py_ssize_t i);
} kv_alias_check;

/* The aliasing check every entry point runs before any write: a
 * destination sharing memory with a source or with another destination is
 * refused, since the result would depend on the order of the copies.  In
 * order: the fixed memory against itself, each array against it, then the
 * arrays against each other (kv_overlap_error names the two).  Returns 0,
 * or -1 with ValueError (MemoryError). */
int kv_check_aliasing(const kv_alias_check *check);

#endif /* KVBM_OVERLAP_H */
