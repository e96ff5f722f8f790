"""Host time of a write plan's replay into a MoE layer's expert codes: plain [E, 2I, K] / [E, K, I] parameters
(two copies: the kernel's packed one is derived) against ``PackedCodes`` (option ``moe_single_copy``).

A CPU benchmark of the sync's Python path, not of the kernels: small experts (bytes do not matter), many of them
(the write count does).  One update through the engine's loaders (the plan is recorded), then ``--reps`` replayed
updates, each through a whole ``UpdateSession`` (recorder, backups, sampled digest).  ``load_ms`` times the session's
``load`` (its per-tensor checks and the replay); ``manifest_ms`` the manifest's JSON both ways, ``finish_ms`` the
local checks and digests, ``commit_ms`` the commit (the plan kept): medians.  ``--phases`` also times, inside the
load, the bucket's content rules, the source registry and the plan's replay (``phases_ms``: mean per load; the
timers add a little).  Prints one JSON row per arm:

    python benchmarks/bench_packed_replay.py [--experts 128] [--reps 5] [--phases] [--out rows.jsonl]
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


class _Phases:
    """Wall time of a few functions the session's load calls, summed while on (``--phases``)."""

    def __init__(self):
        from mxfp8_learner_grid.common.sync import plan, recorder, session
        self.acc, self.on, self._undo = {}, False, []
        self._wrap(session, "check_contents", "check_contents")
        self._wrap(recorder.WriteRecorder, "add_source", "add_source")
        self._wrap(plan.WritePlan, "load", "plan_load")

    def _wrap(self, owner, attr, key):
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.on:
                    self.acc[key] = self.acc.get(key, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def close(self):
        for owner, attr, fn in self._undo:
            setattr(owner, attr, fn)


def run(experts: int, held: bool, reps: int, phases_on: bool = False) -> dict:
    ad = ExpertsAdapter(experts, down=True, norm=False, held=held)
    secs, replayed, phases = [], 0, {"manifest_ms": [], "finish_ms": [], "commit_ms": []}
    timers = _Phases() if phases_on else None
    for v in range(1, reps + 2):
        t = ad.tensors(v)
        t0 = time.perf_counter()
        manifest = Manifest.from_json(Manifest.of(t, v, "bf16").to_json())   # the client's JSON, the rank's parse
        t1 = time.perf_counter()
        s = UpdateSession(ad, manifest, digest="sampled")
        if timers is not None:
            timers.on = v > 1
        t2 = time.perf_counter()
        s.load(list(t.items()))
        t3 = time.perf_counter()
        if timers is not None:
            timers.on = False
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
    extra = {}
    if timers is not None:
        timers.close()
        extra["phases_ms"] = {k: round(v * 1e3 / len(secs), 2) for k, v in timers.acc.items()}
        extra["load_mean_ms"] = round(statistics.mean(secs) * 1e3, 2)
    med = statistics.median(secs)
    row = {"arm": "packed (moe_single_copy)" if held else "plain (two copies)", "experts": experts,
            "writes": 3 * experts, "replayed": replayed, "load_ms": round(med * 1e3, 2),
            "us_per_write": round(med * 1e6 / (3 * experts), 1), "reps_ms": [round(x * 1e3, 2) for x in secs],
            **{k: round(statistics.median(v) * 1e3, 2) for k, v in phases.items()}}
    row.update(extra)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phases", action="store_true", help="also time the load's content rules, source registry "
                    "and replay")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(args.experts, held, args.reps, args.phases) for held in (False, True)]
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
