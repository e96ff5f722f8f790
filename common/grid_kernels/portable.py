"""The kernels that need nothing from an engine: the PyTorch reference (any device, the CPU
path) and the project's Triton kernels (CUDA, sm_89+)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from ..linear import dequantize_weight
from .base import GridKernel, LayerSpec


def triton_supported(spec: LayerSpec) -> tuple[bool, str]:
    if spec.device_type != "cuda":
        return False, "not a CUDA device"
    from ..kernels import _have_triton
    if not _have_triton():
        return False, "Triton is not installed"
    if spec.capability is not None and spec.capability < (8, 9):
        return False, f"compute capability {spec.capability} < 8.9 (no FP8 conversions)"
    return True, ""


class TorchLinear(GridKernel):
    """``mxfp8_linear_reference`` through the ``linear`` custom op; on CPU with a derived fp32 copy
    of W's exact values (``weight_dequant``, option ``cpu_weight_cache``, default on) that saves
    dequantizing W in every forward."""

    name = "torch"
    kind = "linear"

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        self.cache = spec.device_type == "cpu" and bool(spec.options.get("cpu_weight_cache", True))

    def derived_names(self, layer):
        return ("weight_dequant",) if self.cache else ()

    def process_weights_after_loading(self, layer) -> None:
        if not self.cache:
            return
        if not hasattr(layer, "weight_dequant"):
            self.register_derived_buffer(layer, "weight_dequant",
                                         dequantize_weight(layer.weight, layer.weight_scale_inv))
        else:
            self.refresh(layer)

    def refresh(self, layer, experts=None) -> None:
        if self.cache:
            with torch.no_grad():
                layer.weight_dequant.copy_(dequantize_weight(layer.weight, layer.weight_scale_inv))

    def derived(self, layer):
        if not self.cache:
            return {}
        return {"weight_dequant": (layer.weight_dequant, lambda: dequantize_weight(layer.weight, layer.weight_scale_inv))}

    def apply(self, layer, x, bias: Optional[torch.Tensor] = None):
        if self.cache:
            return torch.ops.mxfp8_learner_grid.linear_dequantized(x, layer.weight_dequant, bias)
        return torch.ops.mxfp8_learner_grid.linear_reference(x, layer.weight, layer.weight_scale_inv, bias)


class TritonLinear(GridKernel):
    """The project's Triton grid GEMM (both operands decoded in registers); nothing derived."""

    name = "triton"
    kind = "linear"

    @classmethod
    def is_supported(cls, spec):
        return triton_supported(spec)

    def apply(self, layer, x, bias: Optional[torch.Tensor] = None):
        return torch.ops.mxfp8_learner_grid.linear(x, layer.weight, layer.weight_scale_inv, bias)


def weights_on_activation(spec: LayerSpec) -> bool:
    """Option ``moe_router_weights: activation`` (Megatron's order, ``ops.moe_reference``)."""
    return spec.options.get("moe_router_weights", "combine") == "activation"


def refuse_weights_on_activation(spec: LayerSpec, kernel: str) -> tuple[bool, str]:
    if weights_on_activation(spec):
        return False, (f"moe_router_weights: activation (Megatron's order) is not implemented in the {kernel} MoE "
                       "kernel; the torch kernel has it, on CPU")
    return True, ""


class TorchMoE(GridKernel):
    """The per-expert reference loop (the CPU path); nothing derived."""

    name = "torch"
    kind = "moe"

    @classmethod
    def can_implement(cls, spec):
        if weights_on_activation(spec) and spec.device_type != "cpu":
            return False, ("moe_router_weights: activation (Megatron's order) runs on CPU only for now (the GPU "
                           "MoE kernels do not implement it, and the reference loop has not been measured on a GPU)")
        return True, ""

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        self.on_activation = weights_on_activation(spec)

    def apply(self, layer, x, topk_weights, topk_ids, expert_map=None):
        return torch.ops.mxfp8_learner_grid.moe(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                                layer.w2_weight_scale_inv, topk_weights, topk_ids, expert_map,
                                                self.on_activation)

    def describe(self):
        return self.name + (" (router weights on the activation)" if self.on_activation else "")


class TritonMoE(TorchMoE):
    """The project's Triton grouped GEMM over expert-sorted token slots; nothing derived."""

    name = "triton"

    @classmethod
    def is_supported(cls, spec):
        return triton_supported(spec)

    @classmethod
    def can_implement(cls, spec):
        return refuse_weights_on_activation(spec, "Triton")

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        from .moe_gemv import TRITON_MOE_DEFAULT_SLOTS, moe_gemv_slots
        self.gemv_slots = moe_gemv_slots(spec, TRITON_MOE_DEFAULT_SLOTS)

    def apply(self, layer, x, topk_weights, topk_ids, expert_map=None):
        return torch.ops.mxfp8_learner_grid.moe(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                                layer.w2_weight_scale_inv, topk_weights, topk_ids, expert_map,
                                                False, self.gemv_slots)

    def describe(self):
        return (f"expert GEMV (slots <= {self.gemv_slots}) + " if self.gemv_slots else "") + self.name
