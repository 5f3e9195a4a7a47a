#!/usr/bin/env python3
"""vLLM offloading jobs through kvbm_ext's worker, against a pinned memcpy and a torch loop.

`kvbm_ext.integrations.vllm.KvbmOffloadingWorker` (docs/vllm.md) is given vLLM's
CanonicalKVCaches over caches shaped as vLLM allocates them with the OffloadingConnector
(per layer `[num_blocks, nh, nt, 2 * hd]`, K|V packed, bf16, nt = 16) for Llama-3.1-8B
(nl = 32) and Llama-3.1-70B (nl = 80) dims (nh = 8, hd = 128, one TP worker), and a pinned
tier of universal blocks.  For jobs of --nbs blocks (default 1, 8, 64), store (GPU to
tier) and load (tier to GPU), it measures:

  worker    the GPU time of one job (events on the worker's stream around submit_*, behind
            a GPU sleep that covers the submission), its GB/s, and the host time of
            submit_* and of the get_finished poll that reports it;
  steady    the host time of submit_* made back to back, as a serving loop makes them,
            the stream synchronized and the jobs polled every 8 outside the timed calls
            (median of --steady): right after a synchronize, as `worker` times it, the
            host runs any work slower, the more so the longer it waited
            (probes/host_after_wait.py);
  to_cache  the host time of the job's PagedKVCache.to_cache call made alone as the worker
            makes it (deferred on a stream), in the same state (the stream busy):
            submit_* less it is the worker's own cost;
  memcpy    one copy of the same bytes between a device buffer and a pinned buffer, the
            same direction, timed in the same round: the rate the bytes can cross PCIe;
  loop      a torch copy_ per block and layer between the cache and a pinned pool of
            vLLM's pages (nb * nl copies), what a per-block Python loop costs;
  jobs/s    --burst jobs submitted back to back, polled until every one is reported: the
            jobs per second the worker sustains, host time included.

Rounds alternate the four (--rounds, medians kept).  On a GPU the log first names the path
a store and a load job's to_cache call took, and why (their KVBM_EXT_DEBUG lines).  Output:
a CSV, a log and a PNG (GB/s of a job, the torch loop and the memcpy, a bar each at every
job size measured, per model and direction; figures.py draws it from the CSV) in --out.
Needs a GPU and vLLM's kv_offload files (vllm 0.26 or 0.33 importable); `--device cpu`
runs the same jobs on host caches (the CPU path: every figure wall time, the memcpy
between two host buffers), a check that the script runs where there is no GPU.
"""

import argparse
import csv
import datetime
import logging
import os
import statistics
import sys
import time

import numpy as np
import torch

from figures import draw_file
from harness import (HD, NH, NT, REPO_ROOT, Tee, calibrate_sleep_cycles_per_us, int_list, output_dir, run_stem,
                     steady_host_us)

MODELS = {"8b": ("Llama-3.1-8B", 32), "70b": ("Llama-3.1-70B", 80)}
COLUMNS = ["gpu_name", "date", "model", "nl", "direction", "nb", "bytes", "worker_us", "memcpy_us", "loop_us",
           "worker_gbps", "memcpy_gbps", "loop_gbps", "worker_pct_of_memcpy", "submit_host_us",
           "submit_steady_host_us", "to_cache_host_us", "poll_host_us", "jobs_per_s", "bit_exact"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="8b,70b", help="comma-separated of 8b, 70b (default both)")
    parser.add_argument("--nbs", type=int_list, default=[1, 8, 64], help="blocks a job (default 1,8,64)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case (default 5)")
    parser.add_argument("--burst", type=int, default=64, help="jobs submitted back to back for jobs/s (default 64)")
    parser.add_argument("--steady", type=int, default=96, help="submissions timed for the steady host time (default 96)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    parser.add_argument("--out", help="where the CSV, log and PNG go (default: see harness.output_dir)")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: expected names among {sorted(MODELS)}, got {unknown or args.models}")
    if args.rounds < 1 or args.burst < 1:
        parser.error("--rounds and --burst: expected positive counts")
    return args


class Case:
    """One model's caches, worker and references, for jobs of up to max_nb blocks."""

    def __init__(self, nl, max_nb, device, integration, base):
        num_blocks = 2 * max_nb
        self.device, self.nl = device, nl
        self.page = NH * NT * 2 * HD * 2
        self.layers = [torch.empty(num_blocks, NH, NT, 2 * HD, dtype=torch.bfloat16, device=device)
                       for _ in range(nl)]
        for layer in self.layers:
            layer.view(torch.int16).random_()
        tensors = [base.CanonicalKVCacheTensor(tensor=layer.view(torch.int8).view(num_blocks, self.page),
                                               page_size_bytes=self.page) for layer in self.layers]
        refs = [[base.CanonicalKVCacheRef(t, self.page) for t in range(nl)]]
        self.slots = 2 * max_nb
        self.worker = integration.KvbmOffloadingWorker(
            base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs), tier=integration.PinnedTier(),
            num_slots=self.slots, blocks_per_chunk=1, page=(torch.bfloat16, True, NH, NT, 2, HD))
        self.integration, self.base = integration, base
        # 1 ms of GPU sleep: longer than any submission's host time.
        self.sleep_cycles = int(1000 * calibrate_sleep_cycles_per_us()) if device.type == "cuda" else 0
        self.job_id = 0
        pinned = device.type == "cuda"
        # The loop's pool: vLLM's own pages, per block and layer.
        self.loop_pool = torch.empty(max_nb, nl, NH, NT, 2 * HD, dtype=torch.bfloat16, pin_memory=pinned)
        self.host_bytes = torch.empty(max_nb * nl * self.page, dtype=torch.uint8, pin_memory=pinned)
        self.device_bytes = torch.empty_like(self.host_bytes, device=device)

    def specs(self, nb, first_slot=0, direction="store"):
        gpu = self.base.GPULoadStoreSpec(list(range(nb) if direction == "store" else range(nb, 2 * nb)), [nb], [0])
        tier = self.integration.KvbmLoadStoreSpec(list(range(first_slot, first_slot + nb)))
        return gpu, tier

    def submit(self, direction, nb, first_slot=0, specs=None):
        gpu, tier = specs or self.specs(nb, first_slot, direction)
        self.job_id += 1
        if direction == "store":
            ok = self.worker.submit_store(self.job_id, gpu, tier)
        else:
            ok = self.worker.submit_load(self.job_id, tier, gpu)
        if not ok:
            raise RuntimeError(f"job {self.job_id} ({direction}, {nb} blocks) was not submitted")
        return self.job_id

    def stream(self, direction):
        jobs = self.worker.store_jobs if direction == "store" else self.worker.load_jobs
        return jobs.stream

    def worker_job(self, direction, nb):
        """(GPU us of one job, host us of submit, host us of the poll that reported it).
        A GPU sleep ahead of the start event covers the submission's host time, so the
        events bracket the job's GPU work alone.  The job's specs are made first: vLLM's
        scheduler makes them, not the worker."""
        self.sync()
        stream = self.stream(direction)
        specs = self.specs(nb, direction=direction)
        start = end = None
        if stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.sleep_cycles)
            start.record(stream)
        began = time.perf_counter()
        job = self.submit(direction, nb, specs=specs)
        submit_us = (time.perf_counter() - began) * 1e6
        if stream is not None:
            end.record(stream)
        self.worker.wait({job})
        began = time.perf_counter()
        results = self.worker.get_finished()
        poll_us = (time.perf_counter() - began) * 1e6
        if [(r.job_id, r.success) for r in results] != [(job, True)]:
            raise RuntimeError(f"job {job}: get_finished reported {results}")
        gpu_us = start.elapsed_time(end) * 1e3 if stream is not None else submit_us
        return gpu_us, submit_us, poll_us

    def to_cache_args(self, direction, nb, slots_array=False):
        """(src, dst, src_ids, dst_ids) of the to_cache call a job of nb blocks makes: the
        tier's ids as its spec holds them, or with slots_array as the int64 array the
        worker passes."""
        gpu, tier = self.specs(nb, direction=direction)
        group = self.worker.groups[0]
        cache, pool = group.cache, self.worker.tier.pool_caches[group.index]
        slots = np.asarray(tier.block_ids, dtype=np.int64) if slots_array else tier.block_ids
        return (cache, pool, gpu.block_ids, slots) if direction == "store" else (pool, cache, slots, gpu.block_ids)

    def to_cache_call(self, direction, nb):
        """Host us of the to_cache call a job of nb blocks makes, as the worker makes it (the
        tier's ids an int64 array; on a stream, deferred to the enqueue thread), made alone
        on the worker's stream behind the same GPU sleep (on the CPU path: the copy itself)."""
        self.sync()
        stream = self.stream(direction)
        src, dst, src_ids, dst_ids = self.to_cache_args(direction, nb, slots_array=True)
        if stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.sleep_cycles)
        began = time.perf_counter()
        deferred = src.to_cache(dst, src_ids, dst_ids, stream=stream, defer=stream is not None)
        us = (time.perf_counter() - began) * 1e6
        if deferred is not None:
            deferred.result()   # enqueued: the synchronize below then covers the copy
        self.sync()
        return us

    def memcpy(self, direction, nb):
        """GPU us of one copy of a job's bytes across PCIe, the job's direction (on the
        CPU path: wall us of one copy between two host buffers)."""
        count = nb * self.nl * self.page
        host, dev = self.host_bytes[:count], self.device_bytes[:count]
        if self.device.type != "cuda":
            began = time.perf_counter()
            host.copy_(dev) if direction == "store" else dev.copy_(host)
            return (time.perf_counter() - began) * 1e6
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(self.sleep_cycles)
        start.record()
        (host.copy_(dev, non_blocking=True) if direction == "store" else dev.copy_(host, non_blocking=True))
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def loop(self, direction, nb):
        """Wall us of a copy_ per block and layer, issue to completion."""
        self.sync()
        began = time.perf_counter()
        for b in range(nb):
            for layer_index, layer in enumerate(self.layers):
                if direction == "store":
                    self.loop_pool[b, layer_index].copy_(layer[b], non_blocking=True)
                else:
                    layer[nb + b].copy_(self.loop_pool[b, layer_index], non_blocking=True)
        self.sync()
        return (time.perf_counter() - began) * 1e6

    def steady_submit(self, direction, nb, reps):
        """Median host us of submit_* made back to back, a synchronize and a poll every 8
        jobs, outside the timed calls."""
        specs = self.specs(nb, direction=direction)
        us = steady_host_us([lambda: self.submit(direction, nb, specs=specs)], reps=reps, batch=8,
                            between=self.worker.get_finished, synchronize=self.sync)
        self.worker.get_finished()
        return us

    def jobs_per_s(self, direction, nb, burst):
        """Jobs of nb blocks submitted back to back, polled until all are reported."""
        self.sync()
        began = time.perf_counter()
        jobs = {self.submit(direction, nb) for _ in range(burst)}
        while jobs:
            for result in self.worker.get_finished():
                if not result.success:
                    raise RuntimeError(f"job {result.job_id} failed")
                jobs.discard(result.job_id)
        return burst / (time.perf_counter() - began)

    def bit_exact(self, nb):
        """A store then a load of nb blocks: the tier holds the pages in universal order and
        the loaded blocks equal the stored ones."""
        # vLLM loads a chunk only once its store was reported: the load's stream does not
        # wait for the store's.
        self.worker.wait({self.submit("store", nb)})
        self.worker.wait({self.submit("load", nb)})
        self.worker.get_finished()
        pool = self.worker.tier.pool
        for t in (0, self.nl - 1):
            want = self.layers[t][:nb].unflatten(-1, (2, HD)).transpose(2, 3).cpu()     # [nb, nh, 2, nt, hd]
            if not torch.equal(pool[:nb, :, t].view(torch.int16), want.view(torch.int16)):
                return False
            if not torch.equal(self.layers[t][nb:2 * nb].view(torch.int16), self.layers[t][:nb].view(torch.int16)):
                return False
        return True

    def routes(self, nb):
        """The KVBM_EXT_DEBUG lines of a store and a load job of nb blocks: the path each
        to_cache call took on the GPU, and why."""
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logger = logging.getLogger("kvbm_ext")
        logger.addHandler(handler)
        previous = os.environ.get("KVBM_EXT_DEBUG")
        os.environ["KVBM_EXT_DEBUG"] = "1"
        try:
            for direction in ("store", "load"):
                self.worker.wait({self.submit(direction, nb)})
        finally:
            if previous is None:
                del os.environ["KVBM_EXT_DEBUG"]
            else:
                os.environ["KVBM_EXT_DEBUG"] = previous
            logger.removeHandler(handler)
        self.worker.get_finished()
        return lines

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(args, say):
    sys.path.insert(0, REPO_ROOT)
    import kvbm_ext
    from vllm.v1.kv_offload import base

    from kvbm_ext.integrations import vllm as integration
    device = torch.device(args.device)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    date = datetime.date.today().isoformat()
    say(f"# {gpu_name}, {date}, torch {torch.__version__}, vLLM {integration.VLLM_VERSION}, kvbm_ext "
        f"{kvbm_ext.__version__}; nh={NH} hd={HD} nt={NT} bf16, rounds {args.rounds}, burst {args.burst}")
    rows = []
    for model in args.models:
        name, nl = MODELS[model]
        case = Case(nl, max(args.nbs), device, integration, base)
        exact = case.bit_exact(max(args.nbs))
        say(f"\n{name} (nl={nl}, {nl * case.page / 2**20:.2f} MiB a block): bit-exact {exact}")
        if device.type == "cuda":
            for line in case.routes(max(args.nbs)):
                say(f"route: {line}")
        say(f"{'dir':5} {'nb':>3} {'worker us':>10} {'GB/s':>7} {'memcpy us':>10} {'GB/s':>7} {'% memcpy':>8} "
            f"{'loop us':>9} {'GB/s':>7} {'submit us':>9} {'steady us':>9} {'to_cache us':>11} {'poll us':>8} {'jobs/s':>8}")
        for direction in ("store", "load"):
            for nb in args.nbs:
                parts = (case.worker_job, case.to_cache_call, case.memcpy, case.loop)
                for _ in range(2):               # warm-up: kernels, staging, pinned pages
                    for part in parts:
                        part(direction, nb)
                samples = [[part(direction, nb) for part in parts] for _ in range(args.rounds)]
                worker_us = statistics.median(s[0][0] for s in samples)
                submit_us = statistics.median(s[0][1] for s in samples)
                poll_us = statistics.median(s[0][2] for s in samples)
                to_cache_us = statistics.median(s[1] for s in samples)
                memcpy_us = statistics.median(s[2] for s in samples)
                loop_us = statistics.median(s[3] for s in samples)
                steady_us = case.steady_submit(direction, nb, args.steady)
                per_s = case.jobs_per_s(direction, nb, args.burst)
                nbytes = nb * nl * case.page
                gbps = [nbytes / us / 1e3 for us in (worker_us, memcpy_us, loop_us)]
                pct = 100 * memcpy_us / worker_us
                say(f"{direction:5} {nb:>3} {worker_us:>10.1f} {gbps[0]:>7.1f} {memcpy_us:>10.1f} {gbps[1]:>7.1f} "
                    f"{pct:>7.1f}% {loop_us:>9.1f} {gbps[2]:>7.1f} {submit_us:>9.1f} {steady_us:>9.1f} {to_cache_us:>11.1f} "
                    f"{poll_us:>8.1f} {per_s:>8.0f}")
                rows.append(dict(zip(COLUMNS, [gpu_name, date, name, nl, direction, nb, nbytes, worker_us, memcpy_us,
                                               loop_us, *gbps, pct, submit_us, steady_us, to_cache_us, poll_us, per_s,
                                               exact])))
        case.worker.shutdown()
    return gpu_name, date, rows


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        sys.path.insert(0, REPO_ROOT)
        from kvbm_ext._no_gpu import require_gpu
        require_gpu("vllm_offload")
    folder = output_dir(args.out, "vllm_offload")
    stem = run_stem(folder, "vllm_offload", torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
                    datetime.date.today().isoformat())
    with open(stem + ".log", "w") as log:
        out = Tee(sys.stdout, log)
        gpu_name, date, rows = measure(args, lambda text: print(text, file=out))
        with open(stem + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        pngs, no_png = draw_file(stem + ".csv")
        for png in pngs or [no_png]:
            print(f"PNG: {png}", file=out)
    print(f"wrote {stem}.csv and {stem}.log")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
