/* What the files behind gpu.h share: the per-device resources and their
 * table ring (gpu_ring.c), how every GPU entry point holds its device and
 * carries a failed CUDA step back to Python (gpu_launch.c), a layout
 * move's kernels, launched through its kind (gpu.h, kv_move_kind), and its
 * staging (staging.c).  Only files built with the CUDA toolkit include it. */
#ifndef KVBM_GPU_INTERNAL_H
#define KVBM_GPU_INTERNAL_H

#include "gpu.h"

#include <cuda_runtime_api.h>
#include <pythread.h>
#include <stdio.h>

#define KV_MAX_DEVICES 64
#define KV_RING_REGIONS 64
#define KV_RING_INITIAL_BYTES ((size_t)4 << 20)
#define KV_RING_ALIGN 256
/* Device staging memory (staging.c), unless kvbm_ext.set_staging() says
 * otherwise: two lanes, so that an offload and an onload on two streams run
 * side by side, each large enough that a large call needs few pieces. */
#define KV_STAGING_DEFAULT_BYTES ((size_t)96 << 20)
#define KV_STAGING_DEFAULT_LANES 2
/* The most lanes a device's staging has. */
#define KV_MAX_LANES 16

typedef struct {
    size_t start, end;
    cudaEvent_t done; /* recorded after the kernel that reads [start, end) */
} kv_region;

typedef struct kv_staging kv_staging; /* staging.c */

/* One device's resources. */
typedef struct {
    char *host;   /* pinned staging of pointer tables */
    char *device; /* what kernels read */
    size_t capacity;
    size_t head;
    kv_region busy[KV_RING_REGIONS]; /* FIFO: busy[first], ..., count of them */
    int first, count;
    /* Non-blocking streams, so that the legacy default stream does not
     * serialize them: */
    cudaStream_t copy_stream;  /* uploads tables */
    cudaStream_t batch_stream; /* runs cudaMemcpyBatchAsync for callers on a default stream, which it rejects */
    /* Events that order one stream after another: */
    cudaEvent_t producer_done; /* a producer's stream before the caller's */
    cudaEvent_t table_ready;   /* an upload before the caller's kernel */
    cudaEvent_t batch_start;   /* the caller's stream before batch_stream */
    cudaEvent_t batch_done;    /* batch_stream before the caller's stream */
    kv_staging *staging;       /* device staging memory, allocated on first need */
} kv_ring;

struct kv_gpu {
    PyThread_type_lock lock; /* the rings are used with the GIL released */
    kv_ring *rings[KV_MAX_DEVICES];
    size_t staging_bytes; /* per device, for staging allocated from now on */
    int staging_lanes;
};

/* A failed CUDA step, reported once the GIL is held again. */
typedef struct {
    cudaError_t error;
    const char *what;
} kv_failure;

/* The message kv_raise_failure raises, in `buf` (here, so that the enqueue
 * thread words its failures alike without calling up into gpu_launch.c). */
static inline void kv_failure_message(const kv_failure *f, char *buf, size_t size)
{
    snprintf(buf, size, "CUDA error %s (%d) in %s: %s", cudaGetErrorName(f->error), (int)f->error, f->what,
             cudaGetErrorString(f->error));
}

#define CUDA_STEP(failure, call, description)                                                                          \
    do {                                                                                                               \
        cudaError_t step_error_ = (call);                                                                              \
        if (step_error_ != cudaSuccess) {                                                                              \
            (failure)->error = step_error_;                                                                            \
            (failure)->what = (description);                                                                           \
            return -1;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* Whether `stream` is a default stream (the legacy one, 0 or 1, or the
 * per-thread one, 2), which cudaMemcpyBatchAsync rejects. */
static inline int kv_is_default_stream(cudaStream_t stream)
{
    const intptr_t handle = (intptr_t)stream;
    return handle == 0 || handle == 1 || handle == 2;
}

/* cudaMemcpyBatchAsync of `count` copies on `stream`, each source read in
 * stream order (gpu_batch.c); cudaErrorNotSupported in a build without it.
 * A failure is left for the caller to clear. */
cudaError_t kv_batch_copy(void **dsts, void **srcs, size_t *sizes, size_t count, cudaStream_t stream);

/* Raises RuntimeError naming the failed step (GIL held). */
void kv_raise_failure(const kv_failure *f);

/* Makes `device` current; *previous receives the device to restore, or -1
 * when it already was current.  Safe without the GIL. */
cudaError_t kv_select_device(int device, int *previous);

/* The ring of `device`, created on first use (without table buffers). */
kv_ring *kv_ring_for(kv_gpu *gpu, int device, kv_failure *f);

/* Copies the `nparts` parts of a table (host memory) into the ring one
 * after another and uploads them on the copy stream, which `stream` then
 * waits for; refused while `stream` is captured into a CUDA graph.
 * *device_copy receives the device address, *offset and *bytes the region,
 * which kv_ring_commit must mark busy after the launch that reads it.
 * Returns 0 or -1. */
int kv_stage_table(kv_ring *ring, cudaStream_t stream, const void *const *parts, const size_t *part_bytes, int nparts,
                   char **device_copy, size_t *offset, size_t *bytes, kv_failure *f);

/* Marks [offset, offset + bytes) of the ring busy until the work now on
 * `stream` is done.  Returns 0 or -1. */
int kv_ring_commit(kv_ring *ring, size_t offset, size_t bytes, cudaStream_t stream, kv_failure *f);

/* One call's hold on its device, from kv_device_enter to kv_device_leave:
 * the GIL released, gpu->lock held, the target's device current, the
 * producers' streams ordered before `stream`. */
typedef struct {
    kv_gpu *gpu;
    kv_ring *ring;       /* the device's, once entered */
    cudaStream_t stream; /* the target's */
    kv_failure failure;  /* the step that failed, for kv_device_leave */
    int previous;        /* the device to make current again, or -1 */
    PyThreadState *thread;
} kv_device;

/* Releases the GIL, takes the lock, selects the target's device and
 * orders the producers' streams before the target's.  Returns 0, or -1
 * with d->failure set; call kv_device_leave either way. */
int kv_device_enter(kv_gpu *gpu, const kv_gpu_target *target, kv_device *d);

/* Undoes kv_device_enter and, when `rc` < 0, raises RuntimeError naming
 * d->failure.  Returns rc. */
int kv_device_leave(kv_device *d, int rc);

/* Frees a device's staging (staging.c; waits for the work using it). */
void kv_staging_free(kv_staging *staging);

/* Allocates the staging of the ring's device, the current one, and its
 * capture lane, unless they are.  Returns 0 or -1. */
int kv_staging_reserve(kv_gpu *gpu, kv_ring *ring, kv_failure *f);

/* What kvbm_ext.staging_info() says of a device's staging: `st`, or what
 * the settings would allocate where `st` is NULL. */
typedef struct {
    int lanes;
    size_t lane_bytes;
    int allocated, capture_reserved;
} kv_staging_facts;

kv_staging_facts kv_staging_facts_of(const kv_gpu *gpu, const kv_staging *st);

/* A layout move's kernel over the whole call, and over one staged piece,
 * as its kind (gpu.h, kv_move_kind) launches it. */
static inline cudaError_t kv_move_launch(const kv_move *move, const void *host_table, const void *device_table,
                                         uint32_t num_ctas, cudaStream_t stream)
{
    return (cudaError_t)move->kind->launch(move, host_table, device_table, num_ctas, (void *)stream);
}

struct kv_box;
static inline cudaError_t kv_move_launch_piece(const kv_move *move, const kv_staged *staged, const struct kv_box *box,
                                               char *slot, uint32_t num_ctas, cudaStream_t stream)
{
    return (cudaError_t)move->kind->launch_piece(move, staged, box, slot, num_ctas, (void *)stream);
}

/* Runs plan->staged on `caller` (between kv_device_enter and
 * kv_device_leave), its permutes on plan->num_ctas CTAs and on
 * plan->edge_num_ctas for the pieces at the call's ends.  Returns 0, -1
 * with *f set, or 1 when the move cannot be staged (report->fallback says
 * why; nothing was enqueued). */
int kv_staging_run(kv_gpu *gpu, kv_ring *ring, cudaStream_t caller, const kv_move *move, const kv_move_plan *plan,
                   kv_gpu_report *report, kv_failure *f);

#endif /* KVBM_GPU_INTERNAL_H */
