/* The `stream=` argument of every call. */
#ifndef KVBM_STREAM_H
#define KVBM_STREAM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* stream=None: the call picks the stream where its work runs (target.h,
 * kv_target_resolve_stream).  No handle has this value: 2**64 - 1 is
 * refused as one. */
#define KV_STREAM_CURRENT ((intptr_t)-1)

/* None -> KV_STREAM_CURRENT, an int -> that handle, an object with
 * __cuda_stream__() -> its (version, handle)[1], an object with
 * .cuda_stream -> that int.  An int is an int or any object with __index__
 * (numpy.uint64), never a bool, from 0 to 2**64 - 2.  Returns 0, or -1 with
 * TypeError/ValueError naming `stream`. */
int kv_stream_from_object(PyObject *obj, intptr_t *handle);

/* The same stream in DLPack's encoding for __dlpack__(stream=...): the legacy
 * default stream (and KV_STREAM_CURRENT, which producers are asked as the
 * legacy one) is 1 there, since 0 is reserved.  New reference. */
PyObject *kv_stream_for_dlpack(intptr_t handle);

#endif /* KVBM_STREAM_H */
