/* Where one call's work goes, worked out once from its arrays, by every
 * entry point that moves arrays (convert.c, paged_call.c, and copy.c for
 * its device-resident lists): the device every device array is on, with no
 * pageable host memory beside it; whether pinned host memory takes part;
 * the stream (for stream=None, the arrays' framework's current one); the
 * producers' streams the call orders first. */
#ifndef KVBM_TARGET_H
#define KVBM_TARGET_H

#include "gpu.h"
#include "stream.h"

typedef struct {
    kv_gpu_target gpu;   /* what the GPU entry points take; producers point into `producers` */
    intptr_t *producers; /* owned */
    Py_ssize_t capacity;
    int pinned; /* pinned host memory takes part */
    /* What fixed the device, named in errors about other arrays: a phrase
     * ("the cache is", "the call runs"), or, when NULL, the array at
     * `first`. */
    const char *owner;
    kv_path first;
} kv_target;

/* A target on `stream` of `device` (-1: fixed later by
 * kv_target_fix_device), `owner` saying in errors what fixed it. */
void kv_target_init(kv_target *t, intptr_t stream, int device, const char *owner);

/* Locates `a`, an array whose protocol says it is in device memory, and
 * fixes the call's device to its device, naming it `path` in errors about
 * other arrays.  The device stays unfixed when `a` turns out to be pinned
 * host memory.  Returns 0, or -1 with an exception. */
int kv_target_fix_device(kv_target *t, kv_array *a, const kv_path *path);

/* Places one array of a call whose device is fixed: locates it
 * (kv_gpu_locate), refuses device memory of another device and pageable
 * host memory (ValueError naming `path`), and lists its producer's stream
 * to be ordered first.  Returns 0, or -1 with an exception. */
int kv_target_add(kv_target *t, kv_array *a, const kv_path *path);

/* Some of a call's arrays, asked in turn for the stream of stream=None. */
typedef struct {
    const kv_array *arrays;
    Py_ssize_t count;
} kv_array_group;

/* For stream=None (the target's stream is KV_STREAM_CURRENT), the stream of
 * the first group, in order of preference, that names one other than the
 * legacy default stream: the current stream on the call's device of its
 * first array read through a C exchange API (torch:
 * torch.cuda.current_stream(), which `with torch.cuda.stream(s)` sets),
 * else the stream its first device array's producer named (CAI v3); else
 * the legacy default stream.  A stream the caller gave is kept.  Returns 0,
 * or -1 with an exception. */
int kv_target_resolve_stream(kv_target *t, const kv_array_group *groups, int count);

void kv_target_release(kv_target *t);

/* For `function`, which runs only on a CUDA device (`why` says what needs
 * one): 0 when one is visible, else -1 with RuntimeError saying that none is
 * (no GPU, no usable driver) or that this build has no CUDA. */
int kv_require_device(const char *function, const char *why);

#endif /* KVBM_TARGET_H */
