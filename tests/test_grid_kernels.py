"""The kernel chooser, the derived-tensor refresh and the pieces of the fast path that run on a CPU.

The GPU kernels themselves are checked in tests/gpu/test_fast_path.py; here: the scale
permutation against vLLM's own (pure torch) functions, the deterministic slot order, the
weight-decode kernel under Triton's interpreter, and the chooser's fallbacks and errors.
"""

import textwrap

import pytest
import torch
from interpreter import run_ok

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.grid_kernels import LayerSpec, choose, providers
from mxfp8_learner_grid.common.grid_kernels.marlin import marlin_scales
from mxfp8_learner_grid.common.grid_kernels.marlin_moe import block_size_m, deterministic_order
from mxfp8_learner_grid.common.refresh import deferred_refresh, mark_written


def spec(**kw):
    base = dict(prefix="model.layers.0.mlp.down_proj", kind="linear", device_type="cpu", act_dtype=torch.bfloat16,
                n=256, k=512)
    base.update(kw)
    return LayerSpec(**base)


def test_cpu_chooses_the_reference_and_forced_kernels_fail_loudly():
    assert choose(spec()).name == "torch"
    assert choose(spec(kind="moe", intermediate=128, num_experts=4)).name == "torch"
    with pytest.raises(ValueError, match="down_proj.*marlin.*not a CUDA device"):
        choose(spec(options={"kernel": "marlin"}))
    with pytest.raises(ValueError, match="kernel must be one of"):
        choose(spec(options={"kernel": "cutlass"}))


def test_marlin_declines_what_it_cannot_compute_exactly():
    from mxfp8_learner_grid.common.grid_kernels.marlin import MarlinLinear
    assert not MarlinLinear.can_implement(spec(act_dtype=torch.float16))[0]      # output must round to fp16
    assert not MarlinLinear.can_implement(spec(has_bias=True))[0]
    assert not MarlinLinear.can_implement(spec(n=96, k=96))[0]
    assert MarlinLinear.can_implement(spec(n=6144, k=4096))[0]


def test_without_marlin_a_cuda_layer_gets_the_w8a16_kernel(monkeypatch):
    """An engine that ships no MXFP8 Marlin (SGLang) still gets the W8A16 fast path, and a layer it
    cannot compute exactly falls through to the Triton grid GEMM with the reason logged."""
    pytest.importorskip("triton")
    from mxfp8_learner_grid.common.grid_kernels import providers as P
    from mxfp8_learner_grid.common.grid_kernels.w8a16 import W8A16Linear
    monkeypatch.setattr(P, "_PROVIDERS", {})
    cuda = dict(device_type="cuda", capability=(9, 0), n=6144, k=4096)
    assert choose(spec(**cuda)).name == "w8a16"
    assert choose(spec(**dict(cuda, k=320))).name == "triton"              # K not whole 128-steps
    assert choose(spec(**dict(cuda, act_dtype=torch.float32))).name == "triton"
    assert not W8A16Linear.can_implement(spec(**dict(cuda, has_bias=True)))[0]
    with pytest.raises(ValueError, match="w8a16: K=320 is not a multiple of 128"):
        choose(spec(**dict(cuda, k=320), options={"kernel": "w8a16"}))


def test_a_layer_the_engine_is_rebuilding_is_not_refreshed():
    """vLLM's layerwise reload: parameters on the meta device, derived buffers dropped -- a write
    refreshes nothing (process_weights_after_loading derives afresh afterwards)."""
    layer = torch.nn.Module()
    layer.grid_kernel, layer.grid_processed = _Kernel(), True
    layer.weight = torch.nn.Parameter(torch.zeros(4, 32, device="meta"), requires_grad=False)
    layer.register_buffer("d", torch.zeros(2))
    mark_written(layer)                                       # parameters on meta
    del layer.d
    layer.weight = torch.nn.Parameter(torch.zeros(4, 32), requires_grad=False)
    mark_written(layer)                                       # materialized, derived not there yet
    assert layer.grid_kernel.calls == []
    layer.register_buffer("d", torch.zeros(2))
    mark_written(layer)
    assert layer.grid_kernel.calls == [None]


def test_scale_permutation_equals_vllms():
    mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
    fp8u = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_fp8")
    for n, k in ((256, 512), (640, 2048), (128, 4096)):
        s = torch.randint(1, 255, (n, k // 32), dtype=torch.uint8)
        theirs = mu.marlin_permute_scales(s.view(torch.float8_e8m0fnu).to(torch.bfloat16).t().contiguous(), k, n, 32)
        theirs = fp8u.mxfp8_marlin_process_scales(theirs).view(torch.uint8)
        assert torch.equal(marlin_scales(s), theirs)


def test_deterministic_order_sorts_within_each_expert_segment():
    # two experts, block 4: segment of expert 1 then expert 0 then a -1 (other rank) block; sentinel = numel = 9
    sorted_ids = torch.tensor([7, 2, 9, 9, 5, 0, 3, 9, 8, 6, 9, 9], dtype=torch.int32)
    expert_ids = torch.tensor([1, 0, -1], dtype=torch.int32)
    out = deterministic_order(sorted_ids, expert_ids, 4, 9)
    assert out.tolist() == [2, 7, 9, 9, 0, 3, 5, 9, 6, 8, 9, 9]
    assert block_size_m(1, 8, 128, 128) == 8 and block_size_m(4096, 8, 128, 128) == 64


class _Kernel:
    name = "fake"

    def __init__(self):
        self.calls = []

    def derived_names(self, layer):
        return ("d",)

    def refresh(self, layer, experts=None):
        self.calls.append(experts)


def test_writes_refresh_at_once_or_once_per_scope():
    layer = torch.nn.Module()
    layer.grid_kernel, layer.grid_processed = _Kernel(), True
    layer.register_buffer("d", torch.zeros(2))
    mark_written(layer)
    mark_written(layer, 3)
    assert layer.grid_kernel.calls == [None, [3]]           # outside a scope: at once
    layer.grid_kernel.calls.clear()
    with deferred_refresh():
        mark_written(layer, 1)
        mark_written(layer, 2)
        with deferred_refresh():
            mark_written(layer, 1)
        assert layer.grid_kernel.calls == []
    assert layer.grid_kernel.calls == [[1, 2]]              # once, only the written experts
    layer.grid_kernel.calls.clear()
    with pytest.raises(RuntimeError):
        with deferred_refresh():
            mark_written(layer)
            raise RuntimeError("loader failed halfway")
    assert layer.grid_kernel.calls == [None]                # still rebuilt: derived follows the bytes
    layer.grid_processed = False
    mark_written(layer)                                     # before processing: nothing derived yet
    assert layer.grid_kernel.calls == [None]


def test_reference_kernel_refresh_follows_new_bytes():
    layer = torch.nn.Module()
    wq, ws = quantize_rows(torch.randn(64, 128))
    layer.weight = torch.nn.Parameter(wq, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
    k = choose(spec(n=64, k=128, act_dtype=torch.float32))
    k.process_weights_after_loading(layer)
    layer.grid_kernel, layer.grid_processed = k, True
    ptr = layer.weight_dequant.data_ptr()
    x = torch.randn(3, 128)
    nq, ns = quantize_rows(torch.randn(64, 128))
    layer.weight.data.copy_(nq)
    layer.weight_scale_inv.data.copy_(ns)
    stale = {n for n, (t, b) in k.derived(layer).items() if not torch.equal(t, b())}
    assert stale == {"weight_dequant"}                      # the registry sees a stale copy ...
    mark_written(layer)
    assert layer.weight_dequant.data_ptr() == ptr           # ... rebuilt in place
    from mxfp8_learner_grid.common.linear import mxfp8_linear_reference
    assert torch.equal(k.apply(layer, x), mxfp8_linear_reference(x, nq, ns))


def test_provider_registry():
    assert providers.get("nothing") is None
    providers.register("x", object)
    assert providers.get("x") is object
    providers.unregister("x")


DEQUANT = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks
    from mxfp8_learner_grid.common.kernels.dequant_triton import dequant_rows_bf16
    g = torch.Generator().manual_seed(0)
    for n, k in ((40, 96), (33, 544)):
        q = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        q[(q & 0x7F) == 0x7F] = 0
        s = torch.randint(0, 255, (n, k // 32), dtype=torch.uint8, generator=g)
        s[0, 0] = 0; s[1, 0] = 1; s[2, 0] = 2; s[3, 0] = 254
        got = dequant_rows_bf16(q.view(torch.float8_e4m3fn), s)
        ref = dequantize_blocks(q.view(torch.float8_e4m3fn), s).to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (n, k)
    print("OK")
""")


def test_dequant_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_ok(DEQUANT)


W8A16 = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
    from mxfp8_learner_grid.common.kernels.w8a16_triton import w8a16_gemm
    g = torch.Generator().manual_seed(0)

    def grid(t):
        return dequantize_blocks(*quantize_rows(t))

    # 1. the value path alone: x = I gives y = W's decoded values, bit for bit (codes of every kind,
    #    E4M3 subnormals included, scale bytes 3..200 where every value is exact in bf16)
    n, k = 48, 128
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0
    q[q == 0x80] = 0                       # -0.0: a sum of +0 products and one -0 product is +0
    s = torch.randint(3, 200, (n, k // 32), dtype=torch.uint8, generator=g)
    eye = torch.eye(k, dtype=torch.bfloat16)
    got = w8a16_gemm(eye, q.view(torch.float8_e4m3fn), s)
    ref = dequantize_blocks(q.view(torch.float8_e4m3fn), s).to(torch.bfloat16).t()
    assert torch.equal(got.view(torch.int16), ref.contiguous().view(torch.int16)), "value path"

    # 2. a GEMM: the exact float64 sum rounded once, up to FP32 summation order; split-K (K = 256 ->
    #    2 splits of the interpreter's config), rows and columns that do not fill a tile
    for m, n, k in ((5, 40, 256), (19, 70, 384)):
        w = torch.randn(n, k, generator=g) * 0.05
        wq, ws = quantize_rows(w)
        a = grid(torch.randn(m, k, generator=g)).to(torch.bfloat16)
        wg = dequantize_blocks(wq, ws)
        y = w8a16_gemm(a, wq, ws)
        exact = a.double() @ wg.double().t()
        bound = a.double().abs() @ wg.double().abs().t() * (k * 2.0 ** -24)
        ulp = exact.abs() * 2.0 ** -7 + 2.0 ** -133
        assert ((y.double() - exact).abs() <= ulp + bound).all(), (m, n, k)
        same = (y.view(torch.int16) == exact.float().to(torch.bfloat16).view(torch.int16)).float().mean()
        assert same >= 0.99, (m, n, k, float(same))
        assert torch.equal(w8a16_gemm(a, wq, ws).view(torch.int16), y.view(torch.int16))   # deterministic
    try:
        w8a16_gemm(a[:, :96], wq[:, :96], ws[:, :3])
        raise SystemExit("K = 96 accepted")
    except ValueError as exc:
        assert "multiple of 128" in str(exc)
    print("OK")
""")


def test_w8a16_kernel_under_the_interpreter():
    """The middle-band W8A16 GEMM's indexing, masks, decode and deterministic split-K, on the CPU."""
    pytest.importorskip("triton")
    run_ok(W8A16)


def test_w8a16_band_option():
    from mxfp8_learner_grid.common.options import GridOptions
    assert GridOptions.from_dict({"w8a16_rows": [17, 256]}).raw["w8a16_rows"] == [17, 256]
    GridOptions.from_dict({"w8a16_rows": []})
    for bad in ([256, 17], [1], "17-256", [True, 4], [-1, 4]):
        with pytest.raises(ValueError, match="w8a16_rows"):
            GridOptions.from_dict({"w8a16_rows": bad})


BF16_COPY = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
    from mxfp8_learner_grid.common.grid_kernels import LayerSpec
    from mxfp8_learner_grid.common.grid_kernels.w8a16 import W8A16Linear
    from mxfp8_learner_grid.common.refresh import refresh_layer
    g = torch.Generator().manual_seed(0)
    n, k = 40, 256

    def layer_of(seed):
        wq, ws = quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
        lay = torch.nn.Module()
        lay.weight = torch.nn.Parameter(wq, requires_grad=False)
        lay.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
        return lay

    lay = layer_of(1)
    spec = LayerSpec(prefix="t", kind="linear", device_type="cpu", act_dtype=torch.bfloat16, n=n, k=k,
                     options={"bf16_weight_rows": 8, "gemv_rows": 0})
    kern = W8A16Linear(spec)          # the interpreter stands in for the GPU: construct, not choose
    lay.grid_kernel = kern
    kern.process_weights_after_loading(lay)
    lay.grid_processed = True
    assert kern.derived_names(lay) == ("grid_bf16_weight",) and "bf16 copy" in kern.describe()
    copy = lay.grid_bf16_weight
    ref_w = dequantize_blocks(lay.weight, lay.weight_scale_inv).to(torch.bfloat16)
    assert torch.equal(copy.view(torch.int16), ref_w.view(torch.int16))        # the grid values, exactly
    for m in (3, 8, 20):              # 3: the W8A16 GEMM; 8 and 20: cuBLAS' stand-in on the copy
        x = torch.randn(m, k, generator=g, dtype=torch.bfloat16)
        a = dequantize_blocks(*quantize_rows(x))
        exact = a.double() @ ref_w.double().t()
        y = kern.apply(lay, x)
        same = (y.view(torch.int16) == exact.float().to(torch.bfloat16).view(torch.int16)).float().mean()
        assert same >= 0.99, (m, float(same))
    # an in-place update rewrites the copy in place; a stale copy is what derived_state rebuilds and compares
    new = layer_of(2)
    ptr = copy.data_ptr()
    lay.weight.data.copy_(new.weight)
    lay.weight_scale_inv.data.copy_(new.weight_scale_inv)
    refresh_layer(lay)
    assert lay.grid_bf16_weight.data_ptr() == ptr
    live, build = kern.derived(lay)["grid_bf16_weight"]
    assert torch.equal(live, build()) and not torch.equal(live, ref_w)
    live.view(torch.int16)[0, 0] ^= 1
    assert not torch.equal(live, build())
    off = W8A16Linear(LayerSpec(prefix="t", kind="linear", device_type="cpu", act_dtype=torch.bfloat16, n=n, k=k))
    assert off.derived_names(lay) == () and off.derived(lay) == {}
    print("OK")
""")


def test_bf16_weight_copy_option_under_the_interpreter():
    """bf16_weight_rows: the resident copy is W's grid values bit for bit, used from the given rows on,
    rewritten in place by an update and visible to the derived_state check."""
    pytest.importorskip("triton")
    run_ok(BF16_COPY)


def test_bf16_weight_rows_option():
    from mxfp8_learner_grid.common.options import GridOptions
    assert GridOptions.from_dict({"bf16_weight_rows": 48}).raw["bf16_weight_rows"] == 48
    GridOptions.from_dict({"bf16_weight_rows": 0})
    for bad in (-1, True, "48", 4.5, {"qkv_proj": -1}, {"qkv_proj": True}, {"": 48}, {".o_proj": 48}, {3: 48}):
        with pytest.raises(ValueError, match="bf16_weight_rows"):
            GridOptions.from_dict({"bf16_weight_rows": bad})
    per_module = {"qkv_proj": 48, "self_attn.o_proj": 32, "down_proj": 0, "*": 0}
    assert GridOptions.from_dict({"bf16_weight_rows": per_module}).raw["bf16_weight_rows"] == per_module


def test_bf16_weight_rows_per_module():
    """The per-module form names layers by their prefix's dotted tail; the longest key wins; '*' is the rest;
    each kernel's copy follows it (no copy, nothing derived, where the rows are 0)."""
    from mxfp8_learner_grid.common.grid_kernels import LayerSpec
    from mxfp8_learner_grid.common.grid_kernels.marlin import bf16_copy_rows
    from mxfp8_learner_grid.common.grid_kernels.w8a16 import W8A16Linear
    opt = {"qkv_proj": 48, "self_attn.o_proj": 32, "o_proj": 16, "*": 64}
    assert bf16_copy_rows(opt, "model.layers.3.self_attn.qkv_proj") == 48
    assert bf16_copy_rows(opt, "model.layers.3.self_attn.o_proj") == 32          # the longer key
    assert bf16_copy_rows(opt, "model.layers.3.cross_attn.o_proj") == 16
    assert bf16_copy_rows(opt, "model.layers.3.mlp.down_proj") == 64            # '*'
    assert bf16_copy_rows(opt, "model.layers.3.mlp.xqkv_proj") == 64            # a tail is a whole component
    assert bf16_copy_rows({"qkv_proj": 48}, "model.layers.3.mlp.gate_up_proj") == 0
    assert bf16_copy_rows(48, "anything") == 48 and bf16_copy_rows(0, "x") == 0 and bf16_copy_rows(None, "x") == 0
    for prefix, rows in (("model.layers.0.self_attn.qkv_proj", 48), ("model.layers.0.mlp.gate_up_proj", 0)):
        spec = LayerSpec(prefix=prefix, kind="linear", device_type="cpu", act_dtype=torch.bfloat16, n=64, k=256,
                         options={"bf16_weight_rows": {"qkv_proj": 48}})
        kern = W8A16Linear(spec)
        assert kern.bf16_copy.rows == rows
        assert kern.bf16_copy.names() == (("grid_bf16_weight",) if rows else ())


def test_bf16_weight_copy_platform_default():
    """Without the option, sm_90 copies qkv / o / down from 48 rows and nothing else; other platforms and
    the CPU copy nothing; an explicit 0 (or a mapping) overrides the default everywhere."""
    from mxfp8_learner_grid.common.grid_kernels.marlin import DENSE_COPY_DEFAULTS, Bf16WeightCopy, copy_option
    assert DENSE_COPY_DEFAULTS[(9, 0)] == {"qkv_proj": 48, "o_proj": 48, "down_proj": 48}

    def rows(prefix, capability, options):
        return Bf16WeightCopy(LayerSpec(prefix=prefix, kind="linear", device_type="cuda" if capability else "cpu",
                                        act_dtype=torch.bfloat16, n=64, k=256, capability=capability,
                                        options=options)).rows

    for prefix, want in (("model.layers.0.self_attn.qkv_proj", 48), ("model.layers.0.self_attn.o_proj", 48),
                         ("model.layers.0.mlp.down_proj", 48), ("model.layers.0.mlp.gate_up_proj", 0)):
        assert rows(prefix, (9, 0), {}) == want, prefix
        assert rows(prefix, (9, 0), {"bf16_weight_rows": 0}) == 0
        assert rows(prefix, (8, 9), {}) == 0 and rows(prefix, (10, 0), {}) == 0 and rows(prefix, None, {}) == 0
        assert rows(prefix, None, {"bf16_weight_rows": 32}) == 32
    assert rows("model.layers.0.mlp.gate_up_proj", (9, 0), {"bf16_weight_rows": {"gate_up_proj": 16}}) == 16
    assert rows("model.layers.0.self_attn.qkv_proj", (9, 0), {"bf16_weight_rows": {"gate_up_proj": 16}}) == 0
    assert copy_option({}, None) == 0 and copy_option({"bf16_weight_rows": 0}, (9, 0)) == 0


GEMV_BAND = textwrap.dedent("""
    import torch
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
    from mxfp8_learner_grid.common.grid_kernels import LayerSpec
    from mxfp8_learner_grid.common.grid_kernels.w8a16 import W8A16Linear
    g = torch.Generator().manual_seed(0)
    n, k = 48, 256
    wq, ws = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    lay = torch.nn.Module()
    lay.weight = torch.nn.Parameter(wq, requires_grad=False)
    lay.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
    spec = LayerSpec(prefix="t", kind="linear", device_type="cpu", act_dtype=torch.bfloat16, n=n, k=k,
                     options={"gemv_rows": 4})
    kern = W8A16Linear(spec)          # the interpreter stands in for the GPU: construct, not choose
    kern.process_weights_after_loading(lay)
    assert kern.gemv_rows == 4 and "gemv (M <= 4)" in kern.describe() and kern.derived_names(lay) == ()
    from mxfp8_learner_grid.common.grid_kernels.w8a16 import DEFAULT_GEMV_ROWS
    dflt = W8A16Linear(LayerSpec(prefix="t", kind="linear", device_type="cpu", act_dtype=torch.bfloat16, n=n, k=k))
    assert dflt.gemv_rows == DEFAULT_GEMV_ROWS == 8                 # the measured default of this kernel
    w = dequantize_blocks(lay.weight, lay.weight_scale_inv)
    calls = []
    import mxfp8_learner_grid.common.kernels.gemv_triton as GV
    real = GV.grid_gemv
    GV.grid_gemv = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    for m in (1, 4, 5):               # 1 and 4: the GEMV; 5: the W8A16 GEMM
        x = torch.randn(m, k, generator=g, dtype=torch.bfloat16) * 3
        a = dequantize_blocks(*quantize_rows(x))
        exact = (a.double() @ w.double().t()).float().to(torch.bfloat16)
        y = kern.apply(lay, x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        same = (y.view(torch.int16) == exact.view(torch.int16)).float().mean()
        assert same >= 0.99, (m, float(same))
    assert calls == [1, 4], calls
    xq, xs = quantize_rows(torch.randn(2, k, generator=g, dtype=torch.bfloat16))
    wrong = real(xq, (xs.to(torch.int16) + 1).to(torch.uint8), lay.weight, lay.weight_scale_inv, None,
                 torch.bfloat16, config="auto")
    right = real(xq, xs, lay.weight, lay.weight_scale_inv, None, torch.bfloat16, config="auto")
    assert not torch.equal(wrong, right)      # the check above can fail: scales one power of two off
    print("OK")
""")


def test_gemv_band_under_the_interpreter():
    """gemv_rows: rows 1 ... R take the decode GEMV (x quantized to codes + scales), the exact sum rounded
    once; more rows take the kernel's own GEMM."""
    pytest.importorskip("triton")
    run_ok(GEMV_BAND)


def test_gemv_rows_option():
    from mxfp8_learner_grid.common.options import GridOptions
    assert GridOptions.from_dict({"gemv_rows": 16}).raw["gemv_rows"] == 16
    GridOptions.from_dict({"gemv_rows": 0})
    for bad in (-1, True, "16", 65, 4.5):
        with pytest.raises(ValueError, match="gemv_rows"):
            GridOptions.from_dict({"gemv_rows": bad})


def test_marlin_configs_option():
    """marlin_configs: rows of [n, k, lo, hi, block, thread_k, thread_n, blocks_per_sm], parsed once, each
    wrong row named; the rows of one shape flattened per layer and looked up by M."""
    from mxfp8_learner_grid.common.grid_kernels import marlin_launch as L
    from mxfp8_learner_grid.common.options import GridOptions
    rows = [[6144, 4096, 33, 65, 64, 128, 128, 2], [6144, 4096, 1, 33, 32, -1, -1, -1],
            [1536, 2048, 1, 2, 8, 64, 256, 1]]
    assert GridOptions.from_dict({"marlin_configs": rows}).raw["marlin_configs"] == rows
    GridOptions.from_dict({"marlin_configs": []})
    for bad, what in (("6144", "list of rows"), ([[6144, 4096, 1, 33, 32, -1, -1]], "8 integers"),
                      ([[6144, 4096, 33, 33, 32, -1, -1, -1]], "lo < hi"), ([[6144, 4096, 1, 33, 24, -1, -1, -1]],
                                                                            "block must be"),
                      ([[6144, 4096, 1, 33, 32, 256, 64, -1]], "thread_k, thread_n"),
                      ([[6144, 4096, 1, 33, 32, -1, -1, 5]], "blocks_per_sm"),
                      ([[6144, 4096, 1, 33, 32, -1, -1, True]], "8 integers"),
                      ([[6144, 4096, 1, 33, 32, -1, -1, -1], [6144, 4096, 32, 40, 64, -1, -1, -1]], "overlap")):
        with pytest.raises(ValueError, match="marlin_configs.*" + what.replace("(", r"\(").replace(")", r"\)")):
            GridOptions.from_dict({"marlin_configs": bad})
    flat = L.rows_for({"marlin_configs": rows}, 6144, 4096)
    assert flat == [33, 65, 64, 128, 128, 2, 1, 33, 32, -1, -1, -1]
    assert L.lookup(flat, 1) == (32, -1, -1, -1) and L.lookup(flat, 32) == (32, -1, -1, -1)
    assert L.lookup(flat, 33) == (64, 128, 128, 2) and L.lookup(flat, 64) == (64, 128, 128, 2)
    assert L.lookup(flat, 65) is None and L.lookup([], 8) is None and L.lookup(None, 8) is None
    assert L.rows_for({}, 6144, 4096) == [] and L.rows_for({"marlin_configs": rows}, 4096, 4096) == []


def test_one_expert_routing_views():
    """A dense layer as one expert: the alignment is views of constant buffers (no launch), sorted ids
    0 ... padded-1 whose entries >= M are the padding Marlin skips, the padded count read from the arange."""
    from mxfp8_learner_grid.common.grid_kernels import marlin_launch as L
    bufs = L.one_expert_routing("cpu")
    assert L.one_expert_routing("cpu") is bufs
    for m, block in ((1, 8), (33, 32), (64, 64), (65, 64), (L.MAX_ROWS, 64)):
        ids, experts, ntpp, tw = L.one_expert_views(bufs, m, block)
        padded = -(-m // block) * block
        assert ids.data_ptr() == bufs[0].data_ptr() and torch.equal(ids, torch.arange(padded, dtype=torch.int32))
        assert experts.numel() == padded // block and not experts.any()
        assert ntpp.tolist() == [padded] and tw.shape == (m, 1) and bool((tw == 1).all())


def test_marlin_configs_reach_the_kernels(monkeypatch):
    """The dense kernel takes the rows of its own shape (and says so); without Marlin MoE ops it refuses
    them by name; the MoE kernel takes the rows of its two GEMMs."""
    from mxfp8_learner_grid.common.grid_kernels import providers as P
    from mxfp8_learner_grid.common.grid_kernels.marlin import MarlinLinear
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE
    rows = [[6144, 4096, 33, 65, 64, 128, 128, 2], [1536, 2048, 1, 2, 8, 64, 256, 1], [2048, 768, 1, 2, 8, -1, -1, 2]]

    class Dense:
        pass

    class WithMoE(Dense):
        def moe_gemm(self, *a, **kw):
            raise AssertionError("not called on CPU")

    cuda = dict(device_type="cuda", capability=(9, 0), n=6144, k=4096, options={"marlin_configs": rows})
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": WithMoE()})
    kern = MarlinLinear(spec(**cuda))
    assert kern.one_expert == [33, 65, 64, 128, 128, 2]
    assert "marlin MoE as one expert (33 <= M < 65: block 64, tile 128x128, 2 blocks/SM)" in kern.describe()
    assert MarlinLinear(spec(**dict(cuda, n=4096))).one_expert == []
    moe = MarlinMoE(spec(**dict(cuda, kind="moe", n=1536, k=2048, intermediate=768, num_experts=128)))
    assert moe.cfg13 == [1, 2, 8, 64, 256, 1] and moe.cfg2 == [1, 2, 8, -1, -1, 2]
    assert "marlin_configs" in moe.describe()
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": Dense()})
    with pytest.raises(ValueError, match="down_proj: marlin_configs has rows for N=6144, K=4096.*no Marlin MoE op"):
        MarlinLinear(spec(**cuda))


def test_moe_layers_on_the_h200_take_the_measured_default_rows(monkeypatch, caplog):
    """Without the option, a MoE layer on sm_90 takes MOE_DEFAULT_ROWS for its two GEMMs (the
    Qwen3-30B-A3B experts' M = 1 rows); other platforms, other shapes, ``marlin_configs: []`` and rows
    you set take none of them.  A default row the load probe refuses is dropped with a warning; a row
    you set fails the load."""
    from mxfp8_learner_grid.common.grid_kernels import marlin_launch as L
    from mxfp8_learner_grid.common.grid_kernels import providers as P
    from mxfp8_learner_grid.common.grid_kernels.marlin_moe import MarlinMoE

    class WithMoE:
        def moe_gemm(self, *a, **kw):
            raise AssertionError("not called on CPU")
    monkeypatch.setattr(P, "_PROVIDERS", {"marlin": WithMoE()})
    moe30 = dict(device_type="cuda", capability=(9, 0), kind="moe", n=1536, k=2048, intermediate=768,
                 num_experts=128, options={})
    kern = MarlinMoE(spec(**moe30))
    assert kern.cfg13 == [1, 2, 8, 128, 64, 2] and kern.cfg2 == [1, 2, 8, 128, 64, 2]
    assert "marlin_configs defaults" in kern.describe()
    assert L.parse_rows([list(r) for r in L.MOE_DEFAULT_ROWS[(9, 0)]])       # the defaults are valid rows
    for other in (dict(capability=(8, 0)), dict(n=1024, intermediate=512), dict(options={"marlin_configs": []})):
        k = MarlinMoE(spec(**dict(moe30, **other)))
        assert k.cfg13 == [] and k.cfg2 == [] and "launch knobs" not in k.describe(), other
    mine = MarlinMoE(spec(**dict(moe30, options={"marlin_configs": [[1536, 2048, 1, 5, 16, -1, -1, 1]]})))
    assert mine.cfg13 == [1, 5, 16, -1, -1, 1] and mine.cfg2 == [] and "defaults" not in mine.describe()

    def refuse(layer):
        raise ValueError("x.w13: marlin_configs row [1536, 2048, 1, 2, 8, 128, 64, 2]: Marlin MoE refuses it")
    kern._probe_rows = refuse
    with caplog.at_level("WARNING", logger="mxfp8_learner_grid"):
        kern._probe_launch_knobs(None)
    assert kern.cfg13 == [] and kern.cfg2 == [] and "keeps Marlin's own launch" in caplog.text
    mine._probe_rows = refuse
    with pytest.raises(ValueError, match="Marlin MoE refuses it"):
        mine._probe_launch_knobs(None)


def test_marlin_configs_reach_a_layers_spec():
    """The option passes from quantization_config into each layer's spec (the filter of kernel options
    once dropped it: on the H200 the tuned launch then never ran)."""
    from mxfp8_learner_grid.common.grid_kernels.layers import kernel_options
    from mxfp8_learner_grid.common.options import GridOptions
    rows = [[1536, 2048, 1, 2, 8, 128, 64, 2]]
    assert kernel_options(GridOptions.from_dict({"marlin_configs": rows}))["marlin_configs"] == rows
    # the same for moe_single_copy (dropped by that filter in its first GPU run): every kernel option passes
    assert kernel_options(GridOptions.from_dict({"moe_single_copy": True, "gemv_rows": 8})) == {
        "moe_single_copy": True, "gemv_rows": 8}


def test_the_probe_refuses_broken_launches_and_accepts_reordered_sums():
    """marlin_launch.probe: a launch equal up to FP32 summation order passes (most elements bit-equal, a
    few moved by ulps where terms cancel); an op error, an unwritten (non-finite) output and garbage are
    refused, naming the row."""
    from mxfp8_learner_grid.common.grid_kernels.marlin_launch import probe
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(16, 512, generator=g).to(torch.bfloat16)
    row = [512, 256, 1, 17, 8, -1, -1, 2]
    probe(lambda: ref.clone(), lambda: ref, row, "p")
    moved = ref.clone()
    moved.view(-1)[::1000] = (moved.view(-1)[::1000].float() * (1 + 2 ** -7)).to(torch.bfloat16)   # 1-2 ulps
    ref[0, 0], moved[0, 0] = 1e-3, -1e-3              # terms cancelling near zero: the sign moved
    probe(lambda: moved, lambda: ref, row, "p")

    def boom():
        raise RuntimeError("Invalid thread config: thread_m_blocks = 1\nmore")
    with pytest.raises(ValueError, match=r"p: marlin_configs row \[512, 256, 1, 17, 8, -1, -1, 2\]: Marlin MoE "
                                         r"refuses it: Invalid thread config: thread_m_blocks = 1$"):
        probe(boom, lambda: ref, row, "p")
    nan = ref.clone()
    nan[3, 3] = float("nan")
    with pytest.raises(ValueError, match="wrote no valid output"):
        probe(lambda: nan, lambda: ref, row, "p")
    with pytest.raises(ValueError, match=r"differs from Marlin's own \(0\.0"):
        probe(lambda: torch.randn(16, 512, generator=g).to(torch.bfloat16), lambda: ref, row, "p")
    far = ref.clone()
    far[5, 7] = ref[5].float().abs().max() * 0.5
    far[5, 8] = -far[5, 7]
    with pytest.raises(ValueError, match="differs from Marlin's own"):
        probe(lambda: far, lambda: ref, row, "p")
