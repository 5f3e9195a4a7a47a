/* Staged moves: SMs permute into device staging memory, copy engines carry
 * it over PCIe.  See gpu.h (kv_staged) and pieces.h.
 *
 * Why: a kernel that reads or writes pinned host memory directly holds its
 * SMs for the whole PCIe transfer, taking them from the model running beside
 * it; copy engines cost the model nothing but cannot rearrange bytes.  So a
 * kernel does the rearranging at HBM speed on a few CTAs, into (offload) or
 * out of (onload) a slot of device staging memory, and a copy engine moves
 * the slot.  A ring of slots pipelines the two: the permute of piece k+1
 * runs while piece k crosses PCIe.
 *
 * Staging is per device, allocated on first need and split into lanes.  A
 * lane has its own staging bytes and a high-priority permute stream (so
 * that its short kernels are scheduled ahead of the model's pending CTAs).
 * The copies run on the caller's stream itself, back to back: the engines
 * see one queue of copies, as for a plain memcpy, and the call needs no
 * join for an offload (its last copy is the caller's) nor a fork for an
 * onload (its first copy is).  On a default stream, which
 * cudaMemcpyBatchAsync refuses, they run on the lane's copy stream instead,
 * forked from and joined back to the caller's.  A call takes the lane its
 * stream used last, else an idle one, else the least recently used, so
 * calls on different streams do not share slots; the call returns at once,
 * and work queued on the caller's stream afterwards sees the finished
 * bytes.  A call on a lane that last served another stream first waits for
 * that call to finish with the slots.
 *
 * Beyond its copies a call pays the hand-offs between the engines and the
 * permute of the one piece no copy overlaps, which is why the pieces at
 * its ends run wide (route.c; benchmarks/README.md, "Defaults in the code").
 *
 * Calls made while the caller's stream is captured into a CUDA graph use a
 * separate capture lane, which reserve_staging() allocates (nothing may be
 * allocated during a capture); their ordering is the captured stream's own.
 *
 * Deferred calls.  Enqueuing the pieces costs the host a few microseconds
 * each (a permute's launch, its copies, the events between them), which a
 * caller that submits jobs from its serving loop pays in full.  A call
 * with plan->deferred hands them to the device's enqueue thread
 * (enqueue.c) instead: the caller records where its stream is, makes its
 * stream wait (cuStreamWaitValue32) for the lane's end flag to reach the
 * call's number, and returns; the thread enqueues the pieces on the lane's
 * streams, copies included, after that point and after the lane's last
 * call, then writes the flag on the lane's copy stream once every piece
 * ran.  Work queued on the caller's stream afterwards still sees the
 * finished bytes.  A failure on the thread writes the flag all the same,
 * after whatever it enqueued, and fails the call's outcome.  A call
 * enqueued by its caller first waits (on the host) until the thread has
 * enqueued every deferred call, so that the lanes see calls in the order
 * they were made.
 */
#include "staging.h"

#include <stdio.h>

static int grow_scratch(kv_staging *st, int64_t pieces, int64_t units, kv_failure *f)
{
    if (pieces > st->box_capacity) {
        kv_box *boxes = PyMem_RawRealloc(st->boxes, (size_t)pieces * sizeof *boxes);
        if (boxes == NULL) {
            f->error = cudaErrorMemoryAllocation;
            f->what = "allocating the staging piece list";
            return -1;
        }
        st->boxes = boxes;
        st->box_capacity = pieces;
    }
    if (units <= st->scratch)
        return 0;
    kv_run *runs = PyMem_RawRealloc(st->runs, (size_t)units * sizeof *runs);
    if (runs != NULL)
        st->runs = runs;
    void **srcs = PyMem_RawRealloc(st->srcs, (size_t)units * sizeof *srcs);
    if (srcs != NULL)
        st->srcs = srcs;
    void **dsts = PyMem_RawRealloc(st->dsts, (size_t)units * sizeof *dsts);
    if (dsts != NULL)
        st->dsts = dsts;
    size_t *sizes = PyMem_RawRealloc(st->sizes, (size_t)units * sizeof *sizes);
    if (sizes != NULL)
        st->sizes = sizes;
    if (runs == NULL || srcs == NULL || dsts == NULL || sizes == NULL) {
        f->error = cudaErrorMemoryAllocation;
        f->what = "allocating the staging run lists";
        return -1;
    }
    st->scratch = units;
    return 0;
}

/* Cuts a call into its pieces, in st->boxes. */
static int cut_pieces(kv_staging *st, const kv_staged *s, const kv_job_shape *shape, kv_failure *f)
{
    if (grow_scratch(st, shape->count, shape->max_units, f) < 0)
        return -1;
    int64_t max_units;
    kv_pieces_cut(s, &shape->cut, st->boxes, &max_units);
    return 0;
}

/* Moves one piece's runs between its slot and pinned memory on `stream`:
 * one cudaMemcpyAsync for one run (the usual case: a piece of contiguous
 * blocks), else the batch API, else (no batch API, `async_copies`, or a
 * capture, where the batch API is not promised) one cudaMemcpyAsync a run. */
static int copy_runs(kv_staging *st, cudaStream_t stream, int64_t n, char *slot, const kv_staged *s, int async_copies,
                     int capturing, kv_failure *f)
{
    for (int64_t i = 0; i < n; i++) {
        void *pinned = (void *)(uintptr_t)st->runs[i].pinned, *staged = slot + st->runs[i].offset;
        st->dsts[i] = s->to_host ? pinned : staged;
        st->srcs[i] = s->to_host ? staged : pinned;
        st->sizes[i] = (size_t)st->runs[i].bytes;
    }
    if (n > 1 && !async_copies && !capturing && kv_gpu_batch_available()) {
        if (kv_batch_copy(st->dsts, st->srcs, st->sizes, (size_t)n, stream) == cudaSuccess)
            return 0;
        cudaGetLastError(); /* fall back to the loop below */
    }
    for (int64_t i = 0; i < n; i++)
        CUDA_STEP(f, cudaMemcpyAsync(st->dsts[i], st->srcs[i], st->sizes[i], cudaMemcpyDefault, stream),
                  "copying a staging slot");
    return 0;
}

/* The largest piece: half a lane, so that two slots at least pipeline. */
static int64_t piece_bytes_for(size_t lane_bytes)
{
    return (int64_t)(lane_bytes / 2 / KV_STAGING_ALIGN * KV_STAGING_ALIGN);
}

/* Enqueues the pieces: an offload runs them smallest first, so that the
 * copies start soon, an onload largest first, so that the permute left after
 * the last copy is short.  Each piece's copy waits for its permute (offload)
 * or its permute for its copy (onload) through the slot's `ready` event, and
 * a slot is rewritten only after the second stage of its last use (the
 * `freed` event; recorded only where a later piece of the call reuses the
 * slot, since the next call on the lane follows the whole of this one).
 * The piece no copy overlaps (an offload's first, an onload's last) and
 * the ramp next to it permute on plan->edge_num_ctas CTAs, the others on
 * plan->num_ctas. */
static int enqueue_pieces(kv_staging *st, kv_lane *lane, cudaStream_t copies, const kv_move *move,
                          const kv_move_plan *plan, int64_t count, size_t slot_bytes, int nslots, int capturing,
                          kv_failure *f)
{
    const kv_staged *s = plan->staged;
    for (int64_t k = 0; k < count; k++) {
        const kv_box *box = &st->boxes[s->to_host ? k : count - 1 - k];
        const int slot = (int)(k % nslots);
        char *memory = lane->base + (size_t)slot * slot_bytes;
        const int64_t runs = kv_box_runs(s, box, st->runs);
        const uint32_t num_ctas = box->edge ? plan->edge_num_ctas : plan->num_ctas;
        if (s->to_host) {
            if (k >= nslots)
                CUDA_STEP(f, cudaStreamWaitEvent(lane->permute, lane->freed[slot], 0),
                          "waiting for a free staging slot");
            CUDA_STEP(f, kv_move_launch_piece(move, s, box, memory, num_ctas, lane->permute),
                      "launching the staging permute");
            CUDA_STEP(f, cudaEventRecord(lane->ready[slot], lane->permute), "recording a staged piece");
            CUDA_STEP(f, cudaStreamWaitEvent(copies, lane->ready[slot], 0), "ordering a staged piece");
            if (copy_runs(st, copies, runs, memory, s, plan->async_copies, capturing, f) < 0)
                return -1;
            if (k + nslots < count)
                CUDA_STEP(f, cudaEventRecord(lane->freed[slot], copies), "recording a free staging slot");
            continue;
        }
        if (k >= nslots)
            CUDA_STEP(f, cudaStreamWaitEvent(copies, lane->freed[slot], 0), "waiting for a free staging slot");
        if (copy_runs(st, copies, runs, memory, s, plan->async_copies, capturing, f) < 0)
            return -1;
        CUDA_STEP(f, cudaEventRecord(lane->ready[slot], copies), "recording a staged piece");
        CUDA_STEP(f, cudaStreamWaitEvent(lane->permute, lane->ready[slot], 0), "ordering a staged piece");
        CUDA_STEP(f, kv_move_launch_piece(move, s, box, memory, num_ctas, lane->permute),
                  "launching the staging permute");
        if (k + nslots < count)
            CUDA_STEP(f, cudaEventRecord(lane->freed[slot], lane->permute), "recording a free staging slot");
    }
    return 0;
}

/* A call its caller enqueues: the pieces forked from the caller's stream
 * and joined back to it. */
static int enqueue_call(kv_staging *st, kv_lane *lane, cudaStream_t caller, const kv_move *move,
                        const kv_move_plan *plan, int64_t count, size_t slot_bytes, int nslots, int capturing,
                        kv_failure *f)
{
    const kv_staged *s = plan->staged;
    /* The stream the copies run on (see the top of this file). */
    const cudaStream_t copies = kv_is_default_stream(caller) && !capturing ? lane->copy : caller;
    /* The permutes of an offload, and the copies on the lane's copy stream,
     * follow the work queued on the caller's stream before the call (an
     * onload's permutes follow its copies). */
    if (s->to_host || copies != caller)
        CUDA_STEP(f, cudaEventRecord(lane->handoff, caller), "forking the staging streams");
    if (s->to_host)
        CUDA_STEP(f, cudaStreamWaitEvent(lane->permute, lane->handoff, 0), "forking the staging streams");
    if (copies != caller)
        CUDA_STEP(f, cudaStreamWaitEvent(copies, lane->handoff, 0), "forking the staging streams");
    if (enqueue_pieces(st, lane, copies, move, plan, count, slot_bytes, nslots, capturing, f) < 0)
        return -1;
    /* Join back the stream the call ends on: an onload's last permute, an
     * offload's last copy when it ran on the lane's copy stream. */
    const cudaStream_t last = s->to_host ? copies : lane->permute;
    if (last != caller) {
        CUDA_STEP(f, cudaEventRecord(lane->handoff, last), "joining the staging streams");
        CUDA_STEP(f, cudaStreamWaitEvent(caller, lane->handoff, 0), "joining the staging streams");
    }
    CUDA_STEP(f, cudaEventRecord(lane->done, caller), "marking the end of a staged call");
    return 0;
}

/* The streams of a deferred call's lane wait for the caller's stream at the
 * call and for the lane's last call. */
static int order_job(kv_lane *lane, cudaEvent_t start, kv_failure *f)
{
    const cudaStream_t streams[] = {lane->permute, lane->copy};
    for (int i = 0; i < 2; i++) {
        CUDA_STEP(f, cudaStreamWaitEvent(streams[i], start, 0), "ordering a deferred staged call after its stream");
        CUDA_STEP(f, cudaStreamWaitEvent(streams[i], lane->done, 0), "ordering after the lane's last call");
    }
    return 0;
}

/* The end of a deferred call on the lane's copy stream, after its permutes. */
static int join_job(kv_lane *lane, kv_failure *f)
{
    CUDA_STEP(f, cudaEventRecord(lane->handoff, lane->permute), "joining the staging streams");
    CUDA_STEP(f, cudaStreamWaitEvent(lane->copy, lane->handoff, 0), "joining the staging streams");
    CUDA_STEP(f, cudaEventRecord(lane->done, lane->copy), "marking the end of a staged call");
    return 0;
}

/* A deferred call on the enqueue thread (enqueue.h, kv_job_runner). */
static int run_job(kv_staging *st, const kv_job *job, cudaStream_t *end, kv_failure *f)
{
    kv_lane *lane = &st->lanes[job->lane];
    const kv_job_shape *shape = &job->shape;
    *end = lane->copy;
    int rc = order_job(lane, job->start, f);
    if (rc == 0)
        rc = cut_pieces(st, &job->staged, shape, f);
    if (rc == 0)
        rc = enqueue_pieces(st, lane, lane->copy, &job->move, &job->plan, shape->count, shape->slot_bytes,
                            shape->nslots, 0, f);
    /* Failed or not, the end follows whatever was enqueued: the caller's
     * stream goes on only once nothing of the call runs. */
    kv_failure joined = {cudaSuccess, NULL};
    if (join_job(lane, &joined) < 0 && rc == 0) {
        *f = joined;
        rc = -1;
    }
    atomic_store_explicit(&lane->enqueued, job->number, memory_order_release);
    return rc;
}

/* Hands a call to the enqueue thread (see the top of this file). */
static int defer_call(kv_staging *st, kv_lane *lane, int index, cudaStream_t caller, const kv_move *move,
                      const kv_move_plan *plan, const kv_job_shape *shape, kv_failure *f)
{
    if (st->enqueuer == NULL && (st->enqueuer = kv_enqueuer_start(st, run_job, f)) == NULL)
        return -1;
    kv_job *job = kv_enqueuer_job(st->enqueuer, move, plan, f);
    if (job == NULL)
        return -1;
    job->shape = *shape;
    job->lane = index;
    job->number = lane->deferred + 1;
    if (kv_enqueuer_submit(st->enqueuer, job, caller, plan->deferred, f) < 0)
        return -1;
    lane->deferred = job->number;
    return 0;
}

int kv_staging_run(kv_gpu *gpu, kv_ring *ring, cudaStream_t caller, const kv_move *move, const kv_move_plan *plan,
                   kv_gpu_report *report, kv_failure *f)
{
    const kv_staged *s = plan->staged;
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_STEP(f, cudaStreamIsCapturing(caller, &capture), "asking whether the stream is capturing");
    const int capturing = capture != cudaStreamCaptureStatusNone;
    kv_staging *st = ring->staging;
    if (capturing && (st == NULL || !st->capture_ready)) {
        f->error = cudaErrorStreamCaptureUnsupported;
        f->what = "a staged transfer while the stream is captured into a CUDA graph: call "
                  "kvbm_ext.reserve_staging() before capturing (nothing can be allocated during a capture)";
        return -1;
    }
    if (st == NULL && (st = kv_staging_of(gpu, ring, f)) == NULL)
        return -1;
    /* A capture's order is the captured stream's, which a thread cannot join. */
    const int deferred = plan->deferred != NULL && !capturing && move->kind->own_args != NULL;
    if (!deferred && st->enqueuer != NULL)
        kv_enqueuer_drain(st->enqueuer);
    int index = -1;
    kv_lane *lane = capturing ? &st->capture : kv_pick_lane(st, (intptr_t)caller, &index);

    kv_job_shape shape;
    shape.cut = plan->cut;
    shape.cut.piece_bytes = piece_bytes_for(lane->bytes);
    shape.count = kv_pieces_cut(s, &shape.cut, NULL, &shape.max_units);
    shape.slot_bytes =
        ((size_t)(shape.max_units * s->unit_bytes) + KV_STAGING_ALIGN - 1) / KV_STAGING_ALIGN * KV_STAGING_ALIGN;
    if (2 * shape.slot_bytes > lane->bytes) {
        snprintf(report->fallback, sizeof report->fallback,
                 "a piece of %lld bytes needs two slots, more than a "
                 "staging lane's %zu bytes",
                 (long long)(shape.max_units * s->unit_bytes), lane->bytes);
        return 1;
    }
    const size_t fit = lane->bytes / shape.slot_bytes;
    shape.nslots = fit < KV_LANE_SLOTS ? (int)fit : KV_LANE_SLOTS;
    if (deferred) {
        if (defer_call(st, lane, index, caller, move, plan, &shape, f) < 0)
            return -1;
    }
    else {
        if (cut_pieces(st, s, &shape, f) < 0)
            return -1;
        /* The lane last served another stream, whose call may still be
         * using the slots (on this stream the call already follows it). */
        if (!capturing && lane->last_use != 0 && lane->owner != (intptr_t)caller)
            CUDA_STEP(f, cudaStreamWaitEvent(caller, lane->done, 0), "ordering after the lane's last call");
        if (enqueue_call(st, lane, caller, move, plan, shape.count, shape.slot_bytes, shape.nslots, capturing, f) < 0)
            return -1;
    }
    if (!capturing) {
        lane->owner = (intptr_t)caller;
        lane->last_use = ++st->clock;
    }
    report->staged = 1;
    report->deferred = deferred;
    report->pieces = shape.count;
    report->piece_bytes = shape.max_units * s->unit_bytes;
    report->lane = index;
    return 0;
}
