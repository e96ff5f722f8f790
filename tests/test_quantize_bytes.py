"""Bytes of quantize_mxfp8, worked out by hand from docs/format.md, and against an independent oracle.

Every expected byte below is derived in its comment from the per-block algorithm:
  v = amax * RCP (fp32), e = round-up exponent of v, s = 2^(127-e) (2^-127 at e=254),
  q = rne_e4m3(clamp(x*s, +-448)), NaN -> 0x7F, exact -0.0 -> 0x00.
E4M3 reminders: 1.0 = 0x38, 0.5 = 0x30, 256 = 0x78, 224 = 0x76, 448 = 0x7E, sign bit 0x80.
"""

import math
import struct

import numpy as np
import pytest
import torch

from mxfp8_learner_grid.common import quantize_mxfp8, quantize_rows, dequantize_mxfp8

import oracle

INF, NAN = float("inf"), float("nan")


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def one_block(values, dtype):
    """A (32, 32) tensor whose row 0 holds ``values`` (zero-padded to 32), zeros elsewhere."""
    x = torch.zeros(32, 32, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(dtype)


# (name, dtypes, values, expected codes of the first len(codes) elements, expected scale byte)
CASES = [
    # amax 448: v = 448*RCP rounds to exactly 1.0 -> e = 127, s = 1
    ("amax_448", "bf16 fp16 fp32", [448.0, -448.0, 1.0, 0.0, 0.5], [0x7E, 0xFE, 0x38, 0x00, 0x30], 127),
    # bf16 just below 448 (446): v in [0.5, 1) with mantissa -> e = 127, s = 1; 446 rounds to 448
    ("amax_446", "bf16 fp32", [446.0, 1.0], [0x7E, 0x38], 127),
    # bf16 just above 448 (450): v = 1.0045 -> e = 128, s = 1/2; 225 rounds to 224 (step 16)
    ("amax_450", "bf16 fp32", [450.0, 1.0], [0x76, 0x30], 128),
    # fp32 next above 448 (448.00003): v = 0x3F800001 -> e = 128, s = 1/2: 224.000015 -> 224
    ("amax_448_next_fp32", "fp32", [f32(0x43E00001), 1.0], [0x76, 0x30], 128),
    # fp32 next below 448: v rounds to 1.0 -> e = 127, s = 1; 447.99997 rounds to 448
    ("amax_448_prev_fp32", "fp32", [f32(0x43DFFFFF), 1.0], [0x7E, 0x38], 127),
    # 448 * 2: v = 2.0 exactly -> e = 128, s = 1/2 -> 448
    ("amax_896", "bf16 fp16 fp32", [896.0, -2.0], [0x7E, 0xB8], 128),
    # all zeros: amax 0 -> e = 0
    ("zeros", "bf16 fp16 fp32", [0.0, 0.0], [0x00, 0x00], 0),
    # NaN does not move the scale: amax 2 -> v = 2*RCP (E=119, m!=0) -> e = 120, s = 2^7:
    # 2 -> 256 (0x78), -1 -> -128 (0xF0), NaN -> 0x7F
    ("nan_element", "bf16 fp16 fp32", [NAN, 2.0, -1.0], [0x7F, 0x78, 0xF0], 120),
    # all NaN: amax 0 -> e = 0, every element 0x7F
    ("all_nan", "bf16 fp16 fp32", [NAN] * 32, [0x7F] * 32, 0),
    # Inf block: v = Inf -> e = 254, s = 2^-127: +-Inf -> +-448, finite -> signed zero
    ("inf_block", "bf16 fp16 fp32", [INF, 1.0, -INF, -2.0], [0x7E, 0x00, 0xFE, 0x80], 254),
    # negative zero rule: exact -0.0 -> 0x00; -1e-30 underflows and keeps its sign (0x80);
    # amax 1: v = RCP (E=118, m!=0) -> e = 119, s = 2^8: 1 -> 256 (0x78)
    ("negative_zero", "bf16 fp32", [-0.0, 0.0, 1.0, -1e-30], [0x00, 0x00, 0x78, 0x80], 119),
    ("negative_zero_fp16", "fp16", [-0.0, 0.0, 1.0, -1e-7], [0x00, 0x00, 0x78, 0x80], 119),
    # ties to even at s = 1 (amax 448): 1.0625 between 1.0 (0x38) and 1.125 (0x39) -> 0x38;
    # 1.1875 between 0x39 and 1.25 (0x3A) -> 0x3A; subnormal 2^-10 -> 0, 3*2^-10 -> 2^-8 (0x02)
    ("ties_to_even", "bf16 fp16 fp32", [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10],
     [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02], 127),
    # fp16 max 65504: v = 146.2 (E=134, m!=0) -> e = 135, s = 2^-8 -> 255.875 rounds to 256 (0x78)
    ("fp16_max", "fp16 fp32", [65504.0], [0x78], 135),
    # fp32 max-ish 3.4e38: v = 0x7B122A12 (E=246) -> e = 247, s = 2^-120 -> 255.9 -> 256
    ("fp32_huge", "fp32", [3.4e38], [0x78], 247),
    # fp32-subnormal v: amax 2^-118 -> v = 2^-126.8 (subnormal, m > 0x400000) -> e = 1, s = 2^126 -> 256
    ("subnormal_v_e1", "bf16 fp32", [2.0 ** -118, -(2.0 ** -119)], [0x78, 0xF0], 1),
    # amax 2^-119 -> v = 2^-127.8 (subnormal, m <= 0x400000) -> e = 0, s = 2^127 -> 256
    ("subnormal_v_e0", "bf16 fp32", [2.0 ** -119], [0x78], 0),
    # amax = 0x04600001 (just above 448*2^-127): v rounds to 0x00400000 -> e = 0 (exact
    # ceil(log2) would say 1), s = 2^127 -> 448.00003 clamps to 448
    ("te_differs_from_exact_log2", "fp32", [f32(0x04600001)], [0x7E], 0),
    # fp32 subnormal input: amax 2^-140 -> v = 2^-148.8 rounds to 0x00000001 (E=0, m=1) -> e = 0;
    # s = 2^127 -> 2^-13 -> below half the smallest E4M3 subnormal (2^-10) -> 0
    ("fp32_subnormal_input", "fp32", [2.0 ** -140, -(2.0 ** -140)], [0x00, 0x80], 0),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("name,dtypes,values,codes,scale", CASES, ids=[c[0] for c in CASES])
def test_hand_built_block(name, dtypes, values, codes, scale):
    for dn in dtypes.split():
        x = one_block(values, DTYPES[dn])
        q = quantize_mxfp8(x, rowwise=True, columnwise=True)
        got = q.rowwise_data.view(torch.uint8)[0, : len(codes)].tolist()
        assert got == codes, f"{name}/{dn}: rowwise codes {[hex(c) for c in got]}"
        assert q.rowwise_scale_inv[0, 0].item() == scale, f"{name}/{dn}"
        # the same block seen columnwise (transposed input) gives the same bytes
        qt = quantize_mxfp8(x.t().contiguous(), rowwise=False, columnwise=True)
        gotc = qt.columnwise_data.view(torch.uint8)[: len(codes), 0].tolist()
        assert gotc == codes, f"{name}/{dn}: columnwise codes {[hex(c) for c in gotc]}"
        assert qt.columnwise_scale_inv[0, 0].item() == scale
        # and the oracle agrees with the hand-derived bytes
        oq, os_ = oracle.quantize_block(x[0].to(torch.float32).numpy())
        assert oq[: len(codes)] == codes and os_ == scale


def test_oracle_self_check():
    # the oracle's E4M3 table decodes the codes above to the numbers in the comments
    assert [oracle.e4m3_value(c) for c in (0x38, 0x30, 0x78, 0x76, 0x7E, 0x02)] == [1.0, 0.5, 256.0, 224.0, 448.0, 2.0 ** -8]


@pytest.mark.parametrize("shape", [(96, 160), (32, 32), (160, 96), (2, 48, 64), (4, 8, 32), (128, 128), (256, 4096 + 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layout_and_padding(shape, dtype):
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    q = quantize_mxfp8(x, rowwise=True, columnwise=True)
    m, k = math.prod(shape[:-1]), shape[-1]
    assert q.rowwise_data.shape == x.shape and q.rowwise_data.dtype == torch.float8_e4m3fn
    assert q.columnwise_data.shape == x.shape and q.columnwise_data.dtype == torch.float8_e4m3fn
    rs, cs = q.rowwise_scale_inv, q.columnwise_scale_inv
    assert rs.dtype == cs.dtype == torch.uint8
    assert tuple(rs.shape) == (-(-m // 128) * 128, -(-(k // 32) // 4) * 4)
    assert tuple(cs.shape) == (-(-(m // 32) // 4) * 4, -(-k // 128) * 128)
    assert (rs[m:] == 0).all() and (rs[:, k // 32:] == 0).all()
    assert (cs[m // 32:] == 0).all() and (cs[:, k:] == 0).all()
    # rowwise: byte-equal to the oracle
    x2 = x.reshape(m, k).to(torch.float32).numpy()
    kc = min(k, 512)                       # the oracle is slow: the first 16 blocks of 64 rows
    oq, os_ = oracle.quantize_rowwise(x2[:64, :kc])
    assert np.array_equal(q.rowwise_data.view(torch.uint8).reshape(m, k)[:64, :kc].numpy(), oq)
    assert np.array_equal(rs[:min(m, 64), : kc // 32].numpy(), os_)
    # columnwise: the rowwise quantization of the transpose, transposed back
    kr = min(k, 64)
    oqc, osc = oracle.quantize_rowwise(np.ascontiguousarray(x2.T[:kr]))
    assert np.array_equal(q.columnwise_data.view(torch.uint8).reshape(m, k)[:, :kr].numpy(), oqc.T)
    assert np.array_equal(cs[: m // 32, :kr].numpy(), osc.T)


def test_dequantize_exact_and_bounded():
    x = torch.randn(64, 256, dtype=torch.float32) * torch.logspace(-20, 20, 256)
    q = quantize_mxfp8(x, rowwise=True, columnwise=True)
    for col in (False, True):
        d = dequantize_mxfp8(q, columnwise=col)
        assert d.dtype == torch.float32
        # each value is within half an E4M3 ulp (relative 2^-4) of x, or it is a flushed tiny value
        err = (d - x).abs()
        blocks = x.abs().reshape(64, 8, 32).amax(-1, keepdim=True).expand(64, 8, 32).reshape(64, 256) if not col else \
            x.abs().reshape(2, 32, 256).amax(1, keepdim=True).expand(2, 32, 256).reshape(64, 256)
        assert (err <= torch.maximum(x.abs() * 2.0 ** -4, blocks * 2.0 ** -17)).all()


def test_dequantize_inf_and_nan_blocks():
    x = one_block([INF, 1.0, NAN, -INF], torch.float32)
    d = dequantize_mxfp8(quantize_mxfp8(x))
    assert d[0, 0] == INF and d[0, 3] == -INF and d[0, 1] == 0 and math.isnan(d[0, 2])


@pytest.mark.parametrize("shape", [(31, 32), (32, 33), (64,), (3, 5, 32), (32, 48), ()])
def test_rejected_shapes_name_the_shape(shape):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"shape|dims"):
        quantize_mxfp8(x)


def test_rejected_dtype_and_usage():
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        quantize_mxfp8(torch.zeros(32, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="rowwise"):
        quantize_mxfp8(torch.zeros(32, 32), rowwise=False, columnwise=False)


def test_quantize_rows_any_m_matches_te_rows():
    x = torch.randn(7, 3, 96, dtype=torch.bfloat16)
    d, s = quantize_rows(x)
    assert d.shape == x.shape and s.shape == (7, 3, 3) and s.dtype == torch.uint8
    # rows are independent: the same bytes as the TE-shaped tensor they are part of
    padded = torch.cat([x.reshape(21, 96), torch.randn(11, 96, dtype=torch.bfloat16)])
    q = quantize_mxfp8(padded)
    assert torch.equal(d.reshape(21, 96).view(torch.uint8), q.rowwise_data[:21].view(torch.uint8))
    assert torch.equal(s.reshape(21, 3), q.rowwise_scale_inv[:21, :3])
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(torch.zeros(4, 40))


def test_swizzled_option_is_swizzle_of_compact():
    from mxfp8_learner_grid.common import swizzle_scales
    x = torch.randn(96, 160)
    a, b = quantize_mxfp8(x, True, True), quantize_mxfp8(x, True, True, swizzled=True)
    assert b.with_gemm_swizzled_scales and not a.with_gemm_swizzled_scales
    assert torch.equal(b.rowwise_scale_inv, swizzle_scales(a.rowwise_scale_inv))
    assert torch.equal(b.columnwise_scale_inv, swizzle_scales(a.columnwise_scale_inv, columnwise=True))
    assert torch.equal(b.rowwise_scales_unpadded(), a.rowwise_scales_unpadded())
    assert torch.equal(dequantize_mxfp8(a), dequantize_mxfp8(b))
