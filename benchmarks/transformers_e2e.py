"""The transformers end-to-end part of engines.py (--transformers).

A model of Llama-3.1-8B's shape (hidden 4096, 32 query and 8 KV heads, head dim 128, FFN
14336, vocabulary 128256; random bf16 weights, nothing downloaded; --tf-layers of its 32
layers, as many as the run's time allows) generates greedily for --tf-prompts prompts with
transformers' continuous batching ("paged|sdpa" attention), four times:

  no_pressure           a GPU cache that holds every request at once
  soft_reset            a cache of --tf-pressure of that, no CPU offloading: evicted
                        requests are prefilled again
  transformers_offload  the same small cache with transformers' own CPU offloading
                        (cpu_offload_space=--tf-offload-gib)
  kvbm_offload          the same inside kvbm_ext.integrations.transformers.kvbm_offloading()

Per run: tokens/s (generated tokens over the generate_batch wall time less the offloading
manager's construction, which is reported apart: it allocates the pinned pool).  Per
offload and restore call of the two offloading runs: its GPU time, bytes and GB/s, next to
a pinned memcpy of the same bytes timed the same way, in the same run after it.  GPU time:
CUDA events on transformers' compute stream around the call, after a GPU sleep of
COVER_MS queued there, which keeps the GPU busy while the host prepares the call, so the
events bracket the call's GPU work and not the host's Python (a call whose host time
outran the sleep is marked "uncovered").  The sleeps add COVER_MS per call to both
offloading runs.  Checked: the two
offloading runs offload the same requests and blocks and generate identical tokens.
"""

import contextlib
import csv
import math
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

import kvbm_ext
from harness import calibrate_sleep_cycles_per_us, int_list
from report import csv_cells, fmt

MODES = ("no_pressure", "soft_reset", "transformers_offload", "kvbm_offload")
OFFLOADING = ("transformers_offload", "kvbm_offload")
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
PROMPT_SEED = 2026
MEMCPY_REPS = 5
COVER_MS = 10.0                  # GPU sleep before each timed call (see the docstring)
TARGET_CALL_PCT = 90.0           # each offload and restore call, % of a same-size pinned memcpy

COLUMNS = ["gpu_name", "date", "mode", "kind", "call", "requests", "blocks", "bytes", "gpu_ms", "gbps",
           "same_size_memcpy_gbps", "pct_same_size_memcpy", "tokens", "seconds", "tokens_per_s",
           "manager_seconds", "pool_seconds", "note"]


def add_arguments(parser):
    group = parser.add_argument_group("--transformers (the end-to-end part)")
    group.add_argument("--tf-layers", type=int, default=16, help="layers of Llama-3.1-8B's 32 (default 16)")
    group.add_argument("--tf-prompts", type=int, default=48, help="requests (default 48)")
    group.add_argument("--tf-prompt-tokens", type=int_list, default=[128, 384], metavar="MIN,MAX",
                       help="prompt lengths, drawn at random between (default 128,384)")
    group.add_argument("--tf-new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    group.add_argument("--tf-block-size", type=int, default=32, help="tokens per cache block (default 32)")
    group.add_argument("--tf-pressure", type=float, default=0.25,
                       help="the small cache's share of the blocks every request needs at once (default 0.25)")
    group.add_argument("--tf-offload-gib", type=float, default=4.0, help="cpu_offload_space in GiB (default 4)")
    group.add_argument("--tf-max-batch-tokens", type=int, default=2048, help="max_batch_tokens (default 2048)")
    group.add_argument("--tf-attn", default="paged|sdpa", help="attn_implementation (default paged|sdpa)")
    group.add_argument("--tf-rounds", type=int, default=2,
                       help="runs of each offloading mode, alternating; each keeps its fastest (default 2)")


# ----------------------------------------------------------------------------- the model and the workload

def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=args.tf_layers, attn_implementation=args.tf_attn, **LLAMA_8B)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)          # made in bf16 on the GPU: no fp32 copy of 8B weights
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.to(torch.bfloat16).eval()


def make_prompts(args):
    rng = random.Random(PROMPT_SEED)
    shortest, longest = args.tf_prompt_tokens[0], args.tf_prompt_tokens[-1]
    return [[rng.randrange(LLAMA_8B["vocab_size"]) for _ in range(rng.randint(shortest, longest))]
            for _ in range(args.tf_prompts)]


def blocks_of(args, prompt):
    return math.ceil((len(prompt) + args.tf_new_tokens) / args.tf_block_size)


def cache_config(args, mode, prompts):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    every_request = sum(blocks_of(args, prompt) for prompt in prompts)
    largest = max(blocks_of(args, prompt) for prompt in prompts)
    small = max(int(args.tf_pressure * every_request), 2 * largest)
    return ContinuousBatchingConfig(block_size=args.tf_block_size,
                                    num_blocks=2 * every_request if mode == "no_pressure" else small,
                                    max_batch_tokens=args.tf_max_batch_tokens,
                                    cpu_offload_space=args.tf_offload_gib if mode in OFFLOADING else 0.0)


def generate(model, args, prompts, config):
    from transformers import GenerationConfig
    generation = GenerationConfig(max_new_tokens=args.tf_new_tokens, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
    outputs = list(model.generate_batch(prompts, generation_config=generation,
                                        continuous_batching_config=config).values())
    failed = [output.error for output in outputs if output.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise SystemExit(f"engines --transformers: {len(prompts) - len(outputs) + len(failed)} requests failed "
                         f"({failed[:1]})")
    return [list(output.generated_tokens) for output in outputs]


# ----------------------------------------------------------------------------- timing the manager

@dataclass
class Call:
    kind: str            # "offload" or "restore"
    requests: int
    blocks: int
    start: object        # CUDA events on transformers' compute stream
    end: object
    covered: bool        # the host prepared the call within the sleep before it


def recorded_event(stream):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class Cover:
    """A GPU sleep of `ms` queued on a stream before a start event: while it lasts the host
    prepares the timed work, so the events bracket the GPU work alone."""

    def __init__(self, ms):
        self.ms, self.cycles = ms, int(ms * 1e3 * calibrate_sleep_cycles_per_us())

    def start(self, stream):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.cycles)
        return recorded_event(stream), time.perf_counter()

    def covered(self, queued_at):
        return (time.perf_counter() - queued_at) * 1e3 < self.ms


class Recorder:
    """While entered, wraps `cls`'s construction (timed on the host) and its offload and
    restore calls (CUDA events on the compute stream around each call)."""

    def __init__(self, cls, cover):
        self.cls, self.cover, self.calls, self.construction_s = cls, cover, [], 0.0
        self.originals = {name: cls.__dict__[name] for name in ("__init__", "_offload_to_cpu",
                                                                "restore_scheduled_requests")}

    def __enter__(self):
        originals = self.originals

        def init(manager, *args, **kwargs):
            started = time.perf_counter()
            originals["__init__"](manager, *args, **kwargs)
            self.construction_s += time.perf_counter() - started

        def offload(manager, victims):
            start, queued_at = self.cover.start(manager._compute_stream)
            offloaded = originals["_offload_to_cpu"](manager, victims)
            end = recorded_event(manager._compute_stream)
            if offloaded:
                blocks = sum(len(manager._request_id_to_cpu_blocks[r]) for r in offloaded)
                self.calls.append(Call("offload", len(offloaded), blocks, start, end, self.cover.covered(queued_at)))
            return offloaded

        def restore(manager, batch):
            restored = [f.state.request_id for f in batch if f.state.is_cpu_offloaded]
            blocks = sum(len(manager._request_id_to_cpu_blocks[r]) for r in restored)
            start, queued_at = self.cover.start(manager._compute_stream)
            originals["restore_scheduled_requests"](manager, batch)
            end = recorded_event(manager._compute_stream)
            if restored:
                self.calls.append(Call("restore", len(restored), blocks, start, end, self.cover.covered(queued_at)))

        for name, wrapper in (("__init__", init), ("_offload_to_cpu", offload),
                              ("restore_scheduled_requests", restore)):
            setattr(self.cls, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(self.cls, name, original)
        return False


@dataclass
class ModeResult:
    mode: str
    tokens: list
    seconds: float
    recorder: Recorder
    pool_seconds: object = ""


def run_mode(model, args, mode, prompts, cover):
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    from kvbm_ext.integrations.transformers import KvbmOffloadingManager, kvbm_offloading
    cls = KvbmOffloadingManager if mode == "kvbm_offload" else OffloadingManager
    config = cache_config(args, mode, prompts)
    print(f"{mode}: num_blocks={config.num_blocks} block_size={config.block_size} "
          f"cpu_offload_space={config.cpu_offload_space} GiB", flush=True)
    with Recorder(cls, cover) as recorder, (kvbm_offloading() if mode == "kvbm_offload" else contextlib.nullcontext()) as kv:
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = generate(model, args, prompts, config)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    result = ModeResult(mode, tokens, seconds, recorder)
    if kv is not None and kv.managers:
        result.pool_seconds = kv.managers[0].pool_seconds
    return result


# ----------------------------------------------------------------------------- the same-size memcpys

class SameSize:
    """Pinned memcpys of a call's bytes, each size and way measured once (median of MEMCPY_REPS)."""

    def __init__(self, largest_bytes, cover):
        self.cover = cover
        self.device = torch.empty(largest_bytes, dtype=torch.uint8, device="cuda")
        self.pinned = torch.from_dlpack(kvbm_ext.pinned_empty((largest_bytes,), np.uint8))
        self.stream = torch.cuda.Stream()
        self.rates = {}

    def gbps(self, kind, nbytes):
        if (kind, nbytes) not in self.rates:
            dst, src = (self.pinned, self.device) if kind == "offload" else (self.device, self.pinned)
            samples = []
            with torch.cuda.stream(self.stream):
                for _ in range(MEMCPY_REPS + 1):
                    start, _ = self.cover.start(self.stream)
                    dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
                    end = recorded_event(self.stream)
                    end.synchronize()
                    samples.append(start.elapsed_time(end))
            self.rates[kind, nbytes] = nbytes / (statistics.median(samples[1:]) * 1e6)
        return self.rates[kind, nbytes]


# ----------------------------------------------------------------------------- rows, checks, targets

def block_bytes(args):
    return 2 * args.tf_layers * args.tf_block_size * LLAMA_8B["num_key_value_heads"] * LLAMA_8B["head_dim"] * 2


def call_rows(args, result, same_size, add):
    per_block = block_bytes(args)
    for index, call in enumerate(result.recorder.calls):
        ms = call.start.elapsed_time(call.end)
        nbytes = call.blocks * per_block
        rate, memcpy = nbytes / (ms * 1e6), same_size.gbps(call.kind, nbytes)
        add(mode=result.mode, kind=call.kind, call=index, requests=call.requests, blocks=call.blocks,
            bytes=nbytes, gpu_ms=ms, gbps=rate, same_size_memcpy_gbps=memcpy, pct_same_size_memcpy=100 * rate / memcpy,
            note="" if call.covered else "uncovered")


def generating_seconds(result):
    return result.seconds - result.recorder.construction_s


def mode_row(result, add, runs):
    generated = sum(len(tokens) for tokens in result.tokens)
    offloads = [c for c in result.recorder.calls if c.kind == "offload"]
    note = "runs: " + ", ".join(f"{generated / generating_seconds(r):.1f}" for r in runs) + " tok/s" \
        if len(runs) > 1 else ""
    add(mode=result.mode, kind="run", requests=sum(c.requests for c in offloads),
        blocks=sum(c.blocks for c in offloads), tokens=generated, seconds=result.seconds,
        tokens_per_s=generated / generating_seconds(result), manager_seconds=result.recorder.construction_s,
        pool_seconds=result.pool_seconds, note=note)


def call_target_lines(rows, mode, name):
    lines = []
    for kind in ("offload", "restore"):
        mine = [row for row in rows if row["mode"] == mode and row["kind"] == kind]
        pcts = [row["pct_same_size_memcpy"] for row in mine]
        uncovered = sum(row["note"] == "uncovered" for row in mine)
        if not pcts:
            lines.append(f"MISS  {name} {kind} calls: none were made (no cache pressure?)")
            continue
        passed = sum(p >= TARGET_CALL_PCT for p in pcts)
        verdict = "PASS" if passed == len(pcts) else "MISS"
        lines.append(f"{verdict}  {name} {kind} calls: {passed} of {len(pcts)} at >= {TARGET_CALL_PCT:.0f} % of a "
                     f"same-size pinned memcpy (median {fmt(statistics.median(pcts))} %, min {fmt(min(pcts))} %"
                     f"{f', {uncovered} uncovered' if uncovered else ''})")
    return lines


def target_lines(rows, results):
    runs = {row["mode"]: row for row in rows if row["kind"] == "run"}
    own, ours, free = runs["transformers_offload"], runs["kvbm_offload"], runs["no_pressure"]
    same = [(c.kind, c.requests, c.blocks) for c in results["transformers_offload"].recorder.calls] == \
           [(c.kind, c.requests, c.blocks) for c in results["kvbm_offload"].recorder.calls]
    identical = results["transformers_offload"].tokens == results["kvbm_offload"].tokens
    lines = call_target_lines(rows, "kvbm_offload", "kvbm_ext")
    lines.append(f"{'PASS' if ours['tokens_per_s'] >= own['tokens_per_s'] else 'MISS'}  tokens/s under pressure: "
                 f"kvbm_ext {fmt(ours['tokens_per_s'])} against transformers' own offloading "
                 f"{fmt(own['tokens_per_s'])} (no pressure: {fmt(free['tokens_per_s'])}, kvbm_ext "
                 f"{fmt(100 * (ours['tokens_per_s'] / free['tokens_per_s'] - 1))} % from it)")
    lines.append(f"{'PASS' if identical else 'MISS'}  token ids identical to transformers' own offloading "
                 f"({len(results['kvbm_offload'].tokens)} requests)")
    lines.append(f"{'PASS' if same else 'MISS'}  the same offload and restore calls as transformers' own "
                 f"({len(results['kvbm_offload'].recorder.calls)} calls, {ours['requests']} requests offloaded)")
    return lines


def print_summary(rows):
    print(f"\n{'mode':22s}{'tokens/s':>10s}{'s':>8s}{'offloaded':>10s}{'blocks':>8s}{'manager s':>10s}"
          f"{'pool s':>8s}")
    for row in (r for r in rows if r["kind"] == "run"):
        print(f"{row['mode']:22s}{fmt(row['tokens_per_s']):>10s}{fmt(row['seconds']):>8s}{row['requests']:>10}"
              f"{row['blocks']:>8}{fmt(row['manager_seconds'], 3):>10s}{fmt(row['pool_seconds'], 3):>8s}"
              f"  {row['note']}".rstrip())
    print(f"\n{'calls':32s}{'n':>5s}{'GPU ms':>9s}{'GB/s':>8s}{'memcpy GB/s':>12s}{'median %':>10s}{'min %':>8s}")
    for mode in OFFLOADING:
        for kind in ("offload", "restore"):
            mine = [r for r in rows if r["mode"] == mode and r["kind"] == kind]
            if mine:
                ms, nbytes = sum(r["gpu_ms"] for r in mine), sum(r["bytes"] for r in mine)
                memcpy_ms = sum(r["bytes"] / (r["same_size_memcpy_gbps"] * 1e6) for r in mine)
                pcts = [r["pct_same_size_memcpy"] for r in mine]
                print(f"{mode + ' ' + kind:32s}{len(mine):>5d}{fmt(ms, 2):>9s}{fmt(nbytes / (ms * 1e6)):>8s}"
                      f"{fmt(nbytes / (memcpy_ms * 1e6)):>12s}{fmt(statistics.median(pcts)):>10s}"
                      f"{fmt(min(pcts)):>8s}")


# ----------------------------------------------------------------------------- the part

def run(args, gpu_name, date, stem):
    import transformers
    started = time.perf_counter()
    model = build_model(args)
    prompts = make_prompts(args)
    print(f"transformers {transformers.__version__}; model of Llama-3.1-8B's shape, {args.tf_layers} layers, built "
          f"in {time.perf_counter() - started:.1f} s; {len(prompts)} prompts, {args.tf_new_tokens} new tokens each",
          flush=True)
    generate(model, args, prompts[:2], cache_config(args, "no_pressure", prompts))     # warm-up
    cover = Cover(COVER_MS)
    # A run's host time varies by seconds from one run of a mode to the next, far more than
    # its offloads take: the offloading modes run --tf-rounds times, alternating, and each
    # keeps its fastest run.
    runs = {mode: [] for mode in MODES}
    for round_ in range(max(1, args.tf_rounds)):
        for mode in MODES if round_ == 0 else OFFLOADING:
            result = run_mode(model, args, mode, prompts, cover)
            runs[mode].append(result)
            print(f"{mode}: {result.seconds:.1f} s, {len(result.recorder.calls)} offload/restore calls", flush=True)
    results = {mode: min(mine, key=generating_seconds) for mode, mine in runs.items()}
    largest = max((c.blocks for r in results.values() for c in r.recorder.calls), default=1) * block_bytes(args)
    same_size = SameSize(largest, cover)
    rows = []
    with open(stem + ".csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()

        def add(**fields):
            row = {column: "" for column in COLUMNS}
            row.update(gpu_name=gpu_name, date=date, **fields)
            rows.append(row)
            writer.writerow(csv_cells(row))

        for mode in MODES:
            mode_row(results[mode], add, runs[mode])
            call_rows(args, results[mode], same_size, add)
    print_summary(rows)
    lines = target_lines(rows, results)
    if any(r.tokens != mine[0].tokens for mine in runs.values() for r in mine):
        lines.append("MISS  token ids identical across the runs of each mode")
    print("\ntargets:")
    for line in lines:
        print("  " + line)
