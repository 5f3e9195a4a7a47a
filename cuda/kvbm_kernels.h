/* C ABI of the CUDA kernels.  Every launcher enqueues its work on `stream`,
 * never synchronizes and returns the launch status. */
#ifndef KVBM_KERNELS_H
#define KVBM_KERNELS_H

#include <cuda_runtime_api.h>

#include "kvbm_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most pointers a launch takes by value in its parameters (32 KB of kernel
 * parameters: CUDA 12.1 drivers and newer, compute capability 7.0 and up). */
#define KVBM_TABLE_BY_VALUE_MAX 4000

/* Moves dims->nb blocks between block stacks and universal blocks in one
 * launch.  The pointer table holds dims->nb universal pointers followed by
 * dims->nb * dims->nchunks chunk pointers, block-major.  `device_table` is
 * that table in device-readable memory; when it is NULL the table, which
 * then must not exceed KVBM_TABLE_BY_VALUE_MAX pointers, is read from host
 * memory at `host_table` and passed by value.  Every pointer, and row_bytes,
 * must be a multiple of `vector_bytes` (16, 8, 4, 2 or 1), the width of the
 * loads and stores. */
cudaError_t kvbm_launch_block_universal(const kvbm_block_dims *dims,
                                        void *const *host_table,
                                        void *const *device_table,
                                        kvbm_direction direction,
                                        int vector_bytes,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* KVBM_KERNELS_H */
