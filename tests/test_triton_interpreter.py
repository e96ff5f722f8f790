"""The Triton kernels under Triton's CPU interpreter: same bytes / values as the torch reference.

The interpreter runs the kernel's indexing, masking, amax, scale rule and layout code on
the CPU.  Two GPU instructions are replaced there (``USE_ASM=False``): the ``mul.rn.f32``
inline asm (by numpy's IEEE fp32 multiply) and the hardware E4M3 cast (by an integer
round-to-nearest-even).  tests/gpu/test_cuda_quantize.py checks the real kernel on a GPU.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from interpreter import run_ok

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import quantize_mxfp8, quantize_rows
    torch.manual_seed(0)
    fails = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((96, 160), (64, 256), (2, 48, 64), (128, 96)):
            x = (torch.randn(*shape) * torch.logspace(-25, 25, shape[-1])).to(dt)
            f = x.view(-1)
            f[3] = float("nan"); f[40] = float("inf"); f[70] = -0.0; f[100:132] = 0
            a = quantize_mxfp8(x, True, True, backend="torch")
            b = quantize_mxfp8(x, True, True, backend="triton")
            for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
                if not torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8)):
                    fails.append((str(dt), shape, n))
            for m in (1, 5, 17, 33):
                r1, r2 = quantize_rows(x.reshape(-1, shape[-1])[:m], "torch"), quantize_rows(x.reshape(-1, shape[-1])[:m], "triton")
                if not (torch.equal(r1[0].view(torch.uint8), r2[0].view(torch.uint8)) and torch.equal(r1[1], r2[1])):
                    fails.append((str(dt), shape, "rows", m))
    print("FAILS", fails)
    assert not fails
""")


def test_kernel_logic_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


GEMM_SCRIPT = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows, ops
    from mxfp8_learner_grid.common.kernels.gemm_triton import grid_gemm
    torch.manual_seed(0)
    for m, n, k in ((1, 64, 96), (17, 96, 160), (40, 32, 64)):
        x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.1, torch.randn(n)
        xq, xs = quantize_rows(x); wq, ws = quantize_rows(w)
        exact = dequantize_blocks(xq, xs).double() @ dequantize_blocks(wq, ws).double().t() + b.double()
        y = grid_gemm(xq, xs, wq, ws, b, torch.float32)
        assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-6, (m, n, k)
    t, h, i, e, topk = 40, 64, 32, 8, 2
    x = torch.randn(t, h)
    q13, s13 = quantize_rows(torch.randn(e, 2 * i, h) * 0.2)
    q2, s2 = quantize_rows(torch.randn(e, h, i) * 0.2)
    tw, ids = torch.topk(torch.softmax(torch.randn(t, e), -1), topk)
    r, o = ops.moe_reference(x, q13, s13, q2, s2, tw, ids), ops.moe_triton(x, q13, s13, q2, s2, tw, ids)
    assert ((o - r).norm() / r.norm()).item() < 1e-6
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1])
    loc = ops.local_expert_ids(ids, emap)
    keep = [0, 2, 4, 6]
    r = ops.moe_reference(x, q13[keep], s13[keep], q2[keep], s2[keep], tw, loc)
    o = ops.moe_triton(x, q13[keep], s13[keep], q2[keep], s2[keep], tw, loc)
    assert ((o - r).norm() / r.norm()).item() < 1e-6
    # bf16: each expert's down output is rounded to bf16 before the FP32 combine, as in the reference.
    # Only FP32 summation order may differ (a gate_up element on a rounding boundary can move one
    # SiLU*up code): nearly every element within one bf16 ulp.  Without the rounding: ~87 %.
    xb = (torch.randn(t, h) * 2).to(torch.bfloat16)
    r, o = ops.moe_reference(xb, q13, s13, q2, s2, tw, ids), ops.moe_triton(xb, q13, s13, q2, s2, tw, ids)
    key = lambda v: (lambda i: torch.where(i < 0, -(i & 0x7FFF), i))(v.view(torch.int16).to(torch.int32))
    within = ((key(o) - key(r)).abs() <= 1).float().mean().item()
    assert within >= 0.98 and ((o.double() - r.double()).norm() / r.double().norm()).item() < 2e-3, within
    print("OK")
""")


def test_gemm_and_moe_kernels_under_interpreter():
    run_ok(GEMM_SCRIPT)
