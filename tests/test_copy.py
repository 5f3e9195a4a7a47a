"""Raw copies: vectorized_copy, memcpy_batch, is_memcpy_batch_available, and the
KVBM_EXT_DEBUG line of memcpy_batch (API_SPEC v0.2, "Raw copies" and "Debug log").

Every case builds its pairs as addresses into big torch uint8 buffers
(buffer.data_ptr() + offset): device buffers, pinned host buffers, and pageable host
buffers where the spec accepts them (memcpy_batch) or rejects them (vectorized_copy).
Source bytes are random (fresh seed per case, the `gen` fixture) and never equal the
poison 0xA5, so a destination byte that was not written can never pass as copied.
Destinations are poisoned with 0xA5 before every call; afterwards the whole
destination buffer is compared byte for byte with a plain PyTorch reference: every
pair's range holds the source bytes and every byte outside the pairs still holds the
poison.  Sources must be unchanged.

The CPU part (argument-structure errors, no-GPU RuntimeError, is_memcpy_batch_available)
runs without a GPU; everything else needs CUDA.
"""

import ctypes
import re
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import kvbm_ext
from support.asserts import POISON_BYTE, assert_poisoned, peek_still_poisoned
from support.devices import SLEEP_CYCLES, sync

HAVE_CUDA = torch.cuda.is_available()
MODES = ["batched_with_fallback", "fallback_only", "batch_without_fallback"]
COMPARE_DEVICE = "cuda" if HAVE_CUDA else "cpu"


def library_sees_a_gpu():
    return bool(kvbm_ext.cuda_devices())


def copy_fn(name):
    """Resolved at call time: collection works before the functions exist."""
    return getattr(kvbm_ext, name)


def batch_available():
    return kvbm_ext.is_memcpy_batch_available()


def batch_mode_must_fail(mode):
    """batch_without_fallback raises instead of falling back when the batch API is missing."""
    return mode == "batch_without_fallback" and not batch_available()


# --------------------------------------------------------------------------
# Buffers and random bytes.
# --------------------------------------------------------------------------


def alloc(where, n):
    """An uninitialised uint8 buffer of n bytes: 'device', 'pinned' or 'pageable'."""
    if where == "device":
        return torch.empty(n, dtype=torch.uint8, device="cuda")
    if where == "pinned":
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        assert t.is_pinned()
        return t
    if where == "pageable":
        t = torch.empty(n, dtype=torch.uint8)
        if HAVE_CUDA:
            assert not t.is_pinned()
        return t
    raise ValueError(where)


def poisoned(where, n):
    return alloc(where, n).fill_(POISON_BYTE)


def random_bytes(n, where, gen):
    """n random bytes in a new `where` buffer, drawn from a seed taken from `gen`
    (on the GPU when there is one: fast for hundreds of MB). Never 0xA5."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    if HAVE_CUDA:
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        t = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g)
    else:
        g = torch.Generator()
        g.manual_seed(seed)
        t = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
    t += (t >= POISON_BYTE).to(torch.uint8)  # 0..254 -> every byte value but 0xA5
    if where == "device":
        return t
    buf = alloc(where, n)
    buf.copy_(t)
    return buf


def randint(lo, hi, gen):
    """A random int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def randperm(n, gen):
    return torch.randperm(n, generator=gen).tolist()


# --------------------------------------------------------------------------
# Pair plans: offsets into a source and a destination buffer.
# --------------------------------------------------------------------------


@dataclass
class Plan:
    src_offs: list
    dst_offs: list
    sizes: list
    src_len: int
    dst_len: int

    def without(self, i):
        keep = [j for j in range(len(self.sizes)) if j != i]
        return self.reordered(keep)

    def reordered(self, order):
        return Plan([self.src_offs[i] for i in order], [self.dst_offs[i] for i in order],
                    [self.sizes[i] for i in order], self.src_len, self.dst_len)


def _round_up(x, a):
    return (x + a - 1) // a * a


def _lay_out(sizes, gen, misalign, align):
    """Regions in a random order inside one buffer, each starting `misalign` bytes past an
    `align` boundary, with at least one poison byte between regions and `align` bytes of
    margin at both ends. Returns (offsets by pair index, buffer length)."""
    offs = [0] * len(sizes)
    pos = align
    for i in randperm(len(sizes), gen):
        start = _round_up(pos, align) + misalign
        offs[i] = start
        pos = start + sizes[i] + 1 + randint(0, align, gen)
    return offs, _round_up(pos, align) + align


def make_plan(sizes, gen, *, src_misalign=0, dst_misalign=0, align=64, shuffle=True):
    """Pairs of the given sizes; source and destination regions are laid out independently
    in random orders (so pair i's source and destination positions are unrelated), and the
    pair list itself is shuffled."""
    sizes = list(sizes)
    src_offs, src_len = _lay_out(sizes, gen, src_misalign, align)
    dst_offs, dst_len = _lay_out(sizes, gen, dst_misalign, align)
    plan = Plan(src_offs, dst_offs, sizes, src_len, dst_len)
    return plan.reordered(randperm(len(sizes), gen)) if shuffle else plan


def slot_plan(n, size, spare, gen):
    """n equal pairs of `size` bytes: source slot i -> a random destination slot out of
    n + spare (the spare slots must stay poisoned), pair list in random order."""
    dst_slots = randperm(n + spare, gen)[:n]
    src_slots = randperm(n, gen)
    return Plan([s * size for s in src_slots], [d * size for d in dst_slots], [size] * n,
                n * size, (n + spare) * size)


def random_sizes(n, gen, lo=1, hi=70_000):
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


# --------------------------------------------------------------------------
# Argument forms.
# --------------------------------------------------------------------------

ADDRESS_FORMS = {
    "list": list,
    "tuple": tuple,
    "numpy-uint64": lambda v: np.array(v, dtype=np.uint64),
    "numpy-int64": lambda v: np.array(v, dtype=np.int64),
    "torch-int64": lambda v: torch.tensor(v, dtype=torch.int64),
    # list(np_array): NumPy integer scalars, read through __index__
    "numpy-int64-items": lambda v: list(np.array(v, dtype=np.int64)),
    "numpy-uint64-items": lambda v: list(np.array(v, dtype=np.uint64)),
    "cuda-int64": lambda v: torch.tensor(v, dtype=torch.int64, device="cuda"),
}
HOST_ADDRESS_FORMS = [f for f in ADDRESS_FORMS if f != "cuda-int64"]


def _one_int(v):
    assert len(set(v)) == 1, "the 'int' sizes form needs equal sizes"
    return int(v[0])


SIZE_FORMS = {"int": _one_int, "numpy-int64-scalar": lambda v: np.int64(_one_int(v)), **ADDRESS_FORMS}
HOST_SIZE_FORMS = [f for f in SIZE_FORMS if f != "cuda-int64"]
ONE_SIZE_FORMS = ["int", "numpy-int64-scalar"]  # one size for every pair


def pair_args(src, dst, plan, src_form="list", dst_form="list", sizes_form="list"):
    src_ptrs = ADDRESS_FORMS[src_form]([src.data_ptr() + o for o in plan.src_offs])
    dst_ptrs = ADDRESS_FORMS[dst_form]([dst.data_ptr() + o for o in plan.dst_offs])
    return src_ptrs, dst_ptrs, SIZE_FORMS[sizes_form](plan.sizes)


# --------------------------------------------------------------------------
# Reference and checks.
# --------------------------------------------------------------------------


def expected_destination(src_snapshot, plan):
    """The destination buffer after the copy: poison everywhere, source bytes in each pair."""
    src = src_snapshot.to(COMPARE_DEVICE)
    exp = torch.full((plan.dst_len,), POISON_BYTE, dtype=torch.uint8, device=COMPARE_DEVICE)
    s = plan.sizes[0] if plan.sizes else 0
    if (s > 0 and all(n == s for n in plan.sizes) and plan.src_len % s == 0 and plan.dst_len % s == 0
            and all(o % s == 0 for o in plan.src_offs) and all(o % s == 0 for o in plan.dst_offs)):
        src_idx = torch.tensor([o // s for o in plan.src_offs], device=COMPARE_DEVICE)
        dst_idx = torch.tensor([o // s for o in plan.dst_offs], device=COMPARE_DEVICE)
        exp.view(-1, s)[dst_idx] = src.view(-1, s)[src_idx]
    else:
        for so, do, n in zip(plan.src_offs, plan.dst_offs, plan.sizes):
            if n:
                exp[do:do + n] = src[so:so + n]
    return exp


def assert_copied(dst, src_snapshot, plan, what="destination"):
    """dst[dst_off:dst_off+size] == src[src_off:src_off+size] for every pair, and every
    byte outside the pairs still 0xA5 (one comparison of the whole buffer; on failure the
    report separates the two)."""
    got = dst.to(COMPARE_DEVICE)
    exp = expected_destination(src_snapshot, plan)
    assert got.numel() == exp.numel()
    if torch.equal(got, exp):
        return
    in_pairs = torch.zeros(plan.dst_len, dtype=torch.bool, device=COMPARE_DEVICE)
    for do, n in zip(plan.dst_offs, plan.sizes):
        in_pairs[do:do + n] = True
    bad = (got != exp).nonzero().flatten()
    inside = int(in_pairs[bad].sum())
    first = int(bad[0])
    where = "outside every pair"
    for i, (so, do, n) in enumerate(zip(plan.src_offs, plan.dst_offs, plan.sizes)):
        if do <= first < do + n:
            where = f"in pair {i} (src_off {so}, dst_off {do}, size {n}, byte {first - do} of the pair)"
            break
    raise AssertionError(
        f"{what}: {bad.numel()} of {plan.dst_len} bytes wrong: {inside} inside the pairs "
        f"({int((got[bad][in_pairs[bad]] == POISON_BYTE).sum())} of them never written), "
        f"{bad.numel() - inside} outside every pair (poison overwritten); first at byte {first} {where}: "
        f"got {int(got[first]):#04x}, want {int(exp[first]):#04x}; {len(plan.sizes)} pairs"
    )


def assert_unchanged(buf, snapshot, what="source"):
    a, b = buf.to(COMPARE_DEVICE), snapshot.to(COMPARE_DEVICE)
    if not torch.equal(a, b):
        n = int((a != b).sum())
        raise AssertionError(f"{what}: {n} of {a.numel()} bytes changed")


def assert_message(info, *patterns):
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not found in message {msg!r}"
    return msg


def setup_copy(src_where, dst_where, plan, gen):
    """(src, snapshot of src, poisoned dst); all device work finished."""
    src = random_bytes(plan.src_len, src_where, gen)
    snapshot = src.clone()
    dst = poisoned(dst_where, plan.dst_len)
    sync()
    return src, snapshot, dst


def copy_and_check(fn, src_where, dst_where, plan, gen, forms=("list", "list", "list"), *, stream=None,
                   sync_on=None, **kwargs):
    """Run fn on fresh buffers, wait for `sync_on` (a torch stream; default: the device),
    and compare the whole destination with the reference."""
    src, snapshot, dst = setup_copy(src_where, dst_where, plan, gen)
    args = pair_args(src, dst, plan, *forms)
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        sync()
    assert copy_fn(fn)(*args, stream=stream, **kwargs) is None
    if sync_on is not None:
        sync_on.synchronize()
    else:
        sync()
    assert_copied(dst, snapshot, plan)
    assert_unchanged(src, snapshot)
    return src, dst


# --------------------------------------------------------------------------
# CPU part: argument structure (no GPU needed; with a GPU the same cases run on device
# buffers), no-GPU RuntimeError, is_memcpy_batch_available.
# --------------------------------------------------------------------------


def _structure_buffers(gen):
    """4 pairs of 64 bytes: device buffers when there is a GPU, else pageable host ones."""
    where = "device" if HAVE_CUDA else "pageable"
    plan = make_plan([64] * 4, gen, shuffle=False)
    src, snapshot, dst = setup_copy(where, where, plan, gen)
    s, d, z = pair_args(src, dst, plan)
    return src, snapshot, dst, s, d, z


def _with(seq, i, value):
    seq = list(seq)
    seq[i] = value
    return seq


# name -> (builder(s, d, z) -> (src_ptrs, dst_ptrs, sizes), exception, message patterns)
STRUCTURE_CASES = {
    "dst_ptrs-short": (lambda s, d, z: (s, d[:3], z), ValueError, [r"^dst_ptrs\b", r"\b3\b", r"\b4\b"]),
    "dst_ptrs-long": (lambda s, d, z: (s, d + [d[0] + 128], z), ValueError, [r"^dst_ptrs\b", r"\b5\b", r"\b4\b"]),
    "dst_ptrs-short-numpy": (lambda s, d, z: (s, np.array(d[:2], dtype=np.uint64), z), ValueError,
                             [r"^dst_ptrs\b", r"\b2\b", r"\b4\b"]),
    "src_ptrs-short": (lambda s, d, z: (s[:3], d, z[:3]), ValueError, [r"^(dst_ptrs|src_ptrs)\b", r"\b3\b", r"\b4\b"]),
    "sizes-short-list": (lambda s, d, z: (s, d, z[:3]), ValueError, [r"^sizes\b", r"\b3\b", r"\b4\b"]),
    "sizes-long-numpy": (lambda s, d, z: (s, d, np.array(z + [64], dtype=np.int64)), ValueError,
                         [r"^sizes\b", r"\b5\b", r"\b4\b"]),
    "sizes-short-torch": (lambda s, d, z: (s, d, torch.tensor(z[:2], dtype=torch.int64)), ValueError,
                          [r"^sizes\b", r"\b2\b", r"\b4\b"]),
    "negative-size-list": (lambda s, d, z: (s, d, _with(z, 2, -64)), ValueError, [r"sizes"]),
    "negative-size-int": (lambda s, d, z: (s, d, -1), ValueError, [r"sizes"]),
    "negative-size-numpy": (lambda s, d, z: (s, d, np.array(_with(z, 1, -64), dtype=np.int64)), ValueError,
                            [r"sizes"]),
    "negative-size-torch": (lambda s, d, z: (s, d, torch.tensor(_with(z, 3, -1), dtype=torch.int64)), ValueError,
                            [r"sizes"]),
    "negative-address-list": (lambda s, d, z: (_with(s, 1, -s[1]), d, z), ValueError, [r"src_ptrs"]),
    "negative-address-numpy": (lambda s, d, z: (s, np.array(_with(d, 2, -4096), dtype=np.int64), z), ValueError,
                               [r"dst_ptrs"]),
    "negative-address-torch": (lambda s, d, z: (torch.tensor(_with(s, 3, -16), dtype=torch.int64), d, z),
                               ValueError, [r"src_ptrs"]),
    "float64-numpy-src": (lambda s, d, z: (np.array(s, dtype=np.float64), d, z), TypeError, [r"src_ptrs"]),
    "float32-numpy-dst": (lambda s, d, z: (s, np.array(d, dtype=np.float32), z), TypeError, [r"dst_ptrs"]),
    "float64-torch-src": (lambda s, d, z: (torch.tensor(s, dtype=torch.float64), d, z), TypeError, [r"src_ptrs"]),
    "float64-numpy-sizes": (lambda s, d, z: (s, d, np.array(z, dtype=np.float64)), TypeError, [r"sizes"]),
    "float32-torch-sizes": (lambda s, d, z: (s, d, torch.tensor(z, dtype=torch.float32)), TypeError, [r"sizes"]),
    "str-in-src-list": (lambda s, d, z: (_with(s, 2, hex(s[2])), d, z), TypeError, [r"src_ptrs"]),
    "float-in-dst-list": (lambda s, d, z: (s, _with(d, 1, float(d[1])), z), TypeError, [r"dst_ptrs"]),
    "None-in-src-list": (lambda s, d, z: (_with(s, 3, None), d, z), TypeError, [r"src_ptrs"]),
    "str-in-sizes-list": (lambda s, d, z: (s, d, _with(z, 3, "64")), TypeError, [r"sizes"]),
    "float-size-scalar": (lambda s, d, z: (s, d, 64.0), TypeError, [r"sizes"]),
    "None-sizes": (lambda s, d, z: (s, d, None), TypeError, [r"sizes"]),
    "src-not-a-sequence": (lambda s, d, z: (object(), d, z), TypeError, [r"src_ptrs"]),
}


@pytest.mark.parametrize("case", list(STRUCTURE_CASES))
@pytest.mark.parametrize("fn", ["vectorized_copy", "memcpy_batch"])
def test_argument_structure_errors(fn, case, gen):
    """Raised as ValueError/TypeError before any CUDA use (so also without a GPU, where a
    valid call is a RuntimeError), naming the argument; nothing written."""
    build, exc, patterns = STRUCTURE_CASES[case]
    src, snapshot, dst, s, d, z = _structure_buffers(gen)
    args = build(s, d, z)
    with pytest.raises(exc) as info:
        copy_fn(fn)(*args)
    sync()
    assert_message(info, *patterns)
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


@pytest.mark.parametrize("mode", ["bogus", "batched", "", "BATCHED_WITH_FALLBACK_X"])
def test_memcpy_batch_unknown_mode(mode, gen):
    src, snapshot, dst, s, d, z = _structure_buffers(gen)
    with pytest.raises(ValueError) as info:
        kvbm_ext.memcpy_batch(s, d, z, mode=mode)
    sync()
    assert_message(info, "mode", *MODES)
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


def test_is_memcpy_batch_available_is_a_bool():
    r = kvbm_ext.is_memcpy_batch_available()
    assert type(r) is bool
    assert kvbm_ext.is_memcpy_batch_available() is r
    if kvbm_ext.is_using_stubs() or not library_sees_a_gpu():
        assert r is False


@pytest.mark.skipif(library_sees_a_gpu() or HAVE_CUDA, reason="a GPU is present")
@pytest.mark.parametrize(
    "fn,kwargs",
    [("vectorized_copy", {})] + [("memcpy_batch", {"mode": m}) for m in MODES] + [("memcpy_batch", {})],
    ids=["vectorized_copy"] + [f"memcpy_batch-{m}" for m in MODES] + ["memcpy_batch-default"],
)
@pytest.mark.parametrize("forms", [("list", "list", "int"), ("numpy-uint64", "torch-int64", "numpy-int64"),
                                   ("numpy-int64-items", "numpy-uint64-items", "numpy-int64-scalar")],
                         ids=["lists", "arrays", "numpy-scalars"])
def test_without_gpu_valid_looking_calls_raise_runtime_error(fn, kwargs, forms, gen):
    plan = make_plan([64, 64, 64], gen)
    src, snapshot, dst = setup_copy("pageable", "pageable", plan, gen)
    with pytest.raises(RuntimeError, match=f"^{fn} needs a CUDA device") as info:
        copy_fn(fn)(*pair_args(src, dst, plan, *forms), **kwargs)
    assert "cannot query" not in str(info.value)
    assert_poisoned(dst)  # no silent CPU fallback
    assert_unchanged(src, snapshot)


# --------------------------------------------------------------------------
# vectorized_copy on the GPU: placements, forms, alignment, sizes.
# --------------------------------------------------------------------------

DEVICE_PLACEMENTS = [("device", "device"), ("device", "pinned"), ("pinned", "device"), ("pinned", "pinned")]
placement_id = "{0[0]}-to-{0[1]}".format


@pytest.mark.gpu
@pytest.mark.parametrize("placement", DEVICE_PLACEMENTS, ids=placement_id)
def test_vectorized_copy_placements_per_pair_sizes(placement, gen):
    """100 pairs of random sizes (1..70000 bytes), random positions, random pair order."""
    plan = make_plan(random_sizes(100, gen), gen)
    copy_and_check("vectorized_copy", *placement, plan, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(ADDRESS_FORMS) + ["mixed"])
@pytest.mark.parametrize("placement", [("device", "device"), ("device", "pinned")], ids=placement_id)
def test_vectorized_copy_address_forms(placement, form, gen):
    forms = ("cuda-int64", "list", "numpy-uint64") if form == "mixed" else (form, form, "list")
    plan = make_plan(random_sizes(40, gen, 1, 5000), gen)
    copy_and_check("vectorized_copy", *placement, plan, gen, forms)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes_form", list(SIZE_FORMS) + ["numpy-uint64-device-addresses"])
def test_vectorized_copy_size_forms(sizes_form, gen):
    if sizes_form == "numpy-uint64-device-addresses":
        forms = ("cuda-int64", "cuda-int64", "numpy-uint64")
    else:
        forms = ("list", "numpy-uint64", sizes_form)
    sizes = [3000] * 50 if sizes_form in ONE_SIZE_FORMS else random_sizes(50, gen, 1, 5000)
    plan = make_plan(sizes, gen)
    copy_and_check("vectorized_copy", "device", "device", plan, gen, forms)


@pytest.mark.gpu
def test_vectorized_copy_device_resident_sizes_and_addresses_to_pinned(gen):
    plan = make_plan(random_sizes(64, gen, 1, 9000), gen)
    copy_and_check("vectorized_copy", "device", "pinned", plan, gen, ("cuda-int64", "cuda-int64", "cuda-int64"))


# Sizes around every vector width's head/tail handling.
ALIGNMENT_SIZES = [1, 2, 3, 7, 15, 16, 17, 31, 33, 999, 1000, 4096, 4099, 65543]
MISALIGNMENTS = [(o, 0) for o in (1, 2, 4, 8)] + [(0, o) for o in (1, 2, 4, 8)] + [(o, o) for o in (1, 2, 4, 8)]
MIXED_MISALIGNMENTS = [(1, 2), (2, 4), (4, 8), (8, 1), (3, 7), (15, 1), (8, 12)]


@pytest.mark.gpu
@pytest.mark.parametrize("src_mis,dst_mis", MISALIGNMENTS + MIXED_MISALIGNMENTS)
def test_vectorized_copy_misaligned_addresses(src_mis, dst_mis, gen):
    plan = make_plan(ALIGNMENT_SIZES * 2, gen, src_misalign=src_mis, dst_misalign=dst_mis)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    assert src.data_ptr() % 64 == 0 and dst.data_ptr() % 64 == 0
    args = pair_args(src, dst, plan)
    assert all(a % 16 == src_mis for a in args[0]) and all(a % 16 == dst_mis for a in args[1])
    kvbm_ext.vectorized_copy(*args)
    sync()
    assert_copied(dst, snapshot, plan)
    assert_unchanged(src, snapshot)


@pytest.mark.gpu
@pytest.mark.parametrize("mis", [1, 2, 4, 8])
@pytest.mark.parametrize("placement", [("device", "pinned"), ("pinned", "device")], ids=placement_id)
def test_vectorized_copy_misaligned_pinned(placement, mis, gen):
    plan = make_plan(ALIGNMENT_SIZES, gen, src_misalign=mis, dst_misalign=mis)
    copy_and_check("vectorized_copy", *placement, plan, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 2, 3, 7, 17, 999, 1025, 4097])
@pytest.mark.parametrize("placement", [("device", "device"), ("pinned", "device")], ids=placement_id)
def test_vectorized_copy_odd_sizes(placement, size, gen):
    """64 pairs of one odd size, given as one int."""
    plan = make_plan([size] * 64, gen)
    copy_and_check("vectorized_copy", *placement, plan, gen, ("list", "list", "int"))


@pytest.mark.gpu
@pytest.mark.parametrize("mis", [(0, 0), (4, 4), (1, 0)], ids=["aligned", "misaligned-4", "src-misaligned-1"])
@pytest.mark.parametrize("placement", DEVICE_PLACEMENTS, ids=placement_id)
def test_vectorized_copy_one_big_pair(placement, mis, gen):
    plan = make_plan([8 * 1024 * 1024 + 13], gen, src_misalign=mis[0], dst_misalign=mis[1])
    copy_and_check("vectorized_copy", *placement, plan, gen)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "placement,forms",
    [
        (("device", "pinned"), ("cuda-int64", "cuda-int64", "int")),  # offload
        (("pinned", "device"), ("numpy-uint64", "numpy-uint64", "int")),  # onboard
        (("device", "device"), ("list", "list", "numpy-int64")),
    ],
    ids=["offload-device-lists", "onboard-numpy", "device-python-lists"],
)
def test_vectorized_copy_many_small_pairs(placement, forms, gen):
    """10,240 pairs of 32 KiB (320 MiB), scattered into random slots of the destination
    (256 spare slots must stay poisoned)."""
    plan = slot_plan(10_240, 32 * 1024, 256, gen)
    copy_and_check("vectorized_copy", *placement, plan, gen, forms)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes_form", ["list", "cuda-int64", "numpy-uint64"])
@pytest.mark.parametrize("placement", [("device", "device"), ("pinned", "device"), ("device", "pinned")],
                         ids=placement_id)
def test_vectorized_copy_zero_size_pairs_are_skipped(placement, sizes_form, gen):
    sizes = random_sizes(60, gen, 1, 5000)
    for i in range(0, 60, 3):
        sizes[i] = 0
    plan = make_plan(sizes, gen)
    forms = ("cuda-int64", "cuda-int64", sizes_form) if sizes_form == "cuda-int64" else ("list", "list", sizes_form)
    copy_and_check("vectorized_copy", *placement, plan, gen, forms)


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(ADDRESS_FORMS))
@pytest.mark.parametrize("sizes", ["int", "empty"])
def test_vectorized_copy_zero_pairs_is_a_no_op(form, sizes, gen):
    dst = poisoned("device", 4096)
    pinned_dst = poisoned("pinned", 4096)
    empty = ADDRESS_FORMS[form]([])
    size_arg = 64 if sizes == "int" else SIZE_FORMS[form]([])
    s = torch.cuda.Stream()
    sync()
    assert kvbm_ext.vectorized_copy(empty, ADDRESS_FORMS[form]([]), size_arg) is None
    assert kvbm_ext.vectorized_copy(empty, ADDRESS_FORMS[form]([]), size_arg, stream=s) is None
    sync()
    assert_poisoned(dst)
    assert_poisoned(pinned_dst)


@pytest.mark.gpu
def test_vectorized_copy_pair_order_does_not_matter(gen):
    """Same pairs in sorted, reversed and random order: identical result."""
    base = make_plan(random_sizes(80, gen, 1, 4000), gen, shuffle=False)
    src = random_bytes(base.src_len, "device", gen)
    snapshot = src.clone()
    by_dst = sorted(range(80), key=lambda i: base.dst_offs[i])
    for name, order in [("sorted", by_dst), ("reversed", by_dst[::-1]), ("random", randperm(80, gen))]:
        plan = base.reordered(order)
        dst = poisoned("device", plan.dst_len)
        sync()
        kvbm_ext.vectorized_copy(*pair_args(src, dst, plan))
        sync()
        assert_copied(dst, snapshot, plan, f"destination ({name} pair order)")
    assert_unchanged(src, snapshot)


# --------------------------------------------------------------------------
# vectorized_copy: streams.
# --------------------------------------------------------------------------


def fill_on_current_stream(buf, fresh):
    """Enqueue buf <- fresh (a device tensor) on the current stream."""
    buf.copy_(fresh, non_blocking=True)


def assert_not_written_yet(dst, busy, what="destination"):
    """While `busy` is still sleeping, dst must still be poisoned (see peek_still_poisoned)."""
    if not peek_still_poisoned([dst], busy, what):
        print("the sleep ended before the peek finished: peek not judged")


STREAM_FORMS = ["None", "0", "torch.cuda.Stream", "int-handle"]


def stream_for(form):
    """(the torch stream the work must go on, the argument to pass)."""
    if form == "None":
        return torch.cuda.default_stream(), None
    if form == "0":
        return torch.cuda.default_stream(), 0
    s = torch.cuda.Stream()
    return s, (s if form == "torch.cuda.Stream" else s.cuda_stream)


def ordered_async_copy(fn, src_where, dst_where, stream_form, gen, **kwargs):
    """On the target stream: a long sleep, then the source is rewritten with fresh bytes,
    then the call. The call must return while the stream is still sleeping (asynchronous),
    nothing may be written before the stream reaches it, and once the stream is done the
    destination must hold the FRESH bytes (ordered after the producer)."""
    plan = make_plan(random_sizes(48, gen, 1, 20_000), gen)
    src, _, dst = setup_copy(src_where, dst_where, plan, gen)
    fresh = random_bytes(plan.src_len, "device", gen)
    args = pair_args(src, dst, plan, "numpy-uint64", "list", "list")
    sync()
    s, stream_arg = stream_for(stream_form)
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        fill_on_current_stream(src, fresh)
        t0 = time.perf_counter()
        assert copy_fn(fn)(*args, stream=stream_arg, **kwargs) is None
        elapsed = time.perf_counter() - t0
    assert not s.query(), "the call waited for its stream (or the sleep was too short)"
    assert_not_written_yet(dst, s)
    s.synchronize()
    print(f"{fn} returned after {elapsed * 1e3:.2f} ms")
    assert_copied(dst, fresh, plan, "destination (must hold the bytes written on the stream before the call)")
    assert_unchanged(src, fresh)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_form", STREAM_FORMS)
def test_vectorized_copy_is_async_and_ordered_on_its_stream(stream_form, gen):
    ordered_async_copy("vectorized_copy", "device", "pinned", stream_form, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [("device", "device"), ("pinned", "device"), ("pinned", "pinned")],
                         ids=placement_id)
def test_vectorized_copy_is_async_and_ordered_other_placements(placement, gen):
    ordered_async_copy("vectorized_copy", *placement, "torch.cuda.Stream", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", DEVICE_PLACEMENTS, ids=placement_id)
def test_vectorized_copy_default_stream_none(placement, gen):
    plan = make_plan(random_sizes(30, gen, 1, 9000), gen)
    copy_and_check("vectorized_copy", *placement, plan, gen, stream=None, sync_on=torch.cuda.default_stream())


@pytest.mark.gpu
@pytest.mark.parametrize("fn,kwargs", [("vectorized_copy", {})] + [("memcpy_batch", {"mode": m}) for m in MODES],
                         ids=["vectorized_copy"] + [f"memcpy_batch-{m}" for m in MODES])
def test_address_lists_are_copied_before_return(fn, kwargs, gen):
    """Host address/size arrays are overwritten right after the call (the stream still
    sleeping): the copy must use the values given at call time (the decoy destination,
    named by the overwritten addresses, stays poisoned)."""
    if batch_mode_must_fail(kwargs.get("mode")):
        pytest.skip("the batch API is not available here")
    plan = make_plan(random_sizes(32, gen, 1, 8000), gen)
    src, snapshot, dst = setup_copy("device", "pinned", plan, gen)
    decoy = poisoned("pinned", plan.dst_len)
    src_ptrs, dst_ptrs, sizes = pair_args(src, dst, plan, "numpy-uint64", "numpy-uint64", "numpy-int64")
    sync()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
    copy_fn(fn)(src_ptrs, dst_ptrs, sizes, stream=s, **kwargs)
    dst_ptrs[:] = np.array([decoy.data_ptr() + o for o in plan.dst_offs], dtype=np.uint64)
    sizes[:] = 1
    busy = not s.query()
    s.synchronize()
    assert_copied(dst, snapshot, plan)
    assert_poisoned(decoy, "decoy destination")
    if not busy:
        print("the stream was already idle when the arrays were overwritten")


# --------------------------------------------------------------------------
# vectorized_copy: address errors (with a GPU), all before any write.
# --------------------------------------------------------------------------


def rejected(fn, args, exc, *patterns, **kwargs):
    """Call fn(*args) expecting exc with the patterns in its message."""
    with pytest.raises(exc) as info:
        copy_fn(fn)(*args, **kwargs)
    sync()
    return assert_message(info, *patterns)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["list", "numpy-uint64", "torch-int64"])
@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs"])
def test_vectorized_copy_null_address(which, form, gen):
    plan = make_plan([256] * 6, gen)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    s, d, z = pair_args(src, dst, plan)
    s, d = (_with(s, 3, 0), d) if which == "src_ptrs" else (s, _with(d, 3, 0))
    args = (ADDRESS_FORMS[form](s), ADDRESS_FORMS[form](d), z)
    rejected("vectorized_copy", args, ValueError, "^" + which + r"\[3\]", "null")
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs", "both"])
def test_vectorized_copy_pageable_address(which, gen):
    """Pair 2 of 5 uses a pageable host buffer, the others device memory."""
    plan = make_plan([512] * 5, gen)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    pageable_src = random_bytes(plan.src_len, "pageable", gen)
    pageable_dst = poisoned("pageable", plan.dst_len)
    s, d, z = pair_args(src, dst, plan)
    if which in ("src_ptrs", "both"):
        s = _with(s, 2, pageable_src.data_ptr() + plan.src_offs[2])
    if which in ("dst_ptrs", "both"):
        d = _with(d, 2, pageable_dst.data_ptr() + plan.dst_offs[2])
    name = r"(src_ptrs|dst_ptrs)" if which == "both" else which
    rejected("vectorized_copy", (s, d, z), ValueError, name + r"\[2\]", "pageable", "pinned")
    assert_poisoned(dst)
    assert_poisoned(pageable_dst, "pageable destination")
    assert_unchanged(src, snapshot)


@pytest.mark.gpu
def test_vectorized_copy_all_pageable_rejected(gen):
    plan = make_plan([512] * 3, gen)
    src, snapshot, dst = setup_copy("pageable", "pageable", plan, gen)
    rejected("vectorized_copy", pair_args(src, dst, plan), ValueError, "pageable", "pinned")
    assert_poisoned(dst)


def whole_segment_buffer(n):
    """A device buffer of n bytes that is a whole CUDA allocation of the caching allocator
    (so its end is the end of the allocation the library can see)."""
    torch.cuda.empty_cache()
    buf = torch.empty(n, dtype=torch.uint8, device="cuda")
    p = buf.data_ptr()
    segs = [g for g in torch.cuda.memory_snapshot()
            if g["device"] == buf.device.index and g["address"] <= p < g["address"] + g["total_size"]]
    assert len(segs) == 1, "cannot find the buffer's segment in torch.cuda.memory_snapshot()"
    assert segs[0]["address"] == p and segs[0]["total_size"] == n, (
        f"the caching allocator did not give the {n}-byte buffer a segment of its own: {segs[0]['address']:#x} "
        f"+ {segs[0]['total_size']} vs {p:#x} (PYTORCH_CUDA_ALLOC_CONF?)")
    return buf


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs"])
def test_vectorized_copy_range_past_end_of_allocation(which, gen):
    """Pair 2 of 4 is the last bytes of a 32 MiB allocation: exactly up to the end is
    fine, one byte more is a ValueError, with nothing written."""
    n = 32 * 1024 * 1024
    tail = 1000
    plan = make_plan([tail] * 4, gen)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    big = whole_segment_buffer(n)
    s, d, z = pair_args(src, dst, plan)
    if which == "src_ptrs":
        big.copy_(random_bytes(n, "device", gen))
        s = _with(s, 2, big.data_ptr() + n - tail)
    else:
        big.fill_(POISON_BYTE)
        d = _with(d, 2, big.data_ptr() + n - tail)
    sync()
    # The whole buffer as one pair of n + 1 bytes (the small buffer on the other side runs
    # past its allocation too, so either may be named) ...
    whole = (_with(s, 2, big.data_ptr()), d, _with(z, 2, n + 1)) if which == "src_ptrs" else \
        (s, _with(d, 2, big.data_ptr()), _with(z, 2, n + 1))
    rejected("vectorized_copy", whole, ValueError, r"(src_ptrs|dst_ptrs)\[2\]")
    # ... and the tail pair one byte too long (the other side stays inside its buffer).
    rejected("vectorized_copy", (s, d, _with(z, 2, tail + 1)), ValueError, which + r"\[2\]")
    assert_poisoned(dst)
    if which == "dst_ptrs":
        assert_poisoned(big, "allocation named by the bad pair")
    assert_unchanged(src, snapshot)
    # Control: up to the very last byte is accepted and copied.
    kvbm_ext.vectorized_copy(s, d, z)
    sync()
    if which == "src_ptrs":
        want = plan_with_pair2_from(big, n - tail, src, plan)
        assert_copied(dst, want[0], want[1])
    else:
        assert torch.equal(big[n - tail:], src[plan.src_offs[2]:plan.src_offs[2] + tail]), "tail pair not copied"
        assert_poisoned(big[:n - tail], "rest of the big allocation")
        assert_copied(dst, snapshot, plan.without(2))


def plan_with_pair2_from(big, big_off, src, plan):
    """(source snapshot, plan) equivalent to a copy whose pair 2 reads big[big_off:]."""
    combined = torch.cat([src, big]).clone()
    p = Plan(_with(plan.src_offs, 2, src.numel() + big_off), plan.dst_offs, plan.sizes,
             combined.numel(), plan.dst_len)
    return combined, p


@pytest.mark.gpu
def test_vectorized_copy_structure_errors_with_device_address_arrays(gen):
    plan = make_plan([256] * 4, gen)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    s, d, z = pair_args(src, dst, plan, "cuda-int64", "cuda-int64", "list")
    rejected("vectorized_copy", (s, d[:3], z), ValueError, r"^dst_ptrs\b", r"\b3\b", r"\b4\b")
    rejected("vectorized_copy", (s, d, torch.tensor(z[:3], device="cuda")), ValueError, r"^sizes\b")
    rejected("vectorized_copy", (s.double(), d, z), TypeError, "src_ptrs")
    rejected("vectorized_copy", (s, d, torch.tensor(z, dtype=torch.float32, device="cuda")), TypeError, "sizes")
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


@pytest.mark.gpu(count=2)
def test_vectorized_copy_addresses_on_two_devices(gen):
    plan = make_plan([256] * 4, gen)
    src = random_bytes(plan.src_len, "device", gen)
    dst1 = torch.full((plan.dst_len,), POISON_BYTE, dtype=torch.uint8, device="cuda:1")
    dst0 = poisoned("device", plan.dst_len)
    sync()
    s, d, z = pair_args(src, dst0, plan)
    d = _with(d, 2, dst1.data_ptr() + plan.dst_offs[2])
    rejected("vectorized_copy", (s, d, z), ValueError)
    assert_poisoned(dst0)
    assert_poisoned(dst1)


# --------------------------------------------------------------------------
# memcpy_batch on the GPU.
# --------------------------------------------------------------------------

BATCH_PLACEMENTS = [
    ("device", "pinned"),
    ("pinned", "device"),
    ("device", "device"),
    ("pageable", "device"),
    ("device", "pageable"),
    ("pinned", "pinned"),
]


def batch_plan(gen, n=40):
    """Random sizes with every fourth pair of size 0, odd alignments."""
    sizes = random_sizes(n, gen, 1, 20_000)
    for i in range(1, n, 4):
        sizes[i] = 0
    return make_plan(sizes, gen, src_misalign=randint(0, 15, gen), dst_misalign=randint(0, 15, gen))


def memcpy_batch_and_check(src_where, dst_where, mode, stream_kind, gen, forms=("list", "list", "list")):
    plan = batch_plan(gen)
    if stream_kind == "None":
        sync_on, stream = torch.cuda.default_stream(), None
    else:
        sync_on = stream = torch.cuda.Stream()
    kwargs = {} if mode is None else {"mode": mode}
    if batch_mode_must_fail(mode):
        src, snapshot, dst = setup_copy(src_where, dst_where, plan, gen)
        msg = rejected("memcpy_batch", pair_args(src, dst, plan, *forms), RuntimeError, stream=stream, **kwargs)
        assert re.search(r"not available|not supported|unsupported|cudaError|12\.8", msg, re.I), msg
        assert_poisoned(dst)
        return
    copy_and_check("memcpy_batch", src_where, dst_where, plan, gen, forms, stream=stream, sync_on=sync_on, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["None", "created"])
@pytest.mark.parametrize("placement", BATCH_PLACEMENTS, ids=placement_id)
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_modes_and_placements(mode, placement, stream_kind, gen):
    memcpy_batch_and_check(*placement, mode, stream_kind, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [("device", "pinned"), ("pageable", "device")], ids=placement_id)
def test_memcpy_batch_default_mode(placement, gen):
    memcpy_batch_and_check(*placement, None, "None", gen)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "forms",
    [(f, f, "list") for f in HOST_ADDRESS_FORMS]
    + [("list", "numpy-uint64", f) for f in HOST_SIZE_FORMS if f not in ONE_SIZE_FORMS],
    ids=lambda f: "-".join(f),
)
def test_memcpy_batch_argument_forms(forms, gen):
    plan = make_plan(random_sizes(30, gen, 1, 9000), gen)
    copy_and_check("memcpy_batch", "device", "pinned", plan, gen, forms)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_one_size_for_all_pairs(mode, gen):
    if batch_mode_must_fail(mode):
        pytest.skip("the batch API is not available here")
    plan = make_plan([4099] * 33, gen)
    copy_and_check("memcpy_batch", "pinned", "device", plan, gen, ("list", "list", "int"), mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_many_pairs(mode, gen):
    """2,048 pairs of 32 KiB, device -> pinned, scattered over random slots."""
    if batch_mode_must_fail(mode):
        pytest.skip("the batch API is not available here")
    plan = slot_plan(2048, 32 * 1024, 64, gen)
    copy_and_check("memcpy_batch", "device", "pinned", plan, gen, ("numpy-uint64", "numpy-uint64", "int"), mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_zero_pairs_is_a_no_op(mode):
    if batch_mode_must_fail(mode):
        pytest.skip("the batch API is not available here")
    dst = poisoned("device", 1024)
    sync()
    assert kvbm_ext.memcpy_batch([], [], [], mode=mode) is None
    assert kvbm_ext.memcpy_batch(np.array([], dtype=np.uint64), np.array([], dtype=np.uint64), 8, mode=mode,
                                 stream=torch.cuda.Stream()) is None
    sync()
    assert_poisoned(dst)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_only_zero_size_pairs(mode, gen):
    if batch_mode_must_fail(mode):
        pytest.skip("the batch API is not available here")
    plan = make_plan([0] * 5, gen)
    src, snapshot, dst = setup_copy("device", "pinned", plan, gen)
    kvbm_ext.memcpy_batch(*pair_args(src, dst, plan), mode=mode)
    sync()
    assert_poisoned(dst)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_form", ["None", "torch.cuda.Stream"])
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_is_async_and_ordered_on_its_stream(mode, stream_form, gen):
    if batch_mode_must_fail(mode):
        pytest.skip("the batch API is not available here")
    placement = ("device", "pinned") if stream_form == "None" else ("pinned", "device")
    ordered_async_copy("memcpy_batch", *placement, stream_form, gen, mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["list", "numpy-uint64"])
@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs"])
@pytest.mark.parametrize("mode", MODES)
def test_memcpy_batch_null_address(mode, which, form, gen):
    plan = make_plan([512] * 6, gen)
    src, snapshot, dst = setup_copy("device", "pinned", plan, gen)
    s, d, z = pair_args(src, dst, plan)
    s, d = (_with(s, 3, 0), d) if which == "src_ptrs" else (s, _with(d, 3, 0))
    rejected("memcpy_batch", (ADDRESS_FORMS[form](s), ADDRESS_FORMS[form](d), z), ValueError,
             re.escape(which) + r"\[3\]", "null", mode=mode)
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs", "sizes"])
def test_memcpy_batch_device_resident_arrays_rejected(which, gen):
    plan = make_plan([512] * 4, gen)
    src, snapshot, dst = setup_copy("device", "device", plan, gen)
    forms = tuple("cuda-int64" if name == which else "list" for name in ("src_ptrs", "dst_ptrs", "sizes"))
    args = pair_args(src, dst, plan, *forms)
    sync()
    for mode in MODES:
        rejected("memcpy_batch", args, ValueError, which, mode=mode)
    assert_poisoned(dst)
    assert_unchanged(src, snapshot)


# --------------------------------------------------------------------------
# is_memcpy_batch_available with a GPU, and the KVBM_EXT_DEBUG line.
# --------------------------------------------------------------------------


def driver_version():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("libcuda.so.1 not loadable")
    v = ctypes.c_int(0)
    assert lib.cuDriverGetVersion(ctypes.byref(v)) == 0
    return v.value


@pytest.mark.gpu
def test_is_memcpy_batch_available_matches_versions():
    r = kvbm_ext.is_memcpy_batch_available()
    assert type(r) is bool
    if kvbm_ext.is_using_stubs():
        assert r is False
        return
    major, minor = (int(x) for x in kvbm_ext.build_info()["cuda_version"].split(".")[:2])
    drv = driver_version()
    want = (major, minor) >= (12, 8) and drv >= 12080
    assert r is want, f"build CUDA {major}.{minor}, driver {drv}: expected {want}"


_NAMES_TO_IGNORE = re.compile(
    r"memcpy_batch|batched_with_fallback|batch_without_fallback|fallback_only|cudaMemcpyBatchAsync|cudaMemcpyAsync"
)


def debug_line(err):
    lines = [line for line in err.splitlines() if line.startswith("kvbm_ext: ")]
    assert len(lines) == 1, f"expected one 'kvbm_ext: ' line on stderr, got {err!r}"
    line = lines[0]
    assert "memcpy_batch" in line, line
    return line, _NAMES_TO_IGNORE.sub(" ", line)


DEBUG_STREAMS = ["None", "0", "1", "created"]


def _debug_stream(kind):
    if kind == "created":
        s = torch.cuda.Stream()
        return s, s
    return torch.cuda.default_stream(), {"None": None, "0": 0, "1": 1}[kind]


def _logged_copy(mode, stream_kind, gen, capfd, placement=("device", "pinned")):
    """memcpy_batch under KVBM_EXT_DEBUG=1 (set by the caller); checks the data; returns stderr."""
    plan = batch_plan(gen, 24)
    src, snapshot, dst = setup_copy(*placement, plan, gen)
    sync_on, stream = _debug_stream(stream_kind)
    args = pair_args(src, dst, plan)
    capfd.readouterr()
    kwargs = {} if mode is None else {"mode": mode}
    kvbm_ext.memcpy_batch(*args, stream=stream, **kwargs)
    sync_on.synchronize()
    err = capfd.readouterr().err
    assert_copied(dst, snapshot, plan)
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [("device", "pinned"), ("pinned", "device")], ids=placement_id)
@pytest.mark.parametrize("stream_kind", DEBUG_STREAMS)
@pytest.mark.parametrize("mode", ["batched_with_fallback", None], ids=["batched_with_fallback", "default-mode"])
def test_debug_log_batched_with_fallback_uses_batch(mode, stream_kind, placement, gen, monkeypatch, capfd):
    """On the legacy default stream too, the batch API runs: nothing falls back."""
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    err = _logged_copy(mode, stream_kind, gen, capfd, placement)
    line, rest = debug_line(err)
    if batch_available():
        assert re.search(r"\bbatch\b", rest, re.I), f"line does not name the batch backend: {line!r}"
        low = rest.lower()
        assert "fallback" not in low and "falling back" not in low and "fall back" not in low, line
        assert not re.search(r"cudaError|not available", rest), line
    else:
        assert re.search(r"\basync\b", rest, re.I), f"line does not name the async backend: {line!r}"
        assert re.search(r"not available|cudaError\w+", rest), f"fallback reason missing: {line!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", DEBUG_STREAMS)
def test_debug_log_fallback_only_names_async(stream_kind, gen, monkeypatch, capfd):
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    err = _logged_copy("fallback_only", stream_kind, gen, capfd)
    line, rest = debug_line(err)
    assert re.search(r"\basync\b", rest, re.I), f"line does not name the async backend: {line!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["None", "created"])
def test_debug_log_batch_without_fallback(stream_kind, gen, monkeypatch, capfd):
    if not batch_available():
        pytest.skip("the batch API is not available here")
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    err = _logged_copy("batch_without_fallback", stream_kind, gen, capfd)
    line, rest = debug_line(err)
    assert re.search(r"\bbatch\b", rest, re.I), f"line does not name the batch backend: {line!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("fn,kwargs", [("vectorized_copy", {})] + [("memcpy_batch", {"mode": m}) for m in MODES],
                         ids=["vectorized_copy"] + [f"memcpy_batch-{m}" for m in MODES])
def test_no_debug_output_without_the_variable(fn, kwargs, gen, monkeypatch, capfd):
    if batch_mode_must_fail(kwargs.get("mode")):
        pytest.skip("the batch API is not available here")
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    plan = batch_plan(gen, 16)
    src, snapshot, dst = setup_copy("device", "pinned", plan, gen)
    args = pair_args(src, dst, plan)
    capfd.readouterr()
    copy_fn(fn)(*args, **kwargs)
    copy_fn(fn)(*args, stream=torch.cuda.Stream(), **kwargs)
    sync()
    assert capfd.readouterr().err == ""
    assert_copied(dst, snapshot, plan)
