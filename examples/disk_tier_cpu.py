#!/usr/bin/env python3
"""A disk tier on the CPU: KV blocks stored into a pool file, the pool reopened as after a
restart, the blocks loaded back, and a corrupted slot refused by name.

A serving worker keeps blocks it may need again, too many for host memory, in a file of
slots (`kvbm_ext.disk.DiskPool`): universal slots `[nh, nl, 2, nt, hd]`, each with a header
naming the pool, layout, slot and store, and the CRC-32C of its bytes.  The cache here is a
vLLM-layout cache in host memory (per layer `[num_blocks, nt, nh, 2*hd]`, K|V packed, dims
"bth(kd)"), so everything runs on the CPU.  The script

  1. creates a pool of `--slots` slots in `--dir` and stores `--blocks` blocks, each with
     a key (a stand-in for its prefix hash); the handle completes in the background;
  2. closes the pool and opens it again: `stored()` lists the slots, their generations and
     keys, as an offload manager would rebuild its index after a restart;
  3. loads the slots into other blocks and checks them bit for bit;
  4. flips one byte of one slot in the file and loads again: that slot's load is a
     SlotError naming it, its block keeps what it held, the other blocks are loaded.

It exits with status 1 if a check fails.  Needs NIXL (`pip install "kvbm_ext[nixl]"`):

    python3 examples/disk_tier_cpu.py                  # a pool file in a temporary directory
    python3 examples/disk_tier_cpu.py --dir /nvme      # on the disk the tier would use
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")     # NIXL prints INFO lines on stdout otherwise

import torch  # noqa: E402

import kvbm_ext  # noqa: E402
from kvbm_ext.disk import DiskPool, SlotError  # noqa: E402

NH, NT, HD = 8, 16, 128                           # Llama-3.1-70B's KV heads, tokens a block, head dim


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where the pool file goes (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=4, help="layers a block (default 4; 80 for Llama-3.1-70B)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks stored and loaded (default 8)")
    parser.add_argument("--slots", type=int, default=64, help="slots in the pool (default 64)")
    args = parser.parse_args(argv)
    if min(args.layers, args.blocks) < 1 or args.slots < args.blocks:
        parser.error("--layers and --blocks must be at least 1, --slots at least --blocks")
    return args


def main(argv=None):
    args = parse_args(argv)
    nb, num_blocks = args.blocks, 2 * args.blocks + 1
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randint(-2 ** 15, 2 ** 15, (num_blocks, NT, NH, 2 * HD), dtype=torch.int16,
                            generator=generator).view(torch.bfloat16) for _ in range(args.layers)]
    cache = kvbm_ext.PagedKVCache(layers, "bth(kd)")
    stored, restored = list(range(nb)), list(range(nb, 2 * nb))      # blocks out, and back into others
    slots = list(range(args.slots - nb, args.slots))
    keys = [f"prefix-{b}".encode() for b in stored]

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "kv.pool")
        with DiskPool(path, args.slots, like=cache) as pool:
            print(f"pool: {pool.num_slots} slots of {pool.slot_bytes} bytes, {pool.engine}, "
                  f"{'O_DIRECT' if pool.direct else 'buffered (' + pool.direct_reason + ')'}; GDS: {pool.gds}")
            h = pool.store(cache, stored, slots, keys=keys)
            h.wait(60)
            print(f"stored {nb} blocks in {h.seconds * 1e3:.1f} ms: generations {list(h.generations)}")

        with DiskPool(path) as pool:                      # as after a restart
            index = pool.stored()
            print(f"reopened: {len(index)} slots stored, slot {slots[0]} holds {index[slots[0]]}")
            if sorted(index) != slots or [index[s][1] for s in slots] != keys:
                print("MISMATCH: the reopened pool does not list the slots stored")
                return 1
            h = pool.load(slots, cache, restored)
            h.wait(60)
            exact = all(torch.equal(layer[restored].view(torch.int16), layer[stored].view(torch.int16))
                        for layer in layers)
            print(f"loaded {nb} blocks in {h.seconds * 1e3:.1f} ms, bit-exact: {exact}")
            if not exact:
                return 1

            with open(path, "r+b") as f:                  # one byte of the first slot's payload, flipped
                f.seek(pool._geometry.payload_offset(slots[0]) + 100)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
            kept = [layer[-1].clone() for layer in layers]
            h = pool.load(slots[:2], cache, [num_blocks - 1, restored[1]])
            try:
                h.wait(60)
                print("MISMATCH: a corrupted slot was loaded")
                return 1
            except SlotError as error:
                print(f"corrupted slot refused: {error.reasons}")
            if not all(torch.equal(layer[-1].view(torch.int16), k.view(torch.int16)) for layer, k in zip(layers, kept)):
                print("MISMATCH: the block of the corrupted slot was written")
                return 1
    print("every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
