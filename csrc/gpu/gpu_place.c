/* Where an array lives for the GPU (cudaPointerGetAttributes), and the
 * calling thread's current device.  See gpu.h. */
#include "gpu_internal.h"

int kv_gpu_locate(kv_array *a, const kv_path *path)
{
    if (a->place == KV_DEVICE && a->device_id >= 0)
        return 0;
    struct cudaPointerAttributes attributes;
    cudaError_t error = cudaPointerGetAttributes(&attributes, a->data);
    if (error != cudaSuccess) {
        cudaGetLastError();
        return kv_path_error(PyExc_RuntimeError, path, "cannot tell where this array lives: CUDA error %s: %s",
                             cudaGetErrorName(error), cudaGetErrorString(error));
    }
    switch (attributes.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
        a->place = KV_DEVICE;
        a->device_id = attributes.device;
        return 0;
    case cudaMemoryTypeHost:
        a->place = KV_HOST_PINNED;
        if (attributes.devicePointer != NULL)
            a->data = attributes.devicePointer;
        return 0;
    default:
        if (a->place == KV_DEVICE)
            return kv_path_error(PyExc_ValueError, path,
                                 "__cuda_array_interface__ points at memory that is neither "
                                 "device nor pinned host memory");
        return 0; /* pageable host memory */
    }
}

/* Makes `device` current; *previous receives the device to restore, or -1
 * when it already was current.  Safe without the GIL. */
cudaError_t kv_select_device(int device, int *previous)
{
    int current;
    cudaError_t error = cudaGetDevice(&current);
    *previous = -1;
    if (error == cudaSuccess && current != device) {
        error = cudaSetDevice(device);
        if (error == cudaSuccess)
            *previous = current;
    }
    return error;
}

int kv_gpu_use_device(int device, int *previous)
{
    cudaError_t error = kv_select_device(device, previous);
    if (error != cudaSuccess) {
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s selecting device %d: %s", cudaGetErrorName(error), device,
                     cudaGetErrorString(error));
        return -1;
    }
    return 0;
}

void kv_gpu_restore_device(int previous)
{
    if (previous >= 0)
        cudaSetDevice(previous);
}
