"""The activation qdq fused into the op that produces the activation: RMSNorm (+ residual) and SiLU * up.

A grid Linear quantize-dequantizes its input first (``qdq_triton.qdq_rows``: one launch per Linear).
At decode sizes that launch costs about as much as the whole producer (1.6-2.7 us on the H200,
``bench_qdq_fusion.py``), and Inductor's own fusion of RMSNorm + qdq is slower than two launches
(seventh session).  These kernels compute the producer and write its output's exact grid values in
one pass, so that the Linear after it skips its own qdq (``x_on_grid``):

* :func:`rms_norm_qdq`: ``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``'s native definition, one
  row per program -- ``s = x + r`` in fp32 (``r_out = bf16(s)``), ``var = sum(s^2) / K``,
  ``n = bf16(s * rsqrt(var + eps))``, ``o = bf16(n * w)`` -- then the TE-exact qdq of ``o``.
* :func:`silu_mul_qdq`: ``SiluAndMul``'s ``silu(g) * u`` as torch computes it on the GPU (``bf16(silu(g))``,
  then ``bf16(silu * u)``), then the TE-exact qdq of the product: the MoE's kernel
  (``moe_triton.silu_mul_qdq``), bit for bit ``qdq_rows(F.silu(g) * u)`` on the GPU.

The norm's arithmetic is the engine's up to fp32 summation order and the hardware rsqrt (one-ulp
differences, as between any two RMSNorm kernels: off the grid, and not what the grid fixes).  The
qdq is bit for bit ``qdq_rows`` of the bf16 value the producer computed: the same ``@triton.jit``
helpers (``_tile_scales``, ``_grid_codes_f32``, ``_out_bits``).  ``rms_norm_qdq(...,
return_value=True)`` also writes that bf16 value, which is how the tests check it.

Why the Linear may skip its qdq: its input then is a tensor of grid values, and qdq is the identity
on grid values (every grid value of a block is representable under the scale the block's own amax
gives; ``tests/test_producer_qdq.py`` checks it on edge blocks), so the Linear's result is the same
as if it had quantized the producer's bf16 output itself.  bf16 output only: that is what the grid
Linears take (exact for blocks with scale byte >= 3, see ``qdq_triton``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .qdq_triton import _BF16_SHIFT, _bf16_bits_to_f32, _grid_codes_f32, _mul_f32_exact, _out_bits, _round_bf16, \
    _tile_scales


@triton.jit
def _qdq_bf16_store(o, y_ptrs, mask, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """Store the exact grid values of the bf16-valued fp32 tile ``o`` as bf16 (``qdq_rows``' rules)."""
    obits = o.to(tl.int32, bitcast=True)
    nan_in, e, s, d = _tile_scales(obits, BLOCK_M, BLOCK_K, USE_ASM)
    c = _grid_codes_f32(o, obits, s, USE_ASM)
    v = _mul_f32_exact(c, d, USE_ASM)
    tl.store(y_ptrs, _out_bits(v, obits, nan_in, 1, USE_ASM), mask=mask)


@triton.jit
def _rms_norm_qdq_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, n_ptr, K, stride_x, stride_r, stride_y, stride_ro,
                         stride_n, eps, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr, WRITE_VALUE: tl.constexpr,
                         USE_ASM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)[None, :]                                    # one row: a (1, BLOCK_K) tile
    mask = cols < K
    s = _bf16_bits_to_f32(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0))
    if HAS_RES:
        s = s + _bf16_bits_to_f32(tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0))
        rs = _round_bf16(s, USE_ASM)
        tl.store(ro_ptr + row * stride_ro + cols, (rs.to(tl.int32, bitcast=True) >> _BF16_SHIFT).to(tl.int16),
                 mask=mask)
    var = tl.sum(s * s, axis=1)[:, None] / K
    n = _round_bf16(s * tl.math.rsqrt(var + eps), USE_ASM)
    w = _bf16_bits_to_f32(tl.load(w_ptr + cols, mask=mask, other=0))
    o = _round_bf16(n * w, USE_ASM)
    if WRITE_VALUE:
        tl.store(n_ptr + row * stride_n + cols, (o.to(tl.int32, bitcast=True) >> _BF16_SHIFT).to(tl.int16), mask=mask)
    _qdq_bf16_store(o, y_ptr + row * stride_y + cols, mask, 1, BLOCK_K, USE_ASM)


def _rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{what} takes bf16 activations; got {x.dtype}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_qdq(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                 return_value: bool = False):
    """RMSNorm of ``x`` (+ ``residual``) as vLLM's native op defines it, then its exact grid values (bf16).

    Returns ``y`` (no residual) or ``(y, residual_out)``, with the producer's bf16 output appended
    when ``return_value``.  ``y`` equals ``qdq_rows(o, bf16)`` bit for bit, ``o`` that output.
    """
    k = F.check_k(x.shape)
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (k,):
        raise ValueError(f"rms_norm_qdq: weight must be bf16 of shape ({k},); got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    x2 = _rows(x, k, "rms_norm_qdq")
    m = x2.shape[0]
    y = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    r2 = ro = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm_qdq: residual {tuple(residual.shape)} is not x's {tuple(x.shape)}")
        r2 = _rows(residual, k, "rms_norm_qdq")
        ro = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    n = torch.empty((m, k), dtype=torch.bfloat16, device=x.device) if return_value else None
    if m:
        bk = triton.next_power_of_2(k)
        i16 = lambda t: t.view(torch.int16) if t is not None else y.view(torch.int16)   # noqa: E731
        _rms_norm_qdq_kernel[(m,)](
            i16(x2), i16(r2), weight.view(torch.int16), i16(y), i16(ro), i16(n), k, x2.stride(0),
            r2.stride(0) if r2 is not None else 0, y.stride(0), ro.stride(0) if ro is not None else 0,
            n.stride(0) if n is not None else 0, float(eps), BLOCK_K=bk, HAS_RES=residual is not None,
            WRITE_VALUE=return_value, USE_ASM=not interpreting(), num_warps=min(16, max(4, bk // 512)))
    shape = x.shape
    out = (y.view(shape),)
    if residual is not None:
        out += (ro.view(shape),)
    if return_value:
        out += (n.view(shape),)
    return out[0] if len(out) == 1 else out


def silu_mul_qdq(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` as torch computes it on the GPU, then its exact grid values (bf16):
    ``moe_triton.silu_mul_qdq``, the kernel between the MoE's two expert GEMMs, on (..., 2d) rows."""
    from .moe_triton import silu_mul_qdq as rows_silu_mul_qdq
    d2 = x.shape[-1]
    if d2 % 2:
        raise ValueError(f"silu_mul_qdq: the last dimension ({d2}) must be even (gate and up halves)")
    return rows_silu_mul_qdq(x, d2 // 2).view(*x.shape[:-1], d2 // 2)
