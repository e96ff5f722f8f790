"""The converter: BF16 HF -> wire format, and a TE/Megatron export -> the same wire bytes."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxfp8_learner_grid.common import quantize_mxfp8, swizzle_scales
from mxfp8_learner_grid.common.convert import convert_hf, convert_te, main
from mxfp8_learner_grid.common.selection import ModuleSelection
from mxfp8_learner_grid.common.wire import QUANT_METHOD, split_state_dict

pytest.importorskip("transformers")
import tiny_models  # noqa: E402


def load_dir(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("moe", [False, True])
def test_hf_conversion(tmp_path, moe):
    src = tiny_models.save_model(tmp_path / "src", moe=moe)
    r = convert_hf(src, tmp_path / "dst")
    out, orig = load_dir(tmp_path / "dst"), load_dir(src)
    pairs, plain = split_state_dict(out)
    assert r["grid_weights"] == len(pairs) == (56 if moe else 14)
    assert set(pairs) | set(plain) == set(orig)
    assert "lm_head.weight" in plain and "model.embed_tokens.weight" in plain
    assert not any(n.endswith("mlp.gate.weight") for n in pairs)
    for n, (d, s) in pairs.items():
        q = quantize_mxfp8(orig[n])
        assert torch.equal(d.view(torch.uint8), q.rowwise_data.view(torch.uint8)) and torch.equal(s, q.rowwise_scales_unpadded())
    for n, t in plain.items():
        assert torch.equal(t, orig[n])
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == QUANT_METHOD
    assert (tmp_path / "dst" / "tokenizer.json").exists()


def test_hf_conversion_half_the_layers(tmp_path):
    src = tiny_models.save_model(tmp_path / "src")
    sel = tmp_path / "sel.yaml"
    sel.write_text("layers: [1]\n")
    assert main(["hf", str(src), str(tmp_path / "dst"), "--modules", str(sel)]) == 0
    pairs, _ = split_state_dict(load_dir(tmp_path / "dst"))
    assert pairs and all(n.startswith("model.layers.1.") for n in pairs)
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert ModuleSelection.from_dict(cfg["quantization_config"]["modules"]).layers == {1}


def te_flat(name, w, swizzled):
    """A TE MXFP8 parameter as a TE export flattens it: padded (garbage) scales, maybe swizzled."""
    q = quantize_mxfp8(w)
    s = q.rowwise_scale_inv.clone()
    s[w.shape[0]:] = 0xEE
    s[:, w.shape[1] // 32:] = 0xEE
    out = {f"{name}._rowwise_data": q.rowwise_data.view(torch.uint8),
           f"{name}._rowwise_scale_inv": swizzle_scales(s) if swizzled else s}
    if swizzled:
        out[f"{name}._with_gemm_swizzled_scales"] = torch.tensor(1, dtype=torch.uint8)
    return out


def megatron_export(hf, cfg, moe):
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per = nh // nkv
    ex = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
          "output_layer.weight": hf["lm_head.weight"], "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = (hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
        qkv = torch.cat([torch.cat([q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                         for g in range(nkv)])
        ex.update(te_flat(f"{m}.self_attention.linear_qkv.weight", qkv, swizzled=True))
        ex.update(te_flat(f"{m}.self_attention.linear_proj.weight", hf[f"{p}.self_attn.o_proj.weight"], False))
        ex[f"{m}.self_attention.linear_qkv.layer_norm_weight"] = hf[f"{p}.input_layernorm.weight"]
        ex[f"{m}.self_attention.q_layernorm.weight"] = hf[f"{p}.self_attn.q_norm.weight"]
        ex[f"{m}.self_attention.k_layernorm.weight"] = hf[f"{p}.self_attn.k_norm.weight"]
        if moe:
            ex[f"{m}.pre_mlp_layernorm.weight"] = hf[f"{p}.post_attention_layernorm.weight"]
            ex[f"{m}.mlp.router.weight"] = hf[f"{p}.mlp.gate.weight"]
            for e in range(cfg["num_local_experts"]):
                fc1 = torch.cat([hf[f"{p}.mlp.experts.{e}.gate_proj.weight"], hf[f"{p}.mlp.experts.{e}.up_proj.weight"]])
                ex.update(te_flat(f"{m}.mlp.experts.linear_fc1.weight{e}", fc1, swizzled=e % 2 == 0))
                ex.update(te_flat(f"{m}.mlp.experts.linear_fc2.weight{e}", hf[f"{p}.mlp.experts.{e}.down_proj.weight"],
                                  swizzled=False))
        else:
            ex[f"{m}.mlp.linear_fc1.layer_norm_weight"] = hf[f"{p}.post_attention_layernorm.weight"]
            fc1 = torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]])
            ex.update(te_flat(f"{m}.mlp.linear_fc1.weight", fc1, swizzled=True))
            ex.update(te_flat(f"{m}.mlp.linear_fc2.weight", hf[f"{p}.mlp.down_proj.weight"], False))
    return ex


@pytest.mark.parametrize("moe", [False, True])
def test_megatron_te_export_gives_the_same_bytes(tmp_path, moe):
    src = tiny_models.save_model(tmp_path / "src", moe=moe)
    cfg = json.loads((src / "config.json").read_text())
    hf = load_dir(src)
    save_file({k: v.contiguous() for k, v in megatron_export(hf, cfg, moe).items()}, str(tmp_path / "export.safetensors"))
    assert main(["te", str(tmp_path / "export.safetensors"), str(tmp_path / "te"), "--hf-config", str(src),
                 "--rename", "megatron-qwen3"]) == 0
    convert_hf(src, tmp_path / "hf")
    a, b = load_dir(tmp_path / "te"), load_dir(tmp_path / "hf")
    assert set(a) == set(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn
                                                        else a[n], b[n].view(torch.uint8)
                                                        if b[n].dtype == torch.float8_e4m3fn else b[n]), n


def test_te_export_errors(tmp_path):
    w = torch.randn(64, 96)
    ex = te_flat("x.weight", w, False)
    ex.pop("x.weight._rowwise_scale_inv")
    save_file(ex, str(tmp_path / "e.safetensors"))
    src = tiny_models.save_model(tmp_path / "src")
    with pytest.raises(ValueError, match="x.weight: TE export has ._rowwise_data without"):
        convert_te(tmp_path / "e.safetensors", tmp_path / "out", src)
    save_file({"decoder.layers.0.mystery.weight": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="no HF name for 'decoder.layers.0.mystery.weight'"):
        convert_te(tmp_path / "m.safetensors", tmp_path / "out2", src, rename="megatron-qwen3")
