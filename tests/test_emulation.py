"""The study's other FP8 grids (common/emulation.py) against a loop-by-loop definition."""

import pytest
import torch

from mxfp8_learner_grid.common.emulation import (emulated_linear, emulated_moe, fake_quant_act,
                                                 fake_quant_weight)


def _fq_block(v):
    amax = v.abs().max()
    s = amax / 448 if amax > 0 else torch.tensor(1.0)
    return (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def test_per_tensor_is_on_an_e4m3_grid_and_idempotent():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * 3
    fq = fake_quant_weight(w, "fp8_per_tensor")
    s = w.abs().max() / 448
    codes = fq / s
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)          # every value an E4M3 code x s
    assert torch.equal(fake_quant_weight(fq, "fp8_per_tensor"), fq)            # the amax maps to itself
    assert (fq - w).abs().max() <= s * 16 + 1e-6                               # half an ulp at 448 (32) x s
    assert torch.equal(fake_quant_weight(torch.zeros(4, 4), "fp8_per_tensor"), torch.zeros(4, 4))


def test_blocks_match_the_loop_including_partial_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 200, generator=g)
    w[129, :] *= 1000                  # a partial row block with its own scale
    want = torch.empty_like(w)
    for r in range(0, 130, 128):
        for c in range(0, 200, 128):
            want[r:r + 128, c:c + 128] = _fq_block(w[r:r + 128, c:c + 128])
    assert torch.equal(fake_quant_weight(w, "fp8_block128"), want)
    want_a = torch.empty_like(w)
    for r in range(130):
        for c in range(0, 200, 128):
            want_a[r, c:c + 128] = _fq_block(w[r, c:c + 128])
    assert torch.equal(fake_quant_act(w, "fp8_block128"), want_a)


def test_linear_and_moe():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    w13 = torch.randn(2, 64, 64, generator=g) * 0.1
    w2 = torch.randn(2, 64, 32, generator=g) * 0.1
    for scheme in ("fp8_per_tensor", "fp8_block128"):
        y = emulated_linear(x, w13[0], scheme)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, (fake_quant_act(x, scheme) @ fake_quant_weight(w13[0], scheme).t()).to(torch.bfloat16))
        # every token routed to expert 0 with weight 1: the MoE layer is gate_up -> SiLU*up -> down
        ids = torch.zeros(6, 1, dtype=torch.int64)
        out = emulated_moe(x, w13, w2, torch.ones(6, 1), ids, scheme)
        g_, u = emulated_linear(x, w13[0], scheme).chunk(2, -1)
        assert torch.equal(out, emulated_linear(torch.nn.functional.silu(g_) * u, w2[0], scheme))
    with pytest.raises(ValueError, match="unknown emulated FP8 scheme"):
        fake_quant_weight(w13[0], "fp8_block64")
