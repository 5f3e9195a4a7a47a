"""What one NCCL point-to-point post costs the host through torch.distributed, beside
what a Resharder call costs: two processes on two GPUs, rank 0 sends one tensor to rank 1
per call with `batch_isend_irecv` (as kvbm_ext's TorchTransport posts a piece), back to
back after a warm-up; host time a call (median) and time until done, per size.  Also
PagedKVCache.to_universal's host time at the Resharder benchmark's block shape (a pack).

    python3 benchmarks/probes/nccl_p2p_host.py [--calls 50] [--mib 1,168]
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def child(rank, args, folder):
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(folder, 'pg')}",
                            rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1, device="cuda"))
    for mib in args.mib:
        buffer = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        op = dist.isend if rank == 0 else dist.irecv

        def post():
            for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, 1 - rank)]):
                work.wait()     # a stream wait, as the transport's

        for _ in range(5):
            post()
        torch.cuda.synchronize()
        dist.barrier()
        host = []
        start = time.perf_counter()
        for _ in range(args.calls):
            t0 = time.perf_counter()
            post()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        done = (time.perf_counter() - start) / args.calls
        print(f"rank {rank}: batch_isend_irecv of {mib} MiB: host median {statistics.median(host) * 1e6:.0f} us a "
              f"call (p10 {sorted(host)[len(host) // 10] * 1e6:.0f}), until done {done * 1e6:.0f} us a call",
              flush=True)
        dist.barrier()
    if rank == 0:
        import kvbm_ext

        nb, layers = 64, 80     # benchmarks/reshard.py's Llama-3.1-70B blocks, one rank's 8 heads
        cache = kvbm_ext.PagedKVCache([torch.randn((2, nb, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
                                       for _ in range(layers)], "kbthd")
        staging = torch.empty((nb, 8, layers, 2, 16, 128), dtype=torch.bfloat16, device="cuda")
        ids = torch.arange(nb, device="cuda")
        for _ in range(5):
            cache.to_universal(ids, staging, pack_layers=True)
        torch.cuda.synchronize()
        host = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            cache.to_universal(ids, staging, pack_layers=True)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"rank 0: PagedKVCache.to_universal of {nb} blocks: host median {statistics.median(host) * 1e6:.0f} us a call",
              flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--mib", default="1,168", type=lambda text: [int(x) for x in text.split(",")])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(child, args=(args, folder), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
