/* What the files of kvbm_ext.PagedKVCache share: paged_cache.c
 * (construction and lifetime), paged_call.c (reading and checking a call),
 * paged_run.c (planning and running it) and paged_type.c (the methods,
 * attributes and the type). */
#ifndef KVBM_PAGED_INTERNAL_H
#define KVBM_PAGED_INTERNAL_H

#include "paged.h"

#include "address_list.h"
#include "args.h"
#include "options.h"
#include "overlap.h"
#include "state.h"
#include "target.h"

/* The dimension letters of `dims`. */
enum { DIM_L, DIM_K, DIM_B, DIM_T, DIM_H, DIM_D, DIM_COUNT };

typedef struct {
    PyObject_HEAD
    PyObject *layers;  /* the arrays as given */
    PyObject *dims;    /* the dims string */
    kv_array *arrays;  /* borrowed for the cache's life */
    Py_ssize_t narrays;
    /* Whose version counters from_* bumps (kv_torch_counter_owner): per
     * array (None for none), and the distinct ones (NULL when none). */
    PyObject *counters, *distinct_counters;
    int64_t nl, no, nh, nt, hd, num_blocks, itemsize;
    kv_dtype dtype;
    int device;        /* the CUDA device, or -1 for host memory */
    int readonly;
    int64_t stride[DIM_COUNT];  /* bytes; 0 for a letter dims lacks */
    uint64_t *layer_addresses;  /* base address of every layer (each call's table takes those it moves) */
    kv_span *spans;             /* the bytes of every array, sorted, for the aliasing check */
    uint64_t *reach;
    uint64_t alignment;         /* OR of the layer addresses and strides */
} kv_paged_cache;

/* Where array i of the cache is named in errors. */
kv_path kv_paged_layer_path(const kv_paged_cache *self, Py_ssize_t i);

/* Array i of the cache as the caller gave it (borrowed): item i of the
 * tuple of layers, or the one array. */
PyObject *kv_paged_layer(const kv_paged_cache *self, Py_ssize_t i);

/* paged_cache.c: the type's tp_new, tp_traverse, tp_clear, tp_dealloc. */
PyObject *kv_paged_new(PyTypeObject *type, PyObject *args, PyObject *kwargs);
int kv_paged_traverse(kv_paged_cache *self, visitproc visit, void *arg);
int kv_paged_clear(kv_paged_cache *self);
void kv_paged_dealloc(kv_paged_cache *self);

/* What distinguishes the four methods. */
typedef struct {
    kv_signature signature; /* its parameters (kv_parse_arguments) */
    const char *name;   /* for the debug log */
    int to_flat;        /* the cache is read and the flat blocks written */
    int universal;      /* universal blocks; else operational */
} kv_paged_form;

/* paged_call.c: one call of a method (`form`). */
PyObject *kv_paged_transfer(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                            const kv_paged_form *form);

/* Which of the cache's layers or heads a call moves: count of them, from
 * first, step apart (negative steps run backwards). */
typedef struct {
    int64_t first, step, count;
} kv_selection;

/* A call's keyword options, checked. */
typedef struct {
    kv_selection layers;        /* the cache layers moved */
    kv_selection heads;         /* the cache heads moved */
    int64_t layer_offset, head_offset;
    kvbm_layout layout;         /* the operationals' chunk order */
    kv_move_options move;       /* backend, num_ctas, stream */
} kv_paged_options;

/* Everything one call reads, released by paged_call.c. */
typedef struct {
    kv_paged_cache *cache;
    kv_state *state;
    const kv_paged_form *form;
    kv_paged_options options;
    kv_reader reader;   /* its dlpack_stream owned */
    kv_target target;   /* a device cache's: its flat blocks and block ids placed */
    kv_address_list ids;
    int ids_read;
    const char *flat_name;
    int single;         /* the flat side is one array with a leading nb dimension */
    kv_array *flats;    /* one, or nb */
    Py_ssize_t nflats, parsed;
    int64_t flat_shape[5]; /* of every flat block */
    int flat_ndim;
} kv_paged_call;

/* paged_run.c: moves the bytes of a checked call.  Returns 0 or -1. */
int kv_paged_run(kv_paged_call *call);

#endif /* KVBM_PAGED_INTERNAL_H */
