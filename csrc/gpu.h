/* Everything that calls the CUDA runtime.  Built from gpu.c when nvcc is
 * available, from gpu_stub.c otherwise; the rest of csrc/ needs no CUDA
 * header. */
#ifndef KVBM_GPU_H
#define KVBM_GPU_H

#include "array.h"
#include "kvbm_layout.h"
#include "kvbm_paged.h"

/* Per-module GPU resources (pointer-table staging, events), created lazily
 * per device. */
typedef struct kv_gpu kv_gpu;

kv_gpu *kv_gpu_new(void); /* NULL with MemoryError */
void kv_gpu_free(kv_gpu *gpu);

/* 1 when the CUDA kernels are compiled in. */
int kv_gpu_compiled(void);

/* Finds where an array lives for a call on the GPU: the device of a CAI
 * array, and whether host memory is pinned (then `data` becomes the address
 * kernels use).  Returns 0, or -1 with an exception naming `path`. */
int kv_gpu_locate(kv_array *a, const kv_path *path);

/* Makes `device` the calling thread's current CUDA device for the duration of
 * a producer call (torch exports through DLPack only tensors of the current
 * device).  *previous receives what kv_gpu_restore_device needs.  Returns 0,
 * or -1 with RuntimeError. */
int kv_gpu_use_device(int device, int *previous);
void kv_gpu_restore_device(int previous);

/* Where a call's work goes: `stream` of `device`, after the producers'
 * streams (CAI v3) have been ordered before it. */
typedef struct {
    int device;
    intptr_t stream;
    const intptr_t *producers;
    Py_ssize_t producer_count;
} kv_gpu_target;

/* Every GPU entry point below enqueues its work on the target and returns
 * without waiting for it; host tables are copied before return.  They
 * release the GIL and return 0, or -1 with RuntimeError naming the CUDA
 * error. */

/* A block stack (or operational) <-> universal move; `table` as
 * kvbm_launch_block_universal takes it. */
int kv_gpu_block_universal(kv_gpu *gpu, const kv_gpu_target *target, const kvbm_block_dims *dims,
                           kvbm_direction direction, void *const *table, int vector_bytes);

/* A paged cache <-> flat blocks move, as kvbm_launch_paged takes it (`table`
 * in host memory); at most `max_ctas` CTAs (0: no bound). */
int kv_gpu_paged(kv_gpu *gpu, const kv_gpu_target *target, const kvbm_paged *paged,
                 const kvbm_paged_addresses *addresses, const uint64_t *table, int vector_bytes, uint32_t max_ctas);

/* Copies `bytes` of host memory into a new allocation on `device`, waiting
 * for the copy (for tables built once, not per call).  Returns 0, or -1 with
 * RuntimeError. */
int kv_gpu_upload(int device, const void *host, size_t bytes, void **device_copy);

/* Frees what kv_gpu_upload allocated (NULL: nothing). */
void kv_gpu_release(int device, void *device_copy);

/* A batch of raw copies.  Each list lives in host memory or, flagged
 * `*_on_device`, in device memory of the target's device (kernel only). */
typedef struct {
    int64_t count;
    uint64_t *src, *dst;
    uint64_t *sizes;       /* NULL: every pair moves uniform_size bytes */
    uint64_t uniform_size;
    int src_on_device, dst_on_device, sizes_on_device;
} kv_pairs;

/* How a batch of copies is carried out. */
typedef enum {
    KV_ENGINE_KERNEL, /* kvbm_launch_copy_pairs */
    KV_ENGINE_ASYNC,  /* one cudaMemcpyAsync per pair */
    KV_ENGINE_BATCH,  /* cudaMemcpyBatchAsync */
} kv_engine;

extern const char *const KV_ENGINE_NAMES[3]; /* "kernel", "async", "batch" */

/* Runs the pairs with `engine`.  KV_ENGINE_BATCH falls back to
 * KV_ENGINE_ASYNC when the batch API is missing or fails and `fallback` is
 * set; *ran receives the engine that ran and `why` (may be NULL) the reason
 * for a fallback.  Host lists only, except for the kernel. */
int kv_gpu_copy_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine,
                      int fallback, kv_engine *ran, char *why, size_t why_size);

/* True when both this build and the driver have cudaMemcpyBatchAsync. */
int kv_gpu_batch_available(void);

/* Checks the host-resident address lists of `pairs` before a GPU copy: no
 * null address, every [address, address + size) inside one allocation of
 * device memory or pinned host memory (pageable host memory too when
 * `allow_pageable`), device memory on one device only.  Pinned addresses
 * are rewritten to their device addresses.  *device receives the device of
 * the device memory found, or -1.  `names` are the lists' argument names
 * for errors (ValueError).  Returns 0 or -1. */
int kv_gpu_check_pairs(kv_pairs *pairs, const char *const names[2], int allow_pageable, int *device);

/* The current device, for calls that name none; -1 with RuntimeError. */
int kv_gpu_current_device(void);

/* A list of dicts describing the visible CUDA devices; [] when there are
 * none, no driver, or no CUDA build. */
PyObject *kv_gpu_devices(void);

#endif /* KVBM_GPU_H */
