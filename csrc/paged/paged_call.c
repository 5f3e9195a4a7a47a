/* kvbm_ext.PagedKVCache: reading and checking one call of its methods.
 * See paged_internal.h; paged_run.c runs the call. */
#include "paged_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "state.h"

/* The chunk order of the operational methods: layout=, or inner=, its
 * deprecated spelling (a DeprecationWarning; TypeError when both are
 * given).  inner=None is its default, not given. */
static int read_layout(const char *function, PyObject *layout, PyObject *inner, kvbm_layout *out)
{
    if (inner == NULL || inner == Py_None)
        return kv_layout_read(layout, "layout", KV_PAGED_ARGS_LAYOUT_DEFAULT, out);
    if (layout != NULL)
        return kv_error(PyExc_TypeError, "%s() got both layout and inner, its deprecated spelling: pass layout only",
                        function);
    if (PyErr_WarnFormat(PyExc_DeprecationWarning, 1, "%s(): inner= is deprecated, pass layout= instead", function) < 0)
        return -1;
    return kv_layout_read(inner, "inner", KV_PAGED_ARGS_LAYOUT_DEFAULT, out);
}

/* Every moved layer lands on a layer from 0 on. */
static int check_layer_offset(const kv_paged_options *o)
{
    if (o->pack_layers && o->layer_offset < 0)
        return kv_error(PyExc_ValueError,
                        "layer_offset: %lld is negative, but with pack_layers=True the j-th layer "
                        "moved lands on layer layer_offset + j; it must be at least 0",
                        (long long)o->layer_offset);
    const int64_t bottom = kv_selection_bottom(&o->layers);
    if (!o->pack_layers && o->layer_offset < -bottom)
        return kv_error(PyExc_ValueError,
                        "layer_offset: %lld would put cache layer %lld at universal layer %lld; it "
                        "must be at least %lld (minus the lowest layer moved)",
                        (long long)o->layer_offset, (long long)bottom, (long long)(bottom + o->layer_offset),
                        (long long)-bottom);
    return 0;
}

int kv_paged_read_options(const kv_paged_cache *self, const char *function, const kv_paged_args *a, kv_paged_options *o)
{
    /* Offsets are bounded so that no sum with a dimension overflows. */
    if (kv_read_selection(a->layers, self->nl, "layers", "layer", &o->layers) < 0
        || kv_read_selection(a->heads, self->nh, "heads", "head", &o->heads) < 0
        || kv_parse_int(a->layer_offset, "layer_offset", -INT32_MAX, INT32_MAX, KV_PAGED_ARGS_LAYER_OFFSET_DEFAULT, 0,
                        &o->layer_offset)
               < 0
        || kv_parse_int(a->head_offset, "head_offset", 0, INT32_MAX, KV_PAGED_ARGS_HEAD_OFFSET_DEFAULT, 0,
                        &o->head_offset)
               < 0
        || kv_switch_read(a->pack_layers, "pack_layers", KV_PAGED_ARGS_PACK_LAYERS_DEFAULT, &o->pack_layers) < 0
        || read_layout(function, a->layout, a->inner, &o->layout) < 0
        || kv_move_options_read(a->backend, KV_PAGED_ARGS_BACKEND_DEFAULT, a->num_ctas, a->stream, &o->move) < 0)
        return -1;
    return check_layer_offset(o);
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

/* The repeated-id check of one call uses memory of its own (a cache holds
 * no state that calls share), sized by the ids: a bit per block, on the
 * stack up to this many bytes (caches of up to 65,536 blocks), else on the
 * heap while no larger than a copy of the ids; past that, a sorted copy. */
#define SEEN_STACK_BYTES 8192

typedef struct {
    int64_t id;
    Py_ssize_t at;
} placed_id;

/* The first position of ids[0 .. n) (all in range) repeating an earlier
 * id, that one in *earlier; n when none.  Only the bytes of `seen` the ids
 * touch are cleared: no pass over the whole bit set. */
static Py_ssize_t repeat_in_bits(const int64_t *ids, Py_ssize_t n, uint8_t *seen, Py_ssize_t *earlier)
{
    for (Py_ssize_t i = 0; i < n; i++)
        seen[ids[i] / 8] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t bit = (uint8_t)(1u << (ids[i] % 8));
        if (seen[ids[i] / 8] & bit) {
            for (*earlier = 0; ids[*earlier] != ids[i]; ++*earlier)
                ;
            return i;
        }
        seen[ids[i] / 8] |= bit;
    }
    return n;
}

static int by_id_then_position(const void *a, const void *b)
{
    const placed_id *x = a, *y = b;
    return x->id != y->id ? (x->id > y->id) - (x->id < y->id) : (x->at > y->at) - (x->at < y->at);
}

/* The same through a sorted copy: in each run of one id, the second is its
 * first repeat.  -1 with MemoryError. */
static Py_ssize_t repeat_in_sorted(const int64_t *ids, Py_ssize_t n, Py_ssize_t *earlier)
{
    placed_id *sorted = PyMem_Malloc((size_t)n * sizeof *sorted);
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        sorted[i].id = ids[i], sorted[i].at = i;
    qsort(sorted, (size_t)n, sizeof *sorted, by_id_then_position);
    Py_ssize_t first = n;
    for (Py_ssize_t k = 1, run = 0; k < n; k++) {
        if (sorted[k].id != sorted[k - 1].id)
            run = k;
        else if (k == run + 1 && sorted[k].at < first)
            first = sorted[k].at, *earlier = sorted[run].at;
    }
    PyMem_Free(sorted);
    return first;
}

static Py_ssize_t first_repeat(const int64_t *ids, Py_ssize_t n, int64_t num_blocks, Py_ssize_t *earlier)
{
    uint8_t stack[SEEN_STACK_BYTES];
    const uint64_t bytes = (uint64_t)num_blocks / 8 + 1;
    if (bytes <= sizeof stack)
        return repeat_in_bits(ids, n, stack, earlier);
    if (bytes > (uint64_t)n * sizeof(placed_id))
        return repeat_in_sorted(ids, n, earlier);
    uint8_t *seen = PyMem_Malloc((size_t)bytes);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const Py_ssize_t first = repeat_in_bits(ids, n, seen, earlier);
    PyMem_Free(seen);
    return first;
}

/* Host ids must be in range and, when `written`, each once: 0, or -1 with a
 * ValueError naming the first entry in error as name[i]. */
int kv_paged_check_ids(const int64_t *ids, Py_ssize_t n, int64_t num_blocks, int written, const char *name)
{
    Py_ssize_t bad = 0, earlier = 0;
    while (bad < n && ids[bad] >= 0 && ids[bad] < num_blocks)
        bad++;
    const Py_ssize_t repeat = !written || bad < 2 ? bad : first_repeat(ids, bad, num_blocks, &earlier);
    if (repeat < 0)
        return -1;
    if (repeat < bad)
        return kv_error(PyExc_ValueError,
                        "%s[%zd]: block id %lld repeats %s[%zd]; a block can be written once per "
                        "call",
                        name, repeat, (long long)ids[repeat], name, earlier);
    if (bad < n)
        return kv_error(PyExc_ValueError, "%s[%zd]: block id %lld is out of range [0, %lld)", name, bad,
                        (long long)ids[bad], (long long)num_blocks);
    return 0;
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
    return kv_paged_check_ids((const int64_t *)call->ids.values, call->ids.count, cache->num_blocks,
                              !call->form->to_flat, "block_ids");
}

static kv_path flat_path(const kv_paged_call *call, Py_ssize_t b)
{
    const kv_path path = {call->flat_name, {b, 0}, call->single ? 0 : 1};
    return path;
}

/* The layers of every flat block: at least this many in a universal, exactly in an operational. */
static int64_t flat_layers(const kv_paged_call *call)
{
    const kv_paged_options *o = &call->options;
    const kv_selection landing = kv_paged_landing(o);
    if (call->form->universal)
        return kv_selection_top(&landing) + 1;
    return o->pack_layers ? o->layers.count : call->cache->nl;
}

/* The shape every flat block must have, for errors: "[NH >= 8, NL >= 80, 2, 16, 128] (...)". */
static void expected_flat(const kv_paged_call *call, char *buf, size_t size)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    char layers[80];
    if (o->pack_layers)
        snprintf(layers, sizeof layers, "%lld layers moved, packed", (long long)o->layers.count);
    else
        snprintf(layers, sizeof layers, "layers up to %lld", (long long)kv_selection_top(&o->layers));
    if (call->form->universal)
        snprintf(buf, size,
                 "[NH >= %lld, NL >= %lld, %lld, %lld, %lld] ([heads, layers, no, nt, hd], head_offset %lld "
                 "+ %lld heads moved, layer_offset %lld + %s)",
                 (long long)(o->head_offset + o->heads.count), (long long)flat_layers(call), (long long)c->no,
                 (long long)c->nt, (long long)c->hd, (long long)o->head_offset, (long long)o->heads.count,
                 (long long)o->layer_offset, layers);
    else
        snprintf(buf, size, "[%lld, %lld, %lld] (%s, no, nt*nh*hd])", (long long)flat_layers(call), (long long)c->no,
                 (long long)(c->nt * c->nh * c->hd), o->pack_layers ? "[len(layers)" : "[nl");
}

/* Whether a flat block's shape fits the cache and the options. */
static int flat_shape_fits(const kv_paged_call *call, const int64_t *shape)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    if (!call->form->universal)
        return shape[0] == flat_layers(call) && shape[1] == c->no && shape[2] == c->nt * c->nh * c->hd;
    return shape[0] >= o->head_offset + o->heads.count && shape[1] >= flat_layers(call) && shape[2] == c->no
           && shape[3] == c->nt && shape[4] == c->hd;
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
                         call->single ? "one " : "a ", call->flat_ndim + call->single, call->single ? "[nb] + " : "",
                         want, got);
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
            return kv_path_error(PyExc_ValueError, &path,
                                 "the blocks %s (leading stride %lld bytes, %lld bytes per "
                                 "block)",
                                 a->strides[0] < 0 ? "run backwards" : "overlap", (long long)a->strides[0],
                                 (long long)block_bytes);
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

/* The aliasing check's view of a call (overlap.h): each flat block
 * against the layers and heads the call moves (paged_alias.c), and the
 * flat blocks against each other when they are written (each is
 * contiguous: their spans are their bytes). */
static int flats_written(const void *call, Py_ssize_t i)
{
    (void)i;
    return ((const kv_paged_call *)call)->form->to_flat;
}

static kv_path flat_path_of(const void *call, Py_ssize_t i) { return flat_path(call, i); }

static int flat_against_cache(const void *c, Py_ssize_t i)
{
    const kv_paged_call *call = c;
    const kv_path flat = flat_path(call, i);
    return kv_paged_check_flat(call->cache, &call->options.layers, &call->options.heads, &call->flats[i], &flat,
                               call->form->to_flat);
}

static int check_aliasing(const kv_paged_call *call)
{
    const kv_alias_check check = {.call = call,
                                  .arrays = call->flats,
                                  .count = call->nflats,
                                  .writes = flats_written,
                                  .path = flat_path_of,
                                  .against_fixed = flat_against_cache};
    return kv_check_aliasing(&check);
}

/* Each torch layer a call writes is checked as a destination now
 * (requires_grad may have been set since construction), and their version
 * counters are bumped, as the list API does for its destinations
 * (kv_arrays_written): all distinct counters at once when every layer is
 * written, else those of the layers selected.  Inference tensors need
 * neither (kv_torch_counter_owner). */
int kv_paged_mark_written(const kv_paged_cache *cache, kv_protocols *p, const kv_selection *layers)
{
    /* One array holds every layer, or layer l is array l (both of a
     * (K, V) pair). */
    const int every = cache->narrays == 1 || layers->count == cache->nl;
    const int per_layer = cache->kv_pairs ? 2 : 1;
    const Py_ssize_t count = cache->narrays == 1 ? 1 : (Py_ssize_t)layers->count * per_layer;
    PyObject *bump = NULL;
    if (!every && cache->distinct_counters != NULL && (bump = PyList_New(0)) == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t k = 0; rc == 0 && k < count; k++) {
        const Py_ssize_t i =
            cache->narrays == 1 ? 0
                                : kv_paged_array_of(cache, layers->first + k / per_layer * layers->step, k % per_layer);
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
    kv_paged_args a;
    if (kv_parse_arguments(form->signature, args, nargs, kwnames, &a) < 0)
        return NULL;
    kv_paged_call call;
    memset(&call, 0, sizeof call);
    call.cache = self;
    call.state = PyType_GetModuleState(Py_TYPE(self)); /* not subclassable: the module's own type */
    call.form = form;
    call.flat_name = form->universal ? "universals" : "operationals";
    PyObject *flats = form->universal ? a.universals : a.operationals;
    int rc = -1;
    if (kv_paged_read_options(self, form->signature->name, &a, &call.options) < 0)
        goto done;
    if (!form->to_flat && self->readonly) {
        PyErr_SetString(PyExc_ValueError, "layers: the cache is read-only, so blocks cannot be written into it");
        goto done;
    }
    kv_target_init(&call.target, call.options.move.stream, self->device, "the cache is");
    call.reader.protocols = &call.state->protocols;
    call.reader.dlpack_stream = kv_stream_for_dlpack(call.options.move.stream);
    if (call.reader.dlpack_stream == NULL
        || kv_paged_check_layers(self, "layers", &call.reader, &call.options.layers) < 0
        || (!form->to_flat && kv_paged_check_written(self, &call.options.layers, "layers") < 0)
        || read_block_ids(&call, a.block_ids) < 0 || read_flats(&call, flats) < 0 || check_aliasing(&call) < 0)
        goto done;
    const int64_t chunk_bytes = call.options.heads.count * self->nt * self->hd * self->itemsize;
    const int64_t layers_moved = call.options.layers.count;
    if (!kvbm_fits_one_launch(call.ids.count, layers_moved * self->no, chunk_bytes)) {
        PyErr_Format(PyExc_ValueError,
                     "block_ids: too much data for one call (%zd blocks of %lld layers of %lld "
                     "bytes); split it into several calls",
                     call.ids.count, (long long)layers_moved, (long long)(self->no * chunk_bytes));
        goto done;
    }
    rc = 0;
    if (call.ids.count > 0 && layers_moved > 0 && self->no * chunk_bytes > 0) {
        rc = self->device < 0 ? kv_move_options_check_host(&call.options.move) : 0;
        if (rc == 0)
            rc = form->to_flat ? kv_arrays_written(&call.state->protocols, call.flats, call.nflats)
                               : kv_paged_mark_written(self, &call.state->protocols, &call.options.layers);
        if (rc == 0)
            rc = kv_paged_run(&call);
    }
done:
    release_call(&call);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}
