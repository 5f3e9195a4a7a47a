/* Running a conversion whose arguments are read and checked: placement,
 * aliasing, and the move (the layout kernel, the copy backends, or the
 * CPU).  See convert_run.h. */
#include "convert_run.h"

#include <string.h>

#include "cpu_copy.h"
#include "gil.h"
#include "move_block_universal.h"
#include "overlap.h"
#include "route.h"

kv_path kv_call_path(const kv_call *call, Py_ssize_t i)
{
    const kv_side *side = kv_call_side(call, i);
    if (side == NULL) {
        const kv_path path = {call->other.name, {(i - call->nb) / call->nchunks, (i - call->nb) % call->nchunks}, 2};
        return path;
    }
    /* A block of one array is named by the array. */
    const kv_path path = {side->name, {i < call->nb ? i : i - call->nb, 0}, !side->has_whole};
    return path;
}

/* The aliasing check's view of a call (overlap.h): its arrays, the
 * written side's marked. */
static int call_writes(const void *call, Py_ssize_t i) { return kv_call_writes(call, i); }

static kv_path call_path(const void *call, Py_ssize_t i) { return kv_call_path(call, i); }

/* Places every array of a call that uses device memory: the first array on
 * a device fixes the device (the current one when every such array turns
 * out to be pinned host memory). */
static int place_on_gpu(kv_call *call, kv_target *target)
{
    const Py_ssize_t count = kv_call_count(call);
    for (Py_ssize_t i = 0; i < count && target->gpu.device < 0; i++) {
        if (call->arrays[i].place != KV_DEVICE)
            continue;
        const kv_path path = kv_call_path(call, i);
        if (kv_target_fix_device(target, &call->arrays[i], &path) < 0)
            return -1;
    }
    if (target->gpu.device < 0 && (target->gpu.device = kv_gpu_current_device()) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        const kv_path path = kv_call_path(call, i);
        if (kv_target_add(target, &call->arrays[i], &path) < 0)
            return -1;
    }
    const kv_array_group arrays = {call->arrays, count};
    return kv_target_resolve_stream(target, &arrays, 1);
}

/* Block <-> operational: every chunk is one copy of chunk_bytes.  `target`
 * NULL: on the CPU. */
static int run_block_operational(kv_gpu *gpu, const kv_call *call, const kv_target *target)
{
    const int64_t chunk_bytes = call->flat_shape[2] * call->arrays[0].itemsize;
    const Py_ssize_t count = call->nb * call->nchunks;
    kv_pairs pairs;
    memset(&pairs, 0, sizeof pairs);
    pairs.count = count;
    pairs.uniform_size = (uint64_t)chunk_bytes;
    pairs.src = PyMem_Malloc((size_t)count * sizeof(uint64_t));
    pairs.dst = PyMem_Malloc((size_t)count * sizeof(uint64_t));
    if (pairs.src == NULL || pairs.dst == NULL) {
        PyMem_Free(pairs.src);
        PyMem_Free(pairs.dst);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *chunks = call->to_flat ? pairs.src : pairs.dst;
    uint64_t *operational = call->to_flat ? pairs.dst : pairs.src;
    for (Py_ssize_t b = 0; b < call->nb; b++) {
        for (int64_t c = 0; c < call->nchunks; c++) {
            const Py_ssize_t k = b * call->nchunks + c;
            chunks[k] = (uint64_t)(uintptr_t)call->arrays[call->nb + k].data;
            operational[k] = (uint64_t)(uintptr_t)call->arrays[b].data + (uint64_t)(c * chunk_bytes);
        }
    }
    int rc = 0;
    if (target != NULL) {
        rc = kv_route_chunks(gpu, target, &pairs, &call->options, call->function);
    }
    else {
        PyThreadState *released = kv_release_gil_for(count * chunk_bytes);
        kv_cpu_copy_pairs(&pairs);
        kv_retake_gil(released);
    }
    PyMem_Free(pairs.src);
    PyMem_Free(pairs.dst);
    return rc;
}

/* Whether every array of the flat side (`flat`) or of the other side is in
 * pinned host memory. */
static int side_is(const kv_call *call, int flat, kv_place place)
{
    const Py_ssize_t first = flat ? 0 : call->nb, end = flat ? call->nb : kv_call_count(call);
    for (Py_ssize_t i = first; i < end; i++)
        if (call->arrays[i].place != place)
            return 0;
    return 1;
}

/* What the staged path's plan reads of a block stack (or operational) <->
 * universal move. */
typedef struct {
    const kv_call *call;
    const kvbm_block_dims *dims;
} kv_universal_call;

/* Describes the pinned side of a block stack (or operational) <-> universal
 * move for the staged path (gpu.h), its unit addresses in `addresses` (room
 * for every array of the call).  Returns NULL, or why it cannot be staged. */
static const char *plan_staging(const void *context, uint64_t *addresses, kv_staged *staged)
{
    const kv_call *call = ((const kv_universal_call *)context)->call;
    const kvbm_block_dims *dims = ((const kv_universal_call *)context)->dims;
    const int flat_pinned = side_is(call, 1, KV_HOST_PINNED), other_pinned = side_is(call, 0, KV_HOST_PINNED);
    if (!(flat_pinned && side_is(call, 0, KV_DEVICE)) && !(other_pinned && side_is(call, 1, KV_DEVICE)))
        return "pinned host memory and device memory are mixed on one side of the call";
    for (Py_ssize_t i = 0; i < kv_call_count(call); i++)
        addresses[i] = (uint64_t)(uintptr_t)call->arrays[i].data;
    memset(staged, 0, sizeof *staged);
    staged->nb = call->nb;
    staged->flat_side = flat_pinned;
    staged->to_host = flat_pinned == call->to_flat;
    const int64_t rb = dims->row_bytes, chunk_bytes = dims->nh * dims->nt * rb;
    if (flat_pinned) {
        /* Universals: [nh][nchunks] units of nt rows. */
        staged->mid = dims->nh;
        staged->inner = dims->nchunks;
        staged->unit_bytes = dims->nt * rb;
        staged->block_address = addresses;
        staged->mid_stride = dims->nchunks * dims->nt * rb;
        staged->inner_stride = dims->nt * rb;
        return NULL;
    }
    /* Chunks, each its own allocation, or operationals of nchunks chunks. */
    staged->mid = 1;
    staged->inner = dims->nchunks;
    staged->unit_bytes = chunk_bytes;
    if (call->other_is_blocks) {
        staged->unit_address = addresses + call->nb;
    }
    else {
        staged->block_address = addresses + call->nb;
        staged->inner_stride = chunk_bytes;
    }
    return NULL;
}

/* Block stack or operational <-> universal: the layout kernel, alone or
 * staged through device memory when pinned host memory takes part, or the
 * CPU (`target` NULL). */
static int run_universal(kv_gpu *gpu, const kv_call *call, const kv_target *target)
{
    const Py_ssize_t count = kv_call_count(call);
    const kv_array *u = &call->arrays[0];
    kvbm_block_dims dims;
    dims.nb = call->nb;
    dims.nchunks = call->nchunks;
    dims.nh = u->shape[0];
    dims.nt = u->shape[3];
    dims.row_bytes = u->shape[4] * u->itemsize;
    dims.layout = call->layout;
    dims.nh_divisor = kvbm_divisor_make((uint32_t)dims.nh);
    dims.chunk_stride = call->other_is_blocks ? 0 : dims.nh * dims.nt * dims.row_bytes;
    dims.universal_chunks = dims.nchunks;
    dims.chunk_heads = dims.nh;

    void **table = PyMem_Malloc((size_t)count * sizeof *table);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t bits = (uint64_t)dims.row_bytes;
    for (Py_ssize_t i = 0; i < count; i++) {
        table[i] = call->arrays[i].data;
        bits |= (uint64_t)(uintptr_t)table[i];
    }
    const kv_block_move args = {&dims, call->to_flat ? KVBM_TO_UNIVERSAL : KVBM_FROM_UNIVERSAL};
    const kv_move move = {&kv_move_block_universal, &args, table, kvbm_table_entries(&dims), kvbm_vector_bytes(bits)};
    const kv_universal_call context = {call, &dims};
    const kv_move_call hooks = {.call = &context, .addresses = count, .plan_staging = plan_staging};
    const int rc = kv_run_move(gpu, target, &move, &hooks, &call->options, call->function);
    PyMem_Free(table);
    return rc;
}

/* Tells the destinations' frameworks that they are about to be written
 * (kv_arrays_written): the destination side's one array, or its arrays. */
static int mark_written(kv_call *call)
{
    const kv_side *side = call->to_flat ? &call->flat : &call->other;
    if (side->has_whole)
        return kv_arrays_written(&call->state->protocols, &side->whole, 1);
    const Py_ssize_t first = call->to_flat ? 0 : call->nb, end = call->to_flat ? call->nb : kv_call_count(call);
    return kv_arrays_written(&call->state->protocols, call->arrays + first, end - first);
}

int kv_convert_run(kv_call *call)
{
    const Py_ssize_t count = kv_call_count(call);
    int on_gpu = 0;
    for (Py_ssize_t i = 0; i < count && !on_gpu; i++)
        on_gpu = call->arrays[i].place == KV_DEVICE;
    kv_target target;
    kv_target_init(&target, call->options.stream, -1, "the call runs");
    const kv_alias_check aliasing = {
        .call = call, .arrays = call->arrays, .count = count, .writes = call_writes, .path = call_path};
    int rc = -1;
    if ((on_gpu ? place_on_gpu(call, &target) : kv_move_options_check_host(&call->options)) < 0
        || kv_check_aliasing(&aliasing) < 0 || mark_written(call) < 0)
        goto done;
    kv_gpu *gpu = call->state->gpu;
    const kv_target *where = on_gpu ? &target : NULL;
    rc = call->conversion == KV_BLOCK_OPERATIONAL ? run_block_operational(gpu, call, where)
                                                  : run_universal(gpu, call, where);
done:
    kv_target_release(&target);
    return rc;
}
