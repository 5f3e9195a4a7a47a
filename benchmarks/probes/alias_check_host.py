#!/usr/bin/env python3
"""Host time of to_cache calls between 80-layer Llama-3.1-70B caches at nb = 64, by how the
two caches' memory lies: separate allocations (the hull check decides), and views of one
buffer (block halves: the exact byte check runs at every call).  Device ids on a GPU (no
host sync, as a serving worker calls), host ids and a refused call (num_ctas on host
caches: every check, no copy) on the CPU.

    python3 benchmarks/probes/alias_check_host.py          # GPU if there is one
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import kvbm_ext  # noqa: E402

NL, NH, NT, HD, NB, BLOCKS = 80, 8, 16, 128, 64, 128
DT = torch.bfloat16


def per_layer(device, blocks=BLOCKS):
    return [torch.empty(2, blocks, NT, NH, HD, dtype=DT, device=device) for _ in range(NL)]


def pairs(device):
    return [(torch.empty(BLOCKS, NT, NH, HD, dtype=DT, device=device),
             torch.empty(BLOCKS, NT, NH, HD, dtype=DT, device=device)) for _ in range(NL)]


def cases(device):
    whole = per_layer(device, 2 * BLOCKS)
    one = torch.empty(NL, 2, 2 * BLOCKS, NT, NH, HD, dtype=DT, device=device)
    return {
        "separate per-layer -> per-layer": (kvbm_ext.PagedKVCache(per_layer(device), "kbthd"),
                                            kvbm_ext.PagedKVCache(per_layer(device), "kbthd")),
        "separate per-layer -> (K, V) pairs": (kvbm_ext.PagedKVCache(per_layer(device), "kbthd"),
                                               kvbm_ext.PagedKVCache(pairs(device), "bthd")),
        "one buffer per layer, block halves": (kvbm_ext.PagedKVCache([x[:, :BLOCKS] for x in whole], "kbthd"),
                                               kvbm_ext.PagedKVCache([x[:, BLOCKS:] for x in whole], "kbthd")),
        "one array, block halves": (kvbm_ext.PagedKVCache(one[:, :, :BLOCKS], "lkbthd"),
                                    kvbm_ext.PagedKVCache(one[:, :, BLOCKS:], "lkbthd")),
    }


def host_us(call, reps=2000, sync=None):
    samples = []
    for i in range(reps):
        if sync is not None and i % 50 == 0:
            sync()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    if sync is not None:
        sync()
    return statistics.median(samples) * 1e6


def main():
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    src_ids = torch.arange(NB, device=device) if gpu else list(range(NB))
    dst_ids = torch.arange(BLOCKS - NB, BLOCKS, device=device) if gpu else list(range(BLOCKS - NB, BLOCKS))
    print(f"{torch.cuda.get_device_name() if gpu else 'CPU'}: to_cache host time, nl={NL}, nb={NB}, "
          f"{'device ids, d2d' if gpu else 'host ids, refused after every check (num_ctas on host caches)'}")
    for name, (src, dst) in cases(device).items():
        def call():
            if gpu:
                src.to_cache(dst, src_ids, dst_ids)
                return
            try:
                src.to_cache(dst, src_ids, dst_ids, num_ctas=4)
            except ValueError:
                pass
        try:
            call()
        except ValueError as error:     # a build that refuses the case
            print(f"  {name:40s} refused: {error}")
            continue
        print(f"  {name:40s} {host_us(call, sync=torch.cuda.synchronize if gpu else None):7.2f} us")

if __name__ == "__main__":
    main()
