// median_us: how the CUDA probes time a launch on the device.
#ifndef PROBES_TIMING_H
#define PROBES_TIMING_H

#include <algorithm>
#include <vector>

#include "check.h"

// The median, in us, of 50 timed reps of launch() on `stream` (5 more first,
// untimed), each after a write of flush_bytes at `flush` so that L2 holds
// other bytes when it starts.
template <class F>
double median_us(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, char *flush, size_t flush_bytes, F launch)
{
    std::vector<float> ms;
    for (int rep = 0; rep < 55; ++rep) {
        CK(cudaMemsetAsync(flush, rep, flush_bytes, stream));
        CK(cudaEventRecord(start, stream));
        launch();
        CK(cudaEventRecord(stop, stream));
        CK(cudaEventSynchronize(stop));
        float t;
        CK(cudaEventElapsedTime(&t, start, stop));
        if (rep >= 5)
            ms.push_back(t);
    }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
}

#endif  // PROBES_TIMING_H
