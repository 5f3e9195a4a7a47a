/* The host memory behind kvbm_ext.pinned_empty: an anonymous mapping (or a
 * named shared one, which host_shared.h maps and attaches) with huge pages,
 * placed on a NUMA node, first touched by parallel threads, and the record
 * of its registration with the driver (gpu.h).  Nothing here needs the
 * GIL: pinned_empty runs it with the GIL released, and the last owner to
 * let go of a pool may be a DLPack consumer on any thread. */
#ifndef KVBM_HOST_POOL_H
#define KVBM_HOST_POOL_H

#include <stdatomic.h>
#include <stddef.h>

#include "align.h"
#include "gpu.h"

typedef enum {
    KV_HUGE_TRANSPARENT, /* madvise(MADV_HUGEPAGE): the kernel backs the mapping with huge pages where it can */
    KV_HUGE_EXPLICIT,    /* MAP_HUGETLB: the pages reserved in /proc/sys/vm/nr_hugepages, or an error */
    KV_HUGE_NONE,        /* madvise(MADV_NOHUGEPAGE): base pages only */
} kv_huge_pages;

extern const char *const KV_HUGE_NAMES[3]; /* "transparent", "explicit", "none" */

/* The longest name of a shared region: one file name in /dev/shm (Linux's
 * NAME_MAX, which limits.h declares only with POSIX's feature macros). */
#define KV_SHARED_NAME_MAX 255

/* What the last owner of a pool calls once its memory is unmapped, to let
 * go of what the mapping came from (a shared region: kv_shared_attach sets
 * it), with the argument the pool keeps beside it.  0, or -1 with `why`. */
typedef int (*kv_host_release_hook)(void *arg, char *why, size_t why_size);

/* One mapping and its registration, owned by a HostBuffer while it is open
 * and by each DLPack export of it; the last owner unregisters and unmaps
 * (and calls its release hook, if any). */
typedef struct {
    atomic_long owners;
    char *base;
    size_t map_bytes;
    kv_host_registration registration;
    kv_host_release_hook release; /* NULL: an anonymous mapping, nothing to let go of */
    void *release_arg;
} kv_host_pool;

/* Maps at least `bytes` (at least KV_HOST_ALIGN; a multiple of it) as
 * *huge asks; *huge becomes what was taken: KV_HUGE_NONE where the system
 * does not give transparent huge pages (THP disabled or absent).  *unit
 * receives the huge page size the mapping is a multiple of (KV_HOST_ALIGN
 * but for explicit huge pages larger than that).  Returns 0, or an errno
 * with `why` saying what failed (nothing mapped). */
int kv_host_map(size_t bytes, kv_huge_pages *huge, char **base, size_t *map_bytes, size_t *unit, char *why,
                size_t why_size);

/* The NUMA nodes online, from /sys/devices/system/node/online (node 0 alone
 * where the system has no such file). */
#define KV_MAX_NODES 1024
typedef struct {
    unsigned long mask[KV_MAX_NODES / (8 * sizeof(unsigned long))];
    int count;
    char text[128]; /* as the file says it, e.g. "0-1" */
} kv_numa_nodes;

void kv_numa_online(kv_numa_nodes *nodes);
int kv_numa_has(const kv_numa_nodes *nodes, long node);

/* The node the PCI device `bus_id` ("0000:1b:00.0", any case) is attached
 * to, from sysfs; -1 where the system does not say. */
int kv_numa_node_of_pci(const char *bus_id);

/* Asks the kernel to take the pages of [base, base + bytes) from `node`
 * (mbind, MPOL_PREFERRED: from that node while it has free memory).  Call
 * before the first touch.  Returns 0 or an errno. */
int kv_numa_prefer(char *base, size_t bytes, int node);

/* Writes one byte per `page` bytes of [base, base + bytes) from `threads`
 * threads (the calling one among them), each a contiguous share of whole
 * `unit`s (the huge page size).  With `keep`, each write adds 0 atomically,
 * which keeps what another process sharing the memory wrote there.  Returns
 * the threads that ran: fewer where the memory has fewer units, or where a
 * thread could not be started (the calling thread then touches its share). */
int kv_host_touch(char *base, size_t bytes, size_t page, size_t unit, int threads, int keep);

/* The start of a small text file (a sysfs or /proc one), NUL-terminated.
 * 0, or -1 when it cannot be read. */
int kv_read_text(const char *path, char *buf, size_t size);

/* The CPUs this process may run on (sched_getaffinity), at least 1. */
int kv_cpu_count(void);

/* The bytes of memory a new mapping may take without the kernel reclaiming
 * from others or killing the process: MemAvailable, and the memory cgroup's
 * limit less its usage where /sys/fs/cgroup shows one.  -1 when unknown. */
long long kv_host_available(void);

/* Unmaps (and, when registered, first unregisters) a pool's memory, calls
 * its release hook and frees the pool.  Returns 0, or -1 when unregistering
 * or the hook failed (`why` says how; the memory is unmapped all the
 * same). */
int kv_host_pool_free(kv_host_pool *pool, char *why, size_t why_size);

/* Gives up one owner's hold: the last one frees the pool as
 * kv_host_pool_free does.  Returns what it returns, or 0 for an owner that
 * is not the last. */
int kv_host_pool_release(kv_host_pool *pool, char *why, size_t why_size);

#endif /* KVBM_HOST_POOL_H */
