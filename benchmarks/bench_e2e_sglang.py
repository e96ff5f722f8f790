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
import datetime
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_e2e import make_model_dir  # noqa: E402


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
    commit = os.environ.get("GRID_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip()
    rows = {}
    with open(args.out, "a") as f:
        for arm in args.arms.split(","):
            cmd = [sys.executable, __file__, "--worker", arm, "--shape", args.shape, "--conc", args.conc]
            t0 = time.time()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.arm_timeout)
                text, rc = r.stdout + r.stderr, r.returncode
            except subprocess.TimeoutExpired as exc:
                text, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode(), "timeout"
            got = [json.loads(ln[4:]) for ln in text.splitlines() if ln.startswith("ROW ")]
            kernels = sorted({ln.split("-> kernel", 1)[1].strip()[:120] for ln in text.splitlines() if "-> kernel" in ln})
            if kernels:
                print(f"[{arm}] kernels: {kernels[:6]}", flush=True)
            if not got:
                print(f"[{arm}] failed (rc {rc}, {time.time() - t0:.0f} s):\n" + text[-3000:], flush=True)
            for g in got:
                rec = {"date": datetime.date.today().isoformat(), "shape": args.shape, "arm": arm, "conc": g["conc"],
                       "out_tok_s": g["out_tok_s"], "load_s": g["load_s"], "engine": f"sglang {sglang.__version__}",
                       "commit": commit, "secs": g["secs"]}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                rows[(arm, g["conc"])] = g["out_tok_s"]
    for (arm, c), v in sorted(rows.items()):
        base = rows.get(("bf16", c))
        print(f"{args.shape} {arm:6s} conc {c:3d}: {v:8.1f} tok/s" + (f"  x{v / base:.2f} bf16" if base else ""))


if __name__ == "__main__":
    main()
