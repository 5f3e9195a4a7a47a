/* cudaMemcpyBatchAsync, which CUDA 12.8 added and CUDA 13.0 changed (no
 * failIdx, const sources): whether this build and the driver have it, and
 * the one call, written once for both.  See gpu_internal.h. */
#include "gpu_internal.h"

#include <string.h>

int kv_gpu_batch_available(void)
{
#if CUDART_VERSION >= 12080
    int version = 0;
    if (cudaDriverGetVersion(&version) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return version >= 12080;
#else
    return 0;
#endif
}

cudaError_t kv_batch_copy(void **dsts, void **srcs, size_t *sizes, size_t count, cudaStream_t stream)
{
#if CUDART_VERSION >= 12080
    /* Each source is read in stream order, after the work queued before. */
    struct cudaMemcpyAttributes attributes;
    memset(&attributes, 0, sizeof attributes);
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
    return cudaMemcpyBatchAsync(dsts, (const void *const *)srcs, sizes, count, &attributes, &attribute_index, 1,
                                stream);
#else
    size_t failed = 0;
    return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &attribute_index, 1, &failed, stream);
#endif
#else
    (void)dsts, (void)srcs, (void)sizes, (void)count, (void)stream;
    return cudaErrorNotSupported;
#endif
}
