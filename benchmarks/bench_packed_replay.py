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
from test_write_plan import FusedAdapter  # noqa: E402  (the CPU tests' fused-layer adapter)

from mxfp8_learner_grid.common.grid_kernels.marlin import marlin_weights_batched  # noqa: E402
from mxfp8_learner_grid.common.packed_codes import hold_packed  # noqa: E402
from mxfp8_learner_grid.common.sync.manifest import Manifest  # noqa: E402
from mxfp8_learner_grid.common.sync.session import UpdateSession  # noqa: E402

I, K = 64, 64


def _codes(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 120, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)


class Experts(FusedAdapter):
    """One MoE layer: w13 [E, 2I, K] (gate rows, then up rows) and w2 [E, K, I], loaded expert by expert as
    the engines' expert loaders write them."""

    def __init__(self, experts: int, held: bool):
        super().__init__()
        self.e = experts
        self.m = torch.nn.Module()
        self.m.w13 = torch.nn.Parameter(torch.zeros(experts, 2 * I, K, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.m.w2 = torch.nn.Parameter(torch.zeros(experts, K, I, dtype=torch.float8_e4m3fn), requires_grad=False)
        if held:
            for attr in ("w13", "w2"):
                hold_packed(self.m, attr, marlin_weights_batched(getattr(self.m, attr).data))

    def _engine_load(self, named):
        for n, t in named:
            self.loader_calls += 1
            e, proj = n.split(".")
            if proj == "down":
                self.m.w2.data[int(e)].copy_(t)
            else:
                self.m.w13.data[int(e)].narrow(0, 0 if proj == "gate" else I, I).copy_(t)

    def signature(self):
        shapes = {f"{e}.{p}": (((K, I) if p == "down" else (I, K)), False)
                  for e in range(self.e) for p in ("gate", "up", "down")}
        return shapes, {n: torch.float8_e4m3fn for n in shapes}, set()


def _tensors(experts: int, seed: int) -> dict:
    return {f"{e}.{p}": _codes(*((K, I) if p == "down" else (I, K)), seed=seed * 10_000 + 3 * e + i)
            for e in range(experts) for i, p in enumerate(("gate", "up", "down"))}


def run(experts: int, held: bool, reps: int) -> dict:
    ad = Experts(experts, held)
    secs, replayed = [], 0
    for v in range(1, reps + 2):
        t = _tensors(experts, v)
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
