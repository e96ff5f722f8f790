"""The code-flip explanation of ``tests/gpu/layer_capture.py`` (the per-layer check inside a served
model): a MoE call whose output differs from the reference only by an intermediate code flip at a
stage-1 rounding midpoint is explained; a wrong scale or a wrong router weight is not."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
import layer_capture as lc  # noqa: E402

from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows  # noqa: E402
from mxfp8_learner_grid.common.ops import moe_reference  # noqa: E402

H, INTER, E, TOPK = 256, 64, 4, 2


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=g).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05
    w2 = torch.randn(E, H, INTER, generator=g) * 0.05
    q13, s13 = quantize_rows(w13.to(torch.bfloat16))
    q2, s2 = quantize_rows(w2.to(torch.bfloat16))
    p = {"w13_weight": q13, "w13_weight_scale_inv": s13, "w2_weight": q2, "w2_weight_scale_inv": s2}
    tw = torch.tensor([[0.6, 0.4]], dtype=torch.float32)
    ids = torch.tensor([[1, 3]])
    return x, p, tw, ids


def _with_gate_up_neighbour(x, p, tw, ids, slot, col):
    """The layer's output when stage 1 rounded one gate_up element to its other bf16 neighbour."""
    import torch.nn.functional as Fn
    xa = dequantize_blocks(*quantize_rows(x)).double()
    out = torch.zeros(1, H, dtype=torch.float32)
    for s in range(TOPK):
        e = int(ids[0, s])
        gu = (xa @ dequantize_blocks(p["w13_weight"][e], p["w13_weight_scale_inv"][e]).double().t()).float() \
            .to(torch.bfloat16)
        if s == slot:
            gu[0, col] = (gu[0, col:col + 1].view(torch.int16) + 1).view(torch.bfloat16)[0]
        g, u = gu.chunk(2, dim=-1)
        a = dequantize_blocks(*quantize_rows(Fn.silu(g) * u)).double()
        d = (a @ dequantize_blocks(p["w2_weight"][e], p["w2_weight_scale_inv"][e]).double().t()).float()
        out += d.to(torch.bfloat16).float() * tw[0, s]                  # bf16 per slot, weight and sum in FP32
    return out.to(torch.bfloat16)


def test_a_flip_at_a_midpoint_is_explained_and_the_reference_itself_needs_none():
    x, p, tw, ids = _layer()
    ref = moe_reference(x, p["w13_weight"], p["w13_weight_scale_inv"], p["w2_weight"], p["w2_weight_scale_inv"],
                        tw, ids)
    same = lc.explain_by_code_flips(x, ref, p, tw, ids)
    assert same["flip_base_within_1ulp"] >= 0.99 and same["flip_within_1ulp"] >= 0.99
    assert same["flips_used"] == 0
    # the gate_up element whose neighbour moves the output most (a flip of its intermediate code)
    best, worst_base = None, 1.0
    for col in range(0, 2 * INTER, 3):
        y = _with_gate_up_neighbour(x, p, tw, ids, 0, col)
        w = (lc.ulps(y, ref) <= 1).float().mean().item()
        if w < worst_base:
            best, worst_base = (col, y), w
    assert worst_base < 0.98, "no single neighbour flips a code enough for the test"
    col, y = best
    row = {"rel": ((y.double() - ref.double()).norm() / ref.double().norm()).item(), "within_1ulp": worst_base}
    assert not lc.moe_row_ok(row)
    # with the real FP32 bound, the element is (almost surely) not near a midpoint: not offered, not explained
    strict = lc.explain_by_code_flips(x, y, p, tw, ids)
    assert strict["flip_within_1ulp"] < 0.99
    # widened so that every element is plausible: the flip is found, and it alone explains the call
    wide = lc.explain_by_code_flips(x, y, p, tw, ids, bound_scale=1e6)
    assert wide["flip_base_within_1ulp"] < 0.98
    assert wide["flip_within_1ulp"] >= 0.99 and 1 <= wide["flips_used"] <= 2
    row.update(wide)
    summary, ok = lc.summarize([dict(row, layer="l", kernel="marlin", m=1)])
    assert ok and summary["moe_off_explained_by_code_flips"] == 1


@pytest.mark.parametrize("fault", ["w2_scale", "router_weight"])
def test_a_real_fault_is_not_explained(fault):
    x, p, tw, ids = _layer(1)
    p_bad, tw_bad = dict(p), tw.clone()
    if fault == "w2_scale":
        s = p["w2_weight_scale_inv"].clone()
        s[3, :, 0] += 1                                  # one 32-block of expert 3's down projection, 2x
        p_bad["w2_weight_scale_inv"] = s
    else:
        tw_bad[0, 1] *= 1.01
    y = moe_reference(x, p_bad["w13_weight"], p_bad["w13_weight_scale_inv"], p_bad["w2_weight"],
                      p_bad["w2_weight_scale_inv"], tw_bad, ids)
    out = lc.explain_by_code_flips(x, y, p, tw, ids, bound_scale=1e6)
    assert out["flip_within_1ulp"] < 0.99


def test_an_exact_kernel_output_is_explained_with_no_flip_where_the_fp32_reference_flipped():
    """The served 30B-A3B case (layer 0's experts, one decode step): the kernel's output equals the
    FP64-exact grid forward, while the FP32 CPU reference rounded one gate_up element the other way."""
    x, p, tw, ids = _layer(2)
    exact = _with_gate_up_neighbour(x, p, tw, ids, slot=-1, col=0)          # no element moved
    # the reference that rounded one element the other way: the one that moves the output most
    within = min((lc.ulps(exact, _with_gate_up_neighbour(x, p, tw, ids, 0, c)) <= 1).float().mean().item()
                 for c in range(0, 2 * INTER, 3))
    assert within < 0.98
    out = lc.explain_by_code_flips(x, exact, p, tw, ids)
    assert out["flip_base_within_1ulp"] == 1.0 and out["flips_used"] == 0
    row = {"rel": 1e-3, "within_1ulp": within, "layer": "l", "kernel": "marlin", "m": 1, **out}
    summary, ok = lc.summarize([row])
    assert ok and summary["moe_off_explained_by_code_flips"] == 1
