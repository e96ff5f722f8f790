"""Decode GEMM on the grid (M <= 64): stream the fp8 weight + its compact scales once, near HBM speed.

    y[M, N] = dequant(xq, xs) @ dequant(wq, ws)^T (+ bias),  FP32 accumulation,  ``out_dtype`` out

Same operands and signature as :func:`gemm_triton.grid_gemm` (codes (M, K) / (N, K) as uint8
or float8_e4m3fn, unpadded compact E8M0 scales (M, K/32) / (N, K/32)).  Entry:
:func:`grid_gemv`; configs: :func:`choose_config` (``MXFP8_GEMV_VARIANT`` / ``name=`` picks a
family of :data:`NAMED`).

Two variants of the inner step (one 32-wide K chunk = one scale per row of each operand):

* ``chunk``: E4M3 codes -> fp16 by the hardware conversion (exact: every E4M3 value,
  subnormals included, is an fp16 normal number), ``p = dot(x_c, w_c^T)`` on the tensor cores
  with FP32 accumulation (fp16 x fp16 products are exact in FP32), then
  ``acc += (p * 2^(ex-127)) * 2^(ew-127)``: the outer product of the two power-of-two scales
  applied to the chunk's partial sum.  Multiplying by a power of two is exact unless the result
  leaves the fp32 normal range (see "exactness"), so the result differs from
  dequantize-then-dot only in the order of the FP32 additions.  ALU work per chunk: the
  fp8->fp16 conversion (cvt.rn.f16x2.e4m3x2, half an instruction per byte) plus a BLOCK_M x
  BLOCK_N multiply + FMA epilogue.
* ``deq``: both operands dequantized in registers to bf16 (decode, times the power-of-two
  scale, cast: exact whenever the scale byte is >= 3, as in ``grid_gemm``), then one
  ``tl.dot(..., acc)`` per chunk: ~3 ALU instructions per weight byte, no epilogue; cheaper
  than ``chunk`` only at BLOCK_M 64, where the chunk epilogue is 64 x BLOCK_N per chunk.
* ``swap`` (config flag, either variant): computes (W x^T)^T so that the weight tile is the
  MMA's M side (wgmma with W from registers).  Compiled with Triton 3.6 it issues more
  instructions per byte than the plain form (0.139 vs 0.108 /B at BLOCK_M 16), so no family
  uses it; kept, tested, for other Triton versions.

Scales: E8M0 byte e -> fp32 2^(e-127) is ``max(e << 23, 0x00400000)`` reinterpreted (e = 0 gives
the subnormal 2^-127 as ``dequantize_blocks`` does), and e = 255 (E8M0 NaN, never written by the
quantizer: a block amax is never NaN) is selected to ``format.F32_NAN_BITS``, as in
``format.e8m0_to_float`` and every other kernel (one select per row and 32-chunk).

Launch shape (why it should stream at HBM speed):

* each program owns a BLOCK_N x K-range slab of W and reads it exactly once; the x rows
  (<= 64 x K fp8) are re-read by every program from L2;
* K is walked 128 at a time (4 chunks); a row's 4 scale bytes for that step are ONE int32 word
  (scales viewed as int32 when K % 128 == 0 and rows are 4-byte aligned; byte loads otherwise),
  loaded one step ahead (register double buffer): 1-byte loads are too small for cp.async and
  would stall the loop; the weight/x chunks go through cp.async into shared memory,
  multi-buffered by Triton's pipeliner (``num_stages``; (BLOCK_N + BLOCK_M) x 128 B per stage:
  4 x 18 KB for 128 + 16, i.e. 3 steps = 48 KB of weights in flight per program, 4 programs
  per SM by shared memory -- an H200 needs ~24 KB in flight per SM to cover HBM latency);
* instructions: the main loop's SASS (Triton 3.6, sm_90, compiled offline with the bundled
  ptxas; see NAMED) issues 0.108 warp-instructions per weight byte for ``chunk`` at BLOCK_M 16,
  BLOCK_N 128 (83 registers, no spills).  An SM issues 4 per clock and gets ~17 B/clock at full
  HBM bandwidth, so the loop needs under half the issue slots;
* split-K when N is small: grid (M-tiles x N-tiles, SPLIT_K), SPLIT_K chosen for >= 2 programs
  per SM and >= 90 % wave efficiency (:func:`choose_split`), capped so that the FP32 partials
  stay small.  The partials are reduced inside the same launch, deterministically: every
  program writes its FP32 partial to a workspace, bumps a per-tile counter (acq_rel atomic
  after a CTA barrier); the program that arrives last sums the SPLIT_K partials in split order
  (L2 loads, ``.cg``), adds the bias, casts, stores, and re-arms the counter to 0.  No memset,
  no second kernel, run-to-run identical bits.  The counters live in a per-(device, stream)
  int32 buffer allocated once and kept alive (CUDA-graph safe: a graph replays with the same
  buffer; the counters are back to 0 after every launch; launches on one stream are serial).

Exactness (both variants): every product x_i * w_i is exact in fp32; the result is the FP32
sum of those products in some order, each term through at most n = 31 + K/16 + SPLIT_K + 1
roundings (a 32-term chunk dot, the accumulator updates -- K/32 for ``chunk``, K/16 MMA steps for
``deq`` --, the split-K sum, the bias): |y - exact| <= n * u * sum|x_i w_i| to first order
(u = 2^-24 for IEEE additions; 2^-23 covers tensor cores that truncate) -- tests check this
bound.  Where the variants are not exact: ``chunk`` -- a scaled chunk partial that lands in
fp32 subnormals (needs an activation block of amax < ~1e-30, or scale bytes ex + ew < ~146,
i.e. both blocks below ~2^-45) is rounded there (error < 2^-149 per chunk), and one above
2^128 overflows (an activation block of amax > ~2^100, or a +-Inf block -- inf/NaN in the
reference too); ``deq`` -- operands of blocks with scale byte < 3 are rounded to bf16
subnormals.

Under Triton's CPU interpreter (``HW=False``) the codes are decoded by integer arithmetic to
fp32 and the dots are IEEE fp32 (the interpreter has no fp8/bf16 dot); everything else --
indexing, masks, scale words, split-K reduction, counters -- is the GPU code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .gemm_triton import _e4m3_to_f32
from .qdq_triton import _f32_bits_to_bf16_bits

# format rules as Triton compile-time constants (jit code may read only constexpr globals)
_BLOCK = tl.constexpr(F.BLOCK_SIZE)                  # one K chunk = one scale block
_WORD_K = tl.constexpr(4 * F.BLOCK_SIZE)             # K covered by one int32 word of 4 scale bytes
_E8M0_BIAS = tl.constexpr(F.E8M0_BIAS)               # scale byte of 1.0: the neutral value of a masked load
_E8M0_MIN_BITS = tl.constexpr(F.E8M0_MIN_BITS)
_E8M0_NAN_FIELD = tl.constexpr(F.E8M0_NAN << F.F32_MAN_BITS)     # byte 255 in the exponent field (= +Inf bits)
_F32_NAN_BITS = tl.constexpr(F.F32_NAN_BITS)
_F32_MAN_BITS = tl.constexpr(F.F32_MAN_BITS)
_F32_EXP_FIELD = tl.constexpr(F.F32_EXP_MASK << F.F32_MAN_BITS)  # 0x7F800000
_BF16_NAN_BITS = tl.constexpr(F.BF16_NAN_BITS)

VARIANTS = ("chunk", "deq")
_VARIANT_ID = {"chunk": 0, "deq": 1}


@triton.jit
def _pow2(bits):
    """fp32 2^(e-127) from ``e << 23`` (any int32 whose other bits are 0): e = 0 gives 2^-127 (the
    subnormal 0x00400000, via an integer max), 1..254 the normal power of two, e = 255 (an E8M0
    NaN, which the quantizer never writes: a block amax is never NaN) NaN (``format.F32_NAN_BITS``,
    one select), as ``format.e8m0_to_float`` decodes them."""
    bits = tl.where(bits == _E8M0_NAN_FIELD, _F32_NAN_BITS, tl.maximum(bits, _E8M0_MIN_BITS))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _word_pow2(word, C: tl.constexpr):
    """Scale byte C (0..3, little-endian) of an int32 word of 4 E8M0 scales -> fp32 2^(e-127).
    Two integer ops (shift, mask) plus a max and the NaN select: moves the byte straight into the
    exponent field."""
    if C == 3:
        b = (word >> (8 * 3 - _F32_MAN_BITS)) & _F32_EXP_FIELD
    else:
        b = (word << (_F32_MAN_BITS - 8 * C)) & _F32_EXP_FIELD
    return _pow2(b)


@triton.jit
def _chunk_step(acc, a, w, fx, fw, VARIANT: tl.constexpr, SWAP: tl.constexpr, HW: tl.constexpr):
    """acc += dequant(a) @ dequant(w)^T for one 32-wide K chunk (SWAP: acc^T, i.e. acc is (BN, BM)).

    a: (BM, 32) uint8 codes, w: (BN, 32) uint8 codes, fx: (BM,) / fw: (BN,) fp32 powers of two.
    SWAP computes W x^T: the weight tile is the MMA's M side (BLOCK_N >= 64 rows: Hopper wgmma
    with the weight operand in registers, the small x tile the N side), instead of x W^T.
    """
    if VARIANT == 0:
        if HW:
            af = a.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            af = _e4m3_to_f32(a, False)
            wf = _e4m3_to_f32(w, False)
        if SWAP:
            if HW:
                p = tl.dot(wf, tl.trans(af))
            else:
                p = tl.dot(wf, tl.trans(af), input_precision="ieee")
            acc += (p * fw[:, None]) * fx[None, :]
        else:
            if HW:
                p = tl.dot(af, tl.trans(wf))
            else:
                p = tl.dot(af, tl.trans(wf), input_precision="ieee")
            acc += (p * fx[:, None]) * fw[None, :]
    else:
        av = _e4m3_to_f32(a, HW) * fx[:, None]
        wv = _e4m3_to_f32(w, HW) * fw[:, None]
        if HW:
            av = av.to(tl.bfloat16)
            wv = wv.to(tl.bfloat16)
            if SWAP:
                acc = tl.dot(wv, tl.trans(av), acc)
            else:
                acc = tl.dot(av, tl.trans(wv), acc)
        else:
            if SWAP:
                acc = tl.dot(wv, tl.trans(av), acc, input_precision="ieee")
            else:
                acc = tl.dot(av, tl.trans(wv), acc, input_precision="ieee")
    return acc


@triton.jit
def _store_out(ptrs, v, mask, HW: tl.constexpr):
    """Cast the fp32 result to the output dtype (round to nearest even) and store it."""
    if HW or ptrs.dtype.element_ty != tl.bfloat16:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)
    else:     # the interpreter's fp32 -> bf16 cast truncates: round on the bits instead
        bits = tl.where(v != v, _BF16_NAN_BITS, _f32_bits_to_bf16_bits(v.to(tl.int32, bitcast=True)))
        tl.store(ptrs, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _grid_gemv_kernel(
    xq_ptr, xs_ptr, wq_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym, steps_per_split, SPLIT_K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    SCALE_WORDS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    VARIANT: tl.constexpr, SWAP: tl.constexpr, HW: tl.constexpr,
):
    pid = tl.program_id(0)            # output tile; M-tiles fastest so programs sharing a W slab run together
    pid_k = tl.program_id(1)          # K split
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, _BLOCK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    BLOCK_K: tl.constexpr = CHUNKS * _BLOCK
    k_per_split = steps_per_split * BLOCK_K       # a multiple of BLOCK_K the compiler can see: aligned 16-B loads
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    x_rows = xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = wq_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    ws_rows = ws_ptr + offs_n.to(tl.int64) * stride_wsn
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_WORDS:
        # CHUNKS == 4: the 4 scale bytes of a row for one 128-K step are one little-endian int32
        # word (scale tensors viewed as int32).  Prefetched one step ahead (register double buffer).
        # (every split is non-empty; word indices are clamped into the row instead of masked)
        last_word = (k_end - 1) // _WORD_K
        sx_next = tl.load(xs_rows + k_begin // _WORD_K, mask=m_ok, other=0)
        sw_next = tl.load(ws_rows + k_begin // _WORD_K, mask=n_ok, other=0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if SCALE_WORDS:
            sx_word = sx_next
            sw_word = sw_next
            k1 = tl.minimum((k0 + BLOCK_K) // _WORD_K, last_word)    # past the end: reload the last word
            sx_next = tl.load(xs_rows + k1, mask=m_ok, other=0)
            sw_next = tl.load(ws_rows + k1, mask=n_ok, other=0)
        for c in tl.static_range(CHUNKS):
            kk = k0 + c * _BLOCK + offs_c
            if SCALE_WORDS:
                fx = _word_pow2(sx_word, c)
                fw = _word_pow2(sw_word, c)
            else:
                # a chunk past K (only when K % BLOCK_K != 0) reads the row's last scale byte:
                # its codes are masked to 0 and 0 times any finite power of two is 0
                kb = tl.minimum(k0 // _BLOCK + c, K // _BLOCK - 1)
                fx = _pow2(tl.load(xs_rows + kb, mask=m_ok, other=_E8M0_BIAS).to(tl.int32) << _F32_MAN_BITS)
                fw = _pow2(tl.load(ws_rows + kb, mask=n_ok, other=_E8M0_BIAS).to(tl.int32) << _F32_MAN_BITS)
            if EVEN_K:
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0)
                if EVEN_N:
                    w = tl.load(w_rows + kk[None, :])
                else:
                    w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0)
            else:
                k_ok = kk < k_end
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            acc = _chunk_step(acc, a, w, fx, fw, VARIANT, SWAP, HW)
    if SWAP:
        acc = tl.trans(acc)

    out_mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        _store_out(y_ptrs, acc, out_mask, HW)
    else:
        mn = M.to(tl.int64) * N
        p_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * mn + p_off, acc, mask=out_mask)
        tl.debug_barrier()                       # all of this CTA's partial stores before the release
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:               # the last program of this tile: reduce in split order
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                tot += tl.load(part_ptr + s * mn + p_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            _store_out(y_ptrs, tot, out_mask, HW)
            tl.atomic_xchg(cnt_ptr + pid, 0)     # re-arm for the next launch


# -- configs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemvConfig:
    variant: str = "chunk"     #: "chunk" or "deq" (see module doc)
    block_m: int = 16          #: >= 16 (tensor-core tile); the chooser takes the next power of two >= M
    block_n: int = 64          #: weight rows per program
    chunks: int = 4            #: 32-wide K chunks per loop step (4 = one scale word per row)
    split_k: int = 1           #: K splits (reduced in-kernel, deterministic)
    num_warps: int = 4
    num_stages: int = 5
    swap: bool = False         #: compute (W x^T)^T: the weight tile is the MMA's M operand (see _chunk_step)

    def astuple(self):
        return (self.variant, self.block_m, self.block_n, self.chunks, self.split_k, self.num_warps,
                self.num_stages, self.swap)


#: named config families, timed side by side by benchmarks/bench_linear.py; ``MXFP8_GEMV_VARIANT``
#: (or ``name=``) picks one, default ``auto``.  Instruction counts are of the main loop's SASS
#: (Triton 3.6, sm_90, compiled offline), in warp-instructions per weight byte: an H200 SM issues
#: 4 warp-instructions per clock and receives ~17 B/clock at full HBM bandwidth, so anything above
#: ~0.23 /B cannot keep up with HBM and ~0.12 /B leaves half the issue slots free.
#:   auto      -- chunk (BLOCK_M 16/32) for M <= 32, deq (BLOCK_M 64) for 32 < M <= 64
#:   chunk     -- fp16 MMA per 32-chunk + scale epilogue, BLOCK_N 128, 4 warps, 4 stages:
#:                0.108 /B at BLOCK_M 16, 0.162 /B at BLOCK_M 32; at BLOCK_M 64 (wgmma + a 64x64
#:                epilogue per chunk) BLOCK_N 64 and 8 warps (4 warps spill), 0.49 /B
#:   deq       -- bf16 dequant in registers, BLOCK_N 128, 4 warps, 4 stages: 0.25 (BM 16),
#:                0.23 (BM 32), 0.197 /B (BM 64)
#:   chunk_n64 -- chunk with BLOCK_N 64 (twice the programs, half the bytes each): 0.157 /B at BM 16
NAMED = ("auto", "chunk", "deq", "chunk_n64")
_NUM_SMS = {}


def _num_sms(device) -> int:
    if interpreting():
        return 8
    cuda = torch.cuda.is_available()
    idx = torch.device(device).index
    if idx is None:
        idx = torch.cuda.current_device() if cuda else 0
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count if cuda else 132
    return _NUM_SMS[idx]


def _pow2_at_least(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def _family(name: str, bm: int) -> GemvConfig:
    if name == "auto":
        name = "chunk" if bm <= 32 else "deq"
    if name == "chunk":
        return GemvConfig("chunk", bm, 128, 4, 1, 4, 4) if bm <= 32 else GemvConfig("chunk", bm, 64, 4, 1, 8, 4)
    if name == "deq":
        return GemvConfig("deq", bm, 128, 4, 1, 4, 4)
    return GemvConfig("chunk", bm, 64, 4, 1, 4 if bm <= 32 else 8, 5 if bm == 16 else 4)     # chunk_n64


def _wave_eff(w: int, sms: int) -> float:
    """Fraction of SM time busy when ``w`` equal programs run on ``sms`` SMs (192 on 132: 0.73)."""
    return w / (sms * triton.cdiv(w, sms))


def choose_split(m: int, n: int, k: int, block_m: int, block_n: int, sms: int) -> int:
    """K splits for a (M, N, K) problem on ``sms`` SMs.

    Candidates: powers of two up to 16 with >= 2 K-steps of 128 per program, FP32 partials
    (split x M x N x 4 B, written and read back) <= 1/4 of the weight bytes (8 split M <= K),
    and <= 64 KB of partials for the last program of a tile to sum (its serial tail).  Take
    the smallest split with >= 2 programs per SM (latency hiding) at wave efficiency >= 0.9;
    else the most efficient one (ties: more programs up to 2 per SM, then fewer splits).
    """
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, 128)
    rows = min(m, block_m)
    cands = [s for s in (1, 2, 4, 8, 16)
             if s == 1 or (steps // s >= 2 and 8 * s * m <= k and s * rows * block_n * 4 <= 65536)]
    for s in cands:
        if tiles * s >= 2 * sms and _wave_eff(tiles * s, sms) >= 0.9:
            return s
    return max(cands, key=lambda s: (round(_wave_eff(tiles * s, sms), 2), min(tiles * s, 2 * sms), -s))


def choose_config(m: int, n: int, k: int, name: Optional[str] = None, device="cuda") -> GemvConfig:
    """The launch config for an (M, N, K) problem.  ``name``: one of :data:`NAMED` (default: the
    ``MXFP8_GEMV_VARIANT`` environment variable, else ``auto``).

    The family fixes the variant, BLOCK_M (next power of two >= M, 16 .. 64), warps and stages;
    BLOCK_N 128 is narrowed to 64 when that gives clearly more busy SMs (small N at M > 16, where
    the split is capped by the partials); then :func:`choose_split`.
    """
    name = name or os.environ.get("MXFP8_GEMV_VARIANT", "auto")
    if name not in NAMED:
        raise ValueError(f"gemv variant must be one of {NAMED}; got {name!r}")
    if interpreting():
        # small tiles: the interpreter runs every program's numpy ops on the CPU
        return GemvConfig(variant="deq" if name == "deq" else "chunk", block_m=16, block_n=16 if n <= 16 else 32,
                          chunks=4, split_k=1, num_warps=4, num_stages=1)
    sms = _num_sms(device)
    cfg = _family(name, min(64, max(16, _pow2_at_least(m))))
    options = [cfg]
    if cfg.block_n == 128:
        options.append(replace(cfg, block_n=64, num_stages=5 if cfg.block_m == 16 else 4))
    best, best_score = None, -1.0
    for c in options:
        sp = choose_split(m, n, k, c.block_m, c.block_n, sms)
        w = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n) * sp
        score = _wave_eff(w, sms) * min(1.0, w / sms)
        if score > best_score + 0.05:          # the first (BLOCK_N 128) unless clearly worse
            best, best_score = replace(c, split_k=sp), score
    return best


# -- split-K counters ---------------------------------------------------------------------------

_COUNTERS: dict = {}
_KEEP_ALIVE: list = []      # a CUDA graph may hold the pointer of a buffer we replaced: never free one


def _counters(device: torch.device, n: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
        _KEEP_ALIVE.append(buf)
    return buf


def _scale_words(s: torch.Tensor) -> Optional[torch.Tensor]:
    """The (R, K/32) uint8 scales as (R, K/128) int32 words, or None when not 4-byte viewable."""
    if s.shape[-1] % 4 or s.stride(-1) != 1 or (s.stride(0) % 4 and s.shape[0] > 1) or s.data_ptr() % 4:
        return None
    try:
        return s.view(torch.int32)
    except RuntimeError:
        return None


def grid_gemv(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype, config=None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[M, N] = dequant(xq, xs) @ dequant(wq, ws)^T (+ bias), FP32 accumulation, ``out_dtype`` out.

    xq: (M, K) uint8/float8 codes, xs: (M, K/32) uint8; wq: (N, K), ws: (N, K/32); K % 32 == 0.
    ``config``: a :class:`GemvConfig`, a name of :data:`NAMED`, or None (``choose_config``).
    ``out``: an optional preallocated contiguous (M, N) ``out_dtype`` tensor to write into.
    Meant for M <= 64 (decode); correct for any M.
    """
    m, k = xq.shape
    n = wq.shape[0]
    if k % F.BLOCK_SIZE or wq.shape[1] != k or tuple(xs.shape) != (m, k // F.BLOCK_SIZE) \
            or tuple(ws.shape) != (n, k // F.BLOCK_SIZE):
        raise ValueError(f"grid_gemv: bad shapes xq {tuple(xq.shape)} xs {tuple(xs.shape)} "
                         f"wq {tuple(wq.shape)} ws {tuple(ws.shape)}")
    xq, wq = xq.view(torch.uint8), wq.view(torch.uint8)
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if wq.stride(-1) != 1:
        wq = wq.contiguous()
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    if ws.stride(-1) != 1:
        ws = ws.contiguous()
    dev = xq.device
    if out is not None:
        if out.shape != (m, n) or out.dtype != out_dtype or out.stride(-1) != 1:
            raise ValueError("grid_gemv: out must be a (M, N) out_dtype tensor with contiguous rows")
        y = out
    else:
        y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(out_dtype).expand(m, n))
    if config is None or isinstance(config, str):
        config = choose_config(m, n, k, config, dev)
    cfg = config
    block_k = F.BLOCK_SIZE * cfg.chunks
    xs_arg, ws_arg, words = xs, ws, False
    if cfg.chunks == 4 and k % (4 * F.BLOCK_SIZE) == 0:
        xw, ww = _scale_words(xs), _scale_words(ws)
        if xw is not None and ww is not None:
            xs_arg, ws_arg, words = xw, ww, True
    steps = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(steps, cfg.split_k) * block_k
    split = triton.cdiv(k, k_per_split)                 # no empty splits
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=dev)
        cnt = _counters(dev, tiles)
    else:
        part = cnt = y
    _grid_gemv_kernel[(tiles, split)](
        xq, xs_arg, wq, ws_arg, bias if bias is not None else y, y, part, cnt,
        m, n, k, xq.stride(0), xs_arg.stride(0), wq.stride(0), ws_arg.stride(0), y.stride(0),
        k_per_split // block_k, split,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks,
        SCALE_WORDS=words, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % block_k == 0,
        VARIANT=_VARIANT_ID[cfg.variant], SWAP=cfg.swap, HW=not interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
