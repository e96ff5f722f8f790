"""Which modules run on the grid: one rule, shared by the learner drop-in and both plugins.

A module name (Hugging Face / engine prefix, e.g. ``model.layers.3.self_attn.qkv_proj``)
is on the grid when it matches an ``include`` pattern and no ``exclude`` pattern.
Patterns are shell globs (``fnmatch``) unless they start with ``re:``, then they are
Python regular expressions matched against the whole name.  ``layers`` optionally
restricts the grid to decoder layers whose index (the number after ``layers.``) is in
the given set -- the consistency study's "half of the layers" is
``ModuleSelection(layers=range(0, n, 2))`` or ``layers=range(n // 2)``.

Embeddings, the lm_head, norms and MoE routers are never Linear layers on the grid by
default: ``DEFAULT_EXCLUDE`` keeps the head and the routers in the model dtype.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

DEFAULT_INCLUDE = ("*",)
#: lm_head / output layer and MoE routers stay in the model dtype (as Megatron/TE keeps them)
DEFAULT_EXCLUDE = ("lm_head", "*.lm_head", "output_layer", "*.mlp.gate", "*.router", "*.mlp.router")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _match(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def layer_index(name: str) -> Optional[int]:
    """The decoder-layer index in a module name (``...layers.<i>...``), or None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ModuleSelection:
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    layers: Optional[frozenset[int]] = None

    def __init__(self, include: Iterable[str] = DEFAULT_INCLUDE, exclude: Iterable[str] = DEFAULT_EXCLUDE,
                 layers: Optional[Iterable[int]] = None):
        object.__setattr__(self, "include", tuple(include))
        object.__setattr__(self, "exclude", tuple(exclude))
        object.__setattr__(self, "layers", None if layers is None else frozenset(int(i) for i in layers))
        for p in (*self.include, *self.exclude):
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ValueError(f"bad regular expression in module selection {p!r}: {exc}") from None

    def included(self, name: str) -> bool:
        """An include pattern matches and the layer index (if restricted) is selected."""
        if not any(_match(p, name) for p in self.include):
            return False
        if self.layers is not None:
            idx = layer_index(name)
            if idx is None or idx not in self.layers:
                return False
        return True

    def excluded(self, name: str) -> bool:
        return any(_match(p, name) for p in self.exclude)

    def matches(self, name: str) -> bool:
        return self.included(name) and not self.excluded(name)

    def matches_fused(self, name: str, shard_names: Iterable[str]) -> bool:
        """Is an engine's fused module (e.g. ``...qkv_proj`` of ``q_proj``/``k_proj``/``v_proj``) on the grid?

        It is when its fused name or all of its shards are selected and neither it nor any
        shard is excluded.  A selection that splits a fused module raises ``ValueError``:
        the engine computes it in one GEMM, so it is on the grid whole or not at all.
        """
        shard_names = list(shard_names)
        ex = [self.excluded(n) for n in shard_names]
        if self.excluded(name) or (ex and all(ex)):
            return False
        if any(ex):
            raise ValueError(f"module selection excludes only some of the shards {shard_names} fused in {name}")
        if self.included(name):
            return True
        inc = [self.included(n) for n in shard_names]
        if inc and all(inc):
            return True
        if any(inc):
            raise ValueError(f"module selection includes only some of the shards {shard_names} fused in {name}")
        return False

    # -- (de)serialisation: the plugins carry this inside quantization_config ---------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"include": list(self.include), "exclude": list(self.exclude)}
        if self.layers is not None:
            d["layers"] = sorted(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "ModuleSelection":
        d = dict(d or {})
        unknown = set(d) - {"include", "exclude", "layers"}
        if unknown:
            raise ValueError(f"unknown module-selection keys {sorted(unknown)} "
                             "(expected include, exclude, layers)")
        for key in ("include", "exclude"):
            if isinstance(d.get(key), str):
                d[key] = [d[key]]
        return cls(include=d.get("include", DEFAULT_INCLUDE), exclude=d.get("exclude", DEFAULT_EXCLUDE),
                   layers=d.get("layers"))
