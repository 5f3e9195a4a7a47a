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
#include "gpu_internal.h"

#include <cuda.h>
#include <stdio.h>
#include <string.h>

#include "kvbm_kernels.h"

void kv_raise_failure(const kv_failure *f)
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

/* Makes `device` current; *previous receives the device to restore, or -1
 * when it already was current.  Safe without the GIL. */
cudaError_t kv_select_device(int device, int *previous)
{
    int current;
    cudaError_t error = cudaGetDevice(&current);
    *previous = -1;
    if (error == cudaSuccess && current != device) {
        error = cudaSetDevice(device);
        if (error == cudaSuccess)
            *previous = current;
    }
    return error;
}

int kv_gpu_use_device(int device, int *previous)
{
    cudaError_t error = kv_select_device(device, previous);
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

int kv_gpu_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

int kv_gpu_current_device(void)
{
    int device;
    cudaError_t error = cudaGetDevice(&device);
    if (error != cudaSuccess) {
        cudaGetLastError();
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s finding the current device: %s", cudaGetErrorName(error),
                     cudaGetErrorString(error));
        return -1;
    }
    return device;
}

/* ------------------------------------------------------------ address checks */

/* cuPointerGetAttributes, reached through the runtime so that the module
 * does not link the driver library. */
typedef CUresult (*kv_pointer_attributes_fn)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr);

static kv_pointer_attributes_fn pointer_attributes_fn(void)
{
    static kv_pointer_attributes_fn fn;
    if (fn == NULL) {
        void *found = NULL;
        enum cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
        cudaError_t error = cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &found, 7000, cudaEnableDefault,
                                                             &status);
#else
        cudaError_t error = cudaGetDriverEntryPoint("cuPointerGetAttributes", &found, cudaEnableDefault, &status);
#endif
        if (error != cudaSuccess || status != cudaDriverEntryPointSuccess)
            cudaGetLastError();
        else
            fn = (kv_pointer_attributes_fn)found;
    }
    return fn;
}

/* One allocation, as the driver describes it. */
typedef struct {
    uint64_t start, end;
    int device;     /* -1 for host memory */
    int pinned;     /* host memory the GPU can reach */
    int64_t offset; /* device address - host address, for pinned memory */
} kv_range;

/* The allocations seen during one check, sorted by start: a batch usually
 * points into a few large allocations (one KV cache per layer, one pinned
 * pool), so most lookups are a binary search here, not a driver call. */
typedef struct {
    kv_range *ranges;
    Py_ssize_t count, capacity;
} kv_range_set;

/* Index of the last range starting at or before `address`, or -1. */
static Py_ssize_t range_before(const kv_range_set *set, uint64_t address)
{
    Py_ssize_t lo = 0, hi = set->count;
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (set->ranges[mid].start <= address)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo - 1;
}

static int remember_range(kv_range_set *set, const kv_range *r)
{
    if (set->count == set->capacity) {
        const Py_ssize_t capacity = set->capacity ? 2 * set->capacity : 16;
        kv_range *grown = PyMem_Realloc(set->ranges, (size_t)capacity * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        set->ranges = grown;
        set->capacity = capacity;
    }
    const Py_ssize_t at = range_before(set, r->start) + 1;
    memmove(set->ranges + at + 1, set->ranges + at, (size_t)(set->count - at) * sizeof *r);
    set->ranges[at] = *r;
    set->count++;
    return 0;
}

/* Finds the allocation holding `address`. */
static int find_range(kv_range_set *set, uint64_t address, kv_range *out, const char *name, Py_ssize_t index)
{
    const Py_ssize_t before = range_before(set, address);
    if (before >= 0 && address < set->ranges[before].end) {
        *out = set->ranges[before];
        return 0;
    }
    kv_pointer_attributes_fn fn = pointer_attributes_fn();
    if (fn == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s[%zd]: cannot query the CUDA driver about this address (no usable driver)",
                     name, index);
        return -1;
    }
    unsigned int type = 0;
    int ordinal = -1, managed = 0;
    void *device_pointer = NULL;
    uint64_t start = 0;
    size_t size = 0;
    CUpointer_attribute keys[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                  CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void *values[] = {&type, &ordinal, &managed, &device_pointer, &start, &size};
    CUresult result = fn(6, keys, values, (CUdeviceptr)address);
    if (result != CUDA_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "%s[%zd]: the CUDA driver cannot describe address 0x%llx (CUresult %d)", name,
                     index, (unsigned long long)address, (int)result);
        return -1;
    }
    kv_range r = {address, address + 1, -1, 0, 0};
    if (type == CU_MEMORYTYPE_DEVICE || managed) {
        r.device = ordinal;
    }
    else if (type == CU_MEMORYTYPE_HOST) {
        r.pinned = 1;
        r.offset = (int64_t)((uint64_t)(uintptr_t)device_pointer - address);
    }
    *out = r;
    if (r.device < 0 && !r.pinned)
        return 0; /* pageable: nothing to remember */
    if (size == 0) {
        out->end = UINT64_MAX; /* no range reported: the bounds cannot be checked */
        return 0;
    }
    r.start = start;
    r.end = start + size;
    *out = r;
    return remember_range(set, &r);
}

int kv_gpu_check_pairs(kv_pairs *pairs, const char *const names[2], int allow_pageable, int *device)
{
    kv_range_set set = {NULL, 0, 0};
    int rc = -1;
    const char *device_name = NULL;
    Py_ssize_t device_index = 0;
    *device = -1;
    uint64_t *lists[2] = {pairs->src_on_device ? NULL : pairs->src, pairs->dst_on_device ? NULL : pairs->dst};
    for (Py_ssize_t i = 0; i < pairs->count; i++) {
        /* Sizes on the device are unknown here: then only the start is checked. */
        const uint64_t size = pairs->sizes_on_device ? 1 : pairs->sizes ? pairs->sizes[i] : pairs->uniform_size;
        for (int side = 0; side < 2; side++) {
            if (lists[side] == NULL)
                continue;
            const uint64_t address = lists[side][i];
            if (address == 0) {
                PyErr_Format(PyExc_ValueError, "%s[%zd]: null address", names[side], i);
                goto done;
            }
            if (size == 0)
                continue;
            kv_range r;
            if (find_range(&set, address, &r, names[side], i) < 0)
                goto done;
            if (r.device < 0 && !r.pinned) {
                if (allow_pageable)
                    continue;
                PyErr_Format(PyExc_ValueError, "%s[%zd]: address 0x%llx is in pageable host memory, which the copy "
                             "kernel cannot reach: use pinned (page-locked) host memory or device memory, or "
                             "memcpy_batch", names[side], i, (unsigned long long)address);
                goto done;
            }
            if (size > r.end - address) {
                PyErr_Format(PyExc_ValueError, "%s[%zd]: %llu bytes from 0x%llx run past the end of its allocation "
                             "(%llu bytes left)", names[side], i, (unsigned long long)size,
                             (unsigned long long)address, (unsigned long long)(r.end - address));
                goto done;
            }
            if (r.device >= 0) {
                if (*device < 0) {
                    *device = r.device;
                    device_name = names[side];
                    device_index = i;
                }
                else if (r.device != *device) {
                    PyErr_Format(PyExc_ValueError, "%s[%zd]: on device cuda:%d, but %s[%zd] is on cuda:%d; one call "
                                 "copies on one device", names[side], i, r.device, device_name, device_index, *device);
                    goto done;
                }
            }
            lists[side][i] = address + (uint64_t)r.offset;
        }
    }
    rc = 0;
done:
    PyMem_Free(set.ranges);
    return rc;
}

/* ------------------------------------------------------------ launches */

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

/* Copies `bytes` of host memory into the ring and uploads it on the copy
 * stream, which `stream` then waits for.  *device_copy receives the device
 * address; ring_commit must follow the launch that reads it. */
static int stage_table(kv_ring *ring, cudaStream_t stream, const void *const *parts, const size_t *part_bytes,
                       int nparts, char **device_copy, size_t *offset, size_t *bytes, kv_failure *f)
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
    CUDA_STEP(f, cudaMemcpyAsync(ring->device + *offset, ring->host + *offset, *bytes, cudaMemcpyHostToDevice,
                                 ring->copy_stream),
              "copying the pointer table");
    CUDA_STEP(f, cudaEventRecord(ring->table_ready, ring->copy_stream), "recording the table upload");
    CUDA_STEP(f, cudaStreamWaitEvent(stream, ring->table_ready, 0), "ordering the table upload first");
    *device_copy = ring->device + *offset;
    return 0;
}

int kv_launch_with_table(kv_ring *ring, cudaStream_t stream, const void *table, int64_t entries,
                             kv_table_launch launch, const void *args, const char *what, kv_failure *f)
{
    if (entries <= KVBM_TABLE_BY_VALUE_MAX) {
        CUDA_STEP(f, launch(args, table, NULL, stream), what);
        return 0;
    }
    const void *parts[] = {table};
    const size_t part_bytes[] = {(size_t)entries * 8};
    char *device_table;
    size_t offset, bytes;
    if (stage_table(ring, stream, parts, part_bytes, 1, &device_table, &offset, &bytes, f) < 0)
        return -1;
    CUDA_STEP(f, launch(args, NULL, device_table, stream), what);
    return ring_commit(ring, offset, bytes, stream, f);
}

/* ------------------------------------------------------------ raw copies */

const char *const KV_ENGINE_NAMES[3] = {"kernel", "async", "batch"};

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
    kvbm_pairs launch = {pairs->count, NULL, NULL, NULL, pairs->uniform_size, slices_for(pairs), pairs->max_ctas};
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
    if (nparts > 0 && stage_table(ring, stream, parts, part_bytes, nparts, &device_copy, &offset, &bytes, f) < 0)
        return -1;
    const uint64_t *resolved[3] = {NULL, NULL, NULL};
    for (int k = 0, part = 0; k < nlists; k++)
        resolved[k] = staged[k] ? (const uint64_t *)device_copy + (size_t)(part++) * (size_t)pairs->count : lists[k];
    launch.src = resolved[0];
    launch.dst = resolved[1];
    launch.sizes = resolved[2];
    CUDA_STEP(f, kvbm_launch_copy_pairs(&launch, NULL, stream), "launching the copy kernel");
    return nparts > 0 ? ring_commit(ring, offset, bytes, stream, f) : 0;
}

static int enqueue_async_loop(cudaStream_t stream, const kv_pairs *pairs, kv_failure *f)
{
    for (int64_t i = 0; i < pairs->count; i++) {
        const size_t size = (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size);
        if (size > 0)
            CUDA_STEP(f, cudaMemcpyAsync((void *)(uintptr_t)pairs->dst[i], (const void *)(uintptr_t)pairs->src[i],
                                         size, cudaMemcpyDefault, stream),
                      "cudaMemcpyAsync");
    }
    return 0;
}

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

/* cudaMemcpyBatchAsync over the pairs of non-zero size (it rejects zero-size
 * entries), on `stream`, or on the ring's batch stream when `stream` is a
 * default stream (which it rejects), ordered after and before `stream` with
 * events.  Returns the batch API's error without setting *f for it, so that
 * the caller can fall back. */
static cudaError_t enqueue_batch(kv_ring *ring, cudaStream_t stream, const kv_pairs *pairs, kv_failure *f)
{
#if CUDART_VERSION >= 12080
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
    const int on_default = (intptr_t)stream == 0 || (intptr_t)stream == 1 || (intptr_t)stream == 2;
    cudaStream_t run = on_default ? ring->batch_stream : stream;
    if (on_default) {
        if ((error = cudaEventRecord(ring->batch_start, stream)) != cudaSuccess
            || (error = cudaStreamWaitEvent(run, ring->batch_start, 0)) != cudaSuccess) {
            f->error = error;
            f->what = "ordering the batch stream after the caller's";
            goto done;
        }
    }
    struct cudaMemcpyAttributes attributes;
    memset(&attributes, 0, sizeof attributes);
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
    error = cudaMemcpyBatchAsync(dsts, (const void *const *)srcs, sizes, n, &attributes, &attribute_index, 1, run);
#else
    size_t failed = 0;
    error = cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attributes, &attribute_index, 1, &failed, run);
#endif
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
#else
    (void)ring, (void)stream, (void)pairs, (void)f;
    return cudaErrorNotSupported;
#endif
}

typedef struct {
    const kv_pairs *pairs;
    kv_engine engine;
    int fallback;
    kv_engine *ran;
    cudaError_t batch_error;
} kv_copy_args;

static int enqueue_copies(kv_gpu *gpu, kv_ring *ring, cudaStream_t stream, const void *args, kv_failure *f)
{
    (void)gpu;
    kv_copy_args *a = (kv_copy_args *)args;
    *a->ran = a->engine;
    switch (a->engine) {
    case KV_ENGINE_KERNEL:
        return enqueue_copy_kernel(ring, stream, a->pairs, f);
    case KV_ENGINE_ASYNC:
        return enqueue_async_loop(stream, a->pairs, f);
    case KV_ENGINE_BATCH:
        a->batch_error = enqueue_batch(ring, stream, a->pairs, f);
        if (f->error != cudaSuccess)
            return -1;
        if (a->batch_error == cudaSuccess)
            return 0;
        if (!a->fallback) {
            f->error = a->batch_error;
            f->what = "cudaMemcpyBatchAsync";
            return -1;
        }
        *a->ran = KV_ENGINE_ASYNC;
        return enqueue_async_loop(stream, a->pairs, f);
    }
    return 0;
}

int kv_gpu_copy_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine,
                      int fallback, kv_engine *ran, char *why, size_t why_size)
{
    kv_copy_args args = {pairs, engine, fallback, ran, cudaSuccess};
    if (pairs->count == 0) {
        *ran = engine;
        return 0;
    }
    const int rc = kv_run_on_device(gpu, target, enqueue_copies, &args);
    if (why != NULL && why_size > 0) {
        why[0] = '\0';
        if (args.batch_error == cudaErrorNotSupported && !kv_gpu_batch_available())
            snprintf(why, why_size, "cudaMemcpyBatchAsync not available (build CUDA %d, needs 12080 in build and "
                     "driver)", CUDART_VERSION);
        else if (args.batch_error != cudaSuccess)
            snprintf(why, why_size, "cudaMemcpyBatchAsync failed: %s", cudaGetErrorName(args.batch_error));
    }
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
