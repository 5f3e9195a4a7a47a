/* kvbm_ext.PagedKVCache: reading and checking one call of its methods.
 * See paged_internal.h; paged_run.c runs the call. */
#include "paged_internal.h"

#include <stdio.h>
#include <string.h>

#include "args.h"
#include "state.h"

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
            return kv_error(PyExc_ValueError, "%s: %R has step 0", name, obj);
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
            return kv_error(PyExc_ValueError, "%s: %s %lld is outside the cache's %lld %ss", name, what, (long long)index,
                        (long long)n, what);
        sel->first = index < 0 ? index + n : index, sel->count = 1;
        return 0;
    }
    if (!PyObject_TypeCheck(obj, &PyRange_Type))
        return kv_error(PyExc_TypeError, "%s: expected None, an int, a slice or a range of %s indices, got %s", name,
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
        return kv_error(PyExc_ValueError, "%s: %R selects %ss outside the cache's 0 to %lld", name, obj, what,
                    (long long)n - 1);
    }
    if (sel->count > 0 && (sel->first < 0 || sel->first >= n || last < 0 || last >= n))
        return kv_error(PyExc_ValueError, "%s: %R selects %s %lld, but the cache has %ss 0 to %lld", name, obj, what,
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

/* The chunk order of the operational methods: layout=, or inner=, its
 * deprecated spelling (a DeprecationWarning; TypeError when both are
 * given). */
static int read_layout(const kv_paged_form *form, PyObject *layout, PyObject *inner, kvbm_layout *out)
{
    if (inner == NULL)
        return kv_layout_read(layout, "layout", out);
    if (layout != NULL)
        return kv_error(PyExc_TypeError, "%s() got both layout and inner, its deprecated spelling: pass layout only",
                        form->signature.function);
    if (PyErr_WarnFormat(PyExc_DeprecationWarning, 1, "%s(): inner= is deprecated, pass layout= instead",
                         form->signature.function) < 0)
        return -1;
    return kv_layout_read(inner, "inner", out);
}

static int read_options(const kv_paged_cache *self, const kv_paged_form *form, PyObject *layers,
                        PyObject *layer_offset, PyObject *heads, PyObject *head_offset, PyObject *backend,
                        PyObject *num_ctas, PyObject *layout, PyObject *inner, PyObject *stream, kv_paged_options *o)
{
    /* Offsets are bounded so that no sum with a dimension overflows. */
    if (read_selection(layers, self->nl, "layers", "layer", &o->layers) < 0
        || read_selection(heads, self->nh, "heads", "head", &o->heads) < 0
        || kv_parse_int(layer_offset, "layer_offset", 0, INT32_MAX, 0, 0, &o->layer_offset) < 0
        || kv_parse_int(head_offset, "head_offset", 0, INT32_MAX, 0, 0, &o->head_offset) < 0
        || read_layout(form, layout, inner, &o->layout) < 0
        || kv_move_options_read(backend, num_ctas, stream, &o->move) < 0)
        return -1;
    return 0;
}

static void release_call(kv_paged_call *call)
{
    if (call->ids_read)
        kv_address_list_release(&call->ids);
    for (Py_ssize_t i = 0; i < call->parsed; i++)
        kv_array_release(&call->flats[i]);
    PyMem_Free(call->flats);
    kv_target_release(&call->target);
    Py_XDECREF(call->reader.dlpack_stream);
}

/* Bits for the repeated-id check of one call, on the stack up to this many
 * bytes (caches of up to 65,536 blocks), else on the heap.  Per call, so
 * that a cache holds no state that calls share. */
#define SEEN_STACK_BYTES 8192

/* Host ids must be in range and, when the cache is written, each once: 0,
 * or -1 with a ValueError naming the first entry in error. */
static int check_host_ids(const kv_paged_call *call, const int64_t *ids, Py_ssize_t n)
{
    const int64_t num_blocks = call->cache->num_blocks;
    const int written = !call->form->to_flat;
    uint8_t stack[SEEN_STACK_BYTES], *seen = stack;
    const size_t bytes = (size_t)num_blocks / 8 + 1;
    if (written && bytes > sizeof stack && (seen = PyMem_Malloc(bytes)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* Only the bytes the ids touch need clearing: no pass over the whole
     * bit set, whatever the cache's size. */
    for (Py_ssize_t i = 0; written && i < n; i++)
        if (ids[i] >= 0 && ids[i] < num_blocks)
            seen[ids[i] / 8] = 0;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= num_blocks)
            rc = kv_error(PyExc_ValueError, "block_ids[%zd]: block id %lld is out of range [0, %lld)", i,
                          (long long)id, (long long)num_blocks);
        else if (written) {
            const uint8_t bit = (uint8_t)(1u << (id % 8));
            if (seen[id / 8] & bit) {
                Py_ssize_t earlier = 0;
                while (ids[earlier] != id)
                    earlier++;
                rc = kv_error(PyExc_ValueError, "block_ids[%zd]: block id %lld repeats block_ids[%zd]; a block can "
                              "be written once per call", i, (long long)id, earlier);
            }
            seen[id / 8] |= bit;
        }
    }
    if (seen != stack)
        PyMem_Free(seen);
    return rc;
}

/* Reads block_ids and checks them: on the cache's device or in host memory;
 * host ids in range and, when the cache is written, each once. */
static int read_block_ids(kv_paged_call *call, PyObject *obj)
{
    kv_paged_cache *cache = call->cache;
    if (kv_address_list_read(&call->reader, obj, "block_ids", KV_LIST_BLOCK_IDS, cache->device >= 0, &call->ids) < 0)
        return -1;
    call->ids_read = 1;
    if (call->ids.on_device) {
        const kv_path path = {"block_ids", {0, 0}, 0};
        return kv_target_add(&call->target, &call->ids.array, &path);
    }
    return check_host_ids(call, (const int64_t *)call->ids.values, call->ids.count);
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

/* Checks flats[i]: shape, element type, contiguity, place (kv_array_read
 * checked that a destination is writable). */
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
    if (cache->device >= 0)
        return kv_target_add(&call->target, a, &path);
    if (a->place == KV_DEVICE)
        return kv_path_error(PyExc_ValueError, &path, "on a CUDA device, but the cache is in host memory");
    return 0;
}

/* Reads the universals or operationals: one array, or a sequence of nb. */
static int read_flats(kv_paged_call *call, PyObject *obj)
{
    const Py_ssize_t nb = call->ids.count;
    const kv_path whole = {call->flat_name, {0, 0}, 0};
    call->flat_ndim = call->form->universal ? 5 : 3;
    PyObject *items = kv_array_items(obj, &whole, "an array or a sequence of arrays", &call->single);
    if (items == NULL)
        return -1;
    int rc = -1;
    call->nflats = PyTuple_GET_SIZE(items);
    if (!call->single && call->nflats != nb)
        PyErr_Format(PyExc_ValueError, "%s: has %zd blocks but block_ids has %zd", call->flat_name, call->nflats, nb);
    else if ((call->flats = PyMem_Calloc((size_t)(call->nflats > 0 ? call->nflats : 1), sizeof(kv_array))) == NULL)
        PyErr_NoMemory();
    else {
        rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < call->nflats; i++) {
            const kv_path path = flat_path(call, i);
            rc = kv_array_read(&call->reader, PyTuple_GET_ITEM(items, i), &path, call->form->to_flat, &call->flats[i]);
            if (rc == 0) {
                call->parsed = i + 1;
                rc = check_flat(call, i, nb);
            }
        }
    }
    Py_DECREF(items);
    return rc;
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
            const kv_path flat = flat_path(call, i), layer = kv_paged_layer_path(cache, hit);
            return to_flat ? kv_overlap_error(&flat, &layer) : kv_overlap_error(&layer, &flat);
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
    return kv_overlap_error(&a, &b);
}

/* from_*: the cache's layers are the destination.  Each torch layer the
 * call writes is checked as a destination now (requires_grad may have been
 * set since construction), and their version counters are bumped, as the
 * list API does for its destinations (kv_arrays_written): all distinct
 * counters at once when every layer is written, else those of the layers
 * selected.  Inference tensors need neither (kv_torch_counter_owner). */
static int mark_layers_written(const kv_paged_call *call)
{
    const kv_paged_cache *cache = call->cache;
    kv_protocols *p = &call->state->protocols;
    /* One array holds every layer, or array i is layer i. */
    const kv_selection *layers = &call->options.layers;
    const int every = cache->narrays == 1 || layers->count == cache->narrays;
    const Py_ssize_t count = cache->narrays == 1 ? 1 : (Py_ssize_t)layers->count;
    PyObject *bump = NULL;
    if (!every && cache->distinct_counters != NULL && (bump = PyList_New(0)) == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t k = 0; rc == 0 && k < count; k++) {
        const Py_ssize_t i = cache->narrays == 1 ? 0 : (Py_ssize_t)(layers->first + k * layers->step);
        PyObject *owner = PyTuple_GET_ITEM(cache->counters, i);
        if (owner == Py_None)
            continue;
        const kv_path path = kv_paged_layer_path(cache, i);
        rc = kv_torch_check_destination(p, kv_paged_layer(cache, i), &path);
        if (rc == 0 && bump != NULL)
            rc = PyList_Append(bump, owner);
    }
    if (rc == 0 && (bump != NULL || (every && cache->distinct_counters != NULL)))
        rc = kv_torch_written(p, bump != NULL ? bump : cache->distinct_counters);
    Py_XDECREF(bump);
    return rc;
}

PyObject *kv_paged_transfer(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                            const kv_paged_form *form)
{
    PyObject *v[9];
    if (kv_parse_arguments(&form->signature, args, nargs, kwnames, v) < 0)
        return NULL;
    /* The options after the two positional arguments, in each form's order
     * (paged_type.c); those a form lacks stay NULL. */
    PyObject *first = v[0], *second = v[1], *layer_offset = NULL, *heads = NULL, *head_offset = NULL, *layout = NULL;
    PyObject *inner = NULL, *layers, *backend, *num_ctas, *stream;
    if (form->universal) {
        layers = v[2], layer_offset = v[3], heads = v[4], head_offset = v[5];
        backend = v[6], num_ctas = v[7], stream = v[8];
    }
    else {
        layout = v[2], layers = v[3];
        backend = v[4], num_ctas = v[5], stream = v[6], inner = v[7];
    }
    kv_paged_call call;
    memset(&call, 0, sizeof call);
    call.cache = self;
    call.state = PyType_GetModuleState(Py_TYPE(self)); /* not subclassable: the module's own type */
    call.form = form;
    call.flat_name = form->universal ? "universals" : "operationals";
    PyObject *block_ids = form->to_flat ? first : second;
    PyObject *flats = form->to_flat ? second : first;
    int rc = -1;
    if (read_options(self, form, layers, layer_offset, heads, head_offset, backend, num_ctas, layout, inner, stream,
                     &call.options) < 0)
        goto done;
    if (!form->to_flat && self->readonly) {
        PyErr_SetString(PyExc_ValueError, "layers: the cache is read-only, so blocks cannot be written into it");
        goto done;
    }
    kv_target_init(&call.target, call.options.move.stream, self->device, "the cache is");
    call.reader.protocols = &call.state->protocols;
    call.reader.dlpack_stream = kv_stream_for_dlpack(call.options.move.stream);
    if (call.reader.dlpack_stream == NULL || read_block_ids(&call, block_ids) < 0 || read_flats(&call, flats) < 0
        || check_aliasing(&call) < 0)
        goto done;
    const int64_t chunk_bytes = call.options.heads.count * self->nt * self->hd * self->itemsize;
    const int64_t layers_moved = call.options.layers.count;
    if (!kvbm_fits_one_launch(call.ids.count, layers_moved * self->no, chunk_bytes)) {
        PyErr_Format(PyExc_ValueError, "block_ids: too much data for one call (%zd blocks of %lld layers of %lld "
                     "bytes); split it into several calls", call.ids.count, (long long)layers_moved,
                     (long long)(self->no * chunk_bytes));
        goto done;
    }
    rc = 0;
    if (call.ids.count > 0 && layers_moved > 0 && self->no * chunk_bytes > 0) {
        rc = self->device < 0 ? kv_move_options_check_host(&call.options.move) : 0;
        if (rc == 0)
            rc = form->to_flat ? kv_arrays_written(&call.state->protocols, call.flats, call.nflats)
                               : mark_layers_written(&call);
        if (rc == 0)
            rc = kv_paged_run(&call);
    }
done:
    release_call(&call);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}
