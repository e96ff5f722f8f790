"""vLLM's native (torch) definitions of the ops the fused producers replace, as the tests compare with them."""

import torch


def rms_norm_native(x, r, w, eps):
    """vllm.ir.ops.rms_norm / fused_add_rms_norm, native definition: (normed, residual sum or None)."""
    s = x.float()
    ro = None
    if r is not None:
        s = s + r.float()
        ro = s.to(torch.bfloat16)
    var = s.pow(2).mean(-1, keepdim=True)
    return (s * torch.rsqrt(var + eps)).to(torch.bfloat16) * w, ro
