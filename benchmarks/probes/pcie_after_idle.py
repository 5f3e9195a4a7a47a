"""Whether a pinned transfer's GPU time depends on what came before it: the GPU busy (a GPU
sleep of 0.1 to 10 ms, the host thread spinning in a synchronize meanwhile), or the host
thread asleep (time.sleep of 0.5 to 50 ms, the GPU idle).  Calls: the H2D and D2H memcpys of
16 MiB and the staged onload and offload of Llama-3.1-8B's vllm_flash cache at nb = 8, as
staged_engine_pools.py builds them; medians (and the largest) of 20 calls each.
Results: results/pcie-after-idle-*.log.

    python3 benchmarks/probes/pcie_after_idle.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from staged_engine_pools import NB, behind_sleep_us, eight_b_calls  # noqa: E402

REPS = 20
WHAT = ("h2d", "onload", "d2h", "offload")


def gpu_us(call, cycles_per_us, gpu_sleep_us, host_sleep_s):
    """(median, largest) GPU time of `call` in REPS tries, each after a host sleep and a GPU
    sleep."""
    samples = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        time.sleep(host_sleep_s)
        samples.append(behind_sleep_us(call, gpu_sleep_us, cycles_per_us))
    return statistics.median(samples), max(samples)


def main():
    model, nbytes, calls, cycles = eight_b_calls("vllm_flash")
    print(f"{torch.cuda.get_device_name()}: {model} vllm_flash nb = {NB}, "
          f"{nbytes >> 20} MiB; GPU us, median (largest) of {REPS}")
    print(f"{'before each call':32s}" + "".join(f"{what:>20s}" for what in WHAT))
    conditions = [(f"GPU sleep {ms} ms, host spinning", ms * 1e3, 0) for ms in (0.1, 1, 10)]
    conditions += [(f"host asleep {ms} ms, GPU idle", 100, ms / 1e3) for ms in (0.5, 5, 50)]
    conditions += [conditions[0]]
    for label, gpu_sleep_us, host_sleep_s in conditions:
        cells = (gpu_us(calls[what], cycles, gpu_sleep_us, host_sleep_s) for what in WHAT)
        print(f"{label:32s}" + "".join(f"{median:11.1f} ({largest:5.0f})" for median, largest in cells), flush=True)


if __name__ == "__main__":
    main()
