"""Host time of a write plan's replay into a MoE layer's expert codes: plain [E, 2I, K] / [E, K, I] parameters
(two copies: the kernel's packed one is derived) against ``PackedCodes`` (option ``moe_single_copy``).

A CPU benchmark of the sync's Python path, not of the kernels: small experts (bytes do not matter), many of them
(the write count does).  One update through the engine's loaders (the plan is recorded), then ``--reps`` replayed
updates, each through a whole ``UpdateSession`` (recorder, backups, sampled digest).  Prints one JSON row per arm:

    python benchmarks/bench_packed_replay.py [--experts 128] [--reps 5] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_packed_codes import ExpertsAdapter  # noqa: E402  (the CPU tests' MoE layer: w13 / w2, loaded per expert)

from mxfp8_learner_grid.common.sync.manifest import Manifest  # noqa: E402
from mxfp8_learner_grid.common.sync.session import UpdateSession  # noqa: E402


def run(experts: int, held: bool, reps: int) -> dict:
    ad = ExpertsAdapter(experts, down=True, norm=False, held=held)
    secs, replayed = [], 0
    for v in range(1, reps + 2):
        t = ad.tensors(v)
        s = UpdateSession(ad, Manifest.of(t, v, "bf16"), digest="sampled")
        t0 = time.perf_counter()
        s.load(list(t.items()))
        dt = time.perf_counter() - t0
        rep = s.finish()
        if rep.failed() or not s.commit(True):
            raise SystemExit(f"update {v} failed: {rep.summary()}")
        if v > 1:                                  # update 1 went through the loaders and recorded the plan
            secs.append(dt)
            replayed = s.timings.get("replayed")
    med = statistics.median(secs)
    return {"arm": "packed (moe_single_copy)" if held else "plain (two copies)", "experts": experts,
            "writes": 3 * experts, "replayed": replayed, "load_ms": round(med * 1e3, 2),
            "us_per_write": round(med * 1e6 / (3 * experts), 1), "reps_ms": [round(x * 1e3, 2) for x in secs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(args.experts, held, args.reps) for held in (False, True)]
    for r in rows:
        r.update(torch=torch.__version__, threads=torch.get_num_threads())
        print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
