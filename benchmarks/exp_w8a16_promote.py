"""Experiment (benchmark only, not shipped): a W8A16 GEMM that applies the E8M0 scales to FP32 partial
sums, once per 32-block, instead of to every decoded weight.

    python benchmarks/exp_w8a16_promote.py --out $OUT/w8a16p.jsonl [--ms 16,32,64,128] [--shapes 8b.qkv,...]

Why.  The shipped W8A16 kernel (``common/kernels/w8a16_triton.py``) decodes every weight as
fp32(code) * 2^(e-127) -> bf16 with the scale broadcast over its 32-block (a reshape the compiler
turns into a layout shuffle), and measured slower than Marlin at every M.  Here each K step of 32
decodes the codes alone (E4M3 -> bf16, one exact conversion), runs one BF16 MMA over the block
(``y^T = W x^T``: weight rows on the MMA's 64-row side), and adds the FP32 partial sum times the
block's scale to the accumulator: ``acc += dot(q_b, x_b) * 2^(e_b-127)``.

Exactness.  The codes and ``x_grid = qdq(x)`` are exact in bf16; every product is exact in the
FP32 MMA; a partial sum times a power of two is exact (no overflow or underflow for scale bytes
>= 3, which the layer checks at load); so the result is the same FP32 sum of exact products as
the shipped kernels', in another order, rounded once to bf16.  The benchmark checks each config
against the exact result rounded once before it times it (at least 99% of elements equal, none
more than one bf16 step away), and the CPU interpreter checks the kernel bit for bit on inputs
whose sums are exact in any order (``--check-interpreter``).

Arms per (shape, M): ``bf16`` (torch.mm, the baseline), ``grid_marlin`` (qdq + Marlin, the default),
``grid_w8a16`` (the shipped W8A16 kernel, its default config) and ``w8a16p:<config>`` (this one;
config = BLOCK_N, BLOCK_M, SPLIT_K, UNROLL, warps, stages).  Timed as in ``bench_fast_path``
(CUDA graphs over enough weight copies to defeat the L2).
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
from mxfp8_learner_grid.common.kernels.gemm_triton import _e4m3_to_f32, _e8m0_to_f32
from mxfp8_learner_grid.common.kernels.qdq_triton import _f32_bits_to_bf16_bits
from mxfp8_learner_grid.common.kernels.w8a16_triton import _bf16_bits_to_f32, _splitk_sum_kernel

_BLOCK = tl.constexpr(F.BLOCK_SIZE)
_E8M0_ONE = tl.constexpr(F.E8M0_BIAS)


@triton.jit
def _w8a16p_kernel(x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, UNROLL: tl.constexpr,
                   HW: tl.constexpr, DIRECT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    k_split = K // SPLIT_K
    k_begin = pid_k * k_split
    rk = tl.arange(0, _BLOCK)
    q_base = q_ptr + rn[:, None].to(tl.int64) * stride_qn
    s_base = s_ptr + rn.to(tl.int64) * stride_sn
    x_base = x_ptr + rm[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_split, _BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            kb = k0 + u * _BLOCK
            q = tl.load(q_base + (kb + rk)[None, :], mask=n_ok[:, None], other=0)          # [BLOCK_N, 32] codes
            e = tl.load(s_base + kb // _BLOCK, mask=n_ok, other=_E8M0_ONE)                # [BLOCK_N] scale bytes
            h = tl.load(x_base + (kb + rk)[:, None], mask=m_ok[None, :], other=0)          # [32, BLOCK_M]
            if HW:
                c = q.to(tl.float8e4nv, bitcast=True)
                v = c.to(tl.bfloat16) if DIRECT else c.to(tl.float32).to(tl.bfloat16)      # both exact
                part = tl.dot(v, h)
            else:     # the interpreter has no bf16 dot: fp32 holds the same exact values
                part = tl.dot(_e4m3_to_f32(q, HW), _bf16_bits_to_f32(h))
            acc += part * _e8m0_to_f32(e)[:, None]
    if SPLIT_K == 1:
        y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
        if HW:
            out = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            out = _f32_bits_to_bf16_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
        tl.store(y_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])
    else:
        p_ptrs = p_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])


#: E4M3 -> bf16 in one conversion (False: through fp32, if this Triton lacks the direct one)
DIRECT = [True]


def w8a16p_gemm(x_grid, q, s, config, workspace=None):
    """``x_grid @ dequantize_blocks(q, s)^T`` in bf16; config = (BLOCK_N, BLOCK_M, SPLIT_K, UNROLL, warps, stages)."""
    m, k = x_grid.shape
    n = q.shape[0]
    bn, bm, split, unroll, warps, stages = config
    if k % (F.BLOCK_SIZE * unroll * split):
        raise ValueError(f"K={k} is not a multiple of 32 * UNROLL * SPLIT_K")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x_grid.device)
    hw = not interpreting()
    p = y if split == 1 else (workspace if workspace is not None else
                              torch.empty(split * m * n, dtype=torch.float32, device=x_grid.device))
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _w8a16p_kernel[grid](x_grid if hw else x_grid.view(torch.int16), q.view(torch.uint8), s, y.view(torch.int16), p,
                         m, n, k, x_grid.stride(0), q.stride(0), s.stride(0), y.stride(0),
                         BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=split, UNROLL=unroll, HW=hw, DIRECT=DIRECT[0],
                         num_warps=warps, num_stages=stages)
    if split > 1:
        _splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](p, y.view(torch.int16), m * n, SPLIT_K=split, BLOCK=1024,
                                                        HW=hw, num_warps=4)
    return y


def check_interpreter() -> None:
    """Bit equality under TRITON_INTERPRET=1 on sums that are exact in any order (small integers
    times powers of two), every scale byte class the layer admits, and masked edges."""
    from mxfp8_learner_grid.common import dequantize_blocks
    g = torch.Generator().manual_seed(0)
    for (m, n, k, cfg) in ((5, 40, 128, (32, 16, 1, 2, 4, 1)), (17, 33, 256, (32, 16, 2, 1, 4, 1))):
        codes = torch.randint(-8, 9, (n, k), generator=g).float()          # exact small E4M3 values
        q = codes.to(torch.float8_e4m3fn)
        s = torch.randint(120, 134, (n, k // 32), generator=g, dtype=torch.uint8)
        s[0, 0], s[-1, -1] = 3, 140
        x = torch.randint(-4, 5, (m, k), generator=g).float().to(torch.bfloat16)
        ref = (x.double() @ dequantize_blocks(q, s).double().T).to(torch.bfloat16)
        y = w8a16p_gemm(x, q, s, cfg)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (m, n, k, cfg)
    print("INTERPRETER_OK", flush=True)


def configs(m):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    out = []
    for bn, warps in ((64, 4), (128, 8)):
        for split in (1, 2):
            for unroll in (1, 4):
                for stages in (3, 4):
                    out.append((bn, bm, split, unroll, warps, stages))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="w8a16p.jsonl")
    ap.add_argument("--shapes", default="8b.qkv,8b.o,8b.gate_up,8b.down")
    ap.add_argument("--ms", default="16,32,64,128")
    ap.add_argument("--check-interpreter", action="store_true")
    args = ap.parse_args()
    if args.check_interpreter:
        check_interpreter()
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_fast_path import SHAPES, commit, exact_ref, make_layer, on_grid, time_arms, weight_copies

    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    from mxfp8_learner_grid.common.kernels.w8a16_triton import w8a16_gemm
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()
    meta = {"date": __import__("datetime").date.today().isoformat(), "commit": commit(),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    out = open(args.out, "w")
    total: dict = {}
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        raw, wb = weight_copies(n, k)               # the wire bytes of each copy (make_layer's seeds)
        lays = [make_layer(n, k, i, 1 << 30) for i in range(len(raw))]               # Marlin (the default)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xg = qdq_rows(x)
            ref = exact_ref(x, *raw[0])
            ws = torch.empty(2 * m * n, dtype=torch.float32, device="cuda")
            arms = {"bf16": [lambda w=w: torch.mm(x, w.T) for w in wb],
                    "grid_marlin": [lambda l=l: l.grid_kernel.apply(l, x) for l in lays],
                    "grid_w8a16": [lambda q=q, s=s: w8a16_gemm(qdq_rows(x), q, s, workspace=ws) for q, s in raw]}
            for cfg in configs(m):
                if k % (32 * cfg[3] * cfg[2]) or k // cfg[2] < 32 * cfg[3]:
                    continue
                try:
                    try:
                        y = w8a16p_gemm(xg, raw[0][0], raw[0][1], cfg, ws)
                    except Exception as exc:
                        if not DIRECT[0]:
                            raise
                        print(f"direct E4M3 -> bf16 failed ({type(exc).__name__}: {str(exc)[:120]}); via fp32",
                              flush=True)
                        DIRECT[0] = False
                        y = w8a16p_gemm(xg, raw[0][0], raw[0][1], cfg, ws)
                    on_grid(y, ref)
                    far = (y.float() - ref.float()).abs() > ref.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
                    if bool(far.any()):
                        raise AssertionError(f"{int(far.sum())} elements more than one bf16 step from the exact result")
                except Exception as exc:
                    print(f"{sname} M={m} w8a16p {cfg}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                arms["w8a16p:" + ",".join(map(str, cfg))] = [
                    lambda q=q, s=s, cfg=cfg: w8a16p_gemm(qdq_rows(x), q, s, cfg, ws) for q, s in raw]
            us = time_arms(arms, f"{sname} M={m}")
            for arm, t in us.items():
                out.write(json.dumps(dict(meta, shape=sname, n=n, k=k, m=m, arm=arm, us=round(t, 2),
                                          vs_bf16=round(us["bf16"] / t, 3))) + "\n")
            out.flush()
            pv = {a: t for a, t in us.items() if a.startswith("w8a16p:")}
            best = min(pv, key=pv.get) if pv else None
            for arm in ("bf16", "grid_marlin", "grid_w8a16"):
                total[(m, arm)] = total.get((m, arm), 0.0) + us.get(arm, 0.0)
            if best:
                total[(m, "w8a16p_best")] = total.get((m, "w8a16p_best"), 0.0) + pv[best]
            print(f"{sname:11s} M={m:4d} bf16 {us['bf16']:.1f} marlin {us.get('grid_marlin', 0):.1f} "
                  f"w8a16 {us.get('grid_w8a16', 0):.1f} best w8a16p {best} {pv.get(best, 0):.1f} us", flush=True)
        del lays, wb, raw
        torch.cuda.empty_cache()
    for m in sorted({m for m, _ in total}):
        print(f"W8A16P_SUM M={m}: bf16 {total.get((m, 'bf16'), 0):.1f} marlin {total.get((m, 'grid_marlin'), 0):.1f} "
              f"w8a16 {total.get((m, 'grid_w8a16'), 0):.1f} w8a16p(best per shape) "
              f"{total.get((m, 'w8a16p_best'), 0):.1f} us", flush=True)


if __name__ == "__main__":
    main()
