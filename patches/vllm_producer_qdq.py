"""vLLM 0.26 / 0.32: a model-level step after the weights are processed, for option ``producer_qdq``.

vLLM gives a quantization method no hook that sees the whole model once its layers are processed,
and swapping a layer's producer (``common.producer_fusion``) needs the decoder layer, which a
Linear's method never sees.  ``BaseModelLoader.load_model`` (``model_loader/base_loader.py``) calls
the module-level ``process_weights_after_loading(model, model_config, target_device)`` once per
load, after every layer's method has run and before torch.compile traces the model.  This patch
wraps that name in ``base_loader``: the original runs first, unchanged; then, only when a grid
layer of the model has ``producer_qdq: true``, ``fuse_producers`` runs.  Models without the option
are untouched.

It is applied by the plugin's registration in every vLLM process, only for the vLLM releases it was
written for; with any other release, a model that asks for ``producer_qdq`` fails to load, naming
this patch (``require``), rather than running without the fusion it asked for.
"""

from __future__ import annotations

WRITTEN_FOR = {(0, 26), (0, 32)}
_applied = False
_why_not = "not applied yet"


def apply() -> bool:
    """Wrap ``base_loader.process_weights_after_loading`` once; return whether it is wrapped."""
    global _applied, _why_not
    if _applied:
        return True
    from mxfp8_learner_grid.vllm_plugin import compat
    if compat.VLLM_VERSION[:2] not in WRITTEN_FOR:
        _why_not = (f"it was written for vLLM {sorted(WRITTEN_FOR)}, this is "
                    f"{'.'.join(map(str, compat.VLLM_VERSION))}")
        return False
    from vllm.model_executor.model_loader import base_loader
    original = getattr(base_loader, "process_weights_after_loading", None)
    if original is None or not callable(original):
        raise RuntimeError("patch vllm_producer_qdq: vllm.model_executor.model_loader.base_loader has no "
                           "process_weights_after_loading; the loader changed, update the patch")

    def process_weights_after_loading(model, model_config, target_device):
        original(model, model_config, target_device)
        from mxfp8_learner_grid.common.producer_fusion import fuse_producers, producer_qdq_requested
        if producer_qdq_requested(model):
            fuse_producers(model, compat.fusion_facts())

    process_weights_after_loading.grid_wrapped = original
    base_loader.process_weights_after_loading = process_weights_after_loading
    _applied = True
    return True


def require(prefix: str) -> None:
    """A layer asked for ``producer_qdq``: the patch must be in place, else the load fails here."""
    if not _applied:
        raise ValueError(f"{prefix}: option producer_qdq needs patch patches/vllm_producer_qdq.py, which is not "
                         f"applied ({_why_not}); leave the option out with this vLLM")
