"""``--quantization mxfp8-learner-grid``: the QuantizationConfig SGLang instantiates.

Where the options come from:
1. a pre-quantized (wire-format) checkpoint: ``config.json`` -> ``quantization_config``
   with ``"quant_method": "mxfp8-learner-grid"`` (``--quantization`` may then be omitted);
2. a BF16 checkpoint with ``--json-model-override-args
   '{"quantization_config": {"quant_method": "mxfp8-learner-grid", "modules": {"layers": [0, 1]}}}'``
   (SGLang's way to override config.json; it then reaches ``from_config``);
3. a BF16 checkpoint with ``--quantization mxfp8-learner-grid`` and nothing else: SGLang
   calls the class with no arguments, and every Linear and every MoE expert is on the
   grid, lm_head / embeddings / norms / routers in the model dtype.

Options (all optional; the same keys as the vLLM plugin's)::

    modules:                       # which modules run on the grid (common.selection)
      include: ["*"]               # globs, or "re:<regex>"
      exclude: ["lm_head", "*.mlp.gate", ...]
      layers: [0, 1, 2, 3]         # decoder-layer indices
    kv_cache_scales: optional      # or "required": fail the load if --kv-cache-dtype fp8_* has no scales

A fused SGLang layer (``qkv_proj``, ``gate_up_proj``) is on the grid when its fused name or
all of its Hugging Face shards are selected and none is excluded; a selection that splits
a fused layer is an error (``ModuleSelection.matches_fused``).

Naming: the class names contain neither "Fp8" nor "ModelOpt" nor "compressed", are not
subclasses of SGLang's Fp8 classes and are not in ``WEIGHT_LOADER_V2_SUPPORTED``, so none
of SGLang's string / isinstance special cases (backend choice, w1/w3 swap, scale renames)
applies to them; ``get_name()`` is compared with "mxfp8" only by equality in SGLang.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mxfp8_learner_grid.common.options import GridOptions, GridQuantConfigMixin
from mxfp8_learner_grid.common.selection import ModuleSelection
from mxfp8_learner_grid.common.wire import QUANT_METHOD

from . import compat

#: keys SGLang's loader adds to the checkpoint's quantization_config before from_config
INJECTED_KEYS = {"packed_modules_mapping", "hf_config", "requantization_method"}
#: SGLang's fused layers of Llama/Qwen-like models, for when the model passes no mapping
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class LearnerGridConfig(GridQuantConfigMixin, compat.QuantizationConfig):

    def __init__(self, selection: Optional[ModuleSelection] = None, kv_cache_scales: str = "optional",
                 raw: Optional[dict[str, Any]] = None):
        super().__init__()
        self.options = GridOptions(selection or ModuleSelection(), kv_cache_scales, raw=dict(raw or {}))
        self.selection, self.kv_cache_scales, self.raw = self.options.selection, kv_cache_scales, self.options.raw

    # -- QuantizationConfig API -------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LearnerGridConfig":
        config = dict(config or {})
        packed = config.get("packed_modules_mapping")
        opts = GridOptions.from_dict(config, ignore=INJECTED_KEYS)
        if opts.emulate is not None:
            raise ValueError(f"{QUANT_METHOD}: 'emulate' (the consistency study's other grids) is vLLM-only")
        if opts.router_dtype is not None:
            # SGLang's Qwen3-MoE builds its router with quant_config=None: the plugin never sees it,
            # so the option would silently do nothing
            raise ValueError(f"{QUANT_METHOD}: 'router_dtype' is vLLM-only (SGLang builds MoE routers without the "
                             "quantization config, so the plugin cannot compute them in FP32)")
        if opts.raw.get("producer_qdq", False):
            # the producers are swapped by a vLLM loader patch (patches/vllm_producer_qdq.py); nothing does it here
            raise ValueError(f"{QUANT_METHOD}: 'producer_qdq' is vLLM-only for now (no SGLang hook swaps the norms "
                             "and SiLU*up of its models; each grid Linear quantizes its own input)")
        out = cls(opts.selection, opts.kv_cache_scales, raw=opts.raw)
        if packed:
            out.packed_modules_mapping = dict(packed)
        return out

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from .linear_method import LearnerGridLinearMethod
        from .moe_method import LearnerGridMoEMethod
        if isinstance(layer, compat.LinearBase):
            return LearnerGridLinearMethod(self, prefix) if self.on_grid(prefix) else compat.UnquantizedLinearMethod()
        if isinstance(layer, compat.FusedMoE):
            # off the grid: None lets FusedMoE build its own unquantized method
            return LearnerGridMoEMethod(self, prefix) if self.on_grid(prefix) else None
        if isinstance(layer, compat.RadixAttention):
            return self.kv_cache_method(prefix)
        return None

    def kv_cache_method(self, prefix: str):
        """The KV-cache method of an attention layer, or None when the server's KV cache is not
        FP8: a BF16 cache reads no scales, and SGLang 0.5.17's fused K/V-cache write asserts that
        the layer has none (seen on the H200: Qwen3-MoE, head_dim 32).  Outside a server (layer
        tests) the method is attached."""
        from .kv_cache import LearnerGridKVCacheMethod
        if not compat.kv_cache_reads_scales():
            return None
        return LearnerGridKVCacheMethod(self, prefix)

    # -- module selection -------------------------------------------------------------
    def checkpoint_shards(self, prefix: str) -> list[str] | None:
        """Checkpoint module names fused into the SGLang module ``prefix`` (e.g. q/k/v_proj), or None."""
        last = prefix.rpartition(".")[2]
        return (self.packed_modules_mapping or {}).get(last) or DEFAULT_PACKED.get(last)

    def on_grid(self, prefix: str) -> bool:
        return self.options.on_grid(prefix, self.checkpoint_shards(prefix))
