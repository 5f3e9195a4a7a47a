/* Batched raw copies: vectorized_copy, memcpy_batch, and the backends of
 * block <-> operational. */
#ifndef KVBM_COPY_H
#define KVBM_COPY_H

#include "state.h"

/* The `backend` argument of every conversion: one knob, one meaning.
 * "kernel": SM kernels move every byte, reading and writing pinned host
 * memory directly.  "copy_engines": the copy engines carry every byte that
 * crosses PCIe, staged through device memory where bytes are rearranged
 * (staging.c); "batch" (cudaMemcpyBatchAsync) and "async" (one
 * cudaMemcpyAsync per contiguous run) are that too, naming the call that
 * drives the engines.  "auto": the copy engines whenever pinned host memory
 * takes part, the kernel device to device. */
typedef enum {
    KV_BACKEND_KERNEL,
    KV_BACKEND_ASYNC,
    KV_BACKEND_BATCH,
    KV_BACKEND_AUTO,
    KV_BACKEND_COPY_ENGINES,
    KV_BACKEND_COUNT
} kv_backend;

extern const char *const KV_BACKEND_NAMES[KV_BACKEND_COUNT];

/* How a move that rearranges bytes runs. */
typedef struct {
    int staged;       /* staged through device memory; else the kernel alone */
    uint32_t ctas;    /* the kernel's CTA bound (0: none) */
    int async_copies; /* staged copies as one cudaMemcpyAsync per run */
    const char *why;
} kv_route;

/* The route for `backend` when `pinned` host memory takes part; `unstageable`
 * is NULL when the pinned side can be staged, else why not.  num_ctas 0 (not
 * given) means no bound device to device and KV_PINNED_CTAS over PCIe. */
kv_route kv_route_move(kv_backend backend, int pinned, const char *unstageable, uint32_t num_ctas);

/* The KVBM_EXT_DEBUG line of a move: the path that ran and why. */
void kv_debug_move(const char *function, const kv_route *route, const kv_gpu_report *report, int device);

/* Runs `pairs` (host lists, checked) with `backend` on the target, logging
 * the choice under KVBM_EXT_DEBUG as `function`.  Block <-> operational
 * moves chunks whole, so the copy engines need no staging: "auto" picks them
 * (cudaMemcpyBatchAsync) when the copies cross PCIe (`over_pcie`: pinned
 * host memory on one side) and the batch API is there, because they move
 * data over PCIe more efficiently than SM loads and stores (98 against 92 to
 * 95 % of cudaMemcpy on the H200, benchmarks/README.md) and leave the SMs to
 * the model; else the kernel, which beats the copy engines between device
 * buffers and pays no per-copy cost.  The kernel runs on at most num_ctas
 * CTAs (0: no bound device to device, KV_PINNED_CTAS over PCIe).  Returns 0
 * or -1. */
int kv_copy_with_backend(kv_gpu *gpu, const kv_gpu_target *target, kv_pairs *pairs, kv_backend backend, int over_pcie,
                         uint32_t num_ctas, const char *function);

/* The Python functions; each validates everything before copying.  Return
 * 0, or -1 with an exception set. */
int kv_vectorized_copy(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream);
int kv_memcpy_batch(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *mode, PyObject *stream);

#endif /* KVBM_COPY_H */
