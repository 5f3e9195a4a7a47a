/* kvbm_ext.PagedKVCache: construction and lifetime.  See paged.h.
 *
 * Everything that does not change between calls is worked out once, here:
 * the dimensions and strides named by `dims`, the base address of every
 * layer and the alignment they allow, the arrays' sorted byte spans (for
 * the aliasing check).  A call then reads its block ids and its one (or
 * nb) flat arrays, checks them, and launches one kernel whose parameters
 * carry everything else: its host cost does not depend on nl or the chunk
 * count.
 */
#include "paged_internal.h"

#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "state.h"

Py_ssize_t kv_paged_array_of(const kv_paged_cache *self, int64_t l, int64_t o)
{
    return self->kv_pairs ? (Py_ssize_t)(2 * l + o) : self->narrays == 1 ? 0 : (Py_ssize_t)l;
}

void kv_paged_outer_bases(const kv_paged_cache *self, int64_t first, int64_t step, int64_t count, uint64_t *out)
{
    for (int64_t i = 0; i < count; i++) {
        const int64_t l = first + i * step;
        for (int64_t o = 0; o < self->no; o++)
            out[i * self->no + o] = self->kv_pairs ? self->layer_addresses[2 * l + o]
                                                   : self->layer_addresses[l] + (uint64_t)(o * self->stride[DIM_K]);
    }
}

/* Checks arrays[i] against arrays[0]: dimensions, element type, strides, place. */
static int check_layer_array(kv_paged_cache *self, Py_ssize_t i, const kv_layout *layout)
{
    const int ndim = layout->ndim;
    kv_array *a = &self->arrays[i];
    const kv_array *first = &self->arrays[0];
    const kv_path path = kv_paged_layer_path(self, i);
    char got[96], want[96];
    kv_format_shape(a->shape, a->ndim, got, sizeof got); /* once per array, at construction */
    if (a->ndim != ndim)
        return kv_path_error(PyExc_ValueError, &path, "layout %R names %d dimensions, but the array has shape %s",
                             self->dims, ndim, got);
    if (a->place == KV_DEVICE && kv_gpu_locate(a, &path) < 0)
        return -1;
    if (i == 0)
        return 0;
    if (memcmp(a->shape, first->shape, (size_t)ndim * sizeof(int64_t)) != 0) {
        kv_format_shape(first->shape, first->ndim, want, sizeof want);
        return kv_path_error(PyExc_ValueError, &path, "shape %s differs from layers[0]'s %s", got, want);
    }
    if (a->dtype.code != first->dtype.code || a->dtype.bits != first->dtype.bits)
        return kv_path_error(PyExc_TypeError, &path, "element type %s differs from layers[0]'s %s",
                             kv_dtype_name(a->dtype, got, sizeof got), kv_dtype_name(first->dtype, want, sizeof want));
    for (int d = 0; d < ndim; d++) {
        if (a->shape[d] == 1 || a->strides[d] == first->strides[d])
            continue;
        kv_layout_dim_text(layout, d, want, sizeof want);
        return kv_path_error(PyExc_ValueError, &path,
                             "dimension '%s' has stride %lld bytes, but layers[0]'s has "
                             "%lld; the layers must share one memory layout",
                             want, (long long)a->strides[d], (long long)first->strides[d]);
    }
    if ((a->place == KV_DEVICE) != (first->place == KV_DEVICE)) {
        const int on_device = a->place == KV_DEVICE;
        return kv_path_error(
            PyExc_ValueError, &path, "%s, but layers[0] is %s; a cache lives on one device or in host memory",
            on_device ? "on a CUDA device" : "in host memory", on_device ? "in host memory" : "on a CUDA device");
    }
    /* Host memory is one place whatever its producer numbers it (DLPack's CPU 0, the others -1). */
    if (a->place == KV_DEVICE && a->device_id != first->device_id)
        return kv_path_error(PyExc_ValueError, &path,
                             "on cuda:%d, but layers[0] is on cuda:%d; a cache lives on one device", a->device_id,
                             first->device_id);
    return 0;
}

/* Reads dimensions and strides from arrays[0] and checks the strides. */
static int read_geometry(kv_paged_cache *self, const kv_layout *layout, int64_t block_size)
{
    const kv_array *a = &self->arrays[0];
    const kv_path path = kv_paged_layer_path(self, 0);
    if (kv_array_elements(a) == 0) {
        char shape[192];
        kv_format_shape(a->shape, a->ndim, shape, sizeof shape);
        return kv_path_error(PyExc_ValueError, &path, "has shape %s: a cache needs at least one element", shape);
    }
    if (kv_check_itemsize(a, &path) < 0)
        return -1;
    int64_t size[DIM_COUNT];
    if (kv_layout_geometry(layout, a, block_size, &path, size, self->stride) < 0)
        return -1;
    for (int letter = 0; letter < DIM_COUNT; letter++) {
        if (layout->dim[letter] < 0)
            continue;
        if (self->stride[letter] < 0)
            return kv_path_error(PyExc_ValueError, &path, "dimension '%c' (%s) has a negative stride (%lld bytes)",
                                 KV_LAYOUT_LETTERS[letter], KV_LAYOUT_NAMES[letter], (long long)self->stride[letter]);
        if (self->stride[letter] == 0 && size[letter] > 1)
            return kv_path_error(PyExc_ValueError, &path,
                                 "dimension '%c' (%s) has stride 0 and size %lld: its "
                                 "entries would share memory",
                                 KV_LAYOUT_LETTERS[letter], KV_LAYOUT_NAMES[letter], (long long)size[letter]);
    }
    if (size[DIM_D] > 1 && self->stride[DIM_D] != a->itemsize)
        return kv_path_error(PyExc_ValueError, &path,
                             "dimension 'd' (head dim) must have stride 1 element, got %lld "
                             "bytes for %lld-byte elements",
                             (long long)self->stride[DIM_D], (long long)a->itemsize);
    self->nl = layout->dim[DIM_L] >= 0 ? size[DIM_L] : self->kv_pairs ? self->narrays / 2 : self->narrays;
    self->no = self->kv_pairs ? 2 : size[DIM_K];
    self->num_blocks = size[DIM_B];
    self->nt = size[DIM_T];
    self->nh = size[DIM_H];
    self->hd = size[DIM_D];
    self->itemsize = a->itemsize;
    self->dtype = a->dtype;
    if (self->nh * self->nt * self->hd * self->itemsize > (int64_t)UINT32_MAX)
        return kv_path_error(PyExc_ValueError, &path,
                             "a chunk of %lld heads x %lld tokens x %lld elements exceeds "
                             "4 GiB",
                             (long long)self->nh, (long long)self->nt, (long long)self->hd);
    return 0;
}

/* Base address of every layer, their alignment and the arrays' sorted
 * spans.  Nothing is allocated on a device, and so nothing is freed there
 * when the cache is collected (which may happen during another thread's
 * graph capture). */
static int build_tables(kv_paged_cache *self)
{
    const size_t count = (size_t)(self->kv_pairs ? self->narrays : self->nl > 0 ? self->nl : 1);
    self->layer_addresses = PyMem_Malloc(count * sizeof(uint64_t));
    self->spans = PyMem_Malloc((size_t)self->narrays * sizeof(kv_span));
    self->reach = PyMem_Malloc((size_t)self->narrays * sizeof(uint64_t));
    if (self->layer_addresses == NULL || self->spans == NULL || self->reach == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        self->spans[i] = kv_span_of(&self->arrays[i], i, 0);
    if (kv_sort_spans(self->spans, self->narrays, self->reach) < 0)
        return -1;
    /* Rows move whole (d has stride 1 element): the other strides and the
     * layers' addresses bound the vector width. */
    self->alignment = 0;
    for (int letter = DIM_L; letter < DIM_D; letter++)
        self->alignment |= (uint64_t)self->stride[letter];
    for (int64_t l = 0; l < (int64_t)count; l++) {
        /* Per-layer (or per-K/V) arrays, or one array with an 'l' dimension. */
        const uint64_t base = self->narrays > 1
                                  ? (uint64_t)(uintptr_t)self->arrays[l].data
                                  : (uint64_t)(uintptr_t)self->arrays[0].data + (uint64_t)(l * self->stride[DIM_L]);
        self->layer_addresses[l] = base;
        self->alignment |= base;
    }
    return 0;
}

/* An 'l' in the layout goes with one array holding every layer, and only
 * with it; a 'k' never with (K, V) pairs. */
static int check_layer_letter(PyObject *dims, int single, int pairs, const kv_layout *layout)
{
    if (single && layout->dim[DIM_L] < 0)
        return kv_error(PyExc_ValueError,
                        "layout: %R has no 'l' (layer), but layers is one array; name its layer "
                        "dimension, or pass a sequence of per-layer arrays",
                        dims);
    if (!single && layout->dim[DIM_L] >= 0)
        return kv_error(PyExc_ValueError,
                        "layout: %R has an 'l' (layer), which is only for one array holding every "
                        "layer; layers is a sequence of per-layer %s",
                        dims, pairs ? "(K, V) pairs" : "arrays");
    if (pairs && layout->dim[DIM_K] >= 0)
        return kv_error(PyExc_ValueError,
                        "layout: %R has a 'k' (K/V), but layers are (K, V) pairs: the layout "
                        "describes each of the two arrays",
                        dims);
    return 0;
}

/* A copy kv_as_sequence made, kept for the cache's life: tracked again, so
 * that a layer referring back to the cache is a cycle the collector finds. */
static PyObject *kept(PyObject *tuple)
{
    if (!PyObject_GC_IsTracked(tuple))
        PyObject_GC_Track(tuple);
    return tuple;
}

/* layers as a sequence of (K, V) pairs: the 2n arrays, K then V of each
 * layer (a new tuple), and *pairs the pairs as read, each a tuple (new). */
static PyObject *flatten_pairs(PyObject *seq, PyObject **pairs)
{
    const Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *arrays = PyTuple_New(2 * n);
    *pairs = arrays == NULL ? NULL : PyTuple_New(n);
    for (Py_ssize_t i = 0; *pairs != NULL && i < n; i++) {
        const kv_path path = {"layers", {i, 0}, 1};
        PyObject *pair = kv_as_sequence(PyTuple_GET_ITEM(seq, i), &path, "a (K, V) pair of arrays, as layers[0] is");
        if (pair != NULL && PyTuple_GET_SIZE(pair) != 2) {
            kv_path_error(PyExc_ValueError, &path, "a (K, V) pair has 2 arrays, got %zd", PyTuple_GET_SIZE(pair));
            Py_CLEAR(pair);
        }
        if (pair == NULL) {
            Py_CLEAR(*pairs);
            break;
        }
        PyTuple_SET_ITEM(*pairs, i, kept(pair));
        PyTuple_SET_ITEM(arrays, 2 * i, Py_NewRef(PyTuple_GET_ITEM(pair, 0)));
        PyTuple_SET_ITEM(arrays, 2 * i + 1, Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
    }
    if (*pairs == NULL)
        Py_CLEAR(arrays);
    return arrays;
}

static int compare_addresses(const void *a, const void *b)
{
    const uintptr_t x = (uintptr_t)*(PyObject *const *)a, y = (uintptr_t)*(PyObject *const *)b;
    return (x > y) - (x < y);
}

/* The version counters from_* must bump: self->counters, one entry per
 * array, and self->distinct_counters, each owner once (NULL when there is
 * none), so that a call writing every layer bumps each counter once.
 * Without autograd's checks every entry is None, as for arrays that have
 * no counter: a write neither reads requires_grad nor bumps one. */
static int find_counters(kv_paged_cache *self, kv_protocols *p, int autograd_checks)
{
    if ((self->counters = PyTuple_New(self->narrays)) == NULL)
        return -1;
    PyObject **owners = PyMem_Malloc((size_t)self->narrays * sizeof *owners);
    if (owners == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < self->narrays; i++) {
        PyObject *owner = autograd_checks ? kv_torch_counter_owner(p, kv_paged_layer(self, i)) : Py_NewRef(Py_None);
        if (owner == NULL) {
            PyMem_Free(owners);
            return -1;
        }
        PyTuple_SET_ITEM(self->counters, i, owner);
        if (owner != Py_None)
            owners[n++] = owner;
    }
    qsort(owners, (size_t)n, sizeof *owners, compare_addresses);
    Py_ssize_t distinct = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (distinct == 0 || owners[distinct - 1] != owners[i])
            owners[distinct++] = owners[i];
    if (distinct > 0 && (self->distinct_counters = PyTuple_New(distinct)) != NULL)
        for (Py_ssize_t i = 0; i < distinct; i++)
            PyTuple_SET_ITEM(self->distinct_counters, i, Py_NewRef(owners[i]));
    PyMem_Free(owners);
    return distinct > 0 && self->distinct_counters == NULL ? -1 : 0;
}

/* Keeps the n arrays of `seq` (borrowed for the cache's life) and checks
 * each against the first. */
static int keep_arrays(kv_paged_cache *self, kv_state *state, const kv_layout *layout, PyObject *seq)
{
    const Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (n == 0)
        return kv_error(PyExc_ValueError, "layers: no arrays; expected one per layer");
    /* __dlpack__(stream=-1): only addresses are taken here. */
    const kv_reader reader = {&state->protocols, PyLong_FromLong(-1)};
    if (reader.dlpack_stream == NULL)
        return -1;
    int rc = -1;
    if ((self->arrays = PyMem_Calloc((size_t)n, sizeof(kv_array))) == NULL)
        PyErr_NoMemory();
    else {
        rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
            const kv_path path = kv_paged_layer_path(self, i);
            rc = kv_array_keep(&reader, PyTuple_GET_ITEM(seq, i), &path, &self->arrays[i]);
            if (rc == 0) {
                self->narrays = i + 1;
                rc = check_layer_array(self, i, layout);
            }
        }
    }
    Py_DECREF(reader.dlpack_stream);
    return rc;
}

/* The arrays `layers` names, as a tuple (new reference): the one array,
 * the per-layer arrays, or K then V of each (K, V) pair, which sets
 * kv_pairs.  self->layers becomes what was read, not the caller's
 * (mutable) sequence. */
static PyObject *layer_arrays(kv_paged_cache *self, const kv_layout *layout)
{
    const kv_path whole = {"layers", {0, 0}, 0};
    int single;
    PyObject *seq = kv_array_items(self->layers, &whole,
                                   "a sequence of per-layer arrays or (K, V) pairs, or one "
                                   "array",
                                   &single);
    if (seq == NULL)
        return NULL;
    PyObject *first = PyTuple_GET_SIZE(seq) > 0 ? PyTuple_GET_ITEM(seq, 0) : NULL;
    self->kv_pairs = !single && first != NULL && (PyList_Check(first) || PyTuple_Check(first));
    if (self->kv_pairs) {
        PyObject *pairs;
        Py_SETREF(seq, flatten_pairs(seq, &pairs));
        if (seq != NULL)
            Py_SETREF(self->layers, pairs);
    }
    else if (!single)
        Py_SETREF(self->layers, Py_NewRef(kept(seq)));
    if (seq != NULL && check_layer_letter(self->dims, single, self->kv_pairs, layout) < 0)
        Py_CLEAR(seq);
    return seq;
}

static int describe(kv_paged_cache *self, kv_state *state, int64_t block_size, int autograd_checks)
{
    kv_layout layout;
    if (kv_layout_parse(self->dims, &layout) < 0)
        return -1;
    PyObject *normalized = kv_layout_text(&layout);
    if (normalized == NULL)
        return -1;
    Py_SETREF(self->dims, normalized);
    PyObject *seq = layer_arrays(self, &layout);
    if (seq == NULL)
        return -1;
    const int rc = keep_arrays(self, state, &layout, seq);
    Py_DECREF(seq);
    if (rc < 0)
        return -1;
    const kv_array *first = &self->arrays[0];
    self->device = first->place == KV_DEVICE ? first->device_id : -1;
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        self->readonly |= self->arrays[i].readonly;
    if (read_geometry(self, &layout, block_size) < 0 || kv_paged_name_types(self, &state->protocols) < 0
        || find_counters(self, &state->protocols, autograd_checks) < 0 || build_tables(self) < 0
        || kv_paged_find_aliasing(self) < 0)
        return -1;
    return kv_paged_guard_layers(self, &state->protocols);
}

PyObject *kv_paged_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    kv_paged_new_args a;
    int64_t block_size;
    int autograd_checks;
    if (kv_parse_tuple_arguments(&kv_paged_new_signature, args, kwargs, &a) < 0
        || kv_parse_int(a.block_size, "block_size", 1, INT64_MAX, 0, 1, &block_size) < 0
        || kv_switch_read(a.autograd_checks, "autograd_checks", KV_PAGED_NEW_ARGS_AUTOGRAD_CHECKS_DEFAULT,
                          &autograd_checks)
               < 0)
        return NULL;
    kv_paged_cache *self = (kv_paged_cache *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->device = -1;
    self->layers = Py_NewRef(a.layers);
    self->dims = Py_NewRef(a.layout);
    /* The type is not subclassable: `type` is the module's own. */
    if (describe(self, PyType_GetModuleState(type), block_size, autograd_checks) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

int kv_paged_traverse(kv_paged_cache *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->layers);
    Py_VISIT(self->dims);
    Py_VISIT(self->dtype_object);
    Py_VISIT(self->device_object);
    Py_VISIT(self->counters);
    Py_VISIT(self->distinct_counters);
    Py_VISIT(self->guards);
    Py_VISIT(self->shared_none_dst);
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        Py_VISIT(self->arrays[i].owner);
    return 0;
}

int kv_paged_clear(kv_paged_cache *self)
{
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        kv_array_release(&self->arrays[i]);
    self->narrays = 0;
    Py_CLEAR(self->layers);
    Py_CLEAR(self->dims);
    Py_CLEAR(self->dtype_object);
    Py_CLEAR(self->device_object);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->distinct_counters);
    Py_CLEAR(self->guards);
    Py_CLEAR(self->shared_none_dst);
    return 0;
}

void kv_paged_dealloc(kv_paged_cache *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    kv_paged_clear(self);
    PyMem_Free(self->arrays);
    PyMem_Free(self->layer_addresses);
    PyMem_Free(self->spans);
    PyMem_Free(self->reach);
    PyMem_Free(self->exchange);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}
