"""Read-only views of a live engine's model, for ``LLM.apply_model`` / ``collective_rpc``.

Module-level functions (vLLM pickles them by reference into its workers).
"""

from __future__ import annotations

import hashlib

import torch


def param_digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every parameter's bytes, with dtype and shape: ``name -> "hex|dtype|shape"``."""
    out = {}
    for name, p in model.named_parameters():
        b = p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        out[name] = f"{hashlib.sha256(b).hexdigest()}|{p.dtype}|{tuple(p.shape)}"
    return out


def quant_methods(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> class name of its quant method (which layers are on the grid)."""
    return {n: type(m.quant_method).__name__ for n, m in model.named_modules() if hasattr(m, "quant_method")}


def kv_scales(model: torch.nn.Module) -> dict[str, list]:
    """Attention layer -> [k_scale, v_scale, kv_cache_dtype] as the engine uses them."""
    out = {}
    for n, m in model.named_modules():
        if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype"):
            out[n] = [float(m._k_scale), float(m._v_scale), str(m.kv_cache_dtype)]
    return out


def grid_kernels(model: torch.nn.Module) -> dict[str, str]:
    """On-grid module name -> the kernel it chose (common.grid_kernels), with its description."""
    return {n: m.grid_kernel.describe() for n, m in model.named_modules() if getattr(m, "grid_kernel", None) is not None}


def stale_derived(model: torch.nn.Module) -> list[str]:
    """Derived tensors of the on-grid kernels (packed weights, permuted scales, decoded copies)
    that differ from a rebuild from the layer's current bytes: ``owner.name`` each; [] when all
    are consistent."""
    from ..common.grid_kernels.layers import register_kernel_derived
    from ..common.sync.derived import DerivedRegistry
    reg = DerivedRegistry()
    register_kernel_derived(model, reg)
    return reg.stale()


def derived_ptrs(model: torch.nn.Module) -> dict[str, int]:
    """``owner.name`` -> data pointer of every derived tensor of the on-grid kernels: storage that
    captured CUDA graphs read must never move."""
    return {f"{n}.{d}": t.data_ptr() for n, m in model.named_modules() if getattr(m, "grid_kernel", None) is not None
            for d, (t, _) in m.grid_kernel.derived(m).items()}
