/* A paged cache <-> universal or operational blocks: one kind of layout
 * move (gpu.h, kv_move_kind), defined in move_paged.c, described by
 * PagedKVCache's calls (paged/paged_run.c), its kernel in cuda/paged.cu.
 * This header is the one both sides read: the C side, and nvcc for the
 * kernel file, so it needs neither Python nor gpu.h. */
#ifndef KVBM_MOVE_PAGED_H
#define KVBM_MOVE_PAGED_H

#include "kvbm_paged.h"

#ifdef KVBM_CUDA_VERSION
#include "kvbm_kernels.h"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The call, beside its table (kvbm_paged.h). */
typedef struct {
    const kvbm_paged *paged;
    const kvbm_paged_addresses *addresses;
} kv_paged_move;

extern const struct kv_move_kind kv_move_paged;

#ifdef KVBM_CUDA_VERSION
/* Moves paged->nb blocks between a paged cache and flat (universal or
 * operational) blocks in one launch, as kvbm_paged.h describes; `paged` has
 * been planned (kvbm_paged_plan).  The call's table (kvbm_paged_table_entries
 * values) is `device_table` in device memory or, when that is NULL, read
 * from `host_table` and passed by value (at most KVBM_TABLE_BY_VALUE_MAX
 * values).  Every address, stride and the segment size must be a multiple of
 * `vector_bytes`.  At most `num_ctas` CTAs run (0: one per tile). */
cudaError_t kvbm_launch_paged(const kvbm_paged *paged, const kvbm_paged_addresses *addresses,
                              const uint64_t *host_table, const uint64_t *device_table, int vector_bytes,
                              uint32_t num_ctas, cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* KVBM_MOVE_PAGED_H */
