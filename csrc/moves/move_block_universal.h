/* Block stacks (or operational blocks) <-> universal blocks: one kind of
 * layout move (gpu.h, kv_move_kind), defined in move_block_universal.c,
 * described by a conversion (plan/convert_run.c), its kernel in
 * cuda/block_universal.cu.  This header is the one both sides read: the C
 * side, and nvcc for the kernel file, so it needs neither Python nor gpu.h. */
#ifndef KVBM_MOVE_BLOCK_UNIVERSAL_H
#define KVBM_MOVE_BLOCK_UNIVERSAL_H

#include "kvbm_layout.h"

#ifdef KVBM_CUDA_VERSION
#include "kvbm_kernels.h"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The call, beside its table (kvbm_layout.h, kvbm_table_entries). */
typedef struct {
    const kvbm_block_dims *dims;
    kvbm_direction direction;
} kv_block_move;

extern const struct kv_move_kind kv_move_block_universal;

#ifdef KVBM_CUDA_VERSION
/* Moves dims->nb blocks between block stacks (or operational blocks) and
 * universal blocks in one launch.  The pointer table is laid out as
 * kvbm_layout.h describes (kvbm_table_entries).  `device_table` is
 * that table in device-readable memory; when it is NULL the table, which
 * then must not exceed KVBM_TABLE_BY_VALUE_MAX pointers, is read from host
 * memory at `host_table` and passed by value.  Every pointer, and row_bytes,
 * must be a multiple of `vector_bytes` (16, 8, 4, 2 or 1), the width of the
 * loads and stores.  At most `num_ctas` CTAs run (0: one per tile). */
cudaError_t kvbm_launch_block_universal(const kvbm_block_dims *dims, void *const *host_table, void *const *device_table,
                                        kvbm_direction direction, int vector_bytes, uint32_t num_ctas,
                                        cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* KVBM_MOVE_BLOCK_UNIVERSAL_H */
