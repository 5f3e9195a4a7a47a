/* The layout conversions between block stacks, universal and operational
 * blocks: reading and checking a call's arguments.  See convert.h;
 * convert_run.c runs the call. */
#include "convert.h"

#include <string.h>

#include "args.h"
#include "convert_run.h"
#include "signatures.h"

/* What an array of the other side must look like, for error messages. */
static const char *other_shape_hint(const kv_call *call)
{
    if (!call->other_is_blocks)
        return "[nl, no, nt*nh*hd] matching universals[0]";
    if (call->conversion == KV_BLOCK_OPERATIONAL)
        return "the shape of blocks[0][0]";
    return call->layout == KVBM_NHD ? "[nt, nh, hd] for layout NHD" : "[nh, nt, hd] for layout HND";
}

/* The shape a block of `side` must have, `expected`, as the argument shows
 * it: with the block count first when the side is one stack. */
static void format_expected(const kv_side *side, const int64_t *expected, int ndim, char *buf, size_t size)
{
    int64_t shape[KV_MAX_NDIM];
    const int stacked = side != NULL && side->stacked;
    shape[0] = side != NULL ? side->nb : 0;
    memcpy(shape + stacked, expected, (size_t)ndim * sizeof(int64_t));
    kv_format_shape(shape, ndim + stacked, buf, size);
}

/* Checks arrays[i] against the call: shape, contiguity and element type
 * (that of arrays[0]); kv_array_read checked that destinations are
 * writable. */
static int check_array(const kv_call *call, Py_ssize_t i)
{
    const kv_array *a = &call->arrays[i];
    const kv_path path = kv_call_path(call, i);
    const kv_side *side = kv_call_side(call, i);
    const int is_flat = i < call->nb;
    const int ndim = is_flat ? call->flat_ndim : 3;
    const int64_t *expected = is_flat ? call->flat_shape : call->other_shape;
    char want[128], got[96];

    int same = a->ndim == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = a->shape[d] == expected[d];
    if (!same) {
        format_expected(side, expected, ndim, want, sizeof want);
        if (side != NULL && side->has_whole)
            kv_format_shape(side->whole.shape, side->whole.ndim, got, sizeof got);
        else
            kv_format_shape(a->shape, a->ndim, got, sizeof got);
        const char *prefix = side != NULL && side->stacked ? "[nb, " : "[";
        if (is_flat)
            return kv_path_error(PyExc_ValueError, &path, "expected shape %s (%s%s like %s[0]), got %s", want, prefix,
                                 call->flat_ndim == 5 ? "nh, nl, no, nt, hd]" : "nl, no, nt*nh*hd]", call->flat.name,
                                 got);
        return kv_path_error(PyExc_ValueError, &path, "expected shape %s (%s), got %s", want, other_shape_hint(call),
                             got);
    }
    const kv_array *first = &call->arrays[0];
    if (a->dtype.code != first->dtype.code || a->dtype.bits != first->dtype.bits) {
        kv_path first_path = kv_call_path(call, 0);
        char first_where[96];
        kv_path_format(&first_path, first_where, sizeof first_where);
        return kv_path_error(PyExc_TypeError, &path, "element type %s differs from %s of %s",
                             kv_dtype_name(a->dtype, got, sizeof got), kv_dtype_name(first->dtype, want, sizeof want),
                             first_where);
    }
    if (!kv_array_is_contiguous(a))
        return kv_path_error(PyExc_ValueError, &path, "array must be C-contiguous");
    return 0;
}

/* Fills arrays[i]: block b of its side, borrowed from the side's sequence,
 * or a view of the side's one array. */
static int borrow_block(kv_call *call, const kv_side *side, Py_ssize_t b, Py_ssize_t i)
{
    kv_array *a = &call->arrays[i];
    if (side->has_whole) {
        if (side->stacked)
            kv_array_block(&side->whole, b, a);
        else {
            *a = side->whole;
            a->owner = NULL; /* the whole keeps the borrow */
            a->has_view = 0;
            a->written_tensor = NULL;
        }
        call->parsed = i + 1;
        return 0;
    }
    const kv_path path = kv_call_path(call, i);
    if (kv_array_read(&call->reader, PyTuple_GET_ITEM(side->items, b), &path, kv_call_writes(call, i), a) < 0)
        return -1;
    call->parsed = i + 1;
    return 0;
}

/* Borrows chunk `obj` into arrays[i]. */
static int borrow_chunk(kv_call *call, PyObject *obj, Py_ssize_t i)
{
    const kv_path path = kv_call_path(call, i);
    if (kv_array_read(&call->reader, obj, &path, kv_call_writes(call, i), &call->arrays[i]) < 0)
        return -1;
    call->parsed = i + 1;
    return 0;
}

/* The chunk shape of a block <-> operational call is that of blocks[0][0]
 * (chunks are copied whole, in their own order): it must hold inner
 * elements. */
static int read_first_chunk(kv_call *call, PyObject *chunk)
{
    const Py_ssize_t i = call->nb;
    if (borrow_chunk(call, chunk, i) < 0)
        return -1;
    const kv_array *a = &call->arrays[i];
    const kv_path path = kv_call_path(call, i);
    const int64_t inner = call->flat_shape[2];
    char got[96];
    kv_format_shape(a->shape, a->ndim, got, sizeof got);
    if (a->ndim != 3 || a->shape[0] * a->shape[1] * a->shape[2] != inner)
        return kv_path_error(PyExc_ValueError, &path,
                             "expected a 3-D chunk of %lld elements (the last dimension of "
                             "operationals[0], nt*nh*hd), got shape %s",
                             (long long)inner, got);
    memcpy(call->other_shape, a->shape, sizeof call->other_shape);
    return check_array(call, i);
}

/* Reads flat[0], which fixes the dimensions and the element type. */
static int read_dimensions(kv_call *call)
{
    kv_array *f = &call->arrays[0];
    const kv_path path = kv_call_path(call, 0);
    if (borrow_block(call, &call->flat, 0, 0) < 0)
        return -1;
    const int is_universal = call->conversion != KV_BLOCK_OPERATIONAL;
    if (f->ndim != call->flat_ndim) {
        char got[96];
        kv_format_shape(f->shape, f->ndim, got, sizeof got);
        return kv_path_error(PyExc_ValueError, &path, "expected a %d-D %s array, got shape %s", call->flat_ndim,
                             is_universal ? "[nh, nl, no, nt, hd]" : "[nl, no, nt*nh*hd]", got);
    }
    if (kv_check_itemsize(f, &path) < 0)
        return -1;
    if (kv_array_elements(f) == 0) {
        /* Nothing to move, and the extents may be anything: allocate and
         * multiply nothing by them. */
        call->empty = 1;
        return 0;
    }
    memcpy(call->flat_shape, f->shape, (size_t)call->flat_ndim * sizeof(int64_t));
    int64_t chunk_elements;
    if (is_universal) {
        const int64_t nh = f->shape[0], nl = f->shape[1], no = f->shape[2], nt = f->shape[3], hd = f->shape[4];
        call->nchunks = nl * no;
        chunk_elements = nt * nh * hd;
        if (call->other_is_blocks) {
            call->other_shape[0] = call->layout == KVBM_NHD ? nt : nh;
            call->other_shape[1] = call->layout == KVBM_NHD ? nh : nt;
            call->other_shape[2] = hd;
        }
        else {
            call->other_shape[0] = nl;
            call->other_shape[1] = no;
            call->other_shape[2] = chunk_elements;
        }
    }
    else {
        call->nchunks = f->shape[0] * f->shape[1];
        chunk_elements = f->shape[2];
    }

    const int64_t chunk_bytes = chunk_elements * f->itemsize;
    if (!kvbm_fits_one_launch(call->nb, call->nchunks, chunk_bytes))
        return kv_path_error(PyExc_ValueError, &path,
                             "too much data for one call (%zd blocks of %lld chunks of %lld "
                             "bytes); split it into several calls",
                             call->nb, (long long)call->nchunks, (long long)chunk_bytes);
    return check_array(call, 0);
}

/* Reads and checks every array after flat[0]. */
static int walk_arguments(kv_call *call)
{
    for (Py_ssize_t b = 1; b < call->nb; b++)
        if (borrow_block(call, &call->flat, b, b) < 0 || check_array(call, b) < 0)
            return -1;
    if (!call->other_is_blocks) {
        for (Py_ssize_t b = 0; b < call->nb; b++)
            if (borrow_block(call, &call->other, b, call->nb + b) < 0 || check_array(call, call->nb + b) < 0)
                return -1;
        return 0;
    }
    for (Py_ssize_t b = 0; b < call->nb; b++) {
        const kv_path path = {call->other.name, {b, 0}, 1};
        PyObject *chunks =
            kv_as_sequence(PyTuple_GET_ITEM(call->other.items, b), &path, "a sequence of nl*no chunk arrays");
        if (chunks == NULL)
            return -1;
        int rc = 0;
        if (PyTuple_GET_SIZE(chunks) != call->nchunks)
            rc = kv_path_error(PyExc_ValueError, &path, "expected nl*no = %lld chunk arrays, got %zd",
                               (long long)call->nchunks, PyTuple_GET_SIZE(chunks));
        for (Py_ssize_t c = 0; rc == 0 && c < call->nchunks; c++) {
            const Py_ssize_t i = call->nb + b * call->nchunks + c;
            PyObject *chunk = PyTuple_GET_ITEM(chunks, c);
            if (i == call->nb && call->conversion == KV_BLOCK_OPERATIONAL)
                rc = read_first_chunk(call, chunk);
            else
                rc = borrow_chunk(call, chunk, i) < 0 || check_array(call, i) < 0 ? -1 : 0;
        }
        Py_DECREF(chunks);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* Reads one side's argument (`block_ndim`: a block's dimensions, 5 for
 * universals, 3 for operationals): a sequence is snapshotted; one array is
 * borrowed now, to tell a single block from a stack. */
static int read_side(kv_call *call, kv_side *side, PyObject *obj, int block_ndim, int write)
{
    const kv_path path = {side->name, {0, 0}, 0};
    int single;
    side->items = kv_array_items(obj, &path, "an array or a sequence of arrays", &single);
    if (side->items == NULL)
        return -1;
    if (!single) {
        side->nb = PyTuple_GET_SIZE(side->items);
        return 0;
    }
    kv_array *a = &side->whole;
    if (kv_array_read(&call->reader, PyTuple_GET_ITEM(side->items, 0), &path, write, a) < 0)
        return -1;
    side->has_whole = 1;
    if (a->ndim == block_ndim) {
        side->nb = 1;
        return 0;
    }
    const char *block = block_ndim == 5 ? "nh, nl, no, nt, hd]" : "nl, no, nt*nh*hd]";
    char got[96];
    kv_format_shape(a->shape, a->ndim, got, sizeof got);
    if (a->ndim != block_ndim + 1)
        return kv_path_error(PyExc_ValueError, &path,
                             "expected a %d-D [%s array (one block) or a %d-D [nb, %s array, "
                             "got shape %s",
                             block_ndim, block, block_ndim + 1, block, got);
    side->stacked = 1;
    side->nb = (Py_ssize_t)a->shape[0];
    if (!kv_array_is_contiguous_from(a, 1))
        return kv_path_error(PyExc_ValueError, &path,
                             "every block (all dimensions after the first) must be "
                             "C-contiguous, got shape %s",
                             got);
    if (write && side->nb > 1 && kv_array_elements(a) > 0) {
        /* Blocks that overlap would be written twice, in an order that
         * decides the result. */
        const int64_t block_bytes = kv_array_elements(a) / a->shape[0] * a->itemsize;
        if (a->strides[0] < block_bytes)
            return kv_path_error(PyExc_ValueError, &path,
                                 "the blocks %s (leading stride %lld bytes, %lld bytes per "
                                 "block); a destination's blocks may not overlap",
                                 a->strides[0] < 0 ? "run backwards" : "overlap", (long long)a->strides[0],
                                 (long long)block_bytes);
    }
    return 0;
}

/* The Python function a call came through, for the debug log. */
static const char *function_name(kv_conversion conversion, int to_flat)
{
    switch (conversion) {
    case KV_BLOCK_UNIVERSAL: return to_flat ? "block_to_universal" : "universal_to_block";
    case KV_UNIVERSAL_OPERATIONAL: return to_flat ? "operational_to_universal" : "universal_to_operational";
    default: return to_flat ? "block_to_operational" : "operational_to_block";
    }
}

/* Both sides hold nb blocks; a side given as a stack whose leading
 * dimension disagrees is named, else the other side. */
static int check_block_counts(const kv_call *call)
{
    const kv_side *flat = &call->flat, *other = &call->other;
    if (other->nb == flat->nb)
        return 0;
    const kv_side *wrong = flat->stacked && !other->stacked ? flat : other;
    const kv_side *right = wrong == flat ? other : flat;
    PyErr_Format(PyExc_ValueError, "%s: has %zd blocks%s but %s has %zd", wrong->name, wrong->nb,
                 wrong->stacked ? " (its leading dimension)" : "", right->name, right->nb);
    return -1;
}

int kv_convert(kv_state *state, kv_conversion conversion, int to_flat, PyObject *flat, PyObject *other,
               PyObject *layout, PyObject *backend, PyObject *num_ctas, PyObject *stream)
{
    kv_call call;
    memset(&call, 0, sizeof call);
    call.state = state;
    call.conversion = conversion;
    call.to_flat = to_flat;
    call.flat.name = conversion == KV_BLOCK_OPERATIONAL ? "operationals" : "universals";
    call.other.name = conversion == KV_UNIVERSAL_OPERATIONAL ? "operationals" : "blocks";
    call.other_is_blocks = conversion != KV_UNIVERSAL_OPERATIONAL;
    call.flat_ndim = conversion == KV_BLOCK_OPERATIONAL ? 3 : 5;
    call.function = function_name(conversion, to_flat);
    if (kv_layout_read(layout, "layout", KV_CONVERSION_ARGS_LAYOUT_DEFAULT, &call.layout) < 0
        || kv_move_options_read(backend, KV_CONVERSION_ARGS_BACKEND_DEFAULT, num_ctas, stream, &call.options) < 0)
        return -1;
    call.reader.protocols = &state->protocols;
    call.reader.dlpack_stream = kv_stream_for_dlpack(call.options.stream);
    if (call.reader.dlpack_stream == NULL)
        return -1;

    int rc = -1;
    const kv_path other_path = {call.other.name, {0, 0}, 0};
    if (read_side(&call, &call.flat, flat, call.flat_ndim, to_flat) < 0)
        goto done;
    if (!call.other_is_blocks) {
        if (read_side(&call, &call.other, other, 3, !to_flat) < 0)
            goto done;
    }
    else if ((call.other.items = kv_as_sequence(other, &other_path, "a sequence of nb sequences of chunk arrays"))
             == NULL)
        goto done;
    else
        call.other.nb = PyTuple_GET_SIZE(call.other.items);
    if (check_block_counts(&call) < 0)
        goto done;
    call.nb = call.flat.nb;
    if (call.nb == 0) {
        rc = 0;
        goto done;
    }
    call.arrays = PyMem_Calloc(1, sizeof(kv_array));
    if (call.arrays == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The chunk count is known only once flat[0] has been read. */
    if (read_dimensions(&call) < 0)
        goto done;
    if (call.empty) {
        rc = 0;
        goto done;
    }
    {
        kv_array *grown = PyMem_Realloc(call.arrays, (size_t)kv_call_count(&call) * sizeof(kv_array));
        if (grown == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        call.arrays = grown;
    }
    if (walk_arguments(&call) < 0 || kv_convert_run(&call) < 0)
        goto done;
    rc = 0;
done:
    for (Py_ssize_t i = 0; i < call.parsed; i++)
        kv_array_release(&call.arrays[i]);
    PyMem_Free(call.arrays);
    kv_side *sides[2] = {&call.flat, &call.other};
    for (int i = 0; i < 2; i++) {
        if (sides[i]->has_whole)
            kv_array_release(&sides[i]->whole);
        Py_XDECREF(sides[i]->items);
    }
    Py_XDECREF(call.reader.dlpack_stream);
    return rc;
}
