"""Learner-side tools for trainers without Blackwell (or without Transformer Engine).

* :func:`apply_learner_grid` swaps a PyTorch / ``transformers`` model's on-grid Linear
  layers (and fused MoE expert weights) for modules that compute TE's MXFP8 forward:
  weight quantized rowwise each forward (as TE does with BF16 parameters), activation
  quantized rowwise along K, fp32 accumulation, output in the activation's dtype.
* Backward: ``"ste"`` (default) is straight-through -- gradients are those of the
  high-precision linear at the BF16 weights (dx = dy W, dW = dy^T x, in fp32).
  ``"te"`` mimics TE's MXFP8 backward: dgrad from dy quantized rowwise (1x32 along N)
  and W's columnwise copy; wgrad from the columnwise copies of dy and x (32x1 along
  M; needs the token count M to be a multiple of 32).
* :func:`set_router_dtype` computes the MoE routers' logits in FP32 (Megatron's
  ``moe_router_dtype=fp32``), the learner side of the engines' ``router_dtype`` option.
* :func:`export_wire` writes the model's on-grid weights in the wire format
  (``common/wire.py``) under Hugging Face checkpoint names -- the bytes the forward
  above used.  :func:`wire_from_te` does the same for a Transformer Engine
  ``MXFP8Tensor`` (padding stripped, swizzle undone).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn

from . import format as F
from .grid_weight import GridWeight
from .linear import mxfp8_linear_reference
from .ops import weighted_activation
from .quantize import quantize_mxfp8, quantize_rows
from .selection import ModuleSelection
from .tensor import dequantize_blocks
from .wire import SCALE_SUFFIX, WEIGHT_SUFFIX

BACKWARD_MODES = ("ste", "te")


def _on_grid_shape(w: torch.Tensor) -> bool:
    return w.shape[-1] % F.BLOCK_SIZE == 0 and w.shape[-2] % F.BLOCK_SIZE == 0


class _GridLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        wq, ws = quantize_rows(weight.detach())
        y = mxfp8_linear_reference(x.detach(), wq, ws, None if bias is None else bias.detach())
        ctx.save_for_backward(x, weight)
        ctx.mode, ctx.has_bias = mode, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        k, n = x.shape[-1], w.shape[0]
        x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
        if ctx.mode == "te":
            if x2.shape[0] % F.BLOCK_SIZE:
                raise ValueError(f"backward='te' needs the token count to be a multiple of {F.BLOCK_SIZE}; "
                                 f"got {x2.shape[0]}")
            dyq, dys = quantize_rows(dy2)                                   # 1x32 along N
            w_col = quantize_mxfp8(w.detach(), rowwise=False, columnwise=True)  # 32x1 along N
            dx = dequantize_blocks(dyq, dys) @ w_col.dequantize()
            dy_col = quantize_mxfp8(dy2, rowwise=False, columnwise=True).dequantize()   # 32x1 along M
            x_col = quantize_mxfp8(x2.detach(), rowwise=False, columnwise=True).dequantize()
            dw = dy_col.t() @ x_col
        else:
            dyf = dy2.to(torch.float32)
            dx = dyf @ w.detach().to(torch.float32)
            dw = dyf.t() @ x2.detach().to(torch.float32)
        db = dy2.to(torch.float32).sum(0).to(w.dtype) if ctx.has_bias else None
        return dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype), db, None


def grid_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                backward: str = "ste") -> torch.Tensor:
    """``F.linear`` on the learner's grid, differentiable (see module docstring for backward)."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {BACKWARD_MODES}; got {backward!r}")
    return _GridLinearFn.apply(x, weight, bias, backward)


class GridLinear(nn.Module):
    """Drop-in for ``nn.Linear`` computing TE's MXFP8 forward; shares the original parameters."""

    def __init__(self, linear: nn.Linear, backward: str = "ste"):
        super().__init__()
        if not _on_grid_shape(linear.weight):
            raise ValueError(f"Linear of weight shape {tuple(linear.weight.shape)} is not on the grid "
                             f"(in and out features must be multiples of {F.BLOCK_SIZE})")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.backward_mode = backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grid_linear(x, self.weight, self.bias, self.backward_mode)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, grid=mxfp8-1x32, backward={self.backward_mode}")


class GridExperts(nn.Module):
    """On-grid twin of a ``transformers`` fused-experts module (Qwen3-MoE, Qwen2-MoE, Mixtral in
    transformers 5): ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows), ``down_proj`` [E, H, I].
    """

    def __init__(self, experts: nn.Module, backward: str = "ste"):
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.backward_mode = backward
        self.router_weights = "combine"          # or "activation": Megatron's order (set_moe_router_weights)
        for p in (self.gate_up_proj, self.down_proj):
            if not _on_grid_shape(p):
                raise ValueError(f"expert weights of shape {tuple(p.shape)} are not on the grid")

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # FP32 routing weights (an FP32 router, ``set_router_dtype``): Megatron's unpermute then
        # multiplies and sums in FP32 (type promotion) and rounds once; otherwise transformers'
        # order -- each weighted expert output rounded to the model dtype and summed in it.
        # Router weights on the activation (Megatron's TEGroupedMLP): SiLU(gate) * up * w in FP32,
        # rounded once, is the down projection's input; the experts' outputs are summed unweighted
        # in FP32 (Megatron's fused unpermute) -- ``ops.moe_reference``'s order, for the engine option.
        on_act = self.router_weights == "activation"
        fp32 = on_act or (top_k_weights.dtype == torch.float32 and hidden_states.dtype != torch.float32)
        out = torch.zeros_like(hidden_states, dtype=torch.float32 if fp32 else None)
        for e in torch.unique(top_k_index).tolist():
            token_idx, k_pos = torch.where(top_k_index == e)
            h = hidden_states[token_idx]
            gate, up = grid_linear(h, self.gate_up_proj[e], None, self.backward_mode).chunk(2, dim=-1)
            w = top_k_weights[token_idx, k_pos, None]
            if on_act:
                h = grid_linear(weighted_activation(gate, up, w), self.down_proj[e], None, self.backward_mode)
            else:
                h = grid_linear(self.act_fn(gate) * up, self.down_proj[e], None, self.backward_mode) * w
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out.to(hidden_states.dtype)


def _is_fused_experts(mod: nn.Module) -> bool:
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)
            and gu.dim() == 3 and dn.dim() == 3 and hasattr(mod, "act_fn"))


def apply_learner_grid(model: nn.Module, selection: Optional[ModuleSelection] = None,
                       backward: str = "ste") -> list[str]:
    """Put ``model``'s selected Linear layers and fused experts on the grid, in place.

    Returns the names of the modules that now compute on the grid.  Modules whose
    shapes are not multiples of 32 are left alone only if the selection does not name
    them explicitly -- a selected module that cannot be on the grid raises.
    """
    selection = selection or ModuleSelection()
    done: list[str] = []
    for name, mod in list(model.named_modules()):
        if not name or not selection.matches(name):
            continue
        if isinstance(mod, nn.Linear):
            new = GridLinear(mod, backward)
        elif _is_fused_experts(mod):
            new = GridExperts(mod, backward)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        done.append(name)
    return done


def _is_router(name: str, mod: nn.Module) -> bool:
    from .router import is_router
    w = getattr(mod, "weight", None)
    return is_router(name) and isinstance(w, torch.Tensor) and w.dim() == 2


def set_router_dtype(model: nn.Module, dtype: Optional[torch.dtype] = torch.float32) -> list[str]:
    """Compute every MoE router's logits in ``dtype`` (FP32: Megatron's ``moe_router_dtype=fp32``;
    None: back to the model dtype), in place; returns the routers' names.

    The router's own forward runs unchanged on an FP32 view of its input and weight (bf16 values
    are exact in FP32), so its softmax, top-k and normalisation see FP32 logits and return FP32
    routing weights; :class:`GridExperts` then combines the experts in FP32 and rounds once, as
    Megatron does with FP32 probabilities.  The parameter itself stays in the model dtype."""
    done = []
    for name, mod in model.named_modules():
        if not _is_router(name, mod):
            continue
        if dtype is None:
            mod.__dict__.pop("forward", None)
        else:
            mod.forward = _router_forward(mod, dtype)
        done.append(name)
    return done


def _router_forward(mod: nn.Module, dtype: torch.dtype):
    orig = type(mod).forward

    def forward(hidden_states, *args, **kwargs):
        # the router's own forward, on FP32 views of its input and parameters (differentiable:
        # the gradient reaches the model-dtype parameter through the casts)
        saved = dict(mod._parameters)
        try:
            for k, v in saved.items():
                if v is not None:
                    mod._parameters[k] = v.to(dtype)
            return orig(mod, hidden_states.to(dtype), *args, **kwargs)
        finally:
            mod._parameters.update(saved)
    return forward


def set_moe_router_weights(model: nn.Module, where: str = "activation") -> list[str]:
    """Where the learner's on-grid experts apply the router weights: ``"activation"`` (Megatron's
    TEGroupedMLP: on SiLU(gate) * up, before the down projection's quantization) or ``"combine"``
    (transformers' and vLLM's order: on the experts' outputs).  The engines' twin is the option
    ``moe_router_weights``.  Returns the names of the experts modules set."""
    if where not in ("combine", "activation"):
        raise ValueError(f"where must be 'combine' or 'activation'; got {where!r}")
    done = []
    for name, mod in model.named_modules():
        if isinstance(mod, GridExperts):
            mod.router_weights = where
            done.append(name)
    if not done:
        raise ValueError("no on-grid experts in this model (apply_learner_grid first)")
    return done


def grid_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, mod in model.named_modules():
        if isinstance(mod, (GridLinear, GridExperts)):
            yield name, mod


def _wire_pair(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rows(w.detach())
    return q.contiguous(), s.contiguous()


def _hf_grid_weights(model: nn.Module):
    """(HF checkpoint name, high-precision weight) of every on-grid weight; fused experts split per expert."""
    for name, mod in grid_modules(model):
        if isinstance(mod, GridLinear):
            yield name + WEIGHT_SUFFIX, mod.weight
        else:
            inter = mod.gate_up_proj.shape[1] // 2
            for e in range(mod.num_experts):
                yield f"{name}.{e}.gate_proj{WEIGHT_SUFFIX}", mod.gate_up_proj[e, :inter]
                yield f"{name}.{e}.up_proj{WEIGHT_SUFFIX}", mod.gate_up_proj[e, inter:]
                yield f"{name}.{e}.down_proj{WEIGHT_SUFFIX}", mod.down_proj[e]


def _plain_tensors(model: nn.Module, skip: set[int]):
    named = dict(model.named_parameters(remove_duplicate=False))
    for key, t in model.state_dict(keep_vars=True).items():
        if id(named.get(key, t)) in skip:
            continue
        yield key, t.detach()


def _grid_param_ids(model: nn.Module) -> set[int]:
    ids = set()
    for _, mod in grid_modules(model):
        ids.update(id(p) for p in ((mod.weight,) if isinstance(mod, GridLinear) else (mod.gate_up_proj, mod.down_proj)))
    return ids


def export_hf_state_dict(model: nn.Module, plain_dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face checkpoint names, in high precision (fused experts
    split per expert) -- what ``update_weights(..., format="bf16")`` sends.  ``plain_dtype``
    casts the off-grid tensors (norms, embeddings, lm_head) to the sampler's dtype."""
    out = {n: w.detach() for n, w in _hf_grid_weights(model)}
    for key, t in _plain_tensors(model, _grid_param_ids(model)):
        out[key] = t.to(plain_dtype) if plain_dtype is not None and t.is_floating_point() else t
    return out


def export_wire(model: nn.Module, include_plain: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights in the wire format, under Hugging Face checkpoint names.

    On-grid modules (those :func:`apply_learner_grid` converted) give
    ``<name>.weight`` (float8_e4m3fn) + ``<name>.weight_scale_inv`` (uint8 [N, K/32]);
    fused experts are split per expert as HF checkpoints name them
    (``<experts>.<e>.{gate_proj,up_proj,down_proj}.weight``).  With ``include_plain``
    every other parameter and buffer of the state dict is included in its own dtype.
    """
    out: dict[str, torch.Tensor] = {}
    for name, w in _hf_grid_weights(model):
        out[name], out[name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX] = _wire_pair(w)
    if include_plain:
        for key, t in _plain_tensors(model, _grid_param_ids(model)):
            out.setdefault(key, t)
    return out


# -- Transformer Engine ------------------------------------------------------------------

def is_te_mxfp8_tensor(t: object) -> bool:
    """Duck-typed: TE's ``MXFP8Tensor`` (or its storage class) holds ``_rowwise_scale_inv``."""
    return hasattr(t, "_rowwise_scale_inv") and hasattr(t, "_rowwise_data")


def wire_from_te(t, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data [..., K], uint8 scales [..., K/32]) from a TE ``MXFP8Tensor``: TE's own bytes.

    Strips TE's scale padding and undoes the GEMM swizzle when
    ``_with_gemm_swizzled_scales`` is set (fused grouped-MLP ops swizzle in place).
    The reader is ``GridWeight.from_te`` (errors name ``name``).
    """
    return GridWeight.from_te(name, t).pair()


def export_te_state_dict(named: Iterable[tuple[str, object]] | Mapping[str, object],
                         rename: Optional[Callable[[str], Optional[str]]] = None) -> dict[str, torch.Tensor]:
    """Wire-format dict from TE parameters: MXFP8Tensors become (weight, weight_scale_inv) pairs.

    ``named`` is e.g. ``model.named_parameters()``.  ``rename`` maps TE/Megatron names to
    the sampler's (HF) names, or returns None to drop a tensor.
    """
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        new = rename(name) if rename else name
        if new is None:
            continue
        if is_te_mxfp8_tensor(t):
            out.update(GridWeight.from_te(name, t).to_wire(new))     # names the tensor unless new is '<m>.weight'
        else:
            out[new] = t.detach() if isinstance(t, torch.Tensor) else t
    return out
