// Probe: how fast SM code (plain loads and stores, TMA bulk copies) reads and
// writes pinned host memory over PCIe, against the copy engines (cudaMemcpyAsync,
// a loop of them, cudaMemcpyBatchAsync) on the same bytes.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <chrono>
#include <cuda_runtime.h>
#include "check.h"

template <int UNROLL>
__global__ void plain_copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t n) {
  size_t tile = (size_t)blockDim.x * UNROLL;
  for (size_t base = blockIdx.x * tile; base < n; base += (size_t)gridDim.x * tile) {
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < n) v[k] = src[i]; }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < n) dst[i] = v[k]; }
  }
}

// chunk-pair copy like vectorized_copy: each CTA handles one pair (pair-major grid with split)
__global__ void pair_copy(const uint4 *const *srcs, uint4 *const *dsts, size_t nvec, int split) {
  int pair = blockIdx.x / split, s = blockIdx.x % split;
  const uint4 *src = srcs[pair]; uint4 *dst = dsts[pair];
  size_t per = (nvec + split - 1) / split, lo = s * per, hi = min(nvec, lo + per);
  for (size_t base = lo; base < hi; base += blockDim.x * 4) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < hi) v[k] = src[i]; }
#pragma unroll
    for (int k = 0; k < 4; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < hi) dst[i] = v[k]; }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HAVE_TMA 1
#endif
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// TMA bulk copy: one elected thread per CTA, STAGES buffers of TILE bytes.
template <int STAGES, int TILE>
__global__ void tma_copy(const char *src, char *dst, size_t nbytes) {
#ifdef HAVE_TMA
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;");
  size_t ntiles = (nbytes + TILE - 1) / TILE;
  // my tiles: blockIdx.x, +gridDim.x, ...
  size_t mine = ntiles > blockIdx.x ? (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto issue_load = [&](size_t k) {
    size_t t = blockIdx.x + k * gridDim.x; int s = k % STAGES;
    uint32_t bytes = (uint32_t)min((size_t)TILE, nbytes - t * TILE);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(&bar[s])), "r"(bytes));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(smem + s * TILE)), "l"(src + t * TILE), "r"(bytes), "r"(smem_addr(&bar[s])) : "memory");
  };
  for (size_t k = 0; k < mine && k < STAGES; ++k) issue_load(k);
  for (size_t k = 0; k < mine; ++k) {
    int s = k % STAGES; uint32_t phase = (k / STAGES) & 1;
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" :: "r"(smem_addr(&bar[s])), "r"(phase) : "memory");
    size_t t = blockIdx.x + k * gridDim.x;
    uint32_t bytes = (uint32_t)min((size_t)TILE, nbytes - t * TILE);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst + t * TILE), "r"(smem_addr(smem + s * TILE)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;");
    // refill the stage used by tile k-1 (its store is the second most recent group)
    if (k >= 1 && k - 1 + STAGES < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(k - 1 + STAGES);
    }
  }
  // tail: refill for the last tile handled above; ensure everything done
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

struct Timer { cudaEvent_t a, b; Timer() { cudaEventCreate(&a); cudaEventCreate(&b);} };
template <class F> float time_us(F f, int reps, cudaStream_t st) {
  Timer t; std::vector<float> v;
  for (int i = 0; i < 3; ++i) f();
  CK(cudaStreamSynchronize(st));
  for (int r = 0; r < reps; ++r) { cudaEventRecord(t.a, st); f(); cudaEventRecord(t.b, st); CK(cudaEventSynchronize(t.b)); float ms; cudaEventElapsedTime(&ms, t.a, t.b); v.push_back(ms * 1000); }
  std::sort(v.begin(), v.end()); return v[v.size() / 2];
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t big = (size_t)1 << 30;
  char *d, *h; CK(cudaMalloc(&d, big)); CK(cudaHostAlloc(&h, big, 0));
  memset(h, 1, big); CK(cudaMemset(d, 2, big));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t sizes[] = {(size_t)5242880, (size_t)64 * 5242880, big};
  printf("%-34s %12s %9s %9s\n", "case", "bytes", "us", "GB/s");
  auto report = [](const char *name, size_t bytes, float us) { printf("%-34s %12zu %9.1f %9.2f\n", name, bytes, us, bytes / us / 1e3); };
  for (size_t n : sizes) {
    int reps = n > 100000000 ? 10 : 50;
    report("memcpy H2D", n, time_us([&]{ CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, st)); }, reps, st));
    report("memcpy D2H", n, time_us([&]{ CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, st)); }, reps, st));
    size_t nv = n / 16;
    for (int threads : {256, 512}) {
      int grid4 = (int)std::min<size_t>((nv + threads * 4 - 1) / (threads * 4), (size_t)sms * 16);
      char name[64];
      snprintf(name, 64, "plain u4 t%d H2D", threads);
      report(name, n, time_us([&]{ plain_copy<4><<<grid4, threads, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st));
      snprintf(name, 64, "plain u4 t%d D2H", threads);
      report(name, n, time_us([&]{ plain_copy<4><<<grid4, threads, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st));
      int grid8 = (int)std::min<size_t>((nv + threads * 8 - 1) / (threads * 8), (size_t)sms * 16);
      snprintf(name, 64, "plain u8 t%d H2D", threads);
      report(name, n, time_us([&]{ plain_copy<8><<<grid8, threads, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st));
    }
    {
      auto k = tma_copy<4, 16384>; int smem = 4 * 16384;
      CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      for (int per : {1, 2, 3}) {
        int grid = sms * per; char name[64];
        snprintf(name, 64, "tma 4x16K g%dxSM H2D", per);
        report(name, n, time_us([&]{ k<<<grid, 32, smem, st>>>(h, d, n); }, reps, st));
        snprintf(name, 64, "tma 4x16K g%dxSM D2H", per);
        report(name, n, time_us([&]{ k<<<grid, 32, smem, st>>>(d, h, n); }, reps, st));
      }
      auto k2 = tma_copy<8, 8192>; int smem2 = 8 * 8192;
      CK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem2));
      report("tma 8x8K g2xSM H2D", n, time_us([&]{ k2<<<sms * 2, 32, smem2, st>>>(h, d, n); }, reps, st));
      report("tma 8x8K g2xSM D2H", n, time_us([&]{ k2<<<sms * 2, 32, smem2, st>>>(d, h, n); }, reps, st));
      CK(cudaGetLastError());
    }
  }
  // correctness of tma H2D
  {
    size_t n = 64 * 5242880; for (size_t i = 0; i < n; i += 4096) h[i] = (char)(i * 7 + 3);
    CK(cudaMemset(d, 0, n));
    tma_copy<4, 16384><<<sms * 2, 32, 4 * 16384, st>>>(h, d, n); CK(cudaStreamSynchronize(st));
    std::vector<char> back(n); CK(cudaMemcpy(back.data(), d, n, cudaMemcpyDeviceToHost));
    printf("tma check: %s\n", memcmp(back.data(), h, n) == 0 ? "ok" : "MISMATCH");
  }
  // chunk pairs: 10240 chunks of 32 KB, device <-> pinned, kernel vs async loop vs batch
  {
    const int np = 10240; const size_t cb = 32768;
    std::vector<void*> hs(np), ds(np);
    for (int i = 0; i < np; ++i) { hs[i] = h + (size_t)i * cb; ds[i] = d + (size_t)((i * 7919) % np) * cb; }
    void **tbl; CK(cudaMalloc(&tbl, 2 * np * sizeof(void*)));
    for (int dir = 0; dir < 2; ++dir) {
      std::vector<void*> &src = dir == 0 ? hs : ds, &dst = dir == 0 ? ds : hs;
      CK(cudaMemcpy(tbl, src.data(), np * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(tbl + np, dst.data(), np * 8, cudaMemcpyHostToDevice));
      const char *dn = dir == 0 ? "H2D" : "D2H";
      char name[64];
      for (int split : {1, 2}) {
        snprintf(name, 64, "pairs kernel split%d %s", split, dn);
        report(name, np * cb, time_us([&]{ pair_copy<<<np * split, 256, 0, st>>>((const uint4*const*)tbl, (uint4*const*)(tbl + np), cb / 16, split); }, 20, st));
      }
      snprintf(name, 64, "pairs async loop %s", dn);
      report(name, np * cb, time_us([&]{ for (int i = 0; i < np; ++i) cudaMemcpyAsync(dst[i], src[i], cb, cudaMemcpyDefault, st); }, 5, st));
      std::vector<size_t> sz(np, cb);
      cudaMemcpyAttributes attr = {}; attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; size_t idx = 0;
      snprintf(name, 64, "pairs batch %s", dn);
      report(name, np * cb, time_us([&]{ CK(cudaMemcpyBatchAsync((const void*const*)dst.data(), (const void*const*)src.data(), sz.data(), np, &attr, &idx, 1, st)); }, 5, st));
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      snprintf(name, 64, "pairs batch overlap %s", dn);
      report(name, np * cb, time_us([&]{ CK(cudaMemcpyBatchAsync((const void*const*)dst.data(), (const void*const*)src.data(), sz.data(), np, &attr, &idx, 1, st)); }, 5, st));
      attr.flags = 0;
      // host time of batch
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < 5; ++r) CK(cudaMemcpyBatchAsync((const void*const*)dst.data(), (const void*const*)src.data(), sz.data(), np, &attr, &idx, 1, st));
      auto t1 = std::chrono::steady_clock::now(); CK(cudaStreamSynchronize(st));
      printf("batch host us per call %s: %.1f\n", dn, std::chrono::duration<double, std::micro>(t1 - t0).count() / 5);
      // legacy stream batch
      cudaError_t e = cudaMemcpyBatchAsync((const void*const*)dst.data(), (const void*const*)src.data(), sz.data(), np, &attr, &idx, 1, 0);
      printf("batch on stream 0: %s\n", cudaGetErrorName(e)); cudaGetLastError(); cudaDeviceSynchronize();
      // pointer attribute cost
      t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < np; ++i) { cudaPointerAttributes a; cudaPointerGetAttributes(&a, src[i]); }
      t1 = std::chrono::steady_clock::now();
      printf("cudaPointerGetAttributes us each: %.3f\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / np);
    }
  }
  return 0;
}
