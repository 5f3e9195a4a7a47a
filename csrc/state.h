/* The module's state, reached by the module's functions and by the methods
 * of its types (PyType_GetModuleState). */
#ifndef KVBM_STATE_H
#define KVBM_STATE_H

#include "gpu.h"

typedef struct {
    kv_gpu *gpu;
    kv_protocols protocols; /* names and type facts for reading arrays (array.h) */
} kv_state;

/* This interpreter's kvbm_ext._C state, found through sys.modules (about
 * 0.1 us), for code not handed it; NULL, with no exception, when the module
 * is not there. */
kv_state *kv_find_state(void);

#endif /* KVBM_STATE_H */
