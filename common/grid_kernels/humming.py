"""Option ``humming_rows: [lo, hi]``: a band of M where the dense grid Linear runs humming-kernels' W8A16
wgmma GEMM (``humming-kernels``, which vLLM 0.26 and SGLang 0.5.17 both pin; docs/humming.md) on ``qdq(x)``.

Why it is on the grid.  humming's W8A16 schema for E4M3 weights with E8M0 scales per 32 along K
decodes each weight to bf16 (an E4M3 code times a power of two: exact) and multiplies it with the bf16
activation on the tensor cores with FP32 accumulation.  Fed ``qdq(x)`` it sums the exact products in
FP32 and rounds once -- *only* with the settings fixed here:

* stream-K off (``use_stream_k: False`` in every tuning config, ``use_batch_invariant`` in the compute
  config): humming's default stream-K adds bf16-rounded partial sums across CTAs, off the grid;
* one fixed tuning config per range of M (:func:`tuning_table`), never humming's heuristics;
* scale bytes >= 3 (``marlin.check_bf16_exact_weights``, as for every bf16 fast path); humming decodes
  E8M0 byte 0 as +0, not 2^-127.

Checked on the H200 (eleventh session) by ``tests/gpu/test_humming_band.py``: the exact result rounded once up
to FP32 order, on model and adversarial weights, the same bytes run to run, layouts equal humming's own;
``benchmarks/exp_humming.py`` checks every tile the same way before it times it.  Timed there (fourteenth
session): exact, but slower than Marlin except on wide shapes (gate_up), so the band is off by default.

Derived tensors (allocated once, rewritten in place on every update, registered for ``derived_state``):
``grid_humming_weight`` (humming's repacked int32 layout, built by its repack kernel) and
``grid_humming_scale`` (E8M0 [K/32, N], an 8 x 8 transpose inside every 64 columns -- pure byte movement,
:func:`humming_scales`).  ``grid_humming_locks`` is humming's lock workspace (unused with stream-K off).
"""

from __future__ import annotations

import json
import logging
import types
from typing import Optional

import torch

from .base import LayerSpec

#: the tile of every range, (BLOCK_N, BLOCK_K), warp tile (block_m, 32, 64), 4 stages, warp specialization
#: + TMA (the shape of humming's own sm90 configs); option ``humming_tile`` overrides it
DEFAULT_TILE = (128, 64)
#: the tiles the option accepts (the ones benchmarks/exp_humming.py checks)
#: (BLOCK_N 64 is left out: on the H200, fourteenth session, humming 0.1.10's kernel with tile (64, 64) never finished,
#: on 6144 x 4096 as on 256 x 256, M = 16)
TILE_CHOICES = tuple((bn, bk) for bn in (128, 256) for bk in (64, 128))
#: block_m steps: one kernel per 16 rows of M
_M_STEP = 16
#: the largest M the band takes (block_m <= 128; humming's own sm90 heuristics stop at 176: the warp tile
#: holds block_m x 32 FP32 accumulators per warp)
HUMMING_MAX_ROWS = 128
COMPUTE_CONFIG = json.dumps({"use_f16_accum": False, "use_batch_invariant": True, "gemm_type": "dense"})
WEIGHT_CONFIG = {"quant_method": "humming", "dtype": "float8e4m3", "scale_dtype": "float8e8m0",
                 "group_size": 32, "weight_scale_type": "group"}
_PERM_SIDE = 8
_LOCKS = 1024


def humming_supported(spec: LayerSpec) -> tuple[bool, str]:
    """humming importable, and the GPU a Hopper (sm_90: the wgmma path this band was checked on)."""
    if spec.device_type != "cuda":
        return False, "not a CUDA device"
    if spec.capability is not None and spec.capability[0] != 9:
        return False, f"compute capability {spec.capability}: the humming band is checked on sm_90 only"
    try:
        import humming  # noqa: F401
    except Exception as exc:                                            # ImportError, or its JIT setup failing
        return False, f"humming-kernels is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def humming_shape_ok(n: int, k: int, tile=DEFAULT_TILE) -> bool:
    bn, bk = tile
    return n % max(64, bn) == 0 and k % max(bk, 128) == 0


def tile_config(block_m: int, tile=DEFAULT_TILE) -> dict:
    bn, bk = tile
    return {"block_shape": [block_m, bn, bk], "warp_shape": [block_m, 32, 64], "use_stream_k": False,
            "num_stages": 4, "use_warp_spec": True, "use_tma": True, "use_mbarrier": True}


def tuning_table(lo: int, hi: int, tile=DEFAULT_TILE) -> list:
    """humming's per-M dispatch list for rows lo <= M < hi: ``[[m_lo, m_hi, config], ...]``, each entry
    covering m_lo < M <= m_hi (humming's convention) with block_m = m_hi rounded up to 16.  It always starts
    at M = 1, whatever lo (the op itself sends only lo <= M < hi here): on the H200 a table starting at
    M = 17 segfaulted in humming 0.1.10's launcher, one starting at 1 ran exact (eleventh session)."""
    table = []
    start = 0
    while start < hi - 1:
        end = min(hi - 1, (start // _M_STEP + 1) * _M_STEP)
        table.append([start, end, tile_config(-(-end // _M_STEP) * _M_STEP, tile)])
        start = end
    for entry in table:
        assert not entry[2]["use_stream_k"]
    return table


def humming_scales(s: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales [N, K/32] -> humming's layout [K/32, N] (uint8): transposed, then an 8 x 8 transpose
    of every 64 consecutive bytes -- the bytes of ``prepare_humming_weight_scale(s, to_apply_on_c=False)``
    (its permutation [0, 8, ..., 56, 1, 9, ...]), done with views (its index tensor would synchronize)."""
    n, g = s.shape
    t = s.t().contiguous().reshape(-1, _PERM_SIDE, _PERM_SIDE).transpose(1, 2)
    return t.reshape(g, n).contiguous()


def humming_weight(weight: torch.Tensor) -> torch.Tensor:
    """fp8 codes [N, K] -> humming's repacked int32 layout (its repack kernel, wgmma, bf16 activations)."""
    from humming import dtypes
    from humming.utils.weight import prepare_humming_weight
    return prepare_humming_weight(weight.contiguous().view(torch.int32), b_dtype=dtypes.float8e4m3,
                                  a_dtype=dtypes.bfloat16, use_wgmma=True, packed=True, interleave_mode=3)


def layer_config(n: int, k: int) -> str:
    """humming's layer meta (a JSON string) for a bf16 [*, K] x e4m3 [N, K] GEMM with E8M0 group-32 scales."""
    from humming.layer import HummingMethod
    from humming.schema import BaseWeightSchema
    holder = types.SimpleNamespace()
    meta = HummingMethod.prepare_layer_meta(layer=holder, shape_n=n, shape_k=k,
                                            weight_schema=BaseWeightSchema.from_config(dict(WEIGHT_CONFIG)),
                                            torch_dtype=torch.bfloat16)
    assert not meta.should_apply_bs_on_c and not meta.use_fused_e8m0_scale, meta
    return meta.to_str()


def humming_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, locks: torch.Tensor, layer_cfg: str,
                 tuning: str) -> torch.Tensor:
    """a (bf16 grid values [M, K]) @ W^T by humming, one fixed config per M range, stream-K off."""
    from humming import ops
    return ops.humming_gemm(layer_cfg, COMPUTE_CONFIG, tuning, a.contiguous(), w, weight_scale=s, locks=locks)


def _scale_e8m0(layer) -> torch.Tensor:
    """The layer's humming scales as humming's launcher checks them (float8_e8m0fnu, the same bytes)."""
    return humming_scales(layer.weight_scale_inv.view(torch.uint8)).view(torch.float8_e8m0fnu)


log = logging.getLogger("mxfp8_learner_grid")

#: (layer config, tuning) -> "" (kernels built) or why they could not be: each shape is compiled once per process
_PREPARED: dict = {}


def _prepare(layer_cfg: str, tuning: str) -> str:
    """Build and load humming's kernels for one shape and tuning table, once per process; the reason on failure."""
    key = (layer_cfg, tuning)
    if key not in _PREPARED:
        try:
            from humming.kernel.humming import HummingKernel
            HummingKernel.prepare_kernels(layer_cfg, COMPUTE_CONFIG, tuning)
            _PREPARED[key] = ""
        except Exception as exc:                                        # its JIT: NVRTC, g++, headers
            _PREPARED[key] = f"humming could not build its kernels ({type(exc).__name__}: {str(exc)[:300]})"
            log.warning("mxfp8-learner-grid: humming band off for this shape, the layers run without it: %s",
                        _PREPARED[key])
    return _PREPARED[key]


class HummingBand:
    """The band of a dense kernel (``MarlinLinear``, ``W8A16Linear``): rows lo <= M < hi go to humming."""

    NAMES = ("grid_humming_weight", "grid_humming_scale")

    def __init__(self, spec: LayerSpec):
        band = spec.options.get("humming_rows") or (0, 0)
        tile = tuple(spec.options.get("humming_tile") or DEFAULT_TILE)
        lo, hi = int(band[0]), int(band[1])
        self.band = (0, 0)
        self.why = ""
        if hi > lo:
            ok, why = humming_supported(spec)
            if ok and not humming_shape_ok(spec.n, spec.k, tile):
                ok, why = False, f"shape N={spec.n}, K={spec.k} does not fit the tile {tile}"
            if ok:
                self.band = (max(1, lo), min(hi, HUMMING_MAX_ROWS + 1))
            else:
                self.why = why
        self.tile = tile
        self.layer_cfg = ""
        self.tuning = ""

    @property
    def on(self) -> bool:
        return self.band[1] > self.band[0]

    def names(self) -> tuple[str, ...]:
        return self.NAMES if self.on else ()

    def process(self, kernel, layer) -> None:
        if not self.on:
            return
        n, k = layer.weight.shape
        if not hasattr(layer, self.NAMES[0]):
            # compile + load first: a machine where humming's JIT cannot build (no g++, no CUDA 13 headers)
            # serves the layer without the band, the reason in the kernel's log line, instead of failing the load
            layer_cfg, tuning = layer_config(n, k), json.dumps(tuning_table(*self.band, self.tile))
            why = _prepare(layer_cfg, tuning)
            if why:
                self.band, self.why = (0, 0), why
                return
            self.layer_cfg, self.tuning = layer_cfg, tuning
            kernel.register_derived_buffer(layer, self.NAMES[0], humming_weight(layer.weight))
            kernel.register_derived_buffer(layer, self.NAMES[1], _scale_e8m0(layer))
            kernel.register_derived_buffer(layer, "grid_humming_locks",
                                           torch.zeros(_LOCKS, dtype=torch.int32, device=layer.weight.device))
        else:
            self.refresh(layer)

    def refresh(self, layer) -> None:
        if self.on:
            with torch.no_grad():
                getattr(layer, self.NAMES[0]).copy_(humming_weight(layer.weight))
                getattr(layer, self.NAMES[1]).view(torch.uint8).copy_(_scale_e8m0(layer).view(torch.uint8))

    def derived(self, layer) -> dict:
        if not self.on:
            return {}
        return {self.NAMES[0]: (getattr(layer, self.NAMES[0]), lambda: humming_weight(layer.weight)),
                self.NAMES[1]: (getattr(layer, self.NAMES[1]), lambda: _scale_e8m0(layer))}

    def args(self, layer) -> tuple:
        """The custom op's humming arguments: (weight, scale, locks, lo, hi, layer config, tuning)."""
        if not self.on:
            return (None, None, None, 0, 0, "", "")
        return (getattr(layer, self.NAMES[0]), getattr(layer, self.NAMES[1]), layer.grid_humming_locks,
                *self.band, self.layer_cfg, self.tuning)

    def describe(self) -> str:
        if self.on:
            return f" + humming W8A16 ({self.band[0]} <= M < {self.band[1]}, tile {self.tile}, stream-K off)"
        return f" (humming band off: {self.why})" if self.why else ""


def run_band(a: torch.Tensor, hum_w: Optional[torch.Tensor], hum_s: Optional[torch.Tensor],
             hum_locks: Optional[torch.Tensor], layer_cfg: str, tuning: str) -> torch.Tensor:
    assert hum_w is not None and hum_s is not None and hum_locks is not None
    return humming_gemm(a, hum_w, hum_s, hum_locks, layer_cfg, tuning)
