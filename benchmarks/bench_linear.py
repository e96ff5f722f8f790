"""The grid Linear, every path side by side, against BF16 cuBLAS and FP8 rowwise, on one GPU (issue #7).

    python benchmarks/bench_linear.py --out linear.json [--shapes 8b.qkv,...] [--ms 1,16,...]
                                      [--rep 30] [--budget-s 170]

Shapes: Qwen3-8B projections (qkv, o, gate_up, down) and Qwen3-30B-A3B attention (qkv, o);
M (tokens) 1 .. 8192.  Arms (bf16 activations, bf16 output, no bias):

  bf16        torch.mm(x, W^T), BF16 cuBLAS (the baseline of every ratio)
  fp8row      torch._scaled_mm, E4M3 x E4M3 with per-row x / per-column W fp32 scales (GEMM alone)
  grid_gemm   gemm_triton.grid_gemm on pre-quantized operands (GEMM alone)
  gemv:NAME   gemv_triton.grid_gemv with each named config family (auto, chunk, deq, chunk_n64), M <= 64
              (a family whose config equals an earlier one is not timed twice)
  quant       quantize_rows(x, backend="triton") alone (TE-exact activation quantize)
  qdq         qdq_triton.qdq_rows(x, bf16) alone (exact grid activation in bf16)
  prefill     qdq + torch.mm against the bf16 derived grid weight (the full prefill path)
  full_grid   quant + grid_gemm       full_gemv   quant + grid_gemv (default: auto), M <= 64
Also: the qdq kernel at 4 tile configs for 3 prefill sizes, against a clone of x (copy bandwidth).

Timing: triton.testing.do_bench, median, L2 flushed before every call (do_bench zeroes a
256 MB buffer between calls).  Ceilings measured in the same run: device-to-device copy
bandwidth (1 GiB); BF16 dense peak taken as the H200 datasheet 989 TFLOP/s (the measured
8192^3 torch.mm rate is recorded too).  Per arm: microseconds, ratio bf16_us / arm_us,
bytes moved (each operand read once, output written once) / time / copy bandwidth, and
flops / time / 989 TFLOP/s.  Every grid arm is checked against float64 dequantize-then-matmul
(relative error) before it counts; a gemv config that fails the check cannot win.

Output: JSON (``--out``) and a table on stdout; ``benchmarks/plot_kernels.py`` plots the JSON.
Runtime: ~2 minutes on an H200 for the default grid (``--budget-s`` stops measuring new
points when exceeded and still writes the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
from mxfp8_learner_grid.common.kernels import gemm_triton
from mxfp8_learner_grid.common.kernels import gemv_triton as GV
from mxfp8_learner_grid.common.kernels.qdq_triton import grid_weight_bf16, qdq_rows

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
          "30b.qkv": (5120, 2048), "30b.o": (2048, 4096)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
DECODE_MAX = 64
BF16_PEAK = 989e12          # H200 dense BF16, datasheet
CHECK_REL = 4e-3            # bf16 output vs float64 exact: a few bf16 roundings (2^-9 rel. each)
QDQ_CONFIGS = [(32, 128, 4), (16, 128, 4), (64, 128, 8), (32, 256, 8)]   # (BLOCK_M, BLOCK_K, warps)


def do_bench_us(fn, warmup, rep):
    if not torch.cuda.is_available():            # CPU smoke run of this script (TRITON_INTERPRET=1)
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def measure_copy_bw(dev, nbytes=1 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = do_bench_us(lambda: dst.copy_(src), 10, 50)
    return 2 * nbytes / (t * 1e-6)


def measure_bf16_peak(dev, n=8192):
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = do_bench_us(lambda: a @ a, 10, 50)
    return 2 * n ** 3 / (t * 1e-6)


def rowwise_fp8(t):
    """Per-row E4M3 copy of a bf16 matrix and its fp32 dequant scales (amax / 448)."""
    amax = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def rel_err(y, exact):
    return float((y.double() - exact).norm() / exact.norm().clamp_min(1e-300))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="linear.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=30, help="do_bench repetition time (ms)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop measuring new points after this")
    ap.add_argument("--gemv-names", default=",".join(GV.NAMED))
    ap.add_argument("--no-qdq-sweep", action="store_true")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # cpu: smoke run under TRITON_INTERPRET=1
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    # FP32 accumulation in cuBLAS bf16 GEMMs (no bf16 split-K reductions): the prefill path's
    # exactness needs it; the bf16 baseline runs under the same setting
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    names = [s for s in args.gemv_names.split(",") if s]
    bench = lambda fn: do_bench_us(fn, args.warmup, args.rep)   # noqa: E731

    copy_bw = measure_copy_bw(dev, 1 << 30 if cuda else 1 << 24)
    peak_meas = measure_bf16_peak(dev, 8192 if cuda else 256)
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke run)", "torch": torch.__version__,
            "triton": triton.__version__,
            "sms": torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 0,
            "copy_Bps": copy_bw, "bf16_peak_flops": BF16_PEAK, "bf16_mm_flops_measured": peak_meas,
            "env_MXFP8_GEMV_VARIANT": os.environ.get("MXFP8_GEMV_VARIANT"), "gemv_names": names,
            "timing": f"triton.testing.do_bench median, warmup {args.warmup} ms, rep {args.rep} ms, L2 flushed",
            "allow_bf16_reduced_precision_reduction": False}
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  SMs {info['sms']}")
    print(f"copy {copy_bw / 1e12:.2f} TB/s (1 GiB d2d)   bf16 8192^3 mm {peak_meas / 1e12:.0f} TFLOP/s "
          f"(roofline uses {BF16_PEAK / 1e12:.0f})", flush=True)
    rows, skipped = [], []
    hdr = (f"{'shape':>10} {'M':>5} {'bf16':>7} {'fp8row':>7} {'grid':>7} {'gemv*':>7} {'best':>10} "
           f"{'qdq':>6} {'prefill':>7} {'full_gv':>7} | {'x gemv*':>7} {'x fullgv':>8} {'x prefill':>9} "
           f"{'x fp8':>6} {'gemv%bw':>7} {'roof':>7}")
    print("times in us; 'x ARM' = bf16_us / ARM_us; gemv%bw = bytes / time / copy bandwidth")
    print(hdr, flush=True)
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape] if shape in SHAPES else map(int, shape.split("x"))    # or "NxK"
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq, ws = quantize_rows(w, backend="triton")
        w_grid = grid_weight_bf16(wq, ws)                       # the engine's derived bf16 copy (exact)
        w8, w8s = rowwise_fp8(w)
        w8s = w8s.reshape(1, n).contiguous()
        w_exact = dequantize_blocks(wq, ws).double()
        for m in map(int, args.ms.split(",")):
            if time.time() - t_start > args.budget_s:
                skipped.append((shape, m))
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            xq, xs = quantize_rows(x, backend="triton")
            x8, x8s = rowwise_fp8(x)
            exact = dequantize_blocks(xq, xs).double() @ w_exact.t()
            us, err, relerr, cfgs = {}, {}, {}, {}

            def arm(name, fn, check=False):
                try:
                    if check:
                        relerr[name] = rel_err(fn(), exact)
                        if not relerr[name] < CHECK_REL:
                            err[name] = f"check failed: rel err {relerr[name]:.3g}"
                    us[name] = bench(fn)
                except Exception as exc:        # record, keep going (e.g. _scaled_mm refusing a shape)
                    err[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    us[name] = float("nan")

            arm("bf16", lambda: torch.mm(x, w.t()))
            arm("fp8row", lambda: torch._scaled_mm(x8, w8.t(), scale_a=x8s, scale_b=w8s, out_dtype=torch.bfloat16))
            arm("grid_gemm", lambda: gemm_triton.grid_gemm(xq, xs, wq, ws, None, torch.bfloat16), check=True)
            arm("quant", lambda: quantize_rows(x, backend="triton"))
            arm("qdq", lambda: qdq_rows(x, torch.bfloat16))
            arm("prefill", lambda: torch.mm(qdq_rows(x, torch.bfloat16), w_grid.t()), check=True)
            arm("full_grid", lambda: gemm_triton.grid_gemm(*quantize_rows(x, backend="triton"), wq, ws, None,
                                                           torch.bfloat16))
            best = None
            if m <= DECODE_MAX:
                timed = {}                                   # config -> name it was timed under
                for nm in names:
                    cfg = GV.choose_config(m, n, k, nm)
                    cfgs[nm] = list(cfg.astuple())
                    if cfg in timed:                         # e.g. "auto" is one of the others
                        us[f"gemv:{nm}"] = us[f"gemv:{timed[cfg]}"]
                        if f"gemv:{timed[cfg]}" in err:
                            err[f"gemv:{nm}"] = err[f"gemv:{timed[cfg]}"]
                        continue
                    timed[cfg] = nm
                    arm(f"gemv:{nm}", lambda cfg=cfg: GV.grid_gemv(xq, xs, wq, ws, None, torch.bfloat16, cfg),
                        check=True)
                ok = [nm for nm in names if f"gemv:{nm}" not in err and math.isfinite(us[f"gemv:{nm}"])]
                best = min(ok, key=lambda nm: (us[f"gemv:{nm}"], nm == "auto")) if ok else None
                dflt = GV.choose_config(m, n, k)
                cfgs["default"] = list(dflt.astuple())
                arm("full_gemv", lambda: GV.grid_gemv(*quantize_rows(x, backend="triton"), wq, ws, None,
                                                      torch.bfloat16, dflt))
                if best:
                    us["gemv_best"] = us[f"gemv:{best}"]
            # roofline bookkeeping
            sc = 1 + 1 / 32
            b_gemm = n * k * sc + m * k * sc + 2 * m * n
            b_quant = 2 * m * k + m * k * sc
            b_qdq = 4 * m * k
            bytes_ = {"bf16": 2 * n * k + 2 * m * k + 2 * m * n, "fp8row": n * k + m * k + 2 * m * n + 4 * (m + n),
                      "grid_gemm": b_gemm, "quant": b_quant, "qdq": b_qdq,
                      "prefill": b_qdq + 2 * n * k + 2 * m * k + 2 * m * n,
                      "full_grid": b_quant + b_gemm, "full_gemv": b_quant + b_gemm, "gemv_best": b_gemm}
            for nm in names:
                bytes_[f"gemv:{nm}"] = b_gemm
            flops = 2 * m * n * k
            t_bf = us["bf16"]
            row = dict(shape=shape, m=m, n=n, k=k, flops=flops, us=us, errors=err, relerr=relerr, configs=cfgs,
                       best_gemv=best, bytes=bytes_,
                       ratio_vs_bf16={a: t_bf / t for a, t in us.items() if t == t and t > 0},
                       hbm_frac={a: bytes_[a] / (t * 1e-6) / copy_bw for a, t in us.items()
                                 if a in bytes_ and t == t and t > 0},
                       flop_frac={a: flops / (t * 1e-6) / BF16_PEAK for a, t in us.items() if t == t and t > 0},
                       roofline_us={a: max(bytes_[a] / copy_bw, flops / BF16_PEAK) * 1e6 for a in bytes_})
            rows.append(row)
            r = row["ratio_vs_bf16"]
            f = lambda v: f"{v:7.1f}" if v == v else "    nan"   # noqa: E731
            gb = us.get("gemv_best", float("nan"))
            print(f"{shape:>10} {m:>5} {f(t_bf)} {f(us['fp8row'])} {f(us['grid_gemm'])} {f(gb)} "
                  f"{(best or '-'):>10} {us['qdq']:6.1f} {f(us['prefill'])} {f(us.get('full_gemv', float('nan')))} | "
                  f"{r.get('gemv_best', float('nan')):7.2f} {r.get('full_gemv', float('nan')):8.2f} "
                  f"{r.get('prefill', float('nan')):9.2f} {r.get('fp8row', float('nan')):6.2f} "
                  f"{row['hbm_frac'].get('gemv_best', float('nan')):7.2f} "
                  f"{row['roofline_us']['gemv_best' if m <= DECODE_MAX else 'prefill']:7.1f}", flush=True)
            for a, e in err.items():
                print(f"{'':>17}{a}: {e[:160]}", flush=True)
        if cuda:        # the next shape's tensors replace these; return the cached blocks first
            torch.cuda.empty_cache()

    # the qdq kernel's tile configs at prefill sizes (the default is the quantize kernel's tile)
    qdq_sweep = []
    if time.time() - t_start < args.budget_s and not args.no_qdq_sweep:
        for m, k in ((2048, 4096), (8192, 4096), (8192, 12288)) if cuda else ((64, 256),):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = {}
            for cfg in QDQ_CONFIGS:
                try:
                    res[str(cfg)] = bench(lambda cfg=cfg: qdq_rows(x, torch.bfloat16, config=cfg))
                except Exception as exc:
                    res[str(cfg)] = float("nan")
                    print(f"  qdq config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
            tc = bench(lambda: x.clone())
            best = min(res, key=lambda c: res[c] if res[c] == res[c] else float("inf"))
            qdq_sweep.append(dict(m=m, k=k, us=res, copy_us=tc, best=best,
                                  best_frac_of_copy=tc / res[best] if res[best] == res[best] else float("nan")))
            print(f"qdq {m}x{k}: " + ", ".join(f"{c} {t:.1f}us" for c, t in res.items())
                  + f"; clone of x {tc:.1f}us; best {best} at {qdq_sweep[-1]['best_frac_of_copy']:.2f} of copy")

    # summary: issue #7 goals, and which gemv config wins where
    wins, summary = {}, {"decode": {}, "prefill": {}}
    for row in rows:
        if row["best_gemv"]:
            wins[row["best_gemv"]] = wins.get(row["best_gemv"], 0) + 1
    for shape in {r["shape"] for r in rows}:
        dec = [r for r in rows if r["shape"] == shape and r["m"] <= 16]
        if dec:
            summary["decode"][shape] = {
                "min_x_gemv_best": min(r["ratio_vs_bf16"].get("gemv_best", float("nan")) for r in dec),
                "min_x_full_gemv": min(r["ratio_vs_bf16"].get("full_gemv", float("nan")) for r in dec),
                "min_hbm_frac_gemv_best": min(r["hbm_frac"].get("gemv_best", float("nan")) for r in dec),
                "goal": "x >= 1.7 and hbm_frac >= 0.85"}
        pre = [r for r in rows if r["shape"] == shape and r["m"] >= 2048]
        if pre:
            summary["prefill"][shape] = {
                "min_x_prefill": min(r["ratio_vs_bf16"].get("prefill", float("nan")) for r in pre),
                "min_x_full_grid": min(r["ratio_vs_bf16"].get("full_grid", float("nan")) for r in pre),
                "goal": "x >= 0.9"}
    out = dict(info=info, rows=rows, wins=wins, summary=summary, skipped=skipped, qdq_sweep=qdq_sweep,
               elapsed_s=round(time.time() - t_start, 1))
    print("\ngemv families side by side (us; * = fastest; configs in the JSON):")
    print(f"{'shape':>10} {'M':>3} " + " ".join(f"{nm:>10}" for nm in names) + "   auto config")
    for row in rows:
        if row["m"] > DECODE_MAX:
            continue
        cells = []
        for nm in names:
            t = row["us"].get(f"gemv:{nm}", float("nan"))
            mark = "*" if row["best_gemv"] == nm else (" " if f"gemv:{nm}" not in row["errors"] else "!")
            cells.append(f"{t:9.1f}{mark}")
        print(f"{row['shape']:>10} {row['m']:>3} " + " ".join(cells) + f"   {row['configs'].get('auto')}")
    print("\ngemv config wins (fastest passing config per (shape, M<=64)):", wins)
    print("decode (M<=16): worst ratio vs bf16 per shape -- gemv alone / with quantize; HBM fraction of gemv")
    for s_, d in sorted(summary["decode"].items()):
        print(f"  {s_:>10}: {d['min_x_gemv_best']:.2f}x / {d['min_x_full_gemv']:.2f}x, "
              f"{d['min_hbm_frac_gemv_best']:.2f} of copy bw   (goal 1.7x, 0.85)")
    print("prefill (M>=2048): worst ratio vs bf16 per shape -- qdq+mm / quantize+grid_gemm")
    for s_, d in sorted(summary["prefill"].items()):
        print(f"  {s_:>10}: {d['min_x_prefill']:.2f}x / {d['min_x_full_grid']:.2f}x   (goal 0.9x)")
    if skipped:
        print(f"budget exceeded: skipped {len(skipped)} points: {skipped}")
    print(f"elapsed {out['elapsed_s']} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1, default=float)
    print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
