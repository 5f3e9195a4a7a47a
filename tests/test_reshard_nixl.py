"""kvbm_ext.nixl: Resharder calls between processes that share no process group.

Every rank is its own interpreter, started by the test (tests/support/nixl_ranks.py), on
the CPU over UCX's TCP transport (UCX_TLS=tcp), finding the others through a TCPStore
the test hosts or through records passed as files (the bytes rendezvous).  Caches are
the engines' own (vLLM's packed K|V, SGLang's K/V pairs, a universal pool); every
destination byte is compared with a plain-torch reference after every call.

- two ranks: TP 1 -> 2, 2 -> 1, PP 2 -> 1 (three calls each: check=False, check=True,
  wait=False); headers that disagree (block count, dtype) and a rank's own refused
  arguments raise alike on both ranks, with nothing written, and the next call moves;
  hostile ids move what their first read named; a rank that does not call ends its
  peer's call in PeerError naming it within the timeout, and the next call moves.
- three ranks: TP 1 -> 2 and 2 -> 1 with the ranks apart; the sender killed right after
  its first piece: both receivers raise the same PeerError naming it within their
  timeout, with no piece unpacked that did not arrive.
- a rank that starts seconds after its peer (records passed as files);
- a rank killed between calls and started again with the same name: the survivor's call
  raises PeerError, the next one moves with the new incarnation.
- the example (examples/disagg_nixl.py): vLLM's packed K|V at TP 2 to SGLang's pairs at
  TP 1, and the reverse, in separate processes, checked bit for bit.
- two GPUs: TP 1 -> 2 and 2 -> 1 at Llama-70B's heads, bit for bit, with device and with
  pinned staging.

Each group of processes has a hard deadline, far above what the calls' timeouts allow,
and reports per step.  Without NIXL (nixl-cu13) everything here is skipped, saying so.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from support import REPO_ROOT
from support.devices import missing_gpus
from support.nixl_ranks import launch

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None,
                                 reason="NIXL is not installed: pip install \"kvbm_ext[nixl]\" (nixl-cu13)")]

HARD_DEADLINE = 150
PIECES_TIMEOUT = 3.0        # kill: the receivers' call timeout


class Group:
    """Ranks started by the test, a TCPStore they meet at (or files), and their reports."""

    def __init__(self, tmp_path, store=True, device="cpu", env=None):
        self.out = tmp_path
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                                   wait_for_workers=False) if store else None
        self.env = dict(os.environ, UCX_TLS="tcp") if device == "cpu" else dict(os.environ)
        self.env.update(env or {})
        self.device = device
        self.procs = []
        self.deadline = time.monotonic() + HARD_DEADLINE

    def start(self, rank, world, steps, suffix="", **config):
        config = dict(rank=rank, world=world, steps=steps, out=str(self.out), suffix=suffix,
                      port=self.store.port if self.store else None,
                      device=self.device if self.device == "cpu" else f"cuda:{rank}", **config)
        process = launch(config, self.env)
        self.procs.append(process)
        return process

    def wait(self, process):
        try:
            process.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except Exception:
            for p in self.procs:
                p.kill()
            pytest.fail(f"the ranks did not finish within {HARD_DEADLINE} s:\n{self.output()}\n{self.reports()}",
                        pytrace=False)

    def finish(self):
        for process in self.procs:
            self.wait(process)
        return self.reports()

    def reports(self):
        return {path.stem: json.loads(path.read_text()) for path in self.out.glob("rank*.json")}

    def output(self):
        return "\n".join(p.stdout.read()[-3000:] for p in self.procs if p.poll() is not None and p.stdout)


def results(reports, step, ranks):
    found = [reports.get(r, {}).get(step) for r in ranks]
    assert all(f is not None for f in found), f"{step}: ranks {ranks} reported {found}; all: {reports}"
    for rank, f in zip(ranks, found):
        assert f["ok"], f"{step} on {rank}:\n{f.get('traceback')}"
    return found


def check_moves(found):
    for rank, result in enumerate(found):
        for k, c in enumerate(result["calls"]):
            assert c["error"] is None, (rank, k, c["error"])
            assert c["dst_ok"], f"rank {rank}, call {k}: the destination is not the moved blocks"
    for k in range(len(found[0]["calls"])):
        stats = [r["calls"][k]["stats"] for r in found]
        assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0


# --------------------------------------------------------------------------- two ranks

PAIR_MOVES = ["moves#tp1->tp2", "moves#tp2->tp1", "moves#pp2->pp1"]
PAIR_MISMATCHES = ["mismatch#nb", "mismatch#dtype", "mismatch#own, check=False", "mismatch#own, check=True"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    group = Group(tmp_path_factory.mktemp("nixl-pair"))
    steps = PAIR_MOVES + PAIR_MISMATCHES + ["hostile", "silent"]
    for rank in range(2):
        group.start(rank, 2, steps)
    return group.finish()


@pytest.mark.parametrize("step", PAIR_MOVES)
def test_two_ranks_move_bit_exact(pair, step):
    check_moves(results(pair, step, ["rank0", "rank1"]))


BLOCKS = "rank 0 and rank 1 disagree on the number of blocks: 40 on rank 0, 39 on rank 1"
MISMATCH_ERRORS = {
    "mismatch#nb": {0: ("ValueError", BLOCKS), 1: ("ValueError", BLOCKS)},
    "mismatch#dtype": {0: ("ValueError", "disagree on the dtype: float16 on rank 0, bfloat16 on rank 1"),
                       1: ("ValueError", "disagree on the dtype: float16 on rank 0, bfloat16 on rank 1")},
    "mismatch#own, check=False": {0: ("ValueError", "rank 1 refused its own arguments in this call"),
                                  1: ("ValueError", "dst_block_ids[5] on rank 1: block id 51 is out of range")},
    "mismatch#own, check=True": {0: ("ValueError", "dst_block_ids[5] on rank 1: block id 51 is out of range"),
                                 1: ("ValueError", "dst_block_ids[5] on rank 1: block id 51 is out of range")},
}


@pytest.mark.parametrize("step", PAIR_MISMATCHES)
def test_two_ranks_disagree_alike_and_write_nothing(pair, step):
    found = results(pair, step, ["rank0", "rank1"])
    for rank, result in enumerate(found):
        kind, words = MISMATCH_ERRORS[step][rank]
        assert result["error"] is not None and result["error"][0] == kind, (rank, result["error"])
        assert words in result["error"][1], (rank, result["error"])
        assert result["dst_ok"], f"rank {rank} wrote its destination"
        assert result["seconds"] < 10, "a rank waited for its timeout"
        if "after" in result:
            assert result["after"] == {"error": None, "dst_ok": True}, (rank, result["after"])
    if step != "mismatch#own, check=False":
        assert found[0]["error"][:2] == found[1]["error"][:2], "the ranks raised different errors"


def test_two_ranks_hostile_ids_move_the_first_read(pair):
    for rank, result in enumerate(results(pair, "hostile", ["rank0", "rank1"])):
        assert result["error"] is None and result["dst_ok"], (rank, result)


def test_a_rank_that_does_not_call_is_named_within_the_timeout(pair):
    found = results(pair, "silent", ["rank0", "rank1"])
    for alone, peer in ((1, 0), (0, 1)):
        result = found[alone][f"alone {alone}"]
        assert result["error"] is not None, f"rank {alone} returned, alone"
        kind, message, peers = result["error"]
        assert kind == "PeerError" and peers == [peer], result["error"]
        assert message.startswith(f"rank {peer} (NIXL agent 'eng-{peer}'): lost during this reshard"), message
        assert 2.0 <= result["seconds"] < 6.0, result["seconds"]
        assert result["dst_ok"]
    for rank in range(2):
        assert found[rank]["after"] == {"error": None, "dst_ok": True}, (rank, found[rank]["after"])


# --------------------------------------------------------------------------- three ranks

@pytest.fixture(scope="module")
def three(tmp_path_factory):
    group = Group(tmp_path_factory.mktemp("nixl-three"))
    for rank in range(3):
        group.start(rank, 3, ["moves#tp1->tp2 apart", "moves#tp2->tp1 apart", "kill"])
    return group.finish()


@pytest.mark.parametrize("step", ["moves#tp1->tp2 apart", "moves#tp2->tp1 apart"])
def test_three_ranks_move_bit_exact(three, step):
    check_moves(results(three, step, ["rank0", "rank1", "rank2"]))


def test_a_sender_killed_after_its_first_piece(three):
    assert "kill" not in three.get("rank0", {}), "rank 0 survived its kill"
    found = results(three, "kill", ["rank1", "rank2"])
    for rank, result in zip((1, 2), found):
        assert result["error"] is not None, f"rank {rank} returned: every piece arrived before the kill"
        kind, message, peers = result["error"]
        assert kind == "PeerError" and peers == [0], result["error"]
        assert message.startswith("rank 0 (NIXL agent 'eng-0'): lost during this reshard"), message
        assert result["seconds"] < PIECES_TIMEOUT + 3, result["seconds"]
        assert set(result["written"]) <= set(result["allowed"]), "a block of a piece that did not arrive"
        assert result["whole"], "a piece partly written"
    assert found[0]["error"][:2] == found[1]["error"][:2], "the receivers raised different errors"


# --------------------------------------------------------------------------- late and restarted

def test_a_rank_that_starts_late(tmp_path):
    group = Group(tmp_path, store=False)
    group.start(0, 2, ["moves#tp2->tp1!"])
    time.sleep(3)
    group.start(1, 2, ["moves#tp2->tp1!"])
    reports = group.finish()
    found = results(reports, "moves#tp2->tp1", ["rank0", "rank1"])
    check_moves(found)
    assert found[0]["seconds"] > 2.5, "rank 0 did not wait for its late peer"


def test_a_restarted_rank(tmp_path):
    group = Group(tmp_path)
    group.start(0, 2, ["restart#1#20!", "restart#2#3!", "mark:lost", "restart#3#60!"])
    first = group.start(1, 2, ["restart#1#20!", "die!"])
    group.wait(first)
    # the second incarnation starts once the survivor found the first one lost
    group.start(1, 2, ["wait:lost", "restart#3#60!"], suffix="-b")
    reports = group.finish()
    survivor, first, second = reports["rank0"], reports["rank1"], reports["rank1-b"]
    for result in (survivor["restart#1#20"], first["restart#1#20"]):
        assert result["ok"] and result["error"] is None and result["dst_ok"], result
    lost = survivor["restart#2#3"]
    assert lost["ok"] and lost["error"][0] == "PeerError" and lost["error"][2] == [1], lost
    for result in (survivor["restart#3#60"], second["restart#3#60"]):
        assert result["ok"] and result["error"] is None and result["dst_ok"], result


# --------------------------------------------------------------------------- the example

@pytest.mark.slow
@pytest.mark.parametrize("reverse", [False, True], ids=["vllm tp2 -> sglang tp1", "sglang tp1 -> vllm tp2"])
def test_the_disaggregated_example_runs_on_the_cpu(reverse):
    script = os.path.join(REPO_ROOT, "examples", "disagg_nixl.py")
    run = subprocess.run([sys.executable, script, "--device", "cpu"] + (["--reverse"] if reverse else []),
                         capture_output=True, text=True, timeout=HARD_DEADLINE)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "check OK" in run.stdout, run.stdout
    # the heads regrouped: TP 2 -> 1, the decode rank receives from both; TP 1 -> 2, each from the one
    received = ["decode rank 0 (rank 1, cpu): sent 0 messages (0.00 MB), received 1 (",
                "decode rank 1 (rank 2, cpu): sent 0 messages (0.00 MB), received 1 ("] if reverse else \
        ["decode rank 0 (rank 2, cpu): sent 0 messages (0.00 MB), received 2 ("]
    assert all(line in run.stdout for line in received), run.stdout


# --------------------------------------------------------------------------- two GPUs

@pytest.fixture(scope="module", params=["device", "pinned"])
def gpus(request, tmp_path_factory):
    reason = missing_gpus(2)
    if reason:
        pytest.skip(reason)
    group = Group(tmp_path_factory.mktemp(f"nixl-gpu-{request.param}"), device="cuda")
    for rank in range(2):
        group.start(rank, 2, ["gpu#tp1->tp2", "gpu#tp2->tp1"], staging=request.param)
    return group.finish()


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("step", ["gpu#tp1->tp2", "gpu#tp2->tp1"])
def test_two_gpus_move_bit_exact(gpus, step):
    check_moves(results(gpus, step, ["rank0", "rank1"]))
