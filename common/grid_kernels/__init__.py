"""Kernels for on-grid layers, chosen once per layer (``choose``) when its weights are processed.

Order of preference (first that ``is_supported`` and ``can_implement`` wins):

* linear: ``marlin`` (activation qdq + vLLM's MXFP8 Marlin, dequantize + cuBLAS from
  ``prefill_crossover`` rows) -> ``w8a16`` (activation qdq + the project's W8A16 Triton GEMM, the
  same cuBLAS prefill; needs nothing from the engine) -> ``triton`` (the project's grid GEMM) ->
  ``torch`` (reference);
* moe:    ``marlin`` (activation qdq + Marlin MoE, SiLU*up quantized between the GEMMs)
  -> ``triton`` -> ``torch``.

The option ``kernel: auto | marlin | w8a16 | triton | torch`` (quantization_config) forces one; a
forced kernel that cannot run a layer is an error naming the layer and the reason.
"""

from __future__ import annotations

import logging
from collections import Counter

from .base import GridKernel, LayerSpec
from .marlin import MarlinLinear
from .marlin_moe import MarlinMoE
from .portable import TorchLinear, TorchMoE, TritonLinear, TritonMoE
from .w8a16 import W8A16Linear

log = logging.getLogger("mxfp8_learner_grid")

KERNELS = {
    "linear": (MarlinLinear, W8A16Linear, TritonLinear, TorchLinear),
    "moe": (MarlinMoE, TritonMoE, TorchMoE),
}
KERNEL_CHOICES = ("auto", "marlin", "w8a16", "triton", "torch")

_seen: Counter = Counter()


def choose(spec: LayerSpec) -> GridKernel:
    forced = spec.options.get("kernel", "auto") or "auto"
    if forced not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}; got {forced!r}")
    candidates = [c for c in KERNELS[spec.kind] if forced == "auto" or c.name == forced]
    skipped = []
    for cls in candidates:
        ok, why = cls.is_supported(spec)
        if ok:
            ok, why = cls.can_implement(spec)
        if ok:
            kernel = cls(spec)
            note = f"; passed over: {'; '.join(skipped)}" if skipped else ""
            key = (spec.kind, kernel.describe(), tuple(skipped))     # each distinct choice once at INFO
            level = logging.INFO if not _seen[key] else logging.DEBUG
            _seen[key] += 1
            log.log(level, "mxfp8-learner-grid: %s %s -> kernel %s%s", spec.kind, spec.prefix, kernel.describe(), note)
            return kernel
        skipped.append(f"{cls.name}: {why}")
    raise ValueError(f"{spec.prefix}: no grid kernel can run this {spec.kind} layer "
                     f"(kernel={forced!r}): {'; '.join(skipped)}")


__all__ = ["GridKernel", "LayerSpec", "KERNELS", "KERNEL_CHOICES", "choose"]
