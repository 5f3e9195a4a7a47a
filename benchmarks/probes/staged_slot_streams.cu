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

#include <vector>

#include "staged_pipeline.h"

static void run_a(const Pipe &p, const std::vector<Piece> &pieces, int offload)
{
    pipeline(p, pieces, offload, p.caller);
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
    Bench b = prepare(p, most, "pieces as route.c cuts them (lead 1 MiB, ramp to 4 MiB, up to 24 MiB), two slots");
    const char *names[] = {"A: staging.c", "B: slot streams"};
    for (int offload = 1; offload >= 0; offload--)
        for (size_t total : sizes) {
            const std::vector<Piece> pieces = cut(total);
            // Correctness: every byte where it belongs, poisoned first.
            for (int design = 0; design < 2; design++) {
                poison(p, b, total, offload);
                (design ? run_b : run_a)(p, pieces, offload);
                CK(cudaStreamSynchronize(p.caller));
                const char *got = offload ? p.pinned : b.back.data();
                if (!offload)
                    CK(cudaMemcpy(b.back.data(), p.device, total, cudaMemcpyDeviceToHost));
                if (memcmp(got, b.host.data(), total) != 0) {
                    printf("%s %s %zu MiB: wrong bytes\n", names[design], offload ? "offload" : "onload", total >> 20);
                    return 1;
                }
            }
            std::vector<double> gpu[3], host_us[3];
            for (int round = 0; round < 35; round++)
                for (int way = 0; way < 3; way++) {
                    // Behind 300 us of spin (kHz: cycles a ms).
                    const Timed t = timed_calls(p, b, (long long)b.clock_khz * 3 / 10, 1, [&] {
                        if (way < 2)
                            (way ? run_b : run_a)(p, pieces, offload);
                        else
                            memcpy_reference(p, total, offload);
                    });
                    if (round >= 5) {
                        gpu[way].push_back(t.gpu_us);
                        host_us[way].push_back(t.host_us);
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
