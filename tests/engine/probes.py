"""Test-only views of a live engine's model, run in its worker through ``LLM.apply_model``
(``llm_worker.py``'s ``probe`` key; module-level, so vLLM pickles them by reference)."""

import torch


def router_probe(model):
    """Every MoE router called on a seeded bf16 input: {name: [output dtype, equals F.linear(x.float(),
    W.float()) exactly, every value representable in bf16, quant method]}."""
    from mxfp8_learner_grid.common.router import is_router
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        if not is_router(name) or not hasattr(m, "weight"):
            continue
        w = m.weight
        x = torch.randn(7, w.shape[1], generator=g).to(w.dtype).to(w.device)
        with torch.no_grad():
            y = m(x)
        y = y[0] if isinstance(y, tuple) else y
        dtype, y = str(y.dtype), y.float().cpu()
        ref = torch.nn.functional.linear(x.float(), w.float()).cpu()
        out[name] = [dtype, bool(torch.equal(y, ref)), bool(torch.equal(y, y.bfloat16().float())),
                     type(m.quant_method).__name__]
    return out


def fusion_probe(model):
    """Option producer_qdq: whether the loader step ran (patch applied), the producers swapped in, and the
    grid Linears told that their input is on the grid."""
    from mxfp8_learner_grid.patches import vllm_producer_qdq
    fused = sorted(n for n, m in model.named_modules() if getattr(m, "grid_fused_qdq", None))
    fed = sorted(n for n, m in model.named_modules() if getattr(getattr(m, "grid_kernel", None), "x_on_grid", False))
    return {"patch_applied": vllm_producer_qdq._applied, "fused": fused, "fed": fed}
