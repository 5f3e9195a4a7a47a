/* Layout moves on the GPU (gpu.h, kv_gpu_move): the kernel over the whole
 * call, or staged through device memory piece by piece (staging.c), as the
 * route planned it. */
#include "gpu_internal.h"

#include "kvbm_kernels.h"

/* The kernel over the whole call: its table by value when it fits in the
 * launch's parameters, else staged in the ring. */
static int launch_whole(kv_ring *ring, cudaStream_t stream, const kv_move *move, uint32_t num_ctas, kv_failure *f)
{
    if (move->entries <= KVBM_TABLE_BY_VALUE_MAX) {
        CUDA_STEP(f, kv_move_launch(move, move->table, NULL, num_ctas, stream), move->kind->what);
        return 0;
    }
    const void *parts[] = {move->table};
    const size_t part_bytes[] = {(size_t)move->entries * 8};
    char *device_table;
    size_t offset, bytes;
    if (kv_stage_table(ring, stream, parts, part_bytes, 1, &device_table, &offset, &bytes, f) < 0)
        return -1;
    CUDA_STEP(f, kv_move_launch(move, NULL, device_table, num_ctas, stream), move->kind->what);
    return kv_ring_commit(ring, offset, bytes, stream, f);
}

int kv_gpu_move(kv_gpu *gpu, const kv_gpu_target *target, const kv_move *move, const kv_move_plan *plan,
                kv_gpu_report *report)
{
    /* A piece's table goes by value: the pieces hold whole blocks up to what
     * fits, and a move whose one block does not fit is not staged. */
    kv_move_plan bounded_plan = *plan;
    kv_staged bounded;
    if (plan->staged != NULL) {
        bounded = *plan->staged;
        bounded.max_blocks = move->kind->piece_blocks(move, report->fallback, sizeof report->fallback);
        bounded_plan.staged = bounded.max_blocks > 0 ? &bounded : NULL;
    }
    kv_device device;
    int rc = kv_device_enter(gpu, target, &device);
    if (rc == 0 && bounded_plan.staged != NULL)
        rc = kv_staging_run(gpu, device.ring, device.stream, move, &bounded_plan, report, &device.failure);
    else if (rc == 0)
        rc = 1;
    /* Not staged, or it cannot be (report->fallback says why): the kernel
     * alone. */
    if (rc > 0) {
        report->staged = 0;
        rc = launch_whole(device.ring, device.stream, move, bounded_plan.num_ctas, &device.failure);
    }
    return kv_device_leave(&device, rc);
}
