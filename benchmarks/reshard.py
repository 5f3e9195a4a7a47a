#!/usr/bin/env python3
"""Benchmark kvbm_ext.Resharder between engines of different TP sizes on two GPUs, over
NCCL and over NIXL.

Profile: Llama-3.1-70B KV cache, nl=80 layers, no=2 (K, V), 8 KV heads, hd=128, bf16,
nt=16 tokens per block (5.24 MB per block), vLLM per-layer caches (dims "kbthd").  Two
processes, one per GPU.  Directions:

  1to2  prefill TP 1 on GPU 0 -> decode TP 2 on GPUs 0 and 1
  2to1  prefill TP 2 on GPUs 0 and 1 -> decode TP 1 on GPU 0

With two GPUs one rank holds a position of both engines: its share moves by a local
copy, the other rank's share by one message (the link bytes: the bytes that cross
between the GPUs), in pieces.  For each --transport, direction and nb, in the same run:

  nccl (TorchTransport over NCCL; gloo on --device cpu)
    reshard          Resharder calls, check=False, wait=True (the steady state of a server)
    reshard-async    the same with wait=False (host time: the call alone; the GPU time
                     includes waiting for each handle, as a poll loop would)
    reshard-check    check=True (the ranks exchange a description first: over the header
                     communicator, gloo where the transport has none)
    one-buffer       the ceiling: one send of the link bytes from the sending GPU
    all-bytes        one send of all the bytes the reshard moves, local ones included
    fragments        the link bytes as one send per (layer, K/V, block) chunk (posted in
                     batch_isend_irecv groups of --fragment-batch, over --fragment-calls calls)
  nixl (kvbm_ext.nixl.NixlTransport, UCX; the ranks find each other through a FileStore)
    reshard, reshard-async, reshard-check   as above
    one-buffer       the ceiling: ONE NIXL WRITE of all the link bytes as one descriptor
    fragments        the link bytes as one descriptor per (layer, K/V, block): the descriptor
                     lists made from Nx3 arrays, initialize_xfer, WRITE, per call (the engines' way)

Times: CUDA events around --calls back-to-back calls on each rank after a barrier (on the
CPU, wall time), the slowest rank's, per call, median of --repeats.  gbps: the bytes the
row moves (a reshard: every byte written into the destination caches) over its time;
link_gbps: the link bytes over the time; pct_of_link: the transport's one-buffer time over
the row's.  host_us: the call's own time on the host, median over the calls.  Targets at
nb=64: reshard >= 90 % of one-buffer (link_gbps), >= 70 % at nb=8; NIXL reshard >= 20x
NIXL fragments; host time (async) <= 60 us over NCCL, <= 100 us over NIXL, reshard-check
<= 300 us; messages per call = the (source, destination) pairs that share data.

With --device cpu: host caches, 4 layers and nb 2,4 by default, wall-clock times: a check
that the benchmark works, not a measurement.

The CSV, the PNG (link GB/s per method) and the log go to --out (default: ./reshard-results
when the current directory is outside this source tree, else a new temporary directory).

    python3 benchmarks/reshard.py --out "$OUT/reshard"                # two GPUs, both transports
    python3 benchmarks/reshard.py --device cpu --transport nccl       # anywhere, in seconds
"""

import argparse
import csv
import datetime
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402
from figures import draw_file  # noqa: E402
from harness import HD, NH, NO, Tee, output_dir, run_stem  # noqa: E402
from kvbm_ext._no_gpu import exit_no_gpu, why_no_gpu  # noqa: E402

DTYPE = torch.bfloat16
DIMS = "kbthd"
WORLD = 2
TIMEOUT = 60.0
DIRECTIONS = {
    # name: (prefill layout, decode layout)
    "1to2": (kvbm_ext.EngineLayout(1, ranks=[0]), kvbm_ext.EngineLayout(2, ranks=[0, 1])),
    "2to1": (kvbm_ext.EngineLayout(2, ranks=[0, 1]), kvbm_ext.EngineLayout(1, ranks=[0])),
}
METHODS = ("reshard", "reshard-async", "reshard-check", "one-buffer", "all-bytes", "fragments")
FIELDS = ["device", "transport", "direction", "nb", "method", "messages", "local_copies", "bytes", "link_bytes",
          "time_us", "gbps", "link_gbps", "pct_of_link", "host_us"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when torch sees two GPUs")
    parser.add_argument("--transport", help="nccl, nixl or nccl,nixl (default: both where NIXL is installed)")
    parser.add_argument("--directions", default="1to2,2to1")
    parser.add_argument("--nb", help="blocks per call, comma-separated (default 8,64 on cuda, 2,4 on cpu)")
    parser.add_argument("--layers", type=int, help="layers (default 80 on cuda, 4 on cpu)")
    parser.add_argument("--nt", type=int, default=16)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per case (the median is reported)")
    parser.add_argument("--fragment-batch", type=int, default=1024,
                        help="sends posted per batch_isend_irecv in the NCCL fragments row")
    parser.add_argument("--fragment-calls", type=int, default=2, help="back-to-back calls per fragments timing")
    parser.add_argument("--progress-delay-us", type=int,
                        help="NixlTransport's progress_delay_us (default: kvbm_ext.nixl.PROGRESS_DELAY_US)")
    parser.add_argument("--out", help="directory for the CSV, PNG and log (default: ./reshard-results outside "
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
    has_nixl = importlib.util.find_spec("nixl_cu13") is not None
    args.transports = (args.transport or ("nccl,nixl" if has_nixl else "nccl")).split(",")
    for name in args.transports:
        if name not in ("nccl", "nixl"):
            parser.error(f"--transport: {name!r} is not nccl or nixl")
    if "nixl" in args.transports and not has_nixl:
        parser.error("--transport nixl: NIXL is not installed (pip install \"kvbm_ext[nixl]\")")
    args.nb = [int(n) for n in (args.nb or ("8,64" if on_gpu else "2,4")).split(",")]
    args.layers = args.layers or (80 if on_gpu else 4)
    return args


class Rank:
    """This process's rank: its device, group, NIXL transport and timing helpers."""

    def __init__(self, rank, args, folder):
        self.rank, self.args = rank, args
        self.gpu = args.device == "cuda"
        self.device = f"cuda:{rank}" if self.gpu else "cpu"
        if self.gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if self.gpu else "gloo",
                                store=dist.FileStore(os.path.join(folder, "group"), WORLD), rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=300))
        if self.gpu:
            dist.all_reduce(torch.ones(1, device=self.device))     # NCCL: the first operation involves every rank
        self.nixl = None
        if "nixl" in args.transports:
            from kvbm_ext.nixl import NixlTransport

            # The NIXL ranks meet through a store of their own: the Resharder never uses the group.
            delay = {} if args.progress_delay_us is None else {"progress_delay_us": args.progress_delay_us}
            self.nixl = NixlTransport(rank, WORLD, f"reshard-bench-{rank}",
                                      store=dist.FileStore(os.path.join(folder, "nixl"), WORLD), **delay)

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()

    def seconds(self, fn, calls=None, finish=None):
        """Per-call time of fn over `calls` (default args.calls) back-to-back calls, the slowest rank's, median
        of args.repeats; and fn's own host time per call (median).  `finish` runs after the calls, inside the
        timed span (waiting for what went on in the background)."""
        calls = calls or self.args.calls
        times, host = [], []
        for _ in range(self.args.repeats):
            dist.barrier()
            self.sync()
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            begin = time.perf_counter()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
            if finish is not None:
                finish()
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


def rank_caches(me, layouts, num_blocks):
    """This rank's cache in each layout, of random bits, num_blocks blocks (None where the
    rank holds no position)."""
    caches = []
    for layout in layouts:
        position = layout.position_of(me.rank)
        nh = 0 if position is None else len(layout.heads_of(position[1], NH))
        caches.append(None if position is None else kvbm_ext.PagedKVCache(
            [random_bits((NO, num_blocks, me.args.nt, nh, HD), me.device) for _ in range(me.args.layers)], DIMS))
    return caches


def probe_call(me, resharder, layouts, nb, check=False):
    """The probes' call for this rank, warmed up: `resharder` over its caches of 2 * nb
    blocks, the first nb of each (device ids), with `check`."""
    caches = rank_caches(me, layouts, 2 * nb)
    ids = torch.arange(nb, device=me.device)
    arguments = (caches[0], None if caches[0] is None else ids, caches[1], None if caches[1] is None else ids)

    def call():
        return resharder(*arguments, check=check, timeout=TIMEOUT)

    for _ in range(5):
        call()
    return call


def timeline_probe(doc, child, transport, extra=()):
    """Runs a timeline probe: `child(rank, mine, args, folder)` in each rank's process, with
    the probe's options (--direction, --nb, --rounds and `extra`, (flags, keywords) pairs for
    add_argument) in `mine` and this benchmark's, for `transport`, in `args`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--direction", default="1to2", choices=sorted(DIRECTIONS))
    parser.add_argument("--nb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    for flags, keywords in extra:
        parser.add_argument(*flags, **keywords)
    mine = parser.parse_args()
    args = parse_args(["--device", getattr(mine, "device", "cuda"), "--transport", transport])
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(child, args=(mine, args, folder), nprocs=WORLD, start_method="spawn")


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


def bench_direction(me, transport, name, nb, rows):
    args = me.args
    src, dst = DIRECTIONS[name]
    num_blocks = 2 * nb
    block_bytes = args.layers * NO * args.nt * NH * HD * DTYPE.itemsize
    total = nb * block_bytes

    src_cache, dst_cache = rank_caches(me, (src, dst), num_blocks)
    src_ids = torch.randperm(num_blocks)[:nb].to(me.device)
    dst_ids = torch.randperm(num_blocks)[:nb].to(me.device)
    resharder = kvbm_ext.Resharder(NH, args.layers, src, dst, transport=me.nixl if transport == "nixl" else None)
    arguments = (src_cache, None if src_cache is None else src_ids, dst_cache, None if dst_cache is None else dst_ids)
    last = {}

    def reshard(check, wait=True):
        last["out"] = resharder(*arguments, check=check, wait=wait, timeout=TIMEOUT)

    def waited():
        last["out"].wait(TIMEOUT)
        if me.gpu:
            last["out"].wait_stream()

    reshard(True)                                  # warm-up: kernels loaded, staging allocated, peers connected
    stats = [None] * WORLD
    dist.all_gather_object(stats, last["out"])
    messages = sum(s.messages_sent for s in stats)
    local = sum(s.local_copies for s in stats)
    link = sum(s.bytes_sent for s in stats)
    moved = sum(s.bytes_received + s.bytes_copied for s in stats)
    assert moved == total, (moved, total)
    sender = next(t.src_rank for t in resharder.plan if not t.is_local)
    receiver = 1 - sender

    results = {}
    for method, fn, finish in (("reshard", lambda: reshard(False), None),
                               ("reshard-async", lambda: reshard(False, wait=False), waited),
                               ("reshard-check", lambda: reshard(True), None)):
        results[method] = me.seconds(fn, finish=finish) + ((messages, local, total),)
    del src_cache, dst_cache, resharder, arguments, last
    if me.gpu:
        torch.cuda.empty_cache()
    chunks = args.layers * NO * nb
    if transport == "nccl":
        results.update(nccl_rows(me, sender, receiver, link, total, chunks))
    else:
        results.update(nixl_rows(me, sender, receiver, link, chunks))
    if me.gpu:
        torch.cuda.empty_cache()
    rows += result_rows(me, transport, name, nb, total, link, results)
    return expected_pairs(src, dst, args.layers), (messages, local)


def nccl_rows(me, sender, receiver, link, total, chunks):
    """One send of the link bytes and of all the bytes, and the link bytes as one send per (layer, K/V, block)
    chunk, from the sending rank to the other."""
    results = {}
    peer = receiver if me.rank == sender else sender
    op = dist.isend if me.rank == sender else dist.irecv
    for method, size in (("one-buffer", link), ("all-bytes", total)):
        buffer = torch.empty(size, dtype=torch.uint8, device=me.device)

        def one_buffer(buffer=buffer):
            for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, peer)]):
                work.wait()

        one_buffer()
        results[method] = me.seconds(one_buffer) + ((1, 0, size),)
        del buffer
    pieces = torch.empty(link, dtype=torch.uint8, device=me.device).view(chunks, -1)
    batch = me.args.fragment_batch

    def fragments():
        works = []
        for first in range(0, chunks, batch):
            works += dist.batch_isend_irecv([dist.P2POp(op, pieces[i], peer)
                                             for i in range(first, min(first + batch, chunks))])
        for work in works:
            work.wait()

    fragments()
    results["fragments"] = me.seconds(fragments, me.args.fragment_calls) + ((chunks, 0, link),)
    return results


def nixl_rows(me, sender, receiver, link, chunks):
    """The link bytes as ONE NIXL WRITE of one descriptor, and as one descriptor per (layer, K/V, block) with
    the descriptor lists built per call, between two buffers registered with the transport's agent."""
    from kvbm_ext._nixl_agent import register

    transport = me.nixl
    agent = transport._agent
    buffer = torch.empty(link, dtype=torch.uint8, device=me.device)
    mine = register(agent, buffer)
    described = [None] * WORLD
    dist.all_gather_object(described, (mine.address, mine.device_id, mine.memory, mine.metadata))
    size = link // chunks
    results = {}
    if me.rank == sender:
        address, device_id, memory, metadata = described[receiver]
        name = transport._peers[receiver].name
        agent.add_remote_agent(metadata)
        local = agent.prep_xfer_dlist("", [(mine.address, link, mine.device_id)], mine.memory)
        remote = agent.prep_xfer_dlist(name, [(address, link, device_id)], memory)
        whole = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        offsets = np.arange(chunks, dtype=np.uint64) * np.uint64(size)
        local_rows = np.stack([offsets + np.uint64(mine.address), np.full(chunks, size, np.uint64),
                               np.full(chunks, mine.device_id, np.uint64)], axis=1)
        remote_rows = np.stack([offsets + np.uint64(address), np.full(chunks, size, np.uint64),
                                np.full(chunks, device_id, np.uint64)], axis=1)

        def spin(handle):
            while (state := agent.check_xfer_state(handle)) == "PROC":
                pass
            assert state == "DONE", state

        def one_buffer():
            agent.transfer(whole, b"bench")
            spin(whole)

        def fragments():
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local_rows, mine.memory),
                                           agent.get_xfer_descs(remote_rows, memory), name, b"bench")
            agent.transfer(handle)
            spin(handle)
            agent.release_xfer_handle(handle)
    else:
        arrived = [0]

        def one_buffer():
            # several notifications may come in one poll: each call takes one
            while arrived[0] == 0:
                arrived[0] += sum(notes.count(b"bench") for notes in agent.get_new_notifs().values())
            arrived[0] -= 1

        fragments = one_buffer
    for method, fn in (("one-buffer", one_buffer), ("fragments", fragments)):
        fn()
        results[method] = me.seconds(fn) + ((1 if method == "one-buffer" else chunks, 0, link),)
    dist.barrier()
    if me.rank == sender:
        agent.release_xfer_handle(whole)
        for dlist in (local, remote):
            agent.release_dlist_handle(dlist)
    agent.deregister_memory(mine.handle)
    return results


def result_rows(me, transport, name, nb, total, link, results):
    """The CSV rows of one transport, direction and nb: per method, its time, GB/s of its bytes and of the link
    bytes, against the transport's one-buffer time."""
    ceiling = results["one-buffer"][0]
    backend = transport if transport == "nixl" or me.gpu else "gloo"      # the backend that carried it
    rows = []
    for method, (seconds, host, (msgs, copies, moved)) in results.items():
        rows.append({"device": me.args.device, "transport": backend, "direction": name, "nb": nb, "method": method,
                     "messages": msgs, "local_copies": copies, "bytes": moved, "link_bytes": link,
                     "time_us": round(seconds * 1e6, 2), "gbps": round(moved / seconds / 1e9, 2),
                     "link_gbps": round(link / seconds / 1e9, 2) if method not in ("all-bytes",) else "",
                     "pct_of_link": round(100 * ceiling / seconds, 1) if method != "all-bytes" else "",
                     "host_us": round(host * 1e6, 1) if method.startswith("reshard") else ""})
    return rows


def run(rank, args, folder):
    me = Rank(rank, args, folder)
    rows, targets = [], []
    for transport in args.transports:
        for name in args.directions:
            for nb in args.nb:
                count = len(rows)
                expected, got = bench_direction(me, transport, name, nb, rows)
                targets.append((rows[-1]["transport"], name, nb, expected, got))
                if rank == 0:
                    print_case(rows[count:])
    if rank == 0:
        print_targets(rows, targets, args)
        write_csv(rows, args)
        pngs, no_png = draw_file(args.stem + ".csv")
        for png in pngs or [no_png]:
            print(f"PNG: {png}")
    dist.destroy_process_group()


def print_case(rows):
    first = rows[0]
    print(f"\n{first['transport']} {first['direction']} nb={first['nb']}: {first['bytes'] / 1e6:.1f} MB per call, "
          f"{first['link_bytes'] / 1e6:.1f} MB of it between the ranks")
    print(f"  {'method':14s} {'messages':>8s} {'GB/s':>9s} {'link GB/s':>9s} {'time us':>10s} {'% link':>7s} "
          f"{'host us':>8s}")
    for row in rows:
        print(f"  {row['method']:14s} {row['messages']:8d} {row['gbps']:9.2f} {row['link_gbps']!s:>9s} "
              f"{row['time_us']:10.1f} {row['pct_of_link']!s:>7s} {row['host_us']!s:>8s}")
    sys.stdout.flush()


def print_targets(rows, targets, args):
    def mark(ok):
        return "PASS" if ok else "MISS"

    applies = "" if args.device == "cuda" else "; CPU run: the timing targets do not apply"
    print(f"\ntargets (nb 64 and 8 where run{applies}):")
    host_limit = {"nccl": 60, "gloo": 60, "nixl": 100}
    for transport in dict.fromkeys(row["transport"] for row in rows):
        for name in args.directions:
            for nb, share in ((64, 90), (8, 70)):
                by = {r["method"]: r for r in rows if (r["transport"], r["direction"], r["nb"]) == (transport, name, nb)}
                if not by:
                    continue
                ours = by["reshard"]
                line = (f"  {transport} {name} nb={nb}: reshard {ours['link_gbps']:.2f} GB/s of link bytes = "
                        f"{ours['pct_of_link']:.1f} % of one buffer ({by['one-buffer']['link_gbps']:.2f} GB/s; "
                        f">= {share} %): {mark(ours['pct_of_link'] >= share)}")
                if transport == "nixl":
                    times = by["fragments"]["time_us"] / ours["time_us"]
                    line += f"; {times:.1f}x the fragments row (>= 20x at nb 64): {mark(nb != 64 or times >= 20)}"
                print(line)
                if nb == 64:
                    limit = host_limit[transport]
                    asynchronous, checked = by["reshard-async"]["host_us"], by["reshard-check"]["host_us"]
                    print(f"  {transport} {name} nb=64: host time per call {ours['host_us']:.0f} us, wait=False "
                          f"{asynchronous:.0f} us (<= {limit} us): {mark(asynchronous <= limit)}, check=True "
                          f"{checked:.0f} us (<= 300 us): {mark(checked <= 300)}")
    for transport, name, nb, expected, got in targets:
        print(f"  {transport} {name} nb={nb}: {got[0]} messages + {got[1]} local copies per call, pairs sharing "
              f"data {expected[0]} + {expected[1]}: {mark(got == expected)}")


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
    print(f"writing the CSV, PNG and log into {os.path.dirname(args.stem)}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_child, args=(args, tmp), nprocs=WORLD, start_method="spawn")
    print(f"log: {args.stem}.log")
    return 0


def _child(rank, args, folder):
    if rank == 0:
        log = open(args.stem + ".log", "w")
        sys.stdout = Tee(sys.__stdout__, log)
        devices = [torch.cuda.get_device_name(i) for i in range(WORLD)] if args.device == "cuda" else ["cpu"]
        print(f"kvbm_ext {kvbm_ext.__version__} {kvbm_ext.build_info()}, torch {torch.__version__}, "
              f"devices {devices}, transports {args.transports}, UCX_TLS={os.environ.get('UCX_TLS', '')!r}, "
              f"{' '.join(sys.argv)}")
        print(f"profile: nl={args.layers} no={NO} nh={NH} hd={HD} bf16 nt={args.nt}, {args.device}, "
              f"{args.calls} calls x {args.repeats} repeats")
    run(rank, args, folder)


if __name__ == "__main__":
    sys.exit(main())
