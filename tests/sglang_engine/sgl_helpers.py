"""Shared plumbing of the SGLang plugin tests (CPU, gloo; no GPU, no server).

* :func:`init_dist` -- SGLang's own distributed + model-parallel setup at TP=1 or TP=2
  over gloo (what ``sglang.test.layer_ut_utils.init_single_process_dist`` does, for any
  world size).
* :func:`build_sglang_model` -- SGLang's real ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
  with our quantization config, built on the CPU (construction only: no attention
  backend, so the tests call the on-grid modules one by one, not the whole model).
* :func:`learner_and_wire` -- the learner: a tiny seeded ``transformers`` Qwen3(-MoE) with
  ``apply_learner_grid``, its wire export and its BF16 state dict (HF names).
* :func:`check_model` -- for every on-grid module: parameter bytes equal this rank's slice
  of the wire tensors, and the module's forward equals the learner's forward on the grid.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent")   # no NCCL on these machines

import torch
import torch.nn.functional as Fn

from mxfp8_learner_grid.common import mxfp8_linear_reference
from mxfp8_learner_grid.common.learner import apply_learner_grid, export_hf_state_dict, export_wire
from mxfp8_learner_grid.common.tiny_model import build_model

DTYPE = torch.bfloat16


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.test.test_utils import publish_build_topology
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    if not model_parallel_is_initialized():
        publish_build_topology(world_rank=rank, tp_size=world, ep_size=1, pp_size=1)
        initialize_model_parallel(backend="gloo")
    # RotaryEmbedding.__init__ picks a CUDA/vLLM fallback kernel unless it believes it is on
    # a CPU engine; the tests never run RoPE, so let construction take the CPU branch.
    import sglang.srt.layers.rotary_embedding.base as rope_base
    rope_base._is_cpu = True


def learner_and_wire(moe: bool, seed: int = 0):
    """(transformers model on the grid, wire dict, BF16 dict), all under HF names."""
    hf = build_model(moe=moe, seed=seed)
    apply_learner_grid(hf)                      # shares the BF16 parameters
    return hf, export_wire(hf), export_hf_state_dict(hf)


def build_sglang_model(hf_config, quant_config):
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    cls = Qwen3MoeForCausalLM if getattr(hf_config, "num_experts", 0) else Qwen3ForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        return cls(hf_config, quant_config=quant_config).eval()
    finally:
        torch.set_default_dtype(old)


def load(model, named_tensors) -> None:
    """What SGLang's DefaultModelLoader does with a checkpoint: load_weights, then post-process."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    model.load_weights(list(named_tensors))
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


# -- expected bytes -------------------------------------------------------------------

def _rows(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def _cols(t, rank, world):
    k = t.shape[-1] // world
    return t[..., rank * k:(rank + 1) * k]


def expected_params(wire: dict, sgl_name: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of the learner's bytes for one on-grid SGLang module."""
    head, _, last = sgl_name.rpartition(".")
    w = lambda m: (wire[f"{m}.weight"], wire[f"{m}.weight_scale_inv"])   # noqa: E731
    if last == "qkv_proj":
        parts = [w(f"{head}.{p}") for p in ("q_proj", "k_proj", "v_proj")]
        return {"weight": torch.cat([_rows(d, rank, world) for d, _ in parts]),
                "weight_scale_inv": torch.cat([_rows(s, rank, world) for _, s in parts])}
    if last == "gate_up_proj":
        parts = [w(f"{head}.{p}") for p in ("gate_proj", "up_proj")]
        return {"weight": torch.cat([_rows(d, rank, world) for d, _ in parts]),
                "weight_scale_inv": torch.cat([_rows(s, rank, world) for _, s in parts])}
    if last in ("o_proj", "down_proj"):
        d, s = w(sgl_name)
        return {"weight": _cols(d, rank, world), "weight_scale_inv": _cols(s, rank, world)}
    if last == "experts":
        e = 0
        out = {k: [] for k in ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")}
        while f"{sgl_name}.{e}.gate_proj.weight" in wire:
            (gd, gs), (ud, us), (dd, ds) = (w(f"{sgl_name}.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
            out["w13_weight"].append(torch.cat([_rows(gd, rank, world), _rows(ud, rank, world)]))
            out["w13_weight_scale_inv"].append(torch.cat([_rows(gs, rank, world), _rows(us, rank, world)]))
            out["w2_weight"].append(_cols(dd, rank, world))
            out["w2_weight_scale_inv"].append(_cols(ds, rank, world))
            e += 1
        return {k: torch.stack(v) for k, v in out.items()}
    raise KeyError(sgl_name)


def grid_modules(model):
    from mxfp8_learner_grid.sglang_plugin.linear_method import LearnerGridLinearMethod
    from mxfp8_learner_grid.sglang_plugin.moe_method import LearnerGridMoEMethod
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "quant_method", None), (LearnerGridLinearMethod, LearnerGridMoEMethod)):
            yield name, mod


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_bytes(model, wire, rank=0, world=1) -> int:
    n = 0
    for name, mod in grid_modules(model):
        for pname, want in expected_params(wire, name, rank, world).items():
            got = getattr(mod, pname)
            assert same_bytes(got.data, want), f"{name}.{pname}: bytes differ from the learner's wire tensor"
            n += 1
    return n


# -- expected forward -----------------------------------------------------------------

def moe_from_linear_reference(x, p, topk_weights, topk_ids):
    """The grid MoE built from mxfp8_linear_reference alone (per token, per routed expert):
    gate_up on the grid, SiLU(gate)*up in x's dtype, down on the grid, router weight, fp32 sum."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gu = mxfp8_linear_reference(x[t:t + 1], p["w13_weight"][e], p["w13_weight_scale_inv"][e])
            g, u = gu.chunk(2, dim=-1)
            d = mxfp8_linear_reference(Fn.silu(g) * u, p["w2_weight"][e], p["w2_weight_scale_inv"][e])
            out[t] += d[0].float() * topk_weights[t, j].float()
    return out.to(x.dtype)


def routing(n_tokens: int, n_experts: int, top_k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, n_experts, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32), logits


def check_forward(model, wire, rank=0, world=1, n_tokens=5, seed=2) -> int:
    """Every on-grid module's forward equals the grid reference on this rank's bytes, exactly.

    Column-parallel layers (qkv, gate_up) see the full K: their output is the learner's,
    bit for bit.  Row-parallel ones (o_proj, down_proj) are checked before the all-reduce
    (``skip_all_reduce``): the partial over this rank's K slice, whose 1x32 activation
    blocks are the learner's (the split is at a multiple of 32).  At TP=1 that is the
    whole output.  MoE at TP>1: the same partial over this rank's intermediate slice.
    """
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, mod in grid_modules(model):
        p = expected_params(wire, name, rank, world)
        last = name.rpartition(".")[2]
        if last == "experts":
            h = p["w13_weight"].shape[-1]
            x = torch.randn(n_tokens, h, generator=g).to(DTYPE)
            w, ids, logits = routing(n_tokens, p["w13_weight"].shape[0], mod.top_k, seed)
            got = mod(x, StandardTopKOutput(w, ids, logits))
            want = moe_from_linear_reference(x, p, w, ids)
        else:
            k = p["weight"].shape[-1]
            x = torch.randn(n_tokens, k, generator=g).to(DTYPE)
            got = mod(x, skip_all_reduce=True)[0] if last in ("o_proj", "down_proj") else mod(x)[0]
            want = mxfp8_linear_reference(x, p["weight"], p["weight_scale_inv"])
        assert got.dtype == want.dtype and torch.equal(got, want), \
            f"{name}: forward differs from the grid reference (max {float((got.float() - want.float()).abs().max())})"
        n += 1
    return n
