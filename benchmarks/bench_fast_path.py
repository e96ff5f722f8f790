"""Kernel-level: the fast grid Linear against BF16 and vLLM's FP8 paths, per M, on one GPU (issue #11).

    python benchmarks/bench_fast_path.py --out fast_path.jsonl [--shapes 8b.qkv,...] [--ms 1,16,...]

Arms (bf16 activations and output, no bias), each the whole op as the engine calls it:

  bf16          torch.mm(x, W^T) (cuBLAS) -- the baseline of every ratio
  fp8row        torch._scaled_mm, x quantized per row (torch ops) x W per column, E4M3 (vLLM's ``fp8`` style)
  marlin_w8a16  vLLM's MXFP8 Marlin on x as it is (vLLM's ``mxfp8``: activations not quantized -- off the grid)
  grid_marlin   ours: qdq(x) + Marlin            grid_cublas  ours: qdq(x) + dequantize W + cuBLAS
  grid_triton   the previous grid path (quantize + Triton grid GEMM)
  grid_w8a16    ours: qdq(x) + the swapped W8A16 Triton GEMM (kernels/w8a16_triton, its default config)
  grid_bf16copy ours with option bf16_weight_rows: qdq(x) + cuBLAS on a resident bf16 copy of W (2 bytes/weight more)
  grid_gemv     ours with option gemv_rows (M <= 64): x quantized to codes + scales + the decode GEMV (kernels/gemv_triton)

``--w8a16-sweep`` also times other W8A16 configs (BLOCK_N, BLOCK_M, SPLIT_K, warps, stages)
per (shape, M in --sweep-ms) as arms ``w8a16:<config>`` (``--best-out F`` writes the fastest per
M and shape); ``--band-out F`` writes the rows [lo, hi) where grid_w8a16 beats grid_marlin on
the summed time of the shapes run (the ``w8a16_rows`` option for an end-to-end run);
``--gemv-out F`` writes ``{"gemv_rows": R}``, R the
largest M such that grid_gemv beats grid_marlin (summed over the shapes) at every measured M <= R.

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


def weight_copies(n, k, device="cuda"):
    """The wire bytes (E4M3 codes, E8M0 scales) of as many [n, k] weights as defeat the L2 when timed in turn (2 to
    16), copy i seeded as ``make_layer(n, k, i, ...)`` seeds its own, and their bf16 dequantization."""
    copies = max(2, min(16, -(-L2_BYTES // (n * k * 2))))
    raw = [quantize_rows(torch.randn(n, k, device=device, generator=torch.Generator(device=device).manual_seed(i))
                         * 0.02) for i in range(copies)]
    return raw, [dequantize_blocks(q, s).to(torch.bfloat16) for q, s in raw]


def make_layer(n, k, seed, crossover, band=None, copy_rows=0, gemv_rows=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq, ws = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(wq, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
    spec = LayerSpec(prefix="b", kind="linear", device_type="cuda", act_dtype=torch.bfloat16, n=n, k=k,
                     capability=torch.cuda.get_device_capability(), options={"prefill_crossover": crossover,
                                                                   "w8a16_rows": band or [],
                                                                   "bf16_weight_rows": copy_rows,
                                                                   "gemv_rows": gemv_rows})
    layer.grid_kernel = choose(spec)
    layer.grid_kernel.process_weights_after_loading(layer)
    return layer


def exact_ref(x, q, s):
    """The grid result: qdq(x) times the dequantized weight, summed exactly (float64), rounded once to bf16."""
    return (dequantize_blocks(*quantize_rows(x)).double() @ dequantize_blocks(q, s).double().t()).to(torch.bfloat16)


def on_grid(y, ref, what=""):
    """Raise unless at least 99% of ``y``'s elements equal the exact result (summation order moves the rest)."""
    eq = (y.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
    if eq < 0.99:
        raise AssertionError(f"{what}only {eq:.4f} of elements equal the exact result")


def time_graph(fns):
    """us per call of a list of calls (one per weight copy), captured in one CUDA graph."""
    def run():
        for f in fns:
            f()
    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=60)
    return 1000.0 * ms / len(fns)


def time_arms(arms: dict, label: str) -> dict:
    """us per call of each arm (a list of calls, :func:`time_graph`); an arm that fails is reported and left out."""
    us = {}
    for arm, fns in arms.items():
        try:
            us[arm] = time_graph(fns)
        except Exception as exc:
            print(f"{label} {arm}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fast_path.jsonl")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--arms", default="", help="only these arms (comma-separated; default all)")
    ap.add_argument("--w8a16-sweep", action="store_true")
    ap.add_argument("--sweep-ms", default="16,32,64,128", help="the M values the sweep runs at")
    ap.add_argument("--band-out", default="")
    ap.add_argument("--best-out", default="", help="write the fastest exact W8A16 config per (M, shape) here")
    ap.add_argument("--gemv-out", default="")
    args = ap.parse_args()
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()
    ops = providers.get("marlin")
    assert ops is not None, "vLLM's Marlin ops are needed"
    from mxfp8_learner_grid.common.kernels.gemm_triton import grid_gemm
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    from mxfp8_learner_grid.common.kernels.w8a16_triton import w8a16_config, w8a16_gemm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    total = {}                                    # (m, arm) -> summed us over the shapes
    best_cfg = {}                                 # m -> shape -> (the fastest exact W8A16 config, us)
    meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}
    out = open(args.out, "w")
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        copies = max(2, min(16, -(-L2_BYTES // (n * k * 2))))
        lay_m = [make_layer(n, k, i, 1 << 30) for i in range(copies)]        # always Marlin
        lay_c = [make_layer(n, k, 100 + i, 1) for i in range(copies)]        # always dequant + cuBLAS
        lay_w = [make_layer(n, k, 200 + i, 1 << 30, [1, 1 << 30]) for i in range(copies)]   # always W8A16
        lay_b = [make_layer(n, k, 300 + i, 1 << 30, copy_rows=1) for i in range(copies)]    # always the bf16 copy
        lay_g = [make_layer(n, k, 400 + i, 1 << 30, gemv_rows=64) for i in range(copies)]   # the GEMV (M <= 64)
        wb = [dequantize_blocks(l.weight, l.weight_scale_inv).to(torch.bfloat16) for l in lay_m]
        w8 = [l.weight for l in lay_m]
        wcol = [torch.full((1, n), 2.0 ** -7, device="cuda") for _ in lay_m]
        best = {}
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            # exactness gate for the grid arms
            failed = set()
            for name, lays in (("grid_marlin", lay_m), ("grid_cublas", lay_c), ("grid_w8a16", lay_w),
                               ("grid_bf16copy", lay_b), ("grid_gemv", lay_g)):
                if name == "grid_gemv" and m > 64:
                    failed.add(name)
                    continue
                lay = lays[0]
                ref = exact_ref(x, lay.weight, lay.weight_scale_inv)
                try:
                    on_grid(lay.grid_kernel.apply(lay, x), ref, f"{sname} M={m} {name}: ")
                except Exception as exc:       # an arm off the grid (or broken) is not timed
                    print(f"{sname} M={m} {name} NOT TIMED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    failed.add(name)

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
                "grid_w8a16": [lambda l=l: l.grid_kernel.apply(l, x) for l in lay_w],
                "grid_bf16copy": [lambda l=l: l.grid_kernel.apply(l, x) for l in lay_b],
                "grid_gemv": [lambda l=l: l.grid_kernel.apply(l, x) for l in lay_g],
            }
            if args.arms:
                keep = set(args.arms.split(",")) | {"bf16"}
                arms = {a: f for a, f in arms.items() if a in keep}
            arms = {a: f for a, f in arms.items() if a not in failed}
            if args.w8a16_sweep and "grid_w8a16" not in failed and m in set(map(int, args.sweep_ms.split(","))):
                lay = lay_w[0]
                ref = exact_ref(x, lay.weight, lay.weight_scale_inv)
                for cfg in sweep_configs(m, n, k, sms, w8a16_config(m, n, k, sms)):
                    try:       # a config counts only if it is on the grid (the exact sum rounded once)
                        on_grid(w8a16_gemm(qdq_rows(x, torch.bfloat16), lay.weight, lay.weight_scale_inv, cfg), ref)
                    except Exception as exc:
                        print(f"{sname} M={m} w8a16:{cfg} NOT TIMED: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    arms["w8a16:" + ",".join(map(str, cfg))] = [
                        lambda l=l, c=cfg: w8a16_gemm(qdq_rows(x, torch.bfloat16), l.weight, l.weight_scale_inv, c)
                        for l in lay_w]
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
            for arm, t in us.items():
                if t:
                    total[(m, arm)] = total.get((m, arm), 0.0) + t
            sw = {a: t for a, t in us.items() if a.startswith("w8a16:") and t}
            if sw:
                a = min(sw, key=sw.get)
                best_cfg.setdefault(m, {})[sname] = (a[6:], sw[a])
                print(f"{sname:11s} M={m:5d} best w8a16 config {a[6:]}: {sw[a]:.1f} us "
                      f"(default {us.get('grid_w8a16') or 0:.1f}, marlin {us.get('grid_marlin') or 0:.1f})", flush=True)
            best[m] = us
            times = " ".join(f"{a}={us[a]:.1f}" if us[a] else f"{a}=-" for a in us if ":" not in a)
            ratios = " ".join(f"{a} x{us['bf16'] / us[a]:.2f}" for a in ("grid_marlin", "grid_cublas", "grid_w8a16",
                                                                         "grid_bf16copy", "grid_gemv")
                              if us.get(a))
            print(f"{sname:11s} M={m:5d} {times}  | {ratios}", flush=True)
        cross = [m for m, u in best.items()
                 if u.get("grid_cublas") and u.get("grid_marlin") and u["grid_cublas"] < u["grid_marlin"]]
        print(f"{sname}: dequant+cuBLAS faster than Marlin from M = {min(cross) if cross else 'never'}", flush=True)
        del lay_m, lay_c, lay_w, lay_b, lay_g, wb
        torch.cuda.empty_cache()
    ms = sorted({m for m, _ in total})
    wins = [m for m in ms if total.get((m, "grid_w8a16"), 1e30) < total.get((m, "grid_marlin"), 0.0)]
    band = []
    if wins:   # the widest run of consecutive measured M where W8A16 wins, as [lo, hi) -- unmeasured M at its
               # edges stay on Marlin
        runs, cur = [], [wins[0]]
        for m in wins[1:]:
            if ms.index(m) == ms.index(cur[-1]) + 1:
                cur.append(m)
            else:
                runs.append(cur)
                cur = [m]
        runs.append(cur)
        r = max(runs, key=len)
        band = [r[0], r[-1] + 1]
    print("summed over shapes, us: " + "; ".join(
        f"M={m}: marlin {total.get((m, 'grid_marlin'), 0):.1f} w8a16 {total.get((m, 'grid_w8a16'), 0):.1f} "
        f"bf16copy {total.get((m, 'grid_bf16copy'), 0):.1f} gemv {total.get((m, 'grid_gemv'), 0):.1f} "
        f"bf16 {total.get((m, 'bf16'), 0):.1f}" for m in ms), flush=True)
    print(f"W8A16_BAND {json.dumps(band)}", flush=True)
    if args.best_out:
        with open(args.best_out, "w") as f:
            json.dump({str(m): {sh: [c, round(t, 2)] for sh, (c, t) in per.items()} for m, per in best_cfg.items()}, f)
    for m, per in sorted(best_cfg.items()):       # what a per-shape config table would reach
        print(f"W8A16_BEST M={m}: summed {sum(t for _, t in per.values()):.1f} us (marlin "
              f"{total.get((m, 'grid_marlin'), 0):.1f}, bf16 {total.get((m, 'bf16'), 0):.1f}); "
              + "; ".join(f"{sh} {c} {t:.1f}" for sh, (c, t) in per.items()), flush=True)
    if args.band_out:
        with open(args.band_out, "w") as f:
            json.dump({"w8a16_rows": band}, f)
    gemv_rows = 0
    for m in ms:         # the measured prefix of M where the GEMV wins
        if m > 64 or not total.get((m, "grid_gemv")) or total[(m, "grid_gemv")] >= total.get((m, "grid_marlin"), 0.0):
            break
        gemv_rows = m
    print(f"GEMV_ROWS {gemv_rows}", flush=True)
    if args.gemv_out:
        with open(args.gemv_out, "w") as f:
            json.dump({"gemv_rows": gemv_rows}, f)


def sweep_configs(m, n, k, sms, default):
    """W8A16 configs around the default (BLOCK_N, BLOCK_M, SPLIT_K, warps, stages): weight-row tiles of
    64 (one warpgroup), 128 and 256 (two warpgroups: fewer re-reads of the x tile from L2 per weight
    byte), split-K 1 / 2 (deterministic), 3 or 4 stages."""
    out = {tuple(default)}
    for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        bm = default[1]
        tiles = -(-n // bn) * -(-m // bm)
        for split in (1, 2):
            if k % (128 * split) or k // split < 2 * 128 or tiles * split > 4 * sms:
                continue
            for stages in (3, 4):
                out.add((bn, bm, split, warps, stages))
    return sorted(out)


if __name__ == "__main__":
    main()
