/* The GPU interface of a build without nvcc: host arrays still work, any
 * device array raises RuntimeError. */
#include "gpu.h"

#include <stdio.h>

#include "lock.h"

struct kv_gpu {
    kv_lock lock; /* set_staging from several threads at once */
    int64_t staging_bytes;
    int staging_lanes;
};

static const char NO_CUDA[] =
    "kvbm_ext was built without CUDA (nvcc was not found at build time), so device arrays are not "
    "supported; rebuild with nvcc on PATH or CUDA_HOME set";

kv_gpu *kv_gpu_new(void)
{
    kv_gpu *gpu = PyMem_Calloc(1, sizeof *gpu);
    if (gpu == NULL)
        PyErr_NoMemory();
    return gpu;
}

void kv_gpu_free(kv_gpu *gpu) { PyMem_Free(gpu); }

int kv_gpu_compiled(void) { return 0; }

int kv_gpu_locate(kv_array *a, const kv_path *path)
{
    (void)a;
    return kv_path_error(PyExc_RuntimeError, path, "%s", NO_CUDA);
}

/* Without CUDA there is no current device to switch: the array is rejected
 * later, by kv_gpu_locate. */
int kv_gpu_use_device(int device, int *previous)
{
    (void)device;
    *previous = -1;
    return 0;
}

void kv_gpu_restore_device(int previous) { (void)previous; }

static int no_cuda(void)
{
    PyErr_SetString(PyExc_RuntimeError, NO_CUDA);
    return -1;
}

int kv_gpu_move(kv_gpu *gpu, const kv_gpu_target *target, const kv_move *move, const kv_move_plan *plan,
                kv_gpu_report *report)
{
    (void)gpu, (void)target, (void)move, (void)plan, (void)report;
    return no_cuda();
}

/* The settings are kept, so that they read back as set. */
int kv_gpu_set_staging(kv_gpu *gpu, int64_t bytes, int lanes)
{
    kv_lock_acquire(&gpu->lock);
    if (bytes >= 0)
        gpu->staging_bytes = bytes;
    if (lanes > 0)
        gpu->staging_lanes = lanes;
    kv_lock_release(&gpu->lock);
    return 0;
}

int kv_gpu_reserve_staging(kv_gpu *gpu, int device)
{
    (void)gpu, (void)device;
    return no_cuda();
}

PyObject *kv_gpu_staging_info(kv_gpu *gpu, int device)
{
    (void)gpu, (void)device;
    no_cuda();
    return NULL;
}

int kv_gpu_copy_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine, int fallback,
                      kv_engine *ran, char *why, size_t why_size)
{
    (void)gpu, (void)target, (void)pairs, (void)engine, (void)fallback, (void)ran, (void)why, (void)why_size;
    return no_cuda();
}

int kv_gpu_batch_available(void) { return 0; }

int kv_gpu_check_pairs(kv_pairs *pairs, const char *const names[2], int allow_pageable, int *device)
{
    (void)pairs, (void)names, (void)allow_pageable;
    *device = -1;
    return no_cuda();
}

int kv_gpu_device_count(void) { return 0; }

int kv_gpu_current_device(void) { return no_cuda(); }

PyObject *kv_gpu_devices(void) { return PyList_New(0); }

int kv_gpu_host_register(int device, char *base, size_t bytes, size_t piece_limit, size_t item,
                         kv_host_registration *out, char *why, size_t why_size)
{
    (void)device, (void)base, (void)bytes, (void)piece_limit, (void)item;
    out->pieces = NULL;
    out->count = 0;
    snprintf(why, why_size, "kvbm_ext was built without CUDA");
    return 1;
}

int kv_gpu_host_unregister(kv_host_registration *registration, char *why, size_t why_size)
{
    (void)registration, (void)why, (void)why_size;
    return 0;
}

int kv_gpu_pci_bus_id(int device, char *buf, size_t size)
{
    (void)device, (void)buf, (void)size;
    return -1;
}

const char *kv_gpu_pointer_kind(const void *address)
{
    (void)address;
    no_cuda();
    return NULL;
}

int kv_nccl_load(void) { return no_cuda(); }

int kv_nccl_unique_id(unsigned char id[KV_NCCL_ID_BYTES])
{
    (void)id;
    return no_cuda();
}

kv_nccl *kv_nccl_open(const unsigned char id[KV_NCCL_ID_BYTES], int nranks, int rank, int device)
{
    (void)id, (void)nranks, (void)rank, (void)device;
    no_cuda();
    return NULL;
}

/* Never called: no communicator opens without CUDA. */
void kv_nccl_close(kv_nccl *c) { (void)c; }

int kv_nccl_post(kv_nccl *c, intptr_t stream, const kv_nccl_op *ops, Py_ssize_t n)
{
    (void)c, (void)stream, (void)ops, (void)n;
    return no_cuda();
}

int kv_nccl_swap(kv_nccl *c, const int *peers, Py_ssize_t n, size_t record_bytes, const unsigned char *records,
                 unsigned char *received, double timeout)
{
    (void)c, (void)peers, (void)n, (void)record_bytes, (void)records, (void)received, (void)timeout;
    return no_cuda();
}

void kv_nccl_abort(kv_nccl *c) { (void)c; }

int kv_nccl_aborted(kv_nccl *c)
{
    (void)c;
    return 1;
}
