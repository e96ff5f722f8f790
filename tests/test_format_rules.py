"""The scale and rounding rules of common/format.py over whole input spaces, against tests/oracle.py."""

import struct
from fractions import Fraction

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from mxfp8_learner_grid.common import format as F

import oracle


def e8m0_torch(amax_bits: np.ndarray) -> np.ndarray:
    amax = torch.from_numpy(amax_bits.astype(np.uint32).view(np.int32)).view(torch.float32)
    return F.e8m0_from_amax(amax).numpy()


def e8m0_numpy(amax_bits: np.ndarray) -> np.ndarray:
    """Vectorised oracle: numpy fp32 multiply, then the bit rule written afresh."""
    v = amax_bits.astype(np.uint32).view(np.float32) * oracle.RCP
    b = v.view(np.uint32)
    E, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    up = (m != 0) & (E != 254) & ~((E == 0) & (m <= 0x400000))
    e = E + up
    e = np.where(E == 255, np.where(m != 0, 255, 254), e)
    return e


def exact_e(amax_bits: int) -> int:
    """clamp(ceil(log2(amax / 448)) + 127, 0, 254) in exact rational arithmetic."""
    a = Fraction(struct.unpack("<f", struct.pack("<I", amax_bits))[0])
    if a == 0:
        return 0
    r = a / 448
    n = r.numerator.bit_length() - r.denominator.bit_length()     # 2^n <= r*2 ... adjust
    while Fraction(2) ** n < r:
        n += 1
    while Fraction(2) ** (n - 1) >= r:
        n -= 1
    return max(0, min(254, n + 127))


def neighbourhood(centers_bits, width):
    return np.unique(np.concatenate([np.arange(c - width, c + width + 1) for c in centers_bits]))


def test_e8m0_every_bf16_and_fp16_amax():
    bf16 = (np.arange(0, 0x7F81, dtype=np.uint32) << 16)          # all non-negative bf16 incl. +Inf
    fp16 = torch.arange(0, 0x7C01, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    fp16 = fp16.numpy().view(np.uint32)
    for bits in (bf16, fp16):
        assert np.array_equal(e8m0_torch(bits), e8m0_numpy(bits))


def test_e8m0_near_448_times_powers_of_two_and_subnormals():
    centers = [oracle.f32_bits(448.0 * 2.0 ** k) for k in range(-135, 120)]
    bits = neighbourhood(centers, 64)
    bits = np.concatenate([bits, np.arange(0, 1 << 16), np.arange(0x00400000 - 4096, 0x00400000 + 4096)])
    bits = bits[(bits >= 0) & (bits <= 0x7F800000)].astype(np.uint32)
    assert np.array_equal(e8m0_torch(bits), e8m0_numpy(bits))


def test_e8m0_random_fp32():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800001, size=2_000_000, dtype=np.int64).astype(np.uint32)
    assert np.array_equal(e8m0_torch(bits), e8m0_numpy(bits))


def test_e8m0_differs_from_exact_log2_only_at_0x04600001():
    """docs/format.md: against exact ceil(log2(amax/448)) TE's rule differs at exactly one fp32 value."""
    centers = [oracle.f32_bits(448.0 * 2.0 ** k) for k in range(-140, 120)]
    bits = neighbourhood(centers, 3)
    bits = bits[(bits > 0) & (bits < 0x7F800000)].astype(np.uint32)
    ours = e8m0_torch(bits)
    diffs = [int(b) for b, e in zip(bits, ours) if e != exact_e(int(b))]
    assert diffs == [0x04600001]


def test_e8m0_special_values():
    v = torch.tensor([0.0, float("inf"), float("nan"), 1.0, 2.0 ** -127, 2.0 ** -126], dtype=torch.float32)
    # 0 -> 0; Inf -> 254; NaN -> 255; 1.0 -> 127; 2^-127 (0x00400000, m <= 0x400000) -> 0; 2^-126 -> 1
    assert F.e8m0_round_up(v).tolist() == [0, 254, 255, 127, 0, 1]


def test_scale_reciprocal_and_decode():
    e = torch.arange(0, 256, dtype=torch.int32)
    s = F.scale_reciprocal(e)
    d = F.e8m0_to_float(e)
    for i in range(0, 254):
        assert s[i].item() == 2.0 ** (127 - i)
    assert s[254].item() == 2.0 ** -127 and np.isnan(s[255].item())
    for i in range(1, 255):
        assert d[i].item() == 2.0 ** (i - 127)
    assert d[0].item() == 2.0 ** -127 and np.isnan(d[255].item())


def _e4m3_probe_values():
    """Every E4M3 value, every midpoint between neighbours, and their fp32 neighbours; both signs."""
    vals = oracle.POS_VALUES
    mids = (vals[:-1] + vals[1:]) / 2
    pts = np.concatenate([vals, mids, [448.0 + 16, 464.0, 480.0, 1e30, 2.0 ** -10, 2.0 ** -11, 2.0 ** -140]])
    b = pts.astype(np.float32).view(np.uint32).astype(np.int64)
    b = np.concatenate([b - 1, b, b + 1])
    b = b[(b >= 0) & (b < 0x7F800000)].astype(np.uint32)
    pos = b.view(np.float32)
    return np.concatenate([pos, -pos])


def test_e4m3_cast_rounds_to_nearest_even_and_saturates():
    x = _e4m3_probe_values()
    x = x[x.view(np.uint32) != 0x80000000]           # exact -0.0 follows our rule (test_encode_specials)
    got = F.encode_e4m3(torch.from_numpy(x), torch.tensor(1.0)).numpy()
    want = np.array([oracle.e4m3_rne_satfinite(float(v)) for v in x], dtype=np.uint8)
    assert np.array_equal(got, want)


def test_encode_specials():
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1e-30, 500.0])
    got = F.encode_e4m3(x, torch.tensor(1.0)).tolist()
    # NaN (either sign) -> 0x7F; +-Inf -> +-448; -0.0 -> 0x00 (our rule); underflow keeps sign; 500 -> 448
    assert got == [0x7F, 0x7F, 0x7E, 0xFE, 0x00, 0x00, 0x80, 0x7E]


def test_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    d = F.decode_e4m3(codes).tolist()
    for c in range(256):
        want = oracle.e4m3_value(c)
        assert (np.isnan(want) and np.isnan(d[c])) or d[c] == want


def test_swizzle_offset_formula_small():
    # (i, j) = (0, 0) -> 0; (1, 0) -> 16; (32, 0) -> 4; (0, 1) -> 1; (0, 4) -> 512 with kb = 8
    assert [F.swizzle_offset(i, j, 8) for i, j in ((0, 0), (1, 0), (32, 0), (0, 1), (0, 4), (128, 0))] == \
        [0, 16, 4, 1, 512, 1024]


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 3), k=st.integers(1, 4), dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
       seed=st.integers(0, 2**31 - 1), logscale=st.integers(-140, 100),
       specials=st.lists(st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 448.0, 1e-40]),
                         max_size=4))
def test_random_tensors_against_oracle(m, k, dtype, seed, logscale, specials):
    from mxfp8_learner_grid.common import quantize_mxfp8
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32 * m, 32 * k, generator=g, dtype=torch.float64) * 2.0 ** logscale
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (len(specials),), generator=g)
    for i, v in zip(idx.tolist(), specials):
        flat[i] = v
    x = x.to(dt)
    q = quantize_mxfp8(x, rowwise=True, columnwise=True)
    xf = x.to(torch.float32).numpy()
    oq, os_ = oracle.quantize_rowwise(xf)
    assert np.array_equal(q.rowwise_data.view(torch.uint8).numpy(), oq)
    assert np.array_equal(q.rowwise_scales_unpadded().numpy(), os_)
    oqc, osc = oracle.quantize_rowwise(np.ascontiguousarray(xf.T))
    assert np.array_equal(q.columnwise_data.view(torch.uint8).numpy(), oqc.T)
    assert np.array_equal(q.columnwise_scales_unpadded().numpy(), osc.T)
