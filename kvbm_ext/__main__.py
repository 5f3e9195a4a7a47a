"""python -m kvbm_ext: build facts, visible devices, a self-check and a short
benchmark of the default profile (Llama-3.1-70B KV cache, bf16), on the GPU if
there is one (through torch), else on the CPU (NumPy).  --help lists the options."""

import argparse
import sys
import time

import numpy as np

import kvbm_ext
from kvbm_ext._no_gpu import exit_no_gpu, why_no_gpu

# Llama-3.1-70B: 80 layers, K and V, 8 KV heads, head dim 128, 16 tokens per block.
NL, NO, NH, NT, HD = 80, 2, 8, 16, 128
BLOCK_BYTES = NL * NO * NT * NH * HD * 2  # bf16

# The self-check's shape: odd sizes on purpose (hd = 13 rules out 16-byte vectors).
NL_CHECK, NO_CHECK, NH_CHECK, NT_CHECK, HD_CHECK = 3, 2, 5, 7, 13
UNIVERSAL_CHECK = (NH_CHECK, NL_CHECK, NO_CHECK, NT_CHECK, HD_CHECK)

# Benchmark length per device: blocks per call, timed repetitions (the best or the mean is shown).
DEFAULT_LENGTH = {"cpu": (4, 5), "cuda": (8, 10)}
QUICK_LENGTH = (1, 2)


def build_line():
    info = kvbm_ext.build_info()
    archs = f" ({', '.join(info['cuda_archs'])})" if info["cuda_archs"] else ""
    return f"kvbm_ext {info['version']}: CUDA {info['cuda_version'] or 'not compiled in'}{archs}"


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def device_choice(text):
    """auto, cpu, cuda or cuda:N."""
    text = text.strip().lower()
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m kvbm_ext",
        description="Print the build (CUDA version, GPU targets) and the visible CUDA devices, check that "
                    "conversions are bit-exact on the CPU (and on the GPU when one is used), and time "
                    "block_to_universal / universal_to_block on the Llama-3.1-70B profile "
                    f"(nl={NL} no={NO} nh={NH} nt={NT} hd={HD}, bf16, {BLOCK_BYTES / 1e6:.2f} MB a block).  "
                    "GB/s count the bytes moved once: a copy of N bytes moves N bytes.",
        epilog="Exit status: 0 when every check passed, 1 when a check failed, 2 for a bad option or when "
               "--device asks for a GPU that cannot be used (the reason on stderr).")
    parser.add_argument("--version", action="version", version=build_line(),
                        help="print the version and the CUDA build, then exit")
    parser.add_argument("--device", type=device_choice, default="auto",
                        help="where to check and benchmark: cpu, cuda, cuda:N, or auto (default: cuda:0 when "
                             "this build has CUDA and torch sees a GPU, else cpu)")
    parser.add_argument("--nb", type=positive_int, default=None,
                        help=f"blocks per call in the benchmark (default {DEFAULT_LENGTH['cpu'][0]} on the CPU, "
                             f"{DEFAULT_LENGTH['cuda'][0]} on a GPU)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help=f"timed repetitions (default {DEFAULT_LENGTH['cpu'][1]} on the CPU, "
                             f"{DEFAULT_LENGTH['cuda'][1]} on a GPU)")
    parser.add_argument("--quick", action="store_true",
                        help=f"nb={QUICK_LENGTH[0]}, {QUICK_LENGTH[1]} repetitions (unless given)")
    return parser.parse_args(argv)


def resolve_device(choice):
    """(kind, index, torch, why): ("cpu", None, None, why auto found no GPU, or None) or
    ("cuda", index, torch, None); exits with the no-GPU status when the choice cannot be had."""
    if choice == "cpu":
        return "cpu", None, None, None
    index = int(choice[5:]) if ":" in choice else 0
    why = why_no_gpu(count=index + 1)
    if why is None:
        import torch
        return "cuda", index, torch, None
    if choice == "auto":
        return "cpu", None, None, why
    exit_no_gpu(f"python -m kvbm_ext --device {choice}", why)


def numpy_reference(chunks, layout):
    """[nh, nl, no, nt, hd] from nl*no chunks, by transposition."""
    stacked = np.stack(chunks).reshape((NL_CHECK, NO_CHECK) + chunks[0].shape)
    order = (3, 0, 1, 2, 4) if layout == "NHD" else (2, 0, 1, 3, 4)
    return stacked.transpose(order)


def check_cpu():
    rng = np.random.default_rng()
    for layout in ("NHD", "HND"):
        for dtype in (np.uint8, np.float16, np.float32, np.float64):
            shape = (NT_CHECK, NH_CHECK, HD_CHECK) if layout == "NHD" else (NH_CHECK, NT_CHECK, HD_CHECK)
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            chunks = [rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
                      for _ in range(NL_CHECK * NO_CHECK)]
            universal = np.full(nbytes * NL_CHECK * NO_CHECK, 0xA5, np.uint8).view(dtype).reshape(UNIVERSAL_CHECK)
            kvbm_ext.block_to_universal([chunks], [universal], layout)
            if not np.array_equal(universal.view(np.uint8), numpy_reference(chunks, layout).view(np.uint8)):
                return f"block_to_universal {layout} {np.dtype(dtype).name}: wrong bytes"
            back = [np.empty_like(c) for c in chunks]
            kvbm_ext.universal_to_block([universal], [back], layout)
            if not all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(back, chunks)):
                return f"universal_to_block {layout} {np.dtype(dtype).name}: wrong bytes"
            # The same chunks as a one-block paged cache per layer ([no, 1, *chunk]).
            layers = [np.stack(chunks[l * NO_CHECK:(l + 1) * NO_CHECK])[:, None] for l in range(NL_CHECK)]
            cache = kvbm_ext.PagedKVCache(layers, "kbthd" if layout == "NHD" else "kbhtd")
            paged = np.empty_like(universal)[None]
            paged.view(np.uint8)[...] = 0xA5
            cache.to_universal([0], paged)
            if not np.array_equal(paged[0].view(np.uint8), universal.view(np.uint8)):
                return f"PagedKVCache.to_universal {layout} {np.dtype(dtype).name}: wrong bytes"
    return None


def check_gpu(torch, device):
    for layout in ("NHD", "HND"):
        shape = (NT_CHECK, NH_CHECK, HD_CHECK) if layout == "NHD" else (NH_CHECK, NT_CHECK, HD_CHECK)
        chunks = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device) for _ in range(NL_CHECK * NO_CHECK)]
        for pinned in (False, True):
            universal = torch.full(UNIVERSAL_CHECK, 0xA5, dtype=torch.uint8, device="cpu" if pinned else device)
            if pinned:
                universal = universal.pin_memory()
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            kvbm_ext.block_to_universal([chunks], [universal], layout, stream=stream)
            stream.synchronize()
            expected = numpy_reference([c.cpu().numpy() for c in chunks], layout)
            if not np.array_equal(universal.cpu().numpy(), expected):
                return f"block_to_universal {layout} pinned={pinned} on {device}: wrong bytes"
    return None


def bench_cpu(nb, repeats):
    rng = np.random.default_rng()
    chunk = NT * NH * HD * 2
    blocks = [[rng.integers(0, 256, chunk, dtype=np.uint8).view(np.uint16).reshape(NT, NH, HD)
               for _ in range(NL * NO)] for _ in range(nb)]
    universals = [np.empty((NH, NL, NO, NT, HD), np.uint16) for _ in range(nb)]
    flat_src = rng.integers(0, 256, chunk * NL * NO * nb, dtype=np.uint8)
    flat_dst = np.empty_like(flat_src)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    memcpy = best(lambda: np.copyto(flat_dst, flat_src))
    size_mb = flat_src.nbytes / 1e6
    print(f"  one memcpy of the same {size_mb:.1f} MB (numpy.copyto): {memcpy * 1e3:.2f} ms")
    for name, fn in (("block_to_universal", lambda: kvbm_ext.block_to_universal(blocks, universals)),
                     ("universal_to_block", lambda: kvbm_ext.universal_to_block(universals, blocks))):
        ours = best(fn)
        print(f"  cpu  {name} nb={nb}: {ours * 1e3:.2f} ms, {size_mb / ours / 1e3:.1f} GB/s moved; "
              f"{ours / memcpy:.2f}x the time of one memcpy of the same bytes")


def bench_gpu(torch, device, nb, repeats):
    blocks = [[torch.randint(0, 256, (NT, NH, HD), dtype=torch.int16, device=device).view(torch.bfloat16)
               for _ in range(NL * NO)] for _ in range(nb)]
    universals = [torch.empty((NH, NL, NO, NT, HD), dtype=torch.bfloat16, device=device) for _ in range(nb)]
    nbytes = nb * BLOCK_BYTES
    big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy = torch.empty_like(big)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gpu_ms(fn, host_s):
        fn()
        torch.cuda.synchronize(device)
        # Keep the GPU busy while the host parses the arguments, so the events time the GPU work alone.
        torch.cuda._sleep(int(max(host_s * repeats * 2, 1e-4) * 2e9))
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / repeats

    ceiling = big.numel() / gpu_ms(lambda: copy.copy_(big), 0) / 1e6
    print(f"  device copy of 1 GiB (torch copy_): {ceiling:,.0f} GB/s moved")
    for name, fn in (("block_to_universal", lambda: kvbm_ext.block_to_universal(blocks, universals)),
                     ("universal_to_block", lambda: kvbm_ext.universal_to_block(universals, blocks))):
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        rate = nbytes / gpu_ms(fn, host_s) / 1e6
        print(f"  {device}  {name} nb={nb}: {nbytes / rate / 1e3:.1f} us GPU time, {rate:,.0f} GB/s moved "
              f"= {100 * rate / ceiling:.0f} % of the device copy's rate; "
              f"host {host_s * 1e3:.2f} ms per call")


def main(argv=None):
    args = parse_args(argv)
    kind, index, torch, why_cpu = resolve_device(args.device)
    nb, repeats = QUICK_LENGTH if args.quick else DEFAULT_LENGTH[kind]
    nb, repeats = args.nb or nb, args.repeats or repeats

    print(build_line())
    devices = kvbm_ext.cuda_devices()
    for d in devices:
        print(f"  cuda:{d['index']} {d['name']} sm_{d['capability'][0]}{d['capability'][1]}, "
              f"{d['multiprocessors']} SMs, {d['total_memory'] / 2**30:.0f} GiB")
    if not devices:
        print("  no CUDA device visible")

    if why_cpu is not None and devices:
        print(f"  (no GPU to run on: {why_cpu}: checking the CPU path only)")

    failure = check_cpu()
    print(f"self-check cpu: {'FAILED: ' + failure if failure else 'ok (bit-exact)'}")
    if kind == "cuda":
        device = f"cuda:{index}"
        with torch.cuda.device(index):
            gpu_failure = check_gpu(torch, device)
            print(f"self-check {device}: {'FAILED: ' + gpu_failure if gpu_failure else 'ok (bit-exact)'}")
            failure = failure or gpu_failure
            print(f"benchmark on {device}, Llama-3.1-70B profile (nl={NL} no={NO} nh={NH} nt={NT} hd={HD}, bf16), "
                  f"mean of {repeats}:")
            bench_gpu(torch, device, nb, repeats)
    else:
        print(f"benchmark on the CPU, Llama-3.1-70B profile (nl={NL} no={NO} nh={NH} nt={NT} hd={HD}, bf16), "
              f"best of {repeats}:")
        bench_cpu(nb, repeats)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
