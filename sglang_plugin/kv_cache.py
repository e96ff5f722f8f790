"""Optional FP8 (E4M3) KV cache with trainer-owned scales (``--kv-cache-dtype fp8_e4m3``).

Scale rule (SGLang's, per layer and per tensor, as vLLM's): the cache stores
``e4m3(k / k_scale)`` and reads ``e4m3 * k_scale``; a trainer computes
``k_scale = amax(|K|) / 448`` (likewise V) on a calibration batch --
``common.kv_scales`` does this -- and ships ``model.layers.<i>.self_attn.k_scale`` /
``v_scale`` (fp32 scalars) in the checkpoint or with a weight update.  SGLang's model
loaders remap those names to the ``RadixAttention`` parameters (``...self_attn.attn.k_scale``).

Without scales SGLang uses 1.0, so |K| or |V| beyond 448 saturates silently.  The plugin
logs which layers run without scales; ``kv_cache_scales: required`` in the quantization
config turns that into a load error.  ``process_weights_after_loading`` (SGLang's) also
refreshes the ``k_scale_float`` copies that some attention backends read: it runs again
at ``end_weight_update`` in 0.5.23; in 0.5.17 a scale update needs a reload to reach them.
"""

from __future__ import annotations

import logging

from mxfp8_learner_grid.common.kv_scales import check_kv_scales_at_load

from . import compat

logger = logging.getLogger("mxfp8_learner_grid.sglang")


class LearnerGridKVCacheMethod(compat.BaseKVCacheMethod):

    def __init__(self, quant_config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix

    def process_weights_after_loading(self, layer) -> None:
        if not getattr(layer, "grid_kv_processed", False):       # at load, not again after updates
            check_kv_scales_at_load(layer, self.prefix, compat.kv_cache_dtype(), self.quant_config.kv_cache_scales,
                                    logger)
        super().process_weights_after_loading(layer)
        layer.grid_kv_processed = True
