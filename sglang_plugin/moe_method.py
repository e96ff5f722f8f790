"""Fused MoE experts on the grid (Qwen3-MoE and other SiLU-gated MoE) for SGLang's FusedMoE.

Layout as SGLang lays out its own experts: ``w13_weight`` [E, 2I, H] (w1 = gate rows,
then w3 = up rows, as ``FusedMoE._load_w13`` fills it), ``w2_weight`` [E, H, I], and per-row
E8M0 scales along K: ``w13_weight_scale_inv`` [E, 2I, H/32], ``w2_weight_scale_inv``
[E, H, I/32], marked GROUP so ``FusedMoE.weight_loader`` shards them like the weights.
The forward is the layer's kernel from ``common.grid_kernels`` (the chooser and kernels the
vLLM plugin uses); there is no MoE runner.  The router (``mlp.gate``) stays off the grid: SGLang's
Qwen3-MoE builds it without a quant config, and the default selection excludes it.
"""

from __future__ import annotations

from mxfp8_learner_grid.common import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from mxfp8_learner_grid.common.dummy import fill_dummy_grid_weights
from mxfp8_learner_grid.common.grid_kernels.layers import choose_for_moe
from mxfp8_learner_grid.common.loading import MOE_GRID_PARAMS, check_moe_complete, check_no_nan_scales, create_grid_moe

from . import compat


class LearnerGridMoEMethod(compat.FusedMoEMethodBase):

    def __init__(self, quant_config, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def _check_supported(self, layer, with_bias: bool) -> None:
        cfg = layer.moe_runner_config
        problems = []
        if str(getattr(cfg, "activation", "silu")).lower() != "silu" or not getattr(cfg, "is_gated", True):
            problems.append(f"activation {cfg.activation!r} (SiLU-gated experts only)")
        if with_bias:
            problems.append("expert biases")
        if getattr(cfg, "apply_router_weight_on_input", False):
            problems.append("apply_router_weight_on_input")
        for name in ("gemm1_alpha", "gemm1_clamp_limit", "swiglu_limit"):
            if getattr(cfg, name, None) is not None:
                problems.append(name)
        if getattr(cfg, "routed_scaling_factor", None) not in (None, 1.0):
            problems.append("routed_scaling_factor (not verified against the learner)")
        if not compat.moe_runner_backend_ok():
            problems.append(f"--moe-runner-backend {compat.moe_runner_backend_name()} (use auto or triton)")
        if problems:
            raise NotImplementedError(f"{self.prefix}: mxfp8-learner-grid MoE does not support "
                                      + ", ".join(problems))

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self._check_supported(layer, bool(extra_weight_attrs.pop("with_bias", False)))
        extra_weight_attrs.pop("moe_intermediate_size", None)
        h, i = hidden_size, intermediate_size_per_partition
        base_loader = extra_weight_attrs.pop("weight_loader")
        full_i = i * getattr(layer, "moe_tp_size", 1)

        def shard_info(key, param: str):
            shard, local = key
            label = f"{self.prefix}.{param} (local expert {local}, {shard})"
            if getattr(layer, "use_presharded_weights", False):
                return label, None
            return label, (h, full_i) if shard == "w2" else (full_i, h)

        create_grid_moe(layer, self.prefix, num_experts, h, i, params_dtype, base_loader, extra_weight_attrs,
                        compat.set_weight_attrs, compat.FusedMoeWeightScaleSupported.GROUP.value, shard_info)

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        self.runner = None           # no MoeRunner: apply calls common's op directly

    def get_moe_runner_backend(self, layer):
        return None                  # 0.5.23: "a direct kernel consuming standard TopK with local IDs"

    def process_weights_after_loading(self, layer) -> None:
        first = not getattr(layer, "grid_processed", False)
        if first and compat.load_format() == "dummy":      # random valid grid weights (benchmarks)
            fill_dummy_grid_weights(layer.w13_weight, layer.w13_weight_scale_inv, self.prefix + ".w13")
            fill_dummy_grid_weights(layer.w2_weight, layer.w2_weight_scale_inv, self.prefix + ".w2")
        elif first:
            check_moe_complete(layer, self.prefix)
        check_no_nan_scales(layer, self.prefix, MOE_GRID_PARAMS)      # also after every reload
        if first:
            compat.register_kernel_providers()
            layer.grid_kernel = choose_for_moe(self.quant_config, self.prefix, layer)
        layer.grid_kernel.process_weights_after_loading(layer)
        layer.grid_processed = True

    def restore_weights_before_loading(self, layer) -> None:
        """Nothing to undo: the expert parameters keep their loaded layout."""
        return

    def apply(self, layer, dispatch_output):
        fmt = getattr(dispatch_output, "format", None)
        if fmt is not None and not fmt.is_standard():
            raise NotImplementedError(f"{self.prefix}: mxfp8-learner-grid MoE needs SGLang's standard dispatcher "
                                      f"(no --moe-a2a-backend); got dispatch format {fmt}")
        x = dispatch_output.hidden_states
        topk_weights, topk_ids = compat.standard_topk(dispatch_output.topk_output)
        # the standard dispatcher already maps ids to this rank's experts (-1: elsewhere)
        out = layer.grid_kernel.apply(layer, x, topk_weights, topk_ids, None)
        return compat.StandardCombineInput(hidden_states=out)
