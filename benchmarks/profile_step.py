"""Where a decode step's GPU time goes: kernel time per decode step, per kernel family, per arm (issue #11).

    python benchmarks/profile_step.py --shape qwen3-8b --arms bf16,grid --conc 64 --out step.jsonl [--tokens 64]

The end-to-end gap at Qwen3-8B, concurrency 64 (0.81x BF16) is larger than the kernel-level gap of the
four projections explains (BENCHMARKS.md, sixteenth and seventeenth sessions).  This measures what each
arm's GPU does in a decode step, inside vLLM as served (its defaults: torch.compile, CUDA graphs),
with ``torch.profiler``: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
and the kernels of graph replays are recorded one by one.

Protocol (``bench_e2e.py``'s: dummy weights of the real shapes, 512 prompt tokens, ignore_eos): one
warm-up batch, then two profiled batches of the same prompts, with 1 and with 1 + ``--tokens`` output
tokens.  Their difference, per kernel name, over ``--tokens`` is the kernel time of one decode step
(the prefill cancels).  Kernel names are grouped by :data:`FAMILIES` (first match).  One JSON line
per (arm, family) with ``us_per_step`` and ``launches_per_step``, and the step's wall time measured the
same way without the profiler (``wall_step_us``: what kernels do not explain is host time and gaps);
``--top`` kernels per arm are printed by name.

Each arm runs in its own process (``--worker``), as in ``bench_e2e.py``.  Without a GPU the same
protocol profiles CPU time per op (``--layers 1 --conc 2 --tokens 4``: a dry run of the script).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: kernel name -> family, first match (names of vLLM 0.26 / torch 2.11 / Triton kernels on the H200).  Inductor's
#: fused kernels come first: their names carry the ops they absorbed (``triton_red_fused_fused_add_rms_norm_
#: linear_marlin_2`` is RMSNorm + residual add, not Marlin), and attention before GEMMs (FA3 is a ``cutlass::``
#: kernel); both were misfiled in the first H200 run (5391c9a, regrouped from its printed top kernels).
FAMILIES = (
    ("grid qdq", r"qdq|quantize_rows"),
    ("norm / rope / act (fused)", r"^triton_(red|poi|per)_|rms|norm|rotary|rope|silu|act_and_mul"),
    ("attention", r"flash|attn|attention|paged|fmha|reshape_and_cache"),
    ("marlin", r"[Mm]arlin"),
    ("w8a16 / grid triton", r"w8a16|grid_gemm|gemv|splitk_sum|dequant"),
    ("moe routing / fused experts", r"fused_moe|moe_align|moe_sum|moe_|topk_softmax|grouped_topk|expert"),
    ("cublas gemm", r"gemm|sm90_xmma|cutlass|nvjet|Kernel2|splitKreduce"),
    ("sampling / logits", r"sampl|topk|top_k|softmax|argmax|gumbel|exponential"),
    ("copies / memset", r"[Mm]emcpy|[Mm]emset|copy|fill|elementwise|vectorized|index|cat"),
)


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other"


def kernel_us(prof, device: str = "CUDA", counts: dict | None = None) -> dict:
    """Total device time per kernel name (us) of a finished torch.profiler session (``device="CPU"``:
    self CPU time per op, for a dry run of this script without a GPU); ``counts``, if given, gets the
    number of launches per name."""
    out: dict = {}
    for e in prof.key_averages():
        if device == "CPU":
            t = e.self_cpu_time_total
        else:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if "CUDA" not in str(getattr(e, "device_type", "")):
                t = 0
        if t:
            out[e.key] = out.get(e.key, 0.0) + float(t)
            if counts is not None:
                counts[e.key] = counts.get(e.key, 0) + int(getattr(e, "count", 0) or 0)
    return out


def step_breakdown(short: dict, long: dict, tokens: int) -> dict:
    """Per kernel name: (long - short) / tokens, the time of one decode step (us); negatives (noise) -> 0."""
    names = set(short) | set(long)
    return {n: max(0.0, (long.get(n, 0.0) - short.get(n, 0.0)) / tokens) for n in names}


def by_family(per_kernel: dict) -> dict:
    out: dict = {}
    for n, t in per_kernel.items():
        f = family(n)
        out[f] = out.get(f, 0.0) + t
    return out


def worker(shape, arm, conc, tokens, grid_options, top, layers=None):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine core (and its kernels) in this process
    import torch
    from vllm import LLM, SamplingParams
    from bench_e2e import llm_kwargs, make_model_dir
    kw = llm_kwargs(shape, arm, conc, grid_options)
    if layers:         # a dry run (--layers): fewer decoder layers
        kw["model"] = make_model_dir(shape, layers)
    cuda = torch.cuda.is_available()
    llm = LLM(**kw)
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randrange(1000, 100000) for _ in range(512)]} for _ in range(conc)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    import time
    res, cnt, wall = {}, {}, {}
    for n in (1, 1 + tokens):
        sp = SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0)
        times = []
        for _ in range(2):                 # wall time without the profiler (it slows the host)
            sync()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            sync()
            times.append(time.perf_counter() - t0)
        wall[n] = min(times)
        sync()
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompts, sp, use_tqdm=False)
            sync()
        cnt[n] = {}
        res[n] = kernel_us(prof, "CUDA" if cuda else "CPU", cnt[n])
    per_kernel = step_breakdown(res[1], res[1 + tokens], tokens)
    fams = by_family(per_kernel)
    launches = by_family(step_breakdown(cnt[1], cnt[1 + tokens], tokens))
    wall_us = (wall[1 + tokens] - wall[1]) / tokens * 1e6
    print("ROW " + json.dumps({"families": {f: round(t, 1) for f, t in sorted(fams.items(), key=lambda x: -x[1])},
                               "launches": {f: round(c, 1) for f, c in sorted(launches.items(), key=lambda x: -x[1])},
                               "step_us": round(sum(fams.values()), 1), "wall_step_us": round(wall_us, 1),
                               "top": [[n, round(t, 1)] for n, t in sorted(per_kernel.items(),
                                                                           key=lambda x: -x[1])[:top]]}), flush=True)
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--arms", default="bf16,grid")
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps between the two profiled batches")
    ap.add_argument("--grid-options", default="")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--arm-timeout", type=int, default=400)
    ap.add_argument("--out", default="step.jsonl")
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (a dry run of the script)")
    ap.add_argument("--worker", default="")
    args = ap.parse_args()
    opts = json.loads(args.grid_options) if args.grid_options else {}
    if args.worker:
        return worker(args.shape, args.worker, args.conc, args.tokens, opts, args.top, args.layers)
    import vllm
    commit = os.environ.get("GRID_COMMIT", "")
    rows = {}
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, "--worker", arm, "--shape", args.shape, "--conc", str(args.conc),
               "--tokens", str(args.tokens), "--grid-options", args.grid_options, "--top", str(args.top),
               "--layers", str(args.layers)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.arm_timeout)
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode() + (exc.stderr or b"").decode() + "\nTIMEOUT"
        got = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
        if not got:
            print(f"{arm}: no result\n" + "\n".join(text.splitlines()[-25:]), flush=True)
            continue
        rows[arm] = got[0]
        print(f"{args.shape} {arm} conc {args.conc}: {got[0]['step_us']:.0f} us of kernels per decode step, "
              f"{got[0].get('wall_step_us', 0):.0f} us of wall time", flush=True)
        for f, t in got[0]["families"].items():
            print(f"    {f:28s} {t:9.1f} us  {got[0].get('launches', {}).get(f, 0):7.1f} launches", flush=True)
        for n, t in got[0]["top"]:
            print(f"      {t:9.1f}  {n[:110]}", flush=True)
    with open(args.out, "a") as out:
        for arm, r in rows.items():
            for f, t in r["families"].items():
                out.write(json.dumps({"date": datetime.date.today().isoformat(), "shape": args.shape, "arm": arm,
                                      "conc": args.conc, "family": f, "us_per_step": t, "step_us": r["step_us"],
                                      "launches_per_step": r.get("launches", {}).get(f),
                                      "wall_step_us": r.get("wall_step_us"),
                                      "engine": f"vllm {vllm.__version__}", "commit": commit,
                                      **({"options": opts} if arm == "grid+" and opts else {})}) + "\n")
    base = rows.get("bf16")
    if base:
        for arm, r in rows.items():
            if arm != "bf16":
                print(f"{args.shape} {arm} conc {args.conc}: kernels {r['step_us'] / base['step_us']:.2f}x bf16's per "
                      f"step; by family (arm - bf16, us): " + ", ".join(
                          f"{f} {r['families'].get(f, 0) - base['families'].get(f, 0):+.0f}"
                          for f in sorted(set(r["families"]) | set(base["families"]))), flush=True)
                print(f"{args.shape} {arm} conc {args.conc}: wall {r.get('wall_step_us', 0):.0f} us per step against "
                      f"bf16's {base.get('wall_step_us', 0):.0f}; not in kernels (host, gaps): "
                      f"{r.get('wall_step_us', 0) - r['step_us']:.0f} us against "
                      f"{base.get('wall_step_us', 0) - base['step_us']:.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
