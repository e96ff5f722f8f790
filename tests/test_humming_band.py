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
    GridOptions.from_dict({"humming_rows": [], "humming_tile": [256, 128]})
    for bad in ([129, 17], [1], [True, 4], [-1, 4], [1, 1000]):
        with pytest.raises(ValueError, match="humming_rows"):
            GridOptions.from_dict({"humming_rows": bad})
    # BLOCK_N 64 is refused: humming 0.1.10's kernel with tile (64, 64) never finished on the H200
    for bad in ([96, 64], [128], "128x64", [64, 64], [64, 128]):
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


def test_band_turns_off_when_humming_cannot_build_its_kernels(monkeypatch, caplog):
    """humming importable but its JIT failing (no g++, no CUDA 13 headers): the layer serves without the band,
    the reason logged once per shape, no derived tensor registered -- instead of failing the engine's load."""
    import sys
    import types

    calls = []

    class FailingKernel:
        @staticmethod
        def prepare_kernels(layer_cfg, compute, tuning):
            calls.append(layer_cfg)
            raise RuntimeError("nvrtc: cuda.h not found")
    fake = {"humming": types.ModuleType("humming"), "humming.kernel": types.ModuleType("humming.kernel"),
            "humming.kernel.humming": types.ModuleType("humming.kernel.humming")}
    fake["humming.kernel.humming"].HummingKernel = FailingKernel
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(H, "layer_config", lambda n, k: f"cfg-{n}x{k}")
    monkeypatch.setattr(H, "_PREPARED", {})
    registered = []
    kernel = types.SimpleNamespace(register_derived_buffer=lambda layer, name, t: registered.append(name))
    layer = types.SimpleNamespace(weight=torch.zeros(4096, 12288, dtype=torch.float8_e4m3fn))
    bands = [H.HummingBand(_spec(humming_rows=[17, 129])) for _ in range(3)]
    assert all(b.on for b in bands)
    with caplog.at_level("WARNING"):
        for b in bands:
            b.process(kernel, layer)
    assert all(not b.on and b.names() == () and b.args(layer)[3:5] == (0, 0) for b in bands)
    assert "could not build its kernels" in bands[0].describe() and "cuda.h not found" in bands[0].describe()
    assert registered == [] and calls == ["cfg-4096x12288"]          # one build attempt per shape and table
    assert sum("humming band off" in r.message for r in caplog.records) == 1
