"""Option ``producer_qdq`` on the GPU: the fused RMSNorm + qdq kernel, and a Marlin layer fed grid input.

* ``rms_norm_qdq``: its output is bit for bit ``qdq_rows`` of the bf16 value the norm computed; that value
  equals vLLM's native RMSNorm (torch, eager) in nearly every element (fp32 summation order, rsqrt), and
  the residual sum exactly.
* A Marlin layer told that its input is on the grid (``take_grid_input``) returns, for that input, what
  the same layer returns when it quantizes the producer's bf16 value itself -- at every M band (decode
  GEMV or Marlin, the bf16 copy from 48 rows, dequantize + cuBLAS) -- and both are the exact grid Linear.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from mxfp8_learner_grid.common import dequantize_blocks  # noqa: E402
from native_ops import rms_norm_native  # noqa: E402  (tests/ is on the path: tests/gpu is a package)

from .grid_checks import check_fp32_accumulation, grid_layer, require_marlin, setup_kernel, x_grid  # noqa: E402


@pytest.mark.parametrize("m", [1, 7, 64, 2048])
@pytest.mark.parametrize("k", [2048, 4096, 5120])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_qdq_is_qdq_of_the_native_norm(m, k, residual):
    from mxfp8_learner_grid.common.kernels.producer_qdq_triton import rms_norm_qdq
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * 4).to(torch.bfloat16)
    r = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) if residual else None
    w = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    out = rms_norm_qdq(x, w, 1e-6, r, return_value=True)
    y, o = out[0], out[-1]
    assert torch.equal(y.view(torch.int16), qdq_rows(o, torch.bfloat16).view(torch.int16))
    ref_o, ref_r = rms_norm_native(x, r, w, 1e-6)
    equal = (o.view(torch.int16) == ref_o.view(torch.int16)).float().mean().item()
    assert equal >= 0.99, equal
    if residual:
        assert torch.equal(out[1].view(torch.int16), ref_r.view(torch.int16))
    assert not torch.equal(o.view(torch.int16), y.view(torch.int16))        # the norm's value is off the grid


@pytest.fixture(scope="module")
def marlin():
    require_marlin()


@pytest.mark.parametrize("n,k", [(6144, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 16, 47, 48, 64, 300, 2048])
def test_marlin_layer_on_grid_input_equals_its_own_qdq(marlin, n, k, m):
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    layer = grid_layer(n, k, seed=n + k + m)
    kern = setup_kernel(layer, bf16_weight_rows={"*": 48})
    assert kern.accepts_grid_input and not kern.x_on_grid
    o = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)         # the producer's bf16 value
    y_self = kern.apply(layer, o)                                          # the layer's own qdq
    kern.take_grid_input()
    y_fed = kern.apply(layer, qdq_rows(o, torch.bfloat16))                 # the producer's grid values
    assert "input qdq done by its producer" in kern.describe()
    assert torch.equal(y_fed.view(torch.int16), y_self.view(torch.int16))
    check_fp32_accumulation(y_fed, x_grid(o), dequantize_blocks(layer.weight, layer.weight_scale_inv))
    # a negative control: fed the off-grid value itself, the layer no longer computes the grid Linear
    y_raw = kern.apply(layer, o)
    if m > kern.gemv_rows:                   # (the decode GEMV quantizes its input in any case)
        assert not torch.equal(y_raw.view(torch.int16), y_self.view(torch.int16))
