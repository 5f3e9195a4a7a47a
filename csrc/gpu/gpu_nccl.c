/* NCCL point-to-point for a Resharder's messages between the GPUs of one
 * process group (gpu.h, kv_nccl_*): a communicator of our own, posted
 * straight from C.  torch.distributed's batch_isend_irecv costs about 60 us
 * of host time a post; ncclSend/ncclRecv in one group cost a few.
 *
 * NCCL is loaded at first use from libnccl.so.2, which torch's CUDA build
 * has loaded already; only the handful of entry points below are used, with
 * NCCL's stable C interface declared here (nccl.h is not part of the CUDA
 * toolkit). */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: its feature macros declare clock_gettime and nanosleep */

#include "gpu_internal.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "lock.h"

typedef void *nccl_comm;
typedef int nccl_result;
enum {
    NCCL_SUCCESS = 0,
    NCCL_UINT8 = 1
};
typedef struct {
    char internal[KV_NCCL_ID_BYTES];
} nccl_unique_id;

static struct {
    nccl_result (*get_unique_id)(nccl_unique_id *);
    nccl_result (*comm_init_rank)(nccl_comm *, int, nccl_unique_id, int);
    nccl_result (*comm_abort)(nccl_comm);
    nccl_result (*comm_get_async_error)(nccl_comm, nccl_result *);
    nccl_result (*send)(const void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*recv)(void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*group_start)(void);
    nccl_result (*group_end)(void);
    const char *(*get_error_string)(nccl_result);
} nccl;
static int nccl_state; /* 0 not tried, 1 loaded, -1 failed (nccl_why says why) */
static char nccl_why[256];
static kv_lock nccl_lock;

static int load_nccl(void)
{
    static const char *const names[] = {"libnccl.so.2", "libnccl.so"};
    kv_lock_acquire(&nccl_lock);
    if (nccl_state == 0) {
        void *library = NULL;
        for (size_t i = 0; library == NULL && i < sizeof names / sizeof names[0]; i++)
            library = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        const char *error = library == NULL ? dlerror() : NULL;
#define KV_NCCL_SYMBOL(field, symbol)                                                                                  \
    if (library != NULL && error == NULL && (*(void **)&nccl.field = dlsym(library, symbol)) == NULL)                  \
    error = symbol
        KV_NCCL_SYMBOL(get_unique_id, "ncclGetUniqueId");
        KV_NCCL_SYMBOL(comm_init_rank, "ncclCommInitRank");
        KV_NCCL_SYMBOL(comm_abort, "ncclCommAbort");
        KV_NCCL_SYMBOL(comm_get_async_error, "ncclCommGetAsyncError");
        KV_NCCL_SYMBOL(send, "ncclSend");
        KV_NCCL_SYMBOL(recv, "ncclRecv");
        KV_NCCL_SYMBOL(group_start, "ncclGroupStart");
        KV_NCCL_SYMBOL(group_end, "ncclGroupEnd");
        KV_NCCL_SYMBOL(get_error_string, "ncclGetErrorString");
#undef KV_NCCL_SYMBOL
        if (error != NULL)
            snprintf(nccl_why, sizeof nccl_why, "%s", error);
        nccl_state = error == NULL ? 1 : -1;
    }
    const int state = nccl_state;
    kv_lock_release(&nccl_lock);
    if (state < 0)
        PyErr_Format(PyExc_RuntimeError, "NCCL could not be loaded: %s", nccl_why);
    return state > 0 ? 0 : -1;
}

struct kv_nccl {
    nccl_comm comm;
    int nranks, device;
    atomic_int aborted;      /* written under `lock`, read without it: kv_nccl_aborted never waits for a swap */
    PyThread_type_lock lock; /* one group at a time: NCCL pairs operations in the order they are posted */
    cudaStream_t stream;     /* the records' own, so that they never queue behind a payload */
    cudaEvent_t done;
    unsigned char *host, *dev; /* nranks records out, then nranks in: pinned, and on the device */
    kv_nccl_op *ops;           /* a swap's 2 * nranks operations */
};

/* What failed with the GIL released, raised once it is held again. */
typedef struct {
    cudaError_t cuda;
    nccl_result nccl;
    const char *what;
} nccl_failure;

/* A step that runs only while none failed before it. */
#define NCCL_CUDA(failure, call, description)                                                                          \
    do {                                                                                                               \
        if ((failure)->what == NULL && ((failure)->cuda = (call)) != cudaSuccess)                                      \
            (failure)->what = (description);                                                                           \
    } while (0)
#define NCCL_STEP(failure, call, description)                                                                          \
    do {                                                                                                               \
        if ((failure)->what == NULL && ((failure)->nccl = (call)) != NCCL_SUCCESS)                                     \
            (failure)->what = (description);                                                                           \
    } while (0)

static int raise_failure(const nccl_failure *f)
{
    if (f->cuda != cudaSuccess)
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s (%d) %s: %s", cudaGetErrorName(f->cuda), (int)f->cuda, f->what,
                     cudaGetErrorString(f->cuda));
    else
        PyErr_Format(PyExc_RuntimeError, "NCCL error %d %s: %s", f->nccl, f->what, nccl.get_error_string(f->nccl));
    return -1;
}

/* Makes the communicator's device current, as its NCCL calls and records need, and returns
 * the device for leave_device to make current again (-1: none).  Safe without the GIL. */
static int enter_device(const kv_nccl *c, nccl_failure *f)
{
    int previous = -1;
    NCCL_CUDA(f, kv_select_device(c->device, &previous), "selecting the communicator's device");
    return previous;
}

/* Gives the calling thread its device back, also after a failure (then reported only where
 * nothing failed before).  Safe without the GIL. */
static void leave_device(int previous, nccl_failure *f)
{
    const cudaError_t restored = previous < 0 ? cudaSuccess : cudaSetDevice(previous);
    if (restored != cudaSuccess && f->what == NULL) {
        f->cuda = restored;
        f->what = "making the caller's device current again";
    }
}

int kv_nccl_load(void) { return load_nccl(); }

int kv_nccl_unique_id(unsigned char id[KV_NCCL_ID_BYTES])
{
    nccl_unique_id made;
    nccl_failure f = {cudaSuccess, NCCL_SUCCESS, NULL};
    if (load_nccl() < 0)
        return -1;
    NCCL_STEP(&f, nccl.get_unique_id(&made), "making a communicator's unique id");
    if (f.what != NULL)
        return raise_failure(&f);
    memcpy(id, made.internal, KV_NCCL_ID_BYTES);
    return 0;
}

/* Every resource of `c`.  The communicator is aborted, not destroyed: ncclCommDestroy
 * may wait for its peers, which need not be closing theirs at the same time. */
static void release(kv_nccl *c)
{
    nccl_failure ignored = {cudaSuccess, NCCL_SUCCESS, NULL}; /* a teardown has no one to tell */
    const int previous = enter_device(c, &ignored);
    if (c->comm != NULL && !c->aborted)
        nccl.comm_abort(c->comm);
    if (c->done != NULL)
        cudaEventDestroy(c->done);
    if (c->stream != NULL)
        cudaStreamDestroy(c->stream);
    cudaFreeHost(c->host);
    cudaFree(c->dev);
    leave_device(previous, &ignored);
    cudaGetLastError();
}

void kv_nccl_close(kv_nccl *c)
{
    if (c == NULL)
        return;
    Py_BEGIN_ALLOW_THREADS
    release(c);
    Py_END_ALLOW_THREADS
    if (c->lock != NULL)
        PyThread_free_lock(c->lock);
    PyMem_Free(c->ops);
    PyMem_Free(c);
}

kv_nccl *kv_nccl_open(const unsigned char id[KV_NCCL_ID_BYTES], int nranks, int rank, int device)
{
    if (load_nccl() < 0)
        return NULL;
    kv_nccl *c = PyMem_Calloc(1, sizeof *c);
    kv_nccl_op *ops = c == NULL ? NULL : PyMem_Calloc(2 * (size_t)nranks, sizeof *ops);
    PyThread_type_lock lock = ops == NULL ? NULL : PyThread_allocate_lock();
    if (lock == NULL) {
        PyMem_Free(ops);
        PyMem_Free(c);
        PyErr_NoMemory();
        return NULL;
    }
    *c = (kv_nccl){.nranks = nranks, .device = device, .lock = lock, .ops = ops};
    nccl_unique_id unique;
    memcpy(unique.internal, id, KV_NCCL_ID_BYTES);
    const size_t bytes = 2 * (size_t)nranks * KV_NCCL_RECORD_MAX;
    nccl_failure f = {cudaSuccess, NCCL_SUCCESS, NULL};
    Py_BEGIN_ALLOW_THREADS
    const int previous = enter_device(c, &f);
    int low = 0, high = 0;
    NCCL_CUDA(&f, cudaDeviceGetStreamPriorityRange(&low, &high), "reading the stream priorities");
    /* The highest priority: the records' kernels start as soon as an SM frees up, never after
     * the packs and unpacks queued on the device. */
    NCCL_CUDA(&f, cudaStreamCreateWithPriority(&c->stream, cudaStreamNonBlocking, high),
              "creating the records' stream");
    NCCL_CUDA(&f, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming), "creating the records' event");
    NCCL_CUDA(&f, cudaHostAlloc((void **)&c->host, bytes, cudaHostAllocDefault), "allocating the records");
    NCCL_CUDA(&f, cudaMalloc((void **)&c->dev, bytes), "allocating the records on the device");
    /* Blocks until every rank of the group opened its communicator. */
    NCCL_STEP(&f, nccl.comm_init_rank(&c->comm, nranks, unique, rank), "creating the communicator");
    leave_device(previous, &f);
    Py_END_ALLOW_THREADS
    if (f.what != NULL) {
        raise_failure(&f);
        if (f.nccl != NCCL_SUCCESS)
            c->comm = NULL;
        kv_nccl_close(c);
        return NULL;
    }
    return c;
}

static int aborted_error(void)
{
    PyErr_SetString(PyExc_RuntimeError, "this NCCL communicator was aborted after a failure or a timeout: "
                                        "its messages cannot go on; build the Resharder anew");
    return -1;
}

/* Posts `ops` as one NCCL group on `stream`; called with c->lock held and the device set. */
static void post_group(const kv_nccl *c, const kv_nccl_op *ops, Py_ssize_t n, cudaStream_t stream, nccl_failure *f)
{
    NCCL_STEP(f, nccl.group_start(), "starting a group");
    if (f->what != NULL)
        return;
    for (Py_ssize_t i = 0; i < n; i++) {
        const kv_nccl_op *op = &ops[i];
        if (op->send)
            NCCL_STEP(f, nccl.send((const void *)op->address, op->bytes, NCCL_UINT8, op->peer, c->comm, stream),
                      "posting a send");
        else
            NCCL_STEP(f, nccl.recv((void *)op->address, op->bytes, NCCL_UINT8, op->peer, c->comm, stream),
                      "posting a receive");
    }
    nccl_failure end = {cudaSuccess, NCCL_SUCCESS, NULL};
    NCCL_STEP(&end, nccl.group_end(), "ending a group");
    if (f->what == NULL)
        *f = end;
}

int kv_nccl_post(kv_nccl *c, intptr_t stream, const kv_nccl_op *ops, Py_ssize_t n)
{
    nccl_failure f = {cudaSuccess, NCCL_SUCCESS, NULL};
    int aborted;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->lock, WAIT_LOCK);
    /* Read with the lock held: a swap that failed on another thread may have aborted (freed) the
     * communicator while this one waited for it. */
    aborted = c->aborted;
    if (!aborted) {
        const int previous = enter_device(c, &f);
        post_group(c, ops, n, (cudaStream_t)stream, &f);
        leave_device(previous, &f);
    }
    PyThread_release_lock(c->lock);
    Py_END_ALLOW_THREADS
    if (aborted)
        return aborted_error();
    return f.what == NULL ? 0 : raise_failure(&f);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Waits for c->done until `deadline`: spins first (a swap's round trip takes tens of
 * microseconds), then sleeps between looks.  1 when it timed out. */
static int wait_done(const kv_nccl *c, double deadline, nccl_failure *f)
{
    const struct timespec pause = {0, 50 * 1000};
    const double spin_until = now() + 1e-3;
    for (;;) {
        const cudaError_t state = cudaEventQuery(c->done);
        if (state != cudaErrorNotReady) {
            NCCL_CUDA(f, state, "waiting for the records");
            return 0;
        }
        const double t = now();
        if (t > deadline)
            return 1;
        if (t > spin_until) {
            nccl_result async = NCCL_SUCCESS;
            NCCL_STEP(f, nccl.comm_get_async_error(c->comm, &async), "reading the communicator's state");
            NCCL_STEP(f, async, "in the communicator");
            if (f->what != NULL)
                return 0;
            nanosleep(&pause, NULL);
        }
    }
}

/* kv_nccl_swap's exchange, with c->lock held and the communicator not aborted; aborts it on a
 * failure or when `deadline` passes.  1 when it timed out. */
static int swap_records(kv_nccl *c, const int *peers, Py_ssize_t n, size_t R, const unsigned char *records,
                        unsigned char *received, double deadline, nccl_failure *f)
{
    const size_t in = (size_t)c->nranks * KV_NCCL_RECORD_MAX;
    int timed_out = 0;
    memcpy(c->host, records, (size_t)n * R);
    for (Py_ssize_t i = 0; i < n; i++) {
        c->ops[2 * i] = (kv_nccl_op){peers[i], 1, (uintptr_t)(c->dev + (size_t)i * R), R};
        c->ops[2 * i + 1] = (kv_nccl_op){peers[i], 0, (uintptr_t)(c->dev + in + (size_t)i * R), R};
    }
    const int previous = enter_device(c, f);
    NCCL_CUDA(f, cudaMemcpyAsync(c->dev, c->host, (size_t)n * R, cudaMemcpyHostToDevice, c->stream),
              "copying the records to the device");
    if (f->what == NULL)
        post_group(c, c->ops, 2 * n, c->stream, f);
    NCCL_CUDA(f, cudaMemcpyAsync(c->host + in, c->dev + in, (size_t)n * R, cudaMemcpyDeviceToHost, c->stream),
              "copying the records to the host");
    NCCL_CUDA(f, cudaEventRecord(c->done, c->stream), "recording the records' event");
    if (f->what == NULL)
        timed_out = wait_done(c, deadline, f);
    if (timed_out || f->what != NULL) {
        /* The peers may never post their side: only an abort ends the operations. */
        nccl.comm_abort(c->comm);
        c->aborted = 1;
    }
    else
        memcpy(received, c->host + in, (size_t)n * R);
    leave_device(previous, f);
    return timed_out;
}

int kv_nccl_swap(kv_nccl *c, const int *peers, Py_ssize_t n, size_t record_bytes, const unsigned char *records,
                 unsigned char *received, double timeout)
{
    nccl_failure f = {cudaSuccess, NCCL_SUCCESS, NULL};
    int aborted, timed_out = 0;
    const double deadline = now() + timeout;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->lock, WAIT_LOCK);
    aborted = c->aborted; /* with the lock held, as in kv_nccl_post */
    if (!aborted)
        timed_out = swap_records(c, peers, n, record_bytes, records, received, deadline, &f);
    PyThread_release_lock(c->lock);
    Py_END_ALLOW_THREADS
    if (aborted)
        return aborted_error();
    if (timed_out) {
        char seconds[32];
        snprintf(seconds, sizeof seconds, "%.6g", timeout);
        PyErr_Format(PyExc_TimeoutError, "the peers' records did not come within %s s", seconds);
        return -1;
    }
    return f.what == NULL ? 0 : raise_failure(&f);
}

void kv_nccl_abort(kv_nccl *c)
{
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->lock, WAIT_LOCK);
    if (!c->aborted)
        nccl.comm_abort(c->comm);
    c->aborted = 1;
    PyThread_release_lock(c->lock);
    Py_END_ALLOW_THREADS
}

int kv_nccl_aborted(kv_nccl *c) { return atomic_load(&c->aborted); }
