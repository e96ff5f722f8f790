"""The learner's Linear forward on the grid (common/linear.py)."""

import pytest
import torch

from mxfp8_learner_grid.common import (dequantize_blocks, mxfp8_linear_reference, quantize_mxfp8, quantize_rows)
from mxfp8_learner_grid.common.linear import check_weight


def make(n=96, k=160, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    wq, ws = quantize_rows(w)
    return w, wq, ws


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_is_grid_product_with_fp32_accumulation(dtype):
    w, wq, ws = make(dtype=dtype)
    x = torch.randn(5, 7, 160).to(dtype)
    b = torch.randn(96).to(dtype)
    y = mxfp8_linear_reference(x, wq, ws, b)
    assert y.dtype == dtype and y.shape == (5, 7, 96)
    # exact reference: dequantized operands in float64, bias in fp32 added to the result
    xq, xs = quantize_rows(x)
    a = dequantize_blocks(xq.reshape(35, 160), xs.reshape(35, 5)).double()
    bw = dequantize_blocks(wq, ws).double()
    exact = a @ bw.t() + b.double()
    rel = ((y.reshape(35, 96).double() - exact).norm() / exact.norm()).item()
    # only the cast of the output to `dtype` (and fp32 summation order) separate them
    tol = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}[dtype]
    assert rel < tol
    # the activation really is on the grid: a high-precision x gives a measurably different y
    y_hp = (x.reshape(35, 160).double() @ bw.t() + b.double())
    assert ((y_hp - exact).norm() / exact.norm()).item() > 1e-3


def test_weight_quantized_bytes_used_as_given():
    w, wq, ws = make()
    x = torch.randn(3, 160, dtype=torch.bfloat16)
    y1 = mxfp8_linear_reference(x, wq, ws)
    ws2 = ws.clone()
    ws2[0, 0] += 1                       # doubling one block's scale changes the first output
    y2 = mxfp8_linear_reference(x, wq, ws2)
    assert not torch.equal(y1[:, 0], y2[:, 0]) and torch.equal(y1[:, 1:], y2[:, 1:])


def test_cached_dequantized_weight_is_equivalent():
    w, wq, ws = make()
    x = torch.randn(4, 160, dtype=torch.bfloat16)
    assert torch.equal(mxfp8_linear_reference(x, wq, ws),
                       mxfp8_linear_reference(x, wq, ws, weight_dequantized=dequantize_blocks(wq, ws)))


def test_linear_matches_te_quantized_weight_object():
    w, wq, ws = make()
    q = quantize_mxfp8(w)
    assert torch.equal(q.rowwise_data.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(q.rowwise_scales_unpadded(), ws)


def test_check_weight_errors_name_the_tensor():
    w, wq, ws = make()
    with pytest.raises(ValueError, match="layer.w: on-grid weight must be"):
        check_weight(w, ws, "layer.w")
    with pytest.raises(ValueError, match=r"layer.w scales: shape \(128, 8\); expected \(96, 5\)"):
        check_weight(wq, torch.zeros(128, 8, dtype=torch.uint8), "layer.w")
    with pytest.raises(ValueError, match="uint8"):
        check_weight(wq, ws.float(), "layer.w")
