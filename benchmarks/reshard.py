#!/usr/bin/env python3
"""Benchmark kvbm_ext.Resharder between engines of different TP sizes on two GPUs.

Profile: Llama-3.1-70B KV cache, nl=80 layers, no=2 (K, V), 8 KV heads, hd=128, bf16,
nt=16 tokens per block (5.24 MB per block), vLLM per-layer caches (dims "kbthd").  Two
processes, one per GPU, NCCL.  Directions:

  1to2  prefill TP 1 on GPU 0 -> decode TP 2 on GPUs 0 and 1
  2to1  prefill TP 2 on GPUs 0 and 1 -> decode TP 1 on GPU 0

With two GPUs one rank holds a position of both engines: its share moves by a local
copy, the other rank's share by one NCCL message.  For each direction and nb, in the
same run:

  reshard         Resharder calls (check=False: the steady state of a server)
  reshard-check   Resharder calls with check=True (the default: ranks exchange a
                  description over gloo first)
  nccl-one-buffer the ceiling: NCCL send/recv of all the bytes the reshard moves, as
                  one buffer from the sending GPU to the other
  nccl-link-bytes NCCL send/recv, as one buffer, of only the bytes that cross between
                  the GPUs in the reshard (the rest stays on one GPU)
  fragments       one NCCL send per (layer, K/V, block) chunk of all the bytes: the
                  fragment approach (posted in batch_isend_irecv groups of --fragment-batch,
                  timed over --fragment-calls calls)

GPU time: CUDA events around --calls back-to-back calls on each rank after a barrier,
the slowest rank's, median of --repeats; GB/s = bytes moved into the destination
caches (the same bytes for every method) / time.  Host time: the reshard call's own,
on the host, median over the calls (planning, checks and launches).  Targets at nb=64:
reshard >= 90 % of nccl-one-buffer; messages per call = the (source, destination)
rank pairs that share data, counted here from the head and layer ranges (local pairs
are copies); host time <= 1 ms.

With --device cpu: gloo, host caches, 4 layers and nb 2,4 by default, wall-clock
times: a check that the benchmark works, not a measurement.

The CSV and the log go to --out (default: ./reshard-results when the current directory is
outside this source tree, else a new temporary directory; printed at the end).

    python3 benchmarks/reshard.py --out "$OUT/reshard"          # two GPUs
    python3 benchmarks/reshard.py --device cpu                  # anywhere, in seconds
"""

import argparse
import csv
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402
from harness import Tee, output_dir, run_stem  # noqa: E402
from kvbm_ext._no_gpu import exit_no_gpu, why_no_gpu  # noqa: E402

NH, NO, HD = 8, 2, 128                # Llama-3.1-70B KV cache
DTYPE = torch.bfloat16
DIMS = "kbthd"
WORLD = 2
DIRECTIONS = {
    # name: (prefill layout, decode layout)
    "1to2": (kvbm_ext.EngineLayout(1, ranks=[0]), kvbm_ext.EngineLayout(2, ranks=[0, 1])),
    "2to1": (kvbm_ext.EngineLayout(2, ranks=[0, 1]), kvbm_ext.EngineLayout(1, ranks=[0])),
}
FIELDS = ["device", "direction", "nb", "method", "messages", "local_copies", "bytes", "link_bytes", "time_us",
          "gbps", "pct_of_ceiling", "host_us"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when torch sees two GPUs")
    parser.add_argument("--directions", default="1to2,2to1")
    parser.add_argument("--nb", help="blocks per call, comma-separated (default 8,64 on cuda, 2,4 on cpu)")
    parser.add_argument("--layers", type=int, help="layers (default 80 on cuda, 4 on cpu)")
    parser.add_argument("--nt", type=int, default=16)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per case (the median is reported)")
    parser.add_argument("--fragment-batch", type=int, default=1024,
                        help="sends posted per batch_isend_irecv in the fragment approach")
    parser.add_argument("--fragment-calls", type=int, default=2, help="back-to-back calls per fragments timing")
    parser.add_argument("--out", help="directory for the CSV and the log (default: ./reshard-results outside "
                                      "this source tree, else a new temporary directory)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        why = why_no_gpu(count=WORLD)
        if why is not None and args.device == "cuda":
            exit_no_gpu("reshard --device cuda", why)
        args.device = "cpu" if why is not None else "cuda"
    on_gpu = args.device == "cuda"
    args.directions = args.directions.split(",")
    for name in args.directions:
        if name not in DIRECTIONS:
            parser.error(f"--directions: {name!r} is not one of {', '.join(DIRECTIONS)}")
    args.nb = [int(n) for n in (args.nb or ("8,64" if on_gpu else "2,4")).split(",")]
    args.layers = args.layers or (80 if on_gpu else 4)
    return args


class Rank:
    """This process's rank: its device, group and timing helpers."""

    def __init__(self, rank, args, store_path):
        self.rank, self.args = rank, args
        self.gpu = args.device == "cuda"
        self.device = f"cuda:{rank}" if self.gpu else "cpu"
        if self.gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if self.gpu else "gloo",
                                store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=300))
        if self.gpu:
            dist.all_reduce(torch.ones(1, device=self.device))     # NCCL: the first operation involves every rank

    def seconds(self, fn, calls=None):
        """Per-call time of fn over `calls` (default args.calls) back-to-back calls, the slowest rank's, median
        of args.repeats; and fn's own host time per call (median)."""
        calls = calls or self.args.calls
        times, host = [], []
        for _ in range(self.args.repeats):
            dist.barrier()
            if self.gpu:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            begin = time.perf_counter()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
            if self.gpu:
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                elapsed = time.perf_counter() - begin
            slowest = [None] * WORLD
            dist.all_gather_object(slowest, elapsed)
            times.append(max(slowest) / calls)
        hosts = [None] * WORLD
        dist.all_gather_object(hosts, statistics.median(host))
        return statistics.median(times), max(hosts)


def random_bits(shape, device):
    count = DTYPE.itemsize
    for extent in shape:
        count *= extent
    return torch.randint(0, 256, (count,), dtype=torch.uint8, device=device).view(DTYPE).view(shape)


def expected_pairs(src, dst, num_layers):
    """(messages, local copies): (source rank, destination rank) pairs whose head and layer ranges meet."""
    pairs = set()
    for s in range(src.size):
        s_stage, s_tp = divmod(s, src.tp_size)
        for d in range(dst.size):
            d_stage, d_tp = divmod(d, dst.tp_size)
            heads = set(src.heads_of(s_tp, NH)) & set(dst.heads_of(d_tp, NH))
            layers = set(src.layers_of(s_stage, num_layers)) & set(dst.layers_of(d_stage, num_layers))
            if heads and layers:
                pairs.add((src.rank_of(s_stage, s_tp), dst.rank_of(d_stage, d_tp)))
    return sum(a != b for a, b in pairs), sum(a == b for a, b in pairs)


def bench_direction(me, name, nb, rows):
    args = me.args
    src, dst = DIRECTIONS[name]
    num_blocks = 2 * nb
    chunk = (args.nt, NH, HD)
    block_bytes = args.layers * NO * args.nt * NH * HD * DTYPE.itemsize
    total = nb * block_bytes

    def cache(layout):
        position = layout.position_of(me.rank)
        if position is None:
            return None
        nh = len(layout.heads_of(position[1], NH))
        layers = [random_bits((NO, num_blocks, args.nt, nh, HD), me.device) for _ in range(args.layers)]
        return kvbm_ext.PagedKVCache(layers, DIMS)

    src_cache, dst_cache = cache(src), cache(dst)
    src_ids = torch.randperm(num_blocks)[:nb].to(me.device)
    dst_ids = torch.randperm(num_blocks)[:nb].to(me.device)
    resharder = kvbm_ext.Resharder(NH, args.layers, src, dst)

    last = {}

    def reshard(check):
        last["stats"] = resharder(src_cache, None if src_cache is None else src_ids,
                                  dst_cache, None if dst_cache is None else dst_ids, check=check)

    reshard(True)                                  # warm-up: kernels loaded, staging allocated
    stats = [None] * WORLD
    dist.all_gather_object(stats, last["stats"])
    messages = sum(s.messages_sent for s in stats)
    local = sum(s.local_copies for s in stats)
    link = sum(s.bytes_sent for s in stats)
    moved = sum(s.bytes_received + s.bytes_copied for s in stats)
    assert moved == total, (moved, total)
    sender = next(t.src_rank for t in resharder.plan if not t.is_local)
    receiver = 1 - sender

    results = {}
    for method, fn in (("reshard", lambda: reshard(False)), ("reshard-check", lambda: reshard(True))):
        results[method] = me.seconds(fn) + ((messages, local, link),)
    del src_cache, dst_cache, resharder
    if me.gpu:
        torch.cuda.empty_cache()

    # The same bytes as one NCCL message, and only the bytes that cross, from the sending GPU.
    for method, size in (("nccl-one-buffer", total), ("nccl-link-bytes", link)):
        buffer = torch.empty(size, dtype=torch.uint8, device=me.device)

        def one_buffer(buffer=buffer):
            op = dist.isend if me.rank == sender else dist.irecv
            for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, receiver if me.rank == sender else sender)]):
                work.wait()

        one_buffer()
        results[method] = me.seconds(one_buffer) + ((1, 0, size),)
        del buffer

    # One message per (layer, K/V, block) chunk of all the bytes.
    chunks = torch.empty((args.layers * NO * nb,) + chunk, dtype=DTYPE, device=me.device)

    def fragments():
        op = dist.isend if me.rank == sender else dist.irecv
        peer = receiver if me.rank == sender else sender
        works = []
        for first in range(0, chunks.shape[0], args.fragment_batch):
            works += dist.batch_isend_irecv([dist.P2POp(op, chunks[i], peer)
                                             for i in range(first, min(first + args.fragment_batch, chunks.shape[0]))])
        for work in works:
            work.wait()

    fragments()
    results["fragments"] = me.seconds(fragments, args.fragment_calls) + ((chunks.shape[0], 0, total),)
    del chunks
    if me.gpu:
        torch.cuda.empty_cache()

    rows += result_rows(args.device, name, nb, total, results)
    return expected_pairs(src, dst, args.layers), (messages, local)


def result_rows(device, name, nb, total, results):
    """The CSV rows of one direction and nb: per method, its time and the GB/s of the bytes
    moved into the destination caches, against the one-buffer NCCL ceiling."""
    ceiling = results["nccl-one-buffer"][0]
    return [{"device": device, "direction": name, "nb": nb, "method": method, "messages": msgs,
             "local_copies": copies, "bytes": total, "link_bytes": link_bytes,
             "time_us": round(seconds * 1e6, 2), "gbps": round(total / seconds / 1e9, 2),
             "pct_of_ceiling": round(100 * ceiling / seconds, 1),
             "host_us": round(host * 1e6, 1) if method.startswith("reshard") else ""}
            for method, (seconds, host, (msgs, copies, link_bytes)) in results.items()]


def run(rank, args, store_path):
    me = Rank(rank, args, store_path)
    rows, targets = [], []
    for name in args.directions:
        for nb in args.nb:
            expected, got = bench_direction(me, name, nb, rows)
            targets.append((name, nb, expected, got))
            if rank == 0:
                print_case(rows[-5:], args)
    if rank == 0:
        print_targets(rows, targets, args)
        write_csv(rows, args)
    dist.destroy_process_group()


def print_case(rows, args):
    first = rows[0]
    print(f"\n{first['direction']} nb={first['nb']}: {first['bytes'] / 1e6:.1f} MB per call, "
          f"{rows[0]['link_bytes'] / 1e6:.1f} MB of it between the GPUs")
    print(f"  {'method':16s} {'messages':>8s} {'GB/s':>9s} {'time us':>10s} {'% ceiling':>9s} {'host us':>8s}")
    for row in rows:
        print(f"  {row['method']:16s} {row['messages']:8d} {row['gbps']:9.2f} {row['time_us']:10.1f} "
              f"{row['pct_of_ceiling']:9.1f} {row['host_us']!s:>8s}")
    sys.stdout.flush()


def print_targets(rows, targets, args):
    def mark(ok):
        return "PASS" if ok else "MISS"

    target_nb = 64 if 64 in args.nb else max(args.nb)
    print(f"\ntargets (nb={target_nb}{'' if args.device == 'cuda' else '; CPU run: the timing targets do not apply'}):")
    for name in args.directions:
        by = {r["method"]: r for r in rows if r["direction"] == name and r["nb"] == target_nb}
        ours, link = by["reshard"], by["nccl-link-bytes"]
        print(f"  {name}: reshard {ours['gbps']:.2f} GB/s = {ours['pct_of_ceiling']:.1f} % of the same-run NCCL "
              f"ceiling {by['nccl-one-buffer']['gbps']:.2f} GB/s (>= 90 %): {mark(ours['pct_of_ceiling'] >= 90)}; "
              f"{100 * link['time_us'] / ours['time_us']:.1f} % of one buffer of the bytes that cross only")
        print(f"  {name}: host time per call {ours['host_us']:.0f} us, check=True {by['reshard-check']['host_us']:.0f} us "
              f"(<= 1000 us): {mark(ours['host_us'] <= 1000)} / {mark(by['reshard-check']['host_us'] <= 1000)}")
        print(f"  {name}: fragments {by['fragments']['messages']} messages at {by['fragments']['gbps']:.2f} GB/s")
    for name, nb, expected, got in targets:
        print(f"  {name} nb={nb}: {got[0]} messages + {got[1]} local copies per call, pairs sharing data "
              f"{expected[0]} + {expected[1]}: {mark(got == expected)}")


def write_csv(rows, args):
    path = args.stem + ".csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nCSV: {path}")


def main(argv=None):
    args = parse_args(argv)
    where = f"{WORLD}x{torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu"
    args.stem = run_stem(output_dir(args.out, "reshard"), "reshard", where, datetime.date.today().isoformat())
    print(f"writing the CSV and the log into {os.path.dirname(args.stem)}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_child, args=(args, os.path.join(tmp, "store")), nprocs=WORLD, start_method="spawn")
    print(f"log: {args.stem}.log")
    return 0


def _child(rank, args, store_path):
    if rank == 0:
        log = open(args.stem + ".log", "w")
        sys.stdout = Tee(sys.__stdout__, log)
        devices = [torch.cuda.get_device_name(i) for i in range(WORLD)] if args.device == "cuda" else ["cpu"]
        print(f"kvbm_ext {kvbm_ext.__version__} {kvbm_ext.build_info()}, torch {torch.__version__}, "
              f"devices {devices}, {' '.join(sys.argv)}")
        print(f"profile: nl={args.layers} no={NO} nh={NH} hd={HD} bf16 nt={args.nt}, {args.device}, "
              f"{args.calls} calls x {args.repeats} repeats")
    run(rank, args, store_path)


if __name__ == "__main__":
    sys.exit(main())
