/* Address, size and block-id lists.  See address_list.h. */
#include "address_list.h"

#include <string.h>

#include "args.h"
#include "dlpack.h"
#include "gpu.h"

/* Names entry `index` of a list in errors, e.g. src_ptrs[3]. */
static kv_path entry_path(const char *name, Py_ssize_t index)
{
    const kv_path path = {name, {index, 0}, 1};
    return path;
}

static const char *const EXPECTED[3] = {
    [KV_LIST_ADDRESSES] = "a sequence of ints or a 1-D int64/uint64 array",
    [KV_LIST_SIZES] = "an int, a sequence of ints or a 1-D int64/uint64 array",
    [KV_LIST_BLOCK_IDS] = "a sequence of ints or a 1-D int32/int64 array",
};

/* One int of a sequence: an address or size from 0 to 2**64 - 1, or a block
 * id that fits in int64. */
static int read_int(PyObject *item, const kv_path *entry, kv_list_kind kind, uint64_t *value)
{
    if (kind != KV_LIST_BLOCK_IDS)
        return kv_uint64(item, entry, value);
    int64_t id;
    if (kv_int64(item, entry, "an int", INT64_MIN, INT64_MAX, &id) < 0)
        return -1;
    *value = (uint64_t)id;
    return 0;
}

/* One size for every entry. */
static int one_value(PyObject *obj, const char *name, kv_address_list *out)
{
    const kv_path path = {name, {0, 0}, 0};
    if (kv_uint64(obj, &path, &out->value) < 0)
        return -1;
    out->one_value = 1;
    return 0;
}

static int from_sequence(PyObject *obj, const char *name, kv_list_kind kind, kv_address_list *out)
{
    const kv_path path = {name, {0, 0}, 0};
    PyObject *seq = kv_as_sequence(obj, &path, EXPECTED[kind]);
    if (seq == NULL)
        return -1;
    out->count = PySequence_Fast_GET_SIZE(seq);
    out->values = PyMem_Malloc((size_t)(out->count > 0 ? out->count : 1) * sizeof(uint64_t));
    if (out->values == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < out->count; i++) {
        const kv_path entry = entry_path(name, i);
        if (read_int(PySequence_Fast_GET_ITEM(seq, i), &entry, kind, &out->values[i]) < 0) {
            Py_DECREF(seq);
            PyMem_Free(out->values);
            out->values = NULL;
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* The element types a list accepts: int64/uint64 addresses and sizes,
 * int32/int64 block ids. */
static int element_type_ok(kv_dtype dtype, kv_list_kind kind)
{
    if (kind == KV_LIST_BLOCK_IDS)
        return dtype.code == kDLInt && (dtype.bits == 32 || dtype.bits == 64);
    return (dtype.code == kDLInt || dtype.code == kDLUInt) && dtype.bits == 64;
}

static int from_array(const kv_reader *reader, PyObject *obj, const char *name, kv_list_kind kind, int allow_device,
                      kv_address_list *out)
{
    const kv_path path = {name, {0, 0}, 0};
    kv_array *a = &out->array;
    if (kv_array_read(reader, obj, &path, 0, a) < 0)
        return -1;
    if (a->ndim == 0 && kind == KV_LIST_SIZES) {
        /* An integer scalar (np.int64(4096)): one size, read as an int. */
        kv_array_release(a);
        return one_value(obj, name, out);
    }
    char dtype[48];
    int rc = -1;
    if (a->ndim != 1)
        kv_path_error(PyExc_ValueError, &path, "expected a 1-D array, got %d dimensions", a->ndim);
    else if (!element_type_ok(a->dtype, kind))
        kv_path_error(PyExc_TypeError, &path, "expected %s elements, got %s",
                      kind == KV_LIST_BLOCK_IDS ? "int32 or int64" : "int64 or uint64",
                      kv_dtype_name(a->dtype, dtype, sizeof dtype));
    else if (!kv_array_is_contiguous(a))
        kv_path_error(PyExc_ValueError, &path, "array must be contiguous");
    else if (a->place == KV_DEVICE && !allow_device)
        kv_path_error(PyExc_ValueError, &path, "must be in host memory (this function reads the list on the host)");
    else if (a->place == KV_DEVICE && kv_gpu_locate(a, &path) == 0)
        rc = 0;
    else if (a->place != KV_DEVICE)
        rc = 0;
    if (rc < 0) {
        kv_array_release(a);
        return -1;
    }
    out->count = a->shape[0];
    out->int32 = a->dtype.bits == 32;
    if (a->place == KV_DEVICE) {
        out->on_device = 1;
        out->device_id = a->device_id;
        out->values = (uint64_t *)a->data;
        return 0; /* the array stays borrowed */
    }
    out->values = PyMem_Malloc((size_t)(out->count > 0 ? out->count : 1) * sizeof(uint64_t));
    if (out->values == NULL) {
        kv_array_release(a);
        PyErr_NoMemory();
        return -1;
    }
    if (out->int32)
        for (Py_ssize_t i = 0; i < out->count; i++)
            out->values[i] = (uint64_t)(int64_t)((const int32_t *)a->data)[i];
    else
        memcpy(out->values, a->data, (size_t)out->count * sizeof(uint64_t));
    out->int32 = 0;
    const int check_sign = kind != KV_LIST_BLOCK_IDS && a->dtype.code == kDLInt;
    kv_array_release(a);
    for (Py_ssize_t i = 0; check_sign && i < out->count; i++) {
        if ((int64_t)out->values[i] < 0) {
            const kv_path entry = entry_path(name, i);
            kv_path_error(PyExc_ValueError, &entry, "expected a non-negative value, got %lld",
                          (long long)out->values[i]);
            PyMem_Free(out->values);
            out->values = NULL;
            return -1;
        }
    }
    return 0;
}

int kv_address_list_read(const kv_reader *reader, PyObject *obj, const char *name, kv_list_kind kind, int allow_device,
                         kv_address_list *out)
{
    memset(out, 0, sizeof *out);
    out->device_id = -1;
    /* Ints, lists and tuples first: asking them for the array protocols
     * costs more than reading them. */
    if (kind == KV_LIST_SIZES && PyLong_Check(obj) && !PyBool_Check(obj))
        return one_value(obj, name, out);
    if (PyList_Check(obj) || PyTuple_Check(obj))
        return from_sequence(obj, name, kind, out);
    if (kv_is_array(obj))
        return from_array(reader, obj, name, kind, allow_device, out);
    if (kind == KV_LIST_SIZES && PyIndex_Check(obj))
        return one_value(obj, name, out);
    return from_sequence(obj, name, kind, out);
}

void kv_address_list_release(kv_address_list *list)
{
    if (list->on_device)
        kv_array_release(&list->array);
    else
        PyMem_Free(list->values);
    list->values = NULL;
    list->on_device = 0;
}
