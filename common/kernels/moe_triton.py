"""The glue of the on-grid MoE layer around the expert GEMMs, as three Triton kernels.

The Marlin MoE path (``grid_kernels/marlin_moe.py``) computes, around its two expert GEMMs:

1. the slot order: each expert's token slots, padded to the GEMM's block of rows, in a fixed
   order (:func:`moe_align`);
2. ``qdq(silu(gate) * up)``: SiLU and the product in bf16, as torch computes them, then the
   TE-exact grid values of the product (:func:`silu_mul_qdq`);
3. the combine: the router weights applied in FP32, the top-k slots summed in FP32, one cast
   (:func:`moe_combine`).

Written as torch ops these are about 20 small kernels per MoE layer; at decode sizes (a few
slots per expert) their launches cost more than the expert GEMMs.  Here they are three.

**Rules, each as the torch reference states it:**

* ``moe_align`` equals vLLM's ``moe_align_block_size(..., ignore_invalid_experts=True)``
  followed by :func:`~..grid_kernels.marlin_moe.deterministic_order`: the same buffer sizes,
  each local expert's segment padded to a multiple of the block with the sentinel ``numel``,
  segments in expert order, and the slots of a segment in increasing slot id (a counting sort:
  no atomics, so the order never changes between runs).  Slots routed to no local expert are
  left out.  Blocks past the last segment carry expert -1 (Marlin skips them; it stops at
  ``num_tokens_post_padded`` anyway).  One program per local expert; used up to
  :data:`ALIGN_MAX_SLOTS` slots (decode and small prefill), beyond which the caller takes
  vLLM's kernel and the torch re-sort (kernel count no longer matters there).
* ``silu_mul_qdq`` equals ``qdq_rows(torch.nn.functional.silu(g) * u, bfloat16)`` bit for bit
  on the GPU: SiLU as torch's CUDA kernel computes it in fp32 (``x / (1 + expf(-x))``, IEEE
  division, libdevice ``expf``), rounded to bf16; the product in fp32 (exact: two bf16
  significands) rounded to bf16; then the value path of ``qdq_triton`` (the same helpers).
  Under Triton's CPU interpreter exp and the division are numpy's, so SiLU may differ from
  torch's CPU kernel in its last bit before the bf16 rounding.
* ``moe_combine``: ``sum_k [valid_k] fp32(d_k) * fp32(w_k)``, k in order, each product and sum
  rounded separately (no FMA contraction), then one round-to-nearest-even to bf16.  ``valid_k``:
  the slot's expert is local (``expert_map[id] >= 0``, or ``id >= 0`` without a map); other
  slots were never written by the GEMM and are skipped, whatever they hold.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .qdq_triton import QDQ_CONFIG, QDQ_SMALL_M_CONFIG, _bf16_bits_to_f32, _f32_bits_to_bf16_bits, _grid_codes_f32, \
    _mul_f32_exact, _out_bits, _round_bf16, _tile_scales

try:                                  # libdevice's expf: what torch's CUDA SiLU calls
    from triton.language.extra import libdevice as _libdevice
except ImportError:                   # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice as _libdevice

#: the largest number of token slots (tokens x top-k) the one-pass align kernel takes
ALIGN_MAX_SLOTS = 4096


def align_sizes(numel: int, block: int, num_experts: int) -> tuple[int, int]:
    """vLLM's buffer sizes for ``moe_align_block_size`` (0.26.0): (sorted slots, blocks)."""
    n = numel + num_experts * (block - 1)
    if numel < num_experts:
        n = min(numel * block, n)
    return n, -(-n // block)


@triton.jit
def _moe_align_kernel(ids_ptr, emap_ptr, sorted_ptr, eids_ptr, ntpp_ptr, numel, n_sorted, n_blocks, e_local,
                      HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, SLOTS: tl.constexpr,
                      BINS: tl.constexpr):
    e = tl.program_id(0)                       # the local expert this program places
    o = tl.arange(0, SLOTS)
    inb = o < numel
    ids = tl.load(ids_ptr + o, mask=inb, other=-1).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(emap_ptr + tl.maximum(ids, 0), mask=inb & (ids >= 0), other=-1).to(tl.int32)
    ids = tl.where(inb & (ids >= 0) & (ids < e_local), ids, e_local)      # left out: the spare bin
    counts = tl.histogram(ids, BINS)
    b = tl.arange(0, BINS)
    padded = tl.where(b < e_local, (counts + BLOCK - 1) // BLOCK * BLOCK, 0)
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    mine_b = b == e
    start = tl.sum(tl.where(mine_b, ends - padded, 0), 0)
    cnt = tl.sum(tl.where(mine_b, counts, 0), 0)
    pe = tl.sum(tl.where(mine_b, padded, 0), 0)
    mine = ids == e
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1                            # slot-id order: stable
    tl.store(sorted_ptr + start + rank, o, mask=mine)
    p = tl.arange(0, BLOCK_P2)                                             # BLOCK may be 48
    tl.store(sorted_ptr + start + cnt + p, numel, mask=p < pe - cnt)        # the segment's padding
    tl.store(eids_ptr + start // BLOCK + o, e, mask=o < pe // BLOCK)         # its blocks (<= SLOTS)
    # past the last segment: sentinels and expert -1, spread over the programs
    for base in range(e * SLOTS, n_sorted, e_local * SLOTS):
        q = base + o
        tl.store(sorted_ptr + q, numel, mask=(q >= total) & (q < n_sorted))
    for base in range(e * SLOTS, n_blocks, e_local * SLOTS):
        q = base + o
        tl.store(eids_ptr + q, -1, mask=(q >= total // BLOCK) & (q < n_blocks))
    if e == 0:
        tl.store(ntpp_ptr, total)


def moe_align(topk_ids: torch.Tensor, block: int, num_experts: int, local_experts: int,
              expert_map: Optional[torch.Tensor] = None):
    """Deterministic ``(sorted_ids, expert_ids, num_tokens_post_padded)`` (see the module doc),
    or ``None`` above :data:`ALIGN_MAX_SLOTS` slots.  ``num_experts``: global experts (sizes the
    buffers as vLLM does); ``local_experts``: this rank's (ids after ``expert_map``)."""
    numel = topk_ids.numel()
    if numel > ALIGN_MAX_SLOTS:
        return None
    n_sorted, n_blocks = align_sizes(numel, block, num_experts)
    dev = topk_ids.device
    sorted_ids = torch.empty((n_sorted,), dtype=torch.int32, device=dev)
    expert_ids = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    ntpp = torch.empty((1,), dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    slots = max(triton.next_power_of_2(max(numel, block)), 16)
    _moe_align_kernel[(local_experts,)](
        ids, expert_map if expert_map is not None else ids, sorted_ids, expert_ids, ntpp,
        numel, n_sorted, n_blocks, local_experts, HAS_MAP=expert_map is not None, BLOCK=block,
        BLOCK_P2=triton.next_power_of_2(block), SLOTS=slots, BINS=triton.next_power_of_2(local_experts + 1), num_warps=4)
    return sorted_ids, expert_ids, ntpp


@triton.jit
def _silu_mul_qdq_kernel(gu_ptr, y_ptr, M, I, stride_gm, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    gp = gu_ptr + rows64[:, None] * stride_gm + cols[None, :]
    g = _bf16_bits_to_f32(tl.load(gp, mask=mask, other=0))
    u = _bf16_bits_to_f32(tl.load(gp + I, mask=mask, other=0))
    # torch's CUDA SiLU in fp32 (opmath), then its bf16 result; then bf16 * bf16 in fp32, rounded
    if USE_ASM:
        s = tl.math.div_rn(g, 1.0 + _libdevice.exp(-g))
    else:
        s = g / (1.0 + tl.exp(-g))
    s_nan = s != s
    s = _round_bf16(tl.where(s_nan, 0.0, s), USE_ASM)
    p = _mul_f32_exact(s, u, USE_ASM)
    p_nan = s_nan | (p != p)
    x = _round_bf16(tl.where(p_nan, 0.0, p), USE_ASM)
    x = tl.where(p_nan, float("nan"), x)
    xbits = x.to(tl.int32, bitcast=True)
    # --- the value path of qdq_triton._qdq_rows_kernel (bf16 in, bf16 out): its very helpers ---
    nan_in, e, sc, d = _tile_scales(xbits, BLOCK_M, BLOCK_K, USE_ASM)
    v = _mul_f32_exact(_grid_codes_f32(x, xbits, sc, USE_ASM), d, USE_ASM)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], _out_bits(v, xbits, nan_in, 1, USE_ASM), mask=mask)


def silu_mul_qdq(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``qdq_rows(silu(gu[:, :I]) * gu[:, I:], bfloat16)`` for a bf16 ``gu`` of shape (S, 2I)."""
    if gu.dtype != torch.bfloat16:
        raise ValueError(f"silu_mul_qdq takes the bf16 gate_up output; got {gu.dtype}")
    i = intermediate
    gu2 = gu.reshape(-1, 2 * i)
    if gu2.stride(-1) != 1:
        gu2 = gu2.contiguous()
    if i % F.BLOCK_SIZE:
        raise ValueError(f"silu_mul_qdq: intermediate size {i} is not a multiple of {F.BLOCK_SIZE}")
    m = gu2.shape[0]
    y = torch.empty((m, i), dtype=torch.bfloat16, device=gu.device)
    if m:
        bm, bk, warps = QDQ_SMALL_M_CONFIG if m <= 16 else QDQ_CONFIG
        grid = (triton.cdiv(m, bm), triton.cdiv(i, bk))
        _silu_mul_qdq_kernel[grid](gu2.view(torch.int16), y.view(torch.int16), m, i, gu2.stride(0), y.stride(0),
                                   BLOCK_M=bm, BLOCK_K=bk, USE_ASM=not interpreting(), num_warps=warps)
    return y


@triton.jit
def _moe_combine_kernel(d_ptr, w_ptr, ids_ptr, emap_ptr, out_ptr, H,
                        TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr, USE_ASM: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        slot = m * TOPK + k
        w = tl.load(w_ptr + slot).to(tl.float32)
        eid = tl.load(ids_ptr + slot).to(tl.int32)
        valid = eid >= 0
        if HAS_MAP:
            valid = tl.load(emap_ptr + tl.maximum(eid, 0)).to(tl.int32) >= 0
            valid = valid & (eid >= 0)
        # an invalid slot's row is in the buffer but was never written: read, then not summed
        d = _bf16_bits_to_f32(tl.load(d_ptr + slot * H + cols, mask=cmask, other=0))
        prod = _mul_f32_exact(d, w, USE_ASM)
        acc = tl.where(valid, acc + prod, acc)
    if USE_ASM:
        h = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        h = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
    tl.store(out_ptr + m * H + cols, h, mask=cmask)


def moe_combine(d: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 (m, H) from the down GEMM's bf16 slots ``d`` (m * topk, H): router weights in FP32,
    the valid slots summed in FP32 in k order, one cast (see the module doc)."""
    m, topk = topk_ids.shape
    h = d.shape[-1]
    d2 = d.reshape(m * topk, h)
    if d2.dtype != torch.bfloat16 or not d2.is_contiguous():
        raise ValueError("moe_combine takes the contiguous bf16 output of the down GEMM")
    out = torch.empty((m, h), dtype=torch.bfloat16, device=d.device)
    if m:
        w = topk_weights.reshape(-1)
        ids = topk_ids.reshape(-1)
        w = w if w.is_contiguous() else w.contiguous()
        ids = ids if ids.is_contiguous() else ids.contiguous()
        block_h = min(1024, triton.next_power_of_2(h))
        _moe_combine_kernel[(m, triton.cdiv(h, block_h))](
            d2.view(torch.int16), w, ids, expert_map if expert_map is not None else ids, out.view(torch.int16), h,
            TOPK=topk, HAS_MAP=expert_map is not None, BLOCK_H=block_h, USE_ASM=not interpreting(), num_warps=4)
    return out
