"""An independent oracle for TE's MXFP8 bytes, written from docs/format.md with numpy and Python ints.

Shares no code with the package: the fp32 multiply is numpy's, the E4M3 rounding is a
nearest-value search over the 127 finite non-negative codes with ties to the even code,
and the scale rule is re-derived with Python integers.  Slow; meant for tests.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np

RCP = np.frombuffer(struct.pack("<I", 0x3B124925), dtype=np.float32)[0]


def f32_bits(v) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def bits_f32(b: int) -> np.float32:
    return np.frombuffer(struct.pack("<I", b & 0xFFFFFFFF), dtype=np.float32)[0]


def e4m3_value(code: int) -> float:
    """Exact value of an E4M3 (fn) byte; NaN for 0x7F/0xFF."""
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * m / 8 * 2.0 ** -6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


POS_CODES = np.arange(0, 0x7F)                    # 0 .. 0x7E (448)
POS_VALUES = np.array([e4m3_value(c) for c in POS_CODES], dtype=np.float64)


def e4m3_rne_satfinite(y: float) -> int:
    """cvt.rn.satfinite.e4m3 of an fp32 value given as a Python float (exact)."""
    if y != y:
        return 0x7F
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a >= 448.0:
        return sign | 0x7E
    i = int(np.searchsorted(POS_VALUES, a))      # POS_VALUES[i-1] < a <= POS_VALUES[i]
    if i < len(POS_VALUES) and POS_VALUES[i] == a:
        return sign | int(POS_CODES[i])
    lo, hi = i - 1, i
    dlo, dhi = Fraction(a) - Fraction(POS_VALUES[lo]), Fraction(POS_VALUES[hi]) - Fraction(a)
    if dlo < dhi:
        c = lo
    elif dhi < dlo:
        c = hi
    else:
        c = lo if lo % 2 == 0 else hi
    return sign | int(POS_CODES[c])


def e8m0(amax: float) -> int:
    """TE's scale byte from a block amax (fp32 value)."""
    v = np.float32(amax) * RCP                    # IEEE fp32 multiply
    b = f32_bits(v)
    E, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    if E == 0xFF:
        return 255 if m else 254
    if v == 0:
        return 0
    if m != 0 and E != 254 and not (E == 0 and m <= 0x400000):
        E += 1
    return E


def reciprocal(e: int) -> float:
    if e == 255:
        return float("nan")
    if e == 254:
        return 2.0 ** -127
    return 2.0 ** (127 - e)


def quantize_block(vals_f32: np.ndarray) -> tuple[list[int], int]:
    """One block of 32 fp32 values (as TE sees them after the cast to fp32)."""
    finite_abs = [abs(float(v)) for v in vals_f32 if not np.isnan(v)]
    amax = max(finite_abs, default=0.0)
    e = e8m0(amax)
    s = reciprocal(e)
    codes = []
    for v in vals_f32:
        v = float(v)
        if v != v:
            codes.append(0x7F)
            continue
        if v == 0.0 and math.copysign(1.0, v) < 0:                       # exact -0.0 input -> 0x00
            codes.append(0x00)
            continue
        y = float(np.float32(v) * np.float32(s)) if s == s else float("nan")
        codes.append(e4m3_rne_satfinite(y))
    return codes, e


def quantize_rowwise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, K) fp32 array -> (uint8 codes (M, K), uint8 scales (M, K/32)), unpadded."""
    m, k = x.shape
    q = np.zeros((m, k), dtype=np.uint8)
    s = np.zeros((m, k // 32), dtype=np.uint8)
    for i in range(m):
        for b in range(k // 32):
            codes, e = quantize_block(x[i, 32 * b: 32 * b + 32])
            q[i, 32 * b: 32 * b + 32] = codes
            s[i, b] = e
    return q, s
