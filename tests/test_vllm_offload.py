"""kvbm_ext.integrations.vllm: the manager against vLLM's OffloadingManager contract, the
worker page by page against plain torch, and vLLM's real Scheduler with worker-role
OffloadingConnectors loading KvbmOffloadingSpec by spec_module_path (support/vllm_engine.py:
host caches, a local model config, a fake forward pass whose bytes depend on the token
prefix).  Skipped, with the reason, where vLLM is not importable (.ci/run installs it in
a venv of its own: tests/requirements-vllm.txt)."""

import logging
import math
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed (pip install -r tests/requirements-vllm.txt)")

from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    get_offload_group_idx,
    make_offload_key,
)

import kvbm_ext  # noqa: E402
from kvbm_ext.integrations import vllm as integration  # noqa: E402
from support import REPO_ROOT  # noqa: E402
from support.devices import DEFAULT_STAGING, SLEEP_CYCLES, sync  # noqa: E402
from support.vllm_engine import Engine, write_model_config  # noqa: E402

KEYS = [make_offload_key(bytes([i]) * 32, i % 2) for i in range(16)]


def needs_nixl():
    pytest.importorskip("nixl_cu13", reason="the disk and peer tiers need NIXL (pip install 'kvbm_ext[nixl]')")


@pytest.fixture
def peer_served(monkeypatch):
    """A serving process of kvbm_ext.peer (support/peer.py: UCX over TCP), and the
    kv_connector_extra_config keys of the peer tier naming it."""
    needs_nixl()
    from support.peer import UCX_ENV, Server, store_here

    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    server = Server(store_here(), "vllm")
    yield {"kvbm_tier": "peer", "kvbm_peer_name": "vllm", "kvbm_peer_store": server.address}, server
    server.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("llama"))


# ----------------------------------------------------------------------------------
# The manager


def stored(manager, keys):
    output = manager.prepare_store(keys, None)
    manager.complete_store(output.keys_to_store, None)
    return output


def test_manager_lookup_store_complete():
    manager = integration.KvbmOffloadingManager(4, enable_events=True)
    assert manager.lookup(KEYS[0], None) is LookupResult.MISS
    output = manager.prepare_store(KEYS[:2], None)
    assert output.keys_to_store == KEYS[:2] and output.evicted_keys == []
    assert sorted(output.store_spec.block_ids.tolist()) == [0, 1]
    assert manager.lookup(KEYS[0], None) is LookupResult.HIT_PENDING
    with pytest.raises(KeyError, match="still being stored"):
        manager.prepare_load([KEYS[0]], None)
    manager.complete_store(KEYS[:2], None)
    assert manager.lookup(KEYS[1], None) is LookupResult.HIT
    # Stored keys are not stored again.
    again = manager.prepare_store(KEYS[:3], None)
    assert again.keys_to_store == [KEYS[2]]
    events = list(manager.take_events())
    assert [(e.keys, e.removed) for e in events] == [(KEYS[:2], False)]
    assert events[0].medium == integration.MEDIUM
    assert list(manager.take_events()) == []


def test_manager_evicts_least_recently_used_ready_unpinned():
    manager = integration.KvbmOffloadingManager(4, enable_events=True)
    slots = stored(manager, KEYS[:4]).store_spec.block_ids.tolist()
    manager.touch([KEYS[0]], None)                     # 1, 2, 3, 0 from oldest
    load = manager.prepare_load([KEYS[1]], None)       # 1 is pinned while it loads
    assert load.block_ids.tolist() == [slots[1]]
    list(manager.take_events())
    output = manager.prepare_store([KEYS[4], KEYS[5]], None)
    assert output.evicted_keys == [KEYS[2], KEYS[3]]
    assert sorted(output.store_spec.block_ids.tolist()) == sorted([slots[2], slots[3]])
    assert [(e.keys, e.removed) for e in manager.take_events()] == [([KEYS[2], KEYS[3]], True)]
    # Keys being written and keys being read are never evicted; the keys of the call neither.
    assert manager.prepare_store([KEYS[6], KEYS[7]], None) is None
    manager.complete_store([KEYS[4], KEYS[5]], None)
    manager.complete_load([KEYS[1]], None)
    assert manager.prepare_store([KEYS[0], KEYS[6]], None).evicted_keys == [KEYS[1]]
    with pytest.raises(RuntimeError, match="was not being loaded"):
        manager.complete_load([KEYS[4]], None)


def test_manager_failed_store_frees_its_slots_silently():
    manager = integration.KvbmOffloadingManager(2, enable_events=True)
    output = manager.prepare_store(KEYS[:2], None)
    manager.complete_store(KEYS[:2], None, success=False)
    assert manager.lookup(KEYS[0], None) is LookupResult.MISS
    assert list(manager.take_events()) == []
    assert sorted(stored(manager, KEYS[2:4]).store_spec.block_ids.tolist()) == sorted(
        output.store_spec.block_ids.tolist())
    manager.reset_cache()
    assert manager.lookup(KEYS[2], None) is LookupResult.MISS and manager.num_stored == 0


def test_interface_check_names_the_missing_member(monkeypatch):
    monkeypatch.delattr(base.OffloadingWorker, "submit_load")
    with pytest.raises(ImportError, match=r"has no vllm\.v1\.kv_offload\.base\.OffloadingWorker\.submit_load; "
                                          r"written against vLLM 0\.33\.0, 0\.26\.0"):
        integration.check_vllm()


def test_interface_check_warns_on_another_version(monkeypatch):
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.warns(RuntimeWarning, match="written against vLLM 0.33.0, 0.26.0, this is 0.99.0"):
        assert integration.check_vllm() == "0.99.0"


def test_spec_names_what_it_expects(model_dir):
    with pytest.raises(ValueError, match=r"\['kvbm_tier'\]: 'tape'; expected one of \['disk', 'peer', 'pinned'\]"):
        Engine(model_dir, extra={"kvbm_tier": "tape"})
    with pytest.raises(ValueError, match="the peer tier needs 'kvbm_peer_name' and 'kvbm_peer_store'"):
        Engine(model_dir, extra={"kvbm_tier": "peer"})
    with pytest.raises(ValueError, match="expected 'kvbm_peer_bytes' .bytes for the whole engine. or 'kvbm_num_slots'"):
        Engine(model_dir, extra={"kvbm_tier": "peer", "kvbm_peer_name": "m", "kvbm_peer_store": "h:1",
                                 "kvbm_num_slots": None})
    with pytest.raises(ValueError, match="the disk tier needs 'kvbm_disk_path'"):
        Engine(model_dir, extra={"kvbm_tier": "disk"})
    with pytest.raises(ValueError, match="expected 'kvbm_disk_bytes' .bytes for the whole engine. or 'kvbm_num_slots'"):
        Engine(model_dir, extra={"kvbm_tier": "disk", "kvbm_disk_path": "/nonexistent", "kvbm_num_slots": None,
                                 "cpu_bytes_to_use": 1 << 30})
    with pytest.raises(ValueError, match="expected 'cpu_bytes_to_use' .bytes for the whole engine. or 'kvbm_num_slots'"):
        Engine(model_dir, extra={"kvbm_num_slots": None})
    # vLLM's CPU tier's key, its meaning: bytes for the whole engine, every worker's heads.
    layer_page = 4 * 16 * 2 * 32 * 2           # 4 heads, 16 tokens, K|V of 32, bf16
    chunk = 2 * layer_page * 2                 # 2 layers, 2 blocks a chunk
    engine = Engine(model_dir, tp=2, extra={"kvbm_num_slots": None, "cpu_bytes_to_use": 10 * chunk + 5,
                                            "blocks_per_chunk": 2})
    assert engine.manager.num_slots == 10 and engine.spec_workers[1].tier.pool.shape[0] == 20


# ----------------------------------------------------------------------------------
# The worker, page by page


def vllm_caches(num_layers, num_blocks, nh, nt, hd, device, gen, *, pad=0, heads_first=True, mla=False):
    """Per layer, a cache as vLLM allocates it (random bytes), its (num_blocks, page) int8
    view with a block stride `pad` bytes over the page, and the CanonicalKVCacheTensor."""
    shape = (nt, hd) if mla else ((nh, nt, 2 * hd) if heads_first else (nt, nh, 2 * hd))
    page = int(np.prod(shape)) * 2
    layers, canonical = [], []
    for _ in range(num_layers):
        raw = torch.randint(-128, 128, (num_blocks, page + pad), dtype=torch.int8, generator=gen).to(device)
        layers.append(raw[:, :page].view(torch.bfloat16).unflatten(1, shape))
        canonical.append(CanonicalKVCacheTensor(tensor=raw[:, :page] if pad == 0 else raw, page_size_bytes=page + pad))
    return layers, canonical, page


def universal_of(layer, block, heads_first=True, mla=False):
    """Plain torch: one block of a vLLM page as the pool's [nh, no, nt, hd]."""
    page = layer[block]
    if mla:
        return page[None, None]
    if not heads_first:
        page = page.transpose(0, 1)
    return page.unflatten(-1, (2, -1)).transpose(1, 2)


def test_worker_multi_group_unaligned_chunks_page_by_page(device, gen):
    """Two groups of their own tensors, 3 blocks a chunk, block_indices not on a chunk
    boundary: every pool block against a plain torch permute of its GPU page, then a load
    into other blocks against the GPU pages (vLLM's test_gpu_worker checks the same)."""
    nh, nt, hd, bpc = 2, 4, 8, 3
    layers, canonical, page = vllm_caches(4, 20, nh, nt, hd, device, gen, pad=64)
    refs = [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(2, page)],
            [CanonicalKVCacheRef(1, page), CanonicalKVCacheRef(3, page)]]
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=refs), tier=integration.PinnedTier(), num_slots=6,
        blocks_per_chunk=bpc, page=(torch.bfloat16, True, nh, nt, 2, hd))
    gpu_ids = [7, 3, 11, 5, 9, 2, 14, 6, 1]                 # group 0: 5 blocks from index 4, group 1: 4 from 2
    slots = [4, 1, 0, 5]
    assert worker.submit_store(10, GPULoadStoreSpec(gpu_ids, [5, 4], [4, 2]), integration.KvbmLoadStoreSpec(slots))
    worker.wait({10})
    assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [(10, True, 9 * 2 * page)]
    pool = worker.tier.pool
    expected_pool_blocks = [4 * 3 + 1, 4 * 3 + 2, 1 * 3, 1 * 3 + 1, 1 * 3 + 2] + [0 * 3 + 2, 5 * 3, 5 * 3 + 1, 5 * 3 + 2]
    for i, (gpu, pool_block) in enumerate(zip(gpu_ids, expected_pool_blocks)):
        for t in (refs[0] if i < 5 else refs[1]):
            assert torch.equal(pool[pool_block, :, t.tensor_idx].view(torch.int16).cpu(),
                               universal_of(layers[t.tensor_idx], gpu).view(torch.int16).cpu()), (i, t.tensor_idx)
    dst = [12, 13, 15, 16, 17, 18, 19, 0, 4]
    versions = [c.tensor._version for c in canonical]
    assert worker.submit_load(11, integration.KvbmLoadStoreSpec(slots), GPULoadStoreSpec(dst, [5, 4], [4, 2]))
    worker.wait({11})
    assert [r.job_id for r in worker.get_finished()] == [11]
    # Built without autograd's checks: a load bumps none of vLLM's version counters.
    assert [c.tensor._version for c in canonical] == versions
    for i, (a, b) in enumerate(zip(gpu_ids, dst)):
        for t in (refs[0] if i < 5 else refs[1]):
            assert torch.equal(layers[t.tensor_idx][b].view(torch.int16), layers[t.tensor_idx][a].view(torch.int16))
    worker.shutdown()


@pytest.mark.parametrize("kind", ["tokens_first", "mla", "raw"])
def test_worker_page_kinds(device, gen, kind):
    """vLLM's NHD pages, MLA pages ([nt, hd]) and raw pages (kept byte for byte)."""
    nh, nt, hd = 4, 16, 32
    mla, heads_first = kind == "mla", kind != "tokens_first"
    layers, canonical, page_bytes = vllm_caches(2, 12, nh, nt, hd, device, gen, heads_first=heads_first, mla=mla)
    page = None if kind == "raw" else (torch.bfloat16, heads_first, 1 if mla else nh, nt, 1 if mla else 2, hd)
    refs = [[CanonicalKVCacheRef(0, page_bytes), CanonicalKVCacheRef(1, page_bytes)]]
    worker = integration.KvbmOffloadingWorker(CanonicalKVCaches(tensors=canonical, group_data_refs=refs),
                                              tier=integration.PinnedTier(), num_slots=4, blocks_per_chunk=1,
                                              page=page)
    assert worker.submit_store(1, GPULoadStoreSpec([9, 2, 5], [3], [0]), integration.KvbmLoadStoreSpec([3, 0, 2]))
    worker.wait({1})
    pool = worker.tier.pool
    for gpu, slot in zip([9, 2, 5], [3, 0, 2]):
        for t in range(2):
            if kind == "raw":
                assert torch.equal(pool[slot, t].cpu(), canonical[t].tensor[gpu].cpu())
            else:
                want = universal_of(layers[t], gpu, heads_first, mla).view(torch.int16).cpu()
                assert torch.equal(pool[slot, :, t].view(torch.int16).cpu(), want)
    assert worker.submit_load(2, integration.KvbmLoadStoreSpec([0, 2]), GPULoadStoreSpec([10, 11], [2], [1]),
                              expedited=True)
    worker.wait({2})
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    for t in range(2):
        assert torch.equal(layers[t][10].view(torch.int16), layers[t][2].view(torch.int16))
        assert torch.equal(layers[t][11].view(torch.int16), layers[t][5].view(torch.int16))


class FailingTier(integration.PinnedTier):
    """Stores raise (a submission that cannot be made); loads end with an error."""

    def store(self, group, src_ids, slot_block_ids, stream):
        raise OSError("the tier is gone")

    def load(self, group, slot_block_ids, dst_ids, stream):
        handle = integration.DoneHandle()
        handle.error = OSError("read error")
        return handle


def test_worker_reports_failures(gen, caplog):
    layers, canonical, page = vllm_caches(1, 4, 2, 4, 8, "cpu", gen)
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=[[CanonicalKVCacheRef(0, page)]]), tier=FailingTier(),
        num_slots=2, blocks_per_chunk=1, page=None)
    with caplog.at_level(logging.ERROR, logger="kvbm_ext"):
        assert not worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), integration.KvbmLoadStoreSpec([0]))
        assert worker.submit_load(2, integration.KvbmLoadStoreSpec([0]), GPULoadStoreSpec([1], [1], [0]))
        worker.wait({2})            # the failure is kept for get_finished, not raised here
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, False)]
    assert "store job 1 was not submitted" in caplog.text and "job 2 failed: read error" in caplog.text
    # A spec whose sizes do not add up is refused, naming the job.
    with caplog.at_level(logging.ERROR, logger="kvbm_ext"):
        assert not worker.submit_load(3, integration.KvbmLoadStoreSpec([0, 1]), GPULoadStoreSpec([1], [1], [0]))
    assert "job 3: group sizes [1] cover 1 of 1 GPU blocks and 1 of 2 slots" in caplog.text


def run_two_group_job(worker, job_id, layers, slots, gpu_ids, store):
    """A store of GPU blocks `gpu_ids` into `slots`, or a load of them into blocks
    `gpu_ids` poisoned first (group 0: 5 blocks from index 4, group 1: 4 from index 2),
    waited for: whether the job succeeded."""
    spec = GPULoadStoreSpec(gpu_ids, [5, 4], [4, 2])
    if store:
        assert worker.submit_store(job_id, spec, slots)
    else:
        for layer in layers:
            layer.view(torch.uint8)[gpu_ids] = 0x5A
        assert worker.submit_load(job_id, slots, spec)
    worker.wait({job_id})
    (result,) = worker.get_finished()
    assert result.job_id == job_id
    return result.success


def disk_worker(tmp_path, device, gen, **options):
    """A worker over two groups of their own tensors (3 blocks a chunk) and a DiskTier."""
    needs_nixl()
    nh, nt, hd = 2, 4, 8
    layers, canonical, page = vllm_caches(4, 20, nh, nt, hd, device, gen, pad=64)
    refs = [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(2, page)],
            [CanonicalKVCacheRef(1, page), CanonicalKVCacheRef(3, page)]]
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=refs),
        tier=integration.DiskTier(tmp_path / "tier", "dp0-rank3", **options), num_slots=6, blocks_per_chunk=3,
        page=(torch.bfloat16, True, nh, nt, 2, hd))
    return worker, layers, refs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_disk_tier_round_trip_and_a_corrupted_slot(tmp_path, gen, device):
    """Two groups, unaligned chunks: blocks stored into the disk tier's files come back into
    other blocks bit-exact; then a byte flipped in one slot's payload on disk fails its load
    job, and that block alone is not written (it keeps the poison)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    worker, layers, refs = disk_worker(tmp_path, device, gen)
    names = sorted(p.name for p in (tmp_path / "tier").iterdir())
    assert names == ["kvbm-dp0-rank3-group0.pool", "kvbm-dp0-rank3-group1.pool"]
    gpu_ids = [7, 3, 11, 5, 9, 2, 14, 6, 1]                 # group 0: 5 blocks from index 4, group 1: 4 from 2
    slots = integration.KvbmLoadStoreSpec([4, 1, 0, 5])
    assert worker.submit_store(10, GPULoadStoreSpec(gpu_ids, [5, 4], [4, 2]), slots)
    worker.wait({10})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(10, True)]
    dst = [12, 13, 15, 16, 17, 18, 19, 0, 4]

    def load(job_id):
        return run_two_group_job(worker, job_id, layers, slots, dst, store=False)

    assert load(11)
    for i, (a, b) in enumerate(zip(gpu_ids, dst)):
        for t in (refs[0] if i < 5 else refs[1]):
            assert torch.equal(layers[t.tensor_idx][b].view(torch.int16), layers[t.tensor_idx][a].view(torch.int16))
    # Group 0's second block went to chunk 4's last block: pool block 14 of group 0's file.
    pool = worker.tier.pools[0]
    with open(pool.path, "r+b") as f:
        f.seek(pool._geometry.payload_offset(14) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert not load(12)
    for i, (a, b) in enumerate(zip(gpu_ids, dst)):
        for t in (refs[0] if i < 5 else refs[1]):
            got = layers[t.tensor_idx][b].view(torch.uint8)
            if i == 1 and t.tensor_idx in (0, 2):
                assert bool((got == 0x5A).all()), f"block {b} was written from a slot that failed verification"
            else:
                assert torch.equal(got, layers[t.tensor_idx][a].view(torch.uint8)), (i, t.tensor_idx)
    worker.shutdown()
    assert worker.tier.pools == []


def test_peer_tier_round_trip_and_a_dead_peer(peer_served, gen):
    """Two groups, unaligned chunks, through a PeerTier on a serving process: blocks come
    back into other blocks bit-exact; with the peer killed, the next load job fails and
    writes no block (they keep the poison); with the peer started again (fresh memory),
    a load of the old slots fails verification and writes none either, and a new store
    and load work."""
    keys, server = peer_served
    nh, nt, hd = 2, 4, 8
    layers, canonical, page = vllm_caches(4, 20, nh, nt, hd, "cpu", gen, pad=64)
    refs = [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(2, page)],
            [CanonicalKVCacheRef(1, page), CanonicalKVCacheRef(3, page)]]
    tier = integration.PeerTier(keys["kvbm_peer_name"], keys["kvbm_peer_store"], worker_index=1, timeout=5)
    worker = integration.KvbmOffloadingWorker(CanonicalKVCaches(tensors=canonical, group_data_refs=refs), tier=tier,
                                              num_slots=6, blocks_per_chunk=3,
                                              page=(torch.bfloat16, True, nh, nt, 2, hd))
    sizes = [pool.file_bytes for pool in tier.pools]
    assert [pool.offset for pool in tier.pools] == [sum(sizes), sum(sizes) + sizes[0]]       # worker 1's
    gpu_ids = [7, 3, 11, 5, 9, 2, 14, 6, 1]
    slots = integration.KvbmLoadStoreSpec([4, 1, 0, 5])
    dst = [12, 13, 15, 16, 17, 18, 19, 0, 4]
    expected = [layer.clone() for layer in layers]

    def run(job_id, store):
        return run_two_group_job(worker, job_id, layers, slots, gpu_ids if store else dst, store)

    def written():
        """Whether every dst block holds its source block (True), or every one the poison (False)."""
        moved = [(t.tensor_idx, a, b) for i, (a, b) in enumerate(zip(gpu_ids, dst)) for t in refs[i >= 5]]
        same = [torch.equal(layers[t][b].view(torch.int16), expected[t][a].view(torch.int16)) for t, a, b in moved]
        poisoned = [bool((layers[t][b].view(torch.uint8) == 0x5A).all()) for t, _, b in moved]
        assert all(same) or all(poisoned), "some blocks written, some not"
        return all(same)

    assert run(10, store=True)
    assert run(11, store=False) and written()
    server.kill()
    assert not run(12, store=False) and not written()
    server.start()
    assert not run(13, store=False) and not written()      # looks the peer up again: blank headers
    assert run(14, store=True)
    assert run(15, store=False) and written()
    worker.shutdown()
    assert tier.pools == []


class FakeEvent:
    """torch.cuda.Event on the CPU: record() logs where it was recorded; query() answers
    `done`, which the test sets."""

    def __init__(self, log):
        self.log, self.done = log, False

    def record(self, stream):
        self.done = False
        self.log.append(("record", self, stream))

    def query(self):
        return self.done


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self, event))


class LoggingTier(integration.Tier):
    """Moves nothing; logs each call and the stream it was given, all of it on the stream."""

    def __init__(self, log):
        self.log = log

    def attach(self, groups, num_slots, blocks_per_chunk):
        return

    def store(self, group, src_ids, slot_block_ids, stream):
        self.log.append(("store", group.index, stream))

    def load(self, group, slot_block_ids, dst_ids, stream):
        self.log.append(("load", group.index, stream))


def test_worker_stream_contract_with_reused_events(gen, monkeypatch):
    """The worker's CUDA path on stand-in streams and events: before each job's calls its
    stream waits on the fence recorded on the compute stream current then; after them
    one completion event (none per group) is recorded on that stream; jobs are reported
    in order, each once, when their event has completed; an event is used again only
    once its job was reported, so that the events made stay those of the jobs in flight."""
    layers, canonical, page = vllm_caches(2, 8, 2, 4, 8, "cpu", gen)
    log, made = [], []
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=[[CanonicalKVCacheRef(0, page)],
                                                              [CanonicalKVCacheRef(1, page)]]),
        tier=LoggingTier(log), num_slots=8, blocks_per_chunk=1, page=None)
    compute = FakeStream("compute", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Event", lambda: made.append(FakeEvent(log)) or made[-1])
    worker._fence = fence = FakeEvent(log)
    for direction, name in zip(worker._directions, ("stores", "loads", "expedited")):
        direction.stream = FakeStream(name, log)
    stores, loads = worker.store_jobs.stream, worker.load_jobs.stream

    def store(job_id):
        assert worker.submit_store(job_id, GPULoadStoreSpec([1, 2], [1, 1], [0, 0]),
                                   integration.KvbmLoadStoreSpec([job_id % 8, (job_id + 1) % 8]))

    store(1)
    assert log == [("record", fence, compute), ("wait", stores, fence), ("store", 0, stores), ("store", 1, stores),
                   ("record", made[0], stores)]
    store(2)
    assert worker.submit_load(3, integration.KvbmLoadStoreSpec([1]), GPULoadStoreSpec([4], [0, 1], [0, 0]))
    assert log[-4:] == [("record", fence, compute), ("wait", loads, fence), ("load", 1, loads),
                        ("record", made[2], loads)]
    assert len(made) == 3 and worker.get_finished() == []
    made[1].done = made[2].done = True          # job 2 ended, but not job 1 before it
    assert [r.job_id for r in worker.get_finished()] == [3]
    made[0].done = True
    assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [(1, True, 2 * page),
                                                                                       (2, True, 2 * page)]
    assert worker.get_finished() == []
    for job_id in range(4, 10):                 # one job in flight at a time: the three events made serve
        store(job_id)
        assert not log[-1][1].done and worker.get_finished() == []
        log[-1][1].done = True
        assert [r.job_id for r in worker.get_finished()] == [job_id]
    assert len(made) == 3


# ----------------------------------------------------------------------------------
# vLLM's Scheduler and connectors


def prompt(rng, length):
    return rng.integers(3, 1000, length).tolist()


def evict_from_gpu(engine, rng, count=6, length=96):
    """Requests of their own, one after another, until the GPU prefix cache has moved on."""
    for _ in range(count):
        engine.add_request(prompt(rng, length), max_tokens=2)
        engine.run()


def check_clean(engine):
    lost, twice = engine.drain()
    assert lost == {} and twice == {} and engine.failed == []


@pytest.mark.parametrize("variant", [
    pytest.param({}, id="one_group"),
    pytest.param({"groups": 2}, id="two_groups"),
    pytest.param({"extra": {"blocks_per_chunk": 2}}, id="two_blocks_a_chunk"),
    pytest.param({"extra": {"block_size": 48}}, id="three_blocks_a_chunk"),
    pytest.param({"tp": 2}, id="two_tp_ranks"),
    pytest.param({"extra": {"kvbm_pool_layout": "raw"}}, id="raw_pages"),
    pytest.param({"extra": {"kvbm_tier": "disk", "blocks_per_chunk": 2}, "tp": 2}, id="disk_tier_two_tp_ranks"),
    pytest.param({"extra": {"kvbm_tier": "disk", "kvbm_pool_layout": "raw"}, "groups": 2}, id="disk_tier_raw_pages"),
    pytest.param({"extra": {"kvbm_tier": "peer", "blocks_per_chunk": 2}, "tp": 2}, id="peer_tier_two_tp_ranks"),
    pytest.param({"extra": {"kvbm_tier": "peer", "kvbm_pool_layout": "raw"}, "groups": 2}, id="peer_tier_raw_pages"),
])
def test_store_evict_prefix_hit_and_load(model_dir, variant, tmp_path, request):
    """A prompt is stored, pushed out of the GPU by others, and comes back through a
    prefix hit into other GPU blocks, bit-exact; the stored pool blocks are the GPU's.
    The peer tier's memory is served by a process started apart (support/peer.py)."""
    rng = np.random.default_rng(1)
    variant = dict(variant)
    extra = {"kvbm_num_slots": 160, **variant.pop("extra", {})}
    disk, peer = extra.get("kvbm_tier") == "disk", extra.get("kvbm_tier") == "peer"
    if disk:
        needs_nixl()
        extra["kvbm_disk_path"] = str(tmp_path)
    if peer:
        extra.update(request.getfixturevalue("peer_served")[0])
    engine = Engine(model_dir, num_blocks=32, extra=extra, **variant)
    if disk:        # each worker's files of its own
        assert len(list(tmp_path.iterdir())) == engine.tp * variant.get("groups", 1)
    if peer:        # each worker's pools one after another in the peer's memory
        pools = [pool for worker in engine.spec_workers for pool in worker.tier.pools]
        assert len(pools) == engine.tp * variant.get("groups", 1)
        assert [pool.offset for pool in pools] == [sum(p.file_bytes for p in pools[:i]) for i in range(len(pools))]
    shared = prompt(rng, 100)
    first = engine.add_request(shared + [5], max_tokens=2)
    engine.run()
    first_blocks = 100 // 16
    assert engine.manager.num_stored >= 1
    if "kvbm_pool_layout" not in extra and not disk and not peer:
        # The pool blocks of the first chunk stored (the prompt's first), against the prefix they hold.
        key = next(iter(engine.manager._chunks))
        bpc = engine.spec_workers[0].blocks_per_chunk
        slot = int(engine.manager.prepare_load([key], None).block_ids[0])
        for rank in range(engine.tp):
            for layer in engine.group_layers[get_offload_group_idx(key)]:
                for j in range(bpc):
                    assert torch.equal(engine.pool_block(rank, slot * bpc + j, layer),
                                       engine.expected(rank, layer, first.all_token_ids, j))
        engine.manager.complete_load([key], None)
    evict_from_gpu(engine, rng)
    engine.add_request(shared + [9, 9], max_tokens=3)
    engine.run()
    check_clean(engine)
    loaded = engine.checked_blocks // (2 * engine.tp)
    chunk = engine.spec_workers[0].blocks_per_chunk
    assert loaded >= (first_blocks // chunk) * chunk - 1, f"{loaded} blocks loaded of a {first_blocks}-block prefix"


def test_tp_workers_share_one_pinned_region(model_dir):
    """Two TP workers of one engine map one /dev/shm region of universal blocks of every
    head: each writes its own heads of a block (worker 1's right after worker 0's), the
    stored bytes are each worker's KV; the last worker to close it takes the name away.
    kvbm_shared_pool=False gives each worker a pool of its own."""
    rng = np.random.default_rng(4)
    engine = Engine(model_dir, tp=2, num_blocks=32, extra={"kvbm_num_slots": 40})
    tiers = [worker.tier for worker in engine.spec_workers]
    name = tiers[0].buffer.shared
    assert name and name == tiers[1].buffer.shared and os.path.exists(f"/dev/shm/{name}")
    assert sorted(t.buffer.created for t in tiers) == [False, True]
    heads = engine.heads
    assert tiers[0].pool.stride(0) == 2 * heads * tiers[0].pool.stride(1)      # a block holds both workers' heads
    shared = prompt(rng, 100)
    first = engine.add_request(shared + [5], max_tokens=2)
    engine.run()
    check_clean(engine)
    key = next(iter(engine.manager._chunks))
    slot = int(engine.manager.prepare_load([key], None).block_ids[0])
    # Through worker 0's mapping alone: worker 1's heads are there too.
    shape = (tiers[0].pool.shape[0], 2 * heads) + tuple(tiers[0].pool.shape[2:])
    whole = torch.from_dlpack(tiers[0].buffer).view(torch.bfloat16)[:math.prod(shape)].view(shape)
    for rank in range(2):
        for layer in engine.group_layers[get_offload_group_idx(key)]:
            block = whole[slot, rank * heads:(rank + 1) * heads, layer].view(torch.uint8)
            assert torch.equal(torch.cat([block[:, 0], block[:, 1]], dim=-1).cpu(),
                               engine.expected(rank, layer, first.all_token_ids, 0))
    engine.manager.complete_load([key], None)
    del whole, block            # exports of the region hold it, as the workers' pools do
    for worker in engine.spec_workers:
        worker.shutdown()
    assert not os.path.exists(f"/dev/shm/{name}")
    private = Engine(model_dir, tp=2, num_blocks=32, extra={"kvbm_num_slots": 40, "kvbm_shared_pool": False})
    assert [w.tier.buffer for w in private.spec_workers] == [None, None]      # host caches: plain host memory


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["pinned", "disk", "peer"])
def test_thousand_requests_with_eviction(model_dir, tier, tmp_path, request):
    """1,000 requests over 150 shared prefixes, more than the GPU cache holds and than the
    tier holds (it evicts all along): every job reported once, none failed, every loaded
    block bit-exact."""
    rng = np.random.default_rng(2)
    extra = {"kvbm_num_slots": 200}
    if tier == "disk":
        needs_nixl()
        extra.update(kvbm_tier="disk", kvbm_disk_path=str(tmp_path))
    if tier == "peer":
        extra.update(request.getfixturevalue("peer_served")[0])
    engine = Engine(model_dir, num_blocks=48, extra=extra, max_batched_tokens=512)
    prefixes = [prompt(rng, int(rng.integers(32, 96))) for _ in range(150)]
    started = time.perf_counter()
    for i in range(1000):
        engine.add_request(prefixes[int(rng.integers(150))] + prompt(rng, int(rng.integers(1, 20))),
                           max_tokens=int(rng.integers(1, 4)))
        if i % 8 == 7:
            engine.run()
    engine.run()
    check_clean(engine)
    print(f"{len(engine.submitted)} jobs, {engine.checked_blocks} loaded block layers checked in "
          f"{time.perf_counter() - started:.1f} s")
    kinds = Counter(type(event).__name__ for event in engine.kv_events)
    print(f"{engine.evicted} chunks evicted from the tier; vLLM's events {dict(kinds)}")
    assert len(engine.submitted) > 1000 and engine.checked_blocks > 1000 and engine.evicted > 200
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0


# ----------------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["heads_first", "tokens_first", "mla"])
def test_gpu_worker_on_vllm_shaped_caches(gen, kind):
    """CUDA caches as vLLM allocates them (packed K|V, either order; MLA), pool in pinned
    memory: stores and loads bit-exact against a plain torch copy."""
    nh, nt, hd = 8, 16, 128
    mla, heads_first = kind == "mla", kind != "tokens_first"
    layers, canonical, page_bytes = vllm_caches(4, 64, nh, nt, 576 if mla else hd, "cuda", gen,
                                                heads_first=heads_first, mla=mla)
    page = (torch.bfloat16, heads_first, 1 if mla else nh, nt, 1 if mla else 2, 576 if mla else hd)
    refs = [[CanonicalKVCacheRef(t, page_bytes) for t in range(4)]]
    worker = integration.KvbmOffloadingWorker(CanonicalKVCaches(tensors=canonical, group_data_refs=refs),
                                              tier=integration.PinnedTier(), num_slots=16, blocks_per_chunk=2,
                                              page=page)
    src = [40, 3, 17, 9, 60]
    assert worker.submit_store(1, GPULoadStoreSpec(src, [5], [1]), integration.KvbmLoadStoreSpec([7, 2, 11]))
    worker.wait({1})                # vLLM loads a chunk only once its store is reported: the streams are apart
    dst = [0, 1, 2, 5, 6]
    assert worker.submit_load(2, integration.KvbmLoadStoreSpec([7, 2, 11]), GPULoadStoreSpec(dst, [5], [1]))
    worker.wait({2})
    assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [(1, True), (2, True)]
    pool_blocks = [15, 4, 5, 22, 23]
    for t, layer in enumerate(layers):
        want = torch.stack([universal_of(layer, b, heads_first, mla) for b in src]).cpu()
        assert torch.equal(worker.tier.pool[pool_blocks, :, t].view(torch.int16), want.view(torch.int16))
        assert torch.equal(layer[dst].view(torch.int16), layer[src].view(torch.int16))
    worker.shutdown()


@pytest.mark.gpu
def test_gpu_store_waits_for_the_compute_stream(gen):
    """A slow write to the KV on the compute stream, then submit_store at once: the
    stored bytes are the written ones (the worker's stream waits for the compute
    stream), submission did not wait on the host, and the job is not reported early."""
    nh, nt, hd = 8, 16, 128
    layers, canonical, page_bytes = vllm_caches(2, 16, nh, nt, hd, "cuda", gen)
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=[[CanonicalKVCacheRef(0, page_bytes),
                                                               CanonicalKVCacheRef(1, page_bytes)]]),
        tier=integration.PinnedTier(), num_slots=4, blocks_per_chunk=1, page=(torch.bfloat16, True, nh, nt, 2, hd))
    assert worker.submit_store(0, GPULoadStoreSpec([1], [1], [0]), integration.KvbmLoadStoreSpec([0]))
    worker.wait({0})
    worker.get_finished()
    fresh = [torch.randint(-128, 128, layer[3].shape, dtype=torch.int16, generator=gen).view(torch.bfloat16).cuda()
             for layer in layers]
    sync()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        for layer, new in zip(layers, fresh):
            layer[3].copy_(new)
        started = time.perf_counter()
        assert worker.submit_store(1, GPULoadStoreSpec([3], [1], [0]), integration.KvbmLoadStoreSpec([2]))
        elapsed = time.perf_counter() - started
        assert worker.get_finished() == [], "a store was reported while the compute stream still wrote its KV"
        handle = worker.store_jobs.jobs[0].handles[-1]  # the event after the job
        assert not handle.done()
        with pytest.raises(TimeoutError, match="not finished within 0.001 s"):
            handle.wait(timeout=0.001)
    assert elapsed < 0.05, f"submit_store blocked the host for {elapsed * 1e3:.1f} ms"
    handle.wait(timeout=30)
    assert handle.done() and handle.error is None
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    for t, new in enumerate(fresh):
        want = new.unflatten(-1, (2, -1)).transpose(1, 2).view(torch.int16).cpu()      # [nh, 2, nt, hd]
        assert torch.equal(worker.tier.pool[2, :, t].view(torch.int16), want)


@pytest.fixture
def default_staging():
    """The device's staging as the other tests assume it (DEFAULT_STAGING), restored
    after a test whose worker added lanes."""
    yield
    kvbm_ext.set_staging(DEFAULT_STAGING[0], lanes=DEFAULT_STAGING[1])


@pytest.mark.gpu
def test_gpu_expedited_load_passes_the_jobs_in_flight(gen, default_staging):
    """A store and a load held on their streams (a GPU sleep ahead of each), then an
    expedited load: it ends while both are still held, on a staging lane of its own,
    rather than after one of them, waiting for it to free its lane's slots; then all
    three are bit-exact."""
    nh, nt, hd = 8, 16, 128
    layers, canonical, page_bytes = vllm_caches(2, 16, nh, nt, hd, "cuda", gen)
    worker = integration.KvbmOffloadingWorker(
        CanonicalKVCaches(tensors=canonical, group_data_refs=[[CanonicalKVCacheRef(t, page_bytes)
                                                               for t in range(2)]]),
        tier=integration.PinnedTier(), num_slots=8, blocks_per_chunk=1, page=(torch.bfloat16, True, nh, nt, 2, hd))
    assert kvbm_ext.staging_info()["lanes"] == 3
    assert worker.submit_store(0, GPULoadStoreSpec([1, 2], [2], [0]), integration.KvbmLoadStoreSpec([0, 1]))
    worker.wait({0})
    assert [r.job_id for r in worker.get_finished()] == [0]
    for direction in (worker.store_jobs, worker.load_jobs):
        with torch.cuda.stream(direction.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
    assert worker.submit_store(1, GPULoadStoreSpec([3], [1], [0]), integration.KvbmLoadStoreSpec([2]))
    assert worker.submit_load(2, integration.KvbmLoadStoreSpec([0]), GPULoadStoreSpec([8], [1], [0]))
    assert worker.submit_load(3, integration.KvbmLoadStoreSpec([1]), GPULoadStoreSpec([9], [1], [0]),
                              expedited=True)
    held = [worker.store_jobs.jobs[0].handles[-1], worker.load_jobs.jobs[0].handles[-1]]
    worker.expedited_jobs.jobs[0].handles[-1].wait(timeout=30)
    assert not any(handle.done() for handle in held), "the expedited load waited for a job held on another stream"
    assert [r.job_id for r in worker.get_finished()] == [3]
    worker.wait({1, 2})
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    for t, layer in enumerate(layers):
        assert torch.equal(layer[9].view(torch.int16), layer[2].view(torch.int16))
        assert torch.equal(layer[8].view(torch.int16), layer[1].view(torch.int16))
        assert torch.equal(worker.tier.pool[2, :, t].view(torch.int16), universal_of(layer, 3).view(torch.int16).cpu())
    worker.shutdown()


@pytest.mark.gpu
def test_gpu_jobs_after_reregistration_move_fresh_bytes(gen):
    """Rounds of a store, right after the compute stream rewrote the blocks it reads, then
    a load of what it stored into other blocks, on two workers one after the other (caches
    registered anew, at other addresses): every round stores the bytes just written and
    loads them back, bit-exact, and with one job in flight at a time one CUDA event
    serves every job of a worker."""
    nh, nt, hd = 8, 16, 128
    for registration in range(2):
        layers, canonical, page_bytes = vllm_caches(2, 16, nh, nt, hd, "cuda", gen)
        worker = integration.KvbmOffloadingWorker(
            CanonicalKVCaches(tensors=canonical, group_data_refs=[[CanonicalKVCacheRef(t, page_bytes)
                                                                   for t in range(2)]]),
            tier=integration.PinnedTier(), num_slots=4, blocks_per_chunk=1,
            page=(torch.bfloat16, True, nh, nt, 2, hd))
        compute = torch.cuda.Stream()
        events = set()
        for round_ in range(3):
            src, dst, slots = [round_, 8 + round_], [12 + round_, 4 + round_], integration.KvbmLoadStoreSpec([1, 3])
            fresh = [torch.randint(-128, 128, layer[src].shape, dtype=torch.int16, generator=gen)
                     .view(torch.bfloat16).cuda() for layer in layers]
            sync()
            with torch.cuda.stream(compute):
                torch.cuda._sleep(SLEEP_CYCLES // 10)
                for layer, new in zip(layers, fresh):
                    layer[src] = new
                assert worker.submit_store(2 * round_, GPULoadStoreSpec(src, [2], [0]), slots)
            events.add(id(worker.store_jobs.jobs[0].handles[-1].event))
            # vLLM loads a chunk only once its store is reported.
            worker.wait({2 * round_})
            assert [r.job_id for r in worker.get_finished()] == [2 * round_]
            assert worker.submit_load(2 * round_ + 1, slots, GPULoadStoreSpec(dst, [2], [0]))
            events.add(id(worker.load_jobs.jobs[0].handles[-1].event))
            worker.wait({2 * round_ + 1})
            assert [r.job_id for r in worker.get_finished()] == [2 * round_ + 1]
            for layer, new in zip(layers, fresh):
                assert torch.equal(layer[dst].view(torch.int16), new.view(torch.int16)), (registration, round_)
        assert len(events) == 1, f"registration {registration}: {len(events)} CUDA events for 6 jobs one at a time"
        worker.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "disk"])
def test_gpu_connector_loop(model_dir, tier, tmp_path):
    """The Scheduler and connector loop with CUDA caches: store, eviction, load, bit-exact."""
    rng = np.random.default_rng(3)
    extra = {"kvbm_num_slots": 160}
    if tier == "disk":
        needs_nixl()
        extra.update(kvbm_tier="disk", kvbm_disk_path=str(tmp_path))
    engine = Engine(model_dir, num_blocks=32, extra=extra, device="cuda")
    shared = prompt(rng, 100)
    engine.add_request(shared + [5], max_tokens=2)
    engine.run()
    evict_from_gpu(engine, rng)
    engine.add_request(shared + [9], max_tokens=2)
    engine.run()
    check_clean(engine)
    assert engine.checked_blocks >= 2 * 5


@pytest.mark.slow
def test_cpu_example_runs():
    """examples/vllm_offload_cpu.py, as docs/vllm.md tells to run it."""
    script = os.path.join(REPO_ROOT, "examples", "vllm_offload_cpu.py")
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, script], env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "6 blocks loaded into GPU blocks" in run.stdout and "bit-exact" in run.stdout, run.stdout
