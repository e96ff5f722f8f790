"""Dense Linear layers on the grid (QKV, O, gate_up, down) for vLLM."""

from __future__ import annotations

import torch

from mxfp8_learner_grid.common import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from mxfp8_learner_grid.common.grid_kernels.layers import choose_for_linear, register_kernel_derived
from mxfp8_learner_grid.common.refresh import refresh_layer
from mxfp8_learner_grid.common.loading import (check_complete, check_linear_partition, check_no_nan_scales, labels_only,
                                               new_grid_params, wrap_scale_loader, wrap_weight_loader, writes)

from . import compat
from mxfp8_learner_grid.common.dummy import fill_dummy_grid_weights


def _expected_shards(layer, n_parts: int):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(n_parts))
    return [None]


def _dense_shard_key(*args, **kwargs):
    if args:
        return args[0]
    return kwargs.get("loaded_shard_id")


class GridLinearMethod(compat.LinearMethodBase):
    """fp8 ``weight`` [N, K] + uint8 ``weight_scale_inv`` [N, K/32]; forward = the learner's."""

    def __init__(self, quant_config, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        n, k = sum(output_partition_sizes), input_size_per_partition
        check_linear_partition(self.prefix, output_partition_sizes, k)
        base_loader = extra_weight_attrs.pop("weight_loader")
        weight, scale = new_grid_params((n, k))
        for p in (weight, scale):
            compat.set_weight_attrs(p, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale_inv", scale)
        weight.weight_loader = wrap_weight_loader(layer, "weight", "weight_scale_inv", base_loader,
                                                  _dense_shard_key, labels_only(self.prefix))
        scale.weight_loader = wrap_scale_loader(layer, "weight_scale_inv", base_loader, _dense_shard_key,
                                                labels_only(self.prefix))
        layer.grid_prefix = self.prefix
        layer.grid_act_dtype = params_dtype
        layer.grid_expected_shards = _expected_shards(layer, len(output_partition_sizes))
        layer.grid_dummy_load = compat.load_format() == "dummy"
        writes(layer).clear()

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
