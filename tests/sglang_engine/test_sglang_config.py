"""LearnerGridConfig: both checkpoint kinds, module selection, which SGLang layers go on the grid."""

import json

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

import torch  # noqa: E402

NAME = "mxfp8-learner-grid"


def test_from_config_wire_checkpoint_with_sglang_injected_keys(sgl):
    from mxfp8_learner_grid.common.wire import quantization_config
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    cfg = dict(quantization_config(), packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
               hf_config=object())
    qc = LearnerGridConfig.from_config(cfg)
    assert qc.get_name() == NAME and qc.packed_modules_mapping["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert qc.get_min_capability() <= 90            # Hopper (SGLang checks nothing on CPU)
    with pytest.raises(ValueError, match="unknown quantization_config keys"):
        LearnerGridConfig.from_config({"quant_method": NAME, "weight_block_size": [1, 32]})
    with pytest.raises(ValueError, match="only E4M3 data"):
        LearnerGridConfig.from_config({"quant_method": NAME, "block_size": 16})
    with pytest.raises(ValueError, match="not 'mxfp8-learner-grid'"):
        LearnerGridConfig.from_config({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="kv_cache_scales"):
        LearnerGridConfig.from_config({"quant_method": NAME, "kv_cache_scales": "sometimes"})
    with pytest.raises(ValueError, match="'router_dtype' is vLLM-only"):      # would silently do nothing here
        LearnerGridConfig.from_config({"quant_method": NAME, "router_dtype": "float32"})
    with pytest.raises(ValueError, match="'producer_qdq' is vLLM-only"):      # likewise
        LearnerGridConfig.from_config({"quant_method": NAME, "producer_qdq": True})
    LearnerGridConfig.from_config({"quant_method": NAME, "producer_qdq": False})
    # the class names stay clear of SGLang's string / isinstance special cases
    from sglang.srt.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from mxfp8_learner_grid.sglang_plugin.linear_method import LearnerGridLinearMethod
    from mxfp8_learner_grid.sglang_plugin.moe_method import LearnerGridMoEMethod
    assert not issubclass(LearnerGridConfig, Fp8Config)
    for cls in (LearnerGridConfig, LearnerGridLinearMethod, LearnerGridMoEMethod):
        assert cls.__name__ not in WEIGHT_LOADER_V2_SUPPORTED
        assert not any(s in cls.__name__.lower() for s in ("fp8", "modelopt", "compressed"))


def _methods(model):
    return {n: type(m.quant_method).__name__ for n, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None}


def test_default_selection_in_real_qwen3_moe(sgl, learners):
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf, _, _ = learners[True]
    m = _methods(sgl.build_sglang_model(hf.config, LearnerGridConfig()))
    for i in (0, 1):
        assert m[f"model.layers.{i}.self_attn.qkv_proj"] == "LearnerGridLinearMethod"
        assert m[f"model.layers.{i}.self_attn.o_proj"] == "LearnerGridLinearMethod"
        assert m[f"model.layers.{i}.mlp.experts"] == "LearnerGridMoEMethod"
        assert m[f"model.layers.{i}.mlp.gate"] == "UnquantizedLinearMethod"       # the router stays off the grid
    assert m["lm_head"] == "UnquantizedEmbeddingMethod"


def test_layer_selection_on_bf16_checkpoint(sgl, learners):
    """Half the layers on the grid; the others load the BF16 weights as SGLang always does."""
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf, wire, bf16 = learners[True]
    qc = LearnerGridConfig.from_config({"quant_method": NAME, "modules": {"layers": [1]}})
    model = sgl.build_sglang_model(hf.config, qc)
    m = _methods(model)
    assert m["model.layers.0.self_attn.qkv_proj"] == "UnquantizedLinearMethod"
    assert m["model.layers.0.mlp.experts"] == "UnquantizedFusedMoEMethod"
    assert m["model.layers.1.self_attn.qkv_proj"] == "LearnerGridLinearMethod"
    sgl.load(model, bf16.items())
    assert sgl.check_bytes(model, wire) == 8
    o0 = model.model.layers[0].self_attn.o_proj.weight
    assert o0.dtype == torch.bfloat16 and torch.equal(o0, bf16["model.layers.0.self_attn.o_proj.weight"])


def test_selection_that_splits_a_fused_layer_is_an_error(sgl, learners):
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf, _, _ = learners[False]
    qc = LearnerGridConfig.from_config({"quant_method": NAME, "modules": {"exclude": ["*.k_proj"]}})
    with pytest.raises(ValueError, match="qkv_proj"):
        sgl.build_sglang_model(hf.config, qc)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from mxfp8_learner_grid.common.convert import convert_hf
    from mxfp8_learner_grid.common.tiny_model import save_model
    root = tmp_path_factory.mktemp("ckpt")
    bf16 = save_model(root / "dense")
    convert_hf(bf16, root / "dense-wire")
    return {"bf16": str(bf16), "wire": str(root / "dense-wire")}


@pytest.mark.parametrize("case", ["wire checkpoint", "bf16 + --quantization", "bf16 + --json-model-override-args"])
def test_sglang_model_config_resolves_the_method(sgl, checkpoints, case):
    """SGLang's ModelConfig + get_quant_config, as the server runs them, for both checkpoint kinds."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    path, quant, override = {
        "wire checkpoint": (checkpoints["wire"], None, "{}"),
        "bf16 + --quantization": (checkpoints["bf16"], NAME, "{}"),
        "bf16 + --json-model-override-args": (checkpoints["bf16"], None, json.dumps(
            {"quantization_config": {"quant_method": NAME, "modules": {"layers": [1]}}})),
    }[case]
    mc = ModelConfig(model_path=path, quantization=quant, model_override_args=override)
    assert mc.quantization == NAME
    qc = get_quant_config(mc, LoadConfig(), {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert isinstance(qc, LearnerGridConfig)
    assert qc.selection.layers == (frozenset({1}) if "override" in case else None)
