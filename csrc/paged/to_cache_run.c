/* PagedKVCache.to_cache: planning and running a checked call, on the GPU
 * (one kernel, or staged through device memory where a cache is in pinned
 * host memory) or the CPU.  See to_cache_run.h. */
#include "to_cache_run.h"

#include <stdlib.h>
#include <string.h>

#include "move_to_cache.h"
#include "route.h"
#include "state.h"

/* The move: moved head j of src lands on head head_offset + j of dst,
 * moved layer i (src layer layers.first + i * layers.step) on the dst layer
 * kv_paged_landing gives; the bases in the table carry the layers. */
static kvbm_to_cache plan(const kv_to_cache_call *call)
{
    const kv_paged_cache *src = call->src, *dst = call->dst;
    const kv_paged_options *o = &call->options;
    kvbm_to_cache m;
    memset(&m, 0, sizeof m);
    kvbm_paged *p = &m.p;
    p->nb = call->src_ids.count;
    p->nl = o->layers.count;
    p->no = src->no, p->nh = o->heads.count, p->nt = src->nt;
    p->row_bytes = src->hd * src->itemsize;
    p->num_blocks = src->num_blocks;
    p->split_outer = 1;
    p->cache_block = src->stride[DIM_B];
    p->cache_shift = o->heads.first * src->stride[DIM_H];
    p->cache_head = src->stride[DIM_H] * o->heads.step;
    p->cache_token = src->stride[DIM_T];
    p->flat_shift = o->head_offset * dst->stride[DIM_H];
    p->flat_head = dst->stride[DIM_H];
    p->flat_token = dst->stride[DIM_T];
    p->to_flat = 1;
    kvbm_paged_plan(p);
    m.dst_block = dst->stride[DIM_B];
    m.dst_num_blocks = dst->num_blocks;
    return m;
}

/* The (layer, outer) bases of `cache` for `layers`, its layers moved:
 * where its arrays were located for the device (`located`, not NULL), each
 * base moves with its array. */
static void fill_bases(const kv_paged_cache *cache, const kv_selection *layers, const kv_array *located, uint64_t *out)
{
    kv_paged_outer_bases(cache, layers->first, layers->step, layers->count, out);
    for (int64_t i = 0; located != NULL && i < layers->count; i++)
        for (int64_t o = 0; o < cache->no; o++) {
            const Py_ssize_t a = kv_paged_array_of(cache, layers->first + i * layers->step, o);
            out[i * cache->no + o] += (uint64_t)(uintptr_t)located[a].data - (uint64_t)(uintptr_t)cache->arrays[a].data;
        }
}

/* The OR of every address and stride the moves touch, for the vector width. */
static uint64_t alignment_of(const kvbm_to_cache *m, const uint64_t *table)
{
    const kvbm_paged *p = &m->p;
    uint64_t bits = (uint64_t)(p->row_bytes | p->cache_block | p->cache_head | p->cache_token | p->cache_shift
                               | m->dst_block | p->flat_head | p->flat_token | p->flat_shift);
    for (int64_t i = 0; i < 2 * kvbm_to_cache_bases(m); i++)
        bits |= table[i];
    return bits;
}

/* ------------------------------------------------------------ staging */

/* The moved dimensions of the pinned cache: counts and byte strides
 * (layer and outer strides only where one array holds them). */
static void pinned_dims(const kv_to_cache_call *call, const kvbm_to_cache *m, const uint64_t *bases,
                        int64_t count[KV_MOVED_DIMS], int64_t stride[KV_MOVED_DIMS])
{
    const kvbm_paged *p = &m->p;
    const int to_dst = call->dst->device < 0;
    count[KV_MOVED_LAYER] = p->nl, count[KV_MOVED_OUTER] = p->no;
    count[KV_MOVED_HEAD] = p->nh, count[KV_MOVED_TOKEN] = p->nt;
    stride[KV_MOVED_LAYER] = p->nl > 1 ? (int64_t)(bases[p->no] - bases[0]) : 0;
    stride[KV_MOVED_OUTER] = p->no > 1 ? (int64_t)(bases[1] - bases[0]) : 0;
    stride[KV_MOVED_HEAD] = to_dst ? p->flat_head : p->cache_head;
    stride[KV_MOVED_TOKEN] = to_dst ? p->flat_token : p->cache_token;
}

/* Merges into the unit, from one row up, every dimension from `first` on
 * whose stride is the unit's size so far (and those of one entry), while
 * the unit stays within max_bytes; returns the unit's bytes and the count
 * of dimensions left out. */
static int64_t merge_unit(kv_packing *k, int first, const int64_t count[KV_MOVED_DIMS],
                          const int64_t stride[KV_MOVED_DIMS], int64_t row_bytes, int64_t max_bytes,
                          int assigned[KV_MOVED_DIMS], int *left)
{
    int64_t unit = row_bytes;
    for (int d = 0; d < KV_MOVED_DIMS; d++)
        assigned[d] = count[d] == 1;
    for (int grew = 1; grew;) {
        grew = 0;
        for (int d = first; d < KV_MOVED_DIMS; d++)
            if (!assigned[d] && stride[d] == unit && unit * count[d] <= max_bytes) {
                k->role[d] = KV_IN_UNIT;
                k->unit_stride[d] = stride[d];
                unit *= count[d];
                assigned[d] = grew = 1;
            }
    }
    *left = 0;
    for (int d = 0; d < KV_MOVED_DIMS; d++)
        *left += !assigned[d];
    return unit;
}

/* One array: what is left after the unit, two dimensions at most, becomes
 * the mid (the larger stride) and the inner index of the units. */
static const char *pack_table(const int64_t count[KV_MOVED_DIMS], const int64_t stride[KV_MOVED_DIMS],
                              const int assigned[KV_MOVED_DIMS], kv_packing *k, kv_staged *s)
{
    int left[KV_MOVED_DIMS], n = 0;
    for (int d = 0; d < KV_MOVED_DIMS; d++)
        if (!assigned[d])
            left[n++] = d;
    if (n > 2)
        return "the pinned cache's part of a block is more than two levels of contiguous runs";
    if (n == 2 && llabs(stride[left[0]]) < llabs(stride[left[1]])) {
        const int swap = left[0];
        left[0] = left[1], left[1] = swap;
    }
    s->mid = n == 2 ? count[left[0]] : 1;
    s->mid_stride = n == 2 ? stride[left[0]] : 0;
    s->inner = n >= 1 ? count[left[n - 1]] : 1;
    s->inner_stride = n >= 1 ? stride[left[n - 1]] : 0;
    if (n == 2)
        k->role[left[0]] = KV_AS_MID;
    if (n >= 1)
        k->role[left[n - 1]] = KV_AS_INNER;
    s->one_allocation = 1;
    return NULL;
}

/* Describes the pinned cache's part of each block for the staged path
 * (gpu.h, kv_staged; move_to_cache.h, kv_packing; both zeroed by the
 * callers): units of contiguous rows,
 * addressed from `addresses` (nb entries for one array, else one per (block,
 * layer, outer)).  Returns NULL, or why it cannot be staged. */
typedef struct {
    kv_to_cache_call *call;
    const kvbm_to_cache *m;
    const uint64_t *table;
    kv_packing *packing; /* filled by plan_staging, read by the staged pieces */
} kv_to_cache_run_call;

static const char *plan_staging(const void *context, uint64_t *addresses, kv_staged *s)
{
    const kv_to_cache_run_call *c = context;
    const kv_to_cache_call *call = c->call;
    const kvbm_to_cache *m = c->m;
    const uint64_t *table = c->table;
    kv_packing *k = c->packing;
    const int to_dst = call->dst->device < 0;
    const kv_paged_cache *pinned = to_dst ? call->dst : call->src;
    const kv_address_list *ids = to_dst ? &call->dst_ids : &call->src_ids;
    const kvbm_paged *p = &m->p;
    const uint64_t *bases = table + (to_dst ? kvbm_to_cache_bases(m) : 0);
    if (ids->on_device)
        return "the pinned cache's block ids are on the device, and the copy engines need its addresses on the host";
    int64_t count[KV_MOVED_DIMS], stride[KV_MOVED_DIMS];
    int assigned[KV_MOVED_DIMS];
    pinned_dims(call, m, bases, count, stride);
    k->pinned_is_dst = s->to_host = to_dst;
    s->nb = p->nb;
    /* One array: any of the four dimensions may be in the unit.  Arrays
     * apart (per layer, or K and V per layer): a block's rows of one layer
     * (and K or V, where they are apart) are a unit at an address of its
     * own. */
    const int apart = pinned->narrays > 1;
    const int first = !apart ? KV_MOVED_LAYER : pinned->kv_pairs ? KV_MOVED_HEAD : KV_MOVED_OUTER;
    int left;
    /* One array: units no larger than the lead piece where the rest still
     * packs (a universal block is then cut by heads, as elsewhere), so
     * that the pieces at a call's ends can be short. */
    s->unit_bytes =
        merge_unit(k, first, count, stride, p->row_bytes, apart ? INT64_MAX : KV_LEAD_BYTES, assigned, &left);
    if (!apart && left > 2)
        s->unit_bytes = merge_unit(k, first, count, stride, p->row_bytes, INT64_MAX, assigned, &left);
    const int64_t shift = to_dst ? p->flat_shift : p->cache_shift, block = to_dst ? m->dst_block : p->cache_block;
    if (!apart) {
        s->block_address = addresses;
        for (int64_t b = 0; b < p->nb; b++)
            addresses[b] = bases[0] + (uint64_t)(shift + (int64_t)ids->values[b] * block);
        return pack_table(count, stride, assigned, k, s);
    }
    if (!assigned[KV_MOVED_HEAD] || !assigned[KV_MOVED_TOKEN])
        return "the pinned cache's rows of one block and layer are not one contiguous run";
    k->fused_outer = !assigned[KV_MOVED_OUTER];
    k->role[KV_MOVED_LAYER] = KV_AS_INNER;
    s->mid = 1;
    s->inner = k->fused_outer ? p->nl * p->no : p->nl;
    s->unit_address = addresses;
    const int64_t step = k->fused_outer ? 1 : p->no; /* bases per inner index */
    for (int64_t b = 0; b < p->nb; b++)
        for (int64_t i = 0; i < s->inner; i++)
            addresses[b * s->inner + i] = bases[i * step] + (uint64_t)(shift + (int64_t)ids->values[b] * block);
    return NULL;
}

/* ------------------------------------------------------------ running */

/* The current stream of the call's arrays' framework, for stream=None:
 * the ids', else the caches'. */
static int resolve_stream(const void *context)
{
    kv_to_cache_call *call = ((const kv_to_cache_run_call *)context)->call;
    const kv_array_group groups[] = {{&call->src_ids.array, call->src_ids.on_device ? 1 : 0},
                                     {&call->dst_ids.array, call->dst_ids.on_device ? 1 : 0},
                                     {call->src->arrays, 1},
                                     {call->dst->arrays, 1}};
    return kv_target_resolve_stream(&call->target, groups, 4);
}

/* Moves the bytes: the table holds both caches' (layer, outer) bases, then
 * the host ids (move_to_cache.h). */
int kv_to_cache_run(kv_to_cache_call *call)
{
    const kvbm_to_cache m = plan(call);
    const kvbm_to_cache_ids ids = {call->src_ids.on_device ? call->src_ids.values : NULL,
                                   call->dst_ids.on_device ? call->dst_ids.values : NULL, call->src_ids.int32,
                                   call->dst_ids.int32};
    const int64_t bases = kvbm_to_cache_bases(&m);
    uint64_t *table = PyMem_Malloc((size_t)kvbm_to_cache_table_entries(&m, &ids) * sizeof(uint64_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const kv_selection landing = kv_paged_landing(&call->options);
    fill_bases(call->src, &call->options.layers, call->src->device < 0 ? call->located : NULL, table);
    fill_bases(call->dst, &landing, call->dst->device < 0 ? call->located : NULL, table + bases);
    if (ids.src_ids == NULL)
        memcpy(table + kvbm_to_cache_src_ids_at(&m), call->src_ids.values, (size_t)m.p.nb * sizeof(uint64_t));
    if (ids.dst_ids == NULL)
        memcpy(table + kvbm_to_cache_dst_ids_at(&m, &ids), call->dst_ids.values, (size_t)m.p.nb * sizeof(uint64_t));
    kv_packing packing;
    memset(&packing, 0, sizeof packing);
    const kv_to_cache_move args = {&m, &ids, &packing};
    const kv_move move = {&kv_move_to_cache, &args, table, kvbm_to_cache_table_entries(&m, &ids),
                          kvbm_vector_bytes(alignment_of(&m, table))};
    const kv_to_cache_run_call context = {call, &m, table, &packing};
    const kv_move_call hooks = {.call = &context,
                                .resolve_stream = resolve_stream,
                                .addresses = m.p.nb * (call->located != NULL ? bases : 1),
                                .plan_staging = plan_staging};
    const int rc = kv_run_move(call->state->gpu, call->device >= 0 ? &call->target : NULL, &move, &hooks,
                               &call->options.move, "PagedKVCache.to_cache");
    PyMem_Free(table);
    return rc;
}
