"""Watching an engine's own loaders write a weight update: every ``copy_`` into the model.

While a :class:`WriteRecorder` is active (a ``TorchDispatchMode``), each ``aten.copy_`` whose
destination lives in a registered parameter is

* attributed: to the learner tensor (name, role) its source came from -- the incoming
  tensor itself, or a tensor our loaders derived from it (fp8 data and scales quantized
  from a BF16 weight) -- and to a destination box in the parameter;
* checked: dtype before it happens (no silent casts into a parameter); its content -- no NaN
  where the format forbids it (fp8 codes 0x7F/0xFF, E8M0 scale 255), no NaN / Inf in a float
  tensor -- queued on the tensor's device and read once when the recorder exits (one host sync
  per bucket, not one per tensor), so a bad tensor fails the bucket, named, before it returns, and
  the update is undone whole as for any failure mid-load.  A write whose source was checked
  already (:func:`check_contents` over a whole bucket before its load, ``add_source(checked=True)``;
  or bytes our loaders derived from such a source) is not checked again;
* backed up (optional): the parameter's previous bytes are copied the first time it is
  touched -- to host memory (``backup="host"``, the default) or to a spare buffer on the
  parameter's own device (``backup="device"``: an on-device copy, no PCIe round trip, at
  the cost of GPU memory for the touched parameters) -- so that a failed update can be
  undone, whole.

This is engine-agnostic: it sees tensors, not vLLM or SGLang classes.
"""

from __future__ import annotations

import bisect
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import format as F
from ..packed_codes import copy_held
from .regions import Box, view_box


def backup_mode(b) -> str:
    """Normalize a backup option: "host" (True), "device", or "" (False / "off")."""
    if b is True or b == "host":
        return "host"
    if b == "device":
        return "device"
    if b in (False, None, "off", "", "0", 0):
        return ""
    raise ValueError(f"backup must be 'host', 'device' or 'off'; got {b!r}")


class UpdateRejected(ValueError):
    """An update that failed validation; the message names the tensor.  ``problems``: the same
    problems as data, under the sync condition each would break ({condition: [problem, ...]}),
    so that a rejection crosses processes without its words being parsed."""

    def __init__(self, message: str, problems: dict | None = None):
        super().__init__(message)
        self.problems = dict(problems or {})

    def __reduce__(self):                   # across processes with its problems
        return (type(self), (str(self), self.problems))


_ACTIVE: list = []
#: the source name of a write the recorder could not attribute to any learner tensor
UNATTRIBUTED = "<unattributed>"


def note_derived_source(derived: torch.Tensor, origin: torch.Tensor, role: str) -> None:
    """Loaders call this when they turn a received tensor into the bytes they write (e.g. the
    fp8 data / scales quantized from a BF16 weight): writes of ``derived`` are attributed to
    ``origin``'s learner name.  A no-op when no update is being recorded.

    ``derived`` inherits ``origin``'s checked mark: the grid quantizer maps finite values to E4M3
    codes other than NaN and to scale bytes below 255 (``format.e8m0_round_up``, ``encode_e4m3``;
    tests/test_sync_core.py checks it at the extremes), so bytes quantized from a checked finite
    tensor hold no NaN."""
    for rec in _ACTIVE:
        src = rec.source_of(origin)
        if src is not None:
            rec.add_source(derived, src.name, role, checked=src.checked)


def active() -> Optional["WriteRecorder"]:
    """The recorder of the update being written, when exactly one is active (None: none, or nested ones)."""
    return _ACTIVE[0] if len(_ACTIVE) == 1 else None


@contextlib.contextmanager
def unrecorded():
    """Run ops that write no parameter -- quantizing a received tensor, making the views a write plan copies
    between -- without passing each through the active recorders' Python dispatch (tens of microseconds per
    aten op, most of an update's time on the H200).  Only for our own code that provably writes no
    parameter: a ``copy_`` into the model under it would go unseen."""
    if not _ACTIVE or not _mode_on():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        yield


def _mode_on() -> bool:
    """Is any Python dispatch mode on the stack (so that ops would pass through it)?"""
    from torch._C import _len_torch_dispatch_stack
    return _len_torch_dispatch_stack() > 0


def note_shard_write(layer, param: str, key, loaded: torch.Tensor) -> None:
    """Loaders call this when they count a write of shard ``key`` of ``layer.<param>`` (``common.loading``'s
    write accounting) made from ``loaded``: the recorder keeps it under ``loaded``'s learner name, so that a
    :class:`~.plan.WritePlan` can repeat the count when it replays the writes.  A no-op when no update is
    being recorded."""
    for rec in _ACTIVE:
        src = rec.source_of(loaded)
        if src is not None:
            rec.shards.append((src.name, layer, param, key))


def content_checked(t: torch.Tensor) -> bool:
    """Did ``t``'s content already pass the rules of an update being recorded (its bucket went through
    :func:`check_contents`)?  Loaders then skip their own value checks, which read the device (one host
    synchronization per tensor).  False when no update is being recorded."""
    for rec in _ACTIVE:
        src = rec.source_of(t)
        if src is not None and src.checked:
            return True
    return False


#: the content rules, each with the words of its refusal ({} is the learner tensor's name)
CONTENT_RULES = {"fp8": "{}: fp8 weight holds NaN codes, which the wire format forbids",
                 "scale": "{}: E8M0 scale 255 (NaN) is not a valid learner scale",
                 "float": "{}: holds NaN or Inf"}
#: bytes per concatenated piece of :func:`check_contents` (its transient memory)
CHECK_CHUNK_BYTES = 64 << 20


def content_rule(t: torch.Tensor, role: str) -> Optional[str]:
    """Which content rule a tensor written in ``role`` must pass (None: no rule for its dtype)."""
    if t.dtype == F.FP8_DTYPE:
        return "fp8"
    if t.dtype == F.SCALE_DTYPE and role == "scale":
        return "scale"
    if t.is_floating_point():
        return "float"
    return None


def _breaks(rule: str, flat: torch.Tensor) -> torch.Tensor:
    """0-dim bool, not read (no sync): does ``flat`` (1-D; fp8 read as uint8) break ``rule``?"""
    if rule == "fp8":
        return _nan_codes(flat)
    if rule == "scale":
        return (flat == F.E8M0_NAN).any()
    return ~torch.isfinite(flat).all()


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype == F.FP8_DTYPE else flat


def check_contents(named: list) -> None:
    """The content rules over a whole bucket of ``(name, tensor, role)`` at once, before any write: per
    rule, device and dtype the tensors are concatenated into pieces of at most ``CHECK_CHUNK_BYTES`` and
    tested in a few launches (not a few per tensor), all read in one synchronization.  Raises
    :class:`UpdateRejected` naming the first tensor, in bucket order, that breaks a rule."""
    groups: dict = {}
    for i, (_, t, role) in enumerate(named):
        rule = content_rule(t, role)
        if rule is not None and t.numel():
            groups.setdefault((rule, t.device, t.dtype), []).append(i)
    flags, owners = [], []
    for (rule, _, _), idx in groups.items():
        piece, size = [], 0
        for i in idx + [None]:
            nbytes = 0 if i is None else named[i][1].numel() * named[i][1].element_size()
            if piece and (i is None or size + nbytes > CHECK_CHUNK_BYTES):
                flats = [_flat(named[j][1]) for j in piece]
                flags.append(_breaks(rule, flats[0] if len(flats) == 1 else torch.cat(flats)))
                owners.append((rule, piece))
                piece, size = [], 0
            if i is not None:
                piece.append(i)
                size += nbytes
    from .digest import read_flags
    suspects = sorted((i, rule) for (rule, piece), bad in zip(owners, read_flags(flags)) if bad for i in piece)
    if not suspects:
        return
    for (i, rule), bad in zip(suspects, read_flags([_breaks(rule, _flat(named[i][1])) for i, rule in suspects])):
        if bad:
            raise UpdateRejected(CONTENT_RULES[rule].format(named[i][0]))

def _no_cast(source: str, pname: str, dest: torch.Tensor, src: torch.Tensor) -> None:
    """The dtype rule of every write into a parameter: no silent cast."""
    if dest.dtype != src.dtype:
        raise UpdateRejected(f"{source}: dtype {src.dtype} would be cast into {pname} ({dest.dtype}); "
                             "send the parameter's dtype")


@dataclass
class Write:
    source: str               # learner tensor name (HF name)
    role: str                 # "data" | "scale" | "plain"
    src_box: Optional[Box]    # in the learner tensor (None: not a box, e.g. a scalar broadcast)
    param: str                # engine parameter name
    dest_box: Optional[Box]   # in the engine parameter
    src_shape: Optional[tuple] = None   # the shape of the source tensor src_box is in (the learner's, or
                                        # the grid bytes a loader quantized it into)


@dataclass
class _Source:
    name: str
    role: str
    base_shape: tuple
    base_offset: int          # storage offset, in elements of the source's dtype (for its boxes)
    lo: int = 0               # [lo, hi): the storage bytes the source covers (sources of one storage
    hi: int = 0               #   may differ in dtype: a packed bucket holds fp8, scales and bf16)
    ref: Optional[Callable] = None   # weak reference to the tensor: a freed tensor's memory gets reused
    checked: bool = False     # its content passed the rules already (check_contents): not re-checked per write


@dataclass
class _StorageSources:
    """The sources registered in one storage, by byte range, with the ranges sorted for lookup."""
    by_range: dict = field(default_factory=dict)    # (lo, hi) -> _Source (a range registered again replaces)
    order: Optional[list] = None                    # sorted live (lo, hi); None: rebuild on the next lookup

    def sorted_ranges(self) -> list:
        if self.order is None:
            self.by_range = {r: s for r, s in self.by_range.items() if s.ref() is not None}
            self.order = sorted(self.by_range)
        return self.order


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) storage *bytes* a (strided) tensor touches."""
    es = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * es, t.storage_offset() * es
    if t.is_contiguous():
        return t.storage_offset() * es, (t.storage_offset() + t.numel()) * es
    hi = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    return t.storage_offset() * es, (hi + 1) * es


def _nan_codes(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: does the fp8 tensor hold an E4M3 NaN code (0x7F / 0xFF)?  Not read here (no sync)."""
    b = t.view(torch.uint8)
    return ((b & F.E4M3_NAN_BYTE) == F.E4M3_NAN_BYTE).any()      # the NaN code is every non-sign bit set


@dataclass
class WriteRecorder(TorchDispatchMode):  # noqa: D101
    params: dict                                  # name -> tensor (parameters the update may write)
    backup: bool | str = True                     # True/"host", "device", or False/"off"
    writes: list = field(default_factory=list)
    backups: dict = field(default_factory=dict)   # param name -> host copy of its previous bytes
    _by_storage: dict = field(default_factory=dict)
    _sources: dict = field(default_factory=dict)
    _by_id: dict = field(default_factory=dict)    # id(tensor) -> its _Source, while it is the registered one
    _pending: list = field(default_factory=list)  # (message, 0-dim bool flag) content checks not yet read
    shards: list = field(default_factory=list)    # (learner name, layer, param, shard key): counted writes

    def __post_init__(self):
        super().__init__()
        self.backup = backup_mode(self.backup)
        for name, p in self.params.items():
            self._by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))

    # -- sources ---------------------------------------------------------------------
    def add_source(self, t: torch.Tensor, name: str, role: str, checked: bool = False) -> None:
        """Register a tensor whose copies into the model belong to learner tensor ``name``.

        Sources are keyed by storage *and* byte range: several learner tensors can be views
        of one storage (transformers' fused experts exported per expert, CUDA IPC handles of
        slices of one buffer, a packed CUDA IPC bucket), and each keeps its own name.
        ``checked``: its content already passed :func:`check_contents` (writes of it skip the rules)."""
        lo, hi = _extent(t)
        st = self._sources.setdefault(t.untyped_storage().data_ptr(), _StorageSources())
        old = st.by_range.get((lo, hi))
        if old is not None and old.ref() is not None:
            self._by_id.pop(id(old.ref()), None)      # replaced: its tensor is no longer this range's source
        src = st.by_range[(lo, hi)] = _Source(name, role, tuple(t.shape), t.storage_offset(), lo, hi,
                                              weakref.ref(t), checked)
        self._by_id[id(t)] = src
        st.order = None

    def source_of(self, t: torch.Tensor) -> Optional[_Source]:
        """The registered source whose byte range contains ``t``'s (the innermost, if nested).

        A bisection over the storage's sorted ranges, then a walk down from the last range that starts
        at or before ``t``: the first live range that contains ``t`` is the innermost of the nested
        ranges containing it (views nest), among equal starts the shortest.  A packed bucket holds a
        hundred sources in one storage; a scan of all of them per write cost ~4x the lookup.

        A registered tensor itself (a bucket's tensor, as a write plan's replay and the loaders' shard
        accounting pass it) is found by identity first: a range that contains its own is at least as long,
        and one of the same bytes replaces the older registration (identity included)."""
        hit = self._by_id.get(id(t))
        if hit is not None and hit.ref() is t:
            return hit
        try:
            st = self._sources.get(t.untyped_storage().data_ptr())
        except Exception:
            return None
        if not st:
            return None
        order = st.sorted_ranges()
        lo, hi = _extent(t)
        best = None
        for j in range(bisect.bisect_right(order, (lo, float("inf"))) - 1, -1, -1):
            rlo, rhi = order[j]
            if best is not None and rlo != best.lo:
                break
            src = st.by_range[(rlo, rhi)]
            if src.ref() is not None and hi <= max(rhi, rlo + 1):
                best = src
        return best

    # -- dispatch ------------------------------------------------------------------
    def _param_of(self, t: torch.Tensor):
        try:
            cands = self._by_storage.get(t.untyped_storage().data_ptr())
        except Exception:
            return None
        return cands[0] if cands else None

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        out = super().__exit__(*exc)
        pending, self._pending = self._pending, []
        if exc[0] is None:            # nothing failed yet: read the bucket's content checks, once
            self._resolve(pending)
        return out

    @staticmethod
    def _resolve(pending: list) -> None:
        """Raise :class:`UpdateRejected` for the first failed content check, in write order."""
        if not pending:
            return
        from .digest import read_flags
        for (message, _), bad in zip(pending, read_flags([f for _, f in pending])):
            if bad:
                raise UpdateRejected(message)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dest, src = args[0], args[1]
            hit = self._param_of(dest)
            if hit is not None:
                self._on_write(hit[0], hit[1], dest, src)
        return func(*args, **kwargs)

    def _on_write(self, pname, param, dest, src):
        s = self.source_of(src) if isinstance(src, torch.Tensor) else None
        sname = s.name if s else UNATTRIBUTED
        if isinstance(src, torch.Tensor):
            _no_cast(sname, pname, dest, src)
            rule = None if (s is not None and s.checked) else content_rule(src, s.role if s else "plain")
            if rule is not None and src.numel():
                self._pending.append((CONTENT_RULES[rule].format(sname), _breaks(rule, _flat(src))))
        self._back_up(pname, param)
        dbox = view_box(dest, param.shape, param.storage_offset())
        sbox = view_box(src, s.base_shape, s.base_offset) if (s is not None and isinstance(src, torch.Tensor)) \
            else None
        self.writes.append(Write(sname, s.role if s else "plain", sbox, pname, dbox, s.base_shape if s else None))

    def _back_up(self, pname: str, param: torch.Tensor) -> None:
        """The parameter's previous bytes, the first time an update touches it."""
        if self.backup and pname not in self.backups:
            self.backups[pname] = copy_held(param, "cpu" if self.backup == "host" else param.device)

    def record(self, write: Write, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Account for a copy of ``src`` into ``dest`` (a view of parameter ``write.param``) that the caller
        is about to make outside the dispatch mode -- a write plan's replay, which knows each write's
        attribution and boxes already, so that its copies need not pass the mode one by one.  Does what a
        seen copy gets: the dtype rule (raises before anything is written), the backup, the write record.
        The content rules are not run: the caller only replays sources that passed them
        (:meth:`checked_source`)."""
        _no_cast(write.source, write.param, dest, src)
        if self.backup and write.param not in self.backups:
            with unrecorded():              # the backup's own copy writes no parameter (a no-op when the
                self._back_up(write.param, self.params[write.param])     # caller left the mode already)
        self.writes.append(write)

    def checked_source(self, t: torch.Tensor, name: str) -> bool:
        """Is ``t`` registered as learner tensor ``name`` with its content already checked?"""
        s = self.source_of(t)
        return s is not None and s.name == name and s.checked

    # -- undo ------------------------------------------------------------------------
    @torch.no_grad()
    def rollback(self) -> list[str]:
        """Put every touched parameter's previous bytes back (in its original storage)."""
        restored = []
        for name, old in self.backups.items():
            self.params[name].copy_(old.to(self.params[name].device))
            restored.append(name)
        return restored
