// Probe: what a staged transfer pays beyond its copies, and whether the copy
// engines could rearrange bytes themselves.
//
//   1. Hand-offs between the copy engines and the SMs: chains of a small
//      device-to-pinned copy and a tiny kernel, on one stream or on two
//      joined by events, against a chain of copies alone; the difference per
//      link is the hand-off's cost.
//   2. One strided copy: cudaMemcpy2DAsync with rows of 256 to 4096 bytes
//      (every 8th row of a device buffer, as one head of an NHD chunk),
//      against a contiguous copy of the same bytes.
//   3. cudaMemcpy3DBatchAsync gathering NHD cache heads into universal blocks
//      (one op per block, head and layer, K and V as its depth): GPU and host
//      time against one memcpy of the same bytes.
//
// Build: nvcc -O2 -arch=sm_90 -o copy_engine_handoffs copy_engine_handoffs.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

#include "check.h"

static double now_us()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

__global__ void tiny(int *p) { if (threadIdx.x == 0) p[blockIdx.x] += 1; }

enum { NL = 80, NO = 2, NH = 8, NT = 16, HD = 128, NBC = 256, ROW = HD * 2 };
constexpr size_t BLOCK = (size_t)NL * NO * NT * NH * ROW;  // 5,242,880 bytes

struct Timer {
    cudaEvent_t a, b;
    Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
    void start(cudaStream_t s) { CK(cudaEventRecord(a, s)); }
    double stop_us(cudaStream_t s)
    {
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        return ms * 1000.0;
    }
};

static void handoffs(char *dev, char *pinned, int *flags)
{
    cudaStream_t s, t;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    cudaEvent_t e, f;
    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&f, cudaEventDisableTiming));
    Timer timer;
    const int N = 200;
    const size_t bytes = 4096;
    auto copy = [&](cudaStream_t st) { CK(cudaMemcpyAsync(pinned, dev, bytes, cudaMemcpyDeviceToHost, st)); };
    auto kernel = [&](cudaStream_t st) { tiny<<<1, 32, 0, st>>>(flags); CK(cudaGetLastError()); };
    const char *names[] = {"copy, copy (one stream)", "copy, kernel (one stream)",
                           "copy, wait (satisfied), copy (one stream)", "copy -> event -> kernel on another stream -> event -> back"};
    double per[4];
    for (int mode = 0; mode < 4; mode++) {
        for (int warm = 0; warm < 2; warm++) {
            timer.start(s);
            for (int i = 0; i < N; i++) {
                copy(s);
                if (mode == 0)
                    copy(s);
                else if (mode == 1)
                    kernel(s);
                else if (mode == 2) {
                    CK(cudaEventRecord(e, t));  // t is idle: satisfied at once
                    CK(cudaStreamWaitEvent(s, e, 0));
                    copy(s);
                }
                else {
                    CK(cudaEventRecord(e, s));
                    CK(cudaStreamWaitEvent(t, e, 0));
                    kernel(t);
                    CK(cudaEventRecord(f, t));
                    CK(cudaStreamWaitEvent(s, f, 0));
                }
            }
            per[mode] = timer.stop_us(s) / N;
        }
        printf("handoff  %-58s %6.2f us per pair\n", names[mode], per[mode]);
    }
    printf("handoff  copy -> kernel (one stream) costs %.2f us more than copy -> copy; "
           "copy -> kernel on another stream and back %.2f us more\n", per[1] - per[0], per[3] - per[0]);
    CK(cudaStreamDestroy(s));
    CK(cudaStreamDestroy(t));
}

static void strided(char *dev, char *pinned)
{
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Timer timer;
    const int R = 20;
    for (size_t bytes : {(size_t)655360, BLOCK}) {
        double us[2];
        for (int to_host = 1; to_host >= 0; to_host--) {
            timer.start(s);
            for (int r = 0; r < R; r++)
                CK(cudaMemcpyAsync(to_host ? pinned : dev, to_host ? dev : pinned, bytes, cudaMemcpyDefault, s));
            us[to_host] = timer.stop_us(s) / R;
        }
        printf("strided  %7zu B contiguous: d2h %5.1f GB/s, h2d %5.1f GB/s\n", bytes, bytes / us[1] / 1e3,
               bytes / us[0] / 1e3);
        for (size_t width : {(size_t)256, (size_t)512, (size_t)1024, (size_t)4096}) {
            const size_t rows = bytes / width, pitch = 8 * width;
            for (int to_host = 1; to_host >= 0; to_host--) {
                CK(cudaMemcpy2DAsync(pinned, width, dev, pitch, width, rows, cudaMemcpyDefault, s));  // warm
                timer.start(s);
                for (int r = 0; r < R; r++) {
                    if (to_host)
                        CK(cudaMemcpy2DAsync(pinned, width, dev, pitch, width, rows, cudaMemcpyDefault, s));
                    else
                        CK(cudaMemcpy2DAsync(dev, pitch, pinned, width, width, rows, cudaMemcpyDefault, s));
                }
                us[to_host] = timer.stop_us(s) / R;
            }
            printf("strided  %7zu B in rows of %4zu (device pitch %5zu): d2h %5.1f GB/s, h2d %5.1f GB/s\n", bytes,
                   width, pitch, bytes / us[1] / 1e3, bytes / us[0] / 1e3);
        }
    }
    CK(cudaStreamDestroy(s));
}

static void batch3d(char *pinned, char *dev)
{
    std::vector<char *> layers(NL);
    for (auto &l : layers)
        CK(cudaMalloc(&l, (size_t)NO * NBC * NT * NH * ROW));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Timer timer;
    int ids[64];
    for (int i = 0; i < 64; i++)
        ids[i] = (i * 37 + 11) % NBC;
    for (int to_host = 1; to_host >= 0; to_host--) {
        for (int nb : {1, 8}) {
            std::vector<cudaMemcpy3DBatchOp> ops;
            for (int b = 0; b < nb; b++)
                for (int h = 0; h < NH; h++)
                    for (int l = 0; l < NL; l++) {
                        cudaMemcpy3DOperand cache, universal;
                        memset(&cache, 0, sizeof cache);
                        memset(&universal, 0, sizeof universal);
                        cache.type = universal.type = cudaMemcpyOperandTypePointer;
                        // cache [no, NBC, nt, nh, hd]: rows of one head are NH*ROW apart, K and V NBC*NT rows
                        cache.op.ptr.ptr = layers[l] + (size_t)ids[b] * NT * NH * ROW + (size_t)h * ROW;
                        cache.op.ptr.rowLength = NH * ROW;
                        cache.op.ptr.layerHeight = (size_t)NBC * NT;
                        // universal [nh, nl, no, nt, hd]: packed
                        universal.op.ptr.ptr = pinned + b * BLOCK + ((size_t)h * NL + l) * NO * NT * ROW;
                        universal.op.ptr.rowLength = ROW;
                        universal.op.ptr.layerHeight = NT;
                        cudaMemcpy3DBatchOp op;
                        memset(&op, 0, sizeof op);
                        op.src = to_host ? cache : universal;
                        op.dst = to_host ? universal : cache;
                        op.extent = make_cudaExtent(ROW, NT, NO);
                        op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                        ops.push_back(op);
                    }
            const size_t bytes = nb * BLOCK;
            const int R = 5;
            CK(cudaMemcpy3DBatchAsync(ops.size(), ops.data(), 0, s));
            CK(cudaStreamSynchronize(s));
            const double host0 = now_us();
            timer.start(s);
            for (int r = 0; r < R; r++)
                CK(cudaMemcpy3DBatchAsync(ops.size(), ops.data(), 0, s));
            const double host = (now_us() - host0) / R;
            const double gpu = timer.stop_us(s) / R;
            timer.start(s);
            for (int r = 0; r < R; r++)
                CK(cudaMemcpyAsync(to_host ? pinned : dev, to_host ? dev : pinned, bytes, cudaMemcpyDefault, s));
            const double one = timer.stop_us(s) / R;
            printf("batch3d  %s nb=%d: %5zu ops of %d B: %8.1f us (%4.1f GB/s), host %8.1f us (%.2f us an op); "
                   "one memcpy %6.1f us\n", to_host ? "d2h" : "h2d", nb, ops.size(), NO * NT * ROW, gpu,
                   bytes / gpu / 1e3, host, host / ops.size(), one);
        }
    }
    for (auto l : layers)
        CK(cudaFree(l));
    CK(cudaStreamDestroy(s));
}

int main()
{
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device   %s\n", prop.name);
    char *dev, *pinned;
    int *flags;
    CK(cudaMalloc(&dev, 8 * 8 * BLOCK));
    CK(cudaMallocHost(&pinned, 8 * BLOCK));
    CK(cudaMalloc(&flags, 64 * sizeof(int)));
    handoffs(dev, pinned, flags);
    strided(dev, pinned);
    batch3d(pinned, dev);
    return 0;
}
