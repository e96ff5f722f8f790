"""The fast path on Hopper: activations quantize-dequantized TE-exactly, then a weight-only
MXFP8 GEMM -- which is then the learner's grid GEMM.

Why it is exact.  ``qdq(x)`` (``kernels/qdq_triton.qdq_rows``) is x's grid values: E4M3 codes
times a power of two, exact in bf16 (blocks with scale byte >= 3).  W's grid values are the
same kind of number.  Products of two such bf16 values are exact in FP32, and the kernels
below sum them in FP32 and round once to bf16: the learner's grid forward, up to FP32
summation order -- the tolerance TE's own GEMMs have.

The GEMMs, chosen per call by the number of rows M (options ``gemv_rows``, ``w8a16_rows``,
``prefill_crossover`` and ``bf16_weight_rows``):

* M <= ``gemv_rows`` (off by default): x quantized TE-exactly to codes + scales and the project's
  split-K decode GEMV (``kernels/gemv_triton``: streams the layer's own fp8 codes and scales once,
  the per-32 scales applied to each chunk's FP32 partial sum, deterministic in-launch split-K
  reduction) -- :func:`gemv_band`;
* M < crossover, outside ``w8a16_rows``: vLLM's MXFP8 Marlin (W8A16, E8M0 scales per 32 along K;
  engine-provided, ``providers.get("marlin")``), with FP32 global reduction and no atomics;
* lo <= M < hi for ``w8a16_rows: [lo, hi]`` (off by default): the project's swapped W8A16 Triton
  GEMM (``kernels/w8a16_triton``, wgmma on Hopper, deterministic FP32 split-K), which reads the
  layer's own fp8 codes and scales (no derived tensor);
* M >= crossover: W decoded once per call into a bf16 scratch tensor
  (``kernels/dequant_triton``, 3 bytes of traffic per weight) and cuBLAS, with
  ``allow_bf16_reduced_precision_reduction`` off so that split-K partials are reduced in FP32;
* M >= ``bf16_weight_rows``: cuBLAS on a resident bf16 copy of W's grid values
  (:class:`Bf16WeightCopy`; 2 more bytes of GPU memory per weight, no decode per call) -- memory
  for speed in the middle band of M, where the weight-only kernels decode every weight element in
  every CTA and fall behind BF16.  Default on sm_90: qkv, o and down from 48 rows
  (:data:`DENSE_COPY_DEFAULTS`); elsewhere off.

Derived tensors (allocated once, rewritten in place on every update, registered for the
``derived_state`` check): ``grid_marlin_weight`` (int32, Marlin's tiled layout) and
``grid_marlin_scale`` (E8M0 bytes, Marlin's permuted layout); with ``bf16_weight_rows``, also
``grid_bf16_weight``.  Both layouts are pure byte movement (no dtype round trip): :func:`marlin_scales`,
and :func:`marlin_weights_batched`, with which refreshes rewrite the packed weight in place where it makes
the engine's ``gptq_marlin_repack`` bytes for the layer's shape (:func:`batched_repack_agrees`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch

from .. import format as F
from ..packed_codes import plain
from . import marlin_launch, providers
from .base import GridKernel, LayerSpec, bf16_output_no_bias, platform_default

log = logging.getLogger(__name__)

#: default M from which the dense layer takes the dequantize + cuBLAS path.  Measured on the H200
#: (benchmarks/bench_fast_path.py, 2026-12-01): for every Qwen3-8B projection Marlin wins at M <= 64
#: and dequantize + cuBLAS from M = 256 (30B-A3B qkv: from 64); see BENCHMARKS.md.
DEFAULT_PREFILL_CROSSOVER = 256

#: vLLM's scale permutation (``get_scale_perms()[0]``: [i + 8 j for i < 8 for j < 8]) transposes 8 x 8
#: blocks of each row of 64; ``mxfp8_marlin_process_scales``' byte order [0, 2, 1, 3] transposes 2 x 2
_PERM_SIDE = 8


def marlin_shape_ok(n: int, k: int) -> bool:
    """Marlin's thread tiles without padding: (n % 64, k % 128) or (n % 128, k % 64)."""
    return (n % 64 == 0 and k % 128 == 0) or (n % 128 == 0 and k % 64 == 0)


def marlin_scales(s: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales [..., N, K/32] -> Marlin's layout [..., K/32, N] (uint8), by index permutation only;
    leading dims (a MoE layer's experts) are permuted all at once.

    The same bytes vLLM's ``marlin_permute_scales`` + ``mxfp8_marlin_process_scales`` produce
    (they round-trip through the model dtype, which is exact for E8M0 255 > byte > 0 and 0)."""
    *lead, n, g = s.shape
    # both permutations are transposes of small blocks (8 x 8, then 2 x 2) of each matrix's row-major bytes,
    # done as views: indexing with the lists would copy an index tensor to the GPU and synchronize, on every
    # refresh.  The blocks (64 and 4 bytes) never straddle two matrices: N is a multiple of 64 (marlin_shape_ok)
    t = s.transpose(-1, -2).contiguous().reshape(-1, _PERM_SIDE, _PERM_SIDE).transpose(1, 2).reshape(-1, n)
    return t.reshape(-1, 2, 2).transpose(1, 2).reshape(*lead, g, n).contiguous()


def marlin_weight(ops, w: torch.Tensor) -> torch.Tensor:
    """fp8 [N, K] -> Marlin's tiled int32 layout (``gptq_marlin_repack``, 8 bits): the engine's own op, the
    reference that :func:`marlin_weights_batched` is checked against (:func:`batched_repack_agrees`)."""
    n, k = w.shape
    q = w.contiguous().view(torch.int32).t().contiguous()        # [K/4, N], 4 codes per int32 along K
    return ops.repack(q, k, n)


#: Marlin's tile (vLLM's ``GPTQ_MARLIN_TILE``): W^T [K, N] is reordered in 16 x 16 tiles
MARLIN_TILE = 16
#: the bytes one weight permutation (vLLM's ``get_weight_perm(8)``) orders: four tiles along N
_WEIGHT_PERM_SPAN = 1024
_WEIGHT_PERMS: dict = {}


def weight_perm_8bit() -> list[int]:
    """vLLM's ``get_weight_perm(num_bits=8, is_a_8bit=False)`` (``marlin_utils_test.py``): where each byte of a
    1024-byte group of the tiled weight comes from -- the order in which Marlin's threads load the B
    fragments of ``mma.sync`` m16n8k16 (two 8-column blocks per thread, four rows each), then the 8-bit
    interleave [0, 2, 1, 3] of each 4-byte word."""
    perm = []
    for i in range(32):
        col = i // 4
        rows = (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        one = [16 * row + col + 8 * block for block in (0, 1) for row in rows]
        for j in range(4):
            perm.extend(p + 256 * j for p in one)
    interleave = (0, 2, 1, 3)
    return [perm[w + i] for w in range(0, len(perm), 4) for i in interleave]


def _weight_perm(device) -> torch.Tensor:
    key = str(device)
    if key not in _WEIGHT_PERMS:               # once per device: no host-to-device copy on a refresh
        _WEIGHT_PERMS[key] = torch.tensor(weight_perm_8bit(), dtype=torch.int64, device=device)
    return _WEIGHT_PERMS[key]


def batched_repack_shape_ok(n: int, k: int) -> bool:
    """:func:`marlin_weights_batched` needs whole tiles and whole 1024-byte groups: N % 64 and K % 16."""
    return n % (_WEIGHT_PERM_SPAN // MARLIN_TILE) == 0 and k % MARLIN_TILE == 0


#: the largest transient copy a batched repack makes (its permuting copy), in bytes: a MoE layer's experts are
#: repacked in groups of at most this size, so that a refresh or a check needs no more transient memory than
#: one matrix or this much, whichever is larger
REPACK_CHUNK_BYTES = 64 << 20


def marlin_weights_batched(w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp8 [..., N, K] -> Marlin's tiled int32 layout [..., K/16, 4 N]: for each [N, K] matrix the bytes
    ``gptq_marlin_repack`` (8 bits, no act-order) makes of it, all leading dims (a MoE layer's experts) at
    once.  The layout is a byte permutation -- byte ``(r, 1024 g + j)`` of the result is ``W[n, k]`` with
    ``t = 1024 g + perm[j]``, ``k = 16 r + (t % 256) // 16``, ``n = 16 (t // 256) + t % 16`` (vLLM's
    ``marlin_permute_weights`` + ``marlin_weights``; 4 bytes per int32, little-endian) -- so it is one
    permuting copy and one gather per group of matrices (:data:`REPACK_CHUNK_BYTES`), where the engine's op
    is one launch and two transposing copies per matrix.  ``out`` (contiguous, the result's shape): written
    in place, and returned."""
    *lead, n, k = w.shape
    if not batched_repack_shape_ok(n, k):
        raise ValueError(f"marlin_weights_batched: N={n}, K={k} is not a multiple of (64, 16)")
    t_ = MARLIN_TILE
    shape = (*lead, k // t_, n * t_ // 4)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=w.device)
    elif not out.is_contiguous() or tuple(out.shape) != shape or out.dtype != torch.int32 or out.device != w.device:
        raise ValueError(f"marlin_weights_batched: out must be contiguous int32 {list(shape)} on {w.device}; "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    groups = n * t_ // _WEIGHT_PERM_SPAN
    codes = w.reshape(-1, n, k).view(torch.uint8)
    dest = out.view(-1, k // t_, n * t_ // 4).view(torch.uint8).view(-1, k // t_, groups, _WEIGHT_PERM_SPAN)
    perm = _weight_perm(w.device)
    step = max(1, REPACK_CHUNK_BYTES // (n * k))
    for lo in range(0, codes.shape[0], step):
        part = codes[lo:lo + step]
        tiles = (part.reshape(-1, n // t_, t_, k // t_, t_)             # [E, N/16, n, K/16, k]
                 .permute(0, 3, 1, 4, 2)                                # [E, K/16, N/16, k, n]
                 .reshape(-1, k // t_, groups, _WEIGHT_PERM_SPAN))
        torch.index_select(tiles, -1, perm, out=dest[lo:lo + step])
    return out


def _weight_perm_inverse(device) -> torch.Tensor:
    key = "inverse:" + str(device)
    if key not in _WEIGHT_PERMS:
        perm = _weight_perm(device)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=device)
        _WEIGHT_PERMS[key] = inv
    return _WEIGHT_PERMS[key]


def marlin_unpack_batched(packed: torch.Tensor, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of :func:`marlin_weights_batched`: Marlin's int32 layout [..., K/16, 4 N] -> the fp8
    [..., N, K] codes it was made of (``out``: contiguous, written in place, and returned).  The layout is a
    byte permutation, so this is one gather and one permuting copy per group of matrices, exact for every
    byte.  It is what a layer that keeps only the packed copy resident would read its codes back with (the
    checks' engine bytes, a partial write's read-modify-write); nothing in the shipped paths calls it yet."""
    *lead, kt, n4 = packed.shape
    t_ = MARLIN_TILE
    k = kt * t_
    if n4 != 4 * n or packed.dtype != torch.int32 or not batched_repack_shape_ok(n, k):
        raise ValueError(f"marlin_unpack_batched: want int32 [..., K/16, 4 N] with N={n} a multiple of 64; "
                         f"got {packed.dtype} {list(packed.shape)}")
    shape = (*lead, n, k)
    if out is None:
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=packed.device)
    elif not out.is_contiguous() or tuple(out.shape) != shape or out.dtype != torch.float8_e4m3fn \
            or out.device != packed.device:
        raise ValueError(f"marlin_unpack_batched: out must be contiguous float8_e4m3fn {list(shape)} on "
                         f"{packed.device}; got {out.dtype} {list(out.shape)} on {out.device}")
    groups = n * t_ // _WEIGHT_PERM_SPAN
    src = packed.contiguous().view(torch.uint8).view(-1, kt, groups, _WEIGHT_PERM_SPAN)
    codes = out.view(torch.uint8).view(-1, n, k)
    inv = _weight_perm_inverse(packed.device)
    step = max(1, REPACK_CHUNK_BYTES // (n * k))
    for lo in range(0, src.shape[0], step):
        tiles = torch.index_select(src[lo:lo + step], -1, inv)             # [E, K/16, groups, 1024]
        tiles = tiles.view(-1, kt, n // t_, t_, t_)                         # [E, K/16, N/16, k, n]
        codes[lo:lo + step].view(-1, n // t_, t_, kt, t_).copy_(tiles.permute(0, 2, 4, 1, 3))
    return out


def marlin_pack(ops, w: torch.Tensor, batched: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp8 [..., N, K] -> Marlin's tiled int32 layout [..., K/16, 4 N] (``out``: written in place, and returned):
    :func:`marlin_weights_batched` where it agrees with the engine's op for the shape (``batched``, from
    :func:`batched_repack_agrees`), else the engine's op once per matrix -- the one rule for a Marlin
    layer's load, refresh and ``derived_state`` rebuild, dense or MoE."""
    if batched:
        return marlin_weights_batched(w, out=out)
    *lead, n, k = w.shape
    mats = w.reshape(-1, n, k)
    if out is None:
        return torch.stack([marlin_weight(ops, m) for m in mats]).reshape(*lead, k // MARLIN_TILE, 4 * n)
    flat = out.view(-1, k // MARLIN_TILE, 4 * n)
    for i, m in enumerate(mats):
        flat[i].copy_(marlin_weight(ops, m))
    return out


_AGREES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # engine ops -> {(n, k, device): bool}


def batched_repack_agrees(ops, n: int, k: int, device) -> bool:
    """Does :func:`marlin_weights_batched` make exactly the bytes the engine's ``gptq_marlin_repack``
    (``ops.repack``) makes for [N, K] weights on ``device``?  Checked once per engine, shape and device, on
    seeded random codes (every byte value: the layout is byte movement, blind to what the bytes mean), so a
    layer's load -- and each layer vLLM's layerwise reload rebuilds -- costs nothing after the first of its
    shape.  Where it does not (another Marlin layout in another vLLM version, a shape it does not take, ops
    that fail on the device), the layers of that shape keep the engine's op for their refreshes, with a
    warning."""
    try:
        seen = _AGREES.setdefault(ops, {})
    except TypeError:                                    # ops that take no weak reference: checked every time
        seen = {}
    key = (int(n), int(k), str(device))
    if key in seen:
        return seen[key]
    ok, why = False, f"N={n}, K={k} is not a multiple of (64, 16)"
    if batched_repack_shape_ok(n, k):
        try:
            g = torch.Generator(device=device).manual_seed(n * 65537 + k)
            w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device, generator=g).view(F.FP8_DTYPE)
            with torch.no_grad():
                ok = bool(torch.equal(marlin_weights_batched(w), marlin_weight(ops, w)))
            why = "its bytes differ from the engine's gptq_marlin_repack"
        except (RuntimeError, ValueError) as exc:        # e.g. an op this torch build lacks on the device
            why = f"it failed: {exc}"
    if not ok:
        log.warning("mxfp8-learner-grid: the batched Marlin repack is not used for N=%d, K=%d (%s); updates of "
                    "those layers repack with the engine's op", n, k, why)
    seen[key] = ok
    return ok


#: the largest M the decode GEMV is built for (``kernels/gemv_triton``: BLOCK_M 16 ... 64)
GEMV_MAX_ROWS = 64


def gemv_band(spec: LayerSpec, default: int = 0) -> int:
    """Option ``gemv_rows: R``: rows 1 ... R go to the decode GEMV (0: off); ``default`` where the
    option is not given (the kernel's measured crossover)."""
    rows = spec.options.get("gemv_rows")
    return int(default if rows is None else rows)


def grid_gemv_linear(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x2 (bf16 rows) on the grid by the decode GEMV: x quantized TE-exactly (codes + E8M0 scales, one
    Triton pass), then ``grid_gemv`` on the layer's own fp8 codes and scales, bf16 out."""
    from ..kernels.gemv_triton import grid_gemv
    from ..kernels.quantize_triton import quantize_rows_triton
    xq, xs = quantize_rows_triton(x2)
    return grid_gemv(xq, xs, weight, weight_scale_inv, None, torch.bfloat16, config="auto")   # no env read per call


def cublas_fp32_reduction(x_grid: torch.Tensor, w_grid: torch.Tensor) -> torch.Tensor:
    """x_grid @ w_grid^T (both bf16 grid values) by cuBLAS with split-K partials reduced in FP32
    (``allow_bf16_reduced_precision_reduction`` off for this call only)."""
    m = torch.backends.cuda.matmul
    prev = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        return torch.mm(x_grid, w_grid.t())
    finally:
        m.allow_bf16_reduced_precision_reduction = prev


def dequant_cublas(x_grid: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x_grid (bf16 grid values) @ W^T with W decoded to a bf16 scratch, cuBLAS, FP32 reduction."""
    from ..kernels.dequant_triton import dequant_rows_bf16
    return cublas_fp32_reduction(x_grid, dequant_rows_bf16(weight, weight_scale_inv))


#: the per-module bf16 copy, per compute capability, used when the option ``bf16_weight_rows`` is absent.
#: (9, 0), the H200: the three projections where the copy gains the most time per byte at M = 64 (qkv 0.16,
#: o 0.14, down 0.08 us per MB per layer; gate_up 0.01), from 48 rows on -- Qwen3-8B 0.896-0.899x BF16 at concurrency
#: 64 against 0.81-0.83x without it, its dense weights 13.8 GB against BF16's 13.9 (BENCHMARKS.md, nineteenth
#: and twenty-first sessions).  Below 48 rows (decode at concurrency <= 32) nothing changes.
DENSE_COPY_DEFAULTS = {
    (9, 0): {"qkv_proj": 48, "o_proj": 48, "down_proj": 48},
}


def copy_option(options: dict, capability) -> object:
    """The ``bf16_weight_rows`` a layer uses: the option when given (``0`` turns every copy off), else the
    platform's :data:`DENSE_COPY_DEFAULTS` (none off the GPU or on an unmeasured platform)."""
    if "bf16_weight_rows" in options:
        return options["bf16_weight_rows"]
    return platform_default(DENSE_COPY_DEFAULTS, capability, 0)


def bf16_copy_rows(option, prefix: str) -> int:
    """The rows from which the layer named ``prefix`` multiplies its resident bf16 copy (0: no copy), by the
    option ``bf16_weight_rows``: an integer (every dense layer), or a mapping from module names to rows --
    a key names the layer when it is the whole prefix or its dotted tail (``qkv_proj``,
    ``self_attn.o_proj``); the longest matching key wins, and ``"*"`` stands for every other layer.  So
    ``{"qkv_proj": 48, "o_proj": 48, "down_proj": 48}`` copies only the projections where the copy gains
    the most time per byte (BENCHMARKS.md, nineteenth session)."""
    if not option:
        return 0
    if not isinstance(option, dict):
        return int(option)
    hits = [key for key in option if key != "*" and (prefix == key or prefix.endswith("." + key))]
    if hits:
        return int(option[max(hits, key=len)] or 0)
    return int(option.get("*", 0) or 0)


class Bf16WeightCopy:
    """Option ``bf16_weight_rows: R`` (or per module, :func:`bf16_copy_rows`) of the dense kernels: from R
    rows on, cuBLAS multiplies a
    resident bf16 copy of W's grid values (``grid_bf16_weight`` [N, K], exact: an E4M3 code times
    a power of two), instead of Marlin / W8A16 below the crossover and of a per-call decode above
    it.  A derived tensor like the others: allocated once, rewritten in place by every update,
    rebuilt and compared by the ``derived_state`` check.  It costs 2 bytes of GPU memory per copied
    weight, which the engine then takes from the KV cache.  Default: :data:`DENSE_COPY_DEFAULTS` on
    their platforms (sm_90: qkv, o and down from 48 rows), none elsewhere; ``bf16_weight_rows: 0``
    turns it off."""

    NAME = "grid_bf16_weight"

    def __init__(self, spec: LayerSpec):
        self.rows = bf16_copy_rows(copy_option(spec.options, spec.capability), spec.prefix)

    def names(self) -> tuple[str, ...]:
        return (self.NAME,) if self.rows else ()

    @staticmethod
    def build(layer, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        from ..kernels.dequant_triton import dequant_rows_bf16
        return dequant_rows_bf16(layer.weight, layer.weight_scale_inv, out=out)

    def process(self, kernel: GridKernel, layer) -> None:
        if not self.rows:
            return
        if not hasattr(layer, self.NAME):
            kernel.register_derived_buffer(layer, self.NAME, self.build(layer))
        else:
            self.refresh(layer)

    def refresh(self, layer) -> None:
        if self.rows:
            with torch.no_grad():
                self.build(layer, out=getattr(layer, self.NAME))

    def derived(self, layer) -> dict:
        return {self.NAME: (getattr(layer, self.NAME), lambda: self.build(layer))} if self.rows else {}

    def tensor(self, layer) -> Optional[torch.Tensor]:
        return getattr(layer, self.NAME) if self.rows else None

    def describe(self) -> str:
        return f"; cuBLAS on a resident bf16 copy of W (M >= {self.rows})" if self.rows else ""


@torch.library.custom_op("mxfp8_learner_grid::linear_marlin", mutates_args=())
def linear_marlin(x: torch.Tensor, marlin_w: torch.Tensor, marlin_s: torch.Tensor, workspace: torch.Tensor,
                  weight: torch.Tensor, weight_scale_inv: torch.Tensor, crossover: int,
                  w8a16_lo: int = 0, w8a16_hi: int = 0, w_bf16: Optional[torch.Tensor] = None,
                  bf16_rows: int = 0, gemv_rows: int = 0, hum_w: Optional[torch.Tensor] = None,
                  hum_s: Optional[torch.Tensor] = None, hum_locks: Optional[torch.Tensor] = None,
                  hum_lo: int = 0, hum_hi: int = 0, hum_cfg: str = "", hum_tuning: str = "",
                  one_expert: Optional[list[int]] = None, x_on_grid: bool = False) -> torch.Tensor:
    """The grid Linear (bf16, no bias): the decode GEMV (M <= gemv_rows), else qdq(x) (skipped when
    ``x_on_grid``: the producer wrote x's grid values, ``common.producer_fusion``), then cuBLAS on
    the resident bf16 copy ``w_bf16`` (given, and M >= bf16_rows), dequantize + cuBLAS (M >= crossover),
    humming (hum_lo <= M < hum_hi), the W8A16 Triton GEMM (w8a16_lo <= M < w8a16_hi), Marlin MoE as
    one expert (a row of ``one_expert`` holds M: option ``marlin_configs``) or Marlin."""
    from ..kernels.qdq_triton import qdq_rows
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    if m <= gemv_rows:
        return grid_gemv_linear(x2, weight, weight_scale_inv).reshape(*x.shape[:-1], n)
    a = x2 if x_on_grid else qdq_rows(x2, torch.bfloat16)
    if w_bf16 is not None and m >= bf16_rows:
        y = cublas_fp32_reduction(a, w_bf16)
    elif m >= crossover:
        y = dequant_cublas(a, weight, weight_scale_inv)
    elif hum_lo <= m < hum_hi:
        from .humming import run_band
        y = run_band(a, hum_w, hum_s, hum_locks, hum_cfg, hum_tuning)
    elif w8a16_lo <= m < w8a16_hi:
        from ..kernels.w8a16_triton import w8a16_gemm
        y = w8a16_gemm(a, weight, weight_scale_inv)
    elif (knobs := marlin_launch.lookup(one_expert, m)) is not None:
        y = one_expert_gemm(a, marlin_w, marlin_s, workspace, n, k, *knobs)
    else:
        y = providers.get("marlin").gemm(a, marlin_w, marlin_s, workspace, n, k)
    return y.reshape(*x.shape[:-1], n)


def one_expert_gemm(a: torch.Tensor, marlin_w: torch.Tensor, marlin_s: torch.Tensor, workspace: torch.Tensor,
                    n: int, k: int, block: int, thread_k: int, thread_n: int, blocks_per_sm: int) -> torch.Tensor:
    """The dense GEMM as a one-expert Marlin MoE with the given launch knobs (``marlin_launch``): the
    same packed weight and scales, every token routed to expert 0 through constant views."""
    m = a.shape[0]
    sorted_ids, expert_ids, ntpp, tw = marlin_launch.one_expert_views(marlin_launch.one_expert_routing(a.device),
                                                                      m, block)
    return providers.get("marlin").moe_gemm(a, marlin_w.unsqueeze(0), marlin_s.unsqueeze(0), workspace, sorted_ids,
                                            expert_ids, ntpp, tw, block, 1, size_m=m, size_n=n, size_k=k,
                                            thread_k=thread_k, thread_n=thread_n,
                                            blocks_per_sm=blocks_per_sm).view(m, n)


@linear_marlin.register_fake
def _(x, marlin_w, marlin_s, workspace, weight, weight_scale_inv, crossover, w8a16_lo=0, w8a16_hi=0, w_bf16=None,
      bf16_rows=0, gemv_rows=0, hum_w=None, hum_s=None, hum_locks=None, hum_lo=0, hum_hi=0, hum_cfg="", hum_tuning="",
      one_expert=None, x_on_grid=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _marlin_supported(spec: LayerSpec) -> tuple[bool, str]:
    """The Triton kernels' platform (the activation qdq is one) plus the engine's Marlin ops."""
    from .portable import triton_supported
    ok, why = triton_supported(spec)
    if ok and providers.get("marlin") is None:
        return False, "the engine provides no MXFP8 Marlin ops"
    return ok, why


class MarlinLinear(GridKernel):
    name = "marlin"
    kind = "linear"
    accepts_grid_input = True

    @classmethod
    def is_supported(cls, spec):
        return _marlin_supported(spec)

    @classmethod
    def can_implement(cls, spec):
        ok, why = bf16_output_no_bias(spec, "Marlin")
        if not ok:
            return ok, why
        if not marlin_shape_ok(spec.n, spec.k):
            return False, f"shape N={spec.n}, K={spec.k} is not a Marlin tile multiple"
        return True, ""

    def __init__(self, spec):
        super().__init__(spec)
        self.crossover = int(spec.options.get("prefill_crossover", DEFAULT_PREFILL_CROSSOVER))
        lo, hi = spec.options.get("w8a16_rows") or (0, 0)
        from ..kernels.w8a16_triton import w8a16_shape_ok
        self.w8a16 = (int(lo), int(hi)) if w8a16_shape_ok(spec.k) else (0, 0)
        self.bf16_copy = Bf16WeightCopy(spec)
        self.gemv_rows = gemv_band(spec)
        self.batched = False       # refreshes repack with marlin_weights_batched (checked at load), not the engine's op
        from .humming import HummingBand
        self.humming = HummingBand(spec)
        self.one_expert = marlin_launch.rows_for(spec.options, spec.n, spec.k)
        self.x_on_grid = False
        if self.one_expert and not hasattr(providers.get("marlin"), "moe_gemm"):
            raise ValueError(f"{spec.prefix}: marlin_configs has rows for N={spec.n}, K={spec.k}, which run the "
                             "layer as a one-expert Marlin MoE, but the engine provides no Marlin MoE op")

    def derived_names(self, layer):
        return ("grid_marlin_weight", "grid_marlin_scale") + self.bf16_copy.names() + self.humming.names()

    def process_weights_after_loading(self, layer) -> None:
        ops = providers.get("marlin")
        check_bf16_exact_weights(layer.weight_scale_inv, layer.weight, self.spec.prefix)
        if not hasattr(layer, "grid_marlin_weight"):
            self.batched = batched_repack_agrees(ops, *layer.weight.shape, layer.weight.device)
            self.register_derived_buffer(layer, "grid_marlin_weight", marlin_pack(ops, layer.weight, self.batched))
            self.register_derived_buffer(layer, "grid_marlin_scale", marlin_scales(layer.weight_scale_inv))
            # Marlin MoE's locks: one per thread block, up to MAX_BLOCKS_PER_SM per SM (marlin_configs)
            per_sm = marlin_launch.MAX_BLOCKS_PER_SM if self.one_expert else 1
            self.register_derived_buffer(layer, "grid_marlin_workspace", ops.workspace(layer.weight.device, per_sm))
            self.bf16_copy.process(self, layer)
            self.humming.process(self, layer)
            self._probe_one_expert(layer)
        else:
            self.refresh(layer)

    def _probe_one_expert(self, layer) -> None:
        """Each ``marlin_configs`` row of this layer, launched once at its first M on a random input, must
        compute what Marlin's dense launch does (``marlin_launch.probe``); else the load fails, naming it."""
        from ..kernels.qdq_triton import qdq_rows
        n, k = self.spec.n, self.spec.k
        ops = providers.get("marlin")
        for i, band in enumerate(marlin_launch.bands(self.one_expert)):
            m, knobs = band[0], band[2:]
            g = torch.Generator(device=layer.weight.device).manual_seed(i)
            a = qdq_rows(torch.randn(m, k, device=layer.weight.device, generator=g).to(torch.bfloat16), torch.bfloat16)
            marlin_launch.probe(
                lambda: one_expert_gemm(a, layer.grid_marlin_weight, layer.grid_marlin_scale,
                                        layer.grid_marlin_workspace, n, k, *knobs),
                lambda: ops.gemm(a, layer.grid_marlin_weight, layer.grid_marlin_scale, layer.grid_marlin_workspace,
                                 n, k),
                [n, k, *band], self.spec.prefix)

    def refresh(self, layer, experts=None) -> None:
        ops = providers.get("marlin")
        guard_bf16_exact_weights(layer.weight_scale_inv, layer.weight, self.spec.prefix)
        with torch.no_grad():
            marlin_pack(ops, layer.weight, self.batched, out=layer.grid_marlin_weight)
            layer.grid_marlin_scale.copy_(marlin_scales(layer.weight_scale_inv))
        self.bf16_copy.refresh(layer)
        self.humming.refresh(layer)

    def derived(self, layer):
        ops = providers.get("marlin")
        return {"grid_marlin_weight": (layer.grid_marlin_weight, lambda: marlin_pack(ops, layer.weight, self.batched)),
                "grid_marlin_scale": (layer.grid_marlin_scale, lambda: marlin_scales(layer.weight_scale_inv)),
                **self.bf16_copy.derived(layer), **self.humming.derived(layer)}

    def apply(self, layer, x, bias: Optional[torch.Tensor] = None):
        return torch.ops.mxfp8_learner_grid.linear_marlin(x, layer.grid_marlin_weight, layer.grid_marlin_scale,
                                                           layer.grid_marlin_workspace, layer.weight,
                                                           layer.weight_scale_inv, self.crossover, *self.w8a16,
                                                           self.bf16_copy.tensor(layer), self.bf16_copy.rows,
                                                           self.gemv_rows, *self.humming.args(layer),
                                                           self.one_expert or None, self.x_on_grid)

    def take_grid_input(self) -> None:
        self.x_on_grid = True

    def describe(self):
        lo, hi = self.w8a16
        band = f" + w8a16 Triton ({lo} <= M < {hi})" if hi > lo else ""
        gemv = f"gemv (M <= {self.gemv_rows}) + " if self.gemv_rows else ""
        moe = "".join(f" + marlin MoE as one expert ({lo} <= M < {hi}: block {block}, tile {tk}x{tn}, {bps} blocks/SM)"
                      for lo, hi, block, tk, tn, bps in marlin_launch.bands(self.one_expert))
        return (f"{gemv}marlin (M < {self.crossover}){band}{moe} + dequantize/cuBLAS (M >= {self.crossover})"
                f"{self.bf16_copy.describe()}{self.humming.describe()}"
                f"{'; input qdq done by its producer' if self.x_on_grid else ''}")


def guard_bf16_exact_weights(scales: torch.Tensor, weight: torch.Tensor, prefix: str) -> None:
    """:func:`check_bf16_exact_weights` after a write into a processed layer (an update, a trainer's own
    ``load_weights``): the rare case (a scale byte < 3 at all) flagged without reading the device, the full
    check only where it is flagged (``refresh.guard``: one synchronization per update bucket).  An update
    that brings such weights is refused and rolled back, as the first load refuses them."""
    from ..kernels.qdq_triton import BF16_EXACT_MIN_SCALE
    from ..refresh import guard
    guard((scales < BF16_EXACT_MIN_SCALE).any(), lambda: check_bf16_exact_weights(scales, weight, prefix))


def check_bf16_exact_weights(scales: torch.Tensor, weight: torch.Tensor, prefix: str) -> None:
    """Warn-free guard: a non-zero weight block with scale byte < 3 is not exact in bf16 (amax <= ~1e-35).
    Such weights do not occur in trained models; refuse them loudly rather than compute off the grid."""
    from ..kernels.qdq_triton import BF16_EXACT_MIN_SCALE
    low = scales < BF16_EXACT_MIN_SCALE
    if not bool(low.any()):
        return
    blocks = plain(weight).view(torch.uint8).reshape(*scales.shape, F.BLOCK_SIZE) & 0x7F
    bad = low & (blocks != 0).any(-1)
    if bool(bad.any()):
        raise ValueError(f"{prefix}: {int(bad.sum())} weight blocks have E8M0 scale byte < {BF16_EXACT_MIN_SCALE} "
                         "(block amax <= ~1e-35): not exact in the bf16 fast path; choose kernel 'triton'")
