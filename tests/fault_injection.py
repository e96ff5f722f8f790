"""Fault injection for the sync suites: test machinery, never shipped.

One mixin for both engines' adapters (``vllm_plugin.sync_adapter.VLLMAdapter``,
``sglang_plugin.sync_adapter.SGLangAdapter``): each fault imitates a real bug of a loader, a
post-processing step or a transport, and :data:`FAULTS` names the check that must catch it.
The engines get the faulty adapter only through test classes (``tests/engine/fault_worker.py``
for vLLM's worker extension, ``tests/sglang_engine/test_sglang_sync.py`` for SGLang's grid
worker); the production adapters and workers carry no fault branch.
"""

from __future__ import annotations

import torch

# fault -> the check that must catch it (the README counts these)
FAULTS = {
    "skip_rebuild": "derived_state",           # stale derived copy (a kernel's packed / decoded weight not rebuilt)
    "swap_kv": "layout",                       # wrong fused-shard offset (k written where v goes)
    "padding_not_stripped": "layout",          # TE's padded scale buffer sent as is (client side: no adapter fault)
    "duplicate_shard": "completeness",         # v written into the k shard: element counts look complete
    "skip_expert": "completeness",             # a missed expert
    "swizzled_as_compact": "byte_identity",    # GEMM-swizzled scales labelled compact (client side)
    "realloc": "storage_stability",            # a parameter rebound to new storage after loading
    "crash_midway": "atomic_versioning",       # the transport dies halfway through the update
    "skip_version": "atomic_versioning",       # version mix: one TP rank serves another version
    "skipped_cache_flush": "cache_coherence",  # prefix cache kept across the update (client side)
    "skip_kv": "cache_coherence",              # stale FP8 KV-cache scales
}
#: faults the adapter mixin injects (the rest are made by the test on the client side)
ADAPTER_FAULTS = {"skip_rebuild", "swap_kv", "duplicate_shard", "skip_expert", "realloc", "crash_midway",
                  "skip_version", "skip_kv"}
SKIP_VERSION_RANK = 1


def _swap_kv(n: str) -> str:
    return n.replace("layers.0.self_attn.k_proj", "@").replace("layers.0.self_attn.v_proj",
                                                               "layers.0.self_attn.k_proj").replace("@", "layers.0.self_attn.v_proj")


class FaultyAdapterMixin:
    """Put before an engine adapter class: ``class X(FaultyAdapterMixin, VLLMAdapter)``."""

    faults: frozenset = frozenset()
    skip_version_rank: int = SKIP_VERSION_RANK     # the rank that lies about its version (an engine's last)

    def set_faults(self, faults) -> list:
        unknown = set(faults) - ADAPTER_FAULTS
        if unknown:
            raise ValueError(f"not adapter faults: {sorted(unknown)}")
        self.faults = frozenset(faults)
        return sorted(self.faults)

    # a loader bug / a dying transport
    def load(self, named):
        named = list(named)
        if "crash_midway" in self.faults and getattr(self, "_fault_loads", 0) >= 1:
            raise RuntimeError("injected fault: the transport died halfway through the update")
        self._fault_loads = getattr(self, "_fault_loads", 0) + 1
        if "swap_kv" in self.faults:
            named = [(_swap_kv(n), t) for n, t in named]
        if "duplicate_shard" in self.faults:
            named = [(n.replace("layers.0.self_attn.v_proj", "layers.0.self_attn.k_proj"), t) for n, t in named]
        if "skip_expert" in self.faults:
            named = [(n, t) for n, t in named if ".experts.1." not in n]
        return super().load(named)

    def begin(self):
        self._fault_loads = 0
        super().begin()
        if "skip_rebuild" in self.faults:    # the derived tensors' old bytes, put back after the update
            self._stale_derived = [(d.tensor, d.tensor.clone()) for d in self.derived()]

    def _realloc(self):
        if "realloc" in self.faults:         # a post-processing step that rebinds a parameter
            layer = next(iter(self.grid_layers()))[1]
            name = "weight" if hasattr(layer, "weight") else "w13_weight"
            setattr(layer, name, torch.nn.Parameter(getattr(layer, name).data.clone(), requires_grad=False))

    def after_load(self):
        self._realloc()
        if "skip_rebuild" in self.faults:    # a derived copy left stale
            for live, old in getattr(self, "_stale_derived", []):
                live.copy_(old)
            return
        return super().after_load()

    def after_restore(self, names):
        self._realloc()
        return super().after_restore(names)

    def set_kv_scales(self, scales):
        if "skip_kv" in self.faults:          # KV-cache scales never reach the attention layers
            return []
        return super().set_kv_scales(scales)

    # one TP rank keeps serving the old version number after a commit
    @property
    def version(self):
        return self.__dict__.get("_fault_version", 0)

    @version.setter
    def version(self, v):
        old = self.__dict__.get("_fault_version", 0)
        if "skip_version" in self.faults and self.rank == self.skip_version_rank and v > old:
            v = v - 1
        self.__dict__["_fault_version"] = v
