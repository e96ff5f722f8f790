"""Kernel-level: the fast grid Linear against BF16 and vLLM's FP8 paths, per M, on one GPU (issue #11).

    python benchmarks/bench_fast_path.py --out fast_path.jsonl [--shapes 8b.qkv,...] [--ms 1,16,...]

Arms (bf16 activations and output, no bias), each the whole op as the engine calls it:

  bf16          torch.mm(x, W^T) (cuBLAS) -- the baseline of every ratio
  fp8row        torch._scaled_mm, x quantized per row (torch ops) x W per column, E4M3 (vLLM's ``fp8`` style)
  marlin_w8a16  vLLM's MXFP8 Marlin on x as it is (vLLM's ``mxfp8``: activations not quantized -- off the grid)
  grid_marlin   ours: qdq(x) + Marlin            grid_cublas  ours: qdq(x) + dequantize W + cuBLAS
  grid_triton   the previous grid path (quantize + Triton grid GEMM)

Timing: every arm captured in a CUDA graph over enough distinct weight copies that the weights
cannot stay in the 50 MB L2 (as in a model, where each layer reads its own weights), replayed
(``triton.testing.do_bench_cudagraph``); per-call time = replay time / copies.  Each grid arm's
output is checked against the exact result rounded once to bf16 before it counts.
Output: one JSON line per (shape, M, arm) with us and bf16_us / us; the crossover M where
grid_cublas overtakes grid_marlin is printed per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

import torch
import triton

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
from mxfp8_learner_grid.common.grid_kernels import LayerSpec, choose, providers

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
          "30b.qkv": (5120, 2048), "30b.o": (2048, 4096)}
MS = [1, 16, 64, 256, 512, 1024, 2048, 8192]
L2_BYTES = 256 << 20


def commit():
    if os.environ.get("GRID_COMMIT"):        # the device copy of the tree may carry a stale .git
        return os.environ["GRID_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:
        return "?"


def make_layer(n, k, seed, crossover):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq, ws = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(wq, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
    spec = LayerSpec(prefix="b", kind="linear", device_type="cuda", act_dtype=torch.bfloat16, n=n, k=k,
                     capability=torch.cuda.get_device_capability(), options={"prefill_crossover": crossover})
    layer.grid_kernel = choose(spec)
    layer.grid_kernel.process_weights_after_loading(layer)
    return layer


def time_graph(fns):
    """us per call of a list of calls (one per weight copy), captured in one CUDA graph."""
    def run():
        for f in fns:
            f()
    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=60)
    return 1000.0 * ms / len(fns)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fast_path.jsonl")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()
    ops = providers.get("marlin")
    assert ops is not None, "vLLM's Marlin ops are needed"
    from mxfp8_learner_grid.common.kernels.gemm_triton import grid_gemm
    meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}
    out = open(args.out, "w")
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        copies = max(2, min(16, -(-L2_BYTES // (n * k * 2))))
        lay_m = [make_layer(n, k, i, 1 << 30) for i in range(copies)]        # always Marlin
        lay_c = [make_layer(n, k, 100 + i, 1) for i in range(copies)]        # always dequant + cuBLAS
        wb = [dequantize_blocks(l.weight, l.weight_scale_inv).to(torch.bfloat16) for l in lay_m]
        w8 = [l.weight for l in lay_m]
        wcol = [torch.full((1, n), 2.0 ** -7, device="cuda") for _ in lay_m]
        best = {}
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            # exactness gate for the grid arms
            for name, lays in (("grid_marlin", lay_m), ("grid_cublas", lay_c)):
                lay = lays[0]
                ref = (dequantize_blocks(*quantize_rows(x)).double()
                       @ dequantize_blocks(lay.weight, lay.weight_scale_inv).double().t()).float().to(torch.bfloat16)
                y = lay.grid_kernel.apply(lay, x)
                eq = (y.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
                assert eq >= 0.99, f"{sname} M={m} {name}: only {eq:.4f} of elements equal the exact result"

            def xs8():
                a = x.float()
                s = (a.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)
                return (a / s).to(torch.float8_e4m3fn), s
            xq, xsc = quantize_rows(x)
            arms = {
                "bf16": [lambda w=w: torch.mm(x, w.t()) for w in wb],
                "fp8row": [lambda w=w, c=c: (lambda q, s: torch._scaled_mm(q, w.t(), scale_a=s, scale_b=c,
                                                                           out_dtype=torch.bfloat16))(*xs8())
                           for w, c in zip(w8, wcol)],
                "marlin_w8a16": [lambda l=l: ops.gemm(x, l.grid_marlin_weight, l.grid_marlin_scale,
                                                      l.grid_marlin_workspace, n, k) for l in lay_m],
                "grid_marlin": [lambda l=l: l.grid_kernel.apply(l, x) for l in lay_m],
                "grid_cublas": [lambda l=l: l.grid_kernel.apply(l, x) for l in lay_c],
                "grid_triton": [lambda l=l: grid_gemm(*quantize_rows(x, backend="triton"), l.weight,
                                                      l.weight_scale_inv, None, torch.bfloat16) for l in lay_m],
            }
            us = {}
            for arm, fns in arms.items():
                try:
                    us[arm] = time_graph(fns)
                except Exception as exc:        # an arm that fails is recorded, not fatal
                    us[arm] = None
                    print(f"{sname} M={m} {arm}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            for arm, t in us.items():
                rec = dict(meta, shape=sname, n=n, k=k, m=m, arm=arm, us=None if t is None else round(t, 2),
                           vs_bf16=None if not t else round(us["bf16"] / t, 3))
                out.write(json.dumps(rec) + "\n")
            out.flush()
            best[m] = us
            print(f"{sname:11s} M={m:5d} " + " ".join(f"{a}={us[a]:.1f}" if us[a] else f"{a}=-" for a in us)
                  + f"  | grid_marlin x{us['bf16'] / us['grid_marlin']:.2f}  grid_cublas x{us['bf16'] / us['grid_cublas']:.2f}",
                  flush=True)
        cross = [m for m, u in best.items() if u["grid_cublas"] and u["grid_marlin"] and u["grid_cublas"] < u["grid_marlin"]]
        print(f"{sname}: dequant+cuBLAS faster than Marlin from M = {min(cross) if cross else 'never'}", flush=True)
        del lay_m, lay_c, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
