"""The kernels' guard on bytes written into a processed layer (``refresh.guard``): the bf16 fast paths
(Marlin, W8A16, humming, Marlin MoE) are exact only for scale bytes >= 3 where a block holds a non-zero
code, which the first load checks; an update or a trainer's own ``load_weights`` must be held to the same
rule.  Inside an update's bucket (``deferred_refresh``) the flags are read once, at the scope's exit."""

import pytest
import torch

from mxfp8_learner_grid.common import quantize_rows, refresh
from mxfp8_learner_grid.common.grid_kernels.marlin import guard_bf16_exact_weights
from mxfp8_learner_grid.common.sync import digest


def _weights(tiny_block: bool, zero_block: bool):
    q, s = quantize_rows(torch.randn(4, 64))
    q, s = q.clone(), s.clone()
    if tiny_block:                     # a block of amax ~1e-38 (scale byte 0): not exact in bf16
        q.view(torch.uint8)[1, :32] = 0x08
        s[1, 0] = 0
    if zero_block:                     # an all-zero block has scale byte 0 too: exact (0 * anything)
        q.view(torch.uint8)[2, 32:] = 0
        s[2, 1] = 0
    return q, s


def test_guard_outside_an_update_checks_at_once():
    q, s = _weights(False, True)
    guard_bf16_exact_weights(s, q, "layers.0.o_proj")                  # zero block: fine
    q, s = _weights(True, False)
    with pytest.raises(ValueError, match="layers.0.o_proj: 1 weight blocks have E8M0 scale byte < 3"):
        guard_bf16_exact_weights(s, q, "layers.0.o_proj")


def test_guard_inside_a_bucket_reads_once_at_exit_and_names_the_layer(monkeypatch):
    reads = []
    real = digest.read_flags
    monkeypatch.setattr(digest, "read_flags", lambda flags: reads.append(len(flags)) or real(flags))
    good, bad = _weights(False, True), _weights(True, False)
    with refresh.deferred_refresh():
        for i in range(5):
            guard_bf16_exact_weights(good[1], good[0], f"layers.{i}.qkv_proj")
    assert reads == [5]
    with pytest.raises(ValueError, match="layers.3.qkv_proj"):
        with refresh.deferred_refresh():
            with refresh.deferred_refresh():                       # nested: the outermost scope reads
                for i in range(5):
                    w = bad if i == 3 else good
                    guard_bf16_exact_weights(w[1], w[0], f"layers.{i}.qkv_proj")
            assert reads == [5]
    # an error already in flight wins; the guards are dropped, not raised (nor left for the next bucket)
    with pytest.raises(KeyError):
        with refresh.deferred_refresh():
            guard_bf16_exact_weights(bad[1], bad[0], "layers.0.down_proj")
            raise KeyError("in flight")
    with refresh.deferred_refresh():
        pass
    assert refresh._guards() == []
