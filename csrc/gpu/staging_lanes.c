/* A device's staging lanes: made on first need, picked per call, freed
 * with the staging.  See staging.h, and staging.c for what a call does
 * with a lane. */
#include "staging.h"

#include <string.h>

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
    kv_enqueuer_stop(st->enqueuer);
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

kv_staging *kv_staging_of(kv_gpu *gpu, kv_ring *ring, kv_failure *f)
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

kv_lane *kv_pick_lane(kv_staging *st, intptr_t caller, int *index)
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
            /* A deferred call not yet enqueued has not recorded `done`. */
            const int queued = lane->deferred != atomic_load_explicit(&lane->enqueued, memory_order_acquire);
            if (lane->last_use == 0 || (!queued && cudaEventQuery(lane->done) == cudaSuccess))
                idle = i;
            cudaGetLastError(); /* cudaErrorNotReady is an answer, not an error */
        }
    }
    *index = idle >= 0 ? idle : oldest;
    return &st->lanes[*index];
}

/* ------------------------------------------------------------ reserving and describing */

int kv_staging_reserve(kv_gpu *gpu, kv_ring *ring, kv_failure *f)
{
    kv_staging *st = kv_staging_of(gpu, ring, f);
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
