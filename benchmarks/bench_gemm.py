"""Kernel-level GEMM benchmark on a GPU: the grid Linear vs BF16 cuBLAS and FP8 rowwise _scaled_mm.

    python benchmarks/bench_gemm.py [--json out.json] [--sweep]

Shapes: the projections of Qwen3-8B (qkv, o, gate_up, down) and Qwen3-30B-A3B attention,
M (tokens) from 1 to 8192.  Arms, all timed in the same run with triton.testing.do_bench
(median; inputs rotated across 3 sets so that weights are not served from L2):
  bf16    torch.mm(x, W^T) in BF16 (cuBLAS)
  fp8row  torch._scaled_mm, FP8 E4M3 with per-row / per-column FP32 scales (the fastest FP8 GEMM on Hopper)
  grid    torch.ops.mxfp8_learner_grid.linear: activation quantize (TE-exact) + the grid GEMM
  gemm    the grid GEMM alone (activation already quantized)
Roofline per shape: bytes / measured copy bandwidth and flops / measured BF16 peak.
``--sweep`` times the GEMM's tile configs on the decode shapes and prints the best.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from mxfp8_learner_grid.common import ops  # noqa: F401
from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.kernels import gemm_triton

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
          "30b.qkv": (5120, 2048), "30b.o": (2048, 4096)}
MS = [1, 4, 16, 64, 256, 2048, 8192]


def bench(fn, sets):
    it = itertools.count()
    try:
        return triton.testing.do_bench(lambda: fn(*sets[next(it) % len(sets)]), warmup=25, rep=150,
                                       return_mode="median")
    except Exception as exc:                 # e.g. _scaled_mm refusing M not a multiple of 16
        print("  (arm failed:", type(exc).__name__, str(exc)[:120], ")")
        return float("nan")


def measure_ceilings(dev):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / (t * 1e-3)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: y @ y, return_mode="median")
    return copy_bw, 2 * 8192 ** 3 / (t * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    dev = "cuda"
    # ceilings, measured now
    copy_bw, peak = measure_ceilings(dev)
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 mm {peak / 1e12:.0f} TFLOP/s")
    out = {"copy_Bps": copy_bw, "bf16_flops": peak, "rows": [], "sweep": []}
    print(f"{'shape':>10} {'M':>5} {'bf16 us':>8} {'fp8row':>7} {'grid':>7} {'gemm':>7} "
          f"{'grid/bf16':>9} {'grid/fp8':>8} {'roof us':>8}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
        wq = [quantize_rows(w) for w in ws]
        w8 = [(w.to(torch.float8_e4m3fn), torch.ones(1, n, device=dev)) for w in ws]
        for m in map(int, args.ms.split(",")):
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(3)]
            xq = [quantize_rows(x) for x in xs]
            x8 = [(x.to(torch.float8_e4m3fn), torch.ones(m, 1, device=dev)) for x in xs]
            sets = list(zip(xs, ws, wq, w8, xq, x8))
            t_bf = bench(lambda x, w, *_: torch.mm(x, w.t()), sets)
            t_f8 = bench(lambda x, w, q, w8_, xq_, x8_: torch._scaled_mm(x8_[0], w8_[0].t(), x8_[1], w8_[1],
                                                                      out_dtype=torch.bfloat16), sets)
            t_grid = bench(lambda x, w, q, *_: torch.ops.mxfp8_learner_grid.linear(x, q[0], q[1], None), sets)
            t_gemm = bench(lambda x, w, q, w8_, xq_, x8_: gemm_triton.grid_gemm(xq_[0], xq_[1], q[0], q[1], None,
                                                                              torch.bfloat16), sets)
            bytes_ = n * k * (1 + 1 / 32) + m * k * 2 + m * n * 2
            roof = max(bytes_ / copy_bw, 2 * m * n * k / peak) * 1e6
            row = dict(shape=name, m=m, n=n, k=k, bf16_us=t_bf * 1e3, fp8row_us=t_f8 * 1e3, grid_us=t_grid * 1e3,
                       gemm_us=t_gemm * 1e3, roofline_us=roof)
            out["rows"].append(row)
            print(f"{name:>10} {m:>5} {t_bf * 1e3:>8.1f} {t_f8 * 1e3:>7.1f} {t_grid * 1e3:>7.1f} {t_gemm * 1e3:>7.1f} "
                  f"{t_bf / t_grid:>9.2f} {t_f8 / t_grid:>8.2f} {roof:>8.1f}")
    if args.sweep:
        for name, m in (("8b.gate_up", 1), ("8b.o", 16), ("8b.down", 64), ("8b.gate_up", 2048)):
            n, k = SHAPES[name]
            w = quantize_rows(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
            xq = quantize_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            best = []
            for bm, bn, bk, sk, warps, st in itertools.product((16, 64, 128) if m > 16 else (16,), (32, 64, 128),
                                                               (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4)):
                if m > 256 and sk > 1:
                    continue
                cfg = (bm, bn, bk, 8, sk, warps, st)
                tt = bench(lambda: gemm_triton.grid_gemm(xq[0], xq[1], w[0], w[1], None, torch.bfloat16, cfg), [()])
                if tt == tt:
                    best.append((tt * 1e3, cfg))
            best.sort()
            print(f"sweep {name} M={m}: best {best[:3]}")
            out["sweep"].append(dict(shape=name, m=m, best=best[:5]))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
