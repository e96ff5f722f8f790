"""vLLM side of an in-place weight update: the EngineAdapter over one worker's model.

The engine's own loader (``model.load_weights``: q/k/v and gate/up fusing, TP narrowing,
expert ids) writes; this adapter tells the session what vLLM's layout *should* have done
with each tensor -- computed from the layer's own metadata (head counts, output sizes,
TP rank, expert map), independently of the loader -- and which shards each on-grid layer
must have received exactly once.
"""

from __future__ import annotations

import re

import torch

from mxfp8_learner_grid.common.loading import writes
from mxfp8_learner_grid.common.selection import ModuleSelection
from mxfp8_learner_grid.common.sync.derived import DerivedRegistry
from mxfp8_learner_grid.common.sync.expect import GridLayoutMixin, LinearFacts
from mxfp8_learner_grid.common.sync.manifest import checkpoint_signature
from mxfp8_learner_grid.common.sync.adapter import EngineAdapter
from mxfp8_learner_grid.common.sync.plan import WritePlan




class VLLMAdapter(GridLayoutMixin, EngineAdapter):

    def __init__(self, model: torch.nn.Module, vllm_config, rank: int = 0):
        self._model = model
        self.vllm_config = vllm_config
        self.rank = rank
        self.version = 0
        self.registry = DerivedRegistry()
        self.plan = WritePlan()
        self._sig = None

    # -- basics -------------------------------------------------------------------------
    def model(self):
        return self._model

    def load(self, named):
        self.load_planned(named, lambda rest: self._model.load_weights(iter(rest)))

    def quant_config(self):
        return self.vllm_config.quant_config

    def grid_layers(self):
        from .linear_method import GridLinearMethod
        from .moe_method import GridMoEMethod
        for name, m in self._model.named_modules():
            if isinstance(getattr(m, "quant_method", None), (GridLinearMethod, GridMoEMethod)):
                yield name, m

    def signature(self):
        if self._sig is None:
            qc = self.quant_config()
            # an engine without the grid (a BF16 control sampler) takes plain tensors only
            selection = getattr(qc, "selection", None) or ModuleSelection(include=[])
            sig = checkpoint_signature(self.vllm_config.model_config.hf_config, selection)
            dtype = self.vllm_config.model_config.dtype
            self._sig = (sig, {n: dtype for n, (_, g) in sig.items() if not g}, set())
        return self._sig

    def begin(self):
        for _, layer in self.grid_layers():
            writes(layer).clear()

    def after_load(self):
        """After new bytes: the loaders already rebuilt each written on-grid layer's derived
        tensors in place (common.refresh), once per bucket -- rebuilding them all again here
        would repack every Marlin weight twice per update.  On CPU vLLM's own unquantized
        embedding / lm_head keep a packed GEMM copy, rebuilt here."""
        self._post_process(refresh_grid=False)

    def after_restore(self, names):
        """After a rollback (old bytes back without the loaders): every derived tensor rebuilt."""
        self._post_process(refresh_grid=True)

    def _post_process(self, refresh_grid: bool):
        from vllm.platforms import current_platform
        for _, m in self._model.named_modules():
            qm = getattr(m, "quant_method", None)
            if qm is None:
                continue
            if hasattr(m, "grid_processed"):
                if hasattr(qm, "update_refresh"):
                    if refresh_grid:
                        qm.update_refresh(m)      # derived copies, rebuilt in place
                else:
                    qm.process_weights_after_loading(m)
            elif current_platform.is_cpu() and type(qm).__name__ == "UnquantizedEmbeddingMethod":
                qm.process_weights_after_loading(m)

    def derived(self):
        return self.registry

    # -- completeness -----------------------------------------------------------------------
    def scope(self, touched):
        params = dict(self._model.named_parameters())
        manifest_partial = self.partial
        skip = ("k_scale", "v_scale", "q_scale", "prob_scale")
        if manifest_partial:
            return {n: params[n] for n in touched if n in params}
        return {n: p for n, p in params.items() if not n.endswith(skip)}

    # -- layout: what vLLM's loader must have done ------------------------------------------
    def _linear_facts(self, layer) -> LinearFacts:
        from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                       RowParallelLinear)
        if isinstance(layer, QKVParallelLinear):
            return LinearFacts("qkv", layer.tp_rank, layer.tp_size, layer.num_heads, layer.num_kv_heads,
                               layer.head_size, getattr(layer, "v_head_size", layer.head_size), layer.tp_rank,
                               layer.num_kv_head_replicas)
        if isinstance(layer, MergedColumnParallelLinear):
            return LinearFacts("merged", layer.tp_rank, layer.tp_size, output_sizes=tuple(layer.output_sizes))
        if isinstance(layer, RowParallelLinear):
            return LinearFacts("row", layer.tp_rank, layer.tp_size)
        return LinearFacts("plain")

    def _moe_tp_rank(self, layer) -> int:
        return int(getattr(layer.moe_config, "tp_rank", 0))

    # -- KV scales -------------------------------------------------------------------------
    def _attn_layers(self):
        out = {}
        for name, m in self._model.named_modules():
            if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype"):
                mt = re.search(r"layers\.(\d+)\.", name + ".")
                if mt:
                    out[int(mt.group(1))] = m
        return out

    def set_kv_scales(self, scales):
        problems = []
        layers = self._attn_layers()
        for key, (k, v) in scales.items():
            m = layers.get(int(key))
            if m is None:
                problems.append(f"layer {key}: no attention layer")
                continue
            with torch.no_grad():
                m._k_scale.fill_(float(k))
                m._v_scale.fill_(float(v))
            # host-side copies some backends read (written in place, never rebound)
            for attr, val in (("_k_scale_float", float(k)), ("_v_scale_float", float(v))):
                if hasattr(m, attr):
                    setattr(m, attr, val)
            for attr, val in (("_k_scale_cpu", float(k)), ("_v_scale_cpu", float(v))):
                t = getattr(m, attr, None)
                if isinstance(t, torch.Tensor):
                    t.fill_(val)
        return problems

    def kv_scale_values(self):
        return {i: (float(m._k_scale), float(m._v_scale)) for i, m in self._attn_layers().items()}
