"""Dense Linear layers on the grid (QKV, O, gate_up, down) for vLLM."""

from __future__ import annotations

import torch

from mxfp8_learner_grid.common import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from mxfp8_learner_grid.common.grid_kernels.layers import choose_for_linear, register_kernel_derived
from mxfp8_learner_grid.common.refresh import refresh_layer
from mxfp8_learner_grid.common.router import router_logits
from mxfp8_learner_grid.common.loading import check_complete, check_no_nan_scales, create_grid_linear, labels_only

from . import compat
from mxfp8_learner_grid.common.dummy import fill_dummy_grid_weights


def _fused(layer) -> str | None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    return "qkv" if isinstance(layer, QKVParallelLinear) else \
        "merged" if isinstance(layer, MergedColumnParallelLinear) else None


class GridLinearMethod(compat.LinearMethodBase):
    """fp8 ``weight`` [N, K] + uint8 ``weight_scale_inv`` [N, K/32]; forward = the learner's."""

    def __init__(self, quant_config, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        create_grid_linear(layer, self.prefix, output_partition_sizes, input_size_per_partition, params_dtype,
                           extra_weight_attrs.pop("weight_loader"), extra_weight_attrs, compat.set_weight_attrs,
                           lambda _layer: labels_only(self.prefix), _fused(layer))
        layer.grid_dummy_load = compat.load_format() == "dummy"

    def process_weights_after_loading(self, layer) -> None:
        # Idempotent, and allocation-free after the first call.  The layer's kernel is chosen
        # once (common.grid_kernels.choose); its derived tensors are allocated here once and
        # rewritten in place after every write (common.refresh), so CUDA graphs stay valid.
        first = not getattr(layer, "grid_processed", False)
        if layer.grid_dummy_load and first:
            fill_dummy_grid_weights(layer.weight, layer.weight_scale_inv, self.prefix)
        elif first:
            verify_loaded(layer, self.prefix, ("weight", "weight_scale_inv"), layer.grid_expected_shards)
        if first:
            compat.register_kernel_providers()
            layer.grid_kernel = choose_for_linear(self.quant_config, self.prefix, layer)
            if layer.grid_kernel.spec.options.get("producer_qdq", False):
                from mxfp8_learner_grid.patches import vllm_producer_qdq
                vllm_producer_qdq.require(self.prefix)
        layer.grid_kernel.process_weights_after_loading(layer)
        layer.grid_processed = True

    def update_refresh(self, layer) -> None:
        """After new bytes: rebuild derived copies in their existing storage."""
        refresh_layer(layer)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.grid_kernel.apply(layer, x, bias)


class GridPlainLinearMethod(compat.UnquantizedLinearMethod):
    """A Linear kept off the grid (lm_head-like layers, MoE routers): vLLM's unquantized method,
    except that on CPU it keeps the plain weight parameter (no prepacking that deletes it), so
    that in-place weight updates can write it like any other parameter."""

    def process_weights_after_loading(self, layer) -> None:
        layer._cpu_skip_gemm_dispatch = True
        super().process_weights_after_loading(layer)


class GridRouterMethod(GridPlainLinearMethod):
    """An MoE router with option ``router_dtype: float32``: the plain bf16 weight (written by every
    update like any other), logits computed in FP32 and returned in FP32 (``common.router``), so
    that vLLM's top-k and the grid MoE's combine see the logits Megatron's FP32 router computes."""

    def __init__(self, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.dtype, self.prefix = dtype, prefix

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return router_logits(x, layer.weight, bias, self.dtype)


class GridPlainEmbeddingMethod(compat.UnquantizedEmbeddingMethod):
    """Embeddings and lm_head on CPU: vLLM's unquantized method computes lm_head from a packed copy
    of the weight made once at load (``dispatch_cpu_unquantized_gemm``), which a trainer's plain
    ``model.load_weights`` never refreshes -- the engine then samples from the old lm_head.  This
    one reads the parameter itself (``torch.nn.functional.linear``), so every write is live."""

    def process_weights_after_loading(self, layer) -> None:
        layer.cpu_linear = torch.nn.functional.linear


def register_derived(model, registry) -> None:
    """Register every derived tensor of the on-grid layers (see common/sync/derived.py)."""
    register_kernel_derived(model, registry)


def verify_loaded(layer, prefix, params, expected_shards) -> None:
    check_complete(layer, prefix, expected_shards, params)
    check_no_nan_scales(layer, prefix, params)
