/* A pool's memory in a named POSIX shared-memory object (/dev/shm/NAME),
 * which several processes map: kvbm_ext.pinned_empty(..., shared=NAME).
 *
 * Who holds a region is told by advisory locks (flock) on the object: each
 * mapping keeps the object open with a shared lock for as long as it lives,
 * and the kernel drops that lock when the process ends, however it ends.
 * So a region that no process maps is known for one (an exclusive lock
 * taken without waiting), and:
 *   - the last holder to let go unlinks the name (kv_shared_release, or
 *     kv_shared_at_exit for a process that exits normally still holding it);
 *   - a region left by processes that ended without letting go (killed,
 *     os._exit) is replaced by the next process that asks for the name;
 *   - a process never sees a region half made: the creator makes it as an
 *     unnamed file (O_TMPFILE), sizes it, places it and locks it before it
 *     links the name (linkat fails where another process linked first).
 * Unlinking is conditional on holding the exclusive lock and on the name
 * still linking the object (its link count), so that no process unlinks a
 * region another one made in its place.  Nothing here needs the GIL. */
#ifndef KVBM_HOST_SHARED_H
#define KVBM_HOST_SHARED_H

#include <stddef.h>
#include <sys/types.h>

#include "host_pool.h"

#define KV_SHM_DIR "/dev/shm"

typedef struct kv_shared_region {
    struct kv_shared_region *next;     /* the process's live regions (kv_shared_at_exit) */
    int fd;                            /* open, with a shared lock, while mapped */
    pid_t pid;                         /* the process that holds the lock (a forked child does not) */
    int created;                       /* this process made it */
    int replaced;                      /* ... in place of a region no process mapped */
    char name[KV_SHARED_NAME_MAX + 2]; /* "/NAME", as shm_open and shm_unlink take it */
} kv_shared_region;

typedef enum {
    KV_SHARED_MAPPED,
    KV_SHARED_FAILED,     /* a system call failed: `error` and `why` say which */
    KV_SHARED_OTHER_SIZE, /* a region of the name that processes map has another size: `found` */
    KV_SHARED_NO_ROOM,    /* the creator: more than the memory available (`found`), or /dev/shm's free space */
    KV_SHARED_NOT_PLACED, /* the creator: mbind failed for a node the caller named (`bind_error`) */
} kv_shared_outcome;

/* One kv_shared_map call: what it is asked, what it did. */
typedef struct {
    const char *name;   /* without the '/' */
    size_t bytes;       /* the mapping's size: a multiple of KV_HOST_ALIGN */
    kv_huge_pages huge; /* asked (transparent or none), then what was taken */
    int node, bind;     /* the creator places the pages on `node` where `bind` (mbind) */
    int named;          /* ... a node the caller named: failing to place it fails the call */
    kv_shared_region *region;
    char *base;
    int error, bind_error, shm_full;
    long long found;
    char why[256];
} kv_shared_map_args;

/* Maps the region `a->name` of `a->bytes`: joins it where a process maps
 * it, else makes it (replacing one that no process maps).  The creator's
 * pages are not touched yet; whoever touches them must keep what another
 * process may already have written (kv_host_touch with `keep`). */
kv_shared_outcome kv_shared_map(kv_shared_map_args *a);

/* Lets go of a region whose memory was unmapped: the last holder unlinks
 * the name.  Frees the region.  Returns 0, or -1 with `why` (the region is
 * freed all the same). */
int kv_shared_release(kv_shared_region *region, char *why, size_t why_size);

/* Makes `region` (mapped at pool->base) the pool's to let go of: its last
 * owner releases it, as kv_shared_release does, once the memory is
 * unmapped (kv_host_pool_free). */
void kv_shared_attach(kv_host_pool *pool, kv_shared_region *region);

/* Unlinks NAME (without the '/').  1 where it was unlinked, 0 where there
 * was none, -1 with `why` (errno's text) otherwise. */
int kv_shared_unlink(const char *name, char *why, size_t why_size);

/* At the end of a process that exits normally: for each region it still
 * maps, what kv_shared_release does but unmapping (the memory goes with the
 * process).  No locks of Python's: safe after the interpreter finalized. */
void kv_shared_at_exit(void);

/* The NUMA node whose memory a mapping of shared memory prefers
 * (get_mempolicy: the policy the creator set on the object), or -1. */
int kv_numa_policy_node(char *base);

#endif /* KVBM_HOST_SHARED_H */
