"""python -m kvbm_ext: build facts, visible devices, a self-check and a short
benchmark of the default profile (Llama-3.1-70B KV cache, bf16), on the GPU if
there is one (through torch or CuPy), else on the CPU (NumPy)."""

import sys
import time

import numpy as np

import kvbm_ext

# Llama-3.1-70B: 80 layers, K and V, 8 KV heads, head dim 128, 16 tokens per block.
NL, NO, NH, NT, HD = 80, 2, 8, 16, 128


# The self-check's shape: odd sizes on purpose (hd = 13 rules out 16-byte vectors).
NL_CHECK, NO_CHECK, NH_CHECK, NT_CHECK, HD_CHECK = 3, 2, 5, 7, 13
UNIVERSAL_CHECK = (NH_CHECK, NL_CHECK, NO_CHECK, NT_CHECK, HD_CHECK)


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
            chunks = [rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape) for _ in range(NL_CHECK * NO_CHECK)]
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


def check_gpu(torch):
    device = "cuda"
    for layout in ("NHD", "HND"):
        shape = (NT_CHECK, NH_CHECK, HD_CHECK) if layout == "NHD" else (NH_CHECK, NT_CHECK, HD_CHECK)
        chunks = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device) for _ in range(NL_CHECK * NO_CHECK)]
        for pinned in (False, True):
            universal = torch.full(UNIVERSAL_CHECK, 0xA5, dtype=torch.uint8,
                                   device="cpu" if pinned else device)
            if pinned:
                universal = universal.pin_memory()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            kvbm_ext.block_to_universal([chunks], [universal], layout, stream=stream)
            stream.synchronize()
            expected = numpy_reference([c.cpu().numpy() for c in chunks], layout)
            if not np.array_equal(universal.cpu().numpy(), expected):
                return f"block_to_universal {layout} pinned={pinned}: wrong bytes"
    return None


def bench_cpu(nb=4):
    rng = np.random.default_rng()
    chunk = NT * NH * HD * 2
    blocks = [[rng.integers(0, 256, chunk, dtype=np.uint8).view(np.uint16).reshape(NT, NH, HD) for _ in range(NL * NO)] for _ in range(nb)]
    universals = [np.empty((NH, NL, NO, NT, HD), np.uint16) for _ in range(nb)]
    flat_src = rng.integers(0, 256, chunk * NL * NO * nb, dtype=np.uint8)
    flat_dst = np.empty_like(flat_src)

    def best(fn, repeat=5):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    ours = best(lambda: kvbm_ext.block_to_universal(blocks, universals))
    memcpy = best(lambda: np.copyto(flat_dst, flat_src))
    size = flat_src.nbytes / 1e6
    print(f"  cpu  block_to_universal nb={nb}: {ours * 1e3:7.2f} ms ({size / ours / 1e3:5.1f} GB/s), "
          f"one memcpy of the same {size:.0f} MB: {memcpy * 1e3:.2f} ms ({ours / memcpy:.2f}x)")


def bench_gpu(torch, nb=8):
    device = "cuda"
    blocks = [[torch.randint(0, 256, (NT, NH, HD), dtype=torch.int16, device=device).view(torch.bfloat16)
               for _ in range(NL * NO)] for _ in range(nb)]
    universals = [torch.empty((NH, NL, NO, NT, HD), dtype=torch.bfloat16, device=device) for _ in range(nb)]
    nbytes = nb * NL * NO * NT * NH * HD * 2
    big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy = torch.empty_like(big)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gpu_ms(fn, host_s, repeat=10):
        fn()
        torch.cuda.synchronize()
        # Keep the GPU busy while the host parses the arguments, so the events time the GPU work alone.
        torch.cuda._sleep(int(max(host_s * repeat * 2, 1e-4) * 2e9))
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeat

    ceiling_ms = gpu_ms(lambda: copy.copy_(big), 0)
    print(f"  gpu  device copy ceiling: {2 * big.numel() / ceiling_ms / 1e6:7.0f} GB/s (read + written)")
    for name, fn in (("block_to_universal", lambda: kvbm_ext.block_to_universal(blocks, universals)),
                     ("universal_to_block", lambda: kvbm_ext.universal_to_block(universals, blocks))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        ms = gpu_ms(fn, host_s)
        print(f"  gpu  {name} nb={nb}: {ms * 1e3:7.1f} us GPU, {2 * nbytes / ms / 1e6:7.0f} GB/s, "
              f"host {host_s * 1e3:.2f} ms per call")


def main():
    info = kvbm_ext.build_info()
    print(f"kvbm_ext {info['version']}: CUDA {info['cuda_version'] or 'not compiled in'}"
          f"{' (' + ', '.join(info['cuda_archs']) + ')' if info['cuda_archs'] else ''}")
    devices = kvbm_ext.cuda_devices()
    for d in devices:
        print(f"  cuda:{d['index']} {d['name']} sm_{d['capability'][0]}{d['capability'][1]}, "
              f"{d['multiprocessors']} SMs, {d['total_memory'] / 2**30:.0f} GiB")
    if not devices:
        print("  no CUDA device visible")

    failure = check_cpu()
    print(f"self-check cpu: {'FAILED: ' + failure if failure else 'ok'}")
    torch = None
    if devices and not kvbm_ext.is_using_stubs():
        try:
            import torch as torch_module
            torch = torch_module if torch_module.cuda.is_available() else None
        except ImportError:
            pass
        if torch is None:
            print("self-check gpu: skipped (needs torch with CUDA to allocate device arrays)")
        else:
            gpu_failure = check_gpu(torch)
            print(f"self-check gpu: {'FAILED: ' + gpu_failure if gpu_failure else 'ok'}")
            failure = failure or gpu_failure

    print(f"benchmark, Llama-3.1-70B profile (nl={NL} no={NO} nh={NH} nt={NT} hd={HD}, bf16):")
    if torch is not None:
        bench_gpu(torch)
    else:
        bench_cpu()
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
