/* kvbm_ext.pinned_empty: its arguments, the allocation (with the GIL
 * released) and its KVBM_EXT_DEBUG line.  See host_buffer.h, and
 * host_shared.h for shared regions. */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: its feature macros declare clock_gettime */

#include "host_buffer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "debug.h"
#include "host_shared.h"
#include "state.h"

/* The device the memory serves: the one asked, by default the current one;
 * -1 where there is none (the registration then says why). */
static int resolve_device(int asked, int *device)
{
    const int count = kv_gpu_device_count();
    *device = -1;
    if (count == 0)
        return 0;
    if (asked == KV_CURRENT_DEVICE) {
        *device = kv_gpu_current_device();
        return *device < 0 ? -1 : 0;
    }
    if (asked >= count) {
        PyErr_Format(PyExc_ValueError, "device: cuda:%d does not exist (%d CUDA devices)", asked, count);
        return -1;
    }
    *device = asked;
    return 0;
}

#define REGISTER_PIECE_VARIABLE "KVBM_EXT_HOST_REGISTER_PIECE"

/* The largest registration KVBM_EXT_HOST_REGISTER_PIECE allows (0: none). */
static int register_piece_limit(size_t *limit)
{
    const char *text = getenv(REGISTER_PIECE_VARIABLE);
    *limit = 0;
    if (text == NULL || text[0] == '\0')
        return 0;
    char *end;
    errno = 0;
    const unsigned long long bytes = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || text[0] < '0' || text[0] > '9' || bytes == 0 || bytes > (1ULL << 62)) {
        PyErr_Format(PyExc_ValueError, REGISTER_PIECE_VARIABLE "=%.40s: expected a positive number of bytes", text);
        return -1;
    }
    *limit = (size_t)(bytes + KV_HOST_ALIGN - 1) / KV_HOST_ALIGN * KV_HOST_ALIGN;
    return 0;
}

/* The bytes of one shape[0] slice (one element for 0 dimensions): a
 * registration in pieces keeps each inside one piece. */
static size_t leading_item_bytes(const kv_pool_request *r)
{
    size_t bytes = (size_t)r->dtype->dtype.bits / 8;
    for (int d = 1; d < r->ndim; d++)
        bytes *= (size_t)r->shape[d];
    return bytes;
}

/* Refuses memory that the machine does not have free, before mapping it:
 * touching it would make the kernel kill a process.  Explicit huge pages
 * come from their own reserve, which mmap itself checks. */
static int check_room(const kv_pool_request *r)
{
    if (r->huge == KV_HUGE_EXPLICIT)
        return 0;
    const long long available = kv_host_available();
    const long long needed = (r->nbytes > (int64_t)KV_HOST_ALIGN ? r->nbytes : (int64_t)KV_HOST_ALIGN);
    if (available < 0 || needed <= available)
        return 0;
    char shape[160];
    kv_format_shape(r->shape, r->ndim, shape, sizeof shape);
    PyErr_Format(PyExc_MemoryError,
                 "shape: %s of %s is %lld bytes, more than the %lld bytes of memory available "
                 "(MemAvailable in /proc/meminfo, within the memory cgroup's limit); nothing was mapped",
                 shape, r->dtype->name, (long long)r->nbytes, available);
    return -1;
}

/* ------------------------------------------------------------ placement */

/* Where the pages go, and what the debug line says of it. */
typedef struct {
    int node;  /* -1: nowhere in particular */
    int bind;  /* placed with mbind (the machine has more than one node) */
    int named; /* the caller named the node */
    char said[192];
} kv_placement;

static int choose_node(const kv_pool_request *r, int device, kv_placement *p)
{
    kv_numa_nodes nodes;
    kv_numa_online(&nodes);
    p->node = -1;
    p->bind = 0;
    p->named = r->numa_node >= 0;
    if (p->named && !kv_numa_has(&nodes, (long)r->numa_node)) {
        PyErr_Format(PyExc_ValueError, "numa_node: node %lld does not exist; this machine's nodes: %s",
                     (long long)r->numa_node, nodes.text);
        return -1;
    }
    char bus[32];
    if (nodes.count == 1) {
        for (p->node = 0; !kv_numa_has(&nodes, p->node); p->node++)
            ;
        snprintf(p->said, sizeof p->said, "node %d (one node)", p->node);
    }
    else if (p->named) {
        p->node = (int)r->numa_node;
        snprintf(p->said, sizeof p->said, "node %d (as asked)", p->node);
    }
    else if (device >= 0 && kv_gpu_pci_bus_id(device, bus, sizeof bus) == 0
             && (p->node = kv_numa_node_of_pci(bus)) >= 0)
        snprintf(p->said, sizeof p->said, "node %d (nearest cuda:%d)", p->node, device);
    else
        snprintf(p->said, sizeof p->said, "no node chosen (nodes %s; the GPU's is not known)", nodes.text);
    p->bind = nodes.count > 1 && p->node >= 0;
    return 0;
}

/* ------------------------------------------------------------ allocation */

typedef enum {
    KV_ALLOCATED,
    KV_FAILED_MAP,
    KV_FAILED_BIND,
    KV_FAILED_REGISTER,
    KV_FAILED_SHARED, /* shared_outcome says how */
    KV_FAILED_NODE    /* a shared region joined is not on the node asked */
} kv_outcome;

/* One allocation, run without the GIL: what it was asked, what it did. */
typedef struct {
    size_t bytes;
    kv_huge_pages huge; /* asked, then taken */
    const kv_placement *place;
    int device, threads;
    size_t piece_limit, item; /* item: the bytes of one leading-dimension slice */
    const char *shared;       /* the region's name, or NULL */
    kv_outcome outcome;
    kv_shared_outcome shared_outcome;
    kv_host_pool *pool;
    int threads_run, registered, bind_error, node; /* node: where the pages are placed, or -1 */
    int created, replaced, shm_full, error;
    long long found;
    double seconds;
    char why[256];
} kv_allocation;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Unmaps a pool not registered, lets go of its shared region, frees it. */
static void drop_mapping(kv_host_pool *pool)
{
    char why[192];
    kv_host_pool_free(pool, why, sizeof why);
}

/* An anonymous mapping, placed.  0, or -1 with the outcome (nothing mapped). */
static int map_private(kv_allocation *a, kv_host_pool *pool, size_t *unit)
{
    if (kv_host_map(a->bytes, &a->huge, &pool->base, &pool->map_bytes, unit, a->why, sizeof a->why) != 0)
        return -1;
    if (a->place->bind && (a->bind_error = kv_numa_prefer(pool->base, pool->map_bytes, a->place->node)) != 0
        && a->place->named) {
        a->outcome = KV_FAILED_BIND;
        munmap(pool->base, pool->map_bytes);
        return -1;
    }
    a->node = a->bind_error == 0 ? a->place->node : -1;
    return 0;
}

/* The shared region a->shared, made (and placed) or joined.  A process
 * that joins it takes the placement its maker chose: on a machine of
 * several nodes its node is the object's policy, and a node named that is
 * not that one fails the call.  0, or -1 with the outcome (nothing mapped). */
static int map_shared(kv_allocation *a, kv_host_pool *pool)
{
    kv_shared_map_args s;
    memset(&s, 0, sizeof s);
    s.name = a->shared;
    s.bytes = kv_round_up(a->bytes > KV_HOST_ALIGN ? a->bytes : KV_HOST_ALIGN, KV_HOST_ALIGN);
    s.huge = a->huge;
    s.node = a->place->node;
    s.bind = a->place->bind;
    s.named = a->place->named;
    a->shared_outcome = kv_shared_map(&s);
    a->huge = s.huge;
    a->bind_error = s.bind_error;
    a->found = s.found;
    a->shm_full = s.shm_full;
    a->error = s.error;
    snprintf(a->why, sizeof a->why, "%s", s.why);
    if (a->shared_outcome != KV_SHARED_MAPPED) {
        a->outcome = a->shared_outcome == KV_SHARED_NOT_PLACED ? KV_FAILED_BIND : KV_FAILED_SHARED;
        return -1;
    }
    pool->base = s.base;
    pool->map_bytes = s.bytes;
    a->created = s.region->created;
    a->replaced = s.region->replaced;
    const int one_node = !a->place->bind && a->place->node >= 0;
    a->node = a->created ? (a->bind_error == 0 ? a->place->node : -1)
              : one_node ? a->place->node
                         : kv_numa_policy_node(pool->base);
    if (!a->created && !one_node && a->place->named && a->node != a->place->node) {
        a->outcome = KV_FAILED_NODE;
        munmap(pool->base, pool->map_bytes);
        kv_shared_release(s.region, a->why, sizeof a->why);
        return -1;
    }
    kv_shared_attach(pool, s.region);
    return 0;
}

static void allocate(kv_allocation *a)
{
    const double start = now();
    kv_host_pool *pool = calloc(1, sizeof *pool);
    a->outcome = KV_FAILED_MAP;
    if (pool == NULL) {
        snprintf(a->why, sizeof a->why, "%s", strerror(ENOMEM));
        return;
    }
    size_t unit = KV_HOST_ALIGN;
    if ((a->shared != NULL ? map_shared(a, pool) : map_private(a, pool, &unit)) != 0) {
        free(pool);
        return;
    }
    /* A huge page the mapping is made of is allocated by its first write.
     * Shared pages may already hold what another process wrote: kept. */
    const size_t page = a->huge == KV_HUGE_EXPLICIT ? unit : (size_t)sysconf(_SC_PAGESIZE);
    a->threads_run = kv_host_touch(pool->base, pool->map_bytes, page, unit, a->threads, a->shared != NULL);
    a->registered = kv_gpu_host_register(a->device, pool->base, pool->map_bytes, a->piece_limit, a->item,
                                         &pool->registration, a->why, sizeof a->why);
    if (a->registered < 0) {
        a->outcome = KV_FAILED_REGISTER;
        drop_mapping(pool);
        return;
    }
    atomic_init(&pool->owners, 1);
    a->pool = pool;
    a->outcome = KV_ALLOCATED;
    a->seconds = now() - start;
}

/* The exception of a shared region that could not be mapped. */
static PyObject *raise_shared(const kv_pool_request *r, const kv_allocation *a, const char *shape)
{
    PyObject *name = PyUnicode_FromString(r->shared);
    if (name == NULL)
        return NULL;
    const long long map_bytes =
        (long long)kv_round_up(a->bytes > KV_HOST_ALIGN ? a->bytes : KV_HOST_ALIGN, KV_HOST_ALIGN);
    if (a->outcome == KV_FAILED_NODE)
        PyErr_Format(PyExc_ValueError,
                     "numa_node: the shared region %R is placed on node %d by the process that made it (-1: on no "
                     "node); this process asked for node %d; nothing was mapped",
                     name, a->node, a->place->node);
    else if (a->shared_outcome == KV_SHARED_OTHER_SIZE)
        PyErr_Format(PyExc_ValueError,
                     "shared: %R is %lld bytes in /dev/shm; this buffer maps %lld bytes (%lld bytes rounded up to 2 "
                     "MiB): the processes that share a region must ask for the same size; nothing was mapped",
                     name, a->found, map_bytes, (long long)r->nbytes);
    else if (a->shared_outcome == KV_SHARED_NO_ROOM && a->shm_full)
        PyErr_Format(PyExc_MemoryError,
                     "shared: %R: /dev/shm has %lld bytes free (the size of its tmpfs), fewer than the %lld bytes "
                     "this buffer maps; nothing was made",
                     name, a->found, map_bytes);
    else if (a->shared_outcome == KV_SHARED_NO_ROOM)
        PyErr_Format(PyExc_MemoryError,
                     "shape: %s of %s is %lld bytes, more than the %lld bytes of memory available "
                     "(MemAvailable in /proc/meminfo, within the memory cgroup's limit); nothing was mapped",
                     shape, r->dtype->name, (long long)r->nbytes, a->found);
    else
        kv_raise_os_error(a->error,
                          PyUnicode_FromFormat("shared: %R: %s; nothing was mapped or left in /dev/shm", name, a->why));
    Py_DECREF(name);
    return NULL;
}

/* The exception of a failed allocation, naming the argument at fault. */
static PyObject *raise_failure(const kv_pool_request *r, const kv_allocation *a)
{
    char shape[160];
    kv_format_shape(r->shape, r->ndim, shape, sizeof shape);
    switch (a->outcome) {
    case KV_FAILED_SHARED:
    case KV_FAILED_NODE: return raise_shared(r, a, shape);
    case KV_FAILED_BIND:
        return PyErr_Format(PyExc_OSError, "numa_node: cannot place the pages on node %d (mbind): %s", a->place->node,
                            strerror(a->bind_error));
    case KV_FAILED_REGISTER:
        return PyErr_Format(PyExc_RuntimeError,
                            "pinned_empty: %s of %s for cuda:%d: %s; nothing is left mapped or "
                            "registered",
                            shape, r->dtype->name, a->device, a->why);
    default:
        if (r->huge == KV_HUGE_EXPLICIT)
            return PyErr_Format(PyExc_MemoryError, "huge_pages='explicit': %s; nothing was mapped", a->why);
        return PyErr_Format(PyExc_MemoryError, "shape: %s of %s: %s; nothing was mapped", shape, r->dtype->name,
                            a->why);
    }
}

static void log_allocation(const kv_pool_request *r, const kv_allocation *a, const kv_host_buffer *self)
{
    if (!kv_debug_enabled())
        return;
    char pinned[320];
    if (a->registered == 0)
        snprintf(pinned, sizeof pinned, "pinned for cuda:%d (%d registration%s)", a->device,
                 a->pool->registration.count, a->pool->registration.count == 1 ? "" : "s");
    else
        snprintf(pinned, sizeof pinned, "not pinned: %s", a->why);
    char placed[224];
    if (a->bind_error != 0)
        snprintf(placed, sizeof placed, "not placed on node %d (mbind: %s)", a->place->node, strerror(a->bind_error));
    else if (a->shared != NULL && !a->created && a->place->bind)
        snprintf(placed, sizeof placed, "node %d (placed by the process that made it; -1: none)", a->node);
    else
        snprintf(placed, sizeof placed, "%s", a->place->said);
    char shared[KV_SHARED_NAME_MAX + 80] = "";
    if (a->shared != NULL)
        snprintf(shared, sizeof shared, ", shared '%s' (%s)", a->shared,
                 !a->created   ? "joined"
                 : a->replaced ? "created, in place of one no process mapped"
                               : "created");
    const int dropped = r->huge != (int)a->huge;
    kv_debug("pinned_empty: %lld bytes (%.2f GiB), huge pages %s%s, %s, %d threads, %.3f s, %s%s",
             (long long)self->nbytes, (double)self->nbytes / (1 << 30), KV_HUGE_NAMES[a->huge],
             !dropped            ? ""
             : a->shared != NULL ? " (shmem_enabled gives none here)"
                                 : " (transparent huge pages are off here)",
             placed, a->threads_run, a->seconds, pinned, shared);
}

/* ------------------------------------------------------------ pinned_empty */

static void describe_buffer(kv_host_buffer *self, const kv_pool_request *r, const kv_allocation *a)
{
    self->ndim = r->ndim;
    Py_ssize_t stride = r->dtype->dtype.bits / 8;
    for (int i = r->ndim - 1; i >= 0; i--) {
        self->shape[i] = (Py_ssize_t)r->shape[i];
        self->strides[i] = stride;
        stride *= (Py_ssize_t)r->shape[i];
    }
    self->nbytes = r->nbytes;
    self->dtype = r->dtype;
    self->pinned = a->registered == 0;
    self->numa_node = a->node;
    self->huge_pages = a->huge;
    self->threads = a->threads_run;
    self->seconds = a->seconds;
    self->created = a->shared == NULL || a->created;
}

/* A shared region this process still maps at a normal exit is unlinked if
 * it is the last to map it (kv_shared_at_exit, registered once). */
static void unlink_at_exit(void)
{
    static atomic_int registered;
    if (atomic_exchange(&registered, 1) == 0 && Py_AtExit(kv_shared_at_exit) < 0)
        kv_debug("pinned_empty: Py_AtExit's table is full: a shared region this process maps when it exits "
                 "stays in /dev/shm until the next pinned_empty of its name or unlink_shared");
}

const char kv_pinned_empty_doc[] = KV_PINNED_EMPTY_TEXT_SIGNATURE
    "A HostBuffer: a C-contiguous host array of `shape` and `dtype`, page-locked for\n"
    "the GPUs (pinned), fast to make at any size.  Its memory reads as zeros.\n\n"
    "The memory is an anonymous mapping aligned to 2 MiB, placed on a NUMA node,\n"
    "touched first by `threads` native threads at once with the GIL released, then\n"
    "registered with the CUDA driver (cudaHostRegister, portable: pinned for every\n"
    "device).  Without a GPU (a build without CUDA, no driver, no device) it is made\n"
    "the same way and not registered: `pinned` is False.\n\n"
    "shape: an int or a tuple of ints (at most 8 dimensions).\n"
    "dtype: a torch dtype (torch.bfloat16, torch.float8_e4m3fn, ...), a NumPy dtype\n"
    "    or scalar type, or a name (\"bfloat16\", \"float16\", \"uint8\", ...).\n"
    "numa_node: the node whose memory the pages come from (while it has free memory);\n"
    "    None: the node nearest the GPU `device` (sysfs); ValueError naming the\n"
    "    nodes that exist for another.\n"
    "threads: threads touching the pages first, 1 to 1024; None: the CPUs this\n"
    "    process may run on.\n"
    "huge_pages: \"transparent\" (madvise(MADV_HUGEPAGE); where the system gives none,\n"
    "    the buffer says huge_pages='none'), \"explicit\" (MAP_HUGETLB, from the pages\n"
    "    reserved in /proc/sys/vm/nr_hugepages; MemoryError where too few are free)\n"
    "    or \"none\".\n"
    "device: the CUDA device the memory serves (an int, \"cuda:N\" or a torch.device;\n"
    "    None: the current one): registered with it current, placed near it.\n"
    "shared: None (memory of this process alone), or a name: the memory is then the\n"
    "    POSIX shared-memory object /dev/shm/<name> of the mapped size (nbytes rounded\n"
    "    up to 2 MiB), mapped by every process that asks for the name and that size\n"
    "    (vLLM's tensor-parallel workers sharing one pool).  The first makes it (sized,\n"
    "    placed, touched), the others join it (`created` says which; ValueError naming\n"
    "    `shared` for another size); each registers its own mapping for `device`.  The\n"
    "    name is unlinked when the last process that maps it lets go (close(), the last\n"
    "    reference, a normal exit); one left by processes killed is replaced by the next\n"
    "    pinned_empty of the name, or removed by unlink_shared(name).  huge_pages=\n"
    "    \"explicit\" cannot be shared.\n\n"
    "MemoryError when the memory is not there (more than MemAvailable or the memory\n"
    "cgroup allows, or the mapping fails: errno's text), RuntimeError naming the CUDA\n"
    "error when registering fails; either way nothing is left mapped or registered.\n"
    "KVBM_EXT_DEBUG=1 logs bytes, huge pages, node, threads, seconds and whether it\n"
    "was pinned.  KVBM_EXT_HOST_REGISTER_PIECE=<bytes> registers in pieces of at most\n"
    "that size (where the driver refuses large registrations, pieces are made anyway);\n"
    "each shape[0] slice lies inside one piece (`registrations`).  A single copy-engine\n"
    "copy must not cross pieces: for a buffer of several, move with backend=\"kernel\".";

PyObject *kv_pinned_empty(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_pinned_empty_args given;
    kv_pool_request r;
    kv_placement place;
    kv_allocation a;
    memset(&a, 0, sizeof a);
    if (kv_parse_arguments(&kv_pinned_empty_signature, args, nargs, kwnames, &given) < 0
        || kv_read_pool_request(&given, &r) < 0 || resolve_device(r.device, &a.device) < 0
        || choose_node(&r, a.device, &place) < 0 || register_piece_limit(&a.piece_limit) < 0
        || (!r.is_shared && check_room(&r) < 0)) /* a shared region's maker checks, once it knows it makes it */
        return NULL;
    a.bytes = (size_t)r.nbytes;
    a.item = leading_item_bytes(&r);
    a.huge = (kv_huge_pages)r.huge;
    a.place = &place;
    a.threads = (int)r.threads;
    a.shared = r.is_shared ? r.shared : NULL;
    if (r.is_shared)
        unlink_at_exit();
    Py_BEGIN_ALLOW_THREADS
    allocate(&a);
    Py_END_ALLOW_THREADS
    if (a.outcome != KV_ALLOCATED)
        return raise_failure(&r, &a);
    const kv_state *state = PyModule_GetState(module);
    kv_host_buffer *self = kv_host_buffer_new((PyTypeObject *)state->host_buffer_type, a.pool);
    if (self == NULL) {
        char why[192];
        kv_host_pool_free(a.pool, why, sizeof why);
        return NULL;
    }
    describe_buffer(self, &r, &a);
    if (r.is_shared) {
        PyObject *name = PyUnicode_FromString(r.shared);
        if (name == NULL) {
            Py_DECREF(self); /* lets go of the memory */
            return NULL;
        }
        Py_SETREF(self->shared, name);
    }
    log_allocation(&r, &a, self);
    return (PyObject *)self;
}
