"""The ``sglang.srt.plugins`` entry point: registers ``--quantization mxfp8-learner-grid``.

SGLang's ``load_plugins()`` calls :func:`register` once per process that loads plugins
(``sglang serve`` / ``python -m sglang.launch_server`` before the arguments are parsed,
``Engine``, every scheduler process, the DP controller, the detokenizer).  It

* adds the name to the ``--quantization`` choices (``add_quantization_method_choices``);
* puts :class:`~.config.LearnerGridConfig` into ``QUANTIZATION_METHODS`` (and the AMX-CPU
  table) in place -- what ``ModelConfig._verify_quantization`` and
  ``get_quantization_config`` read;
* registers the hooks of ``patches/sglang_qwen3_kv_scales.py`` and
  ``patches/sglang_update_access.py`` (the bridge closed by default: no network without an API
  key, no NCCL rendezvous outside ``MXFP8_GRID_NCCL_HOSTS``) with SGLang's ``HookRegistry``
  (``load_plugins()`` applies them right after the plugins ran);

is idempotent, and imports no CUDA.  **Failure stops the launch**: ``load_plugins()``
catches ``Exception`` from a plugin and only logs it, so a broken registration would
surface later as "invalid choice" or "Unknown quantization method".  :func:`register`
therefore raises :class:`GridPluginError`, a ``SystemExit`` subclass that
``load_plugins()`` does not catch: the process that loads the plugin exits with a message
naming the cause.  To run SGLang without the plugin, leave ``mxfp8_learner_grid`` out of
``SGLANG_PLUGINS`` (a comma-separated whitelist of entry-point names).

This module imports nothing but the standard library at import time, so the entry point
itself always loads (an import error there would only be logged by SGLang).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("mxfp8_learner_grid.sglang")
ENTRY_POINT = "mxfp8_learner_grid"
_registered = False


class GridPluginError(SystemExit):
    """Registration failed; raised through SGLang's plugin loader, which catches only Exception."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def register() -> None:
    global _registered
    if _registered:
        return
    version = "?"
    try:
        import importlib.metadata
        version = importlib.metadata.version("sglang")
        from . import compat
        warnings = compat.check_version()
        from mxfp8_learner_grid.common.wire import QUANT_METHOD

        from .config import LearnerGridConfig
        if QUANT_METHOD not in compat.QUANTIZATION_CHOICES:
            compat.add_quantization_method_choices([QUANT_METHOD])
        for registry in compat.quantization_registries():
            registry[QUANT_METHOD] = LearnerGridConfig
        from mxfp8_learner_grid.patches import sglang_qwen3_kv_scales, sglang_update_access
        sglang_qwen3_kv_scales.register(compat.SGLANG_VERSION)    # HookRegistry; applied by load_plugins()
        sglang_update_access.register(compat.SGLANG_VERSION)
    except Exception as exc:
        msg = (f"mxfp8-learner-grid could not register its quantization method with SGLang {version}: "
               f"{type(exc).__name__}: {exc}. Fix the installation, or run SGLang without this plugin by "
               f"leaving '{ENTRY_POINT}' out of SGLANG_PLUGINS.")
        logger.error(msg)
        raise GridPluginError(msg) from exc
    for w in warnings:
        logger.warning("mxfp8-learner-grid: %s", w)
    _registered = True


def is_registered() -> bool:
    return _registered
