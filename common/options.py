"""The plugin options both engines read from ``quantization_config``: one parser, one set of rules.

Keys (all optional)::

    quant_method: mxfp8-learner-grid
    modules: {include: [...], exclude: [...], layers: [...]}   # common.selection
    kv_cache_scales: optional | required
    emulate: fp8_per_tensor | fp8_block128                      # vLLM, consistency study only
    kernel: auto | marlin | w8a16 | triton | torch              # force one kernel (common.grid_kernels)
    prefill_crossover: 1024                                     # rows from which dense layers use dequant + cuBLAS
    gemv_rows: 8                                                # rows 1 ... R: the decode GEMV (off: 0; at most 64;
                                                                # default: 0 with Marlin, 8 with w8a16 -- measured)
    moe_gemv_slots: 128                                         # MoE: up to S routed slots (tokens x top-k) by the
                                                                # expert GEMV (off: 0; at most 1024; default: 0 with
                                                                # Marlin MoE, 128 with the Triton MoE -- measured)
    w8a16_rows: [17, 256]                                       # rows [lo, hi) for the W8A16 Triton GEMM (off: [])
    humming_rows: [17, 129]                                     # rows [lo, hi) for humming-kernels' W8A16 wgmma
                                                                # GEMM, stream-K off (sm_90; hi <= 129; off: [])
    humming_tile: [128, 64]                                     # its (BLOCK_N, BLOCK_K) (grid_kernels/humming.py)
    bf16_weight_rows: 48                                        # from these rows, cuBLAS on a resident bf16 copy of W
                                                                # (2 bytes/weight more GPU memory; off: 0); or per
                                                                # module: {qkv_proj: 48, o_proj: 48, "*": 0}
                                                                # (default on sm_90: qkv/o/down from 48; else off)
    marlin_configs: [[n, k, lo, hi, block, tk, tn, bps], ...]   # Marlin MoE's launch knobs per GEMM shape and rows
                                                                # lo <= M < hi (dense layers: run as one expert);
                                                                # default: measured MoE rows on sm_90
                                                                # (grid_kernels/marlin_launch.py; off: [])
    moe_single_copy: true                                       # Marlin MoE: the packed weights are the experts' one
                                                                # copy of their codes (1 byte/weight instead of 2;
                                                                # common/packed_codes.py; default: off)
    cpu_weight_cache: true                                      # CPU: keep an fp32 copy of W's grid values
    router_dtype: float32                                       # MoE router logits in FP32 (Megatron's
                                                                # moe_router_dtype=fp32; default: model dtype)
    moe_router_weights: combine | activation                    # where the router weights multiply: the experts'
                                                                # outputs (default) or the SiLU*up activation before
                                                                # the down projection (Megatron's TEGroupedMLP)
    fmt / block_size / scale_format                             # must say e4m3 / 32 / e8m0
    wire_version, activation_scheme, checkpoint_format, producer   # informational (wire format)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from . import format as F
from .selection import ModuleSelection
from .wire import QUANT_METHOD

#: the keys each layer's kernel sees (``LayerSpec.options``, through ``grid_kernels.layers.kernel_options``): a
#: kernel option must be named here, or it never reaches the kernels (as marlin_configs once did not)
KERNEL_KEYS = ("kernel", "prefill_crossover", "gemv_rows", "w8a16_rows", "bf16_weight_rows", "cpu_weight_cache",
               "moe_router_weights", "moe_gemv_slots", "humming_rows", "humming_tile", "marlin_configs",
               "producer_qdq", "moe_single_copy")
#: the keys the plugins read themselves
CONFIG_KEYS = ("quant_method", "modules", "kv_cache_scales", "wire_version", "fmt", "block_size", "scale_format",
               "activation_scheme", "checkpoint_format", "producer", "emulate", "router_dtype")
KNOWN_KEYS = frozenset(KERNEL_KEYS + CONFIG_KEYS)
MOE_ROUTER_WEIGHTS = ("combine", "activation")
KV_CACHE_SCALES = ("optional", "required")


@dataclass
class GridOptions:
    selection: ModuleSelection = field(default_factory=ModuleSelection)
    kv_cache_scales: str = "optional"
    emulate: Optional[str] = None
    raw: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales must be 'optional' or 'required'; got {self.kv_cache_scales!r}")
        kernel = self.raw.get("kernel", "auto")
        from .grid_kernels import KERNEL_CHOICES
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"kernel must be one of {', '.join(KERNEL_CHOICES)}; got {kernel!r}")
        crossover = self.raw.get("prefill_crossover", 1)
        if isinstance(crossover, bool) or not isinstance(crossover, int) or crossover < 1:
            raise ValueError(f"prefill_crossover must be a positive integer (rows); got {crossover!r}")
        for key in ("w8a16_rows", "humming_rows"):
            band = self.raw.get(key, [])
            if not (isinstance(band, (list, tuple)) and (len(band) == 0 or (
                    len(band) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in band)
                    and band[0] <= band[1]))):
                raise ValueError(f"{key} must be [] or [lo, hi] with 0 <= lo <= hi (rows); got {band!r}")
        from .grid_kernels.humming import HUMMING_MAX_ROWS, TILE_CHOICES
        band = self.raw.get("humming_rows", [])
        if band and band[1] > HUMMING_MAX_ROWS + 1:
            raise ValueError(f"humming_rows: the band ends at most at {HUMMING_MAX_ROWS + 1}; got {band!r}")
        tile = self.raw.get("humming_tile")
        if tile is not None and (not isinstance(tile, (list, tuple)) or tuple(tile) not in TILE_CHOICES):
            raise ValueError(f"humming_tile must be one of {[list(t) for t in TILE_CHOICES]} (BLOCK_N, BLOCK_K); "
                             f"got {tile!r}")
        rows = self.raw.get("bf16_weight_rows", 0)

        def _rows_ok(r):
            return not isinstance(r, bool) and isinstance(r, int) and r >= 0
        if isinstance(rows, dict):
            bad = {k: v for k, v in rows.items() if not (isinstance(k, str) and k.strip(".") == k and k)
                   or not _rows_ok(v)}
            if bad:
                raise ValueError(f"bf16_weight_rows: each key must be a module name (e.g. 'qkv_proj', "
                                 f"'self_attn.o_proj', or '*') and each value a non-negative integer (rows; "
                                 f"0: no copy); got {bad!r}")
        elif not _rows_ok(rows):
            raise ValueError(f"bf16_weight_rows must be a non-negative integer (rows; 0: off) or a mapping "
                             f"from module names to rows; got {rows!r}")
        gemv = self.raw.get("gemv_rows", 0)
        from .grid_kernels.marlin import GEMV_MAX_ROWS
        if isinstance(gemv, bool) or not isinstance(gemv, int) or not 0 <= gemv <= GEMV_MAX_ROWS:
            raise ValueError(f"gemv_rows must be an integer in 0 ... {GEMV_MAX_ROWS} (rows; 0: off); got {gemv!r}")
        slots = self.raw.get("moe_gemv_slots", 0)
        from .grid_kernels.moe_gemv import MOE_GEMV_MAX_SLOTS
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= MOE_GEMV_MAX_SLOTS:
            raise ValueError(f"moe_gemv_slots must be an integer in 0 ... {MOE_GEMV_MAX_SLOTS} (routed slots; 0: off); "
                             f"got {slots!r}")
        from .grid_kernels.marlin_launch import parse_rows
        parse_rows(self.raw.get("marlin_configs"))
        for key in ("producer_qdq", "moe_single_copy", "cpu_weight_cache"):
            if not isinstance(self.raw.get(key, False), bool):
                raise ValueError(f"{key} must be true or false; got {self.raw.get(key)!r}")
        if self.raw.get("moe_router_weights", "combine") not in MOE_ROUTER_WEIGHTS:
            raise ValueError(f"moe_router_weights must be one of {MOE_ROUTER_WEIGHTS}; "
                             f"got {self.raw.get('moe_router_weights')!r}")
        from .router import parse_router_dtype
        self.router_dtype = parse_router_dtype(self.raw.get("router_dtype"))
        if self.emulate is not None:
            from .emulation import SCHEMES
            if self.emulate not in SCHEMES:
                raise ValueError(f"emulate must be one of {SCHEMES}; got {self.emulate!r}")

    @classmethod
    def from_dict(cls, config: Optional[dict[str, Any]], ignore: Iterable[str] = ()) -> "GridOptions":
        """Validate a ``quantization_config`` dict (keys in ``ignore`` are dropped first)."""
        config = {k: v for k, v in dict(config or {}).items() if k not in set(ignore)}
        method = config.get("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}")
        unknown = set(config) - KNOWN_KEYS
        if unknown:
            raise ValueError(f"{QUANT_METHOD}: unknown quantization_config keys {sorted(unknown)}; "
                             f"known: {sorted(KNOWN_KEYS)}")
        if config.get("fmt", "e4m3") != "e4m3" or int(config.get("block_size", F.BLOCK_SIZE)) != F.BLOCK_SIZE \
                or config.get("scale_format", "e8m0") != "e8m0":
            raise ValueError(f"{QUANT_METHOD}: only E4M3 data with E8M0 scales per {F.BLOCK_SIZE} values is "
                             f"the learner's grid; got {config}")
        return cls(ModuleSelection.from_dict(config.get("modules")), config.get("kv_cache_scales", "optional"),
                   config.get("emulate"), config)

    def on_grid(self, prefix: str, shards: Optional[Iterable[str]] = None) -> bool:
        """Is the engine module ``prefix`` on the grid?  ``shards``: the checkpoint modules a fused
        engine module is made of (q/k/v_proj of qkv_proj); a selection that splits one is an error."""
        head = prefix.rpartition(".")[0]
        try:
            if not shards:
                return self.selection.matches(prefix)
            return self.selection.matches_fused(prefix, [f"{head}.{s}" if head else s for s in shards])
        except ValueError as exc:
            raise ValueError(f"{QUANT_METHOD}: {exc}") from None


class GridQuantConfigMixin:
    """The engine-independent half of both plugins' ``QuantizationConfig`` (put it before the
    engine's base class): the method's name, dtypes, capability, config files, and taking over a
    checkpoint whose ``quantization_config`` names this method.  Expects ``self.selection`` and
    ``self.kv_cache_scales``."""

    def get_name(self) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 89          # FP8 conversions in the Triton kernels: Ada, Hopper and newer (no check on CPU)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []          # BF16 checkpoints: the engines then build the config with no arguments (all on the grid)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, *args, **kwargs) -> Optional[str]:
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == QUANT_METHOD:
            return QUANT_METHOD
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(modules={self.selection.to_dict()}, kv_cache_scales={self.kv_cache_scales})"
