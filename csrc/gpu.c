/* Everything that calls the CUDA runtime.  See gpu.h.
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
#include "gpu.h"

#include <cuda_runtime_api.h>
#include <pythread.h>
#include <string.h>

#include "kvbm_kernels.h"

#define KV_MAX_DEVICES 64
#define KV_RING_REGIONS 64
#define KV_RING_INITIAL_BYTES ((size_t)4 << 20)
#define KV_RING_ALIGN 256

typedef struct {
    size_t start, end;
    cudaEvent_t done; /* recorded after the kernel that reads [start, end) */
} kv_region;

typedef struct {
    char *host;   /* pinned staging */
    char *device; /* what kernels read */
    size_t capacity;
    size_t head;
    kv_region busy[KV_RING_REGIONS]; /* FIFO: busy[first], ..., count of them */
    int first, count;
    cudaEvent_t producer_done; /* orders a producer's stream before the caller's */
    cudaStream_t copy_stream;  /* uploads tables; non-blocking, so the legacy stream does not serialize it */
    cudaEvent_t table_ready;   /* orders an upload before the caller's kernel */
} kv_ring;

struct kv_gpu {
    PyThread_type_lock lock; /* the rings are used with the GIL released */
    kv_ring *rings[KV_MAX_DEVICES];
};

/* A failed CUDA step, reported once the GIL is held again. */
typedef struct {
    cudaError_t error;
    const char *what;
} kv_failure;

#define CUDA_STEP(failure, call, description)                                                      \
    do {                                                                                           \
        cudaError_t step_error_ = (call);                                                          \
        if (step_error_ != cudaSuccess) {                                                          \
            (failure)->error = step_error_;                                                        \
            (failure)->what = (description);                                                       \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

static void raise_failure(const kv_failure *f)
{
    PyErr_Format(PyExc_RuntimeError, "CUDA error %s (%d) in %s: %s", cudaGetErrorName(f->error), (int)f->error,
                 f->what, cudaGetErrorString(f->error));
}

int kv_gpu_compiled(void) { return 1; }

kv_gpu *kv_gpu_new(void)
{
    kv_gpu *gpu = PyMem_Calloc(1, sizeof *gpu);
    if (gpu == NULL)
        return (kv_gpu *)PyErr_NoMemory();
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
    CUDA_STEP(f, cudaHostAlloc((void **)&ring->host, capacity, cudaHostAllocDefault), "allocating the pinned table ring");
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

/* Reserves `bytes` of the ring: *offset is where the table goes. */
static int ring_reserve(kv_ring *ring, size_t bytes, size_t *offset, kv_failure *f)
{
    bytes = (bytes + KV_RING_ALIGN - 1) / KV_RING_ALIGN * KV_RING_ALIGN;
    if (bytes > ring->capacity) {
        /* Rare: a table larger than the ring.  Drain, then reallocate. */
        while (ring->count > 0)
            if (ring_retire_oldest(ring, f) < 0)
                return -1;
        cudaFreeHost(ring->host);
        cudaFree(ring->device);
        ring->host = ring->device = NULL;
        size_t capacity = ring->capacity;
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

/* Marks [offset, offset + bytes) busy until the work now on `stream` is done. */
static int ring_commit(kv_ring *ring, size_t offset, size_t bytes, cudaStream_t stream, kv_failure *f)
{
    kv_region *r = &ring->busy[(ring->first + ring->count) % KV_RING_REGIONS];
    CUDA_STEP(f, cudaEventRecord(r->done, stream), "recording the table's event");
    r->start = offset;
    r->end = offset + bytes;
    ring->count++;
    ring->head = (offset + bytes + KV_RING_ALIGN - 1) / KV_RING_ALIGN * KV_RING_ALIGN;
    return 0;
}

static void ring_free(kv_ring *ring)
{
    while (ring->count > 0) {
        kv_failure ignored;
        if (ring_retire_oldest(ring, &ignored) < 0)
            break;
    }
    for (int i = 0; i < KV_RING_REGIONS; i++)
        if (ring->busy[i].done != NULL)
            cudaEventDestroy(ring->busy[i].done);
    if (ring->producer_done != NULL)
        cudaEventDestroy(ring->producer_done);
    if (ring->table_ready != NULL)
        cudaEventDestroy(ring->table_ready);
    if (ring->copy_stream != NULL)
        cudaStreamDestroy(ring->copy_stream);
    cudaFreeHost(ring->host);
    cudaFree(ring->device);
    PyMem_RawFree(ring);
}

/* The ring of the current device, created on first use. */
static kv_ring *ring_for(kv_gpu *gpu, int device, kv_failure *f)
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
    int ok = ring_alloc_buffers(ring, KV_RING_INITIAL_BYTES, f) == 0;
    for (int i = 0; ok && i < KV_RING_REGIONS; i++) {
        f->error = cudaEventCreateWithFlags(&ring->busy[i].done, cudaEventDisableTiming);
        ok = f->error == cudaSuccess;
    }
    if (ok) {
        f->error = cudaEventCreateWithFlags(&ring->producer_done, cudaEventDisableTiming);
        ok = f->error == cudaSuccess;
    }
    if (ok) {
        f->error = cudaEventCreateWithFlags(&ring->table_ready, cudaEventDisableTiming);
        ok = f->error == cudaSuccess;
    }
    if (ok) {
        f->error = cudaStreamCreateWithFlags(&ring->copy_stream, cudaStreamNonBlocking);
        ok = f->error == cudaSuccess;
    }
    if (!ok) {
        if (f->error != cudaSuccess && f->what == NULL)
            f->what = "creating events";
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

/* ------------------------------------------------------------ placement */

int kv_gpu_locate(kv_array *a, const kv_path *path)
{
    if (a->place == KV_DEVICE && a->device_id >= 0)
        return 0;
    struct cudaPointerAttributes attributes;
    cudaError_t error = cudaPointerGetAttributes(&attributes, a->data);
    if (error != cudaSuccess) {
        cudaGetLastError();
        return kv_path_error(PyExc_RuntimeError, path, "cannot tell where this array lives: CUDA error %s: %s",
                             cudaGetErrorName(error), cudaGetErrorString(error));
    }
    switch (attributes.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
        a->place = KV_DEVICE;
        a->device_id = attributes.device;
        return 0;
    case cudaMemoryTypeHost:
        a->place = KV_HOST_PINNED;
        if (attributes.devicePointer != NULL)
            a->data = attributes.devicePointer;
        return 0;
    default:
        if (a->place == KV_DEVICE)
            return kv_path_error(PyExc_ValueError, path,
                                 "__cuda_array_interface__ points at memory that is neither device nor pinned host memory");
        return 0; /* pageable host memory */
    }
}

int kv_gpu_use_device(int device, int *previous)
{
    int current;
    cudaError_t error = cudaGetDevice(&current);
    *previous = -1;
    if (error == cudaSuccess && current != device) {
        error = cudaSetDevice(device);
        if (error == cudaSuccess)
            *previous = current;
    }
    if (error != cudaSuccess) {
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s selecting device %d: %s", cudaGetErrorName(error), device,
                     cudaGetErrorString(error));
        return -1;
    }
    return 0;
}

void kv_gpu_restore_device(int previous)
{
    if (previous >= 0)
        cudaSetDevice(previous);
}

/* ------------------------------------------------------------ launches */

static int same_stream(intptr_t a, intptr_t b)
{
    /* 0 and 1 both name the legacy default stream. */
    return a == b || ((a == 0 || a == 1) && (b == 0 || b == 1));
}

typedef struct {
    const kvbm_block_dims *dims;
    kvbm_direction direction;
    void *const *table;
    int vector_bytes;
    int device;
    intptr_t stream;
    const intptr_t *producers;
    Py_ssize_t producer_count;
} kv_block_universal_call;

/* The GPU work of one call, run without the GIL and under gpu->lock, on the
 * call's device. */
static int enqueue_block_universal(kv_gpu *gpu, const kv_block_universal_call *call, kv_failure *f)
{
    cudaStream_t stream = (cudaStream_t)call->stream;
    kv_ring *ring = ring_for(gpu, call->device, f);
    if (ring == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < call->producer_count; i++) {
        if (same_stream(call->producers[i], call->stream))
            continue;
        CUDA_STEP(f, cudaEventRecord(ring->producer_done, (cudaStream_t)call->producers[i]),
                  "recording an event on the producer's stream");
        CUDA_STEP(f, cudaStreamWaitEvent(stream, ring->producer_done, 0), "ordering the producer's stream first");
    }

    const int64_t count = call->dims->nb * (1 + call->dims->nchunks);
    if (count <= KVBM_TABLE_BY_VALUE_MAX) {
        CUDA_STEP(f, kvbm_launch_block_universal(call->dims, call->table, NULL, call->direction, call->vector_bytes,
                                                 stream),
                  "launching the block/universal kernel");
        return 0;
    }

    size_t bytes = (size_t)count * sizeof(void *);
    size_t offset;
    if (ring_reserve(ring, bytes, &offset, f) < 0)
        return -1;
    memcpy(ring->host + offset, call->table, bytes);
    CUDA_STEP(f, cudaMemcpyAsync(ring->device + offset, ring->host + offset, bytes, cudaMemcpyHostToDevice,
                                 ring->copy_stream),
              "copying the pointer table");
    CUDA_STEP(f, cudaEventRecord(ring->table_ready, ring->copy_stream), "recording the table upload");
    CUDA_STEP(f, cudaStreamWaitEvent(stream, ring->table_ready, 0), "ordering the table upload first");
    CUDA_STEP(f, kvbm_launch_block_universal(call->dims, NULL, (void *const *)(ring->device + offset),
                                             call->direction, call->vector_bytes, stream),
              "launching the block/universal kernel");
    return ring_commit(ring, offset, bytes, stream, f);
}

int kv_gpu_block_universal(kv_gpu *gpu, const kvbm_block_dims *dims, kvbm_direction direction,
                           void *const *table, int vector_bytes, int device, intptr_t stream,
                           const intptr_t *producer_streams, Py_ssize_t producer_count)
{
    kv_block_universal_call call = {dims, direction, table, vector_bytes, device, stream, producer_streams,
                                    producer_count};
    kv_failure failure = {cudaSuccess, NULL};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(gpu->lock, WAIT_LOCK);
    int previous = -1;
    cudaError_t error = cudaGetDevice(&previous);
    if (error == cudaSuccess)
        error = cudaSetDevice(device);
    if (error != cudaSuccess) {
        failure.error = error;
        failure.what = "selecting the arrays' device";
        rc = -1;
    }
    else {
        rc = enqueue_block_universal(gpu, &call, &failure);
        cudaSetDevice(previous);
    }
    PyThread_release_lock(gpu->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        raise_failure(&failure);
    return rc;
}

/* ------------------------------------------------------------ devices */

PyObject *kv_gpu_devices(void)
{
    PyObject *list = PyList_New(0);
    int count = 0;
    if (list == NULL || cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: an empty list */
        return list;
    }
    for (int i = 0; i < count; i++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess)
            continue;
        PyObject *d = Py_BuildValue("{s:i,s:s,s:(ii),s:K,s:i}", "index", i, "name", p.name, "capability", p.major,
                                    p.minor, "total_memory", (unsigned long long)p.totalGlobalMem, "multiprocessors",
                                    p.multiProcessorCount);
        if (d == NULL || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}
