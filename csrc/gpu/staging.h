/* The staging of a device (staging.c): its lanes, each a share of the
 * staging memory with its own streams and events, and the host scratch of
 * the call being enqueued.  staging_lanes.c makes, picks and frees them;
 * staging.c enqueues a call on one. */
#ifndef KVBM_STAGING_H
#define KVBM_STAGING_H

#include "enqueue.h"
#include "pieces.h"

#include <stdatomic.h>

#define KV_LANE_SLOTS 16
#define KV_STAGING_ALIGN 256

typedef struct {
    char *base;
    size_t bytes;
    cudaStream_t permute;
    cudaStream_t copy;                /* the copies of a call on a default stream, or deferred */
    cudaEvent_t handoff;              /* the caller's stream at the start, an onload's last permute */
    cudaEvent_t done;                 /* the end of the lane's last call */
    cudaEvent_t ready[KV_LANE_SLOTS]; /* a slot's first stage done */
    cudaEvent_t freed[KV_LANE_SLOTS]; /* a slot's second stage done: it may be written again */
    intptr_t owner;                   /* the caller's stream of its last call */
    uint64_t last_use;                /* 0: never used */
    uint32_t deferred;                /* deferred calls handed over: the number its end flag reaches last */
    atomic_uint enqueued;             /* the number of the last one the enqueue thread has enqueued */
} kv_lane;

struct kv_staging {
    char *memory; /* every lane's bytes, one allocation */
    int nlanes;
    kv_lane lanes[KV_MAX_LANES];
    kv_lane capture;
    int capture_ready;
    uint64_t clock;
    kv_enqueuer *enqueuer; /* deferred calls' thread, started by the first */
    /* Host scratch: a call's pieces, the runs of a piece and the batch
     * API's arguments; the enqueue thread's while it runs a deferred call
     * (no other call runs then, see staging.c). */
    kv_box *boxes;
    int64_t box_capacity;
    kv_run *runs;
    void **srcs, **dsts;
    size_t *sizes;
    int64_t scratch;
};

/* The device's staging, allocated now if it is not yet (the current device
 * is the ring's).  NULL with *f set. */
kv_staging *kv_staging_of(kv_gpu *gpu, kv_ring *ring, kv_failure *f);

/* The lane for a call on `caller`: the one its stream used last, else an
 * idle one (never used first), else the least recently used; *index
 * receives its index. */
kv_lane *kv_pick_lane(kv_staging *st, intptr_t caller, int *index);

#endif /* KVBM_STAGING_H */
