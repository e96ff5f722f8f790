"""The humming band's rules that need no GPU: its per-M dispatch table, its scale layout, its option and
its refusal to run where humming is missing.  tests/gpu/test_humming_band.py checks it against humming."""

import pytest
import torch

from mxfp8_learner_grid.common.grid_kernels import LayerSpec
from mxfp8_learner_grid.common.grid_kernels import humming as H


@pytest.mark.parametrize("lo,hi", [(17, 129), (1, 65), (33, 34), (1, 129), (5, 100)])
def test_tuning_table_covers_the_band_with_stream_k_off(lo, hi):
    table = H.tuning_table(lo, hi)
    # humming's launcher takes the entry with m_lo < M <= m_hi: every M of [1, hi) in exactly one entry (the
    # table starts at M = 1 whatever lo: one starting at 17 segfaulted in humming's launcher on the H200)
    assert table[0][0] == 0
    for m in range(1, H.HUMMING_MAX_ROWS + 2):
        hits = [e for e in table if e[0] < m <= e[1]]
        assert len(hits) == (1 if m < hi else 0), (m, table)
        if hits:
            cfg = hits[0][2]
            bm = cfg["block_shape"][0]
            assert bm % 16 == 0 and m <= bm < m + 16, (m, cfg)
            assert cfg["warp_shape"][0] == bm
    for _, _, cfg in table:
        assert cfg["use_stream_k"] is False          # stream-K adds bf16-rounded partials: off the grid
        assert cfg["block_shape"][1:] == list(H.DEFAULT_TILE)
    assert '"use_batch_invariant": true' in H.COMPUTE_CONFIG and '"use_f16_accum": false' in H.COMPUTE_CONFIG


def _humming_perm_formula(s):
    """humming 0.1.10's utils/weight.py prepare_humming_weight_scale(to_apply_on_c=False), transcribed."""
    perm = [0, 8, 16, 24, 32, 40, 48, 56]
    count = sum(x < 8 for x in perm)
    perm_new = []
    for i in range(8 // count):
        perm_new += [x + count * i for x in perm]
    t = s.transpose(-1, -2).contiguous()
    return t.view(-1, len(perm_new))[:, torch.tensor(perm_new)].contiguous().view(t.shape)


def test_scale_layout_is_humming_permutation():
    g = torch.Generator().manual_seed(0)
    for n, groups in ((64, 4), (256, 128), (6144, 128)):
        s = torch.randint(0, 256, (n, groups), generator=g, dtype=torch.int32).to(torch.uint8)
        got = H.humming_scales(s)
        assert got.dtype == torch.uint8 and got.shape == (groups, n)
        assert torch.equal(got, _humming_perm_formula(s))
        # pure byte movement: the same multiset of bytes per K group
        assert torch.equal(got.sort(1).values, s.t().sort(1).values)


def test_humming_rows_option():
    from mxfp8_learner_grid.common.options import GridOptions
    assert GridOptions.from_dict({"humming_rows": [17, 129]}).raw["humming_rows"] == [17, 129]
    GridOptions.from_dict({"humming_rows": [], "humming_tile": [64, 128]})
    for bad in ([129, 17], [1], [True, 4], [-1, 4], [1, 1000]):
        with pytest.raises(ValueError, match="humming_rows"):
            GridOptions.from_dict({"humming_rows": bad})
    for bad in ([96, 64], [128], "128x64"):
        with pytest.raises(ValueError, match="humming_tile"):
            GridOptions.from_dict({"humming_tile": bad})


def _spec(**options):
    return LayerSpec(prefix="model.layers.0.mlp.down_proj", kind="linear", device_type="cuda",
                     act_dtype=torch.bfloat16, n=4096, k=12288, capability=(9, 0), options=options)


def test_band_off_by_default_and_where_humming_cannot_run(monkeypatch):
    band = H.HummingBand(_spec())
    assert not band.on and band.names() == () and band.args(None)[3:5] == (0, 0) and band.describe() == ""
    # a requested band on a machine without humming (CI) is off, and says why in the layer's kernel line
    import builtins
    real_import = builtins.__import__

    def no_humming(name, *a, **kw):
        if name == "humming" or name.startswith("humming."):
            raise ImportError("No module named 'humming'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_humming)
    band = H.HummingBand(_spec(humming_rows=[17, 129]))
    assert not band.on and "humming-kernels is not importable" in band.describe()
    ok, why = H.humming_supported(LayerSpec(prefix="p", kind="linear", device_type="cuda", act_dtype=torch.bfloat16,
                                            n=64, k=128, capability=(10, 0)))
    assert not ok and "sm_90" in why
    assert not H.humming_shape_ok(4096 + 64, 4096) and H.humming_shape_ok(4096, 12288)
