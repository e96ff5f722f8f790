"""The decode GEMV that quantizes x inside its own launch (``gemv_triton.grid_gemv_rows``), on the GPU.

Its codes and scales come from the rowwise quantizer's own jit functions, so its result must be the
same bits as ``quantize_rows_triton`` + ``grid_gemv`` with the same config (whose exactness -- the
exact sum rounded once, within the FP32 bound -- tests/gpu/test_cuda_gemv_qdq.py and
test_fast_path.py::test_gemv_band_exact check), for every config family, with split-K, on hard rows
(NaN / Inf / -0 / tiny scale bytes / E4M3 midpoints) and random rows; under a CUDA graph too.
A negative control (one x scale byte off) shows the comparison can fail.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_triton_gemv_qdq import hard_rows, random_input, same_bits  # noqa: E402

from mxfp8_learner_grid.common import quantize_rows  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (2048, 4096), (1000, 2080)]


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    wq, ws = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    return wq.cuda(), ws.cuda()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantize_same_bits_as_two_launches(n, k, m, dtype):
    from mxfp8_learner_grid.common.kernels.gemv_triton import choose_config, grid_gemv, grid_gemv_rows
    from mxfp8_learner_grid.common.kernels.quantize_triton import quantize_rows_triton
    wq, ws = _weights(n, k, n + k + m)
    x = random_input((m, k), dtype, seed=m * 7 + n).cuda()
    for cfg in ("auto", "chunk", "deq", choose_config(m, n, k, "auto")):
        fused = grid_gemv_rows(x, wq, ws, None, torch.bfloat16, config=cfg)
        two = grid_gemv(*quantize_rows_triton(x), wq, ws, None, torch.bfloat16, config=cfg)
        assert same_bits(fused, two), (n, k, m, dtype, cfg)
        rerun = grid_gemv_rows(x, wq, ws, None, torch.bfloat16, config=cfg)
        assert torch.equal(rerun.view(torch.int16), fused.view(torch.int16))      # deterministic: same bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantize_hard_rows_and_negative_control(dtype):
    from mxfp8_learner_grid.common.kernels.gemv_triton import grid_gemv, grid_gemv_rows
    from mxfp8_learner_grid.common.kernels.quantize_triton import quantize_rows_triton
    hard = hard_rows(dtype, k=256).cuda()
    wq, ws = _weights(512, 256, 1)
    for lo in range(0, hard.shape[0], 16):
        x = hard[lo:lo + 16]
        xq, xs = quantize_rows_triton(x)
        rq, rs = quantize_rows(x.cpu())
        assert torch.equal(xq.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs.cpu(), rs)
        for out in (torch.bfloat16, torch.float32):
            assert same_bits(grid_gemv_rows(x, wq, ws, None, out, config="auto"),
                             grid_gemv(xq, xs, wq, ws, None, out, config="auto")), (lo, out)
    x = random_input((4, 256), dtype, seed=5, specials=False).cuda()
    xq, xs = quantize_rows_triton(x)
    xs[-1, -1] += 1
    assert not same_bits(grid_gemv_rows(x, wq, ws, None, torch.float32, config="auto"),
                         grid_gemv(xq, xs, wq, ws, None, torch.float32, config="auto"))


def test_fused_quantize_under_a_cuda_graph():
    from mxfp8_learner_grid.common.kernels.gemv_triton import grid_gemv, grid_gemv_rows
    from mxfp8_learner_grid.common.kernels.quantize_triton import quantize_rows_triton
    wq, ws = _weights(6144, 4096, 2)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(3, 6144, device="cuda", dtype=torch.bfloat16)
    grid_gemv_rows(x, wq, ws, None, torch.bfloat16, config="auto", out=out)        # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        grid_gemv_rows(x, wq, ws, None, torch.bfloat16, config="auto", out=out)
    for seed in range(3):
        x.copy_(torch.randn(3, 4096, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        g.replay()
        want = grid_gemv(*quantize_rows_triton(x), wq, ws, None, torch.bfloat16, config="auto")
        assert same_bits(out, want), seed


@pytest.mark.parametrize("t,topk,e_glob,ep", [(1, 8, 128, False), (2, 8, 128, True), (16, 8, 128, False),
                                              (3, 4, 64, True)])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])        # Qwen3-30B-A3B gate_up, down
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_gemv_quantizes_in_the_kernel_as_two_launches(t, topk, e_glob, ep, n, k, dtype):
    """moe_gemv with xs=None (each slot's row quantized inside the kernel) = quantize_rows_triton first."""
    from mxfp8_learner_grid.common.kernels.moe_gemv_triton import moe_gemv
    from mxfp8_learner_grid.common.kernels.quantize_triton import quantize_rows_triton
    e_loc = e_glob // 2 if ep else e_glob
    g = torch.Generator().manual_seed(t + n)
    wq, ws = quantize_rows(torch.randn(e_loc, n, k, generator=g) * 0.05)
    wq, ws = wq.cuda(), ws.cuda()
    x = random_input((t, k), dtype, seed=t * 3 + n).cuda()
    ids = torch.stack([torch.randperm(e_glob, generator=g)[:topk] for _ in range(t)]).to("cuda", torch.int32)
    emap = None
    if ep:
        emap = torch.full((e_glob,), -1, dtype=torch.int32, device="cuda")
        emap[e_loc:] = torch.arange(e_loc, dtype=torch.int32, device="cuda")
    fused = moe_gemv(x, None, None, wq, ws, ids, topk=topk, expert_map=emap)
    two = moe_gemv(*quantize_rows_triton(x), None, wq, ws, ids, topk=topk, expert_map=emap)
    assert same_bits(fused, two), (t, topk, ep, n, k, dtype)
