"""Dense Linear layers on the grid (QKV, O, gate_up, down) for SGLang.

Parameters, as the learner sends them (this rank's part): ``weight`` float8_e4m3fn [N, K]
and ``weight_scale_inv`` uint8 [N, K/32], both with ``output_dim=0`` / ``input_dim=1``, so
SGLang's own ``weight_loader`` of ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` /
``RowParallelLinear`` places and narrows the scales exactly like the data.

The forward is the layer's kernel, chosen once by ``common.grid_kernels`` (the same chooser
and kernels as the vLLM plugin's: the PyTorch reference on CPU, the Triton grid GEMMs on
CUDA, and vLLM's Marlin with exact activation qdq where vLLM's ops are importable beside
SGLang).  A kernel's derived tensors (the CPU fp32 weight copy, Marlin's packed weights) are
allocated once and rewritten in place after every write through the loaders
(``common.refresh``) -- so ``update_weights_from_tensor`` / ``_from_distributed`` /
``_from_disk``, which all write through them, never leave a stale copy -- and again by
``process_weights_after_loading``, which may run any number of times (0.5.23's
``end_weight_update``) and never reallocates.  ``restore_weights_before_loading`` has nothing to
undo: the parameters keep their wire layout.
"""

from __future__ import annotations

import torch

from mxfp8_learner_grid.common import ops  # noqa: F401  (registers torch.ops.mxfp8_learner_grid.*)
from mxfp8_learner_grid.common.grid_kernels.layers import choose_for_linear
from mxfp8_learner_grid.common.loading import (check_complete, check_no_nan_scales, create_grid_linear,
                                               expected_dense_shards)

from mxfp8_learner_grid.common.dummy import fill_dummy_grid_weights

from . import compat

PARAMS = ("weight", "weight_scale_inv")


def _fused(layer) -> str | None:
    return "qkv" if isinstance(layer, compat.QKVParallelLinear) else \
        "merged" if isinstance(layer, compat.MergedColumnParallelLinear) else None


def _checkpoint_rows(layer, shard):
    """Rows of the checkpoint tensor (unsharded) that a load of ``shard`` carries."""
    if isinstance(layer, compat.QKVParallelLinear):
        sizes = {"q": layer.total_num_heads * layer.head_size, "k": layer.total_num_kv_heads * layer.head_size,
                 "v": layer.total_num_kv_heads * layer.v_head_size}
        return sizes.get(shard, sum(sizes.values()) if shard is None else None)
    if isinstance(layer, compat.MergedColumnParallelLinear):
        if isinstance(shard, int):
            return layer.output_sizes[shard]
        return sum(layer.output_sizes) if shard is None else None     # e.g. tuple shard ids: not checked
    return layer.output_size if shard is None else None


def shard_info_for(layer, prefix: str, checkpoint_names: list[str] | None):
    """(checkpoint tensor name, expected checkpoint shape [rows, K]) of a dense load."""
    order = {s: i for i, s in enumerate(expected_dense_shards(_fused(layer), len(checkpoint_names or [])))}

    def info(shard, param: str):
        i = order.get(shard)
        head = prefix.rpartition(".")[0]
        if shard is not None and checkpoint_names and i is not None and i < len(checkpoint_names):
            label = f"{head + '.' if head else ''}{checkpoint_names[i]}.{param}"
        else:
            label = f"{prefix}.{param}" + (f"[{shard}]" if shard is not None else "")
        if getattr(layer, "use_presharded_weights", False):
            return label, None
        rows = _checkpoint_rows(layer, shard)
        return label, None if rows is None else (rows, layer.input_size)

    return info


class LearnerGridLinearMethod(compat.LinearMethodBase):
    """fp8 ``weight`` [N, K] + uint8 ``weight_scale_inv`` [N, K/32]; forward = the learner's."""

    def __init__(self, quant_config, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        shards = self.quant_config.checkpoint_shards(self.prefix)
        create_grid_linear(layer, self.prefix, output_partition_sizes, input_size_per_partition, params_dtype,
                           extra_weight_attrs.pop("weight_loader"), extra_weight_attrs, compat.set_weight_attrs,
                           lambda lay: shard_info_for(lay, self.prefix, shards), _fused(layer))

    def process_weights_after_loading(self, layer) -> None:
        # First call (after the checkpoint): every shard of data and scales was written, and the
        # kernel is chosen.  Every call (also end_weight_update in 0.5.23): no scale holds E8M0
        # 255, and the kernel's derived tensors are rewritten in place (never reallocated).
        first = not getattr(layer, "grid_processed", False)
        if first and compat.load_format() == "dummy":      # random valid grid weights (benchmarks)
            fill_dummy_grid_weights(layer.weight, layer.weight_scale_inv, self.prefix)
        elif first:
            check_complete(layer, self.prefix, layer.grid_expected_shards, PARAMS)
        check_no_nan_scales(layer, self.prefix, PARAMS)
        if first:
            compat.register_kernel_providers()
            layer.grid_kernel = choose_for_linear(self.quant_config, self.prefix, layer)
        layer.grid_kernel.process_weights_after_loading(layer)       # derived tensors: allocate once, refresh
        layer.grid_processed = True

    def restore_weights_before_loading(self, layer) -> None:
        """Nothing to undo: the parameters keep their checkpoint (wire) layout after loading."""
        return

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.grid_kernel.apply(layer, x, bias)
