"""Loading weights onto the grid inside an engine's own loaders (vLLM and SGLang alike).

Every on-grid layer has two parameters per weight: ``<w>`` (float8_e4m3fn, the learner's
rowwise data) and ``<w>_scale_inv`` (uint8 E8M0, [rows, K/32]).  Both load through the
engine's own weight loader for the layer (so TP narrowing, q/k/v and gate/up offsets,
expert ids are the engine's), wrapped to:

* take a BF16/FP16/FP32 checkpoint tensor, quantize it rowwise on the grid (TE-exact,
  ``common.quantize_rows``; rows are independent and TP splits K at multiples of 32, so
  quantizing the whole tensor then letting the engine narrow it gives the learner's bytes)
  and load data and scales through the same loader;
* take an FP8 tensor (a pre-quantized wire-format checkpoint) as the learner's bytes:
  copied, never re-quantized;
* count every write per (parameter, shard) so that ``process_weights_after_loading`` can
  name anything the checkpoint never provided;
* after a write into a processed layer, bring the kernel's derived tensors up to date
  (``common.refresh.mark_written``): whoever writes -- the engine's ``load_weights``, a
  trainer calling a loader directly, the update session -- nothing is left stale.

The engines' loader signatures agree (``loader(param, tensor, *shard args)``); what differs
is passed in: ``shard_key`` (which shard a call writes) and ``shard_info`` (a label for
messages and, where the engine knows it, the shard's expected checkpoint shape -- loaders
that narrow an oversized tensor silently need that check).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch

from mxfp8_learner_grid.common import format as F
from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.grid_weight import check_data, check_grid_shape, check_scales
from mxfp8_learner_grid.common.refresh import mark_written
from mxfp8_learner_grid.common.sync.recorder import content_checked, note_derived_source, note_shard_write, \
    unrecorded
from mxfp8_learner_grid.common.wire import WireFormatError

SCALE_SENTINEL = 0xFF   # E8M0 NaN: never a learner scale; marks scales nobody wrote
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
SKIP = object()         # shard_key result for a write the engine's loader drops (expert of another rank)
ALL_SHARDS = None       # shard key of a write that covers every shard (fused on disk)


def new_grid_params(shape) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """An on-grid weight's two parameters, not yet written: fp8 data of ``shape`` ([..., N, K])
    and E8M0 scales [..., N, K/32] filled with ``SCALE_SENTINEL`` (what ``check_no_nan_scales``
    finds if the checkpoint never writes them)."""
    shape = tuple(shape)
    w = torch.nn.Parameter(torch.empty(shape, dtype=F.FP8_DTYPE), requires_grad=False)
    s = torch.nn.Parameter(torch.full((*shape[:-1], shape[-1] // F.BLOCK_SIZE), SCALE_SENTINEL, dtype=F.SCALE_DTYPE),
                           requires_grad=False)
    return w, s


def check_linear_partition(prefix: str, output_partition_sizes, k: int) -> None:
    """Raise naming the layer unless every dim of its TP partition is a multiple of 32."""
    if k % F.BLOCK_SIZE or any(p % F.BLOCK_SIZE for p in output_partition_sizes):
        raise WireFormatError(
            f"{prefix}: layer of partition shape out={list(output_partition_sizes)}, in={k} is not on "
            f"the MXFP8 grid (every dim must be a multiple of {F.BLOCK_SIZE} after tensor-parallel "
            f"splitting); exclude it with the module selection or change the TP size")


def writes(layer) -> Counter:
    """(parameter name, shard) -> number of writes, since creation or the last reset."""
    if not hasattr(layer, "_grid_writes"):
        layer._grid_writes = Counter()
    return layer._grid_writes


def count_write(layer, param: str, key, loaded: torch.Tensor) -> None:
    """One more write of shard ``key`` of ``layer.<param>``, made from ``loaded`` (told to an update being
    recorded, for its write plan)."""
    writes(layer)[(param, key)] += 1
    note_shard_write(layer, param, key, loaded)


def _call(base_loader, name: str, param, loaded, *args, **kwargs):
    """The engine's loader, with its bare assertion / shape errors turned into one that names the tensor."""
    try:
        return base_loader(param, loaded, *args, **kwargs)
    except WireFormatError:
        raise
    except Exception as exc:
        raise WireFormatError(f"{name}: cannot load a checkpoint tensor of shape {tuple(loaded.shape)} "
                              f"({loaded.dtype}) into the engine's {tuple(param.shape)} ({param.dtype}) "
                              f"parameter: {type(exc).__name__}: {exc}") from exc


def _check_shape(label: str, t: torch.Tensor, want) -> None:
    """A checkpoint weight against the shard shape the engine expects (where it knows it)."""
    if want is not None and t.dim() == 2 and tuple(t.shape) != tuple(want):
        raise WireFormatError(f"{label}: checkpoint weights have shape {tuple(t.shape)}; expected {tuple(want)}")


def wrap_weight_loader(layer, weight_param: str, scale_param: str, base_loader: Callable,
                       shard_key: Callable[..., object], shard_info: Callable[[object, str], tuple],
                       named_loader: bool = False) -> Callable:
    """A loader for ``layer.<weight_param>`` that quantizes high-precision checkpoints on the grid.

    ``shard_key(*args, **kwargs)`` names the shard a call writes (e.g. "q", 0, ("w1", 3)).
    ``shard_info(key, param_name)`` gives (label for messages, expected checkpoint shape
    [rows, K] of that shard, or None when unknown): some loaders (SGLang's) narrow a too-large
    tensor silently, so shapes are checked here.
    ``named_loader``: the loader's third argument is the parameter name (MoE), which is
    renamed to the scale's name when the scales go through it (the MoE loaders route by "scale").
    """

    @functools.wraps(base_loader)
    def load_weight(param, loaded_weight, *args, **kwargs):
        key = shard_key(*args, **kwargs)
        label, want = shard_info(key, weight_param) if key is not SKIP else (weight_param, None)
        # the grid rules of grid_weight; a write may be part of a weight (its rows are the layer's check)
        if loaded_weight.dtype in HIGH_PRECISION:
            check_grid_shape(label, loaded_weight.shape, whole=False)
            _check_shape(label, loaded_weight, want)
            with unrecorded():                 # new tensors only: nothing here writes the model
                q, s = quantize_rows(loaded_weight)
            note_derived_source(q, loaded_weight, "data")
            note_derived_source(s, loaded_weight, "scale")
            out = _call(base_loader, label, param, q, *args, **kwargs)
            sargs, skwargs = (_scale_args(args), _scale_kwargs(kwargs)) if named_loader else (args, kwargs)
            _call(base_loader, label + " (scales)", getattr(layer, scale_param), s, *sargs, **skwargs)
            if key is not SKIP:
                count_write(layer, scale_param, key, loaded_weight)
        elif loaded_weight.dtype == F.FP8_DTYPE:
            check_data(label, loaded_weight, whole=False)
            _check_shape(label, loaded_weight, want)
            out = _call(base_loader, label, param, loaded_weight, *args, **kwargs)
        else:
            raise WireFormatError(f"{label}: checkpoint tensor has dtype {loaded_weight.dtype}; expected "
                                  f"float8_e4m3fn (wire format) or bf16/fp16/fp32 (quantized on load)")
        if key is not SKIP:
            count_write(layer, weight_param, key, loaded_weight)
            mark_written(layer, _expert_of(key))
        return out

    return load_weight


def wrap_scale_loader(layer, scale_param: str, base_loader: Callable, shard_key: Callable[..., object],
                      shard_info: Callable[[object, str], tuple]) -> Callable:
    @functools.wraps(base_loader)
    def load_scale(param, loaded_weight, *args, **kwargs):
        key = shard_key(*args, **kwargs)
        label, want = shard_info(key, scale_param) if key is not SKIP else (scale_param, None)
        # grid_weight's scale rules: uint8, [.., N, K/32] of the shard's weight where the engine knows
        # it (2-D writes), no E8M0 NaN -- a value check that reads the device, skipped for a tensor whose
        # update bucket passed the same rule already (recorder.check_contents)
        check_scales(label, loaded_weight, want if want is not None and loaded_weight.dim() == 2 else None,
                     values=not content_checked(loaded_weight))
        out = _call(base_loader, label, param, loaded_weight, *args, **kwargs)
        if key is not SKIP:
            count_write(layer, scale_param, key, loaded_weight)
            mark_written(layer, _expert_of(key))
        return out

    return load_scale


def _expert_of(key):
    """The local expert a shard key names (MoE keys are (shard, local expert)); None: the whole layer."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int):
        return key[1]
    return None


# FusedMoE.weight_loader takes the parameter name as its third argument and routes scales
# by "scale" in that name: give the scale its own name when we load it ourselves.
def _scale_args(args):
    if args and isinstance(args[0], str):
        return (_scale_name(args[0]),) + tuple(args[1:])
    return args


def _scale_kwargs(kwargs):
    if "weight_name" in kwargs:
        kwargs = dict(kwargs, weight_name=_scale_name(kwargs["weight_name"]))
    return kwargs


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".weight_scale_inv" if weight_name.endswith(".weight") \
        else weight_name + "_scale_inv"


def check_complete(layer, prefix: str, expected_shards, params: tuple[str, ...]) -> None:
    """Raise naming every (parameter, shard) the checkpoint never wrote."""
    w = writes(layer)
    missing = [f"{prefix}.{p}[{s}]" if s is not None else f"{prefix}.{p}"
               for p in params for s in expected_shards
               if w.get((p, s), 0) == 0 and w.get((p, ALL_SHARDS), 0) == 0]
    if missing:
        raise WireFormatError(
            "mxfp8-learner-grid: these on-grid tensors were never loaded from the checkpoint: "
            + ", ".join(missing[:16]) + (" ..." if len(missing) > 16 else "")
            + " (a pre-quantized checkpoint needs '<module>.weight_scale_inv' for every '<module>.weight')")


def check_no_nan_scales(layer, prefix: str, params) -> None:
    """Raise naming the first scale tensor that still holds E8M0 255 (never written, or NaN input)."""
    for name in params:
        t = getattr(layer, name)
        if t.dtype == F.SCALE_DTYPE and t.numel() and bool((t == SCALE_SENTINEL).any()):
            raise WireFormatError(f"{prefix}.{name}: holds E8M0 255 (scales never written -- the checkpoint "
                                  "misses part of this tensor -- or a NaN/Inf block in a high-precision weight)")


def labels_only(prefix: str) -> Callable[[object, str], tuple]:
    """A ``shard_info`` that names tensors ``<prefix>.<param>`` and checks no expected shape."""
    return lambda key, param: (f"{prefix}.{param}", None)


def accounting_problems(grid_layers, partial: bool = False) -> list[str]:
    """Write accounting of an update over ``(prefix, layer)`` pairs of on-grid layers: any
    (parameter, shard) written more than once, and -- for a full update -- any never written.
    Dense layers carry ``grid_expected_shards``; MoE layers ``grid_num_local_experts`` (w1/w3
    into ``w13_weight``, w2 into ``w2_weight``, the same shards for their scales)."""
    problems = []
    for prefix, layer in grid_layers:
        w = writes(layer)
        problems += [f"{prefix}.{param}[{shard}]: written {n} times" for (param, shard), n in w.items() if n > 1]
        if partial:
            continue
        expected = getattr(layer, "grid_expected_shards", None)
        if expected is not None:                                  # dense
            for p in ("weight", "weight_scale_inv"):
                problems += [f"{prefix}.{p}[{s}]: never written" for s in expected
                             if w.get((p, s), 0) == 0 and w.get((p, ALL_SHARDS), 0) == 0]
        elif hasattr(layer, "grid_num_local_experts"):            # MoE
            e = layer.grid_num_local_experts
            for p, shards in (("w13_weight", ("w1", "w3")), ("w2_weight", ("w2",))):
                for q in (p, p + "_scale_inv"):
                    problems += [f"{prefix}.{q}[{s}, expert {x}]: never written"
                                 for s in shards for x in range(e) if w.get((q, (s, x)), 0) == 0]
    return problems


# -- an on-grid Linear's parameters, for both engines ---------------------------------------------

def dense_shard_key(*args, **kwargs):
    """The shard a dense Linear's weight-loader call writes: the positional shard id (fused q/k/v or
    gate/up index) or ``loaded_shard_id``; None for an unfused layer."""
    if args:
        return args[0]
    return kwargs.get("loaded_shard_id")


def expected_dense_shards(fused: str | None, n_parts: int) -> list:
    """The shards a full checkpoint writes into a dense Linear: ``fused`` "qkv" (q, k, v), "merged"
    (gate/up: 0 .. n_parts-1) or None (one unsharded write)."""
    if fused == "qkv":
        return ["q", "k", "v"]
    if fused == "merged":
        return list(range(n_parts))
    return [None]


def create_grid_linear(layer, prefix: str, output_partition_sizes, k: int, params_dtype, base_loader: Callable,
                       weight_attrs: dict, set_weight_attrs: Callable, shard_info: Callable, fused: str | None) -> None:
    """Register an on-grid Linear's fp8 ``weight`` [N, K] and uint8 ``weight_scale_inv`` [N, K/32] on
    ``layer`` with the grid loaders, and the facts the later checks read.  The engine supplies its
    facts: ``set_weight_attrs`` (its helper), ``shard_info(layer)`` (see ``wrap_weight_loader``; made
    once the parameters exist) and ``fused`` (see ``expected_dense_shards``)."""
    check_linear_partition(prefix, output_partition_sizes, k)
    weight, scale = new_grid_params((sum(output_partition_sizes), k))
    for p in (weight, scale):
        set_weight_attrs(p, {"input_dim": 1, "output_dim": 0, **weight_attrs})
    layer.register_parameter("weight", weight)
    layer.register_parameter("weight_scale_inv", scale)
    info = shard_info(layer)
    weight.weight_loader = wrap_weight_loader(layer, "weight", "weight_scale_inv", base_loader, dense_shard_key, info)
    scale.weight_loader = wrap_scale_loader(layer, "weight_scale_inv", base_loader, dense_shard_key, info)
    layer.grid_prefix = prefix
    layer.grid_act_dtype = params_dtype
    layer.grid_expected_shards = expected_dense_shards(fused, len(output_partition_sizes))
    writes(layer).clear()


#: the on-grid parameters of fused experts
MOE_GRID_PARAMS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")


def check_moe_dims(prefix: str, hidden: int, intermediate: int) -> None:
    if hidden % F.BLOCK_SIZE or intermediate % F.BLOCK_SIZE:
        raise WireFormatError(f"{prefix}: experts of hidden {hidden}, intermediate {intermediate} per partition are "
                              f"not on the MXFP8 grid (multiples of {F.BLOCK_SIZE} needed after TP splitting)")


def moe_shard_key(layer) -> Callable:
    """The key of one expert shard write, ``(shard_id, local expert)``, or SKIP for an expert of another
    rank -- both engines' FusedMoE loaders take ``(param, loaded, weight_name, shard_id, expert_id)``
    and map global to local experts with ``_map_global_expert_id_to_local_expert_id``."""
    def shard_key(*args, **kwargs):
        shard = kwargs.get("shard_id", args[1] if len(args) > 1 else None)
        expert = kwargs.get("expert_id", args[2] if len(args) > 2 else None)
        local = layer._map_global_expert_id_to_local_expert_id(expert)
        return SKIP if local == -1 else (shard, local)
    return shard_key


def create_grid_moe(layer, prefix: str, num_experts: int, hidden: int, intermediate: int, params_dtype,
                    base_loader: Callable, weight_attrs: dict, set_weight_attrs: Callable, scale_quant_method: str,
                    shard_info: Callable) -> None:
    """Register on-grid fused experts on ``layer``: ``w13_weight`` [E, 2I, H] (gate rows, then up rows),
    ``w2_weight`` [E, H, I] (fp8) and their uint8 ``*_scale_inv`` [.., K/32], with the grid loaders and
    the facts the later checks read.  The engine supplies ``set_weight_attrs``, the scales'
    ``quant_method`` attribute (its FusedMoE GROUP value) and ``shard_info`` (see ``wrap_weight_loader``)."""
    check_moe_dims(prefix, hidden, intermediate)
    e, h, i = num_experts, hidden, intermediate
    key = moe_shard_key(layer)
    for wname, shape in (("w13_weight", (e, 2 * i, h)), ("w2_weight", (e, h, i))):
        sname = wname + "_scale_inv"
        w, s = new_grid_params(shape)
        set_weight_attrs(w, weight_attrs)
        set_weight_attrs(s, {**weight_attrs, "quant_method": scale_quant_method})
        layer.register_parameter(wname, w)
        layer.register_parameter(sname, s)
        w.weight_loader = wrap_weight_loader(layer, wname, sname, base_loader, key, shard_info, named_loader=True)
        s.weight_loader = wrap_scale_loader(layer, sname, base_loader, key, shard_info)
    layer.grid_prefix = prefix
    layer.grid_num_local_experts = e
    layer.grid_act_dtype = params_dtype
    writes(layer).clear()


def check_moe_complete(layer, prefix: str) -> None:
    """Every local expert's w1, w3 and w2 written, weights and scales (``check_no_nan_scales`` with
    ``MOE_GRID_PARAMS`` is the other half of a load check; each engine runs it when it should)."""
    e = layer.grid_num_local_experts
    for wname, shards in (("w13_weight", ("w1", "w3")), ("w2_weight", ("w2",))):
        check_complete(layer, prefix, [(sh, x) for sh in shards for x in range(e)], (wname, wname + "_scale_inv"))
