/* The CPU implementation, for calls whose arrays all live in host memory. */
#ifndef KVBM_CPU_COPY_H
#define KVBM_CPU_COPY_H

#include "gpu.h"
#include "kvbm_to_cache.h"

/* Same table as kvbm_launch_block_universal (see kvbm_table_entries).  Needs
 * no GIL (gil.h: callers release it for large copies). */
void kv_cpu_block_universal(const kvbm_block_dims *dims, void *const *table, kvbm_direction direction);

/* Same arguments as kvbm_launch_paged, with every address in host memory.
 * Needs no GIL. */
void kv_cpu_paged(const kvbm_paged *paged, const kvbm_paged_addresses *addresses, const uint64_t *table);

/* The bytes kv_cpu_paged moves, or kv_cpu_to_cache with move->p. */
static inline int64_t kv_cpu_paged_bytes(const kvbm_paged *paged)
{
    return paged->nb * paged->nl * paged->no * paged->nh * paged->nt * paged->row_bytes;
}

/* Same arguments as kvbm_launch_to_cache, with every address in host
 * memory and the ids in the table.  Needs no GIL. */
void kv_cpu_to_cache(const kvbm_to_cache *move, const uint64_t *table);

/* One memcpy per pair (host lists).  Needs no GIL. */
void kv_cpu_copy_pairs(const kv_pairs *pairs);

#endif /* KVBM_CPU_COPY_H */
