"""The Resharder's error contract, and the planner's own arguments.

In process (no group): EngineLayout and plan_reshard take any __index__ integer (NumPy's
included), check every range, bound sizes before building anything proportional to them
(a child runs those, so that a size that never returns fails instead of hanging), and
raise TypeError or ValueError naming the argument, never OverflowError,
ZeroDivisionError or MemoryError. A Resharder over a one-rank stand-in transport checks a
call's own arguments (check, timeout, ids whose __index__ raises, destinations that
cannot be written) with nothing written, and refuses a second concurrent call.

With gloo (two spawned processes, one group, every case bounded by the call's timeout and
the whole run by a hard deadline, none reached): each failure that used to leave the other
rank waiting in the process group's 30-minute timeout is the same error on both ranks,
naming the rank and the argument, with nothing written: `check=1` on one rank, a block id
whose __index__ raises, a construction that fails on one rank, a destination whose layers
require grad, are read-only or share memory (PP 2 -> 1, found before any message); and
`check=False` on one rank only ends in a TimeoutError on both ranks within the timeout.
"""

import datetime
import json
import os
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kvbm_ext
from kvbm_ext import EngineLayout, Resharder, plan_reshard
from support.ranks import run_case
from kvbm_ext._driver import Handle

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Boom:
    def __index__(self):
        raise ZeroDivisionError("boom from __index__")


def L(tp, pp=1, ranks=None, layer_ranges=None):
    return EngineLayout(tp, pp, ranks=ranks, layer_ranges=layer_ranges)


# --------------------------------------------------------------------------
# The planner's arguments.
# --------------------------------------------------------------------------

# Calls that used to build something proportional to a huge size, never return, or raise
# OverflowError / ZeroDivisionError: each must raise the named type at once.
SIZES = {
    "EngineLayout(2**40)": ("L(2**40)", "ValueError", "tp_size: must be at most 65536"),
    "EngineLayout(2, 2**40)": ("L(2, 2**40)", "ValueError", "pp_size: must be at most 65536"),
    "EngineLayout(300, 300)": ("L(300, 300)", "ValueError", "a layout has at most 65536 positions"),
    "ranks=range(2**64)": ("L(1, ranks=range(2**64))", "ValueError", "ranks: its length cannot be read"),
    "plan_reshard(2**40, ...)": ("plan_reshard(2**40, 4, L(1), L(2))", "ValueError",
                                 "num_heads: must be at most 65536"),
    "plan_reshard(.., 2**40, ..)": ("plan_reshard(8, 2**40, L(1), L(2))", "ValueError",
                                    "num_layers: must be at most 2147483647"),
    "planning steps": ("plan_reshard(65536, 8192, L(1, 4096), L(1, 4096))", "ValueError",
                       "planning would take 536870912 steps"),
    "layer_ranges=[(0, 2**64)]": ("L(1, layer_ranges=[(0, 2**64)])", "ValueError",
                                  r"layer_ranges[0][1]: must be at most 2147483647"),
    "layer_ranges=[range(0, 2**64)]": ("L(1, layer_ranges=[range(0, 2**64)])", "ValueError",
                                       "layer_ranges[0].stop: must be at most"),
    "heads_of(0, 0)": ("L(2).heads_of(0, 0)", "ValueError", "num_heads: must be at least 1"),
    "tp_ranks_holding(0, 0)": ("L(2).tp_ranks_holding(0, 0)", "ValueError", "num_heads: must be at least 1"),
}


def run_sizes():
    """In a child: each SIZES call, its outcome and time."""
    out = {}
    for name, (code, _, _) in SIZES.items():
        start = time.perf_counter()
        try:
            eval(code)
            outcome = ["returned", ""]
        except Exception as error:  # noqa: BLE001 - the type is the outcome
            outcome = [type(error).__name__, str(error)]
        out[name] = outcome + [time.perf_counter() - start]
    print("RESULT " + json.dumps(out))


def test_huge_sizes_are_refused_at_once():
    code = f"import sys; sys.path[:0] = [{HERE!r}, {ROOT!r}]\nimport test_reshard_contract as t\nt.run_sizes()\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    outcomes = json.loads(lines[0][len("RESULT "):])
    for name, (_, kind, words) in SIZES.items():
        got_kind, message, seconds = outcomes[name]
        assert (got_kind, words in message) == (kind, True), (name, got_kind, message)
        assert seconds < 1.0, (name, seconds)


@pytest.mark.parametrize("call, error, match", [
    (lambda: L(2).heads_of(2, 8), ValueError, "tp_rank: must be at most 1, got 2"),
    (lambda: L(2).heads_of(-1, 8), ValueError, "tp_rank: must be at least 0, got -1"),
    (lambda: L(2).tp_ranks_holding(8, 8), ValueError, "head: must be at most 7"),
    (lambda: L(1, 2).layers_of(2, 8), ValueError, "pp_stage: must be at most 1"),
    (lambda: L(2, 2).rank_of(0, 2), ValueError, "tp_rank: must be at most 1"),
    (lambda: L(2, 2).rank_of(2, 0), ValueError, "pp_stage: must be at most 1"),
    (lambda: L(2).position_of("0"), TypeError, "rank: expected an int, got str"),
    (lambda: L(2).heads_of(0, 8.0), TypeError, "num_heads: expected an int, got float"),
    (lambda: L(Boom()), TypeError, "tp_size: expected an int, got Boom, whose __index__ failed"),
    (lambda: L(2, ranks=[0, Boom()]), TypeError, r"ranks\[1\]: expected an int, got Boom"),
    (lambda: L(1, 2, layer_ranges=[(0, Boom()), (2, 4)]), TypeError, r"layer_ranges\[0\]\[1\]: expected an int"),
    (lambda: L(1, layer_ranges=[range(0, 8, 2)]), ValueError, r"layer_ranges\[0\]: expected a non-empty range of step"),
    (lambda: L(1, layer_ranges=[(3, 3)]), ValueError, r"layer_ranges\[0\]: expected a non-empty range"),
    (lambda: plan_reshard(Boom(), 4, L(1), L(1)), TypeError, "num_heads: expected an int, got Boom"),
    (lambda: plan_reshard(8, True, L(1), L(1)), TypeError, "num_layers: expected an int, got bool"),
    (lambda: L(2, ranks=[2**31, 0]), ValueError, r"ranks\[0\]: must be at most 2147483647"),
], ids=lambda v: None)
def test_layout_arguments_are_checked(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    if "__index__ failed" in match:
        assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_numpy_integers_are_taken_everywhere():
    i64 = np.int64
    layout = L(i64(2), i64(2), ranks=[i64(3), i64(1), np.int32(0), np.uint8(2)],
               layer_ranges=[(i64(0), i64(3)), range(3, 8)])
    assert layout == L(2, 2, ranks=[3, 1, 0, 2], layer_ranges=[(0, 3), (3, 8)])
    assert all(type(v) is int for v in (layout.tp_size, layout.pp_size, *layout.ranks))
    assert layout.heads_of(i64(1), i64(8)) == range(4, 8) and layout.layers_of(i64(1), i64(8)) == range(3, 8)
    assert layout.rank_of(i64(1), i64(0)) == 0 and layout.position_of(i64(2)) == (1, 1)
    assert layout.tp_ranks_holding(i64(5), i64(8)) == range(1, 2)
    assert plan_reshard(i64(8), i64(8), layout, L(i64(4))) == plan_reshard(8, 8, L(2, 2, ranks=[3, 1, 0, 2],
                                                                              layer_ranges=[(0, 3), (3, 8)]), L(4))


def test_plans_are_unchanged_by_the_stage_merge():
    """The planner finds a destination stage's source stages by walking both stage lists
    once: the plan is the one the exhaustive loop gives (order included)."""
    def exhaustive(h, n, src, dst):
        out = []
        for d_stage in range(dst.pp_size):
            for d_tp in range(dst.tp_size):
                for t in plan_reshard(h, n, src, dst):
                    if t.dst_rank == dst.rank_of(d_stage, d_tp) and t not in out:
                        out.append(t)
        return out
    for h, n, src, dst in [(8, 12, L(2, 3), L(1, 4)), (4, 9, L(1, 3, layer_ranges=[(0, 1), (1, 8), (8, 9)]),
                                                              L(2, 2, layer_ranges=[(0, 5), (5, 9)])),
                           (2, 6, L(4, 2), L(8, 3, ranks=range(8, 32)))]:
        plan = plan_reshard(h, n, src, dst)
        assert list(plan) == exhaustive(h, n, src, dst)
        cells = sorted((t.dst_rank, hh, ll) for t in plan for hh in t.heads for ll in t.layers)
        assert len(cells) == len(set(cells)) == sum(len(dst.heads_of(tp, h)) * len(dst.layers_of(s, n))
                                                    for s in range(dst.pp_size) for tp in range(dst.tp_size))


# --------------------------------------------------------------------------
# One rank: a call's own arguments, and concurrent calls.
# --------------------------------------------------------------------------


class OneRank:
    """A Transport of one rank; its all_gather_object can be held at a gate."""

    rank, world_size = 0, 1

    def __init__(self):
        self.gate = None
        self.entered = threading.Event()

    def all_gather_object(self, obj, timeout):
        if self.gate is not None:
            self.entered.set()
            assert self.gate.wait(timeout)
        return [obj]

    def exchange(self, call, background):
        assert not call.sends and not call.recvs and call.headers is None
        call.allow_writes(call.stream)      # the local copy
        handle = Handle("one rank")
        handle.finish()
        return handle


NH, NL, NO, NT, HD, NB = 2, 3, 2, 4, 8, 6


def local_case(seed, dst_layers=None):
    """tp1 -> tp1 on rank 0 (a local copy): a source cache, a destination cache, ids."""
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    dst = dst_layers if dst_layers is not None else [
        torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    return src, dst, kvbm_ext.PagedKVCache(src, "kbthd"), kvbm_ext.PagedKVCache(dst, "kbthd")


def snapshot(layers):
    """Copies of the layers (torch tensors or NumPy arrays) as torch tensors."""
    return [torch.from_numpy(np.array(np.asarray(layer.detach() if isinstance(layer, torch.Tensor) else layer)))
            for layer in layers]


def unchanged(layers, before):
    return all(torch.equal(after.view(torch.int32), b.view(torch.int32)) for after, b in zip(snapshot(layers), before))


def test_one_rank_call_arguments_raise_and_write_nothing():
    resharder = Resharder(NH, NL, L(1), L(1), transport=OneRank())
    src, dst, src_cache, dst_cache = local_case(1)
    before = snapshot(dst)
    ids = [4, 1]
    cases = [
        (dict(check=1), TypeError, "rank 0: check: expected a bool, got int"),
        (dict(check=None), TypeError, "check: expected a bool"),
        (dict(timeout=0), ValueError, "rank 0: timeout: expected a finite number of seconds above 0"),
        (dict(timeout=float("nan")), ValueError, "timeout"),
        (dict(timeout="5"), TypeError, "timeout: expected seconds"),
        (dict(dst_ids=[4, Boom()]), TypeError, r"dst_block_ids\[1\] on rank 0: expected an int, got Boom, whose "
                                               r"__index__ failed \(ZeroDivisionError"),
        (dict(src_ids=[np.int64(4), 2**70]), ValueError, r"src_block_ids\[1\] on rank 0: block id \d+ is out of range"),
    ]
    for keywords, error, match in cases:
        src_ids, dst_ids = keywords.pop("src_ids", ids), keywords.pop("dst_ids", ids)
        for check in ((True, False) if "check" not in keywords else (keywords.pop("check"),)):
            with pytest.raises(error, match=match):
                resharder(src_cache, src_ids, dst_cache, dst_ids, check=check, **keywords)
            assert unchanged(dst, before), keywords
    resharder(src_cache, [np.int64(4), np.int32(1)], dst_cache, ids)
    assert all(torch.equal(d[:, ids], s[:, [4, 1]]) for d, s in zip(dst, src))


@pytest.mark.parametrize("how", ["requires grad", "read-only", "shared memory"])
def test_one_rank_destination_that_cannot_be_written(how):
    gen = torch.Generator().manual_seed(zlib.crc32(how.encode()))
    layers = [torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    if how == "requires grad":
        layers[2].requires_grad_(True)
        match = r"dst_cache on rank 0: layers\[2\]: destination tensor requires grad"
    elif how == "read-only":
        layers = [layer.numpy() for layer in layers]
        layers[1].flags.writeable = False
        match = "dst_cache on rank 0: layers: the cache is read-only"
    else:
        layers[1] = layers[0]
        match = "dst_cache on rank 0: layers: cache layers 0 and 1 share memory"
    src, dst, src_cache, dst_cache = local_case(2, dst_layers=layers)
    before = snapshot(dst)
    resharder = Resharder(NH, NL, L(1), L(1), transport=OneRank())
    for check in (True, False):
        with pytest.raises(ValueError, match=match):
            resharder(src_cache, [0, 3], dst_cache, [5, 2], check=check)
        assert unchanged(dst, before)


def test_a_second_concurrent_call_is_refused():
    transport = OneRank()
    resharder = Resharder(NH, NL, L(1), L(1), transport=transport)
    src, dst, src_cache, dst_cache = local_case(3)
    transport.gate = threading.Event()
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("stats", resharder(src_cache, [1, 2], dst_cache,
                                                                                  [3, 4])))
    thread.start()
    assert transport.entered.wait(30)
    with pytest.raises(RuntimeError, match="rank 0: this Resharder is in a call on another thread"):
        resharder(src_cache, [0], dst_cache, [0])
    transport.gate.set()
    thread.join(30)
    assert not thread.is_alive() and first["stats"].local_copies == 1
    assert all(torch.equal(d[:, [3, 4]], s[:, [1, 2]]) for d, s in zip(dst, src))
    transport.gate = None
    resharder(src_cache, [0], dst_cache, [0])       # the lock was released


def test_construction_errors_on_one_rank_name_it():
    with pytest.raises(ValueError, match="rank 0: src: tp_size 2 and 3 KV heads"):
        Resharder(3, 4, L(2), L(1), transport=OneRank())
    with pytest.raises(ValueError, match="rank 0: src: rank 1 is not in the group"):
        Resharder(2, 4, L(2), L(1), transport=OneRank())
    with pytest.raises(TypeError, match="rank 0: timeout"):
        Resharder(2, 4, L(1), L(1), transport=OneRank(), timeout=None)


# --------------------------------------------------------------------------
# Two ranks over gloo.
# --------------------------------------------------------------------------

# PP 2 -> 1: rank 0 holds source stage 0 (layers 0-1), rank 1 source stage 1 (layers 2-3)
# and the whole destination: layers 0-1 arrive in a message, 2-3 are a local copy.
CASE = dict(num_heads=2, num_layers=4, src=L(1, 2), dst=L(1, ranks=[1]))
GNB = 5
CALL_TIMEOUT = 4.0
HARD_DEADLINE = 240


def _layers(gen, count, nb):
    return [torch.randint(-9999, 9999, (2, nb, 4, 2, 8), generator=gen).to(torch.float32) for _ in range(count)]


def _gloo_setup(rank, name, dst_kind="tensor"):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    src_model, dst_model = _layers(gen, 4, 8), _layers(gen, 4, 8)
    stage = range(0, 2) if rank == 0 else range(2, 4)
    src_cache = kvbm_ext.PagedKVCache([src_model[l].clone() for l in stage], "kbthd")
    dst, dst_cache = None, None
    if rank == 1:
        dst = [t.clone() for t in dst_model]
        if dst_kind == "requires grad":
            dst[0].requires_grad_(True)       # a layer the message would write
        elif dst_kind == "read-only":
            dst = [t.numpy() for t in dst]
            dst[3].flags.writeable = False
        elif dst_kind == "shared memory":
            dst[1] = dst[0]
            dst_model[1] = dst_model[0]
        dst_cache = kvbm_ext.PagedKVCache(dst, "kbthd")
    ids = torch.randperm(8, generator=gen)[:GNB].tolist(), torch.randperm(8, generator=gen)[:GNB].tolist()
    return src_model, dst_model, src_cache, dst, dst_cache, ids


def _dst_intact(dst, dst_model):
    if dst is None:
        return True
    return all(torch.equal(after, b) for after, b in zip(snapshot(dst), dst_model))


def _gloo_case(rank, name):
    """One case on this rank: {"error": [type, message] or None, "dst_ok": bool}."""
    dst_kind = name if name in ("requires grad", "read-only", "shared memory") else "tensor"
    src_model, dst_model, src_cache, dst, dst_cache, (src_ids, dst_ids) = _gloo_setup(rank, name, dst_kind)
    kwargs = {"timeout": CALL_TIMEOUT}
    num_heads = CASE["num_heads"]
    if rank == 1 and name == "check=1":
        kwargs["check"] = 1
    if rank == 1 and name == "raising __index__":
        dst_ids = dst_ids[:3] + [Boom()] + dst_ids[4:]
    if rank == 1 and name == "check=False on one rank":
        kwargs["check"] = False
    num_layers = CASE["num_layers"]
    if rank == 1 and name == "construction fails":
        num_layers = 1
    if rank == 1 and name == "construction __index__":
        num_heads = Boom()
    error = None
    try:
        resharder = Resharder(num_heads, num_layers, CASE["src"], CASE["dst"], timeout=CALL_TIMEOUT)
        resharder(src_cache, src_ids, dst_cache, dst_ids if rank == 1 else None, **kwargs)
    except Exception as caught:  # noqa: BLE001 - the type is the outcome
        error = [type(caught).__name__, str(caught)]
    ok = _dst_intact(dst, dst_model)
    if name == "moves" and rank == 1:
        expected = [t.clone() for t in dst_model]
        for l in range(4):
            expected[l][:, dst_ids] = src_model[l][:, src_ids]
        ok = _dst_intact(dst, expected)
    return {"error": error, "dst_ok": ok}


# name: (error type on both ranks, part of the message), or None for success. Run in this
# order; the timeout case last (it leaves the group unusable).
GLOO_CASES = {
    "check=1": ("TypeError", "rank 1: check: expected a bool, got int"),
    "raising __index__": ("TypeError", r"dst_block_ids[3] on rank 1: expected an int, got Boom, whose __index__ "
                                       "failed (ZeroDivisionError: boom from __index__)"),
    "construction fails": ("ValueError", "rank 1: src: num_layers 1 is smaller than pp_size 2"),
    "construction __index__": ("TypeError", "rank 1: num_heads: expected an int, got Boom"),
    "requires grad": ("ValueError", "dst_cache on rank 1: layers[0]: destination tensor requires grad"),
    "read-only": ("ValueError", "dst_cache on rank 1: layers: the cache is read-only"),
    "shared memory": ("ValueError", "dst_cache on rank 1: layers: cache layers 0 and 1 share memory"),
    "moves": None,
    "check=False on one rank": ("TimeoutError", "did not complete the"),
}


def _gloo_worker(rank, store_path, out_dir):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in GLOO_CASES:
        run_case(results, name, lambda: _gloo_case(rank, name), os.path.join(out_dir, f"rank{rank}.json"))
        if name != "check=False on one rank":
            dist.barrier()
    # The group has operations pending that no peer will complete (the timeout case):
    # leave without running its destructors.
    os._exit(0)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("contract")
    context = mp.start_processes(_gloo_worker, args=(str(out / "store"), str(out)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + HARD_DEADLINE
    reached = False
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            reached = True
            for process in context.processes:
                process.kill()
            break
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else {}
                for r in range(2)]
    return reached, per_rank


@pytest.mark.parametrize("name", GLOO_CASES)
def test_gloo_failure_is_the_same_error_on_every_rank(gloo_results, name):
    reached, per_rank = gloo_results
    assert not reached, f"the gloo processes reached their {HARD_DEADLINE} s bound; results so far: {per_rank}"
    results = [ranks.get(name) for ranks in per_rank]
    assert all(r is not None for r in results), f"a rank did not report {name}: {per_rank}"
    assert all(r["ok"] for r in results), "\n".join(r.get("traceback", "") for r in results)
    assert all(r["seconds"] < CALL_TIMEOUT + 20 for r in results), [r["seconds"] for r in results]
    expected = GLOO_CASES[name]
    if expected is None:
        assert [r["error"] for r in results] == [None, None]
        assert all(r["dst_ok"] for r in results), "wrong bytes moved"
        return
    kind, words = expected
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} returned without an error"
        assert result["error"][0] == kind and words in result["error"][1], (rank, result["error"])
        assert result["dst_ok"], f"rank {rank}'s destination was written"
    if kind != "TimeoutError":
        assert results[0]["error"] == results[1]["error"], "the ranks raised different errors"
    else:
        assert all(r["seconds"] >= CALL_TIMEOUT * 0.9 for r in results), [r["seconds"] for r in results]
