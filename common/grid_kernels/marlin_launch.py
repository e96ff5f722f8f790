"""Option ``marlin_configs``: Marlin MoE's launch knobs per GEMM shape and band of rows.

vLLM's ``moe_wna16_marlin_gemm`` takes a token block (``moe_block_size``), a thread tile
(``thread_k``, ``thread_n``) and ``blocks_per_sm``; its dense ``marlin_gemm`` picks its tile itself.
Both are the same Marlin kernel (W8A16, FP32 accumulation, here FP32 global reduction and no
atomics), so every setting of these knobs sums the same exact products in FP32: any of them is the
grid, up to FP32 summation order.  Only their speed differs (``benchmarks/exp_marlin_tiles.py``
measures it and writes a table).

A row is ``[n, k, lo, hi, block, thread_k, thread_n, blocks_per_sm]``: for a GEMM with N outputs
and reduction K, at lo <= M < hi rows (tokens), launch with these knobs (-1: Marlin's own choice
of tile / blocks per SM).  N and K are the GEMM as one rank holds it (after tensor parallelism).

* **MoE layers**: the row of the w13 GEMM (n = 2 x intermediate, k = hidden) sets the layer's token
  block and its tiles; the row of the w2 GEMM (n = hidden, k = intermediate) sets the w2 tiles
  (its ``block`` is not used: both GEMMs share one token alignment).  M is the layer's tokens.
* **Dense layers**: in a row's band (below ``prefill_crossover`` and outside the other options' bands,
  which come first) the layer runs as a one-expert Marlin MoE (every token routed to expert 0) on
  its own packed weight and scales (``grid_marlin_weight`` / ``grid_marlin_scale``, the same layout
  per expert): no derived tensor more, and the token alignment is a view of a constant
  ``arange`` (entries >= M are padding, which Marlin skips), so the band adds no launch.

Rows are parsed once (:func:`parse_rows`), the rows of one shape flattened once per layer
(:func:`rows_for`), looked up per call by M (:func:`lookup`).

**Defaults.**  Without the option, MoE layers on a platform of :data:`MOE_DEFAULT_ROWS` take its
measured rows (the ones that beat Marlin's own launch there, end to end); dense layers take none (no
knob beat the dense kernel on the H200).  ``marlin_configs: []`` turns the defaults off.  A default row
that a layer's load probe refuses is dropped for that layer, with a warning (a row you set fails the load).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import platform_default

FIELDS = ("n", "k", "lo", "hi", "block", "thread_k", "thread_n", "blocks_per_sm")
#: the token blocks Marlin MoE is built for (vLLM 0.26.0: ``fused_marlin_moe``'s candidates)
BLOCKS = (8, 16, 32, 48, 64)
#: thread tiles (thread_k, thread_n) of vLLM's Marlin builds; (-1, -1): Marlin's choice
TILES = ((-1, -1), (128, 128), (64, 256), (128, 64), (64, 128))
#: blocks_per_sm choices (-1: Marlin's); the layers' workspaces hold this many locks per SM
MAX_BLOCKS_PER_SM = 4
#: a dense band ends at most here (the one-expert alignment is a view of an arange this long)
MAX_ROWS = 8192
_PER_SHAPE = 6          # lo, hi, block, thread_k, thread_n, blocks_per_sm

#: measured MoE rows per compute capability, used when the option is absent.  (9, 0), the H200: the
#: Qwen3-30B-A3B experts (w13 1536 x 2048, w2 2048 x 768) at one token, block 8, tile 128 x 64, 2 blocks
#: per SM -- 1.12x Marlin's launch on the two expert GEMMs (``benchmarks/exp_marlin_tiles.py``, sixteenth
#: session) and 1.03x end to end at concurrency 1 (199.1 against 193.3 tok/s, seventeenth session;
#: BENCHMARKS.md).  Other expert shapes keep Marlin's own launch.
MOE_DEFAULT_ROWS = {
    (9, 0): ((1536, 2048, 1, 2, 8, 128, 64, 2), (2048, 768, 1, 2, 8, 128, 64, 2)),
}


def parse_rows(rows) -> tuple[tuple[int, ...], ...]:
    """Validate the option's value (a list of 8-integer rows); raise naming the row that is wrong."""
    if rows is None:
        return ()
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"marlin_configs must be a list of rows {list(FIELDS)}; got {rows!r}")
    out = []
    for row in rows:
        if not (isinstance(row, (list, tuple)) and len(row) == len(FIELDS)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in row)):
            raise ValueError(f"marlin_configs: each row is {len(FIELDS)} integers {list(FIELDS)}; got {row!r}")
        n, k, lo, hi, block, tk, tn, bps = row
        if n <= 0 or k <= 0 or not 1 <= lo < hi <= MAX_ROWS + 1:
            raise ValueError(f"marlin_configs row {list(row)}: need n, k > 0 and 1 <= lo < hi <= {MAX_ROWS + 1}")
        if block not in BLOCKS:
            raise ValueError(f"marlin_configs row {list(row)}: block must be one of {BLOCKS}")
        if (tk, tn) not in TILES:
            raise ValueError(f"marlin_configs row {list(row)}: (thread_k, thread_n) must be one of {list(TILES)}")
        if not (bps == -1 or 1 <= bps <= MAX_BLOCKS_PER_SM):
            raise ValueError(f"marlin_configs row {list(row)}: blocks_per_sm must be -1 or 1 ... {MAX_BLOCKS_PER_SM}")
        out.append(tuple(row))
    for i, a in enumerate(out):        # one launch per (shape, M): bands of one shape must not overlap
        for b in out[i + 1:]:
            if a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]:
                raise ValueError(f"marlin_configs rows {list(a)} and {list(b)} overlap (same n, k)")
    return tuple(out)


def uses_defaults(options: dict) -> bool:
    """True when the option is absent: a layer then takes its platform's default rows, if any."""
    return "marlin_configs" not in options


def rows_for(options: dict, n: int, k: int, defaults: Sequence[Sequence[int]] = ()) -> list[int]:
    """The option's rows for an (n, k) GEMM -- ``defaults`` when the option is absent -- flattened to
    [lo, hi, block, tk, tn, bps] * rows (a custom op's ``int[]``)."""
    rows = parse_rows(options["marlin_configs"]) if not uses_defaults(options) else parse_rows(list(defaults))
    flat: list[int] = []
    for row in rows:
        if row[0] == n and row[1] == k:
            flat.extend(row[2:])
    return flat


def moe_defaults(capability) -> tuple[tuple[int, ...], ...]:
    """:data:`MOE_DEFAULT_ROWS` of a compute capability (none for others, or off the GPU)."""
    return platform_default(MOE_DEFAULT_ROWS, capability, ())


def bands(flat: Optional[Sequence[int]]):
    """The rows of :func:`rows_for`'s flat list, as (lo, hi, block, thread_k, thread_n, blocks_per_sm)."""
    flat = flat or ()
    return [tuple(flat[i:i + _PER_SHAPE]) for i in range(0, len(flat), _PER_SHAPE)]


def lookup(flat: Optional[Sequence[int]], m: int) -> Optional[tuple[int, int, int, int]]:
    """(block, thread_k, thread_n, blocks_per_sm) of the row whose band holds M, or None."""
    for lo, hi, *knobs in bands(flat):
        if lo <= m < hi:
            return tuple(knobs)
    return None


_ONE_EXPERT: dict = {}


def one_expert_routing(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Constant buffers of a one-expert launch, made once per device: ``arange`` (int32), the
    expert ids (zeros) and the top-k weights (ones, unused: ``mul_topk_weights`` is off)."""
    key = torch.device(device)
    if key not in _ONE_EXPERT:
        size = MAX_ROWS + 2 * BLOCKS[-1] + 1
        _ONE_EXPERT[key] = (torch.arange(size, dtype=torch.int32, device=key),
                            torch.zeros(size, dtype=torch.int32, device=key),
                            torch.ones(size, dtype=torch.float32, device=key))
    return _ONE_EXPERT[key]


def one_expert_views(buffers, m: int, block: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights) for M tokens all routed to
    expert 0, as views of :func:`one_expert_routing`'s buffers (no launch).  The sorted ids run
    0 ... padded - 1: the entries >= M are the padding Marlin skips (ids >= size_m x top_k)."""
    ar, zeros, ones = buffers
    padded = -(-m // block) * block
    return ar[:padded], zeros[:padded // block], ar[padded:padded + 1], ones[:m].view(m, 1)


def probe(tuned, default, row: Sequence[int], prefix: str) -> None:
    """Refuse a row at load unless its launch computes what Marlin's own launch does, up to FP32
    summation order: >= 99 % of the elements equal bit for bit, and every other one within 1 % of its
    row's largest magnitude (a reordered FP32 sum moves an element by an ulp or, where terms cancel,
    by a few ulps of a small result; a broken launch moves nearly all of them).  A tile that vLLM's
    build lacks is refused by the op; one that fails to launch leaves its output unwritten, silently
    (the op does not check the launch): both are caught here, once per layer, not in a CUDA graph.
    The probe runs on the layer's weights as loaded: on all-zero weights both launches write zeros and
    an unwritten output that happens to be zeros too would pass."""
    try:
        y = tuned()
    except Exception as exc:          # the op's own checks (RuntimeError from its STD_TORCH_CHECKs)
        raise ValueError(f"{prefix}: marlin_configs row {list(row)}: Marlin MoE refuses it: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    ref = default()
    if y.shape != ref.shape or not bool(torch.isfinite(y).all()):
        raise ValueError(f"{prefix}: marlin_configs row {list(row)}: its launch wrote no valid output")
    same = (y.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
    yf, rf = y.float(), ref.float()
    near = bool(((yf - rf).abs() <= 0.01 * rf.abs().amax(dim=-1, keepdim=True)).all())
    if same < 0.99 or not near:
        raise ValueError(f"{prefix}: marlin_configs row {list(row)}: its launch differs from Marlin's own "
                         f"({same:.4f} of elements equal): not used")
