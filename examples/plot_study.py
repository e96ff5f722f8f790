"""Plots of the consistency study: KL per arm (bars with spread) and per-step KL of the RL runs.

    python examples/plot_study.py --study DIR/study-dense DIR/study-moe --rl DIR/rl-*.jsonl --out docs/img
    python examples/plot_study.py --rows benchmarks/results/study-h200.jsonl \
        --amplification benchmarks/results/amplification-h200.jsonl --out docs/img --suffix _h200

Writes ``study_kl.png`` (k3 KL of each arm, mean +- std over prompt sets, one panel per
model; from study directories or, with ``--rows``, from a results JSONL of the study) and
``rl_kl.png`` (per-step k3 KL of each RL run); with ``--amplification``, ``amplification.png``
(per on-grid layer input: the share of activation codes that differ between sampler and learner).
``--suffix`` is added to every file name.  Needs matplotlib (``[bench]``).
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", nargs="*", default=[])
    ap.add_argument("--rl", nargs="*", default=[])
    ap.add_argument("--rows", help="a results JSONL of the study (benchmarks/results/study-*.jsonl)")
    ap.add_argument("--amplification", help="a results JSONL of examples/amplification_study.py")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    panels = []                               # (title, arms, means, stds)
    for d in args.study:
        rep = json.load(open(os.path.join(d, "study.json")))
        arms = list(rep["arms"])
        panels.append((os.path.basename(rep["model"].rstrip("/")) + f"  ({rep['device']})", arms,
                       [rep["arms"][a]["summary"]["kl_k3"]["mean"] for a in arms],
                       [rep["arms"][a]["summary"]["kl_k3"]["std"] for a in arms]))
    if args.rows:
        rows = [json.loads(ln) for ln in open(args.rows) if ln.strip()]
        for model in dict.fromkeys(r["model"] for r in rows):
            rs = [r for r in rows if r["model"] == model]
            panels.append((f"{model}  ({rs[0].get('machine', '').split(' (')[0]}, {rs[0].get('engine', '')})",
                           [r["arm"] for r in rs], [r["kl_k3_mean"] for r in rs], [r["kl_k3_std"] for r in rs]))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (title, arms, mean, std) in zip(axes[0], panels):
            colors = ["tab:gray" if a.startswith("bf16") else "tab:orange" if "kv" in a else "tab:green" if a.startswith("grid")
                      else "tab:red" for a in arms]
            ax.bar(range(len(arms)), mean, yerr=std, color=colors, capsize=4)
            ax.set_xticks(range(len(arms)), arms, rotation=35, ha="right")
            ax.set_yscale("log")
            ax.set_ylabel("k3 KL (sampler || learner), per token")
            ax.set_title(title)
        fig.tight_layout()
        out = os.path.join(args.out, f"study_kl{args.suffix}.png")
        fig.savefig(out, dpi=110)
        print("wrote", out)
    if args.amplification:
        rows = [json.loads(ln) for ln in open(args.amplification) if ln.strip()]
        rows = [r for r in rows if r.get("router_dtype", "model") == "model"]
        fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
        for ax, r in zip(axes[0], rows):
            names = list(r["layers"])
            ax.plot(range(len(names)), [r["layers"][n]["code_flip"] for n in names], marker="o", label="activation codes that differ")
            ax.plot(range(len(names)), [r["layers"][n]["rel_in"] for n in names], marker="s", label="relative distance of the input")
            ax.set_xticks(range(len(names)), [n.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")
                                              for n in names], rotation=60, ha="right", fontsize=7)
            ax.set_ylim(0, 1)
            ax.set_title(f"{r['model']}: sampler vs learner, per on-grid layer input")
            ax.legend(fontsize=8)
        fig.tight_layout()
        out = os.path.join(args.out, f"amplification{args.suffix}.png")
        fig.savefig(out, dpi=110)
        print("wrote", out)
    if args.rl:
        fig, ax = plt.subplots(figsize=(7, 4))
        for f in args.rl:
            steps = [json.loads(ln) for ln in open(f) if ln.strip()]
            label = os.path.basename(f).removesuffix(".jsonl")
            ax.plot([s["step"] for s in steps], [s["kl_k3"] for s in steps], marker="o", ms=3, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_ylabel("k3 KL (sampler || learner)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"rl_kl{args.suffix}.png"), dpi=110)
        print("wrote", os.path.join(args.out, f"rl_kl{args.suffix}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
