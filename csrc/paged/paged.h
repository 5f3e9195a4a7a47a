/* kvbm_ext.PagedKVCache: a serving worker's KV cache (one array per layer, or
 * one for all layers, blocks addressed by id), described once, moved to and
 * from universal and operational blocks with a per-call host cost that does
 * not grow with the number of chunks. */
#ifndef KVBM_PAGED_CACHE_H
#define KVBM_PAGED_CACHE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Creates the type and adds it to `module`.  Returns 0, or -1 with an
 * exception set. */
int kv_paged_add_type(PyObject *module);

#endif /* KVBM_PAGED_CACHE_H */
