"""The grid's compute as PyTorch custom ops, with the kernel chosen per device.

Both engines call these two ops; ``torch.compile`` sees them as opaque nodes and CUDA
graphs capture them like any other op (no host sync, static shapes):

* ``mxfp8_learner_grid::linear(x, weight, weight_scale_inv, bias)`` -- a Linear on the grid.
* ``mxfp8_learner_grid::moe(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
  expert_map)`` -- a SiLU-gated MoE layer on the grid (gate and up fused as w13 = [gate; up]).

Kernel choice (``choose_backend``): CUDA tensors with Triton use the Triton kernels of
``common/kernels``; anything else uses the PyTorch reference (``common/linear.py``), which
is the CPU path of both plugins.  ``MXFP8_GRID_BACKEND=torch`` (read once, at import) forces
the reference.  Which kernel a layer uses is chosen once per layer by ``common.grid_kernels``;
these ops are the portable ones it picks from.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as Fn

from .kernels import triton_available
from .linear import mxfp8_linear_reference
from .quantize import quantize_rows
from .tensor import dequantize_blocks


def _forced_backend() -> str:
    forced = os.environ.get("MXFP8_GRID_BACKEND", "auto")
    if forced not in ("auto", "torch", "triton"):
        raise ValueError(f"MXFP8_GRID_BACKEND must be auto, torch or triton; got {forced!r}")
    return forced


#: read once, at import (never on the hot path)
FORCED_BACKEND = _forced_backend()


def choose_backend(x: torch.Tensor) -> str:
    forced = FORCED_BACKEND
    if forced == "torch":
        return "torch"
    if triton_available(x):
        return "triton"
    if forced == "triton":
        raise RuntimeError("MXFP8_GRID_BACKEND=triton needs Triton and CUDA tensors")
    return "torch"


# -- linear ------------------------------------------------------------------------------

def linear_impl(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    if choose_backend(x) == "torch":
        return mxfp8_linear_reference(x, weight, weight_scale_inv, bias)
    from .kernels.gemm_triton import grid_gemm
    k = x.shape[-1]
    xq, xs = quantize_rows(x.reshape(-1, k), backend="triton")
    y = grid_gemm(xq, xs, weight, weight_scale_inv, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mxfp8_learner_grid::linear", mutates_args=())
def grid_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x W^T on the learner's grid (x quantized rowwise as TE does; FP32 accumulation)."""
    return linear_impl(x, weight, weight_scale_inv, bias)


@grid_linear.register_fake
def _(x, weight, weight_scale_inv, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("mxfp8_learner_grid::linear_reference", mutates_args=())
def grid_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                          bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The grid Linear by its PyTorch definition, on any device (``kernel: torch``)."""
    return mxfp8_linear_reference(x, weight, weight_scale_inv, bias)


@grid_linear_reference.register_fake
def _(x, weight, weight_scale_inv, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("mxfp8_learner_grid::linear_dequantized", mutates_args=())
def grid_linear_dequantized(x: torch.Tensor, weight_dequantized: torch.Tensor,
                            bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The grid Linear with W's exact fp32 values precomputed (a derived copy the caller keeps in sync)."""
    return mxfp8_linear_reference(x, weight_dequantized, None, bias, weight_dequantized=weight_dequantized)


@grid_linear_dequantized.register_fake
def _(x, weight_dequantized, bias):
    return x.new_empty((*x.shape[:-1], weight_dequantized.shape[0]))


# -- MoE ----------------------------------------------------------------------------------

def local_expert_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Global expert ids -> this rank's local ids (-1: not on this rank)."""
    if expert_map is None:
        return topk_ids.to(torch.int64)
    return expert_map.to(torch.int64)[topk_ids.to(torch.int64)]


def weighted_activation(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Megatron's ``weighted_bias_swiglu`` (TEGroupedMLP, ``jit_fuser`` = torch.compile): SiLU(g) * u
    * w computed in FP32 and rounded once to g's dtype -- the down projection's input when the
    router weights multiply the activation (option ``moe_router_weights: activation``)."""
    return (Fn.silu(g.to(torch.float32)) * u.to(torch.float32) * w.to(torch.float32)).to(g.dtype)


def moe_reference(x, w13, w13_s, w2, w2_s, topk_weights, local_ids, weights_on_activation: bool = False):
    """Per-expert loop: the definition (CPU path).  Routed rows of x quantized once (rowwise),
    gate_up on the grid, SiLU(gate) * up in x's dtype, down on the grid, router weight, sum in FP32.
    ``weights_on_activation`` (Megatron's order): the router weight multiplies the activation
    instead (``weighted_activation``), before the down projection quantizes it; the experts'
    outputs are then summed unweighted, in FP32 (Megatron's fused unpermute)."""
    t, h = x.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    xq, xs = quantize_rows(x)
    xa = dequantize_blocks(xq, xs)
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():
        tok, pos = torch.where(local_ids == e)
        gu = (xa[tok] @ dequantize_blocks(w13[e], w13_s[e]).t()).to(x.dtype)
        g, u = gu.chunk(2, dim=-1)
        w = topk_weights[tok, pos, None]
        if weights_on_activation:
            d = mxfp8_linear_reference(weighted_activation(g, u, w), w2[e], w2_s[e])
            out.index_add_(0, tok, d.to(torch.float32))
        else:
            d = mxfp8_linear_reference(Fn.silu(g) * u, w2[e], w2_s[e])
            out.index_add_(0, tok, d.to(torch.float32) * w.to(torch.float32))
    return out.to(x.dtype)


def moe_plain_reference(x, w13, w2, topk_weights, local_ids):
    """The same SiLU-gated MoE layer off the grid, in x's dtype (per-expert loop; the CPU path of
    experts a module selection leaves out).  w13: [E, 2I, H] (gate rows, then up rows), w2: [E, H, I]."""
    t, h = x.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():
        tok, pos = torch.where(local_ids == e)
        g, u = Fn.linear(x[tok], w13[e]).chunk(2, dim=-1)
        d = Fn.linear(Fn.silu(g) * u, w2[e])
        out.index_add_(0, tok, d.to(torch.float32) * topk_weights[tok, pos, None].to(torch.float32))
    return out.to(x.dtype)


def moe_triton(x, w13, w13_s, w2, w2_s, topk_weights, local_ids):
    from .kernels.gemm_triton import grid_moe_gemm, moe_align, moe_block_m
    t, h = x.shape
    topk = local_ids.shape[1]
    slots = t * topk
    bm = moe_block_m(slots)
    sorted_ids, block_expert = moe_align(local_ids, w13.shape[0], bm)
    xq, xs = quantize_rows(x, backend="triton")
    gu = grid_moe_gemm(xq, xs, w13, w13_s, sorted_ids, block_expert, slots, topk, True, None, x.dtype, bm)
    g, u = gu.chunk(2, dim=-1)
    aq, as_ = quantize_rows(Fn.silu(g) * u, backend="triton")
    # each expert's down output is rounded to x's dtype (the expert GEMM's output, as in the reference
    # and the learner), then weighted and summed in FP32: a down GEMM that kept its FP32 sum and
    # applied the router weight in its epilogue was off the reference by that rounding (2.6e-3
    # relative in bf16, seen inside SGLang on the H200)
    d = grid_moe_gemm(aq, as_, w2, w2_s, sorted_ids, block_expert, slots, topk, False, None, x.dtype, bm)
    d = d.to(torch.float32) * topk_weights.reshape(-1, 1).to(torch.float32)
    # slots routed to experts of other ranks were never written: mask them out
    d = torch.where((local_ids.reshape(-1, 1) >= 0), d, torch.zeros((), dtype=d.dtype, device=d.device))
    return d.reshape(t, topk, h).sum(dim=1).to(x.dtype)


@torch.library.custom_op("mxfp8_learner_grid::moe", mutates_args=())
def grid_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
             w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             expert_map: Optional[torch.Tensor], weights_on_activation: bool = False,
             gemv_slots: int = 0) -> torch.Tensor:
    """A SiLU-gated MoE layer on the grid.  w13: [E, 2I, H] (gate rows, then up rows), w2: [E, H, I].
    ``weights_on_activation``: Megatron's order (see ``moe_reference``; the reference loop only).
    ``gemv_slots``: on the Triton path, up to that many routed slots by the expert GEMV
    (``grid_kernels/moe_gemv.py``)."""
    local_ids = local_expert_ids(topk_ids, expert_map)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if weights_on_activation or choose_backend(x) == "torch":
        return moe_reference(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, local_ids, weights_on_activation)
    if x.dtype == torch.bfloat16 and x.shape[0] * topk_ids.shape[1] <= gemv_slots:
        from .grid_kernels.moe_gemv import moe_decode_gemv
        return moe_decode_gemv(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, expert_map,
                               w2.shape[2])
    return moe_triton(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, local_ids)


@grid_moe.register_fake
def _(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, expert_map, weights_on_activation=False,
      gemv_slots=0):
    return torch.empty_like(x)
