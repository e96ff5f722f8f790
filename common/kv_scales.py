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


def check_kv_scales_at_load(layer, prefix: str, kv_cache_dtype: str, policy: str, log) -> bool:
    """Both engines' rule when an attention layer's weights are processed: does it have trainer-set
    k/v scales (> 0; a layer without ``k_scale`` attributes counts as having them)?  Noted on the
    layer (``grid_kv_scales_from_checkpoint``).  Without them an FP8 KV cache uses 1.0 (|K| or |V|
    beyond 448 saturates): a warning, or a load error under ``kv_cache_scales: required``."""
    provided = all(float(getattr(layer, n, -1.0)) > 0 for n in ("k_scale", "v_scale")) \
        if hasattr(layer, "k_scale") else True
    layer.grid_kv_scales_from_checkpoint = provided
    if kv_cache_dtype.startswith("fp8") and not provided:
        if policy == "required":
            raise ValueError(f"{prefix}: --kv-cache-dtype {kv_cache_dtype} needs k_scale and v_scale for this "
                             "layer (quantization config says kv_cache_scales: required)")
        log.warning("mxfp8-learner-grid: %s runs an FP8 KV cache without k/v scales (1.0 is used; "
                    "values beyond 448 saturate) until the trainer sets them", prefix)
    return provided
