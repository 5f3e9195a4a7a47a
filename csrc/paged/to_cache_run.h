/* PagedKVCache.to_cache: blocks of one cache moved into blocks of another,
 * both addressed by id.  to_cache.c reads and checks a call (the method,
 * kv_paged_to_cache, is declared in paged_internal.h), to_cache_run.c
 * plans and runs it: the call they hand on, and the run. */
#ifndef KVBM_TO_CACHE_RUN_H
#define KVBM_TO_CACHE_RUN_H

#include "paged_internal.h"

/* Everything one call reads, released by to_cache.c. */
typedef struct {
    kv_paged_cache *src, *dst;
    kv_state *state;
    kv_paged_options options; /* src's layers and heads, and where they land in dst */
    int device;               /* the device the call runs on, or -1 on the CPU */
    kv_reader reader;         /* its dlpack_stream owned */
    kv_target target;
    kv_address_list src_ids, dst_ids;
    int src_ids_read, dst_ids_read;
    /* The arrays of the cache in pinned host memory of a GPU call, as
     * located for the device (copies of its kv_arrays, owning nothing), or
     * NULL. */
    kv_array *located;
} kv_to_cache_call;

/* to_cache_run.c: moves the bytes of a checked call.  Returns 0 or -1. */
int kv_to_cache_run(kv_to_cache_call *call);

#endif /* KVBM_TO_CACHE_RUN_H */
