/* The device's enqueue thread and its jobs.  See enqueue.h, and staging.c
 * ("Deferred calls") for what the thread does with a job.
 *
 * One thread per device's staging, started by its first deferred call and
 * ended with the staging (set_staging, the module's end): a queue of jobs
 * in the order the calls were made, which keeps each lane's end flag
 * rising one job at a time.  Jobs go back to a free list, their start
 * event and storage with them, so that a call allocates nothing once the
 * list holds as many as are in flight. */
#include "enqueue.h"

#include "kvbm_kernels.h"

#include <cuda.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* cuStreamWaitValue32 and cuStreamWriteValue32, from the driver. */
typedef CUresult (*kv_stream_value32)(CUstream stream, CUdeviceptr address, cuuint32_t value, unsigned int flags);

struct kv_enqueuer {
    kv_staging *staging;
    kv_job_runner run;
    int device;
    uint32_t *flags; /* device memory: each lane's end flag */
    kv_stream_value32 wait_value, write_value;
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t wake; /* a job came, or stop */
    pthread_cond_t idle; /* the queue emptied */
    kv_job *head, *tail; /* handed over, not yet taken */
    kv_job *free;
    int busy; /* the thread runs a job it took */
    int stop;
};

static int fail(kv_failure *f, cudaError_t error, const char *what)
{
    f->error = error;
    f->what = what;
    return -1;
}

static kv_stream_value32 driver_entry(const char *name, kv_failure *f)
{
    void *entry = NULL;
#if CUDART_VERSION >= 12050
    enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t error = cudaGetDriverEntryPointByVersion(name, &entry, 12000, cudaEnableDefault, &found);
    if (error != cudaSuccess || found != cudaDriverEntryPointSuccess)
        entry = NULL;
    cudaGetLastError();
#endif
    if (entry == NULL)
        fail(f, cudaErrorNotSupported, "finding the driver's stream memory operations for a deferred call");
    return (kv_stream_value32)entry;
}

static CUdeviceptr flag_of(const kv_enqueuer *q, int lane) { return (CUdeviceptr)(uintptr_t)(q->flags + lane); }

static void free_jobs(kv_job *job)
{
    while (job != NULL) {
        kv_job *next = job->next;
        cudaEventDestroy(job->start);
        free(job->storage);
        free(job);
        job = next;
    }
}

/* ------------------------------------------------------------ the thread */

static void run_job(kv_enqueuer *q, kv_job *job, cudaError_t selected)
{
    kv_failure f = {cudaSuccess, NULL};
    cudaStream_t end = NULL;
    int rc = q->run(q->staging, job, &end, &f);
    if (selected != cudaSuccess)
        rc = fail(&f, selected, "selecting the device on the enqueue thread");
    /* Ended or failed, the caller's stream must go on. */
    const CUresult written = q->write_value((CUstream)end, flag_of(q, job->lane), job->number, 0);
    if (written != CUDA_SUCCESS && rc == 0)
        rc = fail(&f, (cudaError_t)written, "writing a deferred staged call's end flag");
    char message[512];
    if (rc < 0)
        kv_failure_message(&f, message, sizeof message);
    kv_promise_settle(job->outcome, rc < 0 ? message : NULL);
    kv_promise_release(job->outcome);
    job->outcome = NULL;
}

static void *enqueue_thread(void *arg)
{
    kv_enqueuer *q = arg;
    const cudaError_t selected = cudaSetDevice(q->device);
    pthread_mutex_lock(&q->mutex);
    for (;;) {
        while (q->head == NULL && !q->stop)
            pthread_cond_wait(&q->wake, &q->mutex);
        kv_job *job = q->head;
        if (job == NULL)
            break;
        if ((q->head = job->next) == NULL)
            q->tail = NULL;
        q->busy = 1;
        pthread_mutex_unlock(&q->mutex);
        run_job(q, job, selected);
        pthread_mutex_lock(&q->mutex);
        job->next = q->free;
        q->free = job;
        q->busy = 0;
        if (q->head == NULL)
            pthread_cond_broadcast(&q->idle);
    }
    pthread_mutex_unlock(&q->mutex);
    return NULL;
}

/* ------------------------------------------------------------ its life */

kv_enqueuer *kv_enqueuer_start(kv_staging *staging, kv_job_runner run, kv_failure *f)
{
    kv_enqueuer *q = calloc(1, sizeof *q);
    if (q == NULL) {
        fail(f, cudaErrorMemoryAllocation, "allocating the enqueue thread's state");
        return NULL;
    }
    q->staging = staging;
    q->run = run;
    cudaStream_t zeroing = NULL;
    if ((q->wait_value = driver_entry("cuStreamWaitValue32", f)) == NULL
        || (q->write_value = driver_entry("cuStreamWriteValue32", f)) == NULL)
        goto failed;
    /* The kernels loaded now: a lazy load on the thread would wait for the
     * device, whose callers' streams wait for the thread. */
    cudaError_t error = kvbm_load_kernels();
    if (error == cudaSuccess)
        error = cudaGetDevice(&q->device);
    if (error == cudaSuccess)
        error = cudaMalloc((void **)&q->flags, KV_MAX_LANES * sizeof *q->flags);
    /* Zero before any stream waits on them: on a stream of its own, waited
     * for here, not on the legacy default one the caller's may not follow. */
    if (error == cudaSuccess)
        error = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
    if (error == cudaSuccess)
        error = cudaMemsetAsync(q->flags, 0, KV_MAX_LANES * sizeof *q->flags, zeroing);
    if (error == cudaSuccess)
        error = cudaStreamSynchronize(zeroing);
    if (zeroing != NULL)
        cudaStreamDestroy(zeroing);
    if (error != cudaSuccess) {
        fail(f, error, "loading the kernels and allocating the end flags for deferred calls");
        goto failed;
    }
    pthread_mutex_init(&q->mutex, NULL);
    pthread_cond_init(&q->wake, NULL);
    pthread_cond_init(&q->idle, NULL);
    if (pthread_create(&q->thread, NULL, enqueue_thread, q) != 0) {
        fail(f, cudaErrorOperatingSystem, "starting the enqueue thread");
        pthread_cond_destroy(&q->idle);
        pthread_cond_destroy(&q->wake);
        pthread_mutex_destroy(&q->mutex);
        goto failed;
    }
    return q;
failed:
    cudaFree(q->flags);
    free(q);
    return NULL;
}

void kv_enqueuer_drain(kv_enqueuer *q)
{
    pthread_mutex_lock(&q->mutex);
    while (q->head != NULL || q->busy)
        pthread_cond_wait(&q->idle, &q->mutex);
    pthread_mutex_unlock(&q->mutex);
}

void kv_enqueuer_stop(kv_enqueuer *q)
{
    if (q == NULL)
        return;
    pthread_mutex_lock(&q->mutex);
    q->stop = 1;
    pthread_cond_signal(&q->wake);
    pthread_mutex_unlock(&q->mutex);
    pthread_join(q->thread, NULL); /* it empties the queue first */
    free_jobs(q->free);
    pthread_cond_destroy(&q->idle);
    pthread_cond_destroy(&q->wake);
    pthread_mutex_destroy(&q->mutex);
    cudaFree(q->flags); /* after the work that writes them */
    free(q);
}

/* ------------------------------------------------------------ handing jobs over */

static size_t aligned(size_t bytes) { return (bytes + 15) / 16 * 16; }

kv_job *kv_enqueuer_job(kv_enqueuer *q, const kv_move *move, const kv_move_plan *plan, kv_failure *f)
{
    const kv_staged *s = plan->staged;
    const size_t args_bytes = aligned(move->kind->owned_bytes), table_bytes = (size_t)move->entries * 8;
    const size_t addresses = (size_t)(s->unit_address != NULL ? s->nb * s->inner : s->nb);
    const size_t bytes = args_bytes + table_bytes + addresses * sizeof(uint64_t);
    pthread_mutex_lock(&q->mutex);
    kv_job *job = q->free;
    if (job != NULL)
        q->free = job->next;
    pthread_mutex_unlock(&q->mutex);
    if (job == NULL) {
        if ((job = calloc(1, sizeof *job)) == NULL) {
            fail(f, cudaErrorMemoryAllocation, "allocating a deferred call");
            return NULL;
        }
        const cudaError_t error = cudaEventCreateWithFlags(&job->start, cudaEventDisableTiming);
        if (error != cudaSuccess) {
            free(job);
            fail(f, error, "creating a deferred call's event");
            return NULL;
        }
    }
    if (job->capacity < bytes) {
        char *storage = realloc(job->storage, bytes);
        if (storage == NULL) {
            job->next = NULL;
            free_jobs(job);
            fail(f, cudaErrorMemoryAllocation, "allocating a deferred call");
            return NULL;
        }
        job->storage = storage;
        job->capacity = bytes;
    }
    char *table = job->storage + args_bytes;
    uint64_t *owned_addresses = (uint64_t *)(void *)(table + table_bytes);
    job->move = *move;
    job->move.args = move->kind->own_args(move->args, job->storage);
    job->move.table = memcpy(table, move->table, table_bytes);
    job->staged = *s;
    memcpy(owned_addresses, s->unit_address != NULL ? s->unit_address : s->block_address, addresses * sizeof(uint64_t));
    if (s->unit_address != NULL)
        job->staged.unit_address = owned_addresses;
    else
        job->staged.block_address = owned_addresses;
    job->plan = *plan;
    job->plan.staged = &job->staged;
    job->plan.deferred = NULL;
    job->next = NULL;
    return job;
}

static void take_back(kv_enqueuer *q, kv_job *job)
{
    pthread_mutex_lock(&q->mutex);
    job->next = q->free;
    q->free = job;
    pthread_mutex_unlock(&q->mutex);
}

int kv_enqueuer_submit(kv_enqueuer *q, kv_job *job, cudaStream_t caller, kv_promise **outcome, kv_failure *f)
{
    if ((job->outcome = kv_promise_new()) == NULL) {
        take_back(q, job);
        return fail(f, cudaErrorMemoryAllocation, "allocating a deferred call's outcome");
    }
    cudaError_t error = cudaEventRecord(job->start, caller);
    if (error == cudaSuccess) {
        const CUresult waited =
            q->wait_value((CUstream)caller, flag_of(q, job->lane), job->number, CU_STREAM_WAIT_VALUE_GEQ);
        if (waited != CUDA_SUCCESS)
            error = (cudaError_t)waited;
    }
    if (error != cudaSuccess) {
        kv_promise_release(job->outcome);
        kv_promise_release(job->outcome);
        job->outcome = NULL;
        take_back(q, job);
        return fail(f, error, "ordering the caller's stream after a deferred staged call");
    }
    *outcome = job->outcome;
    pthread_mutex_lock(&q->mutex);
    if (q->tail != NULL)
        q->tail->next = job;
    else
        q->head = job;
    q->tail = job;
    pthread_cond_signal(&q->wake);
    pthread_mutex_unlock(&q->mutex);
    return 0;
}
