/* The raw copies of vectorized_copy and memcpy_batch.  See copy.h. */
#include "copy.h"

#include <string.h>

#include "address_list.h"
#include "args.h"
#include "overlap.h"
#include "route.h"
#include "signatures.h"

static const char *const MODE_NAMES[3] = {"batched_with_fallback", "fallback_only", "batch_without_fallback"};
enum {
    MODE_BATCHED_WITH_FALLBACK,
    MODE_FALLBACK_ONLY,
    MODE_BATCH_WITHOUT_FALLBACK
};

static const char *const LIST_NAMES[2] = {"src_ptrs", "dst_ptrs"};

/* The three lists of one call and everything they borrow. */
typedef struct {
    kv_address_list src, dst, sizes;
    int parsed; /* lists read so far */
    intptr_t stream;
    PyObject *dlpack_stream;
} kv_copy_call;

static void release_call(kv_copy_call *call)
{
    kv_address_list *lists[3] = {&call->src, &call->dst, &call->sizes};
    for (int i = 0; i < call->parsed; i++)
        kv_address_list_release(lists[i]);
    Py_XDECREF(call->dlpack_stream);
}

/* Reads the stream and the three lists and checks that their lengths agree. */
static int read_call(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream, int allow_device,
                     kv_copy_call *call)
{
    memset(call, 0, sizeof *call);
    if (kv_stream_from_object(stream, &call->stream) < 0)
        return -1;
    if (call->stream == KV_STREAM_CURRENT)
        call->stream = 0; /* raw copies run on the legacy default stream unless told otherwise */
    call->dlpack_stream = kv_stream_for_dlpack(call->stream);
    if (call->dlpack_stream == NULL)
        return -1;
    const kv_reader reader = {&state->protocols, call->dlpack_stream};
    if (kv_address_list_read(&reader, src, LIST_NAMES[0], KV_LIST_ADDRESSES, allow_device, &call->src) < 0)
        return -1;
    call->parsed = 1;
    if (kv_address_list_read(&reader, dst, LIST_NAMES[1], KV_LIST_ADDRESSES, allow_device, &call->dst) < 0)
        return -1;
    call->parsed = 2;
    if (call->dst.count != call->src.count) {
        PyErr_Format(PyExc_ValueError, "dst_ptrs: has %zd addresses but src_ptrs has %zd", call->dst.count,
                     call->src.count);
        return -1;
    }
    if (kv_address_list_read(&reader, sizes, "sizes", KV_LIST_SIZES, allow_device, &call->sizes) < 0)
        return -1;
    call->parsed = 3;
    if (!call->sizes.one_value && call->sizes.count != call->src.count) {
        PyErr_Format(PyExc_ValueError, "sizes: has %zd sizes but src_ptrs has %zd addresses", call->sizes.count,
                     call->src.count);
        return -1;
    }
    return 0;
}

static kv_pairs pairs_of(const kv_copy_call *call)
{
    kv_pairs pairs;
    memset(&pairs, 0, sizeof pairs);
    pairs.count = call->src.count;
    pairs.src = call->src.values;
    pairs.dst = call->dst.values;
    pairs.sizes = call->sizes.one_value ? NULL : call->sizes.values;
    pairs.uniform_size = call->sizes.value;
    pairs.src_on_device = call->src.on_device;
    pairs.dst_on_device = call->dst.on_device;
    pairs.sizes_on_device = call->sizes.on_device;
    return pairs;
}

/* Where the call runs: on the device of the device memory the addresses
 * point into, which must be that of any device-resident list, else on the
 * current device; after the device lists' producers. */
static int resolve_target(kv_copy_call *call, int found, kv_target *target)
{
    kv_address_list *lists[3] = {&call->src, &call->dst, &call->sizes};
    const char *names[3] = {LIST_NAMES[0], LIST_NAMES[1], "sizes"};
    kv_target_init(target, call->stream, found, "the copies are");
    for (int i = 0; i < call->parsed; i++) {
        if (!lists[i]->on_device)
            continue;
        kv_array *list = &lists[i]->array;
        const kv_path path = {names[i], {0, 0}, 0};
        if ((target->gpu.device < 0 && kv_target_fix_device(target, list, &path) < 0)
            || kv_target_add(target, list, &path) < 0)
            return -1;
    }
    if (target->gpu.device < 0)
        target->gpu.device = kv_gpu_current_device();
    return target->gpu.device < 0 ? -1 : 0;
}

/* A destination range sharing memory with a source range or another
 * destination range is refused.  Lists on the device are not read on the
 * host, so a call with one is not checked. */
static int check_pair_aliasing(const kv_pairs *pairs)
{
    if (pairs->src_on_device || pairs->dst_on_device || pairs->sizes_on_device)
        return 0;
    const Py_ssize_t count = (Py_ssize_t)pairs->count;
    kv_span *spans = PyMem_Malloc((size_t)count * 2 * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint64_t size = pairs->sizes != NULL ? pairs->sizes[i] : pairs->uniform_size;
        const uint64_t *ends[2] = {pairs->src, pairs->dst};
        for (int side = 0; side < 2; side++) {
            const uint64_t start = ends[side][i];
            if (size > UINT64_MAX - start) {
                PyMem_Free(spans);
                PyErr_Format(PyExc_ValueError, "%s[%zd]: %llu bytes from 0x%llx run past the end of the address space",
                             LIST_NAMES[side], i, (unsigned long long)size, (unsigned long long)start);
                return -1;
            }
            spans[side * count + i] = (kv_span){start, start + size, side * count + i, side};
        }
    }
    Py_ssize_t first, second;
    const int rc = kv_find_overlap(spans, 2 * count, &first, &second);
    PyMem_Free(spans);
    if (rc > 0)
        PyErr_Format(PyExc_ValueError,
                     "%s[%zd]: the destination range shares memory with %s[%zd]; a destination may "
                     "not overlap a source or another destination",
                     LIST_NAMES[1], first - count, LIST_NAMES[second >= count], second % count);
    return rc > 0 ? -1 : rc;
}

/* Both Python functions: read and check the lists, then copy with `engine`.
 * The kernel takes device-resident lists but no pageable memory; the copy
 * engines take pageable memory but only lists they can read on the host. */
static int copy_pairs(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream,
                      kv_engine engine, int fallback, const char *function, const char *reason)
{
    const int kernel = engine == KV_ENGINE_KERNEL;
    kv_copy_call call;
    kv_target target;
    kv_target_init(&target, 0, -1, NULL);
    int rc = -1, device;
    if (read_call(state, src, dst, sizes, stream, kernel, &call) < 0)
        goto done;
    kv_pairs pairs = pairs_of(&call);
    if (pairs.count == 0) {
        rc = 0;
        goto done;
    }
    if (kernel && pairs.count > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "src_ptrs: %lld copies in one call, more than the copy kernel's 2**31 - 1; "
                     "split them into several calls",
                     (long long)pairs.count);
        goto done;
    }
    if (check_pair_aliasing(&pairs) < 0 || kv_require_device(function, "it copies with CUDA, host memory included") < 0)
        goto done;
    if (kv_gpu_check_pairs(&pairs, LIST_NAMES, !kernel, &device) < 0 || resolve_target(&call, device, &target) < 0)
        goto done;
    rc = kv_route_pairs(state->gpu, &target.gpu, &pairs, engine, fallback, function, reason);
done:
    kv_target_release(&target);
    release_call(&call);
    return rc;
}

int kv_vectorized_copy(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream)
{
    return copy_pairs(state, src, dst, sizes, stream, KV_ENGINE_KERNEL, 0, "vectorized_copy", "copy kernel");
}

int kv_memcpy_batch(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *mode, PyObject *stream)
{
    int m;
    if (kv_parse_name(mode, "mode", MODE_NAMES, 3, KV_COPY_ARGS_MODE_DEFAULT, &m) < 0)
        return -1;
    if (m == MODE_FALLBACK_ONLY)
        return copy_pairs(state, src, dst, sizes, stream, KV_ENGINE_ASYNC, 0, "memcpy_batch", "mode fallback_only");
    return copy_pairs(state, src, dst, sizes, stream, KV_ENGINE_BATCH, m == MODE_BATCHED_WITH_FALLBACK, "memcpy_batch",
                      "cudaMemcpyBatchAsync");
}
