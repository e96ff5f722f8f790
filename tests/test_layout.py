"""Scale layouts: the swizzle against TE's offset formula, round trips, and torchao's to_blocked as a peer."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mxfp8_learner_grid.common import format as F
from mxfp8_learner_grid.common import pad_scales, quantize_mxfp8, strip_padding, swizzle_scales, unswizzle_scales


def swizzle_by_formula(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    out = torch.empty(rows * cols, dtype=s.dtype)
    i = torch.arange(rows).repeat_interleave(cols)
    j = torch.arange(cols).repeat(rows)
    out[F.swizzle_offset(i, j, cols)] = s.reshape(-1)
    return out.reshape(rows, cols)


@pytest.mark.parametrize("rows,cols", [(128, 4), (128, 8), (256, 4), (384, 12), (512, 132)])
def test_rowwise_swizzle_is_te_formula(rows, cols):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    sw = swizzle_scales(s)
    assert sw.shape == s.shape and sw.dtype == torch.uint8
    assert torch.equal(sw, swizzle_by_formula(s))
    assert torch.equal(unswizzle_scales(sw), s)


@pytest.mark.parametrize("m,k", [(32, 128), (96, 160), (256, 4096), (4096, 96)])
def test_columnwise_swizzle_is_rowwise_swizzle_of_transpose(m, k):
    q = quantize_mxfp8(torch.randn(m, k), rowwise=False, columnwise=True)
    cs = q.columnwise_scale_inv
    sw = swizzle_scales(cs, columnwise=True)
    assert sw.shape == cs.shape
    assert torch.equal(sw.reshape(-1), swizzle_by_formula(cs.t().contiguous()).reshape(-1))
    assert torch.equal(unswizzle_scales(sw, columnwise=True), cs)


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 4), c=st.integers(1, 6), seed=st.integers(0, 1000), columnwise=st.booleans())
def test_round_trip_property(r, c, seed, columnwise):
    g = torch.Generator().manual_seed(seed)
    shape = (4 * c, 128 * r) if columnwise else (128 * r, 4 * c)
    s = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    sw = swizzle_scales(s, columnwise)
    assert torch.equal(unswizzle_scales(sw, columnwise), s)
    # a permutation: same multiset of bytes
    assert torch.equal(torch.sort(sw.reshape(-1)).values, torch.sort(s.reshape(-1)).values)


def test_swizzle_rejects_unpadded_shapes():
    with pytest.raises(ValueError, match="padded compact shape"):
        swizzle_scales(torch.zeros(96, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        swizzle_scales(torch.zeros(5, dtype=torch.uint8))


def test_batched_swizzle_is_per_matrix():
    s = torch.randint(0, 256, (3, 128, 8), dtype=torch.uint8)
    sw = swizzle_scales(s)
    for e in range(3):
        assert torch.equal(sw[e], swizzle_scales(s[e]))
    assert torch.equal(unswizzle_scales(sw), s)


def test_pad_and_strip():
    s = torch.randint(1, 255, (96, 5), dtype=torch.uint8)
    p = pad_scales(s, F.rowwise_scale_shape(96, 160))
    assert p.shape == (128, 8) and (p[96:] == 0).all() and (p[:, 5:] == 0).all()
    assert torch.equal(strip_padding(p, 96, 5), s)
    with pytest.raises(ValueError):
        strip_padding(s, 128, 5)


def test_torchao_to_blocked_peer():
    """torchao's to_blocked (cuBLAS/TE 128x4 tile layout) is an independent swizzle implementation."""
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    for rows, cols in ((128, 4), (256, 12), (96, 5), (300, 9)):
        s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
        padded = pad_scales(s, (-(-rows // 128) * 128, -(-cols // 4) * 4))
        theirs = utils.to_blocked(s).view(torch.uint8).reshape(-1)
        assert torch.equal(swizzle_scales(padded).reshape(-1), theirs)
