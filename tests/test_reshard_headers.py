"""What a Resharder call with check=False still guarantees, and block ids read once.

check=False skips the exchange of every rank's description, but not the pair's: the two
ranks of every message exchange a fixed-size header (plan digest, call number, dtype,
itemsize, number of blocks, cache geometry, bytes each way) before any payload is posted,
and compare the same two records with the same function.

In process: a scripted peer (a Transport playing rank 0) answers with a header that
differs in one field, and the call raises, naming it, with no payload posted and nothing
written, and the next agreeing call moves the blocks; a transport that cannot carry the
headers (carries_headers False, as TorchTransport over an NCCL-only group without NCCL
communicators of its own) refuses check=False before posting anything, and one that can
once prepared (as TorchTransport, whose prepare opens them) takes it; the C side's
header record is HEADER's size; every ids argument is read once (each __index__ called
once, a sequence read once) and the blocks the first read named move; a Resharder takes
caches of another dtype and geometry in a later call.

Over gloo (two spawned processes, one group, every call bounded by its timeout and the
whole run by a hard deadline, none reached), each disagreement that used to abort the
receiver inside gloo (fewer blocks), write bytes nobody sent (more blocks) or reinterpret
bits (another dtype of the same size, tokens_per_block and head_dim traded) is the same
ValueError on both ranks, naming both and the field, with nothing written; a rank whose
own arguments are refused tells its peer, which raises at once instead of waiting for the
timeout; and the group still works afterwards (the next call moves the blocks). An id
whose __index__ changes its answer, or a list that another id's __index__ mutates, moves
the blocks the first read named, on both ranks, where the later reads used to make one
rank raise after a partial write (or send other blocks) while the other returned success.
"""

import datetime
import importlib
import json
import os
import pickle
import time
import zlib
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kvbm_ext
from kvbm_ext import EngineLayout, Resharder
from kvbm_ext import _transport as transport_module
from kvbm_ext._driver import Handle
from support.ranks import run_case


def L(tp, pp=1, ranks=None, layer_ranges=None):
    return EngineLayout(tp, pp, ranks=ranks, layer_ranges=layer_ranges)


class Flip:
    """A block id whose __index__ gives `first` for its first `reads` calls and `then` after."""

    def __init__(self, first, then, reads=1):
        self.first, self.then, self.reads, self.calls = first, then, reads, 0

    def __index__(self):
        self.calls += 1
        return self.first if self.calls <= self.reads else self.then


class Mutate:
    """A block id (`value`) whose __index__ also sets `ids[at] = to`: the list it sits in."""

    def __init__(self, value, ids, at, to):
        self.value, self.ids, self.at, self.to, self.calls = value, ids, at, to, 0

    def __index__(self):
        self.calls += 1
        self.ids[self.at] = self.to
        return self.value


class Reads(Sequence):
    """A sequence of ids that counts how often it is read (len, items, iteration)."""

    def __init__(self, items):
        self.items, self.reads = list(items), 0

    def __len__(self):
        self.reads += 1
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return self.items[i]

    def __iter__(self):
        self.reads += 1
        return iter(list(self.items))


# --------------------------------------------------------------------------
# One rank: every ids argument is read once.
# --------------------------------------------------------------------------


def _finished():
    handle = Handle("scripted")
    handle.finish()
    return handle


class OneRank:
    rank, world_size = 0, 1

    def all_gather_object(self, obj, timeout):
        return [obj]

    def exchange(self, call, background):
        assert not call.sends and not call.recvs and call.headers is None
        call.allow_writes(call.stream)      # the local copy
        return _finished()


NH, NL, NO, NT, HD, NB = 2, 3, 2, 4, 8, 6


def _local_case(seed):
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    dst = [torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    return src, dst, kvbm_ext.PagedKVCache(src, "kbthd"), kvbm_ext.PagedKVCache(dst, "kbthd")


@pytest.mark.parametrize("check", [True, False])
def test_one_rank_reads_every_ids_argument_once(check):
    src, dst, src_cache, dst_cache = _local_case(11)
    expected = [d.clone() for d in dst]
    resharder = Resharder(NH, NL, L(1), L(1), transport=OneRank())
    # the source: an id that names block 3 once, then block 5; the destination: a sequence
    # that counts its reads, holding an id that names block 1 once, then one out of range
    src_flip, dst_flip = Flip(3, 5), Flip(1, NB + 7)
    src_ids, dst_ids = Reads([0, src_flip, 4]), Reads([2, dst_flip, 0])
    stats = resharder(src_cache, src_ids, dst_cache, dst_ids, check=check)
    assert stats.local_copies == 1
    assert (src_flip.calls, dst_flip.calls) == (1, 1), "an id's __index__ was called more than once"
    assert src_ids.reads <= 2 and dst_ids.reads <= 2, "a sequence was read more than once (len + iteration)"
    for e, s in zip(expected, src):
        e[:, [2, 1, 0]] = s[:, [0, 3, 4]]
    assert all(torch.equal(d, e) for d, e in zip(dst, expected)), "not the blocks the first read named"


@pytest.mark.parametrize("check", [True, False])
def test_one_rank_list_mutated_by_an_index_moves_the_first_read(check):
    src, dst, src_cache, dst_cache = _local_case(12)
    expected = [d.clone() for d in dst]
    resharder = Resharder(NH, NL, L(1), L(1), transport=OneRank())
    dst_ids = [4, None, 3]
    dst_ids[1] = Mutate(5, dst_ids, 2, 4)      # makes the list [4, ., 4]: a repeat, if read again
    src_ids = [1, None, 2]
    src_ids[1] = Mutate(0, src_ids, 0, NB + 1)     # makes src_ids[0] out of range, if read again
    resharder(src_cache, src_ids, dst_cache, dst_ids, check=check)
    assert (dst_ids[1].calls, src_ids[1].calls) == (1, 1)
    for e, s in zip(expected, src):
        e[:, [4, 5, 3]] = s[:, [1, 0, 2]]
    assert all(torch.equal(d, e) for d, e in zip(dst, expected))


@pytest.mark.parametrize("check", [True, False])
def test_one_rank_later_caches_of_another_kind(check):
    """The destination probe of a call follows its caches: a Resharder moves float32 blocks,
    then float16 blocks of another head_dim."""
    resharder = Resharder(NH, NL, L(1), L(1), transport=OneRank())
    for dtype, hd in ((torch.float32, HD), (torch.float16, 2 * HD)):
        gen = torch.Generator().manual_seed(16)
        src = [torch.randint(-99, 99, (NO, NB, NT, NH, hd), generator=gen).to(dtype) for _ in range(NL)]
        dst = [torch.zeros(NO, NB, NT, NH, hd, dtype=dtype) for _ in range(NL)]
        resharder(kvbm_ext.PagedKVCache(src, "kbthd"), [1, 4], kvbm_ext.PagedKVCache(dst, "kbthd"), [0, 3],
                  check=check)
        assert all(torch.equal(d[:, [0, 3]], s[:, [1, 4]]) for d, s in zip(dst, src))


# --------------------------------------------------------------------------
# One rank and a scripted peer: what each header field does, and a transport that
# cannot carry the headers.
# --------------------------------------------------------------------------


class ScriptedPeer:
    """Rank 1 of 2, whose peer (rank 0) is played here: it answers this rank's header with
    its own (this rank's record, as rank 0 would write it, changed by `edit`), and fills any
    payload this rank receives with 0x5A bytes.  Records what this rank posted."""

    rank, world_size = 1, 2

    def __init__(self, edit=None):
        self.edit, self.headers, self.payloads, self.call_numbers = edit, [], [], []

    def all_gather_object(self, obj, timeout):
        return [obj, obj]

    def exchange(self, call, background):
        from kvbm_ext._reshard import HEADER, HEADER_FIELDS

        [(peer, out)] = call.headers.items()
        mine = dict(zip(HEADER_FIELDS, HEADER.unpack(out)))
        self.call_numbers.append(mine["call"])
        theirs = dict(mine, writer=mine["peer"], peer=mine["writer"], sends=mine["expects"], expects=mine["sends"])
        if self.edit:
            theirs.update(self.edit)
        self.headers.append(peer)
        if call.compare(peer, HEADER.pack(*(theirs[f] for f in HEADER_FIELDS))) and call.allow_writes(None):
            for j, message in enumerate(call.recvs):
                message.buffer.fill_(0x5A)
                for p in range(len(message.pieces)):
                    call.unpack(j, p, None)
            self.payloads.append(([m.peer for m in call.sends], [m.peer for m in call.recvs]))
        return _finished()


class NoHeaders(ScriptedPeer):
    """A transport that cannot carry the headers (as TorchTransport over an NCCL-only group,
    own_nccl=False)."""

    carries_headers = False

    def exchange(self, call, background):
        raise AssertionError("nothing may be posted")


class HeadersOncePrepared(ScriptedPeer):
    """A transport that carries the headers once prepared (as TorchTransport over an NCCL-only
    group, whose prepare opens its header communicator)."""

    carries_headers = False

    def prepare(self, timeout):
        self.carries_headers = True


def _receiver_case(seed):
    """Rank 1 receives the whole model (2 heads x 3 layers) from rank 0: its destination cache."""
    gen = torch.Generator().manual_seed(seed)
    dst = [torch.randint(-99, 99, (NO, NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    return dst, kvbm_ext.PagedKVCache(dst, "kbthd")


# edit of the peer's header: (error type, words) this rank raises
HEADER_EDITS = {
    "nb": ({"nb": 4}, ValueError, "rank 0 and rank 1 disagree on the number of blocks: 4 on rank 0, 3 on rank 1"),
    "dtype": ({"dtype": 2}, ValueError, "disagree on the dtype: float16 on rank 0, float32 on rank 1"),
    "head_dim": ({"head_dim": 4}, ValueError, "disagree on the head_dim: 4 on rank 0, 8 on rank 1"),
    "plan": ({"plan": 12345}, ValueError, "disagree on the plan"),
    "call": ({"call": 7}, ValueError, "disagree on the call number: 7 on rank 0, 1 on rank 1"),
    "version": ({"version": 2}, ValueError, "disagree on the header version: 2 on rank 0, 1 on rank 1"),
    "sizes": ({"sends": 999}, ValueError, "disagree on the size of their messages: rank 0 sends 999 bytes"),
    "status": ({"status": 1}, TypeError, "rank 0 refused its own arguments in this call (it raised a TypeError"),
    "magic": ({"magic": 0}, RuntimeError, "the header from rank 0 is not a Resharder header"),
    "writer": ({"writer": 5}, RuntimeError, "the header from rank 0 is not a Resharder header"),
}


@pytest.mark.parametrize("field", HEADER_EDITS)
def test_a_disagreeing_header_refuses_the_call_before_any_payload(field):
    edit, error, words = HEADER_EDITS[field]
    dst, dst_cache = _receiver_case(14)
    before = [d.clone() for d in dst]
    transport = ScriptedPeer(edit)
    resharder = Resharder(NH, NL, L(1), L(1, ranks=[1]), transport=transport)
    with pytest.raises(error) as info:
        resharder(None, None, dst_cache, [5, 0, 2], check=False)
    assert words in str(info.value) and str(info.value).endswith("neither wrote any block"), str(info.value)
    assert transport.headers == [0] and transport.payloads == [], "a payload was posted"
    assert all(torch.equal(d, b) for d, b in zip(dst, before)), "the destination was written"
    # the peer agreeing now, the next call moves the block (the call number did not advance)
    transport.edit = None
    resharder(None, None, dst_cache, [5, 0, 2], check=False)
    assert transport.headers == [0, 0] and transport.payloads == [([], [0])]
    assert transport.call_numbers == [1, 1], "a refused call counted"
    assert all(torch.equal(d[:, [5, 0, 2]].view(torch.uint8), torch.full_like(d[:, [5, 0, 2]].view(torch.uint8), 0x5A))
               for d in dst)


def test_the_header_communicator_carries_a_header_and_a_gather_slot():
    """TorchTransport's NCCL header communicator swaps records of at most the C side's
    KV_NCCL_RECORD_MAX (as _C exports it): a check=False header, and a check=True call's
    description slot (its length, then the slot), or neither could cross."""
    native = importlib.import_module("kvbm_ext._C")
    transport = kvbm_ext._transport
    assert kvbm_ext._reshard.HEADER.size <= native._NCCL_RECORD_MAX
    assert transport._LENGTH.size + transport._GATHER_SLOT <= native._NCCL_RECORD_MAX


class RecordingComm:
    """A stand-in for the header communicator of rank `rank` of a group whose ranks hold
    `slots`: swap() answers each peer's slot, and records what it was given."""

    def __init__(self, slots, fail=False):
        self.slots, self.fail, self.swaps, self.aborted = slots, fail, [], False

    def swap(self, peers, records, timeout):
        self.swaps.append((peers, records, timeout))
        if self.fail:
            raise TimeoutError("the peers' records did not come")
        return b"".join(self.slots[peer] for peer in peers)

    def abort(self):
        self.aborted = True


def _transport_on(comm, rank, world):
    """A TorchTransport of rank `rank` of `world` ranks whose NCCL header communicator is
    `comm` (as prepare() leaves it), without a process group."""
    transport = object.__new__(kvbm_ext.TorchTransport)
    transport._rank, transport._global_ranks, transport._nccl = rank, list(range(world)), (RecordingComm({}), comm)
    return transport


def test_a_checked_calls_exchange_crosses_on_the_header_communicator():
    """all_gather_object over our communicator: one slot (its length, then the pickle) to
    every other rank, each rank's object back in rank order; no process group touched."""
    objects = [("fingerprint", None, (4, 2, 16, 64, "bfloat16", "cuda")), ("fingerprint", None, None),
               ("fingerprint", ("ValueError", "x" * 100), None)]
    slots = {}
    for rank, obj in enumerate(objects):
        data = pickle.dumps(obj)
        slots[rank] = transport_module._LENGTH.pack(len(data)) + data.ljust(transport_module._GATHER_SLOT, b"\0")
    comm = RecordingComm(slots)
    assert _transport_on(comm, 1, 3).all_gather_object(objects[1], 5.0) == objects
    (peers, records, timeout), = comm.swaps
    assert peers == (0, 2) and records == slots[1] * 2 and 0 < timeout <= 5.0


def test_a_checked_calls_exchange_that_never_comes_aborts_the_communicators():
    comm = RecordingComm({}, fail=True)
    transport = _transport_on(comm, 0, 2)
    with pytest.raises(TimeoutError, match="did not complete the exchange within 3"):
        transport.all_gather_object("mine", 3.0)
    assert comm.aborted and transport._nccl[0].aborted, "a timed-out exchange left a communicator open"


def test_a_transport_without_headers_refuses_check_false():
    dst, dst_cache = _receiver_case(15)
    before = [d.clone() for d in dst]
    resharder = Resharder(NH, NL, L(1), L(1, ranks=[1]), transport=NoHeaders())
    for ids in ([1, 2], [1, 99]):       # refused before any argument: the same error on every rank of a pair
        with pytest.raises(ValueError, match="check=False: the ranks of each pair compare a 128-byte header on the "
                                             "host before any payload, and this transport cannot carry it"):
            resharder(None, None, dst_cache, ids, check=False)
    assert all(torch.equal(d, b) for d, b in zip(dst, before))


def test_a_transport_that_carries_headers_once_prepared_takes_check_false():
    """The Resharder reads carries_headers after prepare, not when it starts being built."""
    dst, dst_cache = _receiver_case(17)
    transport = HeadersOncePrepared()
    resharder = Resharder(NH, NL, L(1), L(1, ranks=[1]), transport=transport)
    resharder(None, None, dst_cache, [4, 1], check=False)
    assert transport.headers == [0] and transport.payloads == [([], [0])]
    assert all(torch.equal(d[:, [4, 1]].view(torch.uint8), torch.full_like(d[:, [4, 1]].view(torch.uint8), 0x5A))
               for d in dst)


# --------------------------------------------------------------------------
# Two ranks over gloo.
# --------------------------------------------------------------------------

# PP 2 -> 1: rank 0 holds source stage 0 (layers 0-1) and sends it; rank 1 holds source
# stage 1 (layers 2-3, a local copy) and the whole destination.  SWAP: TP 2 -> TP 2 with
# the destination ranks swapped: one message each way.
PP = dict(num_heads=2, num_layers=4, src=L(1, 2), dst=L(1, ranks=[1]))
PP_UNEVEN = dict(num_heads=2, num_layers=4, src=L(1, 2, layer_ranges=[(0, 1), (1, 4)]), dst=L(1, ranks=[1]))
SWAP = dict(num_heads=2, num_layers=4, src=L(2), dst=L(2, ranks=[1, 0]))
NBLOCKS, GNB = 8, 5
CALL_TIMEOUT = 6.0
HARD_DEADLINE = 240
DIMS = dict(no=2, nt=4, hd=8, dtype=torch.float32)


def _model(gen, dims, heads=2, layers=4):
    return [torch.randint(-9999, 9999, (dims["no"], NBLOCKS, dims["nt"], heads, dims["hd"]), generator=gen)
            .to(dims["dtype"]) for _ in range(layers)]


def _caches(rank, layout, name, dims):
    """(source model, destination model, src_cache, dst layers, dst_cache) of this rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    src_model, dst_model = _model(gen, dims), _model(gen, dims)
    src_cache, dst, dst_cache = None, None, None
    for side, spec, model in (("src", layout["src"], src_model), ("dst", layout["dst"], dst_model)):
        position = spec.position_of(rank)
        if position is None:
            continue
        heads, layers = spec.heads_of(position[1], 2), spec.layers_of(position[0], 4)
        arrays = [model[l][:, :, :, heads.start:heads.stop].clone() for l in layers]
        if side == "src":
            src_cache = kvbm_ext.PagedKVCache(arrays, "kbthd")
        else:
            dst, dst_cache = (arrays, (heads, layers)), kvbm_ext.PagedKVCache(arrays, "kbthd")
    return src_model, dst_model, src_cache, dst, dst_cache


def _expected(dst_model, moves):
    """The destination model after moving src_model blocks: moves = (src_model, src ids, dst ids)."""
    out = [t.clone() for t in dst_model]
    for src_model, src_ids, dst_ids in moves:
        for l in range(len(out)):
            out[l][:, dst_ids] = src_model[l][:, src_ids]
    return out


def _matches(dst, model):
    if dst is None:
        return True
    arrays, (heads, layers) = dst
    return all(torch.equal(a, model[l][:, :, :, heads.start:heads.stop]) for a, l in zip(arrays, layers))


def _ids(name):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
    return torch.randperm(NBLOCKS, generator=gen)[:GNB].tolist(), torch.randperm(NBLOCKS, generator=gen)[:GNB].tolist()


def _call(resharder, rank, src_cache, src_ids, dst_cache, dst_ids, check):
    try:
        resharder(src_cache, src_ids if src_cache is not None else None, dst_cache,
                  dst_ids if dst_cache is not None else None, check=check, timeout=CALL_TIMEOUT)
        return None
    except Exception as caught:  # noqa: BLE001 - the type is the outcome
        return [type(caught).__name__, str(caught)]


def _mismatch(rank, name, resharders):
    """Rank 1 (or rank 0) passes arguments that do not fit its peer's; check=False."""
    layout, dims0, dims1 = PP, dict(DIMS), dict(DIMS)
    if name.startswith("both directions"):
        layout = SWAP
    if name == "dtype of the same size":
        dims0["dtype"], dims1["dtype"] = torch.float16, torch.bfloat16
    if name == "dtype of another size":
        dims0["dtype"], dims1["dtype"] = torch.float32, torch.float16
    if name == "tokens_per_block and head_dim traded":
        dims0["nt"], dims0["hd"] = 8, 4
    src_model, dst_model, src_cache, dst, dst_cache = _caches(rank, layout, "mismatch", dims0 if rank == 0 else dims1)
    src_ids, dst_ids = _ids(name)
    resharder = resharders["pp" if layout is PP else "swap"]
    if name in ("fewer blocks on the receiver", "both directions, fewer blocks on rank 1") and rank == 1:
        src_ids, dst_ids = src_ids[:-1], dst_ids[:-1]
    if name == "more blocks on the receiver" and rank == 0:
        src_ids, dst_ids = src_ids[:-1], dst_ids[:-1]
    if name == "another plan":
        if rank == 1:
            resharder = resharders["pp uneven"]
        src_model, dst_model, src_cache, dst, dst_cache = _caches(rank, PP if rank == 0 else PP_UNEVEN, "plan", DIMS)
    if name == "own arguments refused on rank 1" and rank == 1:
        dst_ids = dst_ids[:4] + [NBLOCKS]
    if name == "call number":
        resharder = resharders["pp call"]
        resharder(src_cache, src_ids if src_cache else None, dst_cache, dst_ids if dst_cache else None,
                  check=False, timeout=CALL_TIMEOUT)      # both ranks: call 1 of this Resharder
        dst_model = _expected(dst_model, [(src_model, src_ids, dst_ids)])
        if rank == 1:
            resharder = resharders["pp twin"]           # the same plan, at its first call
    error = _call(resharder, rank, src_cache, src_ids, dst_cache, dst_ids, check=False)
    return {"error": error, "dst_ok": _matches(dst, dst_model), "after": _moves(rank, name, layout, resharders)}


def _moves(rank, name, layout, resharders):
    """A correct call after a refused one: the group still works, and the blocks move."""
    src_model, dst_model, src_cache, dst, dst_cache = _caches(rank, layout, name + " after", DIMS)
    src_ids, dst_ids = _ids(name + " after")
    error = _call(resharders["pp" if layout is PP else "swap"], rank, src_cache, src_ids, dst_cache, dst_ids,
                  check=False)
    return {"error": error, "dst_ok": _matches(dst, _expected(dst_model, [(src_model, src_ids, dst_ids)]))}


def _hostile(rank, name, resharders):
    """Hostile id objects on one rank; the blocks the first read named must move, on both ranks."""
    check = name.endswith("check=True")
    src_model, dst_model, src_cache, dst, dst_cache = _caches(rank, PP, name, DIMS)
    src_ids, dst_ids = _ids(name)
    want_src, want_dst = list(src_ids), list(dst_ids)
    hostile = None
    free = [b for b in range(NBLOCKS) if b not in dst_ids][0]
    if name.startswith("dst __index__ changes") and rank == 1:
        # right for two reads (the check, the local copy), out of range for the message's unpack
        hostile = dst_ids[2] = Flip(dst_ids[2], NBLOCKS + 3, reads=2)
    if name.startswith("src __index__ changes") and rank == 0:
        hostile = src_ids[1] = Flip(src_ids[1], [b for b in range(NBLOCKS) if b not in src_ids][0])
    if name.startswith("dst list mutated") and rank == 1:
        hostile = dst_ids[1] = Mutate(dst_ids[1], dst_ids, 3, free)
    error = _call(resharders["pp"], rank, src_cache, src_ids, dst_cache, dst_ids, check=check)
    # rank 0 sends its layers, rank 1 copies its own: the whole model's blocks move
    ok = _matches(dst, _expected(dst_model, [(src_model, want_src, want_dst)]))
    return {"error": error, "dst_ok": ok, "index_calls": hostile and hostile.calls}


# name: (kind, expected): expected is None for success on both ranks, else per rank
# (error type, words the message holds). Run in this order.
SAME = "same"      # both ranks raise the same error
GLOO_CASES = {
    "fewer blocks on the receiver": ("mismatch", (SAME, "ValueError", "rank 0 and rank 1 disagree on the number of "
                                                  "blocks: 5 on rank 0, 4 on rank 1")),
    "more blocks on the receiver": ("mismatch", (SAME, "ValueError", "rank 0 and rank 1 disagree on the number of "
                                                 "blocks: 4 on rank 0, 5 on rank 1")),
    "dtype of the same size": ("mismatch", (SAME, "ValueError", "rank 0 and rank 1 disagree on the dtype: float16 "
                                            "on rank 0, bfloat16 on rank 1")),
    "dtype of another size": ("mismatch", (SAME, "ValueError", "disagree on the dtype: float32 on rank 0, float16 on "
                                           "rank 1")),
    "tokens_per_block and head_dim traded": ("mismatch", (SAME, "ValueError", "disagree on the tokens_per_block: 8 on "
                                                          "rank 0, 4 on rank 1")),
    "another plan": ("mismatch", (SAME, "ValueError", "disagree on the plan")),
    "both directions, fewer blocks on rank 1": ("mismatch", (SAME, "ValueError", "rank 0 and rank 1 disagree on the "
                                                             "number of blocks: 5 on rank 0, 4 on rank 1")),
    "call number": ("mismatch", (SAME, "ValueError", "disagree on the call number: 2 on rank 0, 1 on rank 1")),
    "own arguments refused on rank 1": ("mismatch", (("ValueError", "rank 1 refused its own arguments"),
                                                     ("ValueError", "dst_block_ids[4] on rank 1: block id 8 is out "
                                                                    "of range"))),
    "dst __index__ changes, check=False": ("hostile", None),
    "dst __index__ changes, check=True": ("hostile", None),
    "src __index__ changes, check=False": ("hostile", None),
    "src __index__ changes, check=True": ("hostile", None),
    "dst list mutated by another id's __index__, check=False": ("hostile", None),
    "dst list mutated by another id's __index__, check=True": ("hostile", None),
}
RUNNERS = {"mismatch": _mismatch, "hostile": _hostile}


def _gloo_worker(rank, store_path, out_dir, names):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    resharders = {key: Resharder(**layout, timeout=CALL_TIMEOUT) for key, layout in
                  (("pp", PP), ("pp call", PP), ("pp twin", PP), ("pp uneven", PP_UNEVEN), ("swap", SWAP))}
    results = {}
    for name in names:
        run = RUNNERS[GLOO_CASES[name][0]]
        run_case(results, name, lambda: run(rank, name, resharders), os.path.join(out_dir, f"rank{rank}.json"))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("headers")
    context = mp.start_processes(_gloo_worker, args=(str(out / "store"), str(out), list(GLOO_CASES)), nprocs=2,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + HARD_DEADLINE
    reached, died = False, None
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                reached = True
                break
    except Exception as error:  # noqa: BLE001 - a child that died (a signal, an exit): reported per case
        died = str(error)
    for process in context.processes:
        if process.is_alive():
            process.kill()
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else {}
                for r in range(2)]
    return reached, died, per_rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", GLOO_CASES)
def test_gloo_pairs_agree_before_any_payload(gloo_results, name):
    reached, died, per_rank = gloo_results
    results = [ranks.get(name) for ranks in per_rank]
    assert all(r is not None for r in results), (f"a rank did not report {name!r}: "
                                                 f"{'a process died: ' + died if died else ''} {per_rank}")
    assert all(r["ok"] for r in results), "\n".join(r.get("traceback", "") for r in results)
    assert all(r["seconds"] < CALL_TIMEOUT for r in results), ("a call waited for its timeout",
                                                               [r["seconds"] for r in results])
    kind, expected = GLOO_CASES[name]
    if expected is None:
        assert [r["error"] for r in results] == [None, None], [r["error"] for r in results]
        assert all(r["dst_ok"] for r in results), "not the blocks the arguments named (first read)"
        if kind == "hostile":
            assert [r["index_calls"] for r in results if r["index_calls"] is not None] == [1], \
                [r["index_calls"] for r in results]
        return
    per = [expected[1:], expected[1:]] if expected[0] == SAME else list(expected)
    for rank, (result, (error_type, words)) in enumerate(zip(results, per)):
        assert result["error"] is not None, f"rank {rank} returned without an error"
        assert result["error"][0] == error_type and words in result["error"][1], (rank, result["error"])
        assert result["dst_ok"], f"rank {rank}'s destination was written"
    if expected[0] == SAME:
        assert results[0]["error"] == results[1]["error"], "the ranks raised different errors"
    after = [r["after"] for r in results]
    assert [a["error"] for a in after] == [None, None], ("the next call failed", after)
    assert all(a["dst_ok"] for a in after), "the next call did not move the blocks"
    assert not reached and died is None, (reached, died)
