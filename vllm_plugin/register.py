"""The ``vllm.general_plugins`` entry point: registers ``--quantization mxfp8-learner-grid``.

vLLM calls this once per process (API server, engine core, every worker, the model
inspection subprocess).  It is idempotent, never touches CUDA, and -- unlike an import
error, which vLLM only logs until it surfaces as "Unknown quantization method" in another
process -- fails loudly, in the process that loads it, naming what is missing.  To run
vLLM without the plugin, leave it out of ``VLLM_PLUGINS``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("mxfp8_learner_grid.vllm")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    try:
        import vllm

        version = getattr(vllm, "__version__", "?")
        from . import compat
        warnings = compat.check_version()
        from mxfp8_learner_grid.common.wire import QUANT_METHOD

        from .config import MXFP8LearnerGridConfig
        compat.register_quantization_config(QUANT_METHOD)(MXFP8LearnerGridConfig)
    except Exception as exc:
        raise RuntimeError(
            f"mxfp8-learner-grid could not register its quantization method with vLLM {locals().get('version', '?')}:"
            f" {type(exc).__name__}: {exc}. Fix the installation, or run vLLM without this plugin by leaving "
            "'mxfp8_learner_grid' out of VLLM_PLUGINS.") from exc
    for w in warnings:
        logger.warning("mxfp8-learner-grid: %s", w)
    _registered = True
