"""Checks the GPU tests share: the exact result rounded once, FP32-accumulation bounds, grid layers."""

import torch

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
from mxfp8_learner_grid.common.grid_kernels import LayerSpec, choose


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (monotone integer mapping of the bit patterns)."""
    def key(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (key(a) - key(b)).abs()


def exact_bf16(a_grid: torch.Tensor, w_grid: torch.Tensor) -> torch.Tensor:
    return (a_grid.double() @ w_grid.double().t()).to(torch.float32).to(torch.bfloat16)


def fp32_accumulation_stats(y, a_grid, w_grid) -> tuple[float, float]:
    """(equal, worst) of y (bf16) against the exact sum: the fraction of elements equal to the exact result
    rounded to bf16, and the largest error in units of one bf16 ulp plus the FP32 summation bound
    K * 2^-24 * sum|a_k w_k| (where a sum cancels to nearly zero, summation order moves its tiny result by
    many of its own ulps -- TE's GEMMs do the same)."""
    exact = a_grid.double() @ w_grid.double().t()
    ref = exact.to(torch.float32).to(torch.bfloat16)
    bound = a_grid.double().abs() @ w_grid.double().abs().t() * (a_grid.shape[-1] * 2.0 ** -24)
    ulp = ref.double().abs() * 2.0 ** -7 + 2.0 ** -133
    err = (y.double() - exact).abs()
    equal = (y.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
    return equal, (err / (ulp + bound)).max().item()


def check_fp32_accumulation(y, a_grid, w_grid):
    """y (bf16) is the exact sum rounded once, up to FP32 summation order: at least 99 % of the
    elements equal the exact result rounded to bf16, and every element lies within one bf16 ulp
    plus the FP32 summation bound (:func:`fp32_accumulation_stats`)."""
    equal, worst = fp32_accumulation_stats(y, a_grid, w_grid)
    assert equal >= 0.99 and worst <= 1.0, (equal, worst)
    return equal


def adversarial_weights(n, k, seed):
    """e4m3 codes [N, K] drawn from every non-NaN code (E4M3 subnormals included) and E8M0 scale bytes
    100 ... 140 [N, K/32]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)         # no NaN
    scales = torch.randint(100, 141, (n, k // 32), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn), scales


def grid_layer(n, k, seed=0, scale=0.02):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * scale
    wq, ws = quantize_rows(w)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(wq, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)
    return layer


def setup_kernel(layer, kind="linear", **opts):
    n, k = layer.weight.shape
    spec = LayerSpec(prefix="t", kind=kind, device_type="cuda", act_dtype=torch.bfloat16, n=n, k=k,
                     capability=torch.cuda.get_device_capability(), options=opts)
    layer.grid_kernel = choose(spec)
    layer.grid_kernel.process_weights_after_loading(layer)
    layer.grid_processed = True
    return layer.grid_kernel


def x_grid(x):
    q, s = quantize_rows(x)
    return dequantize_blocks(q, s)


def graph_then_update(kern, layer, x, n, k, seed_new=2):
    """Capture ``kern.apply(layer, x)`` in a CUDA graph, update the layer's weights in place to a new grid
    layer (``seed_new``) and refresh it; checks the derived tensors kept their storage, replays the graph and
    checks the output is the new weights' grid result.  Returns the new layer."""
    from mxfp8_learner_grid.common.refresh import refresh_layer
    ptrs = [getattr(layer, d).data_ptr() for d in kern.derived_names(layer)]
    kern.apply(layer, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kern.apply(layer, x)
    new = grid_layer(n, k, seed=seed_new)
    layer.weight.data.copy_(new.weight)
    layer.weight_scale_inv.data.copy_(new.weight_scale_inv)
    refresh_layer(layer)
    assert [getattr(layer, d).data_ptr() for d in kern.derived_names(layer)] == ptrs
    graph.replay()
    check_fp32_accumulation(y, x_grid(x), dequantize_blocks(new.weight, new.weight_scale_inv))
    return new


def require_marlin():
    """vLLM's Marlin ops registered as the ``marlin`` provider, or the test skipped."""
    import pytest
    from mxfp8_learner_grid.common.grid_kernels import providers
    try:
        from mxfp8_learner_grid.vllm_plugin import compat
        compat.register_kernel_providers()
    except Exception:
        pass
    if providers.get("marlin") is None:
        pytest.skip("vLLM's Marlin ops are not available")
