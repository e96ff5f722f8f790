"""Option ``moe_gemv_slots: S`` of the GPU MoE kernels: at decode sizes (tokens x top-k <= S routed
slots) the experts run the project's expert GEMV (``kernels/moe_gemv_triton``) instead of the grouped
GEMM (Marlin MoE in vLLM, the Triton grouped GEMM in SGLang).

The layer in the reference's order (``ops.moe_reference``), with exact operands:

1. x quantized TE-exactly to codes + E8M0 scales (one Triton pass);
2. gate_up = the expert GEMV per slot, FP32 accumulation, rounded once to bf16;
3. ``silu(gate) * up`` in bf16 and its grid values (``moe_triton.silu_mul_qdq``, bit-equal to the
   torch ops), then those values as codes + scales again (re-quantizing grid values returns the
   same values: every block's amax is already on the grid);
4. down = the expert GEMV per slot (rounded once to bf16);
5. the router weights applied in FP32 and the top-k slots summed in FP32 in k order, one cast
   (``moe_triton.moe_combine``).

No slot sort (each program owns one slot), no atomics, nothing derived: the kernel reads the
layer's own fp8 codes and scales, so an update needs no repack.  Slots of other ranks' experts
(expert parallel) read no weight and are written as zeros.  Six launches a layer (the two quantizes,
the two GEMVs, the SiLU*up qdq, the combine) and nothing between them: the GEMV reads each slot's
token row (slot // top-k) and maps its global expert id (int32 or int64, through ``expert_map``)
itself, so a decode step under a CUDA graph replays exactly these.
"""

from __future__ import annotations

from typing import Optional

import torch

#: the largest ``moe_gemv_slots`` the option accepts (the kernel is correct for any number of slots;
#: one program per slot stops paying once slots share experts)
MOE_GEMV_MAX_SLOTS = 1024


#: the Triton MoE kernel's default: measured on the H200 (benchmarks/bench_moe.py, Qwen3-30B-A3B experts,
#: commit e709ed0, 2026-12-01) the expert GEMV beats the Triton grouped GEMM at M = 1 ... 16 tokens of top-8
#: (41.1 against 148.9 us at M = 1, 229.9 against 290.5 at M = 16) and loses at M = 32 (421.1 against 369.9).
#: Marlin MoE beats the expert GEMV at every M (36.5 against 41.1 us at M = 1): its default stays 0.
TRITON_MOE_DEFAULT_SLOTS = 128


def moe_gemv_slots(spec, default: int = 0) -> int:
    """Option ``moe_gemv_slots: S`` (0: off; ``default`` where the option is not given) -- 0 as well
    where the kernel cannot take the shape."""
    from ..kernels.moe_gemv_triton import moe_gemv_shape_ok
    given = spec.options.get("moe_gemv_slots")
    s = int(default if given is None else given)
    return s if s and moe_gemv_shape_ok(spec.k) and moe_gemv_shape_ok(spec.intermediate) else 0


def moe_decode_gemv(x: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor],
                    intermediate: int) -> torch.Tensor:
    """The MoE layer (bf16 x (T, H) -> bf16 (T, H)) by the expert GEMV; see the module doc."""
    from ..kernels import moe_triton
    from ..kernels.moe_gemv_triton import moe_gemv
    from ..kernels.quantize_triton import quantize_rows_triton
    topk = topk_ids.shape[1]
    # slot s = (token s // topk, its k-th choice): the kernel reads the token row and maps the global
    # expert id itself (int32 or int64, through expert_map) -- no index or cast launches here
    xq, xs = quantize_rows_triton(x)
    gu = moe_gemv(xq, xs, None, w13, w13_s, topk_ids, topk=topk, expert_map=expert_map)
    act = moe_triton.silu_mul_qdq(gu, intermediate)
    aq, as_ = quantize_rows_triton(act)
    d = moe_gemv(aq, as_, None, w2, w2_s, topk_ids, expert_map=expert_map)
    tw = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    return moe_triton.moe_combine(d, tw, topk_ids, expert_map)
