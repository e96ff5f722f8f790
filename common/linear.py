"""The forward of a Linear on the learner's grid, as both engines call it.

TE's ``y = x W^T`` (cuBLASLt "TN") consumes W's rowwise data and scales (1x32 blocks
along in_features, the reduction dim) and x quantized rowwise (1x32 along K); products
of the exactly dequantized operands are summed in fp32; the bias is added to the fp32
result (GEMM epilogue) and the output is cast to the activation's dtype.

``mxfp8_linear_reference`` is that definition in plain PyTorch (any device; the CPU path
of both plugins).  Fast GPU kernels are separate and are tested against it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .grid_weight import GridWeight
from .quantize import quantize_rows
from .tensor import dequantize_blocks


def check_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor, name: str = "weight") -> None:
    """Raise ``ValueError`` (``wire.WireFormatError``) naming ``name`` unless (weight, scales) is a
    wire-format pair: the one rule set of ``grid_weight.GridWeight.checked``."""
    GridWeight.checked(name, weight, weight_scale_inv)


def dequantize_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of an on-grid weight (fp8 (..., N, K) + uint8 (..., N, K/32))."""
    return dequantize_blocks(weight, weight_scale_inv)


def mxfp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                           bias: Optional[torch.Tensor] = None,
                           weight_dequantized: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x W^T on the grid: x quantized rowwise (TE-exact), W on the grid, fp32 accumulation.

    ``weight``: float8_e4m3fn (N, K); ``weight_scale_inv``: uint8 (N, K/32), unpadded.
    ``weight_dequantized`` (optional): a cached fp32 copy of W's exact values (a derived
    tensor the caller keeps in sync).  Returns x's dtype.
    """
    k = x.shape[-1]
    xq, xs = quantize_rows(x.reshape(-1, k))
    a = dequantize_blocks(xq, xs)
    w = weight_dequantized if weight_dequantized is not None else dequantize_weight(weight, weight_scale_inv)
    y = a @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
