"""Optional FP8 (E4M3) KV cache with trainer-owned scales (``--kv-cache-dtype fp8``).

Scale rule (vLLM's, per layer and per tensor): the cache stores ``e4m3(k / k_scale)`` and
reads ``e4m3 * k_scale``; a trainer computes ``k_scale = amax(|K|) / 448`` (and likewise
for V) over the layer's keys on a calibration batch -- ``common.kv_scales`` does this --
and ships them as ``model.layers.<i>.self_attn.k_scale`` / ``v_scale`` (fp32 scalars) in
the checkpoint or with every weight update.

Without scales vLLM uses 1.0, so |K| or |V| beyond 448 saturates silently.  The plugin
logs which layers run without scales; ``kv_cache_scales: required`` in the quantization
config turns that into a load error.
"""

from __future__ import annotations

import logging

from . import compat

logger = logging.getLogger("mxfp8_learner_grid.vllm")


class GridKVCacheMethod(compat.BaseKVCacheMethod):

    def __init__(self, quant_config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix

    def process_weights_after_loading(self, layer) -> None:
        dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
        provided = all(float(getattr(layer, n, -1.0)) > 0 for n in ("k_scale", "v_scale")) \
            if hasattr(layer, "k_scale") else True
        layer.grid_kv_scales_from_checkpoint = provided
        if dtype.startswith("fp8") and not provided:
            if self.quant_config.kv_cache_scales == "required":
                raise ValueError(f"{self.prefix}: --kv-cache-dtype {dtype} needs k_scale and v_scale for this "
                                 "layer (quantization config says kv_cache_scales: required)")
            logger.warning("mxfp8-learner-grid: %s runs an FP8 KV cache without k/v scales (1.0 is used; "
                           "values beyond 448 saturate) until the trainer sets them", self.prefix)
        super().process_weights_after_loading(layer)
