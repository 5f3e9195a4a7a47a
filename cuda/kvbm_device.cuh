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

// Moves the vectors j = first + k * blockDim.x (k < kUnroll, j < count) of V
// bytes from src to dst, issuing every load before any store so that each
// thread keeps kUnroll vectors in flight.  offsets(j, &from, &to) gives the
// byte offsets of vector j in the source and the destination.  Plain
// accesses: the evict-first hints (__ldcs, __stcs) measured 2 to 3 % slower
// on the H200.
template <int V, class Offsets>
__device__ __forceinline__ void move_vectors(const char *src, char *dst, uint32_t first, uint32_t count,
                                             const Offsets &offsets)
{
    using Vec = typename VectorOf<V>::type;
    Vec values[kUnroll];
    int64_t to[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
        const uint32_t j = first + k * blockDim.x;
        if (j < count) {
            int64_t from;
            offsets(j, &from, &to[k]);
            values[k] = *reinterpret_cast<const Vec *>(src + from);
        }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
        const uint32_t j = first + k * blockDim.x;
        if (j < count)
            *reinterpret_cast<Vec *>(dst + to[k]) = values[k];
    }
}

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
// small call should not pay for 32 KB.  The two smaller ones keep the whole
// parameter block (table and the kernel's other parameters, under 512 bytes)
// under the 4 KB that launches carry cheapest: the tiny one a one-block call,
// the small one a paged call's 80 layers and 64 host ids.
constexpr int kTinyTable = 64;
constexpr int kSmallTable = 448;

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
