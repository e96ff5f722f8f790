"""The plugin's linear and MoE methods inside SGLang's real layers (real Qwen3 / Qwen3-MoE models), CPU.

Loaded from the learner's BF16 state dict (quantized on load) and from its wire export
(copied), at TP=1 here and at TP=2 in two gloo processes (sgl_tp_worker.py):

* bytes: every on-grid parameter equals this rank's slice of the learner's wire tensors
  (which are ``common.quantize_mxfp8``'s rowwise bytes, checked below), so a BF16 load
  quantizes TE-exactly and a wire load copies without re-quantizing;
* forward: every on-grid module equals the grid reference on those bytes bit for bit
  (``mxfp8_linear_reference``; for MoE the same reference per routed expert), and at
  TP=1 the learner's own modules (``apply_learner_grid``) -- bit for bit for Linear
  layers; for the experts see ``test_experts_match_the_learner``.
"""

import os
import subprocess
import sys

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

import torch  # noqa: E402

from mxfp8_learner_grid.common import quantize_mxfp8  # noqa: E402
from mxfp8_learner_grid.common.wire import WireFormatError  # noqa: E402

HERE = os.path.dirname(__file__)


def _model(sgl, learners, moe, source="wire", tensors=None):
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf, wire, bf16 = learners[moe]
    model = sgl.build_sglang_model(hf.config, LearnerGridConfig())
    sgl.load(model, (tensors if tensors is not None else (wire if source == "wire" else bf16)).items())
    return model


def test_wire_export_is_common_quantizer_bytes(learners):
    hf, wire, bf16 = learners[True]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        q = quantize_mxfp8(bf16[name])
        n, k = bf16[name].shape
        assert torch.equal(wire[name].view(torch.uint8), q.rowwise_data.view(torch.uint8))
        assert torch.equal(wire[name.replace(".weight", ".weight_scale_inv")], q.rowwise_scale_inv[:n, :k // 32])


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("source", ["bf16", "wire"])
def test_tp1_bytes_and_forward(sgl, learners, moe, source):
    model = _model(sgl, learners, moe, source)
    wire = learners[moe][1]
    assert sgl.check_bytes(model, wire) == 16
    assert sgl.check_forward(model, wire) == (6 if moe else 8)


def test_linear_layers_match_the_learner_bit_for_bit(sgl, learners):
    hf = learners[False][0]
    model = _model(sgl, learners, False, "bf16")
    g = torch.Generator().manual_seed(3)
    for i in (0, 1):
        sa, la = model.model.layers[i].self_attn, hf.model.layers[i].self_attn
        sm, lm = model.model.layers[i].mlp, hf.model.layers[i].mlp
        x = torch.randn(4, 128, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(sa.qkv_proj(x)[0], torch.cat([la.q_proj(x), la.k_proj(x), la.v_proj(x)], -1))
            assert torch.equal(sm.gate_up_proj(x)[0], torch.cat([lm.gate_proj(x), lm.up_proj(x)], -1))
            xo = torch.randn(4, sa.o_proj.input_size, generator=g).to(torch.bfloat16)
            assert torch.equal(sa.o_proj(xo)[0], la.o_proj(xo))
            xd = torch.randn(4, sm.down_proj.input_size, generator=g).to(torch.bfloat16)
            assert torch.equal(sm.down_proj(xd)[0], lm.down_proj(xd))


def test_experts_match_the_learner(sgl, learners):
    """vs transformers' experts under apply_learner_grid (GridExperts).

    Same bytes, same activation quantization, same per-expert gate_up / SiLU*up / down
    outputs; only the combine differs.  SGLang's top-k weights are fp32 and common's op
    sums the weighted expert outputs in fp32, rounding once to bf16; transformers routes
    with bf16 weights, rounds each weighted output to bf16 and adds in bf16.  To first
    order that is four bf16 roundings (unit roundoff u = 2^-8): |got - want| <=
    4 u sum_k |w_k d_k|.  The bit-exact comparison with the fp32-combine reference built
    from mxfp8_linear_reference is in check_forward.
    """
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    hf = learners[True][0]
    model = _model(sgl, learners, True, "bf16")
    for i in (0, 1):
        experts, lex = model.model.layers[i].mlp.experts, hf.model.layers[i].mlp.experts
        x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4 + i)).to(torch.bfloat16)
        w, ids, logits = sgl.routing(9, 8, 2, seed=i)
        got = experts(x, StandardTopKOutput(w, ids, logits)).float()
        with torch.no_grad():
            want = lex(x, ids.long(), w.to(torch.bfloat16)).float()
            terms = torch.zeros_like(want)
            for j in range(2):                                  # sum_k |w_k d_k|, from the learner's own pieces
                one = torch.zeros_like(w)
                one[:, j] = w[:, j]
                terms += lex(x, ids.long(), one.to(torch.bfloat16)).float().abs()
        assert torch.all((got - want).abs() <= 4 * 2.0 ** -8 * terms), float((got - want).abs().max())


def test_process_weights_is_idempotent_and_never_reallocates(sgl, learners):
    from mxfp8_learner_grid.sglang_plugin.linear_method import LearnerGridLinearMethod
    model = _model(sgl, learners, True, "bf16")
    wire = learners[True][1]
    before = {n: (p.data_ptr(), p.data.clone()) for n, p in model.named_parameters()}
    for name, mod in sgl.grid_modules(model):
        for _ in range(2):
            mod.quant_method.restore_weights_before_loading(mod)
            mod.quant_method.process_weights_after_loading(mod)
        assert isinstance(mod.quant_method, LearnerGridLinearMethod) or name.endswith("experts")
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and sgl.same_bytes(p.data, before[n][1]), n
    assert sgl.check_forward(model, wire) == 6


# -- bad input: a clear error that names the tensor -------------------------------------

def _bad(learners, moe, edit):
    wire = dict(learners[moe][1])
    edit(wire)
    return wire


@pytest.mark.parametrize("case,match", [
    ("missing scale", r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv"),
    ("missing fused shard scale", r"qkv_proj\.weight_scale_inv\[k\]"),
    ("scale dtype", r"model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv: scales must be uint8"),
    ("scale shape padded", r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv: .*shape \(128, 12\).*TE padding"),
    ("scale shape", r"model\.layers\.0\.mlp\.gate_proj\.weight_scale_inv: .*shape \(256, 2\); expected \(256, 4\)"),
    ("scale NaN", r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv: holds the E8M0 NaN code 255"),
    ("weight K", r"model\.layers\.0\.self_attn\.o_proj\.weight: .*not on the MXFP8 grid"),
    ("bf16 weight shape", r"model\.layers\.1\.mlp\.up_proj\.weight: checkpoint weights have shape \(224, 128\)"),
    ("weight dtype", r"model\.layers\.0\.self_attn\.v_proj\.weight: checkpoint tensor has dtype torch\.int8"),
])
def test_bad_dense_input_names_the_tensor(sgl, learners, case, match):
    p = "model.layers.0."

    def edit(w):
        if case == "missing scale":
            del w[p + "self_attn.o_proj.weight_scale_inv"]
        elif case == "missing fused shard scale":
            del w[p + "self_attn.k_proj.weight_scale_inv"]
        elif case == "scale dtype":
            n = "model.layers.1.self_attn.k_proj.weight_scale_inv"
            w[n] = w[n].float()
        elif case == "scale shape padded":                   # TE's padded compact layout: columns to a multiple of 4
            n = p + "mlp.down_proj.weight_scale_inv"
            w[n] = torch.nn.functional.pad(w[n], (0, 4))
        elif case == "scale shape":
            n = p + "mlp.gate_proj.weight_scale_inv"
            w[n] = w[n][:, :2].contiguous()
        elif case == "scale NaN":
            n = p + "self_attn.q_proj.weight_scale_inv"
            w[n] = w[n].clone()
            w[n][3, 1] = 255
        elif case == "weight K":
            n = p + "self_attn.o_proj.weight"
            w[n] = w[n][:, :100].contiguous()
        elif case == "bf16 weight shape":
            n = "model.layers.1.mlp.up_proj.weight"
            w[n] = torch.zeros(224, 128, dtype=torch.bfloat16)
        elif case == "weight dtype":
            n = p + "self_attn.v_proj.weight"
            w[n] = w[n].view(torch.int8)

    with pytest.raises(WireFormatError, match=match):
        _model(sgl, learners, False, tensors=_bad(learners, False, edit))


@pytest.mark.parametrize("case,match", [
    ("missing expert scale", r"model\.layers\.1\.mlp\.experts\.w2_weight_scale_inv\[\('w2', 5\)\]"),
    ("expert scale dtype", r"experts\.w13_weight_scale_inv \(local expert 2, w3\): scales must be uint8"),
    ("expert scale shape", r"experts\.w2_weight_scale_inv \(local expert 0, w2\): .*expected \(128, 2\)"),
])
def test_bad_expert_input_names_the_tensor(sgl, learners, case, match):
    def edit(w):
        if case == "missing expert scale":
            del w["model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"]
        elif case == "expert scale dtype":
            n = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"
            w[n] = w[n].to(torch.int32)
        elif case == "expert scale shape":
            n = "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"
            w[n] = torch.cat([w[n], w[n]], 1)

    with pytest.raises(WireFormatError, match=match):
        _model(sgl, learners, True, tensors=_bad(learners, True, edit))


def test_layer_off_the_grid_shape_is_refused(sgl):
    from sglang.srt.layers.linear import RowParallelLinear
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    with pytest.raises(WireFormatError, match=r"model\.layers\.0\.mlp\.down_proj: .*in=48 is not on the MXFP8 grid"):
        RowParallelLinear(48, 64, bias=False, quant_config=LearnerGridConfig(), prefix="model.layers.0.mlp.down_proj",
                          params_dtype=torch.bfloat16)


# -- TP=2: two gloo processes ------------------------------------------------------------

def test_tp2_bytes_and_forward(sgl):
    port = str(sgl.free_port())
    env = dict(os.environ, SGLANG_NCCL_SO_PATH="/nonexistent", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "sgl_tp_worker.py"), str(r), "2", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "RESULT " in out, f"rank {r}:\n{out[-2000:]}\n{err[-6000:]}"
        assert '"dense-bf16": [16, 8]' in out and '"moe-wire": [16, 6]' in out, out


def test_dummy_load_fills_valid_grid_weights(sgl, learners, monkeypatch):
    """``--load-format dummy`` (benchmarks of real shapes): SGLang's dummy loader leaves our uint8
    scales as allocated and rounds its U(-1e-3, 1e-3) to near-zero E4M3; the plugin fills every
    on-grid pair with the grid quantization of N(0, 0.02^2) -- valid scales, non-zero codes,
    seeded per layer -- instead of refusing the load as incomplete."""
    from mxfp8_learner_grid.common import dequantize_blocks
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    for moe in (False, True):
        model = sgl.build_sglang_model(learners[moe][0].config, LearnerGridConfig())
        with pytest.raises(Exception, match="never|missing|not loaded|incomplete"):   # a real load must be complete
            sgl.load(model, [])
        model = sgl.build_sglang_model(learners[moe][0].config, LearnerGridConfig())
        for _, p in model.named_parameters():
            if p.dtype == torch.uint8:
                p.data.fill_(255)                          # garbage as allocated: the NaN scale byte
        monkeypatch.setattr(compat, "load_format", lambda: "dummy")
        sgl.load(model, [])
        monkeypatch.undo()
        n = 0
        for name, mod in sgl.grid_modules(model):
            for wname in ("weight", "w13_weight", "w2_weight"):
                if hasattr(mod, wname):
                    w, s = getattr(mod, wname), getattr(mod, wname + "_scale_inv")
                    assert int(s.max()) < 255, name
                    vals = dequantize_blocks(w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1]))
                    std = vals.float().std().item()
                    assert 0.015 < std < 0.025, (name, std)
                    n += 1
        assert n == 8, n                                   # 2 layers x (qkv, o, gate_up | w13, down | w2)


def test_kv_scales_only_with_an_fp8_kv_cache(sgl, monkeypatch):
    """In a server with a BF16 KV cache an attention layer gets no KV-cache method and no k/v
    scales -- through the quant config (models that pass it) and through the Qwen3 hook
    (``patches/sglang_qwen3_kv_scales.attach_kv_method``): SGLang 0.5.17's fused K/V-cache write
    (Qwen3-MoE, head_dim < 64) asserts that a layer has none, which stopped the MoE server on
    the H200.  With an FP8 cache, and outside a server, the layer gets both."""
    import types
    from sglang.srt.layers.radix_attention import RadixAttention
    from mxfp8_learner_grid.patches.sglang_qwen3_kv_scales import attach_kv_method
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    for kv, has in (("auto", False), ("bfloat16", False), ("fp8_e4m3", True), (None, True)):
        monkeypatch.setattr(compat, "server_kv_cache_dtype", lambda kv=kv: kv)
        via_config = RadixAttention(4, 32, 32 ** -0.5, 2, layer_id=0, quant_config=LearnerGridConfig(),
                                    prefix="model.layers.0.self_attn.attn")
        module = types.SimpleNamespace(attn=RadixAttention(4, 32, 32 ** -0.5, 2, layer_id=0, quant_config=None,
                                                           prefix="model.layers.0.self_attn.attn"))
        assert attach_kv_method(module, LearnerGridConfig(), "model.layers.0.self_attn") == has, kv
        for attn in (via_config, module.attn):
            assert (attn.k_scale is not None) == has and (attn.v_scale is not None) == has, kv
