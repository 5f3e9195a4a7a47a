/* kvbm_ext.set_staging(), reserve_staging() and staging_info(): the
 * settings of the staging memory (staging.c) and its allocation ahead of
 * need.  See gpu.h. */
#include "gpu_internal.h"
#include "kvbm_kernels.h"

int kv_gpu_set_staging(kv_gpu *gpu, int64_t bytes, int lanes)
{
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(gpu->lock, WAIT_LOCK);
    if (bytes >= 0)
        gpu->staging_bytes = (size_t)bytes;
    if (lanes > 0)
        gpu->staging_lanes = lanes;
    for (int device = 0; device < KV_MAX_DEVICES; device++) {
        kv_ring *ring = gpu->rings[device];
        int previous = -1;
        if (ring == NULL || ring->staging == NULL || kv_select_device(device, &previous) != cudaSuccess)
            continue;
        kv_staging_free(ring->staging);
        ring->staging = NULL;
        kv_gpu_restore_device(previous);
    }
    PyThread_release_lock(gpu->lock);
    Py_END_ALLOW_THREADS
    return 0;
}

/* Every kernel of the extension loaded on the current device. */
static int load_kernels(kv_failure *f)
{
    CUDA_STEP(f, kvbm_load_kernels(), "loading the kernels");
    return 0;
}

int kv_gpu_reserve_staging(kv_gpu *gpu, int device)
{
    /* Held as a call holds it, so that it shares the device selection and
     * the ring with the calls. */
    const kv_gpu_target target = {device, 0, NULL, 0};
    kv_device held;
    int rc = kv_device_enter(gpu, &target, &held);
    if (rc == 0)
        rc = kv_staging_reserve(gpu, held.ring, &held.failure);
    if (rc == 0)
        rc = load_kernels(&held.failure);
    return kv_device_leave(&held, rc);
}

PyObject *kv_gpu_staging_info(kv_gpu *gpu, int device)
{
    PyThreadState *attached = PyEval_SaveThread(); /* the lock's holder may be waiting for the GPU */
    PyThread_acquire_lock(gpu->lock, WAIT_LOCK);
    const kv_ring *ring = device >= 0 && device < KV_MAX_DEVICES ? gpu->rings[device] : NULL;
    const kv_staging_facts facts = kv_staging_facts_of(gpu, ring != NULL ? ring->staging : NULL);
    PyThread_release_lock(gpu->lock);
    PyEval_RestoreThread(attached);
    return Py_BuildValue("{s:i,s:K,s:i,s:K,s:O,s:O}", "device", device, "size_bytes",
                         (unsigned long long)(facts.lane_bytes * (size_t)facts.lanes), "lanes", facts.lanes,
                         "lane_bytes", (unsigned long long)facts.lane_bytes, "allocated",
                         facts.allocated ? Py_True : Py_False, "capture_reserved",
                         facts.capture_reserved ? Py_True : Py_False);
}
