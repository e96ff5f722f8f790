"""Trainer tensors -> HF checkpoint names, without copies (common/sync/inputs.py)."""

import pytest
import torch

from mxfp8_learner_grid.common.sync.inputs import trainer_tensors
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected


def test_fused_experts_become_per_expert_views():
    gu, down = torch.randn(4, 2 * 64, 32), torch.randn(4, 32, 64)
    out = trainer_tensors({"model.layers.3.mlp.experts.gate_up_proj": gu, "model.layers.3.mlp.experts.down_proj": down,
                           "model.norm.weight": torch.ones(32)})
    assert len(out) == 4 * 3 + 1
    g, u, d = (out[f"model.layers.3.mlp.experts.2.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(g, gu[2, :64]) and torch.equal(u, gu[2, 64:]) and torch.equal(d, down[2])
    for v in (g, u, d):                              # views into the trainer's own storage, not copies
        assert v.untyped_storage().data_ptr() in (gu.untyped_storage().data_ptr(), down.untyped_storage().data_ptr())
    assert list(trainer_tensors([("a.weight", torch.ones(2))])) == ["a.weight"]     # iterables of pairs too


def test_wrong_layouts_are_named():
    with pytest.raises(UpdateRejected, match=r"experts\.down_proj: fused experts with 3-D shape \[E, H, I\]"):
        trainer_tensors({"model.layers.0.mlp.experts.down_proj": torch.randn(32, 64)})
    with pytest.raises(UpdateRejected, match="even dim 1"):
        trainer_tensors({"m.experts.gate_up_proj": torch.randn(2, 63, 32)})
    with pytest.raises(UpdateRejected, match="given twice"):
        trainer_tensors({"m.experts.down_proj": torch.randn(1, 4, 4), "m.experts.0.down_proj.weight": torch.randn(4, 4)})
