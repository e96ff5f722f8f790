"""Fused quantize-dequantize of rows: x -> the exact grid values of x, in one pass.

``qdq_rows(x)`` returns ``dequantize_blocks(*quantize_rows(x)).to(out_dtype)`` bit for bit
(``out_dtype`` defaults to x's dtype): TE's rowwise MXFP8 cast (1x32 blocks along K, the
rules of ``common/format.py``, done by the very ``@triton.jit`` helpers of
``quantize_triton.py``), then the exact decode ``e4m3(q) * 2^(e-127)`` in fp32, then one
round-to-nearest-even cast to ``out_dtype``.  Optionally it also writes the fp8 codes and
the compact (M, K/32) scales, byte-identical to ``quantize_rows``.

Purpose: the prefill Linear becomes ``qdq_rows(x, bfloat16) @ W_grid_bf16^T`` on cuBLAS,
where ``W_grid_bf16`` is the weight's exact grid values in bf16 (a derived copy the engine
keeps).  Both operands are then exactly the grid values, their products are exact in the
FP32 accumulator, so the result is the grid Linear up to FP32 summation order -- at cuBLAS
speed (:func:`prefill_linear`).

When is the output dtype exact?  A grid value is ``c * 2^(e-127)``, c an E4M3 value with at
most 4 significant bits whose lowest set bit is >= 2^-9, e the block's scale byte:

* fp32: exact for every value below 2^128 (lowest bit >= 2^(e-136) >= 2^-136 > 2^-149).  A grid
  value of 2^128 or more -- |x| >= ~3.3e38, which the E4M3 rounding carries to 256 * 2^120, and
  the +-Inf elements of a block holding +-Inf (448 * 2^127) -- is +-inf, as in the reference's
  fp32 decode; the same holds for the bf16 and fp16 outputs below.
* bf16: exact for every element of a block whose scale byte is >= 3 (:data:`BF16_EXACT_MIN_SCALE`);
  bf16 subnormals have resolution 2^-133 = 2^(3-136).  Byte <= 2 means amax * (1/448) <= 2^-125,
  i.e. block amax <= ~1.05e-35: such a block's small elements fall below bf16 resolution and the
  kernel writes their round-to-nearest-even bf16 value -- the same as the reference's
  ``.to(bfloat16)`` (so the output still equals the reference bit for bit), off from the exact
  value by < 2^-134 in absolute terms.  ``return_min_scale=True`` reports the smallest scale
  byte seen (device tensor, no host sync) so that a caller can check exactness lazily.
* fp16: exact for every element iff 112 <= scale byte <= 134 (lowest bit 2^(e-136) >= 2^-24
  and 448 * 2^(e-127) <= 65504), i.e. block amax in about (0.0068, 57344].  Small fp16
  activations (amax < 0.0068) are common, so fp16 is NOT an exact carrier: for an fp16 model
  use ``out_dtype=torch.bfloat16`` (exact from byte 3) and let the GEMM write fp16.
  Outside the exact range the kernel writes the RNE fp16 value (= the reference's
  ``.to(float16)``, including inf for 448 * 2^8 = 114688).

NaN: an input NaN encodes as 0x7F and decodes to NaN; the kernel writes the canonical quiet
NaN of the output dtype (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00: ``format.F32_NAN_BITS``,
``BF16_NAN_BITS``, ``FP16_NAN_BITS``).  The reference's NaN
payload depends on the CPU; tests compare NaN positions, not NaN payloads.

How the values are made bit-exact on both the GPU and Triton's CPU interpreter:
* codes and scales: the helpers of ``quantize_triton.py`` (``USE_ASM`` picks the GPU's
  ``mul.rn.f32`` / ``cvt.rn.satfinite`` or their integer emulations);
* decode: ``gemm_triton._e4m3_to_f32`` (hardware cvt, or integer decode) times the power of two
  ``2^(e-127)`` with a PTX ``mul.rn.f32`` (no flush-to-zero: values of blocks with tiny scales
  are fp32 subnormals) -- numpy's IEEE multiply under the interpreter;
* bf16 input -> fp32 by shifting the 16-bit pattern (exact; the interpreter's own bf16 upcast
  mishandles bf16 subnormals);
* fp32 -> bf16 / fp16 by the IEEE round-to-nearest-even casts (``cvt.rn.bf16x2.f32`` /
  ``cvt.rn.f16.f32`` on the GPU, no flush-to-zero; under the interpreter, whose bf16 cast
  truncates, an integer RNE on the bit pattern, and numpy's fp16 cast); the output is stored as
  integer bit patterns, NaN and -0.0 fixed from the input's bits;
* when the codes are not asked for (the prefill path), the GPU skips forming byte codes:
  ``cvt.rn.satfinite.e4m3x2.f32`` of the clamped ``x * s`` goes straight back to fp32.

Speed: the kernel reads x once and writes the output once (4 B per element for bf16 -> bf16;
plus codes + scales when asked).  An H200 SM receives ~17 B/clock at full HBM bandwidth, i.e.
~4 elements per clock, and issues 4 warp-instructions (128 lane-instructions) per clock: the
kernel keeps up with HBM only below ~30 instructions per element.  Compiled offline (Triton 3.6,
sm_90) the value-only kernel issues ~23 per element (bf16 -> bf16), the codes path ~32 (the
rowwise quantize kernel, which this shares, reached 0.67 of copy bandwidth).  Expected: ~6-8 us
for 2048 x 4096, against ~140 us for the prefill GEMM it feeds (qkv) -- 5 %; for N = 2048
(Qwen3-30B-A3B o_proj) ~10 %.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import format as F
from . import interpreting
from .gemm_triton import _e4m3_to_f32, _e8m0_to_f32, _f32_bits_to_bf16_bits  # noqa: F401 (re-exported)
from .quantize_triton import _e8m0_from_amax_bits, _encode_e4m3, _scale_reciprocal

#: smallest scale byte whose every block value is exact in each output dtype (and the largest for fp16)
BF16_EXACT_MIN_SCALE = 3
FP16_EXACT_MIN_SCALE = 112
FP16_EXACT_MAX_SCALE = 134

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# format rules as Triton compile-time constants (jit code may read only constexpr globals)
_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E4M3_MAX = tl.constexpr(F.E4M3_MAX)
_E8M0_NAN = tl.constexpr(F.E8M0_NAN)                 # larger than every scale a block gets: the min's start
_F32_ABS_MASK = tl.constexpr(F.F32_ABS_MASK)
_F32_INF_BITS = tl.constexpr(F.F32_INF_BITS)
_F32_NEG_ZERO_BITS = tl.constexpr(F.F32_NEG_ZERO_BITS)
_F32_NAN_BITS = tl.constexpr(F.F32_NAN_BITS)
_BF16_NAN_BITS = tl.constexpr(F.BF16_NAN_BITS)
_FP16_NAN_BITS = tl.constexpr(F.FP16_NAN_BITS)
_BF16_SHIFT = tl.constexpr(16)                       # bf16 is the top half of an fp32

#: (BLOCK_M, BLOCK_K, num_warps): the rowwise quantize kernel's tiles (bench_quantize.py sweep)
QDQ_CONFIG = (32, 128, 4)
QDQ_SMALL_M_CONFIG = (16, 128, 4)


@triton.jit
def _mul_f32_exact(a, b, USE_ASM: tl.constexpr):
    """IEEE fp32 a * b, round to nearest, subnormals kept (PTX mul.rn.f32 without .ftz)."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r",
            [a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1)
        return r.to(tl.float32, bitcast=True)
    else:
        return a * b


@triton.jit
def _qdq_rows_kernel(
    x_ptr, y_ptr, q_ptr, s_ptr, min_ptr,
    M, K, stride_xm, stride_ym, stride_qm, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr,
    WRITE_CODES: tl.constexpr, TRACK_MIN: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    if IN_BF16:
        # bf16 -> fp32 is a 16-bit shift of the bit pattern (exact for subnormals too; the
        # interpreter's bf16 conversion mishandles bf16 subnormals, so do it by hand)
        xbits = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0).to(tl.int32) << _BF16_SHIFT
        x = xbits.to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xbits = x.to(tl.int32, bitcast=True)
    nan_in, e, s, d = _tile_scales(xbits, BLOCK_M, BLOCK_K, USE_ASM)
    sb = pid_k * (BLOCK_K // _BLOCK) + tl.arange(0, BLOCK_K // _BLOCK)
    smask = (rows[:, None] < M) & (sb[None, :] < K // _BLOCK)
    if TRACK_MIN:
        tl.atomic_min(min_ptr, tl.min(tl.min(tl.where(smask, e, _E8M0_NAN), axis=1), axis=0))
    if WRITE_CODES:
        # the shared encoder (clamp, cvt.rn.satfinite / integer RNE, NaN -> 0x7F, -0.0 -> 0x00)
        q = _encode_e4m3(x, xbits, s, USE_ASM)                                # (BLOCK_M, BLOCK_K) uint8
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows64[:, None] * stride_sm + sb[None, :], e.to(tl.uint8), mask=smask)
        c = _e4m3_to_f32(q, USE_ASM)
    else:
        c = _grid_codes_f32(x, xbits, s, USE_ASM)
    # --- dequantize: e4m3(q) * 2^(e-127), one IEEE fp32 multiply (exact, see module doc) ---
    v = _mul_f32_exact(c, d, USE_ASM)
    out = _out_bits(v, xbits, nan_in, OUT_KIND, USE_ASM)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], out, mask=mask)


@triton.jit
def _bf16_bits_to_f32(bits16):
    """bf16 bit patterns (loaded as int16) -> fp32, exact (a 16-bit shift; subnormals too)."""
    return (bits16.to(tl.int32) << _BF16_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(v, USE_ASM: tl.constexpr):
    """fp32 -> its round-to-nearest-even bf16 value, as fp32 (non-NaN input; cvt.rn.bf16.f32 on the GPU,
    an integer RNE in the interpreter, whose own bf16 cast truncates)."""
    if USE_ASM:
        return v.to(tl.bfloat16).to(tl.float32)
    else:
        return ((_f32_bits_to_bf16_bits(v.to(tl.int32, bitcast=True))) << _BF16_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _tile_scales(xbits, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """A (BLOCK_M, BLOCK_K) tile's fp32 bit patterns -> (nan_in, e, s, d): input NaNs, the E8M0 scale
    byte of each 1x32 block (int32, (BLOCK_M, BLOCK_K/32)), and, broadcast per element, the exact
    reciprocal scale s and the decode factor d = 2^(e-127) -- exactly the rowwise path of
    ``quantize_triton._mxfp8_quantize_kernel``."""
    abits = xbits & _F32_ABS_MASK
    nan_in = abits > _F32_INF_BITS              # input NaN <=> output NaN (a scale is never NaN)
    abits = tl.where(nan_in, 0, abits)
    NB: tl.constexpr = BLOCK_K // _BLOCK
    amax = tl.max(tl.reshape(abits, (BLOCK_M, NB, _BLOCK)), axis=2)
    e = _e8m0_from_amax_bits(amax, USE_ASM)                                   # (BLOCK_M, NB) int32
    s = tl.reshape(tl.broadcast_to(_scale_reciprocal(e)[:, :, None], (BLOCK_M, NB, _BLOCK)), (BLOCK_M, BLOCK_K))
    d = tl.reshape(tl.broadcast_to(_e8m0_to_f32(e)[:, :, None], (BLOCK_M, NB, _BLOCK)), (BLOCK_M, BLOCK_K))
    return nan_in, e, s, d


@triton.jit
def _grid_codes_f32(x, xbits, s, USE_ASM: tl.constexpr):
    """The E4M3 value of x * s (TE's cast) as fp32, codes not formed on the GPU.  x * s by mul.rn.f32
    (exact power-of-two scaling, no flush of subnormal x), clamp, the hardware cvt.rn.satfinite.e4m3x2.f32
    and back to fp32 (exact): ~16 instructions per element instead of ~32.  NaN and -0.0 are fixed
    on the output (``_out_bits``).  The interpreter takes the shared integer encoder and decode."""
    if USE_ASM:
        y = _mul_f32_exact(x, s, True)
        y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
        c = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        c = _e4m3_to_f32(_encode_e4m3(x, xbits, s, USE_ASM), USE_ASM)
    return c


@triton.jit
def _out_bits(v, xbits, nan_in, OUT_KIND: tl.constexpr, USE_ASM: tl.constexpr):
    """The grid value v (exact fp32) as the output dtype's bit pattern (int32 for fp32, int16 for bf16 /
    fp16, round to nearest even), with the canonical NaN for an input NaN and +0.0 for an input -0.0."""
    neg_zero = xbits == _F32_NEG_ZERO_BITS                                    # exact -0.0 in -> +0.0 out
    if OUT_KIND == 0:        # fp32: the product's bits
        out = tl.where(nan_in, _F32_NAN_BITS, tl.where(neg_zero, 0, v.to(tl.int32, bitcast=True)))
    elif OUT_KIND == 1:      # bf16, round to nearest even (cvt.rn.bf16x2.f32; integer RNE in the interpreter)
        if USE_ASM:
            h = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            h = _f32_bits_to_bf16_bits(v.to(tl.int32, bitcast=True)).to(tl.int16)
        out = tl.where(nan_in, _BF16_NAN_BITS, tl.where(neg_zero, 0, h)).to(tl.int16)
    else:                    # fp16: the IEEE cast (RNE, overflow -> inf)
        h = v.to(tl.float16).to(tl.int16, bitcast=True)
        out = tl.where(nan_in, _FP16_NAN_BITS, tl.where(neg_zero, 0, h)).to(tl.int16)
    return out


def qdq_rows(x: torch.Tensor, out_dtype: Optional[torch.dtype] = None, return_codes: bool = False,
             return_min_scale: bool = False, config=None, out: Optional[torch.Tensor] = None):
    """The exact grid values of ``x`` (..., K) (TE rowwise MXFP8, then exact decode), as ``out_dtype``.

    Equals ``dequantize_blocks(*quantize_rows(x)).to(out_dtype)`` bit for bit (NaN payloads
    canonical).  Returns ``y`` -- or a tuple ``(y, q, s[, min_scale])`` / ``(y, min_scale)``:
    ``q`` float8_e4m3fn (..., K) and ``s`` uint8 (..., K/32) as ``quantize_rows`` returns them;
    ``min_scale`` an int32 device tensor (1,) holding the smallest scale byte of any block
    (255 for an empty x).  Exactness of y per dtype: see the module docstring.
    ``out``: optional preallocated contiguous output of x's shape and ``out_dtype``.
    """
    if x.dtype not in _OUT_KIND:
        raise ValueError(f"qdq_rows takes bf16, fp16 or fp32 input; got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _OUT_KIND:
        raise ValueError(f"qdq_rows writes bf16, fp16 or fp32; got {out_dtype}")
    k = F.check_k(x.shape)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    dev = x.device
    if out is not None:
        if tuple(out.shape) != tuple(x.shape) or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError("qdq_rows: out must be a contiguous tensor of x's shape and out_dtype")
        y = out.view(m, k)
    else:
        y = torch.empty((m, k), dtype=out_dtype, device=dev)
    q = torch.empty((m, k), dtype=torch.uint8, device=dev) if return_codes else None
    s = torch.empty((m, k // F.BLOCK_SIZE), dtype=torch.uint8, device=dev) if return_codes else None
    mn = torch.full((1,), F.E8M0_NAN, dtype=torch.int32, device=dev) if return_min_scale else None
    if m and k:
        bm, bk, warps = config or (QDQ_SMALL_M_CONFIG if m <= 16 else QDQ_CONFIG)
        ybits = y.view(_BITS_VIEW[out_dtype])
        grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
        in_bf16 = x2.dtype == torch.bfloat16
        _qdq_rows_kernel[grid](
            x2.view(torch.int16) if in_bf16 else x2, ybits,
            q if q is not None else ybits, s if s is not None else ybits, mn if mn is not None else ybits,
            m, k, x2.stride(0), y.stride(0), k, k // F.BLOCK_SIZE,
            BLOCK_M=bm, BLOCK_K=bk, IN_BF16=in_bf16, OUT_KIND=_OUT_KIND[out_dtype],
            WRITE_CODES=return_codes, TRACK_MIN=return_min_scale, USE_ASM=not interpreting(), num_warps=warps)
    y = y.reshape(*x.shape[:-1], k)
    out = (y,)
    if return_codes:
        out += (q.view(F.FP8_DTYPE).reshape(x.shape), s.reshape(*x.shape[:-1], k // F.BLOCK_SIZE))
    if return_min_scale:
        out += (mn,)
    return out[0] if len(out) == 1 else out


def qdq_rows_reference(x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The definition qdq_rows must equal: torch-reference quantize, exact fp32 decode, one cast."""
    from ..quantize import quantize_rows
    from ..tensor import dequantize_blocks
    q, s = quantize_rows(x, backend="torch")
    return dequantize_blocks(q, s).to(out_dtype or x.dtype)


def exact_in(out_dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """Per block: are all grid values of a block with scale byte ``scales`` exact in ``out_dtype``?"""
    e = scales.to(torch.int32)
    if out_dtype == torch.float32:
        return torch.ones_like(e, dtype=torch.bool)
    if out_dtype == torch.bfloat16:
        return e >= BF16_EXACT_MIN_SCALE
    if out_dtype == torch.float16:
        return (e >= FP16_EXACT_MIN_SCALE) & (e <= FP16_EXACT_MAX_SCALE)
    raise ValueError(out_dtype)


def grid_weight_bf16(wq: torch.Tensor, ws: torch.Tensor, check: bool = True) -> torch.Tensor:
    """The derived bf16 copy of an on-grid weight (its exact grid values) for :func:`prefill_linear`.

    With ``check`` (a host sync; do it once at load), raises ``ValueError`` when a non-zero block
    has a scale byte < 3 (block amax <= ~1e-35), whose values bf16 cannot hold exactly.
    All-zero blocks (scale byte 0) are exact.
    """
    from ..tensor import dequantize_blocks
    w = dequantize_blocks(wq, ws)
    if check:
        e = ws.to(torch.int32)
        nonzero = (w.reshape(*ws.shape, F.BLOCK_SIZE) != 0).any(-1)
        bad = (e < BF16_EXACT_MIN_SCALE) & nonzero
        if bool(bad.any()):
            raise ValueError(f"{int(bad.sum())} weight blocks have scale byte < {BF16_EXACT_MIN_SCALE}: "
                             "their grid values are not exact in bf16")
    return w.to(torch.bfloat16)


def prefill_linear(x: torch.Tensor, w_grid_bf16: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The grid Linear at prefill sizes: ``qdq_rows(x, bf16) @ W_grid_bf16^T`` on cuBLAS (+ bias).

    Exact operands (bf16 is exact for x blocks with scale byte >= 3, see the module doc), exact
    products, FP32 accumulation in cuBLAS; the result differs from ``mxfp8_linear_reference``
    only by FP32 summation order.  bf16 out without bias: cuBLAS rounds its FP32 result to bf16
    once.  Other cases (bias, fp16/fp32 out) take an FP32 result from ``torch.mm(...,
    out_dtype=float32)`` when this torch has it, add the bias in FP32 and cast once; else
    ``torch.mm`` in bf16 (bias then added in bf16: one more rounding).

    FP32 accumulation in cuBLAS needs ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    = False`` (PyTorch's default True lets cuBLAS reduce split-K partials in bf16); this function
    does not change that global setting -- the engine should set it once.
    """
    out_dtype = out_dtype or x.dtype
    k = x.shape[-1]
    a = qdq_rows(x.reshape(-1, k), torch.bfloat16)
    wt = w_grid_bf16.t()
    if out_dtype == torch.bfloat16 and bias is None:
        y = torch.mm(a, wt)
    else:
        try:
            y = torch.mm(a, wt, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):     # no mm.dtype on this torch/device
            y = torch.mm(a, wt).float()
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.to(out_dtype)
    return y.reshape(*x.shape[:-1], w_grid_bf16.shape[0])
