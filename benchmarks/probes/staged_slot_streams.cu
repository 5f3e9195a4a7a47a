// Probe: whether a staged transfer can cost the host fewer CUDA calls per piece
// without losing its share of a memcpy.
//
//   A (staging.c today): the permutes on a high-priority stream, the copies on
//     the caller's stream, one queue; each piece records and waits for an event
//     each way (its slot ready, its slot free again): 6 calls a piece.
//   B: one high-priority stream per staging slot, each piece's permute and copy
//     on its slot's stream, in stream order, so that neither the hand-off nor
//     the slot's reuse needs an event: 2 calls a piece, and a fork and a join
//     with the caller's stream.
//
// Pieces as route.c cuts a call: a 1 MiB lead, a ramp growing 6x up to 4 MiB
// on 32 CTAs, then pieces doubling up to 24 MiB (half of a 48 MiB lane: 96 MiB
// of staging in two lanes) on 8 CTAs; two slots; an onload runs them largest
// first.  The permute is a copy kernel between device memory and the slot.
// For 5, 40, 128 and 320 MiB (Llama-3.1-70B blocks, nb = 1, 8, ~25, 64), each
// direction: the GPU time of a call (events on the caller's stream, behind a
// GPU sleep that hides the host's enqueue), its host time, and a pinned
// memcpy of the same bytes in the same round; medians of 30 rounds.  Every
// call's bytes are checked against the source once.
//
// Build: nvcc -O2 -arch=sm_90 -o staged_slot_streams staged_slot_streams.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "check.h"

static double now_us()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

__global__ void permute(const int4 *src, int4 *dst, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

__global__ void spin(long long cycles)
{
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

constexpr size_t MiB = (size_t)1 << 20, LEAD = MiB, RAMP = 4 * MiB, PIECE = 24 * MiB;

struct Piece {
    size_t offset, bytes;
    int edge;
};

static std::vector<Piece> cut(size_t total)
{
    std::vector<Piece> pieces;
    size_t at = 0, budget = LEAD;
    int edge = 1;
    while (at < total) {
        size_t bytes = std::min(budget, total - at);
        if (total - at - bytes < bytes && total - at <= PIECE)
            bytes = total - at;   // no remnant smaller than the piece before it
        pieces.push_back({at, bytes, edge});
        at += bytes;
        edge = edge && bytes < RAMP;
        budget = std::min(edge ? std::min(bytes * 6, RAMP) : bytes * 2, PIECE);
    }
    return pieces;
}

struct Pipe {
    cudaStream_t caller, permute, slot[2];
    cudaEvent_t handoff, joined[2], ready[2], freed[2];
    char *device, *staging, *pinned;
};

static void launch(const Pipe &p, const Piece &piece, char *slot, int offload, cudaStream_t stream)
{
    const int4 *src = (const int4 *)(offload ? p.device + piece.offset : slot);
    int4 *dst = (int4 *)(offload ? slot : p.device + piece.offset);
    permute<<<piece.edge ? 32 : 8, 256, 0, stream>>>(src, dst, piece.bytes / sizeof(int4));
    CK(cudaGetLastError());
}

static void copy(const Pipe &p, const Piece &piece, char *slot, int offload, cudaStream_t stream)
{
    if (offload)
        CK(cudaMemcpyAsync(p.pinned + piece.offset, slot, piece.bytes, cudaMemcpyDeviceToHost, stream));
    else
        CK(cudaMemcpyAsync(slot, p.pinned + piece.offset, piece.bytes, cudaMemcpyHostToDevice, stream));
}

// A piece's first stage (an offload's permute, an onload's copy) or its second.
static void stage(const Pipe &p, const Piece &piece, char *slot, int offload, int second, cudaStream_t stream)
{
    if (offload != second)
        launch(p, piece, slot, offload, stream);
    else
        copy(p, piece, slot, offload, stream);
}

// staging.c's pipeline: permutes on p.permute, copies on the caller's stream; each piece's
// first stage hands its slot to the second through `ready`, the second frees it through `freed`.
static void run_a(const Pipe &p, const std::vector<Piece> &pieces, int offload)
{
    const int count = (int)pieces.size();
    const cudaStream_t first = offload ? p.permute : p.caller, second = offload ? p.caller : p.permute;
    if (offload) {
        CK(cudaEventRecord(p.handoff, p.caller));
        CK(cudaStreamWaitEvent(p.permute, p.handoff, 0));
    }
    for (int k = 0; k < count; k++) {
        const Piece &piece = pieces[offload ? k : count - 1 - k];
        const int s = k % 2;
        char *slot = p.staging + s * PIECE;
        if (k >= 2)
            CK(cudaStreamWaitEvent(first, p.freed[s], 0));
        stage(p, piece, slot, offload, 0, first);
        CK(cudaEventRecord(p.ready[s], first));
        CK(cudaStreamWaitEvent(second, p.ready[s], 0));
        stage(p, piece, slot, offload, 1, second);
        if (k + 2 < count)
            CK(cudaEventRecord(p.freed[s], second));
    }
    if (!offload) {
        CK(cudaEventRecord(p.handoff, p.permute));
        CK(cudaStreamWaitEvent(p.caller, p.handoff, 0));
    }
}

// One stream per slot: a piece's permute and copy in its slot's stream order.
static void run_b(const Pipe &p, const std::vector<Piece> &pieces, int offload)
{
    const int count = (int)pieces.size();
    CK(cudaEventRecord(p.handoff, p.caller));
    for (int s = 0; s < 2; s++)
        CK(cudaStreamWaitEvent(p.slot[s], p.handoff, 0));
    for (int k = 0; k < count; k++) {
        const Piece &piece = pieces[offload ? k : count - 1 - k];
        const int s = k % 2;
        char *slot = p.staging + s * PIECE;
        stage(p, piece, slot, offload, 0, p.slot[s]);
        stage(p, piece, slot, offload, 1, p.slot[s]);
    }
    for (int s = 0; s < 2; s++) {
        CK(cudaEventRecord(p.joined[s], p.slot[s]));
        CK(cudaStreamWaitEvent(p.caller, p.joined[s], 0));
    }
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main()
{
    const size_t sizes[] = {5 * MiB, 40 * MiB, 128 * MiB, 320 * MiB}, most = 320 * MiB;
    Pipe p;
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CK(cudaStreamCreateWithFlags(&p.caller, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithPriority(&p.permute, cudaStreamNonBlocking, greatest));
    cudaEvent_t *events[] = {&p.handoff, &p.joined[0], &p.joined[1], &p.ready[0], &p.ready[1], &p.freed[0], &p.freed[1]};
    for (cudaEvent_t *e : events)
        CK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (int s = 0; s < 2; s++)
        CK(cudaStreamCreateWithPriority(&p.slot[s], cudaStreamNonBlocking, greatest));
    char *source;
    CK(cudaMalloc(&source, most));
    CK(cudaMalloc(&p.device, most));
    CK(cudaMalloc(&p.staging, 2 * PIECE));
    CK(cudaMallocHost(&p.pinned, most));
    std::vector<char> host(most), back(most);
    srand(7);
    for (size_t i = 0; i < most; i++)
        host[i] = (char)rand();
    CK(cudaMemcpy(source, host.data(), most, cudaMemcpyHostToDevice));
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("%s; pieces as route.c cuts them (lead 1 MiB, ramp to 4 MiB, up to 24 MiB), two slots\n", prop.name);
    const char *names[] = {"A: staging.c", "B: slot streams"};
    for (int offload = 1; offload >= 0; offload--)
        for (size_t total : sizes) {
            const std::vector<Piece> pieces = cut(total);
            // Correctness: every byte where it belongs, poisoned first.
            for (int design = 0; design < 2; design++) {
                CK(cudaMemcpy(p.device, source, total, cudaMemcpyDeviceToDevice));
                memset(p.pinned, 0x5a, total);
                if (!offload) {
                    memcpy(p.pinned, host.data(), total);
                    CK(cudaMemset(p.device, 0x5a, total));
                }
                (design ? run_b : run_a)(p, pieces, offload);
                CK(cudaStreamSynchronize(p.caller));
                const char *got = offload ? p.pinned : back.data();
                if (!offload)
                    CK(cudaMemcpy(back.data(), p.device, total, cudaMemcpyDeviceToHost));
                if (memcmp(got, host.data(), total) != 0) {
                    printf("%s %s %zu MiB: wrong bytes\n", names[design], offload ? "offload" : "onload", total >> 20);
                    return 1;
                }
            }
            std::vector<double> gpu[3], host_us[3];
            for (int round = 0; round < 35; round++)
                for (int way = 0; way < 3; way++) {
                    spin<<<1, 1, 0, p.caller>>>((long long)clock_khz * 3 / 10);   // 300 us at the base clock (kHz: cycles a ms)
                    CK(cudaEventRecord(start, p.caller));
                    const double t0 = now_us();
                    if (way < 2)
                        (way ? run_b : run_a)(p, pieces, offload);
                    else if (offload)
                        CK(cudaMemcpyAsync(p.pinned, p.device, total, cudaMemcpyDeviceToHost, p.caller));
                    else
                        CK(cudaMemcpyAsync(p.device, p.pinned, total, cudaMemcpyHostToDevice, p.caller));
                    const double t1 = now_us();
                    CK(cudaEventRecord(stop, p.caller));
                    CK(cudaEventSynchronize(stop));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, start, stop));
                    if (round >= 5) {
                        gpu[way].push_back(ms * 1e3);
                        host_us[way].push_back(t1 - t0);
                    }
                }
            const double memcpy_us = median(gpu[2]);
            printf("%-7s %3zu MiB, %2zu pieces: memcpy %7.1f us", offload ? "offload" : "onload", total >> 20,
                   pieces.size(), memcpy_us);
            for (int design = 0; design < 2; design++)
                printf(" | %s: %7.1f us, %5.1f %% of memcpy, host %6.1f us", names[design], median(gpu[design]),
                       100.0 * memcpy_us / median(gpu[design]), median(host_us[design]));
            printf("\n");
        }
    return 0;
}
