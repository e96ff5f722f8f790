"""Decode an on-grid weight to bf16 in one pass: fp8 codes + E8M0 scales -> ``e4m3(q) * 2^(e-127)``.

The prefill path of the fast dense kernel (``common/grid_kernels/marlin.py``) dequantizes W
into a bf16 scratch tensor per call and hands it to cuBLAS: 3 bytes of traffic per weight
element (1 read, 2 written), instead of a permanent bf16 copy of the model.

Exactness: the decode is exact in fp32 (see ``qdq_triton``), and the one RNE cast to bf16
is exact for every block whose scale byte is >= 3 (``qdq_triton.BF16_EXACT_MIN_SCALE``);
weights of such tiny blocks (amax <= ~1e-35) are checked for at load by the kernel that
uses this.  Output equals ``dequantize_blocks(q, s).to(bfloat16)`` bit for bit, NaN as NaN: an
E4M3 NaN code writes ``format.BF16_NAN_BITS``; scale byte 255 decodes to ``format.F32_NAN_BITS``
(as ``format.e8m0_to_float``), a NaN block whose bf16 cast is NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .gemm_triton import _e4m3_to_f32, _e8m0_to_f32
from .qdq_triton import _f32_bits_to_bf16_bits, _mul_f32_exact

_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E8M0_BIAS = tl.constexpr(F.E8M0_BIAS)               # scale byte of 1.0: the neutral value of a masked load
_E4M3_NAN_BYTE = tl.constexpr(F.E4M3_NAN_BYTE)
_E4M3_NEG_NAN_BYTE = tl.constexpr(F.E4M3_NAN_BYTE | F.E4M3_SIGN_MASK)
_BF16_NAN_BITS = tl.constexpr(F.BF16_NAN_BITS)

#: (BLOCK_N, BLOCK_K, num_warps)
DEQUANT_CONFIG = (32, 256, 4)


@triton.jit
def _dequant_rows_bf16_kernel(q_ptr, s_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_yn,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    NB: tl.constexpr = BLOCK_K // _BLOCK
    sb = pid_k * NB + tl.arange(0, NB)
    smask = (rows[:, None] < N) & (sb[None, :] < K // _BLOCK)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + cols[None, :], mask=mask, other=0)
    e = tl.load(s_ptr + rows[:, None] * stride_sn + sb[None, :], mask=smask, other=_E8M0_BIAS)
    d = tl.reshape(tl.broadcast_to(_e8m0_to_f32(e)[:, :, None], (BLOCK_N, NB, _BLOCK)), (BLOCK_N, BLOCK_K))
    v = _mul_f32_exact(_e4m3_to_f32(q, USE_ASM), d, USE_ASM)
    if USE_ASM:
        h = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        h = _f32_bits_to_bf16_bits(v.to(tl.int32, bitcast=True)).to(tl.int16)
    h = tl.where((q == _E4M3_NAN_BYTE) | (q == _E4M3_NEG_NAN_BYTE), _BF16_NAN_BITS, h)   # E4M3 NaN codes -> bf16 NaN
    tl.store(y_ptr + rows[:, None] * stride_yn + cols[None, :], h.to(tl.int16), mask=mask)


def dequant_rows_bf16(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize_blocks(q, s).to(bfloat16)`` for q float8_e4m3fn (N, K), s uint8 (N, K/32)."""
    n, k = q.shape
    if s.shape != (n, k // F.BLOCK_SIZE) or k % F.BLOCK_SIZE:
        raise ValueError(f"dequant_rows_bf16: codes {tuple(q.shape)} and scales {tuple(s.shape)} do not pair")
    if out is None:
        out = torch.empty((n, k), dtype=torch.bfloat16, device=q.device)
    if n and k:
        bn, bk, warps = DEQUANT_CONFIG
        grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
        _dequant_rows_bf16_kernel[grid](q.view(torch.uint8), s, out.view(torch.int16), n, k,
                                        q.stride(0), s.stride(0), out.stride(0),
                                        BLOCK_N=bn, BLOCK_K=bk, USE_ASM=not interpreting(), num_warps=warps)
    return out
