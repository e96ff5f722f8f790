"""Kernel-level: one on-grid MoE layer (Qwen3-30B-A3B shape) against vLLM's BF16 fused experts, per M (issue #11).

    python benchmarks/bench_moe.py --out moe.jsonl [--ms 1,16,64,...] [--experts 128 --hidden 2048 --inter 768 --topk 8]

Arms, each the whole expert computation as the engine calls it (router outside, bf16 in and out):

  bf16        vLLM's ``fused_experts`` (Triton, BF16 weights) -- the baseline of every ratio
  grid        ours: qdq(x) + Marlin MoE + the Triton glue (kernels/moe_triton.py)
  grid_torch  ours with the glue as torch ops (the previous path, ``moe_marlin_torch_glue``)
  grid_gemv   ours with option moe_gemv_slots: quantize + the expert GEMV + SiLU*up qdq + GEMV + FP32 combine
              (``grid_kernels/moe_gemv.moe_decode_gemv``), M * topk <= 1024
  triton      the project's Triton grouped-GEMM path (SGLang's MoE kernel, ``ops.grid_moe``)

``--gemv-out F`` writes ``{"moe_gemv_slots": S}``: S = M * topk of the largest measured M such that
grid_gemv beats grid at every measured M up to it.

Timing as bench_fast_path.py: every arm captured in one CUDA graph over several weight copies
(so that the routed experts' weights cannot stay in L2), replayed with
``triton.testing.do_bench_cudagraph``; us per layer = replay time / copies.  The router's top-k
is drawn once per M (softmax of random logits), the same for every arm.  The two grid arms are
checked against each other (equal up to the FP32 order of the top-k sum) before they count.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from bench_fast_path import commit, time_graph

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.grid_kernels import LayerSpec, choose, providers
from mxfp8_learner_grid.common.grid_kernels.marlin_moe import moe_marlin_torch_glue


def make_layer(e, h, i, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    layer = torch.nn.Module()
    bf = {}
    for name, shape in (("w13", (e, 2 * i, h)), ("w2", (e, h, i))):
        w = torch.randn(*shape, device="cuda", generator=g) * 0.03
        q, s = quantize_rows(w)
        bf[name] = w.to(torch.bfloat16)
        setattr(layer, f"{name}_weight", torch.nn.Parameter(q, requires_grad=False))
        setattr(layer, f"{name}_weight_scale_inv", torch.nn.Parameter(s, requires_grad=False))
    spec = LayerSpec(prefix="moe", kind="moe", device_type="cuda", act_dtype=torch.bfloat16, n=2 * i, k=h,
                     intermediate=i, num_experts=e, capability=torch.cuda.get_device_capability())
    layer.grid_kernel = choose(spec)
    layer.grid_kernel.process_weights_after_loading(layer)
    return layer, bf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe.jsonl")
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--arms", default="", help="only these arms (comma-separated; default all)")
    ap.add_argument("--gemv-out", default="")
    args = ap.parse_args()
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()
    assert providers.get("marlin") is not None, "vLLM's Marlin ops are needed"
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from mxfp8_learner_grid.common.grid_kernels.moe_gemv import moe_decode_gemv
    from mxfp8_learner_grid.common.ops import moe_reference, local_expert_ids
    gemv_slots, gemv_wins = 0, True
    e, h, i, topk = args.experts, args.hidden, args.inter, args.topk
    layers = [make_layer(e, h, i, s) for s in range(args.copies)]
    meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "shape": f"moe_e{e}_h{h}_i{i}_top{topk}"}
    out = open(args.out, "w")
    for m in map(int, args.ms.split(",")):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = torch.topk(torch.softmax(torch.randn(m, e, device="cuda", generator=g), -1), topk)
        w, ids = (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
        lay = layers[0][0]
        y = lay.grid_kernel.apply(lay, x, w, ids, None)
        yt = moe_marlin_torch_glue(x, lay.grid_marlin_w13, lay.grid_marlin_w13_scale, lay.grid_marlin_w2,
                                   lay.grid_marlin_w2_scale, lay.grid_marlin_workspace, w, ids, None, e, i)
        # equal up to the FP32 order of the top-k sum (see tests/gpu/test_fast_path.py)
        err = (y.float() - yt.float()).abs()
        bound = yt.float().abs() * 2.0 ** -7 + yt.float().abs().amax(-1, keepdim=True) * 2.0 ** -16
        eq = (y.view(torch.int16) == yt.view(torch.int16)).float().mean().item()
        assert eq >= 0.999 and bool((err <= bound).all()), f"M={m}: Triton glue vs torch glue: {eq:.5f} equal"
        gemv_ok = m * topk <= 1024
        if gemv_ok:     # the expert GEMV path against the per-expert reference before it counts
            yg = moe_decode_gemv(x, lay.w13_weight, lay.w13_weight_scale_inv, lay.w2_weight, lay.w2_weight_scale_inv,
                                 w, ids, None, i)
            ref = moe_reference(x, lay.w13_weight, lay.w13_weight_scale_inv, lay.w2_weight, lay.w2_weight_scale_inv,
                                w, local_expert_ids(ids, None))
            rel = ((yg.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
            assert rel < 2e-3, f"M={m}: expert GEMV vs reference: relative error {rel:.2e}"
        arms = {
            "bf16": [lambda bf=bf: fused_experts(x, bf["w13"], bf["w2"], w, ids) for _, bf in layers],
            "grid": [lambda l=l: l.grid_kernel.apply(l, x, w, ids, None) for l, _ in layers],
            "grid_torch": [lambda l=l: moe_marlin_torch_glue(x, l.grid_marlin_w13, l.grid_marlin_w13_scale,
                                                             l.grid_marlin_w2, l.grid_marlin_w2_scale,
                                                             l.grid_marlin_workspace, w, ids, None, e, i)
                           for l, _ in layers],
            "grid_gemv": [lambda l=l: moe_decode_gemv(x, l.w13_weight, l.w13_weight_scale_inv, l.w2_weight,
                                                      l.w2_weight_scale_inv, w, ids, None, i) for l, _ in layers],
            "triton": [lambda l=l: torch.ops.mxfp8_learner_grid.moe(x, l.w13_weight, l.w13_weight_scale_inv, l.w2_weight,
                                                                    l.w2_weight_scale_inv, w, ids, None)
                       for l, _ in layers],
        }
        if not gemv_ok:
            arms.pop("grid_gemv")
        if args.arms:
            keep = set(args.arms.split(",")) | {"bf16"}
            arms = {a: f for a, f in arms.items() if a in keep}
        us = {}
        for arm, fns in arms.items():
            try:
                us[arm] = time_graph(fns)
            except Exception as exc:
                us[arm] = None
                print(f"M={m} {arm}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        for arm, t in us.items():
            rec = dict(meta, m=m, arm=arm, us=None if t is None else round(t, 2),
                       vs_bf16=None if not (t and us.get("bf16")) else round(us["bf16"] / t, 3))
            out.write(json.dumps(rec) + "\n")
        out.flush()
        print(f"MoE M={m:5d} " + " ".join(f"{a}={t:.1f}us" if t else f"{a}=-" for a, t in us.items())
              + "  | " + " ".join(f"{a} x{us['bf16'] / us[a]:.2f}" for a in ("grid", "grid_gemv", "triton")
                                  if us.get("bf16") and us.get(a)), flush=True)
        if gemv_wins and us.get("grid_gemv") and us.get("grid") and us["grid_gemv"] < us["grid"]:
            gemv_slots = m * topk
        else:
            gemv_wins = False
    print(f"MOE_GEMV_SLOTS {gemv_slots}", flush=True)
    if args.gemv_out:
        with open(args.gemv_out, "w") as f:
            json.dump({"moe_gemv_slots": gemv_slots}, f)


if __name__ == "__main__":
    main()
