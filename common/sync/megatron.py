"""Megatron-Core / Transformer Engine tensor-parallel shards as an update source.

A Megatron trainer with tensor parallelism holds each Linear split across its TP ranks, in
Megatron's layouts.  :class:`MegatronTPSource` gathers them one bucket at a time -- the same
protocol as :class:`~.sources.ShardedSource` (rank ``src`` of the TP group passes the source to
``update_weights``; every other TP rank calls :meth:`follow`) -- and hands the client Hugging Face
names (``convert.megatron_qwen3_rename``: fused ``linear_qkv`` / ``linear_fc1`` split row-exactly).

How each parameter is split (Megatron-Core's GPT layers; ``module.`` prefixes allowed):

=========================================================  ==========================================
``self_attention.linear_qkv.weight``                       rows (each rank: whole query groups, each
                                                           group's q, k, v rows together)
``mlp.linear_fc1.weight`` (and expert fc1, see below)      rows, gated: each rank holds its gate rows
                                                           then its up rows
``self_attention.linear_proj.weight``, ``mlp.linear_fc2``  columns (K)
``embedding.word_embeddings``, ``output_layer``            rows, vocabulary padded by Megatron: cut to
                                                           ``vocab_size``
norms, ``q_layernorm`` / ``k_layernorm``, ``router``       replicated (rank ``src``'s copy is read)
=========================================================  ==========================================

MoE experts (``mlp.experts.linear_fc1.weight<e>`` of TEGroupedMLP, or
``mlp.experts.local_experts.<e>.linear_fc1.weight``) are split like the dense MLP when
``expert_tensor_parallel`` (Megatron's expert TP size equal to TP), or replicated across the TP
ranks when it is false (expert TP size 1).  Expert parallelism and pipeline stages are not
gathered here: every expert and every layer must be on this TP group.

Either format: plain tensors (``format="bf16"``), or TE ``MXFP8Tensor`` parameters
(``format="mxfp8"``), whose rowwise bytes and scales (``learner.wire_from_te``: padding
stripped, swizzle undone) are gathered with the same rule.  That is exact on the grid: a row
split moves whole rows with their scales, and a column split of a rank's K/tp columns (a
multiple of 32, or TE could not have quantized the shard) moves whole 1x32 blocks -- TE quantizes
each block on its own, so the gathered bytes are those of the whole tensor.  An MXFP8 parameter
yields ``<module>.weight`` (fp8) and ``<module>.weight_scale_inv`` (uint8 ``[N, K/32]``).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional

import torch

from .recorder import UpdateRejected
from .sources import ShardedSource, _nbytes

ROWS, GATED, COLS, VOCAB = "rows", "gated", "cols", "vocab"

_P = r"^(?:module\.)?"
_RULES = [
    (re.compile(_P + r"decoder\.layers\.\d+\.self_attention\.linear_qkv\.weight$"), ROWS),
    (re.compile(_P + r"decoder\.layers\.\d+\.mlp\.linear_fc1\.weight$"), GATED),
    (re.compile(_P + r"decoder\.layers\.\d+\.self_attention\.linear_proj\.weight$"), COLS),
    (re.compile(_P + r"decoder\.layers\.\d+\.mlp\.linear_fc2\.weight$"), COLS),
    (re.compile(_P + r"(?:embedding\.word_embeddings|output_layer)\.weight$"), VOCAB),
]
_EXPERT_RULES = [
    (re.compile(_P + r"decoder\.layers\.\d+\.mlp\.experts\.(?:local_experts\.\d+\.linear_fc1\.weight"
                r"|linear_fc1\.weight\d+)$"), GATED),
    (re.compile(_P + r"decoder\.layers\.\d+\.mlp\.experts\.(?:local_experts\.\d+\.linear_fc2\.weight"
                r"|linear_fc2\.weight\d+)$"), COLS),
]


def tp_rule(name: str, expert_tensor_parallel: bool = True) -> Optional[str]:
    """How Megatron splits parameter ``name`` across TP ranks (None: replicated)."""
    for pat, rule in _RULES + (_EXPERT_RULES if expert_tensor_parallel else []):
        if pat.match(name):
            return rule
    return None


def _global_shape(rule: Optional[str], shape: tuple, world: int, vocab: int) -> tuple:
    if rule is None:
        return shape
    if rule == COLS:
        return (shape[0], shape[1] * world, *shape[2:])
    rows = shape[0] * world
    if rule == VOCAB:
        rows = min(rows, vocab)
    return (rows, *shape[1:])


def assemble(rule: Optional[str], shards: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """The whole tensor from every TP rank's shard, in rank order (the inverse of Megatron's split)."""
    if rule is None:
        return shards[0]
    if rule == COLS:
        return torch.cat(shards, dim=1)
    if rule == GATED:
        half = shards[0].shape[0] // 2
        return torch.cat([s[:half] for s in shards] + [s[half:] for s in shards], dim=0)
    full = torch.cat(shards, dim=0)
    return full[:vocab] if rule == VOCAB else full


class MegatronTPSource(ShardedSource):
    """This TP rank's Megatron/TE parameters (e.g. ``model.named_parameters()``), gathered over the
    TP ``group`` one bucket at a time (see the module doc).  ``hf_config``: the sampler's HF config
    (dict), for the q/k/v split and the vocabulary size."""

    def __init__(self, named: Mapping[str, object] | Iterable[tuple[str, object]], hf_config: dict,
                 group=None, src: int = 0, device: Optional[torch.device | str] = None,
                 expert_tensor_parallel: bool = True):
        from ..convert import megatron_qwen3_rename
        self.hf_config = dict(hf_config)
        self.vocab = int(self.hf_config.get("vocab_size") or 1 << 62)
        self.rename = megatron_qwen3_rename(self.hf_config)
        items = named.items() if isinstance(named, Mapping) else named
        state = {n: t for n, t in items if not self._dropped(n)}
        self._rules = {n: tp_rule(n, expert_tensor_parallel) for n in state}
        super().__init__(state, group=group, src=src, device=device)

    def _dropped(self, name: str) -> bool:
        """TE's ``_extra_state`` and amax history have no HF name; a name nobody knows is refused."""
        if re.search(r"\.(linear_qkv|linear_fc1)\.weight\d*$", name):
            return False                          # split by rows below, never dropped
        try:
            return self.rename(name, None) == []
        except ValueError as exc:
            raise UpdateRejected(f"{name}: {exc}") from None

    # -- a unit: one Megatron parameter (an MXFP8 one is two tensors: bytes and scales) --------
    @staticmethod
    def _parts(name: str, t) -> tuple[torch.Tensor, ...]:
        from ..learner import is_te_mxfp8_tensor, wire_from_te
        if is_te_mxfp8_tensor(t):
            return wire_from_te(t, name)
        if not isinstance(t, torch.Tensor):
            raise UpdateRejected(f"{name}: neither a tensor nor a TE MXFP8Tensor ({type(t).__name__})")
        return (t.detach(),)

    @staticmethod
    def _local_meta(name: str, t) -> list[tuple[tuple, torch.dtype]]:
        from ..learner import is_te_mxfp8_tensor
        from .. import format as F
        if is_te_mxfp8_tensor(t):
            shape = tuple(t.shape)
            return [(shape, F.FP8_DTYPE), ((*shape[:-1], shape[-1] // F.BLOCK_SIZE), torch.uint8)]
        return [(tuple(t.shape), t.dtype)]

    def _named_out(self, name: str, parts: tuple) -> list[tuple[str, torch.Tensor]]:
        from ..wire import SCALE_SUFFIX, WEIGHT_SUFFIX
        x = parts if len(parts) == 2 else parts[0]
        out = []
        for hf, y in self.rename(name, x):
            if isinstance(y, tuple):
                out += [(hf, y[0]), (hf[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX, y[1])]
            else:
                out.append((hf, y))
        return out

    def _meta_of(self, name, t):
        rule = self._rules[name]
        parts = tuple(torch.empty(_global_shape(rule, shape, self.world, self.vocab), dtype=dt, device="meta")
                      for shape, dt in self._local_meta(name, t))
        if rule == GATED and t.shape[0] % 2:                 # each rank holds gate rows, then as many up rows
            raise UpdateRejected(f"{name}: a gated fc1 shard needs an even number of rows; got {tuple(t.shape)}")
        try:
            return [(n, tuple(v.shape), v.dtype) for n, v in self._named_out(name, parts)]
        except (AssertionError, ValueError, IndexError, RuntimeError) as exc:
            nh, nkv = self.hf_config.get("num_attention_heads"), self.hf_config.get("num_key_value_heads")
            raise UpdateRejected(f"{name}: local shape {tuple(t.shape)} on {self.world} TP ranks does not fit "
                                 f"Megatron's layout for this model ({nh} heads, {nkv} query groups): {exc}") from None

    def _nbytes_of(self, name, t):
        k = 1 if self._rules[name] is None else self.world
        return k * sum(_nbytes(s, dt) for s, dt in self._local_meta(name, t))

    def _realize(self, name, t):
        rule = self._rules[name]
        full = tuple(self._gather_part(p, rule) for p in self._parts(name, t))
        if self.rank != self.src:
            return []
        if self.device is not None:
            full = tuple(p.to(self.device) for p in full)
        return self._named_out(name, full)

    def _gather_part(self, p: torch.Tensor, rule: Optional[str]) -> Optional[torch.Tensor]:
        """Every TP rank's shard of ``p`` on rank src (bytes through the group: any dtype, gloo or NCCL)."""
        import torch.distributed as dist
        if rule is None:
            return p                              # replicated: rank src's own copy
        if self.world == 1:
            return assemble(rule, [p], self.vocab)
        p = p.contiguous()
        raw = p.reshape(-1).view(torch.uint8)
        bufs = [torch.empty_like(raw) for _ in range(self.world)] if self.rank == self.src else None
        dst = dist.get_global_rank(self.group, self.src) if self.group is not None else self.src
        dist.gather(raw, bufs, dst=dst, group=self.group)
        if self.rank != self.src:
            return None
        shards = [b.view(p.dtype).reshape(p.shape) for b in bufs]
        return assemble(rule, shards, self.vocab)
