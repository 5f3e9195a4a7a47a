#!/usr/bin/env python3
"""Offload KV blocks into a pinned host pool and restore them, the pool from pinned_empty.

A serving worker keeps a host tier: pinned memory allocated once at start-up, into which
blocks the GPU cache evicts are offloaded and from which they come back.  Here the tier is
one `kvbm_ext.pinned_empty` buffer of `--slots` universal blocks `[nh, nl, 2, nt, hd]`
(heads first, so a tensor-parallel rank's heads are one contiguous slice), bf16; the cache
is a vLLM-layout cache (per layer `[2, num_blocks, nt, nh, hd]`, dims "kbthd") wrapped in
`kvbm_ext.PagedKVCache`.  The script

  1. makes the pool and prints how (seconds, pinned, NUMA node, huge pages, threads);
  2. offloads `--blocks` cache blocks into pool slots (PagedKVCache.to_universal);
  3. overwrites those cache blocks (the GPU reuses them) and restores the slots into other
     block ids (from_universal);
  4. checks bit for bit that every restored block equals the block offloaded (exit status
     1 if not) and prints the offload and onload rates.

The pool is handed to torch as a tensor of the same memory (torch.from_dlpack, no copy)
so that a run of slots is a slice; kvbm_ext takes the HostBuffer itself as well.

Run with kvbm_ext installed (`pip install -e .`; after an in-place build, put the
repository root on PYTHONPATH):

    python3 examples/host_pool_offload.py                # GPU when there is one
    python3 examples/host_pool_offload.py --device cpu   # host cache and pool, slowly

Without a GPU the pool is made the same way but not pinned, and the cache lives in host
memory (defaults: 4 layers, 8 blocks).
"""

import argparse
import sys
import time

import torch

import kvbm_ext

NL, NO, NH, HD, NT = 80, 2, 8, 128, 16     # Llama-3.1-70B: layers, K/V, KV heads, head dim, tokens
DTYPE = torch.bfloat16


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when available")
    parser.add_argument("--layers", type=int, help=f"layers (default {NL} on cuda, 4 on cpu)")
    parser.add_argument("--blocks", type=int, help="blocks offloaded and restored (default 64 on cuda, 8 on cpu)")
    parser.add_argument("--slots", type=int, help="universal blocks in the pool (default 4x --blocks)")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and not kvbm_ext.is_using_stubs() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    on_gpu = args.device == "cuda"
    args.layers = args.layers or (NL if on_gpu else 4)
    args.blocks = args.blocks or (64 if on_gpu else 8)
    args.slots = args.slots or 4 * args.blocks
    if min(args.layers, args.blocks) < 1 or args.slots < args.blocks:
        parser.error("--layers and --blocks must be at least 1, --slots at least --blocks")
    return args


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    args = parse_args(argv)
    device, nl, nb = args.device, args.layers, args.blocks
    num_blocks = 4 * nb
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randint(-2 ** 15, 2 ** 15, (NO, num_blocks, NT, NH, HD), dtype=torch.int16,
                            generator=generator).view(DTYPE).to(device) for _ in range(nl)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")

    pool = kvbm_ext.pinned_empty((args.slots, NH, nl, NO, NT, HD), DTYPE)
    print(f"pool: {pool.nbytes / 2 ** 30:.2f} GiB in {pool.seconds:.3f} s, pinned={pool.pinned}, "
          f"numa_node={pool.numa_node}, huge_pages={pool.huge_pages}, threads={pool.threads}")
    slots = torch.from_dlpack(pool)                    # the same memory, as a torch tensor

    offloaded = torch.randperm(num_blocks, generator=generator)[:nb].tolist()
    first = args.slots - nb                            # the last nb slots of the pool
    saved = [layer[:, offloaded].clone() for layer in layers]

    synchronize(device)
    start = time.perf_counter()
    cache.to_universal(offloaded, slots[first:])
    synchronize(device)
    offload_s = time.perf_counter() - start

    for layer in layers:                               # the GPU reuses the blocks
        layer.view(torch.int16)[:, offloaded] = -0x5A5B
    restored = [b for b in range(num_blocks) if b not in set(offloaded)][:nb]
    synchronize(device)
    start = time.perf_counter()
    cache.from_universal(slots[first:], restored)      # slot first + i into block restored[i]
    synchronize(device)
    onload_s = time.perf_counter() - start

    exact = all(torch.equal(layer[:, restored].view(torch.int16), kept.view(torch.int16))
                for layer, kept in zip(layers, saved))
    block_bytes = NH * nl * NO * NT * HD * DTYPE.itemsize
    print(f"offload {nb} blocks: {nb * block_bytes / offload_s / 1e9:.1f} GB/s; "
          f"onload: {nb * block_bytes / onload_s / 1e9:.1f} GB/s ({device})")
    if not exact:
        print("MISMATCH: the restored blocks differ from the blocks offloaded")
        return 1
    print(f"{nb} blocks restored bit-exact from the pool")
    del slots
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
