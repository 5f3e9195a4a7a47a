"""How a Resharder call cuts its messages into pieces (kvbm_ext._pieces), what a transport
may and may not do with an Exchange, and the KVBM_EXT_DEBUG lines of both transports.

In process: `cut` covers every block once, in order, with small first and last pieces and
few pieces whatever the size, the same from the same arguments (both ranks of a message
cut it alike); a scripted peer that unpacks pieces out of order moves the right blocks,
and one that unpacks before every header was compared is stopped; KVBM_EXT_DEBUG=1 logs
each message's pieces and their sizes, and NixlTransport's choice of staging for GPU
caches and why (UCX_TLS, a peer on another host without an RDMA NIC, or forced).
"""

import importlib.util
import logging

import pytest
import torch

import kvbm_ext
from kvbm_ext import EngineLayout, Resharder
from kvbm_ext._driver import Handle
from kvbm_ext._pieces import EDGE_DIVISOR, MAX_MIDDLE, SINGLE_PIECE_BYTES, cut

LLAMA_70B_HALF = 4 * 80 * 2 * 16 * 128 * 2      # one block's bytes of a TP 1 -> 2 message (4 of 8 heads)


@pytest.mark.parametrize("nb", [1, 2, 3, 7, 8, 16, 17, 64, 100, 1000, 4096])
@pytest.mark.parametrize("block_bytes", [2, 4096, 65536, LLAMA_70B_HALF, 64 << 20])
def test_pieces_cover_every_block_once_in_order(nb, block_bytes):
    pieces = cut(nb, block_bytes)
    assert pieces[0][0] == 0 and pieces[-1][1] == nb
    assert all(a < b for a, b in pieces) and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    assert len(pieces) <= 2 + MAX_MIDDLE
    if nb * block_bytes <= SINGLE_PIECE_BYTES or nb == 1:
        assert pieces == ((0, nb),)
    else:
        edge = -(-nb // EDGE_DIVISOR)
        assert pieces[0][1] - pieces[0][0] == pieces[-1][1] - pieces[-1][0] == min(edge, nb - edge)
    assert cut(nb, block_bytes) == pieces


def test_pieces_of_the_llama_70b_profile():
    # Whole up to 64 blocks (168 MB), where a call is bound by its host work; cut from 256.
    assert cut(64, LLAMA_70B_HALF) == ((0, 64),)
    assert cut(8, LLAMA_70B_HALF) == ((0, 8),)
    assert cut(256, LLAMA_70B_HALF) == ((0, 16), (16, 128), (128, 240), (240, 256))
    assert cut(0, LLAMA_70B_HALF) == ()


# --------------------------------------------------------------------------
# A scripted peer: rank 1 of 2 receives the whole model (2 heads x 3 layers) from rank 0,
# whose header and payload are played here.
# --------------------------------------------------------------------------

NH, NL, NO, NT, HD, NB = 2, 3, 2, 16, 64, 24


class Scripted:
    """Rank 1 of 2; answers with rank 0's header and fills each received piece p with its
    payload bytes, unpacking the pieces in `order` (default: last first)."""

    rank, world_size, pairwise = 1, 2, True

    def __init__(self, payload, order=None, early=False):
        self.payload, self.order, self.early, self.pieces = payload, order, early, []

    def exchange(self, call, background):
        from kvbm_ext._reshard import HEADER, HEADER_FIELDS

        [(peer, out)] = call.headers.items()
        mine = dict(zip(HEADER_FIELDS, HEADER.unpack(out)))
        theirs = dict(mine, writer=0, peer=1, sends=mine["expects"], expects=mine["sends"])
        [message] = call.recvs
        self.pieces.append(message.pieces)
        if self.early:
            call.unpack(0, 0, None)     # before the header came: refused by the Exchange
        assert call.compare(peer, HEADER.pack(*(theirs[f] for f in HEADER_FIELDS)))
        assert call.allow_writes(None)
        order = self.order or range(len(message.pieces) - 1, -1, -1)
        for p in order:
            start, stop = message.pieces[p]
            message.buffer[start:stop].copy_(self.payload[start:stop])
            call.unpack(0, p, None)
        handle = Handle("scripted")
        handle.finish()
        return handle


@pytest.fixture
def cut_small(monkeypatch):
    """Messages of this module's few MiB cut into pieces, as a large message is."""
    monkeypatch.setattr(kvbm_ext._pieces, "SINGLE_PIECE_BYTES", 1 << 20)


def _receiver(seed):
    gen = torch.Generator().manual_seed(seed)
    dst = [torch.randint(-999, 999, (NO, 2 * NB, NT, NH, HD), generator=gen).to(torch.float32) for _ in range(NL)]
    return dst, kvbm_ext.PagedKVCache(dst, "kbthd")


def test_pieces_unpacked_in_any_order_land_on_their_blocks(cut_small):
    dst, cache = _receiver(1)
    nbytes = NB * NH * NL * NO * NT * HD * 4
    gen = torch.Generator().manual_seed(2)
    universal = torch.randint(-999, 999, (NB, NH, NL, NO, NT, HD), generator=gen).to(torch.float32)
    transport = Scripted(universal.view(-1).view(torch.uint8))
    ids = torch.randperm(2 * NB, generator=gen)[:NB].tolist()
    expected = [d.clone() for d in dst]
    for l in range(NL):
        expected[l][:, ids] = universal[:, :, l].permute(2, 0, 3, 1, 4)
    Resharder(NH, NL, EngineLayout(1), EngineLayout(1, ranks=[1]), transport=transport)(
        None, None, cache, ids, check=False)
    assert len(transport.pieces[0]) == 3 and transport.pieces[0][-1][1] == nbytes, transport.pieces
    assert all(torch.equal(d, e) for d, e in zip(dst, expected))


def test_an_unpack_before_every_header_was_compared_is_stopped():
    dst, cache = _receiver(3)
    before = [d.clone() for d in dst]
    transport = Scripted(torch.zeros(NB * NH * NL * NO * NT * HD * 4, dtype=torch.uint8), early=True)
    resharder = Resharder(NH, NL, EngineLayout(1), EngineLayout(1, ranks=[1]), transport=transport)
    with pytest.raises(AssertionError, match="unpack before allow_writes"):
        resharder(None, None, cache, list(range(NB)), check=False)
    assert all(torch.equal(d, b) for d, b in zip(dst, before))


def test_debug_lines_name_each_message_s_pieces(cut_small, monkeypatch, caplog):
    dst, cache = _receiver(4)
    transport = Scripted(torch.zeros(NB * NH * NL * NO * NT * HD * 4, dtype=torch.uint8))
    resharder = Resharder(NH, NL, EngineLayout(1), EngineLayout(1, ranks=[1]), transport=transport)
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        resharder(None, None, cache, list(range(NB)), check=False)
        resharder(None, None, cache, list(range(NB)), check=False)      # the same cut: not logged again
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext"]
    block = NH * NL * NO * NT * HD * 4
    assert lines == [f"reshard: rank 1 receives {NB} blocks of {block} bytes from rank 0 in 3 pieces of 2, 20, 2 "
                     f"blocks ({2 * block}, {20 * block}, {2 * block} bytes), staging on cpu"], lines


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None,
                    reason="NIXL is not installed: pip install \"kvbm_ext[nixl]\" (nixl-cu13)")
def test_nixl_staging_choice_is_logged_with_its_reason(monkeypatch, caplog):
    from kvbm_ext import _nixl_wire as wire
    from kvbm_ext import nixl

    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    monkeypatch.delenv("UCX_TLS", raising=False)
    transport = nixl.NixlTransport(0, 3, "staging-test")
    here = nixl.socket.gethostname()
    for rank, host in ((1, here), (2, "elsewhere")):
        transport._peers[rank] = nixl._Peer(rank, wire.Record(rank, f"peer-{rank}", host, 1, b""))
    monkeypatch.setattr(nixl, "_rdma_devices", lambda: [])
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        assert transport.staging_device("cpu", 1) == "cpu"      # host caches: nothing to choose
        assert transport.staging_device("cuda:0", 1) == "cuda:0"
        assert transport.staging_device("cuda:0", 2) == "cpu"
        monkeypatch.setenv("UCX_TLS", "tcp")
        assert transport.staging_device("cuda:1", 1) == "cpu"
        monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy,cuda_ipc")
        assert transport.staging_device("cuda:2", 1) == "cuda:2"
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext"]
    assert lines == [
        "nixl: rank 0 stages its messages with rank 1 in device memory (UCX reaches GPU memory: the same host)",
        f"nixl: rank 0 stages its messages with rank 2 in pinned host memory (rank 2 is on elsewhere, and {here} "
        "has no RDMA NIC: TCP cannot reach GPU memory)",
        "nixl: rank 0 stages its messages with rank 1 in pinned host memory (UCX_TLS=tcp names no transport that "
        "reaches GPU memory)",
        "nixl: rank 0 stages its messages with rank 1 in device memory (UCX reaches GPU memory: the same host)",
    ], lines
    forced = nixl.NixlTransport(0, 2, "staging-forced", staging="pinned")
    assert forced.staging_device("cuda:0", 1) == "cpu"
