/* kvbm_ext.PagedKVCache: what its layers must still be at each call: their
 * memory must not have moved since construction (torch's resize_ reallocates
 * a storage it grows, freeing the memory the cache was built over).  See
 * paged_internal.h. */
#include "paged_internal.h"

#include <stdio.h>

#include "debug.h"
#include "dlpack.h"

static int check_unmoved(const kv_paged_cache *self, const char *name, Py_ssize_t i, const char *now)
{
    if (now == self->arrays[i].data)
        return 0;
    kv_path path = kv_paged_layer_path(self, i);
    path.name = name;
    char was[24], is[24];
    snprintf(was, sizeof was, "%#llx", (unsigned long long)(uintptr_t)self->arrays[i].data);
    snprintf(is, sizeof is, "%#llx", (unsigned long long)(uintptr_t)now);
    return kv_path_error(PyExc_ValueError, &path,
                         "its memory moved from %s to %s since the cache was built (torch's "
                         "resize_ reallocates a storage it grows), so the cache would move freed memory; build a new "
                         "cache over the layers as they are now",
                         was, is);
}

/* Where array i is now, as its C exchange API describes the object read
 * (for torch, the cache's detached alias: set_ on the caller's tensor does
 * not move it, a resize of their shared storage does). */
static int check_exchange_layer(const kv_paged_cache *self, const char *name, Py_ssize_t i)
{
    DLTensor t;
    if (self->exchange[i]->dltensor_from_py_object_no_sync(self->arrays[i].owner, &t) == 0 && !PyErr_Occurred())
        return check_unmoved(self, name, i, (const char *)t.data + t.byte_offset);
    kv_path path = kv_paged_layer_path(self, i);
    path.name = name;
    return PyErr_Occurred() ? kv_path_error_from(PyExc_ValueError, &path, "its producer can no longer describe it")
                            : kv_path_error(PyExc_ValueError, &path, "its producer can no longer describe it");
}

/* Where array i is now, read again through its protocol, as the caller
 * gave it. */
static int check_reread_layer(const kv_paged_cache *self, const char *name, const kv_reader *reader, Py_ssize_t i)
{
    kv_array now;
    kv_path path = kv_paged_layer_path(self, i);
    path.name = name;
    if (kv_array_read(reader, kv_paged_layer(self, i), &path, 0, &now) < 0)
        return -1;
    const char *data = now.data;
    kv_array_release(&now);
    return check_unmoved(self, name, i, data);
}

/* One array holding every layer, read through a C exchange API, is asked
 * where it is at every call (one C call).  Per-layer arrays would cost one
 * such call per layer, a host cost that grows with the layers, where the
 * rest of a call's does not, so they are checked only under KVBM_EXT_DEBUG
 * (docs/reliability.md), as are arrays without the API (read again through
 * their Python protocol). */
int kv_paged_check_layers(const kv_paged_cache *self, const char *name, const kv_reader *reader,
                          const kv_selection *layers)
{
    const int debug = kv_debug_enabled();
    if (self->narrays > 1 && !debug)
        return 0;
    const int64_t count = self->narrays == 1 ? 1 : layers->count;
    for (int64_t k = 0; k < count; k++) {
        const Py_ssize_t i = self->narrays == 1 ? 0 : (Py_ssize_t)(layers->first + k * layers->step);
        const int rc = self->exchange[i] != NULL ? check_exchange_layer(self, name, i)
                       : debug                   ? check_reread_layer(self, name, reader, i)
                                                 : 0;
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* A weak reference to obj, kept in the cache's guards; none where obj takes
 * none. */
static int keep_weak_reference(kv_paged_cache *self, PyObject *obj)
{
    PyObject *ref = PyWeakref_NewRef(obj, NULL);
    if (ref == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    const int rc = PyList_Append(self->guards, ref);
    Py_DECREF(ref);
    return rc;
}

/* Array i's guard: its C exchange API (the capsule holding it kept), or
 * weak references to the layer and to its `base`: NumPy refuses to resize
 * an array that has weak references, even with refcheck=False, and a
 * view's memory is its base's. */
static int guard_layer(kv_paged_cache *self, kv_protocols *p, Py_ssize_t i)
{
    if (self->arrays[i].current_work_stream != NULL) {
        kv_type_facts facts = kv_type_facts_of(p, Py_TYPE(self->arrays[i].owner));
        int rc = 0;
        if (facts.exchange != NULL && (rc = PyList_Append(self->guards, facts.exchange_capsule)) == 0)
            self->exchange[i] = facts.exchange;
        kv_type_facts_release(&facts);
        return rc;
    }
    PyObject *layer = kv_paged_layer(self, i);
    /* A layer without a readable base (most producers have none) has nothing to guard. */
    PyObject *base = PyObject_GetAttrString(layer, "base");
    if (base == NULL && (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)))
        return -1;
    PyErr_Clear();
    int rc = keep_weak_reference(self, layer);
    if (rc == 0 && base != NULL && base != Py_None)
        rc = keep_weak_reference(self, base);
    Py_XDECREF(base);
    return rc;
}

int kv_paged_guard_layers(kv_paged_cache *self, kv_protocols *p)
{
    self->exchange = PyMem_Calloc((size_t)self->narrays, sizeof *self->exchange);
    if (self->exchange == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if ((self->guards = PyList_New(0)) == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < self->narrays; i++)
        if (guard_layer(self, p, i) < 0)
            return -1;
    return 0;
}
