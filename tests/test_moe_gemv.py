"""The MoE decode path by the expert GEMV (``grid_kernels/moe_gemv.py``, option ``moe_gemv_slots``) under
Triton's CPU interpreter, against the per-expert reference ``ops.moe_reference`` and a per-slot
float64 reference written here.  The GPU side is in tests/gpu/test_fast_path.py."""

import textwrap

import pytest
from interpreter import run_ok

SCRIPT = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
    from mxfp8_learner_grid.common.grid_kernels.moe_gemv import moe_decode_gemv
    from mxfp8_learner_grid.common.kernels.moe_gemv_triton import moe_gemv
    from mxfp8_learner_grid.common.ops import local_expert_ids, moe_reference
    g = torch.Generator().manual_seed(0)

    # the kernel alone: per slot, the float64 sum of the exact products rounded once; other ranks' slots 0
    E, N, K = 5, 40, 256
    wq, ws = quantize_rows(torch.randn(E, N, K, generator=g) * 0.05)
    xq, xs = quantize_rows(torch.randn(3, K, generator=g, dtype=torch.bfloat16))
    rows = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)
    ex = torch.tensor([0, 3, 4, -1, 3, 1], dtype=torch.int32)
    y = moe_gemv(xq, xs, rows, wq, ws, ex)
    xa = dequantize_blocks(xq, xs).double()
    for s in range(6):
        e = int(ex[s])
        if e < 0:
            assert bool((y[s] == 0).all())
            continue
        ref = (xa[rows[s]] @ dequantize_blocks(wq[e], ws[e]).double().t()).float().to(torch.bfloat16)
        assert (y[s].view(torch.int16) == ref.view(torch.int16)).float().mean() >= 0.97, s
    # a wrong scale is seen: the check can fail
    assert not torch.equal(moe_gemv(xq, xs, rows, wq, (ws.to(torch.int16) + 1).to(torch.uint8), ex), y)
    try:
        moe_gemv(xq[:, :96], xs[:, :3], rows, wq[..., :96], ws[..., :3], ex)
        raise SystemExit("K = 96 accepted")
    except ValueError as exc:
        assert "multiple of 128" in str(exc)

    # the whole layer against the per-expert reference, with and without expert parallel
    E, H, I = 6, 128, 128
    w13q, w13s = quantize_rows(torch.randn(E, 2 * I, H, generator=g) * 0.05)
    w2q, w2s = quantize_rows(torch.randn(E, H, I, generator=g) * 0.05)
    for t, topk, ep in ((1, 2, False), (3, 2, True), (2, 4, False)):
        x = torch.randn(t, H, generator=g, dtype=torch.bfloat16)
        e_glob = 2 * E if ep else E
        w, ids = torch.topk(torch.softmax(torch.randn(t, e_glob, generator=g), -1), topk)
        w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
        ids = ids.to(torch.int32)
        emap = None
        if ep:
            emap = torch.full((e_glob,), -1, dtype=torch.int32)
            emap[E:] = torch.arange(E, dtype=torch.int32)
        got = moe_decode_gemv(x, w13q, w13s, w2q, w2s, w, ids, emap, I)
        ref = moe_reference(x, w13q, w13s, w2q, w2s, w, local_expert_ids(ids, emap))
        assert got.dtype == torch.bfloat16 and got.shape == (t, H)
        same = (got.view(torch.int16) == ref.view(torch.int16)).float().mean()
        assert same >= 0.97, (t, topk, ep, float(same))
    print("OK")
""")


def test_moe_expert_gemv_under_the_interpreter():
    pytest.importorskip("triton")
    run_ok(SCRIPT)


def test_moe_gemv_slots_option():
    from mxfp8_learner_grid.common.options import GridOptions
    assert GridOptions.from_dict({"moe_gemv_slots": 64}).raw["moe_gemv_slots"] == 64
    GridOptions.from_dict({"moe_gemv_slots": 0})
    for bad in (-1, True, "64", 1025, 2.0):
        with pytest.raises(ValueError, match="moe_gemv_slots"):
            GridOptions.from_dict({"moe_gemv_slots": bad})


def test_measured_defaults_per_kernel():
    """The expert GEMV is on by default where it measured faster (the Triton MoE: SGLang's), off where
    Marlin MoE measured faster; the option overrides both, 0 turns it off."""
    pytest.importorskip("triton")
    import torch
    from mxfp8_learner_grid.common.grid_kernels import LayerSpec
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE
    from mxfp8_learner_grid.common.grid_kernels.moe_gemv import TRITON_MOE_DEFAULT_SLOTS
    from mxfp8_learner_grid.common.grid_kernels.portable import TritonMoE

    def spec(**opts):
        return LayerSpec(prefix="moe", kind="moe", device_type="cuda", act_dtype=torch.bfloat16, n=1536, k=2048,
                         intermediate=768, num_experts=128, options=opts)
    assert TritonMoE(spec()).gemv_slots == TRITON_MOE_DEFAULT_SLOTS == 128
    assert "expert GEMV (slots <= 128)" in TritonMoE(spec()).describe()
    assert TritonMoE(spec(moe_gemv_slots=0)).gemv_slots == 0
    assert MarlinMoE(spec()).gemv_slots == 0 and MarlinMoE(spec(moe_gemv_slots=64)).gemv_slots == 64
    odd = LayerSpec(prefix="moe", kind="moe", device_type="cuda", act_dtype=torch.bfloat16, n=192, k=2048,
                    intermediate=96, num_experts=8)
    assert TritonMoE(odd).gemv_slots == 0          # intermediate 96: not a multiple of 128, the GEMV declines
