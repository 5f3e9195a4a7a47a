// Device-side pieces shared by the kernels: CTA shape, vector types, and
// tables carried by value in a launch's parameters.
#ifndef KVBM_DEVICE_CUH
#define KVBM_DEVICE_CUH

#include <stdint.h>

#include "kvbm_kernels.h"

namespace kvbm {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 8 measured no faster on the H200

template <int V> struct VectorOf;
template <> struct VectorOf<16> { using type = uint4; };
template <> struct VectorOf<8> { using type = uint2; };
template <> struct VectorOf<4> { using type = uint32_t; };
template <> struct VectorOf<2> { using type = uint16_t; };
template <> struct VectorOf<1> { using type = uint8_t; };

// A table in device-readable memory, or carried by value in the kernel's
// parameters (small tables: no copy to stage before the launch).
template <class T> struct TableInMemory {
    const T *items;
    __device__ T operator[](uint32_t i) const { return items[i]; }
};
template <class T, int N> struct TableByValue {
    T items[N];
    __device__ T operator[](uint32_t i) const { return items[i]; }
};
// Three by-value sizes, because a launch copies its whole parameter block: a
// small call should not pay for 32 KB, and the smallest keeps the parameters
// of a one-block call under the 4 KB that launches carry cheapest.
constexpr int kTinyTable = 64;
constexpr int kSmallTable = 512;

template <class T, int N, class Params, class Kernel>
void launch_with(Kernel kernel, const T *host, int64_t count, const Params &p, unsigned grid, unsigned threads,
                 cudaStream_t stream)
{
    TableByValue<T, N> table;
    for (int64_t i = 0; i < count; ++i)
        table.items[i] = host[i];
    kernel<<<grid, threads, 0, stream>>>(table, p);
}

// Launches kernel<<<grid, threads>>>(table, params) with the table by value
// (count <= KVBM_TABLE_BY_VALUE_MAX entries read from `host`) in the smallest
// parameter block that holds it.
template <class T, class Params, class KernelTiny, class KernelSmall, class KernelMax>
void launch_by_value(KernelTiny tiny, KernelSmall small, KernelMax large, const T *host, int64_t count,
                     const Params &p, unsigned grid, unsigned threads, cudaStream_t stream)
{
    if (count <= kTinyTable)
        launch_with<T, kTinyTable>(tiny, host, count, p, grid, threads, stream);
    else if (count <= kSmallTable)
        launch_with<T, kSmallTable>(small, host, count, p, grid, threads, stream);
    else
        launch_with<T, KVBM_TABLE_BY_VALUE_MAX>(large, host, count, p, grid, threads, stream);
}

}  // namespace kvbm

#endif  // KVBM_DEVICE_CUH
