"""One small interface for every kernel that computes an on-grid layer.

Modelled on vLLM's ``model_executor/kernels/linear``: a kernel is a class with

* ``is_supported(spec)`` -- can it run on this platform at all (device, capability, the
  engine ops it needs);
* ``can_implement(spec)`` -- can it compute this layer exactly (shape, dtype, bias);
* ``process_weights_after_loading(layer)`` -- allocate its derived tensors, once;
* ``refresh(layer, experts)`` -- rewrite them in place from the parameters (every weight
  update; ``common.refresh`` calls it after any write);
* ``derived(layer)`` -- {name: (live tensor, builder)}: what the ``derived_state`` check rebuilds
  and compares;
* ``apply(layer, x, ...)`` -- the forward.

A layer chooses its kernel once, when its weights are processed (``choose``); the choice is
logged.  Kernels read the layer's on-grid parameters by the names in ``spec.params``
(``weight`` / ``weight_scale_inv``, or ``w13_weight`` ... for MoE), so that both engines'
layers fit without adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class LayerSpec:
    """The facts a kernel chooses by.  ``kind``: "linear" or "moe"."""
    prefix: str
    kind: str
    device_type: str
    act_dtype: torch.dtype
    n: int = 0                       # linear: out features of this rank; moe: 2 * intermediate (w13 rows)
    k: int = 0                       # linear: in features; moe: hidden size
    intermediate: int = 0            # moe: intermediate size per partition
    num_experts: int = 0             # moe: local experts
    has_bias: bool = False
    capability: Optional[tuple[int, int]] = None
    options: dict = field(default_factory=dict, compare=False, hash=False)


def platform_default(table: dict, capability, absent):
    """A default measured per compute capability: ``table``'s entry for ``capability``, else ``absent`` (an
    unmeasured platform, or off the GPU: ``capability`` None)."""
    return table.get(tuple(capability), absent) if capability else absent


def bf16_output_no_bias(spec: LayerSpec, kernel: str) -> tuple[bool, str]:
    """The rule of the weight-only kernels that write bf16 and have no FP32 bias epilogue."""
    if spec.act_dtype != torch.bfloat16:
        return False, (f"a {spec.act_dtype} model: {kernel} writes bf16, and the grid Linear's output must be "
                       f"rounded once to {spec.act_dtype}")
    if spec.has_bias:
        return False, f"a bias ({kernel} has no FP32 bias epilogue)"
    return True, ""


class GridKernel:
    """Base class.  Subclasses set ``name`` and ``kind`` and override what they need."""

    name = "base"
    kind = "linear"

    def __init__(self, spec: LayerSpec):
        self.spec = spec

    # -- choosing ----------------------------------------------------------------------
    @classmethod
    def is_supported(cls, spec: LayerSpec) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, spec: LayerSpec) -> tuple[bool, str]:
        return True, ""

    # -- derived state -------------------------------------------------------------------
    @staticmethod
    def register_derived_buffer(layer, name: str, tensor: torch.Tensor) -> None:
        """Attach a derived tensor to ``layer``.  Persistent, on purpose: vLLM's layerwise reload
        (its weight-transfer engines' start/finish) rebuilds a layer on the meta device, runs
        ``process_weights_after_loading`` again and copies the new tensors back into the live
        storage -- but skips non-persistent buffers, which would leave a derived copy stale."""
        layer.register_buffer(name, tensor, persistent=True)

    def derived_names(self, layer) -> tuple[str, ...]:
        """Attributes of ``layer`` this kernel derives from its parameters."""
        return ()

    def process_weights_after_loading(self, layer) -> None:
        """Allocate derived tensors (first call only) and fill them."""

    def refresh(self, layer, experts: Optional[list[int]] = None) -> None:
        """Rewrite the derived tensors in place (``experts``: only these local experts)."""

    def derived(self, layer) -> dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
        return {}

    # -- input -----------------------------------------------------------------------------
    #: can this kernel take an input that is already the grid values (option ``producer_qdq``)?
    accepts_grid_input = False

    def take_grid_input(self) -> None:
        """From now on the input is the grid values of the activation (its producer quantized it):
        skip the activation qdq.  Only ``common.producer_fusion`` calls this, when it swaps the producer."""
        raise ValueError(f"{self.spec.prefix}: kernel {self.name} quantizes its own input")

    # -- forward ---------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name
