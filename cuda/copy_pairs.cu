// Batched raw copies: one launch moves every (src, dst, size) pair.
//
// A pair is cut into `slices` equal shares, one CTA step each (a grid-stride
// loop, so that `num_ctas` bounds the SMs taken), so a few large pairs fill
// the GPU as well as many small ones.  The vector width is picked
// per pair, inside the kernel, from its two addresses and its size: lists on
// the device are never read by the host.
#include <stdint.h>

#include "kvbm_device.cuh"

namespace {

using namespace kvbm;

struct Params {
    uint32_t count;
    uint32_t shares;  // count * slices
    kvbm_divisor slices;
    uint64_t uniform_size;
    int has_sizes;
};

// The lists in device memory.
struct ListsInMemory {
    const uint64_t *lists[3];  // src, dst, sizes
};

// Entry i of list `which` (0 src, 1 dst, 2 sizes).  By value the lists lie
// one after the other.
__device__ __forceinline__ uint64_t entry(const ListsInMemory &t, int which, uint32_t i, uint32_t)
{
    return t.lists[which][i];
}
template <int N>
__device__ __forceinline__ uint64_t entry(const TableByValue<uint64_t, N> &t, int which, uint32_t i, uint32_t count)
{
    return t[which * count + i];
}

// Moves vectors [lo, hi) of V bytes from src to dst: every thread issues its
// kUnroll loads before its stores, so each CTA keeps kThreads * kUnroll
// vectors in flight.
template <int V>
__device__ __forceinline__ void copy_vectors(const char *src, char *dst, uint64_t lo, uint64_t hi)
{
    using Vec = typename VectorOf<V>::type;
    const Vec *s = reinterpret_cast<const Vec *>(src);
    Vec *d = reinterpret_cast<Vec *>(dst);
    for (uint64_t base = lo + threadIdx.x; base < hi; base += (uint64_t)blockDim.x * kUnroll) {
        Vec values[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const uint64_t i = base + (uint64_t)k * blockDim.x;
            if (i < hi)
                values[k] = s[i];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const uint64_t i = base + (uint64_t)k * blockDim.x;
            if (i < hi)
                d[i] = values[k];
        }
    }
}

template <class Table>
__global__ void __launch_bounds__(kThreads)
    copy_pairs_kernel(const __grid_constant__ Table table, const __grid_constant__ Params p)
{
    for (uint32_t share = blockIdx.x; share < p.shares; share += gridDim.x) {
        const uint32_t pair = kvbm_div(p.slices, share);
        const uint32_t slice = share - pair * p.slices.divisor;
        const uint64_t src = entry(table, 0, pair, p.count);
        const uint64_t dst = entry(table, 1, pair, p.count);
        const uint64_t size = p.has_sizes ? entry(table, 2, pair, p.count) : p.uniform_size;

        // The widest vector that divides both addresses and the size.
        const uint32_t v = (uint32_t)kvbm_vector_bytes(src | dst | size);
        const uint64_t n = size / v;
        const uint32_t slices = p.slices.divisor;
        const uint64_t part = n / slices, extra = n % slices;
        const uint64_t lo = part * slice + (slice < extra ? slice : extra);
        const uint64_t hi = lo + part + (slice < extra ? 1 : 0);
        const char *s = reinterpret_cast<const char *>(src);
        char *d = reinterpret_cast<char *>(dst);
        switch (v) {
        case 16: copy_vectors<16>(s, d, lo, hi); break;
        case 8: copy_vectors<8>(s, d, lo, hi); break;
        case 4: copy_vectors<4>(s, d, lo, hi); break;
        case 2: copy_vectors<2>(s, d, lo, hi); break;
        default: copy_vectors<1>(s, d, lo, hi); break;
        }
    }
}

static_assert(sizeof(Params) + sizeof(TableByValue<uint64_t, kSmallTable>) <= 4096,
              "a small by-value launch stays under 4 KB of parameters");

cudaError_t load_copy_pairs()
{
    return load_kernels(copy_pairs_kernel<ListsInMemory>, copy_pairs_kernel<TableByValue<uint64_t, kTinyTable>>,
                        copy_pairs_kernel<TableByValue<uint64_t, kSmallTable>>,
                        copy_pairs_kernel<TableByValue<uint64_t, KVBM_TABLE_BY_VALUE_MAX>>);
}

}  // namespace

extern "C" cudaError_t kvbm_launch_copy_pairs(const kvbm_pairs *pairs, const uint64_t *by_value, cudaStream_t stream)
{
    if (pairs->count == 0)
        return cudaSuccess;
    Params p;
    p.count = (uint32_t)pairs->count;
    p.slices = kvbm_divisor_make(pairs->slices);
    p.uniform_size = pairs->uniform_size;
    p.has_sizes = pairs->sizes != nullptr;
    p.shares = (uint32_t)(pairs->count * pairs->slices);
    const unsigned grid = pairs->num_ctas != 0 && pairs->num_ctas < p.shares ? pairs->num_ctas : p.shares;
    if (by_value == nullptr) {
        const ListsInMemory lists = {{pairs->src, pairs->dst, pairs->sizes}};
        copy_pairs_kernel<<<grid, kThreads, 0, stream>>>(lists, p);
    }
    else {
        launch_by_value(copy_pairs_kernel<TableByValue<uint64_t, kTinyTable>>,
                        copy_pairs_kernel<TableByValue<uint64_t, kSmallTable>>,
                        copy_pairs_kernel<TableByValue<uint64_t, KVBM_TABLE_BY_VALUE_MAX>>, by_value,
                        pairs->count * (p.has_sizes ? 3 : 2), p, grid, kThreads, stream);
    }
    return cudaGetLastError();
}

KVBM_LOAD_AHEAD(load_copy_pairs);
