/* How every GPU entry point holds its device for one call, and how a
 * failed CUDA step reaches Python.  See gpu_internal.h. */
#include "gpu_internal.h"

void kv_raise_failure(const kv_failure *f)
{
    char message[512];
    kv_failure_message(f, message, sizeof message);
    PyErr_SetString(PyExc_RuntimeError, message);
}

static int same_stream(intptr_t a, intptr_t b)
{
    /* 0 and 1 both name the legacy default stream. */
    return a == b || ((a == 0 || a == 1) && (b == 0 || b == 1));
}

/* Makes the target's stream wait for its producers' streams. */
static int order_producers(kv_device *d, const kv_gpu_target *target)
{
    for (Py_ssize_t i = 0; i < target->producer_count; i++) {
        if (same_stream(target->producers[i], target->stream))
            continue;
        CUDA_STEP(&d->failure, cudaEventRecord(d->ring->producer_done, (cudaStream_t)target->producers[i]),
                  "ordering the producer's stream first");
        CUDA_STEP(&d->failure, cudaStreamWaitEvent(d->stream, d->ring->producer_done, 0),
                  "ordering the producer's stream first");
    }
    return 0;
}

int kv_device_enter(kv_gpu *gpu, const kv_gpu_target *target, kv_device *d)
{
    d->gpu = gpu;
    d->ring = NULL;
    d->stream = (cudaStream_t)target->stream;
    d->failure.error = cudaSuccess;
    d->failure.what = NULL;
    d->previous = -1;
    d->thread = PyEval_SaveThread();
    PyThread_acquire_lock(gpu->lock, WAIT_LOCK);
    const cudaError_t error = kv_select_device(target->device, &d->previous);
    if (error != cudaSuccess) {
        d->failure.error = error;
        d->failure.what = "selecting the arrays' device";
        return -1;
    }
    d->ring = kv_ring_for(gpu, target->device, &d->failure);
    return d->ring == NULL ? -1 : order_producers(d, target);
}

int kv_device_leave(kv_device *d, int rc)
{
    kv_gpu_restore_device(d->previous);
    PyThread_release_lock(d->gpu->lock);
    PyEval_RestoreThread(d->thread);
    if (rc < 0)
        kv_raise_failure(&d->failure);
    return rc;
}
