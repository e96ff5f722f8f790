"""An in-place weight update on one engine rank, with the seven sync checks.

Engine-agnostic; an engine plugs in through :class:`EngineAdapter` (its own loader, its
on-grid layers, the layout it expects, its KV-scale and derived state).  Lifecycle, driven
by the trainer's client through the engine's RPC::

    begin(manifest)     validate names / shapes / dtypes / completeness before any write;
                        snapshot data pointers; reset write accounting
    load(bucket) ...    the engine's own loaders write, watched by a WriteRecorder
                        (attribution, dtype / NaN checks, host backup of old bytes)
    finish()            rebuild derived state, apply KV scales, run the local checks;
                        return fingerprints of what landed where (byte identity is decided
                        by the client, against the learner's own bytes)
    commit(accept)      accept: bump the version, drop backups; reject: roll back, whole

Any exception or failed check before commit rolls the parameters back (``backup=True``); with
``backup=False`` a failed update leaves the rank marked *torn* and the client keeps
generation paused (fail closed).
"""

from __future__ import annotations

import random
import time
from typing import Iterable

import torch

from ..refresh import deferred_refresh
from .derived import DerivedRegistry
from .digest import fingerprint
from .manifest import Manifest, flatten, validate_by_condition
from .recorder import UpdateRejected, Write, WriteRecorder
from .regions import coverage_problems, slice_box
from .report import CheckResult, SyncReport


class EngineAdapter:
    """What a session needs from an engine rank.  Subclassed in each plugin."""

    rank: int = 0
    version: int = 0

    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Feed HF-named tensors to the engine's own loader."""
        raise NotImplementedError

    def signature(self) -> tuple[dict, dict, set]:
        """(checkpoint signature, plain dtypes, extra accepted names) -- see manifest.validate."""
        raise NotImplementedError

    def begin(self) -> None:
        """Reset write accounting etc. before the first write."""

    def after_load(self) -> None:
        """Post-process after the new bytes landed through the engine's loaders (which already
        rebuilt the on-grid layers' derived tensors, ``common.refresh``)."""

    def after_restore(self, names: list[str]) -> None:
        """Derived state after a rollback put the previous bytes of ``names`` back -- without the
        loaders, so every derived tensor must be rebuilt.  Default: :meth:`after_load`."""
        self.after_load()

    def grid_accounting(self) -> list[str]:
        """Problems of the per-shard write accounting (each shard written exactly once)."""
        return []

    def expected_boxes(self, w: Write):
        """(src_box, dest_box) the engine's layout implies for this write, or None if it has no opinion."""
        return None

    def scope(self, touched: set[str]) -> dict[str, torch.Tensor]:
        """Parameters an update must cover exactly once."""
        return {}

    def derived(self) -> DerivedRegistry:
        return DerivedRegistry()

    def set_kv_scales(self, scales: dict) -> list[str]:
        """Apply {layer index: (k_scale, v_scale)}; return problems."""
        return [] if not scales else ["this engine has no KV-scale support"]

    def kv_scale_values(self) -> dict:
        return {}

    def kv_scales_used(self) -> bool:
        """Whether the engine's KV cache reads scales (False: a BF16 cache, the trainer's scales are moot)."""
        return True


def _now() -> float:
    return time.perf_counter()


class UpdateSession:
    def __init__(self, adapter: EngineAdapter, manifest: Manifest, backup: bool | str = True, digest: str = "sampled",
                 fraction: float = 0.05, seed: int = 0, verify: bool = False):
        t0 = _now()
        self.verify = bool(verify)
        if self.verify and not backup:
            backup = "host"                 # verification compares with, and restores, the bytes found
        if digest not in ("off", "sampled", "full"):
            raise ValueError(f"digest must be 'off', 'sampled' or 'full'; got {digest!r}")
        self.adapter, self.manifest = adapter, manifest
        self.backup, self.digest, self.fraction, self.seed = backup, digest, fraction, seed
        sig, plain_dtypes, extra = adapter.signature()
        by_condition = validate_by_condition(manifest, sig, plain_dtypes, extra)
        served = int(getattr(adapter, "version", 0) or 0)
        if manifest.version < served:       # a replayed or stale update (an older trainer's push)
            by_condition.setdefault("atomic_versioning", []).append(
                f"version {manifest.version} is older than the version this rank serves ({served}): a replayed or "
                "stale update; versions only move forward")
        if by_condition:
            problems = flatten(by_condition)
            raise UpdateRejected("update rejected before any write: " + "; ".join(problems[:12])
                                 + (f" (+{len(problems) - 12} more)" if len(problems) > 12 else ""), by_condition)
        model = adapter.model()
        self.params = dict(model.named_parameters())
        self.ptrs = {n: p.data_ptr() for n, p in self.params.items()}
        self.objs = {n: p for n, p in self.params.items()}
        self.derived_ptrs = {f"{d.owner}.{d.name}": d.tensor.data_ptr() for d in adapter.derived()}
        self.specs = {t.name: t for t in manifest.tensors}
        self.expected = set(self.specs)
        self.received: set[str] = set()
        self.silent: list[str] = []        # tensors the engine's loader wrote nowhere
        self.recorder = WriteRecorder(self.params, backup=backup)
        self.backup = self.recorder.backup
        self.torn = False
        self.dead = False
        self.rollback_problems: list[str] = []
        self.finished = False
        # the KV scales an update will overwrite, so that a rollback restores them too
        self.kv_before = {str(i): list(v) for i, v in adapter.kv_scale_values().items()} if manifest.kv_scales \
            else {}
        # verification of weights written by someone else (a trainer's native load_weights): the
        # derived tensors as found, before the replay rewrites them
        self.stale_before = adapter.derived().stale() if self.verify else []
        adapter.begin()
        self.timings = {"begin_s": _now() - t0, "load_s": 0.0}

    # -- loading ---------------------------------------------------------------------
    def load(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.dead:
            raise UpdateRejected("this update already failed and was undone; begin a new one")
        t0 = _now()
        items = list(bucket)
        try:
            for name, t in items:
                if name not in self.expected:
                    raise UpdateRejected(f"{name}: not in the manifest of this update")
                if name in self.received:
                    raise UpdateRejected(f"{name}: sent twice")
                spec = self.specs[name]
                if list(t.shape) != list(spec.shape) or str(t.dtype) != spec.dtype:
                    raise UpdateRejected(f"{name}: the manifest announced {list(spec.shape)} {spec.dtype}; the bucket "
                                         f"holds {list(t.shape)} {t.dtype} (file swapped or truncated?)")
                role = "scale" if name.endswith("_scale_inv") else ("data" if t.dtype == torch.float8_e4m3fn
                                                                     else "plain")
                self.recorder.add_source(t, name, role)
            n_before = len(self.recorder.writes)
            with deferred_refresh():           # each written layer's derived tensors rebuilt once, after the bucket
                with self.recorder:
                    self.adapter.load(items)
            written = {w.source for w in self.recorder.writes[n_before:]}
            self.silent += [n for n, _ in items if n not in written]
            self.received.update(n for n, _ in items)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.timings["load_s"] += _now() - t0

    def _fail(self, exc: BaseException) -> None:
        self.dead = True
        if self.backup:
            self._rollback()
        else:
            self.torn = True

    def _rollback(self) -> list[str]:
        """Previous bytes back into the original storage, derived state rebuilt from them, original
        parameter objects back in their modules; then verify the bytes are the old ones."""
        restored = self.recorder.rollback()
        if self.kv_before:
            self.adapter.set_kv_scales(self.kv_before)
        self._restore_objects()
        try:
            self.adapter.after_restore(restored)
        finally:
            self._restore_objects()       # in case the post-processing step is what rebinds
        bad = [n for n in restored if fingerprint(self.objs[n]) != fingerprint(self.recorder.backups[n])]
        self.rollback_problems = bad
        return restored

    # -- finish: local checks ------------------------------------------------------------
    def finish(self) -> SyncReport:
        t0 = _now()
        report = SyncReport(version=self.manifest.version, applied=False)
        missing = self.expected - self.received
        try:
            if missing:
                raise UpdateRejected(f"truncated update: {len(missing)} tensors never arrived, e.g. "
                                     f"{sorted(missing)[:4]}")
            self.adapter.after_load()
            kv_problems = self.adapter.set_kv_scales(self.manifest.kv_scales or {})
        except BaseException as exc:
            self._fail(exc)
            report.error = f"{type(exc).__name__}: {exc}"
            report.rolled_back = self.backup
            report.checks.append(self._rollback_check())
            self.finished = True
            return report
        report.checks += [self._completeness(), self._layout(), self._derived(), self._storage(),
                          self._cache_kv(kv_problems)]
        if self.verify:
            report.checks.append(self._engine_as_found())
        report.extra["regions"] = self._regions()
        report.extra["rank"] = self.adapter.rank
        report.timings = dict(self.timings, finish_s=_now() - t0)
        if report.failed():
            if self.backup:
                self._rollback()
                report.rolled_back = True
                report.checks.append(self._rollback_check())
            else:
                self.torn = True
        self.finished = True
        self.local_ok = not report.failed()
        return report

    @property
    def closed(self) -> bool:
        """Committed or aborted: nothing of this update can change the weights any more."""
        return getattr(self, "committed", False) or getattr(self, "aborted", False)

    def commit(self, accept: bool) -> bool:
        """Accept (bump the version) or reject (roll back).  Returns whether the update serves."""
        if accept and getattr(self, "local_ok", False):
            self.adapter.version = self.manifest.version
            self.recorder.backups.clear()
            self.committed = True
            return True
        if self.backup and getattr(self, "local_ok", False):
            self._rollback()
        self.local_ok = False
        self.aborted = True
        return False

    def _restore_objects(self) -> None:
        model = self.adapter.model()
        for name, obj in self.objs.items():
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            if getattr(mod, attr, None) is not obj:
                setattr(mod, attr, obj)

    def abort(self) -> CheckResult:
        """Roll back now (the client gave up on this update, or died); report the verified result.
        An update that finished its checks but was never committed is rolled back too: the new
        bytes are already in place, and only a commit may leave them serving."""
        if getattr(self, "committed", False):
            return CheckResult("atomic_versioning", True, ["already committed: the new weights serve, whole"],
                               rank=self.adapter.rank)
        if not self.dead and not self.finished:
            self._fail(RuntimeError("aborted by the client"))
        elif getattr(self, "local_ok", False) and self.backup:
            self._rollback()
            self.local_ok = False
        elif getattr(self, "local_ok", False):
            self.torn = True                    # finished, not committed, no backup to undo it
        self.finished = True
        self.aborted = True
        return self._rollback_check()

    def _rollback_check(self) -> CheckResult:
        """Atomicity of a failed update: every touched parameter holds its previous bytes again."""
        if not self.backup:
            return CheckResult("atomic_versioning", False, ["failed without backup: this rank is torn"],
                               rank=self.adapter.rank)
        bad = self.rollback_problems
        return CheckResult("atomic_versioning", not bad,
                           [f"{n}: not restored" for n in bad] or
                           [f"rolled back: {len(self.recorder.backups)} parameters hold their previous bytes "
                            "(fingerprints verified)"], rank=self.adapter.rank)

    # -- the checks ----------------------------------------------------------------------
    def _completeness(self) -> CheckResult:
        t0 = _now()
        problems = [f"{n}: the engine's loader wrote it nowhere" for n in self.silent[:16]]
        problems += list(self.adapter.grid_accounting())
        by_param: dict[str, list] = {}
        for w in self.recorder.writes:
            if w.dest_box is None:
                problems.append(f"{w.source} -> {w.param}: write is not a box of the parameter")
                continue
            by_param.setdefault(w.param, []).append(w.dest_box)
        scope = self.adapter.scope(set(by_param))
        for name, p in scope.items():
            for pr in coverage_problems(by_param.get(name, []), p.shape):
                problems.append(f"{name}: {pr}")
        return CheckResult("completeness", not problems, problems, _now() - t0, self.adapter.rank)

    def _layout(self) -> CheckResult:
        t0 = _now()
        problems, checked = [], 0
        for w in self.recorder.writes:
            exp = self.adapter.expected_boxes(w)
            if exp is None:
                continue
            checked += 1
            src, dest = exp
            if (src is not None and w.src_box != src) or w.dest_box != dest:
                problems.append(f"{w.source} ({w.role}) landed at {w.param}{list(w.dest_box or [])} from "
                                f"{list(w.src_box or [])}; the layout says {w.param}{list(dest)} from {list(src or [])}")
        res = CheckResult("layout", not problems, problems, _now() - t0, self.adapter.rank)
        if not checked:
            res.ok, res.details = None, ["the engine declared no layout expectations"]
        return res

    def _derived(self) -> CheckResult:
        t0 = _now()
        reg = self.adapter.derived()
        stale = reg.stale()
        res = CheckResult("derived_state", not stale, [f"{s}: stale (not rebuilt from the new weights)" for s in stale],
                          _now() - t0, self.adapter.rank)
        if not len(reg):
            res.details = ["no derived tensors registered: the kernels read the parameters as loaded"]
        return res

    def _storage(self) -> CheckResult:
        t0 = _now()
        problems = []
        model = self.adapter.model()
        live = dict(model.named_parameters())
        for name, ptr in self.ptrs.items():
            p = live.get(name)
            if p is None:
                problems.append(f"{name}: parameter disappeared")
            elif p is not self.objs[name] or p.data_ptr() != ptr:
                problems.append(f"{name}: reallocated (data pointer changed) -- captured CUDA graphs would read "
                                "the old storage")
        for d in self.adapter.derived():
            key = f"{d.owner}.{d.name}"
            if key in self.derived_ptrs and d.tensor.data_ptr() != self.derived_ptrs[key]:
                problems.append(f"{key}: derived tensor reallocated")
        return CheckResult("storage_stability", not problems, problems, _now() - t0, self.adapter.rank)

    def _cache_kv(self, kv_problems: list[str]) -> CheckResult:
        t0 = _now()
        problems = list(kv_problems)
        want = self.manifest.kv_scales or {}
        unused = bool(want) and not self.adapter.kv_scales_used()
        if unused:
            want = {}            # a KV cache that is not FP8 reads no scales: nothing to compare
        have = self.adapter.kv_scale_values() if want else {}
        for layer, (k, v) in want.items():
            got = have.get(int(layer))
            if got is None:
                problems.append(f"layer {layer}: engine has no KV scales")
            elif abs(got[0] - k) > 1e-6 * max(1.0, k) or abs(got[1] - v) > 1e-6 * max(1.0, v):
                problems.append(f"layer {layer}: KV scales are {got}, the trainer sent {(k, v)}")
        res = CheckResult("cache_coherence", not problems, problems, _now() - t0, self.adapter.rank)
        res.details.append("the KV cache is not FP8: the trainer's KV scales are not used (not compared)" if unused
                           else "prefix-cache flush is checked by the client (probe)")
        return res

    def _engine_as_found(self) -> CheckResult:
        """Verification: the bytes the engine held before this replay (the recorder's backups) equal
        what the checked replay wrote, region by region; the derived tensors and KV scales found were
        up to date.  Then the weights someone else loaded are exactly what a checked update loads."""
        t0 = _now()
        live = dict(self.adapter.model().named_parameters())
        problems = [f"{name}: derived tensor was stale before the check (not rebuilt after the last write)"
                    for name in self.stale_before]
        for w in self.recorder.writes:
            old = self.recorder.backups.get(w.param)
            if w.dest_box is None or old is None or w.param not in live:
                continue
            new = slice_box(live[w.param].detach(), w.dest_box)
            was = slice_box(old, w.dest_box).to(new.device)
            if not torch.equal(was.view(torch.uint8) if was.dtype != torch.bool else was,
                               new.view(torch.uint8) if new.dtype != torch.bool else new):
                problems.append(f"{w.source} ({w.role}) -> {w.param}{list(w.dest_box)}: the engine held other "
                                "bytes than the learner's")
        for layer, (k, v) in (self.manifest.kv_scales or {}).items():
            had = self.kv_before.get(str(layer))
            if had is not None and (abs(had[0] - k) > 1e-6 * max(1.0, k) or abs(had[1] - v) > 1e-6 * max(1.0, v)):
                problems.append(f"layer {layer}: KV scales were {tuple(had)}, the trainer's are {(k, v)}")
        n = len(self.recorder.writes)
        return CheckResult("engine_as_found", not problems, problems[:64] or
                           [f"{n} written regions held exactly the learner's bytes; derived tensors were current"],
                           _now() - t0, self.adapter.rank)

    def _regions(self) -> list:
        """(source, role, src_box, param, dest_box, fingerprint) of the writes, all or a seeded sample."""
        if self.digest == "off":
            self.timings["digest_s"] = 0.0
            return []
        writes = [w for w in self.recorder.writes if w.role in ("data", "scale") or self.digest == "full"]
        if self.digest == "sampled":
            rnd = random.Random(self.seed)
            k = max(1, int(round(len(writes) * self.fraction))) if writes else 0
            writes = rnd.sample(writes, k) if k < len(writes) else writes
        t0 = _now()
        out = []
        live = dict(self.adapter.model().named_parameters())
        for w in writes:
            if w.dest_box is None or w.param not in live:
                continue
            out.append([w.source, w.role, [list(b) for b in (w.src_box or [])], w.param,
                        [list(b) for b in w.dest_box], fingerprint(slice_box(live[w.param].detach(), w.dest_box))])
        self.timings["digest_s"] = _now() - t0
        return out


def fingerprint_regions(truth, regions: list) -> list[str]:
    """Client side of byte identity: compare the engine's region fingerprints with the learner's own bytes.

    ``truth(name, role)`` returns the learner's tensor for a region's source: its fp8 data
    (role "data") or uint8 scales (role "scale") for an on-grid weight, the tensor itself
    ("plain").
    """
    problems = []
    for source, role, src_box, param, dest_box, fp in regions:
        t = truth(source, role)
        if t is None:
            problems.append(f"{source}: the learner has no such tensor")
            continue
        box = tuple(tuple(b) for b in src_box) if src_box else None
        mine = fingerprint(slice_box(t, box) if box else t)
        if mine != fp:
            problems.append(f"{source} ({role}) -> {param}{dest_box}: engine bytes differ from the learner's")
    return problems
