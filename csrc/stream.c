/* The `stream=` argument of every call.  See stream.h. */
#include "stream.h"

static int handle_from_int(PyObject *value, intptr_t *handle)
{
    if (PyBool_Check(value) || !PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "stream: expected an int handle, got %s", Py_TYPE(value)->tp_name);
        return -1;
    }
    unsigned long long raw = PyLong_AsUnsignedLongLong(value);
    if (raw == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "stream: expected a handle between 0 and 2**64 - 1, got %R", value);
        return -1;
    }
    void *pointer = (void *)(uintptr_t)raw;
    *handle = (intptr_t)pointer;
    return 0;
}

int kv_stream_from_object(PyObject *obj, intptr_t *handle)
{
    if (obj == Py_None) {
        *handle = 0;
        return 0;
    }
    if (PyLong_Check(obj))
        return handle_from_int(obj, handle);

    int rc;
    PyObject *value = NULL;
    if (PyObject_HasAttrString(obj, "__cuda_stream__")) {
        PyObject *pair = PyObject_CallMethod(obj, "__cuda_stream__", NULL);
        if (pair == NULL)
            return -1;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "stream: __cuda_stream__() must return (version, handle), got %R", pair);
            Py_DECREF(pair);
            return -1;
        }
        value = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    }
    else if (PyObject_HasAttrString(obj, "cuda_stream")) {
        value = PyObject_GetAttrString(obj, "cuda_stream");
        if (value == NULL)
            return -1;
    }
    else {
        PyErr_Format(PyExc_TypeError,
                     "stream: expected None, an int handle, or an object with __cuda_stream__() or .cuda_stream, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    rc = handle_from_int(value, handle);
    Py_DECREF(value);
    return rc;
}

PyObject *kv_stream_for_dlpack(intptr_t handle)
{
    return PyLong_FromVoidPtr((void *)(handle == 0 ? 1 : handle));
}
