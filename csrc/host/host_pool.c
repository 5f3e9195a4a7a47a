/* The host memory behind kvbm_ext.pinned_empty: mapping, huge pages, NUMA
 * placement, the parallel first touch.  See host_pool.h. */
#define _GNU_SOURCE
#include "host_pool.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

const char *const KV_HUGE_NAMES[3] = {"transparent", "explicit", "none"};

#define KV_MPOL_PREFERRED 1 /* linux/mempolicy.h: no libnuma needed */

/* ------------------------------------------------------------ files */

int kv_read_text(const char *path, char *buf, size_t size)
{
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t n = 0;
    while (n + 1 < size) {
        const ssize_t got = read(fd, buf + n, size - 1 - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        n += (size_t)got;
    }
    close(fd);
    buf[n] = '\0';
    return n > 0 ? 0 : -1;
}

/* A number in a file (a sysfs or cgroup value); -1 when absent or not one
 * ("max"). */
static long long file_number(const char *path)
{
    char text[64];
    if (kv_read_text(path, text, sizeof text) < 0)
        return -1;
    char *end;
    errno = 0;
    const long long value = strtoll(text, &end, 10);
    return errno != 0 || end == text ? -1 : value;
}

/* A /proc/meminfo field in bytes, or -1. */
static long long meminfo_bytes(const char *field)
{
    char text[8192];
    if (kv_read_text("/proc/meminfo", text, sizeof text) < 0)
        return -1;
    const size_t n = strlen(field);
    for (const char *line = text; line != NULL; line = strchr(line, '\n')) {
        line += *line == '\n';
        if (strncmp(line, field, n) == 0 && line[n] == ':') {
            char *end;
            const long long value = strtoll(line + n + 1, &end, 10);
            return strncmp(end, " kB", 3) == 0 ? value * 1024 : value;
        }
    }
    return -1;
}

/* ------------------------------------------------------------ mapping */

/* Whether the kernel gives transparent huge pages to a mapping that asks. */
static int transparent_huge_pages_on(void)
{
    char text[128];
    return kv_read_text("/sys/kernel/mm/transparent_hugepage/enabled", text, sizeof text) == 0
           && strstr(text, "[never]") == NULL;
}

static int map_explicit(size_t bytes, char **base, size_t *map_bytes, size_t *unit, char *why, size_t why_size)
{
    const long long page = meminfo_bytes("Hugepagesize");
    *unit = page > (long long)KV_HOST_ALIGN ? (size_t)page : KV_HOST_ALIGN;
    const size_t size = kv_round_up(bytes, *unit);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
        const int error = errno;
        snprintf(why, why_size,
                 "cannot map %zu bytes of %lld kB huge pages (MAP_HUGETLB; HugePages_Free %lld of "
                 "HugePages_Total %lld): %s",
                 size, page / 1024, meminfo_bytes("HugePages_Free"), meminfo_bytes("HugePages_Total"), strerror(error));
        return error;
    }
    *base = p;
    *map_bytes = size;
    return 0;
}

/* An anonymous mapping aligned to KV_HOST_ALIGN: mapped one unit larger,
 * the ends trimmed. */
static int map_aligned(size_t bytes, char **base, size_t *map_bytes, char *why, size_t why_size)
{
    const size_t size = kv_round_up(bytes, KV_HOST_ALIGN);
    char *p = mmap(NULL, size + KV_HOST_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        const int error = errno;
        snprintf(why, why_size, "cannot map %zu bytes: %s", size, strerror(error));
        return error;
    }
    const size_t head = kv_round_up((size_t)p, KV_HOST_ALIGN) - (size_t)p;
    if (head > 0)
        munmap(p, head);
    if (KV_HOST_ALIGN - head > 0)
        munmap(p + head + size, KV_HOST_ALIGN - head);
    *base = p + head;
    *map_bytes = size;
    return 0;
}

int kv_host_map(size_t bytes, kv_huge_pages *huge, char **base, size_t *map_bytes, size_t *unit, char *why,
                size_t why_size)
{
    bytes = bytes > KV_HOST_ALIGN ? bytes : KV_HOST_ALIGN;
    *unit = KV_HOST_ALIGN;
    if (*huge == KV_HUGE_EXPLICIT)
        return map_explicit(bytes, base, map_bytes, unit, why, why_size);
    const int error = map_aligned(bytes, base, map_bytes, why, why_size);
    if (error != 0)
        return error;
    /* Failing advice is not an error: the pages are then base pages. */
    if (*huge == KV_HUGE_TRANSPARENT
        && (!transparent_huge_pages_on() || madvise(*base, *map_bytes, MADV_HUGEPAGE) != 0))
        *huge = KV_HUGE_NONE;
    else if (*huge == KV_HUGE_NONE)
        madvise(*base, *map_bytes, MADV_NOHUGEPAGE);
    return 0;
}

/* ------------------------------------------------------------ NUMA */

static void set_node(kv_numa_nodes *nodes, long node)
{
    const size_t bits = 8 * sizeof(unsigned long);
    if (node >= 0 && node < KV_MAX_NODES && !kv_numa_has(nodes, node)) {
        nodes->mask[node / bits] |= 1UL << (node % bits);
        nodes->count++;
    }
}

int kv_numa_has(const kv_numa_nodes *nodes, long node)
{
    const size_t bits = 8 * sizeof(unsigned long);
    return node >= 0 && node < KV_MAX_NODES && (nodes->mask[node / bits] >> (node % bits) & 1UL) != 0;
}

void kv_numa_online(kv_numa_nodes *nodes)
{
    memset(nodes, 0, sizeof *nodes);
    if (kv_read_text("/sys/devices/system/node/online", nodes->text, sizeof nodes->text) == 0) {
        nodes->text[strcspn(nodes->text, "\n")] = '\0';
        /* A list of ranges: "0", "0-3", "0-1,4". */
        for (char *at = nodes->text; *at;) {
            char *end;
            const long first = strtol(at, &end, 10);
            long last = first;
            if (end == at)
                break;
            if (*end == '-')
                last = strtol(end + 1, &end, 10);
            for (long node = first; node <= last && node < KV_MAX_NODES; node++)
                set_node(nodes, node);
            at = *end == ',' ? end + 1 : end;
            if (*end != ',')
                break;
        }
    }
    if (nodes->count == 0) {
        set_node(nodes, 0);
        snprintf(nodes->text, sizeof nodes->text, "0");
    }
}

int kv_numa_node_of_pci(const char *bus_id)
{
    unsigned domain, bus, device, function;
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4)
        return -1;
    char path[96];
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", domain, bus, device, function);
    const long long node = file_number(path);
    return node >= 0 && node < KV_MAX_NODES ? (int)node : -1;
}

int kv_numa_prefer(char *base, size_t bytes, int node)
{
    kv_numa_nodes mask;
    memset(&mask, 0, sizeof mask);
    set_node(&mask, node);
    /* The kernel reads maxnode - 1 bits. */
    if (syscall(SYS_mbind, base, bytes, KV_MPOL_PREFERRED, mask.mask, (unsigned long)KV_MAX_NODES + 1, 0) != 0)
        return errno;
    return 0;
}

/* ------------------------------------------------------------ first touch */

typedef struct {
    char *start;
    size_t bytes, page;
    int keep;
} kv_share;

static void touch(const kv_share *share)
{
    volatile char *bytes = share->start;
    if (share->keep) {
        for (size_t offset = 0; offset < share->bytes; offset += share->page)
            __atomic_fetch_add(&bytes[offset], 0, __ATOMIC_RELAXED);
        return;
    }
    for (size_t offset = 0; offset < share->bytes; offset += share->page)
        bytes[offset] = 0;
}

static void *touch_thread(void *share)
{
    touch(share);
    return NULL;
}

int kv_host_touch(char *base, size_t bytes, size_t page, size_t unit, int threads, int keep)
{
    const size_t units = bytes / unit;
    const size_t count = threads < 1 ? 1 : (size_t)threads < units ? (size_t)threads : units;
    kv_share *shares = malloc(count * sizeof *shares);
    pthread_t *ids = malloc(count * sizeof *ids);
    char *started = calloc(count, 1);
    pthread_attr_t attr;
    const int with_attr = pthread_attr_init(&attr) == 0;
    if (shares == NULL || ids == NULL || started == NULL || !with_attr) {
        touch(&(kv_share){base, bytes, page, keep});
        threads = 1;
        goto done;
    }
    pthread_attr_setstacksize(&attr, (size_t)256 << 10); /* the loop needs little; the default is 8 MiB */
    for (size_t i = 0, first = 0; i < count; i++) {
        const size_t mine = units / count + (i < units % count);
        shares[i] = (kv_share){base + first * unit, mine * unit, page, keep};
        first += mine;
    }
    threads = 1;
    for (size_t i = 1; i < count; i++) {
        started[i] = pthread_create(&ids[i], &attr, touch_thread, &shares[i]) == 0;
        threads += started[i];
    }
    touch(&shares[0]);
    for (size_t i = 1; i < count; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        else
            touch(&shares[i]);
    }
done:
    if (with_attr)
        pthread_attr_destroy(&attr);
    free(started);
    free(ids);
    free(shares);
    return threads;
}

int kv_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

/* ------------------------------------------------------------ limits, release */

/* The room under the memory cgroup's limit (v2, else v1), or -1. */
static long long cgroup_room(void)
{
    long long limit = file_number("/sys/fs/cgroup/memory.max");
    long long usage = file_number("/sys/fs/cgroup/memory.current");
    if (limit < 0 || usage < 0) {
        limit = file_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
        usage = file_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    }
    if (limit < 0 || usage < 0)
        return -1;
    return limit > usage ? limit - usage : 0;
}

long long kv_host_available(void)
{
    const long long available = meminfo_bytes("MemAvailable");
    const long long room = cgroup_room();
    if (available < 0 || room < 0)
        return available < 0 ? room : available;
    return available < room ? available : room;
}

int kv_host_pool_free(kv_host_pool *pool, char *why, size_t why_size)
{
    int rc = pool->registration.count > 0 ? kv_gpu_host_unregister(&pool->registration, why, why_size) : 0;
    munmap(pool->base, pool->map_bytes);
    /* The first failure is the one told. */
    char release_why[192];
    if (pool->release != NULL && pool->release(pool->release_arg, release_why, sizeof release_why) < 0 && rc == 0) {
        snprintf(why, why_size, "%s", release_why);
        rc = -1;
    }
    free(pool);
    return rc;
}

int kv_host_pool_release(kv_host_pool *pool, char *why, size_t why_size)
{
    if (atomic_fetch_sub_explicit(&pool->owners, 1, memory_order_acq_rel) != 1)
        return 0;
    return kv_host_pool_free(pool, why, why_size);
}
