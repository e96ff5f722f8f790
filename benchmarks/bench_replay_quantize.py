"""Host + device time of a write plan's replay quantizer: one ``quantize_rows`` per BF16 tensor against
``plan.quantize_grouped`` (equal shapes stacked into one call), on the same tensors in the same run.

    python benchmarks/bench_replay_quantize.py [--device cuda] [--shape 768,2048] [--count 384] [--reps 5]
        [--out rows.jsonl]

The default is one Qwen3-30B-A3B MoE layer's gate / up / down experts as a trainer sends them in BF16 (384
tensors; down [2048, 768] is counted with gate / up's shape, the same bytes).  ``--shape 64,64 --count 1536`` is
the CPU-sized case.  Each timing synchronizes the device before and after; the bytes of the two paths are
compared once.  Prints one JSON row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.plan import quantize_grouped


def _timed(fn, device, reps):
    out = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="768,2048")
    ap.add_argument("--count", type=int, default=384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = tuple(int(x) for x in args.shape.split(","))
    g = torch.Generator(device=device).manual_seed(0)
    ts = [torch.randn(shape, generator=g, device=device).bfloat16() for _ in range(args.count)]
    per = [quantize_rows(t) for t in ts]
    grouped = quantize_grouped(ts)
    same = all(torch.equal(a.view(torch.uint8), grouped[id(t)][0].view(torch.uint8)) and torch.equal(b, grouped[id(t)][1])
               for t, (a, b) in zip(ts, per))
    del per, grouped
    a = _timed(lambda: [quantize_rows(t) for t in ts], device, args.reps)
    b = _timed(lambda: quantize_grouped(ts), device, args.reps)
    row = {"bench": "replay_quantize", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "shape": list(shape), "count": args.count, "per_tensor_ms": round(a * 1e3, 2),
           "grouped_ms": round(b * 1e3, 2), "speedup": round(a / b, 2), "bytes_equal": same,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
