"""The dense grid Linear with nothing from an engine and nothing derived: activation qdq, then the
project's swapped W8A16 Triton GEMM (``kernels/w8a16_triton``) below ``prefill_crossover`` rows and
W decoded to a bf16 scratch + cuBLAS from there (``marlin.dequant_cublas``); rows 1 ... ``gemv_rows``
(default :data:`DEFAULT_GEMV_ROWS`, measured) go to the decode GEMV (``marlin.grid_gemv_linear``).

It reads the layer's own fp8 codes and E8M0 scales, so a weight update needs no repack and the
``derived_state`` check has nothing to rebuild for it -- unless the option ``bf16_weight_rows``
asks for a resident bf16 copy of W (``marlin.Bf16WeightCopy``).  It is the fast path where the engine ships no
MXFP8 Marlin (SGLang), and the W8A16 band of the Marlin kernel (option ``w8a16_rows``) in vLLM.
Exactness: see ``kernels/w8a16_triton`` (both MMA operands are the exact grid values in bf16, FP32
accumulation, deterministic split-K, one rounding).
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import GridKernel, bf16_output_no_bias
from .marlin import DEFAULT_PREFILL_CROSSOVER, Bf16WeightCopy, check_bf16_exact_weights, cublas_fp32_reduction, \
    dequant_cublas, gemv_band, grid_gemv_linear, guard_bf16_exact_weights


@torch.library.custom_op("mxfp8_learner_grid::linear_w8a16", mutates_args=())
def linear_w8a16(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 crossover: int, w_bf16: Optional[torch.Tensor] = None, bf16_rows: int = 0,
                 gemv_rows: int = 0, hum_w: Optional[torch.Tensor] = None, hum_s: Optional[torch.Tensor] = None,
                 hum_locks: Optional[torch.Tensor] = None, hum_lo: int = 0, hum_hi: int = 0, hum_cfg: str = "",
                 hum_tuning: str = "") -> torch.Tensor:
    """The grid Linear (bf16, no bias): the decode GEMV (M <= gemv_rows), else qdq(x), then cuBLAS on
    the resident bf16 copy ``w_bf16`` (given, and M >= bf16_rows), dequantize + cuBLAS (M >= crossover),
    humming (hum_lo <= M < hum_hi) or W8A16."""
    from ..kernels.qdq_triton import qdq_rows
    from ..kernels.w8a16_triton import w8a16_gemm
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    if x2.shape[0] <= gemv_rows:
        return grid_gemv_linear(x2, weight, weight_scale_inv).reshape(*x.shape[:-1], n)
    a = qdq_rows(x2, torch.bfloat16)
    if w_bf16 is not None and x2.shape[0] >= bf16_rows:
        y = cublas_fp32_reduction(a, w_bf16)
    elif x2.shape[0] >= crossover:
        y = dequant_cublas(a, weight, weight_scale_inv)
    elif hum_lo <= x2.shape[0] < hum_hi:
        from .humming import run_band
        y = run_band(a, hum_w, hum_s, hum_locks, hum_cfg, hum_tuning)
    else:
        y = w8a16_gemm(a, weight, weight_scale_inv)
    return y.reshape(*x.shape[:-1], n)


@linear_w8a16.register_fake
def _(x, weight, weight_scale_inv, crossover, w_bf16=None, bf16_rows=0, gemv_rows=0, hum_w=None, hum_s=None,
      hum_locks=None, hum_lo=0, hum_hi=0, hum_cfg="", hum_tuning=""):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


#: rows 1 ... 8 take the decode GEMV by default: measured on the H200 (benchmarks/bench_fast_path.py, commit
#: e709ed0, 2026-12-01), summed over the Qwen3-8B and -30B-A3B projections the GEMV beats this W8A16 GEMM
#: at M = 1, 2, 4, 8 (139.7 against 151.1 us at M = 1) and loses from M = 16 (157.1 against 155.0)
DEFAULT_GEMV_ROWS = 8


class W8A16Linear(GridKernel):
    name = "w8a16"
    kind = "linear"

    @classmethod
    def is_supported(cls, spec):
        from .portable import triton_supported
        return triton_supported(spec)

    @classmethod
    def can_implement(cls, spec):
        from ..kernels.w8a16_triton import w8a16_shape_ok
        ok, why = bf16_output_no_bias(spec, "the W8A16 GEMM")
        if not ok:
            return ok, why
        if not w8a16_shape_ok(spec.k):
            return False, f"K={spec.k} is not a multiple of 128"
        return True, ""

    def __init__(self, spec):
        super().__init__(spec)
        self.crossover = int(spec.options.get("prefill_crossover", DEFAULT_PREFILL_CROSSOVER))
        self.bf16_copy = Bf16WeightCopy(spec)
        self.gemv_rows = gemv_band(spec, DEFAULT_GEMV_ROWS)
        from .humming import HummingBand
        self.humming = HummingBand(spec)

    def derived_names(self, layer):
        return self.bf16_copy.names() + self.humming.names()

    def process_weights_after_loading(self, layer) -> None:
        check_bf16_exact_weights(layer.weight_scale_inv, layer.weight, self.spec.prefix)
        self.bf16_copy.process(self, layer)
        self.humming.process(self, layer)

    def refresh(self, layer, experts=None) -> None:
        guard_bf16_exact_weights(layer.weight_scale_inv, layer.weight, self.spec.prefix)
        self.bf16_copy.refresh(layer)
        self.humming.refresh(layer)

    def derived(self, layer):
        return {**self.bf16_copy.derived(layer), **self.humming.derived(layer)}

    def apply(self, layer, x, bias: Optional[torch.Tensor] = None):
        return torch.ops.mxfp8_learner_grid.linear_w8a16(x, layer.weight, layer.weight_scale_inv, self.crossover,
                                                          self.bf16_copy.tensor(layer), self.bf16_copy.rows,
                                                          self.gemv_rows, *self.humming.args(layer))

    def describe(self):
        gemv = f"gemv (M <= {self.gemv_rows}) + " if self.gemv_rows else ""
        return (f"{gemv}w8a16 Triton (M < {self.crossover}) + dequantize/cuBLAS (M >= {self.crossover})"
                f"{self.bf16_copy.describe()}{self.humming.describe()}")
