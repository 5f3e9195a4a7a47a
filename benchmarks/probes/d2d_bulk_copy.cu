// Probe: whether a Hopper TMA bulk-copy kernel (cp.async.bulk through a ring
// of shared-memory stages), or a load/store kernel with cache hints and more
// bytes in flight, matches or beats a same-size device cudaMemcpyAsync, for
// one contiguous copy and for gathers of KV-cache chunks.
//
// d2d_gather_shapes found every load/store (LSU) shape, even a flat copy,
// 4-8 % under cudaMemcpyAsync at 36-90 MiB. The workloads here (destination
// packed; a gather's source a 4x larger cache of random nonzero bytes, read
// at distinct random block ids):
//
//   A. flat S MiB   one contiguous copy, S in {36, 128, 1024}
//   B. mla L        64 blocks x L layers (L in {32, 80}) of one 18432-byte
//                   chunk each (16 tokens x 576 bf16), each from its own block
//   C. row 8B       64 blocks x 32 layers x K,V chunks of [16 tokens][8 heads]
//                   [128] bf16 (the vLLM layer layout), each block rearranged
//                   to [8 heads][32 layers][2][16 tokens][128]: runs of 256
//                   bytes read, written into 4 KiB head-major runs; 128 MiB
//
// Variants:
//   memcpy          cudaMemcpyAsync D2D of the same bytes between contiguous
//                   buffers (the workload's reference)
//   lsu1, lsu2      256 threads, 1 or 2 vectors of 16 bytes each, one tile
//                   of 4 or 8 KiB per CTA
//   lsu4            the same with 4 vectors in flight, 16 KiB tiles (the
//                   library's shape)
//   lsu2 x8, lsu4 x8  lsu2 and lsu4 on 8 CTAs per SM looping over the tiles
//   memcpy again    the reference once more, after the kernels above (the
//                   first variant of a workload can run slower)
//   lsu8_cs         8 vectors in flight (32 KiB tiles), loads
//                   ld.global.nc.L1::no_allocate with an L2 evict_first
//                   policy, stores st.global.cs
//   pers2, pers4    lsu8 without hints on 2 or 4 CTAs per SM looping over
//                   the 32 KiB tiles; pers4_cs with lsu8_cs's hints
//   tma kK TK xC    one warp per CTA, C CTAs per SM looping over T-byte
//                   stages of the destination through a ring of K stages of
//                   shared memory: a stage is filled by one cp.async.bulk
//                   global->shared per contiguous source piece (18432-byte
//                   chunks cut at their ends, 256-byte rows for C), which
//                   complete on the stage's mbarrier, issued by up to 32
//                   lanes; lane 0 empties it with one cp.async.bulk
//                   shared->global and refills the stage of the store before
//                   once cp.async.bulk.wait_group.read 1 says it was read
//   tma_ef          the loads with an L2::cache_hint evict_first policy
//   tma_1t          every bulk copy issued by lane 0 alone (C only)
//
// Every variant's output is checked bitwise once (the destination cleared
// first) against the gather computed on the host; a wrong one prints
// MISMATCH and the probe exits 1. Each timed rep starts with L2 holding
// other bytes (a 96 MiB write first); median of 50 reps by events. Columns:
// us, GB/s (bytes moved once, not read + write), % of the workload's memcpy,
// % of a 1 GiB memcpy (the ceiling).
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o d2d_bulk_copy d2d_bulk_copy.cu
// Run:   ./d2d_bulk_copy
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <random>
#include <vector>

#include "check.h"
#include "timing.h"

constexpr int kThreads = 256;   // an LSU CTA
constexpr int kMaxStages = 16;  // a TMA ring
constexpr size_t kMiB = 1 << 20;
constexpr int kBlocks = 64;  // nb
constexpr size_t kMlaChunk = 16 * 576 * 2;
constexpr size_t kRowChunk = 16 * 8 * 128 * 2;           // one layer's K or V of a block
constexpr size_t kRowBlock = 8 * 32 * 2 * 16 * 128 * 2;  // a block in universal order

// The bytes of the source: word w of a buffer holds pattern(w), no byte zero.
__host__ __device__ inline uint64_t pattern(uint64_t word)
{
    uint64_t x = word + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x | 0x0101010101010101ull;
}

__global__ void fill(uint64_t *p, size_t words)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
        p[i] = pattern(i);
}

// bad[0] counts differing vectors, bad[1] is the first.
__global__ void compare(const uint4 *got, const uint4 *want, size_t vectors, unsigned long long *bad)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 a = got[i], b = want[i];
        if (a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w) {
            atomicAdd(&bad[0], 1ull);
            atomicMin(&bad[1], (unsigned long long)i);
        }
    }
}

// Where the byte at offset o of the packed destination comes from. The
// source is contiguous within each kGranule-aligned run of the destination.
struct Flat {
    static constexpr size_t kGranule = size_t(1) << 40;
    const char *src;
    __device__ const char *at(size_t o) const { return src + o; }
};

struct Mla {
    static constexpr size_t kGranule = kMlaChunk;
    const char *cache;
    const int *ids;  // the source chunk of each destination chunk
    __device__ const char *at(size_t o) const
    {
        const size_t c = o / kGranule;
        return cache + (size_t)__ldg(ids + c) * kGranule + (o - c * kGranule);
    }
};

// Destination block: [8 heads][32 layers][2][16 tokens][256 bytes] (2 MiB);
// source: [32 layers][2][cache_blocks][16 tokens][8 heads][256 bytes].
struct Row {
    static constexpr size_t kGranule = 256;
    const char *cache;
    const int *ids;  // the source block of each destination block
    int cache_blocks;
    __device__ const char *at(size_t o) const
    {
        const uint32_t r = (uint32_t)(o & (kRowBlock - 1));
        const uint32_t head = r >> 18, layer = (r >> 13) & 31, kv = (r >> 12) & 1, token = (r >> 8) & 15;
        const size_t chunk = (size_t)(layer * 2 + kv) * cache_blocks + __ldg(ids + o / kRowBlock);
        return cache + chunk * kRowChunk + (token * 8 + head) * 256 + (r & 255);
    }
};

__device__ __forceinline__ uint64_t evict_first_policy()
{
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

__device__ __forceinline__ uint4 load_ef(const void *p, uint64_t policy)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

__device__ __forceinline__ void store_cs(void *p, uint4 v)
{
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Tiles of U x 256 vectors, one per CTA while the grid covers them, else
// looped over. kHints: lsu8_cs's loads and stores.
template <class Map, int U, bool kHints>
__global__ void __launch_bounds__(kThreads) lsu(Map map, char *out, size_t vectors)
{
    [[maybe_unused]] uint64_t policy = 0;
    if constexpr (kHints)
        policy = evict_first_policy();
    for (size_t tile = blockIdx.x; tile * U * kThreads < vectors; tile += gridDim.x) {
        const size_t first = tile * U * kThreads + threadIdx.x;
        uint4 v[U];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const size_t i = first + k * kThreads;
            if (i < vectors) {
                if constexpr (kHints)
                    v[k] = load_ef(map.at(i * 16), policy);
                else
                    v[k] = *reinterpret_cast<const uint4 *>(map.at(i * 16));
            }
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const size_t i = first + k * kThreads;
            if (i < vectors) {
                if constexpr (kHints)
                    store_cs(out + i * 16, v[k]);
                else
                    *reinterpret_cast<uint4 *>(out + i * 16) = v[k];
            }
        }
    }
}

// The TMA and mbarrier operations; shared-memory operands are 32-bit
// shared-window addresses.
__device__ __forceinline__ uint32_t shared_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the async proxy (the bulk
// copies' complete_tx).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The phase's one arrival, expecting `bytes` of transactions.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Until the barrier's phase of this parity has completed. A wait over 2 s
// (a broken pipeline) traps, so the probe stops at CK instead of hanging.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint64_t since = 0;
    for (;;) {
        uint32_t done;
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
        if (done)
            return;
        const uint64_t now = global_ns();
        if (since == 0)
            since = now;
        else if (now - since > 2000000000ull) {
            printf("tma: block %d waited 2 s on a stage barrier (parity %u)\n", blockIdx.x, parity);
            __trap();
        }
    }
}

template <bool kHint>
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar, uint64_t policy)
{
    if constexpr (kHint)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
            "%4;" ::"r"(dst),
            "l"(src), "r"(bytes), "r"(bar), "l"(policy)
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
            "l"(src), "r"(bytes), "r"(bar)
            : "memory");
}

__device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until at most N of this thread's bulk groups have not finished reading
// their source (shared memory).
template <int N>
__device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Until all of this thread's bulk groups are complete (writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One warp per CTA. The destination is cut into items of stage_bytes; CTA b
// moves items b, b + gridDim.x, ... through `stages` stages of `ring`, item
// i in stage i % stages, whose barrier completes its (i / stages)-th phase
// when the item's bytes have landed. kLanes lanes issue an item's loads.
template <class Map, bool kHint, int kLanes>
__global__ void __launch_bounds__(32) tma(Map map, char *out, size_t bytes, int stages, uint32_t stage_bytes)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) uint64_t full[kMaxStages];
    const int lane = threadIdx.x;
    const uint32_t ring_at = shared_address(ring), full_at = shared_address(full);
    if (lane == 0) {
        for (int s = 0; s < stages; ++s)
            mbar_init(full_at + 8 * s, 1);
        mbar_init_fence();
    }
    __syncthreads();
    [[maybe_unused]] uint64_t policy = 0;
    if constexpr (kHint)
        policy = evict_first_policy();
    const size_t items = (bytes + stage_bytes - 1) / stage_bytes;
    const int mine = blockIdx.x < items ? (int)((items - 1 - blockIdx.x) / gridDim.x + 1) : 0;
    auto offset = [&](int i) { return (blockIdx.x + (size_t)i * gridDim.x) * stage_bytes; };
    auto length = [&](size_t o) { return (uint32_t)min((size_t)stage_bytes, bytes - o); };

    // Lane 0 arms item i's barrier with its byte count (the phase's one
    // arrival), then the lanes issue its contiguous source pieces.
    auto load = [&](int i) {
        const int s = i % stages;
        const size_t o = offset(i);
        const uint32_t len = length(o), bar = full_at + 8 * s, stage = ring_at + s * stage_bytes;
        if (lane == 0)
            mbar_arrive_expect_tx(bar, len);
        __syncwarp();
        const size_t g = o / Map::kGranule;
        const int pieces = (int)((o + len - 1) / Map::kGranule - g + 1);
        if (lane < kLanes)
            for (int j = lane; j < pieces; j += kLanes) {
                const size_t begin = j == 0 ? o : (g + j) * Map::kGranule;
                const size_t end = min(o + len, (g + j + 1) * Map::kGranule);
                bulk_load<kHint>(stage + (uint32_t)(begin - o), map.at(begin), (uint32_t)(end - begin), bar, policy);
            }
    };

    for (int i = 0; i < min(stages, mine); ++i)
        load(i);
    for (int i = 0; i < mine; ++i) {
        if (lane == 0) {
            const int s = i % stages;
            const size_t o = offset(i);
            mbar_wait(full_at + 8 * s, (i / stages) & 1);
            fence_proxy_async();  // defensive: the loads' writes before the store's reads
            bulk_store(out + o, ring_at + s * stage_bytes, length(o));
            bulk_commit();
            bulk_wait_read<1>();  // item i - 1's store has read its stage
        }
        __syncwarp();
        if (i >= 1 && i - 1 + stages < mine)
            load(i - 1 + stages);
    }
    if (lane == 0)
        bulk_wait_all();
}

struct Bench {
    cudaStream_t stream;
    cudaEvent_t start, stop;
    char *flush;
    size_t flush_bytes = 96 * kMiB;
    unsigned long long *bad;
    int sms;
    double ceiling = 0;  // GB/s of a 1 GiB memcpy
    // The workload being run.
    char *out = nullptr;
    const char *expect = nullptr;
    size_t bytes = 0;
    double memcpy_us = 0;

    template <class F>
    double time(F launch)
    {
        return median_us(stream, start, stop, flush, flush_bytes, launch);
    }

    template <class F>
    void verify(const char *name, F launch)
    {
        CK(cudaMemsetAsync(out, 0, bytes, stream));
        launch();
        CK(cudaGetLastError());
        const unsigned long long init[2] = {0, ~0ull};
        CK(cudaMemcpyAsync(bad, init, sizeof init, cudaMemcpyHostToDevice, stream));
        compare<<<sms * 8, 256, 0, stream>>>((const uint4 *)out, (const uint4 *)expect, bytes / 16, bad);
        CK(cudaGetLastError());
        unsigned long long got[2];
        CK(cudaMemcpyAsync(got, bad, sizeof got, cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        if (got[0]) {
            printf("MISMATCH: %s: %llu of %zu vectors differ, the first at byte %llu\n", name, got[0], bytes / 16,
                   got[1] * 16);
            exit(1);
        }
    }

    template <class F>
    void variant(const char *name, F launch)
    {
        verify(name, launch);
        const double us = time(launch), rate = bytes / us / 1e3;
        if (memcpy_us == 0)
            memcpy_us = us;
        printf("  %-18s %9.2f us  %7.1f GB/s  %6.1f %%  %6.1f %%\n", name, us, rate, 100 * memcpy_us / us,
               100 * rate / ceiling);
        fflush(stdout);
    }
};

struct TmaConfig {
    int stages, kib, per_sm;
    bool hint, one_lane;
};

// Every variant on the workload whose source `map` describes; `expect` is
// the gathered bytes, contiguous (the memcpy's source).
template <class Map>
void run(Bench &b, const Map &map, char *out, const char *expect, size_t bytes, bool row)
{
    b.out = out;
    b.expect = expect;
    b.bytes = bytes;
    b.memcpy_us = 0;
    printf("  %-18s %12s  %12s  %8s  %8s\n", "variant", "median", "rate", "memcpy", "ceiling");
    cudaStream_t stream = b.stream;
    b.variant("memcpy", [&] { CK(cudaMemcpyAsync(out, expect, bytes, cudaMemcpyDeviceToDevice, stream)); });
    const size_t vectors = bytes / 16;
    const unsigned sms = b.sms;
    const unsigned tiles4 = (unsigned)((vectors + 4 * kThreads - 1) / (4 * kThreads));
    const unsigned tiles8 = (unsigned)((vectors + 8 * kThreads - 1) / (8 * kThreads));
    const unsigned tiles1 = (unsigned)((vectors + kThreads - 1) / kThreads);
    const unsigned tiles2 = (unsigned)((vectors + 2 * kThreads - 1) / (2 * kThreads));
    b.variant("lsu1", [&] { lsu<Map, 1, false><<<tiles1, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("lsu2", [&] { lsu<Map, 2, false><<<tiles2, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("lsu4", [&] { lsu<Map, 4, false><<<tiles4, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("lsu2 x8", [&] { lsu<Map, 2, false><<<8 * sms, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("lsu4 x8", [&] { lsu<Map, 4, false><<<8 * sms, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("memcpy again", [&] { CK(cudaMemcpyAsync(out, expect, bytes, cudaMemcpyDeviceToDevice, stream)); });
    b.variant("lsu8_cs", [&] { lsu<Map, 8, true><<<tiles8, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("pers2", [&] { lsu<Map, 8, false><<<2 * sms, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("pers4", [&] { lsu<Map, 8, false><<<4 * sms, kThreads, 0, stream>>>(map, out, vectors); });
    b.variant("pers4_cs", [&] { lsu<Map, 8, true><<<4 * sms, kThreads, 0, stream>>>(map, out, vectors); });

    std::vector<TmaConfig> configs = {
        {4, 8, 1, false, false},   {4, 8, 2, false, false}, {4, 16, 1, false, false}, {4, 16, 2, false, false},
        {8, 8, 1, false, false},   {8, 8, 2, false, false}, {8, 16, 1, false, false}, {8, 16, 2, false, false},
        {12, 16, 1, false, false}, {8, 16, 1, true, false}, {8, 8, 2, true, false},
    };
    if (row) {
        configs.push_back({16, 4, 2, false, false});
        configs.push_back({8, 16, 1, false, true});
        configs.push_back({8, 8, 2, false, true});
    }
    for (const TmaConfig &c : configs) {
        using Kernel = void (*)(Map, char *, size_t, int, uint32_t);
        const Kernel kernel = c.hint       ? (Kernel)tma<Map, true, 32>
                              : c.one_lane ? (Kernel)tma<Map, false, 1>
                                           : (Kernel)tma<Map, false, 32>;
        const uint32_t stage_bytes = c.kib * 1024;
        const int smem = c.stages * stage_bytes;
        char name[64];
        snprintf(name, sizeof name, "tma%s k%d %dK x%d",
                 c.hint       ? "_ef"
                 : c.one_lane ? "_1t"
                              : "",
                 c.stages, c.kib, c.per_sm);
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int fit;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 32, smem));
        if (fit < c.per_sm) {
            printf("  %-18s skipped: %d KiB of shared memory per CTA, %d CTA(s) fit on an SM\n", name, smem >> 10, fit);
            continue;
        }
        const unsigned grid = c.per_sm * sms;
        b.variant(name, [&] { kernel<<<grid, 32, smem, stream>>>(map, out, bytes, c.stages, stage_bytes); });
    }
}

// A device buffer of `bytes` filled with pattern().
char *patterned(size_t bytes)
{
    char *p;
    CK(cudaMalloc(&p, bytes));
    fill<<<1024, 256>>>((uint64_t *)p, bytes / 8);
    CK(cudaGetLastError());
    return p;
}

// `n` distinct ids of [0, range).
std::vector<int> distinct(int n, int range, std::mt19937 &rng)
{
    std::vector<int> order(range);
    for (int i = 0; i < range; ++i)
        order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    order.resize(n);
    return order;
}

int *upload(const std::vector<int> &ids)
{
    int *p;
    CK(cudaMalloc(&p, ids.size() * sizeof(int)));
    CK(cudaMemcpy(p, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
    return p;
}

char *upload(const std::vector<uint64_t> &words)
{
    char *p;
    CK(cudaMalloc(&p, words.size() * 8));
    CK(cudaMemcpy(p, words.data(), words.size() * 8, cudaMemcpyHostToDevice));
    return p;
}

int main()
{
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("d2d_bulk_copy: %s, %d SMs, L2 %d MiB; median of 50 reps, each after a 96 MiB write\n", prop.name,
           prop.multiProcessorCount, prop.l2CacheSize >> 20);
    Bench b;
    b.sms = prop.multiProcessorCount;
    CK(cudaMalloc(&b.flush, b.flush_bytes));
    CK(cudaMalloc(&b.bad, 2 * sizeof(unsigned long long)));
    CK(cudaStreamCreate(&b.stream));
    CK(cudaEventCreate(&b.start));
    CK(cudaEventCreate(&b.stop));
    std::mt19937 rng(2026);

    {
        const size_t bytes = 1024 * kMiB;
        char *src, *dst;
        CK(cudaMalloc(&src, bytes));
        CK(cudaMalloc(&dst, bytes));
        const double us = b.time([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b.stream)); });
        b.ceiling = bytes / us / 1e3;
        printf("ceiling: a 1 GiB cudaMemcpyAsync D2D, %.2f us, %.1f GB/s\n", us, b.ceiling);
        CK(cudaFree(src));
        CK(cudaFree(dst));
    }

    for (int mib : {36, 128, 1024}) {
        const size_t bytes = mib * kMiB;
        printf("A. flat %d MiB\n", mib);
        char *src = patterned(bytes), *out;
        CK(cudaMalloc(&out, bytes));
        run(b, Flat{src}, out, src, bytes, false);
        CK(cudaFree(src));
        CK(cudaFree(out));
    }

    for (int layers : {32, 80}) {
        const int n = kBlocks * layers, cached = 4 * n;
        const size_t bytes = n * kMlaChunk;
        printf("B. mla gather: %d blocks x %d layers, %d chunks of %zu bytes from %d, %.1f MiB\n", kBlocks, layers, n,
               kMlaChunk, cached, bytes / (double)kMiB);
        const std::vector<int> ids = distinct(n, cached, rng);
        std::vector<uint64_t> want(bytes / 8);
        const size_t words = kMlaChunk / 8;
        for (int c = 0; c < n; ++c)
            for (size_t w = 0; w < words; ++w)
                want[c * words + w] = pattern(ids[c] * words + w);
        char *cache = patterned(cached * kMlaChunk), *expect = upload(want), *out;
        int *ids_at = upload(ids);
        CK(cudaMalloc(&out, bytes));
        run(b, Mla{cache, ids_at}, out, expect, bytes, false);
        CK(cudaFree(cache));
        CK(cudaFree(expect));
        CK(cudaFree(out));
        CK(cudaFree(ids_at));
    }

    {
        const int layers = 32, heads = 8, tokens = 16, cached = 4 * kBlocks;
        const size_t bytes = kBlocks * kRowBlock, run_bytes = tokens * 256;
        printf("C. row gather (8B vllm): %d blocks x %d layers x K,V of [%d tokens][%d heads][128] bf16 from %d "
               "blocks, into [heads][layers][2][tokens][128], %.1f MiB\n",
               kBlocks, layers, tokens, heads, cached, bytes / (double)kMiB);
        const std::vector<int> ids = distinct(kBlocks, cached, rng);
        std::vector<uint64_t> want(bytes / 8);
        for (int blk = 0; blk < kBlocks; ++blk)
            for (int h = 0; h < heads; ++h)
                for (int l = 0; l < layers; ++l)
                    for (int kv = 0; kv < 2; ++kv)
                        for (int t = 0; t < tokens; ++t) {
                            const size_t to = blk * kRowBlock + ((h * layers + l) * 2 + kv) * run_bytes + t * 256;
                            const size_t from =
                                ((size_t)(l * 2 + kv) * cached + ids[blk]) * kRowChunk + (t * heads + h) * 256;
                            for (size_t w = 0; w < 32; ++w)
                                want[to / 8 + w] = pattern(from / 8 + w);
                        }
        char *cache = patterned(layers * 2 * cached * kRowChunk), *expect = upload(want), *out;
        int *ids_at = upload(ids);
        CK(cudaMalloc(&out, bytes));
        run(b, Row{cache, ids_at, cached}, out, expect, bytes, true);
        CK(cudaFree(cache));
        CK(cudaFree(expect));
        CK(cudaFree(out));
        CK(cudaFree(ids_at));
    }
    return 0;
}
