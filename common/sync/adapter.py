"""What an in-place weight update needs from one engine rank: :class:`EngineAdapter`.

Each plugin subclasses it (``vllm_plugin/sync_adapter.py``, ``sglang_plugin/sync_adapter.py``):
its own loader, its on-grid layers, the layout it expects, its KV-scale and derived state.
:class:`~.session.UpdateSession` drives it; the checks (``checks.py``) read it.
"""

from __future__ import annotations

import torch

from .derived import DerivedRegistry
from .recorder import Write


class EngineAdapter:
    """What a session needs from an engine rank.  Subclassed in each plugin."""

    rank: int = 0
    version: int = 0
    #: the rank's write plan (``plan.WritePlan``; None: every tensor through the engine's loader), and whether
    #: the open update may replay it (set by the session)
    plan = None
    plan_active: bool = False

    def load_planned(self, named, engine_load) -> None:
        """``named`` through the write plan where the open update may use it, else through ``engine_load``."""
        if self.plan is not None and self.plan_active:
            self.plan.load(named, engine_load)
        else:
            engine_load(list(named))

    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Feed HF-named tensors to the engine's own loader."""
        raise NotImplementedError

    def signature(self) -> tuple[dict, dict, set]:
        """(checkpoint signature, plain dtypes, extra accepted names) -- see manifest.validate."""
        raise NotImplementedError

    def begin(self) -> None:
        """Reset write accounting etc. before the first write."""

    def after_load(self) -> None:
        """Post-process after the new bytes landed through the engine's loaders (which already
        rebuilt the on-grid layers' derived tensors, ``common.refresh``)."""

    def after_restore(self, names: list[str]) -> None:
        """Derived state after a rollback put the previous bytes of ``names`` back -- without the
        loaders, so every derived tensor must be rebuilt.  Default: :meth:`after_load`."""
        self.after_load()

    def grid_accounting(self) -> list[str]:
        """Problems of the per-shard write accounting (each shard written exactly once)."""
        return []

    def expected_boxes(self, w: Write, modules: dict):
        """(src_box, dest_box) the engine's layout implies for this write, or None if it has no opinion.
        ``modules``: the model's modules by name, looked up once by the caller for all its writes."""
        return None

    def scope(self, touched: set[str]) -> dict[str, torch.Tensor]:
        """Parameters an update must cover exactly once."""
        return {}

    def derived(self) -> DerivedRegistry:
        return DerivedRegistry()

    def set_kv_scales(self, scales: dict) -> list[str]:
        """Apply {layer index: (k_scale, v_scale)}; return problems."""
        return [] if not scales else ["this engine has no KV-scale support"]

    def kv_scale_values(self) -> dict:
        return {}

    def kv_scales_used(self) -> bool:
        """Whether the engine's KV cache reads scales (False: a BF16 cache, the trainer's scales are moot)."""
        return True
