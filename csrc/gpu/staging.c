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
 */
#include "gpu_internal.h"

#include <stdio.h>
#include <string.h>

#include "pieces.h"

#define KV_MAX_LANES 16
#define KV_LANE_SLOTS 16
#define KV_STAGING_ALIGN 256

typedef struct {
    char *base;
    size_t bytes;
    cudaStream_t permute;
    cudaStream_t copy;                /* the copies of a call on a default stream */
    cudaEvent_t handoff;              /* the caller's stream at the start, an onload's last permute */
    cudaEvent_t done;                 /* the end of the lane's last call */
    cudaEvent_t ready[KV_LANE_SLOTS]; /* a slot's first stage done */
    cudaEvent_t freed[KV_LANE_SLOTS]; /* a slot's second stage done: it may be written again */
    intptr_t owner;                   /* the caller's stream of its last call */
    uint64_t last_use;                /* 0: never used */
} kv_lane;

struct kv_staging {
    char *memory; /* every lane's bytes, one allocation */
    int nlanes;
    kv_lane lanes[KV_MAX_LANES];
    kv_lane capture;
    int capture_ready;
    uint64_t clock;
    /* Host scratch: a call's pieces, the runs of a piece and the batch
     * API's arguments. */
    kv_box *boxes;
    int64_t box_capacity;
    kv_run *runs;
    void **srcs, **dsts;
    size_t *sizes;
    int64_t scratch;
};

/* ------------------------------------------------------------ lanes */

static void lane_destroy(kv_lane *lane)
{
    cudaEvent_t *events[] = {&lane->handoff, &lane->done};
    for (int i = 0; i < 2; i++)
        if (*events[i] != NULL)
            cudaEventDestroy(*events[i]);
    for (int i = 0; i < KV_LANE_SLOTS; i++) {
        if (lane->ready[i] != NULL)
            cudaEventDestroy(lane->ready[i]);
        if (lane->freed[i] != NULL)
            cudaEventDestroy(lane->freed[i]);
    }
    if (lane->permute != NULL)
        cudaStreamDestroy(lane->permute);
    if (lane->copy != NULL)
        cudaStreamDestroy(lane->copy);
    memset(lane, 0, sizeof *lane);
}

static int lane_create(kv_lane *lane, char *base, size_t bytes, kv_failure *f)
{
    int least, greatest;
    memset(lane, 0, sizeof *lane);
    lane->base = base;
    lane->bytes = bytes;
    CUDA_STEP(f, cudaDeviceGetStreamPriorityRange(&least, &greatest), "reading the stream priorities");
    CUDA_STEP(f, cudaStreamCreateWithPriority(&lane->permute, cudaStreamNonBlocking, greatest),
              "creating a staging permute stream");
    CUDA_STEP(f, cudaStreamCreateWithFlags(&lane->copy, cudaStreamNonBlocking), "creating a staging copy stream");
    cudaEvent_t *events[] = {&lane->handoff, &lane->done};
    for (int i = 0; i < 2; i++)
        CUDA_STEP(f, cudaEventCreateWithFlags(events[i], cudaEventDisableTiming), "creating a staging event");
    for (int i = 0; i < KV_LANE_SLOTS; i++) {
        CUDA_STEP(f, cudaEventCreateWithFlags(&lane->ready[i], cudaEventDisableTiming), "creating a staging event");
        CUDA_STEP(f, cudaEventCreateWithFlags(&lane->freed[i], cudaEventDisableTiming), "creating a staging event");
    }
    return 0;
}

void kv_staging_free(kv_staging *st)
{
    if (st == NULL)
        return;
    for (int i = 0; i < st->nlanes; i++)
        lane_destroy(&st->lanes[i]);
    if (st->capture_ready) {
        cudaFree(st->capture.base);
        lane_destroy(&st->capture);
    }
    cudaFree(st->memory); /* waits for the work still using it */
    PyMem_RawFree(st->boxes);
    PyMem_RawFree(st->runs);
    PyMem_RawFree(st->srcs);
    PyMem_RawFree(st->dsts);
    PyMem_RawFree(st->sizes);
    PyMem_RawFree(st);
}

static size_t lane_bytes_for(size_t bytes, int lanes)
{
    return bytes / (size_t)lanes / KV_STAGING_ALIGN * KV_STAGING_ALIGN;
}

/* The device's staging, allocated now if it is not yet (the current device
 * is the ring's). */
static kv_staging *staging_of(kv_gpu *gpu, kv_ring *ring, kv_failure *f)
{
    if (ring->staging != NULL)
        return ring->staging;
    kv_staging *st = PyMem_RawCalloc(1, sizeof *st);
    if (st == NULL) {
        f->error = cudaErrorMemoryAllocation;
        f->what = "allocating the staging description";
        return NULL;
    }
    const size_t lane_bytes = lane_bytes_for(gpu->staging_bytes, gpu->staging_lanes);
    cudaError_t error = cudaMalloc((void **)&st->memory, lane_bytes * (size_t)gpu->staging_lanes);
    if (error != cudaSuccess) {
        f->error = error;
        f->what = "allocating device staging memory (kvbm_ext.set_staging() sets its size)";
        PyMem_RawFree(st);
        return NULL;
    }
    for (int i = 0; i < gpu->staging_lanes; i++) {
        st->nlanes = i + 1;
        if (lane_create(&st->lanes[i], st->memory + (size_t)i * lane_bytes, lane_bytes, f) < 0) {
            kv_staging_free(st);
            return NULL;
        }
    }
    ring->staging = st;
    return st;
}

static int reserve_capture_lane(kv_staging *st, kv_failure *f)
{
    if (st->capture_ready)
        return 0;
    char *memory;
    CUDA_STEP(f, cudaMalloc((void **)&memory, st->lanes[0].bytes), "allocating the capture staging lane");
    if (lane_create(&st->capture, memory, st->lanes[0].bytes, f) < 0) {
        lane_destroy(&st->capture);
        cudaFree(memory);
        return -1;
    }
    st->capture_ready = 1;
    return 0;
}

/* The lane for a call on `caller`: the one its stream used last, else an
 * idle one (never used first), else the least recently used. */
static kv_lane *pick_lane(kv_staging *st, intptr_t caller, int *index)
{
    int idle = -1, oldest = 0;
    for (int i = 0; i < st->nlanes; i++) {
        const kv_lane *lane = &st->lanes[i];
        if (lane->last_use != 0 && lane->owner == caller) {
            *index = i;
            return &st->lanes[i];
        }
        if (lane->last_use < st->lanes[oldest].last_use)
            oldest = i;
        if (idle < 0 || lane->last_use < st->lanes[idle].last_use) {
            if (lane->last_use == 0 || cudaEventQuery(lane->done) == cudaSuccess)
                idle = i;
            cudaGetLastError(); /* cudaErrorNotReady is an answer, not an error */
        }
    }
    *index = idle >= 0 ? idle : oldest;
    return &st->lanes[*index];
}

/* ------------------------------------------------------------ one call */

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
static int enqueue_pieces(kv_staging *st, kv_lane *lane, cudaStream_t caller, const kv_move *move,
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
    if (st == NULL && (st = staging_of(gpu, ring, f)) == NULL)
        return -1;
    int index = -1;
    kv_lane *lane = capturing ? &st->capture : pick_lane(st, (intptr_t)caller, &index);

    kv_cut cut = plan->cut;
    cut.piece_bytes = piece_bytes_for(lane->bytes);
    int64_t max_units;
    const int64_t count = kv_pieces_cut(s, &cut, NULL, &max_units);
    const size_t slot_bytes =
        ((size_t)(max_units * s->unit_bytes) + KV_STAGING_ALIGN - 1) / KV_STAGING_ALIGN * KV_STAGING_ALIGN;
    if (2 * slot_bytes > lane->bytes) {
        snprintf(report->fallback, sizeof report->fallback,
                 "a piece of %lld bytes needs two slots, more than a "
                 "staging lane's %zu bytes",
                 (long long)(max_units * s->unit_bytes), lane->bytes);
        return 1;
    }
    const size_t fit = lane->bytes / slot_bytes;
    const int nslots = fit < KV_LANE_SLOTS ? (int)fit : KV_LANE_SLOTS;
    if (grow_scratch(st, count, max_units, f) < 0)
        return -1;
    kv_pieces_cut(s, &cut, st->boxes, &max_units);

    /* The lane last served another stream, whose call may still be using
     * the slots (on this stream the call already follows it). */
    if (!capturing && lane->last_use != 0 && lane->owner != (intptr_t)caller)
        CUDA_STEP(f, cudaStreamWaitEvent(caller, lane->done, 0), "ordering after the lane's last call");
    if (enqueue_pieces(st, lane, caller, move, plan, count, slot_bytes, nslots, capturing, f) < 0)
        return -1;
    if (!capturing) {
        lane->owner = (intptr_t)caller;
        lane->last_use = ++st->clock;
    }
    report->staged = 1;
    report->pieces = count;
    report->piece_bytes = max_units * s->unit_bytes;
    report->lane = index;
    return 0;
}

/* ------------------------------------------------------------ reserving and describing */

int kv_staging_reserve(kv_gpu *gpu, kv_ring *ring, kv_failure *f)
{
    kv_staging *st = staging_of(gpu, ring, f);
    return st == NULL ? -1 : reserve_capture_lane(st, f);
}

kv_staging_facts kv_staging_facts_of(const kv_gpu *gpu, const kv_staging *st)
{
    kv_staging_facts facts;
    facts.allocated = st != NULL;
    facts.lanes = st != NULL ? st->nlanes : gpu->staging_lanes;
    facts.lane_bytes = st != NULL ? st->lanes[0].bytes : lane_bytes_for(gpu->staging_bytes, facts.lanes);
    facts.capture_reserved = st != NULL && st->capture_ready;
    return facts;
}
