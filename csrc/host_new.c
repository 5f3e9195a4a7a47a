/* kvbm_ext.pinned_empty: its arguments, the allocation (with the GIL
 * released) and its KVBM_EXT_DEBUG line.  See host_buffer.h. */
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
#include "dlpack.h"

static const kv_host_dtype DTYPES[] = {
    {"bool", {kDLBool, 8}, "|b1", "?"},
    {"uint8", {kDLUInt, 8}, "|u1", "B"},
    {"int8", {kDLInt, 8}, "|i1", "b"},
    {"uint16", {kDLUInt, 16}, "<u2", "H"},
    {"int16", {kDLInt, 16}, "<i2", "h"},
    {"uint32", {kDLUInt, 32}, "<u4", "I"},
    {"int32", {kDLInt, 32}, "<i4", "i"},
    {"uint64", {kDLUInt, 64}, "<u8", "Q"},
    {"int64", {kDLInt, 64}, "<i8", "q"},
    {"float16", {kDLFloat, 16}, "<f2", "e"},
    {"float32", {kDLFloat, 32}, "<f4", "f"},
    {"float64", {kDLFloat, 64}, "<f8", "d"},
    {"bfloat16", {kDLBfloat, 16}, "<u2", "H"},
    {"float8_e4m3fn", {kDLFloat8_e4m3fn, 8}, "|u1", "B"},
    {"float8_e4m3fnuz", {kDLFloat8_e4m3fnuz, 8}, "|u1", "B"},
    {"float8_e5m2", {kDLFloat8_e5m2, 8}, "|u1", "B"},
    {"float8_e5m2fnuz", {kDLFloat8_e5m2fnuz, 8}, "|u1", "B"},
    {"float8_e8m0fnu", {kDLFloat8_e8m0fnu, 8}, "|u1", "B"},
};
#define DTYPE_COUNT ((int)(sizeof DTYPES / sizeof DTYPES[0]))

#define CURRENT_DEVICE (-1)
#define REGISTER_PIECE_VARIABLE "KVBM_EXT_HOST_REGISTER_PIECE"

/* ------------------------------------------------------------ arguments */

/* What pinned_empty was asked for, read and checked before anything is
 * mapped. */
typedef struct {
    int ndim;
    int64_t shape[KV_MAX_NDIM];
    int64_t nbytes;
    const kv_host_dtype *dtype;
    int64_t numa_node; /* -1: not named */
    int64_t threads;
    int huge; /* a kv_huge_pages */
    int device; /* CURRENT_DEVICE or an index */
} kv_pool_request;

static int read_shape(PyObject *shape, kv_pool_request *r)
{
    const kv_path whole = {"shape", {0}, 0};
    if (PyIndex_Check(shape)) {
        r->ndim = 1;
        return kv_int64(shape, &whole, "an int or a tuple of ints", 0, INT64_MAX, &r->shape[0]);
    }
    PyObject *items = kv_as_sequence(shape, &whole, "an int or a tuple of ints");
    if (items == NULL)
        return -1;
    const Py_ssize_t ndim = PyTuple_GET_SIZE(items);
    int rc = ndim > KV_MAX_NDIM ? kv_path_error(PyExc_ValueError, &whole, "%zd dimensions; at most %d", ndim,
                                                KV_MAX_NDIM)
                                : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < ndim; i++) {
        const kv_path path = {"shape", {i}, 1};
        rc = kv_int64(PyTuple_GET_ITEM(items, i), &path, "an int", 0, INT64_MAX, &r->shape[i]);
    }
    r->ndim = (int)ndim;
    Py_DECREF(items);
    return rc;
}

/* The name `dtype` spells, as a str (new reference): a str; torch's dtype
 * by its str(), "torch.<name>"; a type (NumPy's scalar types) by its
 * __name__; else by its `name` attribute (NumPy's dtypes). */
static PyObject *dtype_text(PyObject *dtype)
{
    PyObject *text;
    if (PyUnicode_Check(dtype))
        text = Py_NewRef(dtype);
    else if (strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") == 0)
        text = PyObject_Str(dtype);
    else
        text = PyObject_GetAttrString(dtype, PyType_Check(dtype) ? "__name__" : "name");
    if (text != NULL && PyUnicode_Check(text))
        return text;
    const kv_path path = {"dtype", {0}, 0};
    const char *expected = "expected a torch dtype, a NumPy dtype or a name such as 'bfloat16', got %s";
    if (text == NULL)
        kv_path_error_from(PyExc_TypeError, &path, expected, Py_TYPE(dtype)->tp_name);
    else
        kv_path_error(PyExc_TypeError, &path, expected, Py_TYPE(dtype)->tp_name);
    Py_XDECREF(text);
    return NULL;
}

/* The element type `dtype` names.  torch's names lose their "torch."
 * prefix, a type's its trailing "_" (numpy.bool_). */
static const kv_host_dtype *read_dtype(PyObject *dtype)
{
    PyObject *text = dtype_text(dtype);
    if (text == NULL)
        return NULL;
    Py_ssize_t n = 0;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL)
        PyErr_Clear(); /* a lone surrogate: a name that matches nothing */
    else if (!PyUnicode_Check(dtype) && strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") == 0 && n > 6
             && memcmp(s, "torch.", 6) == 0) {
        s += 6;
        n -= 6;
    }
    else if (PyType_Check(dtype) && n > 1 && s[n - 1] == '_')
        n--;
    for (int i = 0; s != NULL && i < DTYPE_COUNT; i++) {
        if ((size_t)n == strlen(DTYPES[i].name) && memcmp(s, DTYPES[i].name, (size_t)n) == 0) {
            Py_DECREF(text);
            return &DTYPES[i];
        }
    }
    /* An exact copy to show: a str subclass's __repr__ is not run. */
    PyObject *shown = PyUnicode_Substring(text, 0, PyUnicode_GET_LENGTH(text));
    Py_DECREF(text);
    if (shown != NULL) {
        PyErr_Format(PyExc_ValueError, "dtype: %R is not an element type pinned_empty makes; it makes bool, "
                     "(u)int8/16/32/64, float16/32/64, bfloat16 and float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, "
                     "float8_e5m2fnuz, float8_e8m0fnu", shown);
        Py_DECREF(shown);
    }
    return NULL;
}

/* The device argument: None (the current device), an int, or "cuda" /
 * "cuda:N" as a str or a torch.device. */
static int read_device(PyObject *device, int *out)
{
    const kv_path path = {"device", {0}, 0};
    *out = CURRENT_DEVICE;
    if (device == NULL || device == Py_None)
        return 0;
    if (PyIndex_Check(device)) {
        int64_t index;
        if (kv_int64(device, &path, "an int", 0, INT32_MAX, &index) < 0)
            return -1;
        *out = (int)index;
        return 0;
    }
    const int is_torch = strcmp(Py_TYPE(device)->tp_name, "torch.device") == 0;
    PyObject *text = PyUnicode_Check(device) ? Py_NewRef(device) : is_torch ? PyObject_Str(device) : NULL;
    const char *s = text != NULL && PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : NULL;
    char *end = NULL;
    long index = CURRENT_DEVICE;
    if (s != NULL && strncmp(s, "cuda", 4) == 0 && (s[4] == '\0' || (s[4] == ':' && s[5] >= '0' && s[5] <= '9'))) {
        index = s[4] == '\0' ? CURRENT_DEVICE : strtol(s + 5, &end, 10);
        if (end != NULL && (*end != '\0' || end - (s + 5) > 9))
            s = NULL;
    }
    else
        s = NULL;
    Py_XDECREF(text);
    if (s == NULL) {
        PyErr_Clear();
        return kv_path_error(PyExc_ValueError, &path, "expected None, an int, 'cuda' or 'cuda:N' (a str or a "
                             "torch.device), got %s", Py_TYPE(device)->tp_name);
    }
    *out = (int)index;
    return 0;
}

static int read_request(PyObject *const *v, kv_pool_request *r)
{
    static const char *const huge_names[] = {"transparent", "explicit", "none"};
    if (read_shape(v[0], r) < 0 || (r->dtype = read_dtype(v[1])) == NULL
        || kv_parse_int(v[2], "numa_node", 0, KV_MAX_NODES - 1, -1, 1, &r->numa_node) < 0
        || kv_parse_int(v[3], "threads", 1, 1024, 0, 1, &r->threads) < 0
        || kv_parse_name(v[4], "huge_pages", huge_names, 3, KV_HUGE_TRANSPARENT, &r->huge) < 0
        || read_device(v[5], &r->device) < 0)
        return -1;
    int64_t count = 1;
    int overflow = 0;
    for (int i = 0; i < r->ndim; i++)
        overflow |= __builtin_mul_overflow(count, r->shape[i], &count);
    for (int i = 0; i < r->ndim; i++)
        if (r->shape[i] == 0)
            count = overflow = 0;
    if (overflow || __builtin_mul_overflow(count, (int64_t)(r->dtype->dtype.bits / 8), &r->nbytes)
        || r->nbytes > INT64_MAX - (int64_t)(2 * KV_HOST_ALIGN)) {
        char shape[160];
        kv_format_shape(r->shape, r->ndim, shape, sizeof shape);
        PyErr_Format(PyExc_ValueError, "shape: %s of %s holds more than 2**63 bytes", shape, r->dtype->name);
        return -1;
    }
    if (r->threads == 0)
        r->threads = kv_cpu_count();
    return 0;
}

/* The device the memory serves: the one asked, by default the current one;
 * -1 where there is none (the registration then says why). */
static int resolve_device(int asked, int *device)
{
    const int count = kv_gpu_device_count();
    *device = -1;
    if (count == 0)
        return 0;
    if (asked == CURRENT_DEVICE) {
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
    PyErr_Format(PyExc_MemoryError, "shape: %s of %s is %lld bytes, more than the %lld bytes of memory available "
                 "(MemAvailable in /proc/meminfo, within the memory cgroup's limit); nothing was mapped", shape,
                 r->dtype->name, (long long)r->nbytes, available);
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
    else if (device >= 0 && kv_gpu_pci_bus_id(device, bus, sizeof bus) == 0 && (p->node = kv_numa_node_of_pci(bus)) >= 0)
        snprintf(p->said, sizeof p->said, "node %d (nearest cuda:%d)", p->node, device);
    else
        snprintf(p->said, sizeof p->said, "no node chosen (nodes %s; the GPU's is not known)", nodes.text);
    p->bind = nodes.count > 1 && p->node >= 0;
    return 0;
}

/* ------------------------------------------------------------ allocation */

typedef enum { KV_ALLOCATED, KV_FAILED_MAP, KV_FAILED_BIND, KV_FAILED_REGISTER } kv_outcome;

/* One allocation, run without the GIL: what it was asked, what it did. */
typedef struct {
    size_t bytes;
    kv_huge_pages huge; /* asked, then taken */
    const kv_placement *place;
    int device, threads;
    size_t piece_limit;
    kv_outcome outcome;
    kv_host_pool *pool;
    int threads_run, registered, bind_error;
    double seconds;
    char why[256];
} kv_allocation;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void drop_mapping(kv_host_pool *pool)
{
    munmap(pool->base, pool->map_bytes);
    free(pool);
}

static void allocate(kv_allocation *a)
{
    const double start = now();
    kv_host_pool *pool = malloc(sizeof *pool);
    a->outcome = KV_FAILED_MAP;
    if (pool == NULL) {
        snprintf(a->why, sizeof a->why, "%s", strerror(ENOMEM));
        return;
    }
    if (kv_host_map(a->bytes, &a->huge, &pool->base, &pool->map_bytes, a->why, sizeof a->why) != 0) {
        free(pool);
        return;
    }
    if (a->place->bind && (a->bind_error = kv_numa_prefer(pool->base, pool->map_bytes, a->place->node)) != 0
        && a->place->named) {
        a->outcome = KV_FAILED_BIND;
        drop_mapping(pool);
        return;
    }
    a->threads_run = kv_host_touch(pool->base, pool->map_bytes, (size_t)sysconf(_SC_PAGESIZE), a->threads);
    a->registered = kv_gpu_host_register(a->device, pool->base, pool->map_bytes, a->piece_limit,
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

/* The exception of a failed allocation, naming the argument at fault. */
static PyObject *raise_failure(const kv_pool_request *r, const kv_allocation *a)
{
    char shape[160];
    kv_format_shape(r->shape, r->ndim, shape, sizeof shape);
    switch (a->outcome) {
    case KV_FAILED_BIND:
        return PyErr_Format(PyExc_OSError, "numa_node: cannot place the pages on node %d (mbind): %s",
                            a->place->node, strerror(a->bind_error));
    case KV_FAILED_REGISTER:
        return PyErr_Format(PyExc_RuntimeError, "pinned_empty: %s of %s for cuda:%d: %s; nothing is left mapped or "
                            "registered", shape, r->dtype->name, a->device, a->why);
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
    else
        snprintf(placed, sizeof placed, "%s", a->place->said);
    const int dropped = r->huge != (int)a->huge;
    kv_debug("pinned_empty: %lld bytes (%.2f GiB), huge pages %s%s, %s, %d threads, %.3f s, %s",
             (long long)self->nbytes, (double)self->nbytes / (1 << 30), KV_HUGE_NAMES[a->huge],
             dropped ? " (transparent huge pages are off here)" : "", placed, a->threads_run, a->seconds, pinned);
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
    self->numa_node = a->bind_error == 0 ? a->place->node : -1;
    self->huge_pages = a->huge;
    self->threads = a->threads_run;
    self->seconds = a->seconds;
}

PyDoc_STRVAR(pinned_empty_doc,
             "pinned_empty(shape, dtype, *, numa_node=None, threads=None, huge_pages='transparent', device=None)\n"
             "--\n\n"
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
             "    None: the current one): registered with it current, placed near it.\n\n"
             "MemoryError when the memory is not there (more than MemAvailable or the memory\n"
             "cgroup allows, or the mapping fails: errno's text), RuntimeError naming the CUDA\n"
             "error when registering fails; either way nothing is left mapped or registered.\n"
             "KVBM_EXT_DEBUG=1 logs bytes, huge pages, node, threads, seconds and whether it\n"
             "was pinned.  KVBM_EXT_HOST_REGISTER_PIECE=<bytes> registers in pieces of at most\n"
             "that size (where the driver refuses large registrations, pieces are made anyway).");

static PyObject *pinned_empty(PyObject *type, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"shape", "dtype", "numa_node", "threads", "huge_pages", "device", NULL};
    static const kv_signature signature = {"pinned_empty", names, 0, 2, 2};
    PyObject *v[6];
    kv_pool_request r;
    kv_placement place;
    kv_allocation a;
    memset(&a, 0, sizeof a);
    if (kv_parse_arguments(&signature, args, nargs, kwnames, v) < 0 || read_request(v, &r) < 0
        || resolve_device(r.device, &a.device) < 0 || choose_node(&r, a.device, &place) < 0
        || register_piece_limit(&a.piece_limit) < 0 || check_room(&r) < 0)
        return NULL;
    a.bytes = (size_t)r.nbytes;
    a.huge = (kv_huge_pages)r.huge;
    a.place = &place;
    a.threads = (int)r.threads;
    Py_BEGIN_ALLOW_THREADS
    allocate(&a);
    Py_END_ALLOW_THREADS
    if (a.outcome != KV_ALLOCATED)
        return raise_failure(&r, &a);
    kv_host_buffer *self = kv_host_buffer_new((PyTypeObject *)type, a.pool);
    if (self == NULL) {
        char why[192];
        kv_host_pool_free(a.pool, why, sizeof why);
        return NULL;
    }
    describe_buffer(self, &r, &a);
    log_allocation(&r, &a, self);
    return (PyObject *)self;
}

PyMethodDef kv_pinned_empty_def = {"pinned_empty", (PyCFunction)(void (*)(void))pinned_empty,
                                   METH_FASTCALL | METH_KEYWORDS, pinned_empty_doc};
