/* Reading DLPack producers: capsules (versioned and legacy) from
 * __dlpack__, and the C exchange API.  See readers.h. */
#include "readers.h"

#include "gpu.h"

static const char CAPSULE_VERSIONED[] = "dltensor_versioned";
static const char CAPSULE_LEGACY[] = "dltensor";

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
        return kv_path_error_from(PyExc_ValueError, path,
                                  "on a device its __dlpack_device__() cannot describe, " READABLE);
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
    if (kv_check_ndim(path, t->ndim) < 0)
        return -1;
    /* strides may be NULL (compact row-major); shape may not, where there
     * are dimensions to describe. */
    if (t->ndim > 0 && t->shape == NULL)
        return kv_path_error(PyExc_ValueError, path, "its DLPack tensor has %d dimensions but a NULL shape",
                             (int)t->ndim);
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
        kv_set_compact_strides(out);
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
static PyObject *export_dlpack(const kv_protocols *p, PyObject *obj, PyObject *stream)
{
    PyObject *args[3] = {obj, stream, p->max_version};
    PyObject *capsule = PyObject_VectorcallMethod(p->names[KV_NAME_DLPACK], args, 1, p->dlpack_keywords);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_VectorcallMethod(p->names[KV_NAME_DLPACK], args, 1, p->stream_keyword);
    }
    return capsule;
}

/* The export, where stream -1 (no synchronization: only addresses are
 * taken) fails, is asked again with None, which only orders the producer's
 * work before the legacy default stream: JAX raises on -1 on CUDA.  A
 * BufferError, DLPack's "cannot export this", becomes a ValueError naming
 * the argument. */
static PyObject *call_dlpack(const kv_protocols *p, PyObject *obj, const kv_path *path, PyObject *stream)
{
    PyObject *capsule = export_dlpack(p, obj, stream);
    if (capsule == NULL && PyLong_Check(stream) && PyLong_AsLong(stream) == -1
        && PyErr_ExceptionMatches(PyExc_Exception) && !PyErr_ExceptionMatches(PyExc_BufferError)) {
        PyErr_Clear();
        capsule = export_dlpack(p, obj, Py_None);
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

int kv_from_dlpack(const kv_reader *reader, PyObject *obj, const kv_path *path, kv_array *out)
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

int kv_array_current_stream(const kv_array *a, int32_t device_type, int32_t device_id, void **stream)
{
    const int rc = a->current_work_stream(device_type, device_id, stream);
    if (rc == 0 && !PyErr_Occurred())
        return 0;
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_RuntimeError,
                     "the arrays' producer failed to tell its current stream on device %d (the "
                     "current_work_stream of its DLPack C exchange API returned %d without an exception)",
                     (int)device_id, rc);
    return -1;
}

/* The producer does not synchronize: its current stream on the array's
 * device becomes the array's producer stream, which the call orders before
 * its own, as __dlpack__(stream=...) would. */
int kv_from_exchange(PyObject *obj, const DLPackExchangeAPI *api, const kv_path *path, kv_array *out)
{
    DLTensor t;
    /* A producer that sets an exception has failed, whatever it returned. */
    if (api->dltensor_from_py_object_no_sync(obj, &t) != 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    if (fill_from_dltensor(&t, path, out) < 0)
        return -1;
    out->current_work_stream = api->current_work_stream;
    if (out->place == KV_DEVICE) {
        void *stream = NULL;
        if (kv_array_current_stream(out, t.device.device_type, t.device.device_id, &stream) < 0)
            return -1;
        out->has_stream = 1;
        out->stream = (intptr_t)stream;
    }
    /* The DLTensor carries no read-only flag: the array is taken as writable. */
    out->owner = Py_NewRef(obj);
    return 0;
}
