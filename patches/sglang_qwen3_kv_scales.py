"""SGLang 0.5.17 - 0.5.23: Qwen3 / Qwen3-MoE attention has no KV-cache quant method.

``Qwen3Attention`` and ``Qwen3MoeAttention`` build their ``RadixAttention`` without the
quant config (Llama, Qwen2, Qwen2-MoE, Mixtral pass it), so the layer gets no
``k_scale`` / ``v_scale`` parameters: a checkpoint's or a trainer's per-layer scales are
dropped by ``maybe_remap_kv_scale_name`` ("... is not loaded") and ``--kv-cache-dtype
fp8_e4m3`` runs with scale 1.0.

This patch registers hooks with ``HookRegistry`` (SGLang's sanctioned runtime patching,
applied by ``load_plugins()``):

* AFTER both classes' ``__init__``: when the model's quant config is the plugin's and the
  ``RadixAttention`` has no quant method, it gets the plugin's KV-cache method, exactly as
  the models that pass the config get one (``LearnerGridConfig.kv_cache_method``: none with a
  BF16 KV cache);
* BEFORE ``Qwen3MoeForCausalLM.load_weights``, which (unlike Qwen3's) does not remap scale
  names: the trainer's ``...self_attn.k_scale`` / ``v_scale`` become
  ``...self_attn.attn.k_scale`` / ``v_scale`` (what Qwen3's ``maybe_remap_kv_scale_name``
  does), so both models take the same names (``common.kv_scales``).

Nothing else changes; with another quant config, or once SGLang passes the config itself,
the hooks do nothing.  Registered only for the SGLang versions it was written for.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger("mxfp8_learner_grid.sglang")

WRITTEN_FOR = ((0, 5, 17), (0, 5, 23))        # inclusive range of SGLang versions read
TARGETS = ("sglang.srt.models.qwen3.Qwen3Attention.__init__",
           "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__")
MOE_LOAD_WEIGHTS = "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.load_weights"
_KV_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")
_registered = False


def attach_kv_method(module, quant_config, prefix: str) -> bool:
    """Give ``module.attn`` the plugin's KV-cache method if the config is ours and it has none."""
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    attn = getattr(module, "attn", None)
    if not isinstance(quant_config, LearnerGridConfig) or attn is None or getattr(attn, "quant_method", None):
        return False
    method = quant_config.kv_cache_method(f"{prefix}.attn" if prefix else "attn")
    if method is None:                  # a BF16 KV cache: no scales (the config's rule)
        return False
    attn.quant_method = method
    attn.quant_method.create_weights(attn)
    return True


def _after_init_hook(target: str):
    def after_init(result, self, *args, **kwargs):
        # the arguments of the hooked __init__ (of this target, also when a subclass calls it)
        import pkgutil
        init = pkgutil.resolve_name(target)            # the wrapper; signature() follows __wrapped__
        bound = inspect.signature(init).bind_partial(self, *args, **kwargs).arguments
        attach_kv_method(self, bound.get("quant_config"), bound.get("prefix") or "")

    return after_init


def kv_scale_name(name: str) -> str:
    """``...self_attn.k_scale`` -> ``...self_attn.attn.k_scale`` (the RadixAttention parameter)."""
    for suffix in _KV_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".self_attn.attn." + suffix.rpartition(".")[2]
    return name


def _before_moe_load_weights(self, *args, **kwargs):
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    if not isinstance(getattr(self, "quant_config", None), LearnerGridConfig):
        return None
    remap = lambda weights: ((kv_scale_name(n), t) for n, t in weights)   # noqa: E731
    if "weights" in kwargs:
        return (self, *args), dict(kwargs, weights=remap(kwargs["weights"]))
    return (self, remap(args[0]), *args[1:]), kwargs


def register(sglang_version: tuple[int, int, int]) -> bool:
    """Register the hooks (applied by SGLang's load_plugins); returns whether they were registered."""
    global _registered
    if _registered:
        return True
    if not WRITTEN_FOR[0] <= sglang_version <= WRITTEN_FOR[1]:
        logger.warning("mxfp8-learner-grid: patch sglang_qwen3_kv_scales was written for SGLang %s - %s, this is "
                       "%s: not applied (check whether Qwen3 RadixAttention gets a quant config now); Qwen3 "
                       "k/v scales may not load", *(".".join(map(str, v)) for v in (*WRITTEN_FOR, sglang_version)))
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    for target in TARGETS:
        HookRegistry.register(target, _after_init_hook(target), HookType.AFTER)
    HookRegistry.register(MOE_LOAD_WEIGHTS, _before_moe_load_weights, HookType.BEFORE)
    _registered = True
    return True
