"""Where ``update_weights`` reads a trainer's tensors: names, shapes and dtypes first, then the
tensors bucket by bucket, then (byte identity) the sampled regions' tensors once more.

A source never holds more than one bucket of realized tensors.  Three kinds:

* :class:`DictSource` -- a state dict (or pairs) the trainer already holds: zero-copy views
  (``inputs.trainer_tensors``), every step immediate.
* :class:`ShardedSource` -- a sharded trainer: FSDP2 ``DTensor`` parameters (sharded on dim 0,
  or any placement), plain tensors passed through.  Rank 0 of the trainer's process group drives
  the update; every other rank calls :meth:`ShardedSource.follow` with the same state dict and
  takes part in each gather rank 0 asks for (a broadcast command, then ``full_tensor()`` per
  tensor, in the same order on every rank).  Peak extra memory: one bucket of full tensors per
  rank, never the model.  Metadata needs no gather (a DTensor knows its global shape).
* :class:`StreamSource` -- a re-iterable stream: ``make_iter()`` returns an iterator of
  ``(name, tensor)``.  Without ``metadata`` one pass reads names, shapes and dtypes (the tensors
  are dropped as they come), the next streams bucket by bucket; byte identity iterates once more
  and keeps only the tensors whose regions were sampled.  Nothing is materialized whole.

transformers 5 fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]) are split into per-expert HF names by every source, after the unit is realized, so a
fused DTensor is gathered once (``inputs.fused_plan``: one rule for shapes and tensors).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from .inputs import FUSED_EXPERTS, fused_plan, trainer_tensors
from .recorder import UpdateRejected


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def _expand(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if FUSED_EXPERTS.match(name):
        return [(n, t[idx]) for n, idx, _ in fused_plan(name, tuple(t.shape))]
    return [(name, t)]


def _expand_meta(name: str, shape, dtype) -> list[tuple[str, tuple, torch.dtype]]:
    if FUSED_EXPERTS.match(name):
        return [(n, s, dtype) for n, _, s in fused_plan(name, tuple(shape))]
    return [(name, tuple(shape), dtype)]


def _check_unique(meta: list) -> None:
    seen = set()
    for n, _, _ in meta:
        if n in seen:
            raise UpdateRejected(f"{n}: given twice (once fused, once per expert?)")
        seen.add(n)


class TrainerSource:
    """The interface the client reads (see the module doc)."""

    def metadata(self) -> list[tuple[str, tuple, torch.dtype]]:
        """[(HF name, shape, dtype)] of every tensor of the update, fused experts split."""
        raise NotImplementedError

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named realized tensors, about ``bucket_bytes`` at a time."""
        raise NotImplementedError

    def lookup(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, realized tensor)`` for each of ``names`` found (for byte identity), one at a
        time where the source streams: the caller checks each and drops it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the followers (sharded sources); idempotent."""


class DictSource(TrainerSource):
    def __init__(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
        self.named = trainer_tensors(named)

    def metadata(self):
        return [(n, tuple(t.shape), t.dtype) for n, t in self.named.items()]

    def buckets(self, bucket_bytes):
        from .transport import buckets
        return buckets(self.named.items(), bucket_bytes)

    def lookup(self, names):
        return ((n, self.named[n]) for n in names if n in self.named)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                       # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (a collective for a DTensor: every rank must call it)."""
    t = t.detach()
    return t.full_tensor() if _is_dtensor(t) else t


class ShardedSource(TrainerSource):
    """A sharded trainer's state dict (see the module doc).  Rank ``src`` of ``group`` passes this
    to ``update_weights``; every other rank runs ``ShardedSource(same_state, group).follow()``."""

    STOP = "__grid_stop__"

    def __init__(self, state: Mapping[str, torch.Tensor], group=None, src: int = 0,
                 device: Optional[torch.device | str] = None):
        import torch.distributed as dist
        self.state, self.group, self.src, self.device = dict(state), group, src, device
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._closed = False
        self._unit_meta = {name: self._meta_of(name, t) for name, t in self.state.items()}
        meta = [m for ms in self._unit_meta.values() for m in ms]
        _check_unique(meta)
        self._meta = meta

    # -- what a unit is (a subclass with another layout overrides these three) --
    def _meta_of(self, name: str, t) -> list[tuple[str, tuple, torch.dtype]]:
        """[(HF name, global shape, dtype)] a unit yields, without gathering it."""
        return _expand_meta(name, tuple(t.shape), t.dtype)

    def _nbytes_of(self, name: str, t) -> int:
        """The bytes a unit takes once gathered (for bucketing)."""
        return _nbytes(t.shape, t.dtype)

    def _realize(self, name: str, t) -> list[tuple[str, torch.Tensor]]:
        """Gather one unit -- a collective: every rank calls it, in the same order -- and return its
        HF-named tensors on the driving rank (other ranks may return anything)."""
        full = _full(t)
        if self.device is not None:
            full = full.to(self.device)
        return _expand(name, full) if self.rank == self.src else []

    # -- the protocol: rank src broadcasts which units to gather, everyone gathers them in order --
    def _command(self, units: Optional[list[str]]) -> Optional[list[str]]:
        import torch.distributed as dist
        if self.world == 1:
            return units
        box = [units if self.rank == self.src else None]
        src = dist.get_global_rank(self.group, self.src) if self.group is not None else self.src
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _gather(self, units: list[str]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for u in units:
            got = self._realize(u, self.state[u])
            if self.rank == self.src:
                out += got
        return out

    def follow(self) -> int:
        """Non-driving ranks: take part in every gather until the driver closes; returns how many."""
        if self.rank == self.src:
            raise RuntimeError("ShardedSource.follow() is for the ranks that do not drive the update")
        n = 0
        while True:
            units = self._command(None)
            if units == [self.STOP]:
                return n
            self._gather(units)
            n += 1

    def _drive(self, units: list[str]) -> list[tuple[str, torch.Tensor]]:
        if self._closed:
            raise RuntimeError("ShardedSource used after close()")
        self._command(list(units))
        return self._gather(units)

    def metadata(self):
        return list(self._meta)

    def buckets(self, bucket_bytes):
        cur, size = [], 0
        for name, t in self.state.items():
            n = self._nbytes_of(name, t)
            if cur and size + n > bucket_bytes:
                yield self._drive(cur)
                cur, size = [], 0
            cur.append(name)
            size += n
        if cur:
            yield self._drive(cur)

    def lookup(self, names):
        """One gather per unit that holds a wanted name, yielded before the next (byte identity
        samples nearly every tensor: gathering them together would hold the model)."""
        want = set(names)
        for u in [u for u in self.state if any(n in want for n, _, _ in self._unit_meta[u])]:
            for n, t in self._drive([u]):
                if n in want:
                    yield n, t

    def close(self):
        if not self._closed and self.rank == self.src:
            self._command([self.STOP])
        self._closed = True


class StreamSource(TrainerSource):
    """A re-iterable stream of ``(name, tensor)`` (see the module doc)."""

    def __init__(self, make_iter: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 metadata: Optional[Iterable[tuple[str, Sequence[int], torch.dtype]]] = None):
        self.make_iter = make_iter
        self._meta = None
        if metadata is not None:
            meta = []
            for name, shape, dtype in metadata:
                meta += _expand_meta(name, tuple(shape), dtype)
            self._meta = meta

    def metadata(self):
        if self._meta is None:                 # the metadata pass: tensors are dropped as they come
            meta = []
            for name, t in self.make_iter():
                meta += _expand_meta(name, tuple(t.shape), t.dtype)
            self._meta = meta
        _check_unique(self._meta)
        return list(self._meta)

    def buckets(self, bucket_bytes):
        from .transport import buckets
        expected = [n for n, _, _ in self.metadata()]
        got = []

        def items():
            for name, t in self.make_iter():
                for n, v in _expand(name, t):
                    got.append(n)
                    yield n, v
        yield from buckets(items(), bucket_bytes)
        if got != expected:
            raise UpdateRejected(f"the stream changed between passes: {len(got)} tensors this pass, "
                                 f"{len(expected)} announced; first difference at "
                                 f"{next((a for a, b in zip(got, expected) if a != b), '(the end)')}")

    def lookup(self, names):
        want = set(names)
        for name, t in self.make_iter():
            for n, v in _expand(name, t):
                if n in want:
                    yield n, v


def as_source(named) -> TrainerSource:
    """What ``update_weights`` was given, as a source: a source as is; a callable as a
    :class:`StreamSource`; a state dict holding DTensors as a :class:`ShardedSource` (single
    driver: the other ranks must follow, see the class); anything else as a :class:`DictSource`."""
    if isinstance(named, TrainerSource):
        return named
    if callable(named):
        return StreamSource(named)
    if isinstance(named, Mapping) and any(_is_dtensor(t) for t in named.values()):
        return ShardedSource(named)
    return DictSource(named)
