"""The wire format: how a learner's on-grid weights travel to a sampler.

For every on-grid Linear ``<module>`` (Hugging Face names)::

    <module>.weight            float8_e4m3fn  [N, K]        TE's rowwise data bytes
    <module>.weight_scale_inv  uint8 (E8M0)   [N, K/32]     TE's rowwise scales: compact,
                                                            padding stripped, never swizzled

Expert weights may also travel stacked ([E, N, K] + [E, N, K/32]).  Everything else
(embeddings, norms, lm_head, routers, biases) travels in its own dtype under its own
name.  A checkpoint in this format says so in ``config.json``::

    "quantization_config": {"quant_method": "mxfp8-learner-grid", "fmt": "e4m3",
                            "block_size": 32, "scale_format": "e8m0", "modules": {...}}

This module owns the names; ``grid_weight.GridWeight`` the checks (one rule set, used by
``check_pair`` here); the plugins and the learner tools use both.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from . import format as F
from .selection import ModuleSelection

QUANT_METHOD = "mxfp8-learner-grid"
WEIGHT_SUFFIX = ".weight"
SCALE_SUFFIX = ".weight_scale_inv"
WIRE_VERSION = 1


class WireFormatError(ValueError):
    """A tensor that is not in the wire format; the message names the tensor."""


def scale_name(weight_name: str) -> str:
    if not weight_name.endswith(WEIGHT_SUFFIX):
        raise WireFormatError(f"{weight_name}: on-grid weights are named '<module>.weight'")
    return weight_name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX


def weight_name(scale_name_: str) -> str:
    if not scale_name_.endswith(SCALE_SUFFIX):
        raise WireFormatError(f"{scale_name_}: scales are named '<module>.weight_scale_inv'")
    return scale_name_[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def check_pair(name: str, data: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
    """Validate one on-grid weight and its scales; raise :class:`WireFormatError` naming ``name``.

    The one rule set (``grid_weight.GridWeight.checked``): float8_e4m3fn data and uint8 scales on
    one device, 2-D or 3-D, N and K multiples of 32 (TE's rule; it keeps tensor-parallel shards
    exact), the unpadded scale shape, and the E8M0 range (255 = NaN is never a valid learner scale).
    """
    from .grid_weight import GridWeight          # grid_weight builds on this module's names
    GridWeight.checked(name, data, scales)


def split_state_dict(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                                    dict[str, torch.Tensor]]:
    """Split a wire-format state dict into {weight name: (data, scales)} and plain tensors.

    A float8 ``.weight`` without scales, or scales without a weight, is an error.
    """
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_scale_name(name):
            if weight_name(name) not in tensors:
                raise WireFormatError(f"{name}: scales without a '{weight_name(name)}' tensor")
            continue
        if t.dtype == F.FP8_DTYPE:
            s = tensors.get(scale_name(name)) if name.endswith(WEIGHT_SUFFIX) else None
            check_pair(name, t, s)
            pairs[name] = (t, s)
        else:
            plain[name] = t
    return pairs, plain


def quantization_config(selection: Optional[ModuleSelection] = None, **extra: Any) -> dict[str, Any]:
    """The ``quantization_config`` block of a wire-format checkpoint's config.json."""
    cfg: dict[str, Any] = {
        "quant_method": QUANT_METHOD,
        "wire_version": WIRE_VERSION,
        "fmt": "e4m3",
        "block_size": F.BLOCK_SIZE,
        "scale_format": "e8m0",
        "activation_scheme": "dynamic_1x32",
        "modules": (selection or ModuleSelection()).to_dict(),
    }
    cfg.update(extra)
    return cfg
