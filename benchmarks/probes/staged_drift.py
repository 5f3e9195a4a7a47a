"""Whether a staged call's share of a same-size memcpy drifts over time: Llama-8B
flashinfer_hnd at nb = 8, a pinned H2D memcpy of the call's bytes, the onload, a D2H memcpy
and the offload in turn, each behind a 300 us GPU sleep, for SECONDS seconds; the medians of
each 2-second window.  Results: results/staged-drift-*.log.

    python3 benchmarks/probes/staged_drift.py [SECONDS]     (default 40)
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from staged_engine_pools import NB, behind_sleep_us, eight_b_calls, shares  # noqa: E402

SLEEP_US, WINDOW_S = 300, 2.0


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 40
    model, nbytes, calls, cycles = eight_b_calls("flashinfer_hnd")
    print(f"{torch.cuda.get_device_name()}: {model} flashinfer_hnd nb = {NB}, {nbytes >> 20} MiB a call")
    began = time.time()
    while time.time() - began < seconds:
        samples = {key: [] for key in calls}
        window = time.time()
        while time.time() - window < WINDOW_S:
            for key, call in calls.items():
                samples[key].append(behind_sleep_us(call, SLEEP_US, cycles))
        med = {key: statistics.median(values) for key, values in samples.items()}
        onload = sorted(samples["onload"])
        print(f"t = {time.time() - began:5.1f} s, {len(onload)} each: {shares(med)} (onload p10 "
              f"{onload[len(onload) // 10]:.1f}, p90 {onload[9 * len(onload) // 10]:.1f} us)", flush=True)


if __name__ == "__main__":
    main()
