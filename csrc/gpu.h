/* Everything that calls the CUDA runtime.  Built from gpu.c when nvcc is
 * available, from gpu_stub.c otherwise; the rest of csrc/ needs no CUDA
 * header. */
#ifndef KVBM_GPU_H
#define KVBM_GPU_H

#include "array.h"
#include "kvbm_layout.h"

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

/* Enqueues a block <-> universal move on `stream` of `device`, after the
 * producers' streams (CAI v3) have been ordered before it.  `table` is host
 * memory, copied before return.  Releases the GIL.  Returns 0, or -1 with
 * RuntimeError naming the CUDA error. */
int kv_gpu_block_universal(kv_gpu *gpu, const kvbm_block_dims *dims, kvbm_direction direction,
                           void *const *table, int vector_bytes, int device, intptr_t stream,
                           const intptr_t *producer_streams, Py_ssize_t producer_count);

/* A list of dicts describing the visible CUDA devices; [] when there are
 * none, no driver, or no CUDA build. */
PyObject *kv_gpu_devices(void);

#endif /* KVBM_GPU_H */
