#!/usr/bin/env python3
"""Hand KV blocks from a prefill engine to a decode engine of another TP size.

Disaggregated serving: a prefill engine computes a request's KV cache, a decode
engine with a different tensor-parallel size continues the request.  Here the
prefill engine runs at TP --prefill-tp and the decode engine at TP --decode-tp, one
process per rank, each holding a vLLM-layout cache (per layer
`[2, num_blocks, nt, nh, hd]`, dims "kbthd") of a Llama-3.1-70B-like model (8 KV
heads, hd=128, bf16, 16 tokens per block) wrapped in `kvbm_ext.PagedKVCache`.
`kvbm_ext.Resharder` moves a batch of blocks from the prefill ranks to the decode
ranks: one packed message per pair of ranks that share heads, a local copy where one
rank holds both.

With two or more GPUs (`--device cuda`, the default when there are two): NCCL, one
process per GPU, the prefill engine on the first GPUs and the decode engine on the
last ones (they share a GPU where there are not enough).  Elsewhere (`--device cpu`):
gloo, host caches, one process per rank of each engine, 4 layers by default so that
it finishes in seconds.

The script checks bit for bit that every moved block equals the prefill engine's
block and that every other decode block kept its contents (exit status 1 if not),
then prints the plan, the bytes moved, the messages sent and GB/s.

    python3 examples/disagg_reshard.py                                 # GPUs when there are two
    python3 examples/disagg_reshard.py --device cpu --prefill-tp 4 --decode-tp 2
"""

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Run against the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvbm_ext  # noqa: E402

NH, NO, HD, NT = 8, 2, 128, 16        # Llama-3.1-70B: KV heads, K/V, head dim, tokens per block
DTYPE = torch.bfloat16
DIMS = "kbthd"                        # vLLM per-layer cache [2, num_blocks, nt, nh, hd]
REPS = 5                              # timed calls, after the checked one


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when torch sees two GPUs")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--blocks", type=int, help="blocks moved (default 64 on cuda, 4 on cpu)")
    parser.add_argument("--layers", type=int, help="layers (default 80 on cuda, 4 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not kvbm_ext.is_using_stubs() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus >= 2 else "cpu"
    for tp in (args.prefill_tp, args.decode_tp):
        if tp < 1 or NH % tp:
            parser.error(f"TP sizes must divide the {NH} KV heads, got {tp}")
    if args.device == "cuda":
        if gpus < 2:
            parser.error("--device cuda needs two GPUs visible to torch (and a CUDA build of kvbm_ext)")
        args.world = max(args.prefill_tp, args.decode_tp, 2)
        if args.world > gpus:
            parser.error(f"TP {max(args.prefill_tp, args.decode_tp)} needs {args.world} GPUs, {gpus} visible")
    else:
        args.world = args.prefill_tp + args.decode_tp
    on_gpu = args.device == "cuda"
    args.blocks = args.blocks or (64 if on_gpu else 4)
    args.layers = args.layers or (80 if on_gpu else 4)
    args.num_blocks = 2 * args.blocks          # blocks in each cache
    return args


def layer_bits(seed, layer, num_blocks, device):
    """One layer of the whole model's cache, [2, num_blocks, nt, NH, hd], random bits from (seed, layer)."""
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + layer)
    shape = (NO, num_blocks, NT, NH, HD * DTYPE.itemsize)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device).view(DTYPE)


def engine_cache(layout, rank, seed, args, device):
    """This rank's cache of an engine: its heads of every layer (None when the rank is not in the engine)."""
    position = layout.position_of(rank)
    if position is None:
        return None, None
    heads = layout.heads_of(position[1], NH)
    layers = [layer_bits(seed, l, args.num_blocks, device)[:, :, :, heads.start:heads.stop].contiguous()
              for l in range(args.layers)]
    return kvbm_ext.PagedKVCache(layers, DIMS), (heads, layers)


def check(decode, args, device, prefill_ids, decode_ids):
    """Number of (layer, block) pairs of this decode rank that differ from what they should hold:
    the prefill engine's blocks where blocks were moved, the decode cache's own bits elsewhere."""
    heads, layers = decode
    bad = 0
    for l, got in enumerate(layers):
        want = layer_bits(args.seed + 1, l, args.num_blocks, device)[:, :, :, heads.start:heads.stop]
        want[:, decode_ids] = layer_bits(args.seed, l, args.num_blocks, device)[:, prefill_ids, :, heads.start:heads.stop]
        bad += int((got.view(torch.int16) != want.view(torch.int16)).flatten(2).any(dim=2).any(dim=0).sum())
    return bad


def run(rank, args, store_path):
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
                            store=dist.FileStore(store_path, args.world), rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=120))
    if args.device == "cuda":
        dist.all_reduce(torch.ones(1, device=device))   # NCCL: the group's first operation involves every rank
    world = args.world
    prefill = kvbm_ext.EngineLayout(args.prefill_tp, ranks=range(args.prefill_tp))
    decode = kvbm_ext.EngineLayout(args.decode_tp, ranks=range(world - args.decode_tp, world))
    prefill_cache, _ = engine_cache(prefill, rank, args.seed, args, device)
    decode_cache, decode_part = engine_cache(decode, rank, args.seed + 1, args, device)   # seed + 1: the poison

    gen = torch.Generator().manual_seed(args.seed)
    prefill_ids = torch.randperm(args.num_blocks, generator=gen)[:args.blocks].to(device)
    decode_ids = torch.randperm(args.num_blocks, generator=gen)[:args.blocks].to(device)
    resharder = kvbm_ext.Resharder(NH, args.layers, prefill, decode)

    def call(check_args):
        return resharder(prefill_cache, None if prefill_cache is None else prefill_ids,
                         decode_cache, None if decode_cache is None else decode_ids, check=check_args)

    stats = call(True)                       # checked on every rank; also the warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
    bad = 0 if decode_part is None else check(decode_part, args, device, prefill_ids, decode_ids)

    dist.barrier()
    if args.device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            call(False)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / REPS
    else:
        begin = time.perf_counter()
        for _ in range(REPS):
            call(False)
        seconds = (time.perf_counter() - begin) / REPS

    gathered = [None] * world
    dist.all_gather_object(gathered, (bad, seconds, stats))
    if rank == 0:
        report(args, resharder, gathered)
    dist.destroy_process_group()
    if any(b for b, _, _ in gathered):
        sys.exit(1)


def report(args, resharder, gathered):
    bads = [b for b, _, _ in gathered]
    seconds = max(s for _, s, _ in gathered)             # the call is done when the slowest rank is
    stats = [s for _, _, s in gathered]
    block_bytes = args.layers * NO * NT * NH * HD * DTYPE.itemsize
    moved = sum(s.bytes_received + s.bytes_copied for s in stats)
    print(f"prefill TP {args.prefill_tp} on ranks {list(resharder.src.ranks)} -> decode TP {args.decode_tp} on ranks "
          f"{list(resharder.dst.ranks)}, {args.device} ({'NCCL' if args.device == 'cuda' else 'gloo'}), "
          f"{args.layers} layers x {NH} KV heads, {args.blocks} blocks of {block_bytes / 1e6:.2f} MB")
    for t in resharder.plan:
        kind = "local copy" if t.is_local else "message"
        print(f"  rank {t.src_rank} -> rank {t.dst_rank}: heads [{t.heads.start}, {t.heads.stop}) x layers "
              f"[{t.layers.start}, {t.layers.stop}), {kind}")
    if any(bads):
        print(f"check FAILED: {sum(bads)} (layer, block) pairs differ on the decode ranks "
              f"({', '.join(f'rank {r}: {b}' for r, b in enumerate(bads) if b)})")
    else:
        print(f"check OK: {args.blocks} moved blocks bitwise equal, every other decode block untouched")
    print(f"per call: {sum(s.messages_sent for s in stats)} messages "
          f"({sum(s.bytes_sent for s in stats) / 1e6:.1f} MB), {sum(s.local_copies for s in stats)} local copies "
          f"({sum(s.bytes_copied for s in stats) / 1e6:.1f} MB); a fragment per (layer, K/V, block) would be "
          f"{args.layers * NO * args.blocks} messages")
    print(f"{moved / 1e6:.1f} MB moved in {seconds * 1e3:.3f} ms per call: {moved / seconds / 1e9:.2f} GB/s "
          f"(mean of {REPS} calls, {'CUDA events' if args.device == 'cuda' else 'wall clock'}, slowest rank)")


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(run, args=(args, os.path.join(tmp, "store")), nprocs=args.world,
                                     join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except mp.ProcessExitedException as error:
            return error.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
