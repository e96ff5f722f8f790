"""Plot benchmarks/bench_linear.py's JSON: speed ratio vs BF16 cuBLAS against M, one panel per shape.

    python benchmarks/plot_kernels.py linear.json kernels.png

Ratio = bf16_us / arm_us (above 1: faster than BF16).  Lines: FP8 rowwise _scaled_mm (GEMM
alone), the grid GEMM (alone and with activation quantize), the best gemv config (alone) and
the default gemv with quantize (M <= 64), and the prefill path (qdq + cuBLAS).  Dashed: the
issue #7 goals (1.7x at decode, 0.9x at prefill).  Prints a message and exits 0 when
matplotlib is not installed.
"""

from __future__ import annotations

import json
import math
import sys

ARMS = [("fp8row", "FP8 rowwise _scaled_mm (GEMM)"), ("grid_gemm", "grid GEMM (GEMM)"),
        ("full_grid", "quantize + grid GEMM"), ("gemv_best", "grid GEMV best config (GEMM)"),
        ("full_gemv", "quantize + grid GEMV (default)"), ("prefill", "qdq + cuBLAS bf16 (prefill path)")]


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_kernels: matplotlib is not installed; no plot written (pip install matplotlib)")
        return 0
    data = json.load(open(argv[1]))
    rows = data["rows"]
    shapes = []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    if not shapes:
        print("plot_kernels: no rows in", argv[1])
        return 0
    cols = min(3, len(shapes))
    nrows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for i, shape in enumerate(shapes):
        ax = axes[i // cols][i % cols]
        rs = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        for key, label in ARMS:
            pts = [(r["m"], r["ratio_vs_bf16"][key]) for r in rs
                   if key in r.get("ratio_vs_bf16", {}) and r["ratio_vs_bf16"][key] == r["ratio_vs_bf16"][key]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.7, color="g", lw=0.8, ls="--")
        ax.axhline(0.9, color="r", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        n, k = rs[0]["n"], rs[0]["k"]
        ax.set_title(f"{shape}  (N={n}, K={k})", fontsize=10)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("bf16 time / arm time")
        ax.grid(True, which="both", alpha=0.3)
    for j in range(len(shapes), nrows * cols):
        axes[j // cols][j % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    info = data.get("info", {})
    fig.suptitle(f"grid Linear vs BF16 cuBLAS -- {info.get('device', '?')}, torch {info.get('torch', '?')}, "
                 f"triton {info.get('triton', '?')}; dashed: goals 1.7x (decode), 0.9x (prefill)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(argv[2], dpi=120)
    print("wrote", argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
