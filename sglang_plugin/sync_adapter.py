"""SGLang side of an in-place weight update: the EngineAdapter over one TP rank's model.

The mirror of ``vllm_plugin/sync_adapter.py``.  SGLang's own loader (the model's
``load_weights``: q/k/v and gate/up fusing, TP narrowing, expert ids) writes; this adapter
tells the session what SGLang's layout *should* have done with each tensor -- computed from
the layer's own metadata (head counts, output sizes, TP rank, expert map), independently of
the loader -- and which shards each on-grid layer must have received exactly once.

Derived state: whatever each layer's kernel keeps (``common.grid_kernels``: the CPU fp32
weight copy, Marlin's packed weights on a GPU), registered for the derived_state check on
first use, rewritten in place by the loaders after every write and again by
:meth:`after_load` (so a rollback, whose bytes return without the loaders, is covered too).
``restore_weights_before_loading`` has nothing to undo: the parameters keep their wire layout.
The other copies besides the parameters are the KV-cache method's host floats ``k_scale_float`` /
``v_scale_float``: :meth:`set_kv_scales` writes them with the tensors, and
:meth:`kv_scale_values` reports the floats (what attention backends read), so a stale copy
fails cache_coherence.

SGLang versions: 0.5.17's linear layers keep ``tp_rank`` / ``tp_size``; 0.5.23's keep
``tp_group`` / ``kv_tp_group`` (``_tp`` reads either).
"""

from __future__ import annotations

from collections import Counter

import torch

from mxfp8_learner_grid.common.loading import writes
from mxfp8_learner_grid.common.selection import ModuleSelection
from mxfp8_learner_grid.common.grid_kernels.layers import register_kernel_derived
from mxfp8_learner_grid.common.sync.derived import DerivedRegistry
from mxfp8_learner_grid.common.sync.expect import GridLayoutMixin, LinearFacts
from mxfp8_learner_grid.common.sync.manifest import checkpoint_signature
from mxfp8_learner_grid.common.sync.adapter import EngineAdapter
from mxfp8_learner_grid.common.sync.plan import WritePlan
from . import compat

_KV_PARAMS = ("k_scale", "v_scale")


def _tp(layer, kv: bool = False) -> tuple[int, int]:
    """(rank, size) of a linear layer's TP (or KV-head) group, in 0.5.17 and 0.5.23."""
    if hasattr(layer, "tp_rank"):                                  # 0.5.17
        return int(layer.tp_rank), int(layer.tp_size)
    from sglang.srt.distributed.utils import get_group_rank_size   # 0.5.23
    group = getattr(layer, "kv_tp_group", None) if kv else None
    return get_group_rank_size(group if group is not None else getattr(layer, "tp_group", None))


class SGLangAdapter(GridLayoutMixin, EngineAdapter):

    def __init__(self, model: torch.nn.Module, rank: int = 0, hf_config=None, quant_config=None):
        self._model = model
        self.rank = rank
        self.version = 0
        self.hf_config = hf_config if hf_config is not None else model.config
        self.quant_config = quant_config if quant_config is not None else getattr(model, "quant_config", None)
        self.registry = DerivedRegistry()          # the kernels' derived tensors, registered on first use
        self.plan = WritePlan()
        self._registered = False
        self.partial = False
        self._sig = None

    # -- basics -------------------------------------------------------------------------
    def model(self):
        return self._model

    def load(self, named):
        # the class's loader: an open grid update shadows the instance's (sglang_plugin/updater.py)
        self.load_planned(named, lambda rest: type(self._model).load_weights(self._model, rest))

    def grid_layers(self):
        from .linear_method import LearnerGridLinearMethod
        from .moe_method import LearnerGridMoEMethod
        for name, m in self._model.named_modules():
            if isinstance(getattr(m, "quant_method", None), (LearnerGridLinearMethod, LearnerGridMoEMethod)):
                yield name, m

    def signature(self):
        if self._sig is None:
            from .config import LearnerGridConfig
            qc = self.quant_config
            # a model without the grid (a BF16 control sampler) takes plain tensors only
            selection = qc.selection if isinstance(qc, LearnerGridConfig) else ModuleSelection(include=[])
            sig = checkpoint_signature(self.hf_config, selection)
            dtype = self._plain_dtype()
            self._sig = (sig, {n: dtype for n, (_, g) in sig.items() if not g}, set())
        return self._sig

    def _plain_dtype(self) -> torch.dtype:
        """The dtype SGLang holds the high-precision tensors in (embeddings, norms, lm_head, router)."""
        counts = Counter(p.dtype for n, p in self._model.named_parameters()
                         if p.dtype in (torch.bfloat16, torch.float16, torch.float32) and not n.endswith(_KV_PARAMS))
        return counts.most_common(1)[0][0] if counts else torch.get_default_dtype()

    def begin(self):
        for _, layer in self.grid_layers():
            writes(layer).clear()

    def after_load(self):
        """Re-run the plugin's own post-processing (checks only: no scale may hold E8M0 255; the KV
        method refreshes its floats).  SGLang's other modules are left to SGLang: 0.5.23's
        ``end_weight_update`` post-processes every module, 0.5.17 runs nothing after an update."""
        from .kv_cache import LearnerGridKVCacheMethod
        from .linear_method import LearnerGridLinearMethod
        from .moe_method import LearnerGridMoEMethod
        ours = (LearnerGridLinearMethod, LearnerGridMoEMethod, LearnerGridKVCacheMethod)
        for _, m in self._model.named_modules():
            qm = getattr(m, "quant_method", None)
            if isinstance(qm, ours):
                qm.process_weights_after_loading(m)

    def derived(self):
        if not self._registered:
            register_kernel_derived(self._model, self.registry)
            self._registered = True
        return self.registry

    # -- completeness -----------------------------------------------------------------------
    def scope(self, touched):
        params = dict(self._model.named_parameters())
        if self.partial:
            return {n: params[n] for n in touched if n in params}
        return {n: p for n, p in params.items() if not n.endswith(_KV_PARAMS)}

    # -- layout: what SGLang's loader must have done -----------------------------------------
    def _linear_facts(self, layer) -> LinearFacts:
        from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        if isinstance(layer, QKVParallelLinear):
            rank, size = _tp(layer)
            return LinearFacts("qkv", rank, size, layer.num_heads, layer.num_kv_heads, layer.head_size,
                               getattr(layer, "v_head_size", layer.head_size), _tp(layer, kv=True)[0],
                               layer.num_kv_head_replicas)
        if isinstance(layer, MergedColumnParallelLinear):
            rank, size = _tp(layer)
            return LinearFacts("merged", rank, size, output_sizes=tuple(layer.output_sizes))
        if isinstance(layer, RowParallelLinear):
            return LinearFacts("row", *_tp(layer))
        return LinearFacts("plain")

    def _moe_tp_rank(self, layer) -> int:
        return int(getattr(layer, "moe_tp_rank", 0))

    # -- KV scales -------------------------------------------------------------------------
    def _attn_layers(self) -> dict:
        from .kv_cache import LearnerGridKVCacheMethod
        return {int(m.layer_id): m for _, m in self._model.named_modules()
                if isinstance(getattr(m, "quant_method", None), LearnerGridKVCacheMethod)
                and isinstance(getattr(m, "k_scale", None), torch.Tensor)}

    def set_kv_scales(self, scales):
        problems = []
        layers = self._attn_layers()
        if not layers and not compat.kv_cache_reads_scales():
            return []                            # a BF16 KV cache: no layer reads scales (config.get_quant_method)
        for key, (k, v) in scales.items():
            m = layers.get(int(key))
            if m is None:
                problems.append(f"layer {key}: no attention layer with KV-cache scales")
                continue
            self._write_kv(m, float(k), float(v))
        return problems

    @staticmethod
    def _write_kv(m, k: float, v: float) -> None:
        with torch.no_grad():                    # in place: captured graphs keep reading the same tensors
            m.k_scale.fill_(k)
            m.v_scale.fill_(v)
        m.k_scale_float, m.v_scale_float = k, v  # what the attention backends read (SGLang's KV method sets them)

    def kv_scales_used(self) -> bool:
        return compat.kv_cache_reads_scales() or bool(self._attn_layers())

    def kv_scale_values(self):
        return {i: (float(getattr(m, "k_scale_float", m.k_scale)), float(getattr(m, "v_scale_float", m.v_scale)))
                for i, m in self._attn_layers().items()}
