"""Where does the on-grid sampler's remaining mismatch come from?  Per-layer amplification.

    python examples/amplification_study.py --model ../shared/models/qwen3-tiny-moe --out /tmp/amp-moe \
        [--routers model,float32] [--prompts 32] [--prompt-len 128] [--dtype bfloat16]

The same token sequences (windows of this repository's Python source, as in
``consistency_study.py``) go through

* the **sampler**: vLLM with ``--quantization mxfp8-learner-grid`` (one prefill per sequence,
  ``prompt_logprobs``; eager, in-process), with hooks that record every on-grid layer's input
  and every MoE router's logits;
* the **learner**: ``transformers`` + ``apply_learner_grid`` with the same hooks.

Both compute every on-grid GEMM exactly given its input (checked per layer elsewhere), so what
differs is what reaches each layer.  Reported per on-grid layer (dense: the qkv / o / gate_up /
down inputs; MoE: the experts' input):

* ``code_flip``: the share of activation elements whose grid value (E4M3 code times the block's
  power of two, TE's rowwise quantization) differs between sampler and learner;
* ``scale_flip``: the share of 1x32 blocks whose E8M0 scale byte differs;
* ``rel_in``: ||x_sampler - x_learner|| / ||x_learner|| before quantization;

per MoE router: ``topk_flip``, the share of tokens whose top-k expert *set* differs; and per
token (position t predicting token t+1): |Δlogp| and the k3 term, split by whether the expert
set differed at position t in any layer -- the share of the k3 KL those tokens carry.

``--routers model,float32`` runs the study twice: routers in the model dtype on both sides (the
default), and in FP32 on both sides (the engine option ``router_dtype: float32`` and the
learner's ``set_router_dtype``, Megatron's ``moe_router_dtype=fp32``).  Output:
``<out>/amplification.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _dense_key(name: str) -> str:
    """Engine module name -> the learner module whose input it shares (HF names)."""
    name = name.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
    return name[:-len(".routed_experts")] if name.endswith(".routed_experts") else name   # vLLM 0.32's MoE runner


def _router_hook(cap: dict, name: str):
    """A forward hook recording a router's logits (engine and learner alike)."""
    def post(mod, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        cap.setdefault(name, []).append(logits.detach().float().cpu())
    return post


def _install(model, cap: dict) -> int:
    """Forward hooks on every on-grid layer (input) and every MoE router (logits)."""
    from mxfp8_learner_grid.common.router import is_router
    n = 0
    for name, m in model.named_modules():
        kern = getattr(m, "grid_kernel", None)
        if kern is not None:                 # the kernel's own input (fused MoE layers are not always called
            orig = kern.apply                # as modules), as tests/gpu/layer_capture.py records it

            def apply(layer, x, *a, _orig=orig, _name=_dense_key(name), **kw):
                cap.setdefault(_name, []).append(x.detach().reshape(-1, x.shape[-1]).float().cpu())
                return _orig(layer, x, *a, **kw)
            kern.apply = apply
            n += 1
        elif is_router(name) and hasattr(m, "weight"):
            m.register_forward_hook(_router_hook(cap, name))
    return n


def run_engine(model: str, seqs: list, dtype: str, router: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # hooks live in this process
    import torch
    from vllm import LLM, SamplingParams
    opts = {} if router == "model" else {"router_dtype": router}
    llm = LLM(model=model, dtype=dtype, quantization="mxfp8-learner-grid", enforce_eager=True, seed=0,
              max_model_len=max(len(s) for s in seqs) + 8, gpu_memory_utilization=0.3 if torch.cuda.is_available()
              else 0.1, enable_prefix_caching=False,
              hf_overrides={"quantization_config_dict_json": json.dumps(opts)} if opts else None)
    cap: dict = {}
    installed = llm.apply_model(lambda m: _install(m, cap))
    per_seq = []
    for s in seqs:
        cap.clear()
        o = llm.generate([{"prompt_token_ids": s}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                         use_tqdm=False)[0]
        lp = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]
        rec = {k: v[0] for k, v in cap.items() if v and v[0].shape[0] == len(s)}   # the prefill call
        per_seq.append({"lp": lp, "cap": rec})
    torch.save({"installed": installed, "per_seq": per_seq}, out)
    os._exit(0)


def run_learner(model: str, seqs: list, dtype, router: str, device) -> list:
    import torch
    import transformers
    from mxfp8_learner_grid.common.learner import apply_learner_grid, set_router_dtype
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    apply_learner_grid(m)
    if router == "float32":
        set_router_dtype(m, torch.float32)
    cap: dict = {}
    from mxfp8_learner_grid.common.learner import GridExperts, GridLinear
    from mxfp8_learner_grid.common.router import is_router
    for name, mod in m.named_modules():
        if isinstance(mod, (GridLinear, GridExperts)):
            def pre(mod_, args, _name=name):
                cap.setdefault(_name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())
            mod.register_forward_pre_hook(pre)
        elif is_router(name) and hasattr(mod, "weight"):
            mod.register_forward_hook(_router_hook(cap, name))
    per_seq = []
    with torch.no_grad():
        for s in seqs:
            cap.clear()
            ids = torch.tensor([s], device=device)
            lp = torch.log_softmax(m(ids).logits[0].float(), -1)
            lps = [lp[i - 1, s[i]].item() for i in range(1, len(s))]
            per_seq.append({"lp": lps, "cap": {k: v[0] for k, v in cap.items()}})
    return per_seq


def compare(engine: list, learner: list, top_k: int, dtype) -> dict:
    import torch
    from mxfp8_learner_grid.common import quantize_rows
    from mxfp8_learner_grid.common.tensor import dequantize_blocks
    from mxfp8_learner_grid.common.router import is_router
    layers: dict = {}
    routers: dict = {}
    tok = {"d": [], "flag": []}
    for e, l in zip(engine, learner):
        n_tok = len(e["lp"]) + 1
        flag = torch.zeros(n_tok, dtype=torch.bool)
        for name, xe in e["cap"].items():
            xl = l["cap"].get(name)
            if xl is None or xl.shape != xe.shape:
                continue
            if is_router(name):
                se = torch.topk(xe, top_k, dim=-1).indices.sort(-1).values
                sl = torch.topk(xl, top_k, dim=-1).indices.sort(-1).values
                diff = (se != sl).any(-1)
                flag |= diff
                r = routers.setdefault(name, [0, 0])
                r[0] += int(diff.sum())
                r[1] += diff.numel()
                continue
            xe_, xl_ = xe.to(dtype), xl.to(dtype)          # the values the layer quantized
            qe, se_ = quantize_rows(xe_)
            ql, sl_ = quantize_rows(xl_)
            ve, vl = dequantize_blocks(qe, se_), dequantize_blocks(ql, sl_)
            st = layers.setdefault(name, [0, 0, 0, 0, 0.0, 0.0])
            st[0] += int((ve != vl).sum())
            st[1] += ve.numel()
            st[2] += int((se_ != sl_).sum())
            st[3] += se_.numel()
            st[4] += float(((xe_.float() - xl_.float()) ** 2).sum())
            st[5] += float((xl_.float() ** 2).sum())
        d = torch.tensor(e["lp"], dtype=torch.float64) - torch.tensor(l["lp"], dtype=torch.float64)
        tok["d"].append(d)
        tok["flag"].append(flag[:-1])                 # position t predicts token t+1
    d = torch.cat(tok["d"])
    flag = torch.cat(tok["flag"])
    k3 = torch.exp(-d) + d - 1
    out = {
        "layers": {k: {"code_flip": v[0] / v[1], "scale_flip": v[2] / max(v[3], 1),
                       "rel_in": math.sqrt(v[4] / v[5]) if v[5] else 0.0} for k, v in layers.items()},
        "routers": {k: {"topk_flip": v[0] / v[1], "tokens": v[1]} for k, v in routers.items()},
        "tokens": int(d.numel()),
        "kl_k3": float(k3.mean()),
        "abs_diff": float(d.abs().mean()),
    }
    if routers:
        nf = int(flag.sum())
        out.update({
            "tokens_expert_set_differs": nf,
            "share_tokens_expert_set_differs": nf / max(int(flag.numel()), 1),
            "share_k3_from_those_tokens": float(k3[flag].sum() / k3.sum()) if float(k3.sum()) > 0 else 0.0,
            "abs_diff_flagged": float(d[flag].abs().mean()) if nf else 0.0,
            "abs_diff_unflagged": float(d[~flag].abs().mean()) if nf < flag.numel() else 0.0,
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--routers", default="model,float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arm-timeout", type=int, default=400)
    ap.add_argument("--_router", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch
    os.makedirs(args.out, exist_ok=True)
    seq_file = os.path.join(args.out, "sequences.json")
    if args._router:
        return run_engine(args.model, json.load(open(seq_file)), args.dtype, args._router,
                          os.path.join(args.out, f"engine-{args._router}.pt"))
    from consistency_study import prompt_sets
    seqs = prompt_sets(args.model, 1, args.prompts, args.prompt_len)[0]
    json.dump(seqs, open(seq_file, "w"))
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    top_k = int(cfg.get("num_experts_per_tok", 1))
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"model": os.path.abspath(args.model), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "dtype": args.dtype,
              "sequences": len(seqs), "prompt_len": args.prompt_len, "routers": {}, "errors": {}}
    for router in [r for r in args.routers.split(",") if r]:
        if router == "float32" and "num_experts" not in cfg and "num_local_experts" not in cfg:
            continue                                   # a dense model has no router
        try:
            r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--_router", router], capture_output=True,
                               text=True, timeout=args.arm_timeout)
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
        except Exception as exc:                        # noqa: BLE001 -- recorded, the other arm still runs
            report["errors"][router] = str(exc)[-3000:]
            print(f"[{router}] FAILED: {str(exc)[-1500:]}", flush=True)
            continue
        eng = torch.load(os.path.join(args.out, f"engine-{router}.pt"))
        learn = run_learner(args.model, seqs, dtype, router, device)
        res = compare(eng["per_seq"], learn, top_k, dtype)
        res["engine_layers_hooked"] = eng["installed"]
        report["routers"][router] = res
        print(f"\n[router {router}] tokens {res['tokens']}  k3 {res['kl_k3']:.3e}  |dlogp| {res['abs_diff']:.4f}")
        for name, v in res["layers"].items():
            print(f"  {name:42} code_flip {v['code_flip']:.4f}  scale_flip {v['scale_flip']:.4f}  rel_in {v['rel_in']:.2e}")
        for name, v in res["routers"].items():
            print(f"  {name:42} topk_flip {v['topk_flip']:.4f}")
        if res["routers"]:
            print(f"  tokens whose expert set differs: {res['share_tokens_expert_set_differs']:.3f}, carrying "
                  f"{res['share_k3_from_those_tokens']:.3f} of k3; |dlogp| {res['abs_diff_flagged']:.4f} vs "
                  f"{res['abs_diff_unflagged']:.4f}")
    with open(os.path.join(args.out, "amplification.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["routers"] else 1


if __name__ == "__main__":
    sys.exit(main())
