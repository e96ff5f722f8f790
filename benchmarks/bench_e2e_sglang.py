"""End to end on one GPU in SGLang: output tokens/s with the grid against BF16 (issue #12).

    python benchmarks/bench_e2e_sglang.py --shape qwen3-8b --arms bf16,grid,grid+,fp8 --conc 1,16,64 \
        --out e2e-sglang.jsonl [--grid-options '{"bf16_weight_rows": 40}'] [--reps 2]

The protocol of ``bench_e2e.py`` (vLLM): each arm in its own process, ``load_format="dummy"``
weights of the real layer shapes (the plugin fills valid random grid weights), 512 prompt tokens
and 256 output tokens per request (ignore_eos), the same seeded prompts for every arm.  SGLang's
offline ``Engine`` with its defaults (FlashAttention 3, decode CUDA graphs up to the largest
concurrency), except that the prefill CUDA graph is off for both arms (its capture takes minutes
on the H200 and does not touch the decode-bound numbers measured here).  ``grid`` is
``quantization="mxfp8-learner-grid"``; with vLLM absent the grid layers run the project's own
Triton kernels (``common.grid_kernels``: the choice is printed).  ``grid+`` is the same with the
options of ``--grid-options`` (``json_model_override_args`` -> ``quantization_config``).  Each
concurrency: a warm-up with the whole batch, then ``--reps`` timed runs (the median is recorded).
One JSON line per (arm, concurrency): date, shape, arm, conc, out_tok_s, load_s, engine, commit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_e2e import distinct_per_step, make_model_dir, run_arms  # noqa: E402


def memory_usage(eng):
    """SGLang's own account of the engine's memory (GB of weights -- derived tensors included, as
    measured around the load -- of KV cache, and the KV token capacity), or None where it has none."""
    try:
        states = eng.get_server_info().get("internal_states") or [{}]
        mem = states[0].get("memory_usage") or {}
        return {k: mem[k] for k in ("weight", "kvcache", "token_capacity") if k in mem} or None
    except Exception as exc:                      # a benchmark row still counts without it
        print(f"memory_usage: {exc!r}", flush=True)
        return None


def worker(shape, arm, concs, grid_options, reps=1):
    import sglang as sgl
    kw = dict(model_path=make_model_dir(shape), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              context_length=1024, mem_fraction_static=0.8, max_running_requests=max(concs),
              disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=max(concs), random_seed=0, log_level="warning")
    if arm in ("grid", "grid+"):
        kw["quantization"] = "mxfp8-learner-grid"
        if arm == "grid+" and grid_options:
            kw["json_model_override_args"] = json.dumps(
                {"quantization_config": dict(grid_options, quant_method="mxfp8-learner-grid")})
    elif arm != "bf16":
        kw["quantization"] = arm
    t0 = time.time()
    eng = sgl.Engine(**kw)
    load_s = time.time() - t0
    mem = memory_usage(eng)
    sp = {"max_new_tokens": 256, "ignore_eos": True, "temperature": 0}
    random.seed(0)
    for c in concs:
        ids = [[random.randrange(1000, 100000) for _ in range(512)] for _ in range(c)]
        eng.generate(input_ids=ids, sampling_params=dict(sp, max_new_tokens=8))    # warm-up, whole batch
        rates, secs, distinct = [], [], []
        for _ in range(reps):
            t = time.time()
            outs = eng.generate(input_ids=ids, sampling_params=sp)
            dt = time.time() - t
            n = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
            rates.append(round(n / dt, 1))
            secs.append(round(dt, 2))
            seqs = [o.get("output_ids") for o in outs]      # present where the engine returns token ids
            distinct.append(distinct_per_step(seqs) if all(q is not None for q in seqs) else None)
        print("ROW " + json.dumps({"conc": c, "out_tok_s": sorted(rates)[len(rates) // 2], "reps": rates,
                                   "secs": secs, "distinct": distinct, "load_s": round(load_s, 1),
                                   **({"memory": mem} if mem else {})}), flush=True)
    try:
        eng.shutdown()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--arms", default="bf16,grid")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--out", default="e2e-sglang.jsonl")
    ap.add_argument("--arm-timeout", type=int, default=420)
    ap.add_argument("--worker", default="")
    ap.add_argument("--grid-options", default="")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    opts = json.loads(args.grid_options) if args.grid_options else {}
    if args.worker:
        return worker(args.shape, args.worker, concs, opts, args.reps)
    import sglang
    run_arms(__file__, args.arms.split(","), args.shape, args.conc, args.arm_timeout, args.out,
             f"sglang {sglang.__version__}", extra=["--grid-options", args.grid_options, "--reps", str(args.reps)],
             grid_options=opts)


if __name__ == "__main__":
    main()
