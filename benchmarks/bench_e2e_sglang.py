"""End to end on one GPU in SGLang: output tokens/s with the grid against BF16 (issue #12).

    python benchmarks/bench_e2e_sglang.py --shape qwen3-8b --arms bf16,grid --conc 1,16,64 --out e2e-sglang.jsonl

The protocol of ``bench_e2e.py`` (vLLM): each arm in its own process, ``load_format="dummy"``
weights of the real layer shapes (the plugin fills valid random grid weights), 512 prompt tokens
and 256 output tokens per request (ignore_eos), the same seeded prompts for every arm.  SGLang's
offline ``Engine`` with its defaults (FlashAttention 3, decode CUDA graphs up to the largest
concurrency), except that the prefill CUDA graph is off for both arms (its capture takes minutes
on the H200 and does not touch the decode-bound numbers measured here).  ``grid`` is
``quantization="mxfp8-learner-grid"``; with vLLM absent the grid layers run the project's own
Triton kernels (``common.grid_kernels``: the choice is printed).  One JSON line per (arm,
concurrency): date, shape, arm, conc, out_tok_s, load_s, engine, commit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_e2e import make_model_dir, run_arms  # noqa: E402


def worker(shape, arm, concs):
    import sglang as sgl
    kw = dict(model_path=make_model_dir(shape), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              context_length=1024, mem_fraction_static=0.8, max_running_requests=max(concs),
              disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=max(concs), random_seed=0, log_level="warning")
    if arm == "grid":
        kw["quantization"] = "mxfp8-learner-grid"
    elif arm != "bf16":
        kw["quantization"] = arm
    t0 = time.time()
    eng = sgl.Engine(**kw)
    load_s = time.time() - t0
    sp = {"max_new_tokens": 256, "ignore_eos": True, "temperature": 0}
    random.seed(0)
    for c in concs:
        ids = [[random.randrange(1000, 100000) for _ in range(512)] for _ in range(c)]
        eng.generate(input_ids=ids[:1], sampling_params=dict(sp, max_new_tokens=8))
        t = time.time()
        outs = eng.generate(input_ids=ids, sampling_params=sp)
        dt = time.time() - t
        n = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
        print("ROW " + json.dumps({"conc": c, "out_tok_s": round(n / dt, 1), "secs": round(dt, 2),
                                   "load_s": round(load_s, 1)}), flush=True)
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
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    if args.worker:
        return worker(args.shape, args.worker, concs)
    import sglang
    run_arms(__file__, args.arms.split(","), args.shape, args.conc, args.arm_timeout, args.out,
             f"sglang {sglang.__version__}")


if __name__ == "__main__":
    main()
