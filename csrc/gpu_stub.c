/* The GPU interface of a build without nvcc: host arrays still work, any
 * device array raises RuntimeError. */
#include "gpu.h"

struct kv_gpu {
    int unused;
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

int kv_gpu_block_universal(kv_gpu *gpu, const kvbm_block_dims *dims, kvbm_direction direction,
                           void *const *table, int vector_bytes, int device, intptr_t stream,
                           const intptr_t *producer_streams, Py_ssize_t producer_count)
{
    (void)gpu, (void)dims, (void)direction, (void)table, (void)vector_bytes, (void)device;
    (void)stream, (void)producer_streams, (void)producer_count;
    PyErr_SetString(PyExc_RuntimeError, NO_CUDA);
    return -1;
}

PyObject *kv_gpu_devices(void) { return PyList_New(0); }
