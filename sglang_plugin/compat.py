"""Every SGLang version difference the plugin knows of, in one place.

Supported: SGLang 0.5.17 (what runs on our H200, torch 2.11) through 0.5.23 (the CPU
test venv, torch 2.14.1).  Read in both wheels' sources:

* ``--quantization`` choices: the list ``QUANTIZATION_CHOICES`` and its adder
  ``add_quantization_method_choices`` live in ``srt/server_args.py`` in 0.5.17 and in
  ``srt/arg_groups/choices.py`` in 0.5.23 (``server_args`` re-imports the same list).
* ``srt/layers/quantization/__init__.py`` keeps ``QUANTIZATION_METHODS`` (what
  ``get_quantization_config`` and ``ModelConfig._verify_quantization`` read) and
  ``CPU_QUANTIZATION_METHODS`` (read instead on AMX CPUs) in both.
* ``QuantizeMethodBase.restore_weights_before_loading`` exists only in 0.5.23 (weight
  update sessions, ``begin_weight_update`` / ``end_weight_update``); 0.5.17's
  ``update_weights_from_tensor`` loads in place and runs no post-processing at all.
  Both are correct: the kernels' derived tensors are rewritten by the loaders after every
  write (common.refresh), whether or not post-processing runs (see linear_method.py).
* ``FusedMoE.weight_loader(param, w, weight_name, shard_id, expert_id)`` and its
  GROUP-scale routing (names containing "scale" go by ``param.quant_method``), the
  [w1; w3] order of ``w13`` (swapped only for ``load_up_proj_weight_first`` or for
  Fp8/unquantized/ModelOpt methods under FlashInfer TRT-LLM), ``StandardDispatchOutput``
  / ``StandardCombineInput`` and ``BaseKVCacheMethod`` have the same shape in both.
* The standard dispatcher maps global expert ids to local ones (-1 elsewhere) unless the
  MoE runner backend keeps global ids (FlashInfer/cutlass/hpc-ops); 0.5.17 decides from
  the global ``--moe-runner-backend``, 0.5.23 from the layer's runner.  The plugin's MoE
  has no runner and requires ``--moe-runner-backend`` auto or triton, so ids arrive local.
* ``get_server_args()`` lives in ``srt/runtime_context.py`` in both.
"""

from __future__ import annotations

import importlib.metadata
import re

MIN_VERSION = (0, 5, 17)
#: newest release whose plugin surface was read; newer ones get a warning, not an error
MAX_TESTED_VERSION = (0, 5, 23)


def version_tuple(v: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        raise RuntimeError(f"mxfp8-learner-grid: cannot parse the SGLang version {v!r}")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


SGLANG_VERSION_STR = importlib.metadata.version("sglang")
SGLANG_VERSION = version_tuple(SGLANG_VERSION_STR)


def check_version() -> list[str]:
    """Raise on an unsupported SGLang; return warnings for an untested newer one."""
    if SGLANG_VERSION < MIN_VERSION:
        raise RuntimeError(f"mxfp8-learner-grid supports SGLang >= {'.'.join(map(str, MIN_VERSION))}; "
                           f"this is SGLang {SGLANG_VERSION_STR}")
    if SGLANG_VERSION > MAX_TESTED_VERSION:
        return [f"SGLang {SGLANG_VERSION_STR} is newer than the newest version the plugin was checked "
                f"against ({'.'.join(map(str, MAX_TESTED_VERSION))})"]
    return []


# -- the symbols the plugin uses (import errors here are the loud, early kind) ------
try:                                                             # 0.5.23
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
except ImportError:                                              # 0.5.17
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices  # noqa: F401

import sglang.srt.layers.quantization as _quant_registry  # noqa: E402
from sglang.srt.layers.linear import (  # noqa: E402
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE, FusedMoeWeightScaleSupported  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput  # noqa: E402
from sglang.srt.layers.moe.utils import get_moe_runner_backend  # noqa: E402
from sglang.srt.layers.quantization.base_config import (  # noqa: E402
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod  # noqa: E402
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.utils import set_weight_attrs  # noqa: E402


def quantization_registries() -> list[dict]:
    """The dicts SGLang looks quantization names up in (mutated in place by register)."""
    regs = [_quant_registry.QUANTIZATION_METHODS]
    cpu = getattr(_quant_registry, "CPU_QUANTIZATION_METHODS", None)
    if isinstance(cpu, dict):
        regs.append(cpu)
    return regs


def kv_cache_dtype() -> str:
    """``--kv-cache-dtype`` of the running server ("auto" outside one, e.g. in layer tests)."""
    return server_kv_cache_dtype() or "auto"


def _server_arg(name: str):
    """A server argument of the running server ("auto" when unset), or None outside one (layer tests)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return str(getattr(get_server_args(), name, "auto") or "auto")
    except Exception:
        return None


def server_args():
    """The running server's ``ServerArgs`` (``runtime_context.get_server_args``), or None outside one."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()
    except Exception:
        return None


def server_kv_cache_dtype():
    """``--kv-cache-dtype`` of the running server, or None outside one (layer tests)."""
    return _server_arg("kv_cache_dtype")


def kv_cache_reads_scales() -> bool:
    """Does the KV cache read k/v scales?  An FP8 cache does; a BF16 one reads none (and SGLang 0.5.17's
    fused K/V-cache write asserts that a layer has none).  Outside a server (layer tests): yes."""
    kv = server_kv_cache_dtype()
    return kv is None or kv.startswith("fp8")


def load_format() -> str:
    """``--load-format`` of the running server ("auto" outside one, e.g. in layer tests)."""
    return _server_arg("load_format") or "auto"


def moe_runner_backend_name() -> str:
    b = get_moe_runner_backend()
    return str(getattr(b, "value", b))


def moe_runner_backend_ok() -> bool:
    """Our MoE runs its own op; ids arrive local only with the auto/triton backends."""
    b = get_moe_runner_backend()
    return bool(b.is_auto() or b.is_triton())


def standard_topk(topk_output):
    """(topk_weights, topk_ids) of any top-k output format that can be materialized."""
    if hasattr(topk_output, "topk_ids") and hasattr(topk_output, "topk_weights"):
        return topk_output.topk_weights, topk_output.topk_ids
    if hasattr(topk_output, "to_standard"):
        std = topk_output.to_standard()
        return std.topk_weights, std.topk_ids
    raise NotImplementedError(f"mxfp8-learner-grid MoE needs explicit top-k ids; got {type(topk_output).__name__}")


__all__ = [
    "BaseKVCacheMethod", "FusedMoE", "FusedMoEMethodBase", "FusedMoeWeightScaleSupported", "LinearBase",
    "LinearMethodBase", "MergedColumnParallelLinear", "QKVParallelLinear", "QUANTIZATION_CHOICES",
    "QuantizationConfig", "QuantizeMethodBase", "RadixAttention", "SGLANG_VERSION", "StandardCombineInput",
    "UnquantizedLinearMethod", "add_quantization_method_choices", "check_version", "kv_cache_dtype",
    "moe_runner_backend_ok", "quantization_registries", "set_weight_attrs", "standard_topk",
]


def register_kernel_providers() -> None:
    """SGLang ships no MXFP8 GEMM for Hopper.  Where vLLM's compiled Marlin libraries are there (a
    directory in ``$MXFP8_GRID_VLLM_OPS`` holding the two files of a vLLM 0.26.0 wheel, or an installed
    vLLM), load them without importing vLLM's Python and hand the ops to ``common.grid_kernels``
    (``vllm_plugin/marlin_ops.py``, once per process); otherwise the chooser falls back to the
    project's Triton kernels on CUDA and the reference on CPU."""
    from mxfp8_learner_grid.vllm_plugin.marlin_ops import register_provider
    register_provider("SGLang")
