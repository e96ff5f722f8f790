"""End to end on one GPU: output tokens/s of vLLM with the grid against BF16 and vLLM's own FP8 paths (issue #11).

    python benchmarks/bench_e2e.py --shape qwen3-8b --arms bf16,grid,grid+,fp8,mxfp8 --conc 1,16,64 \
        --out e2e.jsonl [--grid-options '{"w8a16_rows": [17, 256]}'] [--reps 3] [--arm-timeout 420]

Each arm runs in its own process (``--worker``): vLLM with its defaults (torch.compile, full and
piecewise CUDA graphs), ``load_format="dummy"`` weights of the real layer shapes, 512 prompt
tokens and 256 output tokens per request (ignore_eos), the same seeded prompts for every arm --
the protocol of ``shared/device/anchor_bench.py``.  ``grid`` is ``--quantization
mxfp8-learner-grid`` with its default options, ``grid+`` the same with ``--grid-options``.  Each
concurrency's batch runs ``--reps`` times on the warm engine; ``out_tok_s`` is the median, ``reps``
all of them.  One JSON line per (arm, concurrency): date, shape, arm, conc, out_tok_s, reps,
load_s, engine, commit (+ options); the ratios against bf16 of the same run are printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time


def make_model_dir(shape, layers=None):
    from transformers import Qwen3Config, Qwen3MoeConfig
    d = tempfile.mkdtemp(prefix=shape)
    if shape == "qwen3-8b":
        cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    elif shape == "qwen3-30b-a3b":
        cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
                             tie_word_embeddings=False, torch_dtype="bfloat16")
    else:
        raise SystemExit(f"unknown shape {shape}")
    cfg.architectures = ["Qwen3ForCausalLM" if shape == "qwen3-8b" else "Qwen3MoeForCausalLM"]
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    cfg.save_pretrained(d)
    return d


def llm_kwargs(shape, arm, max_num_seqs, grid_options):
    """``vllm.LLM``'s arguments for an arm: bf16, grid (the plugin's defaults), grid+ (with the options),
    or a vLLM quantization method by name (fp8, mxfp8)."""
    kw = dict(model=make_model_dir(shape), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=1024, gpu_memory_utilization=0.85, max_num_seqs=max_num_seqs)
    if arm in ("grid", "grid+"):
        kw["quantization"] = "mxfp8-learner-grid"
        if arm == "grid+" and grid_options:
            kw["hf_overrides"] = {"quantization_config_dict_json": json.dumps(grid_options)}
    elif arm != "bf16":
        kw["quantization"] = arm
    return kw


def kv_capacity(llm):
    """The engine's KV-cache capacity in tokens (``num_gpu_blocks`` x ``block_size``, which the engine core
    reports back to the front end), or None where it has none."""
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        return {"token_capacity": int(cc.num_gpu_blocks) * int(cc.block_size)} if cc.num_gpu_blocks else None
    except Exception as exc:                      # a benchmark row still counts without it
        print(f"kv_capacity: {exc!r}", flush=True)
        return None


#: vLLM's log line for the memory its model took at load (process_weights_after_loading, so derived
#: tensors, included)
_VLLM_WEIGHTS = re.compile(r"Model loading took ([0-9.]+) GiB")


def distinct_per_step(seqs, skip=16):
    """Mean count of distinct token ids across the batch per decode position (after the first ``skip``).  Greedy
    decoding on dummy weights can collapse the batch onto a few tokens; then a MoE layer's tokens pick the same
    experts and a step reads fewer expert weights, so tokens/s depends on this number (a diagnostic for the
    bimodal 30B-A3B batches at concurrency 16, BENCHMARKS.md)."""
    steps = min((len(s) for s in seqs), default=0)
    if steps <= skip:
        return None
    return round(sum(len({s[j] for s in seqs}) for j in range(skip, steps)) / (steps - skip), 2)


def worker(shape, arm, concs, grid_options, reps=1):
    from vllm import LLM, SamplingParams
    kw = llm_kwargs(shape, arm, max(concs), grid_options)
    t0 = time.time()
    llm = LLM(**kw)
    load_s = time.time() - t0
    mem = kv_capacity(llm)
    sp = SamplingParams(max_tokens=256, ignore_eos=True, detokenize=False, temperature=0)
    random.seed(0)
    for c in concs:
        prompts = [{"prompt_token_ids": [random.randrange(1000, 100000) for _ in range(512)]} for _ in range(c)]
        # warm-up with the whole batch: on the H200 the first full batch ran 10-40 % slower in every arm
        # (2026-12-01, REPS=2), so a single cold batch understates the steady state
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
        rates, secs, distinct = [], [], []
        for _ in range(reps):
            t = time.time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.time() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append(round(n / dt, 1))
            secs.append(round(dt, 2))
            distinct.append(distinct_per_step([o.outputs[0].token_ids for o in outs]))
        print("ROW " + json.dumps({"conc": c, "out_tok_s": sorted(rates)[len(rates) // 2], "reps": rates,
                                   "secs": secs, "distinct": distinct, "load_s": round(load_s, 1),
                                   **({"memory": mem} if mem else {})}), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--arms", default="bf16,grid")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--out", default="e2e.jsonl")
    ap.add_argument("--grid-options", default="")
    ap.add_argument("--arm-timeout", type=int, default=420)
    ap.add_argument("--worker", default="")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    opts = json.loads(args.grid_options) if args.grid_options else {}
    if args.worker:
        return worker(args.shape, args.worker, concs, opts, args.reps)
    import vllm
    run_arms(__file__, args.arms.split(","), args.shape, args.conc, args.arm_timeout, args.out,
             f"vllm {vllm.__version__}", extra=["--grid-options", args.grid_options, "--reps", str(args.reps)],
             grid_options=opts)


def run_arms(script, arms, shape, conc, arm_timeout, out, engine, extra=(), grid_options=None):
    """Each arm in its own process (``script --worker ARM``), its ROW lines recorded as JSON lines in
    ``out`` (date, shape, arm, conc, out_tok_s, load_s, engine, commit, secs, and where the worker
    gives them its repetitions and the engine's memory account), ratios to bf16 printed.
    Shared with bench_e2e_sglang.py."""
    # the device copy of the tree may carry a stale .git: the caller can name the commit (GRID_COMMIT)
    commit = os.environ.get("GRID_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip()
    rows = {}
    with open(out, "a") as f:
        for arm in arms:
            cmd = [sys.executable, script, "--worker", arm, "--shape", shape, "--conc", conc, *extra]
            t0 = time.time()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=arm_timeout)
                text, rc = r.stdout + r.stderr, r.returncode
            except subprocess.TimeoutExpired as exc:
                text, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode(), "timeout"
            if os.environ.get("E2E_ARM_LOGS"):          # each arm's whole output, for the record
                with open(os.path.join(os.environ["E2E_ARM_LOGS"], f"e2e-{shape}-{arm}.log"), "a") as log:
                    log.write(text)
            got = [json.loads(ln[4:]) for ln in text.splitlines() if ln.startswith("ROW ")]
            weights = _VLLM_WEIGHTS.search(text)
            if weights:                               # vLLM: the weights' GiB from its own log
                for g in got:
                    g.setdefault("memory", {}).setdefault("weight", float(weights.group(1)))
            kernels = sorted({ln.split("-> kernel", 1)[1].strip()[:120] for ln in text.splitlines() if "-> kernel" in ln})
            if kernels:
                print(f"[{arm}] kernels: {kernels[:6]}", flush=True)
            if not got:
                print(f"[{arm}] failed (rc {rc}, {time.time() - t0:.0f} s):\n" + text[-3000:], flush=True)
            for g in got:
                rec = {"date": datetime.date.today().isoformat(), "shape": shape, "arm": arm, "conc": g["conc"],
                       "out_tok_s": g["out_tok_s"], "load_s": g["load_s"], "engine": engine,
                       "commit": commit, "secs": g["secs"]}
                for key in ("reps", "distinct", "memory"):
                    if key in g:
                        rec[key] = g[key]
                if arm == "grid+" and grid_options:
                    rec["options"] = grid_options
                if kernels:
                    rec["kernels"] = kernels[:6]
                f.write(json.dumps(rec) + "\n")
                f.flush()
                rows[(arm, g["conc"])] = rec
                print(json.dumps(rec), flush=True)
    for (arm, c), rec in sorted(rows.items()):
        base = rows.get(("bf16", c))
        if base and arm != "bf16":
            print(f"{shape} {arm:6s} conc {c:3d}: {rec['out_tok_s'] / base['out_tok_s']:.2f}x bf16 "
                  f"(load {rec['load_s']:.0f} s vs {base['load_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
