/* kvbm_ext.PagedKVCache: planning and running a checked call, on the GPU
 * (the kernel alone, or staged through device memory) or the CPU.  See
 * paged_internal.h. */
#include "paged_internal.h"

#include <string.h>

#include "route.h"
#include "state.h"

/* The kernel's description of the call. */
static kvbm_paged plan(const kv_paged_call *call)
{
    const kv_paged_cache *c = call->cache;
    const kv_paged_options *o = &call->options;
    kvbm_paged p;
    memset(&p, 0, sizeof p);
    p.nb = call->ids.count;
    p.nl = o->layers.count;
    p.no = c->no, p.nh = o->heads.count, p.nt = c->nt;
    p.row_bytes = c->hd * c->itemsize;
    p.num_blocks = c->num_blocks;
    p.cache_outer = c->stride[DIM_K];
    p.split_outer = c->kv_pairs;
    p.cache_block = c->stride[DIM_B];
    /* The kernel counts moved heads: fold the first head and the step in. */
    p.cache_shift = o->heads.first * c->stride[DIM_H];
    p.cache_head = c->stride[DIM_H] * o->heads.step;
    p.cache_token = c->stride[DIM_T];
    const int64_t rb = p.row_bytes;
    if (call->form->universal) {
        /* [NH, NL, no, nt, hd] */
        p.flat_token = rb;
        p.flat_outer = p.nt * rb;
        p.flat_layer = p.no * p.flat_outer;
        p.flat_head = call->flat_shape[1] * p.flat_layer;
        p.flat_shift = o->head_offset * p.flat_head;
    }
    else {
        /* [nl, no, nt*nh*hd], each chunk in the order `layout` names */
        p.flat_outer = p.nt * p.nh * rb;
        p.flat_layer = p.no * p.flat_outer;
        p.flat_token = o->layout == KVBM_NHD ? p.nh * rb : rb;
        p.flat_head = o->layout == KVBM_NHD ? rb : p.nt * rb;
    }
    /* The kernel counts moved layers: fold the first layer they land on and the step in. */
    const kv_selection landing = kv_paged_landing(o);
    p.flat_shift += landing.first * p.flat_layer;
    p.flat_layer *= landing.step;
    p.to_flat = call->form->to_flat;
    kvbm_paged_plan(&p);
    return p;
}

/* Describes the flat blocks for the staged path (gpu.h) when they are all in
 * pinned memory, their addresses in `addresses` (nb entries): universals
 * are [heads][moved layers] of units (no, nt, hd), operationals [1][moved
 * layers] of units (no, nt*nh*hd).  Returns NULL, or why they cannot be
 * staged. */
typedef struct {
    kv_paged_call *call;
    const kvbm_paged *p;
    const kvbm_paged_addresses *a;
} kv_paged_run_call;

static const char *plan_staging(const void *context, uint64_t *addresses, kv_staged *staged)
{
    const kv_paged_run_call *c = context;
    const kv_paged_call *call = c->call;
    const kvbm_paged *p = c->p;
    const kvbm_paged_addresses *a = c->a;
    for (Py_ssize_t i = 0; i < call->nflats; i++)
        if (call->flats[i].place != KV_HOST_PINNED)
            return "the flat blocks are partly on the device, partly in pinned host memory";
    memset(staged, 0, sizeof *staged);
    staged->nb = p->nb;
    staged->inner = p->nl;
    staged->inner_stride = p->flat_layer;
    staged->block_address = addresses;
    staged->to_host = p->to_flat;
    staged->flat_side = 1;
    staged->one_allocation = call->single;
    if (call->form->universal) {
        staged->mid = p->nh;
        staged->mid_stride = p->flat_head;
        staged->unit_bytes = p->no * p->nt * p->row_bytes;
    }
    else {
        staged->mid = 1;
        staged->unit_bytes = p->no * p->nt * p->nh * p->row_bytes;
    }
    for (int64_t b = 0; b < p->nb; b++)
        addresses[b] =
            (a->flat_base ? a->flat_base + (uint64_t)(b * a->flat_block) : (uint64_t)(uintptr_t)call->flats[b].data)
            + (uint64_t)p->flat_shift;
    return NULL;
}

/* The current stream of the call's arrays' framework, for stream=None,
 * else of the cache's (read at construction, asked now). */
static int resolve_stream(const void *context)
{
    kv_paged_call *call = ((const kv_paged_run_call *)context)->call;
    const kv_array_group groups[] = {
        {call->flats, call->nflats}, {&call->ids.array, call->ids.on_device ? 1 : 0}, {call->cache->arrays, 1}};
    return kv_target_resolve_stream(&call->target, groups, 3);
}

/* Moves the bytes: the table holds the base address of every moved layer,
 * the host ids, then the flat blocks' addresses unless they are one array
 * (kvbm_paged.h). */
int kv_paged_run(kv_paged_call *call)
{
    kv_paged_cache *cache = call->cache;
    const Py_ssize_t nb = call->ids.count;
    kvbm_paged p = plan(call);
    kvbm_paged_addresses addresses;
    memset(&addresses, 0, sizeof addresses);
    addresses.ids = call->ids.on_device ? call->ids.values : NULL;
    addresses.ids_int32 = call->ids.int32;
    uint64_t alignment = cache->alignment | (uint64_t)p.row_bytes;
    if (call->single) {
        addresses.flat_base = (uint64_t)(uintptr_t)call->flats[0].data;
        addresses.flat_block = call->flats[0].strides[0];
        alignment |= addresses.flat_base | (uint64_t)addresses.flat_block;
    }
    const int64_t bases = kvbm_paged_bases(&p);
    const int64_t entries = kvbm_paged_table_entries(&addresses, bases, nb);
    uint64_t *table = PyMem_Malloc((size_t)entries * sizeof(uint64_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const kv_selection *layers = &call->options.layers;
    if (p.split_outer)
        kv_paged_outer_bases(cache, layers->first, layers->step, p.nl, table);
    for (int64_t i = 0; !p.split_outer && i < p.nl; i++)
        table[i] = cache->layer_addresses[layers->first + i * layers->step];
    uint64_t *slot = table + bases;
    if (!call->ids.on_device) {
        memcpy(slot, call->ids.values, (size_t)nb * sizeof(uint64_t));
        slot += nb;
    }
    for (Py_ssize_t b = 0; !call->single && b < nb; b++) {
        slot[b] = (uint64_t)(uintptr_t)call->flats[b].data;
        alignment |= slot[b];
    }
    const kv_paged_move args = {&p, &addresses};
    const kv_move move = {&kv_move_paged, &args, table, entries, kvbm_vector_bytes(alignment)};
    const kv_paged_run_call context = {call, &p, &addresses};
    const kv_move_call hooks = {
        .call = &context, .resolve_stream = resolve_stream, .addresses = p.nb, .plan_staging = plan_staging};
    const int rc = kv_run_move(call->state->gpu, cache->device >= 0 ? &call->target : NULL, &move, &hooks,
                               &call->options.move, call->form->name);
    PyMem_Free(table);
    return rc;
}
