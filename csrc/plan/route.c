/* The route of every move on the GPU.  See route.h. */
#include "route.h"

#include <stdio.h>
#include <string.h>

#include "debug.h"
#include "gil.h"

/* CTAs a kernel gets when pinned host memory takes part and num_ctas is
 * not given, the direct kernel and the staged permute alike: enough to keep
 * ahead of PCIe, few enough that a model running beside the transfer keeps
 * its SMs (benchmarks/README.md, "Defaults in the code"). */
#define KV_PINNED_NUM_CTAS 8

/* CTAs for the pieces at a staged call's ends (the one piece no copy
 * overlaps, an offload's first or an onload's last, and the ramp next to
 * it): their permutes add to the call's time where no copy hides them, and
 * they are a few MiB of a call, so they run wide. */
#define KV_EDGE_NUM_CTAS 32

/* How a staged call is cut (gpu.h, kv_cut): a lead piece small enough
 * that the copy engines start after a short permute, a ramp on the edge
 * CTAs, then pieces that double while a permute on KV_PINNED_NUM_CTAS
 * still hides behind the copy before it; fewer, larger pieces keep the
 * host's cost low.  piece_bytes is the staging's (half a lane). */
static const kv_cut PIECE_CUT = {
    .lead_bytes = KV_LEAD_BYTES, .ramp_bytes = (int64_t)4 << 20, .ramp_growth = 6, .growth = 2};

static const char *const ENGINE_NAMES[] = {"kernel", "async", "batch"};

/* The route of a layout move, and why. */
typedef struct {
    kv_move_plan plan;
    const char *why;
} kv_route;

static kv_route route_move(const kv_move_options *o, int pinned, const kv_staged *staged, const char *unstageable)
{
    kv_route route;
    memset(&route, 0, sizeof route);
    route.plan.num_ctas = o->num_ctas != 0 ? o->num_ctas : pinned ? KV_PINNED_NUM_CTAS : 0;
    route.plan.async_copies = o->backend == KV_BACKEND_ASYNC;
    if (o->backend == KV_BACKEND_KERNEL)
        route.why = pinned ? "requested; pinned host memory read directly" : "requested";
    else if (!pinned)
        route.why = o->backend == KV_BACKEND_AUTO ? "auto: device to device"
                                                  : "copy engines requested, but no pinned host memory takes part";
    else if (staged == NULL)
        route.why = unstageable;
    else {
        route.plan.staged = staged;
        route.plan.edge_num_ctas = o->num_ctas != 0 ? o->num_ctas : KV_EDGE_NUM_CTAS;
        route.plan.cut = PIECE_CUT;
        route.plan.deferred = o->deferred;
        route.why = o->backend == KV_BACKEND_AUTO ? "auto: pinned host memory takes part" : "requested";
    }
    return route;
}

/* The KVBM_EXT_DEBUG line of a layout move: the path that ran and why. */
static void log_move(const char *function, const kv_route *route, const kv_gpu_report *report, int device)
{
    if (!kv_debug_enabled())
        return;
    const kv_move_plan *plan = &route->plan;
    char bound[80];
    if (plan->num_ctas == 0)
        snprintf(bound, sizeof bound, "every CTA it needs");
    else if (report->staged && plan->edge_num_ctas != plan->num_ctas)
        snprintf(bound, sizeof bound, "at most %u CTAs, %u for the short pieces at the ends", plan->num_ctas,
                 plan->edge_num_ctas);
    else
        snprintf(bound, sizeof bound, "at most %u CTAs", plan->num_ctas);
    if (report->staged) {
        char lane[32];
        if (report->lane < 0)
            snprintf(lane, sizeof lane, "the graph-capture lane");
        else
            snprintf(lane, sizeof lane, "lane %d", report->lane);
        kv_debug("%s: path staged (%s; %lld pieces of up to %.2f MiB on %s, permute on %s, %s, %s, cuda:%d)", function,
                 route->why, (long long)report->pieces, (double)report->piece_bytes / (1 << 20), lane, bound,
                 plan->async_copies ? "one cudaMemcpyAsync per run" : "copy engines",
                 report->deferred ? "enqueued by the device's enqueue thread" : "enqueued by the caller", device);
    }
    else if (report->fallback[0] != '\0')
        kv_debug("%s: path kernel (cannot stage: %s; %s, cuda:%d)", function, report->fallback, bound, device);
    else
        kv_debug("%s: path kernel (%s; %s, cuda:%d)", function, route->why, bound, device);
}

static int route_and_run(kv_gpu *gpu, const kv_target *target, const kv_move *move, const kv_staged *staged,
                         const char *unstageable, const kv_move_options *options, const char *function)
{
    const kv_route route = route_move(options, target->pinned, staged, unstageable);
    kv_gpu_report report;
    memset(&report, 0, sizeof report);
    if (kv_gpu_move(gpu, &target->gpu, move, &route.plan, &report) < 0)
        return -1;
    log_move(function, &route, &report, target->gpu.device);
    return 0;
}

int kv_run_move(kv_gpu *gpu, const kv_target *target, const kv_move *move, const kv_move_call *call,
                const kv_move_options *options, const char *function)
{
    if (target == NULL) {
        PyThreadState *released = kv_release_gil_for(move->kind->cpu_bytes(move));
        move->kind->cpu(move);
        kv_retake_gil(released);
        return 0;
    }
    if (call->resolve_stream != NULL && call->resolve_stream(call->call) < 0)
        return -1;
    /* The staged path alone needs the pinned side described. */
    uint64_t *addresses = NULL;
    if (target->pinned
        && (addresses = PyMem_Malloc((size_t)(call->addresses > 0 ? call->addresses : 1) * sizeof *addresses))
               == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    kv_staged staged;
    memset(&staged, 0, sizeof staged);
    const char *unstageable = target->pinned ? call->plan_staging(call->call, addresses, &staged) : NULL;
    const int rc = route_and_run(gpu, target, move, target->pinned && unstageable == NULL ? &staged : NULL, unstageable,
                                 options, function);
    PyMem_Free(addresses);
    return rc;
}

int kv_route_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine, int fallback,
                   const char *function, const char *reason)
{
    kv_engine ran;
    char why[160];
    if (kv_gpu_copy_pairs(gpu, target, pairs, engine, fallback, &ran, why, sizeof why) < 0)
        return -1;
    const char *path = ran == KV_ENGINE_KERNEL ? "kernel" : "copy_engines";
    if (ran != engine)
        kv_debug("%s: path %s (backend %s, falling back from %s: %s)", function, path, ENGINE_NAMES[ran],
                 ENGINE_NAMES[engine], why);
    else
        kv_debug("%s: path %s (backend %s, %s, %lld copies on cuda:%d)", function, path, ENGINE_NAMES[ran], reason,
                 (long long)pairs->count, target->device);
    return 0;
}

int kv_route_chunks(kv_gpu *gpu, const kv_target *target, kv_pairs *pairs, const kv_move_options *options,
                    const char *function)
{
    const int over_pcie = target->pinned;
    pairs->num_ctas = options->num_ctas != 0 ? options->num_ctas : over_pcie ? KV_PINNED_NUM_CTAS : 0;
    switch (options->backend) {
    case KV_BACKEND_KERNEL: return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_KERNEL, 1, function, "requested");
    case KV_BACKEND_ASYNC: return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_ASYNC, 1, function, "requested");
    case KV_BACKEND_BATCH:
    case KV_BACKEND_COPY_ENGINES:
        return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_BATCH, 1, function, "requested");
    default: break;
    }
    if (!over_pcie)
        return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_KERNEL, 1, function, "auto: device to device");
    if (!kv_gpu_batch_available())
        return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_KERNEL, 1, function,
                              "auto: over PCIe, no cudaMemcpyBatchAsync");
    return kv_route_pairs(gpu, &target->gpu, pairs, KV_ENGINE_BATCH, 1, function, "auto: over PCIe");
}
