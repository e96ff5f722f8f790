"""A weight-only MXFP8 GEMM in Triton: y = x_grid @ dequant(W)^T, FP32 accumulation.

Why it exists.  vLLM's MXFP8 Marlin falls to 0.58-0.68x BF16 at M = 64 on the Qwen3-8B projections
on the H200 (an Ampere-style ``mma.sync`` kernel), and SGLang ships no MXFP8 GEMM at all.  This one
uses Triton's ``tl.dot``, a ``wgmma`` on sm_90, with the problem swapped (``y^T = W x^T``) so that
the weight rows fill the MMA's 64-row side and the few tokens its narrow side.  Measured on the
H200 (BENCHMARKS.md, 2026-12-01): exact, but slower than Marlin at every M (0.52x BF16 at M = 64
summed over the 8B projections, Marlin 0.75x).  The decode is not what limits it: decoding each
32-block straight in the MMA's register layout, with the GPU's conversion or with integer and
bf16x2 ops only (no conversion unit, no shared-memory round trip), measured no faster at M = 64
(seventeenth session, 2026-12-03; that code is at commit 36e9058).  So it
is the dense kernel where no Marlin exists (SGLang: ``grid_kernels/w8a16.py``), 1.1-1.9x the
previous Triton grid GEMM there, and an off-by-default band (``w8a16_rows``) of vLLM's Marlin
kernel.

Exactness.  ``x_grid`` is ``qdq_rows(x)`` (bf16 grid values).  Each weight tile is decoded exactly
as ``dequant_triton`` decodes it (E4M3 code -> fp32, times 2^(e-127) with a ``mul.rn.f32`` that
keeps subnormals, one RNE cast to bf16: exact for scale bytes >= 3, which the layer checks at
load), so both MMA operands are exactly the grid values; their products are exact in the FP32
accumulator, and the result is rounded once to bf16.

Deterministic split-K.  A layer with few weight-row tiles (N = 4096 gives 64 of 64 rows, for 132
SMs) splits K: each split writes its FP32 partial sum to a workspace, and a second kernel adds the
splits in a fixed order, in FP32, and rounds once.  No atomics, so the same input gives the same
bits on every call, and the partials are never reduced in bf16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .gemm_triton import _e4m3_to_f32, _e8m0_to_f32
from .qdq_triton import _f32_bits_to_bf16_bits, _mul_f32_exact


# format rules as Triton compile-time constants (jit code may read only constexpr globals)
_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_SCALES_PER_WORD = tl.constexpr(4)                   # E8M0 bytes in one int32 scale word
_E8M0_BYTE_MASK = tl.constexpr(F.E8M0_BYTE_MASK)     # one E8M0 byte of the word
#: a masked-off scale word: four bytes of E8M0_BIAS (2^0)
_E8M0_ONE_WORD = tl.constexpr(F.E8M0_BIAS * 0x01010101)


@triton.jit
def _bf16_bits_to_f32(h):
    """int16 bf16 bit patterns -> fp32 (exact, by shifting)."""
    return (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, s_ptr, y_ptr, p_ptr,
                  M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, HW: tl.constexpr):
    """One (BLOCK_N weight rows) x (BLOCK_M tokens) tile of y^T over one K split, K steps of 128.

    x_ptr: bf16 (HW) or its int16 bit patterns (interpreter); s_ptr: the E8M0 scales as int32 words,
    four 32-blocks (one K step) per word, so that the scale load is a 4-byte copy the pipeliner can
    make asynchronous like the code and activation tiles."""
    BLOCK_K: tl.constexpr = _SCALES_PER_WORD * _BLOCK
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # weight rows (the MMA's long side)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # tokens (the MMA's narrow side)
    n_ok = rn < N
    m_ok = rm < M
    k_split = K // SPLIT_K                                       # the caller makes it a multiple of 128
    k_begin = pid_k * k_split
    q_base = q_ptr + rn[:, None].to(tl.int64) * stride_qn
    s_base = s_ptr + rn.to(tl.int64) * stride_sn
    x_base = x_ptr + rm[None, :].to(tl.int64) * stride_xm
    shifts = tl.arange(0, _SCALES_PER_WORD) * 8
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_split, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_base + kk[None, :], mask=n_ok[:, None], other=0)
        word = tl.load(s_base + k0 // BLOCK_K, mask=n_ok, other=_E8M0_ONE_WORD)
        e = (word[:, None] >> shifts[None, :]) & _E8M0_BYTE_MASK               # [BLOCK_N, 4] scale bytes
        d = tl.reshape(tl.broadcast_to(_e8m0_to_f32(e)[:, :, None], (BLOCK_N, _SCALES_PER_WORD, _BLOCK)),
                       (BLOCK_N, BLOCK_K))
        v = _mul_f32_exact(_e4m3_to_f32(q, HW), d, HW)
        h = tl.load(x_base + kk[:, None], mask=m_ok[None, :], other=0)          # [BLOCK_K, BLOCK_M]
        if HW:
            acc = tl.dot(v.to(tl.bfloat16), h, acc)
        else:   # the CPU interpreter has no bf16 dot; fp32 holds the same exact values
            w = _f32_bits_to_bf16_bits(v.to(tl.int32, bitcast=True))
            acc = tl.dot(_bf16_bits_to_f32(w.to(tl.int16)), _bf16_bits_to_f32(h), acc)
    if SPLIT_K == 1:
        y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
        if HW:
            out = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            out = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
        tl.store(y_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])
    else:
        p_ptrs = p_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _splitk_sum_kernel(p_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr):
    """y = bf16(sum over the splits, in order, in FP32) -- one rounding, no atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HW:
        out = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        out = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
    tl.store(y_ptr + offs, out, mask=ok)


#: the K step of the kernel: four E8M0 scale bytes, read as one int32 word
BLOCK_K = 4 * F.BLOCK_SIZE


def w8a16_shape_ok(k: int) -> bool:
    """K must be whole K steps (K % 128; every Qwen3 projection is)."""
    return k > 0 and k % BLOCK_K == 0


def w8a16_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, SPLIT_K, num_warps, num_stages) for an M x N x K problem."""
    if interpreting():
        return 32, 16, 2 if k % 256 == 0 else 1, 4, 1
    # measured on the H200 (benchmarks/bench_fast_path.py --w8a16-sweep, 2026-12-01, Qwen3-8B shapes at
    # M = 16 and 64): BLOCK_N 64 beats 128, a split of 2 beats 4 and 8 even where 64 tiles leave SMs
    # idle, and 3 stages beat 4 (by up to 1.45x at M = 64, where 4 stages cost occupancy)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bn = 64
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = 2 if tiles < sms and k % (2 * BLOCK_K) == 0 and k // 2 >= 4 * BLOCK_K else 1
    return bn, bm, split, 4, 3


@functools.lru_cache(maxsize=None)
def _sm_count(index) -> int:
    index = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def w8a16_gemm(x_grid: torch.Tensor, q: torch.Tensor, s: torch.Tensor, config=None,
               workspace: torch.Tensor | None = None) -> torch.Tensor:
    """``x_grid @ dequantize_blocks(q, s)^T`` in bf16 with FP32 accumulation.

    x_grid: (M, K) bf16 (the activation's grid values, ``qdq_rows``); q: (N, K) float8_e4m3fn /
    uint8 codes; s: (N, K/32) uint8 E8M0 (rows 4-byte aligned); K a multiple of 128.  ``config``: a
    ``w8a16_config`` tuple (benchmarks).
    ``workspace``: an FP32 buffer of at least SPLIT_K * M * N elements for the split-K partials
    (allocated here when absent)."""
    m, k = x_grid.shape
    n = q.shape[0]
    if x_grid.dtype != torch.bfloat16:
        raise ValueError(f"w8a16_gemm: activations must be bf16 grid values, got {x_grid.dtype}")
    if q.shape[1] != k or s.shape != (n, k // F.BLOCK_SIZE) or not w8a16_shape_ok(k):
        raise ValueError(f"w8a16_gemm: x {tuple(x_grid.shape)}, codes {tuple(q.shape)} and scales "
                         f"{tuple(s.shape)} do not pair (K must be a multiple of {BLOCK_K})")
    if s.stride(1) != 1 or s.stride(0) % 4 or s.data_ptr() % 4 or q.stride(1) != 1:
        raise ValueError("w8a16_gemm: codes and scales must be row-major with 4-byte aligned scale rows")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x_grid.device)
    if m == 0 or n == 0:
        return y
    if config is None:
        config = w8a16_config(m, n, k, _sm_count(x_grid.device.index) if x_grid.is_cuda else 132)
    bn, bm, split, warps, stages = config
    if k % (BLOCK_K * split):
        raise ValueError(f"w8a16_gemm: K={k} is not a multiple of 128 * SPLIT_K = {BLOCK_K * split}")
    x = x_grid.contiguous() if x_grid.stride(-1) != 1 else x_grid
    if split > 1:
        need = split * m * n
        p = workspace[:need] if workspace is not None and workspace.numel() >= need else \
            torch.empty(need, dtype=torch.float32, device=x.device)
    else:
        p = y
    hw = not interpreting()
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _w8a16_kernel[grid](x if hw else x.view(torch.int16), q.view(torch.uint8), s.view(torch.int32),
                        y.view(torch.int16), p, m, n, k, x.stride(0), q.stride(0), s.stride(0) // 4, y.stride(0),
                        BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=split, HW=hw, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(m * n, block),)](p, y.view(torch.int16), m * n, SPLIT_K=split,
                                                         BLOCK=block, HW=hw, num_warps=4)
    return y
