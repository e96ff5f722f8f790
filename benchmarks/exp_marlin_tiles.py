"""Experiment: Marlin MoE's launch knobs at decode sizes, for the MoE layers and for dense layers run as one
expert (issue #11).

    python benchmarks/exp_marlin_tiles.py --out tiles.jsonl [--parts moe,dense] [--budget-s 300] [--table-out F]

vLLM 0.26.0's dense ``marlin_gemm`` chooses its thread tile itself (no arguments for it), while
``moe_wna16_marlin_gemm`` takes ``moe_block_size``, ``thread_k``, ``thread_n`` and ``blocks_per_sm``.
Both are the same Marlin template (FP32 accumulation; here FP32 global reduction, no atomics), so:

* ``moe``: the Qwen3-30B-A3B experts (128 x H 2048 x I 768, top-8), M = 1, 4, 16, 64 tokens.  Each
  expert GEMM (w13: M rows x top-k, w2: M x top-k rows) is timed at every token block, vLLM's (what the
  grid runs by default) among them; the block with the least w13 + w2 time is the layer's (both GEMMs
  share one alignment); at that block, each GEMM with explicit tiles and ``blocks_per_sm``;
* ``dense``: each Qwen3-8B projection as a one-expert MoE (``topk_ids`` all 0, block size 16 ... 64) with
  the same knobs, against the dense ``marlin_gemm`` (the grid's kernel below the crossover) and
  ``torch.mm`` in BF16 at M = 16 ... 192.

``--table-out F`` writes ``{"marlin_configs": rows}`` (``grid_kernels/marlin_launch.py``): per measured M,
the band from the previous measured M (exclusive) to it, where the best launch beats the default by 5 %
(MoE: w13 + w2) or 3 % (dense: against the dense ``marlin_gemm``).

A config counts only if its output is on the grid: at least 99 % of the elements equal the exact result
(float64 sum of the grid values) rounded once to bf16, and none is more than one bf16 ulp plus the FP32
bound away.  A config the op refuses is printed and skipped.  Timing: CUDA graphs over weight copies that
do not fit in L2 (as ``bench_fast_path.py``), us per call.  The activation qdq is not in any arm (it is
the same launch for all of them; ``qdq`` is printed per M for reference).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from bench_fast_path import L2_BYTES, SHAPES, commit, time_graph

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
from mxfp8_learner_grid.common.grid_kernels import providers
from mxfp8_learner_grid.common.grid_kernels.marlin import marlin_scales, marlin_weight, one_expert_gemm
from mxfp8_learner_grid.common.grid_kernels.marlin_launch import BLOCKS, TILES
from mxfp8_learner_grid.common.grid_kernels.marlin_moe import _align, block_size_m

BPS = (-1, 1, 2, 4)


def align(ops, ids, bs, e):
    """The layer's own token alignment (deterministic)."""
    return _align(ops, ids, bs, e, e, None)


def check(y, ref, what):
    """On the grid: >= 99 % equal to the exact result rounded once, none beyond 1 ulp + the FP32 bound."""
    r = ref.to(torch.bfloat16)
    eq = (y.view(torch.int16) == r.view(torch.int16)).float().mean().item()
    err = (y.double() - ref).abs()
    bound = r.double().abs() * 2.0 ** -7 + ref.abs().amax() * 2.0 ** -20
    if eq < 0.99 or not bool((err <= bound).all()):
        raise AssertionError(f"{what}: off the grid ({eq:.4f} equal)")
    return eq


class Budget:
    def __init__(self, seconds):
        self.end = time.time() + seconds

    def left(self):
        return self.end - time.time()


def sweep(label, fns_of, check_of, budget, out, meta, base_key, extra):
    """Time each config (a key -> list of calls) that passes its check; returns {key: us}."""
    us = {}
    for key, fns in fns_of.items():
        if budget.left() < 5:
            print(f"{label}: budget spent, {key} and later not timed", flush=True)
            break
        try:
            eq = check_of(key)
            us[key] = time_graph(fns)
        except Exception as exc:
            print(f"{label} {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
            continue
        out.write(json.dumps({**meta, **extra, "config": key, "us": round(us[key], 2), "equal": round(eq, 5)}) + "\n")
        out.flush()
    if base_key in us:
        best = min(us, key=us.get)
        print(f"{label}: base {base_key} {us[base_key]:.1f} us; best {best} {us[best]:.1f} us "
              f"({us[base_key] / us[best]:.2f}x)", flush=True)
    return us


def moe_part(ops, args, budget, out, meta, table):
    e, h, i, topk = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    copies = []
    for c in range(args.copies):
        lay = {}
        for name, shape in (("w13", (e, 2 * i, h)), ("w2", (e, h, i))):
            q, s = quantize_rows(torch.randn(*shape, device="cuda", generator=g) * 0.03)
            lay[name] = (q, s, torch.stack([marlin_weight(ops, q[j]) for j in range(e)]),
                         torch.stack([marlin_scales(s[j]) for j in range(e)]))
        copies.append(lay)
    ws = ops.workspace(torch.device("cuda"), 4)
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    prev = 0
    for m in map(int, args.moe_ms.split(",")):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ids = torch.topk(torch.softmax(torch.randn(m, e, device="cuda", generator=g), -1), topk)
        tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
        a = qdq_rows(x, torch.bfloat16)
        act = qdq_rows(torch.randn(m * topk, i, device="cuda", dtype=torch.bfloat16, generator=g), torch.bfloat16)
        slots = ids.reshape(-1).long()
        base_bs = block_size_m(m, topk, e, e)
        aligned = {bs: align(ops, ids, bs, e) for bs in BLOCKS}
        gemms = {"w13": (a, m, 2 * i, h, topk), "w2": (act, m * topk, h, i, 1)}
        refs = {}
        for gemm, (inp, size_m, n, k, top_k) in gemms.items():
            q0, s0 = copies[0][gemm][0], copies[0][gemm][1]
            ref = torch.empty(m * topk, n, dtype=torch.float64, device="cuda")
            rows = inp.double() if gemm == "w2" else inp.double().repeat_interleave(topk, 0)
            for ex in slots.unique().tolist():
                sel = (slots == ex).nonzero().squeeze(1)
                ref[sel] = rows[sel] @ dequantize_blocks(q0[ex], s0[ex]).double().t()
            refs[gemm] = ref

        def calls(gemm, bs, tk=-1, tn=-1, bps=-1):
            inp, size_m, n, k, top_k = gemms[gemm]
            si, ei, nt = aligned[bs]
            return [lambda c=c: ops.moe_gemm(inp, c[gemm][2], c[gemm][3], ws, si, ei, nt, tw, bs, top_k,
                                             size_m, n, k, tk, tn, bps) for c in copies]

        def checker(gemm):
            n = gemms[gemm][2]
            return lambda key: check(calls(gemm, *key)[0]().view(m * topk, n), refs[gemm], f"moe {gemm} M={m} {key}")

        print(f"moe M={m}: vLLM's block size {base_bs}", flush=True)
        base = (base_bs, -1, -1, -1)
        # the token block is the layer's (both GEMMs share one alignment): chosen on the sum
        by_bs = {gemm: sweep(f"moe {gemm} M={m}", {(bs, -1, -1, -1): calls(gemm, bs) for bs in BLOCKS}, checker(gemm),
                             budget, out, meta, base, {"part": "moe", "gemm": gemm, "m": m, "base_bs": base_bs})
                 for gemm in gemms}
        both = [bs for bs in BLOCKS if all((bs, -1, -1, -1) in by_bs[gm] for gm in gemms)]
        if base_bs not in both:
            prev = m
            continue
        total = {bs: sum(by_bs[gm][(bs, -1, -1, -1)] for gm in gemms) for bs in both}
        best_bs = min(total, key=total.get)
        best = {}
        for gemm in gemms:
            keys = {(best_bs, tk, tn, bps): calls(gemm, best_bs, tk, tn, bps) for tk, tn in TILES for bps in BPS
                    if (tk, tn, bps) != (-1, -1, -1)}
            us = sweep(f"moe {gemm} M={m} tiles at block {best_bs}", keys, checker(gemm), budget, out, meta, None,
                       {"part": "moe", "gemm": gemm, "m": m, "base_bs": base_bs})
            us[(best_bs, -1, -1, -1)] = by_bs[gemm][(best_bs, -1, -1, -1)]
            best[gemm] = min(us, key=us.get), min(us.values())
        tuned = sum(t for _, t in best.values())
        print(f"moe M={m}: vLLM's launch {total[base_bs]:.1f} us (w13 + w2), best {tuned:.1f} us "
              f"({total[base_bs] / tuned:.2f}x): {best['w13'][0]} / {best['w2'][0]}", flush=True)
        if tuned < 0.95 * total[base_bs]:
            for gemm, (key, _) in best.items():
                n, k = gemms[gemm][2], gemms[gemm][3]
                table.append([n, k, prev + 1, m + 1, *key])
        prev = m


def dense_part(ops, args, budget, out, meta, table):
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    ws = ops.workspace(torch.device("cuda"), 4)
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        ncopy = max(2, min(16, -(-L2_BYTES // (n * k * 2))))
        g = torch.Generator(device="cuda").manual_seed(1)
        lays = []
        for c in range(ncopy):
            q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
            lays.append((q, s, marlin_weight(ops, q), marlin_scales(s), dequantize_blocks(q, s).to(torch.bfloat16)))
        prev = 16
        for m in map(int, args.dense_ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            a = qdq_rows(x, torch.bfloat16)
            ref = a.double() @ dequantize_blocks(lays[0][0], lays[0][1]).double().t()
            label = f"dense {sname} M={m}"
            base = {"bf16": [lambda l=l: torch.mm(x, l[4].t()) for l in lays],
                    "qdq": [lambda: qdq_rows(x, torch.bfloat16)] * ncopy,
                    "marlin": [lambda l=l: ops.gemm(a, l[2], l[3], ws, n, k) for l in lays]}
            us0 = {}
            for key, fns in base.items():
                if key == "marlin":
                    check(fns[0](), ref, label + " marlin")
                us0[key] = time_graph(fns)
                out.write(json.dumps({**meta, "part": "dense", "shape": sname, "m": m, "config": key,
                                      "us": round(us0[key], 2)}) + "\n")
            print(f"{label}: bf16 {us0['bf16']:.1f} us, qdq {us0['qdq']:.1f}, dense marlin {us0['marlin']:.1f}",
                  flush=True)

            def calls(bs, tk=-1, tn=-1, bps=-1):      # the shipped path (option marlin_configs)
                return [lambda l=l: one_expert_gemm(a, l[2], l[3], ws, n, k, bs, tk, tn, bps) for l in lays]

            def check_of(key):
                return check(calls(*key)[0]().view(m, n), ref, f"{label} {key}")

            keys = {(bs, tk, tn, bps): calls(bs, tk, tn, bps) for bs in (16, 32, 64) for tk, tn in TILES
                    for bps in (-1, 2)}
            us = sweep(label + " as one expert", keys, check_of, budget, out, meta, None,
                       {"part": "dense", "shape": sname, "m": m})
            if us:
                best = min(us, key=us.get)
                print(f"{label}: best one-expert {best} {us[best]:.1f} us = {us0['marlin'] / us[best]:.2f}x dense "
                      f"marlin, {us0['bf16'] / (us[best] + us0['qdq']):.2f}x bf16 with the qdq", flush=True)
                if us[best] < 0.97 * us0["marlin"]:
                    table.append([n, k, prev + 1, m + 1, *best])
            prev = m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tiles.jsonl")
    ap.add_argument("--parts", default="moe,dense")
    ap.add_argument("--moe-ms", default="1,4,16,64")
    ap.add_argument("--shapes", default="8b.qkv,8b.o,8b.gate_up,8b.down")
    ap.add_argument("--dense-ms", default="32,64,128")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--table-out", default="", help="write {'marlin_configs': rows} for `e2e ... grid+ ... F`")
    args = ap.parse_args()
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()          # vLLM's env (SGLang's: the ops alone, $MXFP8_GRID_VLLM_OPS)
    if providers.get("marlin") is None:
        from mxfp8_learner_grid.vllm_plugin import marlin_ops
        marlin_ops.register_provider("experiment")
    ops = providers.get("marlin")
    assert ops is not None and hasattr(ops, "moe_gemm"), "vLLM's Marlin (dense and MoE) ops are needed"
    meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "experiment": "marlin_tiles"}
    budget = Budget(args.budget_s)
    table = []
    with open(args.out, "w") as out:
        for part in args.parts.split(","):
            {"moe": moe_part, "dense": dense_part}[part](ops, args, budget, out, meta, table)
    from mxfp8_learner_grid.common.grid_kernels.marlin_launch import parse_rows
    parse_rows(table)
    print(f"TILES_TABLE {json.dumps({'marlin_configs': table})}", flush=True)
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump({"marlin_configs": table}, f)


if __name__ == "__main__":
    main()
