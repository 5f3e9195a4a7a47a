/* The CPU implementation, for calls whose arrays all live in host memory. */
#ifndef KVBM_CPU_COPY_H
#define KVBM_CPU_COPY_H

#include "kvbm_layout.h"

/* Same table as kvbm_launch_block_universal: dims->nb universal pointers,
 * then dims->nb * dims->nchunks chunk pointers.  Call without the GIL. */
void kv_cpu_block_universal(const kvbm_block_dims *dims, void *const *table, kvbm_direction direction);

#endif /* KVBM_CPU_COPY_H */
