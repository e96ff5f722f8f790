"""What both plugins do with a layer's kernel: build its spec from the layer, and register its
derived tensors for the ``derived_state`` check."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..options import KERNEL_KEYS as KERNEL_OPTION_KEYS   # options a layer's kernel reads (the one list)
from .base import GridKernel, LayerSpec

#: load-time override of ``cpu_weight_cache`` (0: no fp32 copy of W on CPU; saves memory)
CPU_CACHE_ENV = "MXFP8_GRID_CPU_CACHE"


def kernel_options(quant_config: Any) -> dict:
    """The kernel options of a plugin's quant config (its GridOptions' raw dict), env override applied."""
    opts = getattr(quant_config, "options", None)
    raw = dict(getattr(opts, "raw", None) or getattr(quant_config, "raw", None) or {})
    out = {k: raw[k] for k in KERNEL_OPTION_KEYS if k in raw}
    env = os.environ.get(CPU_CACHE_ENV)
    if env is not None:
        out["cpu_weight_cache"] = env != "0"
    return out


def layer_spec(quant_config: Any, prefix: str, kind: str, weight: torch.Tensor, act_dtype: torch.dtype, **facts) -> LayerSpec:
    dev = weight.device
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    return LayerSpec(prefix=prefix, kind=kind, device_type=dev.type, act_dtype=act_dtype, capability=cap,
                     options=kernel_options(quant_config), **facts)


def choose_for_linear(quant_config: Any, prefix: str, layer) -> "GridKernel":
    """The kernel of an on-grid Linear (``weight`` [N, K] fp8), chosen once from the layer's facts."""
    from . import choose
    n, k = layer.weight.shape
    return choose(layer_spec(quant_config, prefix, "linear", layer.weight, layer.grid_act_dtype, n=n, k=k,
                             has_bias=getattr(layer, "bias", None) is not None))


def choose_for_moe(quant_config: Any, prefix: str, layer) -> "GridKernel":
    """The kernel of on-grid fused experts (``w13_weight`` [E, 2I, H] fp8), chosen once."""
    from . import choose
    e, two_i, h = layer.w13_weight.shape
    return choose(layer_spec(quant_config, prefix, "moe", layer.w13_weight, layer.grid_act_dtype, n=two_i, k=h,
                             intermediate=two_i // 2, num_experts=e))


def register_kernel_derived(model: torch.nn.Module, registry) -> int:
    """Register every derived tensor of every on-grid layer's kernel; returns how many."""
    n = 0
    for name, m in model.named_modules():
        kernel = getattr(m, "grid_kernel", None)
        if kernel is None or not getattr(m, "grid_processed", False):
            continue
        for dname, (tensor, builder) in kernel.derived(m).items():
            registry.register(name, dname, tensor, builder)
            n += 1
    return n
