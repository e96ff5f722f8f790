"""The ``grid_*`` surface of one engine rank, once for both engines.

Each plugin reaches its ranks its own way -- vLLM's ``collective_rpc`` calls methods of a worker
extension (``vllm_plugin/worker.py``), SGLang runs a custom weight loader on every TP rank
(``sglang_plugin/updater.py``) -- and moves the bucket bytes its own way.  What a rank does with
a call is the same, and lives here:

    begin(manifest_json, options_json)   validate, snapshot, start recording (an open update that
                                         was never committed is rolled back first); a manifest
                                         refused before any write is answered as data:
                                         {"begun": false, "rejected": {condition: [problem]}}
    load(items)                          one bucket of (name, tensor) through the engine's loaders
    finish()                             the local checks + region fingerprints (report dict)
    commit("1" | "0")                    accept (bump the version) or roll back
    abort()                              roll back now
    state()                              version, torn flag, open flag, on-grid layer count
    fingerprints(names_json)             fingerprints of named parameters

and, for an engine whose own update paths load a bucket (SGLang's broadcast), ``absorb`` (such a
load, through the open session; a failure kept, never raised into the engine) and ``absorbed``
(the bucket's account: exactly the announced tensors arrived, none failed).

Arguments and results are strings and JSON-able dicts, so the same calls work in-process and
across processes.  A call that needs an open update (load, finish, commit) is refused without
one, with the same words on every engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Callable, Iterable, Optional

from .digest import fingerprint
from .manifest import Manifest
from .recorder import UpdateRejected
from .session import UpdateSession, gc_paused

log = logging.getLogger("mxfp8_learner_grid.sync")

#: the options of ``begin`` and their defaults (the client sends them as JSON)
SESSION_DEFAULTS = {"backup": True, "digest": "sampled", "fraction": 0.05, "seed": 0, "verify": False, "replay": True}


def session_options(options_json: str) -> dict:
    """``UpdateSession`` keyword arguments from the client's options JSON (unknown keys ignored)."""
    opts = {**SESSION_DEFAULTS, **json.loads(options_json or "{}")}
    return {"backup": opts["backup"], "digest": opts["digest"], "fraction": float(opts["fraction"]),
            "seed": int(opts["seed"]), "verify": bool(opts["verify"]), "replay": bool(opts["replay"])}


def checked(method: str, results: list) -> list:
    """A transport's results of ``method`` on every rank, as they are -- unless it was a ``begin``
    that a rank refused: then one ``UpdateRejected`` carrying every rank's problems by condition is
    raised, so a caller sees one error type and its ``problems`` as data, whatever carried them."""
    bad = [r for r in results if isinstance(r, dict) and r.get("begun") is False] \
        if method == "grid_update_begin" else []
    if not bad:
        return results
    problems: dict = {}
    for r in bad:
        for cond, texts in (r.get("rejected") or {}).items():
            seen = problems.setdefault(cond, [])
            seen += [t for t in texts if t not in seen]          # ranks see the same manifest
    raise UpdateRejected(bad[0].get("error") or "update rejected before any write", problems)


class RankService:
    """One rank's update state: the engine adapter (made on first use by ``adapter_factory``),
    the current session, and whether an update is open (begun, not yet committed or aborted).
    Engines hook ``on_open`` / ``on_close`` (SGLang shadows the model's loader meanwhile)."""

    def __init__(self, adapter_factory: Callable[[], object]):
        self._factory = adapter_factory
        self._adapter = None
        self.session: Optional[UpdateSession] = None
        self.open = False
        self.received: list[str] = []       # names the engine's own update paths loaded (absorb)
        self.load_error: Optional[BaseException] = None

    @property
    def adapter(self):
        if self._adapter is None:
            self._adapter = self._factory()
        return self._adapter

    # -- hooks ------------------------------------------------------------------------------
    def on_open(self) -> None:
        """Called once an update is open."""

    def on_close(self) -> None:
        """Called when it is committed or aborted."""

    # -- the calls ----------------------------------------------------------------------------
    def require(self) -> UpdateSession:
        if self.session is None or not self.open:
            raise RuntimeError("no grid update is open on this rank (grid_update_begin first)")
        return self.session

    def begin(self, manifest_json: str, options_json: str = "{}") -> dict:
        with gc_paused():                    # the manifest's parse: objects per tensor, as in the session's calls
            return self._begin(manifest_json, options_json)

    def _begin(self, manifest_json: str, options_json: str) -> dict:
        kwargs, manifest, ad = session_options(options_json), Manifest.from_json(manifest_json), self.adapter
        if self.open:                        # a previous update never committed (client died or gave up)
            self.abort()
        ad.partial = manifest.partial
        try:
            self.session = UpdateSession(ad, manifest, **kwargs)
        except UpdateRejected as exc:        # nothing was written: the previous weights serve, whole
            self.session = None
            return {"rank": ad.rank, "begun": False, "rejected": exc.problems, "error": str(exc)}
        self.open = True
        self.received, self.load_error = [], None
        self.on_open()
        return {"rank": ad.rank, "begun": True}

    def load(self, items: Iterable, read_s: float = 0.0) -> dict:
        """``read_s``: the seconds the caller spent receiving the bucket (kept in the rank's timings)."""
        items = list(items)
        self.require().load(items, read_s)
        return {"rank": self.adapter.rank, "tensors": len(items)}

    def load_announced(self, names: list, tensors: list) -> dict:
        """A bucket that came with the request, checked against the names its source announced."""
        got = [n for n, _ in tensors]
        if got != list(names):
            raise UpdateRejected(f"bucket arrived garbled: {len(got)} tensors, {len(names)} announced")
        return self.load(tensors)

    def absorb(self, items: Iterable) -> None:
        """A load the engine ran its own way while this update is open: through the session.  Never
        raises (the caller is the engine); a failure is kept for :meth:`absorbed` to report."""
        items = list(items)
        self.received += [n for n, _ in items]
        if self.load_error is not None:
            return                          # this update already failed (and was rolled back)
        try:
            if self.session is None or self.session.finished:
                raise UpdateRejected("a weight load arrived after grid_update_finish")
            self.session.load(items)
        except Exception as exc:            # noqa: BLE001 -- reported by absorbed()
            log.error("mxfp8-learner-grid: weight update failed while loading: %s", exc)
            self.load_error = exc

    def absorbed(self, want: list) -> dict:
        """The account of one bucket that went the engine's way: the tensors ``want`` arrived, none failed."""
        self.require()
        got, self.received = self.received, []
        if self.load_error is not None:
            raise self.load_error
        if sorted(got) != sorted(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise UpdateRejected(f"bucket arrived incomplete: missing {missing[:4]}, unexpected {extra[:4]}")
        return {"rank": self.adapter.rank, "tensors": len(got)}

    def finish(self) -> dict:
        return dataclasses.asdict(self.require().finish())

    def commit(self, accept: str = "1") -> dict:
        ok = self.require().commit(accept in ("1", "true", "True"))
        self._close()
        return {"rank": self.adapter.rank, "applied": ok, "version": self.adapter.version}

    def abort(self) -> dict:
        s = self.session
        check = dataclasses.asdict(s.abort()) if s is not None and not getattr(s, "aborted", False) else None
        self._close()
        return {"rank": self.adapter.rank, "version": self.adapter.version, "check": check}

    def state(self) -> dict:
        ad = self.adapter
        return {"rank": ad.rank, "version": ad.version, "torn": bool(self.session.torn) if self.session else False,
                "open": self.open, "grid_layers": sum(1 for _ in ad.grid_layers()), "derived": len(ad.registry)}

    def fingerprints(self, names_json: str = "[]") -> dict:
        params = dict(self.adapter.model().named_parameters())
        names = json.loads(names_json) or list(params)
        return {n: fingerprint(params[n]) for n in names if n in params}

    def _close(self) -> None:
        self.open = False
        self.on_close()
