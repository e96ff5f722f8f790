"""Loading weights onto the grid inside vLLM's own loaders.

Every on-grid layer has two parameters per weight: ``<w>`` (float8_e4m3fn, the learner's
rowwise data) and ``<w>_scale_inv`` (uint8 E8M0, [rows, K/32]).  Both use vLLM's own
weight loader for the layer (so TP narrowing, q/k/v and gate/up offsets, expert ids are
vLLM's), wrapped to:

* take a BF16/FP16/FP32 checkpoint tensor, quantize it rowwise on the grid (TE-exact,
  ``common.quantize_rows``; rows are independent, so quantizing a shard or the whole
  tensor gives the same bytes) and load data and scales through the same loader;
* take an FP8 tensor (a pre-quantized wire-format checkpoint) as the learner's bytes:
  copied, never re-quantized;
* count every write per (parameter, shard) so that ``process_weights_after_loading`` can
  name anything the checkpoint never provided.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch

from mxfp8_learner_grid.common import format as F
from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.recorder import note_derived_source
from mxfp8_learner_grid.common.wire import WireFormatError

SCALE_SENTINEL = 0xFF   # E8M0 NaN: never a learner scale; marks scales nobody wrote
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
SKIP = object()         # shard_key result for a write vLLM's loader drops (expert of another rank)
ALL_SHARDS = None       # shard key of a write that covers every shard (fused on disk)


def writes(layer) -> Counter:
    """(parameter name, shard) -> number of writes, since creation or the last reset."""
    if not hasattr(layer, "_grid_writes"):
        layer._grid_writes = Counter()
    return layer._grid_writes


def _call(base_loader, name: str, param, loaded, *args, **kwargs):
    """vLLM's loader, with its bare assertion / shape errors turned into one that names the tensor."""
    try:
        return base_loader(param, loaded, *args, **kwargs)
    except WireFormatError:
        raise
    except Exception as exc:
        raise WireFormatError(f"{name}: cannot load a checkpoint tensor of shape {tuple(loaded.shape)} "
                              f"({loaded.dtype}) into the engine's {tuple(param.shape)} ({param.dtype}) "
                              f"parameter: {type(exc).__name__}: {exc}") from exc


def _check_fp8_on_grid(name: str, t: torch.Tensor) -> None:
    if t.dim() < 2 or t.shape[-1] % F.BLOCK_SIZE:
        raise WireFormatError(f"{name}: shape {tuple(t.shape)} is not on the MXFP8 grid "
                              f"(K must be a multiple of {F.BLOCK_SIZE})")


def wrap_weight_loader(layer, weight_param: str, scale_param: str, base_loader: Callable,
                       prefix: str, shard_key: Callable[..., object], named_loader: bool = False) -> Callable:
    """A loader for ``layer.<weight_param>`` that quantizes high-precision checkpoints on the grid.

    ``shard_key(*args, **kwargs)`` names the shard a call writes (e.g. "q", 0, ("w1", 3)).
    ``named_loader``: the loader's third argument is the checkpoint name (MoE), which is
    renamed to the scale's name when the scales go through it.
    """

    @functools.wraps(base_loader)
    def load_weight(param, loaded_weight, *args, **kwargs):
        name = f"{prefix}.{weight_param}"
        key = shard_key(*args, **kwargs)
        if loaded_weight.dtype in HIGH_PRECISION:
            if loaded_weight.shape[-1] % F.BLOCK_SIZE:
                raise WireFormatError(f"{name}: checkpoint shape {tuple(loaded_weight.shape)} is not on the "
                                      f"MXFP8 grid (in_features must be a multiple of {F.BLOCK_SIZE})")
            q, s = quantize_rows(loaded_weight)
            note_derived_source(q, loaded_weight, "data")
            note_derived_source(s, loaded_weight, "scale")
            out = _call(base_loader, name, param, q, *args, **kwargs)
            sname = f"{prefix}.{scale_param}"
            if named_loader:
                _call(base_loader, sname, getattr(layer, scale_param), s, *_scale_args(args), **_scale_kwargs(kwargs))
            else:
                _call(base_loader, sname, getattr(layer, scale_param), s, *args, **kwargs)
            if key is not SKIP:
                writes(layer)[(scale_param, key)] += 1
        elif loaded_weight.dtype == F.FP8_DTYPE:
            _check_fp8_on_grid(name, loaded_weight)
            out = _call(base_loader, name, param, loaded_weight, *args, **kwargs)
        else:
            raise WireFormatError(f"{name}: checkpoint tensor has dtype {loaded_weight.dtype}; expected "
                                  f"float8_e4m3fn (wire format) or bf16/fp16/fp32 (quantized on load)")
        if key is not SKIP:
            writes(layer)[(weight_param, key)] += 1
        return out

    return load_weight


def wrap_scale_loader(layer, scale_param: str, base_loader: Callable, prefix: str,
                      shard_key: Callable[..., object]) -> Callable:
    @functools.wraps(base_loader)
    def load_scale(param, loaded_weight, *args, **kwargs):
        name = f"{prefix}.{scale_param}"
        if loaded_weight.dtype != F.SCALE_DTYPE:
            raise WireFormatError(f"{name}: scales must be uint8 (E8M0); got {loaded_weight.dtype}")
        if loaded_weight.dim() < 2:
            raise WireFormatError(f"{name}: scales must be [N, K/32]; got shape {tuple(loaded_weight.shape)}")
        if loaded_weight.numel() and int(loaded_weight.max()) == F.E8M0_NAN:
            raise WireFormatError(f"{name}: holds the E8M0 NaN code 255")
        out = _call(base_loader, name, param, loaded_weight, *args, **kwargs)
        key = shard_key(*args, **kwargs)
        if key is not SKIP:
            writes(layer)[(scale_param, key)] += 1
        return out

    return load_scale


# The MoE loader takes the checkpoint name as its third argument and routes scales by
# "scale" in that name: give the scale its own name when we load it ourselves.
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
    """Raise naming every (parameter, shard) the checkpoint never wrote, and scale sentinels left."""
    w = writes(layer)
    missing = [f"{prefix}.{p}[{s}]" if s is not None else f"{prefix}.{p}"
               for p in params for s in expected_shards
               if w.get((p, s), 0) == 0 and w.get((p, ALL_SHARDS), 0) == 0]
    if missing:
        raise WireFormatError(
            "mxfp8-learner-grid: these on-grid tensors were never loaded from the checkpoint: "
            + ", ".join(missing[:16]) + (" ..." if len(missing) > 16 else "")
            + " (a pre-quantized checkpoint needs '<module>.weight_scale_inv' for every '<module>.weight')")
