"""Megatron-Core's tensor-parallel layouts, written from HF weights for the tests (independently of
``common/sync/megatron.py``, which undoes them): this rank's parameters of Megatron's GPT with TE
layers, under Megatron's names, optionally as TE MXFP8 tensors."""

import torch

from mxfp8_learner_grid.common.layout import swizzle_scales
from mxfp8_learner_grid.common.quantize import quantize_mxfp8


class FakeTEMXFP8Tensor:
    """transformer_engine's MXFP8Tensor fields: rowwise bytes, padded and (here) swizzled scales."""

    def __init__(self, w):
        q = quantize_mxfp8(w, rowwise=True, columnwise=False)
        self.shape = w.shape
        self._rowwise_data = q.rowwise_data.view(torch.uint8)
        self._rowwise_scale_inv = swizzle_scales(q.rowwise_scale_inv.clone())
        self._with_gemm_swizzled_scales = True


def megatron_shards(sd, cfg, moe, rank, tp, mxfp8, padded_vocab):
    """This TP rank's Megatron-Core parameters (names and layouts of Megatron's GPT with TE layers)."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per = nh // nkv

    def rows(t, n):
        return t.chunk(tp, dim=0)[rank] if n is None else t[rank * n:(rank + 1) * n]

    def cols(t):
        return t.chunk(tp, dim=1)[rank]

    def lin(t):
        return FakeTEMXFP8Tensor(t) if mxfp8 else t.clone()

    def gated(gate, up):
        return torch.cat([rows(gate, None), rows(up, None)])
    emb = sd["model.embed_tokens.weight"]
    pad = torch.zeros(padded_vocab - cfg["vocab_size"], cfg["hidden_size"], dtype=emb.dtype)
    out = {"embedding.word_embeddings.weight": rows(torch.cat([sd["model.embed_tokens.weight"], pad]), None),
           "output_layer.weight": rows(torch.cat([sd["lm_head.weight"], pad]), None),
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p, m = f"model.layers.{i}", f"module.decoder.layers.{i}"
        q, k, v = (sd[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
        groups = range(rank * nkv // tp, (rank + 1) * nkv // tp)          # whole query groups per rank
        qkv = torch.cat([torch.cat([q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                         for g in groups])
        out.update({f"{m}.self_attention.linear_qkv.weight": lin(qkv),
                    f"{m}.self_attention.linear_qkv._extra_state": torch.zeros(3, dtype=torch.uint8),
                    f"{m}.self_attention.linear_proj.weight": lin(cols(sd[f"{p}.self_attn.o_proj.weight"])),
                    f"{m}.self_attention.linear_qkv.layer_norm_weight": sd[f"{p}.input_layernorm.weight"],
                    f"{m}.self_attention.q_layernorm.weight": sd[f"{p}.self_attn.q_norm.weight"],
                    f"{m}.self_attention.k_layernorm.weight": sd[f"{p}.self_attn.k_norm.weight"]})
        if moe:
            out[f"{m}.pre_mlp_layernorm.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
            out[f"{m}.mlp.router.weight"] = sd[f"{p}.mlp.gate.weight"]
            for e in range(cfg.get("num_experts") or cfg["num_local_experts"]):
                x = f"{p}.mlp.experts.{e}"
                out[f"{m}.mlp.experts.linear_fc1.weight{e}"] = lin(gated(sd[f"{x}.gate_proj.weight"],
                                                                         sd[f"{x}.up_proj.weight"]))
                out[f"{m}.mlp.experts.linear_fc2.weight{e}"] = lin(cols(sd[f"{x}.down_proj.weight"]))
        else:
            out[f"{m}.mlp.linear_fc1.layer_norm_weight"] = sd[f"{p}.post_attention_layernorm.weight"]
            out[f"{m}.mlp.linear_fc1.weight"] = lin(gated(sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]))
            out[f"{m}.mlp.linear_fc2.weight"] = lin(cols(sd[f"{p}.mlp.down_proj.weight"]))
    return out
