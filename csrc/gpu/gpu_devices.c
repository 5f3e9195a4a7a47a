/* The visible CUDA devices and the build's CUDA.  See gpu.h. */
#include "gpu_internal.h"

int kv_gpu_compiled(void) { return 1; }

int kv_gpu_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

int kv_gpu_current_device(void)
{
    int device;
    cudaError_t error = cudaGetDevice(&device);
    if (error != cudaSuccess) {
        cudaGetLastError();
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s finding the current device: %s", cudaGetErrorName(error),
                     cudaGetErrorString(error));
        return -1;
    }
    return device;
}

PyObject *kv_gpu_devices(void)
{
    PyObject *list = PyList_New(0);
    int count = 0;
    if (list == NULL || cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: an empty list */
        return list;
    }
    for (int i = 0; i < count; i++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess)
            continue;
        PyObject *d = Py_BuildValue("{s:i,s:s,s:(ii),s:K,s:i}", "index", i, "name", p.name, "capability", p.major,
                                    p.minor, "total_memory", (unsigned long long)p.totalGlobalMem, "multiprocessors",
                                    p.multiProcessorCount);
        if (d == NULL || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}
