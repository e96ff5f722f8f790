"""Host time of a write plan's replay into a MoE layer's expert codes: plain [E, 2I, K] / [E, K, I] parameters
(two copies: the kernel's packed one is derived) against ``PackedCodes`` (option ``moe_single_copy``).

A CPU benchmark of the sync's Python path, not of the kernels: small experts (bytes do not matter), many of them
(the write count does).  One update through the engine's loaders (the plan is recorded), then ``--reps`` replayed
updates, each through a whole ``UpdateSession`` (recorder, backups, sampled digest).  ``load_ms`` times the session's
``load`` (its per-tensor checks and the replay); ``manifest_ms`` the manifest's JSON both ways, ``finish_ms`` the
local checks and digests, ``commit_ms`` the commit (the plan kept): medians.  Prints one JSON row per arm:

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
    secs, replayed, phases = [], 0, {"manifest_ms": [], "finish_ms": [], "commit_ms": []}
    for v in range(1, reps + 2):
        t = ad.tensors(v)
        t0 = time.perf_counter()
        manifest = Manifest.from_json(Manifest.of(t, v, "bf16").to_json())   # the client's JSON, the rank's parse
        t1 = time.perf_counter()
        s = UpdateSession(ad, manifest, digest="sampled")
        t2 = time.perf_counter()
        s.load(list(t.items()))
        t3 = time.perf_counter()
        rep = s.finish()
        t4 = time.perf_counter()
        if rep.failed() or not s.commit(True):
            raise SystemExit(f"update {v} failed: {rep.summary()}")
        t5 = time.perf_counter()
        if v > 1:                                  # update 1 went through the loaders and recorded the plan
            secs.append(t3 - t2)
            for key, dt in (("manifest_ms", t1 - t0), ("finish_ms", t4 - t3), ("commit_ms", t5 - t4)):
                phases[key].append(dt)
            replayed = s.timings.get("replayed")
    med = statistics.median(secs)
    return {"arm": "packed (moe_single_copy)" if held else "plain (two copies)", "experts": experts,
            "writes": 3 * experts, "replayed": replayed, "load_ms": round(med * 1e3, 2),
            "us_per_write": round(med * 1e6 / (3 * experts), 1), "reps_ms": [round(x * 1e3, 2) for x in secs],
            **{k: round(statistics.median(v) * 1e3, 2) for k, v in phases.items()}}


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
