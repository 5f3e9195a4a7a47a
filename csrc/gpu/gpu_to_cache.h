/* The GPU side of PagedKVCache.to_cache, a kv_move_to_cache move (gpu.h)
 * routed as every layout move is (route.c): one kernel for a move whose
 * caches are both device-addressable, or a staged move between a device
 * cache and a cache in pinned host memory, whose pieces gpu_to_cache.c
 * launches. */
#ifndef KVBM_GPU_TO_CACHE_H
#define KVBM_GPU_TO_CACHE_H

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
typedef struct kv_packing {
    kv_pack_role role[KV_MOVED_DIMS];
    int64_t unit_stride[KV_MOVED_DIMS]; /* bytes, of a dimension in the unit */
    int fused_outer;   /* the inner index runs over (layer, outer) pairs, each unit at an address of its own */
    int pinned_is_dst; /* the bytes move into the pinned cache */
} kv_packing;

#endif /* KVBM_GPU_TO_CACHE_H */
