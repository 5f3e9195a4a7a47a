/* kvbm_ext.HostBuffer: its attributes, close(), the context manager, the
 * buffer protocol and __array_interface__.  See host_buffer.h. */
#include "host_buffer.h"

#include <stddef.h>

#include "args.h"
#include "debug.h"

int kv_host_buffer_check_open(const kv_host_buffer *self, const char *what)
{
    if (!self->closed)
        return 0;
    PyErr_Format(PyExc_BufferError, "%s: this HostBuffer is closed; its memory can no longer be exported", what);
    return -1;
}

/* The pieces of the pool's registration, as offsets from its start. */
static PyObject *registration_tuple(const kv_host_pool *pool)
{
    const kv_host_registration *r = &pool->registration;
    PyObject *pieces = PyTuple_New(r->count);
    for (int i = 0; pieces != NULL && i < r->count; i++) {
        PyObject *piece =
            Py_BuildValue("(nn)", (Py_ssize_t)(r->pieces[i].start - pool->base), (Py_ssize_t)r->pieces[i].bytes);
        if (piece == NULL)
            Py_CLEAR(pieces);
        else
            PyTuple_SET_ITEM(pieces, i, piece);
    }
    return pieces;
}

kv_host_buffer *kv_host_buffer_new(PyTypeObject *type, kv_host_pool *pool)
{
    PyObject *registrations = registration_tuple(pool);
    kv_host_buffer *self = registrations == NULL ? NULL : (kv_host_buffer *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_XDECREF(registrations);
        return NULL;
    }
    self->pool = pool;
    self->data = pool->base;
    self->registrations = registrations;
    self->numa_node = -1;
    self->shared = Py_NewRef(Py_None);
    self->created = 1;
    return self;
}

/* Gives up this object's hold on its memory; the last holder unregisters
 * and unmaps it, which takes time in proportion to its size: without the
 * GIL.  Returns 0, or -1 with `why` saying how unregistering failed. */
static int let_go(kv_host_buffer *self, char *why, size_t why_size)
{
    kv_host_pool *pool = self->pool;
    if (pool == NULL)
        return 0;
    self->pool = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kv_host_pool_release(pool, why, why_size);
    Py_END_ALLOW_THREADS
    return rc;
}

/* For the paths that cannot raise (dealloc, a released view): the failure
 * goes to sys.unraisablehook, any exception being raised is kept. */
static void report_unraisable(const char *why)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_Format(PyExc_RuntimeError, "kvbm_ext.HostBuffer: releasing its memory: %s", why);
    PyErr_WriteUnraisable(NULL);
    PyErr_Restore(type, value, traceback);
}

static void host_dealloc(kv_host_buffer *self)
{
    PyTypeObject *type = Py_TYPE(self);
    char why[192];
    if (let_go(self, why, sizeof why) < 0)
        report_unraisable(why);
    Py_XDECREF(self->registrations);
    Py_XDECREF(self->shared);
    type->tp_free(self);
    Py_DECREF(type);
}

/* ------------------------------------------------------------ methods */

PyDoc_STRVAR(close_doc, KV_HOST_BUFFER_CLOSE_TEXT_SIGNATURE
             "Release the memory now rather than when the last reference goes: unregister it\n"
             "from the driver, then unmap it.  Idempotent.  Afterwards every export (DLPack,\n"
             "the buffer protocol, __array_interface__) raises BufferError; the attributes\n"
             "still read.  Exports made before stay valid: the memory goes when the last of\n"
             "them is released (a DLPack consumer's tensor, a memoryview or NumPy array), and,\n"
             "where __array_interface__ was read (a bare address, whose holder keeps only this\n"
             "object alive), when this object goes.  Work queued on a GPU that reads or writes\n"
             "the memory must be finished first (synchronize its streams): freeing it does not\n"
             "wait for that work.  A shared region's name (pinned_empty(shared=NAME)) is\n"
             "unlinked when the memory goes, where no other process maps it.  RuntimeError,\n"
             "after the memory is unmapped, when unregistering (or unlinking) failed.");

static PyObject *host_close(kv_host_buffer *self, PyObject *unused)
{
    (void)unused;
    if (self->closed)
        Py_RETURN_NONE;
    self->closed = 1;
    if (self->buffer_exports > 0 || self->address_given) {
        kv_debug("HostBuffer.close(): %lld bytes kept until %s", (long long)self->nbytes,
                 self->buffer_exports > 0 ? "its buffer views are released"
                                          : "the object goes (__array_interface__ "
                                            "was read)");
        Py_RETURN_NONE;
    }
    const int exported = self->pool != NULL && atomic_load(&self->pool->owners) > 1;
    char why[192];
    if (let_go(self, why, sizeof why) < 0) {
        PyErr_Format(PyExc_RuntimeError, "HostBuffer.close(): %s", why);
        return NULL;
    }
    kv_debug("HostBuffer.close(): %lld bytes %s", (long long)self->nbytes,
             exported ? "kept until its DLPack exports are released" : "released");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(enter_doc, KV_HOST_BUFFER_ENTER_TEXT_SIGNATURE "Returns the buffer.");

static PyObject *host_enter(kv_host_buffer *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

PyDoc_STRVAR(exit_doc, KV_HOST_BUFFER_EXIT_TEXT_SIGNATURE "Closes the buffer (close()).");

static PyObject *host_exit(kv_host_buffer *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args, (void)nargs;
    PyObject *result = host_close(self, NULL);
    Py_XDECREF(result);
    return result == NULL ? NULL : Py_NewRef(Py_False);
}

PyDoc_STRVAR(pointer_kind_doc, "_pointer_kind(address, /)\n--\n\n"
                               "What the CUDA driver says the address is: \"device\", \"managed\", \"pinned\" or\n"
                               "\"pageable\" (cudaPointerGetAttributes).  RuntimeError in a build without CUDA.");

static PyObject *host_pointer_kind(PyObject *unused, PyObject *address)
{
    (void)unused;
    uint64_t value;
    const kv_path path = {"address", {0}, 0};
    if (kv_uint64(address, &path, &value) < 0)
        return NULL;
    const char *kind = kv_gpu_pointer_kind((const void *)(uintptr_t)value);
    return kind == NULL ? NULL : PyUnicode_FromString(kind);
}

static PyMethodDef host_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))kv_host_buffer_dlpack, METH_FASTCALL | METH_KEYWORDS,
     kv_host_buffer_dlpack_doc},
    {"__dlpack_device__", (PyCFunction)kv_host_buffer_dlpack_device, METH_NOARGS, kv_host_buffer_dlpack_device_doc},
    {"close", (PyCFunction)host_close, METH_NOARGS, close_doc},
    {"__enter__", (PyCFunction)host_enter, METH_NOARGS, enter_doc},
    {"__exit__", (PyCFunction)(void (*)(void))host_exit, METH_FASTCALL, exit_doc},
    {"_pointer_kind", host_pointer_kind, METH_O | METH_STATIC, pointer_kind_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------ attributes */

static PyObject *shape_tuple(const kv_host_buffer *self)
{
    PyObject *shape = PyTuple_New(self->ndim);
    for (int i = 0; shape != NULL && i < self->ndim; i++) {
        PyObject *extent = PyLong_FromSsize_t(self->shape[i]);
        if (extent == NULL)
            Py_CLEAR(shape);
        else
            PyTuple_SET_ITEM(shape, i, extent);
    }
    return shape;
}

static PyObject *get_shape(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return shape_tuple(self);
}

static PyObject *get_dtype(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return PyUnicode_FromString(self->dtype->name);
}

static PyObject *get_nbytes(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return PyLong_FromLongLong(self->nbytes);
}

/* The int and bool members, by offset. */
static PyObject *get_flag(kv_host_buffer *self, void *offset)
{
    return PyBool_FromLong(*(const int *)((const char *)self + (size_t)offset));
}

static PyObject *get_int(kv_host_buffer *self, void *offset)
{
    return PyLong_FromLong(*(const int *)((const char *)self + (size_t)offset));
}

static PyObject *get_registrations(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->registrations);
}

static PyObject *get_shared(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->shared);
}

static PyObject *get_numa_node(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return self->numa_node < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(self->numa_node);
}

static PyObject *get_huge_pages(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return PyUnicode_FromString(KV_HUGE_NAMES[self->huge_pages]);
}

static PyObject *get_seconds(kv_host_buffer *self, void *unused)
{
    (void)unused;
    return PyFloat_FromDouble(self->seconds);
}

static PyObject *get_array_interface(kv_host_buffer *self, void *unused)
{
    (void)unused;
    if (kv_host_buffer_check_open(self, "__array_interface__") < 0)
        return NULL;
    PyObject *shape = shape_tuple(self);
    PyObject *address = shape == NULL ? NULL : PyLong_FromVoidPtr(self->data);
    if (address == NULL) {
        Py_XDECREF(shape);
        return NULL;
    }
    const char *typestr = self->dtype->typestr;
    PyObject *interface =
        Py_BuildValue("{s:N,s:s,s:[(s,s)],s:(N,O),s:O,s:i}", "shape", shape, "typestr", typestr, "descr", "", typestr,
                      "data", address, Py_False, "strides", Py_None, "version", 3);
    if (interface != NULL)
        self->address_given = 1;
    return interface;
}

#define MEMBER(name) (void *)offsetof(kv_host_buffer, name)

static PyGetSetDef host_getset[] = {
    {"shape", (getter)get_shape, NULL, "the extents, a tuple of ints", NULL},
    {"dtype", (getter)get_dtype, NULL, "the element type's name, e.g. 'bfloat16'", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "bytes of the array (the mapping is rounded up to 2 MiB)", NULL},
    {"pinned", (getter)get_flag, NULL, "True when registered with the CUDA driver (page-locked)", MEMBER(pinned)},
    {"registrations", (getter)get_registrations, NULL,
     "the pieces registered with the driver, ((offset, nbytes), ...) from the start, tiling the\n"
     "mapping; one unless the driver refused the whole or KVBM_EXT_HOST_REGISTER_PIECE asked;\n"
     "() when not pinned.  Each shape[0] slice lies inside one piece.",
     NULL},
    {"numa_node", (getter)get_numa_node, NULL, "the NUMA node the pages were placed on, or None", NULL},
    {"huge_pages", (getter)get_huge_pages, NULL, "what was taken: 'transparent', 'explicit' or 'none'", NULL},
    {"threads", (getter)get_int, NULL, "the threads that touched the pages first", MEMBER(threads)},
    {"seconds", (getter)get_seconds, NULL, "the time the allocation took, registration included", NULL},
    {"closed", (getter)get_flag, NULL, "True after close()", MEMBER(closed)},
    {"shared", (getter)get_shared, NULL,
     "the name of the shared region it maps (/dev/shm/<shared>), or None for memory of its own", NULL},
    {"created", (getter)get_flag, NULL,
     "True where this process made the memory; False for a shared region another process made", MEMBER(created)},
    {"__array_interface__", (getter)get_array_interface, NULL, "NumPy's array interface (version 3)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* ------------------------------------------------------------ buffer protocol */

static int host_getbuffer(kv_host_buffer *self, Py_buffer *view, int flags)
{
    view->obj = NULL;
    if (kv_host_buffer_check_open(self, "the buffer protocol") < 0)
        return -1;
    view->buf = self->data;
    view->len = (Py_ssize_t)self->nbytes;
    view->readonly = 0;
    view->itemsize = self->dtype->dtype.bits / 8;
    view->format = (flags & PyBUF_FORMAT) ? (char *)self->dtype->format : NULL;
    view->ndim = self->ndim;
    view->shape = (flags & PyBUF_ND) ? self->shape : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? self->strides : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !PyBuffer_IsContiguous(view, 'F')) {
        PyErr_SetString(PyExc_BufferError, "a HostBuffer is C-contiguous, not Fortran-contiguous");
        return -1;
    }
    view->obj = Py_NewRef(self);
    self->buffer_exports++;
    return 0;
}

static void host_releasebuffer(kv_host_buffer *self, Py_buffer *view)
{
    (void)view;
    char why[192];
    if (--self->buffer_exports == 0 && self->closed && !self->address_given && let_go(self, why, sizeof why) < 0)
        report_unraisable(why);
}

/* ------------------------------------------------------------ the type */

static PyObject *host_repr(kv_host_buffer *self)
{
    PyObject *shape = shape_tuple(self);
    PyObject *node = shape == NULL ? NULL : get_numa_node(self, NULL);
    PyObject *shared = node == NULL              ? NULL
                       : self->shared == Py_None ? PyUnicode_FromString("")
                                                 : PyUnicode_FromFormat(", shared=%R", self->shared);
    PyObject *repr =
        shared == NULL
            ? NULL
            : PyUnicode_FromFormat("HostBuffer(shape=%R, dtype='%s', nbytes=%lld, pinned=%s, numa_node=%R, "
                                   "huge_pages='%s'%s%U)",
                                   shape, self->dtype->name, (long long)self->nbytes, self->pinned ? "True" : "False",
                                   node, KV_HUGE_NAMES[self->huge_pages], self->closed ? ", closed" : "", shared);
    Py_XDECREF(shared);
    Py_XDECREF(node);
    Py_XDECREF(shape);
    return repr;
}

PyDoc_STRVAR(host_doc, "An array in host memory from kvbm_ext.pinned_empty: page-locked (pinned) where a\n"
                       "GPU can be reached, mapped for it alone (or shared by name with other processes:\n"
                       "`shared`, `created`), aligned to 2 MiB, C-contiguous.\n\n"
                       "Every kvbm_ext function takes it as an array, and so do torch, NumPy, CuPy and\n"
                       "JAX, without a copy: DLPack (torch.from_dlpack(buf); is_pinned() is True when\n"
                       "pinned), the buffer protocol (np.asarray(buf), memoryview(buf)) and\n"
                       "__array_interface__.  NumPy has no bfloat16 or float8: through the buffer\n"
                       "protocol and the interface their bits read as uint16 and uint8.\n\n"
                       "The memory is released (unregistered, then unmapped) when the last reference to\n"
                       "it goes: this object's, and each export's (see close()).  Releasing does not wait\n"
                       "for GPU work queued on the memory: finish it first.  A with-block closes the\n"
                       "buffer at its end.  A shared region (pinned_empty(shared=NAME)) is unlinked\n"
                       "from /dev/shm when the last process that maps it releases it.");

static PyType_Slot host_slots[] = {
    {Py_tp_doc, (void *)host_doc},
    {Py_tp_dealloc, host_dealloc},
    {Py_tp_methods, host_methods},
    {Py_tp_getset, host_getset},
    {Py_tp_repr, host_repr},
    {Py_bf_getbuffer, host_getbuffer},
    {Py_bf_releasebuffer, host_releasebuffer},
    {0, NULL},
};

/* Made only by pinned_empty. */
static PyType_Spec host_spec = {
    .name = "kvbm_ext.HostBuffer",
    .basicsize = sizeof(kv_host_buffer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = host_slots,
};

int kv_host_buffer_add_type(PyObject *module, PyObject **type)
{
    *type = PyType_FromModuleAndSpec(module, &host_spec, NULL);
    return *type == NULL ? -1 : PyModule_AddObjectRef(module, "HostBuffer", *type);
}
