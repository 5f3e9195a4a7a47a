"""kvbm_ext.Resharder: KV blocks between engines of different TP / PP sizes.

The planner is tested in process.  The transfers run in groups of processes spawned
here: on the CPU over gloo (every case, in one group of WORLD processes), and on two
GPUs over NCCL (the cases that fit on two GPUs).  Each case builds the whole model's
cache from a seed, gives every source rank its slice, poisons every destination with
other random bits, moves blocks twice, and compares every destination bit for bit
with the reference: the whole destination model with the moved blocks replaced,
every other block keeping its poison.  Child processes report per case; a failure
is shown with the child's traceback.
"""

import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kvbm_ext
from kvbm_ext import EngineLayout, Resharder, plan_reshard
from support import REPO_ROOT
from support.devices import missing_gpus

LOGICAL = "kbthd"       # a per-layer cache's logical order: K/V, block, token, head, head dim


# --------------------------------------------------------------------------
# The planner, in process.
# --------------------------------------------------------------------------

def L(tp, pp=1, ranks=None, layer_ranges=None):
    return EngineLayout(tp, pp, ranks=ranks, layer_ranges=layer_ranges)


PLANS = {
    # name: (num_heads, num_layers, src, dst, messages, local copies), counted by hand
    "tp1->tp2": (8, 4, L(1), L(2), 1, 1),
    "tp2->tp1": (8, 4, L(2), L(1), 1, 1),
    "tp2->tp4": (8, 4, L(2), L(4), 3, 1),
    "tp4->tp2 apart": (8, 4, L(4), L(2, ranks=[4, 5]), 4, 0),
    "tp8->tp1 gqa": (2, 4, L(8), L(1, ranks=[8]), 2, 0),
    "tp4->tp4 replicas": (2, 4, L(4), L(4, ranks=[7, 6, 5, 4]), 4, 0),
    "mla tp2->tp4": (1, 4, L(2), L(4), 2, 2),
    "mla tp4->tp1": (1, 4, L(4), L(1, ranks=[2]), 0, 1),
    "pp2->pp1": (8, 6, L(1, 2), L(1, ranks=[2]), 2, 0),
    "pp1->pp3": (8, 6, L(1), L(1, 3), 2, 1),
    "tp2pp2->tp4": (4, 4, L(2, 2), L(4), 6, 2),
    "tp2pp2->tp1pp2 uneven": (4, 4, L(2, 2), L(1, 2, ranks=[1, 2], layer_ranges=[(0, 1), range(1, 4)]), 4, 2),
    "tp1pp4->tp4pp1": (8, 8, L(1, 4), L(4), 12, 4),
}


@pytest.mark.parametrize("name", PLANS)
def test_plan_covers_every_destination_cell_once(name):
    heads, layers, src, dst, messages, local = PLANS[name]
    plan = plan_reshard(heads, layers, src, dst)
    assert sum(not t.is_local for t in plan) == messages
    assert sum(t.is_local for t in plan) == local
    pairs = [(t.src_rank, t.dst_rank) for t in plan]
    assert len(pairs) == len(set(pairs)), "one transfer (one message) per pair of ranks"
    for d_stage in range(dst.pp_size):
        for d_tp in range(dst.tp_size):
            d_rank = dst.rank_of(d_stage, d_tp)
            want = {(h, l) for h in dst.heads_of(d_tp, heads) for l in dst.layers_of(d_stage, layers)}
            got = []
            for t in plan:
                if t.dst_rank != d_rank:
                    continue
                s_stage, s_tp = src.position_of(t.src_rank)
                # the source holds what it sends, and the local indices name the same heads and layers
                assert set(t.heads) <= set(src.heads_of(s_tp, heads)) and set(t.layers) <= set(src.layers_of(s_stage, layers))
                assert [src.heads_of(s_tp, heads)[i] for i in t.src_heads] == list(t.heads)
                assert [src.layers_of(s_stage, layers)[i] for i in t.src_layers] == list(t.layers)
                assert [dst.heads_of(d_tp, heads)[i] for i in t.dst_heads] == list(t.heads)
                assert [dst.layers_of(d_stage, layers)[i] for i in t.dst_layers] == list(t.layers)
                got += [(h, l) for h in t.heads for l in t.layers]
            assert sorted(got) == sorted(want), f"destination rank {d_rank} must receive each of its cells once"


def test_plan_spreads_replicated_heads_over_their_replicas():
    # 2 heads on 8 source ranks (4 replicas each) to 8 destination ranks elsewhere: every source sends once
    plan = plan_reshard(2, 4, L(8), L(8, ranks=range(8, 16)))
    assert sorted(t.src_rank for t in plan) == list(range(8))
    # MLA, one latent head on 4 ranks, to 2 ranks elsewhere: two different senders
    plan = plan_reshard(1, 4, L(4), L(2, ranks=[4, 5]))
    assert [t.src_rank for t in plan] == [0, 1]


def test_plan_prefers_the_replica_on_the_destination_rank():
    plan = plan_reshard(1, 4, L(2), L(2, ranks=[1, 0]))
    assert all(t.is_local for t in plan) and len(plan) == 2


def test_plan_is_identical_for_equal_arguments():
    assert plan_reshard(2, 6, L(4, 2), L(2, 3)) == plan_reshard(2, 6, L(4, 2, ranks=range(8)), L(2, 3))


def test_layout_accessors():
    layout = L(2, 2, ranks=[10, 11, 12, 13], layer_ranges=[(0, 3), (3, 5)])
    assert layout.size == 4 and layout.rank_of(1, 0) == 12 and layout.position_of(13) == (1, 1)
    assert layout.position_of(0) is None
    assert layout.heads_of(1, 8) == range(4, 8) and layout.layers_of(1, 5) == range(3, 5)
    assert L(4).heads_of(3, 2) == range(1, 2) and L(4).tp_ranks_holding(1, 2) == range(2, 4)
    assert L(1, 3).layers_of(2, 8) == range(5, 8)


@pytest.mark.parametrize("make, error, match", [
    (lambda: L(0), ValueError, "tp_size: must be at least 1"),
    (lambda: L(2, True), TypeError, "pp_size: expected an int"),
    (lambda: L("2"), TypeError, "tp_size: expected an int"),
    (lambda: L(2, ranks=[0]), ValueError, "ranks: expected 2 ranks"),
    (lambda: L(2, ranks=[3, 3]), ValueError, "rank 3 holds two positions"),
    (lambda: L(2, ranks=[0, -1]), ValueError, r"ranks\[1\]: must be at least 0"),
    (lambda: L(2, ranks=5), TypeError, "ranks: expected a sequence"),
    (lambda: L(1, 2, layer_ranges=[(0, 2)]), ValueError, "one range per PP stage"),
    (lambda: L(1, 2, layer_ranges=[(0, 2), (3, 4)]), ValueError, r"layer_ranges\[1\]: starts at layer 3, expected 2"),
    (lambda: L(1, 2, layer_ranges=[(0, 2), range(2, 2)]), ValueError, "non-empty range of step 1"),
    (lambda: L(1, 2, layer_ranges=[(0, 2), "x"]), TypeError, r"layer_ranges\[1\]: expected a range"),
    (lambda: plan_reshard(6, 4, L(4), L(1)), ValueError, "src: tp_size 4 and 6 KV heads: one must divide the other"),
    (lambda: plan_reshard(2, 4, L(1), L(3)), ValueError, "dst: tp_size 3 and 2 KV heads"),
    (lambda: plan_reshard(8, 3, L(1, 4), L(1)), ValueError, "num_layers 3 is smaller than pp_size 4"),
    (lambda: plan_reshard(8, 6, L(1, 2, layer_ranges=[(0, 2), (2, 5)]), L(1)), ValueError,
     "layer_ranges: end at layer 5, but the model has 6 layers"),
    (lambda: plan_reshard(8, 4, "tp2", L(1)), TypeError, "src: expected a kvbm_ext.EngineLayout"),
    (lambda: plan_reshard(0, 4, L(1), L(1)), ValueError, "num_heads: must be at least 1"),
])
def test_layout_and_plan_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_importing_kvbm_ext_does_not_import_torch():
    code = "import sys, kvbm_ext; assert kvbm_ext.Resharder and 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_resharder_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        Resharder(8, 4, L(1), L(2))


GROUP_AND_TRANSPORT = """
import datetime, os, sys, tempfile
import torch.distributed as dist
import kvbm_ext
from kvbm_ext import EngineLayout as L
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0,
                        world_size=1, timeout=datetime.timedelta(seconds=20))
for make in (lambda group, transport: kvbm_ext.Resharder(8, 4, L(1), L(1), group=group, transport=transport),
             lambda group, transport: kvbm_ext.reshard(None, None, None, None, num_heads=8, num_layers=4, src=L(1),
                                                       dst=L(1), group=group, transport=transport)):
    try:
        make(dist.group.WORLD, kvbm_ext.TorchTransport())
        sys.exit("no error")
    except ValueError as error:
        assert "pass group= or transport=, not both" in str(error), error
dist.destroy_process_group()
"""


def test_group_and_transport_together_are_refused():
    # Its own process: a process group initialized here would stay for the other tests.
    result = subprocess.run([sys.executable, "-c", GROUP_AND_TRANSPORT], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_example_runs_on_the_cpu():
    script = os.path.join(REPO_ROOT, "examples", "disagg_reshard.py")
    run = subprocess.run([sys.executable, script, "--device", "cpu", "--prefill-tp", "1", "--decode-tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "check OK" in run.stdout and "per call: 2 messages" in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("transport, backend, methods", [
    ("nccl", "gloo", 6),
    pytest.param("nixl", "nixl", 5, marks=pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None,
                                                            reason="NIXL is not installed (kvbm_ext[nixl])")),
])
def test_benchmark_runs_on_the_cpu(tmp_path, transport, backend, methods):
    script = os.path.join(REPO_ROOT, "benchmarks", "reshard.py")
    run = subprocess.run([sys.executable, script, "--device", "cpu", "--transport", transport, "--nb", "2",
                          "--calls", "2", "--repeats", "2", "--out", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    [csv_path] = tmp_path.glob("reshard-*.csv")
    [log_path] = tmp_path.glob("reshard-*.log")
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 1 + 2 * methods, lines          # a header, then every method for each direction
    # 4 layers x K/V x 2 blocks: one send (NCCL) or one descriptor (NIXL) per chunk
    assert f"cpu,{backend},1to2,2,fragments,16," in csv_path.read_text()
    for direction in ("1to2", "2to1"):
        assert (f"{backend} {direction} nb=2: 1 messages + 1 local copies per call, pairs sharing data 1 + 1: "
                "PASS") in run.stdout
    assert "targets" in log_path.read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(list(tmp_path.glob("reshard-*.png"))) == 1


# --------------------------------------------------------------------------
# Cases run by groups of processes.
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    src: EngineLayout
    dst: EngineLayout
    messages: int           # per call, counted by hand
    local: int
    heads: int = 4
    layers: int = 4
    no: int = 2
    nt: int = 4
    hd: int = 8
    dtype: str = "bfloat16"
    src_dims: str = "kbthd"
    dst_dims: str = "kbthd"
    ids: str = "list"       # "list", "int64", "int32" (on the caches' device), "host-int64"
    nb: int = 5
    group: list | None = None   # world ranks of a subgroup the layouts' ranks are ranks of (None: the world)
    one_shot: bool = False  # kvbm_ext.reshard() for each call instead of one Resharder
    torch_posts: bool = False   # NCCL: torch's batch_isend_irecv, not the transport's own communicators


NB_SRC, NB_DST = 12, 10

GLOO_WORLD = 4
GLOO_CASES = {
    "tp1->tp2 apart": Case(L(1), L(2, ranks=[1, 2]), 2, 0, dst_dims="bkthd"),
    "tp2->tp1 co-located": Case(L(2), L(1, ranks=[1]), 1, 1, src_dims="kbhtd", ids="int64"),
    "tp2->tp4": Case(L(2), L(4), 3, 1, dtype="float16", ids="int32"),
    "tp4->tp2": Case(L(4), L(2, ranks=[2, 3]), 3, 1, dst_dims="blkthd", dtype="float32"),
    "gqa 2 heads tp4->tp1": Case(L(4), L(1, ranks=[3]), 1, 1, heads=2),
    "gqa 2 heads tp4->tp4 replicas spread": Case(L(4), L(4, ranks=[3, 2, 1, 0]), 4, 0, heads=2),
    "gqa 2 heads tp2->tp4": Case(L(2), L(4), 3, 1, heads=2, dtype="float8_e4m3fn"),
    "mla tp2->tp4": Case(L(2), L(4), 2, 2, heads=1, no=1, hd=16, src_dims="btd", dst_dims="btd"),
    "mla tp4->tp1": Case(L(4), L(1, ranks=[2]), 0, 1, heads=1, no=1, hd=16, src_dims="btd", dst_dims="btd"),
    "pp2->pp1": Case(L(1, 2), L(1, ranks=[2]), 2, 0),
    "pp1->pp2": Case(L(1), L(1, 2, ranks=[1, 2]), 2, 0, dst_dims="blkthd"),
    "tp2pp2->tp4": Case(L(2, 2), L(4), 6, 2),
    "tp2pp2->tp1pp2 uneven layers": Case(L(2, 2), L(1, 2, ranks=[1, 2], layer_ranges=[(0, 1), (1, 4)]), 4, 2),
    "tp2->tp2 same ranks": Case(L(2), L(2), 0, 2, ids="int64"),
    "tp1->tp2 in a subgroup": Case(L(1), L(2, ranks=[1, 2]), 2, 0, group=[3, 1, 2]),
    "tp2->tp1 one-shot reshard()": Case(L(2, ranks=[2, 0]), L(1, ranks=[0]), 1, 1, one_shot=True),
    "tp1pp2->tp2pp2 six layers": Case(L(1, 2, ranks=[3, 1]), L(2, 2, ranks=[0, 1, 2, 3]), 4, 0, layers=6),
}

GLOO_ERROR_BASE = Case(L(2), L(2, ranks=[1, 2]), 2, 1)      # rank 1: source and destination; rank 3: neither
# name: (rank whose arguments are wrong, how, error type, part of the message); the cases of GLOO_ERROR_BASE
GLOO_ERRORS = {
    "head_dim": (2, "dst_hd", ValueError, r"head_dim differs across the ranks: 8 \(src_cache on rank 0, src_cache on "
                                          r"rank 1, dst_cache on rank 1\), 16 \(dst_cache on rank 2\)"),
    "dtype": (0, "src_dtype", ValueError, r"dtype differs across the ranks: float16 \(src_cache on rank 0\), bfloat16"),
    "block count": (2, "dst_ids_short", ValueError, r"number of block ids differs across the ranks: 5 \(.*\), 4 "
                                                     r"\(dst_block_ids on rank 2\)"),
    "block count on one rank": (1, "dst_ids_short", ValueError, "rank 1: src_block_ids has 5 ids and dst_block_ids 4"),
    "stream for host caches": (0, "host_stream", ValueError, "stream: rank 0's caches are in host memory"),
    "cache heads": (0, "src_all_heads", ValueError, r"src_cache on rank 0: holds 4 heads x 4 layers, but its "
                                                     r"position holds heads \[0, 2\)"),
    "plan": (3, "other_plan", ValueError, "rank 3 built its Resharder for"),
    "id out of range": (1, "dst_ids_range", ValueError, r"dst_block_ids\[4\] on rank 1: block id 10 is out of range"),
    "id repeated": (2, "dst_ids_repeat", ValueError, r"dst_block_ids\[4\] on rank 2: block id \d+ repeats"),
    "cache type": (0, "src_not_cache", TypeError, "src_cache on rank 0: expected a kvbm_ext.PagedKVCache, got list"),
    "bystander": (3, "bystander_cache", ValueError, "rank 3 holds no dst position"),
}

NCCL_WORLD = 2
NCCL_CASES = {
    "tp1->tp2": Case(L(1), L(2), 1, 1, heads=8, layers=6, hd=64, nt=16, ids="int64"),
    "tp2->tp1": Case(L(2), L(1, ranks=[1]), 1, 1, heads=8, layers=6, hd=64, nt=16, src_dims="bkthd"),
    "pp2->pp1": Case(L(1, 2), L(1), 1, 1, heads=8, layers=6, hd=64, nt=16, ids="int32"),
    "mla tp1->tp2": Case(L(1), L(2), 1, 1, heads=1, no=1, hd=576, nt=16, src_dims="btd", dst_dims="btd"),
    "gqa 1 head tp1->tp2": Case(L(1), L(2), 1, 1, heads=1, hd=128, nt=16, dst_dims="kbhtd"),
    "gqa 1 head tp2->tp1": Case(L(2), L(1), 0, 1, heads=1, hd=128, nt=16, ids="host-int64"),
    "tp1->tp2 through torch's posts": Case(L(1), L(2), 1, 1, heads=8, layers=6, hd=64, nt=16, torch_posts=True),
}
# Four GPUs (nvidia-h200-x4): TP 2 <-> 4 with Llama-3.1-70B's heads, fewer layers.
NCCL4_WORLD = 4
NCCL4_CASES = {
    "tp2->tp4 on four gpus": Case(L(2), L(4), 3, 1, heads=8, layers=6, hd=128, nt=16, ids="int64"),
    "tp4->tp2 on four gpus": Case(L(4), L(2, ranks=[2, 3]), 3, 1, heads=8, layers=6, hd=128, nt=16,
                                  src_dims="bkthd", dst_dims="blkthd"),
    "gqa 2 heads tp4->tp2 on four gpus": Case(L(4), L(2), 1, 1, heads=2, layers=4, hd=128, nt=16, dtype="float16"),
    "mla tp2->tp4 on four gpus": Case(L(2), L(4), 2, 2, heads=1, no=1, hd=576, nt=16, src_dims="btd", dst_dims="btd"),
}
NCCL_ERROR_BASE = Case(L(2), L(1, ranks=[1]), 1, 1)        # rank 1: source and destination
NCCL_ERRORS = {
    "dtype": (0, "src_dtype", ValueError, r"dtype differs across the ranks: float16 \(src_cache on rank 0\), "
                                          r"bfloat16 \(src_cache on rank 1, dst_cache on rank 1\)"),
    "id out of range": (1, "dst_ids_range", ValueError, r"dst_block_ids\[4\] on rank 1: block id 10 is out of range"),
    "block count": (0, "src_ids_short", ValueError, r"number of block ids differs across the ranks: 4 \(src_block_ids "
                                                     r"on rank 0\), 5"),
    "caches off the communicators' device": (0, "other_device", ValueError, r"rank 0: the caches are on cuda:1, but "
                                                                            r"this transport's NCCL communicators on "
                                                                            r"cuda:0"),
    # a description over the 4 KiB slot of the header communicator: a second exchange, through torch
    "a description larger than the gather slot": (0, "src_long_type", TypeError,
                                                  r"src_block_ids on rank 0: expected a sequence of ints or a 1-D int "
                                                  r"tensor, got X{5000}$"),
}
ERRORS = {"gloo": (GLOO_ERROR_BASE, GLOO_ERRORS), "nccl": (NCCL_ERROR_BASE, NCCL_ERRORS)}

# check=False: only the two ranks of a message compare (their headers), and a pair that
# disagrees does not hold up the others.  name: (rank whose arguments are wrong, or None
# for all, how, {rank: None (returns, its destination written) or (error type, part of the
# message)}); ranks that expect one error raise the same.  GLOO_ERROR_BASE's messages:
# 0 -> 1 and 1 -> 2 (rank 3 holds nothing).
GLOO_BLOCKS_12 = (ValueError, "rank 1 and rank 2 disagree on the number of blocks: 5 on rank 1, 4 on rank 2; nothing "
                              "was sent between them and neither wrote any block")
GLOO_BLOCKS_01 = (ValueError, "rank 0 and rank 1 disagree on the number of blocks: 4 on rank 0, 5 on rank 1")
GLOO_UNCHECKED = {
    # rank 1 receives rank 0's message (the pair agrees) but, refusing its pair with rank 2, writes nothing
    "block count on a receiver, check=False": (2, "dst_ids_short", {0: None, 1: GLOO_BLOCKS_12, 2: GLOO_BLOCKS_12,
                                                                    3: None}),
    # rank 1 still sends rank 2 its message: rank 2 writes it
    "block count on a sender, check=False": (0, "src_ids_short", {0: GLOO_BLOCKS_01, 1: GLOO_BLOCKS_01, 2: None,
                                                                  3: None}),
    "own arguments refused, check=False": (0, "src_all_heads", {
        0: (ValueError, "src_cache on rank 0: holds 4 heads x 4 layers"),
        1: (ValueError, "rank 0 refused its own arguments in this call"), 2: None, 3: None}),
}
# NCCL_ERROR_BASE's message: 0 -> 1 (headers and payload over the transport's own NCCL communicators).
NCCL_BLOCKS = (ValueError, "rank 0 and rank 1 disagree on the number of blocks: 4 on rank 0, 5 on rank 1")
NCCL_DTYPE = (ValueError, "rank 0 and rank 1 disagree on the dtype: float16 on rank 0, bfloat16 on rank 1")
NCCL_ONLY = (ValueError, "check=False: the ranks of each pair compare a 128-byte header on the host before any "
                         "payload, and this transport cannot carry it")
NCCL_UNCHECKED = {
    "block count, check=False": (0, "src_ids_short", {0: NCCL_BLOCKS, 1: NCCL_BLOCKS}),
    "dtype, check=False": (0, "src_dtype", {0: NCCL_DTYPE, 1: NCCL_DTYPE}),
    # NCCL alone: the headers cross on the transport's own header communicator, no host tensor
    "an NCCL-only group moves check=False's blocks": (None, "nccl_only_group", {0: None, 1: None}),
    # ... and without communicators of its own they cannot cross
    "an NCCL-only group refuses check=False without own_nccl": (None, "nccl_only_group_torch_posts",
                                                                {0: NCCL_ONLY, 1: NCCL_ONLY}),
}
UNCHECKED = {"gloo": GLOO_UNCHECKED, "nccl": NCCL_UNCHECKED}


def _random_bits(shape, dtype, gen):
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = itemsize
    for extent in shape:
        count *= extent
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def _bits(x):
    return x.contiguous().flatten().view(torch.uint8)


def _stored(x, dims):
    """A logical tensor (one layer's [no, nb, nt, nh, hd], or [nl, no, nb, nt, nh, hd] for dims
    with 'l') as a contiguous tensor in the order of `dims` (no 'k' / 'h': that size is 1)."""
    logical = ("l" if "l" in dims else "") + LOGICAL
    for letter in "kh":
        if letter not in dims:
            x = x.select(logical.index(letter), 0)
            logical = logical.replace(letter, "")
    # a copy even where the permutation is the identity: a cache never aliases the reference model
    return x.permute([logical.index(c) for c in dims]).clone(memory_format=torch.contiguous_format)


def _logical(t, dims):
    """The inverse of _stored: a view in the logical order."""
    logical = ("l" if "l" in dims else "") + LOGICAL
    present = "".join(c for c in logical if c in dims)
    x = t.permute([dims.index(c) for c in present])
    for letter in "kh":
        if letter not in dims:
            x = x.unsqueeze(logical.index(letter))
    return x


class Side:
    """One rank's cache on one side: its heads x layers of a whole model held as logical layers."""

    def __init__(self, model, heads, layers, dims, device):
        parts = [model[l][:, :, :, heads.start:heads.stop] for l in layers]
        if "l" in dims:
            self.arrays = _stored(torch.stack(parts), dims).to(device)
        else:
            self.arrays = [_stored(p, dims).to(device) for p in parts]
        self.dims, self.heads, self.layers = dims, heads, layers
        self.cache = kvbm_ext.PagedKVCache(self.arrays, dims)

    def matches(self, model):
        """True when every layer equals the model's heads x layers bit for bit."""
        if "l" in self.dims:
            got = list(_logical(self.arrays.cpu(), self.dims))
        else:
            got = [_logical(a.cpu(), self.dims) for a in self.arrays]
        return all(torch.equal(_bits(g), _bits(model[l][:, :, :, self.heads.start:self.heads.stop]))
                   for g, l in zip(got, self.layers))


class Recording:
    """A Transport that forwards to another and records what each call moved: the
    Transport interface, used by a second engine's adapter, exercised here.  A call with
    check=False carries a header (kvbm_ext._reshard.HEADER.size bytes) for each peer,
    recorded apart from the payloads; each message's pieces must cover it in order."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        self.headers = []

    def prepare(self, timeout):
        self.inner.prepare(timeout)

    def check_device(self, device):
        self.inner.check_device(device)

    @property
    def carries_headers(self):
        return self.inner.carries_headers

    @property
    def rank(self):
        return self.inner.rank

    @property
    def world_size(self):
        return self.inner.world_size

    def all_gather_object(self, obj, timeout):
        return self.inner.all_gather_object(obj, timeout)

    def exchange(self, call, background):
        messages = list(call.sends) + list(call.recvs)
        assert all(m.buffer.is_contiguous() and m.buffer.dtype == torch.uint8 for m in messages)
        assert len({m.buffer.device for m in messages}) <= 1, "one call: all on the host or all on one device"
        for m in messages:
            assert m.pieces and m.pieces[0][0] == 0 and m.pieces[-1][1] == m.buffer.numel(), m.pieces
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(m.pieces, m.pieces[1:])), m.pieces
        if call.headers is not None:
            self.headers.append({"sends": [(p, len(r)) for p, r in call.headers.items()],
                                 "recvs": [(p, len(r)) for p, r in call.headers.items()]})
        self.calls.append({"sends": [(m.peer, m.nbytes) for m in call.sends],
                           "recvs": [(m.peer, m.nbytes) for m in call.recvs]})
        return self.inner.exchange(call, background)


def _ids_arg(ids, form, device):
    if form == "list":
        return ids.tolist()
    if form == "host-int64":
        return ids.to(torch.int64)
    return ids.to(dtype=getattr(torch, form), device=device)


def _setup(name, case, rank, device):
    """The whole source model, the poisoned destination model, the ids of two calls and this rank's caches."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, case.dtype)
    src_model = [_random_bits((case.no, NB_SRC, case.nt, case.heads, case.hd), dtype, gen) for _ in range(case.layers)]
    dst_model = [_random_bits((case.no, NB_DST, case.nt, case.heads, case.hd), dtype, gen) for _ in range(case.layers)]
    ids = [(torch.randperm(NB_SRC, generator=gen)[:nb], torch.randperm(NB_DST, generator=gen)[:nb])
           for nb in (case.nb, case.nb - 1)]      # the second call smaller: staging is reused as it is
    sides = []
    for layout, model, dims in ((case.src, src_model, case.src_dims), (case.dst, dst_model, case.dst_dims)):
        position = layout.position_of(rank)
        sides.append(None if position is None else
                     Side(model, layout.heads_of(position[1], case.heads), layout.layers_of(position[0], case.layers),
                          dims, device))
    return src_model, dst_model, ids, sides[0], sides[1]


def _run_case(name, case, rank, device, stream=None):
    group = None
    if case.group is not None:
        group = dist.new_group(case.group)          # every rank of the world takes part in creating it
        if rank not in case.group:
            return {"involved": False, "me": None, "posted": [], "headers": [], "staging": [0, 0], "stats": [dataclasses.asdict(
                    kvbm_ext.ReshardStats())] * 2, "dst_ok": True, "src_ok": True, "plan_messages": case.messages}
        rank = dist.get_rank(group)                 # the layouts name ranks of the group
    src_model, dst_model, ids, src, dst = _setup(name, case, rank, device)
    transport = Recording(kvbm_ext.TorchTransport(group, own_nccl=not case.torch_posts))
    resharder = Resharder(case.heads, case.layers, case.src, case.dst, transport=transport)
    expected = [t.clone() for t in dst_model]
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())     # the caches' writers, as a server orders them
    stats, staging = [], []
    with _torch_all_gathers() as gathers:
        for call, (src_ids, dst_ids) in enumerate(ids):
            arguments = (src and src.cache, src and _ids_arg(src_ids, case.ids, device),
                         dst and dst.cache, dst and _ids_arg(dst_ids, case.ids, device))
            if case.one_shot:
                result = kvbm_ext.reshard(*arguments, num_heads=case.heads, num_layers=case.layers, src=case.src,
                                          dst=case.dst, transport=transport, stream=stream)
            else:
                result = resharder(*arguments, stream=stream, check=call == 0)
            stats.append(dataclasses.asdict(result))
            staging.append(resharder.staging_nbytes)
            for l in range(case.layers):
                expected[l][:, dst_ids] = src_model[l][:, src_ids]
    if device != "cpu":
        torch.cuda.synchronize()
    return {"involved": src is not None or dst is not None, "me": transport.rank, "posted": transport.calls,
            "headers": transport.headers, "staging": staging, "torch_gathers": len(gathers),
            "stats": stats, "dst_ok": dst is None or dst.matches(expected), "src_ok": src is None or src.matches(src_model),
            "plan_messages": resharder.num_messages, "own_nccl": transport.inner._nccl is not None}


@contextlib.contextmanager
def _torch_all_gathers():
    """Counts the calls of torch.distributed.all_gather within the block (the list it
    yields): check=True's exchange goes through it only where the transport has no NCCL
    communicators of its own."""
    gathers, all_gather = [], dist.all_gather

    def counted(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)

    dist.all_gather = counted
    try:
        yield gathers
    finally:
        dist.all_gather = all_gather


def _run_error(backend, name, rank, device):
    case, errors = ERRORS[backend]
    unchecked = name in UNCHECKED[backend]
    bad_rank, how = (UNCHECKED[backend] if unchecked else errors)[name][:2]
    if rank == bad_rank and how == "dst_hd":
        case = dataclasses.replace(case, hd=2 * case.hd)
    if rank == bad_rank and how == "src_dtype":
        case = dataclasses.replace(case, dtype="float16")
    src_model, dst_model, ids, src, dst = _setup("errors", case, rank, device)
    src_ids, dst_ids = (x.tolist() if side else None for x, side in zip(ids[0], (src, dst)))
    src_cache, dst_cache, dst_layout = src and src.cache, dst and dst.cache, case.dst
    if rank == bad_rank:
        if how == "dst_ids_short":
            dst_ids = dst_ids[:-1]
        elif how == "src_ids_short":
            src_ids = src_ids[:-1]
        elif how == "dst_ids_range":
            dst_ids[4] = NB_DST
        elif how == "dst_ids_repeat":
            dst_ids[4] = dst_ids[0]
        elif how == "src_all_heads":
            src_cache = Side(src_model, range(case.heads), range(case.layers), case.src_dims, device).cache
        elif how == "other_plan":
            dst_layout = L(2, ranks=[2, 1])
        elif how == "src_not_cache":
            src_cache = list(src.arrays)
        elif how == "other_device":
            src_cache = Side(src_model, src.heads, src.layers, case.src_dims, f"cuda:{1 - rank}").cache
        elif how == "src_long_type":
            src_ids = type("X" * 5000, (), {})()
        elif how == "bystander_cache":
            dst_cache, dst_ids = Side(dst_model, range(2), range(case.layers), "kbthd", device).cache, [0]
    stream = 1 if rank == bad_rank and how == "host_stream" else None
    # every rank creates it (a collective), with NCCL alone: no gloo to carry check=False's headers
    nccl_only = how in ("nccl_only_group", "nccl_only_group_torch_posts")
    group = dist.new_group(list(range(dist.get_world_size())), backend="nccl") if nccl_only else None
    try:
        transport = kvbm_ext.TorchTransport(group, own_nccl=how != "nccl_only_group_torch_posts")
        resharder = Resharder(case.heads, case.layers, case.src, dst_layout, transport=transport)
        resharder(src_cache, src_ids, dst_cache, dst_ids, stream=stream, check=not unchecked)
        error = None
    except (TypeError, ValueError) as caught:
        error = [type(caught).__name__, str(caught)]
    if device != "cpu":
        torch.cuda.synchronize()
    if group is not None:
        dist.destroy_process_group(group)
    moved = [t.clone() for t in dst_model]
    for l in range(case.layers):
        moved[l][:, ids[0][1]] = src_model[l][:, ids[0][0]]
    return {"error": error, "dst_ok": dst is None or dst.matches(dst_model),
            "dst_moved": dst is None or dst.matches(moved)}


def _worker(rank, world, backend, store_path, out_dir, names):
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                            store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60 if backend == "nccl" else 20))
    stream = None
    if backend == "nccl":
        # NCCL: the group's first operation must involve every rank (batch_isend_irecv's rule).
        dist.all_reduce(torch.ones(1, device=device))
        stream = torch.cuda.Stream()
    results = {}
    for name in names:
        try:
            if name in ERRORS[backend][1] or name in UNCHECKED[backend]:
                results[name] = {"ok": True, **_run_error(backend, name, rank, device)}
            else:
                case = ({**NCCL_CASES, **NCCL4_CASES} if backend == "nccl" else GLOO_CASES)[name]
                results[name] = {"ok": True, **_run_case(name, case, rank, device, stream)}
        except Exception:
            results[name] = {"ok": False, "traceback": traceback.format_exc()}
        _save(results, out_dir, rank)      # so far: a later hang still shows what failed first
        dist.barrier()                     # keep the ranks in step from one case to the next
    if backend == "nccl" and world == NCCL_WORLD:
        results["async"] = _run_async(rank, device)
        _save(results, out_dir, rank)
        dist.barrier()
        for check in (False, True):
            results[f"{'checked exchange' if check else 'header'} timeout"] = _run_header_timeout(rank, device, check)
            _save(results, out_dir, rank)
            dist.barrier()
    dist.destroy_process_group()


def _save(results, out_dir, rank):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _run_async(rank, device):
    """On a busy stream the call returns before the GPU has run it: nothing waits on the host."""
    try:
        case = NCCL_CASES["tp1->tp2"]
        src_model, dst_model, ids, src, dst = _setup("async", case, rank, device)
        resharder = Resharder(case.heads, case.layers, case.src, case.dst)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        src_ids, dst_ids = (x.to(device) for x in ids[0])
        resharder(src and src.cache, src and src_ids, dst.cache, dst_ids, stream=stream)      # warm-up
        stream.synchronize()
        pending, host_s = [], []
        # checked: descriptions, unchecked: the pair's headers, both over the header communicator (neither
        # waits for the call's stream);
        # in the background: the headers waited for and the pieces posted by other threads, the stream
        # ordered after the unpacks by the handle
        for check, wait in ((True, True), (False, True), (False, False)):
            # the moved blocks poisoned again (the case's caches are "kbthd"): each call must write them
            for d in dst.arrays:
                d[:, dst_ids] = 0
            torch.cuda._sleep(500_000_000)      # ~0.25 s on the current stream, which the call's stream waits for
            stream.wait_stream(torch.cuda.current_stream())
            start = time.perf_counter()
            out = resharder(src and src.cache, src and src_ids, dst.cache, dst_ids, stream=stream, check=check,
                            wait=wait)
            host_s.append(time.perf_counter() - start)
            pending.append(not stream.query())
            if not wait:
                out.wait_stream(stream)
                out.wait(60)
            stream.synchronize()
        expected = [t.clone() for t in dst_model]
        for l in range(case.layers):
            expected[l][:, ids[0][1]] = src_model[l][:, ids[0][0]]
        return {"ok": True, "pending": all(pending), "host_s": host_s, "dst_ok": dst.matches(expected)}
    except Exception:
        return {"ok": False, "traceback": traceback.format_exc()}


def _run_header_timeout(rank, device, check):
    """check=False's headers, or check=True's exchange of descriptions, over the transport's
    own communicators, rank 0 never calling: rank 1 raises TimeoutError within its timeout,
    writes nothing, and its next call raises at once."""
    try:
        case = NCCL_CASES["tp1->tp2"]
        src_model, dst_model, ids, src, dst = _setup("header timeout", case, rank, device)
        resharder = Resharder(case.heads, case.layers, case.src, case.dst)
        outcome = {"ok": True, "own_nccl": resharder.transport._nccl is not None}
        if rank == 1:
            src_ids, dst_ids = (x.tolist() for x in ids[0])
            errors = []
            for _ in range(2):
                start = time.monotonic()
                try:
                    resharder(None, None, dst.cache, dst_ids, check=check, timeout=2)
                    errors.append(None)
                except Exception as error:
                    errors.append([type(error).__name__, str(error), time.monotonic() - start])
            torch.cuda.synchronize()
            outcome.update(errors=errors, dst_ok=dst.matches(dst_model))
        return outcome
    except Exception:
        return {"ok": False, "traceback": traceback.format_exc()}


def _spawn(backend, world, names, tmp_path, timeout_s=240):
    """Run the named cases in `world` spawned processes; {name: [result of rank 0, rank 1, ...]}."""
    store = tmp_path / "store"
    context = mp.start_processes(_worker, args=(world, backend, str(store), str(tmp_path), list(names)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):       # raises with the child's traceback when one fails
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{backend} processes did not finish within {timeout_s} s")
    except Exception as error:
        pytest.fail(f"{error}\ncases that failed before:\n{_failures_so_far(tmp_path, world)}", pytrace=False)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


def _failures_so_far(tmp_path, world):
    lines = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results = json.loads(path.read_text()) if path.exists() else {}
        lines += [f"{name} on rank {rank}:\n{result['traceback']}" for name, result in results.items()
                  if not result["ok"]]
    return "\n".join(lines) or "(none)"


def _failures(results):
    return "\n".join(f"rank {r}:\n{result['traceback']}" for r, result in enumerate(results) if not result["ok"])


def _check_case(case, results):
    assert all(r["ok"] for r in results), _failures(results)
    assert all(r["dst_ok"] for r in results), [r for r, res in enumerate(results) if not res["dst_ok"]]
    assert all(r["src_ok"] for r in results), "a source cache changed"
    for call in range(2):
        stats = [r["stats"][call] for r in results]
        assert sum(s["messages_sent"] for s in stats) == case.messages
        assert sum(s["messages_received"] for s in stats) == case.messages
        assert sum(s["local_copies"] for s in stats) == case.local
        assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
        itemsize = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
        block = case.heads * case.layers * case.no * case.nt * case.hd * itemsize
        nb = case.nb - call
        moved = sum(s["bytes_received"] + s["bytes_copied"] for s in stats)
        # every destination receives its heads x layers once: the whole model's blocks,
        # times the number of replicas of each head at the destination
        replicas = max(1, case.dst.tp_size // case.heads)
        assert moved == nb * block * replicas, (moved, nb * block * replicas)
    for r, result in enumerate(results):
        assert len(result["posted"]) == (2 if result["involved"] else 0), result["posted"]
        for posted, stats in zip(result["posted"], result["stats"]):
            peers_out = [p for p, _ in posted["sends"]]
            peers_in = [p for p, _ in posted["recvs"]]
            assert len(peers_out) == len(set(peers_out)) and len(peers_in) == len(set(peers_in)), posted
            assert result["me"] not in peers_out + peers_in, "a rank never messages itself"
            assert sum(n for _, n in posted["sends"]) == stats["bytes_sent"]
            assert sum(n for _, n in posted["recvs"]) == stats["bytes_received"]
        # the second call (check=False) posted one header to and from every peer of its messages first
        peers = sorted({p for posted in result["posted"] for p, _ in posted["sends"] + posted["recvs"]})
        header = kvbm_ext._reshard.HEADER.size
        unchecked = peers and not case.one_shot       # one-shot reshard() calls are checked
        assert result["headers"] == ([{"sends": [[p, header] for p in peers], "recvs": [[p, header] for p in peers]}]
                                     if unchecked else []), result["headers"]
    for result in results:
        assert result["staging"][1] == result["staging"][0], "the second, smaller call allocated staging"
        assert result["plan_messages"] == case.messages


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return _spawn("gloo", GLOO_WORLD, list(GLOO_CASES) + list(GLOO_ERRORS) + list(GLOO_UNCHECKED),
                  tmp_path_factory.mktemp("gloo"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", GLOO_CASES)
def test_gloo_reshard(gloo_results, name):
    _check_case(GLOO_CASES[name], gloo_results[name])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", GLOO_ERRORS)
def test_gloo_errors_raise_on_every_rank_and_write_nothing(gloo_results, name):
    _check_error(GLOO_ERRORS[name], gloo_results[name])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", GLOO_UNCHECKED)
def test_gloo_unchecked_pairs_raise_alike_and_the_others_move(gloo_results, name):
    _check_unchecked(GLOO_UNCHECKED[name][2], gloo_results[name])


def _check_unchecked(expected, results):
    """check=False: each rank as `expected`; a rank that raises wrote nothing."""
    assert all(r["ok"] for r in results), _failures(results)
    errors = [r["error"] for r in results]
    for rank, want in expected.items():
        if want is None:
            assert errors[rank] is None, (rank, errors[rank])
            assert results[rank]["dst_moved"], f"rank {rank} returned, but its destination is not the moved blocks"
        else:
            assert errors[rank] is not None, f"rank {rank} returned without an error"
            assert errors[rank][0] == want[0].__name__ and want[1] in errors[rank][1], (rank, errors[rank])
            assert results[rank]["dst_ok"], f"rank {rank} raised, but wrote its destination"
    for a in expected:
        for b in expected:
            if expected[a] is not None and expected[a] == expected[b]:
                assert errors[a] == errors[b], f"ranks {a} and {b} raised different errors: {errors[a]}, {errors[b]}"


def _check_error(error, results):
    assert all(r["ok"] for r in results), _failures(results)
    _, _, error_type, match = error
    errors = [r["error"] for r in results]
    assert errors[0] is not None, "no error raised"
    assert all(e == errors[0] for e in errors), f"the ranks raised different errors: {errors}"
    kind, message = errors[0]
    assert kind == error_type.__name__, errors[0]
    assert re.search(match, message), message
    assert all(r["dst_ok"] for r in results), "a destination was written"


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    # Its tests are marked gpu(count=2); the fixture holds the same line itself, so that no
    # group is spawned over GPUs that are not there.
    reason = missing_gpus(2)
    if reason:
        pytest.skip(reason)
    return _spawn("nccl", NCCL_WORLD, list(NCCL_CASES) + list(NCCL_ERRORS) + list(NCCL_UNCHECKED),
                  tmp_path_factory.mktemp("nccl"))


@pytest.mark.multiprocess
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("name", NCCL_CASES)
def test_nccl_reshard(nccl_results, name):
    case = NCCL_CASES[name]
    _check_case(case, nccl_results[name])
    # through the transport's own communicators, unless the case asks for torch's posts; the
    # first call's check=True exchange too (torch's all_gather over gloo otherwise)
    assert [r["own_nccl"] for r in nccl_results[name]] == [not case.torch_posts] * NCCL_WORLD
    gathers = [r["torch_gathers"] for r in nccl_results[name]]
    assert gathers == ([1] * NCCL_WORLD if case.torch_posts else [0] * NCCL_WORLD), gathers


@pytest.fixture(scope="module")
def nccl4_results(tmp_path_factory):
    reason = missing_gpus(NCCL4_WORLD)
    if reason:
        pytest.skip(reason)
    return _spawn("nccl", NCCL4_WORLD, list(NCCL4_CASES), tmp_path_factory.mktemp("nccl4"))


@pytest.mark.multiprocess
@pytest.mark.gpu(count=4)
@pytest.mark.parametrize("name", NCCL4_CASES)
def test_nccl_reshard_on_four_gpus(nccl4_results, name):
    _check_case(NCCL4_CASES[name], nccl4_results[name])


@pytest.mark.multiprocess
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("name", NCCL_ERRORS)
def test_nccl_errors_raise_on_every_rank_and_write_nothing(nccl_results, name):
    _check_error(NCCL_ERRORS[name], nccl_results[name])


@pytest.mark.multiprocess
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("name", NCCL_UNCHECKED)
def test_nccl_unchecked_pairs_raise_alike(nccl_results, name):
    _check_unchecked(NCCL_UNCHECKED[name][2], nccl_results[name])


@pytest.mark.multiprocess
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("name, what", [("header timeout", "messages"), ("checked exchange timeout", "exchange")])
def test_nccl_header_that_never_comes_times_out_and_writes_nothing(nccl_results, name, what):
    results = nccl_results[name]
    assert all(r["ok"] for r in results), _failures(results)
    assert [r["own_nccl"] for r in results] == [True, True]
    (kind, message, seconds), (again, why, at_once) = results[1]["errors"]
    assert kind == "TimeoutError" and f"did not complete the {what} within 2" in message, message
    assert 1.9 < seconds < 10, seconds
    assert again == "RuntimeError" and "aborted" in why and at_once < 1, (why, at_once)
    assert results[1]["dst_ok"], "a destination block was written"


@pytest.mark.multiprocess
@pytest.mark.gpu(count=2)
def test_nccl_call_does_not_wait_for_the_gpu(nccl_results):
    results = nccl_results["async"]
    assert all(r["ok"] for r in results), _failures(results)
    assert all(r["dst_ok"] for r in results)
    assert all(r["pending"] for r in results), [r["host_s"] for r in results]
