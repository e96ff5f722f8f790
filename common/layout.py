"""Scale layouts: padded compact <-> GEMM-swizzled, and padding in/out.

TE keeps E8M0 scales in one of two layouts of the same padded buffer:

* compact: a row-major (rows, cols) matrix, padded as ``format.rowwise_scale_shape`` /
  ``format.columnwise_scale_shape`` say;
* GEMM-swizzled (cuBLASLt's 128x4 tiles of 512 bytes; TE ``swizzle.cuh``): element
  (i, j) of the compact matrix sits at flat offset ``format.swizzle_offset(i, j, cols)``.
  The columnwise swizzle is the rowwise swizzle of the transposed columnwise matrix.

Both functions here keep the buffer's shape: only the byte order changes.
"""

from __future__ import annotations

import torch

from . import format as F


def _check_swizzle_shape(rows: int, cols: int, what: str) -> None:
    if rows % F.SWIZZLE_TILE_ROWS or cols % F.SWIZZLE_TILE_COLS:
        raise ValueError(
            f"{what}: swizzling needs the padded compact shape (rows a multiple of "
            f"{F.SWIZZLE_TILE_ROWS}, cols a multiple of {F.SWIZZLE_TILE_COLS}); got ({rows}, {cols})")


#: a 128-row tile is _GROUPS interleaved groups of F.SWIZZLE_SUB_ROWS rows (4 of 32)
_GROUPS = F.SWIZZLE_TILE_ROWS // F.SWIZZLE_SUB_ROWS


def _swizzle_2d(s: torch.Tensor) -> torch.Tensor:
    # i = a*128 + b*32 + c, j = d*4 + e  ->  off = (a*(cols/4) + d)*512 + c*16 + b*4 + e
    rows, cols = s.shape
    _check_swizzle_shape(rows, cols, "swizzle_scales")
    return (s.reshape(rows // F.SWIZZLE_TILE_ROWS, _GROUPS, F.SWIZZLE_SUB_ROWS,
                      cols // F.SWIZZLE_TILE_COLS, F.SWIZZLE_TILE_COLS)
             .permute(0, 3, 2, 1, 4).reshape(rows, cols).contiguous())


def _unswizzle_2d(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    _check_swizzle_shape(rows, cols, "unswizzle_scales")
    return (s.reshape(rows // F.SWIZZLE_TILE_ROWS, cols // F.SWIZZLE_TILE_COLS, F.SWIZZLE_SUB_ROWS,
                      _GROUPS, F.SWIZZLE_TILE_COLS)
             .permute(0, 3, 2, 1, 4).reshape(rows, cols).contiguous())


def swizzle_scales(scale_inv: torch.Tensor, columnwise: bool = False) -> torch.Tensor:
    """Compact padded scales -> TE's GEMM-swizzled layout (same shape, same dtype).

    ``scale_inv`` is a 2-D padded compact scale tensor as ``quantize_mxfp8`` returns
    (rowwise: (round_up(M,128), round_up(K/32,4)); columnwise: (round_up(M/32,4),
    round_up(K,128))).  A leading batch of such matrices (e.g. experts) is swizzled
    matrix by matrix.
    """
    if scale_inv.dim() > 2:
        return torch.stack([swizzle_scales(s, columnwise) for s in scale_inv])
    if scale_inv.dim() != 2:
        raise ValueError(f"swizzle_scales needs a 2-D scale matrix; got shape {tuple(scale_inv.shape)}")
    if columnwise:
        return _swizzle_2d(scale_inv.t().contiguous()).reshape(scale_inv.shape)
    return _swizzle_2d(scale_inv)


def unswizzle_scales(scale_inv: torch.Tensor, columnwise: bool = False) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`."""
    if scale_inv.dim() > 2:
        return torch.stack([unswizzle_scales(s, columnwise) for s in scale_inv])
    if scale_inv.dim() != 2:
        raise ValueError(f"unswizzle_scales needs a 2-D scale matrix; got shape {tuple(scale_inv.shape)}")
    if columnwise:
        rows, cols = scale_inv.shape
        return _unswizzle_2d(scale_inv.reshape(cols, rows)).t().contiguous()
    return _unswizzle_2d(scale_inv)


def pad_scales(scales: torch.Tensor, padded_shape: tuple[int, int]) -> torch.Tensor:
    """Place an unpadded (rows, cols) scale matrix into a zero-padded buffer of ``padded_shape``."""
    rows, cols = scales.shape[-2:]
    if rows > padded_shape[0] or cols > padded_shape[1]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit padded shape {padded_shape}")
    out = torch.full((*scales.shape[:-2], *padded_shape), F.SCALE_PAD_BYTE,
                     dtype=F.SCALE_DTYPE, device=scales.device)
    out[..., :rows, :cols] = scales
    return out


def strip_padding(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The meaningful (rows, cols) corner of a padded compact scale tensor (contiguous copy)."""
    if scales.shape[-2] < rows or scales.shape[-1] < cols:
        raise ValueError(
            f"scale tensor of shape {tuple(scales.shape)} is smaller than its unpadded size ({rows}, {cols})")
    return scales[..., :rows, :cols].contiguous()
