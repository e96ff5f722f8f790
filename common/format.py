"""The learner's grid, rule by rule: every constant and scale rule of TE's MXFP8 in one place.

This module is the specification in code.  It follows Transformer Engine's MXFP8 cast
(``transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh`` and ``util/ptx.cuh``,
TE 2.19 - 2.20) as written down in ``docs/format.md``; nothing else in the project
computes a scale, a padded shape or a swizzled offset on its own.

Per block of 32 values (rowwise: 1x32 along K; columnwise: 32x1 along M)::

    amax = max(|x_i|) over the non-NaN x_i, starting from 0        (exact)
    v    = fp32(amax) * RCP          RCP = fp32 0x3B124925 = (float)(1/448), IEEE multiply
    e    = e8m0_round_up(v)          TE's ptx::float_to_e8m0
    s    = scale_reciprocal(e)       TE's ptx::exp2f_rcp<float>
    q_i  = e4m3_rn_satfinite(fp32(x_i) * s)   NaN -> 0x7F, +-Inf/overflow -> +-448
    scale byte = e                   block value = e4m3(q_i) * 2^(e - 127)

Negative zero (TE is not consistent; this is our one rule): an input that is exactly
-0.0 encodes as 0x00, as TE's specialized bf16/fp16 kernels do with ``fma(x, s, +0)`` --
the kernels that quantize Linear weights and activations in training.  Every other
value keeps its sign, so a negative value that underflows encodes as 0x80, which is
what ``fma(x, s, +0)`` gives too.  Both bytes decode to zero.
"""

from __future__ import annotations

import struct

import torch

# --- element format (E4M3, "fn": no infinities, one NaN code per sign) -------------
BLOCK_SIZE = 32                       #: values per scale, along the quantized dimension
E4M3_MAX = 448.0                      #: largest finite E4M3 magnitude
E4M3_NAN_BYTE = 0x7F                  #: TE's NaN code (sign dropped); torch writes 0xFF for -NaN
E4M3_MAX_BYTE = 0x7E                  #: +448 (satfinite target for +overflow and +Inf)
FP8_DTYPE = torch.float8_e4m3fn

# --- scale format (E8M0: a biased power-of-two exponent, no sign, no mantissa) ----
E8M0_BIAS = 127
E8M0_NAN = 255                        #: only reachable from a NaN v (never from TE's amax)
E8M0_INF_BLOCK = 254                  #: a block that holds +-Inf
SCALE_DTYPE = torch.uint8
#: fp32 bits of (float)(1.0 / 448): TE's Quantized_Limits<fp8e4m3>::max_norm_rcp
RCP_E4M3_BITS = 0x3B124925
RCP_E4M3 = struct.unpack("<f", struct.pack("<I", RCP_E4M3_BITS))[0]

# --- compact scale layouts (TE allocates these padded shapes) ----------------------
ROWWISE_ROW_ALIGN = 128               #: rowwise scales: rows padded to a multiple of 128
ROWWISE_COL_ALIGN = 4                 #:                 K/32 padded to a multiple of 4
COLWISE_ROW_ALIGN = 4                 #: columnwise:     M/32 padded to a multiple of 4
COLWISE_COL_ALIGN = 128               #:                 K padded to a multiple of 128
SCALE_PAD_BYTE = 0x00                 #: what this project writes into padding (TE leaves it uninitialised)

# --- GEMM-swizzled layout (TE swizzle.cuh, cuBLASLt's 128x4 tiles) -----------------
SWIZZLE_TILE_ROWS = 128
SWIZZLE_TILE_COLS = 4
SWIZZLE_TILE_BYTES = 512


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def rowwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    """Padded compact rowwise scale shape of an (m, k) tensor: (round_up(m,128), round_up(k/32,4))."""
    return (round_up(m, ROWWISE_ROW_ALIGN), round_up(k // BLOCK_SIZE, ROWWISE_COL_ALIGN))


def columnwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    """Padded compact columnwise scale shape of an (m, k) tensor: (round_up(m/32,4), round_up(k,128))."""
    return (round_up(m // BLOCK_SIZE, COLWISE_ROW_ALIGN), round_up(k, COLWISE_COL_ALIGN))


def check_te_shape(shape) -> tuple[int, int]:
    """Flatten (..., K) to (M, K) exactly as TE does, refusing what TE refuses.

    TE's MXFP8 quantizer needs at least two dimensions and M, K multiples of 32.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(
            f"MXFP8 needs a tensor of at least 2 dims (..., K); got shape {shape}")
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    if m % BLOCK_SIZE or k % BLOCK_SIZE:
        raise ValueError(
            f"MXFP8 (as Transformer Engine) needs M and K to be multiples of {BLOCK_SIZE}; "
            f"shape {shape} flattens to M={m}, K={k}")
    return m, k


def check_k(shape) -> int:
    """Rowwise-only quantization (activations at inference) needs only K % 32 == 0."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1 or shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"rowwise MXFP8 needs the last dim to be a multiple of {BLOCK_SIZE}; got shape {shape}")
    return shape[-1]


# --- the scale rules, as tensor functions (CPU or CUDA, any shape) ------------------

def abs_bits_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """int32 bit pattern of |x| in fp32, with NaN mapped to +0.

    For non-negative floats the integer order of the bit patterns is the numeric
    order, so an integer max over these gives amax exactly, with no float arithmetic
    (nothing a flush-to-zero mode or a NaN-propagating max could change).
    """
    bits = x.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    return torch.where(bits > 0x7F800000, torch.zeros_like(bits), bits)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """TE ``ptx::float_to_e8m0`` (software path, = ``cvt.rp.satfinite.ue8m0x2.f32``).

    ``v`` is a non-negative fp32 tensor (amax * RCP); returns int32 biased exponents:
    NaN -> 255, Inf -> 254, 0 -> 0, else the fp32 exponent field rounded up when the
    mantissa is non-zero, except at 254 (saturate) and for subnormal v <= 2^-127.
    """
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    up = (man != 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    e = exp + up.to(torch.int32)
    e = torch.where(exp == 0xFF, torch.where(man != 0, E8M0_NAN, E8M0_INF_BLOCK), e)
    return e


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Scale exponent of a block from its amax (fp32 tensor): e8m0_round_up(amax * RCP)."""
    rcp = torch.tensor(RCP_E4M3, dtype=torch.float32, device=amax.device)
    return e8m0_round_up(amax.to(torch.float32) * rcp)


def scale_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """TE ``ptx::exp2f_rcp<float>``: the fp32 factor that maps a block into E4M3 range.

    255 -> NaN, 254 -> 2^-127 (fp32 subnormal 0x00400000), else 2^(127 - e)
    built from the exponent field ((254 - e) << 23); e == 0 gives 2^127.
    """
    e = e.to(torch.int32)
    bits = (254 - e) << 23
    bits = torch.where(e == E8M0_INF_BLOCK, 0x00400000, bits)
    bits = torch.where(e == E8M0_NAN, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to fp32 powers of two: 2^(e-127); 0 -> 2^-127 (subnormal); 255 -> NaN."""
    e = e.to(torch.int32)
    bits = e << 23
    bits = torch.where(e == 0, 0x00400000, bits)
    bits = torch.where(e == E8M0_NAN, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def encode_e4m3(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q = e4m3_rn_satfinite(fp32(x) * s) as TE's cast writes it, with our -0 rule; uint8 out.

    ``s`` broadcasts against ``x`` (a power of two per block).  The product is exact
    except where it falls into fp32 subnormals, which round to a signed zero in E4M3
    either way.  torch's float8 cast is round-to-nearest-even; clamping first gives
    satfinite (an unclamped 464 would become NaN); NaN is forced to 0x7F (torch keeps
    the sign as 0xFF); exact -0.0 inputs become 0x00 (the module's negative-zero rule).
    """
    xf = x.to(torch.float32)
    q = (xf * s).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(torch.uint8)
    q = torch.where(torch.isnan(xf), torch.full_like(q, E4M3_NAN_BYTE), q)
    neg_zero = xf.view(torch.int32) == torch.iinfo(torch.int32).min     # bits 0x80000000
    return torch.where(neg_zero, torch.zeros_like(q), q)


def decode_e4m3(q: torch.Tensor) -> torch.Tensor:
    """Exact fp32 values of E4M3 bytes (uint8 or float8_e4m3fn)."""
    if q.dtype == torch.uint8:
        q = q.view(FP8_DTYPE)
    return q.to(torch.float32)


def swizzle_offset(i, j, kb: int):
    """Flat byte offset of element (i, j) of a padded compact scale matrix with ``kb`` columns
    in TE's GEMM-swizzled layout (swizzle.cuh; cuBLASLt 128x4 tiles, 512 bytes each)::

        off = ((i//128)*(kb//4) + j//4)*512 + (i%32)*16 + ((i%128)//32)*4 + j%4

    Works on ints and on integer tensors.
    """
    tile = (i // SWIZZLE_TILE_ROWS) * (kb // SWIZZLE_TILE_COLS) + j // SWIZZLE_TILE_COLS
    return tile * SWIZZLE_TILE_BYTES + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
