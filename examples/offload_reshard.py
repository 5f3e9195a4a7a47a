#!/usr/bin/env python3
"""Offload a tensor-parallel KV cache to host memory and load it back at another TP size.

Two TP ranks of a Llama-3.1-70B-like model (nl=80 layers, K and V, hd=128, bf16, 16
tokens per block) each hold 4 of the 8 KV heads.  They are simulated on one GPU as two
vLLM-layout caches (per layer `[2, num_blocks, nt, nh, hd]`, dims "kbthd") wrapped in
`kvbm_ext.PagedKVCache`.  Each rank offloads the same blocks into universal blocks
`[8 heads, nl, 2, nt, hd]` in pinned host memory, writing its own heads at
`head_offset=4 * rank`; a TP=1 cache of 8 heads then loads the universals back into
other block ids.  The universal layout keeps heads first, so the two ranks' halves meet in
the same host block and the resharding costs no extra pass.

The script checks bit for bit that every moved TP=1 block equals the two rank blocks
concatenated along the head dimension (exit status 1 if not), then prints the offload
(both ranks) and onload bandwidth in GB/s of universal bytes, that is bytes over PCIe.

Run with kvbm_ext installed (`pip install -e .`; after an in-place build, put the
repository root on PYTHONPATH):

    python3 examples/offload_reshard.py                # GPU when there is one
    python3 examples/offload_reshard.py --device cpu   # host arrays: the CPU path, slowly

With --device cpu every array is in host memory, timing is wall-clock, and the defaults
are 4 layers and 4 blocks so that it finishes in seconds.
"""

import argparse
import sys
import time

import torch

import kvbm_ext

NL, NO, HD, NT = 80, 2, 128, 16        # Llama-3.1-70B: layers, K/V, head dim, tokens per block
TP, NH = 2, 8                          # 2 ranks of 4 KV heads each; 8 heads at TP=1
NH_RANK = NH // TP
DIMS = "kbthd"                         # vLLM per-layer cache [2, num_blocks, nt, nh, hd]
HEAD_AXIS = DIMS.index("h")
DTYPE = torch.bfloat16
REPS = 5                               # timed repetitions per direction, after a warm-up


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when available")
    parser.add_argument("--blocks", type=int, help="blocks moved (default 64 on cuda, 4 on cpu)")
    parser.add_argument("--num-blocks", type=int,
                        help="blocks in each cache (default 4x --blocks)")
    parser.add_argument("--layers", type=int, help=f"layers (default {NL} on cuda, 4 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.device == "auto":
        gpu = torch.cuda.is_available() and not kvbm_ext.is_using_stubs()
        args.device = "cuda" if gpu else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    on_gpu = args.device == "cuda"
    if args.blocks is None:
        args.blocks = 64 if on_gpu else 4
    if args.layers is None:
        args.layers = NL if on_gpu else 4
    if args.num_blocks is None:
        args.num_blocks = 4 * args.blocks
    if args.blocks < 1 or args.layers < 1:
        parser.error("--blocks and --layers must be at least 1")
    if args.num_blocks < args.blocks:
        parser.error(f"--num-blocks {args.num_blocks} is smaller than --blocks {args.blocks}")
    return args


def make_cache(nl, num_blocks, nh, device, random):
    """A PagedKVCache over nl vLLM per-layer arrays [2, num_blocks, nt, nh, hd]."""
    shape = (NO, num_blocks, NT, nh, HD * DTYPE.itemsize)       # in bytes along hd
    if random:
        layers = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(DTYPE)
                  for _ in range(nl)]
    else:
        layers = [torch.zeros(shape, dtype=torch.uint8, device=device).view(DTYPE)
                  for _ in range(nl)]
    return kvbm_ext.PagedKVCache(layers, DIMS)


def mismatches(ranks, tp1, src_ids, dst_ids):
    """(layer, index into the ids) of every TP=1 block that differs from the ranks' heads."""
    bad = []
    for l, got in enumerate(tp1.layers):
        want = torch.cat([rank.layers[l][:, src_ids] for rank in ranks], dim=HEAD_AXIS)
        differs = got[:, dst_ids].view(torch.int16) != want.view(torch.int16)
        per_block = differs.flatten(2).any(dim=2).any(dim=0)
        bad += [(l, b) for b in per_block.nonzero().flatten().tolist()]
    return bad


def seconds_per_call(fn, reps, stream):
    """Mean time of fn() over reps calls: CUDA events on stream, wall clock on the CPU."""
    if stream is None:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main(argv=None):
    args = parse_args(argv)
    device, nb, nl = args.device, args.blocks, args.layers
    on_gpu = device == "cuda"
    torch.manual_seed(args.seed)

    ranks = [make_cache(nl, args.num_blocks, NH_RANK, device, random=True) for _ in range(TP)]
    tp1 = make_cache(nl, args.num_blocks, NH, device, random=False)
    src_ids = torch.randperm(args.num_blocks)[:nb]       # the same blocks on both ranks
    dst_ids = torch.randperm(args.num_blocks)[:nb]
    universals = torch.empty((nb, NH, nl, NO, NT, HD), dtype=DTYPE, pin_memory=on_gpu)
    stream = None
    if on_gpu:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the fills on the current stream

    def offload():
        for r, rank in enumerate(ranks):
            rank.to_universal(src_ids, universals, head_offset=r * NH_RANK, stream=stream)

    def onload():
        tp1.from_universal(universals, dst_ids, stream=stream)

    where = "pinned host" if on_gpu else "host"
    print(f"{tp1!r}\n{TP} ranks x {NH_RANK} heads -> {where} universals"
          f" [{nb}, {NH}, {nl}, {NO}, {NT}, {HD}] ({universals.nbytes / 1e6:.1f} MB) -> TP=1")

    offload()                                            # also the warm-up
    onload()
    if stream is not None:
        stream.synchronize()
    bad = mismatches(ranks, tp1, src_ids, dst_ids)
    if bad:
        shown = ", ".join(f"layer {l} TP=1 block {dst_ids[b].item()}" for l, b in bad[:5])
        print(f"check FAILED: {len(bad)} of {nb * nl} (block, layer) pairs differ: {shown}")
        return 1
    print(f"check OK: {nb} blocks x {nl} layers bitwise equal")

    for name, fn in ((f"offload ({TP} ranks)", offload), ("onload (TP=1)", onload)):
        s = seconds_per_call(fn, REPS, stream)
        print(f"{name:18s} {universals.nbytes / s / 1e9:7.2f} GB/s  ({s * 1e3:.3f} ms per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
