// Loads every kernel ahead of need (kvbm_kernels.h): the loads each kernel
// file named with KVBM_LOAD_AHEAD, until one fails.
#include "kvbm_device.cuh"

extern "C" cudaError_t kvbm_load_kernels(void)
{
    cudaError_t error = cudaSuccess;
    for (const kvbm::LoadAhead *entry = kvbm::LoadAhead::first; error == cudaSuccess && entry != nullptr;
         entry = entry->next)
        error = entry->load();
    return error;
}
