"""Decode GEMM for MoE experts on the grid: one routed slot per program, the expert's fp8 weight streamed once.

    y[s, :] = dequant(xq[r_s], xs[r_s]) @ dequant(wq[e_s], ws[e_s])^T,
    r_s = rows[s] (or s // topk),  e_s = experts[s] (or expert_map[experts[s]])

FP32 accumulation, bf16 (or ``out_dtype``) out; a slot whose expert is < 0 (another rank's, under
expert parallelism) is written as zeros and reads no weight.  Operands as :func:`gemv_triton.grid_gemv`'s:
codes (T, K) uint8 / float8_e4m3fn with compact E8M0 scales (T, K/32); the experts' codes (E, N, K)
and scales (E, N, K/32).  The slot's token row and expert are read in the kernel: ``rows=None``
gives row ``s // topk`` (slots in token-major top-k order), the expert ids are loaded as given (int32
or int64) and, with ``expert_map``, mapped to this rank's ids there -- so the MoE layer launches no
index arithmetic or casts around the GEMV (a fixed launch: CUDA-graph safe).

At decode sizes (a few tokens, top-k of 8) nearly every slot has its own expert, so the slots share
no weight tile: each program owns one slot and a BLOCK_N x K slab of that slot's expert, and reads
it exactly once -- the experts' bytes are the whole traffic, as in the dense GEMV.  The inner step
is the dense GEMV's ``chunk`` step (``gemv_triton._chunk_step``): E4M3 codes -> fp16 (exact), the
32-wide chunk's dot on the tensor cores in FP32, scaled by the two powers of two of the chunk.
Exactness is the dense GEMV's: every product exact in FP32, the result the FP32 sum of those
products in some order, one rounding at the store (see ``gemv_triton``'s "Exactness").  No split
K: with one program per (slot, N tile) the decode shapes already give >= 2 programs per SM
(Qwen3-30B-A3B at one token: 8 slots x 48 tiles of 32 rows for gate_up, 8 x 32 tiles of 64 rows
for down), and the
order of the FP32 additions is then fixed by the program alone (deterministic, no atomics).
BLOCK_N (128 / 64 / 32 weight rows) is chosen per call to fill the SMs (:func:`choose_block_n`).

The row of the BLOCK_M (16, the smallest tensor-core tile) x 32 activation tile that carries the
slot's x is row 0; the other 15 are masked to zero (the tensor core's waste, not memory traffic).

Under Triton's CPU interpreter (``HW=False``) the codes are decoded by integer arithmetic and the
dots are IEEE fp32, as in ``gemv_triton``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .gemv_triton import _BLOCK, _WORD_K, _chunk_step, _num_sms, _scale_words, _store_out, _wave_eff, _word_pow2

#: the K granularity of the kernel: one int32 word of scale bytes per step (``gemv_triton._WORD_K``)
K_STEP = _WORD_K.value


@triton.jit(do_not_specialize=["S"])
def _moe_gemv_kernel(
    xq_ptr, xs_ptr, rows_ptr, wq_ptr, ws_ptr, eid_ptr, emap_ptr, y_ptr,
    S, N, K, stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    HAS_ROWS: tl.constexpr, TOPK: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr,
):
    CHUNKS: tl.constexpr = _WORD_K // _BLOCK          # 32-wide chunks per step (one scale byte each)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)                              # the slot
    e = tl.load(eid_ptr + s).to(tl.int32)             # int32 or int64 ids, as given
    if HAS_MAP:                                       # global -> this rank's id (-1: another rank's)
        e = tl.where(e >= 0, tl.load(emap_ptr + tl.maximum(e, 0)).to(tl.int32), -1)
    live = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + s).to(tl.int64)
    else:
        row = (s // TOPK).to(tl.int64)                # slots in token-major top-k order
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, _BLOCK)
    m_ok = offs_m < tl.where(live, 1, 0)           # row 0 carries the slot (none for another rank's expert)
    n_ok = offs_n < tl.where(live, N, 0)
    x_rows = xq_ptr + row * stride_xm + offs_m[:, None] * 0
    xs_row = xs_ptr + row * stride_xsm + offs_m * 0
    w_rows = wq_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + e * stride_wse + offs_n.to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the scale bytes of a row for one _WORD_K step are one int32 word, prefetched one step ahead
    last_word = (K - 1) // _WORD_K
    sx_next = tl.load(xs_row, mask=m_ok, other=0)
    sw_next = tl.load(ws_rows, mask=n_ok, other=0)
    for k0 in range(0, K, _WORD_K):
        sx_word = sx_next
        sw_word = sw_next
        k1 = tl.minimum((k0 + _WORD_K) // _WORD_K, last_word)
        sx_next = tl.load(xs_row + k1, mask=m_ok, other=0)
        sw_next = tl.load(ws_rows + k1, mask=n_ok, other=0)
        for c in tl.static_range(CHUNKS):
            kk = k0 + c * _BLOCK + offs_c
            fx = _word_pow2(sx_word, c)
            fw = _word_pow2(sw_word, c)
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0)
            # the mask is constant along K (per weight row): the loads stay 16-byte vectors
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0)
            acc = _chunk_step(acc, a, w, fx, fw, 0, False, HW)
    y_ptrs = y_ptr + s.to(tl.int64) * stride_ym + offs_n[None, :] + offs_m[:, None] * 0
    # a slot of another rank's expert: acc is 0 (every load masked) and is stored as zeros
    _store_out(y_ptrs, acc, (offs_m[:, None] < 1) & (offs_n[None, :] < N), HW)


def moe_gemv_shape_ok(k: int) -> bool:
    """K a multiple of 128 (one scale word per step)."""
    return k % K_STEP == 0


def choose_block_n(slots: int, n: int, sms: int) -> int:
    """BLOCK_N of 128, 64 or 32 rows: the one whose programs fill the SMs best -- wave efficiency
    times min(1, programs / (2 x SMs)), ties to the wider tile (fewer, longer weight streams).
    Qwen3-30B-A3B at one token (8 slots, 132 SMs): 32 for gate_up (384 programs), 64 for down (256)."""
    def score(bn):
        w = slots * triton.cdiv(n, bn)
        return _wave_eff(w, sms) * min(1.0, w / (2 * sms))
    best = 128
    for bn in (64, 32):
        if score(bn) > score(best) + 0.05:
            best = bn
    return best


def _index_vector(v: torch.Tensor) -> torch.Tensor:
    """v as a contiguous 1-D integer tensor the kernel loads as is: no launch for the usual int32 /
    int64 contiguous input (a view); other integer dtypes are cast to int32."""
    if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
        raise ValueError(f"moe_gemv: index tensors must be integer; got {v.dtype}")
    v = v.reshape(-1)
    if v.dtype not in (torch.int32, torch.int64):
        v = v.to(torch.int32)
    return v if v.is_contiguous() else v.contiguous()


def moe_gemv(xq: torch.Tensor, xs: torch.Tensor, rows: Optional[torch.Tensor], wq: torch.Tensor, ws: torch.Tensor,
             experts: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
             block_n: Optional[int] = None, *, topk: int = 1,
             expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y (S, N): slot s = dequant(x row ``rows[s]``) @ dequant(expert ``experts[s]``)^T; experts < 0 give 0.

    xq (T, K) / xs (T, K/32); wq (E, N, K) / ws (E, N, K/32); experts: (S,) integer tensor (int32 or
    int64, read as given); rows: (S,) integer tensor, or None for row ``s // topk`` (the slots of
    ``topk_ids.reshape(-1)``; ``topk`` ignored when rows are given).  ``expert_map`` (global -> local
    id, -1: another rank's): the experts are global ids, mapped in the kernel (a negative id stays
    another rank's), as ``ops.local_expert_ids`` maps them.
    K % 128 == 0.  Meant for decode (S up to a few hundred); correct for any S.
    """
    t, k = xq.shape
    e_n, n, k2 = wq.shape
    s = experts.numel()
    if (rows is not None and rows.numel() != s) or topk < 1:
        raise ValueError(f"moe_gemv: rows {rows.numel() if rows is not None else None} for {s} experts, topk {topk}")
    if not moe_gemv_shape_ok(k) or k2 != k or tuple(xs.shape) != (t, k // F.BLOCK_SIZE) \
            or tuple(ws.shape) != (e_n, n, k // F.BLOCK_SIZE):
        raise ValueError(f"moe_gemv: bad shapes xq {tuple(xq.shape)} xs {tuple(xs.shape)} wq {tuple(wq.shape)} "
                         f"ws {tuple(ws.shape)} experts {s} (K must be a multiple of {K_STEP})")
    y = torch.empty((s, n), dtype=out_dtype, device=xq.device)
    if s == 0 or n == 0:
        return y
    xq, wq = xq.contiguous().view(torch.uint8), wq.contiguous().view(torch.uint8)
    xw, ww = _scale_words(xs.contiguous()), _scale_words(ws.contiguous().view(e_n * n, -1))
    if xw is None or ww is None:
        raise ValueError("moe_gemv: the scales must be viewable as int32 words (4-byte aligned rows)")
    ww = ww.view(e_n, n, k // K_STEP)
    experts = _index_vector(experts)
    rows = _index_vector(rows) if rows is not None else None
    emap = _index_vector(expert_map) if expert_map is not None else None
    if interpreting():
        block_n = block_n or 16
    elif block_n is None:
        block_n = choose_block_n(s, n, _num_sms(xq.device))
    _moe_gemv_kernel[(triton.cdiv(n, block_n), s)](
        xq, xw, experts if rows is None else rows, wq, ww, experts, experts if emap is None else emap, y,
        s, n, k, xq.stride(0), xw.stride(0), wq.stride(0), wq.stride(1), ww.stride(0), ww.stride(1), y.stride(0),
        HAS_ROWS=rows is not None, TOPK=topk if rows is None else 1, HAS_MAP=emap is not None,
        BLOCK_M=16, BLOCK_N=block_n, HW=not interpreting(),
        num_warps=4, num_stages=1 if interpreting() else 4)
    return y
