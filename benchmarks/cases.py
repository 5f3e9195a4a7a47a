"""The cases kvbench.py times: the Llama-3.1-70B profile (harness.py's, in bf16), the buffers, the pure-torch
references every case is verified against, the groups of GPU cases (list, operational,
copy, paged), the ceilings measured in the same run, and the CPU cases.  Each case
becomes a row (report.py) through run_gpu_case or run_cpu_case: verified bit for bit
first, then timed (harness.py)."""

import math
import os
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import kvbm_ext
from harness import (HD, NH, NL, NO, RepPolicy, cuda_synchronize, fill_random_, no_synchronize, run_once,
                     steady_host_us, time_cpu_calls, time_gpu_calls)
from report import make_row, print_progress


# ----------------------------------------------------------------------------- profile

DTYPE = torch.bfloat16

# (direction, kvbm_ext function, whether it writes side b of the pairing)
LIST_DIRECTIONS = (("b2u", "block_to_universal", True), ("u2b", "universal_to_block", False))
BLOCK_OP_DIRECTIONS = (("b2o", "block_to_operational", True),
                       ("o2b", "operational_to_block", False))
UNIVERSAL_OP_DIRECTIONS = (("u2o", "universal_to_operational", True),
                           ("o2u", "operational_to_universal", False))
COPY_DIRECTIONS = (("d2h", True), ("h2d", False))      # side a on the device, side b pinned

# PagedKVCache methods (and TorchLoop's): side a is the cache, side b the universals / operationals
PAGED_DIRECTIONS = (("b2u", "to_universal", True), ("u2b", "from_universal", False))
PAGED_OP_DIRECTIONS = (("b2o", "to_operational", True), ("o2b", "from_operational", False))
PAGED_DIMS = {"NHD": "kbthd", "HND": "kbhtd"}          # a per-layer cache [no, num_blocks, *chunk]
ID_KINDS = ("host_ids", "device_ids")    # block_ids as a list of ints, as an int64 CUDA tensor
ID_SEED = 2026                           # the spread block ids are the same in every run
CTAS_SWEEP = (8, 16, 32)                 # num_ctas swept at CTAS_NB, next to None (all SMs)
CTAS_NB = 64                             # (the largest --nb when 64 is not in it)
BACKENDS = ("kernel", "async", "batch", "auto")
MEMCPY_BATCH_MODES = ("batched_with_fallback", "fallback_only", "batch_without_fallback")

# Backends that may put one copy per chunk on the copy engines (memcpy_batch does, in every
# mode): more operations than a stream queues, so timing takes them as "fed" at once.
QUEUE_BOUND = ("async", "batch", "auto")

REQUIRED = {
    "list": ("block_to_universal", "universal_to_block"),
    "operational": ("block_to_operational", "operational_to_block", "universal_to_operational",
                    "operational_to_universal", "is_memcpy_batch_available"),
    "copy": ("vectorized_copy", "memcpy_batch", "is_memcpy_batch_available"),
    "paged": ("PagedKVCache", "block_to_universal", "universal_to_block"),
}

MIB = 1 << 20
GPU_L2_FALLBACK = 60 * MIB
CPU_L3_FALLBACK = 32 * MIB
CACHE_MULTIPLE = 3                      # rotate buffers until the working set is 3x the cache
MAX_SETS = 64
STEADY_MAX_NB = 64                      # paged rows get a steady host time up to this nb (larger calls take long)


# ----------------------------------------------------------------------------- data

def block_bytes(nt):
    return NL * NO * nt * NH * HD * DTYPE.itemsize


def chunk_shape(nt, layout):
    return (nt, NH, HD) if layout == "NHD" else (NH, nt, HD)


def arena_shape(num_blocks, nt):
    """num_blocks operational blocks [nl, no, nt*nh*hd]; the other forms are views of it."""
    return (num_blocks, NL, NO, nt * NH * HD)


def new_arena(num_blocks, nt, device):
    return torch.empty(arena_shape(num_blocks, nt), dtype=DTYPE, device=device)


def pinned_arena(pool, num_blocks, nt):
    """The front of the pinned pool as an arena (the pool is allocated once: pinning is slow)."""
    return pool[:num_blocks * block_bytes(nt)].view(DTYPE).view(arena_shape(num_blocks, nt))


def layer_caches(arena, nt, layout):
    """An arena seen as a vLLM block stack: per layer, a cache [no, num_blocks, *chunk]."""
    stack = arena.view((NL, NO, arena.shape[0]) + chunk_shape(nt, layout))
    return list(stack.unbind(0))


def as_universals(arena, nt):
    return arena.view(arena.shape[0], NH, NL, NO, nt, HD)


def block_views(caches, block_ids):
    """The `blocks` argument: per block, its nl*no chunk views in [layer][outer] order."""
    return [[caches[l][o, b] for l in range(NL) for o in range(NO)] for b in block_ids]


def rotation_sets(working_set_bytes, cache_bytes):
    """Buffer sets to rotate through so repeated calls do not run out of the cache."""
    return max(1, min(MAX_SETS, math.ceil(CACHE_MULTIPLE * cache_bytes / working_set_bytes)))


def set_slices(arena, nb, nsets):
    """Rotation set s: blocks [s*nb, (s+1)*nb) of the arena, as one tensor."""
    return [arena[s * nb:(s + 1) * nb] for s in range(nsets)]


def tensor_sets(arena, nb, nsets):
    """Per rotation set, its nb blocks as separate tensors."""
    return [list(blocks.unbind(0)) for blocks in set_slices(arena, nb, nsets)]


def block_sets(caches, nb, nsets):
    """Per rotation set, the chunk views of its nb blocks."""
    return [block_views(caches, range(s * nb, (s + 1) * nb)) for s in range(nsets)]


def spread_ids(nb, nsets):
    """Per rotation set, nb block ids out of nsets*nb blocks: a random permutation (fixed
    seed) cut into nsets parts, so the sets are disjoint and each is spread over the cache."""
    order = np.random.default_rng(ID_SEED).permutation(nsets * nb)
    return [order[s * nb:(s + 1) * nb].tolist() for s in range(nsets)]


def chunk_pointers(blocks):
    """Addresses of every chunk of the blocks, in block, layer, outer order."""
    return np.array([chunk.data_ptr() for chunks in blocks for chunk in chunks], dtype=np.uint64)


def operational_chunk_pointers(operationals):
    """Addresses of every chunk [l, o, :] of operational blocks, in the same order."""
    offsets = np.arange(NL * NO, dtype=np.uint64) * np.uint64(operationals[0][0, 0].nbytes)
    return np.concatenate([np.uint64(op.data_ptr()) + offsets for op in operationals])


def block_pointers(tensors):
    return np.array([t.data_ptr() for t in tensors], dtype=np.uint64)


def on_device(pointers, device):
    """A host address list as a torch int64 tensor on the device."""
    return torch.from_numpy(pointers.view(np.int64)).to(device)


# ----------------------------------------------------------------------------- correctness

def reference_universal(chunks, layout):
    """Pure-torch universal [nh, nl, no, nt, hd] of one block's chunks."""
    stacked = torch.stack(chunks)
    stacked = stacked.view((NL, NO) + tuple(stacked.shape[1:]))
    order = (3, 0, 1, 2, 4) if layout == "NHD" else (2, 0, 1, 3, 4)
    return stacked.permute(order)


def reference_operational(chunks):
    """Pure-torch operational [nl, no, inner] of one block's chunks."""
    return torch.stack(chunks).view(NL, NO, -1)


def operational_of_universal(universal, layout):
    """Pure-torch operational of a universal, [nl, no, nt, nh, hd] (NHD) or [nl, no, nh, nt, hd]."""
    return universal.permute((1, 2, 3, 0, 4) if layout == "NHD" else (1, 2, 0, 3, 4))


def bitwise_equal(actual, expected):
    """Same bits, compared on expected's device; actual is reshaped to expected's shape."""
    actual = actual.to(expected.device).reshape(expected.shape)
    return torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def chunks_match_universal(chunks, universal, layout):
    return bitwise_equal(universal, reference_universal(chunks, layout))


def chunks_match_operational(chunks, operational):
    return bitwise_equal(operational, reference_operational(chunks))


def universal_matches_operational(universal, operational, layout):
    expected = operational_of_universal(universal.to(operational.device), layout)
    return bitwise_equal(operational, expected)


def same_block(device_block, other):
    return bitwise_equal(other, device_block)


@dataclass
class Pairing:
    """Two sides that hold the same blocks in two forms, per rotation set (a block is a list
    of chunk views or one tensor), and the bitwise relation between block i of side a and
    block i of side b that a call converting either side into the other establishes."""
    a: list
    b: list
    relation: object


@dataclass
class Case:
    fields: dict          # the row fields that name the case
    link: str             # d2d, d2h or h2d (pinned: the way over PCIe), host (CPU)
    calls: list           # one per rotation set
    pairing: Pairing
    writes_b: bool        # the call writes side b (else side a)
    queue_bound: bool     # may enqueue more operations than a stream queues (QUEUE_BOUND)


def checked_ids(nb):
    """Blocks verified per case: first, middle, last."""
    return sorted({0, nb // 2, nb - 1})


def block_tensors(block):
    """The tensors of one block of a side: its chunk views, or its own tensor."""
    return block if isinstance(block, list) else [block]


def verify(case, synchronize, gen_device):
    """Poison the destination of the checked blocks of rotation set 0 with fresh random bits,
    run the call on it once from an idle device (the timing's warm-up) and check the relation
    on those blocks.  Returns (exact, run_once's times)."""
    a, b = case.pairing.a[0], case.pairing.b[0]
    ids = checked_ids(len(a))
    for i in ids:
        for tensor in block_tensors(b[i] if case.writes_b else a[i]):
            fill_random_(tensor, gen_device)
    first = run_once(case.calls[0], synchronize)
    return all(case.pairing.relation(a[i], b[i]) for i in ids), first


# ----------------------------------------------------------------------------- rows

@dataclass
class Context:
    gpu_name: str
    date: str
    policy: RepPolicy


def gbps(nbytes, us):
    """GB/s (1e9 bytes) of a call that moves nbytes: each byte counted once, as it leaves
    its source for its destination (never read + written)."""
    return nbytes / (us * 1e3) if us and not math.isnan(us) else math.nan


def timed_fields(timing, nbytes, ceiling_gbps=None, memcpy_gbps=None):
    """Row fields of a GPU timing; percentages of the ceiling and of the same-size memcpy."""
    rate = gbps(nbytes, timing.gpu_us)
    fields = dict(gpu_us=timing.gpu_us, host_us=timing.host_us, gbps=rate, reps=timing.reps,
                  uncovered_reps=timing.uncovered, gpu_timing=timing.method)
    if ceiling_gbps is not None:
        fields.update(ceiling_gbps=ceiling_gbps, pct_of_ceiling=100 * rate / ceiling_gbps)
    if memcpy_gbps is not None:
        fields.update(same_size_memcpy_gbps=memcpy_gbps,
                      pct_same_size_memcpy=100 * rate / memcpy_gbps)
    return fields


def run_checked(row, case, synchronize, gen_device, measure):
    """Verify the case, then fill the row with measure(first run's times).  A mismatch or an
    exception goes into the row's status instead.  Prints and returns the row."""
    try:
        exact, first = verify(case, synchronize, gen_device)
        if exact:
            row.update(measure(first))
        else:
            row["status"] = "MISMATCH"
    except Exception as exc:  # report the case and go on with the others
        row["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
    print_progress(row)
    return row


# ----------------------------------------------------------------------------- ceilings

def time_copy_row(ctx, cycles_per_us, fields, calls, nbytes, ceiling_gbps=None):
    """A ceiling row: torch copy_ calls, timed after a warm-up run."""
    first = run_once(calls[0], cuda_synchronize)
    timing = time_gpu_calls(calls, ctx.policy, cycles_per_us, first)
    row = make_row(ctx, mode="ceiling", function="copy_", **fields,
                   **timed_fields(timing, nbytes, ceiling_gbps))
    print_progress(row)
    return row


def measure_ceilings(ctx, device, quick, cycles_per_us):
    """Copy ceilings: device-to-device, pinned H2D and D2H."""
    d2d_bytes = (256 if quick else 2048) * MIB
    host_bytes = (64 if quick else 1024) * MIB

    src = torch.empty(d2d_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fill_random_(src, device)
    fill_random_(dst, device)
    rows = {"d2d": time_copy_row(ctx, cycles_per_us,
                                 dict(direction="d2d", placement="device", bytes=d2d_bytes, sets=1),
                                 [lambda: dst.copy_(src, non_blocking=True)], d2d_bytes)}
    del src, dst

    pinned = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)
    fill_random_(pinned, device)
    fill_random_(dev, device)
    fields = dict(placement="pinned", bytes=host_bytes, sets=1)
    rows["h2d"] = time_copy_row(ctx, cycles_per_us, dict(fields, direction="h2d"),
                                [lambda: dev.copy_(pinned, non_blocking=True)], host_bytes)
    rows["d2h"] = time_copy_row(ctx, cycles_per_us, dict(fields, direction="d2h"),
                                [lambda: pinned.copy_(dev, non_blocking=True)], host_bytes)
    del pinned, dev
    torch.cuda.empty_cache()
    return rows


def measure_same_size_memcpys(ctx, gpu, shape):
    """A pinned memcpy of exactly one call's bytes each way, rotating over the shape's sets."""
    fields = dict(placement="pinned", nt=shape.nt, nb=shape.nb, bytes=shape.nbytes,
                  sets=shape.nsets)
    device = set_slices(shape.device_a, shape.nb, shape.nsets)
    pinned = set_slices(shape.pinned, shape.nb, shape.nsets)
    calls = {"d2h": [partial(h.copy_, d, non_blocking=True) for d, h in zip(device, pinned)],
             "h2d": [partial(d.copy_, h, non_blocking=True) for d, h in zip(device, pinned)]}
    return {link: time_copy_row(ctx, gpu.cycles_per_us, dict(fields, direction=link),
                                calls[link], shape.nbytes, gpu.ceilings[link]["gbps"])
            for link in ("d2h", "h2d")}


# ----------------------------------------------------------------------------- GPU cases

@dataclass
class Gpu:
    device: torch.device
    stream: object
    cycles_per_us: float
    ceilings: dict       # d2d, h2d, d2h -> ceiling row
    batch: bool          # kvbm_ext.is_memcpy_batch_available()
    sms: int             # multiprocessors (kvbm_ext.cuda_devices())
    ctas_nb: int         # nb of the paged group's num_ctas sweep


@dataclass
class Shape:
    """One (nt, nb) of the GPU cases: nsets rotation sets of nb blocks, in four random-filled
    arenas of nsets*nb blocks each."""
    nt: int
    nb: int
    nsets: int
    stack: torch.Tensor      # device, seen as the vLLM block stack (layer_caches)
    device_a: torch.Tensor   # device operationals; universals of the list API's d2d cases
    device_b: torch.Tensor   # device universals of universal <-> operational d2d cases
    pinned: torch.Tensor     # pinned host operationals or universals
    blocks: dict             # layout -> per rotation set, the chunk views of its blocks

    @property
    def nbytes(self):
        return self.nb * block_bytes(self.nt)


def l2_bytes(device):
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or GPU_L2_FALLBACK


def shape_sets(nt, nb, device):
    return rotation_sets(2 * nb * block_bytes(nt), l2_bytes(device))


def make_shape(nt, nb, layouts, device, pool):
    nsets = shape_sets(nt, nb, device)
    arenas = [new_arena(nsets * nb, nt, device) for _ in range(3)]
    arenas.append(pinned_arena(pool, nsets * nb, nt))
    for arena in arenas:
        fill_random_(arena, device)
    blocks = {layout: block_sets(layer_caches(arenas[0], nt, layout), nb, nsets)
              for layout in layouts}
    return Shape(nt, nb, nsets, *arenas, blocks)


def shape_fields(shape, **fields):
    return dict(mode="gpu", nt=shape.nt, nb=shape.nb, bytes=shape.nbytes, sets=shape.nsets,
                **fields)


def link_for(placement, writes_pinned):
    if placement != "pinned":
        return placement
    return "d2h" if writes_pinned else "h2d"


def binder(*args, **kwargs):
    """bind(function, sources, destinations) -> the call with these further arguments."""
    return lambda function, sources, destinations: partial(function, sources, destinations,
                                                            *args, **kwargs)


def function_name(owner, name):
    """A function's name in the rows: kvbm_ext's by name, methods as Type.method."""
    return name if owner is kvbm_ext else f"{type(owner).__name__}.{name}"


def conversion_cases(fields, placement, pinned_side, pairing, directions, bind,
                     queue_bound=False, owner=kvbm_ext, sides=None):
    """One case per direction of a conversion between the pairing's sides: owner's function
    of each direction, called with the per-set arguments that stand for sides a and b
    (sides; by default the pairing's own)."""
    a, b = sides or (pairing.a, pairing.b)
    cases = []
    for direction, name, writes_b in directions:
        function = getattr(owner, name)
        sources, destinations = (a, b) if writes_b else (b, a)
        calls = [bind(function, s, d) for s, d in zip(sources, destinations)]
        link = link_for(placement, writes_b == (pinned_side == "b"))
        cases.append(Case(dict(fields, function=function_name(owner, name), direction=direction,
                               placement=placement),
                          link, calls, pairing, writes_b, queue_bound))
    return cases


def placements(device_arena, pinned):
    return (("d2d", device_arena), ("pinned", pinned))


def list_cases(gpu, shape, layouts):
    """block_to_universal / universal_to_block: universals on the device or pinned."""
    cases = []
    for layout in layouts:
        for placement, arena in placements(shape.device_a, shape.pinned):
            universals = tensor_sets(as_universals(arena, shape.nt), shape.nb, shape.nsets)
            pairing = Pairing(shape.blocks[layout], universals,
                              partial(chunks_match_universal, layout=layout))
            cases += conversion_cases(shape_fields(shape, api="list", layout=layout), placement,
                                      "b", pairing, LIST_DIRECTIONS,
                                      binder(layout, stream=gpu.stream))
    return cases


def backends(batch):
    return [backend for backend in BACKENDS if batch or backend != "batch"]


def block_operational_cases(gpu, shape, layouts):
    """block_to_operational / operational_to_block per backend: operationals on the device
    or pinned.  Chunks are copied as they are, so one layout's views serve."""
    cases = []
    for placement, arena in placements(shape.device_a, shape.pinned):
        pairing = Pairing(shape.blocks[layouts[0]], tensor_sets(arena, shape.nb, shape.nsets),
                          chunks_match_operational)
        for backend in backends(gpu.batch):
            cases += conversion_cases(shape_fields(shape, api="operational", backend=backend),
                                      placement, "b", pairing, BLOCK_OP_DIRECTIONS,
                                      binder(backend=backend, stream=gpu.stream),
                                      backend in QUEUE_BOUND)
    return cases


def universal_operational_cases(gpu, shape, layouts):
    """universal_to_operational / operational_to_universal: operationals on the device,
    universals on the device or pinned."""
    operationals = tensor_sets(shape.device_a, shape.nb, shape.nsets)
    cases = []
    for layout in layouts:
        for placement, arena in placements(shape.device_b, shape.pinned):
            universals = tensor_sets(as_universals(arena, shape.nt), shape.nb, shape.nsets)
            pairing = Pairing(universals, operationals,
                              partial(universal_matches_operational, layout=layout))
            cases += conversion_cases(shape_fields(shape, api="operational", layout=layout),
                                      placement, "a", pairing, UNIVERSAL_OP_DIRECTIONS,
                                      binder(layout, stream=gpu.stream))
    return cases


def memcpy_batch_modes(batch):
    return [mode for mode in MEMCPY_BATCH_MODES if batch or mode != "batch_without_fallback"]


def copy_variants(gpu, size):
    """(function, backend, bind(src_ptrs, dst_ptrs) -> call, queue_bound) per raw copy."""
    def vectorized(src, dst):
        return partial(kvbm_ext.vectorized_copy, src, dst, size, stream=gpu.stream)

    def vectorized_device_list(src, dst):
        return vectorized(on_device(src, gpu.device), on_device(dst, gpu.device))

    def memcpy_batch(mode, src, dst):
        return partial(kvbm_ext.memcpy_batch, src, dst, size, mode=mode, stream=gpu.stream)

    variants = [("vectorized_copy", "host_list", vectorized, False),
                ("vectorized_copy", "device_list", vectorized_device_list, False)]
    variants += [("memcpy_batch", mode, partial(memcpy_batch, mode), True)
                 for mode in memcpy_batch_modes(gpu.batch)]
    return variants


def copy_cases(gpu, shape, layouts):
    """vectorized_copy and memcpy_batch between the device and pinned host: per-layer chunks
    of the block stack <-> pinned operationals ("chunk"), device operationals <-> pinned
    ones ("block")."""
    pinned = tensor_sets(shape.pinned, shape.nb, shape.nsets)
    chunk_bytes = shape.nt * NH * HD * DTYPE.itemsize
    granularities = (
        ("chunk", Pairing(shape.blocks[layouts[0]], pinned, chunks_match_operational),
         chunk_pointers, operational_chunk_pointers, chunk_bytes),
        ("block", Pairing(tensor_sets(shape.device_a, shape.nb, shape.nsets), pinned, same_block),
         block_pointers, block_pointers, block_bytes(shape.nt)),
    )
    cases = []
    for granularity, pairing, a_pointers, b_pointers, size in granularities:
        a = [a_pointers(blocks) for blocks in pairing.a]
        b = [b_pointers(blocks) for blocks in pairing.b]
        fields = shape_fields(shape, api="copy", placement="pinned", granularity=granularity,
                              pairs=len(a[0]))
        for direction, writes_b in COPY_DIRECTIONS:
            sources, destinations = (a, b) if writes_b else (b, a)
            for function, backend, bind, queue_bound in copy_variants(gpu, size):
                calls = [bind(s, d) for s, d in zip(sources, destinations)]
                cases.append(Case(dict(fields, function=function, direction=direction,
                                       backend=backend),
                                  direction, calls, pairing, writes_b, queue_bound))
    return cases


@dataclass
class TorchLoop:
    """The plain-PyTorch baseline, with PagedKVCache's universal methods: per layer, the
    blocks gathered with index_select on the cache's block dimension, permuted and copied
    into the universals' layer slice (index_copy_ back)."""
    caches: list         # per layer [no, num_blocks, *chunk]
    layout: str

    def order(self):
        """The gathered blocks' dimensions, [no, nb, *chunk], in universal order."""
        return (1, 3, 0, 2, 4) if self.layout == "NHD" else (1, 2, 0, 3, 4)

    def to_universal(self, block_ids, universals):
        order = self.order()
        for l, cache in enumerate(self.caches):
            universals[:, :, l].copy_(cache.index_select(1, block_ids).permute(order))

    def from_universal(self, universals, block_ids):
        order = self.order()
        inverse = tuple(order.index(d) for d in range(5))
        for l, cache in enumerate(self.caches):
            cache.index_copy_(1, block_ids, universals[:, :, l].permute(inverse))


@dataclass
class PagedSetup:
    """A stack of nsets*nb blocks as a worker holds it: a vLLM cache per layer, described once
    as a PagedKVCache, and per rotation set the spread ids of its nb blocks."""
    nt: int
    nb: int
    layout: str
    caches: list         # per layer [no, num_blocks, *chunk] (layer_caches)
    cache: object        # kvbm_ext.PagedKVCache(caches, PAGED_DIMS[layout])
    ids: list            # per rotation set, its block ids (ints)
    id_tensors: list     # per rotation set, its block ids as an int64 tensor on the caches' device
    blocks: list         # per rotation set, the chunk views of its blocks (the list API's argument)

    def id_sets(self, kinds):
        """(kind, ids per set) for the kinds of block_ids asked for that the cache takes
        (device_ids: a GPU cache's)."""
        by_kind = {"host_ids": self.ids, "device_ids": self.id_tensors}
        on_gpu = self.id_tensors[0].is_cuda
        return [(kind, by_kind[kind]) for kind in kinds if on_gpu or kind == "host_ids"]


def paged_setup(stack, nt, nb, nsets, layout):
    caches = layer_caches(stack, nt, layout)
    ids = spread_ids(nb, nsets)
    return PagedSetup(nt, nb, layout, caches, kvbm_ext.PagedKVCache(caches, PAGED_DIMS[layout]),
                      ids, [torch.tensor(s, dtype=torch.int64, device=stack.device) for s in ids],
                      [block_views(caches, s) for s in ids])


def universal_pairing(setup, arena):
    """The setup's blocks and, per rotation set, one universal array [nb, nh, nl, no, nt, hd],
    a slice of the arena."""
    universals = set_slices(as_universals(arena, setup.nt), setup.nb, len(setup.ids))
    return Pairing(setup.blocks, universals, partial(chunks_match_universal, layout=setup.layout))


def operational_pairing(setup, arena):
    """The setup's blocks and, per rotation set, one operational array [nb, nl, no, inner]."""
    return Pairing(setup.blocks, set_slices(arena, setup.nb, len(setup.ids)),
                   chunks_match_operational)


def ctas_fields(num_ctas, sms):
    """The row fields of a GPU PagedKVCache call: num_ctas as passed, the SMs it can use."""
    return dict(num_ctas="None" if num_ctas is None else num_ctas,
                sms=sms if num_ctas is None else min(num_ctas, sms))


def paged_kv_cases(fields, placement, setup, pairing, directions, stream, sms=None,
                   num_ctas=None, kinds=ID_KINDS, **kwargs):
    """PagedKVCache calls between the cache and side b of the pairing, per kind of ids."""
    cases = []
    for kind, ids in setup.id_sets(kinds):
        kind_fields = dict(fields, backend=kind)
        if sms is not None:
            kind_fields.update(ctas_fields(num_ctas, sms))
        cases += conversion_cases(kind_fields, placement, "b", pairing, directions,
                                  binder(num_ctas=num_ctas, stream=stream, **kwargs),
                                  owner=setup.cache, sides=(ids, pairing.b))
    return cases


def paged_universal_cases(fields, placement, setup, pairing, stream, sms=None):
    """Cache <-> universals, the same blocks three ways: PagedKVCache (each kind of ids), the
    list API on the blocks' chunk views and nb universals, and (not pinned) the torch loop."""
    cases = paged_kv_cases(fields, placement, setup, pairing, PAGED_DIRECTIONS, stream, sms)
    universals = [list(u.unbind(0)) for u in pairing.b]
    cases += conversion_cases(dict(fields, backend="list"), placement, "b", pairing,
                              LIST_DIRECTIONS, binder(setup.layout, stream=stream),
                              sides=(pairing.a, universals))
    if placement != "pinned":
        cases += conversion_cases(dict(fields, backend="torch"), placement, "b", pairing,
                                  PAGED_DIRECTIONS, binder(),
                                  owner=TorchLoop(setup.caches, setup.layout),
                                  sides=(setup.id_tensors, pairing.b))
    return cases


def paged_cases(gpu, shape, layouts):
    """PagedKVCache over the stack seen as vLLM's per-layer caches: to/from universals on the
    device or pinned (next to the list API and the torch loop), the num_ctas sweep of
    to_universal at gpu.ctas_nb, and to/from operationals on the device or pinned."""
    cases = []
    for layout in layouts:
        setup = paged_setup(shape.stack, shape.nt, shape.nb, shape.nsets, layout)
        fields = shape_fields(shape, api="paged", layout=layout)
        for placement, arena in placements(shape.device_a, shape.pinned):
            pairing = universal_pairing(setup, arena)
            cases += paged_universal_cases(fields, placement, setup, pairing, gpu.stream, gpu.sms)
            if shape.nb == gpu.ctas_nb:
                for num_ctas in CTAS_SWEEP:
                    cases += paged_kv_cases(fields, placement, setup, pairing,
                                            PAGED_DIRECTIONS[:1], gpu.stream, gpu.sms,
                                            num_ctas, kinds=("device_ids",))
        for placement, arena in placements(shape.device_b, shape.pinned):
            cases += paged_kv_cases(fields, placement, setup, operational_pairing(setup, arena),
                                    PAGED_OP_DIRECTIONS, gpu.stream, gpu.sms, layout=layout)
    return cases

GROUPS = {
    "list": (list_cases,),
    "operational": (block_operational_cases, universal_operational_cases),
    "copy": (copy_cases,),
    "paged": (paged_cases,),
}


def run_gpu_case(ctx, gpu, case, memcpys):
    """Verify, then time one case against the ceiling of its link and the same-size memcpy."""
    nbytes = case.fields["bytes"]
    ceiling = gpu.ceilings[case.link]["gbps"]
    memcpy = memcpys[case.link]["gbps"] if case.link in memcpys else None

    def measure(first):
        timing = time_gpu_calls(case.calls, ctx.policy, gpu.cycles_per_us, first,
                                case.queue_bound)
        fields = timed_fields(timing, nbytes, ceiling, memcpy)
        if case.fields["api"] == "paged" and case.fields["nb"] <= STEADY_MAX_NB:
            fields["host_steady_us"] = steady_host_us(case.calls)
        return fields

    return run_checked(make_row(ctx, **case.fields), case, cuda_synchronize, gpu.device, measure)


def run_shape(ctx, gpu, args, nt, nb, pool):
    """The same-size memcpys and every case of the selected groups for one (nt, nb)."""
    shape = make_shape(nt, nb, args.layouts, gpu.device, pool)
    memcpys = measure_same_size_memcpys(ctx, gpu, shape)
    rows = list(memcpys.values())
    for api in args.apis:
        for group in GROUPS[api]:
            for case in group(gpu, shape, args.layouts):
                rows.append(run_gpu_case(ctx, gpu, case, memcpys))
    return rows


def run_gpu_cases(ctx, gpu, args):
    pool_bytes = max(shape_sets(nt, nb, gpu.device) * nb * block_bytes(nt)
                     for nt in args.nt for nb in args.nb)
    pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
    rows = []
    for nt in args.nt:
        for nb in args.nb:
            rows += run_shape(ctx, gpu, args, nt, nb, pool)
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- CPU cases

def l3_bytes():
    """Size of cpu0's last-level cache from sysfs (fallback 32 MiB)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
    except OSError:
        return CPU_L3_FALLBACK
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


def memcpy_buffers(nbytes, nsets):
    """nsets random-filled (source, destination) pairs of one contiguous buffer of nbytes."""
    src = torch.empty((nsets, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    fill_random_(src, torch.device("cpu"))
    fill_random_(dst, torch.device("cpu"))
    return src, dst


def time_memcpy(nbytes, nsets, policy):
    """Single-threaded memcpy baseline: numpy.copyto of one contiguous buffer of nbytes."""
    src, dst = memcpy_buffers(nbytes, nsets)
    src_np, dst_np = src.numpy(), dst.numpy()
    calls = [lambda s=s: np.copyto(dst_np[s], src_np[s]) for s in range(nsets)]
    return time_cpu_calls(calls, policy, run_once(calls[0], no_synchronize))


def time_torch_memcpy(nbytes, nsets, policy):
    """The torch loop's ceiling: torch copy_ of one contiguous buffer of nbytes, which splits
    the copy over torch.get_num_threads() threads as the loop's own copies are."""
    src, dst = memcpy_buffers(nbytes, nsets)
    calls = [lambda s=s: dst[s].copy_(src[s]) for s in range(nsets)]
    return time_cpu_calls(calls, policy, run_once(calls[0], no_synchronize))


def run_cpu_case(ctx, case, memcpy, ceiling):
    """A CPU case against `ceiling`, a copy of the same bytes by as many threads as the case
    uses (kvbm_ext: the calling thread, so `memcpy`); ratio_vs_memcpy is always against
    `memcpy`, the single-threaded memcpy of the CPU target."""
    nbytes = case.fields["bytes"]

    def measure(first):
        timing = time_cpu_calls(case.calls, ctx.policy, first)
        return dict(host_us=timing.host_us, gbps=gbps(nbytes, timing.host_us),
                    pct_of_ceiling=100 * ceiling.host_us / timing.host_us,
                    ratio_vs_memcpy=timing.host_us / memcpy.host_us, reps=timing.reps)

    row = make_row(ctx, **case.fields, ceiling_gbps=gbps(nbytes, ceiling.host_us))
    return run_checked(row, case, no_synchronize, torch.device("cpu"), measure)


def cpu_arenas(nt, nb, nsets):
    """Two random-filled host arenas of nsets*nb blocks: the block stack and universals."""
    cpu = torch.device("cpu")
    arenas = new_arena(nsets * nb, nt, cpu), new_arena(nsets * nb, nt, cpu)
    for arena in arenas:
        fill_random_(arena, cpu)
    return arenas


def cpu_fields(api, nt, nb, layout, nsets):
    return dict(mode="cpu", api=api, layout=layout, nt=nt, nb=nb, bytes=nb * block_bytes(nt),
                sets=nsets)


def cpu_list_cases(nt, nb, layout, nsets):
    """The list API between the block stack and nb universals per set, in host memory."""
    stack, universals = cpu_arenas(nt, nb, nsets)
    pairing = Pairing(block_sets(layer_caches(stack, nt, layout), nb, nsets),
                      tensor_sets(as_universals(universals, nt), nb, nsets),
                      partial(chunks_match_universal, layout=layout))
    return conversion_cases(cpu_fields("list", nt, nb, layout, nsets), "host", "b", pairing,
                            LIST_DIRECTIONS, binder(layout, stream=None))


def cpu_paged_cases(nt, nb, layout, nsets):
    """PagedKVCache on host caches (host ids) next to the list API and the torch loop."""
    stack, universals = cpu_arenas(nt, nb, nsets)
    setup = paged_setup(stack, nt, nb, nsets, layout)
    return paged_universal_cases(cpu_fields("paged", nt, nb, layout, nsets), "host", setup,
                                 universal_pairing(setup, universals), None)

CPU_GROUPS = {"list": cpu_list_cases, "paged": cpu_paged_cases}


def run_cpu_cases(ctx, apis, nts, nbs, layouts):
    """The CPU sections of the groups in apis (CPU_APIS).  Each row's ceiling is a copy of the
    same bytes by as many threads as the row uses: numpy.copyto on one thread for kvbm_ext
    (its CPU path runs on the calling thread), torch copy_ on torch's threads for the torch
    loop, whose index_select / index_copy_ / copy_ run on them too.  Against the
    single-threaded memcpy the loop reached 145 % with 16 torch threads."""
    threads = torch.get_num_threads()
    print(f"CPU section: torch.get_num_threads()={threads}, "
          f"os.cpu_count()={os.cpu_count()}, L3={l3_bytes() // MIB} MiB, "
          "ceiling = a copy of the same bytes on as many threads as the row: numpy.copyto "
          f"(1 thread) for kvbm_ext, torch copy_ ({threads} threads) for the torch loop", flush=True)
    rows = []
    for nt in nts:
        for nb in nbs:
            nbytes = nb * block_bytes(nt)
            nsets = rotation_sets(2 * nbytes, l3_bytes())
            memcpy = time_memcpy(nbytes, nsets, ctx.policy)
            torch_memcpy = time_torch_memcpy(nbytes, nsets, ctx.policy) if "paged" in apis else None
            for api in apis:
                for layout in layouts:
                    for case in CPU_GROUPS[api](nt, nb, layout, nsets):
                        ceiling = torch_memcpy if case.fields.get("backend") == "torch" else memcpy
                        rows.append(run_cpu_case(ctx, case, memcpy, ceiling))
    return rows
