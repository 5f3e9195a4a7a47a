/* Batched raw copies: vectorized_copy, memcpy_batch, and the backends of
 * block <-> operational. */
#ifndef KVBM_COPY_H
#define KVBM_COPY_H

#include "gpu.h"

typedef enum { KV_BACKEND_KERNEL, KV_BACKEND_ASYNC, KV_BACKEND_BATCH, KV_BACKEND_AUTO } kv_backend;

extern const char *const KV_BACKEND_NAMES[4]; /* "kernel", "async", "batch", "auto" */

/* Runs `pairs` (host lists, checked) with `backend` on the target, logging
 * the choice under KVBM_EXT_DEBUG as `function`.  "auto" picks the copy
 * engines (cudaMemcpyBatchAsync) when the copies cross PCIe (`over_pcie`:
 * pinned host memory on one side) and the batch API is there, because they
 * move data over PCIe more efficiently than SM loads and stores (98 against
 * 92 to 95 % of cudaMemcpy on the H200, benchmarks/README.md); else the
 * kernel, which beats the copy engines between device buffers and pays no
 * per-copy cost.  Returns 0 or -1. */
int kv_copy_with_backend(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_backend backend,
                         int over_pcie, const char *function);

/* The Python functions; each validates everything before copying.  Return
 * 0, or -1 with an exception set. */
int kv_vectorized_copy(kv_gpu *gpu, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream);
int kv_memcpy_batch(kv_gpu *gpu, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *mode, PyObject *stream);

#endif /* KVBM_COPY_H */
