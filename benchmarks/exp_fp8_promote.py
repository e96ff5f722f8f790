"""Experiment (benchmark only, not shipped): FP8 tensor cores (wgmma e4m3 x e4m3) with the two E8M0 scales
applied to the FP32 partial sum of every 32-block -- issue #11's stretch goal -- and whether that is exact.

    python benchmarks/exp_fp8_promote.py --out $OUT/fp8p.jsonl [--ms 16,64,256,2048,8192] [--shapes 8b.qkv,...]
    python benchmarks/exp_fp8_promote.py --probe-only --out $OUT/fp8p.jsonl
    TRITON_INTERPRET=1 python benchmarks/exp_fp8_promote.py --check-interpreter

The kernel.  Both operands are on the grid as codes: x -> (E4M3 codes, one E8M0 byte per 32 along K) by
the project's TE-exact quantizer, W as loaded.  Each K step of 32 runs one MMA over the codes alone into a
fresh accumulator and adds ``part * 2^(ex-127) * 2^(ew-127)`` to the FP32 accumulator (``y^T = W x^T``:
weight rows on the MMA's 64-row side).  ``MMA=bf16`` runs the same loop with the codes converted to bf16
(exact) and a BF16 MMA: the control, whose 32-term partial sums are FP32 sums of exact products.

What decides exactness is the tensor core's own sum of the 32 products inside one FP8 MMA.  Each product
of two E4M3 values has at most 8 significant bits; their exact sum is what the learner's FP32
accumulation approximates to within FP32 rounding.  If the FP8 MMA keeps fewer bits than FP32 when it
aligns the products (reported for Hopper), the per-32 promotion cannot repair it.  So the experiment
first probes one 32-block (``--probe``): many independent 32-term dots of codes drawn (a) from quantized
Gaussian rows, as in a model, and (b) uniformly over every finite E4M3 byte, through the FP8 MMA and the
BF16 control, each compared with the exact sum (float64): the share equal to the exact sum rounded once
to FP32, and the worst error in units of ``2^-24 * sum|p_i|`` (any FP32 summation order of 32 terms stays
within 31 of them; a correctly rounded one within 0.5).

Then the GEMM over the Qwen3-8B projections, with the grid criterion of the fast path's tests: the share
of bf16 outputs equal to the exact result rounded once (float64 -> bf16), the worst distance in bf16
steps, and the share of elements outside the bound of an FP32 sum in any order rounded once
(``|y - exact| <= ulp/2 + K * 2^-24 * sum |x_i w_i|``; 0 for an exact kernel).  Timed arms per
(shape, M): ``bf16`` (torch.mm, the baseline), ``grid_shipped`` (qdq + Marlin below M = 256, dequantize +
cuBLAS from 256: the shipped bands without the bf16 copy),
``scaled_mm_rowwise`` (torch._scaled_mm, FP8 per-row scales: the speed of FP8 tensor cores off the grid),
``fp8p:<config>`` (quantize x + this kernel) and ``bf16p:<config>`` (the control); config = BLOCK_N,
BLOCK_M, UNROLL, warps, stages.  Timed as in ``bench_fast_path`` (CUDA graphs over weight copies that
defeat the L2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from mxfp8_learner_grid.common import format as F
from mxfp8_learner_grid.common.kernels import interpreting
from mxfp8_learner_grid.common.kernels.gemm_triton import _e4m3_to_f32, _e8m0_to_f32, _f32_bits_to_bf16_bits

_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E8M0_ONE = tl.constexpr(F.E8M0_BIAS)


@triton.jit
def _fp8p_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn,
                 stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, UNROLL: tl.constexpr,
                 MMA_BF16: tl.constexpr, OUT_F32: tl.constexpr, HW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rk = tl.arange(0, _BLOCK)
    w_base = wq_ptr + rn[:, None].to(tl.int64) * stride_wn
    ws_base = ws_ptr + rn.to(tl.int64) * stride_wsn
    x_base = xq_ptr + rm[None, :].to(tl.int64) * stride_xm
    xs_base = xs_ptr + rm.to(tl.int64) * stride_xsm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, _BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            kb = k0 + u * _BLOCK
            w = tl.load(w_base + (kb + rk)[None, :], mask=n_ok[:, None], other=0)            # [BLOCK_N, 32] codes
            x = tl.load(x_base + (kb + rk)[:, None], mask=m_ok[None, :], other=0)            # [32, BLOCK_M] codes
            ew = tl.load(ws_base + kb // _BLOCK, mask=n_ok, other=_E8M0_ONE)
            ex = tl.load(xs_base + kb // _BLOCK, mask=m_ok, other=_E8M0_ONE)
            if HW:
                if MMA_BF16:      # the control: codes -> bf16 (exact), BF16 MMA, FP32 partial sums of exact products
                    part = tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16),
                                  x.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16))
                else:             # FP8 MMA on the codes
                    part = tl.dot(w.to(tl.float8e4nv, bitcast=True), x.to(tl.float8e4nv, bitcast=True))
            else:                 # the interpreter: fp32 holds the same exact values
                part = tl.dot(_e4m3_to_f32(w, HW), _e4m3_to_f32(x, HW))
            acc += part * (_e8m0_to_f32(ew)[:, None] * _e8m0_to_f32(ex)[None, :])   # powers of two: exact
    y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    if OUT_F32:
        tl.store(y_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        if HW:
            out = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            out = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
        tl.store(y_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])


def fp8p_gemm(xq, xs, wq, ws, config, mma="fp8", out_f32=False):
    """``dequant(xq, xs) @ dequant(wq, ws)^T`` (bf16, or fp32 with ``out_f32``); codes uint8 or e4m3,
    scales uint8 (rows, K/32).  config = (BLOCK_N, BLOCK_M, UNROLL, warps, stages)."""
    m, k = xq.shape
    n = wq.shape[0]
    bn, bm, unroll, warps, stages = config
    if k % (F.BLOCK_SIZE * unroll):
        raise ValueError(f"K={k} is not a multiple of 32 * UNROLL")
    y = torch.empty((m, n), dtype=torch.float32 if out_f32 else torch.bfloat16, device=xq.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8p_kernel[grid](xq.view(torch.uint8), xs, wq.view(torch.uint8), ws, y if out_f32 else y.view(torch.int16),
                       m, n, k, xq.stride(0), xs.stride(0), wq.stride(0), ws.stride(0), y.stride(0),
                       BLOCK_N=bn, BLOCK_M=bm, UNROLL=unroll, MMA_BF16=(mma == "bf16"), OUT_F32=out_f32,
                       HW=not interpreting(), num_warps=warps, num_stages=stages)
    return y


def check_interpreter() -> None:
    """Bit equality under TRITON_INTERPRET=1 on sums that are exact in any order (small integers times
    powers of two), with scale bytes of both operands varying per block, and masked edges."""
    from mxfp8_learner_grid.common import dequantize_blocks
    g = torch.Generator().manual_seed(0)
    for (m, n, k, cfg) in ((5, 40, 128, (32, 16, 2, 4, 1)), (17, 33, 256, (32, 16, 1, 4, 1))):
        wq = torch.randint(-8, 9, (n, k), generator=g).float().to(torch.float8_e4m3fn)
        ws = torch.randint(120, 134, (n, k // 32), generator=g, dtype=torch.uint8)
        xq = torch.randint(-8, 9, (m, k), generator=g).float().to(torch.float8_e4m3fn)
        xs = torch.randint(118, 130, (m, k // 32), generator=g, dtype=torch.uint8)
        exact = dequantize_blocks(xq, xs).double() @ dequantize_blocks(wq, ws).double().T
        y = fp8p_gemm(xq, xs, wq, ws, cfg)
        assert torch.equal(y.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16)), (m, n, k, cfg)
        xs2, ws2 = xs.clamp(125, 129), ws.clamp(125, 129)     # FP32 holds these sums exactly, in any order
        exact2 = dequantize_blocks(xq, xs2).double() @ dequantize_blocks(wq, ws2).double().T
        y32 = fp8p_gemm(xq, xs2, wq, ws2, cfg, out_f32=True)
        assert torch.equal(y32.double(), exact2), (m, n, k, cfg)
    # the probe's accounting on a case it can compute by hand: a result off by 2 units is reported so
    p = torch.tensor([[1.0, 2.0 ** -20]], dtype=torch.float64)
    st = block_stats(torch.tensor([1.0], dtype=torch.float32), p.sum(1), p.abs().sum(1), p.abs().amax(1))
    assert st["share_equal"] == 0.0 and st["max_err_u"] > 1.0, st
    print("INTERPRETER_OK", flush=True)


def block_stats(y32, exact, abs_sum, abs_max) -> dict:
    """Compare FP32 results of 32-term dots with their exact sums (float64)."""
    err = (y32.double() - exact).abs()
    u = abs_sum * 2.0 ** -24
    ok = u > 0
    r = torch.where(ok, err / u.clamp_min(1e-300), torch.zeros_like(err))
    rel_max = torch.where(abs_max > 0, err / abs_max.clamp_min(1e-300), torch.zeros_like(err))
    return {"n": int(y32.numel()), "share_equal": round(float((y32.double() == exact.float().double()).double().mean()), 6),
            "max_err_u": float(r.max()), "p99_err_u": float(r.float().quantile(0.99)) if r.numel() else 0.0,
            "share_over_31u": round(float((r > 31).double().mean()), 6),
            "max_err_over_max_term_log2": (float(torch.log2(rel_max.max())) if float(rel_max.max()) > 0 else None)}


def probe(dev, out, meta, n_tiles=8):
    """32-term dots through one MMA: the FP8 MMA against the BF16 control against the exact sum."""
    from mxfp8_learner_grid.common import quantize_rows
    g = torch.Generator(device=dev).manual_seed(1)
    rows = 128 * n_tiles
    finite = torch.tensor([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=torch.uint8, device=dev)
    for dist in ("gaussian_rows", "uniform_bytes"):
        if dist == "gaussian_rows":
            wq, _ = quantize_rows(torch.randn(rows, 32, device=dev, generator=g))
            xq, _ = quantize_rows(torch.randn(rows, 32, device=dev, generator=g))
        else:
            wq = finite[torch.randint(0, finite.numel(), (rows, 32), device=dev, generator=g)].view(F.FP8_DTYPE)
            xq = finite[torch.randint(0, finite.numel(), (rows, 32), device=dev, generator=g)].view(F.FP8_DTYPE)
        one = torch.full((rows, 1), F.E8M0_BIAS, dtype=torch.uint8, device=dev)
        wd, xd = wq.double(), xq.double()
        exact = xd @ wd.T                                                     # [rows, rows] exact (<= 2^-18 .. 2^17)
        abs_sum = xd.abs() @ wd.abs().T
        abs_max = (xd.abs()[:, None, :] * wd.abs()[None, :, :]).amax(-1)
        for mma in ("fp8", "bf16"):
            for cfg in ((128, 64, 1, 4, 2), (64, 16, 1, 4, 2)):
                y32 = fp8p_gemm(xq, one, wq, one, cfg, mma=mma, out_f32=True)
                st = block_stats(y32, exact, abs_sum, abs_max)
                rec = dict(meta, kind="probe", dist=dist, mma=mma, config=",".join(map(str, cfg)), **st)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"PROBE {dist:13s} mma={mma:4s} cfg={cfg}: equal {st['share_equal']:.4f} "
                      f"max err {st['max_err_u']:.3g} u p99 {st['p99_err_u']:.3g} u >31u {st['share_over_31u']:.4f} "
                      f"log2(max err / max term) {st['max_err_over_max_term_log2']}", flush=True)


def gemm_stats(y, xq, xs, wq, ws, rows=256) -> dict:
    from mxfp8_learner_grid.common import dequantize_blocks
    xg = dequantize_blocks(xq[:rows], xs[:rows]).double()
    wg = dequantize_blocks(wq, ws).double()
    exact = xg @ wg.T
    ref = exact.to(torch.bfloat16)
    yy = y[:rows]
    eq = float((yy.view(torch.int16) == ref.view(torch.int16)).double().mean())
    steps = (yy.float().view(torch.int32).long() - ref.float().view(torch.int32).long()).abs() >> 16
    ulp = (ref.float().abs().clamp_min(2.0 ** -126).double() * 2.0 ** -7)
    bound = ulp / 2 + xg.shape[1] * 2.0 ** -24 * (xg.abs() @ wg.abs().T)
    over = float(((yy.double() - exact).abs() > bound).double().mean())
    return {"share_equal": round(eq, 6), "max_steps": int(steps.max()), "share_over_fp32_bound": round(over, 6)}


def configs(m):
    if m <= 64:
        bm = max(16, m)
        return [(bn, bm, un, 4, st) for bn in (64, 128) for un in (1, 4) for st in (3, 4)]
    bm = 64 if m <= 256 else 128
    return [(128, bm, un, 8, st) for un in (1, 2, 4) for st in (3, 4)] + [(128, 128 if m > 256 else 64, 2, 4, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8p.jsonl")
    ap.add_argument("--shapes", default="8b.qkv,8b.o,8b.gate_up,8b.down")
    ap.add_argument("--ms", default="16,64,256,2048,8192")
    ap.add_argument("--check-interpreter", action="store_true")
    ap.add_argument("--probe-only", action="store_true")
    args = ap.parse_args()
    if args.check_interpreter:
        check_interpreter()
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_fast_path import SHAPES, commit, make_layer, time_arms, weight_copies

    from mxfp8_learner_grid.common.kernels.quantize_triton import quantize_rows_triton
    meta = {"date": __import__("datetime").date.today().isoformat(), "commit": commit(),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    out = open(args.out, "w")
    probe("cuda", out, meta)
    if args.probe_only:
        return
    try:
        from mxfp8_learner_grid.vllm_plugin import compat
        compat.register_kernel_providers()
        have_marlin = True
    except Exception as exc:
        print(f"no Marlin arm ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
        have_marlin = False
    total: dict = {}
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        raw, wb = weight_copies(n, k)
        lays = [make_layer(n, k, i, 256) for i in range(len(raw))] if have_marlin else []
        # rowwise FP8 off the grid: per-row amax scales of the same weights
        w8 = []
        for w in wb:
            sw = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
            w8.append(((w.float() / sw).to(torch.float8_e4m3fn), sw.T.contiguous()))
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows_triton(x)
            sx = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
            x8 = (x.float() / sx).to(torch.float8_e4m3fn)
            arms = {"bf16": [lambda w=w: torch.mm(x, w.T) for w in wb],
                    "scaled_mm_rowwise": [lambda q=q, s=s: torch._scaled_mm(x8, q.T, scale_a=sx, scale_b=s,
                                                                            out_dtype=torch.bfloat16)
                                          for q, s in w8]}
            if lays:
                arms["grid_shipped"] = [lambda l=l: l.grid_kernel.apply(l, x) for l in lays]
            for mma in ("fp8", "bf16"):
                for cfg in configs(m):
                    if k % (32 * cfg[2]):
                        continue
                    name = f"{mma}p:" + ",".join(map(str, cfg))
                    try:
                        y = fp8p_gemm(xq, xs, raw[0][0], raw[0][1], cfg, mma=mma)
                        st = gemm_stats(y, xq, xs, raw[0][0], raw[0][1])
                    except Exception as exc:
                        print(f"{sname} M={m} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                        continue
                    out.write(json.dumps(dict(meta, kind="exact", shape=sname, n=n, k=k, m=m, arm=name, **st)) + "\n")
                    if (mma, cfg) == ("fp8", configs(m)[0]) or (mma, cfg) == ("bf16", configs(m)[0]):
                        print(f"EXACT {sname} M={m} {name}: {st}", flush=True)
                    arms[name] = [lambda q=q, s=s, cfg=cfg, mma=mma: fp8p_gemm(*quantize_rows_triton(x), q, s, cfg,
                                                                               mma=mma) for q, s in raw]
            us = time_arms(arms, f"{sname} M={m}")
            for arm, t in us.items():
                out.write(json.dumps(dict(meta, kind="time", shape=sname, n=n, k=k, m=m, arm=arm, us=round(t, 2),
                                          vs_bf16=round(us["bf16"] / t, 3))) + "\n")
            out.flush()
            best = {}
            for mma in ("fp8p", "bf16p"):
                pv = {a: t for a, t in us.items() if a.startswith(mma + ":")}
                best[mma] = min(pv, key=pv.get) if pv else None
                if best[mma]:
                    total[(m, mma)] = total.get((m, mma), 0.0) + pv[best[mma]]
            for arm in ("bf16", "grid_shipped", "scaled_mm_rowwise"):
                total[(m, arm)] = total.get((m, arm), 0.0) + us.get(arm, 0.0)
            print(f"{sname:11s} M={m:5d} bf16 {us['bf16']:.1f} grid {us.get('grid_shipped', 0):.1f} "
                  f"scaled_mm {us.get('scaled_mm_rowwise', 0):.1f} best fp8p {best['fp8p']} "
                  f"{us.get(best['fp8p'], 0):.1f} best bf16p {best['bf16p']} {us.get(best['bf16p'], 0):.1f} us",
                  flush=True)
        del lays, wb, raw, w8
        torch.cuda.empty_cache()
    for m in sorted({m for m, _ in total}):
        t = {a: total.get((m, a), 0.0) for a in ("bf16", "grid_shipped", "scaled_mm_rowwise", "fp8p", "bf16p")}
        print(f"FP8P_SUM M={m}: " + " ".join(f"{a} {v:.1f}" for a, v in t.items()) + " us; vs bf16: "
              + " ".join(f"{a} {t['bf16'] / v:.2f}x" for a, v in t.items() if v), flush=True)


if __name__ == "__main__":
    main()
