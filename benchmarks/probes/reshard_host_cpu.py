"""Host time of a Resharder call on the CPU: two processes, small host caches (4 heads x
4 layers x K/V x 4 tokens x 8, bf16), nb 8 and 64, TP 1 -> 2 (rank 0 sends half and copies
half) and PP 2 -> 1; over gloo (TorchTransport) and over NIXL (UCX; UCX_TLS=tcp for TCP only).
Per mode, 4 rounds of 50 back-to-back calls of rank 0 after a barrier: the 10th percentile
and median of the call's wall time, and the median of its thread's CPU time.  With
wait=False the handle is waited for outside the timed call.

    UCX_TLS=tcp python3 benchmarks/probes/reshard_host_cpu.py [gloo] [nixl]
"""
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import kvbm_ext  # noqa: E402
from kvbm_ext import EngineLayout as L  # noqa: E402

NH, NL, NO, NT, HD = 4, 4, 2, 4, 8
CASES = {"tp1->tp2": (L(1, ranks=[0]), L(2, ranks=[0, 1])), "pp2->pp1": (L(1, 2, ranks=[0, 1]), L(1, ranks=[0]))}
MODES = {"check=False": {"check": False}, "check=False wait=False": {"check": False, "wait": False},
         "check=True": {"check": True}}


def caches(rank, src, dst, num_blocks=128):
    out = []
    for layout in (src, dst):
        position = layout.position_of(rank)
        if position is None:
            out.append(None)
            continue
        nh, nl = len(layout.heads_of(position[1], NH)), len(layout.layers_of(position[0], NL))
        out.append(kvbm_ext.PagedKVCache([torch.randn(NO, num_blocks, NT, nh, HD).to(torch.bfloat16)
                                          for _ in range(nl)], "kbthd"))
    return out


def worker(rank, path, which):
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    transport = None
    if which == "nixl":
        from kvbm_ext.nixl import NixlTransport

        transport = NixlTransport(rank, 2, f"host-time-{rank}", store=dist.FileStore(path + ".nixl", 2))
    for name, (src, dst) in CASES.items():
        src_cache, dst_cache = caches(rank, src, dst)
        resharder = kvbm_ext.Resharder(NH, NL, src, dst, transport=transport)
        for nb in (8, 64):
            ids = list(range(nb))
            for mode, kwargs in MODES.items():
                wall, cpu = [], []
                for _ in range(4):
                    dist.barrier()
                    for _ in range(50):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        out = resharder(src_cache, ids if src_cache else None, dst_cache, ids if dst_cache else None,
                                        **kwargs)
                        wall.append(time.perf_counter() - t0)
                        cpu.append(time.thread_time() - c0)
                        if kwargs.get("wait") is False:
                            out.wait(10)
                wall.sort()
                cpu.sort()
                if rank == 0:
                    print(f"{which:5s} {name} nb={nb:2d} {mode:24s} wall p10 {wall[len(wall) // 10] * 1e6:5.0f} us, "
                          f"median {wall[len(wall) // 2] * 1e6:5.0f} us; CPU median {cpu[len(cpu) // 2] * 1e6:5.0f} us",
                          flush=True)
    dist.barrier()
    os._exit(0)     # NIXL's and UCX's threads need no orderly teardown


if __name__ == "__main__":
    print(f"kvbm_ext {kvbm_ext.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"UCX_TLS={os.environ.get('UCX_TLS', '')!r}", flush=True)
    for which in sys.argv[1:] or ["gloo", "nixl"]:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(os.path.join(tmp, "store"), which), nprocs=2, start_method="spawn")
