"""The references themselves, checked against the flat offset formulas of REFERENCE.md section 1.

No kvbm_ext here: if these fail, every other verdict is meaningless.
"""

import pytest
import torch

from support.asserts import assert_bitwise_equal, poison_
from support.builders import random_tensor
from support.references import block_to_universal_ref, chunk_shape, universal_to_block_ref


def _universal_offset(h, l, o, t, d, nl, no, nt, hd):
    return (((h * nl + l) * no + o) * nt + t) * hd + d


def _chunk_offset(h, t, d, nh, nt, hd, layout):
    if layout == "NHD":
        return (t * nh + h) * hd + d
    return (h * nt + t) * hd + d


@pytest.mark.parametrize("layout", ["NHD", "HND", "nhd", "hNd"])
@pytest.mark.parametrize("nl,no,nh,nt,hd", [(2, 2, 3, 4, 5), (3, 1, 1, 2, 3), (1, 2, 2, 1, 1)])
def test_references_match_offset_formula(layout, nl, no, nh, nt, hd):
    up = layout.upper()
    # Unique values: every element is its own universal offset.
    universal = torch.arange(nh * nl * no * nt * hd, dtype=torch.int64).reshape(nh, nl, no, nt, hd)
    chunks = []
    for l in range(nl):
        for o in range(no):
            flat = torch.full((nt * nh * hd,), -1, dtype=torch.int64)
            for h in range(nh):
                for t in range(nt):
                    for d in range(hd):
                        flat[_chunk_offset(h, t, d, nh, nt, hd, up)] = _universal_offset(h, l, o, t, d, nl, no, nt, hd)
            chunks.append(flat.reshape(chunk_shape(nh, nt, hd, up)))
    assert all(int(c.min()) >= 0 for c in chunks)

    assert_bitwise_equal(block_to_universal_ref(chunks, no, layout), universal, "b2u ref")
    for got, want in zip(universal_to_block_ref(universal, layout), chunks):
        assert_bitwise_equal(got, want, "u2b ref")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
def test_random_tensor_covers_bit_patterns_and_compare_is_exact(dtype, gen):
    t = random_tensor((64, 64), dtype, generator=gen)
    raw = t.view(torch.uint8)
    assert len(torch.unique(raw)) > 200, "random bytes should cover nearly every byte value"
    assert_bitwise_equal(t, t.clone())  # NaN-safe
    u = t.clone()
    u.view(torch.uint8).view(-1)[7] ^= 1
    with pytest.raises(AssertionError):
        assert_bitwise_equal(u, t)
    poison_(u)
    assert bool((u.view(torch.uint8) == 0xA5).all())
