"""The quantizer: high-precision tensor -> MXFP8Tensor, byte-identical to TE.

Two implementations of the same rules (``format.py``), chosen per device:

* ``torch``: plain tensor ops, any device; the reference.
* ``triton``: one fused kernel on CUDA (``kernels/quantize_triton.py``).

``quantize_rows`` is the building block both engines call for activations: rowwise
only, any number of rows (TE's 32-row rule concerns its 2-D tensors, not the math of a
1x32 block), unpadded scales.
"""

from __future__ import annotations

import torch

from . import format as F
from .layout import pad_scales
from .tensor import MXFP8Tensor

SUPPORTED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKENDS = ("auto", "torch", "triton")


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"MXFP8 quantization takes bf16, fp16 or fp32 input; got {x.dtype}")


def quantize_blocks_torch(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: 1x32 blocks along the last dim of an (R, C) tensor.

    Returns (uint8 codes (R, C), uint8 scales (R, C/32)).
    """
    r, c = x2d.shape
    xb = x2d.reshape(r, c // F.BLOCK_SIZE, F.BLOCK_SIZE)
    if xb.numel() == 0:
        return (torch.empty(r, c, dtype=torch.uint8, device=x2d.device),
                torch.empty(r, c // F.BLOCK_SIZE, dtype=F.SCALE_DTYPE, device=x2d.device))
    amax = F.abs_bits_ignoring_nan(xb).amax(dim=-1).view(torch.float32)
    e = F.e8m0_from_amax(amax)
    q = F.encode_e4m3(xb, F.scale_reciprocal(e).unsqueeze(-1))
    return q.reshape(r, c), e.to(F.SCALE_DTYPE)


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "torch":
        return False
    from .kernels import triton_available
    if backend == "triton":
        if not triton_available(x):
            raise RuntimeError("backend='triton' needs Triton and a CUDA tensor")
        return True
    return triton_available(x)


def quantize_rows(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise MXFP8 of (..., K): float8_e4m3fn data (..., K) and uint8 scales (..., K/32), unpadded.

    Any number of rows; K must be a multiple of 32.  This is the activation quantizer
    of the learner's forward (TE quantizes x rowwise, 1x32 along K).
    """
    _check_dtype(x)
    k = F.check_k(x.shape)
    x2 = x.reshape(-1, k)
    if _use_triton(x, backend):
        from .kernels.quantize_triton import quantize_rows_triton
        q, s = quantize_rows_triton(x2)
    else:
        q, s = quantize_blocks_torch(x2)
    return q.view(F.FP8_DTYPE).reshape(x.shape), s.reshape(*x.shape[:-1], k // F.BLOCK_SIZE)


def quantize_mxfp8(x: torch.Tensor, rowwise: bool = True, columnwise: bool = False,
                   backend: str = "auto", swizzled: bool = False) -> MXFP8Tensor:
    """Quantize ``x`` (bf16/fp16/fp32, shape (..., K), CPU or CUDA) exactly as TE's MXFP8 cast.

    Returns an :class:`MXFP8Tensor` whose data bytes and scale bytes equal TE's, with the
    scale padding written as 0x00.  Shapes TE rejects (fewer than 2 dims, M or K not a
    multiple of 32) raise ``ValueError``.  ``swizzled=True`` returns GEMM-swizzled scales.
    """
    _check_dtype(x)
    if not (rowwise or columnwise):
        raise ValueError("quantize_mxfp8 needs rowwise=True, columnwise=True or both")
    m, k = F.check_te_shape(x.shape)
    x2 = x.reshape(m, k)
    out = MXFP8Tensor(shape=x.shape, dtype=x.dtype)
    if _use_triton(x, backend):
        from .kernels.quantize_triton import quantize_mxfp8_triton
        rq, rs, cq, cs = quantize_mxfp8_triton(x2, rowwise, columnwise)
    else:
        rq = rs = cq = cs = None
        if rowwise:
            q, s = quantize_blocks_torch(x2)
            rq, rs = q, pad_scales(s, F.rowwise_scale_shape(m, k))
        if columnwise:
            q, s = quantize_blocks_torch(x2.t())
            cq, cs = q.t().contiguous(), pad_scales(s.t(), F.columnwise_scale_shape(m, k))
    if rowwise:
        out.rowwise_data, out.rowwise_scale_inv = rq.view(F.FP8_DTYPE).reshape(x.shape), rs
    if columnwise:
        out.columnwise_data, out.columnwise_scale_inv = cq.view(F.FP8_DTYPE).reshape(x.shape), cs
    return out.swizzled() if swizzled else out


class MXFP8Quantizer:
    """A quantizer makes tensors (TE's ``MXFP8Quantizer`` shape of API)."""

    def __init__(self, rowwise: bool = True, columnwise: bool = False,
                 swizzled: bool = False, backend: str = "auto"):
        self.rowwise, self.columnwise = rowwise, columnwise
        self.swizzled, self.backend = swizzled, backend

    def __call__(self, x: torch.Tensor) -> MXFP8Tensor:
        return quantize_mxfp8(x, self.rowwise, self.columnwise, self.backend, self.swizzled)

    def __repr__(self) -> str:
        return (f"MXFP8Quantizer(rowwise={self.rowwise}, columnwise={self.columnwise}, "
                f"swizzled={self.swizzled}, backend={self.backend!r})")

