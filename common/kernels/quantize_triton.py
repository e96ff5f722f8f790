"""Triton MXFP8 quantize: one pass over the input, rowwise and/or columnwise, TE-exact bytes.

Each program loads one (BLOCK_M, BLOCK_K) tile once and writes both copies from it.
The scale rules are those of ``common/format.py``, done on integer bit patterns so that
no flush-to-zero or NaN-propagation mode can change them:

* amax: integer max of ``|x|`` bit patterns (NaN mapped to 0);
* ``v = amax * RCP``: a PTX ``mul.rn.f32`` (IEEE, no FTZ, never fused) on the GPU;
* the E4M3 cast: the GPU's ``cvt.rn.satfinite`` through Triton; under Triton's CPU
  interpreter (``USE_ASM=False``) an integer round-to-nearest-even instead, because the
  interpreter's float8 cast does not round like the hardware;
* E8M0 round-up and the reciprocal scale from bit fields;
* data: ``clamp(x * s, +-448)`` cast with round-to-nearest-even, then NaN -> 0x7F and
  exact -0.0 -> 0x00 (the project's negative-zero rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting


@triton.jit
def _e8m0_from_amax_bits(amax_bits, USE_ASM: tl.constexpr):
    if USE_ASM:
        v = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, 0f3B124925;", "=r,r", [amax_bits],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = (amax_bits.to(tl.float32, bitcast=True) * 0.002232142857142857).to(tl.int32, bitcast=True)
    exp = (v >> 23) & 0xFF
    man = v & 0x7FFFFF
    up = (man != 0) & (exp != 0xFE) & ((exp != 0) | (man > 0x400000))
    e = exp + up.to(tl.int32)
    e = tl.where(exp == 0xFF, tl.where(man != 0, 255, 254), e)
    return e


@triton.jit
def _scale_reciprocal(e):
    bits = (254 - e) << 23
    bits = tl.where(e == 254, 0x00400000, bits)
    bits = tl.where(e == 255, 0x7FFFFFFF, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne_software(y):
    # Integer round-to-nearest-even to E4M3 of a clamped, non-NaN fp32 (Triton's CPU
    # interpreter does not round its float8 casts this way; the GPU uses the cvt).
    a = y.to(tl.int32, bitcast=True)
    sign = (a >> 24) & 0x80
    a = a & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    t = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a >= (121 << 23), normal, sub) | sign


@triton.jit
def _encode_e4m3(x, xbits, s, USE_ASM: tl.constexpr):
    y = x * s
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if USE_ASM:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        q = _e4m3_rne_software(y)
    q = tl.where(x != x, 0x7F, q)
    q = tl.where(xbits == -2147483648, 0, q)
    return q.to(tl.uint8)


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr,
    M, K, stride_xm, stride_rs, stride_cs,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xbits = x.to(tl.int32, bitcast=True)
    abits = xbits & 0x7FFFFFFF
    abits = tl.where(abits > 0x7F800000, 0, abits)
    out_off = rows64[:, None] * K + cols[None, :]
    NB: tl.constexpr = BLOCK_K // 32
    if ROWWISE:
        amax = tl.max(tl.reshape(abits, (BLOCK_M, NB, 32)), axis=2)
        e = _e8m0_from_amax_bits(amax, USE_ASM)
        s = tl.reshape(tl.broadcast_to(_scale_reciprocal(e)[:, :, None], (BLOCK_M, NB, 32)), (BLOCK_M, BLOCK_K))
        tl.store(rq_ptr + out_off, _encode_e4m3(x, xbits, s, USE_ASM), mask=mask)
        sb = pid_k * NB + tl.arange(0, NB)
        smask = (rows[:, None] < M) & (sb[None, :] < K // 32)
        tl.store(rs_ptr + rows64[:, None] * stride_rs + sb[None, :], e.to(tl.uint8), mask=smask)
    if COLWISE:
        MB: tl.constexpr = BLOCK_M // 32
        amax = tl.max(tl.reshape(abits, (MB, 32, BLOCK_K)), axis=1)
        e = _e8m0_from_amax_bits(amax, USE_ASM)
        s = tl.reshape(tl.broadcast_to(_scale_reciprocal(e)[:, None, :], (MB, 32, BLOCK_K)), (BLOCK_M, BLOCK_K))
        tl.store(cq_ptr + out_off, _encode_e4m3(x, xbits, s, USE_ASM), mask=mask)
        rb = pid_m * MB + tl.arange(0, MB)
        cmask = (rb[:, None] < M // 32) & (cols[None, :] < K)
        tl.store(cs_ptr + rb[:, None].to(tl.int64) * stride_cs + cols[None, :], e.to(tl.uint8), mask=cmask)


#: tile shapes (BLOCK_M, BLOCK_K, num_warps), chosen on the H200 by benchmarks/bench_quantize.py
ROWWISE_CONFIG = (32, 128, 4)
BOTH_CONFIG = (32, 128, 4)
SMALL_M_CONFIG = (16, 128, 4)


def _launch(x2d, rowwise, columnwise, rq, rs, cq, cs, config):
    m, k = x2d.shape
    bm, bk, warps = config
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    dummy = rq if rq is not None else cq
    _mxfp8_quantize_kernel[grid](
        x2d, rq if rq is not None else dummy, rs if rs is not None else dummy,
        cq if cq is not None else dummy, cs if cs is not None else dummy,
        m, k, x2d.stride(0),
        rs.stride(0) if rs is not None else 0, cs.stride(0) if cs is not None else 0,
        BLOCK_M=bm, BLOCK_K=bk, ROWWISE=rowwise, COLWISE=columnwise,
        USE_ASM=not interpreting(), num_warps=warps)


def _contiguous_rows(x2d: torch.Tensor) -> torch.Tensor:
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def quantize_rows_triton(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise only, any M: (uint8 codes (M, K), uint8 scales (M, K/32) unpadded)."""
    x2d = _contiguous_rows(x2d)
    m, k = x2d.shape
    rq = torch.empty((m, k), dtype=torch.uint8, device=x2d.device)
    rs = torch.empty((m, k // F.BLOCK_SIZE), dtype=torch.uint8, device=x2d.device)
    if m and k:
        _launch(x2d, True, False, rq, rs, None, None, SMALL_M_CONFIG if m <= 16 else ROWWISE_CONFIG)
    return rq, rs


def quantize_mxfp8_triton(x2d: torch.Tensor, rowwise: bool, columnwise: bool, config=None):
    """TE layout: codes (M, K) per copy, padded compact scales zero-filled."""
    x2d = _contiguous_rows(x2d)
    m, k = x2d.shape
    dev = x2d.device
    rq = rs = cq = cs = None
    if rowwise:
        rq = torch.empty((m, k), dtype=torch.uint8, device=dev)
        rs = torch.zeros(F.rowwise_scale_shape(m, k), dtype=torch.uint8, device=dev)
    if columnwise:
        cq = torch.empty((m, k), dtype=torch.uint8, device=dev)
        cs = torch.zeros(F.columnwise_scale_shape(m, k), dtype=torch.uint8, device=dev)
    if m and k:
        if config is None:
            config = BOTH_CONFIG if columnwise else ROWWISE_CONFIG
        _launch(x2d, rowwise, columnwise, rq, rs, cq, cs, config)
    return rq, rs, cq, cs
