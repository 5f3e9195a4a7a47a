/* Argument helpers shared by the entry points.  See args.h. */
#include "args.h"

#include <stdio.h>
#include <string.h>

int kv_parse_name(PyObject *value, const char *argument, const char *const *names, int count, int fallback, int *out)
{
    char valid[160];
    size_t n = 0;
    for (int i = 0; i < count && n < sizeof valid; i++)
        n += (size_t)snprintf(valid + n, sizeof valid - n, "%s\"%s\"", i == 0 ? "" : i == count - 1 ? " or " : ", ",
                              names[i]);
    if (value == NULL) {
        *out = fallback;
        return 0;
    }
    if (!PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a str (%s), got %s", argument, valid, Py_TYPE(value)->tp_name);
        return -1;
    }
    /* Whole strings are compared: an embedded NUL, a non-ASCII letter or a
     * lone surrogate is just another name that does not match. */
    if (PyUnicode_IS_ASCII(value)) {
        const char *s = (const char *)PyUnicode_DATA(value);
        const size_t n = (size_t)PyUnicode_GET_LENGTH(value);
        for (int i = 0; i < count; i++) {
            if (strlen(names[i]) == n && memchr(s, '\0', n) == NULL && PyOS_strnicmp(s, names[i], n) == 0) {
                *out = i;
                return 0;
            }
        }
    }
    PyErr_Format(PyExc_ValueError, "%s: expected %s (any case), got %R", argument, valid, value);
    return -1;
}

PyObject *kv_as_sequence(PyObject *obj, const kv_path *path, const char *expected)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || kv_is_array(obj) || !PySequence_Check(obj)) {
        kv_path_error(PyExc_TypeError, path, "expected %s, got %s", expected, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PySequence_Tuple(obj);
}

void kv_format_shape(const int64_t *shape, int ndim, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, ndim == 1 ? ",)" : ")");
}

int kv_parse_int(PyObject *obj, const char *name, int64_t minimum, int64_t maximum, int64_t fallback, int allow_none,
                 int64_t *out)
{
    if (obj == NULL || (obj == Py_None && allow_none)) {
        *out = fallback;
        return 0;
    }
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int%s, got %s", name, allow_none ? " or None" : "",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const long long value = PyLong_AsLongLong(obj);
    if (value == -1 && PyErr_Occurred())
        PyErr_Clear();
    else if (value >= minimum && value <= maximum) {
        *out = value;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "%s: expected an int from %lld to %lld, got %R", name, (long long)minimum,
                 (long long)maximum, obj);
    return -1;
}
