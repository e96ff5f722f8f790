"""Megatron-Core / Transformer Engine parameter names -> Hugging Face checkpoint names.

``megatron_qwen3_rename``: the built-in table for Megatron's GPT / Qwen3 (dense and MoE) layers,
splitting the fused ``linear_qkv`` and ``linear_fc1`` tensors by rows (exact on the grid: rowwise
scales belong to rows); ``rules_rename``: a list of ``[regex, replacement]`` rules.  Both return a
function ``rename(name, x) -> [(hf_name, x_part), ...]`` where ``x`` is a tensor or an on-grid
``(data, scales)`` pair ([] drops the tensor).  Used by ``mxfp8-grid-convert te`` and by
``sync.megatron.MegatronTPSource`` (whose own table says how Megatron *splits* each parameter
across TP ranks -- a different question, not a second name table).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import torch


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
