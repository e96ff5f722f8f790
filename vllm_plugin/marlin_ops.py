"""vLLM's compiled MXFP8 Marlin ops, called through ``torch.ops``: importable without vLLM's Python.

``common.grid_kernels`` gets Marlin as a provider (``providers.register("marlin", ops)``).  The
ops are vLLM's CUDA extension libraries (0.26.0: ``vllm/_C_stable_libtorch.abi3.so`` holds
``_C::marlin_gemm`` and ``_C::gptq_marlin_repack``; ``vllm/_moe_C_stable_libtorch.abi3.so``
holds ``_moe_C::moe_wna16_marlin_gemm`` and ``_moe_C::moe_align_block_size``).  Both are built
against libtorch's stable ABI and link nothing of vLLM, so:

* the vLLM plugin uses them as vLLM loaded them (``vllm._custom_ops``, which also registers their
  fake implementations for torch.compile);
* the SGLang plugin loads the two libraries alone with :func:`load_compiled_ops`, from the directory
  named by ``$MXFP8_GRID_VLLM_OPS`` (the two files unzipped from a vLLM 0.26.0 wheel), else from an
  installed ``vllm`` package's directory, found without importing it.  SGLang 0.5.17 ships no MXFP8
  GEMM for Hopper.  (A vLLM installed with ``--no-deps`` beside SGLang is not recommended: SGLang
  tries ``import vllm`` in places, and vLLM's import sets process-wide torch options.)

Each op's argument list is checked against the one read in vLLM 0.26.0's source
(:data:`SCHEMAS`); a build whose ops differ is refused, named, and the chooser falls back to
the project's Triton kernels.  Calls are vLLM's own (``_custom_ops.marlin_gemm`` /
``gptq_marlin_repack`` / ``moe_wna16_marlin_gemm``, ``moe_align_block_size.py``), always with
FP32 global reduction and no atomic adds: the grid needs FP32 accumulation and a deterministic sum.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

import torch

_log = logging.getLogger("mxfp8_learner_grid")

#: a directory holding vLLM's extension libraries (default: the installed ``vllm`` package's)
OPS_DIR_ENV = "MXFP8_GRID_VLLM_OPS"
#: the libraries, in load order, and the ops each must provide
LIBRARIES = {
    "_C_stable_libtorch.abi3.so": ("_C", ("marlin_gemm", "gptq_marlin_repack")),
    "_moe_C_stable_libtorch.abi3.so": ("_moe_C", ("moe_wna16_marlin_gemm", "moe_align_block_size")),
}
#: argument names of each op, as vLLM 0.26.0 declares them (csrc/*/torch_bindings.cpp)
SCHEMAS = {
    "_C::marlin_gemm": (
        "a", "c_or_none", "b_q_weight", "b_bias_or_none", "b_scales", "a_scales", "global_scale", "b_zeros_or_none",
        "g_idx_or_none", "perm_or_none", "workspace", "b_type_id", "size_m", "size_n", "size_k", "is_k_full",
        "use_atomic_add", "use_fp32_reduce", "is_zp_float"),
    "_C::gptq_marlin_repack": ("b_q_weight", "perm", "size_k", "size_n", "num_bits", "is_a_8bit"),
    "_moe_C::moe_wna16_marlin_gemm": (
        "a", "c_or_none", "b_q_weight", "b_bias_or_none", "b_scales", "a_scales", "global_scale", "b_zeros_or_none",
        "g_idx_or_none", "perm_or_none", "workspace", "sorted_token_ids", "expert_ids", "num_tokens_past_padded",
        "topk_weights", "moe_block_size", "top_k", "mul_topk_weights", "b_type_id", "size_m", "size_n", "size_k",
        "is_full_k", "use_atomic_add", "use_fp32_reduce", "is_zp_float", "thread_k", "thread_n", "blocks_per_sm"),
    "_moe_C::moe_align_block_size": (
        "topk_ids", "num_experts", "block_size", "sorted_token_ids", "experts_ids", "num_tokens_post_pad",
        "maybe_expert_map"),
}


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool,
                   nan_repr: int) -> int:
    """vLLM's ``ScalarType.id`` (scalar_type.py, kept in sync with csrc/core/scalar_type.hpp): the
    fields packed into one int64, low bits first."""
    val, offset = 0, 0
    for member, width in ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1),
                          (nan_repr, 8)):
        val |= (int(member) & ((1 << width) - 1)) << offset
        offset += width
    return val


#: ``scalar_types.float8_e4m3fn``: ``ScalarType.float_(4, 3, True, NanRepr.EXTD_RANGE_MAX_MIN)``
FLOAT8_E4M3FN_ID = scalar_type_id(4, 3, True, 0, True, 2)


def schema_mismatch(qualname: str) -> Optional[str]:
    """Why the loaded op ``ns::name`` cannot be called as vLLM 0.26.0's, or None when it can."""
    ns, name = qualname.split("::")
    packet = getattr(getattr(torch.ops, ns), name, None) if hasattr(torch.ops, ns) else None
    if packet is None:
        return f"{qualname} is not loaded"
    try:
        args = tuple(a.name for a in packet.default._schema.arguments)
    except Exception as e:          # an op without a default overload
        return f"{qualname}: no readable schema ({e})"
    want = SCHEMAS[qualname]
    if args != want:
        return f"{qualname} takes ({', '.join(args)}), not vLLM 0.26.0's ({', '.join(want)})"
    return None


def _loaded(ns: str, names) -> bool:
    return hasattr(torch.ops, ns) and all(hasattr(getattr(torch.ops, ns), n) for n in names)


def vllm_ops_dir() -> Optional[str]:
    """Where vLLM's extension libraries are: ``$MXFP8_GRID_VLLM_OPS``, else the installed ``vllm``
    package's directory (found without importing it), else None."""
    where = os.environ.get(OPS_DIR_ENV)
    if where:
        return where
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec is not None else []
    return locations[0] if locations else None


def load_compiled_ops(where: Optional[str] = None) -> tuple[bool, bool, str]:
    """Load vLLM's Marlin libraries unless their ops are already there.  Returns ``(dense, moe, why)``:
    whether the dense and the MoE ops are usable, and what was loaded or why not."""
    where = where or vllm_ops_dir()
    notes, usable = [], []
    for lib, (ns, names) in LIBRARIES.items():
        if not _loaded(ns, names):
            path = os.path.join(where, lib) if where else None
            if path is None or not os.path.isfile(path):
                notes.append(f"{lib} not found" + (f" in {where}" if where else " (no vLLM installed, "
                                                   f"{OPS_DIR_ENV} unset)"))
                usable.append(False)
                continue
            try:
                torch.ops.load_library(path)
            except Exception as e:
                notes.append(f"{path} does not load: {e}")
                usable.append(False)
                continue
            notes.append(f"loaded {path}")
        bad = [why for why in (schema_mismatch(f"{ns}::{n}") for n in names) if why]
        notes.extend(bad)
        usable.append(not bad)
    return usable[0], usable[0] and usable[1], "; ".join(notes) or "already loaded"


class MarlinOps:
    """The dense Marlin ops, as ``common.grid_kernels.marlin`` calls them."""

    def repack(self, q: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
        perm = torch.empty(0, dtype=torch.int, device=q.device)
        return torch.ops._C.gptq_marlin_repack(q, perm, size_k, size_n, 8, False)

    def workspace(self, device, max_blocks_per_sm: int = 1) -> torch.Tensor:
        """``marlin_make_workspace_new``: one int per thread block the kernels may launch."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return torch.zeros(sms * max_blocks_per_sm, dtype=torch.int, device=device)

    def gemm(self, a, w, s, workspace, size_n: int, size_k: int) -> torch.Tensor:
        return torch.ops._C.marlin_gemm(
            a, None, w, None, s.view(torch.float8_e8m0fnu), None, None, None, None, None, workspace,
            FLOAT8_E4M3FN_ID, a.size(0), size_n, size_k, True, False, True, False)


class MarlinMoEOps(MarlinOps):
    """The dense ops plus Marlin MoE (vLLM's ``fused_marlin_moe``, called one GEMM at a time)."""

    def moe_align(self, topk_ids, block_size: int, num_experts: int, expert_map):
        """``moe_align_block_size(..., ignore_invalid_experts=True)`` of vLLM 0.26.0."""
        numel = topk_ids.numel()
        padded = numel + num_experts * (block_size - 1)
        if numel < num_experts:
            padded = min(numel * block_size, padded)
        dev = topk_ids.device
        sorted_ids = torch.empty((padded,), dtype=torch.int32, device=dev)
        expert_ids = torch.empty((-(-padded // block_size),), dtype=torch.int32, device=dev)
        ntpp = torch.empty((1,), dtype=torch.int32, device=dev)
        torch.ops._moe_C.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, ntpp,
                                              expert_map)
        return sorted_ids, expert_ids, ntpp

    def moe_gemm(self, a, w, s, workspace, sorted_ids, expert_ids, ntpp, topk_weights, block_size: int, top_k: int,
                 size_m: int, size_n: int, size_k: int, thread_k: int = -1, thread_n: int = -1,
                 blocks_per_sm: int = -1) -> torch.Tensor:
        """One expert GEMM; ``thread_k`` / ``thread_n`` / ``blocks_per_sm`` -1: Marlin's own choice
        (option ``marlin_configs`` sets them, ``grid_kernels/marlin_launch.py``)."""
        return torch.ops._moe_C.moe_wna16_marlin_gemm(
            a, None, w, None, s.view(torch.float8_e8m0fnu), None, None, None, None, None, workspace,
            sorted_ids, expert_ids, ntpp, topk_weights, block_size, top_k, False, FLOAT8_E4M3FN_ID,
            size_m, size_n, size_k, True, False, True, False, thread_k, thread_n, blocks_per_sm)


def compiled_marlin_ops(where: Optional[str] = None) -> tuple[Optional[MarlinOps], str]:
    """The provider to register (MoE ops included where that library loaded), or None and why."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    dense, moe, why = load_compiled_ops(where)
    if not dense:
        return None, why
    return (MarlinMoEOps() if moe else MarlinOps()), why


_tried = False


def register_provider(engine: str) -> None:
    """Hand the ops to ``common.grid_kernels`` (provider ``marlin``), once per process: both plugins
    call this for every on-grid layer they process.  Where they cannot be loaded on a CUDA device,
    one warning names why and the chooser keeps the project's Triton kernels."""
    global _tried
    from mxfp8_learner_grid.common.grid_kernels import providers
    if providers.get("marlin") is not None or _tried:
        return
    _tried = True
    ops, why = compiled_marlin_ops()
    if ops is None:
        if torch.cuda.is_available():
            _log.warning("mxfp8-learner-grid: no MXFP8 Marlin in %s (%s); the grid runs the project's Triton kernels",
                         engine, why)
        return
    _log.info("mxfp8-learner-grid: vLLM's MXFP8 Marlin ops in %s (%s%s)", engine, why,
              "" if isinstance(ops, MarlinMoEOps) else "; dense only")
    providers.register("marlin", ops)
