"""A control-message bridge: the grid calls carried to every rank inside an engine's own
weight-update request, the ranks' answers read back from a reply file.

For an engine that has no RPC returning plugin results from its workers but does run a plugin
hook on every rank with the tensors of an update request (SGLang's custom weight loader,
``sglang_plugin``).  The framing, engine-agnostic:

* request: the payload's first entry is the control message -- the name ``CONTROL + json``
  ({"method", "args", "reply"}) on a carrier tensor; a bucket's tensors may follow it;
* each rank runs the method (``rank_service``) and makes an *outcome* of it: ``{"ok": true,
  "result": ...}`` or ``{"ok": false, "type", "error", "problems"?}`` -- nothing raises into the
  engine; the ranks gather their outcomes and write the list, atomically, to ``reply``: a
  ``.json`` file in a ``mxfp8-grid-*`` directory directly under an allowed root
  (``MXFP8_GRID_REPLY_DIRS``, default ``/dev/shm`` and the temp dir; nothing else is written);
* the client (:class:`BridgeTransport`) reads the file once the request returned and raises
  the first failed rank's error as it was (``UpdateRejected`` with its problems).  So trainer and
  engine share a host.

:class:`BridgeTransport` is the trainer side over such an engine: the ``GridSyncClient``
transport API in terms of a few engine calls its subclass supplies.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Callable, Optional

import torch

from .protocol import allowed_dirs
from .rank_service import checked
from .recorder import UpdateRejected
from .transport import nccl_source, staging_dir

CONTROL = "mxfp8_grid_control:"
REPLY_DIRS_ENV = "MXFP8_GRID_REPLY_DIRS"
REPLY_PREFIX = "mxfp8-grid-"
logger = logging.getLogger("mxfp8_learner_grid.sync")


# -- rank side ---------------------------------------------------------------------------------

def is_control(named: list) -> bool:
    """Does a control message head ``named`` ((name, tensor) pairs)?"""
    return bool(named) and isinstance(named[0][0], str) and named[0][0].startswith(CONTROL)


def parse_control(named: list) -> dict:
    """The control message heading ``named``: {"method", "args", "reply"}."""
    msg = json.loads(named[0][0][len(CONTROL):])
    if not isinstance(msg, dict):
        raise ValueError("a grid control message is a JSON object")
    return msg


def outcome(fn: Callable[[], object]) -> dict:
    """``fn()``'s result as a reply entry; an exception becomes data (it must not reach the engine)."""
    try:
        return {"ok": True, "result": fn()}
    except Exception as exc:               # noqa: BLE001 -- reported to the client
        out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        if getattr(exc, "problems", None):
            out["problems"] = exc.problems
        return out


def reply_roots() -> list[str]:
    """Where a reply directory may live (``MXFP8_GRID_REPLY_DIRS``; ``protocol.allowed_dirs``)."""
    return allowed_dirs(REPLY_DIRS_ENV)


def reply_path_ok(path) -> bool:
    if not isinstance(path, str) or not path.endswith(".json"):
        return False
    d = os.path.realpath(os.path.dirname(path))
    return os.path.basename(d).startswith(REPLY_PREFIX) and os.path.dirname(d) in reply_roots()


def write_reply(path, results) -> bool:
    """Write the ranks' outcomes to ``path`` atomically -- only where :func:`reply_path_ok` allows."""
    if not reply_path_ok(path):
        logger.error("mxfp8-learner-grid: refusing to write a reply to %r (a .json file in an %s* directory "
                     "under %s is required; %s)", path, REPLY_PREFIX, reply_roots(), REPLY_DIRS_ENV)
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, default=str)
    os.replace(tmp, path)
    return True


# -- client side -------------------------------------------------------------------------------

def raise_failed(results: list) -> list:
    """Each rank's result, in rank order -- or the first failed rank's error, raised as it was."""
    bad = [r for r in results if not r["ok"]]
    if bad:
        e = bad[0]
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        if e["type"] == "UpdateRejected":
            raise UpdateRejected(e["error"] + more, e.get("problems"))
        raise RuntimeError((e["error"] if e["type"] == "RuntimeError" else f"{e['type']}: {e['error']}") + more)
    return [r["result"] for r in sorted(results, key=lambda r: r["rank"])]


class BridgeTransport:
    """The ``GridSyncClient`` transport over a bridged engine.  A subclass supplies the engine's calls:

    ``_update_from_tensor(named, weight_version) -> (ok, msg)``   the update request that carries the
        control message (and an inline bucket) to every rank; ``weight_version`` set on the commit
    ``_update_from_distributed(names, dtypes, shapes, group_name) -> (ok, msg)``   receive a bucket the
        trainer broadcasts over ``self.group`` (staging ``"nccl"``)
    ``_session_call("begin" | "end") -> (ok, msg) | None``   the engine's update session (None: it has none)
    ``_pause_generation()``, ``_continue_generation()``, ``_flush() -> bool``
    ``_control_tensor()``   the carrier tensor of the control message

    Update sessions: where the engine has them, every grid call made outside an update (the version
    query at connect, fingerprints) is wrapped in its own session."""

    STAGINGS = ("tensor", "nccl")
    #: what to check when no reply came (the subclass names its engine's flag)
    no_reply_hint = "is the engine on this host, with the grid bridge enabled?"

    def __init__(self, staging: str = "tensor"):
        if staging not in self.STAGINGS:
            raise ValueError(f"staging must be one of {self.STAGINGS}; got {staging!r}")
        self.staging = staging
        self.reply_dir = tempfile.mkdtemp(prefix=REPLY_PREFIX, dir=staging_dir())
        self.close = weakref.finalize(self, shutil.rmtree, self.reply_dir, True)   # also at exit
        self.sessions: Optional[bool] = None        # the engine has update sessions; None: not yet known
        self.in_session = False
        self.group, self.group_name = None, None
        self._bucket: list = []
        self._version: Optional[int] = None

    # -- the GridSyncClient transport API --------------------------------------------------
    def rpc(self, method: str, *args: str) -> list:
        if method == "grid_update_begin":
            self._version = int(json.loads(args[0])["version"])
        own_session = not self.in_session
        if own_session:
            self._begin()
        try:
            extra, version = [], None
            if method == "grid_update_load":
                src = json.loads(args[0])
                if src["kind"] == "loaded":               # the bytes go the engine's broadcast way first
                    names, dtypes, shapes = (list(x) for x in zip(*src["tensors"]))
                    ok, msg = self._update_from_distributed(names, dtypes, shapes, self.group_name)
                    if not ok:
                        raise RuntimeError(f"the engine's distributed weight update failed: {msg}")
                else:
                    extra, self._bucket = self._bucket, []
            if method == "grid_update_commit" and args and args[0] == "1" and self._version is not None:
                version = str(self._version)
            return checked(method, self._control(method, args, extra, version))
        finally:
            if own_session:
                self._end()

    def stage(self, bucket) -> dict:
        if self.staging == "nccl":
            if self.group is None:
                raise RuntimeError("staging='nccl' needs init_group() first (connect(..., nccl={...}) does it)")
            return {"kind": "loaded", "tensors": nccl_source(bucket)["tensors"]}
        self._bucket = [(n, t.detach().contiguous()) for n, t in bucket]
        return {"kind": "inline", "names": [n for n, _ in bucket]}

    @property
    def send(self):
        """Push a staged bucket while the engine's receiving request runs (nccl only; None: nothing to push)."""
        if self.staging != "nccl":
            return None

        def push(bucket, source):
            for _, t in bucket:
                torch.distributed.broadcast(t.detach().contiguous(), src=0, group=self.group)
        return push

    def release(self, source) -> None:
        self._bucket = []

    def pause(self) -> None:
        self._pause_generation()
        try:
            self._begin()
        except BaseException:
            self._continue_generation()     # the client only resumes what it paused
            raise

    def resume(self) -> None:
        try:
            self._end()
        finally:
            self._continue_generation()

    def reset_prefix_cache(self) -> None:
        if not self._flush():
            raise RuntimeError("the engine refused to flush its prefix cache (requests still running or queued): "
                               "KV computed with the old weights would be reused")

    # -- the bridge --------------------------------------------------------------------------
    def _control(self, method: str, args, extra: list, weight_version: Optional[str]) -> list:
        reply = os.path.join(self.reply_dir, f"{method}-{uuid.uuid4().hex}.json")
        ctl = CONTROL + json.dumps({"method": method, "args": list(args), "reply": reply})
        ok, msg = self._update_from_tensor([(ctl, self._control_tensor())] + list(extra), weight_version)
        try:
            if not ok:
                raise RuntimeError(f"{method}: the engine refused the request: {msg}")
            try:
                with open(reply) as f:
                    results = json.load(f)
            except FileNotFoundError:
                raise RuntimeError(f"{method}: no reply from the engine's workers in {self.reply_dir} "
                                   f"({self.no_reply_hint})") from None
        finally:
            try:
                os.unlink(reply)
            except FileNotFoundError:
                pass
        return raise_failed(results)

    def _control_tensor(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def _begin(self) -> None:
        if self.sessions is False or self.in_session:
            return
        r = self._session_call("begin")
        if r is None:                                    # the engine has no update sessions
            self.sessions = False
            return
        ok, msg = r
        if not ok:
            raise RuntimeError(f"begin_weight_update failed: {msg}")
        self.sessions, self.in_session = True, True

    def _end(self) -> None:
        if not self.in_session:
            return
        self.in_session = False
        ok, msg = self._session_call("end")
        if not ok:
            raise RuntimeError(f"end_weight_update failed: {msg}")
