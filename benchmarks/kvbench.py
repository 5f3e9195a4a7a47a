#!/usr/bin/env python3
"""Benchmark kvbm_ext on a Llama-3.1-70B KV cache.

Profile: nl=80 layers, no=2 (K, V), nh=8 KV heads, hd=128, bf16.  Blocks are held
vLLM-style: one cache [no, num_blocks, *chunk] per layer, and each block is passed as the
list of its nl*no chunk views ([nt, nh, hd] for NHD, [nh, nt, hd] for HND).  Universals
[nh, nl, no, nt, hd] and operationals [nl, no, nt*nh*hd] are contiguous per block.

--api picks the groups timed in GPU mode:
  list         block_to_universal / universal_to_block (and a small CPU section)
  operational  block_to_operational / operational_to_block per backend, and
               universal_to_operational / operational_to_universal
  copy         vectorized_copy and memcpy_batch on address lists
  paged        PagedKVCache over the per-layer caches ("kbthd"): to/from universals with
               host and device block ids, next to the list API and a plain-PyTorch loop on
               the same blocks; to/from operationals; a num_ctas sweep (and a CPU section)
with every array on the device ("d2d") or one side in pinned host memory ("pinned"),
next to copy ceilings measured in the same run: a device copy, a 1 GiB pinned memcpy
each way, and a pinned memcpy of exactly the bytes of each size.  CPU mode times the
host implementation of the list API (and of PagedKVCache) against a single-threaded
memcpy.  Every case is checked bit for bit against a pure-torch reference before it is
timed.

GB/s count the bytes a call moves, each once (a copy of N bytes moves N bytes), the
ceilings too.  The run writes a CSV, PNGs (GB/s at each nb measured, one question each) and a log
into --out; --compare OLD.csv prints each row's change against an older run.  The parts:
cases.py (what is timed), harness.py (how), report.py (the tables, targets, CSV and
comparison), figures.py (the PNGs).  See benchmarks/README.md.
"""

import argparse
import datetime
import os
import sys

# Benchmark the checkout: an in-place build in the repository root comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torch, kvbm_ext and the modules that import them (cases, harness) take seconds to import:
# load_modules() imports them after the options are parsed, so --help and a bad option
# answer at once.
torch = kvbm_ext = None
APIS = ("list", "operational", "copy", "paged")
CPU_APIS = ("list", "paged")            # the groups with a CPU section
CAP_TARGETS = 4                         # a case times at most 4 times its budget (RepPolicy.cap_s)
EXIT_NOT_VERIFIED, EXIT_REGRESSION = 1, 3


def load_modules():
    """Imports torch, kvbm_ext and the parts that use them into this module's namespace."""
    global torch, kvbm_ext, exit_no_gpu, why_no_gpu, CTAS_NB, REQUIRED, Context, Gpu
    global measure_ceilings, run_cpu_cases, run_gpu_cases, RepPolicy, Tee
    global calibrate_sleep_cycles_per_us, output_dir, run_stem, draw
    global VERIFIED, annotate_backends, annotate_paged, apply_targets, compare
    global print_comparison, print_summary, read_csv, regressions, targets, write_csv
    import torch
    import kvbm_ext
    from kvbm_ext._no_gpu import exit_no_gpu, why_no_gpu
    from cases import CTAS_NB, REQUIRED, Context, Gpu, measure_ceilings, run_cpu_cases, run_gpu_cases
    from harness import RepPolicy, Tee, calibrate_sleep_cycles_per_us, output_dir, run_stem
    from figures import draw
    from report import (VERIFIED, annotate_backends, annotate_paged, apply_targets, compare,
                        print_comparison, print_summary, read_csv, regressions, targets, write_csv)


def int_list(text):
    """argparse type: comma-separated positive integers (harness.int_list, imported when an
    option needs it)."""
    from harness import int_list as parse
    return parse(text)


def layout_list(text):
    """argparse type: comma-separated layouts out of NHD, HND."""
    values = [part.strip().upper() for part in text.split(",") if part.strip()]
    if not values or any(v not in ("NHD", "HND") for v in values):
        raise argparse.ArgumentTypeError(f"expected layouts out of NHD,HND, got {text!r}")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time kvbm_ext on a Llama-3.1-70B KV cache (nl=80 no=2 nh=8 hd=128 bf16).",
        epilog="Exit status: 0; 1 when a case was not verified bit-exact; 2 for bad options, or when "
               "a GPU is needed and none can be used (the reason on stderr); 3 when "
               "--fail-on-regression found a row slower than allowed.  GB/s count the bytes moved "
               "once (a copy of N bytes moves N bytes), ceilings included.")
    parser.add_argument("--api", choices=APIS + ("all",), default="list",
                        help="GPU groups: list (block_to_universal / universal_to_block, plus "
                             "the CPU section), operational (block/universal <-> operational), "
                             "copy (vectorized_copy, memcpy_batch), paged (PagedKVCache next to "
                             "the list API and a torch loop, plus its CPU section), or all "
                             "(default list)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: ceilings and GPU cases (and the CPU sections of the list "
                             "and paged groups); cpu: CPU cases of the list or paged group only; "
                             "auto (default): cuda when a GPU can be used, else cpu for the list "
                             "and paged groups")
    parser.add_argument("--nt", type=int_list, default=[16, 32, 64],
                        help="tokens per block for GPU cases (default 16,32,64)")
    parser.add_argument("--nb", type=int_list, default=[1, 8, 64, 256],
                        help="blocks per call for GPU cases (default 1,8,64,256)")
    parser.add_argument("--layouts", type=layout_list, default=["NHD"],
                        help="chunk layouts of the list API, of universal <-> operational and "
                             "of the paged caches (NHD: dims kbthd, HND: kbhtd), NHD and/or HND "
                             "(default NHD)")
    parser.add_argument("--cpu-nt", type=int_list, default=[16],
                        help="tokens per block for CPU cases (default 16)")
    parser.add_argument("--cpu-nb", type=int_list, default=[1, 8],
                        help="blocks per call for CPU cases (default 1,8)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="timing budget per case in ms, sets the repetitions "
                             "(default 100, 20 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: GPU nt 16, nb 1,8, few repetitions, small ceilings")
    parser.add_argument("--out", default=None,
                        help="directory for kvbench-<gpu>-<date>.csv, -<figure>.png and .log (default: "
                             "./kvbench-results when the current directory is outside this "
                             "source tree, else a new temporary directory; printed at the end)")
    parser.add_argument("--compare", metavar="OLD.csv", default=None,
                        help="print each row's change in GB/s against an older run's CSV")
    parser.add_argument("--fail-on-regression", metavar="PCT", type=float, default=None,
                        help="with --compare: exit with status 3 when a row timed in both runs "
                             "lost more than PCT percent of its GB/s")
    args = parser.parse_args(argv)
    if args.fail_on_regression is not None and args.compare is None:
        parser.error("--fail-on-regression needs --compare OLD.csv")
    if args.fail_on_regression is not None and args.fail_on_regression < 0:
        parser.error("--fail-on-regression takes a percentage >= 0")
    if args.target_ms is not None and args.target_ms <= 0:
        parser.error("--target-ms must be positive")
    if args.quick:
        args.nt, args.nb = [16], [1, 8]
    if args.target_ms is None:
        args.target_ms = 20.0 if args.quick else 100.0
    args.apis = APIS if args.api == "all" else (args.api,)
    if args.device == "cpu" and cpu_apis(args.apis) != list(args.apis):
        parser.error("--device cpu times the list and paged groups only (--api list or paged)")
    return args


def rep_policy(args):
    target_s = args.target_ms / 1e3
    return RepPolicy(target_s, 3, 10 if args.quick else 200, CAP_TARGETS * target_s)


def batch_available():
    return hasattr(kvbm_ext, "is_memcpy_batch_available") and kvbm_ext.is_memcpy_batch_available()


def environment_line(gpu_name):
    info = kvbm_ext.build_info()
    return (f"gpu={gpu_name} torch={torch.__version__} kvbm_ext={info.get('version')} "
            f"({os.path.dirname(kvbm_ext.__file__)}) "
            f"cuda={info.get('cuda_version')} archs={','.join(info.get('cuda_archs') or [])} "
            f"stubs={kvbm_ext.is_using_stubs()} memcpy_batch={batch_available()} "
            f"torch_threads={torch.get_num_threads()}")


def resolve_device(args):
    """cuda or cpu; auto takes the CPU without a usable GPU when the groups asked for have a
    CPU section, else (like --device cuda) exits saying why there is no GPU."""
    if args.device == "cpu":
        return "cpu"
    why = why_no_gpu()
    if why is None:
        return "cuda"
    if args.device == "auto" and cpu_apis(args.apis) == list(args.apis):
        return "cpu"
    exit_no_gpu(f"kvbench --api {args.api} --device {args.device}", why)


def check_required(apis):
    missing = [name for api in apis for name in REQUIRED[api] if not hasattr(kvbm_ext, name)]
    if missing:
        sys.exit(f"kvbench: this kvbm_ext build has no {', '.join(dict.fromkeys(missing))}: "
                 "rebuild it, or use --api list")


def multiprocessors(device):
    return next(d["multiprocessors"] for d in kvbm_ext.cuda_devices()
                if d["index"] == device.index)


def cpu_apis(apis):
    return [api for api in apis if api in CPU_APIS]


def run_gpu_mode(ctx, args):
    check_required(args.apis)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    with torch.cuda.stream(torch.cuda.Stream(device)):
        cycles_per_us = calibrate_sleep_cycles_per_us()
        print(f"torch.cuda._sleep: {cycles_per_us:.0f} cycles/us", flush=True)
        ceilings = measure_ceilings(ctx, device, args.quick, cycles_per_us)
        rows += ceilings.values()
        gpu = Gpu(device, torch.cuda.current_stream(device), cycles_per_us, ceilings,
                  batch_available(), multiprocessors(device),
                  CTAS_NB if CTAS_NB in args.nb else max(args.nb))
        rows += run_gpu_cases(ctx, gpu, args)
    if cpu_apis(args.apis):
        rows += run_cpu_cases(ctx, cpu_apis(args.apis), args.cpu_nt, args.cpu_nb, args.layouts)
    return rows


def read_old(path):
    """The rows of --compare's CSV, read before the run so that a wrong path costs nothing."""
    try:
        return read_csv(path)
    except (OSError, ValueError) as error:
        print(f"kvbench: --compare {path}: {error}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    load_modules()
    old_rows = read_old(args.compare) if args.compare else None
    device = resolve_device(args)
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else "none"
    ctx = Context(gpu_name, datetime.date.today().isoformat(), rep_policy(args))
    folder = output_dir(args.out, "kvbench")
    stem = run_stem(folder, "kvbench", gpu_name if device == "cuda" else "cpu", ctx.date)
    with open(stem + ".log", "w") as log:
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
        try:
            status = run(args, device, ctx, stem, old_rows)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return status


def run(args, device, ctx, stem, old_rows):
    """The run itself, everything it prints going to the log too; returns the exit status."""
    print(environment_line(ctx.gpu_name), flush=True)
    if device == "cuda":
        rows = run_gpu_mode(ctx, args)
    else:
        check_required(args.apis)
        rows = run_cpu_cases(ctx, args.apis, args.cpu_nt, args.cpu_nb, args.layouts)
    annotate_backends(rows)
    annotate_paged(rows)
    goals = targets()
    apply_targets(rows, goals)

    write_csv(stem + ".csv", rows)
    print()
    print_summary(rows, goals)
    pngs, no_png = draw(rows, stem)
    status = 0
    if old_rows is not None:
        changes, only_new, only_old = compare(old_rows, rows)
        print_comparison(args.compare, changes, only_new, only_old, args.fail_on_regression)
        if args.fail_on_regression is not None:
            worse = regressions(changes, args.fail_on_regression)
            print(f"regressions beyond {args.fail_on_regression:g} %: {len(worse)} of {len(changes)} rows")
            status = EXIT_REGRESSION if worse else 0
    print()
    print(f"CSV: {stem}.csv")
    for png in pngs or [no_png]:
        print(f"PNG: {png}")
    print(f"log: {stem}.log")
    failed = [row for row in rows if row["status"] != VERIFIED]
    if failed:
        print(f"kvbench: {len(failed)} case(s) not verified", file=sys.stderr)
        return EXIT_NOT_VERIFIED
    return status


if __name__ == "__main__":
    sys.exit(main())
