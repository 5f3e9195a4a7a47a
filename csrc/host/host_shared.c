/* A pool's memory in a named POSIX shared-memory object, mapped by several
 * processes, and the rule of its name's life.  See host_shared.h. */
#define _GNU_SOURCE
#include "host_shared.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KV_MPOL_PREFERRED 1 /* linux/mempolicy.h */
#define KV_MPOL_F_ADDR (1 << 1)
/* Rounds of open-or-create: one more each time another process made or
 * unlinked the name in between; so many only under a storm of them. */
#define KV_SHARED_ATTEMPTS 64

/* ------------------------------------------------------------ the live regions */

/* The regions this process maps, for kv_shared_at_exit. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static kv_shared_region *live;

static void remember(kv_shared_region *region)
{
    pthread_mutex_lock(&live_lock);
    region->next = live;
    live = region;
    pthread_mutex_unlock(&live_lock);
}

static void forget(kv_shared_region *region)
{
    pthread_mutex_lock(&live_lock);
    for (kv_shared_region **at = &live; *at != NULL; at = &(*at)->next) {
        if (*at == region) {
            *at = region->next;
            break;
        }
    }
    pthread_mutex_unlock(&live_lock);
}

/* ------------------------------------------------------------ locks, unlinking */

/* flock, again where a signal interrupted it. */
static int lock(int fd, int operation)
{
    int rc;
    while ((rc = flock(fd, operation)) != 0 && errno == EINTR)
        ;
    return rc;
}

static int say(char *why, size_t why_size, const char *format, ...)
{
    const int error = errno;
    va_list args;
    va_start(args, format);
    const int n = vsnprintf(why, why_size, format, args);
    va_end(args);
    if (n >= 0 && (size_t)n < why_size)
        snprintf(why + n, why_size - (size_t)n, ": %s", strerror(error));
    errno = error;
    return -1;
}

/* Unlinks the region's name where no other holder has it open (an
 * exclusive lock taken without waiting) and the name still links this
 * object.  0 (unlinked or not), or -1 with `why`. */
static int unlink_if_last(const kv_shared_region *region, char *why, size_t why_size)
{
    if (lock(region->fd, LOCK_EX | LOCK_NB) != 0)
        return errno == EWOULDBLOCK ? 0 : say(why, why_size, "locking " KV_SHM_DIR "%s (flock)", region->name);
    struct stat s;
    if (fstat(region->fd, &s) != 0)
        return say(why, why_size, "reading " KV_SHM_DIR "%s (fstat)", region->name);
    if (s.st_nlink > 0 && shm_unlink(region->name) != 0 && errno != ENOENT)
        return say(why, why_size, "unlinking " KV_SHM_DIR "%s (shm_unlink)", region->name);
    return 0;
}

/* Lets go of the region's object: unlinks it where this process was the
 * last holder (never from a forked child, which shares its parent's lock),
 * and closes it.  0, or -1 with `why`. */
static int let_go(kv_shared_region *region, char *why, size_t why_size)
{
    if (region->fd < 0)
        return 0;
    int rc = region->pid == getpid() ? unlink_if_last(region, why, why_size) : 0;
    if (close(region->fd) != 0 && rc == 0)
        rc = say(why, why_size, "closing " KV_SHM_DIR "%s", region->name);
    region->fd = -1;
    return rc;
}

int kv_shared_release(kv_shared_region *region, char *why, size_t why_size)
{
    forget(region);
    const int rc = let_go(region, why, why_size);
    free(region);
    return rc;
}

/* The pool's release hook: its argument is the region. */
static int release_region(void *region, char *why, size_t why_size) { return kv_shared_release(region, why, why_size); }

void kv_shared_attach(kv_host_pool *pool, kv_shared_region *region)
{
    pool->release = release_region;
    pool->release_arg = region;
}

void kv_shared_at_exit(void)
{
    pthread_mutex_lock(&live_lock);
    for (kv_shared_region *region = live; region != NULL; region = region->next) {
        char why[192];
        if (region->pid == getpid() && unlink_if_last(region, why, sizeof why) < 0)
            fprintf(stderr, "kvbm_ext: at exit, the shared region %s: %s\n", region->name + 1, why);
    }
    live = NULL;
    pthread_mutex_unlock(&live_lock);
}

int kv_shared_unlink(const char *name, char *why, size_t why_size)
{
    char path[KV_SHARED_NAME_MAX + 2];
    snprintf(path, sizeof path, "/%s", name);
    if (shm_unlink(path) == 0)
        return 1;
    return errno == ENOENT ? 0 : say(why, why_size, "cannot unlink " KV_SHM_DIR "%s (shm_unlink)", path);
}

/* ------------------------------------------------------------ mapping */

static kv_shared_outcome failed(kv_shared_map_args *a, const char *format, ...)
{
    a->error = errno;
    va_list args;
    va_start(args, format);
    const int n = vsnprintf(a->why, sizeof a->why, format, args);
    va_end(args);
    if (n >= 0 && (size_t)n < sizeof a->why)
        snprintf(a->why + n, sizeof a->why - (size_t)n, ": %s", strerror(a->error));
    return KV_SHARED_FAILED;
}

/* A shared mapping of `fd`'s first `bytes`, aligned to KV_HOST_ALIGN: an
 * address range reserved one unit larger, the object mapped over its
 * aligned part, the ends given back.  MAP_FAILED with errno on failure. */
static char *map_aligned_shared(int fd, size_t bytes)
{
    char *reserve = mmap(NULL, bytes + KV_HOST_ALIGN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reserve == MAP_FAILED)
        return MAP_FAILED;
    const size_t head = kv_round_up((size_t)reserve, KV_HOST_ALIGN) - (size_t)reserve;
    char *base = reserve + head;
    if (mmap(base, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        const int error = errno;
        munmap(reserve, bytes + KV_HOST_ALIGN);
        errno = error;
        return MAP_FAILED;
    }
    if (head > 0)
        munmap(reserve, head);
    if (KV_HOST_ALIGN - head > 0)
        munmap(base + bytes, KV_HOST_ALIGN - head);
    return base;
}

/* Whether shared memory gets transparent huge pages, where a mapping asks
 * (shmem_enabled: always, within_size, advise or force). */
static int shmem_huge_pages_on(void)
{
    char text[128];
    if (kv_read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled", text, sizeof text) < 0)
        return 0;
    return strstr(text, "[always]") != NULL || strstr(text, "[within_size]") != NULL || strstr(text, "[advise]") != NULL
           || strstr(text, "[force]") != NULL;
}

/* Maps the region whose object is open (and locked) in a->region->fd. */
static kv_shared_outcome map_region(kv_shared_map_args *a)
{
    a->base = map_aligned_shared(a->region->fd, a->bytes);
    if (a->base == MAP_FAILED) {
        a->base = NULL;
        return failed(a, "cannot map %zu bytes of " KV_SHM_DIR "%s (mmap)", a->bytes, a->region->name);
    }
    /* Advice that fails is not an error: the pages are then base pages. */
    if (a->huge == KV_HUGE_TRANSPARENT && (!shmem_huge_pages_on() || madvise(a->base, a->bytes, MADV_HUGEPAGE) != 0))
        a->huge = KV_HUGE_NONE;
    else if (a->huge == KV_HUGE_NONE)
        madvise(a->base, a->bytes, MADV_NOHUGEPAGE);
    remember(a->region);
    return KV_SHARED_MAPPED;
}

/* Whether a new object of a->bytes fits: the memory available, and the
 * free space of /dev/shm (a tmpfs: touching a page past it is SIGBUS). */
static int room_for(kv_shared_map_args *a, int fd, kv_shared_outcome *out)
{
    const long long available = kv_host_available();
    struct statvfs s;
    if (available >= 0 && (long long)a->bytes > available) {
        a->found = available;
        *out = KV_SHARED_NO_ROOM;
        return -1;
    }
    if (fstatvfs(fd, &s) != 0) {
        *out = failed(a, "cannot read the free space of " KV_SHM_DIR " (fstatvfs)");
        return -1;
    }
    const unsigned long long free_bytes = (unsigned long long)s.f_bavail * s.f_frsize;
    if (s.f_blocks > 0 && free_bytes < a->bytes) { /* f_blocks 0: a tmpfs without a size limit */
        a->found = (long long)free_bytes;
        a->shm_full = 1;
        *out = KV_SHARED_NO_ROOM;
        return -1;
    }
    return 0;
}

/* The creator places the pages before any process touches one: mbind over
 * a mapping of its own sets the object's shared policy, which every
 * mapping's faults follow. */
static int place(kv_shared_map_args *a, int fd, kv_shared_outcome *out)
{
    if (!a->bind)
        return 0;
    char *base = map_aligned_shared(fd, a->bytes);
    if (base == MAP_FAILED) {
        *out = failed(a, "cannot map %zu bytes of a new object in " KV_SHM_DIR " (mmap)", a->bytes);
        return -1;
    }
    a->bind_error = kv_numa_prefer(base, a->bytes, a->node);
    munmap(base, a->bytes);
    if (a->bind_error != 0 && a->named) {
        *out = KV_SHARED_NOT_PLACED;
        return -1;
    }
    return 0;
}

/* The creator's object, opened again by its name and locked so, so that
 * its mapping shows the name (in /proc/PID/maps, to fuser and lsof) rather
 * than the unnamed file's.  Where the name no longer links the object (an
 * unlink_shared right after the link), the unnamed file serves. */
static int reopen_by_name(const char *name, int fd)
{
    const int named = shm_open(name, O_RDWR, 0);
    struct stat mine, theirs;
    if (named >= 0 && fstat(fd, &mine) == 0 && fstat(named, &theirs) == 0 && mine.st_dev == theirs.st_dev
        && mine.st_ino == theirs.st_ino && lock(named, LOCK_SH) == 0) {
        close(fd);
        return named;
    }
    if (named >= 0)
        close(named);
    return fd;
}

/* Makes the object unnamed (O_TMPFILE), sized, placed and locked, then
 * links the name to it.  0 with a->region->fd open and locked, 1 where
 * another process linked the name first (join that one), -1 with *out. */
static int create(kv_shared_map_args *a, kv_shared_outcome *out)
{
    kv_shared_region *region = a->region;
    const int fd = open(KV_SHM_DIR, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
        *out = failed(a, "cannot make an object in " KV_SHM_DIR " (open, O_TMPFILE)");
        return -1;
    }
    char proc[64], path[sizeof KV_SHM_DIR + KV_SHARED_NAME_MAX + 2];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    snprintf(path, sizeof path, KV_SHM_DIR "%s", region->name);
    int rc = room_for(a, fd, out) < 0 ? -1 : 0;
    if (rc == 0 && ftruncate(fd, (off_t)a->bytes) != 0) {
        *out = failed(a, "cannot size a new object in " KV_SHM_DIR " to %zu bytes (ftruncate)", a->bytes);
        rc = -1;
    }
    rc = rc == 0 ? place(a, fd, out) : rc;
    if (rc == 0 && lock(fd, LOCK_SH) != 0) {
        *out = failed(a, "cannot lock a new object in " KV_SHM_DIR " (flock)");
        rc = -1;
    }
    if (rc == 0 && linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW) != 0) {
        rc = errno == EEXIST ? 1 : -1;
        if (rc < 0)
            *out = failed(a, "cannot link %s to a new object (linkat)", path);
    }
    if (rc != 0) {
        close(fd);
        return rc;
    }
    region->fd = reopen_by_name(region->name, fd);
    region->created = 1;
    return 0;
}

/* The name is taken: joins the region where a process holds it, else
 * unlinks it (a region nobody maps).  0 with a->region->fd open and
 * locked, 1 to start again (create), -1 with *out.  Takes `fd`. */
static int join(kv_shared_map_args *a, int fd, int *removed, kv_shared_outcome *out)
{
    const char *name = a->region->name;
    struct stat s;
    int rc = 0;
    if (lock(fd, LOCK_EX | LOCK_NB) == 0) {
        /* No process holds it: left behind.  Gone already where nlink is 0. */
        if (fstat(fd, &s) != 0)
            rc = -1, *out = failed(a, "cannot read " KV_SHM_DIR "%s (fstat)", name);
        else if (s.st_nlink > 0 && shm_unlink(name) != 0 && errno != ENOENT)
            rc = -1, *out = failed(a, "cannot unlink " KV_SHM_DIR "%s, which no process maps (shm_unlink)", name);
        else
            rc = 1, *removed |= s.st_nlink > 0;
    }
    else if (errno != EWOULDBLOCK || lock(fd, LOCK_SH) != 0)
        rc = -1, *out = failed(a, "cannot lock " KV_SHM_DIR "%s (flock)", name);
    else if (fstat(fd, &s) != 0)
        rc = -1, *out = failed(a, "cannot read " KV_SHM_DIR "%s (fstat)", name);
    else if (s.st_nlink == 0)
        rc = 1; /* its last holder unlinked it while this process waited for the lock */
    else if ((unsigned long long)s.st_size != a->bytes) {
        a->found = (long long)s.st_size;
        rc = -1, *out = KV_SHARED_OTHER_SIZE;
    }
    if (rc != 0)
        close(fd);
    else
        a->region->fd = fd;
    return rc;
}

kv_shared_outcome kv_shared_map(kv_shared_map_args *a)
{
    kv_shared_region *region = calloc(1, sizeof *region);
    if (region == NULL) {
        errno = ENOMEM;
        return failed(a, "shared region");
    }
    snprintf(region->name, sizeof region->name, "/%s", a->name);
    region->fd = -1;
    region->pid = getpid();
    a->region = region;
    kv_shared_outcome out = KV_SHARED_FAILED;
    int removed = 0, rc = 1;
    for (int attempt = 0; rc == 1 && attempt < KV_SHARED_ATTEMPTS; attempt++) {
        const int fd = shm_open(region->name, O_RDWR, 0);
        if (fd >= 0)
            rc = join(a, fd, &removed, &out);
        else if (errno == ENOENT)
            rc = create(a, &out);
        else
            rc = -1, out = failed(a, "cannot open " KV_SHM_DIR "%s (shm_open)", region->name);
    }
    if (rc == 1) {
        errno = EAGAIN;
        out = failed(a, "other processes made and unlinked " KV_SHM_DIR "%s %d times while this one tried",
                     region->name, KV_SHARED_ATTEMPTS);
    }
    else if (rc == 0) {
        region->replaced = region->created && removed;
        out = map_region(a);
    }
    if (out != KV_SHARED_MAPPED) {
        char why[192];
        let_go(region, why, sizeof why); /* unlinks what this call made and linked */
        free(region);
        a->region = NULL;
    }
    return out;
}

int kv_numa_policy_node(char *base)
{
    kv_numa_nodes mask;
    int mode = 0;
    memset(&mask, 0, sizeof mask);
    if (syscall(SYS_get_mempolicy, &mode, mask.mask, (unsigned long)KV_MAX_NODES + 1, base, KV_MPOL_F_ADDR) != 0
        || mode != KV_MPOL_PREFERRED)
        return -1;
    for (int node = 0; node < KV_MAX_NODES; node++)
        if (kv_numa_has(&mask, node))
            return node;
    return -1;
}
