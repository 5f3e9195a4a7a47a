/* The device's enqueue thread, which enqueues the pieces of deferred
 * staged calls (staging.c, "Deferred calls"), and the jobs it takes: a
 * call's description copied, owned, so that the call can return first. */
#ifndef KVBM_ENQUEUE_H
#define KVBM_ENQUEUE_H

#include "gpu_internal.h"

/* How a staged call is cut (pieces.h), worked out when it is made. */
typedef struct {
    kv_cut cut;
    int64_t count, max_units; /* pieces, and the units of the largest */
    size_t slot_bytes;
    int nslots;
} kv_job_shape;

typedef struct kv_job {
    struct kv_job *next;
    kv_move move;      /* its args and table in `storage` */
    kv_move_plan plan; /* `staged` is the job's own */
    kv_staged staged;  /* its addresses in `storage` */
    kv_job_shape shape;
    int lane;
    uint32_t number;   /* the value the lane's end flag takes when the job ends */
    cudaEvent_t start; /* recorded on the caller's stream at the call */
    kv_promise *outcome;
    char *storage;
    size_t capacity;
} kv_job;

typedef struct kv_enqueuer kv_enqueuer;

/* What the thread does with a job (staging.c): enqueues its pieces on its
 * lane's streams, after the caller's stream at the call and the lane's last
 * call.  *end receives the lane stream the job ends on, failed or not, where
 * its flag is written.  Returns 0, or -1 with *f set. */
typedef int (*kv_job_runner)(kv_staging *st, const kv_job *job, cudaStream_t *end, kv_failure *f);

/* Starts the thread of `staging`, whose device is the current one, to run
 * each job with `run`.  NULL with *f set. */
kv_enqueuer *kv_enqueuer_start(kv_staging *staging, kv_job_runner run, kv_failure *f);

/* Waits until the thread has enqueued every job handed to it. */
void kv_enqueuer_drain(kv_enqueuer *q);

/* Drains, ends the thread and frees what it holds (the current device is
 * its own).  Accepts NULL. */
void kv_enqueuer_stop(kv_enqueuer *q);

/* A job holding copies of `move` and of `plan` with its staged side, or
 * NULL with *f set.  Its lane, number and shape are the caller's to set. */
kv_job *kv_enqueuer_job(kv_enqueuer *q, const kv_move *move, const kv_move_plan *plan, kv_failure *f);

/* Hands the job over: records its start on `caller`, makes `caller` wait
 * for the lane's end flag to reach job->number and puts the job in the
 * thread's queue; *outcome receives the outcome the thread settles.
 * Returns 0, or -1 with *f set, the job taken back and nothing handed
 * over. */
int kv_enqueuer_submit(kv_enqueuer *q, kv_job *job, cudaStream_t caller, kv_promise **outcome, kv_failure *f);

#endif /* KVBM_ENQUEUE_H */
