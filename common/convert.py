"""Write a wire-format (pre-quantized) checkpoint, from a BF16 Hugging Face checkpoint or a TE export.

    mxfp8-grid-convert hf  SRC_DIR DST_DIR [--modules grid.yaml]
    mxfp8-grid-convert te  EXPORT DST_DIR --hf-config HF_DIR [--rename megatron-qwen3 | rules.yaml]

``hf`` (this module, :func:`convert_hf`): every Linear weight of the model (and every MoE expert
projection) that the module selection puts on the grid is quantized rowwise (TE-exact) into
``<m>.weight`` (fp8) + ``<m>.weight_scale_inv`` (uint8 [N, K/32]); everything else is copied as
is.  Which tensors are Linear weights is read from the architecture (``transformers``, meta device).

``te`` (``te_export.convert_te``): the learner's own bytes, no quantization at all -- a TE
``MXFP8Tensor`` or its flattened ``_rowwise_data`` / ``_rowwise_scale_inv`` form, read by
``GridWeight.from_te`` (padding stripped, swizzle undone); names mapped by ``megatron_names``.

Both write ``config.json`` with ``quantization_config.quant_method = "mxfp8-learner-grid"``
(``shards``), so ``vllm serve DST_DIR`` picks the plugin without ``--quantization``.

The converter lives in a few modules; this one keeps every name it ever exported::

    convert       HF conversion (grid_weight_names, convert_hf) and the re-exports below
    convert_cli   the ``mxfp8-grid-convert`` command line (main)
    shards        the safetensors shard writer and config.json (ShardWriter, write_config)
    te_export     TE / Megatron exports (load_te_export, convert_te)
    megatron_names  the Megatron -> HF name table (megatron_qwen3_rename, rules_rename)
    grid_weight   the TE reader and the rule set (GridWeight.from_te)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from . import format as F
from .convert_cli import main
from .grid_weight import GridWeight, check_grid_shape
from .megatron_names import megatron_qwen3_rename, rules_rename
from .quantize import quantize_rows
from .selection import ModuleSelection
from .shards import AUX_FILES, MAX_SHARD_BYTES, ShardWriter, write_config
from .te_export import TE_DATA, TE_SCALE, TE_SWZ, convert_te, load_te_export
from .wire import WEIGHT_SUFFIX

# the names these had here before the split
_ShardWriter, _write_config = ShardWriter, write_config

__all__ = ["AUX_FILES", "MAX_SHARD_BYTES", "TE_DATA", "TE_SCALE", "TE_SWZ", "ShardWriter", "convert_hf",
           "convert_te", "grid_weight_names", "load_te_export", "main", "megatron_qwen3_rename", "rules_rename",
           "write_config"]


# -- which tensors of an HF checkpoint are on-grid Linear weights ------------------------

def grid_weight_names(config_dir: os.PathLike, selection: ModuleSelection) -> set[str]:
    """HF checkpoint names of the Linear / expert weights the selection puts on the grid."""
    try:
        import transformers
        from torch import nn
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError("converting an HF checkpoint needs `transformers` (to read the architecture)") from exc
    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    names: set[str] = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            if selection.matches(mname) and mod.in_features % F.BLOCK_SIZE == 0 \
                    and mod.out_features % F.BLOCK_SIZE == 0:
                names.add(mname + WEIGHT_SUFFIX)
        elif isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor) and getattr(mod, "gate_up_proj").dim() == 3:
            if selection.matches(mname):
                for e in range(mod.gate_up_proj.shape[0]):
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        names.add(f"{mname}.{e}.{proj}{WEIGHT_SUFFIX}")
    return names


def _iter_checkpoint(src: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                yield f.name, name, fh.get_tensor(name)


def convert_hf(src: os.PathLike, dst: os.PathLike, selection: Optional[ModuleSelection] = None) -> dict:
    """BF16 HF checkpoint -> wire-format checkpoint.  Returns counts."""
    src, dst = Path(src), Path(dst)
    selection = selection or ModuleSelection()
    dst.mkdir(parents=True, exist_ok=True)
    on_grid = grid_weight_names(src, selection)
    writer = ShardWriter(dst)
    seen, n_grid = set(), 0
    for _, name, t in _iter_checkpoint(src):
        if name in on_grid:
            check_grid_shape(name, t.shape)
            for k, v in GridWeight(name, *quantize_rows(t)).to_wire().items():
                writer.add(k, v)
            n_grid += 1
            seen.add(name)
        else:
            writer.add(name, t)
    writer.close()
    missing = on_grid - seen
    if missing:
        raise ValueError(f"the checkpoint lacks on-grid weights the architecture has: {sorted(missing)[:8]}")
    write_config(src, dst, selection, checkpoint_format="wire",
                 producer={"name": "mxfp8-learner-grid", "tool": "mxfp8-grid-convert hf"})
    return {"grid_weights": n_grid}


if __name__ == "__main__":
    raise SystemExit(main())
