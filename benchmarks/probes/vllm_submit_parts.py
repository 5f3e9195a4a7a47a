"""Where the host time of a vLLM worker's submission goes: the steady host time of
KvbmOffloadingWorker.submit_store / submit_load (jobs back to back, the stream synchronized
and the jobs polled every 8, outside the timed calls), beside each part of it made alone:
the job's to_cache call on the worker's stream (enqueued by the call, and deferred to the
enqueue thread, alone and followed by the completion event's record, which the worker
makes while the thread enqueues), the wait on the compute stream (the fence's record and
the worker stream's wait), and the completion event's record.  The submission
less those parts is the worker's own Python.  Llama-3.1-8B and 70B dims, vLLM's packed K|V
pages, a pinned universal tier (benchmarks/vllm_offload.py's Case), nb = 1, 8, 64; medians
of --reps.  Needs vLLM's kv_offload files (tools/vllm_gpu_carry.sh).

    python3 benchmarks/probes/vllm_submit_parts.py [--reps 400]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kvbm_ext  # noqa: E402
from harness import spin_us, steady_host_us  # noqa: E402
from vllm_offload import MODELS, Case  # noqa: E402

NBS = (1, 8, 64)


def parts(case, direction, nb, reps):
    worker = case.worker
    stream = case.stream(direction)
    specs = case.specs(nb, direction=direction)
    src, dst, src_ids, dst_ids = case.to_cache_args(direction, nb)
    # The ids as the worker passes them: the tier's as an int64 array, vLLM's as given.
    _, _, src_np, dst_np = case.to_cache_args(direction, nb, slots_array=True)
    fence, done = torch.cuda.Event(), torch.cuda.Event()

    def steady_us(call, batch=8):
        # The jobs that finished are polled after each synchronize, as vLLM polls them.
        return steady_host_us([call], reps=reps, batch=batch, between=worker.get_finished)

    def wait_on_compute():
        fence.record(torch.cuda.current_stream(worker._device))
        stream.wait_event(fence)

    def defer_then_record(pause_us):
        src.to_cache(dst, src_np, dst_np, stream=stream, defer=True)
        spin_us(pause_us)
        done.record(stream)

    measured = {
        # Each call after a synchronize (the enqueue thread idle when it starts), as
        # vllm_offload.py times one job; the record after a pause of 300 us, by when the
        # thread has enqueued the job, less the pause.
        "idle: submit": steady_us(lambda: case.submit(direction, nb, specs=specs), batch=1),
        "idle: to_cache, defer": steady_us(lambda: src.to_cache(dst, src_np, dst_np, stream=stream, defer=True),
                                           batch=1),
        "idle: + event record": steady_us(lambda: defer_then_record(0), batch=1),
        "idle: + 300 us, event record": steady_us(lambda: defer_then_record(300), batch=1) - 300,
        "submit": steady_us(lambda: case.submit(direction, nb, specs=specs)),
        "to_cache": steady_us(lambda: src.to_cache(dst, src_ids, dst_ids, stream=stream)),
        "to_cache, int64 slots": steady_us(lambda: src.to_cache(dst, src_np, dst_np, stream=stream)),
        "to_cache, defer": steady_us(lambda: src.to_cache(dst, src_np, dst_np, stream=stream, defer=True)),
        "to_cache, defer, event record": steady_us(lambda: (src.to_cache(dst, src_np, dst_np, stream=stream,
                                                                          defer=True), done.record(stream))),
        "wait on compute": steady_us(wait_on_compute),
        "current_stream": steady_us(lambda: torch.cuda.current_stream(worker._device)),
        "event record": steady_us(lambda: done.record(stream)),
    }
    tier_calls = worker.tier.store, worker.tier.load
    worker.tier.store = worker.tier.load = lambda *args: None
    try:
        measured["submit, tier a no-op"] = steady_us(lambda: case.submit(direction, nb, specs=specs))
    finally:
        worker.tier.store, worker.tier.load = tier_calls
    return measured


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    from vllm.v1.kv_offload import base

    from kvbm_ext.integrations import vllm as integration
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kvbm_ext {kvbm_ext.__version__}; "
          f"host us, medians of {args.reps}")
    names = None
    for name, nl in MODELS.values():
        case = Case(nl, max(NBS), torch.device("cuda", 0), integration, base)
        for direction in ("store", "load"):
            for nb in NBS:
                p = parts(case, direction, nb, args.reps)
                if names is None:
                    names = list(p)
                    print(f"{'model':<14} {'dir':<6} {'nb':>3} " + " | ".join(names))
                print(f"{name:<14} {direction:<6} {nb:>3} " + " | ".join(f"{p[n]:.1f}" for n in names))
        case.worker.shutdown()
        del case


if __name__ == "__main__":
    main()
