"""The MoE router's precision: one rule for the engines' routers and for the learner's.

The router stays off the grid (``selection.DEFAULT_EXCLUDE``); what can still differ between
sampler and learner is the precision of its logits.  By default both compute them in the
model dtype (bf16): ``x @ W^T`` accumulated in FP32 and then rounded to bf16, so two logits
closer than a bf16 ulp (2^-8 relative) tie, and a one-ulp difference in x can swap the top-k.

Megatron's ``moe_router_dtype=fp32`` (common in RL) computes the router GEMM in FP32 instead
and keeps the routing probabilities in FP32.  Option ``router_dtype: float32`` does the same
in the sampler: ``router_logits`` below returns FP32 logits of bf16 operands -- products exact
in FP32 (bf16 values are exact in FP32 and in TF32), FP32 accumulation, no rounding to bf16 --
equal to Megatron's ``F.linear(x.float(), W.float())`` up to summation order.  The top-k, the
softmax and the combine then run on FP32 values (vLLM's ``fused_topk`` and the grid MoE's FP32
combine already do).  The learner side is :func:`mxfp8_learner_grid.common.learner.set_router_dtype`.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

import torch

#: option value -> torch dtype of the router logits (None: the model dtype, the default)
ROUTER_DTYPES: dict[str, Optional[torch.dtype]] = {"model": None, "float32": torch.float32, "fp32": torch.float32}
#: module names of MoE routers (Qwen2/3-MoE, Mixtral: ``mlp.gate``; others: ``router``)
ROUTER_PATTERNS = ("*.mlp.gate", "*.router", "*.mlp.router", "*.block_sparse_moe.gate")


def parse_router_dtype(value: Any) -> Optional[torch.dtype]:
    """``router_dtype`` option -> dtype (None: the model dtype).  Unknown values raise, naming the option."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in ROUTER_DTYPES:
        raise ValueError(f"router_dtype must be one of {sorted(ROUTER_DTYPES)}; got {value!r}")
    return ROUTER_DTYPES[value]


def is_router(prefix: str) -> bool:
    """Is the module ``prefix`` an MoE router (by name, as the default selection excludes them)?"""
    return any(fnmatch.fnmatchcase(prefix, p) for p in ROUTER_PATTERNS)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` computed in ``dtype`` (FP32): Megatron's ``moe_router_dtype=fp32``.

    bf16 operands on CUDA: cuBLAS with FP32 output (``torch.mm(..., out_dtype=float32)``), which
    accumulates in FP32 and never rounds to bf16 -- no upcast copies of x or W.  Elsewhere (CPU,
    or operands already in ``dtype``): both operands upcast (exact) and one FP32 GEMM."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if (dtype == torch.float32 and x2.is_cuda and x2.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        y = torch.mm(x2, weight.t(), out_dtype=torch.float32)
    else:
        y = torch.nn.functional.linear(x2.to(dtype), weight.to(dtype))
    if bias is not None:
        y = y + bias.to(dtype)
    return y.reshape(*lead, weight.shape[0])
