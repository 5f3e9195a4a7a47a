"""Where the host time of a vLLM worker's job goes: the steady host time of one
PagedKVCache.to_cache call between vLLM's packed K|V cache (per layer [blocks, nh, nt, 2, hd],
bf16) and a pinned universal pool, staged (the default), on the kernel alone, and between two
device caches, at Llama-3.1-8B and 70B dims, nb = 1, 8, 64, at the default staging (96 MiB)
and at 256 and 512 MiB (fewer, larger pieces); with the host cost of the CUDA calls a staged
piece makes (event record, stream wait, a 1 MiB device-to-pinned cudaMemcpyAsync).  Calls
back to back, the stream synchronized every 8, medians of 400.  Results:
results/staged-host-cost-*.log.

    python3 benchmarks/probes/staged_host_cost.py
"""
import ctypes
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kvbm_ext  # noqa: E402
from harness import HD, NH, NT, steady_host_us  # noqa: E402

MODELS = (("Llama-3.1-8B", 32), ("Llama-3.1-70B", 80))
NBS = (1, 8, 64)
STAGING_MIB = (96, 256, 512)


def api_costs():
    """Host microseconds of the CUDA runtime calls a staged piece makes, through ctypes."""
    cudart = _cudart()
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    event = ctypes.c_void_p()
    assert cudart.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
    device = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    calls = {
        "cudaEventRecord": lambda: cudart.cudaEventRecord(event, ctypes.c_void_p(stream.cuda_stream)),
        "cudaStreamWaitEvent": lambda: cudart.cudaStreamWaitEvent(ctypes.c_void_p(other.cuda_stream), event, 0),
        "cudaMemcpyAsync 1 MiB D2H": lambda: cudart.cudaMemcpyAsync(
            ctypes.c_void_p(pinned.data_ptr()), ctypes.c_void_p(device.data_ptr()), ctypes.c_size_t(1 << 20), 4,
            ctypes.c_void_p(stream.cuda_stream)),
        "ctypes call alone": lambda: cudart.cudaGetLastError(),
    }
    return {name: steady_host_us([call], reps=400, batch=8) for name, call in calls.items()}


def _cudart():
    """The CUDA runtime torch loaded (CUDA 13's, else the unversioned name)."""
    for name in ("libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    raise OSError("no libcudart.so.13 or libcudart.so to load")


def main():
    torch.cuda.set_device(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kvbm_ext {kvbm_ext.__version__}")
    print("CUDA calls, host us: " + ", ".join(f"{name} {us:.2f}" for name, us in api_costs().items()))
    stream = torch.cuda.current_stream()
    for model, nl in MODELS:
        layers = [torch.randint(-30000, 30000, (2 * max(NBS), NH, NT, 2, HD), dtype=torch.int16,
                                device="cuda").view(torch.bfloat16) for _ in range(nl)]
        cache = kvbm_ext.PagedKVCache(layers, "bhtkd")
        shape = (max(NBS), NH, nl, 2, NT, HD)
        buffer = kvbm_ext.pinned_empty((int(np.prod(shape)) * 2,), np.uint8, device=0)
        pool = kvbm_ext.PagedKVCache(torch.from_dlpack(buffer).view(torch.bfloat16).view(shape), "bhlktd")
        device_pool = kvbm_ext.PagedKVCache(torch.empty(shape, dtype=torch.bfloat16, device="cuda"), "bhlktd")
        for mib in STAGING_MIB:
            kvbm_ext.set_staging(mib << 20, lanes=2)
            for nb in NBS:
                ids, slots = np.arange(1, nb + 1), np.arange(nb)
                calls = {"store staged": lambda: cache.to_cache(pool, ids, slots, stream=stream),
                         "load staged": lambda: pool.to_cache(cache, slots, ids, stream=stream)}
                if mib == STAGING_MIB[0]:
                    calls["store kernel"] = lambda: cache.to_cache(pool, ids, slots, stream=stream, backend="kernel")
                    calls["store d2d"] = lambda: cache.to_cache(device_pool, ids, slots, stream=stream)
                times = {}
                for name, call in calls.items():
                    for _ in range(10):
                        call()
                    times[name] = steady_host_us([call], reps=400, batch=8)
                print(f"{model} staging {mib} MiB nb {nb:2d}: " +
                      ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)
        buffer.close()


if __name__ == "__main__":
    main()
