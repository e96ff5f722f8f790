"""The local sync checks of one rank, run by :meth:`UpdateSession.finish <.session.UpdateSession.finish>`.

Each takes the session (its recorder's writes, the snapshot taken at ``begin``, the adapter)
and returns one :class:`CheckResult`.  Byte identity is not here: the engine only reports
region fingerprints (``fingerprints.py``); the client decides against the learner's bytes.
"""

from __future__ import annotations

import time

from .derived import differs
from .digest import read_flags
from .regions import coverage_problems, slice_box
from .report import CheckResult


def _now() -> float:
    return time.perf_counter()


def _kv_differs(a: tuple, b: tuple) -> bool:
    return abs(a[0] - b[0]) > 1e-6 * max(1.0, b[0]) or abs(a[1] - b[1]) > 1e-6 * max(1.0, b[1])


def completeness(s) -> CheckResult:
    t0 = _now()
    problems = [f"{n}: the engine's loader wrote it nowhere" for n in s.silent[:16]]
    problems += list(s.adapter.grid_accounting())
    by_param: dict[str, list] = {}
    for w in s.recorder.writes:
        if w.dest_box is None:
            problems.append(f"{w.source} -> {w.param}: write is not a box of the parameter")
            continue
        by_param.setdefault(w.param, []).append(w.dest_box)
    for name, p in s.adapter.scope(set(by_param)).items():
        problems += [f"{name}: {pr}" for pr in coverage_problems(by_param.get(name, []), p.shape)]
    return CheckResult("completeness", not problems, problems, _now() - t0, s.adapter.rank)


def _modules_by_name(adapter) -> dict:
    """The engine model's modules by name, once per check (empty: the adapter has no model to give).  Every
    name of a module reached under several (``remove_duplicate=False``), as ``get_submodule`` finds them."""
    try:
        return dict(adapter.model().named_modules(remove_duplicate=False))
    except NotImplementedError:
        return {}


def layout(s) -> CheckResult:
    t0 = _now()
    problems, checked = [], 0
    modules = _modules_by_name(s.adapter) if s.recorder.writes else {}
    for w in s.recorder.writes:
        exp = s.adapter.expected_boxes(w, modules)
        if exp is None:
            continue
        checked += 1
        src, dest = exp
        if (src is not None and w.src_box != src) or w.dest_box != dest:
            problems.append(f"{w.source} ({w.role}) landed at {w.param}{list(w.dest_box or [])} from "
                            f"{list(w.src_box or [])}; the layout says {w.param}{list(dest)} from {list(src or [])}")
    res = CheckResult("layout", not problems, problems, _now() - t0, s.adapter.rank)
    if not checked:
        res.ok, res.details = None, ["the engine declared no layout expectations"]
    return res


def derived_state(s) -> CheckResult:
    t0 = _now()
    reg = s.adapter.derived()
    stale = reg.stale()
    res = CheckResult("derived_state", not stale, [f"{d}: stale (not rebuilt from the new weights)" for d in stale],
                      _now() - t0, s.adapter.rank)
    if not len(reg):
        res.details = ["no derived tensors registered: the kernels read the parameters as loaded"]
    return res


def storage_stability(s) -> CheckResult:
    t0 = _now()
    problems = []
    live = dict(s.adapter.model().named_parameters())
    for name, ptr in s.ptrs.items():
        p = live.get(name)
        if p is None:
            problems.append(f"{name}: parameter disappeared")
        elif p is not s.objs[name] or p.data_ptr() != ptr:
            problems.append(f"{name}: reallocated (data pointer changed) -- captured CUDA graphs would read "
                            "the old storage")
    for d in s.adapter.derived():
        key = f"{d.owner}.{d.name}"
        if key in s.derived_ptrs and d.tensor.data_ptr() != s.derived_ptrs[key]:
            problems.append(f"{key}: derived tensor reallocated")
    return CheckResult("storage_stability", not problems, problems, _now() - t0, s.adapter.rank)


def cache_coherence(s, kv_problems: list[str]) -> CheckResult:
    t0 = _now()
    problems = list(kv_problems)
    want = s.manifest.kv_scales or {}
    unused = bool(want) and not s.adapter.kv_scales_used()
    if unused:
        want = {}            # a KV cache that is not FP8 reads no scales: nothing to compare
    have = s.adapter.kv_scale_values() if want else {}
    for layer, (k, v) in want.items():
        got = have.get(int(layer))
        if got is None:
            problems.append(f"layer {layer}: engine has no KV scales")
        elif _kv_differs(got, (k, v)):
            problems.append(f"layer {layer}: KV scales are {got}, the trainer sent {(k, v)}")
    res = CheckResult("cache_coherence", not problems, problems, _now() - t0, s.adapter.rank)
    res.details.append("the KV cache is not FP8: the trainer's KV scales are not used (not compared)" if unused
                       else "prefix-cache flush is checked by the client (probe)")
    return res


def engine_as_found(s) -> CheckResult:
    """Verification: the bytes the engine held before this replay (the recorder's backups) equal
    what the checked replay wrote, region by region; the derived tensors and KV scales found were
    up to date.  Then the weights someone else loaded are exactly what a checked update loads."""
    t0 = _now()
    live = dict(s.adapter.model().named_parameters())
    problems = [f"{name}: derived tensor was stale before the check (not rebuilt after the last write)"
                for name in s.stale_before]
    compared, flags = [], []
    for w in s.recorder.writes:
        old = s.recorder.backups.get(w.param)
        if w.dest_box is None or old is None or w.param not in live:
            continue
        new = slice_box(live[w.param].detach(), w.dest_box)
        # byte identity, queued on the device; read once for all regions below (no sync per write)
        compared.append(w)
        flags.append(differs(new, slice_box(old, w.dest_box)))
    for w, bad in zip(compared, read_flags(flags)):
        if bad:
            problems.append(f"{w.source} ({w.role}) -> {w.param}{list(w.dest_box)}: the engine held other "
                            "bytes than the learner's")
    for layer, (k, v) in (s.manifest.kv_scales or {}).items():
        had = s.kv_before.get(str(layer))
        if had is not None and _kv_differs(had, (k, v)):
            problems.append(f"layer {layer}: KV scales were {tuple(had)}, the trainer's are {(k, v)}")
    n = len(s.recorder.writes)
    return CheckResult("engine_as_found", not problems, problems[:64] or
                       [f"{n} written regions held exactly the learner's bytes; derived tensors were current"],
                       _now() - t0, s.adapter.rank)


def rolled_back(s) -> CheckResult:
    """Atomicity of a failed update: every touched parameter holds its previous bytes again."""
    if not s.backup:
        return CheckResult("atomic_versioning", False, ["failed without backup: this rank is torn"],
                           rank=s.adapter.rank)
    bad = s.rollback_problems
    return CheckResult("atomic_versioning", not bad,
                       [f"{n}: not restored" for n in bad] or
                       [f"rolled back: {len(s.recorder.backups)} parameters hold their previous bytes "
                        "(fingerprints verified)"], rank=s.adapter.rank)


def local_checks(s, kv_problems: list[str]) -> list[CheckResult]:
    """The checks every finished update runs (plus ``engine_as_found`` when verifying)."""
    out = [completeness(s), layout(s), derived_state(s), storage_stability(s), cache_coherence(s, kv_problems)]
    return out + ([engine_as_found(s)] if s.verify else [])
