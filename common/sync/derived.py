"""A registry of derived tensors: every copy an engine keeps besides the learner's bytes.

Kernel layouts (swizzled scales, repacked or dequantized weights, caches) are rebuilt from
the parameters after each update.  Each entry names its owner, the live tensor, and a
``builder`` that recomputes it from the current parameters; the derived-state check rebuilds
into a temporary tensor and compares it with the live one byte for byte, on the tensor's own
device, so a copy that an update forgot to rebuild is caught (and named).

The comparison is of bit patterns, not of values: both tensors are viewed as the integer
dtype of their item size (a NaN with another payload, or -0 against +0, differs).  A rebuild
of another shape is stale.  A rebuild of another dtype or device is first converted to the
live tensor's, as the kernels' in-place refresh (``copy_``) would store it.  The registry's
check queues one comparison per entry on the device, frees each rebuild as soon as its
comparison is queued (peak memory: one rebuild) and synchronizes once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..packed_codes import plain
from .digest import Flag, read_flags

__all__ = ["Derived", "DerivedRegistry", "Flag", "differs", "read_flags"]

# item size -> an integer dtype of that size: the view that compares bit patterns
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same item size (any strides: no copy)."""
    as_int = _BITS.get(t.element_size())
    if as_int is not None:
        return t.view(as_int)
    return t.contiguous().view(torch.uint8)      # e.g. complex128: compared as bytes


def differs(live: torch.Tensor, built: torch.Tensor) -> Flag:
    """Does ``live`` hold other bytes than ``built`` (the rebuild)?  ``True`` / ``False`` on the CPU or
    when the shapes decide it, else a 0-dim bool tensor on ``live``'s device (read it later: no
    sync here)."""
    live = plain(live.detach())
    if tuple(built.shape) != tuple(live.shape):
        return True
    built = built.detach().to(device=live.device, dtype=live.dtype)
    if live.numel() == 0:
        return False
    a, b = _bits(live), _bits(built)
    if live.device.type == "cpu":
        return not torch.equal(a, b)         # no device to stay ahead of: decide now
    return torch.ne(a, b).any()


@dataclass
class Derived:
    owner: str
    name: str
    tensor: torch.Tensor
    builder: Callable[[], torch.Tensor]

    def stale_flag(self) -> Flag:
        """Rebuild and queue the comparison; the rebuild is freed on return (see :func:`differs`)."""
        with torch.no_grad():
            return differs(self.tensor, self.builder())

    def stale(self) -> bool:
        return read_flags([self.stale_flag()])[0]


class DerivedRegistry:
    def __init__(self):
        self.entries: dict[tuple[str, str], Derived] = {}

    def register(self, owner: str, name: str, tensor: torch.Tensor, builder: Callable[[], torch.Tensor]) -> None:
        self.entries[(owner, name)] = Derived(owner, name, tensor, builder)

    def __iter__(self):
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def stale(self) -> list[str]:
        """``owner.name`` of every entry whose live tensor differs from a rebuild, in registration order."""
        entries = list(self)
        flags = [d.stale_flag() for d in entries]          # each rebuild freed as soon as it is compared
        return [f"{d.owner}.{d.name}" for d, s in zip(entries, read_flags(flags)) if s]
