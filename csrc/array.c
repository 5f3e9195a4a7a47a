/* Borrowing arrays from Python objects.  See array.h. */
#include "array.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "state.h"

static const char CAPSULE_VERSIONED[] = "dltensor_versioned";
static const char CAPSULE_LEGACY[] = "dltensor";

void kv_path_format(const kv_path *path, char *buf, size_t size)
{
    int n = snprintf(buf, size, "%s", path->name);
    for (int i = 0; i < path->depth && n >= 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - (size_t)n, "[%zd]", path->index[i]);
}

/* "path: message" from a printf-style format, or NULL with an exception. */
static PyObject *path_message(const kv_path *path, const char *format, va_list args)
{
    char where[96];
    kv_path_format(path, where, sizeof where);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    if (message == NULL)
        return NULL;
    PyObject *full = PyUnicode_FromFormat("%s: %U", where, message);
    Py_DECREF(message);
    return full;
}

int kv_path_error(PyObject *type, const kv_path *path, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    PyObject *message = path_message(path, format, args);
    va_end(args);
    if (message != NULL) {
        PyErr_SetObject(type, message);
        Py_DECREF(message);
    }
    return -1;
}

int kv_path_error_from(PyObject *type, const kv_path *path, const char *format, ...)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
        return -1;
    PyObject *cause_type, *cause, *traceback;
    PyErr_Fetch(&cause_type, &cause, &traceback);
    PyErr_NormalizeException(&cause_type, &cause, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(cause, traceback);
    va_list args;
    va_start(args, format);
    PyObject *message = path_message(path, format, args);
    va_end(args);
    PyObject *full = message == NULL ? NULL
                                     : PyUnicode_FromFormat("%U (%s: %S)", message, ((PyTypeObject *)cause_type)->tp_name,
                                                            cause);
    Py_XDECREF(message);
    if (full != NULL) {
        PyErr_SetObject(type, full);
        Py_DECREF(full);
        PyObject *new_type, *value, *new_traceback;
        PyErr_Fetch(&new_type, &value, &new_traceback);
        PyErr_NormalizeException(&new_type, &value, &new_traceback);
        PyException_SetCause(value, Py_NewRef(cause));
        PyErr_Restore(new_type, value, new_traceback);
    }
    Py_DECREF(cause_type);
    Py_DECREF(cause);
    Py_XDECREF(traceback);
    return -1;
}

int kv_is_array(PyObject *obj)
{
    if (PyList_Check(obj) || PyTuple_Check(obj))
        return 0;
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

/* ------------------------------------------------ names and type facts */

static const char *const NAME_TEXT[KV_NAME_COUNT] = {
    [KV_NAME_DLPACK] = "__dlpack__",
    [KV_NAME_DLPACK_DEVICE] = "__dlpack_device__",
    [KV_NAME_CUDA_ARRAY_INTERFACE] = "__cuda_array_interface__",
    [KV_NAME_ARRAY_INTERFACE] = "__array_interface__",
    [KV_NAME_EXCHANGE_API] = "__dlpack_c_exchange_api__",
    [KV_NAME_DEVICE] = "device",
    [KV_NAME_IS_NEG] = "is_neg",
    [KV_NAME_IS_CONJ] = "is_conj",
    [KV_NAME_REQUIRES_GRAD] = "requires_grad",
    [KV_NAME_TYPESTR] = "typestr",
    [KV_NAME_SHAPE] = "shape",
    [KV_NAME_STRIDES] = "strides",
    [KV_NAME_DATA] = "data",
    [KV_NAME_MASK] = "mask",
    [KV_NAME_STREAM] = "stream",
    [KV_NAME_TORCH] = "torch",
    [KV_NAME_TENSOR] = "Tensor",
};

int kv_protocols_init(kv_protocols *p)
{
    memset(p, 0, sizeof *p);
    for (int i = 0; i < KV_NAME_COUNT; i++)
        if ((p->names[i] = PyUnicode_InternFromString(NAME_TEXT[i])) == NULL)
            goto fail;
    p->dlpack_keywords = Py_BuildValue("(ss)", "stream", "max_version");
    p->stream_keyword = Py_BuildValue("(s)", "stream");
    p->max_version = Py_BuildValue("(ii)", 1, 3);
    if (p->dlpack_keywords != NULL && p->stream_keyword != NULL && p->max_version != NULL)
        return 0;
fail:
    kv_protocols_clear(p);
    return -1;
}

int kv_protocols_traverse(kv_protocols *p, visitproc visit, void *arg)
{
    for (int i = 0; i < KV_TYPES_CACHED; i++) {
        Py_VISIT(p->types[i].type);
        Py_VISIT(p->types[i].is_neg);
        Py_VISIT(p->types[i].is_conj);
    }
    Py_VISIT(p->increment_version);
    return 0;
}

static void clear_facts(kv_type_facts *facts)
{
    Py_CLEAR(facts->type);
    Py_CLEAR(facts->is_neg);
    Py_CLEAR(facts->is_conj);
    facts->exchange = NULL;
}

void kv_protocols_clear(kv_protocols *p)
{
    for (int i = 0; i < KV_NAME_COUNT; i++)
        Py_CLEAR(p->names[i]);
    Py_CLEAR(p->dlpack_keywords);
    Py_CLEAR(p->stream_keyword);
    Py_CLEAR(p->max_version);
    Py_CLEAR(p->increment_version);
    for (int i = 0; i < KV_TYPES_CACHED; i++)
        clear_facts(&p->types[i]);
}

/* The C exchange API a type offers, or NULL.  Errors are cleared: a type
 * without a usable one is read through the Python protocols. */
static const DLPackExchangeAPI *find_exchange_api(const kv_protocols *p, PyTypeObject *type)
{
    PyObject *capsule = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_EXCHANGE_API]);
    if (capsule == NULL) {
        PyErr_Clear();
        return NULL;
    }
    const DLPackExchangeAPI *api = PyCapsule_IsValid(capsule, "dlpack_exchange_api")
                                       ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api")
                                       : NULL;
    Py_DECREF(capsule);
    /* A major version other than 1 may have another layout. */
    if (api == NULL || api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL
        || api->current_work_stream == NULL)
        return NULL;
    return api;
}

/* For torch.Tensor and its subclasses, the type's is_neg and is_conj
 * (new references), looked up on the type once rather than on each tensor;
 * else both NULL.  torch is looked up among the imported modules only:
 * before torch is imported there is no tensor.  Errors are cleared. */
static void find_torch_flags(const kv_protocols *p, PyTypeObject *type, kv_type_facts *facts)
{
    PyObject *torch = PyImport_GetModule(p->names[KV_NAME_TORCH]);
    PyObject *tensor = torch == NULL ? NULL : PyObject_GetAttr(torch, p->names[KV_NAME_TENSOR]);
    if (tensor != NULL && PyType_Check(tensor) && PyType_IsSubtype(type, (PyTypeObject *)tensor)) {
        facts->is_neg = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_IS_NEG]);
        facts->is_conj = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_IS_CONJ]);
        if (facts->is_neg == NULL || facts->is_conj == NULL) {
            Py_CLEAR(facts->is_neg);
            Py_CLEAR(facts->is_conj);
        }
    }
    Py_XDECREF(tensor);
    Py_XDECREF(torch);
    PyErr_Clear();
}

/* The facts of `type`, from the cache or found (and cached) now.  The
 * caller gets its own references to is_neg and is_conj (release_facts):
 * finding facts runs Python code, which may call into this module again and
 * recycle any slot. */
static kv_type_facts type_facts(kv_protocols *p, PyTypeObject *type)
{
    for (int i = 0; i < KV_TYPES_CACHED; i++) {
        if (p->types[i].type == type) {
            kv_type_facts facts = p->types[i];
            Py_XINCREF(facts.is_neg);
            Py_XINCREF(facts.is_conj);
            return facts;
        }
    }
    kv_type_facts facts = {type, find_exchange_api(p, type), NULL, NULL};
    find_torch_flags(p, type, &facts);
    kv_type_facts *slot = &p->types[p->next_type];
    p->next_type = (p->next_type + 1) % KV_TYPES_CACHED;
    kv_type_facts old = *slot;
    slot->type = (PyTypeObject *)Py_NewRef(type);
    slot->exchange = facts.exchange;
    slot->is_neg = Py_XNewRef(facts.is_neg);
    slot->is_conj = Py_XNewRef(facts.is_conj);
    clear_facts(&old); /* last: freeing a type may run Python code */
    return facts;
}

static void release_facts(kv_type_facts *facts)
{
    Py_CLEAR(facts->is_neg);
    Py_CLEAR(facts->is_conj);
}

/* ---------------------------------------------------------------- devices */

/* DLPack's device types that kvbm_ext cannot read, by name. */
static const char *dlpack_device_name(int type)
{
    switch (type) {
    case 4: return "OpenCL";
    case 7: return "Vulkan";
    case 8: return "Metal";
    case 9: return "VPI";
    case 10: return "ROCm";
    case 11: return "ROCm host";
    case 12: return "ext_dev";
    case 14: return "oneAPI";
    case 15: return "WebGPU";
    case 16: return "Hexagon";
    case 17: return "MAIA";
    case 18: return "Trainium";
    default: return NULL;
    }
}

#define READABLE "which kvbm_ext cannot read (it reads host memory and CUDA device memory)"

static int is_readable(int type)
{
    return type == kDLCPU || type == kDLCUDA || type == kDLCUDAHost || type == kDLCUDAManaged;
}

static int unsupported_device(const kv_path *path, int type)
{
    const char *name = dlpack_device_name(type);
    if (name != NULL)
        return kv_path_error(PyExc_ValueError, path, "on device %s (DLPack device type %d), " READABLE, name, type);
    return kv_path_error(PyExc_ValueError, path, "on DLPack device type %d, " READABLE, type);
}

/* __dlpack_device__() raised: the producer cannot describe where the array
 * lives (torch: a meta tensor).  Its `device` attribute, if any, names it. */
static int undescribed_device(const kv_protocols *p, PyObject *obj, const kv_path *path)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
        return -1;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *device = PyObject_GetAttr(obj, p->names[KV_NAME_DEVICE]);
    PyObject *name = device == NULL ? NULL : PyObject_Str(device);
    Py_XDECREF(device);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    if (name == NULL)
        return kv_path_error_from(PyExc_ValueError, path, "on a device its __dlpack_device__() cannot describe, "
                                  READABLE);
    kv_path_error_from(PyExc_ValueError, path, "on device %U, " READABLE, name);
    Py_DECREF(name);
    return -1;
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
            kv_path_error(PyExc_ValueError, path, "DLPack major version %u is not supported (expected 1)", major);
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
    if (!is_readable(type))
        return unsupported_device(path, type);
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
 * max_version for producers that predate it (they raise TypeError).  A
 * BufferError, DLPack's "cannot export this", becomes a ValueError naming
 * the argument. */
static PyObject *call_dlpack(const kv_protocols *p, PyObject *obj, const kv_path *path, PyObject *stream)
{
    PyObject *args[3] = {obj, stream, p->max_version};
    PyObject *capsule = PyObject_VectorcallMethod(p->names[KV_NAME_DLPACK], args, 1, p->dlpack_keywords);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_VectorcallMethod(p->names[KV_NAME_DLPACK], args, 1, p->stream_keyword);
    }
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_BufferError))
        kv_path_error_from(PyExc_ValueError, path, "its producer refused to export it through DLPack");
    return capsule;
}

/* The (device_type, device_id) of obj.__dlpack_device__(). */
static int dlpack_device(const kv_protocols *p, PyObject *obj, const kv_path *path, int *type, int *id)
{
    PyObject *device = PyObject_VectorcallMethod(p->names[KV_NAME_DLPACK_DEVICE], &obj, 1, NULL);
    if (device == NULL)
        return undescribed_device(p, obj, path);
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

static int from_dlpack(const kv_reader *reader, PyObject *obj, const kv_path *path, kv_array *out)
{
    int device_type = 0, device_id = 0;
    if (dlpack_device(reader->protocols, obj, path, &device_type, &device_id) < 0)
        return -1;
    if (!is_readable(device_type))
        return unsupported_device(path, device_type);

    /* The stream argument asks the producer to order its pending work before
     * the consumer's stream; it means nothing for host memory.  The array's
     * device is made current for the call, as torch requires. */
    const int on_device = device_type == kDLCUDA || device_type == kDLCUDAManaged;
    int previous = -1;
    if (on_device && kv_gpu_use_device(device_id, &previous) < 0)
        return -1;
    PyObject *capsule = call_dlpack(reader->protocols, obj, path, on_device ? reader->dlpack_stream : Py_None);
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

/* ------------------------------------------------------------------ torch */

/* Whether `flag` (a method of obj's type, e.g. is_neg, or NULL for
 * obj.requires_grad) is set: 1, 0, or -1 with an exception. */
static int torch_flag(const kv_protocols *p, PyObject *obj, PyObject *flag)
{
    PyObject *value = flag != NULL ? PyObject_Vectorcall(flag, &obj, 1, NULL)
                                   : PyObject_GetAttr(obj, p->names[KV_NAME_REQUIRES_GRAD]);
    if (value == NULL)
        return -1;
    const int set = PyObject_IsTrue(value);
    Py_DECREF(value);
    return set;
}

/* What neither the C exchange API nor torch's __dlpack__ tells: a conjugate
 * or negative view's bytes are not its values (the bit is applied lazily,
 * by torch's own operations), and a tensor that requires grad cannot be
 * written behind autograd's back (torch refuses in-place writes to such a
 * leaf; on a non-leaf the graph would silently use the new values). */
static int check_torch(const kv_protocols *p, PyObject *obj, const kv_type_facts *facts, const kv_path *path,
                       int write, kv_array *out)
{
    int set = out->dtype.code == kDLComplex ? torch_flag(p, obj, facts->is_conj) : 0; /* only complex can be */
    if (set != 0)
        return set < 0 ? -1
                       : kv_path_error(PyExc_ValueError, path, "a conjugate view (its conjugate bit is set): its bytes "
                                       "are not its values; pass x.resolve_conj()");
    if ((set = torch_flag(p, obj, facts->is_neg)) != 0)
        return set < 0 ? -1
                       : kv_path_error(PyExc_ValueError, path, "a negative view (its negative bit is set, e.g. "
                                       "x._neg_view() or the .imag of a conjugate view): its bytes are not its values; "
                                       "pass x.resolve_neg()");
    if (!write)
        return 0;
    if ((set = torch_flag(p, obj, NULL)) != 0)
        return set < 0 ? -1
                       : kv_path_error(PyExc_ValueError, path, "destination tensor requires grad, and autograd cannot "
                                       "see this write; pass x.detach() (same memory) to write it anyway");
    out->torch_written = 1;
    return 0;
}

/* torch.autograd.graph.increment_version, found once; None when this torch
 * has none.  Borrowed, or NULL with an exception. */
static PyObject *increment_version(kv_protocols *p)
{
    if (p->increment_version == NULL) {
        PyObject *graph = PyImport_ImportModule("torch.autograd.graph");
        PyObject *found = graph == NULL ? NULL : PyObject_GetAttrString(graph, "increment_version");
        Py_XDECREF(graph);
        if (found == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_ImportError) && !PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();
            found = Py_NewRef(Py_None);
        }
        Py_XSETREF(p->increment_version, found);
    }
    return p->increment_version;
}

int kv_arrays_written(kv_protocols *p, const kv_array *arrays, Py_ssize_t count)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        n += arrays[i].torch_written;
    if (n == 0)
        return 0;
    PyObject *bump = increment_version(p);
    if (bump == NULL)
        return -1;
    if (bump == Py_None)
        return 0;
    PyObject *tensors = PyTuple_New(n);
    if (tensors == NULL)
        return -1;
    for (Py_ssize_t i = 0, k = 0; i < count; i++)
        if (arrays[i].torch_written)
            PyTuple_SET_ITEM(tensors, k++, Py_NewRef(arrays[i].owner));
    /* Held by the call: the function may drop p's reference. */
    Py_INCREF(bump);
    PyObject *result = PyObject_CallOneArg(bump, tensors);
    Py_DECREF(bump);
    Py_DECREF(tensors);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
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

/* The value of an interface dict's key, borrowed from the dict (the
 * caller's copy); NULL when absent, with an exception only on error. */
static PyObject *entry(const kv_protocols *p, PyObject *dict, int name)
{
    return PyDict_GetItemWithError(dict, p->names[name]);
}

/* Fills shape and strides from an interface dict's "shape" and "strides". */
static int parse_shape_strides(const kv_protocols *p, PyObject *dict, const kv_path *path, kv_array *out)
{
    PyObject *shape = entry(p, dict, KV_NAME_SHAPE);
    if (shape == NULL || !PyTuple_Check(shape))
        return PyErr_Occurred() ? -1 : kv_path_error(PyExc_TypeError, path, "array interface has no shape tuple");
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (check_ndim(path, ndim) < 0)
        return -1;
    out->ndim = (int)ndim;
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (read_entry(PyTuple_GET_ITEM(shape, i), path, "shape", i, 0, &out->shape[i]) < 0)
            return -1;
    PyObject *strides = entry(p, dict, KV_NAME_STRIDES);
    if (strides == NULL && PyErr_Occurred())
        return -1;
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

/* An address or a stream handle of an interface dict: an int, or any
 * object with __index__ but a bool, from 0 to 2**64 - 1.  0, or -1 with the
 * error cleared (the caller names it). */
static int read_address(PyObject *obj, uint64_t *value)
{
    PyObject *number = PyBool_Check(obj) || !PyIndex_Check(obj) ? NULL : PyNumber_Index(obj);
    const unsigned long long v = number == NULL ? 0 : PyLong_AsUnsignedLongLong(number);
    Py_XDECREF(number);
    if (number == NULL || (v == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *value = v;
    return 0;
}

/* Fills data and readonly from an interface dict's (pointer, readonly) "data". */
static int parse_data(const kv_protocols *p, PyObject *dict, const kv_path *path, kv_array *out)
{
    PyObject *data = entry(p, dict, KV_NAME_DATA);
    if (data == NULL || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2)
        return PyErr_Occurred() ? -1
                                : kv_path_error(PyExc_TypeError, path, "array interface data must be a (pointer, "
                                                "readonly) tuple");
    PyObject *pointer = PyTuple_GET_ITEM(data, 0);
    uint64_t address;
    if (read_address(pointer, &address) < 0)
        return kv_path_error(PyExc_ValueError, path, "array interface data pointer %R is not an int from 0 to 2**64 - 1",
                             pointer);
    out->data = (void *)(uintptr_t)address;
    out->readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (out->readonly < 0)
        return -1;
    PyObject *mask = entry(p, dict, KV_NAME_MASK);
    if (mask == NULL && PyErr_Occurred())
        return -1;
    if (mask != NULL && mask != Py_None)
        return kv_path_error(PyExc_ValueError, path, "masked arrays are not supported");
    return 0;
}

/* Shared by __cuda_array_interface__ and __array_interface__ (`name`). */
static int from_interface(const kv_protocols *p, PyObject *obj, const kv_path *path, int name, kv_array *out)
{
    PyObject *given = PyObject_GetAttr(obj, p->names[name]);
    if (given == NULL)
        return -1;
    if (!PyDict_Check(given)) {
        Py_DECREF(given);
        return kv_path_error(PyExc_TypeError, path, "%U is not a dict", p->names[name]);
    }
    /* Read a copy: reading runs the entries' __index__, which could change
     * the producer's dict and free what a borrowed reference points at. */
    PyObject *dict = PyDict_Copy(given);
    Py_DECREF(given);
    if (dict == NULL)
        return -1;
    int rc = -1;
    PyObject *typestr = entry(p, dict, KV_NAME_TYPESTR);
    if (typestr == NULL) {
        if (!PyErr_Occurred())
            kv_path_error(PyExc_TypeError, path, "%U has no typestr", p->names[name]);
        goto done;
    }
    if (parse_typestr(typestr, path, out) < 0 || parse_shape_strides(p, dict, path, out) < 0
        || parse_data(p, dict, path, out) < 0)
        goto done;
    PyObject *stream = entry(p, dict, KV_NAME_STREAM);
    if (stream == NULL && PyErr_Occurred())
        goto done;
    if (stream != NULL && stream != Py_None) {
        /* CAI v3: the producer's work on this stream must be ordered before
         * ours.  0 is forbidden by the protocol (ambiguous). */
        uint64_t handle = 0;
        if (read_address(stream, &handle) < 0 || handle == 0) {
            kv_path_error(PyExc_ValueError, path, "__cuda_array_interface__ stream %R is not allowed (a nonzero "
                          "cudaStream_t int, or None)", stream);
            goto done;
        }
        out->stream = (intptr_t)handle;
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
static int read_protocol(const kv_reader *reader, PyObject *obj, const kv_type_facts *facts, const kv_path *path,
                         kv_array *out)
{
    const kv_protocols *p = reader->protocols;
    if (facts->exchange != NULL) {
        const int rc = from_exchange(obj, facts->exchange, path, out);
        if (rc <= 0)
            return rc;
        clear_array(out);
    }
    if (PyObject_HasAttr(obj, p->names[KV_NAME_DLPACK]) && PyObject_HasAttr(obj, p->names[KV_NAME_DLPACK_DEVICE]))
        return from_dlpack(reader, obj, path, out);
    if (PyObject_HasAttr(obj, p->names[KV_NAME_CUDA_ARRAY_INTERFACE])) {
        out->place = KV_DEVICE;
        return from_interface(p, obj, path, KV_NAME_CUDA_ARRAY_INTERFACE, out);
    }
    if (PyObject_HasAttr(obj, p->names[KV_NAME_ARRAY_INTERFACE]))
        return from_interface(p, obj, path, KV_NAME_ARRAY_INTERFACE, out);
    if (PyObject_CheckBuffer(obj))
        return from_buffer(obj, path, out);
    return kv_path_error(PyExc_TypeError, path,
                         "expected an array (DLPack, __cuda_array_interface__, __array_interface__ or a buffer), got %s",
                         Py_TYPE(obj)->tp_name);
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
        elements *= a->shape[i]; /* in range: kv_array_read checked it */
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

/* kv_array_read and kv_array_keep for a reader without the module's names
 * (callers without the module state): made for the one array. */
static int read_alone(const kv_reader *reader, PyObject *obj, const kv_path *path, int keep, kv_array *out)
{
    kv_protocols protocols;
    if (kv_protocols_init(&protocols) < 0) {
        clear_array(out);
        return -1;
    }
    const kv_reader with_names = {&protocols, reader->dlpack_stream};
    const int rc = keep ? kv_array_keep(&with_names, obj, path, out) : kv_array_read(&with_names, obj, path, 0, out);
    kv_protocols_clear(&protocols);
    return rc;
}

int kv_array_read(const kv_reader *reader, PyObject *obj, const kv_path *path, int write, kv_array *out)
{
    if (reader->protocols == NULL)
        return read_alone(reader, obj, path, 0, out);
    clear_array(out);
    kv_type_facts facts = type_facts(reader->protocols, Py_TYPE(obj));
    int rc = read_protocol(reader, obj, &facts, path, out);
    if (rc == 0 && facts.is_neg != NULL)
        rc = check_torch(reader->protocols, obj, &facts, path, write, out);
    release_facts(&facts);
    if (rc == 0)
        rc = check_extents(out, path);
    if (rc == 0 && write && out->readonly)
        rc = kv_path_error(PyExc_ValueError, path, "destination array is read-only");
    if (rc < 0)
        kv_array_release(out);
    return rc;
}

int kv_array_keep(const kv_reader *reader, PyObject *obj, const kv_path *path, kv_array *out)
{
    if (reader->protocols == NULL)
        return read_alone(reader, obj, path, 1, out);
    /* torch exports through DLPack a handle to the tensor itself, which
     * set_ and resize_ re-point, freeing the old storage under the capsule;
     * a detached alias shares the storage but is not re-pointed with it. */
    PyObject *alias = NULL;
    if (PyObject_HasAttrString(obj, "detach") && PyObject_HasAttrString(obj, "set_")) {
        alias = PyObject_CallMethod(obj, "detach", NULL);
        if (alias == NULL)
            return -1;
    }
    const int rc = kv_array_read(reader, alias != NULL ? alias : obj, path, 0, out);
    Py_XDECREF(alias); /* the array's owner holds it */
    return rc;
}

/* A reader for callers without the module's state: the state found in
 * sys.modules, else none (names made per array). */
static kv_reader reader_alone(PyObject *dlpack_stream)
{
    kv_state *state = kv_find_state();
    const kv_reader reader = {state != NULL ? &state->protocols : NULL, dlpack_stream};
    return reader;
}

int kv_array_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out)
{
    const kv_reader reader = reader_alone(dlpack_stream);
    return kv_array_read(&reader, obj, path, 0, out);
}

int kv_array_keep_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out)
{
    const kv_reader reader = reader_alone(dlpack_stream);
    return kv_array_keep(&reader, obj, path, out);
}

void kv_array_block(const kv_array *stack, int64_t b, kv_array *out)
{
    clear_array(out);
    out->data = stack->data + b * stack->strides[0];
    out->ndim = stack->ndim - 1;
    memcpy(out->shape, stack->shape + 1, (size_t)out->ndim * sizeof(int64_t));
    memcpy(out->strides, stack->strides + 1, (size_t)out->ndim * sizeof(int64_t));
    out->itemsize = stack->itemsize;
    out->dtype = stack->dtype;
    out->place = stack->place;
    out->device_id = stack->device_id;
    out->readonly = stack->readonly;
    out->has_stream = stack->has_stream;
    out->stream = stack->stream;
    out->current_work_stream = stack->current_work_stream;
}

void kv_array_release(kv_array *a)
{
    if (a->has_view) {
        PyBuffer_Release(&a->view);
        a->has_view = 0;
    }
    Py_CLEAR(a->owner);
}
