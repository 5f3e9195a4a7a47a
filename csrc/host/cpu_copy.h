/* The CPU implementation, for calls whose arrays all live in host memory:
 * each kind of layout move's CPU twin, defined with the kind's descriptor
 * (gpu.h, kv_move_kind), and the raw copies. */
#ifndef KVBM_CPU_COPY_H
#define KVBM_CPU_COPY_H

#include "gpu.h"

/* One memcpy per pair (host lists).  Needs no GIL. */
void kv_cpu_copy_pairs(const kv_pairs *pairs);

#endif /* KVBM_CPU_COPY_H */
