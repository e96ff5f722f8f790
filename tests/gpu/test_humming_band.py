"""The humming band (option ``humming_rows``: humming-kernels' W8A16 wgmma GEMM on qdq(x), stream-K off) is
the grid, and its derived tensors follow every update in place.

Needs a CUDA GPU of sm_90 and humming-kernels able to build its kernels (its JIT: g++, NVRTC, CUDA 13 headers;
``benchmarks/humming_env.sh`` on the H200); skipped otherwise.  Engine-free: the band runs inside the
``w8a16`` kernel here (and inside ``marlin`` where vLLM's ops are importable).
"""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    humming = pytest.importorskip("humming")

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows  # noqa: E402
from mxfp8_learner_grid.common.grid_kernels import humming as H  # noqa: E402

from .grid_checks import adversarial_weights, bf16_ulps, check_fp32_accumulation, exact_bf16, graph_then_update, \
    grid_layer, require_marlin, setup_kernel, x_grid  # noqa: E402

BAND = [1, H.HUMMING_MAX_ROWS + 1]


@pytest.fixture(scope="module", autouse=True)
def humming_builds():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the humming band is checked on sm_90 only")
    try:
        layer = grid_layer(256, 256)
        setup_kernel(layer, kernel="w8a16", humming_rows=[1, 17], gemv_rows=0)
        layer.grid_kernel.apply(layer, torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))
    except Exception as exc:                                     # its JIT toolchain is missing on this machine
        pytest.skip(f"humming cannot build its kernels here: {type(exc).__name__}: {str(exc)[:300]}")


def test_derived_layouts_equal_hummings_own():
    """Our repacked weight, E8M0 scale layout and layer meta are humming's own (HummingLayer.transform)."""
    from humming.layer import HummingLayer
    n, k = 6144, 4096
    q, s = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    with torch.device("cuda"):
        lay = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(H.WEIGHT_CONFIG), torch_dtype=torch.bfloat16)
    lay.load_from_tensors({"weight": q.view(torch.int32), "weight_scale": s.view(torch.float8_e8m0fnu)})
    lay.transform()
    assert torch.equal(H.humming_weight(q).view(torch.int32), lay.weight.view(torch.int32))
    assert torch.equal(H.humming_scales(s), lay.weight_scale.view(torch.uint8))
    assert json.loads(H.layer_config(n, k)) == json.loads(lay.humming_metas[""].to_str())


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1024, 4096)])
@pytest.mark.parametrize("m", [1, 16, 17, 33, 64, 100, 128])
def test_band_exact(n, k, m):
    layer = grid_layer(n, k, seed=m)
    kern = setup_kernel(layer, kernel="w8a16", humming_rows=BAND, gemv_rows=0)
    assert kern.humming.on, kern.describe()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = kern.apply(layer, x)
    w = dequantize_blocks(layer.weight, layer.weight_scale_inv)
    check_fp32_accumulation(y, x_grid(x), w)
    assert torch.equal(y.view(torch.int16), kern.apply(layer, x).view(torch.int16))     # run to run
    # negative control: humming on x NOT quantized (vLLM's mxfp8 with humming) misses most elements
    raw = H.humming_gemm(x, layer.grid_humming_weight, layer.grid_humming_scale, layer.grid_humming_locks,
                         kern.humming.layer_cfg, kern.humming.tuning)
    assert (bf16_ulps(raw, exact_bf16(x_grid(x), w)) == 0).float().mean().item() < 0.9


def test_band_exact_on_adversarial_weights():
    """Every non-NaN E4M3 code (subnormals included) and scale bytes 100 ... 140."""
    n, k, m = 2048, 4096, 64
    codes, scales = adversarial_weights(n, k, 3)
    layer = grid_layer(n, k)
    layer.weight.data.copy_(codes)
    layer.weight_scale_inv.data.copy_(scales)
    kern = setup_kernel(layer, kernel="w8a16", humming_rows=BAND, gemv_rows=0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4
    check_fp32_accumulation(kern.apply(layer, x), x_grid(x), dequantize_blocks(layer.weight, layer.weight_scale_inv))


def test_refresh_in_place_under_cuda_graph_and_stale_copy_caught():
    from mxfp8_learner_grid.common.grid_kernels.layers import register_kernel_derived
    from mxfp8_learner_grid.common.sync.derived import DerivedRegistry
    n, k, m = 4096, 4096, 48
    model = torch.nn.Module()
    model.dense = grid_layer(n, k, seed=1)
    kern = setup_kernel(model.dense, kernel="w8a16", humming_rows=BAND, gemv_rows=0)
    layer = model.dense
    assert kern.derived_names(layer) == H.HummingBand.NAMES
    graph_then_update(kern, layer, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), n, k)
    reg = DerivedRegistry()
    assert register_kernel_derived(model, reg) == 2
    assert reg.stale() == []
    layer.grid_humming_weight.view(torch.uint8)[0, :8] ^= 1
    layer.grid_humming_scale.view(torch.uint8)[2, 5] += 1
    assert sorted(reg.stale()) == ["dense.grid_humming_scale", "dense.grid_humming_weight"]


def test_band_inside_marlin_kernel():
    require_marlin()
    n, k = 6144, 4096
    layer = grid_layer(n, k, seed=4)
    kern = setup_kernel(layer, humming_rows=[17, 129])
    assert kern.name == "marlin" and kern.humming.on, kern.describe()
    w = dequantize_blocks(layer.weight, layer.weight_scale_inv)
    for m in (8, 17, 64, 128, 129):                             # Marlin, humming, humming, humming, Marlin
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        check_fp32_accumulation(kern.apply(layer, x), x_grid(x), w)
