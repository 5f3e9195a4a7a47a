/* Where an argument sits in a call's arguments, e.g. blocks[3][17], and the
 * errors that name it. */
#ifndef KVBM_ERRORS_H
#define KVBM_ERRORS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Formatted only when an error is raised. */
typedef struct {
    const char *name;
    Py_ssize_t index[2];
    int depth;
} kv_path;

/* Raises `type` with a printf-style message (PyErr_Format's).  Returns -1. */
int kv_error(PyObject *type, const char *format, ...);

/* Writes "name[i][j]" into buf. */
void kv_path_format(const kv_path *path, char *buf, size_t size);

/* Raises `type` with the message prefixed by "path: ". Returns -1. */
int kv_path_error(PyObject *type, const kv_path *path, const char *format, ...);

/* The same in place of the exception being raised by Python code the
 * argument ran (an __index__, a producer's __dlpack_device__): its type
 * and message are appended, and it becomes the new one's __cause__.
 * MemoryError and exceptions that are not Exceptions (KeyboardInterrupt)
 * are left as they are.  Returns -1. */
int kv_path_error_from(PyObject *type, const kv_path *path, const char *format, ...);

#endif /* KVBM_ERRORS_H */
