/* Blocks of one paged cache into another (PagedKVCache.to_cache): one kind
 * of layout move (gpu.h, kv_move_kind), defined in move_to_cache.c,
 * described by paged/to_cache_run.c.  It runs as every layout move does
 * (plan/route.c): one kernel for a move whose caches are both
 * device-addressable, or a staged move between a device cache and a cache
 * in pinned host memory, whose pinned cache packs into units as the
 * kv_packing below says.  Its kernel is cuda/to_cache.cu.  This header is
 * the one both sides read: the C side, and nvcc for the kernel file, so it
 * needs neither Python nor gpu.h. */
#ifndef KVBM_MOVE_TO_CACHE_H
#define KVBM_MOVE_TO_CACHE_H

#include "kvbm_paged.h"

#ifdef KVBM_CUDA_VERSION
#include "kvbm_kernels.h"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Where a row goes, shared by the CPU twin and the kernel.
 *
 * Both sides are caches addressed by block id, each described as the cache
 * side of a kvbm_paged (kvbm_paged.h) with split_outer set: moved layer i,
 * outer o of a side starts at its base(i, o), and the row (i, o, id, h, t)
 * at
 *
 *     base(i, o) + shift + id*block + h*head + t*token
 *
 * The kvbm_paged `p` carries the source as its cache side and the
 * destination's head and token strides and shift as its flat side (flat
 * outer and layer strides 0), so that kvbm_paged_plan picks the runs
 * contiguous on both sides and kvbm_paged_segment gives their offsets, as
 * for the other moves.  Moved head h of the source lands on moved head h
 * of the destination, moved layer i on moved layer i: the callers fold
 * their selections and offsets into the bases and shifts. */
typedef struct {
    kvbm_paged p;           /* the source (cache side) and the destination's head, token, shift (flat side) */
    int64_t dst_block;      /* bytes between the destination's blocks */
    int64_t dst_num_blocks; /* destination ids outside [0, dst_num_blocks) are skipped, as source ids outside
                               [0, p.num_blocks) */
} kvbm_to_cache;

/* A call's table holds, in this order: the source's bases (nl*no, entry
 * i*no + o), the destination's, the nb source ids unless `src_ids` points at
 * them on the device, then the nb destination ids unless `dst_ids` does. */
typedef struct {
    const void *src_ids, *dst_ids; /* device-resident ids, int32 or int64, or NULL */
    int src_int32, dst_int32;
} kvbm_to_cache_ids;

KVBM_HOST_DEVICE int64_t kvbm_to_cache_bases(const kvbm_to_cache *m) { return m->p.nl * m->p.no; }

/* The table entry of the first source id and of the first destination id. */
KVBM_HOST_DEVICE int64_t kvbm_to_cache_src_ids_at(const kvbm_to_cache *m) { return 2 * kvbm_to_cache_bases(m); }

KVBM_HOST_DEVICE int64_t kvbm_to_cache_dst_ids_at(const kvbm_to_cache *m, const kvbm_to_cache_ids *ids)
{
    return kvbm_to_cache_src_ids_at(m) + (ids->src_ids ? 0 : m->p.nb);
}

KVBM_HOST_DEVICE int64_t kvbm_to_cache_table_entries(const kvbm_to_cache *m, const kvbm_to_cache_ids *ids)
{
    return kvbm_to_cache_dst_ids_at(m, ids) + (ids->dst_ids ? 0 : m->p.nb);
}

/* Where chunk (id, o) starts in the destination, from its base. */
KVBM_HOST_DEVICE int64_t kvbm_to_cache_dst_chunk(const kvbm_to_cache *m, int64_t id, int64_t o)
{
    return m->p.flat_shift + id * m->dst_block + o * m->p.flat_outer;
}

/* The dimensions a move runs over, in kvbm_to_cache's order. */
enum {
    KV_MOVED_LAYER,
    KV_MOVED_OUTER,
    KV_MOVED_HEAD,
    KV_MOVED_TOKEN,
    KV_MOVED_DIMS
};

/* Where a dimension sits in the staged units of the pinned cache. */
typedef enum {
    KV_IN_UNIT,  /* inside a unit, at unit_stride apart (or of one entry) */
    KV_AS_MID,   /* the units' mid index (kv_staged) */
    KV_AS_INNER, /* their inner index */
} kv_pack_role;

/* How the pinned cache's part of each block packs into units (gpu.h,
 * kv_staged), worked out by to_cache_run.c. */
typedef struct {
    kv_pack_role role[KV_MOVED_DIMS];
    int64_t unit_stride[KV_MOVED_DIMS]; /* bytes, of a dimension in the unit */
    int fused_outer;   /* the inner index runs over (layer, outer) pairs, each unit at an address of its own */
    int pinned_is_dst; /* the bytes move into the pinned cache */
} kv_packing;

/* The call, beside its table (kvbm_to_cache_ids above). */
typedef struct {
    const kvbm_to_cache *move;
    const kvbm_to_cache_ids *ids;
    const kv_packing *packing; /* staged: how the pinned cache packs into units */
} kv_to_cache_move;

extern const struct kv_move_kind kv_move_to_cache;

#ifdef KVBM_CUDA_VERSION
/* Moves move->p.nb blocks from one paged cache to another in one launch, as
 * above; move->p has been planned (kvbm_paged_plan).  The table
 * (kvbm_to_cache_table_entries values) is `device_table` in device memory
 * or, when that is NULL, read from `host_table` and passed by value (at
 * most KVBM_TABLE_BY_VALUE_MAX values).  Every address, stride and the
 * segment size must be a multiple of `vector_bytes`.  At most `num_ctas`
 * CTAs run (0: one per tile). */
cudaError_t kvbm_launch_to_cache(const kvbm_to_cache *move, const kvbm_to_cache_ids *ids, const uint64_t *host_table,
                                 const uint64_t *device_table, int vector_bytes, uint32_t num_ctas,
                                 cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* KVBM_MOVE_TO_CACHE_H */
