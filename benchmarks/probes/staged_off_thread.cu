// Probe: what a staged transfer costs the caller's thread when another thread
// enqueues its pieces, and what that costs the transfer.
//
//   A (staging.c today): the caller's thread enqueues every piece: the permutes
//     on a high-priority stream, the copies on the caller's stream, an event
//     each way a piece.
//   C: the caller's thread records an event on its stream (where the job may
//     start), enqueues cuStreamWaitValue32 on its stream (work queued after the
//     call waits for a flag word to reach the job's number) and hands the job to
//     one enqueue thread, which enqueues A's pipeline on a lane's own streams
//     (after the start event) and then cuStreamWriteValue32 of the job's number
//     after the last piece.  The caller's stream never carries the copies: they
//     would queue behind its wait for the flag they write.
//
// Pieces as route.c cuts a call (see staged_slot_streams.cu), two slots.  For
// 5, 40, 128 and 320 MiB (Llama-3.1-70B blocks, nb = 1, 8, ~25, 64), each
// direction: one call behind a 1 ms GPU spin (its GPU time between events on
// the caller's stream, and the caller's host time), medians of 30 rounds, a
// pinned memcpy of the same bytes in the same round; then bursts of 16 calls
// back to back (the caller's host time a call, and GB/s from the burst's
// first to last event against 16 memcpys').  Every design's bytes are checked
// against the source for every size and direction.
//
// Build: nvcc -O2 -std=c++17 -arch=sm_90 -o staged_off_thread staged_off_thread.cu
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "staged_pipeline.h"

#define CU(x)                                                               \
    do {                                                                    \
        CUresult status = (x);                                              \
        if (status != CUDA_SUCCESS) {                                       \
            printf("%s line %d: CUresult %d\n", #x, __LINE__, (int)status); \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

// The driver's stream memory operations, through the runtime (nothing linked
// against libcuda, as the extension).
typedef CUresult (*StreamValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
static StreamValue32 wait_value32, write_value32;

static StreamValue32 driver_entry(const char *name)
{
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
        printf("%s: not found in the driver\n", name);
        exit(1);
    }
    return (StreamValue32)fn;
}

constexpr int BURST = 16;

// Design C's enqueue thread and the caller's half of a call.
struct Job {
    const std::vector<Piece> *pieces;
    int offload;
    cudaEvent_t start;
    uint32_t number;
};

struct Enqueuer {
    Pipe *p;
    CUdeviceptr flag;        // device memory: the number of the last job whose pieces all ran
    uint32_t next = 0;
    std::vector<cudaEvent_t> starts;   // one per job in flight: a start event is recorded anew only once
                                       // the thread has enqueued the wait on its previous recording
    std::deque<Job> queue;
    std::mutex lock;
    std::condition_variable wake, drained;
    bool stop = false;
    std::thread thread;

    void run()
    {
        CK(cudaSetDevice(0));
        std::unique_lock<std::mutex> held(lock);
        for (;;) {
            wake.wait(held, [&] { return stop || !queue.empty(); });
            if (queue.empty())
                return;
            Job job = queue.front();
            held.unlock();
            CK(cudaStreamWaitEvent(p->copies, job.start, 0));
            pipeline(*p, *job.pieces, job.offload, p->copies);
            CU(write_value32((CUstream)p->copies, flag, job.number, CU_STREAM_WRITE_VALUE_DEFAULT));
            held.lock();
            queue.pop_front();
            drained.notify_all();
        }
    }

    // The caller's half: returns once the job is handed over.
    void submit(const std::vector<Piece> &pieces, int offload)
    {
        const uint32_t number = ++next;
        cudaEvent_t start = starts[number % starts.size()];
        {
            // The event of `starts.size()` jobs ago must have been waited on by the thread.
            std::unique_lock<std::mutex> held(lock);
            drained.wait(held, [&] { return queue.size() < starts.size(); });
        }
        CK(cudaEventRecord(start, p->caller));
        CU(wait_value32((CUstream)p->caller, flag, number, CU_STREAM_WAIT_VALUE_GEQ));
        {
            std::lock_guard<std::mutex> held(lock);
            queue.push_back({&pieces, offload, start, number});
        }
        wake.notify_one();
    }

    void finish()
    {
        {
            std::lock_guard<std::mutex> held(lock);
            stop = true;
        }
        wake.notify_one();
        thread.join();
    }
};

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    const size_t sizes[] = {5 * MiB, 40 * MiB, 128 * MiB, 320 * MiB}, most = 320 * MiB;
    CK(cudaSetDevice(0));
    Pipe p;
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CK(cudaStreamCreateWithFlags(&p.caller, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&p.copies, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithPriority(&p.permute, cudaStreamNonBlocking, greatest));
    cudaEvent_t *events[] = {&p.handoff, &p.ready[0], &p.ready[1], &p.freed[0], &p.freed[1]};
    for (cudaEvent_t *e : events)
        CK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    Bench b = prepare(p, most, "pieces as route.c cuts them (lead 1 MiB, ramp to 4 MiB, up to 24 MiB), two slots; "
                               "host us on the caller's thread");
    Enqueuer q;
    q.p = &p;
    wait_value32 = driver_entry("cuStreamWaitValue32");
    write_value32 = driver_entry("cuStreamWriteValue32");
    uint32_t *flag;
    CK(cudaMalloc(&flag, sizeof *flag));
    CK(cudaMemset(flag, 0, sizeof *flag));
    q.flag = (CUdeviceptr)flag;
    q.starts.resize(4 * BURST);
    for (cudaEvent_t &e : q.starts)
        CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    q.thread = std::thread(&Enqueuer::run, &q);

    const char *names[] = {"A: caller enqueues", "C: enqueue thread"};
    auto call = [&](int design, const std::vector<Piece> &pieces, int offload) {
        if (design == 0)
            pipeline(p, pieces, offload, p.caller);
        else
            q.submit(pieces, offload);
    };
    for (int offload = 1; offload >= 0; offload--)
        for (size_t total : sizes) {
            const std::vector<Piece> pieces = cut(total);
            for (int design = 0; design < 2; design++) {
                poison(p, b, total, offload);
                call(design, pieces, offload);
                // Read back on the caller's stream: ordered after the call by its stream alone.
                if (!offload)
                    CK(cudaMemcpyAsync(b.back.data(), p.device, total, cudaMemcpyDeviceToHost, p.caller));
                CK(cudaStreamSynchronize(p.caller));
                if (memcmp(offload ? p.pinned : b.back.data(), b.host.data(), total) != 0) {
                    printf("%s %s %zu MiB: wrong bytes\n", names[design], offload ? "offload" : "onload", total >> 20);
                    return 1;
                }
            }
            std::vector<double> gpu[3], host_us[3];
            auto way_of = [&](int way) {
                return [&, way] {
                    if (way < 2)
                        call(way, pieces, offload);
                    else
                        memcpy_reference(p, total, offload);
                };
            };
            for (int round = 0; round < 35; round++)
                for (int way = 0; way < 3; way++) {
                    const Timed t = timed_calls(p, b, b.clock_khz, 1, way_of(way));   // behind 1 ms of spin
                    if (round >= 5) {
                        gpu[way].push_back(t.gpu_us);
                        host_us[way].push_back(t.host_us);
                    }
                }
            // Bursts: BURST calls back to back, behind one spin.
            std::vector<double> burst_gpu[3], burst_host[3];
            for (int round = 0; round < 8; round++)
                for (int way = 0; way < 3; way++) {
                    const Timed t = timed_calls(p, b, b.clock_khz, BURST, way_of(way));
                    if (round >= 2) {
                        burst_gpu[way].push_back(t.gpu_us);
                        burst_host[way].push_back(t.host_us);
                    }
                }
            const double memcpy_us = median(gpu[2]), burst_memcpy = median(burst_gpu[2]);
            printf("%-7s %3zu MiB, %2zu pieces: memcpy %7.1f us\n", offload ? "offload" : "onload", total >> 20,
                   pieces.size(), memcpy_us);
            for (int design = 0; design < 2; design++)
                printf("    %-18s one call %7.1f us, %5.1f %% of memcpy, host %6.1f us | burst of %d: %5.1f %% of "
                       "memcpys, host %6.1f us a call\n",
                       names[design], median(gpu[design]), 100.0 * memcpy_us / median(gpu[design]),
                       median(host_us[design]), BURST, 100.0 * burst_memcpy / median(burst_gpu[design]),
                       median(burst_host[design]));
        }
    q.finish();
    return 0;
}
