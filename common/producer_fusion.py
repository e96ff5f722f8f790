"""Option ``producer_qdq``: a grid Linear's activation qdq done by the op that produces its input.

Every grid Linear quantize-dequantizes its input (one launch per Linear; at decode sizes about as
long as the RMSNorm before it).  With ``producer_qdq: true`` the producer of a Linear's input
writes that input's exact grid values itself (``kernels/producer_qdq_triton``), and the Linear
skips its qdq:

* the input RMSNorm of a decoder layer -> its attention's ``qkv_proj``;
* the post-attention RMSNorm -> a dense MLP's ``gate_up_proj`` (not an MoE block: its router reads
  the same tensor, off the grid);
* the MLP's SiLU * up -> its ``down_proj``.

Where it applies -- the engine supplies the facts (``FusionFacts``), this module holds the rules:

* only decoder layers of a type the engine adapter names, whose forward passes each producer's
  output to that one consumer and nothing else (read from the engine's model code);
* only producers of exactly the engine's RMSNorm / SiLU-and-mul class (no subclass: Gemma's norm
  differs), with a bf16 weight and no variance-size override;
* only consumers on the grid whose kernel takes grid input (``accepts_grid_input``), with bf16
  activations; the kernel is told once (``take_grid_input``), when the producer is swapped.

The producer keeps its module and its parameters (their names, their storage: weight updates stay
live); only its class becomes a subclass whose ``forward`` calls the fused op.  The result is the
same grid Linear: qdq is the identity on grid values, so the Linear computes what it computed
when it quantized the producer's bf16 output itself.  The producer's own arithmetic is the
engine's up to fp32 summation order (``producer_qdq_triton``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger("mxfp8_learner_grid.fusion")

OPTION = "producer_qdq"

#: (producer path, consumer path, kind) inside one decoder layer
RULES = (("input_layernorm", "self_attn.qkv_proj", "rms_norm"),
         ("post_attention_layernorm", "mlp.gate_up_proj", "rms_norm"),
         ("mlp.act_fn", "mlp.down_proj", "silu_mul"))


@dataclass(frozen=True)
class FusionFacts:
    """What the engine adapter knows: the decoder-layer class names whose forwards have the RULES'
    data flow, its RMSNorm and SiLU-and-mul classes, and the norm's epsilon attribute."""
    layer_types: frozenset
    rms_norm_type: type
    silu_mul_type: type
    eps_attr: str = "variance_epsilon"


# -- the ops -------------------------------------------------------------------------------------

@torch.library.custom_op("mxfp8_learner_grid::rms_norm_qdq", mutates_args=())
def rms_norm_qdq_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .kernels.producer_qdq_triton import rms_norm_qdq
    return rms_norm_qdq(x, weight, eps)


@rms_norm_qdq_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("mxfp8_learner_grid::add_rms_norm_qdq", mutates_args=())
def add_rms_norm_qdq_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.producer_qdq_triton import rms_norm_qdq
    return rms_norm_qdq(x, weight, eps, residual)


@add_rms_norm_qdq_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("mxfp8_learner_grid::silu_mul_qdq", mutates_args=())
def silu_mul_qdq_op(x: torch.Tensor) -> torch.Tensor:
    from .kernels.producer_qdq_triton import silu_mul_qdq
    return silu_mul_qdq(x)


@silu_mul_qdq_op.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# -- the producers' forwards ---------------------------------------------------------------------

def _rms_norm_forward(eps_attr: str):
    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        eps = getattr(self, eps_attr)
        if residual is None:
            return torch.ops.mxfp8_learner_grid.rms_norm_qdq(x, self.weight, eps)
        return torch.ops.mxfp8_learner_grid.add_rms_norm_qdq(x, residual, self.weight, eps)
    return forward


def _silu_mul_forward(self, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mxfp8_learner_grid.silu_mul_qdq(x)


_FUSED_CLASSES: dict = {}


def fused_class(cls: type, kind: str, eps_attr: str) -> type:
    """The subclass of ``cls`` whose forward is the fused op (one per class, cached)."""
    key = (cls, kind, eps_attr)
    if key not in _FUSED_CLASSES:
        forward = _rms_norm_forward(eps_attr) if kind == "rms_norm" else _silu_mul_forward
        _FUSED_CLASSES[key] = type(f"GridQdq{cls.__name__}", (cls,), {"forward": forward, "grid_fused_qdq": kind,
                                                                      "__module__": __name__})
    return _FUSED_CLASSES[key]


# -- the rules -----------------------------------------------------------------------------------

def _at(module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def why_not(producer, consumer, kind: str, facts: FusionFacts) -> str:
    """Why this producer -> consumer pair may not be fused ('' when it may)."""
    kernel = getattr(consumer, "grid_kernel", None)
    if kernel is None:
        return "the consumer is not on the grid"
    if not getattr(kernel, "accepts_grid_input", False):
        return f"its kernel ({kernel.name}) quantizes its own input"
    if kernel.spec.act_dtype != torch.bfloat16:
        return f"{kernel.spec.act_dtype} activations (the fused kernels write bf16)"
    if kernel.spec.k % 32:
        return f"K = {kernel.spec.k} is not a multiple of 32"
    if getattr(producer, "grid_fused_qdq", None):
        return ""
    if kind == "rms_norm":
        if type(producer) is not facts.rms_norm_type:
            return f"the producer is a {type(producer).__name__}, not the engine's {facts.rms_norm_type.__name__}"
        w = getattr(producer, "weight", None)
        if not isinstance(w, torch.nn.Parameter) or w.dtype != torch.bfloat16 or w.dim() != 1:
            return "the norm has no 1-D bf16 weight parameter"
        if getattr(producer, "variance_size_override", None) is not None:
            return "the norm has a variance-size override"
        if w.shape[0] != kernel.spec.k:
            return f"the norm's width {w.shape[0]} is not the consumer's K = {kernel.spec.k}"
    elif type(producer) is not facts.silu_mul_type:
        return f"the producer is a {type(producer).__name__}, not the engine's {facts.silu_mul_type.__name__}"
    return ""


def fuse_producers(model: torch.nn.Module, facts: FusionFacts) -> list[str]:
    """Swap in the fused producers wherever a consumer's options ask for it (``producer_qdq: true``) and
    the rules allow.  Idempotent.  Returns the pairs fused; logs each refusal once per reason."""
    fused, refused = [], {}
    for name, layer in model.named_modules():
        if type(layer).__name__ not in facts.layer_types:
            continue
        for prod_path, cons_path, kind in RULES:
            producer, consumer = _at(layer, prod_path), _at(layer, cons_path)
            kernel = getattr(consumer, "grid_kernel", None)
            if producer is None or kernel is None or not kernel.spec.options.get(OPTION, False):
                continue
            why = why_not(producer, consumer, kind, facts)
            if why:
                refused.setdefault(f"{prod_path} -> {cons_path}: {why}", f"{name}")
                continue
            if not getattr(producer, "grid_fused_qdq", None):
                producer.__class__ = fused_class(type(producer), kind, facts.eps_attr)
            kernel.take_grid_input()
            fused.append(f"{name}.{prod_path} -> {cons_path}")
    for why, first in refused.items():
        logger.warning("%s: not fused (%s, first at %s)", OPTION, why, first)
    if fused:
        logger.info("%s: %d producers write their consumer's grid input (e.g. %s)", OPTION, len(fused), fused[0])
    return fused


def producer_qdq_requested(model: torch.nn.Module) -> bool:
    """Does any grid layer of ``model`` have option ``producer_qdq`` on?"""
    return any(getattr(getattr(m, "grid_kernel", None), "spec", None) is not None
               and m.grid_kernel.spec.options.get(OPTION, False) for m in model.modules())
