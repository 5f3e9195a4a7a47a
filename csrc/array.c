/* Borrowing arrays from Python objects.  See array.h. */
#include "array.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "gpu.h"

static const char CAPSULE_VERSIONED[] = "dltensor_versioned";
static const char CAPSULE_LEGACY[] = "dltensor";

void kv_path_format(const kv_path *path, char *buf, size_t size)
{
    int n = snprintf(buf, size, "%s", path->name);
    for (int i = 0; i < path->depth && n >= 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - (size_t)n, "[%zd]", path->index[i]);
}

int kv_path_error(PyObject *type, const kv_path *path, const char *format, ...)
{
    char where[96];
    kv_path_format(path, where, sizeof where);
    va_list args;
    va_start(args, format);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (message != NULL) {
        PyErr_Format(type, "%s: %U", where, message);
        Py_DECREF(message);
    }
    return -1;
}

int kv_is_array(PyObject *obj)
{
    return PyObject_HasAttrString(obj, "__dlpack__")
        || PyObject_HasAttrString(obj, "__cuda_array_interface__")
        || PyObject_HasAttrString(obj, "__array_interface__")
        || PyObject_CheckBuffer(obj);
}

const char *kv_dtype_name(kv_dtype dtype, char *buf, size_t size)
{
    const char *kind;
    switch (dtype.code) {
    case kDLInt: kind = "int"; break;
    case kDLUInt: kind = "uint"; break;
    case kDLFloat: kind = "float"; break;
    case kDLBfloat: kind = "bfloat"; break;
    case kDLComplex: kind = "complex"; break;
    case kDLBool: snprintf(buf, size, "bool"); return buf;
    case kDLFloat8_e3m4: snprintf(buf, size, "float8_e3m4"); return buf;
    case kDLFloat8_e4m3: snprintf(buf, size, "float8_e4m3"); return buf;
    case kDLFloat8_e4m3b11fnuz: snprintf(buf, size, "float8_e4m3b11fnuz"); return buf;
    case kDLFloat8_e4m3fn: snprintf(buf, size, "float8_e4m3fn"); return buf;
    case kDLFloat8_e4m3fnuz: snprintf(buf, size, "float8_e4m3fnuz"); return buf;
    case kDLFloat8_e5m2: snprintf(buf, size, "float8_e5m2"); return buf;
    case kDLFloat8_e5m2fnuz: snprintf(buf, size, "float8_e5m2fnuz"); return buf;
    case kDLFloat8_e8m0fnu: snprintf(buf, size, "float8_e8m0fnu"); return buf;
    case KV_RAW_CODE: kind = "raw"; break;
    default: snprintf(buf, size, "dlpack_type_%u_%u", dtype.code, dtype.bits); return buf;
    }
    snprintf(buf, size, "%s%u", kind, dtype.code == KV_RAW_CODE ? dtype.bits / 8u : dtype.bits);
    return buf;
}

int kv_array_is_contiguous(const kv_array *a) { return kv_array_is_contiguous_from(a, 0); }

int kv_array_is_contiguous_from(const kv_array *a, int first)
{
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] == 0)
            return 1; /* no elements: any strides will do (torch reports 0 for them) */
    int64_t expected = a->itemsize;
    for (int i = a->ndim - 1; i >= first; i--) {
        if (a->shape[i] != 1 && a->strides[i] != expected)
            return 0;
        expected *= a->shape[i];
    }
    return 1;
}

void kv_array_add_producer(const kv_array *a, intptr_t *streams, Py_ssize_t *count)
{
    if (!a->has_stream)
        return;
    for (Py_ssize_t k = 0; k < *count; k++)
        if (streams[k] == a->stream)
            return;
    streams[(*count)++] = a->stream;
}

int kv_arrays_default_stream(const kv_array *arrays, Py_ssize_t count, int device, intptr_t *stream)
{
    *stream = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (arrays[i].current_work_stream != NULL) {
            void *current = NULL;
            if (arrays[i].current_work_stream(kDLCUDA, device, &current) != 0)
                return -1;
            *stream = (intptr_t)current;
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (arrays[i].place == KV_DEVICE && arrays[i].has_stream) {
            *stream = arrays[i].stream;
            return 0;
        }
    }
    return 0;
}

static void set_compact_strides(kv_array *a)
{
    int64_t stride = a->itemsize;
    for (int i = a->ndim - 1; i >= 0; i--) {
        a->strides[i] = stride;
        stride *= a->shape[i];
    }
}

static int check_ndim(const kv_path *path, Py_ssize_t ndim)
{
    if (ndim < 0 || ndim > KV_MAX_NDIM)
        return kv_path_error(PyExc_ValueError, path, "arrays of %zd dimensions are not supported (at most %d)",
                             ndim, KV_MAX_NDIM);
    return 0;
}

/* ---------------------------------------------------------------- DLPack */

/* The capsule's tensor, or NULL with an exception set.  *flags and the
 * version check come from the versioned form; a legacy capsule has none. */
static DLTensor *capsule_tensor(PyObject *capsule, const kv_path *path, uint64_t *flags)
{
    *flags = 0;
    if (PyCapsule_IsValid(capsule, CAPSULE_VERSIONED)) {
        DLManagedTensorVersioned *managed = PyCapsule_GetPointer(capsule, CAPSULE_VERSIONED);
        if (managed == NULL)
            return NULL;
        if (managed->version.major != 1) {
            /* An unknown ABI: only the deleter may be touched.  Rename the
             * capsule so its destructor does not call the deleter again. */
            unsigned major = managed->version.major;
            if (PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0)
                return NULL;
            if (managed->deleter != NULL)
                managed->deleter(managed);
            kv_path_error(PyExc_BufferError, path, "DLPack major version %u is not supported (expected 1)", major);
            return NULL;
        }
        *flags = managed->flags;
        return &managed->dl_tensor;
    }
    if (PyCapsule_IsValid(capsule, CAPSULE_LEGACY)) {
        DLManagedTensor *managed = PyCapsule_GetPointer(capsule, CAPSULE_LEGACY);
        return managed == NULL ? NULL : &managed->dl_tensor;
    }
    kv_path_error(PyExc_TypeError, path, "__dlpack__() returned %R, not a DLPack capsule", capsule);
    return NULL;
}

/* Fills *out from a DLPack tensor (everything but the owner and the
 * read-only flag). */
static int fill_from_dltensor(const DLTensor *t, const kv_path *path, kv_array *out)
{
    const int type = t->device.device_type;
    if (type != kDLCPU && type != kDLCUDA && type != kDLCUDAHost && type != kDLCUDAManaged)
        return kv_path_error(PyExc_ValueError, path,
                             "DLPack device type %d is not supported (expected CPU, CUDA, CUDA host or CUDA managed "
                             "memory)", type);
    if (check_ndim(path, t->ndim) < 0)
        return -1;
    if (t->dtype.lanes != 1 || t->dtype.bits % 8 != 0 || t->dtype.bits == 0)
        return kv_path_error(PyExc_TypeError, path, "DLPack element type (code %u, %u bits, %u lanes) is not supported",
                             t->dtype.code, t->dtype.bits, t->dtype.lanes);
    out->data = (char *)t->data + t->byte_offset;
    out->ndim = t->ndim;
    out->itemsize = t->dtype.bits / 8;
    out->dtype.code = t->dtype.code;
    out->dtype.bits = t->dtype.bits;
    for (int i = 0; i < t->ndim; i++)
        out->shape[i] = t->shape[i];
    if (t->strides == NULL)
        set_compact_strides(out);
    else
        for (int i = 0; i < t->ndim; i++)
            if (__builtin_mul_overflow(t->strides[i], out->itemsize, &out->strides[i]))
                return kv_path_error(PyExc_ValueError, path, "DLPack stride %lld of dimension %d overflows in bytes",
                                     (long long)t->strides[i], i);
    out->place = type == kDLCPU ? KV_HOST : type == kDLCUDAHost ? KV_HOST_PINNED : KV_DEVICE;
    out->device_id = t->device.device_id;
    return 0;
}

/* obj.__dlpack__(stream=stream, max_version=(1, 3)), retried without
 * max_version for producers that predate it (they raise TypeError). */
static PyObject *call_dlpack(PyObject *obj, PyObject *stream)
{
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (method == NULL)
        return NULL;
    PyObject *args[] = {stream, NULL};
    PyObject *names = Py_BuildValue("(ss)", "stream", "max_version");
    PyObject *capsule = NULL;
    if (names != NULL) {
        args[1] = Py_BuildValue("(ii)", 1, 3);
        if (args[1] != NULL)
            capsule = PyObject_Vectorcall(method, args, 0, names);
        Py_XDECREF(args[1]);
    }
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyObject *stream_only = PyTuple_GetSlice(names, 0, 1);
        if (stream_only != NULL)
            capsule = PyObject_Vectorcall(method, args, 0, stream_only);
        Py_XDECREF(stream_only);
    }
    Py_XDECREF(names);
    Py_DECREF(method);
    return capsule;
}

/* The (device_type, device_id) of obj.__dlpack_device__(). */
static int dlpack_device(PyObject *obj, const kv_path *path, int *type, int *id)
{
    PyObject *device = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (device == NULL)
        return -1;
    int rc = -1;
    if (!PyTuple_Check(device) || PyTuple_GET_SIZE(device) != 2)
        kv_path_error(PyExc_TypeError, path, "__dlpack_device__() must return a (device_type, device_id) tuple");
    else {
        /* The tuple owns its items while their __index__ runs. */
        const long device_type = PyLong_AsLong(PyTuple_GET_ITEM(device, 0));
        const long device_id = device_type == -1 && PyErr_Occurred() ? -1 : PyLong_AsLong(PyTuple_GET_ITEM(device, 1));
        if (PyErr_Occurred() || device_type < 0 || device_type > INT32_MAX || device_id < 0 || device_id > INT32_MAX) {
            PyErr_Clear();
            kv_path_error(PyExc_TypeError, path, "__dlpack_device__() returned %R, not two ints from 0 to 2**31 - 1",
                          device);
        }
        else {
            *type = (int)device_type;
            *id = (int)device_id;
            rc = 0;
        }
    }
    Py_DECREF(device);
    return rc;
}

static int from_dlpack(PyObject *obj, const kv_path *path, PyObject *cuda_stream, kv_array *out)
{
    int device_type = 0, device_id = 0;
    if (dlpack_device(obj, path, &device_type, &device_id) < 0)
        return -1;
    if (device_type != kDLCPU && device_type != kDLCUDA && device_type != kDLCUDAHost
        && device_type != kDLCUDAManaged)
        return kv_path_error(PyExc_ValueError, path,
                             "DLPack device type %d is not supported (expected CPU, CUDA, CUDA host or CUDA managed memory)",
                             device_type);

    /* The stream argument asks the producer to order its pending work before
     * the consumer's stream; it means nothing for host memory.  The array's
     * device is made current for the call, as torch requires. */
    const int on_device = device_type == kDLCUDA || device_type == kDLCUDAManaged;
    int previous = -1;
    if (on_device && kv_gpu_use_device(device_id, &previous) < 0)
        return -1;
    PyObject *capsule = call_dlpack(obj, on_device ? cuda_stream : Py_None);
    kv_gpu_restore_device(previous);
    if (capsule == NULL)
        return -1;
    uint64_t flags;
    DLTensor *t = capsule_tensor(capsule, path, &flags);
    if (t == NULL || fill_from_dltensor(t, path, out) < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    out->readonly = (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    /* The capsule keeps the tensor alive; its destructor calls the deleter
     * because the capsule is never renamed to used_*. */
    out->owner = capsule;
    return 0;
}

/* ------------------------------------------------ DLPack C exchange API */

/* The exchange API of recently seen types, or NULL for types without one:
 * asking a type costs an attribute lookup (an AttributeError for most
 * types), far more than the call it saves.  Entries hold a reference to
 * their type, so an address is never reused by another type while cached;
 * the slots are recycled in turn.  Guarded by the GIL. */
#define KV_EXCHANGE_TYPES 8
static struct {
    PyTypeObject *type;
    const DLPackExchangeAPI *api;
} exchange_types[KV_EXCHANGE_TYPES];
static int exchange_next;

static const DLPackExchangeAPI *exchange_api(PyTypeObject *type)
{
    for (int i = 0; i < KV_EXCHANGE_TYPES; i++)
        if (exchange_types[i].type == type)
            return exchange_types[i].api;
    const DLPackExchangeAPI *api = NULL;
    PyObject *capsule = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
    if (capsule == NULL)
        PyErr_Clear();
    else {
        const DLPackExchangeAPI *found = PyCapsule_IsValid(capsule, "dlpack_exchange_api")
                                             ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api")
                                             : NULL;
        /* A major version other than 1 may have another layout. */
        if (found != NULL && found->header.version.major == 1 && found->dltensor_from_py_object_no_sync != NULL
            && found->current_work_stream != NULL)
            api = found;
        Py_DECREF(capsule);
    }
    Py_XSETREF(exchange_types[exchange_next].type, (PyTypeObject *)Py_NewRef(type));
    exchange_types[exchange_next].api = api;
    exchange_next = (exchange_next + 1) % KV_EXCHANGE_TYPES;
    return api;
}

/* Fills *out through the producer's C function.  The producer does not
 * synchronize: its current stream on the array's device becomes the array's
 * producer stream, which the call orders before its own, as
 * __dlpack__(stream=...) would.  Returns 0, -1 with an exception, or 1 when
 * the producer cannot describe obj (the Python protocols then try). */
static int from_exchange(PyObject *obj, const DLPackExchangeAPI *api, const kv_path *path, kv_array *out)
{
    DLTensor t;
    if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
        PyErr_Clear();
        return 1;
    }
    if (fill_from_dltensor(&t, path, out) < 0)
        return -1;
    if (out->place == KV_DEVICE) {
        void *stream = NULL;
        if (api->current_work_stream(t.device.device_type, t.device.device_id, &stream) != 0)
            return -1;
        out->has_stream = 1;
        out->stream = (intptr_t)stream;
    }
    out->current_work_stream = api->current_work_stream;
    /* The DLTensor carries no read-only flag: the array is taken as writable. */
    out->owner = Py_NewRef(obj);
    return 0;
}

/* ----------------------------------------------- typestr-based interfaces */

/* Parses a NumPy typestr such as "<f2", "|u1", "<V2". */
static int parse_typestr(PyObject *typestr, const kv_path *path, kv_array *out)
{
    const char *s = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
    if (s == NULL) {
        PyErr_Clear();
        return kv_path_error(PyExc_TypeError, path, "typestr must be a str, got %R", typestr);
    }
    char order = s[0], kind = s[0] ? s[1] : 0;
    long size = (kind != 0) ? strtol(s + 2, NULL, 10) : 0;
    if (size <= 0 || size > 255 / 8)
        return kv_path_error(PyExc_TypeError, path, "typestr %R is not supported", typestr);
    if (order == '>' && size > 1)
        return kv_path_error(PyExc_TypeError, path, "typestr %R: big-endian data is not supported", typestr);
    uint8_t code;
    switch (kind) {
    case 'f': code = kDLFloat; break;
    case 'i': code = kDLInt; break;
    case 'u': code = kDLUInt; break;
    case 'b': code = kDLBool; break;
    case 'c': code = kDLComplex; break;
    case 'V': code = KV_RAW_CODE; break;
    default: return kv_path_error(PyExc_TypeError, path, "typestr %R is not supported", typestr);
    }
    out->dtype.code = code;
    out->dtype.bits = (uint8_t)(size * 8);
    out->itemsize = size;
    return 0;
}

/* An int of an interface dict's tuple `what` (owned by the tuple, which the
 * caller's dict copy owns, while its __index__ runs), from `minimum` to
 * INT64_MAX. */
static int read_entry(PyObject *item, const kv_path *path, const char *what, Py_ssize_t i, int64_t minimum,
                      int64_t *value)
{
    const long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        return kv_path_error(PyExc_ValueError, path, "array interface %s[%zd] is %R, not an int from %lld to 2**63 - 1",
                             what, i, item, (long long)minimum);
    }
    if (v < minimum)
        return kv_path_error(PyExc_ValueError, path, "array interface %s[%zd] is %lld, below %lld", what, i, v,
                             (long long)minimum);
    *value = v;
    return 0;
}

/* Fills shape and strides from an interface dict's "shape" and "strides". */
static int parse_shape_strides(PyObject *dict, const kv_path *path, kv_array *out)
{
    PyObject *shape = PyDict_GetItemString(dict, "shape");
    if (shape == NULL || !PyTuple_Check(shape))
        return kv_path_error(PyExc_TypeError, path, "array interface has no shape tuple");
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (check_ndim(path, ndim) < 0)
        return -1;
    out->ndim = (int)ndim;
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (read_entry(PyTuple_GET_ITEM(shape, i), path, "shape", i, 0, &out->shape[i]) < 0)
            return -1;
    PyObject *strides = PyDict_GetItemString(dict, "strides");
    if (strides == NULL || strides == Py_None) {
        set_compact_strides(out);
        return 0;
    }
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != ndim)
        return kv_path_error(PyExc_TypeError, path, "array interface strides must be None or a tuple of %zd ints", ndim);
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (read_entry(PyTuple_GET_ITEM(strides, i), path, "strides", i, INT64_MIN + 1, &out->strides[i]) < 0)
            return -1;
    return 0;
}

/* Fills data and readonly from an interface dict's (pointer, readonly) "data". */
static int parse_data(PyObject *dict, const kv_path *path, kv_array *out)
{
    PyObject *data = PyDict_GetItemString(dict, "data");
    if (data == NULL || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2)
        return kv_path_error(PyExc_TypeError, path, "array interface data must be a (pointer, readonly) tuple");
    PyObject *pointer = PyTuple_GET_ITEM(data, 0);
    const unsigned long long address = PyLong_Check(pointer) ? PyLong_AsUnsignedLongLong(pointer) : 0;
    if (!PyLong_Check(pointer) || (address == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        return kv_path_error(PyExc_ValueError, path, "array interface data pointer %R is not an int from 0 to 2**64 - 1",
                             pointer);
    }
    out->data = (void *)(uintptr_t)address;
    out->readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (out->readonly < 0)
        return -1;
    PyObject *mask = PyDict_GetItemString(dict, "mask");
    if (mask != NULL && mask != Py_None)
        return kv_path_error(PyExc_ValueError, path, "masked arrays are not supported");
    return 0;
}

/* Shared by __cuda_array_interface__ and __array_interface__. */
static int from_interface(PyObject *obj, const kv_path *path, const char *attribute, kv_array *out)
{
    PyObject *given = PyObject_GetAttrString(obj, attribute);
    if (given == NULL)
        return -1;
    if (!PyDict_Check(given)) {
        Py_DECREF(given);
        return kv_path_error(PyExc_TypeError, path, "%s is not a dict", attribute);
    }
    /* Read a copy: reading runs the entries' __index__, which could change
     * the producer's dict and free what a borrowed reference points at. */
    PyObject *dict = PyDict_Copy(given);
    Py_DECREF(given);
    if (dict == NULL)
        return -1;
    int rc = -1;
    PyObject *typestr = PyDict_GetItemString(dict, "typestr");
    if (typestr == NULL) {
        kv_path_error(PyExc_TypeError, path, "%s has no typestr", attribute);
        goto done;
    }
    if (parse_typestr(typestr, path, out) < 0 || parse_shape_strides(dict, path, out) < 0
        || parse_data(dict, path, out) < 0)
        goto done;
    PyObject *stream = PyDict_GetItemString(dict, "stream");
    if (stream != NULL && stream != Py_None) {
        /* CAI v3: the producer's work on this stream must be ordered before
         * ours.  0 is forbidden by the protocol (ambiguous). */
        out->stream = PyLong_Check(stream) ? (intptr_t)PyLong_AsVoidPtr(stream) : 0;
        if (out->stream == 0) {
            PyErr_Clear();
            kv_path_error(PyExc_ValueError, path, "__cuda_array_interface__ stream %R is not allowed (a nonzero "
                          "cudaStream_t int, or None)", stream);
            goto done;
        }
        out->has_stream = 1;
    }
    out->owner = Py_NewRef(obj);
    rc = 0;
done:
    Py_DECREF(dict);
    return rc;
}

/* ------------------------------------------------------- buffer protocol */

static int format_dtype(const Py_buffer *view, kv_dtype *dtype)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == 0 || f[1] != 0)
        return -1;
    switch (*f) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': dtype->code = kDLInt; break;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': case 'c': dtype->code = kDLUInt; break;
    case 'e': case 'f': case 'd': dtype->code = kDLFloat; break;
    case '?': dtype->code = kDLBool; break;
    default: return -1;
    }
    dtype->bits = (uint8_t)(view->itemsize * 8);
    return 0;
}

static int from_buffer(PyObject *obj, const kv_path *path, kv_array *out)
{
    if (PyObject_GetBuffer(obj, &out->view, PyBUF_RECORDS_RO) < 0)
        return -1;
    out->has_view = 1;
    const Py_buffer *v = &out->view;
    if (check_ndim(path, v->ndim) < 0 || v->itemsize <= 0 || v->itemsize > 31 || format_dtype(v, &out->dtype) < 0) {
        if (!PyErr_Occurred())
            kv_path_error(PyExc_TypeError, path, "buffer format '%s' is not supported",
                          v->format == NULL ? "B" : v->format);
        PyBuffer_Release(&out->view);
        out->has_view = 0;
        return -1;
    }
    out->data = v->buf;
    out->ndim = v->ndim;
    out->itemsize = v->itemsize;
    out->readonly = v->readonly;
    for (int i = 0; i < v->ndim; i++) {
        out->shape[i] = v->shape[i];
        out->strides[i] = v->strides[i];
    }
    return 0;
}

/* ---------------------------------------------------------------- entry */

static void clear_array(kv_array *out)
{
    memset(out, 0, sizeof *out);
    out->place = KV_HOST;
    out->device_id = -1;
}

/* Borrows obj through the first protocol it offers, the C exchange API
 * first. */
static int read_array(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out)
{
    clear_array(out);
    int rc;
    const DLPackExchangeAPI *api = exchange_api(Py_TYPE(obj));
    if (api != NULL) {
        rc = from_exchange(obj, api, path, out);
        if (rc <= 0) {
            if (rc < 0)
                kv_array_release(out);
            return rc;
        }
        clear_array(out);
    }
    if (PyObject_HasAttrString(obj, "__dlpack__") && PyObject_HasAttrString(obj, "__dlpack_device__"))
        rc = from_dlpack(obj, path, dlpack_stream, out);
    else if (PyObject_HasAttrString(obj, "__cuda_array_interface__")) {
        rc = from_interface(obj, path, "__cuda_array_interface__", out);
        out->place = KV_DEVICE;
    }
    else if (PyObject_HasAttrString(obj, "__array_interface__"))
        rc = from_interface(obj, path, "__array_interface__", out);
    else if (PyObject_CheckBuffer(obj))
        rc = from_buffer(obj, path, out);
    else
        return kv_path_error(PyExc_TypeError, path,
                             "expected an array (DLPack, __cuda_array_interface__, __array_interface__ or a buffer), got %s",
                             Py_TYPE(obj)->tp_name);
    if (rc < 0)
        kv_array_release(out);
    return rc;
}

static int has_empty_dimension(const kv_array *a)
{
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] == 0)
            return 1;
    return 0;
}

int64_t kv_array_elements(const kv_array *a)
{
    if (has_empty_dimension(a))
        return 0;
    int64_t elements = 1;
    for (int i = 0; i < a->ndim; i++)
        elements *= a->shape[i]; /* in range: kv_array_from_object checked it */
    return elements;
}

/* What every later check and copy relies on: no negative extent, an
 * element count, a byte size and every stride's reach that fit in int64,
 * and a data pointer wherever there is an element. */
static int check_extents(const kv_array *a, const kv_path *path)
{
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] < 0)
            return kv_path_error(PyExc_ValueError, path, "dimension %d has a negative extent (%lld)", i,
                                 (long long)a->shape[i]);
    if (has_empty_dimension(a))
        return 0; /* any extents: nothing is addressed */
    int64_t elements = 1, bytes;
    for (int i = 0; i < a->ndim; i++)
        if (__builtin_mul_overflow(elements, a->shape[i], &elements))
            return kv_path_error(PyExc_ValueError, path, "its extents multiply to more than 2**63 - 1 elements");
    if (__builtin_mul_overflow(elements, a->itemsize, &bytes))
        return kv_path_error(PyExc_ValueError, path, "holds more than 2**63 - 1 bytes");
    if (a->data == NULL)
        return kv_path_error(PyExc_ValueError, path, "has a NULL data pointer but %lld elements", (long long)elements);
    for (int i = 0; i < a->ndim; i++) {
        int64_t reach;
        if (a->strides[i] == INT64_MIN || __builtin_mul_overflow(a->strides[i] < 0 ? -a->strides[i] : a->strides[i],
                                                                 a->shape[i] - 1, &reach))
            return kv_path_error(PyExc_ValueError, path, "stride %lld of dimension %d reaches past 2**63 - 1 bytes",
                                 (long long)a->strides[i], i);
    }
    return 0;
}

int kv_array_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out)
{
    const int rc = read_array(obj, path, dlpack_stream, out);
    if (rc == 0 && check_extents(out, path) < 0) {
        kv_array_release(out);
        return -1;
    }
    return rc;
}

int kv_array_keep_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out)
{
    /* torch exports through DLPack a handle to the tensor itself, which
     * set_ and resize_ re-point, freeing the old storage under the capsule;
     * a detached alias shares the storage but is not re-pointed with it. */
    PyObject *alias = NULL;
    if (PyObject_HasAttrString(obj, "detach") && PyObject_HasAttrString(obj, "set_")) {
        alias = PyObject_CallMethod(obj, "detach", NULL);
        if (alias == NULL)
            return -1;
    }
    const int rc = kv_array_from_object(alias != NULL ? alias : obj, path, dlpack_stream, out);
    Py_XDECREF(alias); /* the array's owner holds it */
    return rc;
}

void kv_array_release(kv_array *a)
{
    if (a->has_view) {
        PyBuffer_Release(&a->view);
        a->has_view = 0;
    }
    Py_CLEAR(a->owner);
}
