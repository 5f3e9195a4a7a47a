/* block_to_universal and universal_to_block: argument walking, validation
 * and dispatch to the CPU or the GPU. */
#ifndef KVBM_CONVERT_H
#define KVBM_CONVERT_H

#include "gpu.h"

/* Validates every argument, then moves the bytes.  `layout` may be NULL
 * (NHD).  Nothing is written
 * unless every check passes.  Returns 0, or -1 with an exception set. */
int kv_block_universal(kv_gpu *gpu, PyObject *blocks, PyObject *universals, PyObject *layout, PyObject *stream,
                       kvbm_direction direction);

#endif /* KVBM_CONVERT_H */
