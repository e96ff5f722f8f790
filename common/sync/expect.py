"""What an engine's loader must have done with each learner tensor: the shared part of the
adapters' completeness and layout checks.

Both plugins mark their on-grid layers the same way -- dense layers carry
``grid_expected_shards``, MoE layers ``grid_num_local_experts`` -- and both engines' MoE
layers map global to local expert ids with ``_map_global_expert_id_to_local_expert_id``.
So the accounting, the dispatch of a write to its layer and the expert arithmetic are the
same, and so is the dense layout arithmetic (:func:`dense_boxes`): an adapter supplies only
*facts* -- ``_linear_facts(layer)``, a :class:`LinearFacts` read off its engine's fused-layer
classes (kind, TP rank and size, head counts and sizes, merged output sizes) -- and
``_moe_tp_rank``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .. import format as F
from ..loading import accounting_problems

EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
#: the Hugging Face shards of a fused q/k/v layer and of a merged gate/up layer
QKV_SHARDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
MERGED_SHARDS = ("gate_proj", "up_proj")
LINEAR_KINDS = ("qkv", "merged", "row", "plain")


@dataclass(frozen=True)
class LinearFacts:
    """What an engine's parallel Linear says about its layout -- all the engine knowledge the dense
    layout check needs.  ``kind``: ``qkv`` (fused q/k/v, column-parallel), ``merged`` (fused gate/up,
    column-parallel), ``row`` (K split by TP) or ``plain`` (not split)."""
    kind: str
    tp_rank: int = 0
    tp_size: int = 1
    num_heads: int = 0          # qkv: this rank's query heads
    num_kv_heads: int = 0       # qkv: this rank's key/value heads
    head_size: int = 0          # qkv: q and k head size
    v_head_size: int = 0        # qkv: v head size (0: head_size)
    kv_rank: int = 0            # qkv: rank in the group that splits the KV heads
    kv_head_replicas: int = 1   # qkv: ranks holding each KV head (TP > KV heads)
    output_sizes: tuple = ()    # merged: the global rows of each merged output

    def __post_init__(self):
        if self.kind not in LINEAR_KINDS:
            raise ValueError(f"LinearFacts.kind must be one of {LINEAR_KINDS}; got {self.kind!r}")


def dense_boxes(facts: LinearFacts, source: str, n: int, k: int) -> Optional[tuple]:
    """(box in the learner tensor ``source``, box in the engine parameter [n, k]) of one dense write;
    None where ``source`` is not a shard of this fused layer.  Boxes are ((row0, rows), (col0, cols))."""
    short = source.rsplit(".", 2)[-2]
    if facts.kind == "qkv":
        shard = QKV_SHARDS.get(short)
        if shard is None:
            return None
        q = facts.num_heads * facts.head_size
        kv = facts.num_kv_heads * facts.head_size
        v = facts.num_kv_heads * (facts.v_head_size or facts.head_size)
        off, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, v)}[shard]
        r = facts.tp_rank if shard == "q" else facts.kv_rank // facts.kv_head_replicas
        return ((r * size, size), (0, k)), ((off, size), (0, k))
    if facts.kind == "merged":
        if short not in MERGED_SHARDS:
            return None
        i = MERGED_SHARDS.index(short)
        local = [s // facts.tp_size for s in facts.output_sizes]
        return ((facts.tp_rank * local[i], local[i]), (0, k)), ((sum(local[:i]), local[i]), (0, k))
    if facts.kind == "row":
        return ((0, n), (facts.tp_rank * k, k)), ((0, n), (0, k))
    return ((0, n), (0, k)), ((0, n), (0, k))


class GridLayoutMixin:
    partial: bool = False          # the update's manifest is partial: unsent shards are not missing

    def grid_accounting(self) -> list[str]:
        return accounting_problems(self.grid_layers(), self.partial)

    def expected_boxes(self, w, modules: dict):
        """(box in the learner tensor, box in the engine parameter) the write ``w`` should have had.
        ``modules``: the model's modules by name, looked up once by the ``layout`` check for all its writes
        (a 24-layer Qwen3-30B-A3B update makes ~18,700)."""
        if w.role not in ("data", "scale") or w.dest_box is None:
            return None
        layer = modules.get(w.param.rpartition(".")[0])
        if layer is None:
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
        n, kk = layer.weight.shape
        return dense_boxes(self._linear_facts(layer), source, n, kk // div)

    def _linear_facts(self, layer) -> LinearFacts:
        raise NotImplementedError

    def _moe_tp_rank(self, layer) -> int:
        raise NotImplementedError
