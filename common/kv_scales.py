"""FP8 (E4M3) KV-cache scales owned by the trainer.

The engines' rule (vLLM and SGLang, per layer, per tensor): the cache stores
``e4m3(k / k_scale)`` and attention reads ``e4m3_value * k_scale``.  A trainer picks
``k_scale = amax(|K|) / 448`` over the layer's keys on a calibration batch (likewise V),
optionally with a margin, so that nothing saturates at 448.  This module computes them
and names them as the checkpoint / weight update carries them:
``model.layers.<i>.self_attn.k_scale`` and ``...v_scale`` (fp32 scalars).
"""

from __future__ import annotations

from typing import Mapping

import torch

from .format import E4M3_MAX

MIN_SCALE = 1e-12


def kv_scale_from_amax(amax: float, margin: float = 1.0) -> float:
    """``max(amax * margin / 448, MIN_SCALE)``: the scale that maps ``amax`` to the E4M3 maximum."""
    if not amax >= 0:
        raise ValueError(f"amax must be a non-negative number; got {amax}")
    return max(float(amax) * margin / E4M3_MAX, MIN_SCALE)


def kv_scale(t: torch.Tensor, margin: float = 1.0) -> float:
    """Scale for one layer's K (or V) activations ``t`` (any shape)."""
    return kv_scale_from_amax(float(t.detach().abs().max()), margin)


def kv_scale_tensors(k_amax: Mapping[int, float], v_amax: Mapping[int, float], margin: float = 1.0,
                     prefix: str = "model.layers") -> dict[str, torch.Tensor]:
    """{``<prefix>.<i>.self_attn.k_scale``: fp32 scalar, ...} from per-layer amaxes."""
    out = {}
    for i, a in k_amax.items():
        out[f"{prefix}.{i}.self_attn.k_scale"] = torch.tensor(kv_scale_from_amax(a, margin), dtype=torch.float32)
    for i, a in v_amax.items():
        out[f"{prefix}.{i}.self_attn.v_scale"] = torch.tensor(kv_scale_from_amax(a, margin), dtype=torch.float32)
    return out
