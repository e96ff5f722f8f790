"""Marlin's weight layout made without the engine's op (``marlin_weights_batched``), on CPU.

The reference is vLLM's own pure-Python packing (``marlin_utils_test.marlin_weights`` with
``get_weight_perm(8)``), which vLLM's kernel tests hold equal to the compiled ``gptq_marlin_repack``; the
GPU test (``tests/gpu/test_fast_path.py``) compares with the compiled op itself.  The kernels' wiring runs
here with a stand-in provider whose ``repack`` is that reference: a layer whose batched repack agrees at
load refreshes in place with it (dense, and MoE experts in runs), one where it does not keeps the op.
"""

import pytest
import torch

from mxfp8_learner_grid.common.grid_kernels import LayerSpec
from mxfp8_learner_grid.common.grid_kernels import providers as P
from mxfp8_learner_grid.common.grid_kernels.marlin import (batched_repack_agrees, marlin_scales,
                                                           marlin_unpack_batched, marlin_weights_batched,
                                                           weight_perm_8bit)
from mxfp8_learner_grid.common.grid_kernels.marlin_moe import expert_runs
from mxfp8_learner_grid.common.refresh import deferred_refresh, mark_written

mt = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


def _codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b[(b & 0x7F) == 0x7F] = 0x11                # no NaN codes
    return b.view(torch.float8_e4m3fn)


def _vllm_reference(w: torch.Tensor) -> torch.Tensor:
    """vLLM's packing of one fp8 [N, K] weight (W^T as the [K, N] codes it permutes)."""
    n, k = w.shape
    return mt.marlin_weights(w.view(torch.uint8).t().contiguous().to(torch.int32), k, n, 8, mt.get_weight_perm(8))


class ReferenceMarlin:
    """A CPU stand-in for the engine's Marlin ops: ``repack`` unpacks the GPTQ int32 words the kernels hand it
    ([K/4, N], 4 codes along K each) and packs them as vLLM's reference does; ``perturb`` makes it disagree."""

    def __init__(self, perturb=False):
        self.perturb, self.calls = perturb, 0

    def repack(self, q, size_k, size_n):
        self.calls += 1
        q_w = q.contiguous().view(torch.uint8).reshape(size_k // 4, size_n, 4).permute(0, 2, 1).reshape(size_k, size_n)
        out = mt.marlin_weights(q_w.to(torch.int32), size_k, size_n, 8, mt.get_weight_perm(8))
        if self.perturb:
            out = out.clone()
            out.view(-1)[0] ^= 1
        return out

    def workspace(self, device, max_blocks_per_sm=1):
        return torch.zeros(4, dtype=torch.int32, device=device)


def test_the_permutation_is_vllms():
    assert weight_perm_8bit() == mt.get_weight_perm(8).tolist()
    assert sorted(weight_perm_8bit()) == list(range(1024))


@pytest.mark.parametrize("n,k", [(64, 128), (128, 64), (256, 512), (1536, 2048), (2048, 768), (192, 48)])
def test_batched_repack_equals_vllms_packing(n, k):
    w = _codes(n, k, seed=n + k)
    assert torch.equal(marlin_weights_batched(w), _vllm_reference(w))


def test_batched_repack_of_many_experts_at_once_and_in_place(monkeypatch):
    from mxfp8_learner_grid.common.grid_kernels import marlin as M
    w = _codes(5, 128, 256, seed=3)
    ref = torch.stack([_vllm_reference(w[e]) for e in range(5)])
    assert torch.equal(marlin_weights_batched(w), ref)
    monkeypatch.setattr(M, "REPACK_CHUNK_BYTES", 2 * 128 * 256)         # groups of two experts: 2, 2, 1
    assert torch.equal(marlin_weights_batched(w), ref)
    monkeypatch.setattr(M, "REPACK_CHUNK_BYTES", 1)                     # below one matrix: one at a time
    assert torch.equal(marlin_weights_batched(w), ref)
    out = torch.zeros_like(ref)
    ptr = out.data_ptr()
    res = marlin_weights_batched(w[1:4], out=out[1:4])
    assert res.data_ptr() == out[1:4].data_ptr() and out.data_ptr() == ptr
    assert torch.equal(out[1:4], ref[1:4]) and not out[0].any() and not out[4].any()
    with pytest.raises(ValueError, match="not a multiple of"):
        marlin_weights_batched(_codes(96, 128))
    with pytest.raises(ValueError, match="out must be contiguous int32"):
        marlin_weights_batched(w[0], out=torch.zeros(8, 512, dtype=torch.int32).t())


@pytest.mark.parametrize("n,k", [(64, 128), (128, 64), (256, 512), (1536, 2048), (2048, 768), (192, 48)])
def test_unpack_gives_back_the_codes_of_vllms_packing(n, k):
    """Every byte of vLLM's own packing read back to the [N, K] codes it was made of (the layout a layer
    that keeps only the packed copy would read its engine bytes from)."""
    w = _codes(n, k, seed=7 * n + k)
    got = marlin_unpack_batched(_vllm_reference(w), n)
    assert got.dtype == torch.float8_e4m3fn and tuple(got.shape) == (n, k)
    assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))


def test_unpack_of_many_experts_in_groups_and_in_place(monkeypatch):
    from mxfp8_learner_grid.common.grid_kernels import marlin as M
    w = _codes(5, 128, 256, seed=11)
    packed = marlin_weights_batched(w)
    for chunk in (M.REPACK_CHUNK_BYTES, 2 * 128 * 256, 1):              # all at once; 2, 2, 1; one at a time
        monkeypatch.setattr(M, "REPACK_CHUNK_BYTES", chunk)
        assert torch.equal(marlin_unpack_batched(packed, 128).view(torch.uint8), w.view(torch.uint8))
    out = torch.zeros(5, 128, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    res = marlin_unpack_batched(packed[1:4], 128, out=out[1:4])
    assert res.data_ptr() == out[1:4].data_ptr()
    b = out.view(torch.uint8)
    assert torch.equal(b[1:4], w.view(torch.uint8)[1:4]) and not b[0].any() and not b[4].any()
    bumped = packed.clone()
    bumped.view(torch.uint8).view(-1)[12345] ^= 1                       # one byte changed: one code changed
    diff = marlin_unpack_batched(bumped, 128).view(torch.uint8) != w.view(torch.uint8)
    assert int(diff.sum()) == 1
    with pytest.raises(ValueError, match="want int32"):
        marlin_unpack_batched(packed, 64)
    with pytest.raises(ValueError, match="out must be contiguous float8_e4m3fn"):
        marlin_unpack_batched(packed[0], 128, out=torch.zeros(256, 128, dtype=torch.uint8).view(torch.float8_e4m3fn))


def test_the_agreement_with_the_engines_op_is_checked_once_per_shape(caplog):
    ops, wrong = ReferenceMarlin(), ReferenceMarlin(perturb=True)
    assert batched_repack_agrees(ops, 128, 256, "cpu") and ops.calls == 1
    assert batched_repack_agrees(ops, 128, 256, "cpu") and ops.calls == 1          # cached: no second repack
    assert batched_repack_agrees(ops, 256, 128, "cpu") and ops.calls == 2          # another shape: checked
    with caplog.at_level("WARNING", logger="mxfp8_learner_grid"):
        assert not batched_repack_agrees(wrong, 128, 256, "cpu")                   # another engine's ops
        assert not batched_repack_agrees(ops, 96, 128, "cpu") and ops.calls == 2   # a shape it does not take
    assert "differ from the engine's gptq_marlin_repack" in caplog.text and "not a multiple" in caplog.text


def test_a_batched_repack_that_fails_on_the_device_is_not_used(monkeypatch):
    from mxfp8_learner_grid.common.grid_kernels import marlin as M

    def broken(*a, **kw):
        raise RuntimeError("index_select_out: not implemented for this device")
    monkeypatch.setattr(M.torch, "index_select", broken)
    assert not batched_repack_agrees(ReferenceMarlin(), 64, 128, "cpu")


def test_batched_scale_permutation_equals_the_per_matrix_one():
    s = torch.randint(0, 255, (6, 256, 16), dtype=torch.uint8)
    assert torch.equal(marlin_scales(s), torch.stack([marlin_scales(s[e]) for e in range(6)]))


def test_expert_runs():
    assert expert_runs(8) == [(0, 8)] and expert_runs(0) == []
    assert expert_runs(8, [5, 1, 2, 7, 6, 2]) == [(1, 3), (5, 8)] and expert_runs(8, []) == []


def _spec(**kw):
    # bf16_weight_rows 0: the sm_90 default would give down_proj a bf16 copy, built by a Triton kernel (no CPU
    # backend); these tests are about Marlin's repack
    base = dict(prefix="model.layers.0.mlp.down_proj", kind="linear", device_type="cuda", capability=(9, 0),
                act_dtype=torch.bfloat16, n=256, k=512, options={"bf16_weight_rows": 0})
    base.update(kw)
    return LayerSpec(**base)


def _scales(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(110, 130, shape, dtype=torch.uint8, generator=g)


def _processed(kern, **params):
    """A layer holding ``params`` whose weights ``kern`` processed, as an engine's first load leaves it."""
    layer = torch.nn.Module()
    for name, t in params.items():
        setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
    layer.grid_kernel = kern
    kern.process_weights_after_loading(layer)
    layer.grid_processed = True
    return kern, layer


def _dense(ops, monkeypatch):
    from mxfp8_learner_grid.common.grid_kernels.marlin import MarlinLinear
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": ops})
    return _processed(MarlinLinear(_spec()), weight=_codes(256, 512, seed=1), weight_scale_inv=_scales(256, 16, seed=1))


def test_a_dense_layer_refreshes_in_place_with_the_batched_repack(monkeypatch):
    ops = ReferenceMarlin()
    kern, layer = _dense(ops, monkeypatch)
    assert kern.batched and ops.calls == 1                      # the load: the shape's check, then batched
    assert torch.equal(layer.grid_marlin_weight, _vllm_reference(layer.weight))
    ptr = layer.grid_marlin_weight.data_ptr()
    layer.weight.data.copy_(_codes(256, 512, seed=2))
    layer.weight_scale_inv.data.copy_(_scales(256, 16, seed=2))
    with deferred_refresh():
        mark_written(layer)
    assert ops.calls == 1 and layer.grid_marlin_weight.data_ptr() == ptr
    assert torch.equal(layer.grid_marlin_weight, _vllm_reference(layer.weight))
    assert torch.equal(layer.grid_marlin_scale, marlin_scales(layer.weight_scale_inv))
    for name, (live, build) in kern.derived(layer).items():
        assert torch.equal(live, build()), name


def test_a_dense_layer_whose_batched_repack_disagrees_keeps_the_engines_op(monkeypatch, caplog):
    ops = ReferenceMarlin(perturb=True)
    with caplog.at_level("WARNING", logger="mxfp8_learner_grid"):
        kern, layer = _dense(ops, monkeypatch)
    assert not kern.batched and "differ from the engine's gptq_marlin_repack" in caplog.text
    layer.weight.data.copy_(_codes(256, 512, seed=2))
    with deferred_refresh():
        mark_written(layer)
    assert ops.calls == 3 and torch.equal(layer.grid_marlin_weight, ops.repack(
        layer.weight.view(torch.int32).t().contiguous(), 512, 256))


def _moe(ops, monkeypatch, e=4, h=128, inter=64):
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": ops})
    kern = MarlinMoE(_spec(kind="moe", prefix="model.layers.0.mlp.experts", n=2 * inter, k=h, intermediate=inter,
                           num_experts=e, options={"marlin_configs": []}))
    return _processed(kern, w13_weight=_codes(e, 2 * inter, h, seed=5),
                      w13_weight_scale_inv=_scales(e, 2 * inter, h // 32, seed=5),
                      w2_weight=_codes(e, h, inter, seed=6), w2_weight_scale_inv=_scales(e, h, inter // 32, seed=6))


def test_moe_experts_refresh_in_runs_with_the_batched_repack(monkeypatch):
    ops = ReferenceMarlin()
    kern, layer = _moe(ops, monkeypatch)
    assert kern.batched and ops.calls == 2                      # the load: the two shapes' checks, then batched
    before = {n: getattr(layer, f"grid_marlin_{n}").clone() for n in ("w13", "w2", "w13_scale", "w2_scale")}
    ptrs = {n: getattr(layer, f"grid_marlin_{n}").data_ptr() for n in before}
    for ex in (1, 2):                                           # a partial update: experts 1 and 2
        layer.w13_weight.data[ex].copy_(_codes(128, 128, seed=10 + ex))
        layer.w2_weight.data[ex].copy_(_codes(128, 64, seed=20 + ex))
        layer.w2_weight_scale_inv.data[ex].copy_(_scales(128, 2, seed=30 + ex))
    with deferred_refresh():
        mark_written(layer, 1)
        mark_written(layer, 2)
    assert ops.calls == 2 and ptrs == {n: getattr(layer, f"grid_marlin_{n}").data_ptr() for n in before}
    for which in ("w13", "w2"):
        live = getattr(layer, f"grid_marlin_{which}")
        w = getattr(layer, f"{which}_weight")
        for ex in range(4):
            assert torch.equal(live[ex], _vllm_reference(w[ex])), (which, ex)
        for ex in (0, 3):                                       # untouched experts: the same bytes
            assert torch.equal(live[ex], before[which][ex])
        scales = getattr(layer, f"{which}_weight_scale_inv")
        assert torch.equal(getattr(layer, f"grid_marlin_{which}_scale"),
                           torch.stack([marlin_scales(scales[ex]) for ex in range(4)]))
    for name, (live, build) in kern.derived(layer).items():
        assert torch.equal(live, build()), name


def test_moe_experts_whose_batched_repack_disagrees_keep_the_engines_op(monkeypatch):
    ops = ReferenceMarlin(perturb=True)
    kern, layer = _moe(ops, monkeypatch)
    assert not kern.batched
    layer.w2_weight.data[3].copy_(_codes(128, 64, seed=40))
    with deferred_refresh():
        mark_written(layer, 3)
    assert ops.calls == 8 + 1 + 2        # the load (its first check fails), then expert 3's two GEMMs, by the op


def test_moe_codes_held_once_in_the_packed_buffer(monkeypatch):
    """Option ``moe_single_copy``: after the load the experts' code parameters are PackedCodes over the
    buffers Marlin reads (no second copy); a loader's write into a parameter lands in Marlin's bytes, the
    refresh rebuilds only the scales, and ``derived_state`` has no packed weight left to rebuild."""
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE
    from mxfp8_learner_grid.common.packed_codes import PackedCodes, plain
    ops = ReferenceMarlin()
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": ops})
    e, h, inter = 4, 128, 64
    kern = MarlinMoE(_spec(kind="moe", prefix="model.layers.0.mlp.experts", n=2 * inter, k=h, intermediate=inter,
                           num_experts=e, options={"marlin_configs": [], "moe_single_copy": True}))
    codes = {"w13": _codes(e, 2 * inter, h, seed=5), "w2": _codes(e, h, inter, seed=6)}
    kern, layer = _processed(kern, w13_weight=codes["w13"].clone(),
                             w13_weight_scale_inv=_scales(e, 2 * inter, h // 32, seed=5),
                             w2_weight=codes["w2"].clone(), w2_weight_scale_inv=_scales(e, h, inter // 32, seed=6))
    assert "codes held once" in kern.describe()
    ptrs = {}
    for which in ("w13", "w2"):
        w, live = getattr(layer, f"{which}_weight"), getattr(layer, f"grid_marlin_{which}")
        assert isinstance(w, PackedCodes) and w.packed is live and w.data_ptr() == live.data_ptr()
        assert torch.equal(plain(w).view(torch.uint8), codes[which].view(torch.uint8))
        for ex in range(e):
            assert torch.equal(live[ex], _vllm_reference(codes[which][ex])), (which, ex)
        ptrs[which] = live.data_ptr()
    assert set(kern.derived(layer)) == {"grid_marlin_w13_scale", "grid_marlin_w2_scale"}
    new_up = _codes(inter, h, seed=40)
    layer.w13_weight.data[2].narrow(0, inter, inter).copy_(new_up)      # an up_proj shard, as the loaders write it
    layer.w2_weight_scale_inv.data[2].copy_(_scales(h, inter // 32, seed=41))
    codes["w13"][2, inter:].copy_(new_up)
    with deferred_refresh():
        mark_written(layer, 2)
    assert ops.calls == 2                                       # the load's two shape checks; no repack since
    for which in ("w13", "w2"):
        live = getattr(layer, f"grid_marlin_{which}")
        assert live.data_ptr() == ptrs[which]
        for ex in range(e):
            assert torch.equal(live[ex], _vllm_reference(codes[which][ex])), (which, ex)
        assert torch.equal(getattr(layer, f"grid_marlin_{which}_scale"),
                           marlin_scales(getattr(layer, f"{which}_weight_scale_inv")))
    for name, (live, build) in kern.derived(layer).items():
        assert torch.equal(live, build()), name
    layer.grid_marlin_w13 = layer.grid_marlin_w13.clone()           # a rebound buffer: the kernel says so
    with pytest.raises(ValueError, match="grid_marlin_w13 was rebound"):
        kern.refresh(layer)


def test_moe_single_copy_refuses_what_reads_the_checkpoint_layout(monkeypatch):
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE
    from mxfp8_learner_grid.common.options import GridOptions
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": ReferenceMarlin(perturb=True)})
    base = dict(kind="moe", prefix="model.layers.0.mlp.experts", n=128, k=128, intermediate=64, num_experts=4)
    with pytest.raises(ValueError, match="moe_single_copy.*moe_gemv_slots: 0"):
        MarlinMoE(_spec(**{**base, "intermediate": 128}, options={"moe_single_copy": True, "moe_gemv_slots": 64}))
    kern = MarlinMoE(_spec(**base, options={"marlin_configs": [], "moe_single_copy": True}))
    with pytest.raises(ValueError, match="moe_single_copy needs the batched Marlin repack"):
        _processed(kern, w13_weight=_codes(4, 128, 128), w13_weight_scale_inv=_scales(4, 128, 4),
                   w2_weight=_codes(4, 128, 64), w2_weight_scale_inv=_scales(4, 128, 2))
    with pytest.raises(ValueError, match="moe_single_copy must be true or false"):
        GridOptions.from_dict({"moe_single_copy": "yes"})
