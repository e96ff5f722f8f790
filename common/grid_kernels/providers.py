"""Kernels an engine ships, handed to ``common`` as plain callables (``common`` imports no engine).

Both plugins register vLLM's MXFP8 Marlin ops here (``vllm_plugin/marlin_ops.py``): the vLLM
plugin as vLLM loaded them, the SGLang plugin where vLLM's two compiled libraries are there
(``$MXFP8_GRID_VLLM_OPS``, or an installed vLLM), loaded without vLLM's Python.  A kernel
that needs a provider declares it in ``is_supported``; without it the chooser moves on.
"""

from __future__ import annotations

from typing import Any, Optional

_PROVIDERS: dict[str, Any] = {}


def register(name: str, ops: Any) -> None:
    _PROVIDERS[name] = ops


def get(name: str) -> Optional[Any]:
    return _PROVIDERS.get(name)


def unregister(name: str) -> None:
    _PROVIDERS.pop(name, None)
