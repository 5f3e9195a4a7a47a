/* What the CUDA kernels share in their C ABI: the size of a by-value table,
 * the raw copies' kernel (which no kind of move owns) and the loading of
 * every kernel ahead of need.  Each kind of layout move declares its own
 * kernel's launch in its header (csrc/moves/move_<kind>.h).  Every launcher
 * enqueues its work on `stream`, never synchronizes and returns the launch
 * status. */
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

/* Loads every instance of every kernel now, on the current device, until
 * one fails (CUDA would load each at its first launch, waiting for the
 * device to be idle).  Each kernel file names its own load
 * (KVBM_LOAD_AHEAD, kvbm_device.cuh), so that no list here grows with the
 * kernels. */
cudaError_t kvbm_load_kernels(void);

/* Vectors of 16 bytes that one CTA of kvbm_launch_copy_pairs moves per step:
 * the slice size a caller aims for when it picks `slices`. */
#define KVBM_COPY_TILE_BYTES (256 * 4 * 16)

#ifdef __cplusplus
}
#endif

#endif /* KVBM_KERNELS_H */
