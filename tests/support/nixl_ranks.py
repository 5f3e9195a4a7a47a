"""Ranks of the kvbm_ext.nixl tests (tests/test_reshard_nixl.py): processes started on
their own (no process group), that find each other through a TCPStore the test hosts, or
through records the test's "control plane" passes as files.

`launch(...)` starts one rank: `python -c ...` running `main()` here with a JSON config.
A rank runs the steps of its scenario in order; before each step the ranks meet at a
barrier (the store, or files), and after it the rank writes what it saw to
`out/rank{R}[-{incarnation}].json` (so a rank that dies keeps what it reported).  Every
cache is an engine's own (tests/support/engines.py): vLLM's packed K|V "bth(kd)", SGLang's
K/V pairs "(bt)hd" with block_size=, or a universal pool; sources hold slices of one
model of random bytes, destinations are poisoned with other random bytes, and every
destination byte is compared with a plain-torch reference after each call.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from datetime import timedelta

import torch

from support import REPO_ROOT
from support.engines import ENGINES, Dims
from support.ranks import run_case
from support.references import as_int

ENGINE = {"vllm": "vllm_packed_memory", "sglang": "sglang_mha", "universal": "universal_pool"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's KV cache: heads, layers, tokens per block, head dim, blocks in a cache, and
    the blocks a call moves."""

    nh: int = 4
    nl: int = 4
    nt: int = 16
    hd: int = 64
    blocks: int = 48
    nb: int = 40        # float32: 1.25 MiB and more per message, three pieces


CPU = Shape()
GPU = Shape(nh=8, nl=8, nt=16, hd=128, blocks=96, nb=64)     # Llama-3.1-70B's heads, fewer layers


def launch(config, env=None):
    """Starts one rank (a separate interpreter) with `config` (a JSON-able dict)."""
    code = (f"import sys; sys.path[:0] = [{os.path.join(REPO_ROOT, 'tests')!r}, {REPO_ROOT!r}]\n"
            "from support.nixl_ranks import main; main()\n")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


# --------------------------------------------------------------------------- caches

class Side:
    """One rank's cache on one side of a move: `heads` x `layers` of the model in an
    engine's layout; `model` None: poison (random bytes of another seed)."""

    def __init__(self, engine, model, heads, layers, dtype, seed, shape, device="cpu"):
        self.engine, self.heads, self.layers = ENGINES[ENGINE[engine]], heads, layers
        self.d = Dims(nl=len(layers), nh=len(heads), nt=shape.nt, hd=shape.hd, blocks=shape.blocks)
        gen = torch.Generator().manual_seed(seed)
        self.memory = self.engine.allocate(self.d, dtype, gen)
        if model is not None:
            for i, layer in enumerate(layers):
                for o, rows in enumerate(self.engine.rows(self.memory, self.d)[i]):
                    rows.copy_(as_int(model[layer][o][:, :, heads.start:heads.stop]))
        self.memory = [m.to(device) for m in self.memory]
        self.cache = self.engine.build(self.memory, self.d)
        self.before = self.snapshot()

    def snapshot(self):
        return [[r.clone() for r in layer] for layer in self.engine.rows([m.cpu() for m in self.memory], self.d)]

    def moved(self, model, src_ids, dst_ids):
        """The rows this side must hold after moving model blocks src_ids to dst_ids."""
        expected = [[r.clone() for r in layer] for layer in self.before]
        for i, layer in enumerate(self.layers):
            for o in range(2):
                expected[i][o][dst_ids] = as_int(model[layer][o][src_ids][:, :, self.heads.start:self.heads.stop])
        return expected

    def equals(self, expected):
        return all(torch.equal(a, b) for la, lb in zip(self.snapshot(), expected) for a, b in zip(la, lb))

    def written_blocks(self):
        """The ids of the blocks whose bytes changed since it was built (any layer)."""
        now = self.snapshot()
        changed = set()
        for la, lb in zip(now, self.before):
            for a, b in zip(la, lb):
                changed |= set(torch.nonzero((a != b).flatten(1).any(1)).flatten().tolist())
        return sorted(changed)


def model_of(seed, dtype, shape):
    """The whole model: per layer, K and V [blocks, nt, nh, hd] of random bytes."""
    gen = torch.Generator().manual_seed(seed)
    count = shape.blocks * shape.nt * shape.nh * shape.hd * torch.empty((), dtype=dtype).element_size()
    return [[torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype)
             .view(shape.blocks, shape.nt, shape.nh, shape.hd) for _ in range(2)] for _ in range(shape.nl)]


def ids_of(seed, nb, shape=CPU):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(shape.blocks, generator=gen)[:nb].tolist(),
            torch.randperm(shape.blocks, generator=gen)[:nb].tolist())


# --------------------------------------------------------------------------- a rank

class Rank:
    def __init__(self, config):
        from kvbm_ext.nixl import NixlTransport

        self.config, self.rank, self.world = config, config["rank"], config["world"]
        self.out = config["out"]
        self.device = config.get("device", "cpu")
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
        self.store = None
        if config.get("port"):
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", config["port"], None, False, timedelta(seconds=120))
        self.transport = NixlTransport(self.rank, self.world, f"eng-{self.rank}", store=self.store,
                                       staging=config.get("staging", "auto"))
        if self.store is None:
            self._publish()
        self.results = {}
        self.kept = {}          # what a later step takes up again (a Resharder)
        self.path = os.path.join(self.out, f"rank{self.rank}{config.get('suffix', '')}.json")

    def _publish(self):
        """The control plane of the bytes rendezvous: records as files, watched by a thread."""
        records = os.path.join(self.out, "records")
        os.makedirs(records, exist_ok=True)
        with open(os.path.join(records, f"{self.rank}.tmp"), "wb") as f:
            f.write(self.transport.local_metadata())
        os.replace(os.path.join(records, f"{self.rank}.tmp"), os.path.join(records, str(self.rank)))

        def watch():
            seen = {}
            while True:
                for name in os.listdir(records):
                    if name.isdigit() and int(name) != self.rank:
                        data = open(os.path.join(records, name), "rb").read()
                        if seen.get(name) != data:
                            seen[name] = data
                            self.transport.add_peer(int(name), data)
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()

    def barrier(self, name):
        key = f"{name}/{self.config.get('suffix', '')}"
        if self.store is not None:
            self.store.set(f"barrier/{key}/{self.rank}", b"1")
            self.store.wait([f"barrier/{key}/{r}" for r in range(self.world)], timedelta(seconds=60))
            return
        folder = os.path.join(self.out, "barriers")
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, f"{name}.{self.rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(folder, f"{name}.{r}")) for r in range(self.world)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {name}")
            time.sleep(0.01)

    def run(self, steps):
        for name in steps:
            if name.startswith("wait:"):       # a key another rank sets (mark:)
                self.store.wait([name[5:]], timedelta(seconds=60))
                continue
            if name.startswith("mark:"):
                self.store.set(name[5:], b"1")
                continue
            if not name.endswith("!"):         # "!": no barrier (a rank that starts late, or alone)
                self.barrier(name)
            step = STEPS[name.split("#")[0]]
            run_case(self.results, name.rstrip("!"), lambda: step(self, name.rstrip("!")), self.path)


def call(resharder, src, src_ids, dst, dst_ids, **kwargs):
    """One Resharder call: (None, stats as a dict) or ([error type, message], None)."""
    try:
        out = resharder(src and src.cache, src_ids if src else None, dst and dst.cache, dst_ids if dst else None,
                        **kwargs)
        if kwargs.get("wait") is False:
            if dst is not None and dst.memory[0].is_cuda:
                out.wait_stream()
            out = out.wait(60)
        if dst is not None and dst.memory[0].is_cuda:
            torch.cuda.synchronize()
        return None, out.__dict__
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        return [type(error).__name__, str(error), getattr(error, "peers", None)], None


def sides(me, src_layout, dst_layout, src_engine, dst_engine, seed, dtype=torch.float32, shape=CPU):
    """This rank's (source, destination) caches of a move (None where it holds no position)."""
    model = model_of(seed, dtype, shape)
    out = []
    for layout, engine, data in ((src_layout, src_engine, model), (dst_layout, dst_engine, None)):
        position = layout.position_of(me.rank)
        if position is None:
            out.append(None)
            continue
        out.append(Side(engine, data, layout.heads_of(position[1], shape.nh), layout.layers_of(position[0], shape.nl),
                        dtype, seed + 1 + me.rank, shape, me.device))
    return model, out[0], out[1]


# --------------------------------------------------------------------------- steps

def L(tp, pp=1, ranks=None):
    import kvbm_ext

    return kvbm_ext.EngineLayout(tp, pp, ranks=ranks)


def resharder(me, src, dst, shape=CPU):
    import kvbm_ext

    return kvbm_ext.Resharder(shape.nh, shape.nl, src, dst, transport=me.transport)


MOVES = {
    # name: (src layout, dst layout, src engine, dst engine); every layout over the ranks 0.. of the run
    "tp1->tp2": (L(1, ranks=[0]), L(2, ranks=[0, 1]), "vllm", "sglang"),
    "tp2->tp1": (L(2, ranks=[0, 1]), L(1, ranks=[1]), "sglang", "vllm"),
    "pp2->pp1": (L(1, 2, ranks=[0, 1]), L(1, ranks=[0]), "universal", "vllm"),
    "tp1->tp2 apart": (L(1, ranks=[0]), L(2, ranks=[1, 2]), "vllm", "sglang"),
    "tp2->tp1 apart": (L(2, ranks=[0, 1]), L(1, ranks=[2]), "sglang", "universal"),
}


def moves(me, name):
    """A move called three times (check=False, nb 40; check=True, nb 7; wait=False, nb 40),
    each checked bit for bit."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES[name.split("#")[1]]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed)
    r = resharder(me, src_layout, dst_layout)
    calls = []
    expected = dst.before if dst else None
    for k, (nb, kwargs) in enumerate(((CPU.nb, {"check": False}), (7, {"check": True}), (CPU.nb, {"wait": False}))):
        src_ids, dst_ids = ids_of(seed + k, nb)
        error, stats = call(r, src, src_ids, dst, dst_ids, timeout=20, **kwargs)
        if dst is not None:
            expected = dst.moved(model, src_ids, dst_ids) if error is None else expected
            dst.before = expected
        calls.append({"error": error, "stats": stats, "dst_ok": dst is None or dst.equals(expected)})
    return {"calls": calls}


def mismatch(me, name):
    """TP 1 -> 2, rank 1's arguments disagree with rank 0's (check=False): both raise, and
    neither writes; then a call that agrees moves the blocks."""
    how = name.split("#")[1]
    src_layout, dst_layout, src_engine, dst_engine = MOVES["tp1->tp2"]
    seed = zlib.crc32(name.encode())
    dtype = torch.bfloat16 if how == "dtype" and me.rank == 1 else torch.float16
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed, dtype=dtype)
    r = resharder(me, src_layout, dst_layout)
    src_ids, dst_ids = ids_of(seed, CPU.nb)
    check = how == "own, check=True"
    if me.rank == 1 and how == "nb":
        dst_ids = dst_ids[:-1]
    if me.rank == 1 and how.startswith("own"):
        dst_ids = dst_ids[:5] + [CPU.blocks + 3] + dst_ids[6:]
    error, _ = call(r, src, src_ids, dst, dst_ids, check=check, timeout=20)
    result = {"error": error, "dst_ok": dst.equals(dst.before)}
    if how == "dtype":
        return result
    src_ids, dst_ids = ids_of(seed + 1, CPU.nb)
    error, _ = call(r, src, src_ids, dst, dst_ids, check=False, timeout=20)
    result["after"] = {"error": error, "dst_ok": dst.equals(dst.moved(model, src_ids, dst_ids))}
    return result


class Flip:
    """A block id whose __index__ names `first` once, then `then`."""

    def __init__(self, first, then):
        self.first, self.then, self.calls = first, then, 0

    def __index__(self):
        self.calls += 1
        return self.first if self.calls == 1 else self.then


def hostile(me, name):
    """Ids whose __index__ changes its answer (rank 0's sources, rank 1's destinations):
    the blocks the first read named move, on both ranks."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES["tp1->tp2"]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed)
    r = resharder(me, src_layout, dst_layout)
    src_ids, dst_ids = ids_of(seed, CPU.nb)
    want_src, want_dst = list(src_ids), list(dst_ids)
    unused = [b for b in range(CPU.blocks) if b not in dst_ids]
    if me.rank == 0:
        src_ids[3] = Flip(src_ids[3], CPU.blocks + 9)
        dst_ids[4] = Flip(dst_ids[4], unused[0])
    else:
        dst_ids[7] = Flip(dst_ids[7], CPU.blocks + 1)
    error, _ = call(r, src, src_ids, dst, dst_ids, check=False, timeout=20)
    return {"error": error, "dst_ok": dst.equals(dst.moved(model, want_src, want_dst))}


def silent_peer(me, name):
    """TP 1 -> 2 with one rank not calling: rank 1 (a receiver) calls alone, then rank 0 (a
    sender) calls alone, each raising PeerError naming the other within its timeout;
    then both call the same Resharders and the blocks move."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES["tp1->tp2"]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed)
    r = resharder(me, src_layout, dst_layout)
    src_ids, dst_ids = ids_of(seed, CPU.nb)
    result = {}
    for alone in (1, 0):
        me.barrier(f"{name} alone {alone}")
        if me.rank == alone:
            start = time.monotonic()
            result[f"alone {alone}"] = {"error": call(r, src, src_ids, dst, dst_ids, check=False, timeout=2)[0],
                                        "seconds": time.monotonic() - start, "dst_ok": dst.equals(dst.before)}
        me.barrier(f"{name} alone {alone} done")
    error, _ = call(r, src, src_ids, dst, dst_ids, check=False, timeout=20)
    result["after"] = {"error": error, "dst_ok": dst.equals(dst.moved(model, src_ids, dst_ids))}
    return result


def kill(me, name):
    """TP 1 -> 2 apart: rank 0 sends to ranks 1 and 2 and is killed (SIGKILL) as soon as one
    of its WRITEs is DONE (NIXL notifies the receiver of that piece then), having written
    which piece of which message it was to a file.  Ranks 1 and 2 must raise the same
    PeerError naming it within their timeout, each having unpacked at most that piece,
    whole or not at all."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES["tp1->tp2 apart"]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed)
    r = resharder(me, src_layout, dst_layout)
    src_ids, dst_ids = ids_of(seed, CPU.nb)
    marker = os.path.join(me.out, "killed-after")
    if me.rank == 0:
        agent, transport = me.transport._agent, me.transport

        def die_if_done(state, handle):
            if state == "DONE":
                peer, piece = next((key[2], xfer.handles.index(handle)) for key, xfer in transport._xfers.items()
                                   if handle in xfer.handles)
                with open(marker, "w") as f:
                    f.write(f"{peer} {piece}")
                os.kill(os.getpid(), signal.SIGKILL)
            return state

        post, check = agent.transfer, agent.check_xfer_state
        agent.transfer = lambda handle, note=b"": die_if_done(post(handle, note), handle)
        agent.check_xfer_state = lambda handle: die_if_done(check(handle), handle)
    start = time.monotonic()
    error, _ = call(r, src, src_ids, dst, dst_ids, check=False, timeout=3)
    seconds = time.monotonic() - start
    from kvbm_ext._pieces import cut

    peer, piece = map(int, open(marker).read().split())
    allowed = []
    if peer == me.rank:
        first, stop = cut(CPU.nb, 2 * CPU.nt * CPU.hd * 4 * CPU.nl * len(dst.heads))[piece]
        allowed = (src_ids[first:stop], dst_ids[first:stop])
    whole = dst.equals(dst.before) or (allowed and dst.equals(dst.moved(model, *allowed)))
    return {"error": error, "seconds": seconds, "written": dst.written_blocks(),
            "allowed": sorted(allowed[1]) if allowed else [], "whole": bool(whole)}


def die(me, name):
    """This rank ends its process (SIGKILL) here: a peer lost between calls."""
    os.kill(os.getpid(), signal.SIGKILL)


def restart(me, name):
    """TP 2 -> 1 (rank 1 receives); rank 1's first incarnation moves once and dies, the
    survivor's next call raises PeerError naming it, and a second incarnation of rank 1
    (same agent name) moves again with the survivor, which connects to it anew."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES["tp2->tp1"]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed)
    r = me.kept.get("restart") or me.kept.setdefault("restart", resharder(me, src_layout, dst_layout))
    src_ids, dst_ids = ids_of(seed, CPU.nb)
    timeout = float(name.split("#")[2])
    start = time.monotonic()
    error, _ = call(r, src, src_ids, dst, dst_ids, check=False, timeout=timeout)
    return {"error": error, "seconds": time.monotonic() - start,
            "dst_ok": dst is None or dst.equals(dst.moved(model, src_ids, dst_ids) if error is None else dst.before)}


def gpu_moves(me, name):
    """Llama-70B-like shapes (GPU: 8 layers) on two GPUs, vLLM packed K|V to SGLang pairs
    and back, bit for bit: check=False and True, wait=False, nb 64 and 8."""
    src_layout, dst_layout, src_engine, dst_engine = MOVES[name.split("#")[1]]
    seed = zlib.crc32(name.encode())
    model, src, dst = sides(me, src_layout, dst_layout, src_engine, dst_engine, seed, dtype=torch.bfloat16, shape=GPU)
    r = resharder(me, src_layout, dst_layout, GPU)
    calls = []
    for k, (nb, kwargs) in enumerate(((GPU.nb, {"check": False}), (8, {"check": True}), (GPU.nb, {"wait": False}))):
        src_ids, dst_ids = ids_of(seed + k, nb, GPU)
        error, stats = call(r, src, src_ids, dst, dst_ids, timeout=60, **kwargs)
        expected = dst.moved(model, src_ids, dst_ids) if dst is not None and error is None else None
        if dst is not None and expected is not None:
            dst.before = expected
        calls.append({"error": error, "stats": stats, "dst_ok": dst is None or (expected is not None and
                                                                                dst.equals(expected))})
    return {"calls": calls}


STEPS = {"moves": moves, "mismatch": mismatch, "hostile": hostile, "silent": silent_peer, "kill": kill,
         "die": die, "restart": restart, "gpu": gpu_moves}


def main():
    config = json.loads(sys.argv[1])
    # These messages are a few MiB: cut them as a large message is, so that pieces cross.
    from kvbm_ext import _pieces

    _pieces.SINGLE_PIECE_BYTES = 1 << 20
    me = Rank(config)
    me.run(config["steps"])
    if me.store is not None:
        me.store.set(f"finished/{me.rank}{config.get('suffix', '')}", b"1")
    # NIXL's agents and UCX's threads need not be torn down in order: leave at once
    os._exit(0)
