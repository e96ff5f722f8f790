"""The Triton GEMMs against common/'s reference on the GPU (fresh inputs each run, poisoned outputs).

Skipped without a GPU.  Last run on an H200 (device kind nvidia-h200-x2, GPU 0, torch 2.11 +
triton 3.6) on 2026-11-30: 13 passed (BENCHMARKS.md, "GPU test runs").
Tolerance: both sides take exactly the same dequantized operands; only the FP32
summation order differs (tensor-core tiles vs. one matmul), so outputs computed in FP32
agree to ~1e-6 relative.  BF16 outputs differ by at most one BF16 rounding.
"""

import pytest
import torch

pytest.importorskip("triton")     # the kernels import Triton: without it, skip (never abort collection)

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows  # noqa: E402
from mxfp8_learner_grid.common import ops  # noqa: E402
from mxfp8_learner_grid.common.kernels.gemm_triton import grid_gemm, moe_align  # noqa: E402

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def poison():
    t = torch.full((1 << 26,), float("nan"), dtype=torch.float32, device="cuda")
    del t


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 1024, 4096), (16, 12288, 4096), (64, 4096, 12288),
                                   (333, 2048, 768), (2048, 4096, 4096), (4096, 768, 2048)])
def test_dense_gemm_matches_reference(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * 31 + n)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    wq, ws = quantize_rows(w)
    xq, xs = quantize_rows(x)
    exact = dequantize_blocks(xq, xs).double() @ dequantize_blocks(wq, ws).double().t() + b.double()
    poison()
    y32 = grid_gemm(xq, xs, wq, ws, b, torch.float32)
    assert torch.isfinite(y32).all()
    assert rel(y32, exact) < 2e-6
    poison()
    y = torch.ops.mxfp8_learner_grid.linear(x, wq, ws, b)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert rel(y, exact) < 4e-3
    # and against the CPU reference path end to end (quantize + matmul)
    ref = ops.mxfp8_linear_reference(x.cpu(), wq.cpu(), ws.cpu(), b.cpu())
    assert (y.cpu().float() - ref.float()).abs().max().item() <= ref.float().abs().max().item() * 2 ** -7


@pytest.mark.parametrize("t,e,topk,h,i", [(1, 128, 8, 2048, 768), (5, 16, 4, 320, 128), (64, 128, 8, 2048, 768),
                                           (700, 32, 4, 1024, 256)])
def test_moe_matches_reference(t, e, topk, h, i):
    g = torch.Generator(device="cuda").manual_seed(t + e)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    q13, s13 = quantize_rows(w13)
    q2, s2 = quantize_rows(w2)
    logits = torch.randn(t, e, device="cuda", generator=g)
    tw, ids = torch.topk(torch.softmax(logits, -1), topk)
    poison()
    out = ops.moe_triton(x, q13, s13, q2, s2, tw, ids)
    ref = ops.moe_reference(x, q13, s13, q2, s2, tw, ids)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-2          # the gate/up output is rounded to bf16 on both sides
    # expert parallel: half of the experts on this rank
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[: e // 2] = torch.arange(e // 2, dtype=torch.int32, device="cuda")
    loc = ops.local_expert_ids(ids, emap)
    out2 = ops.moe_triton(x, q13[: e // 2], s13[: e // 2], q2[: e // 2], s2[: e // 2], tw, loc)
    ref2 = ops.moe_reference(x, q13[: e // 2], s13[: e // 2], q2[: e // 2], s2[: e // 2], tw, loc)
    assert torch.isfinite(out2).all() and rel(out2, ref2) < 1e-2


def test_moe_align_is_a_partition():
    ids = torch.randint(0, 128, (333, 8), device="cuda", dtype=torch.int32)
    ids[5, 3] = -1
    sorted_ids, block_expert = moe_align(ids, 128, 16)
    flat = ids.reshape(-1).cpu()
    s = sorted_ids.cpu().reshape(-1, 16)
    be = block_expert.cpu()
    seen = []
    for b in range(s.shape[0]):
        for slot in s[b].tolist():
            if slot < flat.numel():
                assert be[b] == flat[slot]
                seen.append(slot)
    assert sorted(seen) == [j for j in range(flat.numel()) if flat[j] >= 0]


def test_ops_capture_in_cuda_graph():
    """Static shapes, no host sync: the ops can be captured and replayed."""
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_rows(torch.randn(512, 1024, device="cuda") * 0.02)
    q13, s13 = quantize_rows(torch.randn(8, 256, 1024, device="cuda") * 0.05)
    q2, s2 = quantize_rows(torch.randn(8, 1024, 128, device="cuda") * 0.05)
    tw, ids = torch.topk(torch.softmax(torch.randn(8, 8, device="cuda"), -1), 2)
    f = lambda: (torch.ops.mxfp8_learner_grid.linear(x, wq, ws, None),
                 torch.ops.mxfp8_learner_grid.moe(x, q13, s13, q2, s2, tw, ids, None))
    eager = f()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    x.copy_(torch.randn_like(x))
    graph.replay()
    fresh = f()
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    assert not torch.equal(out[0], eager[0])
