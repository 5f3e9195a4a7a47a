/* The route of every move on the GPU: which path carries the bytes (the
 * backend decision), the defaults that the options leave open (CTAs per
 * path, how a staged move is cut), and the KVBM_EXT_DEBUG line that says
 * what ran and why.  Every entry point that moves bytes on the GPU ends
 * here: the layout moves through kv_route_move (route -> stage -> launch
 * -> log), block <-> operational through kv_route_chunks, raw copies
 * through kv_route_pairs. */
#ifndef KVBM_ROUTE_H
#define KVBM_ROUTE_H

#include "options.h"
#include "target.h"

/* Runs a layout move, described for the whole call (`move`), on the
 * target, routed by `options`, and logs the path under KVBM_EXT_DEBUG as
 * `function`.  `staged` describes the pinned side for the staged path; NULL
 * when no pinned memory takes part, or when it cannot be staged
 * (`unstageable` says why).  Returns 0, or -1 with an exception. */
int kv_route_move(kv_gpu *gpu, const kv_target *target, const kv_move *move, const kv_staged *staged,
                  const char *unstageable, const kv_move_options *options, const char *function);

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
