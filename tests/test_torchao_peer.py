"""torchao's MX quantizer in RCEIL mode as an independent peer.

Documented differences (docs/format.md), excluded below and tested in test_differs_only_where_documented:
* NaN in a block: torchao writes scale 255 (and a NaN block) where TE ignores NaN for the amax.
  (docs/format.md also lists Inf amax -> 255; torchao 0.18's CPU path writes 254 as TE does,
  which this test checks);
* -0.0: torchao keeps 0x80, our rule writes 0x00;
* blocks with scale byte 0 (amax <= 448 * 2^-127, nonzero): torchao 0.18 scales them by 1.0,
  following an older TE ``exp2f_rcp`` (commit b7598aa); TE 2.19+ scales them by 2^127.
Skipped when torchao is not installed."""

import pytest
import torch

from mxfp8_learner_grid.common import quantize_rows

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
cfg = pytest.importorskip("torchao.prototype.mx_formats.config")


def torchao_rceil(x):
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, cfg.ScaleCalculationMode.RCEIL)
    return data.view(torch.uint8), scale.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("logscale", [-130, -120, -60, -8, 0, 8, 60, 120])
def test_agrees_on_finite_blocks(dtype, logscale):
    g = torch.Generator().manual_seed(logscale + 1000)
    x = (torch.randn(64, 1024, generator=g, dtype=torch.float64) * 2.0 ** logscale).to(dtype)
    x[x == 0] = 2.0 ** logscale      # no -0.0 (rule differs by design)
    ours_q, ours_s = quantize_rows(x)
    q, s = torchao_rceil(x)
    assert torch.equal(ours_s, s)
    normal = (s != 0).repeat_interleave(32, dim=-1)       # scale-0 blocks: older TE rule in torchao
    assert normal.float().mean() > 0.5 or logscale <= -120
    assert torch.equal(ours_q.view(torch.uint8)[normal], q[normal])


def test_differs_only_where_documented():
    x = torch.randn(4, 64)
    x[0, 3] = float("nan")      # NaN block: torchao scale 255, data NaN
    x[1, 40] = float("inf")     # Inf block: 254 in both (torchao 0.18 CPU path)
    ours_q, ours_s = quantize_rows(x)
    q, s = torchao_rceil(x)
    assert ours_s[0, 0] != 255 and s[0, 0] == 255
    assert ours_s[1, 1] == 254 and s[1, 1] == 254
    assert torch.equal(ours_q.view(torch.uint8)[1, 32:], q[1, 32:])
    same = torch.ones_like(ours_s, dtype=torch.bool)
    same[0, 0] = False
    assert torch.equal(ours_s[same], s[same])
    # a tiny block: same scale byte 0, different data (TE 2.19+ multiplies by 2^127, torchao by 1)
    t = torch.full((1, 32), 2.0 ** -125)
    (tq, ts), (aq, as_) = quantize_rows(t), torchao_rceil(t)
    assert ts.item() == as_.item() == 0
    assert tq.view(torch.uint8)[0, 0].item() == 0x48 and aq[0, 0].item() == 0x00    # 2^-125 * 2^127 = 4
