"""Write a wire-format (pre-quantized) checkpoint, from a BF16 Hugging Face checkpoint or a TE export.

    mxfp8-grid-convert hf  SRC_DIR DST_DIR [--modules grid.yaml]
    mxfp8-grid-convert te  EXPORT DST_DIR --hf-config HF_DIR [--rename megatron-qwen3 | rules.yaml]

``hf``: every Linear weight of the model (and every MoE expert projection) that the module
selection puts on the grid is quantized rowwise (TE-exact) into ``<m>.weight`` (fp8) +
``<m>.weight_scale_inv`` (uint8 [N, K/32]); everything else is copied as is.  Which tensors
are Linear weights is read from the architecture (``transformers``, meta device).

``te``: the learner's own bytes, no quantization at all.  EXPORT is a ``.safetensors`` or
``.pt`` state dict in which each MXFP8 parameter ``<p>`` is either a Transformer Engine
``MXFP8Tensor`` (``.pt``, TE installed) or flattened as ``<p>._rowwise_data`` (uint8),
``<p>._rowwise_scale_inv`` (uint8, TE's padded compact or GEMM-swizzled layout) and
optionally ``<p>._with_gemm_swizzled_scales`` (0-d).  Padding is stripped and the swizzle
undone.  ``--rename`` maps TE/Megatron names to HF names: the built-in ``megatron-qwen3``
(also splits Megatron's fused ``linear_qkv`` / ``linear_fc1`` row-exactly), or a YAML list of
``[regex, replacement]`` rules.  Config, tokenizer and generation files come from --hf-config.

Both write ``config.json`` with ``quantization_config.quant_method = "mxfp8-learner-grid"``,
so ``vllm serve DST_DIR`` picks the plugin without ``--quantization``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch

from . import format as F
from .layout import strip_padding, unswizzle_scales
from .quantize import quantize_rows
from .selection import ModuleSelection
from .wire import SCALE_SUFFIX, WEIGHT_SUFFIX, quantization_config, split_state_dict

AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
MAX_SHARD_BYTES = 4 << 30


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


class _ShardWriter:
    def __init__(self, dst: Path):
        self.dst, self.buf, self.size, self.n, self.index = dst, {}, 0, 0, {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self.buf[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= MAX_SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file
        if not self.buf:
            return
        self.n += 1
        fname = f"model-{self.n:05d}.safetensors"
        save_file(self.buf, str(self.dst / fname), metadata={"format": "pt"})
        for k in self.buf:
            self.index[k] = fname
        self.buf, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        if self.n == 1:
            os.replace(self.dst / "model-00001.safetensors", self.dst / "model.safetensors")
        else:
            total = sum((self.dst / f).stat().st_size for f in set(self.index.values()))
            (self.dst / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": self.index}, indent=1))


def _write_config(src_cfg_dir: Path, dst: Path, selection: ModuleSelection, **extra) -> None:
    cfg = json.loads((src_cfg_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(selection, **extra)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in AUX_FILES:
        if (src_cfg_dir / f).exists():
            shutil.copy(src_cfg_dir / f, dst / f)


def convert_hf(src: os.PathLike, dst: os.PathLike, selection: Optional[ModuleSelection] = None) -> dict:
    """BF16 HF checkpoint -> wire-format checkpoint.  Returns counts."""
    src, dst = Path(src), Path(dst)
    selection = selection or ModuleSelection()
    dst.mkdir(parents=True, exist_ok=True)
    on_grid = grid_weight_names(src, selection)
    writer = _ShardWriter(dst)
    seen, n_grid = set(), 0
    for _, name, t in _iter_checkpoint(src):
        if name in on_grid:
            if t.shape[-1] % F.BLOCK_SIZE or t.shape[-2] % F.BLOCK_SIZE:
                raise ValueError(f"{name}: shape {tuple(t.shape)} is not on the MXFP8 grid")
            q, s = quantize_rows(t)
            writer.add(name, q)
            writer.add(name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX, s)
            n_grid += 1
            seen.add(name)
        else:
            writer.add(name, t)
    writer.close()
    missing = on_grid - seen
    if missing:
        raise ValueError(f"the checkpoint lacks on-grid weights the architecture has: {sorted(missing)[:8]}")
    _write_config(src, dst, selection, checkpoint_format="wire",
                  producer={"name": "mxfp8-learner-grid", "tool": "mxfp8-grid-convert hf"})
    return {"grid_weights": n_grid}


# -- TE / Megatron exports ---------------------------------------------------------------

TE_DATA, TE_SCALE, TE_SWZ = "._rowwise_data", "._rowwise_scale_inv", "._with_gemm_swizzled_scales"


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
                raise ValueError(f"{base}: TE export has {TE_DATA} without {TE_SCALE}")
            swz = bool(raw[base + TE_SWZ].item()) if base + TE_SWZ in raw else False
            out[base] = _te_pair(base, raw[name], raw[base + TE_SCALE], swz)
        elif hasattr(t, "_rowwise_scale_inv"):
            from .learner import wire_from_te
            out[name] = wire_from_te(t, name)
        else:
            out[name] = t
    return out


def _te_pair(name, data, scales, swizzled):
    data = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    m, k = F.check_te_shape(data.shape)
    if scales.dtype != torch.uint8:
        raise ValueError(f"{name}: {TE_SCALE} must be uint8; got {scales.dtype}")
    if swizzled:
        scales = unswizzle_scales(scales)
    s = strip_padding(scales, m, k // F.BLOCK_SIZE).reshape(*data.shape[:-1], k // F.BLOCK_SIZE)
    return data.view(F.FP8_DTYPE), s


def megatron_qwen3_rename(hf_config: dict) -> Callable[[str, object], list[tuple[str, object]]]:
    """Megatron-Core GPT/Qwen3 names -> HF names, splitting fused linear_qkv and linear_fc1 by rows.

    Row splits are exact on the grid: rowwise scales belong to rows, so the q/k/v and
    gate/up parts of the fused tensors carry their own scales unchanged.
    """
    nh, nkv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    hd = hf_config.get("head_dim") or hf_config["hidden_size"] // nh
    per_group = nh // nkv

    def rows(x, idx):
        if isinstance(x, tuple):
            return (x[0][idx], x[1][idx])
        return x[idx]

    def split_qkv(prefix, x):
        n = (x[0] if isinstance(x, tuple) else x).shape[0]
        assert n == nkv * (per_group + 2) * hd, f"{prefix}: fused qkv has {n} rows"
        idx = torch.arange(n).reshape(nkv, per_group + 2, hd)
        q, k, v = idx[:, :per_group].reshape(-1), idx[:, per_group].reshape(-1), idx[:, per_group + 1].reshape(-1)
        return [(f"{prefix}.self_attn.{p}.weight", rows(x, i)) for p, i in (("q_proj", q), ("k_proj", k),
                                                                               ("v_proj", v))]

    def split_fc1(prefix, x):
        n = (x[0] if isinstance(x, tuple) else x).shape[0]
        return [(f"{prefix}.gate_proj.weight", rows(x, slice(0, n // 2))),
                (f"{prefix}.up_proj.weight", rows(x, slice(n // 2, n)))]

    simple = [
        (r"^(?:module\.)?embedding\.word_embeddings\.weight$", "model.embed_tokens.weight"),
        (r"^(?:module\.)?output_layer\.weight$", "lm_head.weight"),
        (r"^(?:module\.)?decoder\.final_layernorm\.weight$", "model.norm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight$",
         r"model.layers.\1.input_layernorm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.input_layernorm\.weight$", r"model.layers.\1.input_layernorm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.self_attention\.q_layernorm\.weight$",
         r"model.layers.\1.self_attn.q_norm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.self_attention\.k_layernorm\.weight$",
         r"model.layers.\1.self_attn.k_norm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight$",
         r"model.layers.\1.self_attn.o_proj.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight$",
         r"model.layers.\1.post_attention_layernorm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight$",
         r"model.layers.\1.post_attention_layernorm.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.router\.weight$", r"model.layers.\1.mlp.gate.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight$",
         r"model.layers.\1.mlp.experts.\2.down_proj.weight"),
        (r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc2\.weight(\d+)$",
         r"model.layers.\1.mlp.experts.\2.down_proj.weight"),
    ]
    qkv = re.compile(r"^(?:module\.)?decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight$")
    fc1 = re.compile(r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight$")
    efc1 = re.compile(r"^(?:module\.)?decoder\.layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc1\.weight"
                      r"|linear_fc1\.weight(\d+))$")

    def rename(name, x):
        if m := qkv.match(name):
            return split_qkv(f"model.layers.{m.group(1)}", x)
        if m := fc1.match(name):
            return split_fc1(f"model.layers.{m.group(1)}.mlp", x)
        if m := efc1.match(name):
            return split_fc1(f"model.layers.{m.group(1)}.mlp.experts.{m.group(2) or m.group(3)}", x)
        for pat, rep in simple:
            if re.match(pat, name):
                return [(re.sub(pat, rep, name), x)]
        if name.endswith("._extra_state") or "_amax" in name:
            return []
        raise ValueError(f"megatron-qwen3: no HF name for {name!r}")

    return rename


def rules_rename(rules: Iterable[tuple[str, str]]) -> Callable[[str, object], list[tuple[str, object]]]:
    compiled = [(re.compile(p), r) for p, r in rules]

    def rename(name, x):
        for pat, rep in compiled:
            if pat.search(name):
                new = pat.sub(rep, name)
                return [] if new == "" else [(new, x)]
        return [(name, x)]
    return rename


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
                if not new.endswith(WEIGHT_SUFFIX):
                    raise ValueError(f"{name}: an MXFP8 tensor must map to '<module>.weight'; got {new!r}")
                out[new], out[new[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX] = y[0].contiguous(), y[1].contiguous()
                n_grid += 1
            else:
                out[new] = y.contiguous() if isinstance(y, torch.Tensor) else y
    split_state_dict(out)          # every fp8 weight has valid scales (names the tensor otherwise)
    writer = _ShardWriter(dst)
    for k, v in out.items():
        writer.add(k, v)
    writer.close()
    _write_config(hf_dir, dst, selection or ModuleSelection(), checkpoint_format="wire",
                  producer={"name": "mxfp8-learner-grid", "tool": "mxfp8-grid-convert te"})
    return {"grid_weights": n_grid, "tensors": len(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mxfp8-grid-convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf", help="BF16 Hugging Face checkpoint -> wire format (quantized TE-exactly)")
    h.add_argument("src")
    h.add_argument("dst")
    h.add_argument("--modules", help="YAML/JSON module selection (include/exclude/layers)")
    t = sub.add_parser("te", help="TE / Megatron export -> wire format (the learner's bytes)")
    t.add_argument("export")
    t.add_argument("dst")
    t.add_argument("--hf-config", required=True, help="HF model dir with config.json (and tokenizer files)")
    t.add_argument("--rename", help="'megatron-qwen3' or a YAML list of [regex, replacement] rules")
    t.add_argument("--modules", help="module selection written to quantization_config")
    a = ap.parse_args(argv)
    sel = None
    if a.modules:
        import yaml
        sel = ModuleSelection.from_dict(yaml.safe_load(Path(a.modules).read_text()))
    if a.cmd == "hf":
        r = convert_hf(a.src, a.dst, sel)
    else:
        r = convert_te(a.export, a.dst, a.hf_config, a.rename, sel)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
