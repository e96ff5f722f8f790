"""A Transformer Engine / Megatron export -> a wire-format checkpoint, the learner's bytes unchanged.

EXPORT is a ``.safetensors`` or ``.pt`` state dict in which each MXFP8 parameter ``<p>`` is either
a Transformer Engine ``MXFP8Tensor`` (``.pt``, TE installed) or flattened as
``<p>._rowwise_data`` (uint8), ``<p>._rowwise_scale_inv`` (uint8, TE's padded compact or
GEMM-swizzled layout) and optionally ``<p>._with_gemm_swizzled_scales`` (0-d).  Either form is
read by ``GridWeight.from_te`` (padding stripped, swizzle undone).  Names are mapped to HF names
by ``megatron_names`` (or a callable); config, tokenizer and generation files come from the HF
config directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from .grid_weight import TE_ROWWISE_DATA, TE_ROWWISE_SCALES, TE_SWIZZLED, GridWeight
from .megatron_names import megatron_qwen3_rename, rules_rename
from .selection import ModuleSelection
from .shards import ShardWriter, write_config
from .wire import WireFormatError, split_state_dict

#: suffixes of a flattened TE export
TE_DATA, TE_SCALE, TE_SWZ = "." + TE_ROWWISE_DATA, "." + TE_ROWWISE_SCALES, "." + TE_SWIZZLED


def load_te_export(path: os.PathLike) -> dict[str, object]:
    """A TE export as {name: tensor or (fp8 data, unpadded scales)} (flattened or MXFP8Tensor form)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        raw = load_file(str(path))
    else:
        raw = torch.load(str(path), map_location="cpu", weights_only=False)
    out: dict[str, object] = {}
    for name, t in raw.items():
        if name.endswith(TE_SCALE) or name.endswith(TE_SWZ):
            continue
        if name.endswith(TE_DATA):
            base = name[: -len(TE_DATA)]
            if base + TE_SCALE not in raw:
                raise WireFormatError(f"{base}: TE export has {TE_DATA} without {TE_SCALE}")
            state = {TE_ROWWISE_DATA: t, TE_ROWWISE_SCALES: raw[base + TE_SCALE],
                     TE_SWIZZLED: raw.get(base + TE_SWZ, False)}
            out[base] = GridWeight.from_te(base, state).pair()
        elif hasattr(t, TE_ROWWISE_SCALES):
            out[name] = GridWeight.from_te(name, t).pair()
        else:
            out[name] = t
    return out


def convert_te(export: os.PathLike, dst: os.PathLike, hf_config_dir: os.PathLike,
               rename: str | Callable | None = None, selection: Optional[ModuleSelection] = None) -> dict:
    """TE/Megatron export -> wire-format checkpoint, carrying the learner's bytes unchanged."""
    dst, hf_dir = Path(dst), Path(hf_config_dir)
    dst.mkdir(parents=True, exist_ok=True)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    if rename == "megatron-qwen3":
        fn = megatron_qwen3_rename(hf_cfg)
    elif isinstance(rename, str):
        import yaml
        fn = rules_rename(yaml.safe_load(Path(rename).read_text()))
    else:
        fn = rename or rules_rename([])
    tensors = load_te_export(export)
    out: dict[str, torch.Tensor] = {}
    n_grid = 0
    for name, x in tensors.items():
        for new, y in fn(name, x):
            if new in out:
                raise ValueError(f"two export tensors map to {new!r}")
            if isinstance(y, tuple):
                out.update(GridWeight(name, *y).to_wire(new))     # names ``name`` unless new is '<m>.weight'
                n_grid += 1
            else:
                out[new] = y.contiguous() if isinstance(y, torch.Tensor) else y
    split_state_dict(out)          # every fp8 weight has valid scales (names the tensor otherwise)
    writer = ShardWriter(dst)
    for k, v in out.items():
        writer.add(k, v)
    writer.close()
    write_config(hf_dir, dst, selection or ModuleSelection(), checkpoint_format="wire",
                 producer={"name": "mxfp8-learner-grid", "tool": "mxfp8-grid-convert te"})
    return {"grid_weights": n_grid, "tensors": len(out)}
