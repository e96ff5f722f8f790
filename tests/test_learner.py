"""Learner-side tools: the drop-in grid forward, backward modes, wire export, TE export."""

import types

import pytest
import torch
from torch import nn

from mxfp8_learner_grid.common import (ModuleSelection, dequantize_blocks, mxfp8_linear_reference, quantize_mxfp8,
                                       quantize_rows, swizzle_scales)
from mxfp8_learner_grid.common.learner import (GridLinear, apply_learner_grid, export_te_state_dict,
                                               export_wire, grid_linear, wire_from_te)
from mxfp8_learner_grid.common.wire import split_state_dict

transformers = pytest.importorskip("transformers")
import tiny_models  # noqa: E402


def test_grid_linear_forward_is_reference_at_quantized_weight():
    lin = nn.Linear(160, 96).to(torch.bfloat16)
    g = GridLinear(lin)
    x = torch.randn(3, 160, dtype=torch.bfloat16)
    wq, ws = quantize_rows(lin.weight.detach())
    assert torch.equal(g(x), mxfp8_linear_reference(x, wq, ws, lin.bias.detach()))
    assert not torch.equal(g(x), lin(x))


def test_ste_backward_is_high_precision_linear_gradient():
    w = torch.randn(64, 96, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    x = torch.randn(8, 96, requires_grad=True)
    dy = torch.randn(8, 64)
    grid_linear(x, w, b).backward(dy)
    gx, gw, gb = x.grad.clone(), w.grad.clone(), b.grad.clone()
    assert torch.allclose(gx, dy @ w.detach(), atol=1e-5) and torch.allclose(gw, dy.t() @ x.detach(), atol=1e-5)
    assert torch.allclose(gb, dy.sum(0), atol=1e-5)


def test_te_backward_uses_quantized_operands():
    w = torch.randn(64, 96, requires_grad=True)
    x = torch.randn(32, 96, requires_grad=True)
    dy = torch.randn(32, 64)
    grid_linear(x, w, None, backward="te").backward(dy)
    dyq, dys = quantize_rows(dy)
    want_dx = dequantize_blocks(dyq, dys) @ quantize_mxfp8(w.detach(), False, True).dequantize()
    want_dw = quantize_mxfp8(dy, False, True).dequantize().t() @ quantize_mxfp8(x.detach(), False, True).dequantize()
    assert torch.allclose(x.grad, want_dx, atol=1e-5) and torch.allclose(w.grad, want_dw, atol=1e-4)
    # close to, but not equal to, the high-precision gradient
    assert 0 < ((x.grad - dy @ w.detach()).norm() / x.grad.norm()).item() < 0.1
    with pytest.raises(ValueError, match="multiple of 32"):
        grid_linear(torch.randn(5, 96, requires_grad=True), w, None, backward="te").sum().backward()


@pytest.mark.parametrize("moe", [False, True])
def test_apply_to_transformers_qwen3(moe, tmp_path):
    model = tiny_models.build_model(moe=moe)
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        ref = model(ids).logits.float()
    names = apply_learner_grid(model)
    kinds = {type(m).__name__ for n, m in model.named_modules() if n in names}
    assert kinds == ({"GridLinear", "GridExperts"} if moe else {"GridLinear"})
    assert "lm_head" not in names and not any(n.endswith("mlp.gate") for n in names)
    assert sum(n.endswith("q_proj") for n in names) == 2
    with torch.no_grad():
        out = model(ids).logits.float()
    diff = (out - ref).abs().max().item()
    assert 1e-3 < diff < 0.5 * ref.abs().max().item()     # on the grid: close, not equal

    # export: HF checkpoint names, bytes = rowwise quantization of the learner's weights
    wire = export_wire(model)
    pairs, plain = split_state_dict(wire)
    tiny_models.save_model(tmp_path, moe=moe)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        ckpt_names = set(f.keys())
    assert set(pairs) | set(plain) == ckpt_names
    assert "lm_head.weight" in plain and "model.embed_tokens.weight" in plain
    name = "model.layers.1.mlp.experts.3.up_proj.weight" if moe else "model.layers.1.mlp.up_proj.weight"
    assert name in pairs
    if moe:
        inter = model.config.moe_intermediate_size
        src = model.model.layers[1].mlp.experts.gate_up_proj[3, inter:]
    else:
        src = model.model.layers[1].mlp.up_proj.weight
    q, s = quantize_rows(src.detach())
    assert torch.equal(pairs[name][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(pairs[name][1], s)


def test_selection_half_layers():
    model = tiny_models.build_model()
    names = apply_learner_grid(model, ModuleSelection(layers=[0]))
    assert names and all(n.startswith("model.layers.0.") for n in names)


def test_selected_off_grid_linear_raises():
    model = nn.Sequential(nn.Linear(40, 64))
    with pytest.raises(ValueError, match="not on the grid"):
        apply_learner_grid(model, ModuleSelection(include=["0"]))


class FakeTEMXFP8Tensor:
    """Stands in for transformer_engine.pytorch.tensor.MXFP8Tensor (same private fields)."""

    def __init__(self, w, swizzled):
        q = quantize_mxfp8(w, rowwise=True, columnwise=True)
        self.shape = w.shape
        self._rowwise_data = q.rowwise_data.view(torch.uint8)
        rs = q.rowwise_scale_inv.clone()
        rs[w.shape[0]:] = 0xEE                     # TE leaves padding uninitialised
        self._rowwise_scale_inv = swizzle_scales(rs) if swizzled else rs
        self._columnwise_data = q.columnwise_data.view(torch.uint8)
        self._columnwise_scale_inv = q.columnwise_scale_inv
        self._with_gemm_swizzled_scales = swizzled


@pytest.mark.parametrize("swizzled", [False, True])
def test_wire_from_te_strips_padding_and_unswizzles(swizzled):
    w = torch.randn(96, 160, dtype=torch.bfloat16)
    t = FakeTEMXFP8Tensor(w, swizzled)
    data, scales = wire_from_te(t)
    q, s = quantize_rows(w)
    assert data.dtype == torch.float8_e4m3fn and torch.equal(data.view(torch.uint8), q.view(torch.uint8))
    assert scales.shape == (96, 5) and torch.equal(scales, s)


def test_export_te_state_dict_renames_and_pairs():
    w = torch.randn(64, 96)
    named = [("decoder.layers.0.mlp.linear_fc2.weight", FakeTEMXFP8Tensor(w, True)),
             ("decoder.final_layernorm.weight", torch.ones(96)), ("decoder.drop.me", torch.ones(1))]
    rename = {"decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
              "decoder.final_layernorm.weight": "model.norm.weight"}.get
    out = export_te_state_dict(named, rename)
    assert set(out) == {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
                        "model.norm.weight"}
    split_state_dict(out)
    t = types.SimpleNamespace(shape=w.shape, _rowwise_data=None, _rowwise_scale_inv=None)
    with pytest.raises(ValueError, match="no rowwise copy"):
        wire_from_te(t, "x.weight")


def _routed(moe_model, dtype):
    """(router input, router outputs) of layer 0 in one forward of ``moe_model``."""
    cap = {}
    r = moe_model.model.layers[0].mlp.gate
    h1 = r.register_forward_pre_hook(lambda mod, args: cap.__setitem__("x", args[0]) or None)
    h2 = r.register_forward_hook(lambda mod, args, out: cap.__setitem__("out", out) or None)
    with torch.no_grad():
        logits = moe_model(torch.arange(3, 40).reshape(1, -1)).logits.float()
    h1.remove()
    h2.remove()
    return cap["x"], cap["out"], logits


def test_fp32_router_matches_megatron_and_can_be_undone():
    """set_router_dtype: the router's logits are F.linear(x.float(), W.float()) exactly (Megatron's
    moe_router_dtype=fp32), not bf16-rounded; routing weights are FP32; the weight stays bf16; None undoes it."""
    from mxfp8_learner_grid.common.learner import set_router_dtype
    m = tiny_models.build_model(moe=True).to(torch.bfloat16).eval()
    apply_learner_grid(m)
    x0, out0, lg0 = _routed(m, None)
    assert out0[0].dtype == torch.bfloat16                                  # the default: model dtype
    names = set_router_dtype(m, torch.float32)
    assert names == [f"model.layers.{i}.mlp.gate" for i in range(len(m.model.layers))]
    x, out, lg = _routed(m, torch.float32)
    w = m.model.layers[0].mlp.gate.weight
    assert w.dtype == torch.bfloat16 and isinstance(w, nn.Parameter)
    ref = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), w.float())
    assert out[0].dtype == torch.float32 and torch.equal(out[0], ref)
    assert not torch.equal(out[0], out[0].bfloat16().float())             # really not rounded to bf16
    assert out[1].dtype == torch.float32                                  # routing weights in FP32
    assert not torch.equal(lg, lg0)                                       # and the model's output moves
    set_router_dtype(m, None)
    assert torch.equal(_routed(m, None)[2], lg0)


def test_grid_experts_combine_fp32_weights_in_fp32_rounding_once():
    """FP32 routing weights: the experts' weighted outputs are summed in FP32 and rounded once (the
    engine's FP32 combine, Megatron's unpermute with FP32 probs); bf16 weights keep transformers' order
    (each weighted output rounded to bf16, summed in bf16)."""
    from mxfp8_learner_grid.common.learner import GridExperts, grid_linear
    m = tiny_models.build_model(moe=True).to(torch.bfloat16).eval()
    ge = GridExperts(m.model.layers[0].mlp.experts)
    g = torch.Generator().manual_seed(0)
    t, k, e = 16, 2, ge.num_experts
    x = torch.randn(t, ge.gate_up_proj.shape[-1], generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g) + 0.1
    with torch.no_grad():
        y32, y16 = ge(x, idx, wts), ge(x, idx, wts.bfloat16())
        ref32, ref16 = torch.zeros(t, x.shape[-1]), torch.zeros(t, x.shape[-1], dtype=torch.bfloat16)
        for i in range(t):
            for j in range(k):
                ex = int(idx[i, j])
                gate, up = grid_linear(x[i:i + 1], ge.gate_up_proj[ex]).chunk(2, dim=-1)
                h = grid_linear(ge.act_fn(gate) * up, ge.down_proj[ex])[0]
                ref32[i] += h.float() * wts[i, j]
                ref16[i] += (h * wts[i, j].bfloat16()).bfloat16()
    assert y32.dtype == y16.dtype == torch.bfloat16
    assert torch.equal(y32, ref32.bfloat16())
    assert torch.equal(y16, ref16)
    assert not torch.equal(y32, y16)


def test_router_dtype_option():
    from mxfp8_learner_grid.common.options import GridOptions
    from mxfp8_learner_grid.common.router import is_router
    assert GridOptions.from_dict({}).router_dtype is None
    assert GridOptions.from_dict({"router_dtype": "model"}).router_dtype is None
    assert GridOptions.from_dict({"router_dtype": "float32"}).router_dtype == torch.float32
    assert GridOptions.from_dict({"router_dtype": "fp32"}).router_dtype == torch.float32
    for bad in ("float16", 32, True, "bf16"):
        with pytest.raises(ValueError, match="router_dtype"):
            GridOptions.from_dict({"router_dtype": bad})
    assert is_router("model.layers.3.mlp.gate") and not is_router("model.layers.3.mlp.gate_up_proj")
    assert not is_router("model.layers.3.mlp.gate_proj")


def test_router_weights_on_the_activation_megatron_order():
    """moe_router_weights: activation -- the engine's reference loop and the learner's GridExperts both
    compute Megatron's order: down(bf16(SiLU(g) * u * w in FP32)), summed unweighted in FP32, rounded
    once; the default order (weights on the outputs) differs."""
    import torch.nn.functional as Fn
    from mxfp8_learner_grid.common.learner import GridExperts, set_moe_router_weights
    from mxfp8_learner_grid.common.ops import moe_reference
    m = tiny_models.build_model(moe=True).to(torch.bfloat16).eval()
    apply_learner_grid(m)
    ge = m.model.layers[0].mlp.experts
    assert isinstance(ge, GridExperts)
    g = torch.Generator().manual_seed(1)
    t, k, e = 12, 2, ge.num_experts
    x = torch.randn(t, ge.gate_up_proj.shape[-1], generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g) * 0.9 + 0.05
    # the definition, written out: TE-exact grid GEMMs (mxfp8_linear_reference), Megatron's activation
    want = torch.zeros(t, x.shape[-1])
    for i in range(t):
        for j in range(k):
            ex = int(idx[i, j])
            w13q, w13s = quantize_rows(ge.gate_up_proj[ex])
            gu = mxfp8_linear_reference(x[i:i + 1], w13q, w13s)
            gt, up = gu.chunk(2, dim=-1)
            a = (Fn.silu(gt.float()) * up.float() * wts[i, j]).bfloat16()
            w2q, w2s = quantize_rows(ge.down_proj[ex])
            want[i] += mxfp8_linear_reference(a, w2q, w2s)[0].float()
    want = want.bfloat16()
    with torch.no_grad():
        default = ge(x, idx, wts)
        assert set_moe_router_weights(m, "activation") == [f"model.layers.{i}.mlp.experts" for i in range(len(m.model.layers))]
        learner = ge(x, idx, wts)
    q13, s13 = zip(*[quantize_rows(ge.gate_up_proj[i]) for i in range(e)])
    q2, s2 = zip(*[quantize_rows(ge.down_proj[i]) for i in range(e)])
    engine = moe_reference(x, torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2), wts, idx,
                           weights_on_activation=True)
    assert torch.equal(learner, want) and torch.equal(engine, want)
    assert not torch.equal(default, want)
    with pytest.raises(ValueError, match="'combine' or 'activation'"):
        set_moe_router_weights(m, "input")


def test_router_weights_on_the_activation_is_refused_by_the_gpu_kernels():
    """A GPU layer asking for Megatron's order gets a load error naming the option (no kernel has it there)."""
    from mxfp8_learner_grid.common.grid_kernels import LayerSpec, choose
    from mxfp8_learner_grid.common.options import GridOptions
    spec = LayerSpec(prefix="model.layers.0.mlp.experts", kind="moe", device_type="cuda", act_dtype=torch.bfloat16,
                     n=256, k=128, intermediate=128, num_experts=8, capability=(9, 0),
                     options={"moe_router_weights": "activation"})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: no grid kernel.*moe_router_weights: activation"):
        choose(spec)
    cpu = choose(LayerSpec(**{**spec.__dict__, "device_type": "cpu", "capability": None}))
    assert cpu.name == "torch" and cpu.on_activation and "activation" in cpu.describe()
    assert GridOptions.from_dict({"moe_router_weights": "combine"}).raw["moe_router_weights"] == "combine"
    with pytest.raises(ValueError, match="moe_router_weights"):
        GridOptions.from_dict({"moe_router_weights": "input"})
