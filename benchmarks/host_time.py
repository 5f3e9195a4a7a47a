#!/usr/bin/env python3
"""Host time per call, side by side for several builds of kvbm_ext (before and after a change).

A call's host time is what the issuing thread spends in it: in a serving worker, time the
scheduler does not have.  This script measures it for the Llama-3.1-70B KV cache
(nl=80 no=2 nh=8 hd=128 bf16, nt=16), on the GPU, device to device, calls issued back to
back on a side stream:

  list     block_to_universal / universal_to_block at nb=64: 10,240 chunk tensors read or
           written per call, so the cost per tensor shows;
  paged    PagedKVCache.to_universal / from_universal at nb=1 and 64, over three kinds of
           torch layers: "separate" (80 tensors of their own), "views" (80 views of one
           tensor) and "inference" (80 tensors made under torch.inference_mode()).  What
           a from_* call asks torch of its layers depends on the kind (README, "torch
           tensors").

Every build is a source tree with an in-place build of the extension (`--build
LABEL=ROOT`, repeatable; default: this checkout).  Builds are imported in turn by child
processes of this script, alternating for --rounds rounds, so that a slow spell of the host
falls on every build.  Each case is timed in 9 batches of back-to-back calls (the stream is
synchronized between batches, outside the timing); a round keeps the median batch, and the
report gives the median and the minimum over rounds.  Output: a CSV and a log in --out.
"""

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from harness import HD, NH, NL, NO, NT, REPO_ROOT, Tee, output_dir, run_stem

NUM_BLOCKS = 256
LIST_NB = 64
PAGED_NBS = (1, 64)
LAYER_KINDS = ("separate", "views", "inference")
BATCHES = 9
LIST_CALLS, PAGED_CALLS = 3, 200          # calls per batch
COLUMNS = ["gpu_name", "date", "build", "root", "case", "rounds", "median_us", "min_us", "per_round_us"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", metavar="LABEL=ROOT", default=[],
                        help="a build to time: a label and its source tree (repeatable; default: "
                             "checkout=<this repository>)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the builds (default 3)")
    parser.add_argument("--out", help="where the CSV and log go (default: see harness.output_dir)")
    parser.add_argument("--worker", nargs=3, metavar=("ROOT", "LABEL", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    builds = []
    for text in args.build or [f"checkout={REPO_ROOT}"]:
        label, sep, root = text.partition("=")
        if not sep or not label or not os.path.isdir(root):
            parser.error(f"--build: expected LABEL=ROOT with ROOT a directory, got {text!r}")
        builds.append((label, os.path.abspath(root)))
    if args.rounds < 1:
        parser.error("--rounds: expected a positive count")
    args.builds = builds
    return args


# ----------------------------------------------------------------------------- one build

def batches_us(call, calls_per_batch):
    """Median over BATCHES of the mean host time of calls_per_batch back-to-back calls."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    means = []
    for _ in range(BATCHES):
        start = time.perf_counter()
        for _ in range(calls_per_batch):
            call()
        means.append((time.perf_counter() - start) / calls_per_batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means)


def layer_tensors(kind, device):
    shape = (NO, NUM_BLOCKS, NT, NH, HD)
    if kind == "views":
        return list(torch.randn((NL,) + shape, dtype=torch.bfloat16, device=device).unbind(0))
    if kind == "inference":
        with torch.inference_mode():
            return [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(NL)]
    return [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(NL)]


def time_build(root):
    """{case: host us per call} for the build in `root` (imported here, first on the path)."""
    sys.path.insert(0, root)
    import kvbm_ext
    if os.path.dirname(os.path.dirname(os.path.abspath(kvbm_ext.__file__))) != os.path.realpath(root):
        raise SystemExit(f"host_time: imported {kvbm_ext.__file__}, not the build in {root}")
    device = torch.device("cuda")
    stream = torch.cuda.Stream().cuda_stream
    results = {}
    layers = layer_tensors("separate", device)
    blocks = [[layers[l][o][b] for l in range(NL) for o in range(NO)] for b in range(LIST_NB)]
    universals = list(torch.empty((LIST_NB, NH, NL, NO, NT, HD), dtype=torch.bfloat16, device=device).unbind(0))
    results[f"list block_to_universal nb={LIST_NB}"] = batches_us(
        lambda: kvbm_ext.block_to_universal(blocks, universals, "NHD", stream=stream), LIST_CALLS)
    results[f"list universal_to_block nb={LIST_NB}"] = batches_us(
        lambda: kvbm_ext.universal_to_block(universals, blocks, "NHD", stream=stream), LIST_CALLS)
    for kind in LAYER_KINDS:
        cache = kvbm_ext.PagedKVCache(layers if kind == "separate" else layer_tensors(kind, device), "kbthd")
        for nb in PAGED_NBS:
            ids = torch.arange(nb, dtype=torch.int64, device=device) * 3
            flat = torch.empty((nb, NH, NL, NO, NT, HD), dtype=torch.bfloat16, device=device)
            results[f"paged {kind} to_universal nb={nb}"] = batches_us(
                lambda: cache.to_universal(ids, flat, stream=stream), PAGED_CALLS)
            results[f"paged {kind} from_universal nb={nb}"] = batches_us(
                lambda: cache.from_universal(flat, ids, stream=stream), PAGED_CALLS)
    return results


# ----------------------------------------------------------------------------- all builds

def require_a_gpu():
    """The no-GPU answer every script gives, from the checkout's package.  Imported here, not
    at the top: a worker must import the build it times, not this one."""
    sys.path.insert(0, REPO_ROOT)
    from kvbm_ext._no_gpu import require_gpu
    sys.path.remove(REPO_ROOT)
    require_gpu("host_time", build=False)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        root, _, path = args.worker
        with open(path, "w") as f:
            json.dump(time_build(root), f)
        return
    require_a_gpu()
    gpu_name = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    folder = output_dir(args.out, "host_time")
    stem = run_stem(folder, "host_time", gpu_name, date)
    samples = {label: {} for label, _ in args.builds}
    with open(stem + ".log", "w") as log:
        out = Tee(sys.stdout, log)
        print(f"# {gpu_name}, {date}, torch {torch.__version__}; builds: "
              + ", ".join(f"{label}={root}" for label, root in args.builds), file=out)
        for r in range(args.rounds):
            for label, root in args.builds:
                path = f"{stem}-{label}-{r}.json"
                subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", root, label, path], check=True)
                with open(path) as f:
                    for case, us in json.load(f).items():
                        samples[label].setdefault(case, []).append(us)
                os.remove(path)
        rows = []
        cases = list(samples[args.builds[0][0]])
        labels = [label for label, _ in args.builds]
        print(f"\n{'case':40s}" + "".join(f"{label + ' median / min us':>30s}" for label in labels), file=out)
        for case in cases:
            cells = []
            for label, root in args.builds:
                values = samples[label][case]
                rows.append([gpu_name, date, label, root, case, len(values), f"{statistics.median(values):.2f}",
                             f"{min(values):.2f}", " ".join(f"{v:.2f}" for v in values)])
                cells.append(f"{statistics.median(values):12.1f} / {min(values):9.1f}")
            print(f"{case:40s}" + "".join(f"{c:>30s}" for c in cells), file=out)
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    print(f"\nwrote {stem}.csv and {stem}.log")


if __name__ == "__main__":
    main()
