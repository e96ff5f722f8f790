"""Fused MoE experts on the grid through vLLM's MXFP8 Marlin MoE GEMM (the fast path on Hopper).

The layer is computed in the reference's order (``ops.moe_reference``), with exact operands:

1. x's grid values, ``qdq(x)`` (bf16, TE-exact);
2. gate_up = Marlin MoE GEMM over the expert-sorted token slots (FP32 accumulation, rounded
   once to bf16);
3. ``silu(gate) * up`` in bf16 (torch's own ops, as the reference), then its grid values
   ``qdq(.)`` -- the SiLU*up intermediate is quantized TE-exactly between the two GEMMs;
4. down = Marlin MoE GEMM (rounded once to bf16);
5. the router weights applied in FP32 and the top-k slots summed in FP32, then one cast.

Steps 3 and 5 and the slot order are three Triton kernels (``kernels/moe_triton.py``), equal to
the torch ops they replace (:func:`moe_marlin_torch_glue`): at decode sizes the ~20 small torch
kernels of that glue cost more than the expert GEMMs.

What Marlin would otherwise do differently, and is avoided here (vLLM 0.26 source):
``mul_topk_weights`` multiplies in bf16 after rounding (so it stays off); bf16 atomic adds
(``use_atomic_add`` stays off; FP32 global reduction on); ``moe_align_block_size`` orders the
tokens of an expert with atomics on large batches, which can move a token to another block
and change its bits between runs -- up to ``moe_triton.ALIGN_MAX_SLOTS`` slots the order is made
by a counting sort without atomics (``moe_triton.moe_align``), beyond that vLLM's slots are
re-sorted within each expert segment (:func:`deterministic_order`); both graph-safe, no host sync.  Slots routed to other ranks' experts
(expert parallel) are never written by Marlin and are masked out of the sum.

With the option ``moe_gemv_slots: S``, up to S routed slots (decode) go to the expert GEMV
(``moe_gemv.py``), which reads the layer's own codes and scales.

Derived tensors: ``grid_marlin_w13`` / ``grid_marlin_w2`` (Marlin-tiled int32, per expert) and
``grid_marlin_w13_scale`` / ``grid_marlin_w2_scale`` (permuted E8M0 bytes); a refresh after a
write rebuilds only the written experts, in place.  Where ``marlin.marlin_weights_batched`` makes
the engine op's bytes for the layer's two shapes (``marlin.batched_repack_agrees``), the load (and
each layerwise reload), refreshes and the ``derived_state`` check repack all experts, or each run of
written experts, at once (a few launches per layer instead of several per expert); otherwise, with
a warning, the op, expert by expert.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as Fn

from . import marlin_launch, providers
from .base import GridKernel
from ..packed_codes import PackedCodes, hold_packed
from .marlin import (_marlin_supported, batched_repack_agrees, check_bf16_exact_weights, guard_bf16_exact_weights,
                     marlin_pack, marlin_scales)

log = logging.getLogger("mxfp8_learner_grid")

_BLOCK_SIZES = (8, 16, 32, 48, 64)


def block_size_m(m: int, topk: int, local_experts: int, global_experts: int) -> int:
    """vLLM's ``fused_marlin_moe`` choice of the token block (0.26.0, marlin_moe.py)."""
    if global_experts != local_experts:
        m = -(-m * local_experts // global_experts)
    for bs in _BLOCK_SIZES:
        if m * topk / local_experts / bs < 0.9:
            return bs
    return _BLOCK_SIZES[-1]


def deterministic_order(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Sort the slot ids inside each expert's segment (padding sentinels ``numel`` stay last), so
    that the order no longer depends on the atomics of ``moe_align_block_size``."""
    n = sorted_ids.numel()
    # segment number of each block: +1 wherever the expert changes, so it only grows along the
    # array and sorting by (segment, slot id) never moves a segment, whatever the expert order
    change = torch.ones_like(expert_ids, dtype=torch.int64)
    change[1:] = (expert_ids[1:] != expert_ids[:-1]).to(torch.int64)
    seg = torch.cumsum(change, 0).repeat_interleave(block)[:n]
    key = seg * (numel + 1) + sorted_ids.to(torch.int64)
    return (torch.sort(key).values - seg * (numel + 1)).to(sorted_ids.dtype)


def token_block(knobs13, m: int, topk: int, local_experts: int, global_experts: int) -> int:
    """The layer's token block for M tokens (both GEMMs share one alignment): that of its w13 row's
    knobs (``marlin_launch.lookup`` of option ``marlin_configs`` at M), else vLLM's choice
    (:func:`block_size_m`)."""
    return knobs13[0] if knobs13 is not None else block_size_m(m, topk, local_experts, global_experts)


def _align(ops, topk_ids, bs: int, global_num_experts: int, e_local: int, expert_map):
    """The deterministic token alignment (``moe_triton.moe_align``); for a large batch, vLLM's align
    (atomics), then the slot order fixed."""
    from ..kernels import moe_triton
    aligned = moe_triton.moe_align(topk_ids, bs, global_num_experts, e_local, expert_map)
    if aligned is None:
        sorted_ids, expert_ids, ntpp = ops.moe_align(topk_ids, bs, global_num_experts, expert_map)
        return deterministic_order(sorted_ids, expert_ids, bs, topk_ids.numel()), expert_ids, ntpp
    return aligned


@torch.library.custom_op("mxfp8_learner_grid::moe_marlin", mutates_args=())
def moe_marlin(x: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
               workspace: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               expert_map: Optional[torch.Tensor], global_num_experts: int, intermediate: int,
               w13_codes: Optional[torch.Tensor] = None, w13_scales: Optional[torch.Tensor] = None,
               w2_codes: Optional[torch.Tensor] = None, w2_scales: Optional[torch.Tensor] = None,
               gemv_slots: int = 0, cfg13: Optional[list[int]] = None,
               cfg2: Optional[list[int]] = None) -> torch.Tensor:
    """The layer by Marlin MoE; with ``gemv_slots`` (and the layer's own codes and scales given), up to
    that many routed slots by the expert GEMV instead (``moe_gemv.moe_decode_gemv``).  ``cfg13`` /
    ``cfg2``: the rows of option ``marlin_configs`` for the two GEMMs (``marlin_launch``): where one
    holds M, its launch knobs, and the w13 row's token block for both GEMMs."""
    from ..kernels import moe_triton
    from ..kernels.qdq_triton import qdq_rows
    ops = providers.get("marlin")
    m, h = x.shape
    if m == 0:
        return torch.zeros_like(x)
    topk = topk_ids.shape[1]
    if m * topk <= gemv_slots:
        from .moe_gemv import moe_decode_gemv
        return moe_decode_gemv(x, w13_codes, w13_scales, w2_codes, w2_scales, topk_weights, topk_ids, expert_map,
                               intermediate).to(x.dtype)
    e_local = w13.shape[0]
    k13 = marlin_launch.lookup(cfg13, m)
    k2 = marlin_launch.lookup(cfg2, m)
    bs = token_block(k13, m, topk, e_local, global_num_experts)
    t13 = k13[1:] if k13 is not None else (-1, -1, -1)
    t2 = k2[1:] if k2 is not None else (-1, -1, -1)
    sorted_ids, expert_ids, ntpp = _align(ops, topk_ids, bs, global_num_experts, e_local, expert_map)
    tw = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    a = qdq_rows(x, torch.bfloat16)
    gu = ops.moe_gemm(a, w13, w13_s, workspace, sorted_ids, expert_ids, ntpp, tw, bs, topk,
                      size_m=m, size_n=2 * intermediate, size_k=h, thread_k=t13[0], thread_n=t13[1],
                      blocks_per_sm=t13[2])
    act = moe_triton.silu_mul_qdq(gu.view(m * topk, 2 * intermediate), intermediate)
    d = ops.moe_gemm(act, w2, w2_s, workspace, sorted_ids, expert_ids, ntpp, tw, bs, 1,
                     size_m=m * topk, size_n=h, size_k=intermediate, thread_k=t2[0], thread_n=t2[1],
                     blocks_per_sm=t2[2])
    return moe_triton.moe_combine(d.view(m * topk, h), tw, topk_ids, expert_map).to(x.dtype)


def moe_marlin_torch_glue(x, w13, w13_s, w2, w2_s, workspace, topk_weights, topk_ids, expert_map,
                          global_num_experts: int, intermediate: int) -> torch.Tensor:
    """The same layer with its glue as plain torch ops (the definition the Triton glue of
    ``kernels/moe_triton.py`` must equal; kept for the GPU tests and the benchmark)."""
    from ..kernels.qdq_triton import qdq_rows
    ops = providers.get("marlin")
    m, h = x.shape
    topk = topk_ids.shape[1]
    e_local = w13.shape[0]
    bs = block_size_m(m, topk, e_local, global_num_experts)
    sorted_ids, expert_ids, ntpp = ops.moe_align(topk_ids, bs, global_num_experts, expert_map)
    sorted_ids = deterministic_order(sorted_ids, expert_ids, bs, topk_ids.numel())
    tw = topk_weights.to(torch.float32)
    a = qdq_rows(x, torch.bfloat16)
    gu = ops.moe_gemm(a, w13, w13_s, workspace, sorted_ids, expert_ids, ntpp, tw, bs, topk,
                      size_m=m, size_n=2 * intermediate, size_k=h)
    g, u = gu.view(m * topk, 2 * intermediate).chunk(2, dim=-1)
    act = qdq_rows(Fn.silu(g) * u, torch.bfloat16)
    d = ops.moe_gemm(act, w2, w2_s, workspace, sorted_ids, expert_ids, ntpp, tw, bs, 1,
                     size_m=m * topk, size_n=h, size_k=intermediate)
    valid = (topk_ids >= 0) if expert_map is None else (expert_map[topk_ids.to(torch.int64)] >= 0)
    d = d.view(m, topk, h).to(torch.float32) * tw[..., None]
    d = torch.where(valid[..., None], d, torch.zeros((), dtype=d.dtype, device=d.device))
    return d.sum(dim=1).to(x.dtype)


@moe_marlin.register_fake
def _(x, w13, w13_s, w2, w2_s, workspace, topk_weights, topk_ids, expert_map, global_num_experts, intermediate,
      w13_codes=None, w13_scales=None, w2_codes=None, w2_scales=None, gemv_slots=0, cfg13=None, cfg2=None):
    return torch.empty_like(x)


def expert_runs(n: int, experts=None) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive local expert ids among ``experts`` (None: all ``n``), for batched refreshes."""
    if experts is None:
        return [(0, n)] if n else []
    runs: list = []
    for e in sorted(set(int(x) for x in experts)):
        if runs and runs[-1][1] == e:
            runs[-1][1] = e + 1
        else:
            runs.append([e, e + 1])
    return [tuple(r) for r in runs]


class MarlinMoE(GridKernel):
    name = "marlin"
    kind = "moe"

    @classmethod
    def is_supported(cls, spec):
        ok, why = _marlin_supported(spec)
        if ok and not hasattr(providers.get("marlin"), "moe_gemm"):
            return False, "the engine provides no Marlin MoE op"
        return ok, why

    @classmethod
    def can_implement(cls, spec):
        from .portable import refuse_weights_on_activation
        ok, why = refuse_weights_on_activation(spec, "Marlin")
        if not ok:
            return ok, why
        if spec.act_dtype != torch.bfloat16:
            return False, f"a {spec.act_dtype} model: Marlin writes bf16, and the output must be rounded to {spec.act_dtype}"
        i, h = spec.intermediate, spec.k
        if i % 64 or h % 128:
            return False, f"intermediate {i} / hidden {h} are not Marlin MoE tile multiples (64 / 128)"
        return True, ""

    def __init__(self, spec):
        super().__init__(spec)
        from .moe_gemv import moe_gemv_slots
        self.gemv_slots = moe_gemv_slots(spec)
        defaults = marlin_launch.moe_defaults(spec.capability)
        self.cfg13 = marlin_launch.rows_for(spec.options, 2 * spec.intermediate, spec.k, defaults)
        self.cfg2 = marlin_launch.rows_for(spec.options, spec.k, spec.intermediate, defaults)
        self.default_knobs = marlin_launch.uses_defaults(spec.options)
        self.batched = False       # refreshes repack all experts at once (marlin_weights_batched, checked at load)
        #: option ``moe_single_copy``: the packed weights are the experts' only codes (``common.packed_codes``)
        self.single_copy = bool(spec.options.get("moe_single_copy", False))
        if self.single_copy and self.gemv_slots:
            raise ValueError(f"{spec.prefix}: moe_single_copy keeps the experts' codes only in Marlin's layout, "
                             f"and the expert GEMV (moe_gemv_slots: {self.gemv_slots}) reads the checkpoint layout; "
                             f"set moe_gemv_slots: 0")

    def describe(self):
        src = "marlin_configs defaults" if self.default_knobs else "marlin_configs"
        tuned = f" (launch knobs from {src})" if self.cfg13 or self.cfg2 else ""
        once = ", codes held once (packed)" if self.single_copy else ""
        return (f"expert GEMV (slots <= {self.gemv_slots}) + " if self.gemv_slots else "") + "marlin" + tuned + once

    def derived_names(self, layer):
        return ("grid_marlin_w13", "grid_marlin_w2", "grid_marlin_w13_scale", "grid_marlin_w2_scale")

    def _packed(self, layer, which: str, out: Optional[torch.Tensor] = None, lo: int = 0, hi: Optional[int] = None):
        """Experts [lo, hi) of w13 / w2 in Marlin's layout (``marlin.marlin_pack``; ``out``: in place)."""
        return marlin_pack(providers.get("marlin"), getattr(layer, f"{which}_weight")[lo:hi], self.batched, out=out)

    def _scales(self, layer, which: str, lo: int = 0, hi: Optional[int] = None):
        """Experts [lo, hi) of w13 / w2's scales in Marlin's permuted layout, all at once."""
        return marlin_scales(getattr(layer, f"{which}_weight_scale_inv")[lo:hi])

    def process_weights_after_loading(self, layer) -> None:
        for which in ("w13", "w2"):
            check_bf16_exact_weights(getattr(layer, f"{which}_weight_scale_inv"), getattr(layer, f"{which}_weight"),
                                     f"{self.spec.prefix}.{which}")
        if not hasattr(layer, "grid_marlin_w13"):
            ops = providers.get("marlin")
            self.batched = all(batched_repack_agrees(ops, *getattr(layer, f"{which}_weight").shape[1:],
                                                     layer.w13_weight.device) for which in ("w13", "w2"))
            for which in ("w13", "w2"):
                self.register_derived_buffer(layer, f"grid_marlin_{which}", self._packed(layer, which))
                self.register_derived_buffer(layer, f"grid_marlin_{which}_scale", self._scales(layer, which))
            workspace = providers.get("marlin").workspace(layer.w13_weight.device, marlin_launch.MAX_BLOCKS_PER_SM)
            self.register_derived_buffer(layer, "grid_marlin_workspace", workspace)
            if self.single_copy:
                self._hold_packed(layer)
            self._probe_launch_knobs(layer)
        else:
            self.refresh(layer)

    def _hold_packed(self, layer) -> None:
        """Option ``moe_single_copy``: the packed weights become the experts' one copy of their codes
        (``packed_codes.hold_packed``); the checkpoint-layout storage is released.  Writes then repack in
        place through the parameter, so only the batched repack (the layout ``PackedCodes`` writes) may be
        the engine's."""
        if not self.batched:
            raise ValueError(f"{self.spec.prefix}: moe_single_copy needs the batched Marlin repack, and it does not "
                             f"make the engine's bytes for this layer's shapes (see the warning above); "
                             f"set moe_single_copy: false")
        for which in ("w13", "w2"):
            hold_packed(layer, f"{which}_weight", getattr(layer, f"grid_marlin_{which}"))

    def _held(self, layer, which: str) -> bool:
        w = getattr(layer, f"{which}_weight")
        if not isinstance(w, PackedCodes):
            return False
        if w.packed is not getattr(layer, f"grid_marlin_{which}"):
            raise ValueError(f"{self.spec.prefix}.{which}: the parameter's packed codes are not the buffer the "
                             f"kernel reads (grid_marlin_{which} was rebound)")
        return True

    def _probe_launch_knobs(self, layer) -> None:
        """Each ``marlin_configs`` row of this layer, its GEMM run once at the row's first M (random tokens
        and routing, the token block the layer would use there), must compute what Marlin's own launch
        does (``marlin_launch.probe``); else the load fails, naming the row.  Default rows (the option
        absent) that fail are dropped instead: the layer keeps Marlin's own launch, with a warning."""
        try:
            self._probe_rows(layer)
        except ValueError as exc:
            if not self.default_knobs:
                raise
            log.warning("mxfp8-learner-grid: %s; the layer keeps Marlin's own launch (marlin_configs: [] "
                        "skips the default rows)", exc)
            self.cfg13, self.cfg2 = [], []

    def _probe_rows(self, layer) -> None:
        from ..kernels.qdq_triton import qdq_rows
        ops = providers.get("marlin")
        dev = layer.w13_weight.device
        e, h, inter = layer.w13_weight.shape[0], layer.w13_weight.shape[2], layer.w2_weight.shape[2]
        topk = min(8, e)
        for which, flat in (("w13", self.cfg13), ("w2", self.cfg2)):
            for i, band in enumerate(marlin_launch.bands(flat)):
                m, knobs = band[0], band[2:]
                g = torch.Generator(device=dev).manual_seed(i)
                ids = torch.topk(torch.randn(m, e, device=dev, generator=g), topk).indices.to(torch.int32)
                # the block the layer uses at this M (a w2 row's own block is not used)
                bs = knobs[0] if which == "w13" else token_block(marlin_launch.lookup(self.cfg13, m), m, topk, e, e)
                sorted_ids, expert_ids, ntpp = _align(ops, ids, bs, e, e, None)
                tw = torch.ones(m, topk, dtype=torch.float32, device=dev)
                n, k, rows, top = (2 * inter, h, m, topk) if which == "w13" else (h, inter, m * topk, 1)
                a = qdq_rows(torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16), torch.bfloat16)
                w, s = getattr(layer, f"grid_marlin_{which}"), getattr(layer, f"grid_marlin_{which}_scale")

                def gemm(tk, tn, bps):
                    return ops.moe_gemm(a, w, s, layer.grid_marlin_workspace, sorted_ids, expert_ids, ntpp, tw, bs,
                                        top, size_m=rows, size_n=n, size_k=k, thread_k=tk, thread_n=tn,
                                        blocks_per_sm=bps)
                marlin_launch.probe(lambda: gemm(*knobs[1:]), lambda: gemm(-1, -1, -1), [n, k, *band],
                                    f"{self.spec.prefix}.{which}")

    def refresh(self, layer, experts=None) -> None:
        n = layer.w13_weight.shape[0]
        for which in ("w13", "w2"):          # whole tensors: two launches per layer, not per expert
            guard_bf16_exact_weights(getattr(layer, f"{which}_weight_scale_inv"), getattr(layer, f"{which}_weight"),
                                     f"{self.spec.prefix}.{which}")
        held = {which: self._held(layer, which) for which in ("w13", "w2")}
        with torch.no_grad():
            for lo, hi in expert_runs(n, experts):      # each run of written experts at once, in place
                for which in ("w13", "w2"):
                    if not held[which]:                 # held once: the write repacked the codes already
                        self._packed(layer, which, getattr(layer, f"grid_marlin_{which}")[lo:hi], lo, hi)
                    getattr(layer, f"grid_marlin_{which}_scale")[lo:hi].copy_(self._scales(layer, which, lo, hi))

    def derived(self, layer):
        out = {}
        for which in ("w13", "w2"):
            # each builder rebuilds only its own tensor (the derived_state check calls both); codes held
            # once are no derived tensor: the packed buffer is the parameter's state
            if not self._held(layer, which):
                out[f"grid_marlin_{which}"] = (getattr(layer, f"grid_marlin_{which}"),
                                               lambda which=which: self._packed(layer, which))
            out[f"grid_marlin_{which}_scale"] = (getattr(layer, f"grid_marlin_{which}_scale"),
                                                 lambda which=which: self._scales(layer, which))
        return out

    def apply(self, layer, x, topk_weights, topk_ids, expert_map=None):
        e_global = int(expert_map.shape[0]) if expert_map is not None else int(layer.w13_weight.shape[0])
        return torch.ops.mxfp8_learner_grid.moe_marlin(
            x, layer.grid_marlin_w13, layer.grid_marlin_w13_scale, layer.grid_marlin_w2, layer.grid_marlin_w2_scale,
            layer.grid_marlin_workspace, topk_weights, topk_ids, expert_map, e_global, layer.w2_weight.shape[2],
            *((layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv)
              if self.gemv_slots else (None, None, None, None)), self.gemv_slots,
            self.cfg13 or None, self.cfg2 or None)
