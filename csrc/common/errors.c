/* Argument paths and the errors that name them.  See errors.h. */
#include "errors.h"

#include <stdarg.h>
#include <stdio.h>

int kv_error(PyObject *type, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    PyErr_FormatV(type, format, args);
    va_end(args);
    return -1;
}

void kv_path_format(const kv_path *path, char *buf, size_t size)
{
    int n = snprintf(buf, size, "%s", path->name);
    for (int i = 0; i < path->depth && n >= 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - (size_t)n, "[%zd]", path->index[i]);
}

/* "path: message" from a printf-style format, or NULL with an exception. */
static PyObject *path_message(const kv_path *path, const char *format, va_list args)
{
    char where[96];
    kv_path_format(path, where, sizeof where);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    if (message == NULL)
        return NULL;
    PyObject *full = PyUnicode_FromFormat("%s: %U", where, message);
    Py_DECREF(message);
    return full;
}

int kv_path_error(PyObject *type, const kv_path *path, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    PyObject *message = path_message(path, format, args);
    va_end(args);
    if (message != NULL) {
        PyErr_SetObject(type, message);
        Py_DECREF(message);
    }
    return -1;
}

int kv_path_error_from(PyObject *type, const kv_path *path, const char *format, ...)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
        return -1;
    PyObject *cause_type, *cause, *traceback;
    PyErr_Fetch(&cause_type, &cause, &traceback);
    PyErr_NormalizeException(&cause_type, &cause, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(cause, traceback);
    va_list args;
    va_start(args, format);
    PyObject *message = path_message(path, format, args);
    va_end(args);
    PyObject *full = message == NULL
                         ? NULL
                         : PyUnicode_FromFormat("%U (%s: %S)", message, ((PyTypeObject *)cause_type)->tp_name, cause);
    Py_XDECREF(message);
    if (full != NULL) {
        PyErr_SetObject(type, full);
        Py_DECREF(full);
        PyObject *new_type, *value, *new_traceback;
        PyErr_Fetch(&new_type, &value, &new_traceback);
        PyErr_NormalizeException(&new_type, &value, &new_traceback);
        PyException_SetCause(value, Py_NewRef(cause));
        PyErr_Restore(new_type, value, new_traceback);
    }
    Py_DECREF(cause_type);
    Py_DECREF(cause);
    Py_XDECREF(traceback);
    return -1;
}
