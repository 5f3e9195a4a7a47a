/* Blocks of one paged cache into another: the kind's descriptor (gpu.h,
 * kv_move_kind), its kernel side (cuda/to_cache.cu over the whole call,
 * cuda/paged.cu over one staged piece, built with nvcc only) and its CPU
 * twin.  See move_to_cache.h.
 *
 * A staged piece is the paged kernel (kvbm_launch_paged) run between the
 * device cache and the piece's slot: the device cache is its cache side,
 * and the slot, which holds the piece's units of the pinned cache packed
 * ([bn][mn][in][unit], pieces.h), its flat side, with the strides the
 * packing gives each moved dimension. */
#include "move_to_cache.h"

#include <string.h>

#include "gpu.h"

#ifdef KVBM_CUDA_VERSION
#include <stdio.h>

#include "kvbm_kernels.h"
#include "move_paged.h"
#include "pieces.h"

static int to_cache_launch(const kv_move *move, const void *host_table, const void *device_table, uint32_t num_ctas,
                           void *stream)
{
    const kv_to_cache_move *a = move->args;
    return kvbm_launch_to_cache(a->move, a->ids, host_table, device_table, move->vector_bytes, num_ctas,
                                (cudaStream_t)stream);
}

static int64_t to_cache_piece_blocks(const kv_move *move, char *why, size_t why_size)
{
    /* A piece's bases, and its host ids, travel by value. */
    const kv_to_cache_move *a = move->args;
    const kvbm_to_cache_ids *ids = a->ids;
    const int64_t bases = kvbm_to_cache_bases(a->move);
    if (bases >= KVBM_TABLE_BY_VALUE_MAX) {
        snprintf(why, why_size, "a table of %lld (layer, K/V) bases does not fit in a launch's parameters",
                 (long long)bases);
        return 0;
    }
    const int device_ids = a->packing->pinned_is_dst ? ids->src_ids != NULL : ids->dst_ids != NULL;
    return device_ids ? INT64_MAX : KVBM_TABLE_BY_VALUE_MAX - bases;
}

/* The device cache of a staged move: its strides, bases and ids. */
typedef struct {
    int64_t block, head, token, shift, num_blocks;
    const uint64_t *bases;    /* entry i * no + o */
    const uint64_t *host_ids; /* NULL when the ids are on the device */
    const char *device_ids;
    int ids_int32;
} kv_device_side;

static kv_device_side device_side(const kv_move *move)
{
    const kv_to_cache_move *a = move->args;
    const kvbm_to_cache *m = a->move;
    const kvbm_to_cache_ids *ids = a->ids;
    const uint64_t *table = move->table;
    const kvbm_paged *p = &m->p;
    kv_device_side s;
    if (a->packing->pinned_is_dst) {
        const kv_device_side src = {p->cache_block,
                                    p->cache_head,
                                    p->cache_token,
                                    p->cache_shift,
                                    p->num_blocks,
                                    table,
                                    table + kvbm_to_cache_src_ids_at(m),
                                    ids->src_ids,
                                    ids->src_int32};
        s = src;
    }
    else {
        const kv_device_side dst = {m->dst_block,
                                    p->flat_head,
                                    p->flat_token,
                                    p->flat_shift,
                                    m->dst_num_blocks,
                                    table + kvbm_to_cache_bases(m),
                                    table + kvbm_to_cache_dst_ids_at(m, ids),
                                    ids->dst_ids,
                                    ids->dst_int32};
        s = dst;
    }
    if (s.device_ids != NULL)
        s.host_ids = NULL;
    return s;
}

/* One piece: blocks [b0, b0 + bn) and, of the dimensions the packing makes
 * mid and inner, the box's ranges, between the device cache and `slot`.
 * Its table, by value: the piece's (layer, outer) bases of the device
 * cache, then its host ids. */
static int to_cache_launch_piece(const kv_move *move, const kv_staged *staged, const kv_box *box, char *slot,
                                 uint32_t num_ctas, void *stream)
{
    const kv_to_cache_move *a = move->args;
    const kv_packing *k = a->packing;
    const kvbm_paged *whole = &a->move->p;
    const kv_device_side dev = device_side(move);
    const int64_t unit = staged->unit_bytes;
    /* Fused, the (layer, outer) pairs are the layers of the piece. */
    int64_t count[KV_MOVED_DIMS] = {k->fused_outer ? whole->nl * whole->no : whole->nl, k->fused_outer ? 1 : whole->no,
                                    whole->nh, whole->nt};
    int64_t start[KV_MOVED_DIMS] = {0, 0, 0, 0}, slot_stride[KV_MOVED_DIMS];
    const int64_t outers = count[KV_MOVED_OUTER];
    for (int d = 0; d < KV_MOVED_DIMS; d++) {
        slot_stride[d] = k->unit_stride[d];
        if (k->role[d] == KV_AS_MID)
            start[d] = box->m0, count[d] = box->mn, slot_stride[d] = box->in * unit;
        else if (k->role[d] == KV_AS_INNER)
            start[d] = box->i0, count[d] = box->in, slot_stride[d] = unit;
    }
    kvbm_paged p;
    memset(&p, 0, sizeof p);
    p.nb = box->bn;
    p.nl = count[KV_MOVED_LAYER], p.no = count[KV_MOVED_OUTER];
    p.nh = count[KV_MOVED_HEAD], p.nt = count[KV_MOVED_TOKEN];
    p.row_bytes = whole->row_bytes;
    p.num_blocks = dev.num_blocks;
    p.split_outer = 1;
    p.cache_block = dev.block, p.cache_head = dev.head, p.cache_token = dev.token;
    p.cache_shift = dev.shift + start[KV_MOVED_HEAD] * dev.head + start[KV_MOVED_TOKEN] * dev.token;
    p.flat_layer = slot_stride[KV_MOVED_LAYER], p.flat_outer = slot_stride[KV_MOVED_OUTER];
    p.flat_head = slot_stride[KV_MOVED_HEAD], p.flat_token = slot_stride[KV_MOVED_TOKEN];
    p.to_flat = k->pinned_is_dst;
    kvbm_paged_plan(&p);
    uint64_t table[KVBM_TABLE_BY_VALUE_MAX];
    int64_t n = 0;
    for (int64_t i = 0; i < p.nl; i++)
        for (int64_t o = 0; o < p.no; o++)
            table[n++] = dev.bases[(start[KV_MOVED_LAYER] + i) * outers + start[KV_MOVED_OUTER] + o];
    kvbm_paged_addresses addresses = {NULL, dev.ids_int32, (uint64_t)(uintptr_t)slot, box->mn * box->in * unit};
    if (dev.device_ids != NULL)
        addresses.ids = dev.device_ids + box->b0 * (dev.ids_int32 ? 4 : 8);
    else
        memcpy(table + n, dev.host_ids + box->b0, (size_t)box->bn * sizeof *table);
    return kvbm_launch_paged(&p, &addresses, table, NULL, move->vector_bytes, num_ctas, (cudaStream_t)stream);
}
#endif /* KVBM_CUDA_VERSION */

/* The CPU twin: the same arguments as the kernel's, the ids in the table,
 * one memcpy per segment. */
static void to_cache_cpu(const kv_move *move)
{
    const kvbm_to_cache *m = ((const kv_to_cache_move *)move->args)->move;
    const uint64_t *table = move->table;
    const kvbm_paged *p = &m->p;
    const int64_t bases = kvbm_to_cache_bases(m);
    const uint64_t *src_ids = table + kvbm_to_cache_src_ids_at(m), *dst_ids = src_ids + p->nb;
    for (int64_t b = 0; b < p->nb; b++) {
        /* Each (layer, outer) has a base of its own: the outer strides are 0. */
        for (int64_t entry = 0; entry < bases; entry++) {
            const char *src = (const char *)(uintptr_t)table[entry] + kvbm_paged_cache_chunk(p, (int64_t)src_ids[b], 0);
            char *dst = (char *)(uintptr_t)table[bases + entry] + kvbm_to_cache_dst_chunk(m, (int64_t)dst_ids[b], 0);
            for (uint32_t s = 0; s < (uint32_t)p->segments; s++) {
                int64_t src_off, dst_off;
                kvbm_paged_segment(p, s, &src_off, &dst_off);
                memcpy(dst + dst_off, src + src_off, (size_t)p->segment_bytes);
            }
        }
    }
}

static int64_t to_cache_bytes(const kv_move *move)
{
    const kvbm_paged *p = &((const kv_to_cache_move *)move->args)->move->p;
    return p->nb * p->nl * p->no * p->nh * p->nt * p->row_bytes;
}

/* The description with its parts, for a deferred call (gpu.h, own_args). */
typedef struct {
    kv_to_cache_move args;
    kvbm_to_cache move;
    kvbm_to_cache_ids ids;
    kv_packing packing;
} kv_to_cache_owned;

static const void *to_cache_own_args(const void *args, void *storage)
{
    const kv_to_cache_move *a = args;
    kv_to_cache_owned *owned = storage;
    owned->move = *a->move;
    owned->ids = *a->ids;
    owned->packing = *a->packing;
    owned->args.move = &owned->move;
    owned->args.ids = &owned->ids;
    owned->args.packing = &owned->packing;
    return &owned->args;
}

const kv_move_kind kv_move_to_cache = {
    .what = "launching the cache-to-cache kernel",
    KV_MOVE_KERNEL(to_cache),
    .cpu = to_cache_cpu,
    .cpu_bytes = to_cache_bytes,
    .own_args = to_cache_own_args,
    .owned_bytes = sizeof(kv_to_cache_owned),
};
