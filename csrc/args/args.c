/* Argument helpers shared by the entry points.  See args.h. */
#include "args.h"

#include <stdio.h>
#include <string.h>

/* The names a name argument takes, for its errors: "a", "b" or "c". */
static void format_names(const char *const *names, int count, char *valid, size_t size)
{
    size_t n = 0;
    for (int i = 0; i < count && n < size; i++)
        n += (size_t)snprintf(valid + n, size - n, "%s\"%s\"", i == 0 ? "" : i == count - 1 ? " or " : ", ", names[i]);
}

/* The index of the n bytes at `s` among `names`, ignoring case; -1 where
 * none matches.  Whole strings are compared: an embedded NUL is just
 * another name that does not match. */
static int find_name(const char *s, size_t n, const char *const *names, int count)
{
    for (int i = 0; i < count; i++)
        if (strlen(names[i]) == n && memchr(s, '\0', n) == NULL && PyOS_strnicmp(s, names[i], n) == 0)
            return i;
    return -1;
}

int kv_parse_name(PyObject *value, const char *argument, const char *const *names, int count, const char *fallback,
                  int *out)
{
    if (value == NULL) {
        /* The default is found as a given name is, so that it is written
         * once, as signatures.c's text. */
        *out = find_name(fallback, strlen(fallback), names, count);
        if (*out >= 0)
            return 0;
        PyErr_Format(PyExc_SystemError, "%s: its default \"%s\" is none of its names", argument, fallback);
        return -1;
    }
    char valid[160];
    if (!PyUnicode_Check(value)) {
        format_names(names, count, valid, sizeof valid);
        PyErr_Format(PyExc_TypeError, "%s: expected a str (%s), got %s", argument, valid, Py_TYPE(value)->tp_name);
        return -1;
    }
    /* A non-ASCII letter or a lone surrogate is just another name that
     * does not match. */
    if (PyUnicode_IS_ASCII(value)) {
        *out = find_name((const char *)PyUnicode_DATA(value), (size_t)PyUnicode_GET_LENGTH(value), names, count);
        if (*out >= 0)
            return 0;
    }
    format_names(names, count, valid, sizeof valid);
    PyErr_Format(PyExc_ValueError, "%s: expected %s (any case), got %R", argument, valid, value);
    return -1;
}

PyObject *kv_as_sequence(PyObject *obj, const kv_path *path, const char *expected)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || kv_is_array(obj) || !PySequence_Check(obj)) {
        kv_path_error(PyExc_TypeError, path, "expected %s, got %s", expected, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *items = PySequence_Tuple(obj);
    /* A copy lives only as long as the call that made it and nothing refers
     * to it, so it cannot be part of a cycle: the garbage collector need not
     * walk the copies (a call may make one per block). */
    if (items != NULL && items != obj)
        PyObject_GC_UnTrack(items);
    return items;
}

PyObject *kv_array_items(PyObject *obj, const kv_path *path, const char *expected, int *single)
{
    *single = kv_is_array(obj);
    if (!*single)
        return kv_as_sequence(obj, path, expected);
    PyObject *items = PyTuple_Pack(1, obj);
    if (items != NULL)
        PyObject_GC_UnTrack(items); /* as kv_as_sequence's copies */
    return items;
}

void kv_format_shape(const int64_t *shape, int ndim, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, ndim == 1 ? ",)" : ")");
}

PyObject *kv_index(PyObject *obj, const kv_path *path, const char *expected)
{
    if (PyLong_CheckExact(obj))
        return Py_NewRef(obj);
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        kv_path_error(PyExc_TypeError, path, "expected %s, got %s", expected, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *value = PyNumber_Index(obj);
    if (value == NULL)
        kv_path_error_from(PyExc_TypeError, path, "expected %s, got %s, whose __index__ failed", expected,
                           Py_TYPE(obj)->tp_name);
    return value;
}

int kv_int64(PyObject *obj, const kv_path *path, const char *expected, int64_t minimum, int64_t maximum, int64_t *out)
{
    PyObject *value = kv_index(obj, path, expected);
    if (value == NULL)
        return -1;
    const long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        PyErr_Clear(); /* OverflowError: out of range below */
    else if (v >= minimum && v <= maximum) {
        Py_DECREF(value);
        *out = v;
        return 0;
    }
    kv_path_error(PyExc_ValueError, path, "expected an int from %lld to %lld, got %R", (long long)minimum,
                  (long long)maximum, value);
    Py_DECREF(value);
    return -1;
}

int kv_uint64(PyObject *obj, const kv_path *path, uint64_t *out)
{
    PyObject *value = kv_index(obj, path, "an int");
    if (value == NULL)
        return -1;
    const unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        kv_path_error(PyExc_ValueError, path, "expected an int from 0 to 2**64 - 1, got %R", value);
        Py_DECREF(value);
        return -1;
    }
    Py_DECREF(value);
    *out = v;
    return 0;
}

int kv_parse_int(PyObject *obj, const char *name, int64_t minimum, int64_t maximum, int64_t fallback, int allow_none,
                 int64_t *out)
{
    if (obj == NULL || (obj == Py_None && allow_none)) {
        *out = fallback;
        return 0;
    }
    const kv_path path = {name, {0, 0}, 0};
    return kv_int64(obj, &path, allow_none ? "an int or None" : "an int", minimum, maximum, out);
}
