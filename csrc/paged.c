/* kvbm_ext.PagedKVCache.  See paged.h.
 *
 * Everything that does not change between calls is worked out once, at
 * construction: the dimensions and strides named by `dims`, the base address
 * of every layer (copied to the device for GPU caches) and the alignment
 * they allow.  A call then reads its block ids and its one (or nb) flat
 * arrays, checks them, and launches one kernel whose parameters carry
 * everything else: its host cost does not depend on nl or the chunk count.
 */
#include "paged.h"

#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include "address_list.h"
#include "args.h"
#include "copy.h"
#include "cpu_copy.h"
#include "overlap.h"
#include "state.h"
#include "stream.h"

/* The dimension letters of `dims`. */
enum { DIM_L, DIM_K, DIM_B, DIM_T, DIM_H, DIM_D, DIM_COUNT };
static const char DIM_LETTERS[] = "lkbthd";
static const char *const DIM_NAMES[DIM_COUNT] = {"layer", "K/V", "block", "token", "head", "head dim"};

typedef struct {
    PyObject_HEAD
    PyObject *layers;  /* the arrays as given */
    PyObject *dims;    /* the dims string */
    kv_array *arrays;  /* borrowed for the cache's life */
    Py_ssize_t narrays;
    int64_t nl, no, nh, nt, hd, num_blocks, itemsize;
    kv_dtype dtype;
    int device;        /* the CUDA device, or -1 for host memory */
    int readonly;
    int64_t stride[DIM_COUNT];  /* bytes; 0 for a letter dims lacks */
    uint64_t *layer_addresses;  /* base address of every layer (each call's table takes those it moves) */
    kv_span *spans;             /* the bytes of every array, sorted, for the aliasing check */
    uint64_t *reach;
    uint64_t alignment;         /* OR of the layer addresses and strides */
    uint8_t *seen;              /* num_blocks bits for the repeated-id check, clear between calls */
} kv_paged_cache;

/* ------------------------------------------------------------ construction */

/* Raises `type` with a formatted message.  Returns -1. */
static int fail(PyObject *type, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    PyErr_FormatV(type, format, args);
    va_end(args);
    return -1;
}

/* Fills position[letter] with the letter's index in dims, or -1. */
static int parse_dims(PyObject *dims, int position[DIM_COUNT])
{
    if (!PyUnicode_Check(dims))
        return fail(PyExc_TypeError, "dims: expected a str such as \"kbthd\", got %s", Py_TYPE(dims)->tp_name);
    for (int i = 0; i < DIM_COUNT; i++)
        position[i] = -1;
    const Py_ssize_t n = PyUnicode_GET_LENGTH(dims);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_UCS4 read = PyUnicode_READ_CHAR(dims, i);
        /* Letters in either case, as `layout` and `inner` take any case. */
        const Py_UCS4 c = read >= 'A' && read <= 'Z' ? read - 'A' + 'a' : read;
        const char *found = c != 0 && c < 128 ? strchr(DIM_LETTERS, (int)c) : NULL;
        if (found == NULL) {
            PyObject *letter = PyUnicode_FromOrdinal((int)read);
            if (letter != NULL)
                fail(PyExc_ValueError, "dims: %R at position %zd of %R is not one of l (layer), k (K/V), b (block), "
                     "t (token), h (head), d (head dim)", letter, i, dims);
            Py_XDECREF(letter);
            return -1;
        }
        const int letter = (int)(found - DIM_LETTERS);
        if (position[letter] >= 0)
            return fail(PyExc_ValueError, "dims: letter '%c' (%s) appears twice in %R", DIM_LETTERS[letter],
                        DIM_NAMES[letter], dims);
        position[letter] = (int)i;
    }
    const int required[] = {DIM_B, DIM_T, DIM_D};
    for (int i = 0; i < 3; i++)
        if (position[required[i]] < 0)
            return fail(PyExc_ValueError, "dims: %R has no '%c' (%s); every cache has b, t and d", dims,
                        DIM_LETTERS[required[i]], DIM_NAMES[required[i]]);
    return 0;
}

/* Where array i of the cache is named in errors. */
static kv_path layer_path(const kv_paged_cache *self, Py_ssize_t i)
{
    const kv_path path = {"layers", {i, 0}, PyList_Check(self->layers) || PyTuple_Check(self->layers) ? 1 : 0};
    return path;
}

/* Checks arrays[i] against arrays[0]: dimensions, element type, strides, place. */
static int check_layer_array(kv_paged_cache *self, Py_ssize_t i, Py_ssize_t ndim)
{
    kv_array *a = &self->arrays[i];
    const kv_array *first = &self->arrays[0];
    const kv_path path = layer_path(self, i);
    char got[96], want[96];
    kv_format_shape(a->shape, a->ndim, got, sizeof got); /* once per array, at construction */
    if (a->ndim != ndim)
        return kv_path_error(PyExc_ValueError, &path, "dims %R names %zd dimensions, but the array has shape %s",
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
    for (int d = 0; d < ndim; d++)
        if (a->shape[d] != 1 && a->strides[d] != first->strides[d])
            return kv_path_error(PyExc_ValueError, &path, "dimension '%c' has stride %lld bytes, but layers[0]'s has "
                                 "%lld; the layers must share one memory layout",
                                 PyUnicode_AsUTF8(self->dims)[d], (long long)a->strides[d],
                                 (long long)first->strides[d]);
    if ((a->place == KV_DEVICE) != (first->place == KV_DEVICE) || a->device_id != first->device_id) {
        const int on_device = a->place == KV_DEVICE;
        return kv_path_error(PyExc_ValueError, &path, "%s %s, but layers[0] is %s %s; a cache lives on one device or "
                             "in host memory", on_device ? "on" : "in", on_device ? "a CUDA device" : "host memory",
                             first->place == KV_DEVICE ? "on" : "in",
                             first->place == KV_DEVICE ? "a CUDA device" : "host memory");
    }
    return 0;
}

/* Reads dimensions and strides from arrays[0] and checks the strides. */
static int read_geometry(kv_paged_cache *self, const int position[DIM_COUNT])
{
    const kv_array *a = &self->arrays[0];
    const kv_path path = layer_path(self, 0);
    char name[48];
    if (kv_array_elements(a) == 0) {
        char shape[192];
        kv_format_shape(a->shape, a->ndim, shape, sizeof shape);
        return kv_path_error(PyExc_ValueError, &path, "has shape %s: a cache needs at least one element", shape);
    }
    if (a->itemsize != 1 && a->itemsize != 2 && a->itemsize != 4 && a->itemsize != 8)
        return kv_path_error(PyExc_TypeError, &path, "element type %s has %lld bytes; supported sizes are 1, 2, 4 and 8",
                             kv_dtype_name(a->dtype, name, sizeof name), (long long)a->itemsize);
    int64_t size[DIM_COUNT];
    for (int letter = 0; letter < DIM_COUNT; letter++) {
        const int d = position[letter];
        size[letter] = d < 0 ? 1 : a->shape[d];
        self->stride[letter] = d < 0 ? 0 : a->strides[d];
        if (d < 0)
            continue;
        if (self->stride[letter] < 0)
            return kv_path_error(PyExc_ValueError, &path, "dimension '%c' (%s) has a negative stride (%lld bytes)",
                                 DIM_LETTERS[letter], DIM_NAMES[letter], (long long)self->stride[letter]);
        if (self->stride[letter] == 0 && size[letter] > 1)
            return kv_path_error(PyExc_ValueError, &path, "dimension '%c' (%s) has stride 0 and size %lld: its "
                                 "entries would share memory", DIM_LETTERS[letter], DIM_NAMES[letter],
                                 (long long)size[letter]);
    }
    if (size[DIM_D] > 1 && self->stride[DIM_D] != a->itemsize)
        return kv_path_error(PyExc_ValueError, &path, "dimension 'd' (head dim) must have stride 1 element, got %lld "
                             "bytes for %lld-byte elements", (long long)self->stride[DIM_D], (long long)a->itemsize);
    self->nl = position[DIM_L] >= 0 ? size[DIM_L] : self->narrays;
    self->no = size[DIM_K];
    self->num_blocks = size[DIM_B];
    self->nt = size[DIM_T];
    self->nh = size[DIM_H];
    self->hd = size[DIM_D];
    self->itemsize = a->itemsize;
    self->dtype = a->dtype;
    if (self->nh * self->nt * self->hd * self->itemsize > (int64_t)UINT32_MAX)
        return kv_path_error(PyExc_ValueError, &path, "a chunk of %lld heads x %lld tokens x %lld elements exceeds "
                             "4 GiB", (long long)self->nh, (long long)self->nt, (long long)self->hd);
    return 0;
}

/* Base address of every layer, their alignment, the arrays' sorted spans
 * and the scratch of the repeated-id check.  Nothing is allocated on a device, and so nothing is
 * freed there when the cache is collected (which may happen during another
 * thread's graph capture). */
static int build_tables(kv_paged_cache *self)
{
    const size_t count = self->nl > 0 ? (size_t)self->nl : 1;
    self->layer_addresses = PyMem_Malloc(count * sizeof(uint64_t));
    self->seen = PyMem_Calloc((size_t)(self->num_blocks + 7) / 8 + 1, 1);
    self->spans = PyMem_Malloc((size_t)self->narrays * sizeof(kv_span));
    self->reach = PyMem_Malloc((size_t)self->narrays * sizeof(uint64_t));
    if (self->layer_addresses == NULL || self->seen == NULL || self->spans == NULL || self->reach == NULL) {
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
    for (int64_t l = 0; l < self->nl; l++) {
        /* Per-layer arrays, or one array with an 'l' dimension. */
        const uint64_t base = self->narrays == self->nl
                                  ? (uint64_t)(uintptr_t)self->arrays[l].data
                                  : (uint64_t)(uintptr_t)self->arrays[0].data + (uint64_t)(l * self->stride[DIM_L]);
        self->layer_addresses[l] = base;
        self->alignment |= base;
    }
    return 0;
}

/* An 'l' in dims goes with one array holding every layer, and only with it. */
static int check_layer_letter(PyObject *dims, int single, const int position[DIM_COUNT])
{
    if (single && position[DIM_L] < 0)
        return fail(PyExc_ValueError, "dims: %R has no 'l' (layer), but layers is one array; name its layer "
                    "dimension, or pass a sequence of per-layer arrays", dims);
    if (!single && position[DIM_L] >= 0)
        return fail(PyExc_ValueError, "dims: %R has an 'l' (layer), which is only for one array holding every layer; "
                    "layers is a sequence of per-layer arrays", dims);
    return 0;
}

static int describe(kv_paged_cache *self)
{
    int position[DIM_COUNT];
    if (parse_dims(self->dims, position) < 0)
        return -1;
    /* Keep dims in lower case: letters are distinct, so at most DIM_COUNT. */
    const Py_ssize_t ndim = PyUnicode_GetLength(self->dims);
    char lower[DIM_COUNT];
    for (int letter = 0; letter < DIM_COUNT; letter++)
        if (position[letter] >= 0)
            lower[position[letter]] = DIM_LETTERS[letter];
    PyObject *normalized = PyUnicode_FromStringAndSize(lower, ndim);
    if (normalized == NULL)
        return -1;
    Py_SETREF(self->dims, normalized);
    const int single = !PyList_Check(self->layers) && !PyTuple_Check(self->layers) && kv_is_array(self->layers);
    const kv_path whole = {"layers", {0, 0}, 0};
    PyObject *seq = single ? PyTuple_Pack(1, self->layers)
                           : kv_as_sequence(self->layers, &whole, "a sequence of per-layer arrays, or one array");
    if (seq == NULL)
        return -1;
    /* Keep the arrays as read, not the caller's (mutable) list. */
    if (!single)
        Py_SETREF(self->layers, Py_NewRef(seq));
    if (check_layer_letter(self->dims, single, position) < 0) {
        Py_DECREF(seq);
        return -1;
    }
    int rc = -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *no_sync = PyLong_FromLong(-1); /* __dlpack__(stream=-1): only addresses are taken here */
    if (n == 0)
        PyErr_SetString(PyExc_ValueError, "layers: no arrays; expected one per layer");
    else if (no_sync != NULL && (self->arrays = PyMem_Calloc((size_t)n, sizeof(kv_array))) == NULL)
        PyErr_NoMemory();
    else if (no_sync != NULL) {
        rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
            const kv_path path = layer_path(self, i);
            rc = kv_array_keep_from_object(PySequence_Fast_GET_ITEM(seq, i), &path, no_sync, &self->arrays[i]);
            if (rc == 0) {
                self->narrays = i + 1;
                rc = check_layer_array(self, i, ndim);
            }
        }
    }
    Py_XDECREF(no_sync);
    Py_DECREF(seq);
    if (rc < 0)
        return -1;
    const kv_array *first = &self->arrays[0];
    self->device = first->place == KV_DEVICE ? first->device_id : -1;
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        self->readonly |= self->arrays[i].readonly;
    if (read_geometry(self, position) < 0)
        return -1;
    return build_tables(self);
}

static PyObject *paged_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"layers", "dims", NULL};
    PyObject *layers, *dims;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:PagedKVCache", keywords, &layers, &dims))
        return NULL;
    kv_paged_cache *self = (kv_paged_cache *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->device = -1;
    self->layers = Py_NewRef(layers);
    self->dims = Py_NewRef(dims);
    if (describe(self) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int paged_traverse(kv_paged_cache *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->layers);
    Py_VISIT(self->dims);
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        Py_VISIT(self->arrays[i].owner);
    return 0;
}

static int paged_clear(kv_paged_cache *self)
{
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        kv_array_release(&self->arrays[i]);
    self->narrays = 0;
    Py_CLEAR(self->layers);
    Py_CLEAR(self->dims);
    return 0;
}

static void paged_dealloc(kv_paged_cache *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    paged_clear(self);
    PyMem_Free(self->arrays);
    PyMem_Free(self->layer_addresses);
    PyMem_Free(self->spans);
    PyMem_Free(self->reach);
    PyMem_Free(self->seen);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* ------------------------------------------------------------ one call */

/* What distinguishes the four methods. */
typedef struct {
    const char *format; /* PyArg format, with the method's name */
    const char *name;   /* for the debug log */
    int to_flat;        /* the cache is read and the flat blocks written */
    int universal;      /* universal blocks; else operational */
} kv_paged_form;

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
    uint32_t max_ctas;          /* 0: not given */
    kv_backend backend;
    kvbm_layout inner;
    intptr_t stream;
    int stream_none;            /* stream=None: the arrays' framework's current stream */
} kv_paged_options;

/* The layers or heads argument: None (all n), an index (Python's rules for
 * a negative one), a slice (Python's clipping rules) or a range whose every
 * value is an index.  `what` names one entry in errors ("layer", "head"). */
static int read_selection(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel)
{
    sel->first = 0, sel->step = 1, sel->count = n;
    if (obj == NULL || obj == Py_None)
        return 0;
    if (PySlice_Check(obj)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(obj, &start, &stop, &step) < 0) {
            PyErr_Clear();
            return fail(PyExc_ValueError, "%s: %R has step 0", name, obj);
        }
        sel->count = PySlice_AdjustIndices((Py_ssize_t)n, &start, &stop, step);
        sel->first = start, sel->step = step;
        return 0;
    }
    if (!PyBool_Check(obj) && PyIndex_Check(obj)) {
        int64_t index;
        if (kv_parse_int(obj, name, INT64_MIN, INT64_MAX, 0, 0, &index) < 0)
            return -1;
        if (index < -n || index >= n)
            return fail(PyExc_ValueError, "%s: %s %lld is outside the cache's %lld %ss", name, what, (long long)index,
                        (long long)n, what);
        sel->first = index < 0 ? index + n : index, sel->count = 1;
        return 0;
    }
    if (!PyObject_TypeCheck(obj, &PyRange_Type))
        return fail(PyExc_TypeError, "%s: expected None, an int, a slice or a range of %s indices, got %s", name,
                    what, Py_TYPE(obj)->tp_name);
    PyObject *start = PyObject_GetAttrString(obj, "start"), *step = PyObject_GetAttrString(obj, "step");
    sel->first = start == NULL ? -1 : PyLong_AsLongLong(start);
    sel->step = step == NULL ? -1 : PyLong_AsLongLong(step);
    sel->count = PyErr_Occurred() ? -1 : PyObject_Size(obj);
    Py_XDECREF(start);
    Py_XDECREF(step);
    int64_t last = 0;
    if (!PyErr_Occurred() && sel->count > 0
        && (__builtin_mul_overflow(sel->count - 1, sel->step, &last) || __builtin_add_overflow(last, sel->first, &last)))
        PyErr_SetString(PyExc_OverflowError, "");
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return fail(PyExc_ValueError, "%s: %R selects %ss outside the cache's 0 to %lld", name, obj, what,
                    (long long)n - 1);
    }
    if (sel->count > 0 && (sel->first < 0 || sel->first >= n || last < 0 || last >= n))
        return fail(PyExc_ValueError, "%s: %R selects %s %lld, but the cache has %ss 0 to %lld", name, obj, what,
                    (long long)(sel->first < 0 || sel->first >= n ? sel->first : last), what, (long long)n - 1);
    return 0;
}

/* The highest index a selection takes, or -1 for none. */
static int64_t selection_top(const kv_selection *sel)
{
    if (sel->count <= 0)
        return -1;
    return sel->step > 0 ? sel->first + (sel->count - 1) * sel->step : sel->first;
}

static const char *const INNER_NAMES[] = {"NHD", "HND"};

static int read_options(const kv_paged_cache *self, PyObject *layers, PyObject *layer_offset, PyObject *heads,
                        PyObject *head_offset, PyObject *backend, PyObject *num_ctas, PyObject *inner,
                        PyObject *stream, kv_paged_options *o)
{
    int64_t max_ctas;
    int inner_index = KVBM_NHD, backend_index = KV_BACKEND_AUTO;
    /* Offsets are bounded so that no sum with a dimension overflows. */
    if (read_selection(layers, self->nl, "layers", "layer", &o->layers) < 0
        || read_selection(heads, self->nh, "heads", "head", &o->heads) < 0
        || kv_parse_int(layer_offset, "layer_offset", 0, INT32_MAX, 0, 0, &o->layer_offset) < 0
        || kv_parse_int(head_offset, "head_offset", 0, INT32_MAX, 0, 0, &o->head_offset) < 0
        || kv_parse_name(backend, "backend", KV_BACKEND_NAMES, KV_BACKEND_COUNT, KV_BACKEND_AUTO, &backend_index) < 0
        || kv_parse_int(num_ctas, "num_ctas", 1, UINT32_MAX, 0, 1, &max_ctas) < 0
        || kv_parse_name(inner, "inner", INNER_NAMES, 2, KVBM_NHD, &inner_index) < 0
        || kv_stream_from_object(stream, &o->stream) < 0)
        return -1;
    o->max_ctas = (uint32_t)max_ctas;
    o->backend = (kv_backend)backend_index;
    o->stream_none = stream == NULL || stream == Py_None;
    o->inner = (kvbm_layout)inner_index;
    return 0;
}

/* Everything one call reads, released by release_call. */
typedef struct {
    kv_paged_cache *cache;
    const kv_paged_form *form;
    kv_paged_options options;
    kv_address_list ids;
    int ids_read;
    const char *flat_name;
    int single;         /* the flat side is one array with a leading nb dimension */
    kv_array *flats;    /* one, or nb */
    Py_ssize_t nflats, parsed;
    int64_t flat_shape[5]; /* of every flat block */
    int flat_ndim;
    PyObject *dlpack_stream;
} kv_paged_call;

static void release_call(kv_paged_call *call)
{
    if (call->ids_read)
        kv_address_list_release(&call->ids);
    for (Py_ssize_t i = 0; i < call->parsed; i++)
        kv_array_release(&call->flats[i]);
    PyMem_Free(call->flats);
    Py_XDECREF(call->dlpack_stream);
}

/* Reads block_ids and checks them: on the cache's device or in host memory;
 * host ids in range and, when the cache is written, each once. */
static int read_block_ids(kv_paged_call *call, PyObject *obj)
{
    kv_paged_cache *cache = call->cache;
    if (kv_address_list_from_object(obj, "block_ids", KV_LIST_BLOCK_IDS, cache->device >= 0, call->dlpack_stream,
                                    &call->ids) < 0)
        return -1;
    call->ids_read = 1;
    if (call->ids.on_device) {
        if (call->ids.device_id != cache->device)
            return fail(PyExc_ValueError, "block_ids: on cuda:%d, but the cache is on cuda:%d", call->ids.device_id,
                        cache->device);
        return 0;
    }
    const int64_t *ids = (const int64_t *)call->ids.values;
    const Py_ssize_t n = call->ids.count;
    int rc = 0;
    Py_ssize_t i = 0;
    for (; i < n && rc == 0; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= cache->num_blocks) {
            PyErr_Format(PyExc_ValueError, "block_ids[%zd]: block id %lld is out of range [0, %lld)", i, (long long)id,
                         (long long)cache->num_blocks);
            rc = -1;
        }
        else if (!call->form->to_flat) {
            uint8_t *byte = &cache->seen[id / 8];
            const uint8_t bit = (uint8_t)(1u << (id % 8));
            if (*byte & bit) {
                Py_ssize_t earlier = 0;
                while (ids[earlier] != id)
                    earlier++;
                PyErr_Format(PyExc_ValueError, "block_ids[%zd]: block id %lld repeats block_ids[%zd]; a block can "
                             "be written once per call", i, (long long)id, earlier);
                rc = -1;
            }
            *byte |= bit;
        }
    }
    /* Leave the scratch clear for the next call. */
    for (Py_ssize_t k = 0; !call->form->to_flat && k < i; k++)
        if (ids[k] >= 0 && ids[k] < cache->num_blocks)
            cache->seen[ids[k] / 8] = 0;
    return rc;
}

static kv_path flat_path(const kv_paged_call *call, Py_ssize_t b)
{
    const kv_path path = {call->flat_name, {b, 0}, call->single ? 0 : 1};
    return path;
}

/* The shape every flat block must have, for errors: "[NH >= 8, NL >= 80, 2, 16, 128]". */
static void expected_flat(const kv_paged_call *call, char *buf, size_t size)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    if (call->form->universal) {
        const int64_t top = selection_top(&o->layers);
        snprintf(buf, size, "[NH >= %lld, NL >= %lld, %lld, %lld, %lld] ([heads, layers, no, nt, hd], head_offset %lld "
                 "+ %lld heads moved, layer_offset %lld + layers up to %lld)",
                 (long long)(o->head_offset + o->heads.count), (long long)(o->layer_offset + top + 1),
                 (long long)c->no, (long long)c->nt, (long long)c->hd, (long long)o->head_offset,
                 (long long)o->heads.count, (long long)o->layer_offset, (long long)top);
    }
    else {
        snprintf(buf, size, "[%lld, %lld, %lld] ([nl, no, nt*nh*hd])", (long long)c->nl, (long long)c->no,
                 (long long)(c->nt * c->nh * c->hd));
    }
}

/* Whether a flat block's shape fits the cache and the options. */
static int flat_shape_fits(const kv_paged_call *call, const int64_t *shape)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    if (!call->form->universal)
        return shape[0] == c->nl && shape[1] == c->no && shape[2] == c->nt * c->nh * c->hd;
    return shape[0] >= o->head_offset + o->heads.count && shape[1] >= o->layer_offset + selection_top(&o->layers) + 1
        && shape[2] == c->no && shape[3] == c->nt && shape[4] == c->hd;
}

/* A flat block's shape does not fit: the expected one, or that of the first
 * block (`like_first`). */
static int flat_shape_error(const kv_paged_call *call, const kv_path *path, const kv_array *a, int like_first)
{
    char got[96], want[256];
    kv_format_shape(a->shape, a->ndim, got, sizeof got);
    if (like_first) {
        kv_format_shape(call->flat_shape, call->flat_ndim, want, sizeof want);
        return kv_path_error(PyExc_ValueError, path, "shape %s differs from %s[0]'s %s", got, call->flat_name, want);
    }
    expected_flat(call, want, sizeof want);
    return kv_path_error(PyExc_ValueError, path, "expected %s%d-D array %s%s, got shape %s",
                         call->single ? "one " : "a ", call->flat_ndim + call->single,
                         call->single ? "[nb] + " : "", want, got);
}

/* Checks flats[i]: shape, element type, contiguity, writability, place. */
static int check_flat(kv_paged_call *call, Py_ssize_t i, Py_ssize_t nb)
{
    kv_array *a = &call->flats[i];
    const kv_paged_cache *cache = call->cache;
    const kv_path path = flat_path(call, i);
    const int ndim = call->flat_ndim + call->single;
    const int64_t *shape = a->shape + call->single;
    char got[48], want[48];
    if (a->ndim != ndim || (i == 0 && !flat_shape_fits(call, shape)))
        return flat_shape_error(call, &path, a, 0);
    if (call->single && a->shape[0] != nb)
        return kv_path_error(PyExc_ValueError, &path, "has %lld blocks (its leading dimension) but block_ids has %zd",
                             (long long)a->shape[0], nb);
    if (i == 0)
        memcpy(call->flat_shape, shape, (size_t)call->flat_ndim * sizeof(int64_t));
    else if (memcmp(shape, call->flat_shape, (size_t)call->flat_ndim * sizeof(int64_t)) != 0)
        return flat_shape_error(call, &path, a, 1);
    if (a->dtype.code != cache->dtype.code || a->dtype.bits != cache->dtype.bits)
        return kv_path_error(PyExc_TypeError, &path, "element type %s differs from the cache's %s",
                             kv_dtype_name(a->dtype, got, sizeof got), kv_dtype_name(cache->dtype, want, sizeof want));
    if (!kv_array_is_contiguous_from(a, call->single))
        return kv_path_error(PyExc_ValueError, &path, "%s must be C-contiguous",
                             call->single ? "every block (all dimensions after the first)" : "the array");
    if (call->single && nb > 1) {
        int64_t block_bytes = a->itemsize;
        for (int d = 1; d < ndim; d++)
            block_bytes *= a->shape[d];
        if (a->strides[0] < 0 || (call->form->to_flat && a->strides[0] < block_bytes))
            return kv_path_error(PyExc_ValueError, &path, "the blocks %s (leading stride %lld bytes, %lld bytes per "
                                 "block)", a->strides[0] < 0 ? "run backwards" : "overlap",
                                 (long long)a->strides[0], (long long)block_bytes);
    }
    if (call->form->to_flat && a->readonly)
        return kv_path_error(PyExc_ValueError, &path, "destination array is read-only");
    if (cache->device < 0) {
        if (a->place == KV_DEVICE)
            return kv_path_error(PyExc_ValueError, &path, "on a CUDA device, but the cache is in host memory");
        return 0;
    }
    if (kv_gpu_locate(a, &path) < 0)
        return -1;
    if (a->place == KV_HOST)
        return kv_path_error(PyExc_ValueError, &path, "in pageable host memory, but the cache is on cuda:%d, which "
                             "needs pinned (page-locked) host memory: pin it (e.g. torch's tensor.pin_memory()) or "
                             "move it to the device", cache->device);
    if (a->place == KV_DEVICE && a->device_id != cache->device)
        return kv_path_error(PyExc_ValueError, &path, "on cuda:%d, but the cache is on cuda:%d", a->device_id,
                             cache->device);
    return 0;
}

/* Reads the universals or operationals: one array, or a sequence of nb. */
static int read_flats(kv_paged_call *call, PyObject *obj)
{
    const Py_ssize_t nb = call->ids.count;
    const kv_path whole = {call->flat_name, {0, 0}, 0};
    call->flat_ndim = call->form->universal ? 5 : 3;
    call->single = !PyList_Check(obj) && !PyTuple_Check(obj) && kv_is_array(obj);
    PyObject *seq = call->single ? PyTuple_Pack(1, obj) : kv_as_sequence(obj, &whole, "an array or a sequence of arrays");
    if (seq == NULL)
        return -1;
    int rc = -1;
    call->nflats = PySequence_Fast_GET_SIZE(seq);
    if (!call->single && call->nflats != nb)
        PyErr_Format(PyExc_ValueError, "%s: has %zd blocks but block_ids has %zd", call->flat_name, call->nflats, nb);
    else if ((call->flats = PyMem_Calloc((size_t)(call->nflats > 0 ? call->nflats : 1), sizeof(kv_array))) == NULL)
        PyErr_NoMemory();
    else {
        rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < call->nflats; i++) {
            const kv_path path = flat_path(call, i);
            rc = kv_array_from_object(PySequence_Fast_GET_ITEM(seq, i), &path, call->dlpack_stream, &call->flats[i]);
            if (rc == 0) {
                call->parsed = i + 1;
                rc = check_flat(call, i, nb);
            }
        }
    }
    Py_DECREF(seq);
    return rc;
}

/* Raises "destination shares memory with ..." naming two arguments. */
static int overlap_error(const kv_path *destination, const kv_path *other)
{
    char where[96];
    kv_path_format(other, where, sizeof where);
    return kv_path_error(PyExc_ValueError, destination, "destination shares memory with %s; a destination may not "
                         "overlap a source or another destination", where);
}

/* A destination sharing memory with a source or another destination is
 * refused: each flat block against the cache's arrays (sorted once, at
 * construction: a binary search a block), and the flat blocks against each
 * other when they are written. */
static int check_aliasing(const kv_paged_call *call)
{
    const kv_paged_cache *cache = call->cache;
    const int to_flat = call->form->to_flat;
    for (Py_ssize_t i = 0; i < call->nflats; i++) {
        const kv_span s = kv_span_of(&call->flats[i], i, to_flat);
        const Py_ssize_t hit = kv_span_overlaps(cache->spans, cache->reach, cache->narrays, &s);
        if (hit >= 0) {
            const kv_path flat = flat_path(call, i), layer = layer_path(cache, hit);
            return to_flat ? overlap_error(&flat, &layer) : overlap_error(&layer, &flat);
        }
    }
    if (!to_flat || call->nflats < 2)
        return 0;
    kv_span *spans = PyMem_Malloc((size_t)call->nflats * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < call->nflats; i++)
        spans[i] = kv_span_of(&call->flats[i], i, 1);
    Py_ssize_t first, second;
    const int rc = kv_find_overlap(spans, call->nflats, &first, &second);
    PyMem_Free(spans);
    if (rc <= 0)
        return rc;
    const kv_path a = flat_path(call, first), b = flat_path(call, second);
    return overlap_error(&a, &b);
}

/* The kernel's description of the call. */
static kvbm_paged plan(const kv_paged_call *call)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    kvbm_paged p;
    memset(&p, 0, sizeof p);
    p.nb = call->ids.count;
    p.nl = o->layers.count;
    p.no = c->no, p.nh = o->heads.count, p.nt = c->nt;
    p.row_bytes = c->hd * c->itemsize;
    p.num_blocks = c->num_blocks;
    p.cache_outer = c->stride[DIM_K];
    p.cache_block = c->stride[DIM_B];
    /* The kernel counts moved heads: fold the first head and the step in. */
    p.cache_shift = o->heads.first * c->stride[DIM_H];
    p.cache_head = c->stride[DIM_H] * o->heads.step;
    p.cache_token = c->stride[DIM_T];
    const int64_t rb = p.row_bytes;
    if (call->form->universal) {
        /* [NH, NL, no, nt, hd] */
        p.flat_token = rb;
        p.flat_outer = p.nt * rb;
        p.flat_layer = p.no * p.flat_outer;
        p.flat_head = call->flat_shape[1] * p.flat_layer;
        p.flat_shift = o->head_offset * p.flat_head + o->layer_offset * p.flat_layer;
    }
    else {
        /* [nl, no, nt*nh*hd], each chunk in the inner order */
        p.flat_outer = p.nt * p.nh * rb;
        p.flat_layer = p.no * p.flat_outer;
        p.flat_token = o->inner == KVBM_NHD ? p.nh * rb : rb;
        p.flat_head = o->inner == KVBM_NHD ? rb : p.nt * rb;
    }
    /* The kernel counts moved layers: fold the first layer and the step in. */
    p.flat_shift += o->layers.first * p.flat_layer;
    p.flat_layer *= o->layers.step;
    p.to_flat = call->form->to_flat;
    kvbm_paged_plan(&p);
    return p;
}

/* Describes the flat blocks for the staged path (gpu.h) when they are all in
 * pinned memory, their addresses in `addresses` (nb entries): universals
 * are [heads][moved layers] of units (no, nt, hd), operationals [1][moved
 * layers] of units (no, nt*nh*hd).  Returns NULL, or why they cannot be
 * staged. */
static const char *plan_staging(const kv_paged_call *call, const kvbm_paged *p, const kvbm_paged_addresses *a,
                                uint64_t *addresses, kv_staged *staged)
{
    for (Py_ssize_t i = 0; i < call->nflats; i++)
        if (call->flats[i].place != KV_HOST_PINNED)
            return "the flat blocks are partly on the device, partly in pinned host memory";
    memset(staged, 0, sizeof *staged);
    staged->nb = p->nb;
    staged->inner = p->nl;
    staged->inner_stride = p->flat_layer;
    staged->block_address = addresses;
    staged->to_host = p->to_flat;
    staged->flat_side = 1;
    staged->one_allocation = call->single;
    if (call->form->universal) {
        staged->mid = p->nh;
        staged->mid_stride = p->flat_head;
        staged->unit_bytes = p->no * p->nt * p->row_bytes;
    }
    else {
        staged->mid = 1;
        staged->unit_bytes = p->no * p->nt * p->nh * p->row_bytes;
    }
    for (int64_t b = 0; b < p->nb; b++)
        addresses[b] = (a->flat_base ? a->flat_base + (uint64_t)(b * a->flat_block)
                                     : (uint64_t)(uintptr_t)call->flats[b].data) + (uint64_t)p->flat_shift;
    return NULL;
}

/* The GPU side of run(): the producers' streams, the route, the launch. */
static int run_on_gpu(kv_gpu *gpu, const kv_paged_call *call, const kvbm_paged *p, const kvbm_paged_addresses *a,
                      const uint64_t *table, int vector_bytes)
{
    const kv_paged_cache *cache = call->cache;
    intptr_t *producers = PyMem_Malloc((size_t)(call->nflats + 1) * sizeof(intptr_t));
    uint64_t *addresses = PyMem_Malloc((size_t)(p->nb > 0 ? p->nb : 1) * sizeof(uint64_t));
    if (producers == NULL || addresses == NULL) {
        PyMem_Free(producers);
        PyMem_Free(addresses);
        PyErr_NoMemory();
        return -1;
    }
    kv_gpu_target target = {cache->device, call->options.stream, producers, 0};
    /* stream=None: the current stream of the call's arrays' framework, else
     * of the cache's (read at construction, asked now). */
    if (call->options.stream_none
        && (kv_arrays_default_stream(call->flats, call->nflats, cache->device, &target.stream) < 0
            || (target.stream == 0 && call->ids.on_device
                && kv_arrays_default_stream(&call->ids.array, 1, cache->device, &target.stream) < 0)
            || (target.stream == 0 && kv_arrays_default_stream(cache->arrays, 1, cache->device, &target.stream) < 0))) {
        PyMem_Free(producers);
        PyMem_Free(addresses);
        return -1;
    }
    if (call->ids.on_device)
        kv_array_add_producer(&call->ids.array, producers, &target.producer_count);
    int pinned = 0;
    for (Py_ssize_t i = 0; i < call->nflats; i++) {
        kv_array_add_producer(&call->flats[i], producers, &target.producer_count);
        pinned |= call->flats[i].place == KV_HOST_PINNED;
    }
    kv_staged staged;
    const char *unstageable = pinned ? plan_staging(call, p, a, addresses, &staged) : NULL;
    const kv_route route = kv_route_move(call->options.backend, pinned, unstageable, call->options.max_ctas);
    staged.async_copies = route.async_copies;
    kv_gpu_report report;
    memset(&report, 0, sizeof report);
    const int rc = kv_gpu_paged(gpu, &target, p, a, table, vector_bytes, route.ctas, route.staged ? &staged : NULL,
                                &report);
    if (rc == 0)
        kv_debug_move(call->form->name, &route, &report, cache->device);
    PyMem_Free(producers);
    PyMem_Free(addresses);
    return rc;
}

/* Moves the bytes: the table holds the base address of every moved layer,
 * the host ids, then the flat blocks' addresses unless they are one array
 * (kvbm_paged.h). */
static int run(kv_gpu *gpu, kv_paged_call *call)
{
    kv_paged_cache *cache = call->cache;
    const Py_ssize_t nb = call->ids.count;
    kvbm_paged p = plan(call);
    kvbm_paged_addresses addresses;
    memset(&addresses, 0, sizeof addresses);
    addresses.ids = call->ids.on_device ? call->ids.values : NULL;
    addresses.ids_int32 = call->ids.int32;
    uint64_t alignment = cache->alignment | (uint64_t)p.row_bytes | 16;
    if (call->single) {
        addresses.flat_base = (uint64_t)(uintptr_t)call->flats[0].data;
        addresses.flat_block = call->flats[0].strides[0];
        alignment |= addresses.flat_base | (uint64_t)addresses.flat_block;
    }
    const int64_t entries = kvbm_paged_table_entries(&addresses, p.nl, nb);
    uint64_t *table = PyMem_Malloc((size_t)entries * sizeof(uint64_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *slot = table;
    for (int64_t i = 0; i < p.nl; i++)
        *slot++ = cache->layer_addresses[call->options.layers.first + i * call->options.layers.step];
    if (!call->ids.on_device) {
        memcpy(slot, call->ids.values, (size_t)nb * sizeof(uint64_t));
        slot += nb;
    }
    for (Py_ssize_t b = 0; !call->single && b < nb; b++) {
        slot[b] = (uint64_t)(uintptr_t)call->flats[b].data;
        alignment |= slot[b];
    }
    int rc = 0;
    if (cache->device >= 0)
        rc = run_on_gpu(gpu, call, &p, &addresses, table, (int)(alignment & (~alignment + 1)));
    else {
        Py_BEGIN_ALLOW_THREADS
        kv_cpu_paged(&p, &addresses, table);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(table);
    return rc;
}

static PyObject *transfer(kv_paged_cache *self, PyObject *args, PyObject *kwargs, const kv_paged_form *form)
{
    static char *universal_keywords[] = {"", "", "layers", "layer_offset", "heads", "head_offset", "backend",
                                         "num_ctas", "stream", NULL};
    static char *operational_keywords[] = {"", "", "inner", "layers", "backend", "num_ctas", "stream", NULL};
    PyObject *first, *second, *layers = NULL, *layer_offset = NULL, *heads = NULL, *head_offset = NULL;
    PyObject *num_ctas = NULL;
    PyObject *inner = NULL, *backend = NULL, *stream = Py_None;
    const int parsed = form->universal
        ? PyArg_ParseTupleAndKeywords(args, kwargs, form->format, universal_keywords, &first, &second, &layers,
                                      &layer_offset, &heads, &head_offset, &backend, &num_ctas, &stream)
        : PyArg_ParseTupleAndKeywords(args, kwargs, form->format, operational_keywords, &first, &second, &inner,
                                      &layers, &backend, &num_ctas, &stream);
    if (!parsed)
        return NULL;
    kv_paged_call call;
    memset(&call, 0, sizeof call);
    call.cache = self;
    call.form = form;
    call.flat_name = form->universal ? "universals" : "operationals";
    PyObject *block_ids = form->to_flat ? first : second;
    PyObject *flats = form->to_flat ? second : first;
    int rc = -1;
    if (read_options(self, layers, layer_offset, heads, head_offset, backend, num_ctas, inner, stream, &call.options) < 0)
        goto done;
    if (!form->to_flat && self->readonly) {
        PyErr_SetString(PyExc_ValueError, "layers: the cache is read-only, so blocks cannot be written into it");
        goto done;
    }
    call.dlpack_stream = kv_stream_for_dlpack(call.options.stream);
    if (call.dlpack_stream == NULL || read_block_ids(&call, block_ids) < 0 || read_flats(&call, flats) < 0
        || check_aliasing(&call) < 0)
        goto done;
    const int64_t chunk_bytes = call.options.heads.count * self->nt * self->hd * self->itemsize;
    const int64_t layers_moved = call.options.layers.count;
    int64_t weight;
    if (__builtin_mul_overflow((int64_t)call.ids.count * layers_moved, self->no * (chunk_bytes / 1024 + 1), &weight)
        || weight > (int64_t)INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "block_ids: too much data for one call (%zd blocks of %lld layers of %lld "
                     "bytes); split it into several calls", call.ids.count, (long long)layers_moved,
                     (long long)(self->no * chunk_bytes));
        goto done;
    }
    rc = 0;
    if (call.ids.count > 0 && layers_moved > 0 && self->no * chunk_bytes > 0)
        rc = run(((kv_state *)PyType_GetModuleState(Py_TYPE(self)))->gpu, &call);
done:
    release_call(&call);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define DEFINE_TRANSFER(name, format, to_flat, universal)                                                              \
    static PyObject *name(kv_paged_cache *self, PyObject *args, PyObject *kwargs)                                      \
    {                                                                                                                  \
        static const kv_paged_form form = {format, "PagedKVCache." #name, to_flat, universal};                       \
        return transfer(self, args, kwargs, &form);                                                                    \
    }

#define COMMON_DOC                                                                                                     \
    "block_ids: a sequence of ints, or a 1-D int32/int64 array in host memory or on the\n"                             \
    "    cache's device (nb = its length; nb = 0 does nothing).  Host ids must lie in\n"                               \
    "    [0, num_blocks) and, where the cache is written, appear once (ValueError).\n"                                 \
    "    Device ids are not read on the host (that would need a synchronization): the\n"                               \
    "    kernel skips a block whose id is outside [0, num_blocks), and repeated ids\n"                                 \
    "    are not detected.\n"                                                                                          \
    "layers: None (every layer), an int, a slice (Python's rules) or a range of cache\n"                                \
    "    layers.\n"                               \
    "backend: \"auto\" (default): with universal or operational blocks in pinned host\n"                               \
    "    memory, the copy engines carry the bytes over PCIe and a kernel on a few CTAs\n"                              \
    "    rearranges them through device staging memory (set_staging(),\n"                                             \
    "    reserve_staging()), leaving the SMs to the model; device to device, the\n"                                    \
    "    kernel.  \"copy_engines\" (or \"batch\", or \"async\": one cudaMemcpyAsync per\n"                              \
    "    run) asks for the copy engines, \"kernel\" for SM kernels reading and writing\n"                               \
    "    pinned memory directly.  KVBM_EXT_DEBUG=1 logs the path taken and why.\n"                                     \
    "num_ctas: None or the most CUDA blocks the kernel (or the staged permute) may\n"                                  \
    "    use, to bound the SMs a transfer takes beside the model; None: no bound\n"                                    \
    "    device to device, 8 with pinned memory.  The bytes moved are the same.\n"                                     \
    "stream: None, an int cudaStream_t, or an object with __cuda_stream__() or\n"                                    \
    "    .cuda_stream.  None runs where an operation of the arrays' framework would:\n"                                  \
    "    torch's current stream (inside `with torch.cuda.stream(s)`, on s), else the\n"                                 \
    "    legacy default stream.  The work is enqueued and not waited for;\n"                                            \
    "    the call's arrays' producers are ordered before it (DLPack, CAI v3).  The\n"                                  \
    "    cache itself is read at construction: order its writers yourself.\n"                                          \
    "Universal or operational blocks live on the cache's device or in pinned host\n"                               \
    "memory (host memory for a host cache).  Everything is checked before anything\n"                                  \
    "is written.  With device-resident block_ids and one flat array, a call stages\n"                                  \
    "nothing and synchronizes nothing, so it can be captured in a CUDA graph\n"                                        \
    "(pass the capturing stream) and replayed with new ids written into block_ids;\n"                                  \
    "on the staged path, call reserve_staging() before capturing.\n"

#define UNIVERSAL_DOC                                                                                                  \
    "universals: a sequence of nb C-contiguous arrays [NH, NL, no, nt, hd], or one\n"                                  \
    "    array [nb, NH, NL, no, nt, hd] whose blocks are C-contiguous, with\n"                                         \
    "    NH >= head_offset + len(heads), NL >= layer_offset + the highest layer moved.\n"                              \
    "layer_offset: cache layer l is universal layer l + layer_offset.\n"                                               \
    "heads: None (every head), an int, a slice or a range of the cache's heads: the\n"                                  \
    "    heads moved, in that order (a receiver's share when resharding).\n"                                          \
    "head_offset: the heads moved are universal heads [head_offset, head_offset +\n"                                  \
    "    len(heads)) (a tensor-parallel rank's slice).  Other heads and layers are not\n"                             \
    "    touched.\n"

#define OPERATIONAL_BLOCKS_DOC                                                                                         \
    "operationals: a sequence of nb C-contiguous arrays [nl, no, nt*nh*hd] (every cache\n"                             \
    "    layer, whatever `layers` selects), or one array [nb, nl, no, nt*nh*hd].\n"                                    \
    "inner: the order inside each chunk, \"NHD\" ([nt, nh, hd]) or \"HND\" ([nh, nt, hd]).\n"

PyDoc_STRVAR(to_universal_doc,
             "to_universal($self, block_ids, universals, /, *, layers=None, layer_offset=0, heads=None, "
             "head_offset=0, backend='auto', num_ctas=None, stream=None)\n--\n\n"
             "Copy cache blocks into universal blocks:\n"
             "universals[b][head_offset + j, layer_offset + l, o, t, :] = cache row (block_ids[b], l, o, t, heads[j])\n"
             "for every layer l in `layers` and every j < len(heads).\n\n" UNIVERSAL_DOC COMMON_DOC);
DEFINE_TRANSFER(to_universal, "OO|$OOOOOOO:to_universal", 1, 1)

PyDoc_STRVAR(from_universal_doc,
             "from_universal($self, universals, block_ids, /, *, layers=None, layer_offset=0, heads=None, "
             "head_offset=0, backend='auto', num_ctas=None, stream=None)\n--\n\n"
             "Copy universal blocks into cache blocks, the inverse of to_universal.\n\n" UNIVERSAL_DOC COMMON_DOC);
DEFINE_TRANSFER(from_universal, "OO|$OOOOOOO:from_universal", 0, 1)

PyDoc_STRVAR(to_operational_doc,
             "to_operational($self, block_ids, operationals, /, *, inner='NHD', layers=None, backend='auto', "
             "num_ctas=None, stream=None)\n--\n\n"
             "Copy cache blocks into operational blocks:\n"
             "operationals[b][l, o].view(nt, nh, hd)[t, h, :] = cache row (block_ids[b], l, o, t, h)\n"
             "for inner \"NHD\" (.view(nh, nt, hd)[h, t, :] for \"HND\").\n\n" OPERATIONAL_BLOCKS_DOC COMMON_DOC);
DEFINE_TRANSFER(to_operational, "OO|$OOOOO:to_operational", 1, 0)

PyDoc_STRVAR(from_operational_doc,
             "from_operational($self, operationals, block_ids, /, *, inner='NHD', layers=None, backend='auto', "
             "num_ctas=None, stream=None)\n--\n\n"
             "Copy operational blocks into cache blocks, the inverse of to_operational.\n\n" OPERATIONAL_BLOCKS_DOC
             COMMON_DOC);
DEFINE_TRANSFER(from_operational, "OO|$OOOOO:from_operational", 0, 0)

static PyMethodDef paged_methods[] = {
    {"to_universal", (PyCFunction)(void (*)(void))to_universal, METH_VARARGS | METH_KEYWORDS, to_universal_doc},
    {"from_universal", (PyCFunction)(void (*)(void))from_universal, METH_VARARGS | METH_KEYWORDS,
     from_universal_doc},
    {"to_operational", (PyCFunction)(void (*)(void))to_operational, METH_VARARGS | METH_KEYWORDS,
     to_operational_doc},
    {"from_operational", (PyCFunction)(void (*)(void))from_operational, METH_VARARGS | METH_KEYWORDS,
     from_operational_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------ attributes */

/* The int64 members, by offset, served by one getter. */
#define INT_MEMBER(name) (void *)offsetof(kv_paged_cache, name)

static PyObject *get_int(kv_paged_cache *self, void *offset)
{
    return PyLong_FromLongLong(*(const int64_t *)((const char *)self + (size_t)offset));
}

static PyObject *get_dtype(kv_paged_cache *self, void *unused)
{
    (void)unused;
    char name[48];
    return PyUnicode_FromString(kv_dtype_name(self->dtype, name, sizeof name));
}

static PyObject *get_device(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return self->device >= 0 ? PyUnicode_FromFormat("cuda:%d", self->device) : PyUnicode_FromString("cpu");
}

static PyObject *get_dims(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->dims);
}

static PyObject *get_layers(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->layers);
}

static PyGetSetDef paged_getset[] = {
    {"num_layers", (getter)get_int, NULL, "nl: layers in the cache", INT_MEMBER(nl)},
    {"num_blocks", (getter)get_int, NULL, "blocks per layer (valid ids: 0 .. num_blocks - 1)", INT_MEMBER(num_blocks)},
    {"num_heads", (getter)get_int, NULL, "nh: KV heads (1 without an 'h' in dims)", INT_MEMBER(nh)},
    {"tokens_per_block", (getter)get_int, NULL, "nt: tokens per block", INT_MEMBER(nt)},
    {"head_dim", (getter)get_int, NULL, "hd: elements per head and token", INT_MEMBER(hd)},
    {"num_outer", (getter)get_int, NULL, "no: 2 for K and V, 1 without a 'k' in dims", INT_MEMBER(no)},
    {"itemsize", (getter)get_int, NULL, "bytes per element", INT_MEMBER(itemsize)},
    {"dtype", (getter)get_dtype, NULL, "element type, e.g. 'bfloat16'", NULL},
    {"device", (getter)get_device, NULL, "'cuda:N', or 'cpu' for a cache in host memory", NULL},
    {"dims", (getter)get_dims, NULL, "the dims string given at construction, in lower case", NULL},
    {"layers", (getter)get_layers, NULL, "the arrays given at construction (the cache keeps them alive)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *paged_repr(kv_paged_cache *self)
{
    char dtype[48];
    PyObject *device = get_device(self, NULL);
    PyObject *repr = device == NULL ? NULL
        : PyUnicode_FromFormat("PagedKVCache(dims=%R, num_layers=%lld, num_blocks=%lld, num_outer=%lld, num_heads=%lld, "
                               "tokens_per_block=%lld, head_dim=%lld, dtype='%s', device='%U')", self->dims,
                               (long long)self->nl, (long long)self->num_blocks, (long long)self->no,
                               (long long)self->nh, (long long)self->nt, (long long)self->hd,
                               kv_dtype_name(self->dtype, dtype, sizeof dtype), device);
    Py_XDECREF(device);
    return repr;
}

PyDoc_STRVAR(paged_doc,
             "PagedKVCache(layers, dims)\n--\n\n"
             "A serving worker's KV cache, described once: the blocks of every layer are\n"
             "addressed by block id, and each call moves nb blocks to or from universal or\n"
             "operational blocks in one kernel launch, with a host cost that does not grow\n"
             "with the number of layers or chunks.\n\n"
             "layers: a sequence of nl per-layer arrays, or one array holding every layer.\n"
             "dims: one letter per dimension of each array, in its logical order: l layer\n"
             "    (only for one all-layer array), k K/V (absent: no = 1), b block, t token,\n"
             "    h head (absent: nh = 1), d head dim.  E.g. \"kbthd\" (vLLM FlashAttention,\n"
             "    [2, num_blocks, nt, nh, hd]), \"bkthd\" (FlashInfer), \"btd\" (MLA), \"blkthd\"\n"
             "    (one cross-layer array).\n\n"
             "Strides come from the arrays, so any physical order works (e.g. vLLM's HND\n"
             "memory order behind a \"kbthd\" view); 'd' must have stride 1 element and no\n"
             "stride may be negative.  Every array has one element type (1, 2, 4 or 8 bytes)\n"
             "and all are on one CUDA device, or all in host memory (then calls run on the\n"
             "CPU, without the GIL).  The cache keeps the memory of its arrays alive (for\n"
             "DLPack producers, through the capsules' managed tensors) and always moves\n"
             "that memory: re-pointing a layer tensor afterwards (torch's set_ or resize_)\n"
             "does not change what the cache reads or writes.  It holds no device memory\n"
             "of its own: constructing or collecting it never allocates, frees or\n"
             "synchronizes on a device.");

static PyType_Slot paged_slots[] = {
    {Py_tp_doc, (void *)paged_doc},
    {Py_tp_new, paged_new},
    {Py_tp_dealloc, paged_dealloc},
    {Py_tp_traverse, paged_traverse},
    {Py_tp_clear, paged_clear},
    {Py_tp_methods, paged_methods},
    {Py_tp_getset, paged_getset},
    {Py_tp_repr, paged_repr},
    {0, NULL},
};

/* Not subclassable: methods find the module state through their own type. */
static PyType_Spec paged_spec = {
    .name = "kvbm_ext.PagedKVCache",
    .basicsize = sizeof(kv_paged_cache),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = paged_slots,
};

int kv_paged_add_type(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &paged_spec, NULL);
    if (type == NULL)
        return -1;
    const int rc = PyModule_AddObjectRef(module, "PagedKVCache", type);
    Py_DECREF(type);
    return rc;
}
