/* Reading the typestr interfaces (__cuda_array_interface__ versions 2 and
 * 3, __array_interface__) and the buffer protocol.  See readers.h. */
#include "readers.h"

#include <stdlib.h>

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
    if (kv_check_ndim(path, ndim) < 0)
        return -1;
    out->ndim = (int)ndim;
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (read_entry(PyTuple_GET_ITEM(shape, i), path, "shape", i, 0, &out->shape[i]) < 0)
            return -1;
    PyObject *strides = entry(p, dict, KV_NAME_STRIDES);
    if (strides == NULL && PyErr_Occurred())
        return -1;
    if (strides == NULL || strides == Py_None) {
        kv_set_compact_strides(out);
        return 0;
    }
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != ndim)
        return kv_path_error(PyExc_TypeError, path, "array interface strides must be None or a tuple of %zd ints",
                             ndim);
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
                                : kv_path_error(PyExc_TypeError, path,
                                                "array interface data must be a (pointer, "
                                                "readonly) tuple");
    PyObject *pointer = PyTuple_GET_ITEM(data, 0);
    uint64_t address;
    if (read_address(pointer, &address) < 0)
        return kv_path_error(PyExc_ValueError, path,
                             "array interface data pointer %R is not an int from 0 to "
                             "2**64 - 1",
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

int kv_from_interface(const kv_protocols *p, PyObject *obj, const kv_path *path, int name, kv_array *out)
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
            kv_path_error(PyExc_ValueError, path,
                          "__cuda_array_interface__ stream %R is not allowed (a nonzero "
                          "cudaStream_t int, or None)",
                          stream);
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
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
    case 'n': dtype->code = kDLInt; break;
    case 'B':
    case 'H':
    case 'I':
    case 'L':
    case 'Q':
    case 'N':
    case 'c': dtype->code = kDLUInt; break;
    case 'e':
    case 'f':
    case 'd': dtype->code = kDLFloat; break;
    case '?': dtype->code = kDLBool; break;
    default: return -1;
    }
    dtype->bits = (uint8_t)(view->itemsize * 8);
    return 0;
}

int kv_from_buffer(PyObject *obj, const kv_path *path, kv_array *out)
{
    if (PyObject_GetBuffer(obj, &out->view, PyBUF_RECORDS_RO) < 0)
        return -1;
    out->has_view = 1;
    const Py_buffer *v = &out->view;
    if (kv_check_ndim(path, v->ndim) < 0 || v->itemsize <= 0 || v->itemsize > 31 || format_dtype(v, &out->dtype) < 0) {
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
