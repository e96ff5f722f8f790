"""A rank's write plan: what the engine's own loaders did with each learner tensor, replayed.

An engine's ``load_weights`` walks its module tree for every tensor of every update -- name mapping,
q/k/v and gate/up offsets, TP narrowing, expert ids -- and does the same thing each time the same
tensor (name, shape, dtype) arrives.  (On the H200 the walk itself turned out to be a small part of an
update's time: replay saved 25 ms of the mxfp8 loaders' 0.18 s, BENCHMARKS.md, twelfth session.)  So
after an update that passed every check and was committed, the rank keeps, per learner tensor:

* its writes as the recorder saw them: (role, box in the source, parameter, box in the parameter),
  the source being the tensor itself or the grid bytes our loaders quantized it into (``quantized``:
  ``quantize_rows`` of the whole tensor -- the only derivation a plan repeats);
* the shard writes the loaders counted (``common.loading.count_write``) with their layers.

A later update's tensor of the same name, shape and dtype is then written by replaying those copies
(one per box, still accounted for by the session's recorder: attributed, dtype-checked, backed up --
the plan hands the recorder each write it knows, then copies a bucket in one ``torch._foreach_copy_``
per device pair and dtype, outside the recorder's Python dispatch mode) and counting the same shards,
marking the same layers for their derived-tensor refresh -- without the module tree.  Everything the
session checks stays checked against the layout it computes on its own
(completeness, layout, byte identity, derived state, storage): a replay that wrote anything else
would fail them like a loader bug.  The plan is dropped whenever it may no longer describe the engine:

* a parameter it writes was rebound or moved (``storage_stability``'s condition);
* an update that used it failed or was rolled back;
* a tensor it cannot describe exactly (an unattributed write, a box that is not a box, bytes derived
  in some other way) is left out, so the engine's loader handles that tensor, every time.

Engine-agnostic: an adapter holds one (``plan``) and calls :meth:`WritePlan.load` from its ``load``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import format as F
from ..loading import HIGH_PRECISION, _expert_of, count_write
from ..refresh import mark_written
from .recorder import UNATTRIBUTED, Write, active, note_derived_source, unrecorded
from .regions import slice_box


#: source bytes per stacked quantizer call of :func:`quantize_grouped` (its transient memory: the stack)
QUANTIZE_STACK_BYTES = 256 << 20
#: on CPU only tensors up to this size are stacked: the torch quantizer there is bound by its bytes, and a stack
#: of larger ones ran slower than one call each (``benchmarks/bench_replay_quantize.py`` on this repo's 2-core
#: CPU: 4.9x faster for 1,536 [64, 64], 1.06x for [128, 256], 0.44x for [768, 2048])
CPU_STACK_MAX_BYTES = 32 << 10


def quantize_grouped(tensors: list) -> dict:
    """{id(t): quantize_rows(t)} for high-precision tensors a replay quantizes, with the tensors of one shape,
    dtype and device stacked into one call (in stacks of at most :data:`QUANTIZE_STACK_BYTES`): a MoE layer's
    experts are hundreds of equal [I, H] tensors, and each call costs host time beyond its bytes (~0.3 ms for a
    small one on this repo's CPU; a Triton launch and its Python on a GPU).  On CPU only small tensors are
    stacked (:data:`CPU_STACK_MAX_BYTES`).  The bytes are the per-tensor calls': each 1x32 block's scale and
    codes depend only on its own 32 values, and stacking adds only leading rows."""
    from .. import quantize_rows
    groups: dict = {}
    out = {}
    for t in tensors:
        if t.device.type == "cpu" and t.numel() * t.element_size() > CPU_STACK_MAX_BYTES:
            out[id(t)] = quantize_rows(t)
        else:
            groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
    for group in groups.values():
        per = max(1, QUANTIZE_STACK_BYTES // max(1, group[0].numel() * group[0].element_size()))
        for i in range(0, len(group), per):
            chunk = group[i:i + per]
            if len(chunk) == 1:
                out[id(chunk[0])] = quantize_rows(chunk[0])
                continue
            q, s = quantize_rows(torch.stack(chunk))
            for j, t in enumerate(chunk):
                out[id(t)] = (q[j], s[j])
    return out


def _view_geometry(param: torch.Tensor, box) -> Optional[tuple]:
    """(size, stride, storage offset) of ``slice_box(param, box)``, or None for a parameter that makes its own
    views (``PackedCodes``)."""
    if getattr(param, "slice_box", None) is not None:
        return None
    v = slice_box(param, box)
    return tuple(v.shape), v.stride(), v.storage_offset()


def _dest_view(param: torch.Tensor, box, geo: Optional[tuple]) -> torch.Tensor:
    """The replay's destination: ``slice_box(param, box)``, from its geometry kept at capture (the plan's
    ``valid`` checks that the parameter's storage, shape and strides did not move since)."""
    return slice_box(param, box) if geo is None else param.as_strided(*geo)


@dataclass
class _Entry:
    shape: tuple
    dtype: torch.dtype
    quantized: bool                 # writes come from quantize_rows(tensor): role "data" -> codes, "scale" -> scales
    writes: list                    # the recorder's Write per write, as a replay records it (immutable: one
                                    # object serves every replay)
    shards: list                    # (weak ref to the layer, param, shard key), in the order the loaders counted them
    views: list                     # per write, the destination view's (size, stride, storage offset) in its plain
                                    # parameter, or None (a PackedCodes parameter makes its own view)


@dataclass
class WritePlan:
    """Holds only weak references to the engine's modules and parameters: an engine that rebuilds a layer
    (vLLM's layerwise reload) frees the old one, and the plan then no longer describes it (:meth:`valid`)."""
    entries: dict = field(default_factory=dict)      # learner name -> _Entry
    params: dict = field(default_factory=dict)       # parameter name -> (weak ref to the module, attribute,
                                                     #                    weak ref to the tensor, data_ptr)
    replayed: int = 0                                # tensors the last load calls replayed (for reports and tests)
    replayed_names: set = field(default_factory=set)  # the learner tensors replayed since the session began
                                                      # (``begin``): their entries are what the update did

    # -- building ----------------------------------------------------------------------------
    def capture(self, model: torch.nn.Module, specs: dict, writes: list, shards: list) -> int:
        """Keep what a committed, fully checked update did: ``specs`` {learner name: (shape, dtype)} of the
        tensors it sent, ``writes`` (the recorder's), ``shards`` (the recorder's counted shard writes).
        Adds to the plan (a partial update keeps the entries of the others); returns the entries kept."""
        if any(w.source == UNATTRIBUTED for w in writes):
            self.clear()                      # some write was not the learner's: describe nothing of it
            return 0
        if self.entries and not self.valid():
            self.clear()
        # a tensor this update replayed was written exactly as its entry says (the replay made its writes and
        # counted its shards from the entry): the entry stays, without regrouping its writes
        same = {n for n in self.replayed_names if n in self.entries and n in specs
                and (self.entries[n].shape, self.entries[n].dtype) == (tuple(specs[n][0]), specs[n][1])}
        self.replayed_names = set()
        by_source: dict = {}
        for w in writes:
            if w.source not in same:
                by_source.setdefault(w.source, []).append(w)
        by_shard: dict = {}
        for name, layer, param, key in shards:
            if name not in same:
                by_shard.setdefault(name, []).append((weakref.ref(layer), param, key))
        live = dict(model.named_parameters())
        kept = len(same)
        for name, (shape, dtype) in specs.items():
            if name in same:
                continue
            entry = self._entry(name, tuple(shape), dtype, by_source.get(name, []), by_shard.get(name, []), live)
            if entry is None:
                self.entries.pop(name, None)
                continue
            self.entries[name] = entry
            kept += 1
        for pname in {w.param for e in self.entries.values() for w in e.writes} - set(self.params):
            mod_name, _, attr = pname.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            t = live[pname]
            self.params[pname] = (weakref.ref(mod), attr, weakref.ref(t), t.data_ptr(), tuple(t.shape), t.stride())
        return kept

    @staticmethod
    def _entry(name, shape, dtype, writes, shards, live) -> Optional[_Entry]:
        if not writes or any(w.src_box is None or w.dest_box is None or w.param not in live for w in writes):
            return None
        roles = {w.role for w in writes}
        quantized = dtype in HIGH_PRECISION and roles <= {"data", "scale"}
        if quantized:
            want = {"data": shape, "scale": (*shape[:-1], shape[-1] // F.BLOCK_SIZE)}
            if len(shape) < 1 or shape[-1] % F.BLOCK_SIZE or any(tuple(w.src_shape or ()) != want[w.role]
                                                                for w in writes):
                return None                   # bytes derived otherwise (a slice quantized on its own): the loader's
        elif len(roles) != 1 or any(tuple(w.src_shape or ()) != shape for w in writes):
            return None
        records = [Write(name, w.role, w.src_box, w.param, w.dest_box,
                         tuple(w.src_shape) if w.src_shape is not None else None) for w in writes]
        return _Entry(shape, dtype, quantized, records, list(shards),
                      [_view_geometry(live[w.param], w.dest_box) for w in records])

    def begin(self) -> None:
        """An update session starts: nothing replayed in it yet."""
        self.replayed_names = set()

    def clear(self) -> None:
        self.entries.clear()
        self.params.clear()
        self.replayed_names = set()

    def valid(self) -> bool:
        """Every parameter the plan writes is still its module's, in the same storage, and every layer whose
        shards it counts is alive."""
        for mod_ref, attr, t_ref, ptr, shape, stride in self.params.values():
            mod, t = mod_ref(), t_ref()
            if (mod is None or t is None or getattr(mod, attr, None) is not t or t.data_ptr() != ptr
                    or t.shape != shape or t.stride() != stride):
                return False
        return all(ref() is not None for e in self.entries.values() for ref, _, _ in e.shards)

    # -- replaying --------------------------------------------------------------------------------
    def load(self, named: list, engine_load: Callable[[list], None]) -> None:
        """Write ``named`` [(learner name, tensor)]: tensors the plan describes (same name, shape, dtype) by
        replay, the rest through ``engine_load`` (the engine's own loader), in one call.

        Inside an update whose recorder holds the tensor as a checked source (the session's buckets: their
        content rules ran before the load), a replay's writes are accounted for with the recorder directly --
        the plan knows each write's attribution and boxes -- and copied outside its dispatch mode, a bucket's
        copies in one ``torch._foreach_copy_`` per device pair and dtype (:meth:`_copy`).  Otherwise each copy
        passes the recorder's mode as a loader's would.  Tensors the plan quantizes are quantized by shape, in
        stacked calls (:func:`quantize_grouped`)."""
        named = list(named)
        self.replayed = 0
        if self.entries and not self.valid():
            self.clear()
        rec = active()
        rest, batch, seen, done, planned = [], [], [], [], []
        for name, t in named:
            e = self.entries.get(name)
            if e is None or tuple(t.shape) != e.shape or t.dtype != e.dtype:
                rest.append((name, t))
            else:
                planned.append((name, t, e))
        with unrecorded():                 # the quantizer, the views and the accounting write no parameter
            grid = quantize_grouped([t for _, t, e in planned if e.quantized])
            for name, t, e in planned:
                if e.quantized:
                    q, s = grid[id(t)]
                    src = {"data": q, "scale": s}
                else:
                    src = {e.writes[0].role: t}
                pairs = [(_dest_view(self.params[w.param][2](), w.dest_box, geo), slice_box(src[w.role], w.src_box))
                         for w, geo in zip(e.writes, e.views)]
                if rec is not None and rec.checked_source(t, name) and all(w.param in rec.params for w in e.writes):
                    for write, (dest, part) in zip(e.writes, pairs):
                        rec.record(write, dest, part)
                    batch += pairs
                else:
                    seen.append((t, e, src, pairs))
                done.append((name, t, e))
        self._copy(batch)
        for t, e, src, pairs in seen:              # each copy through the recorder's mode, as a loader's
            if e.quantized:
                note_derived_source(src["data"], t, "data")
                note_derived_source(src["scale"], t, "scale")
            with torch.no_grad():
                for dest, part in pairs:
                    dest.copy_(part)
        for name, t, e in done:                    # after the bytes landed: a refresh outside a deferred scope
            self._count(t, e)                      # rebuilds from them
            self.replayed_names.add(name)
        if rest:
            engine_load(rest)

    @staticmethod
    def _copy(pairs: list) -> None:
        """The recorded replay's copies, grouped by (destination device, source device, dtype): one
        ``torch._foreach_copy_`` per group, outside the recorder's mode (every write is accounted for already)."""
        groups: dict = {}
        for dest, part in pairs:
            dests, parts = groups.setdefault((dest.device, part.device, dest.dtype), ([], []))
            dests.append(dest)
            parts.append(part)
        with unrecorded(), torch.no_grad():
            for dests, parts in groups.values():
                torch._foreach_copy_(dests, parts)

    def _count(self, t: torch.Tensor, e: _Entry) -> None:
        """The replayed tensor's shard writes counted and its layers marked for their derived-tensor refresh,
        as the loaders did."""
        layers = [(ref(), param, key) for ref, param, key in e.shards]
        for layer, param, key in layers:
            count_write(layer, param, key, t)
        for layer, expert in {(id(layer), _expert_of(key)): (layer, _expert_of(key))
                              for layer, _, key in layers}.values():
            mark_written(layer, expert)
        self.replayed += 1
