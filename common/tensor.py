"""MXFP8Tensor: quantized data plus scales, and a tensor that knows its own layout.

Field names follow TE's ``MXFP8Tensor`` (``_rowwise_data``, ``_rowwise_scale_inv`` ...)
without the underscores.  Data is never padded and never transposed (columnwise data
has the input's shape and row-major layout); scales are padded compact matrices, or
GEMM-swizzled when ``with_gemm_swizzled_scales`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from . import format as F
from .layout import strip_padding, swizzle_scales, unswizzle_scales


@dataclass
class MXFP8Tensor:
    shape: torch.Size                                  #: the high-precision tensor's shape (..., K)
    dtype: torch.dtype                                 #: the high-precision tensor's dtype
    rowwise_data: Optional[torch.Tensor] = None        #: float8_e4m3fn, ``shape``; 1x32 blocks along K
    rowwise_scale_inv: Optional[torch.Tensor] = None   #: uint8 (round_up(M,128), round_up(K/32,4))
    columnwise_data: Optional[torch.Tensor] = None     #: float8_e4m3fn, ``shape``; 32x1 blocks along M
    columnwise_scale_inv: Optional[torch.Tensor] = None  #: uint8 (round_up(M/32,4), round_up(K,128))
    with_gemm_swizzled_scales: bool = False

    # -- geometry ------------------------------------------------------------------
    @property
    def m(self) -> int:
        return int(torch.Size(self.shape[:-1]).numel())

    @property
    def k(self) -> int:
        return int(self.shape[-1])

    @property
    def device(self) -> torch.device:
        t = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return t.device

    # -- layouts -------------------------------------------------------------------
    def compact(self) -> "MXFP8Tensor":
        """The same tensor with compact (unswizzled) scales."""
        if not self.with_gemm_swizzled_scales:
            return self
        return replace(
            self,
            rowwise_scale_inv=None if self.rowwise_scale_inv is None else unswizzle_scales(self.rowwise_scale_inv),
            columnwise_scale_inv=None if self.columnwise_scale_inv is None
            else unswizzle_scales(self.columnwise_scale_inv, columnwise=True),
            with_gemm_swizzled_scales=False)

    def swizzled(self) -> "MXFP8Tensor":
        """The same tensor with GEMM-swizzled scales."""
        if self.with_gemm_swizzled_scales:
            return self
        return replace(
            self,
            rowwise_scale_inv=None if self.rowwise_scale_inv is None else swizzle_scales(self.rowwise_scale_inv),
            columnwise_scale_inv=None if self.columnwise_scale_inv is None
            else swizzle_scales(self.columnwise_scale_inv, columnwise=True),
            with_gemm_swizzled_scales=True)

    def rowwise_scales_unpadded(self) -> torch.Tensor:
        """uint8 (M, K/32): the wire format's scales (compact, padding stripped)."""
        if self.rowwise_scale_inv is None:
            raise ValueError("this MXFP8Tensor has no rowwise copy")
        return strip_padding(self.compact().rowwise_scale_inv, self.m, self.k // F.BLOCK_SIZE)

    def columnwise_scales_unpadded(self) -> torch.Tensor:
        """uint8 (M/32, K)."""
        if self.columnwise_scale_inv is None:
            raise ValueError("this MXFP8Tensor has no columnwise copy")
        return strip_padding(self.compact().columnwise_scale_inv, self.m // F.BLOCK_SIZE, self.k)

    # -- values --------------------------------------------------------------------
    def dequantize(self, columnwise: Optional[bool] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact values (fp32 holds every MXFP8 value of a finite block exactly).

        Uses the rowwise copy unless ``columnwise=True`` or only the columnwise copy exists.
        """
        if columnwise is None:
            columnwise = self.rowwise_data is None
        if columnwise:
            if self.columnwise_data is None:
                raise ValueError("this MXFP8Tensor has no columnwise copy")
            data = self.columnwise_data.reshape(self.m, self.k)
            s = self.columnwise_scales_unpadded()                       # (M/32, K)
            vals = dequantize_blocks(data.t(), s.t()).t()
        else:
            if self.rowwise_data is None:
                raise ValueError("this MXFP8Tensor has no rowwise copy")
            vals = dequantize_blocks(self.rowwise_data.reshape(self.m, self.k), self.rowwise_scales_unpadded())
        return vals.reshape(self.shape).to(dtype)


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of (..., R, C) E4M3 data with (..., R, C/32) E8M0 scales along the last dim."""
    r, c = data.shape[-2:]
    if c % F.BLOCK_SIZE or tuple(scales.shape[-2:]) != (r, c // F.BLOCK_SIZE):
        raise ValueError(
            f"data {tuple(data.shape)} and scales {tuple(scales.shape)} do not form 1x{F.BLOCK_SIZE} blocks")
    vals = F.decode_e4m3(data).reshape(*data.shape[:-1], c // F.BLOCK_SIZE, F.BLOCK_SIZE)
    return (vals * F.e8m0_to_float(scales).unsqueeze(-1)).reshape(data.shape)


def dequantize_mxfp8(q: MXFP8Tensor, columnwise: Optional[bool] = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact values of an :class:`MXFP8Tensor` (see :meth:`MXFP8Tensor.dequantize`)."""
    return q.dequantize(columnwise=columnwise, dtype=dtype)
