"""The write plan's replay alone: the host time of writing a bucket by replay, the recorder's way against the
plan's own accounting (``common/sync/plan.py``), on a synthetic engine with a Qwen3-8B-like number of writes.

    python benchmarks/bench_replay.py [--layers 36] [--device cpu|cuda] [--backup device|host|off] [--reps 7]
        [--out FILE]

The engine: ``--layers`` decoder layers of small tensors (so that copying is cheap and the per-write host
work shows), each written as a Qwen3 layer is -- q, k, v into one fused ``qkv`` parameter, gate and up into
one ``gate_up``, o, down and two norms as they are: 9 learner tensors, 11 writes... per layer as
vLLM's loaders make them (plus embeddings and the final norm).  An update session (``UpdateSession``, sampled
digests, ``--backup``) writes the same tensors after a first clean update left a plan:

* ``recorded``: every replayed copy passes the recorder's dispatch mode (``plan.active`` patched to say no
  recorder is active: the path a replay took before the plan accounted for its own writes);
* ``direct``: the shipped path -- the plan records each write with the recorder and copies the bucket in
  one ``torch._foreach_copy_`` per device pair and dtype.

Reported per arm: the session's ``loaders_s`` (median over ``--reps`` updates) and per write in us, and the
ratio ``recorded / direct`` in the same run.  Each update's report must be clean.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from mxfp8_learner_grid.common.sync import plan as plan_mod
from mxfp8_learner_grid.common.sync.manifest import Manifest
from mxfp8_learner_grid.common.sync.plan import WritePlan
from mxfp8_learner_grid.common.sync.session import EngineAdapter, UpdateSession

H, I = 64, 128          # hidden and intermediate sizes: small, so that the host work per write dominates


def _learner_shapes(layers: int) -> dict:
    out = {"model.embed_tokens.weight": (256, H), "model.norm.weight": (H,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (H // 2, H),
                    p + "self_attn.v_proj.weight": (H // 2, H), p + "self_attn.o_proj.weight": (H, H),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    return out


class SyntheticAdapter(EngineAdapter):
    """A vLLM-like module tree with fused qkv and gate_up parameters, and a loader that narrows into them."""

    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", H), "v_proj": ("qkv_proj", H + H // 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", I)}

    def __init__(self, layers: int, device):
        self.shapes = _learner_shapes(layers)
        m = torch.nn.Module()
        self.params = {}
        for name, shape in self.shapes.items():
            target, _ = self._target(name)
            if target not in self.params:
                full = (2 * H, H) if target.endswith("qkv_proj.weight") else \
                    (2 * I, H) if target.endswith("gate_up_proj.weight") else shape
                self.params[target] = torch.nn.Parameter(torch.zeros(full, device=device, dtype=torch.bfloat16),
                                                         requires_grad=False)
        for target, p in self.params.items():
            m.register_parameter(target.replace(".", "__"), p)
        self.m = m
        self.plan = WritePlan()

    def _target(self, name: str):
        for k, (fused, off) in self.FUSED.items():
            if f".{k}." in name:
                return name.replace(k, fused), off
        return name, None

    def model(self):
        return self.m

    def load(self, named):
        self.load_planned(named, self._engine_load)

    def _engine_load(self, named):
        for name, t in named:
            target, off = self._target(name)
            p = self.params[target]
            dest = p.data if off is None else p.data.narrow(0, off, t.shape[0])
            dest.copy_(t)

    def signature(self):
        return ({n: (s, False) for n, s in self.shapes.items()}, {n: torch.bfloat16 for n in self.shapes}, set())

    def scope(self, touched):
        return dict(self.m.named_parameters())


def _tensors(shapes: dict, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=device).to(torch.bfloat16) for n, s in shapes.items()}


def _update(ad, version, tensors, backup):
    s = UpdateSession(ad, Manifest.of(tensors, version, "bf16"), backup=backup, digest="sampled")
    s.load(list(tensors.items()))
    rep = s.finish()
    if rep.failed():
        raise SystemExit(rep.summary())
    s.commit(True)
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backup", default="device", choices=["device", "host", "off"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    device = torch.device(a.device)
    backup = False if a.backup == "off" else a.backup
    ad = SyntheticAdapter(a.layers, device)
    version = 1
    _update(ad, version, _tensors(ad.shapes, device, 0), backup)       # the loaders' update: leaves the plan
    real_active = plan_mod.active
    rows = {}
    for arm in ("recorded", "direct", "recorded", "direct"):          # interleaved: drift hits both arms
        plan_mod.active = (lambda: None) if arm == "recorded" else real_active
        try:
            times, writes = [], 0
            for r in range(a.reps):
                version += 1
                s = _update(ad, version, _tensors(ad.shapes, device, version), backup)
                if s.timings["replayed"] != len(ad.shapes):
                    raise SystemExit(f"{arm}: replayed {s.timings['replayed']} of {len(ad.shapes)} tensors")
                times.append(s.timings["loaders_s"])
                writes = len(s.recorder.writes)
        finally:
            plan_mod.active = real_active
        rows.setdefault(arm, []).extend(times)
    out = {"bench": "replay", "layers": a.layers, "device": str(device), "backup": a.backup,
           "tensors": len(ad.shapes), "writes": writes, "reps": 2 * a.reps}
    for arm, times in rows.items():
        med = statistics.median(times)
        out[f"{arm}_loaders_s"] = round(med, 5)
        out[f"{arm}_us_per_write"] = round(med / writes * 1e6, 1)
    out["recorded_over_direct"] = round(out["recorded_loaders_s"] / out["direct_loaders_s"], 2)
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    out["date"] = time.strftime("%Y-%m-%d")
    out["torch"] = torch.__version__
    out["command"] = "python benchmarks/bench_replay.py " + " ".join(sys.argv[1:])
    print(json.dumps(out))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
