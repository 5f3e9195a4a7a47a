/* C ABI of the CUDA kernels.  Every launcher enqueues its work on `stream`,
 * never synchronizes and returns the launch status. */
#ifndef KVBM_KERNELS_H
#define KVBM_KERNELS_H

#include <cuda_runtime_api.h>

#include "kvbm_layout.h"
#include "kvbm_paged.h"
#include "kvbm_to_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most pointers a launch takes by value in its parameters (32 KB of kernel
 * parameters: CUDA 12.1 drivers and newer, compute capability 7.0 and up). */
#define KVBM_TABLE_BY_VALUE_MAX 4000

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

/* A batch of raw copies: pair i moves size(i) bytes from src[i] to dst[i],
 * size(i) = sizes ? sizes[i] : uniform_size.  The lists are in
 * device-readable memory, or all NULL with the values passed by value (see
 * kvbm_launch_copy_pairs). */
typedef struct {
    int64_t count;
    const uint64_t *src;
    const uint64_t *dst;
    const uint64_t *sizes;
    uint64_t uniform_size;
    uint32_t slices;   /* shares per pair, each moved by one CTA step */
    uint32_t num_ctas; /* at most this many CTAs (0: one per share) */
} kvbm_pairs;

/* Enqueues every pair of `pairs` in one launch of count * slices shares (the
 * caller keeps that below 2^31), at most num_ctas CTAs.  Each pair moves with the widest vector
 * (16, 8, 4, 2 or 1 bytes) that both its addresses and its size allow.
 * When `by_value` is not NULL it holds the lists themselves, src then dst
 * then (if pairs->sizes is not NULL) sizes, at most
 * KVBM_TABLE_BY_VALUE_MAX values in all, and travels in the launch's
 * parameters; the list pointers of `pairs` are then ignored. */
cudaError_t kvbm_launch_copy_pairs(const kvbm_pairs *pairs, const uint64_t *by_value, cudaStream_t stream);

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

/* Moves move->p.nb blocks from one paged cache to another in one launch, as
 * kvbm_to_cache.h describes; move->p has been planned (kvbm_paged_plan).
 * The table (kvbm_to_cache_table_entries values) is `device_table` in
 * device memory or, when that is NULL, read from `host_table` and passed
 * by value (at most KVBM_TABLE_BY_VALUE_MAX values).  Every address, stride
 * and the segment size must be a multiple of `vector_bytes`.  At most
 * `num_ctas` CTAs run (0: one per tile). */
cudaError_t kvbm_launch_to_cache(const kvbm_to_cache *move, const kvbm_to_cache_ids *ids, const uint64_t *host_table,
                                 const uint64_t *device_table, int vector_bytes, uint32_t num_ctas,
                                 cudaStream_t stream);

/* Load every instance of one file's kernel now (CUDA would at its first
 * launch, waiting for the device to be idle); on the current device. */
cudaError_t kvbm_load_block_universal(void);
cudaError_t kvbm_load_copy_pairs(void);
cudaError_t kvbm_load_paged(void);
cudaError_t kvbm_load_to_cache(void);

/* Loads every kernel above, in turn, until one fails: the one list of the
 * kernels, kept beside their declarations so that a new kernel joins it
 * where it declares its launch. */
static inline cudaError_t kvbm_load_kernels(void)
{
    cudaError_t (*const loads[])(void) = {kvbm_load_copy_pairs, kvbm_load_block_universal, kvbm_load_paged,
                                          kvbm_load_to_cache};
    cudaError_t error = cudaSuccess;
    for (size_t i = 0; error == cudaSuccess && i < sizeof loads / sizeof *loads; i++)
        error = loads[i]();
    return error;
}

/* Vectors of 16 bytes that one CTA of kvbm_launch_copy_pairs moves per step:
 * the slice size a caller aims for when it picks `slices`. */
#define KVBM_COPY_TILE_BYTES (256 * 4 * 16)

#ifdef __cplusplus
}
#endif

#endif /* KVBM_KERNELS_H */
