/* The per-device resources and the pointer-table ring.  See gpu.h and
 * gpu_internal.h.
 *
 * Pointer tables reach the kernels in one of two ways.  A small table (up to
 * KVBM_TABLE_BY_VALUE_MAX pointers: nb <= 24 for an 80-layer model) travels
 * by value in the launch's parameters, so nothing is staged and a one-block
 * call costs one launch.  A larger one is written into a pinned staging ring
 * and copied to a device ring on an internal copy stream, which the caller's
 * stream then waits for: the upload overlaps whatever the caller's stream is
 * still running instead of queueing behind it.  An event recorded after the
 * kernel marks the region busy; a later call reuses a region only once that
 * event has completed, so no call overwrites a table a pending kernel still
 * reads.  The per-call path neither allocates nor synchronizes (it waits only
 * when the ring is full, and grows the ring when one table does not fit).
 */
#include "gpu_internal.h"

#include <string.h>

kv_gpu *kv_gpu_new(void)
{
    kv_gpu *gpu = PyMem_Calloc(1, sizeof *gpu);
    if (gpu == NULL)
        return (kv_gpu *)PyErr_NoMemory();
    gpu->staging_bytes = KV_STAGING_DEFAULT_BYTES;
    gpu->staging_lanes = KV_STAGING_DEFAULT_LANES;
    gpu->lock = PyThread_allocate_lock();
    if (gpu->lock == NULL) {
        PyMem_Free(gpu);
        return (kv_gpu *)PyErr_NoMemory();
    }
    return gpu;
}

/* ------------------------------------------------------------ the ring */

static int ring_alloc_buffers(kv_ring *ring, size_t capacity, kv_failure *f)
{
    CUDA_STEP(f, cudaHostAlloc((void **)&ring->host, capacity, cudaHostAllocDefault),
              "allocating the pinned table ring");
    CUDA_STEP(f, cudaMalloc((void **)&ring->device, capacity), "allocating the device table ring");
    ring->capacity = capacity;
    ring->head = 0;
    return 0;
}

/* Waits for the oldest busy region and frees it. */
static int ring_retire_oldest(kv_ring *ring, kv_failure *f)
{
    CUDA_STEP(f, cudaEventSynchronize(ring->busy[ring->first].done), "waiting for an earlier call's table");
    ring->first = (ring->first + 1) % KV_RING_REGIONS;
    ring->count--;
    return 0;
}

static int ring_overlaps(const kv_ring *ring, size_t start, size_t end)
{
    for (int i = 0; i < ring->count; i++) {
        const kv_region *r = &ring->busy[(ring->first + i) % KV_RING_REGIONS];
        if (r->start < end && start < r->end)
            return 1;
    }
    return 0;
}

/* Reserves `bytes` of the ring: *offset is where the table goes.  The
 * buffers are allocated by the first table that needs them (calls whose
 * tables travel by value never do), and regrown when one table exceeds them. */
static int ring_reserve(kv_ring *ring, size_t bytes, size_t *offset, kv_failure *f)
{
    bytes = (bytes + KV_RING_ALIGN - 1) / KV_RING_ALIGN * KV_RING_ALIGN;
    if (bytes > ring->capacity) {
        while (ring->count > 0)
            if (ring_retire_oldest(ring, f) < 0)
                return -1;
        cudaFreeHost(ring->host);
        cudaFree(ring->device);
        ring->host = ring->device = NULL;
        ring->capacity = 0;
        size_t capacity = KV_RING_INITIAL_BYTES;
        while (capacity < bytes)
            capacity *= 2;
        if (ring_alloc_buffers(ring, capacity, f) < 0)
            return -1;
    }
    size_t start = ring->head + bytes <= ring->capacity ? ring->head : 0;
    while (ring->count == KV_RING_REGIONS || ring_overlaps(ring, start, start + bytes))
        if (ring_retire_oldest(ring, f) < 0)
            return -1;
    *offset = start;
    return 0;
}

int kv_ring_commit(kv_ring *ring, size_t offset, size_t bytes, cudaStream_t stream, kv_failure *f)
{
    kv_region *r = &ring->busy[(ring->first + ring->count) % KV_RING_REGIONS];
    CUDA_STEP(f, cudaEventRecord(r->done, stream), "recording the table's event");
    r->start = offset;
    r->end = offset + bytes;
    ring->count++;
    ring->head = (offset + bytes + KV_RING_ALIGN - 1) / KV_RING_ALIGN * KV_RING_ALIGN;
    return 0;
}

/* The ring's ordering events and streams, for creation and destruction. */
static cudaEvent_t *ring_events(kv_ring *ring, int i)
{
    cudaEvent_t *events[] = {&ring->producer_done, &ring->table_ready, &ring->batch_start, &ring->batch_done};
    return i < 4 ? events[i] : NULL;
}

static cudaStream_t *ring_streams(kv_ring *ring, int i)
{
    cudaStream_t *streams[] = {&ring->copy_stream, &ring->batch_stream};
    return i < 2 ? streams[i] : NULL;
}

static void ring_free(kv_ring *ring)
{
    kv_staging_free(ring->staging);
    while (ring->count > 0) {
        kv_failure ignored;
        if (ring_retire_oldest(ring, &ignored) < 0)
            break;
    }
    for (int i = 0; i < KV_RING_REGIONS; i++)
        if (ring->busy[i].done != NULL)
            cudaEventDestroy(ring->busy[i].done);
    for (int i = 0; ring_events(ring, i) != NULL; i++)
        if (*ring_events(ring, i) != NULL)
            cudaEventDestroy(*ring_events(ring, i));
    for (int i = 0; ring_streams(ring, i) != NULL; i++)
        if (*ring_streams(ring, i) != NULL)
            cudaStreamDestroy(*ring_streams(ring, i));
    cudaFreeHost(ring->host);
    cudaFree(ring->device);
    PyMem_RawFree(ring);
}

/* The ring of the current device, created on first use (without buffers:
 * see ring_reserve). */
kv_ring *kv_ring_for(kv_gpu *gpu, int device, kv_failure *f)
{
    if (device < 0 || device >= KV_MAX_DEVICES) {
        f->error = cudaErrorInvalidDevice;
        f->what = "selecting the device";
        return NULL;
    }
    if (gpu->rings[device] != NULL)
        return gpu->rings[device];
    kv_ring *ring = PyMem_RawCalloc(1, sizeof *ring);
    if (ring == NULL) {
        f->error = cudaErrorMemoryAllocation;
        f->what = "allocating the table ring";
        return NULL;
    }
    cudaError_t error = cudaSuccess;
    for (int i = 0; error == cudaSuccess && i < KV_RING_REGIONS; i++)
        error = cudaEventCreateWithFlags(&ring->busy[i].done, cudaEventDisableTiming);
    for (int i = 0; error == cudaSuccess && ring_events(ring, i) != NULL; i++)
        error = cudaEventCreateWithFlags(ring_events(ring, i), cudaEventDisableTiming);
    for (int i = 0; error == cudaSuccess && ring_streams(ring, i) != NULL; i++)
        error = cudaStreamCreateWithFlags(ring_streams(ring, i), cudaStreamNonBlocking);
    if (error != cudaSuccess) {
        f->error = error;
        f->what = "creating the device's events and streams";
        ring_free(ring);
        return NULL;
    }
    gpu->rings[device] = ring;
    return ring;
}

void kv_gpu_free(kv_gpu *gpu)
{
    if (gpu == NULL)
        return;
    for (int device = 0; device < KV_MAX_DEVICES; device++) {
        if (gpu->rings[device] != NULL && cudaSetDevice(device) == cudaSuccess)
            ring_free(gpu->rings[device]);
    }
    PyThread_free_lock(gpu->lock);
    PyMem_Free(gpu);
}

int kv_stage_table(kv_ring *ring, cudaStream_t stream, const void *const *parts, const size_t *part_bytes, int nparts,
                   char **device_copy, size_t *offset, size_t *bytes, kv_failure *f)
{
    /* A graph would replay the upload from the ring, which later calls
     * overwrite: refuse rather than capture it. */
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_STEP(f, cudaStreamIsCapturing(stream, &capture), "asking whether the stream is capturing");
    if (capture != cudaStreamCaptureStatusNone) {
        f->error = cudaErrorStreamCaptureUnsupported;
        f->what = "staging a pointer table while the stream is captured into a CUDA graph (capture calls whose "
                  "tables travel in the kernel's parameters: device-resident block ids and one array)";
        return -1;
    }
    *bytes = 0;
    for (int i = 0; i < nparts; i++)
        *bytes += part_bytes[i];
    if (ring_reserve(ring, *bytes, offset, f) < 0)
        return -1;
    size_t at = *offset;
    for (int i = 0; i < nparts; i++) {
        memcpy(ring->host + at, parts[i], part_bytes[i]);
        at += part_bytes[i];
    }
    CUDA_STEP(f,
              cudaMemcpyAsync(ring->device + *offset, ring->host + *offset, *bytes, cudaMemcpyHostToDevice,
                              ring->copy_stream),
              "copying the pointer table");
    CUDA_STEP(f, cudaEventRecord(ring->table_ready, ring->copy_stream), "recording the table upload");
    CUDA_STEP(f, cudaStreamWaitEvent(stream, ring->table_ready, 0), "ordering the table upload first");
    *device_copy = ring->device + *offset;
    return 0;
}
