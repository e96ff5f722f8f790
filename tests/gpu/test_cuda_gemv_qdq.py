"""The fused qdq kernel and the decode GEMV on the GPU, against common/'s CPU reference.

Skipped without a GPU.  Not yet run on a GPU (written for torch 2.11 + triton 3.6 on an H200).

* qdq: output bits (NaN positions, not payloads), fp8 codes, scales and the min-scale report
  equal the CPU torch reference, for bf16/fp16/fp32 inputs, every output dtype, random inputs
  over a wide range with specials, the hand-derived hard blocks of test_quantize_bytes, amax at
  and one ulp around 448 * 2^j, tiny scale bytes, zero/NaN/Inf blocks, every E4M3 rounding
  boundary, and random bit patterns.
* GEMV: every named config family (auto, chunk, deq, chunk_n64) with the chooser's split-K,
  plus forced odd configs (split 3, BLOCK_M 32, BLOCK_N 32/128, 8 warps, the SWAP form), on
  fresh random data (seed printed), M in {1, 4, 16, 33, 64}, Qwen3-8B and Qwen3-30B-A3B shapes
  and an odd shape (N = 1000, K = 2080: masked N, byte scales, masked K).
  Bound: see tests/test_triton_gemv_qdq.py; on tensor cores u = 2^-23 (truncating adds).
  Also: relative error < 2e-6 in fp32 (as tests/gpu/test_cuda_gemm.py), bit-identical reruns
  (the in-kernel split-K reduction is ordered), counters re-armed, CUDA-graph capture.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_triton_gemv_qdq import (counters_zero, exact_linear, gemv_bound, hard_rows,  # noqa: E402
                                     random_input, same_bits)

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows  # noqa: E402
from mxfp8_learner_grid.common.linear import mxfp8_linear_reference  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OUTS = [None, torch.bfloat16, torch.float32, torch.float16]
TC_U = 2.0 ** -23


def poison(nbytes=1 << 28):
    # leave NaN garbage in the caching allocator: an unwritten output shows up
    t = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del t


def fresh_seed():
    s = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    print("seed", s)
    return s


def _check_qdq(x):
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    q_ref, s_ref = quantize_rows(x, backend="torch")
    vals = dequantize_blocks(q_ref, s_ref)
    xc = x.cuda()
    for od in OUTS:
        want = vals.to(od or x.dtype)
        poison()
        y, q, s, mn = qdq_rows(xc, od, return_codes=True, return_min_scale=True)
        assert same_bits(y.cpu(), want), (od, "values")
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (od, "codes")
        assert torch.equal(s.cpu(), s_ref), (od, "scales")
        assert int(mn.item()) == int(s_ref.min()), (od, "min scale")
        poison()
        assert same_bits(qdq_rows(xc, od).cpu(), want), (od, "values, plain call")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (7, 2048), (333, 4096), (2048, 4096), (3, 64, 320), (4096, 96)])
def test_qdq_cpu_cuda_same_bits(dtype, shape):
    _check_qdq(random_input(shape, dtype, seed=sum(shape) + len(str(dtype))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qdq_hard_blocks(dtype):
    _check_qdq(hard_rows(dtype))
    _check_qdq(hard_rows(dtype, k=128))


def test_qdq_random_bit_patterns():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2048, 2048), generator=g, dtype=torch.int64).to(torch.int32)
    _check_qdq(bits.view(torch.float32))
    b16 = torch.randint(-2 ** 15, 2 ** 15 - 1, (1024, 1024), generator=g, dtype=torch.int64).to(torch.int16)
    _check_qdq(b16.view(torch.bfloat16))
    _check_qdq(b16.view(torch.float16))


@pytest.fixture
def fp32_reductions():
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old


def test_prefill_linear_bound(fp32_reductions):
    from mxfp8_learner_grid.common.kernels.qdq_triton import grid_weight_bf16, prefill_linear
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    for m, n, k, has_bias in ((256, 6144, 4096, False), (100, 1000, 2080, True), (2048, 4096, 4096, False)):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) if has_bias else None
        wq, ws = quantize_rows(w)
        xq, xs = quantize_rows(x)
        exact, sabs = exact_linear(xq, xs, wq, ws, b)
        wg = grid_weight_bf16(wq, ws)
        poison()
        y = prefill_linear(x, wg, b)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        # cuBLAS: any order, possibly split-K; safe bound K additions with truncation + bf16 output
        nb = (k + 2) * TC_U * sabs
        tol = nb + 2.0 ** -8 * (exact.abs() + nb)
        if b is not None:      # without torch.mm(out_dtype=fp32) the product is rounded to bf16 once more
            tol = tol + 2.0 ** -8 * ((exact - b.double()).abs() + nb)
        assert ((y.double() - exact).abs() <= tol).all()


SHAPES = {"8b.qkv": (6144, 4096), "8b.down": (4096, 12288), "30b.qkv": (5120, 2048), "30b.o": (2048, 4096),
          "odd": (1000, 2080)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 16, 33, 64])
def test_gemv_matches_reference(shape, m):
    from mxfp8_learner_grid.common.kernels.gemv_triton import NAMED, choose_config, grid_gemv
    n, k = SHAPES[shape]
    has_bias = shape in ("30b.qkv", "odd")
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) if has_bias else None
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    exact, sabs = exact_linear(xq, xs, wq, ws, b)
    cfgs = []
    for name in NAMED:
        if choose_config(m, n, k, name) not in cfgs:
            cfgs.append(choose_config(m, n, k, name))
    for i, cfg in enumerate(cfgs):
        name = cfg.variant
        outs = (torch.bfloat16, torch.float32) if i == 0 else (torch.bfloat16,)
        for od in outs:
            poison()
            y = grid_gemv(xq, xs, wq, ws, b, od, cfg)
            assert y.dtype == od and y.shape == (m, n)
            assert torch.isfinite(y).all(), (name, od, cfg)
            err = (y.double() - exact).abs()
            bound = gemv_bound(sabs, exact, k, cfg.split_k, u=TC_U, out_dtype=od)
            assert (err <= bound).all(), (name, od, cfg, float((err / bound).max()))
            if od == torch.float32:
                assert ((y.double() - exact).norm() / exact.norm()).item() < 2e-6
            y2 = grid_gemv(xq, xs, wq, ws, b, od, cfg)
            assert torch.equal(y, y2), ("not deterministic", name, cfg)
    torch.cuda.synchronize()
    assert counters_zero()
    if m == 16:
        # the project's definition on the CPU, end to end (it quantizes x itself)
        y = grid_gemv(xq, xs, wq, ws, b, torch.bfloat16)
        ref = mxfp8_linear_reference(x.cpu(), wq.cpu(), ws.cpu(), None if b is None else b.cpu())
        tol = 2 * gemv_bound(sabs, exact, k, 16, u=TC_U, out_dtype=torch.bfloat16) + k * 2.0 ** -24 * sabs
        assert ((y.cpu().double() - ref.double()).abs() <= tol.cpu()).all()


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("variant", ["chunk", "deq"])
@pytest.mark.parametrize("split", [1, 3, 8])
def test_gemv_forced_configs(variant, split, swap):
    """Configs the chooser may not pick: odd split counts, BLOCK_M 32, BLOCK_N 32 / 128, 8 warps, SWAP."""
    from mxfp8_learner_grid.common.kernels.gemv_triton import GemvConfig, grid_gemv
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    shapes = (((20, 3072, 4096), (32, 32, 4, 3)), ((2, 1000, 2080), (16, 128, 8, 4)))
    if swap:       # the weight tile is the MMA's M side: BLOCK_N 64 / 128
        shapes = (((20, 3072, 4096), (32, 64, 4, 3)), ((2, 1000, 2080), (16, 128, 4, 4)))
    for (m, n, k), (bm, bn, warps, stages) in shapes:
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float16) * 0.02
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.float32)
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)
        exact, sabs = exact_linear(xq, xs, wq, ws, b)
        cfg = GemvConfig(variant, bm, bn, 4, split, warps, stages, swap)
        poison()
        y = grid_gemv(xq, xs, wq, ws, b, torch.float16, cfg)
        assert torch.isfinite(y).all()
        assert ((y.double() - exact).abs() <= gemv_bound(sabs, exact, k, split, TC_U, torch.float16)).all()
    torch.cuda.synchronize()
    assert counters_zero()


def test_gemv_wide_scale_range():
    """Per-block magnitudes from 2^-60 to 2^60 on both operands: the scale epilogue stays exact."""
    from mxfp8_learner_grid.common.kernels.gemv_triton import NAMED, choose_config, grid_gemv
    m, n, k = 8, 512, 4096
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    ramp = torch.logspace(-18, 18, k // 32, device="cuda").repeat_interleave(32)
    x = torch.randn(m, k, device="cuda", generator=g) * ramp
    w = torch.randn(n, k, device="cuda", generator=g) * ramp.flip(0)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    exact, sabs = exact_linear(xq, xs, wq, ws, None)
    for name in NAMED[1:]:
        cfg = choose_config(m, n, k, name)
        y = grid_gemv(xq, xs, wq, ws, None, torch.float32, cfg)
        assert ((y.double() - exact).abs() <= gemv_bound(sabs, exact, k, cfg.split_k, TC_U)).all(), name


def test_gemv_and_qdq_capture_in_cuda_graph():
    from mxfp8_learner_grid.common.kernels.gemv_triton import GemvConfig, grid_gemv
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_rows(torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    cfg = GemvConfig("chunk", 16, 64, 4, 4, 4, 5)

    def f():
        xq, xs = quantize_rows(x, backend="triton")
        return grid_gemv(xq, xs, wq, ws, None, torch.bfloat16, cfg), qdq_rows(x, torch.bfloat16)

    eager = f()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        fresh = f()
        torch.cuda.synchronize()
        assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    assert not torch.equal(out[0], eager[0])
    assert counters_zero()
