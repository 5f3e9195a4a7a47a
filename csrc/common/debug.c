/* The KVBM_EXT_DEBUG log.  See debug.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "debug.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kv_debug_enabled(void)
{
    const char *value = getenv("KVBM_EXT_DEBUG");
    return value != NULL && value[0] != '\0' && strcmp(value, "0") != 0;
}

/* kvbm_ext._debug.emit(line); the module comes from sys.modules after the first line. */
static void emit(const char *line)
{
    PyObject *text = PyUnicode_DecodeUTF8(line, (Py_ssize_t)strlen(line), "replace");
    PyObject *module = text != NULL ? PyImport_ImportModule("kvbm_ext._debug") : NULL;
    PyObject *result = module != NULL ? PyObject_CallMethod(module, "emit", "O", text) : NULL;
    if (result == NULL)
        PyErr_WriteUnraisable(text); /* "Exception ignored in: '<the line>'" */
    Py_XDECREF(result);
    Py_XDECREF(module);
    Py_XDECREF(text);
}

void kv_debug(const char *format, ...)
{
    if (!kv_debug_enabled())
        return;
    assert(PyGILState_Check());
    char line[512];
    va_list args;
    va_start(args, format);
    vsnprintf(line, sizeof line, format, args);
    va_end(args);
    /* Python code must not run with an exception set: keep any aside (the caller's to
     * report) and put it back afterwards. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    emit(line);
    PyErr_Restore(type, value, traceback);
}
