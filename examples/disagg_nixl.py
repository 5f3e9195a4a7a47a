#!/usr/bin/env python3
"""A prefill engine and a decode engine that share no process group hand over one
request's KV blocks over NIXL, regrouping heads on the way.

Disaggregated serving: the prefill engine computes a request's KV cache, the decode
engine continues the request.  Here they are separate processes started separately, one
per rank, that only know how to find each other (a TCPStore: `--store HOST:PORT`):

- prefill: vLLM's packed K|V cache, per layer `[num_blocks, block_size, nkv, 2*hd]`
  (dims "bth(kd)"), at TP --prefill-tp (default 2);
- decode: SGLang's K/V pairs, per layer `k_buffer[l]`, `v_buffer[l]`, each
  `[tokens, nkv, hd]` (dims "(bt)hd" with block_size=), at TP --decode-tp (default 1).

`--reverse` swaps the engines' caches and TP sizes (prefill SGLang at TP 1, decode vLLM at
TP 2).  The model is Llama-3.1-70B's KV cache (8 KV heads, hd 128, bf16, 16 tokens a
block), --layers layers (4 on the CPU, 80 on GPUs).  The prefill engine fills its cache
(every value a function of its layer, K/V, block, token, head and dim), takes the
request's blocks, and publishes their ids; the decode engine takes that many free blocks
of its own and publishes theirs; every rank then calls its `kvbm_ext.Resharder` over a
`kvbm_ext.nixl.NixlTransport`.  At the end each decode rank checks bit for bit that the
moved blocks hold the prefill engine's values for its heads and that every other block
kept its own (exit status 1 if not), and prints what moved and how fast.

Without --role the script is its own launcher: it hosts the store and starts every rank as
a process of its own (`--device cpu`: host caches and UCX over TCP, UCX_TLS=tcp; `cuda`,
the default with two GPUs: global rank g on GPU g mod the GPUs).

    python3 examples/disagg_nixl.py                           # everything, on this machine
    python3 examples/disagg_nixl.py --device cpu --reverse
    # or each rank on its own (ranks 0.. are prefill, then decode), e.g. on two hosts:
    python3 examples/disagg_nixl.py --role prefill --rank 0 --store host:29600 &
    python3 examples/disagg_nixl.py --role prefill --rank 1 --store host:29600 &
    python3 examples/disagg_nixl.py --role decode --rank 0 --store host:29600
"""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Run against the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402

NH, HD, NT = 8, 128, 16                # Llama-3.1-70B: KV heads, head dim, tokens per block
DTYPE = torch.bfloat16
TIMEOUT = 60.0
REPS = 5                               # timed calls after the checked one


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when torch sees two GPUs")
    parser.add_argument("--prefill-tp", type=int)
    parser.add_argument("--decode-tp", type=int)
    parser.add_argument("--reverse", action="store_true", help="prefill SGLang at TP 1, decode vLLM at TP 2")
    parser.add_argument("--blocks", type=int, default=12, help="the request's blocks")
    parser.add_argument("--num-blocks", type=int, default=48, help="blocks of each engine's cache")
    parser.add_argument("--layers", type=int, help="layers (default 80 on cuda, 4 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--role", choices=("prefill", "decode"), help="run one rank (else: launch them all)")
    parser.add_argument("--rank", type=int, help="the rank's TP rank within its engine (with --role)")
    parser.add_argument("--store", help="HOST:PORT of the TCPStore the ranks meet at (with --role)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not kvbm_ext.is_using_stubs() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus >= 2 else "cpu"
    if args.device == "cuda" and gpus < 1:
        parser.error("--device cuda needs a GPU visible to torch (and a CUDA build of kvbm_ext)")
    args.gpus = gpus
    args.prefill_tp = args.prefill_tp or (1 if args.reverse else 2)
    args.decode_tp = args.decode_tp or (2 if args.reverse else 1)
    args.prefill_engine, args.decode_engine = ("sglang", "vllm") if args.reverse else ("vllm", "sglang")
    for tp in (args.prefill_tp, args.decode_tp):
        if tp < 1 or NH % tp:
            parser.error(f"TP sizes must divide the {NH} KV heads, got {tp}")
    if args.blocks > args.num_blocks:
        parser.error("--blocks: more than --num-blocks")
    args.layers = args.layers or (80 if args.device == "cuda" else 4)
    if args.role is not None and (args.rank is None or args.store is None):
        parser.error("--role needs --rank and --store")
    return args


# --------------------------------------------------------------------------- the model

def values(seed, layer, blocks, heads, device):
    """What the cache holds for K and V of `blocks` (a 1-D int64 tensor) in `layer`:
    [2, len(blocks), NT, len(heads), HD] int16 bits, a function of every index."""
    shape = (2, 1, 1, 1, 1)
    index = [torch.arange(2, device=device).view(shape), blocks.to(device).view(1, -1, 1, 1, 1),
             torch.arange(NT, device=device).view(1, 1, -1, 1, 1),
             torch.arange(heads.start, heads.stop, device=device).view(1, 1, 1, -1, 1),
             torch.arange(HD, device=device).view(1, 1, 1, 1, -1)]
    x = seed * 1_000_003 + layer * 7_919
    for weight, i in zip((104_729, 1_299_709, 15_485_863, 32_452_843, 49_979_687), index):
        x = x + weight * i
    return ((x * 2_654_435_761) >> 16 & 0xFFFF).to(torch.int32).to(torch.int16)


class EngineCache:
    """A rank's cache in its engine's layout, every block holding values(seed, ...)."""

    def __init__(self, engine, layers, heads, num_blocks, seed, device):
        self.engine, self.heads, self.layers = engine, heads, layers
        blocks = torch.arange(num_blocks)
        self.arrays = []
        for layer in layers:
            k, v = values(seed, layer, blocks, heads, device).view(DTYPE)        # [num_blocks, NT, nh, HD] each
            if engine == "vllm":      # packed K|V: [num_blocks, block_size, nkv, 2 * hd]
                self.arrays.append(torch.cat([k, v], dim=-1).contiguous())
            else:                     # SGLang: k_buffer, v_buffer [tokens, nkv, hd]
                self.arrays.append((k.reshape(-1, len(heads), HD).clone(), v.reshape(-1, len(heads), HD).clone()))
        if engine == "vllm":
            self.cache = kvbm_ext.PagedKVCache(self.arrays, "bth(kd)")
        else:
            self.cache = kvbm_ext.PagedKVCache(self.arrays, "(bt)hd", block_size=NT)

    def kv(self, i):
        """Layer i's K and V as int16 [num_blocks, NT, nh, HD] views."""
        if self.engine == "vllm":
            packed = self.arrays[i].view(torch.int16)
            return packed[..., :HD], packed[..., HD:]
        return tuple(x.view(torch.int16).view(-1, NT, len(self.heads), HD) for x in self.arrays[i])

    def wrong_blocks(self, seed, moved_from, moved_to, own_seed):
        """The (layer, block) pairs that do not hold what they should: the prefill engine's
        values where blocks were moved (moved_from -> moved_to), their own elsewhere."""
        bad = 0
        for i, layer in enumerate(self.layers):
            k, v = self.kv(i)
            want = values(own_seed, layer, torch.arange(k.shape[0]), self.heads, k.device)
            want[:, moved_to] = values(seed, layer, moved_from, self.heads, k.device)
            got = torch.stack([k, v])
            bad += int((got != want).flatten(2).any(dim=2).any(dim=0).sum())
        return bad


# --------------------------------------------------------------------------- one rank

def rank_main(args):
    prefill = kvbm_ext.EngineLayout(args.prefill_tp, ranks=range(args.prefill_tp))
    decode = kvbm_ext.EngineLayout(args.decode_tp, ranks=range(args.prefill_tp, args.prefill_tp + args.decode_tp))
    layout = prefill if args.role == "prefill" else decode
    me = layout.ranks[args.rank]                   # the rank in the Resharder's numbering
    world = args.prefill_tp + args.decode_tp
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{me % args.gpus}"
        torch.cuda.set_device(device)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=TIMEOUT))
    from kvbm_ext.nixl import NixlTransport

    transport = NixlTransport(me, world, f"{args.role}-{args.rank}", store=store)
    heads = layout.heads_of(args.rank, NH)
    layers = list(range(args.layers))
    # the decode cache's own values: another seed (what must survive where nothing moves)
    seed = args.seed if args.role == "prefill" else args.seed + 1
    engine = args.prefill_engine if args.role == "prefill" else args.decode_engine
    cache = EngineCache(engine, layers, heads, args.num_blocks, seed, device)

    # The control plane (the store here): the request's block ids on each side.
    gen = torch.Generator().manual_seed(args.seed + (0 if args.role == "prefill" else 1))
    mine = torch.randperm(args.num_blocks, generator=gen)[:args.blocks].tolist()
    if args.rank == 0:
        store.set(f"request/{args.role}", json.dumps(mine))
    other = "decode" if args.role == "prefill" else "prefill"
    theirs = json.loads(store.get(f"request/{other}"))
    src_ids, dst_ids = (mine, theirs) if args.role == "prefill" else (theirs, mine)

    resharder = kvbm_ext.Resharder(NH, args.layers, prefill, decode, transport=transport)
    src = (cache.cache, src_ids) if args.role == "prefill" else (None, None)
    dst = (cache.cache, dst_ids) if args.role == "decode" else (None, None)
    stats = resharder(*src, *dst, check=True, timeout=TIMEOUT)     # the first call also connects the peers
    begin = time.perf_counter()
    for _ in range(REPS):
        resharder(*src, *dst, check=False, timeout=TIMEOUT)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - begin) / REPS
    bad = 0
    if args.role == "decode":
        bad = cache.wrong_blocks(args.seed, torch.tensor(src_ids), torch.tensor(dst_ids), args.seed + 1)
    print(json.dumps({"role": args.role, "rank": args.rank, "global": me, "device": device, "bad": bad,
                      "seconds": seconds, "stats": stats.__dict__}), flush=True)
    return 1 if bad else 0


# --------------------------------------------------------------------------- the launcher

def launch(args):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT), wait_for_workers=False)
    env = dict(os.environ)
    if args.device == "cpu":
        env["UCX_TLS"] = "tcp"
    common = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--store", f"127.0.0.1:{store.port}",
              "--blocks", str(args.blocks), "--num-blocks", str(args.num_blocks), "--layers", str(args.layers),
              "--seed", str(args.seed), "--prefill-tp", str(args.prefill_tp), "--decode-tp", str(args.decode_tp)]
    if args.reverse:
        common.append("--reverse")
    processes = []
    for role, tp in (("decode", args.decode_tp), ("prefill", args.prefill_tp)):      # decode first: it waits
        for rank in range(tp):
            processes.append(subprocess.Popen(common + ["--role", role, "--rank", str(rank)], env=env,
                                              stdout=subprocess.PIPE, text=True))
    reports, status = [], 0
    for process in processes:
        out, _ = process.communicate(timeout=10 * TIMEOUT)
        status = status or process.returncode
        reports += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    report(args, reports)
    return status or (1 if any(r["bad"] for r in reports) else 0)


def report(args, reports):
    block_bytes = args.layers * 2 * NT * NH * HD * DTYPE.itemsize
    print(f"prefill {args.prefill_engine} TP {args.prefill_tp} -> decode {args.decode_engine} TP {args.decode_tp}, "
          f"separate processes over NIXL ({args.device}{', UCX_TLS=tcp' if args.device == 'cpu' else ''}), "
          f"{args.layers} layers x {NH} KV heads, one request of {args.blocks} blocks of {block_bytes / 1e6:.2f} MB")
    for r in sorted(reports, key=lambda r: r["global"]):
        s = r["stats"]
        print(f"  {r['role']} rank {r['rank']} (rank {r['global']}, {r['device']}): sent {s['messages_sent']} "
              f"messages ({s['bytes_sent'] / 1e6:.2f} MB), received {s['messages_received']} "
              f"({s['bytes_received'] / 1e6:.2f} MB), {s['local_copies']} local copies")
    decoders = [r for r in reports if r["role"] == "decode"]
    if len(reports) != args.prefill_tp + args.decode_tp:
        print(f"check FAILED: {len(reports)} of {args.prefill_tp + args.decode_tp} ranks reported")
    elif any(r["bad"] for r in decoders):
        print(f"check FAILED: {sum(r['bad'] for r in decoders)} (layer, block) pairs differ on the decode ranks")
    else:
        print(f"check OK: the request's {args.blocks} blocks bitwise equal on every decode rank, heads regrouped, "
              "every other decode block untouched")
    if reports:
        seconds = max(r["seconds"] for r in reports)
        moved = args.blocks * block_bytes
        print(f"{moved / 1e6:.1f} MB moved in {seconds * 1e3:.3f} ms per call: {moved / seconds / 1e9:.2f} GB/s "
              f"(mean of {REPS} calls, wall clock, slowest rank)")


def main(argv=None):
    args = parse_args(argv)
    return rank_main(args) if args.role else launch(args)


if __name__ == "__main__":
    sys.exit(main())
