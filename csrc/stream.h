/* The `stream=` argument of every call. */
#ifndef KVBM_STREAM_H
#define KVBM_STREAM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* None -> 0 (the legacy default stream), an int -> that handle, an object
 * with __cuda_stream__() -> its (version, handle)[1], an object with
 * .cuda_stream -> that int.  An int is an int or any object with __index__
 * (numpy.uint64), never a bool, from 0 to 2**64 - 1 (kv_uint64).  Returns 0,
 * or -1 with TypeError/ValueError naming `stream`. */
int kv_stream_from_object(PyObject *obj, intptr_t *handle);

/* The same stream in DLPack's encoding for __dlpack__(stream=...): the legacy
 * default stream is 1 there, since 0 is reserved.  New reference. */
PyObject *kv_stream_for_dlpack(intptr_t handle);

#endif /* KVBM_STREAM_H */
