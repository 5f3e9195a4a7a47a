/* Raw copies: the copy kernel, one cudaMemcpyAsync per pair, and
 * cudaMemcpyBatchAsync.  See gpu.h. */
#include "gpu_internal.h"

#include <stdio.h>
#include <string.h>

#include "kvbm_kernels.h"

/* CTAs per pair: enough that one CTA moves about KVBM_COPY_TILE_BYTES of
 * the largest pair, or, when the sizes live on the device, enough CTAs to
 * fill the GPU several times over. */
static uint32_t slices_for(const kv_pairs *pairs)
{
    uint64_t slices;
    if (pairs->sizes_on_device) {
        slices = (8192 + (uint64_t)pairs->count - 1) / (uint64_t)pairs->count;
    }
    else {
        uint64_t largest = pairs->uniform_size;
        for (int64_t i = 0; pairs->sizes != NULL && i < pairs->count; i++)
            largest = pairs->sizes[i] > largest ? pairs->sizes[i] : largest;
        slices = (largest + KVBM_COPY_TILE_BYTES - 1) / KVBM_COPY_TILE_BYTES;
    }
    const uint64_t most = (uint64_t)INT32_MAX / (uint64_t)pairs->count;
    slices = slices > 65536 ? 65536 : slices;
    slices = slices > most ? most : slices;
    return slices == 0 ? 1 : (uint32_t)slices;
}

static int enqueue_copy_kernel(kv_ring *ring, cudaStream_t stream, const kv_pairs *pairs, kv_failure *f)
{
    kvbm_pairs launch = {pairs->count, NULL, NULL, NULL, pairs->uniform_size, slices_for(pairs), pairs->num_ctas};
    uint64_t *lists[3] = {pairs->src, pairs->dst, pairs->sizes};
    const int on_device[3] = {pairs->src_on_device, pairs->dst_on_device, pairs->sizes_on_device};
    const int nlists = pairs->sizes != NULL ? 3 : 2;
    const void *parts[3];
    size_t part_bytes[3];
    int nparts = 0, staged[3] = {0, 0, 0};
    for (int k = 0; k < nlists; k++) {
        if (!on_device[k]) {
            staged[k] = 1;
            parts[nparts] = lists[k];
            part_bytes[nparts++] = (size_t)pairs->count * sizeof(uint64_t);
        }
    }
    const int by_value = nparts == nlists && pairs->count * nlists <= KVBM_TABLE_BY_VALUE_MAX;
    if (by_value) {
        uint64_t values[KVBM_TABLE_BY_VALUE_MAX];
        for (int k = 0; k < nlists; k++)
            memcpy(values + k * pairs->count, lists[k], (size_t)pairs->count * sizeof(uint64_t));
        launch.sizes = pairs->sizes; /* only tells the launcher that there are sizes */
        CUDA_STEP(f, kvbm_launch_copy_pairs(&launch, values, stream), "launching the copy kernel");
        return 0;
    }
    char *device_copy = NULL;
    size_t offset = 0, bytes = 0;
    if (nparts > 0 && kv_stage_table(ring, stream, parts, part_bytes, nparts, &device_copy, &offset, &bytes, f) < 0)
        return -1;
    const uint64_t *resolved[3] = {NULL, NULL, NULL};
    for (int k = 0, part = 0; k < nlists; k++)
        resolved[k] = staged[k] ? (const uint64_t *)device_copy + (size_t)(part++) * (size_t)pairs->count : lists[k];
    launch.src = resolved[0];
    launch.dst = resolved[1];
    launch.sizes = resolved[2];
    CUDA_STEP(f, kvbm_launch_copy_pairs(&launch, NULL, stream), "launching the copy kernel");
    return nparts > 0 ? kv_ring_commit(ring, offset, bytes, stream, f) : 0;
}

static int enqueue_async_loop(cudaStream_t stream, const kv_pairs *pairs, kv_failure *f)
{
    for (int64_t i = 0; i < pairs->count; i++) {
        const size_t size = (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size);
        if (size > 0)
            CUDA_STEP(f,
                      cudaMemcpyAsync((void *)(uintptr_t)pairs->dst[i], (const void *)(uintptr_t)pairs->src[i], size,
                                      cudaMemcpyDefault, stream),
                      "cudaMemcpyAsync");
    }
    return 0;
}

/* cudaMemcpyBatchAsync over the pairs of non-zero size (it rejects zero-size
 * entries), on `stream`, or on the ring's batch stream when `stream` is a
 * default stream (which it rejects), ordered after and before `stream` with
 * events.  Returns the batch API's error without setting *f for it, so that
 * the caller can fall back. */
static cudaError_t enqueue_batch(kv_ring *ring, cudaStream_t stream, const kv_pairs *pairs, kv_failure *f)
{
    if (!kv_gpu_batch_available())
        return cudaErrorNotSupported;
    void **dsts = PyMem_RawMalloc((size_t)pairs->count * sizeof(void *));
    void **srcs = PyMem_RawMalloc((size_t)pairs->count * sizeof(void *));
    size_t *sizes = PyMem_RawMalloc((size_t)pairs->count * sizeof(size_t));
    size_t n = 0;
    cudaError_t error = cudaErrorMemoryAllocation;
    if (dsts == NULL || srcs == NULL || sizes == NULL)
        goto done;
    for (int64_t i = 0; i < pairs->count; i++) {
        const size_t size = (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size);
        if (size > 0) {
            dsts[n] = (void *)(uintptr_t)pairs->dst[i];
            srcs[n] = (void *)(uintptr_t)pairs->src[i];
            sizes[n++] = size;
        }
    }
    error = cudaSuccess;
    if (n == 0)
        goto done;
    const int on_default = kv_is_default_stream(stream);
    cudaStream_t run = on_default ? ring->batch_stream : stream;
    if (on_default) {
        if ((error = cudaEventRecord(ring->batch_start, stream)) != cudaSuccess
            || (error = cudaStreamWaitEvent(run, ring->batch_start, 0)) != cudaSuccess) {
            f->error = error;
            f->what = "ordering the batch stream after the caller's";
            goto done;
        }
    }
    error = kv_batch_copy(dsts, srcs, sizes, n, run);
    if (error != cudaSuccess) {
        cudaGetLastError();
        goto done;
    }
    if (on_default) {
        cudaError_t join = cudaEventRecord(ring->batch_done, run);
        if (join == cudaSuccess)
            join = cudaStreamWaitEvent(stream, ring->batch_done, 0);
        if (join != cudaSuccess) {
            f->error = join;
            f->what = "ordering the caller's stream after the batch";
        }
    }
done:
    PyMem_RawFree(dsts);
    PyMem_RawFree(srcs);
    PyMem_RawFree(sizes);
    return error;
}

/* Enqueues the pairs with `engine`, the batch falling back to the loop
 * where `fallback` allows; *ran receives the engine that ran and
 * *batch_error the batch API's error, if any. */
static int enqueue_copies(kv_device *d, const kv_pairs *pairs, kv_engine engine, int fallback, kv_engine *ran,
                          cudaError_t *batch_error)
{
    kv_failure *f = &d->failure;
    switch (engine) {
    case KV_ENGINE_KERNEL: return enqueue_copy_kernel(d->ring, d->stream, pairs, f);
    case KV_ENGINE_ASYNC: return enqueue_async_loop(d->stream, pairs, f);
    case KV_ENGINE_BATCH:
        *batch_error = enqueue_batch(d->ring, d->stream, pairs, f);
        if (f->error != cudaSuccess)
            return -1;
        if (*batch_error == cudaSuccess)
            return 0;
        if (!fallback) {
            f->error = *batch_error;
            f->what = "cudaMemcpyBatchAsync";
            return -1;
        }
        *ran = KV_ENGINE_ASYNC;
        return enqueue_async_loop(d->stream, pairs, f);
    }
    return 0;
}

int kv_gpu_copy_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine, int fallback,
                      kv_engine *ran, char *why, size_t why_size)
{
    *ran = engine;
    if (pairs->count == 0)
        return 0;
    cudaError_t batch_error = cudaSuccess;
    kv_device device;
    int rc = kv_device_enter(gpu, target, &device);
    if (rc == 0)
        rc = enqueue_copies(&device, pairs, engine, fallback, ran, &batch_error);
    rc = kv_device_leave(&device, rc);
    if (why != NULL && why_size > 0) {
        why[0] = '\0';
        if (batch_error == cudaErrorNotSupported && !kv_gpu_batch_available())
            snprintf(why, why_size,
                     "cudaMemcpyBatchAsync not available (build CUDA %d, needs 12080 in build and "
                     "driver)",
                     CUDART_VERSION);
        else if (batch_error != cudaSuccess)
            snprintf(why, why_size, "cudaMemcpyBatchAsync failed: %s", cudaGetErrorName(batch_error));
    }
    return rc;
}
