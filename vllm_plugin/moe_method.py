"""Fused MoE experts on the grid (Qwen3-MoE and other SiLU-gated MoE) for vLLM.

Layout as vLLM's own MXFP8 MoE: ``w13_weight`` [E, 2I, H] (gate rows, then up rows, as
vLLM fuses w1/w3), ``w2_weight`` [E, H, I], and per-row E8M0 scales along K:
``w13_weight_scale_inv`` [E, 2I, H/32], ``w2_weight_scale_inv`` [E, H, I/32].  They load
through ``RoutedExperts.weight_loader`` (GROUP scales are sharded like the weights, so
tensor and expert parallel splits stay exact).  The router stays outside the grid.
"""

from __future__ import annotations

import torch

from mxfp8_learner_grid.common import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from mxfp8_learner_grid.common.grid_kernels.layers import choose_for_moe
from mxfp8_learner_grid.common.refresh import refresh_layer
from mxfp8_learner_grid.common.dummy import fill_dummy_grid_weights
from mxfp8_learner_grid.common.loading import (MOE_GRID_PARAMS, check_moe_complete, check_no_nan_scales,
                                               create_grid_moe, labels_only)

from . import compat

class GridMoEMethod(compat.FusedMoEMethodBase):

    def __init__(self, quant_config, layer, prefix: str):
        super().__init__(layer.moe_config)
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        act = compat.moe_activation_name(layer)
        if act != "silu" or not getattr(self.moe, "is_act_and_mul", True):
            raise NotImplementedError(f"{self.prefix}: mxfp8-learner-grid MoE supports SiLU-gated experts; "
                                      f"got activation {act!r}")
        base_loader = extra_weight_attrs.pop("weight_loader")
        create_grid_moe(layer, self.prefix, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                        base_loader, extra_weight_attrs, compat.set_weight_attrs,
                        compat.FusedMoeWeightScaleSupported.GROUP.value, labels_only(self.prefix))
        layer.grid_dummy_load = compat.load_format() == "dummy"

    def process_weights_after_loading(self, layer) -> None:
        # Idempotent, allocation-free after the first call (see GridLinearMethod).
        first = not getattr(layer, "grid_processed", False)
        if first and layer.grid_dummy_load:
            fill_dummy_grid_weights(layer.w13_weight, layer.w13_weight_scale_inv, self.prefix + ".w13")
            fill_dummy_grid_weights(layer.w2_weight, layer.w2_weight_scale_inv, self.prefix + ".w2")
        elif first:
            check_moe_complete(layer, self.prefix)
            check_no_nan_scales(layer, self.prefix, MOE_GRID_PARAMS)
        if first:
            compat.register_kernel_providers()
            layer.grid_kernel = choose_for_moe(self.quant_config, self.prefix, layer)
        layer.grid_kernel.process_weights_after_loading(layer)
        layer.grid_processed = True

    def update_refresh(self, layer) -> None:
        """After new bytes: rebuild derived copies in their existing storage."""
        refresh_layer(layer)

    def get_fused_moe_quant_config(self, layer):
        return compat.moe_quant_config_none()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(f"{self.prefix}: apply_router_weight_on_input is not supported on the grid")
        return layer.grid_kernel.apply(layer, x, topk_weights, topk_ids, layer.expert_map)



class GridPlainMoEMethod(compat.FusedMoEMethodBase):
    """Experts a module selection leaves off the grid, on CPU: plain weights in the checkpoint's
    layout ([E, 2I, H] / [E, H, I]) and a plain MoE forward.  vLLM's own unquantized CPU method
    prepacks the experts into a runtime layout that an in-place weight update cannot write (a
    BF16 control sampler's updates would land in the wrong layout); this one keeps them
    updatable, like ``GridPlainLinearMethod`` for Linear layers.  On CUDA the plugin uses vLLM's
    own unquantized method."""

    def __init__(self, layer):
        super().__init__(layer.moe_config)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        for name, shape in (("w13_weight", (e, 2 * i, h)), ("w2_weight", (e, h, i))):
            p = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, p)
            compat.set_weight_attrs(p, extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        pass

    def get_fused_moe_quant_config(self, layer):
        return compat.moe_quant_config_none()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        from mxfp8_learner_grid.common.ops import local_expert_ids, moe_plain_reference
        return moe_plain_reference(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                   local_expert_ids(topk_ids, layer.expert_map))
