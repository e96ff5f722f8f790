"""Derived tensors follow every write into an on-grid parameter, whoever writes it.

A kernel may keep tensors derived from a layer's parameters (a dequantized fp32 copy on CPU,
a Marlin-packed weight and permuted scales on the GPU).  Those copies must never go stale:
a trainer that pushes weights through the engine's own ``model.load_weights`` (as most RL
frameworks do), a direct call of a layer's weight loader, SGLang's ``update_weights_from_*``
and this project's update session all write through the loader wrappers of
``common.loading``, which call :func:`mark_written` after each write.

* Outside a :func:`deferred_refresh` scope, the written layer's derived tensors are rebuilt
  at once (MoE: only the written expert), in place -- storage never moves, so captured CUDA
  graphs stay valid.  One loader call leaves the layer consistent before anything can run a
  forward.
* Inside a scope (the update session wraps each bucket in one; so may any caller that writes
  many shards in a row), writes only mark layers stale, and the scope's exit rebuilds each
  stale layer once.  The exit rebuilds even when the body raised: derived tensors always
  describe the bytes the parameters hold.

Before ``process_weights_after_loading`` (the engine's first load) nothing is derived yet
and writes are only counted.  The same holds while an engine rebuilds a layer: vLLM's layerwise
reload (the start/finish of its weight-transfer engines) puts the layer's parameters on the
meta device and drops its buffers, replays the loads, then runs ``process_weights_after_loading``
again, which derives from the new bytes; vLLM then copies the result into the live storage (the
kernels register derived tensors as persistent buffers for that copy).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Optional

_state = threading.local()

#: a stale mark that covers the whole layer (dense layers; MoE writes without an expert id)
WHOLE = None


def _scope_stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def processed(layer) -> bool:
    """Has ``layer``'s kernel processed its weights?  Then a write is refreshed: its derived tensors (if it has
    any) rebuilt, and its guards on the new bytes (:func:`guard`) run even where nothing is derived."""
    return bool(getattr(layer, "grid_processed", False) and getattr(layer, "grid_kernel", None) is not None)


def mark_written(layer, expert: Optional[int] = WHOLE) -> None:
    """A loader wrote into ``layer``'s on-grid parameters (MoE: into local ``expert``)."""
    if not processed(layer):
        return
    stack = _scope_stack()
    if stack:
        stack[-1].setdefault(id(layer), (layer, set()))[1].add(expert)
        return
    refresh_layer(layer, [expert])


def refresh_layer(layer, experts: Optional[Iterable] = None) -> None:
    """Rebuild ``layer``'s derived tensors in place (``experts``: local expert ids to rebuild,
    ``None`` or a set holding :data:`WHOLE`: everything)."""
    kernel = getattr(layer, "grid_kernel", None)
    if kernel is None or not getattr(layer, "grid_processed", False) or rebuilding(layer, kernel):
        return
    experts = None if experts is None else set(experts)
    if experts is not None and WHOLE in experts:
        experts = None
    kernel.refresh(layer, None if experts is None else sorted(experts))


def rebuilding(layer, kernel) -> bool:
    """Is an engine rebuilding ``layer`` (its derived tensors gone, or its parameters on the meta
    device)?  Then ``process_weights_after_loading`` derives everything afresh when it is done."""
    if any(not hasattr(layer, name) for name in kernel.derived_names(layer)):
        return True
    return any(p.is_meta for p in layer.parameters(recurse=False))


@contextlib.contextmanager
def deferred_refresh():
    """Writes inside only mark layers stale; leaving the outermost scope rebuilds each once, then reads the
    kernels' guards on the new bytes (:func:`guard`) in one synchronization and raises the first that fails
    (unless the body raised: its error wins)."""
    stack = _scope_stack()
    stale: dict = {}
    stack.append(stale)
    failed = False
    try:
        yield stale
    except BaseException:
        failed = True
        raise
    finally:
        stack.pop()
        if stack:                                   # nested: the outer scope rebuilds
            for key, (layer, experts) in stale.items():
                stack[-1].setdefault(key, (layer, set()))[1].update(experts)
        else:
            try:
                for layer, experts in stale.values():
                    refresh_layer(layer, experts)
            finally:
                pending, _state.guards = _guards(), []
            if not failed and pending:
                from .sync.digest import read_flags
                for (_, check), hit in zip(pending, read_flags([f for f, _ in pending])):
                    if hit:
                        check()


def _guards() -> list:
    if not hasattr(_state, "guards"):
        _state.guards = []
    return _state.guards


def guard(flag, check) -> None:
    """A kernel's guard on the bytes it just derived from: ``flag`` (a 0-dim bool tensor, not yet read: no
    synchronization) says whether ``check()`` -- which raises, naming the layer -- must run.  Inside a
    :func:`deferred_refresh` scope (an update's bucket) every flag is read once, when the outermost scope
    exits, so a bucket costs one synchronization, not one per layer; outside one, now."""
    if _scope_stack():
        _guards().append((flag, check))
    elif bool(flag):
        check()
