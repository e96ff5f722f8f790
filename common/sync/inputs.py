"""What trainers actually hold, turned into the Hugging Face checkpoint names the engines load.

``update_weights`` takes a trainer's tensors as they are and normalizes them here, without
copies:

* transformers 5 keeps Qwen3-MoE (and similar) experts fused in memory:
  ``<...>.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
  ``<...>.experts.down_proj`` [E, H, I].  They are split into per-expert
  ``<...>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` *views*: no byte is copied, and
  the learner-side fingerprints of byte identity read the fused tensor itself.
* Anything else passes through under its own name (the manifest then refuses names the
  engine's checkpoint does not have, naming them).

A fused tensor of the wrong rank or an odd gate_up size is refused with the layout that
would have been accepted, before anything reaches the engine.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from .recorder import UpdateRejected

FUSED_EXPERTS = re.compile(r"^(?P<experts>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")


def fused_plan(name: str, shape: tuple) -> list[tuple[str, tuple, tuple]]:
    """[(per-expert HF name, index into the fused tensor, that view's shape)] of a transformers 5
    fused-experts tensor of ``shape``; refuses a wrong layout, naming it and the accepted one."""
    m = FUSED_EXPERTS.match(name)
    kind, experts = m["kind"], m["experts"]
    if len(shape) != 3:
        want = "[E, 2I, H] (gate rows, then up rows)" if kind == "gate_up_proj" else "[E, H, I]"
        raise UpdateRejected(f"{name}: fused experts with 3-D shape {want} expected (transformers 5 layout); "
                             f"got shape {tuple(shape)}")
    e_n, rows, cols = (int(d) for d in shape)
    out = []
    if kind == "gate_up_proj":
        if rows % 2:
            raise UpdateRejected(f"{name}: fused gate_up_proj [E, 2I, H] needs an even dim 1; got {tuple(shape)}")
        inter = rows // 2
        for e in range(e_n):
            out.append((f"{experts}.{e}.gate_proj.weight", (e, slice(0, inter)), (inter, cols)))
            out.append((f"{experts}.{e}.up_proj.weight", (e, slice(inter, rows)), (inter, cols)))
    else:
        out += [(f"{experts}.{e}.down_proj.weight", (e,), (rows, cols)) for e in range(e_n)]
    return out


def split_fused_experts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(n, t[idx]) for n, idx, _ in fused_plan(name, tuple(t.shape))]


def trainer_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{HF checkpoint name: tensor (a view where split)} from a trainer's (name, tensor) pairs."""
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        pairs = split_fused_experts(name, t) if FUSED_EXPERTS.match(name) else [(name, t)]
        for n, v in pairs:
            if n in out:
                raise UpdateRejected(f"{n}: given twice (once fused, once per expert?)")
            out[n] = v
    return out
