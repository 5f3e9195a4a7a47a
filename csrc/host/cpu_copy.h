/* Raw copies for calls whose arrays all live in host memory.  (Each kind
 * of layout move's CPU twin is its descriptor's: csrc/moves/.) */
#ifndef KVBM_CPU_COPY_H
#define KVBM_CPU_COPY_H

#include "gpu.h"

/* One memcpy per pair (host lists).  Needs no GIL. */
void kv_cpu_copy_pairs(const kv_pairs *pairs);

#endif /* KVBM_CPU_COPY_H */
