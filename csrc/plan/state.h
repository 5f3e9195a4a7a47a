/* The module's state, reached by the module's functions and by the methods
 * of its types (PyType_GetModuleState). */
#ifndef KVBM_STATE_H
#define KVBM_STATE_H

#include "gpu.h"

typedef struct {
    kv_gpu *gpu;
    kv_protocols protocols;     /* names and type facts for reading arrays (protocols.h) */
    PyObject *host_buffer_type; /* kvbm_ext.HostBuffer, which pinned_empty makes */
    PyObject *deferred_type;    /* kvbm_ext.Deferred, which to_cache(..., defer=True) returns */
} kv_state;

#endif /* KVBM_STATE_H */
