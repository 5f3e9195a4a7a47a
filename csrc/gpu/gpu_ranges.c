/* The address checks of raw copies: every range inside one allocation, as
 * the driver describes it (cuPointerGetAttributes).  See gpu.h. */
#define _DEFAULT_SOURCE /* mincore */
#include "gpu_internal.h"

#include <cuda.h>
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "grow.h"

/* cuPointerGetAttributes, reached through the runtime so that the module
 * does not link the driver library. */
typedef CUresult (*kv_pointer_attributes_fn)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr);

/* Found once per process and shared by every interpreter that imports the
 * module, hence atomic: two threads finding it at once store the same
 * value. */
static _Atomic(kv_pointer_attributes_fn) found_fn;

static kv_pointer_attributes_fn pointer_attributes_fn(void)
{
    kv_pointer_attributes_fn fn = atomic_load_explicit(&found_fn, memory_order_acquire);
    if (fn != NULL)
        return fn;
    void *found = NULL;
    enum cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    cudaError_t error =
        cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &found, 7000, cudaEnableDefault, &status);
#else
    cudaError_t error = cudaGetDriverEntryPoint("cuPointerGetAttributes", &found, cudaEnableDefault, &status);
#endif
    if (error != cudaSuccess || status != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return NULL;
    }
    fn = (kv_pointer_attributes_fn)found;
    atomic_store_explicit(&found_fn, fn, memory_order_release);
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
    kv_range *ranges = kv_room_for_one(set->ranges, set->count, &set->capacity, 16, sizeof *ranges);
    if (ranges == NULL)
        return -1;
    set->ranges = ranges;
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
    CUpointer_attribute keys[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                  CU_POINTER_ATTRIBUTE_IS_MANAGED,       CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
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

/* Whether every page of [address, address + size) is mapped in this process:
 * the driver copies pageable memory with the CPU, so an unmapped address
 * would crash it where the driver cannot tell (mincore fails with ENOMEM). */
static int pageable_mapped(uint64_t address, uint64_t size)
{
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t first = address & ~(page - 1), last = (address + size - 1) & ~(page - 1);
    unsigned char vector[64];
    for (uint64_t at = first; at <= last; at += page * sizeof vector) {
        const uint64_t span = last - at + page < page * sizeof vector ? last - at + page : page * sizeof vector;
        if (mincore((void *)(uintptr_t)at, (size_t)span, vector) != 0 && errno == ENOMEM)
            return 0;
    }
    return 1;
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
                if (allow_pageable && (size > UINT64_MAX - address || !pageable_mapped(address, size))) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s[%zd]: %llu bytes from 0x%llx are not all mapped in this "
                                 "process (neither device memory nor host memory)",
                                 names[side], i, (unsigned long long)size, (unsigned long long)address);
                    goto done;
                }
                if (allow_pageable)
                    continue;
                PyErr_Format(PyExc_ValueError,
                             "%s[%zd]: address 0x%llx is in pageable host memory, which the copy "
                             "kernel cannot reach: use pinned (page-locked) host memory or device memory, or "
                             "memcpy_batch",
                             names[side], i, (unsigned long long)address);
                goto done;
            }
            if (size > r.end - address) {
                PyErr_Format(PyExc_ValueError,
                             "%s[%zd]: %llu bytes from 0x%llx run past the end of its allocation "
                             "(%llu bytes left)",
                             names[side], i, (unsigned long long)size, (unsigned long long)address,
                             (unsigned long long)(r.end - address));
                goto done;
            }
            if (r.device >= 0) {
                if (*device < 0) {
                    *device = r.device;
                    device_name = names[side];
                    device_index = i;
                }
                else if (r.device != *device) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s[%zd]: on device cuda:%d, but %s[%zd] is on cuda:%d; one call "
                                 "copies on one device",
                                 names[side], i, r.device, device_name, device_index, *device);
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
