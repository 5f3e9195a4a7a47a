/* The route of every move on the GPU: which path carries the bytes (the
 * backend decision), the defaults that the options leave open (CTAs per
 * path, how a staged move is cut), and the KVBM_EXT_DEBUG line that says
 * what ran and why.  Every entry point that moves bytes on the GPU ends
 * here: the layout moves through kv_run_move (route -> stage -> launch
 * -> log), block <-> operational through kv_route_chunks, raw copies
 * through kv_route_pairs. */
#ifndef KVBM_ROUTE_H
#define KVBM_ROUTE_H

#include "options.h"
#include "target.h"

/* What differs between the kinds of calls that end in kv_run_move, as
 * hooks on `call`: resolve_stream (NULL: none) settles the target's stream
 * for stream=None before anything runs on the GPU; plan_staging describes
 * the pinned side of the move for the staged path (gpu.h, kv_staged), its
 * unit addresses in `addresses` (room for `addresses` entries), and
 * returns NULL, or why the move cannot be staged. */
typedef struct {
    const void *call;
    int (*resolve_stream)(const void *call);
    int64_t addresses;
    const char *(*plan_staging)(const void *call, uint64_t *addresses, kv_staged *staged);
} kv_move_call;

/* Runs a layout move, described for the whole call (`move`): with its
 * kind's CPU twin when `target` is NULL (the GIL released for a large
 * one), else on the target, routed by `options`, staged as the call plans
 * where pinned host memory takes part, and logged under KVBM_EXT_DEBUG as
 * `function`.  The three kinds of calls (conversions, PagedKVCache's
 * moves, to_cache) end here once their move is described.  Returns 0, or
 * -1 with an exception. */
int kv_run_move(kv_gpu *gpu, const kv_target *target, const kv_move *move, const kv_move_call *call,
                const kv_move_options *options, const char *function);

/* Runs the chunk copies of a block <-> operational move (host lists,
 * checked) on the target.  Chunks move whole, so the copy engines need no
 * staging: "auto" picks them (cudaMemcpyBatchAsync) when pinned host
 * memory takes part and the batch API is there, because they leave the SMs
 * to the model; else the kernel, which beats the copy engines between
 * device buffers and pays no per-copy cost.  Returns 0, or -1. */
int kv_route_chunks(kv_gpu *gpu, const kv_target *target, kv_pairs *pairs, const kv_move_options *options,
                    const char *function);

/* Runs `pairs` with `engine` (kv_gpu_copy_pairs) and logs what ran: `reason`
 * when `engine` did, else why it fell back.  Returns 0, or -1. */
int kv_route_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine, int fallback,
                   const char *function, const char *reason);

#endif /* KVBM_ROUTE_H */
