/* The `stream=` argument of every call.  See stream.h. */
#include "stream.h"

#include "args.h"

/* A handle given as an int or any object with __index__ (numpy.uint64),
 * never a bool, from 0 to 2**64 - 2, read as every int argument is. */
static int handle_from_int(PyObject *value, intptr_t *handle)
{
    const kv_path path = {"stream", {0, 0}, 0};
    uint64_t raw;
    if (kv_uint64(value, &path, &raw) < 0)
        return -1;
    if (raw == UINT64_MAX)
        return kv_path_error(PyExc_ValueError, &path, "2**64 - 1 is not a cudaStream_t handle");
    void *pointer = (void *)(uintptr_t)raw;
    *handle = (intptr_t)pointer;
    return 0;
}

int kv_stream_from_object(PyObject *obj, intptr_t *handle)
{
    if (obj == Py_None) {
        *handle = KV_STREAM_CURRENT;
        return 0;
    }
    if (PyIndex_Check(obj))
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
                     "stream: expected None, an int handle, or an object with __cuda_stream__() or "
                     ".cuda_stream, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    rc = handle_from_int(value, handle);
    Py_DECREF(value);
    return rc;
}

PyObject *kv_stream_for_dlpack(intptr_t handle)
{
    return PyLong_FromVoidPtr((void *)(handle == 0 || handle == KV_STREAM_CURRENT ? 1 : handle));
}
