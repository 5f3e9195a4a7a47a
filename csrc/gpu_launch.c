/* The runner every GPU entry point goes through, and how a failed CUDA
 * step reaches Python.  See gpu_internal.h. */
#include "gpu_internal.h"

void kv_raise_failure(const kv_failure *f)
{
    PyErr_Format(PyExc_RuntimeError, "CUDA error %s (%d) in %s: %s", cudaGetErrorName(f->error), (int)f->error,
                 f->what, cudaGetErrorString(f->error));
}

static int same_stream(intptr_t a, intptr_t b)
{
    /* 0 and 1 both name the legacy default stream. */
    return a == b || ((a == 0 || a == 1) && (b == 0 || b == 1));
}

int kv_run_on_device(kv_gpu *gpu, const kv_gpu_target *target, kv_gpu_work work, const void *args)
{
    kv_failure failure = {cudaSuccess, NULL};
    cudaStream_t stream = (cudaStream_t)target->stream;
    int rc = -1, previous = -1;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(gpu->lock, WAIT_LOCK);
    cudaError_t error = kv_select_device(target->device, &previous);
    if (error != cudaSuccess) {
        failure.error = error;
        failure.what = "selecting the arrays' device";
    }
    else {
        kv_ring *ring = kv_ring_for(gpu, target->device, &failure);
        rc = ring == NULL ? -1 : 0;
        for (Py_ssize_t i = 0; rc == 0 && i < target->producer_count; i++) {
            if (same_stream(target->producers[i], target->stream))
                continue;
            error = cudaEventRecord(ring->producer_done, (cudaStream_t)target->producers[i]);
            if (error == cudaSuccess)
                error = cudaStreamWaitEvent(stream, ring->producer_done, 0);
            if (error != cudaSuccess) {
                failure.error = error;
                failure.what = "ordering the producer's stream first";
                rc = -1;
            }
        }
        if (rc == 0)
            rc = work(gpu, ring, stream, args, &failure);
        kv_gpu_restore_device(previous);
    }
    PyThread_release_lock(gpu->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        kv_raise_failure(&failure);
    return rc;
}
