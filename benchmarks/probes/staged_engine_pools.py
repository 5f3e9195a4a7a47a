"""The staged nb = 8 moves of engines.py, every engine in one process, each against a memcpy
of its own pinned pool: how much of each pool transparent huge pages back (/proc/self/smaps),
the pool's H2D and D2H memcpy of the call's bytes, and the onload and offload, timed as
engines.py times them.  Results: results/staged-engine-pools-*.log.

    python3 benchmarks/probes/staged_engine_pools.py
"""
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import engines as E  # noqa: E402
import harness as H  # noqa: E402

NB = 8


def huge_mib(address, nbytes):
    """MiB of AnonHugePages in the mappings that overlap [address, address + nbytes)."""
    kib, inside = 0, False
    for line in open("/proc/self/smaps"):
        mapping = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if mapping:
            inside = int(mapping.group(1), 16) < address + nbytes and int(mapping.group(2), 16) > address
        elif inside and line.startswith("AnonHugePages:"):
            kib += int(line.split()[1])
    return kib >> 10


def staged_calls(name, layers, device, stream):
    """Engine `name`'s cache at `layers` layers, a pinned universal pool of 64 blocks of its
    dims, and the calls a staged move at NB blocks is compared by: the H2D and D2H memcpys of
    its bytes from the pool, the onload and the offload (engines.py's ids).  (pool, the call's
    bytes, calls)."""
    dims = E.engine_dims(name, layers)
    pool = E.make_pool(dims, 64, device, pinned=True)
    engine = E.build_engine(name, dims, 130, device)
    ids = E.id_sets(engine, NB, 1, 64, "cpu")[0]
    nbytes = NB * dims.block_bytes
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return pool, nbytes, {"h2d": lambda: staging.copy_(pool.raw[:nbytes], non_blocking=True),
                          "onload": E.transfer(engine, pool, "onload", ids, stream),
                          "d2h": lambda: pool.raw[:nbytes].copy_(staging, non_blocking=True),
                          "offload": E.transfer(engine, pool, "offload", ids, stream)}


def eight_b_calls(name):
    """staged_calls of engine `name` at Llama-3.1-8B's layers on the first GPU, with a stream
    of its own made current, each call made twice: (model, the call's bytes, calls, the GPU
    sleep's cycles per us)."""
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    model, layers = E.MODELS["8b"]
    _, nbytes, calls = staged_calls(name, layers, device, stream)
    for call in calls.values():
        call()
        call()
    torch.cuda.synchronize()
    return model, nbytes, calls, H.calibrate_sleep_cycles_per_us()


def behind_sleep_us(call, sleep_us, cycles_per_us):
    """The GPU time of one call, by events queued behind a GPU sleep of sleep_us."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_us * cycles_per_us))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def shares(us):
    """The memcpys' and the staged calls' GPU us ({"h2d": ..., "onload": ..., "d2h": ...,
    "offload": ...}) and each call's share of its memcpy, as a line's words."""
    return (f"H2D memcpy {us['h2d']:.1f} us, onload {us['onload']:.1f} us = {100 * us['h2d'] / us['onload']:.1f} %; "
            f"D2H memcpy {us['d2h']:.1f} us, offload {us['offload']:.1f} us = {100 * us['d2h'] / us['offload']:.1f} %")


def main():
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    policy, cycles = H.RepPolicy(0.1, 5, 200, 0.2), H.calibrate_sleep_cycles_per_us()

    def gpu_us(call):
        return H.time_gpu_calls([call], policy, cycles, H.run_once(call, H.cuda_synchronize)).gpu_us

    print(f"{torch.cuda.get_device_name(device)}, nb = {NB}, pools of 64 blocks from kvbm_ext.pinned_empty")
    for key in ("70b", "8b"):
        model, layers = E.MODELS[key]
        for name in E.ENGINES:
            pool, _, calls = staged_calls(name, layers, device, stream)
            us = {what: gpu_us(calls[what]) for what in ("h2d", "onload", "offload", "d2h")}
            print(f"{model} {name}: pool {pool.raw.numel() >> 20} MiB, huge pages "
                  f"{huge_mib(pool.raw.data_ptr(), pool.raw.numel())} MiB; {shares(us)}", flush=True)


if __name__ == "__main__":
    main()
