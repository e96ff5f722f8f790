"""The consistency study: does a sampler on the learner's MXFP8 grid agree with the learner better?

    python examples/consistency_study.py --model ../shared/models/qwen3-tiny-dense --out /tmp/study-dense \
        [--arms bf16,grid_half,grid_all,fp8,grid_all_kvfp8] [--sets 3] [--prompts 64] [--max-tokens 64]

Weights are fixed (a trained checkpoint: random weights give flat distributions and
meaningless KL).  For each *arm* a vLLM engine samples completions (temperature 1, the
sampled token's logprob returned); the *learner* -- the same checkpoint in ``transformers``,
its Linear layers computing TE's MXFP8 forward through ``apply_learner_grid`` (the
"MXFP8 learner"), or plain BF16 (the "BF16 learner") -- recomputes the logprob of every
sampled token.  The mismatch metrics of ``common.metrics`` compare the two.

Arms (sampler side; the learner is MXFP8 unless the arm says otherwise):

=================  ===============================================================
``bf16``           vLLM in BF16, no quantization
``grid_half``      ``mxfp8-learner-grid`` on the first half of the decoder layers
``grid_all``       ``mxfp8-learner-grid`` on every Linear / expert
``fp8``            vLLM's own ``--quantization fp8`` (per-tensor FP8, another grid; CUDA only)
``fp8emu_tensor``  another grid, emulated (``common/emulation.py``): per-tensor FP8 W8A8
``fp8emu_block128`` another grid, emulated: 128x128 weight blocks, 1x128 activation groups
``grid_all_kvfp8`` ``grid_all`` + FP8 KV cache, per-layer scales from the learner (amax/448)
``bf16_bf16``      vLLM in BF16 against the BF16 learner (BF16 end to end)
``grid_all_r32``   ``grid_all`` with the MoE routers in FP32 (``router_dtype: float32``), against
                   the MXFP8 learner with FP32 routers (``set_router_dtype``: Megatron's
                   ``moe_router_dtype=fp32``)
``bf16_r32``       vLLM in BF16 against that same FP32-router learner (the baseline of ``grid_all_r32``)
``grid_all_meg``   ``grid_all`` with ``moe_router_weights: activation``, against a learner in Megatron's
                   MoE order (``set_moe_router_weights``: router weights on SiLU*up, before the down
                   projection's quantization, as Megatron's TEGroupedMLP)
``grid_all_vs_meg`` ``grid_all`` (default order) against that Megatron-order learner
``bf16_meg``       vLLM in BF16 against the Megatron-order learner (the baseline of the two above)
=================  ===============================================================

Prompts: windows of this repository's own Python source (the checkpoints were trained on
Python source), tokenized with the model's tokenizer; ``--sets`` disjoint prompt sets with
their own sampling seeds give the spread.  Each arm runs in its own process
(``enforce_eager``; one engine at a time per GPU).  Output: ``<out>/study.json`` (per arm and
set: every metric) and a table on stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

ARMS = {
    "bf16": dict(quant=None, learner="grid"),
    "grid_half": dict(quant="half", learner="grid"),
    "grid_all": dict(quant="all", learner="grid"),
    "fp8": dict(quant="fp8", learner="grid"),
    "grid_all_kvfp8": dict(quant="all", kv="fp8", learner="grid"),
    "fp8emu_tensor": dict(quant="emulate:fp8_per_tensor", learner="grid"),
    "fp8emu_block128": dict(quant="emulate:fp8_block128", learner="grid"),
    "bf16_bf16": dict(quant=None, learner="bf16"),
    "grid_all_r32": dict(quant="all", router="float32", learner="grid_r32"),
    "bf16_r32": dict(quant=None, learner="grid_r32"),
    "grid_all_meg": dict(quant="all", opts={"moe_router_weights": "activation"}, learner="grid_meg"),
    "grid_all_vs_meg": dict(quant="all", learner="grid_meg"),
    "bf16_meg": dict(quant=None, learner="grid_meg"),
}
#: the learner of each ``learner`` mode that is not plain BF16: (router dtype, MoE router-weight order)
LEARNER_MODES = {"grid": (None, "combine"), "grid_r32": ("float32", "combine"), "grid_meg": (None, "activation")}
#: the BF16-sampler arm each learner mode is compared with
BASELINE = {"grid": "bf16", "grid_r32": "bf16_r32", "grid_meg": "bf16_meg", "bf16": "bf16"}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def prompt_sets(model: str, sets: int, n: int, length: int) -> list[list[list[int]]]:
    """``sets`` x ``n`` prompts of ``length`` tokens: windows of this repo's Python files (seeded)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    files = sorted(f for f in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
                   if "/." not in os.path.relpath(f, ROOT))
    ids = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            ids.extend(tok(fh.read())["input_ids"])
    r = random.Random(0)
    starts = r.sample(range(0, len(ids) - length), sets * n)
    return [[ids[s:s + length] for s in starts[i * n:(i + 1) * n]] for i in range(sets)]


def kv_scales_dir(model: str, out: str, prompts: list[list[int]]) -> str:
    """A copy of the checkpoint (symlinks) plus per-layer k/v scales the learner computes:
    ``amax / 448`` over a calibration batch, K measured after its norm as the norm of each
    rotary pair (an upper bound of |K| after RoPE, which rotates pairs)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from mxfp8_learner_grid.common.kv_scales import kv_scale_tensors
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    k_amax, v_amax, hooks = {}, {}, []
    for i, layer in enumerate(m.model.layers):
        att = layer.self_attn

        def kh(mod, inp, outp, i=i):
            half = outp.shape[-1] // 2
            pair = torch.sqrt(outp[..., :half] ** 2 + outp[..., half:] ** 2)
            k_amax[i] = max(k_amax.get(i, 0.0), float(pair.abs().max()))

        def vh(mod, inp, outp, i=i):
            v_amax[i] = max(v_amax.get(i, 0.0), float(outp.abs().max()))
        hooks += [att.k_norm.register_forward_hook(kh), att.v_proj.register_forward_hook(vh)]
    with torch.no_grad():
        for p in prompts:
            m(torch.tensor([p]))
    for h in hooks:
        h.remove()
    d = os.path.join(out, "model-kvscales")
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(model):
        if not os.path.exists(os.path.join(d, f)):
            os.symlink(os.path.abspath(os.path.join(model, f)), os.path.join(d, f))
    save_file(kv_scale_tensors(k_amax, v_amax, margin=1.0), os.path.join(d, "kv_scales.safetensors"))
    return d


def run_arm(arm: str, model: str, sets_file: str, out: str, max_tokens: int, cfg: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams
    spec = ARMS[arm]
    gpu = torch.cuda.is_available()
    num_layers = cfg["num_hidden_layers"]
    kw = dict(model=model, dtype="bfloat16", max_model_len=min(1024, cfg.get("max_position_embeddings", 1024)),
              seed=0, enforce_eager=True,
              gpu_memory_utilization=0.3 if gpu else 0.1, max_num_seqs=64)
    if spec["quant"] in ("all", "half"):
        kw["quantization"] = "mxfp8-learner-grid"
        opts = {"modules": {"layers": list(range(num_layers // 2))}} if spec["quant"] == "half" else {}
        if spec.get("router"):
            opts["router_dtype"] = spec["router"]
        opts.update(spec.get("opts", {}))
        if opts:
            kw["hf_overrides"] = {"quantization_config_dict_json": json.dumps(opts)}
    elif spec["quant"] == "fp8":
        kw["quantization"] = "fp8"
    elif spec["quant"] and spec["quant"].startswith("emulate:"):
        kw["quantization"] = "mxfp8-learner-grid"
        kw["hf_overrides"] = {"quantization_config_dict_json": json.dumps({"emulate": spec["quant"][8:]})}
    if spec.get("kv") == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    sets = json.load(open(sets_file))
    rec = {"arm": arm, "engine_start_s": round(start_s, 1), "sets": []}
    for si, prompts in enumerate(sets):
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=1000 * si + i,
                                 ignore_eos=True, detokenize=False) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        comps = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, c)] for o, c in zip(outs, comps)]
        rec["sets"].append({"completions": comps, "logprobs": lps})
    with open(out, "w") as f:
        json.dump(rec, f)
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


def learner_logprobs(model: str, mode: str, prompts, completions, device) -> list[list[float]]:
    import torch
    import transformers

    from mxfp8_learner_grid.common.learner import apply_learner_grid, set_moe_router_weights, set_router_dtype
    key = (model, mode)
    if key not in _LEARNERS:
        m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
        if mode in LEARNER_MODES:
            apply_learner_grid(m)
            router, order = LEARNER_MODES[mode]
            if router:
                set_router_dtype(m, getattr(torch, router))
            if order != "combine":
                set_moe_router_weights(m, order)
        _LEARNERS[key] = m
    m = _LEARNERS[key]
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c], device=device)
            lp = torch.log_softmax(m(ids).logits[0].float(), -1)
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
            out.append(lp[pos, torch.tensor(c, device=device)].tolist())
    return out


_LEARNERS: dict = {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default="bf16,grid_half,grid_all,fp8,grid_all_kvfp8,bf16_bf16")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arm-timeout", type=int, default=400)
    ap.add_argument("--_arm", help=argparse.SUPPRESS)
    ap.add_argument("--_model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    if args._arm:
        return run_arm(args._arm, args._model, os.path.join(args.out, "prompts.json"),
                       os.path.join(args.out, f"arm-{args._arm}.json"), args.max_tokens, cfg)

    os.makedirs(args.out, exist_ok=True)
    t_all = time.time()
    sets = prompt_sets(args.model, args.sets, args.prompts, args.prompt_len)
    json.dump(sets, open(os.path.join(args.out, "prompts.json"), "w"))
    arms = [a for a in args.arms.split(",") if a]
    gpu = torch.cuda.is_available()
    report = {"model": os.path.abspath(args.model), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "arms": {}, "errors": {}}
    kv_model = None
    moe = "num_experts" in cfg or "num_local_experts" in cfg
    for arm in arms:
        if ARMS[arm]["learner"] in ("grid_r32", "grid_meg") and not moe:
            report["errors"][arm] = "a dense model has no router"
            continue
        if ARMS[arm]["quant"] == "fp8" and not gpu:
            report["errors"][arm] = "vLLM's fp8 needs CUDA; skipped on CPU"
            continue
        model = args.model
        if ARMS[arm].get("kv") == "fp8":
            kv_model = kv_model or kv_scales_dir(args.model, args.out, sets[0][:16])
            model = kv_model
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--_arm", arm, "--_model", model],
                               capture_output=True, text=True, timeout=args.arm_timeout)
            err = r.stderr[-3000:] if r.returncode else None
        except subprocess.TimeoutExpired:
            err = f"timeout after {args.arm_timeout}s"
        if err:
            report["errors"][arm] = err
            print(f"[{arm}] FAILED: {err[-1500:]}", flush=True)
            continue
        print(f"[{arm}] sampled in {time.time() - t0:.0f}s", flush=True)

    from mxfp8_learner_grid.common.metrics import mismatch_metrics
    device = "cuda" if gpu else "cpu"
    for arm in arms:
        path = os.path.join(args.out, f"arm-{arm}.json")
        if arm in report["errors"] or not os.path.exists(path):
            continue
        rec = json.load(open(path))
        per_set = []
        for prompts, s in zip(sets, rec["sets"]):
            train = learner_logprobs(args.model, ARMS[arm]["learner"], prompts, s["completions"], device)
            per_set.append(mismatch_metrics(s["logprobs"], train))
        keys = [k for k in per_set[0] if k != "tokens"]
        summary = {k: {"mean": statistics.fmean(m[k] for m in per_set),
                       "std": statistics.stdev(m[k] for m in per_set) if len(per_set) > 1 else 0.0} for k in keys}
        report["arms"][arm] = {"learner": ARMS[arm]["learner"], "engine_start_s": rec["engine_start_s"],
                               "per_set": per_set, "summary": summary}
    def base_of(learner):
        return report["arms"].get(BASELINE.get(learner, "bf16"), {}).get("summary", {}).get("kl_k3", {}).get("mean")
    print(f"\n{'arm':16} {'learner':8} {'kl_k3':>22} {'kl_k1':>12} {'abs_diff':>10} {'mult_err':>9} {'vs bf16':>8}")
    for arm, a in report["arms"].items():
        s = a["summary"]
        b = base_of(a["learner"])                      # against the BF16 sampler, same learner
        ratio = s["kl_k3"]["mean"] / b if b else float("nan")
        a["kl_k3_vs_bf16_sampler"] = ratio
        print(f"{arm:16} {a['learner']:8} {s['kl_k3']['mean']:.3e} ± {s['kl_k3']['std']:.1e} "
              f"{s['kl_k1']['mean']:12.2e} {s['abs_diff']['mean']:10.4f} {s['token_mult_prob_err']['mean']:9.4f} "
              f"{ratio:8.2f}")
    report["total_s"] = round(time.time() - t_all, 1)
    with open(os.path.join(args.out, "study.json"), "w") as f:
        json.dump(report, f, indent=1)
    if not report["arms"]:
        print("no arm ran:", json.dumps(report["errors"], indent=1)[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
