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


# -- GridWeight: the one rule set, the one TE reader ------------------------------------------------

def test_grid_weight_checked_and_to_wire():
    from mxfp8_learner_grid.common.grid_weight import GridWeight
    q, s = pair()
    g = GridWeight.checked("a.weight", q, s)
    assert g.pair() == (q, s)
    assert set(g.to_wire()) == {"a.weight", "a.weight_scale_inv"}
    assert set(g.to_wire("b.weight")) == {"b.weight", "b.weight_scale_inv"}
    with pytest.raises(WireFormatError, match=r"a\.weight: an on-grid weight travels as '<module>\.weight'"):
        g.to_wire("b.bias")
    codes = GridWeight.checked("a.weight", q.view(torch.uint8), s, codes=True)   # uint8 E4M3 codes, on request
    assert codes.data.dtype == torch.float8_e4m3fn and torch.equal(codes.data.view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(WireFormatError, match="a.weight: on-grid weight must be torch.float8_e4m3fn; got torch.uint8"):
        GridWeight.checked("a.weight", q.view(torch.uint8), s)
    with pytest.raises(WireFormatError, match=r"a\.weight: on-grid weight is on cpu but its scales "
                                              r"\(a\.weight_scale_inv\) are on meta"):
        GridWeight.checked("a.weight", q, torch.empty_like(s, device="meta"))
    GridWeight.checked("a.weight", q, torch.full_like(s, 255), values=False)     # structure only


def test_one_wording_for_every_site():
    """The pair check, the manifest (specs) and an engine loader name a padded scale tensor alike."""
    from mxfp8_learner_grid.common.grid_weight import check_scales, scales_problem
    from mxfp8_learner_grid.common.sync.manifest import Manifest, validate
    q, s = pair()
    padded = torch.zeros(128, 4, dtype=torch.uint8)
    with pytest.raises(WireFormatError) as ei:
        check_pair("a.weight", q, padded)
    want = scales_problem("a.weight_scale_inv", padded.shape, padded.dtype, q.shape)
    assert str(ei.value) == want and "TE padding not stripped" in want
    with pytest.raises(WireFormatError) as ei:
        check_scales("a.weight_scale_inv", padded, (64, 96))                     # the loaders' check
    assert str(ei.value) == want
    probs = validate(Manifest.of({"a.weight": q, "a.weight_scale_inv": padded}, 1, "mxfp8"),
                     {"a.weight": ((64, 96), True)}, {})
    assert probs == [want]


def _te_state(w, swizzled):
    from mxfp8_learner_grid.common import quantize_mxfp8, swizzle_scales
    qm = quantize_mxfp8(w)
    rs = qm.rowwise_scale_inv.clone()
    rs[w.shape[0]:] = 0xEE                                   # TE leaves padding uninitialised
    rs[:, w.shape[1] // 32:] = 0xEE
    return {"_rowwise_data": qm.rowwise_data.view(torch.uint8),
            "_rowwise_scale_inv": swizzle_scales(rs) if swizzled else rs,
            "_with_gemm_swizzled_scales": torch.tensor(int(swizzled), dtype=torch.uint8)}


@pytest.mark.parametrize("swizzled", [False, True])
def test_grid_weight_from_te_state_and_object(swizzled):
    import types
    from mxfp8_learner_grid.common.grid_weight import GridWeight
    w = torch.randn(64, 96)
    q, s = quantize_rows(w)
    state = _te_state(w, swizzled)
    for te in (state, types.SimpleNamespace(shape=w.shape, **{k: v for k, v in state.items()})):
        g = GridWeight.from_te("x.weight", te)
        assert g.data.dtype == torch.float8_e4m3fn and torch.equal(g.data.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(g.scales, s)


def test_grid_weight_from_te_errors_name_the_tensor():
    from mxfp8_learner_grid.common.grid_weight import GridWeight
    state = _te_state(torch.randn(64, 96), False)
    with pytest.raises(WireFormatError, match=r"x\.weight\._rowwise_scale_inv: scales must be uint8"):
        GridWeight.from_te("x.weight", dict(state, _rowwise_scale_inv=state["_rowwise_scale_inv"].float()))
    with pytest.raises(WireFormatError, match=r"x\.weight: on-grid weight must be .*or uint8 E4M3 codes; got torch.float32"):
        GridWeight.from_te("x.weight", dict(state, _rowwise_data=torch.zeros(64, 96)))
    with pytest.raises(WireFormatError, match=r"x\.weight: shape \(48, 96\) is not on the MXFP8 grid"):
        GridWeight.from_te("x.weight", dict(state, _rowwise_data=state["_rowwise_data"][:48]))
    with pytest.raises(WireFormatError, match=r"x\.weight: TE MXFP8Tensor has no rowwise copy"):
        GridWeight.from_te("x.weight", {"_rowwise_data": state["_rowwise_data"]})
