"""``load_format="dummy"``: random but valid on-grid weights, for benchmarks of real shapes.

vLLM's and SGLang's dummy loaders fill floating-point parameters with U(-1e-3, 1e-3) -- which
rounds to almost all zeros in E4M3 -- and leave integer ones (our uint8 scales) as allocated
(garbage, possibly the NaN byte 255).  Timing on zeros flatters a kernel, so both plugins
replace the pair with the on-grid quantization of N(0, 0.02^2) weights, seeded per layer name
(reproducible across ranks and runs).
"""

from __future__ import annotations

import zlib

import torch

from .quantize import quantize_rows

DUMMY_STD = 0.02


@torch.no_grad()
def fill_dummy_grid_weights(weight: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    g = torch.Generator(device=weight.device)
    g.manual_seed(zlib.crc32(name.encode()))
    rows = weight.reshape(-1, weight.shape[-1])
    srows = scale.reshape(-1, scale.shape[-1])
    step = max(1, (1 << 26) // max(1, rows.shape[1]))          # bounded temporary memory
    for i in range(0, rows.shape[0], step):
        w = torch.randn(min(step, rows.shape[0] - i), rows.shape[1], generator=g, device=weight.device,
                        dtype=torch.float32) * DUMMY_STD
        q, s = quantize_rows(w.to(torch.bfloat16))
        rows[i:i + q.shape[0]].copy_(q)
        srows[i:i + s.shape[0]].copy_(s)
