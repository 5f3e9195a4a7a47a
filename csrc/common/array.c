/* An array as kvbm_ext sees it (kv_array): what can be asked of one,
 * whatever its protocol.  See array.h; array_read.c reads them. */
#include "array.h"

#include <stdio.h>
#include <string.h>

#include "dlpack.h"

int kv_is_array(PyObject *obj)
{
    if (PyList_Check(obj) || PyTuple_Check(obj))
        return 0;
    /* The buffer protocol first: asking for an attribute by a C string misses
     * the interpreter's type cache, and on free-threaded CPython takes its
     * type lock, which threads calling at once then contend for. */
    return PyObject_CheckBuffer(obj) || PyObject_HasAttrString(obj, "__dlpack__")
           || PyObject_HasAttrString(obj, "__cuda_array_interface__")
           || PyObject_HasAttrString(obj, "__array_interface__");
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
        /* Past int64 the array is refused by its size (kv_array_read) or
         * empty, where no stride is used: the outer strides stay in range. */
        if (__builtin_mul_overflow(stride, a->shape[i], &stride))
            stride = INT64_MAX;
    }
}

int kv_check_ndim(const kv_path *path, Py_ssize_t ndim)
{
    if (ndim < 0 || ndim > KV_MAX_NDIM)
        return kv_path_error(PyExc_ValueError, path, "arrays of %zd dimensions are not supported (at most %d)", ndim,
                             KV_MAX_NDIM);
    return 0;
}

void kv_array_clear(kv_array *out)
{
    memset(out, 0, sizeof *out);
    out->place = KV_HOST;
    out->device_id = -1;
}

int kv_array_has_empty_dimension(const kv_array *a)
{
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] == 0)
            return 1;
    return 0;
}

int64_t kv_array_elements(const kv_array *a)
{
    if (kv_array_has_empty_dimension(a))
        return 0;
    int64_t elements = 1;
    for (int i = 0; i < a->ndim; i++)
        elements *= a->shape[i]; /* in range: kv_array_read checked it */
    return elements;
}

void kv_array_block(const kv_array *stack, int64_t b, kv_array *out)
{
    kv_array_clear(out);
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
