"""``--quantization mxfp8-learner-grid``: the QuantizationConfig vLLM instantiates.

Where the options come from, in vLLM's order:
1. a pre-quantized (wire-format) checkpoint: ``config.json`` -> ``quantization_config``
   with ``"quant_method": "mxfp8-learner-grid"`` (``--quantization`` may then be omitted);
2. a BF16 checkpoint with ``--hf-overrides '{"quantization_config_file": "grid.yaml"}'`` or
   ``'{"quantization_config_dict_json": "{\\"modules\\": {\\"layers\\": [0, 1, 2]}}"}'``;
3. a BF16 checkpoint with nothing else: every Linear and every MoE expert on the grid,
   lm_head / embeddings / norms / routers in the model dtype.

Options (all optional)::

    modules:                       # which modules run on the grid (common.selection)
      include: ["*"]               # globs, or "re:<regex>"
      exclude: ["lm_head", "*.mlp.gate", ...]
      layers: [0, 1, 2, 3]         # decoder-layer indices; e.g. half of the layers
    kv_cache_scales: optional      # or "required": fail the load if --kv-cache-dtype fp8 has no scales
    emulate: fp8_per_tensor        # STUDY ONLY: the selected modules on another FP8 grid instead
                                   # (common/emulation.py; fp8_per_tensor | fp8_block128), BF16 weights
    kernel: auto                   # or marlin | w8a16 | triton | torch: force one grid kernel (common/grid_kernels)
    prefill_crossover: 256         # rows from which dense layers switch Marlin -> W decode + cuBLAS
    gemv_rows: 8                   # rows 1 ... R: dense layers use the decode GEMV (gemv_triton; max 64; default 0
                                   # with Marlin, which measured faster at every M on the H200; 8 with w8a16)
    moe_gemv_slots: 128            # MoE: up to S routed slots (tokens x top-k) by the expert GEMV (default 0 with
                                   # Marlin MoE, which measured faster; 128 with the Triton MoE)
    w8a16_rows: [17, 256]          # rows [lo, hi) for which dense layers use the W8A16 Triton GEMM ([]: off)
    humming_rows: [17, 129]        # rows [lo, hi) for which dense layers use humming-kernels' W8A16 wgmma GEMM with
                                   # stream-K off (sm_90, humming importable; []: off); humming_tile: [BLOCK_N, BLOCK_K]
    bf16_weight_rows: 48           # from these rows, dense layers run cuBLAS on a resident bf16 copy of W's grid
                                   # values (exact; 2 bytes/weight more GPU memory, taken from the KV cache; 0: off);
                                   # per module: {qkv_proj: 48, o_proj: 48, down_proj: 48} (other layers: no copy);
                                   # that mapping is the default on sm_90, no copy elsewhere
    cpu_weight_cache: true         # CPU: keep an fp32 copy of W's grid values (MXFP8_GRID_CPU_CACHE=0 at load)
    router_dtype: float32          # MoE router logits computed in FP32, as Megatron's moe_router_dtype=fp32
                                   # (common/router.py; default "model": the model dtype, as before)
    moe_router_weights: activation # Megatron's MoE order: router weights on SiLU*up before the down
                                   # projection (default "combine": on the experts' outputs); CPU kernel only

A fused vLLM layer (``qkv_proj``, ``gate_up_proj``) is on the grid when its fused name or
all of its Hugging Face shards (``q_proj``/``k_proj``/``v_proj``) are selected and none is
excluded; a selection that splits a fused layer is an error (``ModuleSelection.matches_fused``).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from mxfp8_learner_grid.common.options import GridOptions, GridQuantConfigMixin
from mxfp8_learner_grid.common.router import is_router
from mxfp8_learner_grid.common.selection import ModuleSelection
from mxfp8_learner_grid.common.wire import QUANT_METHOD

from . import compat


class MXFP8LearnerGridConfig(GridQuantConfigMixin, compat.QuantizationConfig):

    def __init__(self, selection: Optional[ModuleSelection] = None, kv_cache_scales: str = "optional",
                 raw: Optional[dict[str, Any]] = None):
        super().__init__()
        raw = dict(raw or {})
        self.options = GridOptions(selection or ModuleSelection(), kv_cache_scales, raw.get("emulate"), raw)
        self.selection, self.kv_cache_scales = self.options.selection, self.options.kv_cache_scales
        self.emulate, self.raw = self.options.emulate, raw

    # -- QuantizationConfig API -------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MXFP8LearnerGridConfig":
        opts = GridOptions.from_dict(config)
        return cls(opts.selection, opts.kv_cache_scales, raw=opts.raw)

    @classmethod
    def from_config_file(cls, path: str) -> "MXFP8LearnerGridConfig":
        import yaml
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        return cls.from_config(data)

    @classmethod
    def from_config_dict_json(cls, text: str) -> "MXFP8LearnerGridConfig":
        return cls.from_config(json.loads(text))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if getattr(self, "online_quantization_config", None) is not None:
            raise ValueError(f"{QUANT_METHOD} does not compose with --quantization-config (vLLM online "
                             "quantization would quantize the learner's grid a second time)")
        from .kv_cache import GridKVCacheMethod
        from .linear_method import GridLinearMethod, GridPlainLinearMethod
        from .moe_method import GridMoEMethod
        if self.emulate is not None:                  # the consistency study's other-grid arms
            from .emulation_method import EmulatedLinearMethod, EmulatedMoEMethod
            if isinstance(layer, compat.LinearBase):
                return EmulatedLinearMethod(self.emulate) if self.on_grid(prefix) else GridPlainLinearMethod()
            if isinstance(layer, compat.MOE_LAYER_TYPES) and self.on_grid(prefix):
                return EmulatedMoEMethod(self.emulate, layer)
        if isinstance(layer, compat.LinearBase):
            if self.on_grid(prefix):
                if self.options.raw.get("producer_qdq", False):
                    # the model-level step after loading (in this worker, before load_model reaches it)
                    from mxfp8_learner_grid.patches import vllm_producer_qdq
                    vllm_producer_qdq.apply()
                return GridLinearMethod(self, prefix)
            if self.options.router_dtype is not None and is_router(prefix):
                from .linear_method import GridRouterMethod
                return GridRouterMethod(self.options.router_dtype, prefix)
            return GridPlainLinearMethod()
        if isinstance(layer, compat.MOE_LAYER_TYPES):
            if self.on_grid(prefix):
                return GridMoEMethod(self, layer, prefix)
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                from .moe_method import GridPlainMoEMethod
                return GridPlainMoEMethod(layer)
            return compat.UnquantizedFusedMoEMethod(layer.moe_config)
        if isinstance(layer, compat.Attention):
            return GridKVCacheMethod(self, prefix)
        if isinstance(layer, compat.VocabParallelEmbedding):
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                from .linear_method import GridPlainEmbeddingMethod
                return GridPlainEmbeddingMethod()
        return None

    # -- module selection -------------------------------------------------------------
    def on_grid(self, prefix: str) -> bool:
        last = prefix.rpartition(".")[2]
        return self.options.on_grid(prefix, (getattr(self, "packed_modules_mapping", None) or {}).get(last))
