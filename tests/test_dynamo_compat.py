"""kvbm_ext.compat.dynamo, Dynamo kvbm-kernels' retired Python API over kvbm_ext: Dynamo's
spellings (layouts, backends and their aliases, one tensor for nb = 1, an empty batch)
reach the kvbm_ext functions; the bytes moved are exact, on the CPU and on the GPU; errors
keep Dynamo's exception types and write nothing; a GPU call has finished when it returns.
Dynamo's own test file (lib/kvbm-kernels/python/tests/test_tensor_kernels.py, ai-dynamo/dynamo,
not in this repository) passes against the module with its import pointed at kvbm_ext.compat.dynamo."""

import pytest
import torch

import kvbm_ext
from kvbm_ext.compat import dynamo as ctk
from support.asserts import assert_all_bitwise_equal, assert_poisoned, poison_
from support.builders import clone_all, make_case, make_op_case
from support.devices import DEVICES, SLEEP_CYCLES
from support.references import expected_blocks, expected_op, expected_universals


LAYOUTS = ["NHD", "nhd", "Nhd", "HND", "hnd", "Hnd"]
# Every spelling Dynamo accepted, and the kvbm_ext backend it names.
BACKENDS = [
    (None, "auto"), ("auto", "auto"), (" AUTO ", "auto"),
    ("kernel", "kernel"), ("kernel_only", "kernel"), ("Kernel_Only", "kernel"),
    ("async", "async"), ("memcpy_async", "async"), ("cuda_memcpy_async", "async"),
    ("batch", "batch"), ("memcpy_batch", "batch"), ("\tCUDA_MEMCPY_BATCH\n", "batch"),
]
SHAPE = (3, 2, 2, 4, 8, 16)             # nb, nl, no, nh, nt, hd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_universal_both_ways(device, layout, dtype):
    blocks, universals = make_case(*SHAPE, dtype, layout.upper(), device)
    want = expected_universals(blocks, SHAPE[2], layout)
    poison_(universals)
    assert ctk.block_to_universal(blocks, universals, layout) is None
    assert_all_bitwise_equal(universals, want, "universals")

    _, fresh = make_case(*SHAPE, dtype, layout.upper(), device)
    want = expected_blocks(fresh, layout)
    poison_(blocks)
    assert ctk.universal_to_block(fresh, blocks, layout) is None
    assert_all_bitwise_equal(blocks, want, "blocks")


@pytest.mark.parametrize("device", DEVICES)
def test_one_tensor_is_one_block(device):
    blocks, universals = make_case(1, 2, 2, 3, 4, 8, torch.float16, "HND", device)
    universal = universals[0]
    want = expected_universals(blocks, 2, "HND")
    poison_(universal)
    ctk.block_to_universal(blocks, universal, "HND")
    assert_all_bitwise_equal([universal], want, "universal")
    poison_(blocks)
    ctk.universal_to_block(universal, blocks, "HND")
    assert_all_bitwise_equal(blocks, expected_blocks([universal], "HND"), "blocks")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spelling", [spelling for spelling, _ in BACKENDS])
def test_operational_both_ways(device, spelling):
    blocks, _, operationals = make_op_case(*SHAPE, torch.bfloat16, device=device)
    want = expected_op("b2o", blocks, operationals)
    poison_(operationals)
    assert ctk.block_to_operational(blocks, operationals, spelling) is None
    assert_all_bitwise_equal(operationals, want, "operationals")

    want = expected_op("o2b", operationals, blocks)
    poison_(blocks)
    assert ctk.operational_to_block(operationals, blocks, backend=spelling) is None
    assert_all_bitwise_equal(blocks, want, "blocks")


@pytest.mark.parametrize("spelling,backend", BACKENDS)
@pytest.mark.parametrize("name", ["block_to_operational", "operational_to_block"])
def test_backend_spellings_name_kvbm_ext_backends(monkeypatch, name, spelling, backend):
    """A GPU call gets the backend the spelling names; a call that can only run on the CPU
    gets "auto", the one backend kvbm_ext takes there."""
    seen = []
    monkeypatch.setattr(kvbm_ext, name, lambda *args, **kwargs: seen.append(kwargs["backend"]))
    flat = torch.zeros(2, 2, 6)
    getattr(ctk, name)(flat, flat, spelling)
    monkeypatch.setattr(ctk, "_runs_on_cpu", lambda flats: False)
    getattr(ctk, name)(flat, flat, spelling)
    assert seen == ["auto", backend]


def test_empty_batch_does_nothing_whatever_the_blocks():
    blocks, universals = make_case(*SHAPE, torch.float32, "NHD")
    poison_(blocks)
    assert ctk.universal_to_block([], blocks, "NHD") is None
    assert ctk.operational_to_block((), blocks, None) is None
    assert_poisoned(blocks, "blocks")


@pytest.mark.parametrize("layout", ["nHd", "NDH", "", "NHD "])
def test_unknown_layout_is_a_value_error_before_anything(layout):
    with pytest.raises(ValueError, match="layout"):
        ctk.block_to_universal([], [], layout)


@pytest.mark.parametrize("backend", ["copy_engines", "kernels", "", "batched"])
def test_unknown_backend_is_a_value_error_before_anything(backend):
    with pytest.raises(ValueError, match=f"backend: unknown backend {backend!r}"):
        ctk.operational_to_block([], [], backend)


@pytest.mark.parametrize("call", [
    lambda: ctk.block_to_universal([], [], None),
    lambda: ctk.universal_to_block([], [], b"NHD"),
    lambda: ctk.block_to_operational([], [], 1),
    lambda: ctk.block_to_universal([], 7, "NHD"),
])
def test_wrong_argument_types_are_type_errors(call):
    with pytest.raises(TypeError):
        call()


def test_shape_mismatch_is_a_value_error_and_writes_nothing():
    blocks, universals = make_case(*SHAPE, torch.float32, "NHD")
    blocks[1][3] = torch.zeros(SHAPE[4] - 1, SHAPE[3], SHAPE[5])
    poison_(universals)
    with pytest.raises(ValueError, match=r"blocks\[1\]\[3\]"):
        ctk.block_to_universal(blocks, universals, "NHD")
    assert_poisoned(universals, "universals")


def test_mixed_dtypes_are_a_type_error_and_write_nothing():
    blocks, universals = make_case(*SHAPE, torch.float16, "NHD")
    universals[2] = torch.zeros(universals[2].shape, dtype=torch.float32)
    poison_(universals)
    sources = clone_all(blocks)
    with pytest.raises(TypeError):
        ctk.block_to_universal(blocks, universals, "NHD")
    assert_poisoned(universals, "universals")
    assert_all_bitwise_equal(blocks, sources, "blocks")


@pytest.mark.gpu
def test_gpu_call_has_finished_when_it_returns():
    """The call queues behind a GPU sleep on the current stream and returns only once it ran."""
    blocks, universals = make_case(*SHAPE, torch.bfloat16, "NHD", "cuda")
    want = expected_universals(blocks, SHAPE[2], "NHD")
    poison_(universals)
    ctk.block_to_universal(blocks, universals, "NHD")     # warm-up: loads the kernels
    poison_(universals)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctk.block_to_universal(blocks, universals, "NHD")
        assert side.query(), "the call returned before its stream had run it"
    assert_all_bitwise_equal(universals, want, "universals")
