"""One on-grid weight -- E4M3 data and its E8M0 scales -- and the one rule set that validates it.

A :class:`GridWeight` is the pair the wire format carries (``common/wire.py``)::

    data    float8_e4m3fn  [N, K] or [E, N, K]        TE's rowwise bytes
    scales  uint8 (E8M0)   data.shape[:-1] + (K/32,)  compact, padding stripped, never swizzled

Every place that checks such a pair -- ``wire.check_pair`` / ``wire.split_state_dict``,
``linear.check_weight``, the engines' loaders (``loading``: data and scales arrive through
separate loader calls) and the update manifest (``sync.manifest``: shapes and dtypes only,
before any byte moves) -- uses the rule functions below, so there is one rule set and one
wording, and every message starts with the name of the tensor at fault:

* data: ``float8_e4m3fn`` (``uint8`` E4M3 codes where the caller says so), 2-D or 3-D, K a
  multiple of 32 and, for a whole weight, N too (TE's rule; it keeps TP shards exact);
* scales: ``uint8``, shape ``data.shape[:-1] + (K // 32,)`` exactly (``format.BLOCK_SIZE``;
  a larger one is TE's padding, named as such), never the E8M0 NaN code 255;
* a pair: both tensors present and on one device.

:meth:`GridWeight.from_te` is the one reader of Transformer Engine's rowwise copy (a TE
``MXFP8Tensor`` or its flattened ``_rowwise_data`` / ``_rowwise_scale_inv`` state): TE's
padding stripped, the GEMM swizzle undone, the bytes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from . import format as F
from .layout import strip_padding, unswizzle_scales
from .wire import SCALE_SUFFIX, WEIGHT_SUFFIX, WireFormatError, scale_name

#: TE's rowwise fields (attributes of an ``MXFP8Tensor``; suffixes of a flattened export)
TE_ROWWISE_DATA = "_rowwise_data"
TE_ROWWISE_SCALES = "_rowwise_scale_inv"
TE_SWIZZLED = "_with_gemm_swizzled_scales"

PADDING_HINT = " (TE padding not stripped? send scale_inv[:N, :K/32])"
_E8M0_DTYPES = (F.SCALE_DTYPE,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def scales_label(name: str) -> str:
    """How a message names the scales of weight ``name``: their wire name where ``name`` is a
    ``<module>.weight``, else ``"<name> scales"``."""
    return scale_name(name) if name.endswith(WEIGHT_SUFFIX) else f"{name} scales"


def scale_shape(data_shape: Sequence[int]) -> tuple[int, ...]:
    """The unpadded scale shape of a weight of ``data_shape``: ``data_shape[:-1] + (K/32,)``."""
    shape = tuple(int(d) for d in data_shape)
    return (*shape[:-1], shape[-1] // F.BLOCK_SIZE)


# -- the rules: each returns the problem (a message naming the tensor) or None --------------------
# They read shapes and dtypes only, so they serve tensors, meta tensors and manifest specs alike.

def grid_shape_problem(name: str, shape: Sequence[int], whole: bool = True) -> Optional[str]:
    """K a multiple of 32 and, for a ``whole`` weight, N too (a loader's write may be a part of a
    weight whose rows the engine's layer checks: ``loading.check_linear_partition``)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        return f"{name}: on-grid weight must be 2-D [N, K] or 3-D [E, N, K]; got shape {shape}"
    n, k = shape[-2:]
    if k % F.BLOCK_SIZE or (whole and n % F.BLOCK_SIZE):
        dims = "N and K must be multiples" if whole else "K must be a multiple"
        return f"{name}: shape {shape} is not on the MXFP8 grid ({dims} of {F.BLOCK_SIZE})"
    return None


def data_problem(name: str, shape: Sequence[int], dtype: torch.dtype, whole: bool = True,
                 codes: bool = False) -> Optional[str]:
    """The data of an on-grid weight: float8_e4m3fn (or, with ``codes``, uint8 E4M3 codes) on the grid."""
    if dtype != F.FP8_DTYPE and not (codes and dtype == torch.uint8):
        want = f"{F.FP8_DTYPE} or uint8 E4M3 codes" if codes else str(F.FP8_DTYPE)
        return f"{name}: on-grid weight must be {want}; got {dtype}"
    return grid_shape_problem(name, shape, whole)


def scales_problem(label: str, shape: Sequence[int], dtype: torch.dtype,
                   data_shape: Optional[Sequence[int]] = None) -> Optional[str]:
    """The scales (named ``label``) of a weight of ``data_shape``: uint8, ``scale_shape(data_shape)``
    exactly.  Without ``data_shape`` (not known yet) only the number of dims is checked."""
    shape = tuple(int(d) for d in shape)
    if dtype != F.SCALE_DTYPE:
        return f"{label}: scales must be uint8 (E8M0); got {dtype}"
    if data_shape is None:
        if len(shape) not in (2, 3):
            return f"{label}: shape {shape}; expected scales [N, K/32] or [E, N, K/32]"
        return None
    want = scale_shape(data_shape)
    if shape != want:
        hint = PADDING_HINT if len(shape) == len(want) and all(s >= w for s, w in zip(shape, want)) else ""
        return (f"{label}: shape {shape}; expected {want} for weight "
                f"{tuple(int(d) for d in data_shape)}{hint}")
    return None


def scale_values_problem(label: str, scales: torch.Tensor) -> Optional[str]:
    """E8M0 255 (NaN) is never a learner's scale (TE only reaches it from a NaN amax)."""
    if scales.numel() and int(scales.max()) == F.E8M0_NAN:
        return f"{label}: holds the E8M0 NaN code {F.E8M0_NAN}"
    return None


def missing_scales_problem(name: str) -> str:
    return f"{name}: on-grid weight has no '{SCALE_SUFFIX[1:]}' tensor"


def _raise(problem: Optional[str]) -> None:
    if problem is not None:
        raise WireFormatError(problem)


def check_grid_shape(name: str, shape: Sequence[int], whole: bool = True) -> None:
    _raise(grid_shape_problem(name, shape, whole))


def check_data(name: str, data: torch.Tensor, whole: bool = True, codes: bool = False) -> None:
    _raise(data_problem(name, data.shape, data.dtype, whole, codes))


def check_scales(label: str, scales: torch.Tensor, data_shape: Optional[Sequence[int]] = None,
                 values: bool = True) -> None:
    _raise(scales_problem(label, scales.shape, scales.dtype, data_shape))
    if values:
        _raise(scale_values_problem(label, scales))


# -- the pair -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GridWeight:
    """An on-grid weight ``name``: fp8 ``data`` [..., N, K] and uint8 ``scales`` [..., N, K/32].

    Build it with :meth:`checked` (tensors at hand) or :meth:`from_te` (TE's rowwise copy); the
    plain constructor does not validate.  :meth:`to_wire` gives its wire-format tensors.
    """

    name: str
    data: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def checked(cls, name: str, data: torch.Tensor, scales: Optional[torch.Tensor], *,
                codes: bool = False, values: bool = True) -> "GridWeight":
        """Validate (data, scales) by the rule set and return the pair; raise
        :class:`~.wire.WireFormatError` naming the tensor at fault.

        ``codes``: accept uint8 data as E4M3 codes (viewed as float8_e4m3fn in the result).
        ``values``: also refuse the E8M0 NaN code (reads the scales: a device sync on a GPU).
        """
        if scales is None:
            raise WireFormatError(missing_scales_problem(name))
        check_data(name, data, codes=codes)
        label = scales_label(name)
        check_scales(label, scales, data.shape, values=False)
        if data.device != scales.device:
            raise WireFormatError(f"{name}: on-grid weight is on {data.device} but its scales ({label}) are on "
                                  f"{scales.device}; both must be on one device")
        if values:
            _raise(scale_values_problem(label, scales))
        if data.dtype != F.FP8_DTYPE:
            data = data.view(F.FP8_DTYPE)
        return cls(name, data, scales)

    @classmethod
    def from_te(cls, name: str, te: Any) -> "GridWeight":
        """TE's own bytes of an MXFP8 weight: its rowwise data and scales, TE's padding stripped and
        the GEMM swizzle undone (``_with_gemm_swizzled_scales``: fused grouped-MLP ops swizzle in place).

        ``te``: a Transformer Engine ``MXFP8Tensor`` (or its storage class; duck-typed), or a mapping
        with the same fields (a flattened export: ``_rowwise_data`` uint8 or fp8 codes,
        ``_rowwise_scale_inv`` uint8 in TE's padded compact or swizzled layout, optionally
        ``_with_gemm_swizzled_scales``, a bool or 0-d tensor).  The tensor's shape is ``te.shape``
        where it has one, else the data's.  The scale values are not read (no device sync).
        """
        get = te.get if isinstance(te, Mapping) else (lambda k, d=None: getattr(te, k, d))
        data, scales = get(TE_ROWWISE_DATA), get(TE_ROWWISE_SCALES)
        if data is None or scales is None:
            raise WireFormatError(f"{name}: TE MXFP8Tensor has no rowwise copy (quantizer without rowwise usage); "
                                  "the sampler's forward needs W's rowwise data and scales")
        swizzled = get(TE_SWIZZLED, False)
        swizzled = bool(swizzled.item()) if isinstance(swizzled, torch.Tensor) else bool(swizzled)
        shape = tuple(int(d) for d in (te.shape if not isinstance(te, Mapping) and hasattr(te, "shape")
                                       else data.shape))
        _raise(data_problem(name, shape, data.dtype, codes=True))      # the dtype of the bytes, the logical shape
        s_label = f"{name}.{TE_ROWWISE_SCALES}"
        if scales.dtype not in _E8M0_DTYPES:                            # (torch's float8_e8m0fnu: the same bytes)
            _raise(scales_problem(s_label, scales.shape, scales.dtype))
        try:
            m, k = F.check_te_shape(shape)
        except ValueError as exc:
            raise WireFormatError(f"{name}: {exc}") from None
        if data.numel() != m * k:
            raise WireFormatError(f"{name}: TE rowwise data of shape {tuple(data.shape)} does not hold a tensor "
                                  f"of shape {shape}")
        scales = scales.view(torch.uint8)
        if scales.dim() > 2 and all(d == 1 for d in scales.shape[:-2]):
            scales = scales.reshape(scales.shape[-2:])
        if scales.dim() != 2:
            raise WireFormatError(f"{s_label}: TE scales must be one 2-D matrix for the (M, K) = ({m}, {k}) "
                                  f"tensor TE quantized; got shape {tuple(scales.shape)}")
        try:
            if swizzled:
                scales = unswizzle_scales(scales)
            scales = strip_padding(scales, m, k // F.BLOCK_SIZE)
        except ValueError as exc:
            raise WireFormatError(f"{s_label}: {exc}") from None
        data = data.view(torch.uint8).reshape(shape).view(F.FP8_DTYPE).contiguous()
        return cls.checked(name, data, scales.reshape(scale_shape(shape)), values=False)

    # -- export -----------------------------------------------------------------------------------
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scales)."""
        return self.data, self.scales

    def to_wire(self, name: Optional[str] = None) -> dict[str, torch.Tensor]:
        """``{<module>.weight: data, <module>.weight_scale_inv: scales}`` (contiguous), under ``name``
        (default: this weight's own name), which must be a ``<module>.weight`` name."""
        target = self.name if name is None else name
        if not target.endswith(WEIGHT_SUFFIX):
            raise WireFormatError(f"{self.name}: an on-grid weight travels as '<module>{WEIGHT_SUFFIX}'; "
                                  f"got the name {target!r}")
        return {target: self.data.contiguous(), scale_name(target): self.scales.contiguous()}
