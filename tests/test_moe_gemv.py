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
    # ids as given: int64 ids and rows read in the kernel give the same bits
    assert torch.equal(moe_gemv(xq, xs, rows.long(), wq, ws, ex.long()).view(torch.int16), y.view(torch.int16))
    # rows=None: slot s reads row s // topk (here topk 2: rows 0 0 1 1 2 2); topk 1: row s
    assert torch.equal(moe_gemv(xq, xs, None, wq, ws, ex, topk=2).view(torch.int16), y.view(torch.int16))
    y1 = moe_gemv(xq, xs, None, wq, ws, ex[:3].long())
    assert torch.equal(y1.view(torch.int16), moe_gemv(xq, xs, torch.arange(3), wq, ws, ex[:3]).view(torch.int16))
    # expert_map in the kernel = ops.local_expert_ids on the host; a negative global id: another rank's
    emap = torch.tensor([4, -1, 0, 3, -1, 1, 2], dtype=torch.int32)
    gid = torch.tensor([0, 2, 6, 1, -1, 5, 3, 4, 2], dtype=torch.int32)
    local = local_expert_ids(gid.clamp_min(0), emap).masked_fill(gid < 0, -1)
    rows9 = torch.arange(9) // 3
    ym = moe_gemv(xq, xs, None, wq, ws, gid, topk=3, expert_map=emap)
    assert torch.equal(ym.view(torch.int16), moe_gemv(xq, xs, rows9, wq, ws, local).view(torch.int16))
    assert torch.equal(ym.view(torch.int16), moe_gemv(xq, xs, rows9, wq, ws, gid.long(),
                                                      expert_map=emap.long()).view(torch.int16))
    assert bool((ym[[3, 4, 7]] == 0).all()) and not bool((ym[[0, 1, 2, 5, 6, 8]] == 0).all(-1).any())
    for bad in (dict(rows=rows[:5]), dict(rows=None, topk=0)):
        try:
            moe_gemv(xq, xs, wq=wq, ws=ws, experts=ex, **bad)
            raise SystemExit(f"accepted {bad}")
        except ValueError:
            pass
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
        # int64 router ids (and map): the kernel casts them, same bits
        got64 = moe_decode_gemv(x, w13q, w13s, w2q, w2s, w, ids.long(), None if emap is None else emap.long(), I)
        assert torch.equal(got64.view(torch.int16), got.view(torch.int16)), (t, topk, ep)
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


def test_choose_block_n_choices():
    """BLOCK_N per (slots, N, SMs): the choices recorded before choose_block_n took gemv_triton._wave_eff
    (Qwen3-30B-A3B at one token on 132 SMs: 32 for gate_up N 1536, 64 for down N 2048)."""
    pytest.importorskip("triton")
    from mxfp8_learner_grid.common.kernels import gemv_triton, moe_gemv_triton as MT
    recorded = {(8, 1536, 132): 32, (8, 2048, 132): 64, (1, 1536, 132): 32, (16, 1536, 132): 64,
                (24, 1536, 132): 32, (128, 768, 132): 128, (256, 4096, 132): 128, (1, 40, 8): 128,
                (2, 768, 78): 32, (64, 2048, 114): 128, (8, 768, 114): 32, (16, 2048, 78): 64}
    assert {key: MT.choose_block_n(*key) for key in recorded} == recorded
    assert MT._num_sms is gemv_triton._num_sms
    assert MT.K_STEP == gemv_triton._WORD_K.value == 4 * gemv_triton._BLOCK.value


def test_moe_decode_gemv_launches_nothing_between_the_kernels(monkeypatch):
    """moe_decode_gemv runs no torch op of its own (no arange, no index division, no id casts): with the
    five kernels stubbed, a dispatch log of the call is empty, and the GEMVs get the router's ids
    as given (rows=None, topk, the expert map passed through).  The GEMV's own wrapper, its launch
    stubbed, only allocates its output and takes views."""
    pytest.importorskip("triton")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from mxfp8_learner_grid.common.grid_kernels.moe_gemv import moe_decode_gemv
    from mxfp8_learner_grid.common.kernels import moe_gemv_triton as MT, moe_triton, quantize_triton

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    m, h, i, topk = 2, 128, 128, 4
    x = torch.zeros(m, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    w = torch.full((m, topk), 0.25)
    emap = torch.tensor([1, 0, -1, 2], dtype=torch.int32)
    gu, act, d, out = (torch.zeros(r, c, dtype=torch.bfloat16)
                       for r, c in ((m * topk, 2 * i), (m * topk, i), (m * topk, h), (m, h)))
    codes = (torch.zeros(1, h, dtype=torch.uint8), torch.zeros(1, h // 32, dtype=torch.uint8))
    calls = []

    def gemv(xq, xs, rows, wq, ws, experts, out_dtype=torch.bfloat16, block_n=None, *, topk=1, expert_map=None):
        calls.append((rows, experts, topk, expert_map))
        return gu if len(calls) == 1 else d
    monkeypatch.setattr(MT, "moe_gemv", gemv)
    monkeypatch.setattr(quantize_triton, "quantize_rows_triton", lambda v: codes)
    monkeypatch.setattr(moe_triton, "silu_mul_qdq", lambda g, n: act)
    monkeypatch.setattr(moe_triton, "moe_combine", lambda dd, tw, ti, em: out)
    for em in (None, emap):
        calls.clear()
        with Log() as log:
            assert moe_decode_gemv(x, None, None, None, None, w, ids, em, i) is out
        assert log.ops == [], log.ops
        assert [(r, e is ids, k, mp is em) for r, e, k, mp in calls] == [(None, True, topk, True),
                                                                          (None, True, 1, True)]

    monkeypatch.undo()
    from mxfp8_learner_grid.common import quantize_rows
    wq, ws = quantize_rows(torch.zeros(4, 64, 256))
    xq, xs = quantize_rows(torch.zeros(2, 256))
    launched = []
    monkeypatch.setattr(MT, "_moe_gemv_kernel", type("K", (), {"__getitem__": lambda self, g: lambda *a, **k:
                                                               launched.append(g)})())
    for dt in (torch.int32, torch.int64):
        ids_dt, emap_dt = ids.to(dt), emap.to(dt)
        with Log() as log:
            MT.moe_gemv(xq, xs, None, wq, ws, ids_dt, topk=topk, expert_map=emap_dt)
        # views and detach alias their input (no kernel); the one allocation is the output
        assert set(log.ops) <= {"aten.view.dtype", "aten.view.default", "aten.detach.default",
                                "aten.empty.memory_format"}, log.ops
        assert log.ops.count("aten.empty.memory_format") == 1, log.ops
    assert len(launched) == 2
