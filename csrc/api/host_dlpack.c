/* HostBuffer's DLPack export: versioned and legacy capsules of its memory,
 * each holding the memory until its consumer lets go of it.  See
 * host_buffer.h. */
#include "host_buffer.h"

#include <stdlib.h>

#include "args.h"
#include "dlpack.h"

static const char VERSIONED[] = "dltensor_versioned";
static const char LEGACY[] = "dltensor";

/* The DLPack 1.x minor version the versioned capsules follow. */
#define KV_DLPACK_MINOR 3

/* One export: the managed tensor first, the consumer's pointer to it being
 * the export; malloc'ed, since a consumer may free it without the GIL. */
typedef struct {
    DLManagedTensorVersioned managed;
    int64_t shape[KV_MAX_NDIM];
    kv_host_pool *pool;
} kv_versioned_export;

typedef struct {
    DLManagedTensor managed;
    int64_t shape[KV_MAX_NDIM];
    kv_host_pool *pool;
} kv_legacy_export;

/* The deleters run on any thread, with or without the GIL.  A failure to
 * unregister cannot be reported from here; the memory is unmapped all the
 * same. */
static void release_export(kv_host_pool *pool, void *export)
{
    char why[160];
    (void)kv_host_pool_release(pool, why, sizeof why);
    free(export);
}

static void delete_versioned(DLManagedTensorVersioned *managed)
{
    kv_versioned_export *export = managed->manager_ctx;
    release_export(export->pool, export);
}

static void delete_legacy(DLManagedTensor *managed)
{
    kv_legacy_export *export = managed->manager_ctx;
    release_export(export->pool, export);
}

/* A capsule nobody consumed (still named dltensor*) owns its tensor. */
static void destroy_versioned_capsule(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, VERSIONED))
        return;
    DLManagedTensorVersioned *managed = PyCapsule_GetPointer(capsule, VERSIONED);
    managed->deleter(managed);
}

static void destroy_legacy_capsule(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, LEGACY))
        return;
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, LEGACY);
    managed->deleter(managed);
}

static void fill_tensor(const kv_host_buffer *self, int32_t device_type, int64_t *shape, DLTensor *t)
{
    for (int i = 0; i < self->ndim; i++)
        shape[i] = self->shape[i];
    t->data = self->data;
    t->device = (DLDevice){device_type, 0};
    t->ndim = self->ndim;
    t->dtype = (DLDataType){self->dtype->dtype.code, self->dtype->dtype.bits, 1};
    t->shape = shape;
    t->strides = NULL; /* compact row-major */
    t->byte_offset = 0;
}

/* A capsule of self's memory; `minor` < 0 asks for the legacy form. */
static PyObject *export_capsule(kv_host_buffer *self, int32_t device_type, int minor)
{
    PyObject *capsule;
    if (minor >= 0) {
        kv_versioned_export *export = calloc(1, sizeof *export);
        if (export == NULL)
            return PyErr_NoMemory();
        export->managed.version = (DLPackVersion){1, (uint32_t)minor};
        export->managed.manager_ctx = export;
        export->managed.deleter = delete_versioned;
        fill_tensor(self, device_type, export->shape, &export->managed.dl_tensor);
        export->pool = self->pool;
        capsule = PyCapsule_New(&export->managed, VERSIONED, destroy_versioned_capsule);
        if (capsule == NULL)
            free(export);
    }
    else {
        kv_legacy_export *export = calloc(1, sizeof *export);
        if (export == NULL)
            return PyErr_NoMemory();
        export->managed.manager_ctx = export;
        export->managed.deleter = delete_legacy;
        fill_tensor(self, device_type, export->shape, &export->managed.dl_tensor);
        export->pool = self->pool;
        capsule = PyCapsule_New(&export->managed, LEGACY, destroy_legacy_capsule);
        if (capsule == NULL)
            free(export);
    }
    if (capsule != NULL)
        atomic_fetch_add_explicit(&self->pool->owners, 1, memory_order_relaxed);
    return capsule;
}

/* The versioned minor to export for max_version (absent or None: -1, the
 * legacy capsule; so too for a major below 1). */
static int read_max_version(PyObject *max_version, int *minor)
{
    *minor = -1;
    if (max_version == NULL || max_version == Py_None)
        return 0;
    if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: max_version: expected None or a (major, minor) tuple, got %s",
                     Py_TYPE(max_version)->tp_name);
        return -1;
    }
    int64_t major, wanted;
    const kv_path major_path = {"max_version", {0}, 1}, minor_path = {"max_version", {1}, 1};
    if (kv_int64(PyTuple_GET_ITEM(max_version, 0), &major_path, "an int", 0, INT32_MAX, &major) < 0
        || kv_int64(PyTuple_GET_ITEM(max_version, 1), &minor_path, "an int", 0, INT32_MAX, &wanted) < 0)
        return -1;
    if (major >= 1)
        *minor = major > 1 || wanted > KV_DLPACK_MINOR ? KV_DLPACK_MINOR : (int)wanted;
    return 0;
}

/* The device type to export on: dl_device when the consumer names one the
 * memory is on without a copy; by default the CPU (see the doc below). */
static int read_dl_device(const kv_host_buffer *self, PyObject *dl_device, int32_t *device_type)
{
    *device_type = kDLCPU;
    if (dl_device == NULL || dl_device == Py_None)
        return 0;
    int64_t type, id;
    const kv_path type_path = {"dl_device", {0}, 1}, id_path = {"dl_device", {1}, 1};
    if (!PyTuple_Check(dl_device) || PyTuple_GET_SIZE(dl_device) != 2) {
        PyErr_Format(PyExc_TypeError,
                     "__dlpack__: dl_device: expected None or a (device_type, device_id) tuple, "
                     "got %s",
                     Py_TYPE(dl_device)->tp_name);
        return -1;
    }
    if (kv_int64(PyTuple_GET_ITEM(dl_device, 0), &type_path, "an int", 0, INT32_MAX, &type) < 0
        || kv_int64(PyTuple_GET_ITEM(dl_device, 1), &id_path, "an int", 0, INT32_MAX, &id) < 0)
        return -1;
    if (type == kDLCPU || (type == kDLCUDAHost && self->pinned)) {
        *device_type = (int32_t)type;
        return 0;
    }
    PyErr_Format(PyExc_BufferError,
                 "__dlpack__: dl_device (%lld, %lld): this buffer is %s host memory (DLPack device "
                 "type %d%s); it is exported where it is, never copied",
                 (long long)type, (long long)id, self->pinned ? "pinned" : "pageable",
                 self->pinned ? kDLCUDAHost : kDLCPU, self->pinned ? " or 1" : "");
    return -1;
}

const char kv_host_buffer_dlpack_doc[] = KV_HOST_BUFFER_DLPACK_TEXT_SIGNATURE
    "A DLPack capsule of this memory, without a copy: \"dltensor_versioned\" when\n"
    "max_version is (1, m) or later, else the legacy \"dltensor\".  The capsule holds\n"
    "the memory (a close() meanwhile does not free it) until its consumer lets go.\n"
    "The tensor says device type 1 (CPU) unless dl_device asks for (3, 0)\n"
    "(kDLCUDAHost, pinned buffers only): torch imports CPU capsules only, and a\n"
    "pinned buffer read as CPU memory is still pinned (torch: is_pinned() is True).\n"
    "__dlpack_device__() says (3, 0) for a pinned buffer, as torch does for its own.\n"
    "stream: None or an int (host memory has no pending work to order).  copy=True\n"
    "raises BufferError, and so does a closed buffer.";

PyObject *kv_host_buffer_dlpack(kv_host_buffer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_dlpack_args a;
    int minor;
    int32_t device_type;
    if (kv_parse_arguments(&kv_host_buffer_dlpack_signature, args, nargs, kwnames, &a) < 0)
        return NULL;
    if (a.stream != NULL && a.stream != Py_None && (!PyLong_Check(a.stream) || PyBool_Check(a.stream))) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: stream: expected None or an int, got %s",
                     Py_TYPE(a.stream)->tp_name);
        return NULL;
    }
    if (read_max_version(a.max_version, &minor) < 0 || read_dl_device(self, a.dl_device, &device_type) < 0)
        return NULL;
    const int copy = a.copy == NULL || a.copy == Py_None ? 0 : PyObject_IsTrue(a.copy);
    if (copy < 0)
        return NULL;
    if (copy) {
        PyErr_SetString(PyExc_BufferError, "__dlpack__: copy=True: a HostBuffer exports its own memory, never a copy");
        return NULL;
    }
    if (kv_host_buffer_check_open(self, "__dlpack__") < 0)
        return NULL;
    return export_capsule(self, device_type, minor);
}

const char kv_host_buffer_dlpack_device_doc[] = KV_HOST_BUFFER_DLPACK_DEVICE_TEXT_SIGNATURE
    "(3, 0) (kDLCUDAHost) for a pinned buffer, (1, 0) (kDLCPU) for the others.";

PyObject *kv_host_buffer_dlpack_device(kv_host_buffer *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("(ii)", self->pinned ? kDLCUDAHost : kDLCPU, 0);
}
