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
E4M3_SIGN_MASK = 0x80                 #: sign bit of an E4M3 code (0x80 | c is -c; 0x80 itself is -0)
E4M3_MAN_BITS = 3                     #: mantissa width of E4M3
E4M3_MAN_MASK = 0x7                   #: mantissa field of a code
E4M3_EXP_MASK = 0xF                   #: exponent field of a code (after >> E4M3_MAN_BITS)
E4M3_BIAS = 7                         #: exponent bias of E4M3: normals are 2^(ex-7) * 1.m
E4M3_MIN_NORMAL_EXP = 1 - E4M3_BIAS   #: 2^-6, the smallest normal E4M3 magnitude
E4M3_SUBNORMAL_UNIT = 2.0 ** -9       #: value of the lowest mantissa bit of a subnormal (ex == 0)
FP8_DTYPE = torch.float8_e4m3fn

# --- fp32 bit fields the rules are written in (an E8M0 byte is an fp32 exponent field) --
F32_MAN_BITS = 23                     #: fp32 mantissa width: scale byte e sits at e << 23
F32_MAN_MASK = (1 << F32_MAN_BITS) - 1  #: fp32 mantissa field
F32_EXP_MASK = 0xFF                   #: fp32 exponent field (after >> 23); all ones: Inf / NaN
F32_BIAS = 127                        #: fp32 exponent bias (equal to E8M0_BIAS by design)
F32_ABS_MASK = 0x7FFFFFFF             #: fp32 bits without the sign
F32_INF_BITS = 0x7F800000             #: fp32 +Inf; |x| bits above it are NaN
F32_NEG_ZERO_BITS = -(1 << 31)        #: fp32 -0.0 (0x80000000) as a signed int32
#: the one fp32 NaN this project writes: what E8M0 byte 255 decodes to, everywhere (kernels
#: included), and the NaN the kernels write to fp32 outputs (the canonical quiet NaN)
F32_NAN_BITS = 0x7FC00000
BF16_NAN_BITS = F32_NAN_BITS >> 16    #: the bf16 NaN the kernels write (0x7FC0: the top half of F32_NAN_BITS)
FP16_NAN_BITS = 0x7E00                #: the fp16 NaN the kernels write (canonical quiet NaN)

# --- scale format (E8M0: a biased power-of-two exponent, no sign, no mantissa) ----
E8M0_BIAS = 127                       #: scale byte e means 2^(e - 127); byte 127 is 1.0
E8M0_NAN = 255                        #: only reachable from a NaN v (never from TE's amax); decodes to NaN
E8M0_MAX = 254                        #: largest non-NaN scale byte: float_to_e8m0 saturates here
E8M0_BYTE_MASK = 0xFF                 #: one 8-bit scale byte (e.g. of an int32 word of 4 scales)
E8M0_INF_BLOCK = E8M0_MAX             #: a block that holds +-Inf
#: fp32 bits of 2^-127 (an fp32 subnormal): the value of scale byte 0, the reciprocal of
#: byte 254, and the largest v that rounds up to byte 0
E8M0_MIN_BITS = 0x00400000
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
SWIZZLE_TILE_ROWS = 128               #: rows of a swizzle tile
SWIZZLE_TILE_COLS = 4                 #: scale columns of a swizzle tile
SWIZZLE_TILE_BYTES = 512              #: bytes of a tile (128 x 4)
SWIZZLE_SUB_ROWS = 32                 #: a tile's rows interleave as 4 groups of 32: row i % 32 is the 16-byte line
SWIZZLE_LINE_BYTES = SWIZZLE_TILE_BYTES // SWIZZLE_SUB_ROWS   #: 16 bytes: one row of each group, 4 scales each


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
    bits = x.to(torch.float32).view(torch.int32) & F32_ABS_MASK
    return torch.where(bits > F32_INF_BITS, torch.zeros_like(bits), bits)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """TE ``ptx::float_to_e8m0`` (software path, = ``cvt.rp.satfinite.ue8m0x2.f32``).

    ``v`` is a non-negative fp32 tensor (amax * RCP); returns int32 biased exponents:
    NaN -> 255, Inf -> 254, 0 -> 0, else the fp32 exponent field rounded up when the
    mantissa is non-zero, except at 254 (saturate) and for subnormal v <= 2^-127.
    """
    bits = v.view(torch.int32)
    exp = (bits >> F32_MAN_BITS) & F32_EXP_MASK
    man = bits & F32_MAN_MASK
    up = (man != 0) & (exp != E8M0_MAX) & ~((exp == 0) & (man <= E8M0_MIN_BITS))
    e = exp + up.to(torch.int32)
    e = torch.where(exp == F32_EXP_MASK, torch.where(man != 0, E8M0_NAN, E8M0_INF_BLOCK), e)
    return e


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Scale exponent of a block from its amax (fp32 tensor): e8m0_round_up(amax * RCP)."""
    rcp = torch.tensor(RCP_E4M3, dtype=torch.float32, device=amax.device)
    return e8m0_round_up(amax.to(torch.float32) * rcp)


def scale_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """TE ``ptx::exp2f_rcp<float>``: the fp32 factor that maps a block into E4M3 range.

    255 -> NaN (``F32_NAN_BITS``; unreachable: the quantizer never makes byte 255),
    254 -> 2^-127 (fp32 subnormal 0x00400000), else 2^(127 - e) built from the exponent
    field ((254 - e) << 23); e == 0 gives 2^127.
    """
    e = e.to(torch.int32)
    bits = (2 * E8M0_BIAS - e) << F32_MAN_BITS
    bits = torch.where(e == E8M0_INF_BLOCK, E8M0_MIN_BITS, bits)
    bits = torch.where(e == E8M0_NAN, F32_NAN_BITS, bits)
    return bits.view(torch.float32)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to fp32 powers of two: 2^(e-127); 0 -> 2^-127 (subnormal); 255 -> NaN.

    This is the decode every kernel follows; byte 255 is the NaN ``F32_NAN_BITS``.
    """
    e = e.to(torch.int32)
    bits = e << F32_MAN_BITS
    bits = torch.where(e == 0, E8M0_MIN_BITS, bits)
    bits = torch.where(e == E8M0_NAN, F32_NAN_BITS, bits)
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
    neg_zero = xf.view(torch.int32) == F32_NEG_ZERO_BITS                 # bits 0x80000000
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
    return (tile * SWIZZLE_TILE_BYTES + (i % SWIZZLE_SUB_ROWS) * SWIZZLE_LINE_BYTES
            + ((i % SWIZZLE_TILE_ROWS) // SWIZZLE_SUB_ROWS) * SWIZZLE_TILE_COLS + j % SWIZZLE_TILE_COLS)
