// CK(call): a probe stops at the first CUDA error, naming the call and its line.
#ifndef PROBES_CHECK_H
#define PROBES_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                     \
    do {                                                                          \
        cudaError_t status = (x);                                                 \
        if (status != cudaSuccess) {                                              \
            printf("%s line %d: %s\n", #x, __LINE__, cudaGetErrorString(status)); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

#endif  // PROBES_CHECK_H
