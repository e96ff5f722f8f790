"""A Marlin layer's derived-tensor refresh after an update, the engine's op against the batched repack.

    python benchmarks/bench_refresh.py [--reps 5] [--out FILE]     # needs a CUDA GPU and vLLM's Marlin ops

Per shape -- the Qwen3-8B projections (dense) and one Qwen3-30B-A3B MoE layer (128 experts, w13 and w2) --
the packed weight rebuilt into the layer's derived tensor:

* ``op``: ``marlin_pack(..., batched=False)``: vLLM's ``gptq_marlin_repack`` on the transposed int32 words,
  then a copy into the derived tensor, per matrix (what a refresh did before the batched repack, and still
  does where the batched one disagrees);
* ``batched``: ``marlin_pack(..., batched=True)`` = ``marlin_weights_batched(w, out=derived)`` (a permuting
  copy and a gather per group of experts, in place).

Reported: milliseconds per refresh (median of ``--reps``), host-side (the Python and launches, to the last
launch) and end to end (after a synchronization), and the ratio ``op / batched`` in the same run; the two
results must be equal byte for byte.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

SHAPES = {"8b.qkv": ((), 6144, 4096), "8b.o": ((), 4096, 4096), "8b.gate_up": ((), 24576, 4096),
          "8b.down": ((), 4096, 12288), "30b.w13": ((128,), 1536, 2048), "30b.w2": ((128,), 2048, 768)}


def _time(fn, reps):
    host, total = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return statistics.median(host[1:]) * 1e3, statistics.median(total[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from mxfp8_learner_grid.common.grid_kernels import providers
    from mxfp8_learner_grid.common.grid_kernels.marlin import marlin_pack, marlin_weights_batched
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers()
    ops = providers.get("marlin")
    rows = []
    for name, (lead, n, k) in SHAPES.items():
        q = torch.randint(0, 256, (*lead, n, k), dtype=torch.uint8, device="cuda")
        q[(q & 0x7F) == 0x7F] = 0
        w = q.view(torch.float8_e4m3fn)
        ref = marlin_weights_batched(w)
        live_op, live_b = torch.zeros_like(ref), torch.zeros_like(ref)

        def by_op():
            marlin_pack(ops, w, False, out=live_op)

        def batched():
            marlin_pack(ops, w, True, out=live_b)
        op_host, op_total = _time(by_op, a.reps)
        b_host, b_total = _time(batched, a.reps)
        row = {"shape": name, "experts": lead[0] if lead else 1, "n": n, "k": k, "op_host_ms": round(op_host, 3),
               "op_ms": round(op_total, 3), "batched_host_ms": round(b_host, 3), "batched_ms": round(b_total, 3),
               "op_over_batched": round(op_total / b_total, 2), "equal": bool(torch.equal(live_op, live_b))}
        print(json.dumps(row))
        rows.append(row)
        del q, w, ref, live_op, live_b
        torch.cuda.empty_cache()
    meta = {"bench": "refresh", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "command": "python benchmarks/bench_refresh.py"}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")
    if not all(r["equal"] for r in rows):
        raise SystemExit("bench_refresh: the batched repack differs from the engine's op")


if __name__ == "__main__":
    main()
