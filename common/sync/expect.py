"""What an engine's loader must have done with each learner tensor: the shared part of the
adapters' completeness and layout checks.

Both plugins mark their on-grid layers the same way -- dense layers carry
``grid_expected_shards``, MoE layers ``grid_num_local_experts`` -- and both engines' MoE
layers map global to local expert ids with ``_map_global_expert_id_to_local_expert_id``.
So the accounting, the dispatch of a write to its layer and the expert arithmetic are the
same; an adapter supplies ``_dense_boxes`` (its engine's fused-layer classes and TP facts)
and ``_moe_tp_rank``.
"""

from __future__ import annotations

import re
from typing import Optional

from .. import format as F
from ..loading import accounting_problems

EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")


class GridLayoutMixin:
    partial: bool = False          # the update's manifest is partial: unsent shards are not missing

    def grid_accounting(self) -> list[str]:
        return accounting_problems(self.grid_layers(), self.partial)

    def expected_boxes(self, w):
        """(box in the learner tensor, box in the engine parameter) the write ``w`` should have had."""
        if w.role not in ("data", "scale") or w.dest_box is None:
            return None
        mod_name = w.param.rpartition(".")[0]
        try:
            layer = self.model().get_submodule(mod_name)
        except AttributeError:
            return None
        div = F.BLOCK_SIZE if w.role == "scale" else 1
        m = EXPERT.search("." + w.source)
        if m is not None and hasattr(layer, "grid_num_local_experts"):
            return self._expert_boxes(layer, int(m.group(1)), m.group(2), div)
        if not hasattr(layer, "grid_expected_shards"):
            return None
        return self._dense_boxes(layer, w.source, div)

    def _expert_boxes(self, layer, expert: int, proj: str, div: int) -> Optional[tuple]:
        local = layer._map_global_expert_id_to_local_expert_id(expert)
        if local < 0:
            return None
        tp_rank = self._moe_tp_rank(layer)
        if proj == "down_proj":                                   # w2 [E, H, I]: K (= I) split by TP
            _, h, i = layer.w2_weight.shape
            ik = i // div
            return ((0, h), (tp_rank * ik, ik)), ((local, 1), (0, h), (0, ik))
        _, two_i, h = layer.w13_weight.shape                      # w13 [E, 2I, H] = [gate; up]
        i, hk = two_i // 2, h // div
        off = 0 if proj == "gate_proj" else i
        return ((tp_rank * i, i), (0, hk)), ((local, 1), (off, i), (0, hk))

    def _dense_boxes(self, layer, source: str, div: int) -> Optional[tuple]:
        raise NotImplementedError

    def _moe_tp_rank(self, layer) -> int:
        raise NotImplementedError
