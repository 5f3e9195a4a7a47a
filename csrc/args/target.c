/* Where a call's work goes.  See target.h. */
#include "target.h"

#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "grow.h"

void kv_target_init(kv_target *t, intptr_t stream, int device, const char *owner)
{
    memset(t, 0, sizeof *t);
    t->gpu.device = device;
    t->gpu.stream = stream;
    t->owner = owner;
}

int kv_target_fix_device(kv_target *t, kv_array *a, const kv_path *path)
{
    if (kv_gpu_locate(a, path) < 0)
        return -1;
    if (a->place == KV_DEVICE) {
        t->gpu.device = a->device_id;
        t->owner = NULL;
        t->first = *path;
    }
    return 0;
}

/* "the cache is", or "universals[0] is": what fixed the device. */
static void owner_phrase(const kv_target *t, char *buf, size_t size)
{
    if (t->owner != NULL) {
        snprintf(buf, size, "%s", t->owner);
        return;
    }
    kv_path_format(&t->first, buf, size);
    const size_t n = strlen(buf);
    snprintf(buf + n, size - n, " is");
}

/* Lists a's producer stream (CAI v3, or the C exchange API's current
 * stream) unless it is listed already. */
static int add_producer(kv_target *t, const kv_array *a)
{
    if (!a->has_stream)
        return 0;
    for (Py_ssize_t k = 0; k < t->gpu.producer_count; k++)
        if (t->producers[k] == a->stream)
            return 0;
    intptr_t *producers = kv_room_for_one(t->producers, t->gpu.producer_count, &t->capacity, 4, sizeof *producers);
    if (producers == NULL)
        return -1;
    t->producers = producers;
    t->gpu.producers = producers;
    t->producers[t->gpu.producer_count++] = a->stream;
    return 0;
}

int kv_target_add(kv_target *t, kv_array *a, const kv_path *path)
{
    if (kv_gpu_locate(a, path) < 0)
        return -1;
    char owner[112];
    if (a->place == KV_DEVICE && a->device_id != t->gpu.device) {
        owner_phrase(t, owner, sizeof owner);
        return kv_path_error(PyExc_ValueError, path, "on cuda:%d, but %s on cuda:%d; a call runs on one device",
                             a->device_id, owner, t->gpu.device);
    }
    if (a->place == KV_HOST) {
        owner_phrase(t, owner, sizeof owner);
        return kv_path_error(PyExc_ValueError, path,
                             "in pageable host memory, but %s on cuda:%d, which needs pinned "
                             "(page-locked) host memory: pin it (e.g. torch's tensor.pin_memory()) or move it to the "
                             "device",
                             owner, t->gpu.device);
    }
    t->pinned |= a->place == KV_HOST_PINNED;
    return add_producer(t, a);
}

/* The stream a group of arrays names (kv_target_resolve_stream), if any. */
static int group_stream(kv_target *t, const kv_array_group *group)
{
    for (Py_ssize_t i = 0; i < group->count; i++) {
        const kv_array *a = &group->arrays[i];
        if (a->current_work_stream != NULL) {
            void *current = NULL;
            if (kv_array_current_stream(a, kDLCUDA, t->gpu.device, &current) < 0)
                return -1;
            t->gpu.stream = (intptr_t)current;
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < group->count; i++) {
        const kv_array *a = &group->arrays[i];
        if (a->place == KV_DEVICE && a->has_stream) {
            t->gpu.stream = a->stream;
            return 0;
        }
    }
    return 0;
}

int kv_target_resolve_stream(kv_target *t, const kv_array_group *groups, int count)
{
    if (t->gpu.stream != KV_STREAM_CURRENT)
        return 0;
    t->gpu.stream = 0; /* the legacy default stream, unless a group names another */
    for (int g = 0; g < count && t->gpu.stream == 0; g++)
        if (group_stream(t, &groups[g]) < 0)
            return -1;
    return 0;
}

int kv_require_device(const char *function, const char *why)
{
    if (kv_gpu_device_count() > 0)
        return 0;
    if (kv_gpu_compiled())
        return kv_error(PyExc_RuntimeError,
                        "%s needs a CUDA device (%s), and none is visible: no GPU, or no usable "
                        "driver",
                        function, why);
    return kv_error(PyExc_RuntimeError,
                    "%s needs a CUDA device (%s), but kvbm_ext was built without CUDA (nvcc was "
                    "not found at build time)",
                    function, why);
}

void kv_target_release(kv_target *t)
{
    PyMem_Free(t->producers);
    t->producers = NULL;
    t->gpu.producers = NULL;
    t->capacity = t->gpu.producer_count = 0;
}
