/* Blocks of one paged cache into another (PagedKVCache.to_cache): one kind
 * of layout move (gpu.h, kv_move_kind), defined in move_to_cache.c,
 * described by paged/to_cache_run.c.  It runs as every layout move does
 * (plan/route.c): one kernel for a move whose caches are both
 * device-addressable, or a staged move between a device cache and a cache
 * in pinned host memory, whose pinned cache packs into units as the
 * kv_packing below says. */
#ifndef KVBM_MOVE_TO_CACHE_H
#define KVBM_MOVE_TO_CACHE_H

#include "gpu.h"
#include "kvbm_to_cache.h"

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

/* The call, beside its table (kvbm_to_cache.h). */
typedef struct {
    const kvbm_to_cache *move;
    const kvbm_to_cache_ids *ids;
    const kv_packing *packing; /* staged: how the pinned cache packs into units */
} kv_to_cache_move;

extern const kv_move_kind kv_move_to_cache;

#endif /* KVBM_MOVE_TO_CACHE_H */
