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

The adapter interface is ``adapter.py``, the checks ``checks.py``, the region fingerprints
(both sides of byte identity) ``fingerprints.py``; this module re-exports ``EngineAdapter``
and ``fingerprint_regions``.
"""

from __future__ import annotations

import functools
import gc
import time
from contextlib import contextmanager
from typing import Iterable

import torch

from ..refresh import deferred_refresh
from . import checks
from .adapter import EngineAdapter
from .digest import fingerprint
from .fingerprints import fingerprint_regions, region_digests
from .manifest import Manifest, flatten, validate_by_condition
from .recorder import UpdateRejected, WriteRecorder, check_contents
from .report import CheckResult, SyncReport

__all__ = ["EngineAdapter", "UpdateSession", "fingerprint_regions"]   # the interface, re-exported


def _now() -> float:
    return time.perf_counter()


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the duration, back on after if it was on (nested uses keep it
    off until the outermost ends).  An update allocates objects per tensor (records, sources, views), and the
    collections they trigger cost a replayed load 9-25 % of its mean time on CPU and made its slowest loads 2-3x
    the median (BENCHMARKS.md, thirty-second session).  Reference counting still frees everything acyclic; cycles
    made meanwhile wait for the next collection, after the call."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _gc_paused(fn):
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)
    return paused


class UpdateSession:
    @_gc_paused
    def __init__(self, adapter: EngineAdapter, manifest: Manifest, backup: bool | str = True, digest: str = "sampled",
                 fraction: float = 0.05, seed: int = 0, verify: bool = False, replay: bool = True):
        t0 = _now()
        self.verify = bool(verify)
        # the adapter's write plan (plan.py): replayed for the tensors it describes, rebuilt after a clean
        # commit; never when verifying a trainer's own load (that must run the engine's loader)
        self.plan = getattr(adapter, "plan", None) if (replay and not self.verify) else None
        if self.plan is not None:
            self.plan.begin()
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
        adapter.plan_active = self.plan is not None
        adapter.begin()
        # seconds on this rank: read_s (receiving the buckets, as the caller timed it), load_s (whole
        # buckets) of which loaders_s (the engine's loaders under the recorder, content checks read) and
        # refresh_s (derived tensors rebuilt after each bucket)
        self.timings = {"begin_s": _now() - t0, "read_s": 0.0, "load_s": 0.0, "loaders_s": 0.0, "refresh_s": 0.0,
                        "replayed": 0}

    # -- loading ---------------------------------------------------------------------
    @_gc_paused
    def load(self, bucket: Iterable[tuple[str, torch.Tensor]], read_s: float = 0.0) -> None:
        """``read_s``: the seconds the caller spent receiving ``bucket`` (kept in the timings)."""
        self.timings["read_s"] += float(read_s)
        if self.dead:
            raise UpdateRejected("this update already failed and was undone; begin a new one")
        t0 = _now()
        items = list(bucket)
        named = []
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
                named.append((name, t, role))
            check_contents(named)           # the whole bucket's content rules in a few launches, before any write
            for name, t, role in named:
                self.recorder.add_source(t, name, role, checked=True)
            n_before = len(self.recorder.writes)
            t1 = _now()
            with deferred_refresh():           # each written layer's derived tensors rebuilt once, after the bucket
                with self.recorder:
                    self.adapter.load(items)
                t2 = _now()
            self.timings["loaders_s"] += t2 - t1
            if self.plan is not None:
                self.timings["replayed"] += self.plan.replayed
            self.timings["refresh_s"] += _now() - t2
            written = {w.source for w in self.recorder.writes[n_before:]}
            self.silent += [n for n, _ in items if n not in written]
            self.received.update(n for n, _ in items)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.timings["load_s"] += _now() - t0

    def _drop_plan(self) -> None:
        """A failed or refused update: the plan may be what went wrong; the engine's loaders write the next."""
        if self.plan is not None:
            self.plan.clear()

    def _fail(self, exc: BaseException) -> None:
        self.dead = True
        self._drop_plan()
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
    @_gc_paused
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
            report.checks.append(checks.rolled_back(self))
            self.finished = True
            return report
        report.checks += checks.local_checks(self, kv_problems)
        t1 = _now()
        report.extra["regions"] = region_digests(self.recorder.writes, dict(self.adapter.model().named_parameters()),
                                                 self.digest, self.fraction, self.seed)
        self.timings["digest_s"] = _now() - t1
        report.extra["rank"] = self.adapter.rank
        report.timings = dict(self.timings, finish_s=_now() - t0)
        if report.failed():
            self._drop_plan()
            if self.backup:
                self._rollback()
                report.rolled_back = True
                report.checks.append(checks.rolled_back(self))
            else:
                self.torn = True
        self.finished = True
        self.local_ok = not report.failed()
        return report

    @property
    def closed(self) -> bool:
        """Committed or aborted: nothing of this update can change the weights any more."""
        return getattr(self, "committed", False) or getattr(self, "aborted", False)

    @_gc_paused
    def commit(self, accept: bool) -> bool:
        """Accept (bump the version) or reject (roll back).  Returns whether the update serves."""
        if accept and getattr(self, "local_ok", False):
            self.adapter.version = self.manifest.version
            self.recorder.backups.clear()
            self.committed = True
            if self.plan is not None:        # every check passed: what the loaders did is the plan from now on
                self.plan.capture(self.adapter.model(), self._sent_specs(), self.recorder.writes, self.recorder.shards)
            return True
        self._drop_plan()
        if self.backup and getattr(self, "local_ok", False):
            self._rollback()
        self.local_ok = False
        self.aborted = True
        return False

    def _sent_specs(self) -> dict:
        """{learner name: (shape, torch dtype)} of the tensors this update wrote."""
        return {n: (tuple(sp.shape), getattr(torch, str(sp.dtype).rpartition(".")[2]))
                for n, sp in self.specs.items() if n in self.received}

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
        self._drop_plan()
        if not self.dead and not self.finished:
            self._fail(RuntimeError("aborted by the client"))
        elif getattr(self, "local_ok", False) and self.backup:
            self._rollback()
            self.local_ok = False
        elif getattr(self, "local_ok", False):
            self.torn = True                    # finished, not committed, no backup to undo it
        self.finished = True
        self.aborted = True
        return checks.rolled_back(self)
