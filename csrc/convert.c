/* block_to_universal and universal_to_block.  See convert.h. */
#include "convert.h"

#include <stdio.h>
#include <string.h>

#include "cpu_copy.h"
#include "stream.h"

/* One call's arguments as they are walked and checked.  `arrays` holds the
 * nb universals, then the nb * nchunks chunks, block-major: the same order
 * as the pointer table the kernels and the CPU path read. */
typedef struct {
    kvbm_direction direction;
    kvbm_layout layout;
    intptr_t stream;
    PyObject *dlpack_stream;
    PyObject *universals; /* a list or tuple (a single array is wrapped) */
    int single_universal; /* universals was one array: its path is "universals" */
    PyObject *blocks;     /* a list or tuple */
    Py_ssize_t nb;
    int64_t nchunks;
    int64_t universal_shape[5];
    int64_t chunk_shape[3];
    kv_array *arrays;
    Py_ssize_t parsed; /* arrays[0 .. parsed) hold borrows to release */
} kv_call;

static const char *const LAYOUT_NAMES[] = {"NHD", "HND"};

/* NULL (the argument was not given) means NHD. */
static int parse_layout(PyObject *layout, kvbm_layout *out)
{
    if (layout == NULL) {
        *out = KVBM_NHD;
        return 0;
    }
    if (!PyUnicode_Check(layout)) {
        PyErr_Format(PyExc_TypeError, "layout: expected a str (\"NHD\" or \"HND\"), got %s", Py_TYPE(layout)->tp_name);
        return -1;
    }
    const char *s = PyUnicode_AsUTF8(layout);
    if (s == NULL)
        return -1;
    for (int i = 0; i < 2; i++) {
        if (strlen(s) == 3 && PyOS_strnicmp(s, LAYOUT_NAMES[i], 3) == 0) {
            *out = (kvbm_layout)i;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "layout: expected \"NHD\" or \"HND\" (any case), got %R", layout);
    return -1;
}

/* A list or tuple view of a sequence argument; arrays and strings are not
 * accepted as sequences even though they are iterable. */
static PyObject *as_sequence(PyObject *obj, const kv_path *path, const char *expected)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || kv_is_array(obj) || !PySequence_Check(obj)) {
        kv_path_error(PyExc_TypeError, path, "expected %s, got %s", expected, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PySequence_Fast(obj, "expected a sequence");
}

/* "(16, 8, 128)", or "(5,)" for one dimension. */
static void format_shape(const int64_t *shape, int ndim, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, ndim == 1 ? ",)" : ")");
}

static kv_path path_of(const kv_call *call, Py_ssize_t i)
{
    kv_path path = {"universals", {i, 0}, 1};
    if (i >= call->nb) {
        path.name = "blocks";
        path.index[0] = (i - call->nb) / call->nchunks;
        path.index[1] = (i - call->nb) % call->nchunks;
        path.depth = 2;
    }
    else if (call->single_universal) {
        path.depth = 0;
    }
    return path;
}

/* Checks arrays[i] against the call: shape, contiguity, element type (that
 * of arrays[0]) and, for destinations, writability. */
static int check_array(const kv_call *call, Py_ssize_t i)
{
    const kv_array *a = &call->arrays[i];
    const kv_path path = path_of(call, i);
    const int is_chunk = i >= call->nb;
    const int ndim = is_chunk ? 3 : 5;
    const int64_t *expected = is_chunk ? call->chunk_shape : call->universal_shape;
    char want[96], got[96];

    int same = a->ndim == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = a->shape[d] == expected[d];
    if (!same) {
        format_shape(expected, ndim, want, sizeof want);
        format_shape(a->shape, a->ndim, got, sizeof got);
        if (is_chunk)
            return kv_path_error(PyExc_ValueError, &path, "expected shape %s ([%s] for layout %s), got %s", want,
                                 call->layout == KVBM_NHD ? "nt, nh, hd" : "nh, nt, hd", LAYOUT_NAMES[call->layout], got);
        return kv_path_error(PyExc_ValueError, &path, "expected shape %s ([nh, nl, no, nt, hd] like universals[0]), got %s",
                             want, got);
    }
    const kv_array *first = &call->arrays[0];
    if (a->dtype.code != first->dtype.code || a->dtype.bits != first->dtype.bits) {
        kv_path first_path = path_of(call, 0);
        char first_where[96];
        kv_path_format(&first_path, first_where, sizeof first_where);
        return kv_path_error(PyExc_TypeError, &path, "element type %s differs from %s of %s",
                             kv_dtype_name(a->dtype, got, sizeof got), kv_dtype_name(first->dtype, want, sizeof want),
                             first_where);
    }
    if (!kv_array_is_contiguous(a))
        return kv_path_error(PyExc_ValueError, &path, "array must be C-contiguous");
    const int is_destination = is_chunk == (call->direction == KVBM_FROM_UNIVERSAL);
    if (is_destination && a->readonly)
        return kv_path_error(PyExc_ValueError, &path, "destination array is read-only");
    return 0;
}

/* Borrows `obj` into the next slot of call->arrays and checks it. */
static int add_array(kv_call *call, PyObject *obj, Py_ssize_t i)
{
    const kv_path path = path_of(call, i);
    if (kv_array_from_object(obj, &path, call->dlpack_stream, &call->arrays[i]) < 0)
        return -1;
    call->parsed = i + 1;
    return check_array(call, i);
}

/* Reads universals[0], which fixes nh, nl, no, nt, hd and the element type. */
static int read_dimensions(kv_call *call)
{
    kv_array *u = &call->arrays[0];
    const kv_path path = path_of(call, 0);
    if (kv_array_from_object(PySequence_Fast_GET_ITEM(call->universals, 0), &path, call->dlpack_stream, u) < 0)
        return -1;
    call->parsed = 1;
    if (u->ndim != 5) {
        char got[96];
        format_shape(u->shape, u->ndim, got, sizeof got);
        return kv_path_error(PyExc_ValueError, &path, "expected a 5-D [nh, nl, no, nt, hd] array, got shape %s", got);
    }
    if (u->itemsize != 1 && u->itemsize != 2 && u->itemsize != 4 && u->itemsize != 8) {
        char name[48];
        return kv_path_error(PyExc_TypeError, &path, "element type %s has %lld bytes; supported sizes are 1, 2, 4 and 8",
                             kv_dtype_name(u->dtype, name, sizeof name), (long long)u->itemsize);
    }
    memcpy(call->universal_shape, u->shape, sizeof call->universal_shape);
    const int64_t nh = u->shape[0], nl = u->shape[1], no = u->shape[2], nt = u->shape[3], hd = u->shape[4];
    call->nchunks = nl * no;
    call->chunk_shape[0] = call->layout == KVBM_NHD ? nt : nh;
    call->chunk_shape[1] = call->layout == KVBM_NHD ? nh : nt;
    call->chunk_shape[2] = hd;

    /* Segment, vector and CTA counts are 32-bit in the kernels. */
    const int64_t chunk_bytes = nt * nh * hd * u->itemsize;
    if (chunk_bytes > (int64_t)UINT32_MAX
        || (chunk_bytes > 0 && call->nb * call->nchunks * (chunk_bytes / 1024 + 1) > (int64_t)INT32_MAX))
        return kv_path_error(PyExc_ValueError, &path, "too much data for one call (%zd blocks of %lld chunks of %lld bytes); "
                             "split it into several calls", call->nb, (long long)call->nchunks, (long long)chunk_bytes);
    return check_array(call, 0);
}

/* Reads and checks every array after universals[0]. */
static int walk_arguments(kv_call *call)
{
    for (Py_ssize_t b = 1; b < call->nb; b++)
        if (add_array(call, PySequence_Fast_GET_ITEM(call->universals, b), b) < 0)
            return -1;
    for (Py_ssize_t b = 0; b < call->nb; b++) {
        const kv_path path = {"blocks", {b, 0}, 1};
        PyObject *chunks = as_sequence(PySequence_Fast_GET_ITEM(call->blocks, b), &path, "a sequence of nl*no chunk arrays");
        if (chunks == NULL)
            return -1;
        int rc = 0;
        if (PySequence_Fast_GET_SIZE(chunks) != call->nchunks)
            rc = kv_path_error(PyExc_ValueError, &path, "expected nl*no = %lld*%lld = %lld chunk arrays, got %zd",
                               (long long)call->universal_shape[1], (long long)call->universal_shape[2],
                               (long long)call->nchunks, PySequence_Fast_GET_SIZE(chunks));
        for (Py_ssize_t c = 0; rc == 0 && c < call->nchunks; c++)
            rc = add_array(call, PySequence_Fast_GET_ITEM(chunks, c), call->nb + b * call->nchunks + c);
        Py_DECREF(chunks);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* The widest vector (16, 8, 4, 2 or 1 bytes) that every address and row allows. */
static int vector_bytes(const void *const *table, Py_ssize_t count, int64_t row_bytes)
{
    uintptr_t bits = (uintptr_t)row_bytes | 16;
    for (Py_ssize_t i = 0; i < count; i++)
        bits |= (uintptr_t)table[i];
    return (int)(bits & (~bits + 1));
}

/* Checks that every array can take part in a GPU call, and finds its device. */
static int place_on_gpu(kv_call *call, Py_ssize_t count, int *device)
{
    Py_ssize_t reference = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        kv_array *a = &call->arrays[i];
        const kv_path path = path_of(call, i);
        if (kv_gpu_locate(a, &path) < 0)
            return -1;
        if (a->place != KV_DEVICE)
            continue;
        if (reference < 0) {
            reference = i;
            *device = a->device_id;
        }
        else if (a->device_id != *device) {
            kv_path first = path_of(call, reference);
            char where[96];
            kv_path_format(&first, where, sizeof where);
            return kv_path_error(PyExc_ValueError, &path, "on device cuda:%d, but %s is on cuda:%d; all device arrays "
                                 "of a call must be on one device", a->device_id, where, *device);
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (call->arrays[i].place == KV_HOST) {
            const kv_path path = path_of(call, i);
            return kv_path_error(PyExc_ValueError, &path, "in pageable host memory, but the call uses device cuda:%d, "
                                 "which needs pinned (page-locked) host memory: pin it (e.g. torch's "
                                 "tensor.pin_memory()) or move it to the device",
                                 *device);
        }
    }
    return 0;
}

static int run(kv_gpu *gpu, kv_call *call)
{
    const Py_ssize_t count = call->nb * (1 + call->nchunks);
    const kv_array *u = &call->arrays[0];
    kvbm_block_dims dims;
    dims.nb = call->nb;
    dims.nchunks = call->nchunks;
    dims.nh = u->shape[0];
    dims.nt = u->shape[3];
    dims.row_bytes = u->shape[4] * u->itemsize;
    dims.layout = call->layout;
    if (dims.nh * dims.nt * dims.row_bytes * dims.nchunks == 0)
        return 0; /* nothing to move */
    dims.nh_divisor = kvbm_divisor_make((uint32_t)dims.nh);

    int on_gpu = 0;
    for (Py_ssize_t i = 0; i < count && !on_gpu; i++)
        on_gpu = call->arrays[i].place == KV_DEVICE;
    int device = -1;
    if (on_gpu && place_on_gpu(call, count, &device) < 0)
        return -1;

    void **table = PyMem_Malloc((size_t)count * sizeof *table);
    intptr_t *producers = on_gpu ? PyMem_Malloc((size_t)count * sizeof *producers) : NULL;
    if (table == NULL || (on_gpu && producers == NULL)) {
        PyMem_Free(table);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t producer_count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const kv_array *a = &call->arrays[i];
        table[i] = a->data;
        if (on_gpu && a->has_stream) {
            Py_ssize_t k = 0;
            while (k < producer_count && producers[k] != a->stream)
                k++;
            if (k == producer_count)
                producers[producer_count++] = a->stream;
        }
    }

    int rc = 0;
    if (on_gpu) {
        rc = kv_gpu_block_universal(gpu, &dims, call->direction, table, vector_bytes((const void *const *)table, count,
                                    dims.row_bytes), device, call->stream, producers, producer_count);
    }
    else {
        Py_BEGIN_ALLOW_THREADS
        kv_cpu_block_universal(&dims, table, call->direction);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(producers);
    PyMem_Free(table);
    return rc;
}

int kv_block_universal(kv_gpu *gpu, PyObject *blocks, PyObject *universals, PyObject *layout, PyObject *stream,
                       kvbm_direction direction)
{
    kv_call call;
    memset(&call, 0, sizeof call);
    call.direction = direction;
    if (parse_layout(layout, &call.layout) < 0 || kv_stream_from_object(stream, &call.stream) < 0)
        return -1;

    int rc = -1;
    const kv_path universals_path = {"universals", {0, 0}, 0};
    const kv_path blocks_path = {"blocks", {0, 0}, 0};
    call.single_universal = kv_is_array(universals);
    if (call.single_universal)
        call.universals = PyTuple_Pack(1, universals);
    else
        call.universals = as_sequence(universals, &universals_path, "an array or a sequence of arrays");
    if (call.universals == NULL)
        goto done;
    call.blocks = as_sequence(blocks, &blocks_path, "a sequence of nb sequences of chunk arrays");
    if (call.blocks == NULL)
        goto done;
    call.nb = PySequence_Fast_GET_SIZE(call.universals);
    if (PySequence_Fast_GET_SIZE(call.blocks) != call.nb) {
        kv_path_error(PyExc_ValueError, &blocks_path, "has %zd blocks but universals has %zd",
                      PySequence_Fast_GET_SIZE(call.blocks), call.nb);
        goto done;
    }
    if (call.nb == 0) {
        rc = 0;
        goto done;
    }
    call.dlpack_stream = kv_stream_for_dlpack(call.stream);
    if (call.dlpack_stream == NULL)
        goto done;
    call.arrays = PyMem_Calloc(1, sizeof(kv_array));
    if (call.arrays == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The chunk count is known only once universals[0] has been read. */
    if (read_dimensions(&call) < 0)
        goto done;
    {
        kv_array *grown = PyMem_Realloc(call.arrays, (size_t)(call.nb * (1 + call.nchunks)) * sizeof(kv_array));
        if (grown == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        call.arrays = grown;
    }
    if (walk_arguments(&call) < 0 || run(gpu, &call) < 0)
        goto done;
    rc = 0;
done:
    for (Py_ssize_t i = 0; i < call.parsed; i++)
        kv_array_release(&call.arrays[i]);
    PyMem_Free(call.arrays);
    Py_XDECREF(call.dlpack_stream);
    Py_XDECREF(call.universals);
    Py_XDECREF(call.blocks);
    return rc;
}
