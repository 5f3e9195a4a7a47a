// The staged pipeline the staging probes share: pieces cut as route.c cuts a
// call, a copy kernel standing in for the permute, and staging.c's enqueue of
// them (design A of staged_slot_streams.cu and staged_off_thread.cu).
#ifndef PROBES_STAGED_PIPELINE_H
#define PROBES_STAGED_PIPELINE_H

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

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
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

// A 1 MiB lead, a ramp growing 6x up to 4 MiB on the edge CTAs, then pieces
// doubling up to 24 MiB (half of a 48 MiB lane).
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

// Streams, events and memory of the probes' designs (each uses what it needs).
struct Pipe {
    cudaStream_t caller, permute, copies, slot[2];
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

// staging.c's pipeline: permutes on p.permute, copies on `base`, the stream the
// call follows and ends on; each piece's first stage hands its slot to the
// second through `ready`, the second frees it through `freed`.
static void pipeline(const Pipe &p, const std::vector<Piece> &pieces, int offload, cudaStream_t base)
{
    const int count = (int)pieces.size();
    const cudaStream_t first = offload ? p.permute : base, second = offload ? base : p.permute;
    if (offload) {
        CK(cudaEventRecord(p.handoff, base));
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
        CK(cudaStreamWaitEvent(base, p.handoff, 0));
    }
}

// The reference: one pinned memcpy of the call's bytes on the caller's stream.
static void memcpy_reference(const Pipe &p, size_t total, int offload)
{
    if (offload)
        CK(cudaMemcpyAsync(p.pinned, p.device, total, cudaMemcpyDeviceToHost, p.caller));
    else
        CK(cudaMemcpyAsync(p.device, p.pinned, total, cudaMemcpyHostToDevice, p.caller));
}

// What every probe run needs: `most` bytes of device, pinned and source memory
// (random bytes, also in host[]), two slots of staging, the timing events and
// the SM clock (kHz: cycles a ms); prints the GPU's name and `what`.
struct Bench {
    char *source;
    std::vector<char> host, back;
    cudaEvent_t start, stop;
    int clock_khz;
};

static Bench prepare(Pipe &p, size_t most, const char *what)
{
    Bench b;
    CK(cudaMalloc(&b.source, most));
    CK(cudaMalloc(&p.device, most));
    CK(cudaMalloc(&p.staging, 2 * PIECE));
    CK(cudaMallocHost(&p.pinned, most));
    b.host.resize(most);
    b.back.resize(most);
    srand(7);
    for (size_t i = 0; i < most; i++)
        b.host[i] = (char)rand();
    CK(cudaMemcpy(b.source, b.host.data(), most, cudaMemcpyHostToDevice));
    CK(cudaEventCreate(&b.start));
    CK(cudaEventCreate(&b.stop));
    CK(cudaDeviceGetAttribute(&b.clock_khz, cudaDevAttrClockRate, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s; %s\n", prop.name, what);
    return b;
}

// Before a checked call: the side it writes poisoned, the side it reads the
// source's bytes.
static void poison(const Pipe &p, const Bench &b, size_t total, int offload)
{
    CK(cudaMemcpy(p.device, b.source, total, cudaMemcpyDeviceToDevice));
    memset(p.pinned, 0x5a, total);
    if (!offload) {
        memcpy(p.pinned, b.host.data(), total);
        CK(cudaMemset(p.device, 0x5a, total));
    }
}

// `calls` calls of enqueue() back to back on the caller's stream, behind a
// GPU spin of `spin_cycles` that hides their host time: the GPU us from the
// first to the last (events on the caller's stream) and the host us a call.
struct Timed {
    double gpu_us, host_us;
};

template <class F>
static Timed timed_calls(const Pipe &p, const Bench &b, long long spin_cycles, int calls, F enqueue)
{
    spin<<<1, 1, 0, p.caller>>>(spin_cycles);
    CK(cudaEventRecord(b.start, p.caller));
    double host_us = 0;
    for (int i = 0; i < calls; i++) {
        const double t0 = now_us();
        enqueue();
        host_us += now_us() - t0;
    }
    CK(cudaEventRecord(b.stop, p.caller));
    CK(cudaEventSynchronize(b.stop));
    float ms;
    CK(cudaEventElapsedTime(&ms, b.start, b.stop));
    return {ms * 1e3, host_us / calls};
}

#endif  // PROBES_STAGED_PIPELINE_H
