/* Borrowing arrays from Python objects: kv_array_read and kv_array_keep,
 * through the protocol readers readers.h lists, and the checks every array
 * passes whatever its protocol.  See array.h. */
#include "readers.h"

/* Borrows obj through the first protocol it offers, the C exchange API
 * first. */
static int read_protocol(const kv_reader *reader, PyObject *obj, const kv_type_facts *facts, const kv_path *path,
                         kv_array *out)
{
    const kv_protocols *p = reader->protocols;
    if (facts->exchange != NULL) {
        const int rc = kv_from_exchange(obj, facts->exchange, path, out);
        if (rc <= 0)
            return rc;
        kv_array_clear(out);
    }
    if (PyObject_HasAttr(obj, p->names[KV_NAME_DLPACK]) && PyObject_HasAttr(obj, p->names[KV_NAME_DLPACK_DEVICE]))
        return kv_from_dlpack(reader, obj, path, out);
    if (PyObject_HasAttr(obj, p->names[KV_NAME_CUDA_ARRAY_INTERFACE])) {
        out->place = KV_DEVICE;
        return kv_from_interface(p, obj, path, KV_NAME_CUDA_ARRAY_INTERFACE, out);
    }
    if (PyObject_HasAttr(obj, p->names[KV_NAME_ARRAY_INTERFACE]))
        return kv_from_interface(p, obj, path, KV_NAME_ARRAY_INTERFACE, out);
    if (PyObject_CheckBuffer(obj))
        return kv_from_buffer(obj, path, out);
    return kv_path_error(PyExc_TypeError, path,
                         "expected an array (DLPack, __cuda_array_interface__, "
                         "__array_interface__ or a buffer), got %s",
                         Py_TYPE(obj)->tp_name);
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
    if (kv_array_has_empty_dimension(a))
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
        if (a->strides[i] == INT64_MIN
            || __builtin_mul_overflow(a->strides[i] < 0 ? -a->strides[i] : a->strides[i], a->shape[i] - 1, &reach))
            return kv_path_error(PyExc_ValueError, path, "stride %lld of dimension %d reaches past 2**63 - 1 bytes",
                                 (long long)a->strides[i], i);
    }
    return 0;
}

int kv_array_read(const kv_reader *reader, PyObject *obj, const kv_path *path, int write, kv_array *out)
{
    kv_array_clear(out);
    kv_type_facts facts = kv_type_facts_of(reader->protocols, Py_TYPE(obj));
    int rc = read_protocol(reader, obj, &facts, path, out);
    if (rc == 0 && facts.is_neg != NULL)
        rc = kv_check_torch(reader->protocols, obj, &facts, path, write, out);
    kv_type_facts_release(&facts);
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
