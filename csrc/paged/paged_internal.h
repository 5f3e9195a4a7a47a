/* What the files of kvbm_ext.PagedKVCache share: paged_cache.c
 * (construction and lifetime), paged_dtype_device.c (the dtype and device
 * it reports), paged_call.c (reading and checking a call), paged_run.c
 * (planning and running it) and paged_type.c (the methods, attributes and
 * the type). */
#ifndef KVBM_PAGED_INTERNAL_H
#define KVBM_PAGED_INTERNAL_H

#include "paged.h"

#include "address_list.h"
#include "args.h"
#include "move_paged.h"
#include "options.h"
#include "overlap.h"
#include "paged_layout.h"
#include "signatures.h"
#include "state.h"
#include "target.h"

/* Which of the cache's layers or heads a call moves: count of them, from
 * first, step apart (negative steps run backwards). */
typedef struct {
    int64_t first, step, count;
} kv_selection;

typedef struct {
    PyObject_HEAD PyObject *layers; /* the arrays as given (a tuple of (K, V) tuples for kv_pairs) */
    PyObject *dims;                 /* the layout string, normalized */
    /* dtype and device as the framework of the first array names them,
     * made once at construction (kv_paged_name_types). */
    PyObject *dtype_object, *device_object;
    kv_array *arrays; /* borrowed for the cache's life */
    Py_ssize_t narrays;
    int kv_pairs; /* K and V are separate arrays: array 2l is layer l's K, 2l + 1 its V */
    /* Whose version counters from_* bumps (kv_torch_counter_owner): per
     * array (None for none), and the distinct ones (NULL when none). */
    PyObject *counters, *distinct_counters;
    int64_t nl, no, nh, nt, hd, num_blocks, itemsize;
    kv_dtype dtype;
    int device; /* the CUDA device, or -1 for host memory */
    int readonly;
    int64_t stride[DIM_COUNT]; /* bytes; 0 for a letter dims lacks */
    uint64_t *layer_addresses; /* base address of every layer, or of every array for kv_pairs (each
                                   call's table takes those it moves) */
    kv_span *spans;            /* the bytes of every array, sorted, for the aliasing check */
    uint64_t *reach;
    uint64_t alignment; /* OR of the layer addresses and strides */
    int aliased;        /* two layers share memory: a call writing the cache checks the layers it selects */
    /* Per array, the C exchange API it was read through (asked again at
     * each call, to catch memory that moved), or NULL. */
    const struct DLPackExchangeAPI **exchange;
    /* What keeps those checks valid: the APIs' capsules, and weak
     * references to the other layers (kv_paged_new). */
    PyObject *guards;
    /* The last dst to_cache found sharing no byte with this cache by the
     * exact check (their hulls meeting), and the selections it was for:
     * the same call again skips it (paged_alias.c).  Under `shared_lock`. */
    PyObject *shared_none_dst;
    kv_selection shared_none[4];
    kv_lock shared_lock;
} kv_paged_cache;

/* Where array i of the cache is named in errors. */
static inline kv_path kv_paged_layer_path(const kv_paged_cache *self, Py_ssize_t i)
{
    if (self->kv_pairs) {
        const kv_path pair = {"layers", {i / 2, i % 2}, 2};
        return pair;
    }
    const kv_path path = {"layers", {i, 0}, PyList_Check(self->layers) || PyTuple_Check(self->layers) ? 1 : 0};
    return path;
}

/* Array i of the cache as the caller gave it (borrowed): item i of the
 * tuple of layers, or the one array. */
static inline PyObject *kv_paged_layer(const kv_paged_cache *self, Py_ssize_t i)
{
    if (self->kv_pairs)
        return PyTuple_GET_ITEM(PyTuple_GET_ITEM(self->layers, i / 2), i % 2);
    return PyTuple_Check(self->layers) ? PyTuple_GET_ITEM(self->layers, i) : self->layers;
}

/* The base address of (layer l, outer o) of every moved layer, first,
 * first + step, ... (count of them), at out[i * no + o]: the table of a
 * call whose outers are addressed apart (kvbm_paged's split_outer). */
void kv_paged_outer_bases(const kv_paged_cache *self, int64_t first, int64_t step, int64_t count, uint64_t *out);

/* The index in self->arrays of the array holding (layer l, outer o). */
Py_ssize_t kv_paged_array_of(const kv_paged_cache *self, int64_t l, int64_t o);

/* paged_cache.c: the type's tp_new, tp_traverse, tp_clear, tp_dealloc. */
PyObject *kv_paged_new(PyTypeObject *type, PyObject *args, PyObject *kwargs);
int kv_paged_traverse(kv_paged_cache *self, visitproc visit, void *arg);
int kv_paged_clear(kv_paged_cache *self);
void kv_paged_dealloc(kv_paged_cache *self);

/* paged_dtype_device.c: self->dtype_object and self->device_object from
 * the cache's element type and device (set before): for a torch tensor
 * (the first array), torch's dtype and a torch.device; for a NumPy array,
 * numpy.dtype where NumPy has the type, and the device's name; else the
 * names.  Made from what the array's protocol reported, never from the
 * array's own dtype or device attributes, and with a framework the caller
 * has imported (none is imported here).  Returns 0, or -1 with an
 * exception. */
int kv_paged_name_types(kv_paged_cache *self, kv_protocols *protocols);

/* The element type's name, e.g. "bfloat16", and the device's, "cuda:N"
 * or "cpu" (new references). */
PyObject *kv_paged_dtype_name(const kv_paged_cache *self);
PyObject *kv_paged_device_name(const kv_paged_cache *self);

/* What distinguishes the four methods. */
typedef struct {
    const kv_signature *signature; /* its parameters (signatures.c) */
    const char *name;              /* for the debug log */
    int to_flat;                   /* the cache is read and the flat blocks written */
    int universal;                 /* universal blocks; else operational */
} kv_paged_form;

/* paged_call.c: one call of a method (`form`). */
PyObject *kv_paged_transfer(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                            const kv_paged_form *form);

/* to_cache.c: the to_cache method (METH_FASTCALL | METH_KEYWORDS). */
PyObject *kv_paged_to_cache(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* paged_select.c: a layers= or heads= argument (NULL: not given) among
 * the cache's n layers or heads, `what` naming one ("layer", "head"):
 * None for all, an index (Python's rules for a negative one), a slice
 * (Python's rules, but a bound outside the n entries is an error rather
 * than clipped) or a range of indices; never empty.  0, or -1 with
 * ValueError or TypeError naming `name`. */
int kv_read_selection(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel);

/* The highest and the lowest index a selection takes. */
int64_t kv_selection_top(const kv_selection *sel);
int64_t kv_selection_bottom(const kv_selection *sel);

/* paged_layers.c: at construction, what the check below needs (0, or -1
 * with an exception); for a call moving `layers`, a ValueError naming a
 * layer whose memory moved since construction (the cache's arrays called
 * `name`).  Returns 0 or -1. */
int kv_paged_guard_layers(kv_paged_cache *self, kv_protocols *protocols);
int kv_paged_check_layers(const kv_paged_cache *self, const char *name, const kv_reader *reader,
                          const kv_selection *layers);

/* paged_alias.c: memory shared by bytes, not by hulls.  At construction,
 * whether the cache's layers share any (self->aliased; 0, or -1 with
 * MemoryError); for a call writing `layers`, a ValueError naming two that
 * share a byte (the cache's arrays called `name`; through the one aliasing
 * check, overlap.h's kv_check_aliasing, as the call's fixed memory); for to_cache, a ValueError naming a written layer of dst
 * sharing a byte with a read layer of src (each side's selected layers
 * and heads); for a flat array of a call, a ValueError naming it and a
 * layer it shares a byte with (`to_flat`: the flat array is written).
 * Return 0 or -1. */
int kv_paged_find_aliasing(kv_paged_cache *self);
int kv_paged_check_written(const kv_paged_cache *self, const kv_selection *layers, const char *name);
int kv_paged_check_caches(kv_paged_cache *src, const kv_selection *src_layers, const kv_selection *src_heads,
                          const kv_paged_cache *dst, const kv_selection *dst_layers, const kv_selection *dst_heads);
int kv_paged_check_flat(const kv_paged_cache *cache, const kv_selection *layers, const kv_selection *heads,
                        const kv_array *flat, const kv_path *path, int to_flat);

/* A call's keyword options, checked. */
typedef struct {
    kv_selection layers; /* the cache layers moved */
    kv_selection heads;  /* the cache heads moved */
    int64_t layer_offset, head_offset;
    int pack_layers;      /* moved layer k lands on layer_offset + k, not on its cache index + layer_offset */
    kvbm_layout layout;   /* the operationals' chunk order */
    kv_move_options move; /* backend, num_ctas, stream */
} kv_paged_options;

/* The layers of the universal or operational blocks (or of to_cache's dst)
 * the moved layers land on: moved layer k, cache layer layers.first + k *
 * layers.step, on layer landing.first + k * landing.step. */
static inline kv_selection kv_paged_landing(const kv_paged_options *o)
{
    const kv_selection packed = {o->layer_offset, 1, o->layers.count};
    const kv_selection kept = {o->layers.first + o->layer_offset, o->layers.step, o->layers.count};
    return o->pack_layers ? packed : kept;
}

/* Everything one call reads, released by paged_call.c. */
typedef struct {
    kv_paged_cache *cache;
    kv_state *state;
    const kv_paged_form *form;
    kv_paged_options options;
    kv_reader reader; /* its dlpack_stream owned */
    kv_target target; /* a device cache's: its flat blocks and block ids placed */
    kv_address_list ids;
    int ids_read;
    const char *flat_name;
    int single;      /* the flat side is one array with a leading nb dimension */
    kv_array *flats; /* one, or nb */
    Py_ssize_t nflats, parsed;
    int64_t flat_shape[5]; /* of every flat block */
    int flat_ndim;
} kv_paged_call;

/* Reads and checks the options every call shares against `self` (the
 * cache whose layers and heads they select): those of `a` a method takes
 * (NULL where not given or not taken).  `function` names the method in
 * the layout/inner messages. */
int kv_paged_read_options(const kv_paged_cache *self, const char *function, const kv_paged_args *a,
                          kv_paged_options *o);

/* Host ids of a cache of num_blocks blocks must be in range and, when the
 * cache is `written`, each once: 0, or -1 with a ValueError naming the
 * first entry in error as name[i]. */
int kv_paged_check_ids(const int64_t *ids, Py_ssize_t n, int64_t num_blocks, int written, const char *name);

/* The cache's selected `layers` are about to be written: each torch layer
 * is checked as a destination and the version counters are bumped. */
int kv_paged_mark_written(const kv_paged_cache *cache, kv_protocols *protocols, const kv_selection *layers);

/* paged_run.c: moves the bytes of a checked call.  Returns 0 or -1. */
int kv_paged_run(kv_paged_call *call);

#endif /* KVBM_PAGED_INTERNAL_H */
