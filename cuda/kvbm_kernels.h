/* C ABI of the CUDA kernels.  Every launcher enqueues its work on `stream`,
 * never synchronizes and returns the launch status. */
#ifndef KVBM_KERNELS_H
#define KVBM_KERNELS_H

#include <cuda_runtime_api.h>

#include "kvbm_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Moves dims->nb blocks between block stacks and universal blocks in one
 * launch.  `table` is a device-readable array of dims->nb universal pointers
 * followed by dims->nb * dims->nchunks chunk pointers, block-major.  Every
 * pointer, and row_bytes, must be a multiple of `vector_bytes` (16, 8, 4, 2
 * or 1), the width of the loads and stores. */
cudaError_t kvbm_launch_block_universal(const kvbm_block_dims *dims,
                                        void *const *table,
                                        kvbm_direction direction,
                                        int vector_bytes,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* KVBM_KERNELS_H */
