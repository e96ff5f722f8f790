"""RL weight updates through SGLang's own model-runner updater, and the FP8 KV-cache scales. CPU.

SGLang's ``WeightUpdater`` (the model runner's component behind ``/update_weights_from_tensor``
and the 0.5.23 update sessions) runs without a GPU: it is driven here directly on the
real Qwen3-MoE model.  Not covered: the scheduler / tokenizer-manager layers above it
(request pausing, cache flush, HTTP), which need a running server.
"""

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

import torch  # noqa: E402


def _updater(model):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=lambda **kw: None,
                         recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)


def test_update_session_then_inplace_update(sgl, learners):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf, wire_0, bf16_0 = learners[True]
    _, wire_1, _ = sgl.learner_and_wire(True, seed=1)
    _, wire_2, bf16_2 = sgl.learner_and_wire(True, seed=2)
    model = sgl.build_sglang_model(hf.config, LearnerGridConfig())
    sgl.load(model, bf16_0.items())
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    u = _updater(model)

    # 0.5.23 session: begin (restore_weights_before_loading on every module), a flattened
    # bucket of the learner's wire bytes (fp8 + uint8 + bf16 in one buffer), end (post-process)
    u.begin_weight_update()
    bucket = FlattenedTensorBucket(named_tensors=list(wire_1.items()))
    ok, msg = u.update_weights_from_tensor(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
        load_format="flattened_bucket")
    assert ok, msg
    u.end_weight_update(run_post_load=True)
    assert sgl.check_bytes(model, wire_1) == 16 and sgl.check_forward(model, wire_1) == 6

    # 0.5.17 style: update_weights_from_tensor with no session and no post-processing at all,
    # BF16 this time (quantized on load): live at once -- the CPU kernel's derived fp32 weight
    # copies are rewritten by the loaders as they write (common.refresh), not by post-processing
    derived = {n: m.weight_dequant.data_ptr() for n, m in model.named_modules() if hasattr(m, "weight_dequant")}
    assert len(derived) == 4, "the CPU kernel keeps a derived copy per dense layer (qkv, o x 2 layers)"
    ok, msg = u.update_weights_from_tensor(list(bf16_2.items()), load_format=None)
    assert ok, msg
    assert sgl.check_bytes(model, wire_2) == 16 and sgl.check_forward(model, wire_2) == 6
    assert all(p.data_ptr() == ptrs[n] for n, p in model.named_parameters()), "a parameter was reallocated"

    # a partial native update (decoder layer 0 only): layer 0 computes the new bytes, the rest the old
    part = [(n, t) for n, t in bf16_0.items() if n.startswith("model.layers.0.")]
    ok, msg = u.update_weights_from_tensor(part, load_format=None)
    assert ok, msg
    mixed = {n: (wire_0 if n.startswith("model.layers.0.") else wire_2)[n] for n in wire_2}
    assert sgl.check_bytes(model, mixed) == 16 and sgl.check_forward(model, mixed) == 6
    assert {n: m.weight_dequant.data_ptr() for n, m in model.named_modules()
            if hasattr(m, "weight_dequant")} == derived, "a derived copy was reallocated"


def _attention(quant_config):
    from sglang.srt.layers.radix_attention import RadixAttention
    return RadixAttention(4, 32, 32 ** -0.5, 2, layer_id=0, quant_config=quant_config,
                          prefix="model.layers.0.self_attn.attn")


def test_fp8_kv_cache_scales_from_the_trainer(sgl, monkeypatch, caplog):
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from mxfp8_learner_grid.common.kv_scales import kv_scale_tensors
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    from mxfp8_learner_grid.sglang_plugin.kv_cache import LearnerGridKVCacheMethod
    monkeypatch.setattr(compat, "server_kv_cache_dtype", lambda: "fp8_e4m3")

    attn = _attention(LearnerGridConfig())
    assert isinstance(attn.quant_method, LearnerGridKVCacheMethod)
    scales = kv_scale_tensors({0: 44.8}, {0: 896.0})             # amax / 448
    default_weight_loader(attn.k_scale, scales["model.layers.0.self_attn.k_scale"])
    default_weight_loader(attn.v_scale, scales["model.layers.0.self_attn.v_scale"])
    attn.quant_method.process_weights_after_loading(attn)
    assert attn.k_scale_float == pytest.approx(0.1) and attn.v_scale_float == pytest.approx(2.0)
    assert attn.grid_kv_scales_from_checkpoint
    # a trainer update of the scale reaches the float copy when post-processing runs again
    default_weight_loader(attn.k_scale, torch.tensor(0.25))
    attn.quant_method.process_weights_after_loading(attn)
    assert attn.k_scale_float == pytest.approx(0.25)

    attn = _attention(LearnerGridConfig())                        # no scales: 1.0, with a warning
    with caplog.at_level("WARNING", logger="mxfp8_learner_grid.sglang"):
        attn.quant_method.process_weights_after_loading(attn)
    assert attn.k_scale_float == 1.0 and "without k/v scales" in caplog.text

    strict = LearnerGridConfig.from_config({"quant_method": "mxfp8-learner-grid", "kv_cache_scales": "required"})
    attn = _attention(strict)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.attn: --kv-cache-dtype fp8_e4m3 needs"):
        attn.quant_method.process_weights_after_loading(attn)


def test_qwen3_kv_scales_load_through_the_plugin_hooks(tmp_path):
    """End to end through load_plugins(): entry point -> register -> HookRegistry hooks applied ->
    SGLang's Qwen3 / Qwen3-MoE attention gets k/v scale parameters (patches/sglang_qwen3_kv_scales.py)
    -> the models' loaders put the trainer's ``self_attn.k_scale`` / ``v_scale`` there."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sgl_helpers as H
        H.init_dist()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import torch
        from mxfp8_learner_grid.sglang_plugin import compat
        compat.server_kv_cache_dtype = lambda: "fp8_e4m3"     # a server with an FP8 KV cache
        from mxfp8_learner_grid.common.kv_scales import kv_scale_tensors
        from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
        from mxfp8_learner_grid.sglang_plugin.kv_cache import LearnerGridKVCacheMethod
        for moe in (True, False):
            hf, wire, _ = H.learner_and_wire(moe)
            model = H.build_sglang_model(hf.config, LearnerGridConfig())
            attn = model.model.layers[1].self_attn.attn
            assert isinstance(attn.quant_method, LearnerGridKVCacheMethod), attn.quant_method
            assert attn.quant_method.prefix == "model.layers.1.self_attn.attn"
            scales = kv_scale_tensors({0: 4.48, 1: 44.8}, {0: 8.96, 1: 89.6})    # the trainer's names
            H.load(model, list(wire.items()) + list(scales.items()))
            got = [(l.self_attn.attn.k_scale_float, l.self_attn.attn.v_scale_float) for l in model.model.layers]
            assert all(abs(a - b) < 1e-6 for a, b in zip(sum(got, ()), (0.01, 0.02, 0.1, 0.2))), (moe, got)
            assert H.check_forward(model, wire) == (6 if moe else 8)
        print("OK")
    """)
    import os
    env = dict(os.environ, SGLANG_PLUGINS="mxfp8_learner_grid", SGLANG_NCCL_SO_PATH="/nonexistent")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-6000:]
