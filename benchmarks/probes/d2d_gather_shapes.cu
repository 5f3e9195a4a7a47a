// Probe: how close a device-to-device gather of whole chunks gets to a
// same-size cudaMemcpyAsync, by the shape of the kernel that moves them.
//
// The move is the MLA case of engines.py at nb = 64: 64 blocks x L layers of
// one 18 KiB chunk (16 tokens x 576 bf16), each read from a random block of
// a larger cache and written packed, so both sides are contiguous within a
// chunk and the shape of the kernel is all that differs from a memcpy.
// Each rep starts with L2 holding other bytes (a 96 MiB write first).
//
//   tile4      the library's shape: 256 threads, 4 vectors of 16 bytes each
//              in flight, one tile of 16 KiB per CTA (an 18 KiB chunk makes
//              a 16 KiB and a 2 KiB tile)
//   even4      the same, but a chunk's tiles split it evenly (2 x 9 KiB)
//   chunk4     a CTA per chunk, 256 threads looping 4 vectors at a time
//   tile8      256 threads, 8 vectors in flight, 32 KiB tiles
//   chunk8     a CTA per chunk, 8 vectors at a time
//   warp4      warp tiles of 2 KiB, eight to a CTA of 256 threads (nine
//              fill an 18 KiB chunk)
//   flat4      tile4 over one contiguous buffer (no gather)
//   *_256      loads with the L2::256B prefetch hint, no L1 allocation
//
//   batch      the chunks as one cudaMemcpyBatchAsync (CUDA 13)
//
// Then whether cudaMemcpyAsync runs on the SMs at all: the same memcpy while
// a kernel on another stream holds every SM's threads for about 1 ms.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o d2d_gather_shapes d2d_gather_shapes.cu
// Run:   ./d2d_gather_shapes [layers ...]   (default 32 80)
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

#include <algorithm>
#include <vector>

#include "check.h"
#include "timing.h"

constexpr int kChunkBytes = 16 * 576 * 2;
constexpr int kVectors = kChunkBytes / 16;

__device__ __forceinline__ uint4 load_256(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Vectors [first, first + U * stride) of chunk c, U at a time per thread.
template <int U, bool H = false>
__device__ __forceinline__ void move(const uint4 *src, uint4 *dst, int first, int stride, int end)
{
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k)
        if (first + k * stride < end)
            v[k] = H ? load_256(src + first + k * stride) : src[first + k * stride];
#pragma unroll
    for (int k = 0; k < U; ++k)
        if (first + k * stride < end)
            dst[first + k * stride] = v[k];
}

// Tiles of `per_tile` vectors (a chunk has tiles_per_chunk), one per CTA.
template <int U, bool H = false>
__global__ void tiles(const char *cache, char *out, const int *ids, int per_tile, int tiles_per_chunk)
{
    const int chunk = blockIdx.x / tiles_per_chunk, tile = blockIdx.x % tiles_per_chunk;
    const uint4 *src = reinterpret_cast<const uint4 *>(cache + (size_t)ids[chunk] * kChunkBytes);
    uint4 *dst = reinterpret_cast<uint4 *>(out + (size_t)chunk * kChunkBytes);
    const int begin = tile * per_tile, end = min(begin + per_tile, kVectors);
    move<U, H>(src, dst, begin + threadIdx.x, blockDim.x, end);
}

// Warp tiles of 128 vectors, nine to a chunk, eight to a CTA; `ctas` bounds
// the grid (a grid-stride loop), as the staged permute's is.
template <bool H = false>
__global__ void warps(const char *cache, char *out, const int *ids, int n)
{
    const int lane = threadIdx.x % 32;
    for (int t = blockIdx.x * 8 + threadIdx.x / 32; t < n * 9; t += gridDim.x * 8) {
        const int chunk = t / 9, tile = t % 9;
        const uint4 *src = reinterpret_cast<const uint4 *>(cache + (size_t)ids[chunk] * kChunkBytes);
        uint4 *dst = reinterpret_cast<uint4 *>(out + (size_t)chunk * kChunkBytes);
        move<4, H>(src, dst, tile * 128 + lane, 32, tile * 128 + 128);
    }
}

// tile4 on a grid bounded to `ctas` CTAs, looping over the tiles.
__global__ void tiles_bounded(const char *cache, char *out, const int *ids, int n)
{
    for (int t = blockIdx.x; t < n * 2; t += gridDim.x) {
        const int chunk = t / 2, tile = t % 2;
        const uint4 *src = reinterpret_cast<const uint4 *>(cache + (size_t)ids[chunk] * kChunkBytes);
        uint4 *dst = reinterpret_cast<uint4 *>(out + (size_t)chunk * kChunkBytes);
        const int begin = tile * 1024, end = min(begin + 1024, kVectors);
        move<4>(src, dst, begin + threadIdx.x, 256, end);
    }
}

// A CTA per chunk, looping.
template <int U>
__global__ void chunks(const char *cache, char *out, const int *ids)
{
    const uint4 *src = reinterpret_cast<const uint4 *>(cache + (size_t)ids[blockIdx.x] * kChunkBytes);
    uint4 *dst = reinterpret_cast<uint4 *>(out + (size_t)blockIdx.x * kChunkBytes);
    for (int first = threadIdx.x; first < kVectors; first += U * blockDim.x)
        move<U>(src, dst, first, blockDim.x, kVectors);
}

__global__ void hold(long long cycles)
{
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

template <bool H = false>
__global__ void flat4(const uint4 *src, uint4 *dst, size_t vectors)
{
    const size_t first = (size_t)blockIdx.x * 1024 + threadIdx.x;
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (first + k * 256 < vectors)
            v[k] = H ? load_256(src + first + k * 256) : src[first + k * 256];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (first + k * 256 < vectors)
            dst[first + k * 256] = v[k];
}

int main(int argc, char **argv)
{
    std::vector<int> layer_counts;
    for (int i = 1; i < argc; ++i)
        layer_counts.push_back(atoi(argv[i]));
    if (layer_counts.empty())
        layer_counts = {32, 80};
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("d2d_gather_shapes: %s, %d SMs, L2 %d MiB; median of 50 reps, each after a 96 MiB write\n", prop.name,
           prop.multiProcessorCount, prop.l2CacheSize >> 20);
    const size_t flush_bytes = 96u << 20;
    char *flush;
    CK(cudaMalloc(&flush, flush_bytes));
    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    srand(2026);
    for (int layers : layer_counts) {
        const int n = 64 * layers;  // chunks moved
        const size_t bytes = (size_t)n * kChunkBytes;
        char *cache, *out, *contiguous;
        int *ids;
        CK(cudaMalloc(&cache, 2 * bytes));
        CK(cudaMalloc(&out, bytes));
        CK(cudaMalloc(&contiguous, bytes));
        CK(cudaMemset(cache, 0x5a, 2 * bytes));
        std::vector<int> order(2 * n);
        for (int i = 0; i < 2 * n; ++i)
            order[i] = i;
        for (int i = 2 * n - 1; i > 0; --i)
            std::swap(order[i], order[rand() % (i + 1)]);
        CK(cudaMalloc(&ids, n * sizeof(int)));
        CK(cudaMemcpy(ids, order.data(), n * sizeof(int), cudaMemcpyHostToDevice));

        auto time = [&](const char *name, auto launch) {
            const double us = median_us(stream, start, stop, flush, flush_bytes, launch);
            printf("  %-8s %8.2f us  %7.1f GB/s\n", name, us, bytes / us / 1e3);
            return us;
        };
        printf("%d layers: %d chunks of %d bytes, %.1f MiB\n", layers, n, kChunkBytes, bytes / 1048576.0);
        time("memcpy", [&] { CK(cudaMemcpyAsync(out, contiguous, bytes, cudaMemcpyDeviceToDevice, stream)); });
        time("flat4", [&] { flat4<<<(unsigned)((bytes / 16 + 1023) / 1024), 256, 0, stream>>>(
                                (const uint4 *)contiguous, (uint4 *)out, bytes / 16); });
        time("flat4_256", [&] { flat4<true><<<(unsigned)((bytes / 16 + 1023) / 1024), 256, 0, stream>>>(
                                    (const uint4 *)contiguous, (uint4 *)out, bytes / 16); });
        time("tile4_256", [&] { tiles<4, true><<<n * 2, 256, 0, stream>>>(cache, out, ids, 1024, 2); });
        time("warp4", [&] { warps<<<(n * 9 + 7) / 8, 256, 0, stream>>>(cache, out, ids, n); });
        time("warp4_256", [&] { warps<true><<<(n * 9 + 7) / 8, 256, 0, stream>>>(cache, out, ids, n); });
        {
            std::vector<void *> dsts(n), srcs(n);
            std::vector<size_t> sizes(n, kChunkBytes);
            for (int i = 0; i < n; ++i) {
                dsts[i] = out + (size_t)i * kChunkBytes;
                srcs[i] = cache + (size_t)order[i] * kChunkBytes;
            }
            cudaMemcpyAttributes attributes;
            memset(&attributes, 0, sizeof attributes);
            attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            size_t index = 0;
            time("batch", [&] {
                CK(cudaMemcpyBatchAsync(dsts.data(), (const void *const *)srcs.data(), sizes.data(), n, &attributes,
                                        &index, 1, stream));
            });
        }
        for (int ctas : {8, 32}) {
            printf("  on %d CTAs:\n", ctas);
            time("tile4", [&] { tiles_bounded<<<ctas, 256, 0, stream>>>(cache, out, ids, n); });
            time("warp4", [&] { warps<<<ctas, 256, 0, stream>>>(cache, out, ids, n); });
        }
        time("tile4", [&] { tiles<4><<<n * 2, 256, 0, stream>>>(cache, out, ids, 1024, 2); });
        time("even4", [&] { tiles<4><<<n * 2, 160, 0, stream>>>(cache, out, ids, kVectors / 2, 2); });
        time("chunk4", [&] { chunks<4><<<n, 256, 0, stream>>>(cache, out, ids); });
        time("tile8", [&] { tiles<8><<<n, 256, 0, stream>>>(cache, out, ids, 2048, 1); });
        time("chunk8", [&] { chunks<8><<<n, 256, 0, stream>>>(cache, out, ids); });
        time("chunk4/512", [&] { chunks<4><<<n, 512, 0, stream>>>(cache, out, ids); });
        time("even4x3", [&] { tiles<4><<<n * 3, 96, 0, stream>>>(cache, out, ids, kVectors / 3, 3); });
        {
            int clock_khz;
            CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
            cudaStream_t other;
            CK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
            CK(cudaDeviceSynchronize());
            hold<<<prop.multiProcessorCount * (prop.maxThreadsPerMultiProcessor / 256), 256, 0, other>>>(
                clock_khz);  // 1 ms
            CK(cudaEventRecord(start, stream));
            CK(cudaMemcpyAsync(out, contiguous, bytes, cudaMemcpyDeviceToDevice, stream));
            CK(cudaEventRecord(stop, stream));
            CK(cudaDeviceSynchronize());
            float t;
            CK(cudaEventElapsedTime(&t, start, stop));
            printf("  memcpy while every SM is held for 1000 us: done after %.2f us\n", t * 1e3);
            CK(cudaStreamDestroy(other));
        }
        CK(cudaFree(cache));
        CK(cudaFree(out));
        CK(cudaFree(contiguous));
        CK(cudaFree(ids));
    }
    return 0;
}
