/* Borrowing arrays from Python objects: the entry points, and the checks
 * every array passes whatever its protocol.  The protocols themselves are
 * read by the files readers.h lists. */
#include "readers.h"

#include <stdio.h>
#include <string.h>

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

int kv_check_itemsize(const kv_array *a, const kv_path *path)
{
    if (a->itemsize == 1 || a->itemsize == 2 || a->itemsize == 4 || a->itemsize == 8)
        return 0;
    char name[48];
    return kv_path_error(PyExc_TypeError, path, "element type %s has %lld bytes; supported sizes are 1, 2, 4 and 8",
                         kv_dtype_name(a->dtype, name, sizeof name), (long long)a->itemsize);
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

void kv_set_compact_strides(kv_array *a)
{
    int64_t stride = a->itemsize;
    for (int i = a->ndim - 1; i >= 0; i--) {
        a->strides[i] = stride;
        stride *= a->shape[i];
    }
}

int kv_check_ndim(const kv_path *path, Py_ssize_t ndim)
{
    if (ndim < 0 || ndim > KV_MAX_NDIM)
        return kv_path_error(PyExc_ValueError, path, "arrays of %zd dimensions are not supported (at most %d)",
                             ndim, KV_MAX_NDIM);
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
        const int rc = kv_from_exchange(obj, facts->exchange, path, out);
        if (rc <= 0)
            return rc;
        clear_array(out);
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

int kv_array_read(const kv_reader *reader, PyObject *obj, const kv_path *path, int write, kv_array *out)
{
    clear_array(out);
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
    Py_CLEAR(a->written_tensor);
}
