"""The wire format's checks (common/wire.py): every bad tensor is named."""

import pytest
import torch

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.wire import (QUANT_METHOD, WireFormatError, check_pair, quantization_config,
                                            split_state_dict)
from mxfp8_learner_grid.common.selection import ModuleSelection


def pair(n=64, k=96):
    return quantize_rows(torch.randn(n, k))


def test_good_pairs_pass():
    check_pair("m.weight", *pair())
    q = torch.stack([pair()[0] for _ in range(3)])
    s = torch.stack([pair()[1] for _ in range(3)])
    check_pair("experts.weight", q, s)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, s: (q.view(torch.uint8), s), "must be torch.float8_e4m3fn"),
    (lambda q, s: (q, s.to(torch.int8)), "uint8"),
    (lambda q, s: (q, torch.zeros(128, 4, dtype=torch.uint8)), "padding not stripped"),
    (lambda q, s: (q, s.t().contiguous()), "expected"),
    (lambda q, s: (q, None), "has no 'weight_scale_inv'"),
    (lambda q, s: (q[:48], s[:48]), "not on the MXFP8 grid"),
    (lambda q, s: (q, torch.full_like(s, 255)), "NaN code 255"),
    (lambda q, s: (q[0], s[0]), "2-D"),
])
def test_bad_pairs_named(mutate, match):
    q, s = pair()
    with pytest.raises(WireFormatError, match=match) as ei:
        check_pair("model.layers.0.mlp.down_proj.weight", *mutate(q, s))
    assert "model.layers.0.mlp.down_proj" in str(ei.value)


def test_split_state_dict():
    q, s = pair()
    sd = {"a.weight": q, "a.weight_scale_inv": s, "norm.weight": torch.ones(4)}
    pairs, plain = split_state_dict(sd)
    assert list(pairs) == ["a.weight"] and list(plain) == ["norm.weight"]
    with pytest.raises(WireFormatError, match="b.weight_scale_inv: scales without"):
        split_state_dict({"b.weight_scale_inv": s})
    with pytest.raises(WireFormatError, match="c.weight: on-grid weight has no"):
        split_state_dict({"c.weight": q})


def test_quantization_config_round_trips_selection():
    sel = ModuleSelection(include=["re:.*proj"], exclude=["lm_head"], layers=[0, 2])
    cfg = quantization_config(sel)
    assert cfg["quant_method"] == QUANT_METHOD and cfg["block_size"] == 32
    assert ModuleSelection.from_dict(cfg["modules"]) == sel


def test_selection_rules():
    sel = ModuleSelection()
    assert sel.matches("model.layers.0.self_attn.qkv_proj")
    assert not sel.matches("lm_head") and not sel.matches("model.layers.1.mlp.gate")
    assert sel.matches("model.layers.1.mlp.gate_up_proj")
    half = ModuleSelection(layers=range(3))
    assert half.matches("model.layers.2.mlp.down_proj") and not half.matches("model.layers.3.mlp.down_proj")
    assert not half.matches("model.embed_tokens")
    with pytest.raises(ValueError, match="bad regular expression"):
        ModuleSelection(include=["re:("])
    with pytest.raises(ValueError, match="unknown module-selection keys"):
        ModuleSelection.from_dict({"inclde": ["*"]})


def test_kv_scales():
    from mxfp8_learner_grid.common.kv_scales import kv_scale, kv_scale_from_amax, kv_scale_tensors
    assert kv_scale_from_amax(448.0) == 1.0 and kv_scale_from_amax(0.0) == 1e-12
    assert kv_scale(torch.tensor([[-896.0, 3.0]])) == 2.0
    t = kv_scale_tensors({0: 44.8}, {0: 4.48}, margin=2.0)
    assert t["model.layers.0.self_attn.k_scale"].item() == pytest.approx(0.2)
    assert t["model.layers.0.self_attn.v_scale"].dtype == torch.float32
    with pytest.raises(ValueError):
        kv_scale_from_amax(float("nan"))
