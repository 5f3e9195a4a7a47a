/* kvbm_ext.Deferred, what PagedKVCache.to_cache(..., defer=True) returns:
 * the outcome of a staged call whose pieces the device's enqueue thread
 * enqueues after the call returned (staging.c, "Deferred calls"), or of a
 * call that ran whole before it returned. */
#ifndef KVBM_DEFERRED_H
#define KVBM_DEFERRED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "promise.h"

/* A Deferred over `outcome`, whose hold it takes (NULL: the call ran whole;
 * the object then is done).  NULL with an exception, the hold released. */
PyObject *kv_deferred_new(PyObject *type, kv_promise *outcome);

/* Adds kvbm_ext.Deferred to `module`; *type receives a new reference. */
int kv_deferred_add_type(PyObject *module, PyObject **type);

#endif /* KVBM_DEFERRED_H */
