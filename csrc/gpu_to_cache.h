/* The GPU side of PagedKVCache.to_cache: one kernel for a move whose
 * caches are both device-addressable, or a staged move between a device
 * cache and a cache in pinned host memory (gpu_to_cache.c; gpu_stub.c
 * without nvcc). */
#ifndef KVBM_GPU_TO_CACHE_H
#define KVBM_GPU_TO_CACHE_H

#include "gpu.h"
#include "kvbm_to_cache.h"

/* The dimensions a move runs over, in kvbm_to_cache's order. */
enum { KV_MOVED_LAYER, KV_MOVED_OUTER, KV_MOVED_HEAD, KV_MOVED_TOKEN, KV_MOVED_DIMS };

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

/* Moves the blocks as `move` says, `table` in host memory: the kernel
 * alone (`staged` NULL) on at most max_ctas CTAs (0: no bound), else staged
 * as `staged` and `packing` describe the pinned cache (max_ctas then as
 * kv_gpu_paged takes it).  0, or -1 with RuntimeError. */
int kv_gpu_to_cache(kv_gpu *gpu, const kv_gpu_target *target, const kvbm_to_cache *move,
                    const kvbm_to_cache_ids *ids, const uint64_t *table, int vector_bytes, uint32_t max_ctas,
                    const kv_staged *staged, const kv_packing *packing, kv_gpu_report *report);

#endif /* KVBM_GPU_TO_CACHE_H */
