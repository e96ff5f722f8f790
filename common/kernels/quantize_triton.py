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

# format rules as Triton compile-time constants (jit code may read only constexpr globals)
_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E4M3_MAX = tl.constexpr(F.E4M3_MAX)
_E4M3_NAN_BYTE = tl.constexpr(F.E4M3_NAN_BYTE)
_E4M3_SIGN_MASK = tl.constexpr(F.E4M3_SIGN_MASK)
_F32_MAN_BITS = tl.constexpr(F.F32_MAN_BITS)
_F32_MAN_MASK = tl.constexpr(F.F32_MAN_MASK)
_F32_EXP_MASK = tl.constexpr(F.F32_EXP_MASK)
_F32_ABS_MASK = tl.constexpr(F.F32_ABS_MASK)
_F32_INF_BITS = tl.constexpr(F.F32_INF_BITS)
_F32_NEG_ZERO_BITS = tl.constexpr(F.F32_NEG_ZERO_BITS)
_F32_NAN_BITS = tl.constexpr(F.F32_NAN_BITS)
_E8M0_NAN = tl.constexpr(F.E8M0_NAN)
_E8M0_MAX = tl.constexpr(F.E8M0_MAX)
_E8M0_INF_BLOCK = tl.constexpr(F.E8M0_INF_BLOCK)
_E8M0_MIN_BITS = tl.constexpr(F.E8M0_MIN_BITS)
_RCP_EXP = tl.constexpr(2 * F.E8M0_BIAS)             # 2^(127 - (e - 127)) has exponent field 254 - e
_RCP_E4M3 = tl.constexpr(F.RCP_E4M3)                 # the fp32 value of RCP_E4M3_BITS (exact as a Python float)
_RCP_MUL_ASM = tl.constexpr(f"mul.rn.f32 $0, $1, 0f{F.RCP_E4M3_BITS:08X};")
# integer E4M3 round-to-nearest-even (software path): fp32 bits dropped, exponent rebias,
# smallest normal, and the subnormal grid (2^-9) as a power of two to scale onto integers
_E4M3_DROP = tl.constexpr(F.F32_MAN_BITS - F.E4M3_MAN_BITS)                      # 20
_E4M3_REBIAS = tl.constexpr((F.F32_BIAS - F.E4M3_BIAS) << F.E4M3_MAN_BITS)       # (127 - 7) << 3
_E4M3_MIN_NORMAL_BITS = tl.constexpr((F.F32_BIAS + F.E4M3_MIN_NORMAL_EXP) << F.F32_MAN_BITS)   # 121 << 23
_E4M3_RND = tl.constexpr((1 << (F.F32_MAN_BITS - F.E4M3_MAN_BITS - 1)) - 1)      # 0x7FFFF: just under half an E4M3 ulp
_E4M3_SUB_SCALE = tl.constexpr(1.0 / F.E4M3_SUBNORMAL_UNIT)                     # 512.0
_F32_RINT = tl.constexpr(float(1 << F.F32_MAN_BITS))                            # 2^23: x + 2^23 - 2^23 rounds to an integer
_F32_SIGN_TO_E4M3 = tl.constexpr(32 - 8)             # fp32 sign bit 31 -> E4M3 sign bit 7


@triton.jit
def _e8m0_from_amax_bits(amax_bits, USE_ASM: tl.constexpr):
    if USE_ASM:
        v = tl.inline_asm_elementwise(
            _RCP_MUL_ASM, "=r,r", [amax_bits],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = (amax_bits.to(tl.float32, bitcast=True) * _RCP_E4M3).to(tl.int32, bitcast=True)
    exp = (v >> _F32_MAN_BITS) & _F32_EXP_MASK
    man = v & _F32_MAN_MASK
    up = (man != 0) & (exp != _E8M0_MAX) & ((exp != 0) | (man > _E8M0_MIN_BITS))
    e = exp + up.to(tl.int32)
    e = tl.where(exp == _F32_EXP_MASK, tl.where(man != 0, _E8M0_NAN, _E8M0_INF_BLOCK), e)
    return e


@triton.jit
def _scale_reciprocal(e):
    bits = (_RCP_EXP - e) << _F32_MAN_BITS
    bits = tl.where(e == _E8M0_INF_BLOCK, _E8M0_MIN_BITS, bits)
    bits = tl.where(e == _E8M0_NAN, _F32_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne_software(y):
    # Integer round-to-nearest-even to E4M3 of a clamped, non-NaN fp32 (Triton's CPU
    # interpreter does not round its float8 casts this way; the GPU uses the cvt).
    a = y.to(tl.int32, bitcast=True)
    sign = (a >> _F32_SIGN_TO_E4M3) & _E4M3_SIGN_MASK
    a = a & _F32_ABS_MASK
    normal = ((a + _E4M3_RND + ((a >> _E4M3_DROP) & 1)) >> _E4M3_DROP) - _E4M3_REBIAS
    t = a.to(tl.float32, bitcast=True) * _E4M3_SUB_SCALE
    sub = ((t + _F32_RINT) - _F32_RINT).to(tl.int32)
    return tl.where(a >= _E4M3_MIN_NORMAL_BITS, normal, sub) | sign


@triton.jit
def _encode_e4m3(x, xbits, s, USE_ASM: tl.constexpr):
    y = x * s
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    if USE_ASM:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        q = _e4m3_rne_software(y)
    q = tl.where(x != x, _E4M3_NAN_BYTE, q)
    q = tl.where(xbits == _F32_NEG_ZERO_BITS, 0, q)
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
    abits = xbits & _F32_ABS_MASK
    abits = tl.where(abits > _F32_INF_BITS, 0, abits)
    out_off = rows64[:, None] * K + cols[None, :]
    NB: tl.constexpr = BLOCK_K // _BLOCK
    if ROWWISE:
        amax = tl.max(tl.reshape(abits, (BLOCK_M, NB, _BLOCK)), axis=2)
        e = _e8m0_from_amax_bits(amax, USE_ASM)
        s = tl.reshape(tl.broadcast_to(_scale_reciprocal(e)[:, :, None], (BLOCK_M, NB, _BLOCK)), (BLOCK_M, BLOCK_K))
        tl.store(rq_ptr + out_off, _encode_e4m3(x, xbits, s, USE_ASM), mask=mask)
        sb = pid_k * NB + tl.arange(0, NB)
        smask = (rows[:, None] < M) & (sb[None, :] < K // _BLOCK)
        tl.store(rs_ptr + rows64[:, None] * stride_rs + sb[None, :], e.to(tl.uint8), mask=smask)
    if COLWISE:
        MB: tl.constexpr = BLOCK_M // _BLOCK
        amax = tl.max(tl.reshape(abits, (MB, _BLOCK, BLOCK_K)), axis=1)
        e = _e8m0_from_amax_bits(amax, USE_ASM)
        s = tl.reshape(tl.broadcast_to(_scale_reciprocal(e)[:, None, :], (MB, _BLOCK, BLOCK_K)), (BLOCK_M, BLOCK_K))
        tl.store(cq_ptr + out_off, _encode_e4m3(x, xbits, s, USE_ASM), mask=mask)
        rb = pid_m * MB + tl.arange(0, MB)
        cmask = (rb[:, None] < M // _BLOCK) & (cols[None, :] < K)
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
