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

from mxfp8_learner_grid.common.kv_scales import check_kv_scales_at_load

from . import compat

logger = logging.getLogger("mxfp8_learner_grid.vllm")


class GridKVCacheMethod(compat.BaseKVCacheMethod):

    def __init__(self, quant_config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix

    def process_weights_after_loading(self, layer) -> None:
        check_kv_scales_at_load(layer, self.prefix, str(getattr(layer, "kv_cache_dtype", "auto")),
                                self.quant_config.kv_cache_scales, logger)
        super().process_weights_after_loading(layer)
