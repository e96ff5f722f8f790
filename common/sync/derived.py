"""A registry of derived tensors: every copy an engine keeps besides the learner's bytes.

Kernel layouts (swizzled scales, repacked or dequantized weights, caches) are rebuilt from
the parameters after each update.  Each entry names its owner, the live tensor, and a
``builder`` that recomputes it from the current parameters; the derived-state check rebuilds
into a temporary tensor and compares fingerprints with the live one, so a copy that an
update forgot to rebuild is caught (and named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .digest import fingerprint


@dataclass
class Derived:
    owner: str
    name: str
    tensor: torch.Tensor
    builder: Callable[[], torch.Tensor]

    def stale(self) -> bool:
        with torch.no_grad():
            return fingerprint(self.tensor) != fingerprint(self.builder().to(self.tensor.dtype))


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
        return [f"{d.owner}.{d.name}" for d in self if d.stale()]
