"""Option ``producer_qdq``: the producer of a grid Linear's input writes the input's grid values.

* The fused RMSNorm + qdq kernel under Triton's CPU interpreter: its qdq equals the reference qdq
  (``qdq_rows_reference``, the torch path of common/quantize.py) of the bf16 value the norm computed, bit
  for bit; that value and the residual sum equal vLLM's native RMSNorm in torch.
* qdq is the identity on grid values (the reason a Linear may skip its own qdq), including blocks
  whose amax rounds down across a power of two; a negative control shows the check can fail.
* The wiring (``common.producer_fusion``) on stand-in modules: what is fused, what is refused and why,
  parameter names kept, the consumer's kernel told.
* The vLLM patch that runs the wiring after the weights are processed: version-checked, and a model
  that asks for the option without it fails to load.
"""

from __future__ import annotations

import inspect

import pytest

import torch

from mxfp8_learner_grid.common import producer_fusion as PF
from mxfp8_learner_grid.common.grid_kernels import LayerSpec
from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows_reference
from mxfp8_learner_grid.common.options import GridOptions

import native_ops
from interpreter import run_ok


def _bits(t):
    return t.view(torch.int16)


# --- the kernels, under the interpreter -----------------------------------------------------------

_KERNEL_CHECKS = inspect.getsource(native_ops) + r'''
import torch
from mxfp8_learner_grid.common.kernels.producer_qdq_triton import rms_norm_qdq, silu_mul_qdq
from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows_reference


g = torch.Generator().manual_seed(0)
worst = 1.0
for m, k in ((1, 64), (7, 96), (3, 4096), (2, 5120)):
    spread = torch.logspace(-30, 4, k)[torch.randperm(k, generator=g)]
    x = (torch.randn(m, k, generator=g) * spread).to(torch.bfloat16)
    x[0, :32] = 0                                      # an all-zero block
    r = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.rand(k, generator=g) * 2 - 0.5).to(torch.bfloat16)
    for res in (None, r):
        out = rms_norm_qdq(x, w, 1e-6, res, return_value=True)
        y, o = (out[0], out[-1])
        ref_o, ref_r = rms_norm_native(x, res, w, 1e-6)
        assert torch.equal(y.view(torch.int16), qdq_rows_reference(o, torch.bfloat16).view(torch.int16)), (m, k)
        worst = min(worst, (o.view(torch.int16) == ref_o.view(torch.int16)).float().mean().item())
        if res is not None:
            assert torch.equal(out[1].view(torch.int16), ref_r.view(torch.int16)), (m, k, "residual")
        else:
            assert torch.equal(rms_norm_qdq(x, w, 1e-6).view(torch.int16), y.view(torch.int16))
        # a negative control: the norm's own output is not its grid values
        assert not torch.equal(o.view(torch.int16), y.view(torch.int16))
assert worst >= 0.99, worst
x3 = (torch.randn(2, 3, 2 * 96, generator=g) * 3).to(torch.bfloat16)
ys = silu_mul_qdq(x3)
gg, uu = x3.chunk(2, -1)
assert ys.shape == (2, 3, 96)
same = (ys.view(torch.int16) == qdq_rows_reference(torch.nn.functional.silu(gg) * uu, torch.bfloat16).view(torch.int16))
assert same.float().mean().item() >= 0.99, same.float().mean().item()    # numpy's exp under the interpreter
print("NORM_EQUAL", worst)
print("OK")
'''


def test_fused_norm_qdq_is_the_reference_qdq_of_the_norm():
    out = run_ok(_KERNEL_CHECKS)
    assert "NORM_EQUAL" in out


# --- qdq is the identity on grid values ----------------------------------------------------------

def _boundary_blocks() -> torch.Tensor:
    """Blocks whose amax / scale lies in (224, 240): it rounds to 224 or 240, so the grid block's amax can
    sit on the power of two below the scale TE picked from the original amax."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for j in range(1, 17):
        for e in (-100, -8, 0, 7, 100):       # scale bytes >= 3: bf16 holds the grid values
            b = torch.rand(32, generator=g) * 0.8
            b[5] = (224 + j) / 256
            b[9] = -(224 + j) / 256 * torch.rand(1, generator=g).item()
            rows.append(b * 2.0 ** e)
    return torch.stack(rows).reshape(-1, 64).to(torch.bfloat16)


def test_qdq_is_the_identity_on_grid_values():
    g = torch.Generator().manual_seed(2)
    x = torch.cat([_boundary_blocks(),
                   (torch.randn(64, 64, generator=g) * torch.logspace(-20, 20, 64)).to(torch.bfloat16)])
    y = qdq_rows_reference(x, torch.bfloat16)
    # equal as values: a tiny negative that rounds to the code -0 decodes to -0.0, which TE's cast then
    # encodes as +0 (the one bit that may change; a GEMM's sums are the same)
    assert torch.equal(qdq_rows_reference(y, torch.bfloat16).float(), y.float())
    assert not torch.equal(_bits(y), _bits(x))                  # the check can fail: x itself is off the grid


# --- the wiring ----------------------------------------------------------------------------------

class Norm(torch.nn.Module):                 # stands in for the engine's RMSNorm
    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(k, dtype=torch.bfloat16))
        self.variance_epsilon = 1e-6

    def forward(self, x, residual=None):
        raise AssertionError("the plain norm ran")


class OtherNorm(Norm):                       # a subclass (Gemma-like): never fused
    pass


class SiluMul(torch.nn.Module):
    def forward(self, x):
        raise AssertionError("the plain act ran")


class Kernel:
    name = "marlin"
    accepts_grid_input = True

    def __init__(self, prefix, k, **options):
        self.spec = LayerSpec(prefix=prefix, kind="linear", device_type="cuda", act_dtype=torch.bfloat16, n=64, k=k,
                              options=options)
        self.x_on_grid = False

    def take_grid_input(self):
        self.x_on_grid = True


def _linear(prefix, k, **options):
    m = torch.nn.Module()
    m.grid_kernel = Kernel(prefix, k, **options)
    return m


def _decoder(cls_name, k=64, i=128, moe=False, norm=Norm, **options):
    layer = type(cls_name, (torch.nn.Module,), {})()
    layer.input_layernorm, layer.post_attention_layernorm = norm(k), norm(k)
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = _linear("qkv_proj", k, **options)
    layer.mlp = torch.nn.Module()
    if moe:
        layer.mlp.experts = torch.nn.Module()
    else:
        layer.mlp.gate_up_proj = _linear("gate_up_proj", k, **options)
        layer.mlp.act_fn = SiluMul()
        layer.mlp.down_proj = _linear("down_proj", i, **options)
    return layer


FACTS = PF.FusionFacts(frozenset({"Qwen3DecoderLayer", "Qwen3MoeDecoderLayer"}), Norm, SiluMul)


def test_dense_layer_fuses_all_three_producers_and_keeps_parameter_names():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_decoder("Qwen3DecoderLayer", producer_qdq=True) for _ in range(2)])
    names = [n for n, _ in model.named_parameters()]
    w = model.layers[0].input_layernorm.weight
    fused = PF.fuse_producers(model, FACTS)
    assert len(fused) == 6 and "layers.0.input_layernorm -> self_attn.qkv_proj" in fused
    assert [n for n, _ in model.named_parameters()] == names
    assert model.layers[0].input_layernorm.weight is w                       # the same storage: updates stay live
    assert isinstance(model.layers[0].input_layernorm, Norm)
    assert model.layers[1].mlp.act_fn.grid_fused_qdq == "silu_mul"
    assert all(lin.grid_kernel.x_on_grid for lyr in model.layers
               for lin in (lyr.self_attn.qkv_proj, lyr.mlp.gate_up_proj, lyr.mlp.down_proj))
    assert PF.fuse_producers(model, FACTS) == fused                           # idempotent


def test_refusals():
    model = torch.nn.Module()
    model.a = _decoder("Qwen3DecoderLayer")                                   # option off: untouched
    model.b = _decoder("LlamaLikeUnknownLayer", producer_qdq=True)            # a layer type not vouched for
    model.c = _decoder("Qwen3DecoderLayer", norm=OtherNorm, producer_qdq=True)  # norm subclass: only act_fn
    model.d = _decoder("Qwen3MoeDecoderLayer", moe=True, producer_qdq=True)   # MoE: qkv only (router reads the norm)
    model.e = _decoder("Qwen3DecoderLayer", producer_qdq=True)
    model.e.self_attn.qkv_proj.grid_kernel.accepts_grid_input = False         # a kernel that quantizes its input
    model.e.mlp.gate_up_proj.grid_kernel.spec = LayerSpec("g", "linear", "cuda", torch.float16, 64, 64,
                                                          options={"producer_qdq": True})
    model.e.post_attention_layernorm.weight.data = torch.ones(64, dtype=torch.float32)
    fused = PF.fuse_producers(model, FACTS)
    assert sorted(fused) == ["c.mlp.act_fn -> mlp.down_proj", "d.input_layernorm -> self_attn.qkv_proj",
                             "e.mlp.act_fn -> mlp.down_proj"]
    assert not model.a.self_attn.qkv_proj.grid_kernel.x_on_grid and not hasattr(model.a.input_layernorm,
                                                                                "grid_fused_qdq")
    assert not model.b.self_attn.qkv_proj.grid_kernel.x_on_grid
    assert not model.e.self_attn.qkv_proj.grid_kernel.x_on_grid and not model.e.mlp.gate_up_proj.grid_kernel.x_on_grid
    assert "fp16" in PF.why_not(model.e.post_attention_layernorm, model.e.mlp.gate_up_proj, "rms_norm",
                                FACTS).replace("torch.float16", "fp16")
    assert "quantizes its own input" in PF.why_not(model.e.input_layernorm, model.e.self_attn.qkv_proj, "rms_norm", FACTS)
    assert "OtherNorm" in PF.why_not(model.c.input_layernorm, model.c.self_attn.qkv_proj, "rms_norm", FACTS)


def test_the_base_kernel_refuses_grid_input():
    from mxfp8_learner_grid.common.grid_kernels.base import GridKernel
    k = GridKernel(LayerSpec("p.qkv_proj", "linear", "cpu", torch.bfloat16, 64, 64))
    assert not k.accepts_grid_input
    with pytest.raises(ValueError, match="p.qkv_proj"):
        k.take_grid_input()


_FORWARD_CHECK = r'''
import torch
from mxfp8_learner_grid.common import producer_fusion as PF
from mxfp8_learner_grid.common.kernels.producer_qdq_triton import rms_norm_qdq, silu_mul_qdq

class Norm(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(k).to(torch.bfloat16))
        self.variance_epsilon = 1e-5

class Act(torch.nn.Module):
    pass

n, a = Norm(128), Act()
n.__class__ = PF.fused_class(Norm, "rms_norm", "variance_epsilon")
a.__class__ = PF.fused_class(Act, "silu_mul", "variance_epsilon")
x, r = torch.randn(3, 128).to(torch.bfloat16), torch.randn(3, 128).to(torch.bfloat16)
y, ro = n(x, r)
ey, ero = rms_norm_qdq(x, n.weight.detach(), 1e-5, r)
assert torch.equal(y.view(torch.int16), ey.view(torch.int16)) and torch.equal(ro.view(torch.int16), ero.view(torch.int16))
assert torch.equal(n(x).view(torch.int16), rms_norm_qdq(x, n.weight.detach(), 1e-5).view(torch.int16))
with torch.no_grad():
    n.weight.mul_(2)                             # a weight update is seen by the next call
assert torch.equal(n(x).view(torch.int16), rms_norm_qdq(x, n.weight.detach(), 1e-5).view(torch.int16))
g = torch.randn(4, 256).to(torch.bfloat16)
assert torch.equal(a(g).view(torch.int16), silu_mul_qdq(g).view(torch.int16))
print("OK")
'''


def test_the_fused_forwards_call_the_kernels_and_read_the_live_weight():
    run_ok(_FORWARD_CHECK)


def test_option_is_a_bool():
    assert GridOptions.from_dict({"producer_qdq": True}).raw["producer_qdq"] is True
    with pytest.raises(ValueError, match="producer_qdq must be true or false"):
        GridOptions.from_dict({"producer_qdq": "yes"})


# --- the vLLM patch ------------------------------------------------------------------------------

def test_vllm_patch_wraps_the_loader_step_and_requires_itself():
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader import base_loader

    from mxfp8_learner_grid.patches import vllm_producer_qdq as P
    from mxfp8_learner_grid.vllm_plugin import compat
    original = base_loader.process_weights_after_loading
    saved = (P._applied, P._why_not)
    try:
        P._applied, P._why_not = False, "not applied yet"
        with pytest.raises(ValueError, match="producer_qdq needs patch"):
            P.require("model.layers.0.self_attn.qkv_proj")
        if compat.VLLM_VERSION[:2] not in P.WRITTEN_FOR:
            assert not P.apply()
            return
        calls = []
        base_loader.process_weights_after_loading = lambda *a: calls.append(a)
        assert P.apply() and P.apply()
        wrapped = base_loader.process_weights_after_loading
        model = torch.nn.Module()
        model.layer = _decoder("Qwen3DecoderLayer")                  # option off: fuse_producers is not run
        wrapped(model, None, None)
        assert len(calls) == 1 and not hasattr(model.layer.input_layernorm, "grid_fused_qdq")
        P.require("x")                                               # applied: no error
        facts = compat.fusion_facts()
        assert "Qwen3DecoderLayer" in facts.layer_types and facts.rms_norm_type.__name__ == "RMSNorm"
    finally:
        base_loader.process_weights_after_loading = original
        P._applied, P._why_not = saved
