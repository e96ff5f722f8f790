"""CPU and CUDA give the same MXFP8 bytes (the Triton kernel against the torch reference).

Skipped without a GPU.  Last run on an H200 (device kind nvidia-h200-x2, GPU 0, torch 2.11 +
triton 3.6) on 2026-11-30: all passed (BENCHMARKS.md, "GPU test runs").
"""

import numpy as np
import pytest
import torch

from mxfp8_learner_grid.common import quantize_mxfp8, quantize_rows

pytestmark = pytest.mark.gpu

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def poison_allocator(nbytes=1 << 26):
    # leave garbage in the caching allocator so that unwritten outputs show up as mismatches
    t = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del t


def special_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-45, 38, shape[-1], dtype=torch.float64) if dtype == torch.float32 else \
        x * torch.logspace(-30, 30, shape[-1], dtype=torch.float64)
    x = x.to(dtype)
    f = x.view(-1)
    n = f.numel()
    idx = torch.randint(0, n, (64,), generator=g)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 448.0, -448.0, 2.0 ** -130],
                            dtype=torch.float64).to(dtype)
    f[idx] = specials[torch.arange(64) % len(specials)]
    f[: min(n, 96)] = 0                       # a zero block (rowwise) at the start
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (128, 4096), (4096, 96), (3, 64, 320), (1056, 2080)])
@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)])
def test_cpu_cuda_same_bytes(dtype, shape, usage):
    x = special_input(shape, dtype, seed=hash((shape, str(dtype), usage)) % 2**31)
    ref = quantize_mxfp8(x, *usage, backend="torch")
    poison_allocator()
    got = quantize_mxfp8(x.cuda(), *usage, backend="triton")
    for f in FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), f


@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 64, 333])
def test_rows_cpu_cuda_same_bytes(m):
    x = special_input((m, 4096), torch.bfloat16, seed=m)
    rq, rs = quantize_rows(x, backend="torch")
    poison_allocator()
    gq, gs = quantize_rows(x.cuda(), backend="triton")
    assert torch.equal(rq.view(torch.uint8), gq.cpu().view(torch.uint8))
    assert torch.equal(rs, gs.cpu())


def test_hardware_cast_at_every_rounding_boundary():
    """Every E4M3 value, midpoint and fp32 neighbour, at s = 1 (each row's first value is 448)."""
    import sys, os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from test_format_rules import _e4m3_probe_values
    v = _e4m3_probe_values()
    v = v[np.abs(v) <= 448]
    n = -(-len(v) // 31)
    rows = np.zeros((n, 31), dtype=np.float32)
    rows.reshape(-1)[: len(v)] = v
    x = torch.from_numpy(np.concatenate([np.full((n, 1), 448.0, dtype=np.float32), rows], axis=1))
    x = torch.cat([x, torch.zeros((-n) % 32, 32)])
    ref = quantize_mxfp8(x, backend="torch")
    got = quantize_mxfp8(x.cuda(), backend="triton")
    assert torch.equal(ref.rowwise_data.view(torch.uint8), got.rowwise_data.cpu().view(torch.uint8))


def test_random_fp32_bit_patterns():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (2048, 2048), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    ref = quantize_mxfp8(x, True, True, backend="torch")
    got = quantize_mxfp8(x.cuda(), True, True, backend="triton")
    for f in FIELDS:
        assert torch.equal(getattr(ref, f).view(torch.uint8), getattr(got, f).cpu().view(torch.uint8)), f
