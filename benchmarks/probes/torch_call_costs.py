"""The host cost of the torch calls a Resharder call makes around its own work (one GPU):
device and stream lookups, the stream and device contexts, events, and reading a cache's
layers.  Median of --repeats timings of --count calls each, in microseconds a call.

    python3 benchmarks/probes/torch_call_costs.py [--count 2000] [--repeats 5]
"""
import argparse
import contextlib
import statistics
import time

import torch

import kvbm_ext


def per_call(fn, count, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        times.append((time.perf_counter() - t0) / count * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cuda:0"
    stream = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    layers = [torch.empty(2, 64, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(80)]
    cache = kvbm_ext.PagedKVCache(layers, "kbthd")
    ids = torch.arange(64, device=device)
    probe = torch.empty(0, 8, 80, 2, 16, 128, dtype=torch.bfloat16, device=device)

    def stack():
        with contextlib.ExitStack() as s:
            s.enter_context(torch.cuda.device(device))
            s.enter_context(torch.cuda.stream(stream))

    def device_context():
        with torch.cuda.device(device):
            pass

    def stream_context():
        with torch.cuda.stream(stream):
            pass

    def grads():
        for layer in cache.layers:
            getattr(layer, "requires_grad", False)

    cases = {
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "torch.device(str)": lambda: torch.device(device),
        "with torch.cuda.device(device)": device_context,
        "with torch.cuda.stream(stream)": stream_context,
        "ExitStack of both (_on_stream)": stack,
        "torch.cuda.Event()": torch.cuda.Event,
        "event.record(stream)": lambda: event.record(stream),
        "stream.wait_event(event)": lambda: stream.wait_event(event),
        "event.query()": event.query,
        "str(ids.device) (device ids' check)": lambda: str(ids.device),
        "ids.detach()": ids.detach,
        "cache.layers, requires_grad of 80 layers": grads,
        "cache.from_universal(probe, []) (a probe)": lambda: cache.from_universal(probe, [], pack_layers=True),
        "cache.to_universal([], probe) (a probe)": lambda: cache.to_universal([], probe, pack_layers=True),
    }
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.count} calls x {args.repeats}")
    for name, fn in cases.items():
        fn()
        print(f"{name:48s} {per_call(fn, args.count, args.repeats):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
