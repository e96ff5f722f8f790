"""Triton GEMMs on the grid: y = x_q W_q^T with both operands dequantized exactly in registers.

Operands arrive as E4M3 codes plus E8M0 scales along K (1x32 blocks).  Each K-tile is
decoded, multiplied by its power-of-two scale and handed to the tensor cores as BF16:
an E4M3 value times 2^(e-127) has at most 4 significant bits, so the BF16 operand is
exact whenever it lies in BF16's range -- every block whose scale byte is at least 3
(amax >= 448 * 2^-124, i.e. everything but blocks of ~1e-35 and below, which would
flush towards zero).  Products of BF16 operands are exact in FP32 and are summed in the
FP32 accumulator; the bias is added in FP32 and the result is cast to the output dtype.

Two entry points:
* :func:`grid_gemm` -- dense (M, K) x (N, K)^T;
* :func:`grid_moe_gemm` -- the grouped GEMM of a fused MoE layer over token slots
  sorted by expert (``moe_align``), for gate_up (A = the tokens) and down (A = the
  per-(token, expert) rows), with the router weight optionally applied in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting

# format rules as Triton compile-time constants (jit code may read only constexpr globals)
_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E8M0_BIAS = tl.constexpr(F.E8M0_BIAS)               # scale byte of 1.0: the neutral value of a masked load
_E8M0_NAN = tl.constexpr(F.E8M0_NAN)
_E8M0_MIN_BITS = tl.constexpr(F.E8M0_MIN_BITS)
_F32_MAN_BITS = tl.constexpr(F.F32_MAN_BITS)
_F32_NAN_BITS = tl.constexpr(F.F32_NAN_BITS)
_F32_ABS_MASK = tl.constexpr(F.F32_ABS_MASK)
_E4M3_SIGN_MASK = tl.constexpr(F.E4M3_SIGN_MASK)
_E4M3_MAN_BITS = tl.constexpr(F.E4M3_MAN_BITS)
_E4M3_MAN_MASK = tl.constexpr(F.E4M3_MAN_MASK)
_E4M3_EXP_MASK = tl.constexpr(F.E4M3_EXP_MASK)
_E4M3_SUBNORMAL_UNIT = tl.constexpr(F.E4M3_SUBNORMAL_UNIT)
_E4M3_SIGN_TO_F32 = tl.constexpr(32 - 8)             # E4M3 sign bit 7 -> fp32 sign bit 31
_E4M3_TO_F32_EXP = tl.constexpr(F.F32_BIAS - F.E4M3_BIAS)                 # 120: rebias an E4M3 exponent
_E4M3_TO_F32_MAN = tl.constexpr(F.F32_MAN_BITS - F.E4M3_MAN_BITS)         # 20: widen its mantissa


@triton.jit
def _e8m0_to_f32(e):
    """E8M0 bytes -> fp32 2^(e-127), as ``format.e8m0_to_float``: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    e = e.to(tl.int32)
    bits = tl.where(e == 0, _E8M0_MIN_BITS, e << _F32_MAN_BITS)
    bits = tl.where(e == _E8M0_NAN, _F32_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _f32_bits_to_bf16_bits(vbits):
    """Round-to-nearest-even fp32 -> bf16 on bit patterns (non-NaN input; inf stays inf,
    overflow rounds to inf, subnormals round correctly).  Returns int32 holding the 16 bits."""
    a = vbits & _F32_ABS_MASK
    return ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) | ((vbits >> 16) & 0x8000)


@triton.jit
def _e4m3_to_f32(q, HW: tl.constexpr):
    """uint8 E4M3 codes -> fp32 values (exact).  HW: the GPU's conversion; else integer decode."""
    if HW:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        c = q.to(tl.int32)
        sign = (c & _E4M3_SIGN_MASK) << _E4M3_SIGN_TO_F32
        ex = (c >> _E4M3_MAN_BITS) & _E4M3_EXP_MASK
        man = c & _E4M3_MAN_MASK
        normal = (sign | ((ex + _E4M3_TO_F32_EXP) << _F32_MAN_BITS) | (man << _E4M3_TO_F32_MAN)).to(tl.float32, bitcast=True)
        sub = man.to(tl.float32) * _E4M3_SUBNORMAL_UNIT          # 2^-9
        sub = tl.where(sign != 0, -sub, sub)
        val = tl.where(ex == 0, sub, normal)
        return tl.where((ex == _E4M3_EXP_MASK) & (man == _E4M3_MAN_MASK), float("nan"), val)


@triton.jit
def _dequant_tile(q_ptrs, s_ptrs, mask, s_mask, R: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr):
    # q: (R, BLOCK_K) codes; s: the compact (R, BLOCK_K // 32) scales, broadcast over each 32-block
    q = tl.load(q_ptrs, mask=mask, other=0)
    s = _e8m0_to_f32(tl.load(s_ptrs, mask=s_mask, other=_E8M0_BIAS))
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, BLOCK_K // _BLOCK, _BLOCK)), (R, BLOCK_K))
    v = _e4m3_to_f32(q, HW) * s
    if HW:
        return v.to(tl.bfloat16)
    else:
        return v          # the CPU interpreter has no bf16 dot; fp32 holds the same exact values


@triton.jit
def _grid_gemm_kernel(
    xq_ptr, xs_ptr, wq_ptr, ws_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, HW: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // _BLOCK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        kk = k0 + offs_k
        kb = k0 // _BLOCK + offs_kb
        k_ok = kk < K
        kb_ok = kb < K // _BLOCK
        a = _dequant_tile(xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                          xs_ptr + offs_m[:, None].to(tl.int64) * stride_xsm + kb[None, :],
                          m_ok[:, None] & k_ok[None, :], m_ok[:, None] & kb_ok[None, :], BLOCK_M, BLOCK_K, HW)
        b = _dequant_tile(wq_ptr + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                          ws_ptr + offs_n[:, None].to(tl.int64) * stride_wsn + kb[None, :],
                          n_ok[:, None] & k_ok[None, :], n_ok[:, None] & kb_ok[None, :], BLOCK_N, BLOCK_K, HW)
        acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int, n: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages) for a problem size."""
    if interpreting():
        return 16, 32, 64, 4, 1, 4, 1
    if m <= 16:
        return 16, 64, 256, 1, 1, 4, 4
    if m <= 64:
        return 32, 64, 256, 4, 1, 4, 4
    if m <= 256:
        return 64, 128, 128, 8, 1, 8, 3
    return 128, 128, 128, 8, 1, 8, 3


def grid_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, config=None) -> torch.Tensor:
    """y[M, N] = dequant(xq, xs) @ dequant(wq, ws)^T (+ bias), FP32 accumulation, ``out_dtype`` out.

    xq: (M, K) uint8/float8 codes, xs: (M, K/32) uint8; wq: (N, K), ws: (N, K/32).
    """
    m, k = xq.shape
    n = wq.shape[0]
    xq, wq = xq.view(torch.uint8), wq.view(torch.uint8)
    bm, bn, bk, gm, split, warps, stages = config or _config(m, n, k)
    if split > 1:
        y = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
    else:
        y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y.to(out_dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _grid_gemm_kernel[grid](
        xq, xs, wq, ws, bias if bias is not None else ws, y,
        m, n, k, xq.stride(0), xs.stride(0), wq.stride(0), ws.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, SPLIT_K=split,
        HW=not interpreting(), num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(out_dtype)


# -- fused MoE ------------------------------------------------------------------------

def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, k) slots by expert into blocks of ``block_m`` (static shapes, graph-safe).

    Returns (sorted_ids [P] int32 -- slot index t*topk+k, or T*topk for padding;
    block_expert [P/block_m] int32 -- the local expert of each block, -1 for blocks past
    the end or of experts not on this rank; P = T*topk + E*(block_m-1) rounded up).
    ``topk_ids`` holds local expert ids, -1 for experts not on this rank.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))      # invalid -> bucket E
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    first_of_key = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - first_of_key.index_select(0, skey.clamp(max=num_experts - 1))
    dest = starts.index_select(0, skey.clamp(max=num_experts - 1)) + rank
    cap = (n + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int64, device=dev)
    dest = torch.where(skey < num_experts, dest, torch.full_like(dest, cap))   # invalid slots -> dump row
    sorted_ids.scatter_(0, dest, order)
    sorted_ids = sorted_ids[:cap].to(torch.int32)
    block_start = torch.arange(0, cap, block_m, device=dev)
    be = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grid_moe_kernel(
    aq_ptr, as_ptr, wq_ptr, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr,
    N, K, num_valid_slots, TOPK,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    A_PER_TOKEN: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr,
    BF16_BITS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    s_ok = slots < num_valid_slots
    rows = slots // TOPK if A_PER_TOKEN else slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // _BLOCK)
    e64 = expert.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kb = k0 // _BLOCK + offs_kb
        k_ok = kk < K
        kb_ok = kb < K // _BLOCK
        a = _dequant_tile(aq_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                          as_ptr + rows[:, None].to(tl.int64) * stride_asm + kb[None, :],
                          s_ok[:, None] & k_ok[None, :], s_ok[:, None] & kb_ok[None, :], BLOCK_M, BLOCK_K, HW)
        b = _dequant_tile(wq_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                          ws_ptr + e64 * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + kb[None, :],
                          n_ok[:, None] & k_ok[None, :], n_ok[:, None] & kb_ok[None, :], BLOCK_N, BLOCK_K, HW)
        acc = tl.dot(a, tl.trans(b), acc)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_w_ptr + slots, mask=s_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    y_ptrs = y_ptr + slots[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if BF16_BITS:   # the interpreter's bf16 cast truncates: store the round-to-nearest-even bit pattern
        out = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, out, mask=s_ok[:, None] & n_ok[None, :])


def moe_block_m(num_slots: int) -> int:
    if interpreting():
        return 16
    return 16 if num_slots <= 256 else 64


def grid_moe_gemm(aq, as_, wq, ws, sorted_ids, block_expert, num_slots: int, topk: int,
                  a_per_token: bool, topk_weights, out_dtype, block_m: int):
    """Grouped GEMM over expert-sorted slots: y[slot] = A[row(slot)] W[expert]^T (* router weight).

    aq/as_: (rows, K) codes + (rows, K/32) scales, rows = tokens (``a_per_token``) or slots;
    wq/ws: (E, N, K) + (E, N, K/32); returns y (num_slots, N) in ``out_dtype``.
    """
    e, n, k = wq.shape
    aq, wq = aq.view(torch.uint8), wq.view(torch.uint8)
    y = torch.empty((num_slots, n), dtype=out_dtype, device=aq.device)
    bn, bk, warps, stages = (32, 64, 4, 1) if interpreting() else (64, 128, 4, 3)
    grid = (block_expert.numel(), triton.cdiv(n, bn))
    bits = interpreting() and out_dtype == torch.bfloat16
    _grid_moe_kernel[grid](
        aq, as_, wq, ws, y.view(torch.int16) if bits else y, topk_weights if topk_weights is not None else y,
        sorted_ids, block_expert,
        n, k, num_slots, topk,
        aq.stride(0), as_.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), y.stride(0),
        A_PER_TOKEN=a_per_token, MUL_ROUTED_WEIGHT=topk_weights is not None, BF16_BITS=bits,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, HW=not interpreting(), num_warps=warps, num_stages=stages)
    return y
