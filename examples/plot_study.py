"""Plots of the consistency study: KL per arm (bars with spread) and per-step KL of the RL runs.

    python examples/plot_study.py --study DIR/study-dense DIR/study-moe --rl DIR/rl-*.jsonl --out docs/img

Writes ``study_kl.png`` (k3 KL of each arm, mean +- std over prompt sets, one panel per
model) and ``rl_kl.png`` (per-step k3 KL of each RL run).  Needs matplotlib (``[bench]``).
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", nargs="*", default=[])
    ap.add_argument("--rl", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    if args.study:
        fig, axes = plt.subplots(1, len(args.study), figsize=(6 * len(args.study), 4), squeeze=False)
        for ax, d in zip(axes[0], args.study):
            rep = json.load(open(os.path.join(d, "study.json")))
            arms = list(rep["arms"])
            mean = [rep["arms"][a]["summary"]["kl_k3"]["mean"] for a in arms]
            std = [rep["arms"][a]["summary"]["kl_k3"]["std"] for a in arms]
            colors = ["tab:gray" if a.startswith("bf16") else "tab:orange" if "kv" in a else "tab:green" if a.startswith("grid")
                      else "tab:red" for a in arms]
            ax.bar(range(len(arms)), mean, yerr=std, color=colors, capsize=4)
            ax.set_xticks(range(len(arms)), arms, rotation=35, ha="right")
            ax.set_yscale("log")
            ax.set_ylabel("k3 KL (sampler || learner), per token")
            ax.set_title(os.path.basename(rep["model"].rstrip("/")) + f"  ({rep['device']})")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "study_kl.png"), dpi=110)
        print("wrote", os.path.join(args.out, "study_kl.png"))
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
        fig.savefig(os.path.join(args.out, "rl_kl.png"), dpi=110)
        print("wrote", os.path.join(args.out, "rl_kl.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
