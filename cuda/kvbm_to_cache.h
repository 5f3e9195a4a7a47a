/* Where a row goes when blocks move from one paged cache to another
 * (PagedKVCache.to_cache), shared by the CPU twin
 * (csrc/moves/move_to_cache.c) and the CUDA kernel (cuda/to_cache.cu).
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
#ifndef KVBM_TO_CACHE_H
#define KVBM_TO_CACHE_H

#include "kvbm_paged.h"

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

#endif /* KVBM_TO_CACHE_H */
