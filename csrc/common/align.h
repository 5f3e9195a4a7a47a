/* The boundary host memory is mapped on and registered in pieces of, and
 * rounding up to it: what the pinned pool (host/host_pool.h) and its
 * registration with the driver (gpu/gpu_host.c) agree on. */
#ifndef KVBM_ALIGN_H
#define KVBM_ALIGN_H

#include <stddef.h>

/* Mappings start and end on this boundary (the usual huge page size on
 * x86-64 and arm64), so that transparent huge pages can back all of one
 * and the touching threads' shares never split a huge page. */
#define KV_HOST_ALIGN ((size_t)2 << 20)

/* `n` rounded up to a multiple of `unit`. */
static inline size_t kv_round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

#endif /* KVBM_ALIGN_H */
