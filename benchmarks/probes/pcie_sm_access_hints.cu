// Probe: whether access hints (ld.global.nc, L2 prefetch sizes, streaming
// stores) or the grid size move SM reads and writes of pinned host memory
// closer to the copy engines' rate.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "check.h"
template <int MODE> __device__ __forceinline__ uint4 load(const uint4 *p) {
  uint4 v;
  if (MODE == 0) v = *p;
  else if (MODE == 1) asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (MODE == 2) asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (MODE == 3) asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (MODE == 4) asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (MODE == 5) asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <int MODE, int SMODE>
__global__ void copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t n) {
  size_t tile = (size_t)blockDim.x * 4;
  for (size_t base = blockIdx.x * tile; base < n; base += (size_t)gridDim.x * tile) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < n) v[k] = load<MODE>(src + i); }
#pragma unroll
    for (int k = 0; k < 4; ++k) { size_t i = base + threadIdx.x + k * blockDim.x; if (i < n) {
      if (SMODE == 0) dst[i] = v[k];
      else if (SMODE == 1) __stcs(dst + i, v[k]);
      else if (SMODE == 2) asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(dst + i), "r"(v[k].x), "r"(v[k].y), "r"(v[k].z), "r"(v[k].w));
      else if (SMODE == 3) __stwt(dst + i, v[k]);
    } }
  }
}
template <class F> float time_us(F f, int reps, cudaStream_t st) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); std::vector<float> v;
  for (int i = 0; i < 3; ++i) f();
  CK(cudaStreamSynchronize(st));
  for (int r = 0; r < reps; ++r) { cudaEventRecord(a, st); f(); cudaEventRecord(b, st); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); v.push_back(ms * 1000); }
  std::sort(v.begin(), v.end()); return v[v.size() / 2];
}
int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t big = (size_t)64 * 5242880; char *d, *h; CK(cudaMalloc(&d, big)); CK(cudaHostAlloc(&h, big, 0)); memset(h, 1, big); CK(cudaMemset(d, 2, big));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto report = [](const char *name, size_t bytes, float us, float ref) { printf("%-28s %12zu %9.1f %7.2f GB/s %6.1f%%\n", name, bytes, us, bytes / us / 1e3, 100 * ref / us); };
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) { size_t g; CK(cudaDeviceSetLimit(cudaLimitMaxL2FetchGranularity, 128)); cudaDeviceGetLimit(&g, cudaLimitMaxL2FetchGranularity); printf("-- L2 fetch granularity %zu\n", g); }
    else { size_t g; cudaDeviceGetLimit(&g, cudaLimitMaxL2FetchGranularity); printf("-- default L2 fetch granularity %zu\n", g); }
    for (size_t n : {(size_t)5242880, big}) {
      int reps = n > 100000000 ? 10 : 50; size_t nv = n / 16; int grid = (int)std::min<size_t>((nv + 1023) / 1024, (size_t)sms * 16);
      float h2d = time_us([&]{ CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, st)); }, reps, st);
      float d2h = time_us([&]{ CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, st)); }, reps, st);
      report("memcpy H2D", n, h2d, h2d); report("memcpy D2H", n, d2h, d2h);
      report("H2D plain", n, time_us([&]{ copy<0,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("H2D nc", n, time_us([&]{ copy<1,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("H2D nc.L2::256B", n, time_us([&]{ copy<2,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("H2D L2::256B", n, time_us([&]{ copy<3,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("H2D L2::128B", n, time_us([&]{ copy<4,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("H2D cs", n, time_us([&]{ copy<5,0><<<grid, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
      report("D2H plain", n, time_us([&]{ copy<0,0><<<grid, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      report("D2H stcs", n, time_us([&]{ copy<0,1><<<grid, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      report("D2H no_allocate", n, time_us([&]{ copy<0,2><<<grid, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      report("D2H stwt", n, time_us([&]{ copy<0,3><<<grid, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      report("D2H L2::256B load", n, time_us([&]{ copy<3,0><<<grid, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      for (int g : {sms, sms * 2, sms * 4}) {
        char name[40]; snprintf(name, 40, "H2D L2::256B grid %d", g);
        report(name, n, time_us([&]{ copy<3,0><<<g, 256, 0, st>>>((uint4*)h, (uint4*)d, nv); }, reps, st), h2d);
        snprintf(name, 40, "D2H plain grid %d", g);
        report(name, n, time_us([&]{ copy<0,0><<<g, 256, 0, st>>>((uint4*)d, (uint4*)h, nv); }, reps, st), d2h);
      }
    }
  }
  CK(cudaGetLastError());
  return 0;
}
