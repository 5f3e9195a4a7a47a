"""kvbm_ext.peer on the CPU: a serving process (`python -m kvbm_ext.peer`, started apart)
holds the pool's bytes; PeerPool stores host caches' blocks into it and loads them back
over NIXL (UCX over TCP), bit for bit against plain torch (tests/support/disk.py's
reference; destinations poisoned and compared whole); universal slots read back by
another head split; a peer that hangs or dies mid-use fails the jobs within their
timeout, naming it, with no block written; a restarted peer's fresh memory fails
verification, after which stores and loads work again.  Without NIXL everything here
is skipped, saying so."""

import time

import pytest
import torch

from support.disk import expect_round_trip, make, poisoned_copy, snapshot
from support.engines import Dims
from support.peer import UCX_ENV, Server, needs_nixl, store_here

pytestmark = [needs_nixl, pytest.mark.multiprocess]

ROUND_TRIP_S = 30


@pytest.fixture(autouse=True)
def ucx_over_tcp(monkeypatch):
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def served():
    """(store, server) shared by the module's tests that leave the peer alone."""
    store = store_here()
    server = Server(store, "shared")
    yield store, server
    server.close()


@pytest.fixture
def own():
    """(store, server) of one test: it may stop, kill and restart the peer."""
    store = store_here()
    server = Server(store, "own")
    yield store, server
    server.kill()


def peer_pool(store, name, like, num_slots=8, **options):
    from kvbm_ext.peer import PeerPool

    return PeerPool(name, store, num_slots, like=like, **options)


@pytest.mark.parametrize("name", ["vllm_packed", "sglang_mha", "flashinfer_hnd", "universal_pool"])
def test_round_trip_bit_exact(served, name, gen):
    """Blocks of an engine's cache into the peer's slots and back into other blocks,
    bit for bit; the source is untouched; offsets in the peer's memory keep pools apart."""
    store, _ = served
    e, memory, cache = make(name, gen)
    before = snapshot(memory)
    with peer_pool(store, "shared", cache, create=True, offset=1 << 20) as pool:
        src_ids, slots, dst_ids = [6, 0, 3], [5, 1, 7], [2, 4, 0]
        h = pool.store(cache, src_ids, slots)
        h.wait(ROUND_TRIP_S)
        assert h.error is None and h.nbytes == 3 * pool.slot_bytes and pool.generation(5) > 0
        _, dst_mem, dst_cache, dst_want = poisoned_copy(name, gen)
        pool.load(slots, dst_cache, dst_ids).wait(ROUND_TRIP_S)
        expect_round_trip(e, before, e, dst_mem, dst_want, src_ids, dst_ids)
    expect_round_trip(e, before, e, memory, before, [], [], what="source memory")


def test_universal_slots_read_by_another_head_split(served, gen):
    """Slots stored from a 4-head cache (TP 1) are read by two 2-head caches (TP 2 ranks),
    each its own heads of every slot; and reopened by a new pool (create=None), which finds
    them stored."""
    store, _ = served
    d4 = Dims(nl=3, nh=4, nt=4, hd=8, blocks=7)
    d2 = Dims(nl=3, nh=2, nt=4, hd=8, blocks=7)
    e, memory, cache = make("vllm_packed", gen, d=d4)
    before = snapshot(memory)
    with peer_pool(store, "shared", cache, create=True, offset=8 << 20) as pool:
        pool.store(cache, [1, 4], [0, 2], keys=[b"a", b"b"]).wait(ROUND_TRIP_S)
    with peer_pool(store, "shared", None, num_slots=None, offset=8 << 20) as pool:      # create=None: opens it
        assert pool.stored() == {0: (1, b"a"), 2: (2, b"b")} and pool.num_heads == 4
        for rank in range(2):
            dst, dst_mem, dst_cache, dst_want = poisoned_copy("sglang_mha", gen, d=d2)
            pool.load([2, 0], dst_cache, [5, 3], heads=slice(2 * rank, 2 * rank + 2)).wait(ROUND_TRIP_S)
            expect_round_trip(e, before, dst, dst_mem, dst_want, [4, 1], [5, 3], d_src=d4, d_dst=d2,
                              heads=slice(2 * rank, 2 * rank + 2))


def test_arguments_and_a_missing_peer(served):
    from kvbm_ext.peer import PeerLostError, PeerPool

    store, _ = served
    like = make("vllm_packed", torch.Generator().manual_seed(0))[2]
    with pytest.raises(ValueError, match="name: expected a non-empty str without '/'"):
        PeerPool("a/b", store, 4, like=like)
    with pytest.raises(ValueError, match="offset: expected a non-negative multiple of 4096, got 100"):
        PeerPool("shared", store, 4, like=like, offset=100)
    with pytest.raises(TypeError, match="store: expected an object with set"):
        PeerPool("shared", object(), 4, like=like)
    with pytest.raises(ValueError, match="the pool takes bytes 0 to .* of the peer's memory, which has 67108864"):
        PeerPool("shared", store, 100_000, like=like, create=True)
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="no peer 'ghost': the store's key 'kvbm_ext/peer/ghost' is not there "
                                            "after 0.5 s") as info:
        PeerPool("ghost", store, 4, like=like, connect_timeout=0.5)
    assert info.value.peer == "ghost" and time.monotonic() - started < 10


def test_a_peer_that_hangs_then_dies_mid_use(own, gen):
    """Slots stored; the peer stopped (SIGSTOP): a load fails once nothing of it completed
    within the pool's timeout, naming the peer, and writes no block; the peer killed: the
    next load fails at once, naming it, and writes no block, and the bounce slots of the
    hung load's transfers come back once they end."""
    from kvbm_ext.peer import PeerLostError

    store, server = own
    e, memory, cache = make("vllm_packed", gen)
    pool = peer_pool(store, "own", cache, create=True, timeout=2)
    pool.store(cache, [0, 1, 2], [0, 1, 2]).wait(ROUND_TRIP_S)
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
    server.stop()
    started = time.monotonic()
    h = pool.load([0, 1, 2], dst_cache, [3, 4, 5])
    with pytest.raises(PeerLostError, match="does not answer") as info:
        h.wait(30)
    assert info.value.peer == "own" and "peer 'own' (NIXL agent 'kvbm_ext.peer-own-" in str(info.value)
    assert time.monotonic() - started < 15
    expect_round_trip(e, snapshot(memory), e, dst_mem, dst_want, [], [], what="blocks after a hung peer")
    server.kill()
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="peer 'own'") as info:
        pool.load([0, 1], dst_cache, [3, 4]).wait(30)
    assert time.monotonic() - started < 15
    expect_round_trip(e, snapshot(memory), e, dst_mem, dst_want, [], [], what="blocks after a dead peer")
    # The hung load's transfers ended with the peer: their bounce slots are back.
    deadline = time.monotonic() + 15
    while len(pool._free) < pool.bounce_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool._free) == pool.bounce_slots
    pool.close(timeout=10)


def test_a_restarted_peer(own, gen):
    """The peer killed and started again (fresh memory, another incarnation): the first
    load fails on the lost connection, naming the peer; the next finds the new peer, whose
    blank headers fail verification (no block written); then stores and loads work, and a
    new pool over the same name opens the pool the old one wrote its superblock into."""
    from kvbm_ext.disk import SlotError
    from kvbm_ext.peer import PeerLostError, PeerPool

    store, server = own
    e, memory, cache = make("vllm_packed", gen)
    before = snapshot(memory)
    pool = peer_pool(store, "own", cache, create=True)
    pool.store(cache, [0, 1, 2], [0, 1, 2]).wait(ROUND_TRIP_S)
    first = pool.incarnation
    server.kill()
    server.start()
    _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen)
    with pytest.raises(PeerLostError, match="peer 'own'"):
        pool.load([0, 1], dst_cache, [3, 4]).wait(30)
    with pytest.raises(SlotError, match=r"slot 0: never written \(its header is blank\); slot 1: never written") \
            as info:
        pool.load([0, 1], dst_cache, [3, 4]).wait(30)
    assert sorted(info.value.reasons) == [0, 1] and pool.incarnation != first
    expect_round_trip(e, before, e, dst_mem, dst_want, [], [], what="blocks after a restart")
    pool.store(cache, [5, 6], [1, 4]).wait(ROUND_TRIP_S)
    pool.load([4, 1], dst_cache, [0, 2]).wait(ROUND_TRIP_S)
    expect_round_trip(e, before, e, dst_mem, dst_want, [6, 5], [0, 2])
    pool.close()
    with PeerPool("own", store, create=False) as again:
        assert sorted(again.stored()) == [1, 4]


@pytest.mark.gpu
def test_gpu_cache_round_trip(served, gen):
    """A CUDA cache's blocks through the peer and back into another CUDA cache, the load
    ordered on the caller's stream by wait_stream."""
    store, _ = served
    e, memory, cache = make("vllm_packed", gen, device="cuda")
    before = snapshot(memory)
    with peer_pool(store, "shared", cache, create=True, offset=16 << 20) as pool:
        pool.store(cache, [1, 2, 6], [0, 3, 4]).wait(ROUND_TRIP_S)
        _, dst_mem, dst_cache, dst_want = poisoned_copy("vllm_packed", gen, device="cuda")
        h = pool.load([4, 0, 3], dst_cache, [5, 0, 1])
        h.wait_stream(torch.cuda.current_stream())
        h.wait(ROUND_TRIP_S)
        torch.cuda.synchronize()
        expect_round_trip(e, before, e, dst_mem, dst_want, [6, 1, 2], [5, 0, 1])
