"""Worker side of grid weight updates in SGLang: the bridge from the trainer's client to each
TP rank's :class:`~mxfp8_learner_grid.common.sync.session.UpdateSession`.

    --custom-weight-loader mxfp8_learner_grid.sglang_plugin.updater.grid_loader

SGLang has no RPC that runs plugin code on every worker and returns its result (its
``collective_rpc`` calls scheduler methods and returns only success).  It does run a
*custom weight loader* on every TP rank: ``update_weights_from_tensor(...,
load_format=GRID_LOADER)`` deserializes each rank's payload (SGLang's own serializer: CUDA IPC
on a GPU, shared memory on the CPU) and calls ``grid_loader(model, named_tensors)`` on every
rank, in lockstep, inside SGLang's weight-update session.  The bridge:

* request: the payload's first entry is the control message -- the name ``CONTROL + json``
  ({"method", "args", "reply"}) with an empty tensor; for ``grid_update_load`` the bucket's
  tensors follow it, so the bytes travel SGLang's way;
* execution: the rank's :class:`GridWorker` runs the method (``common.sync.rank_service``'s
  calls, as ``vllm_plugin/worker.py`` does).  Nothing escapes ``grid_loader``: an exception
  there would stop SGLang's scheduler, so an error is a result;
* reply: the ranks all-gather their results over SGLang's TP CPU group and each writes the
  list, atomically, to ``reply``: a ``.json`` file in an ``mxfp8-grid-*`` directory directly
  under an allowed root (``MXFP8_GRID_REPLY_DIRS``, default ``/dev/shm`` and the temp dir;
  nothing else is ever written).  The client reads it when the request returns: SGLang
  answers after every rank passed its post-load barrier.  So trainer and engine share a host
  (as for the ``/dev/shm`` staging of the vLLM plugin).

Between ``grid_update_begin`` and the commit or abort, the model's ``load_weights`` is
shadowed by the open session (an instance attribute; the adapter calls the class's): whatever
SGLang loads meanwhile -- ``update_weights_from_distributed``'s broadcast buckets, a plain or
flattened-bucket ``update_weights_from_tensor`` -- goes through the recorder and the
manifest, and a failure is kept for the next ``grid_update_load`` to report (never raised
into SGLang).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from mxfp8_learner_grid.common.sync.rank_service import RankService
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected
from mxfp8_learner_grid.common.sync.security import Refused

from .sync_adapter import SGLangAdapter

logger = logging.getLogger("mxfp8_learner_grid.sglang")

GRID_LOADER = "mxfp8_learner_grid.sglang_plugin.updater.grid_loader"
CONTROL = "mxfp8_grid_control:"
REPLY_DIRS_ENV = "MXFP8_GRID_REPLY_DIRS"
REPLY_PREFIX = "mxfp8-grid-"
METHODS = ("grid_update_begin", "grid_update_load", "grid_update_finish", "grid_update_commit",
           "grid_update_abort", "grid_state", "grid_fingerprints")
#: the RankService call behind each grid_* method name (the others are GridWorker's own)
CALLS = {"grid_update_begin": "begin", "grid_update_finish": "finish", "grid_update_commit": "commit",
         "grid_update_abort": "abort", "grid_fingerprints": "fingerprints"}


def _tp_group():
    """(rank, world size, CPU group) of SGLang's TP group; (0, 1, None) outside a distributed run."""
    from sglang.srt.distributed.parallel_state import model_parallel_is_initialized
    if not model_parallel_is_initialized():
        return 0, 1, None
    from sglang.srt.runtime_context import get_parallel
    g = get_parallel().tp_group                  # the TP GroupCoordinator (0.5.17 and 0.5.23)
    return g.rank_in_group, g.world_size, g.cpu_group


def _sglang_weight_version():
    try:
        from sglang.srt.runtime_context import get_serving
        return get_serving().weight_version
    except Exception:              # noqa: BLE001 -- informational only
        return None


class GridWorker(RankService):
    """The grid_* methods on one TP rank: ``common.sync.rank_service.RankService`` (the same surface
    as vllm_plugin/worker.py), plus SGLang's two ways a bucket arrives and the shadowed loader."""

    adapter_cls = SGLangAdapter           # a subclass may name another (the test suites' faulty adapter)

    def __init__(self, model: torch.nn.Module):
        rank, self.world, _ = _tp_group()
        super().__init__(lambda: self.adapter_cls(model, rank))
        self.received: list[str] = []       # names SGLang's own update paths loaded (shadowed loader)
        self.load_error: BaseException | None = None
        self.adapter                        # made now: the shadowed loader needs the model

    # -- the shadowed loader ----------------------------------------------------------------
    def on_open(self) -> None:
        self.received, self.load_error = [], None
        self.adapter.model().load_weights = self._shadowed_load

    def on_close(self) -> None:
        model = self.adapter.model()
        if "load_weights" in vars(model):
            del model.load_weights

    def _shadowed_load(self, weights, *args, **kwargs):
        items = list(weights)
        self.received += [n for n, _ in items]
        if self.load_error is not None:
            return                          # this update already failed (and was rolled back)
        try:
            if self.session is None or self.session.finished:
                raise UpdateRejected("a weight load arrived after grid_update_finish")
            self.session.load(items)
        except Exception as exc:            # noqa: BLE001 -- reported by the next grid_update_load
            logger.error("mxfp8-learner-grid: weight update failed while loading: %s", exc)
            self.load_error = exc

    # -- grid_* ---------------------------------------------------------------------------
    def grid_update_load(self, source_json: str, tensors=()) -> dict:
        self.require()
        src = json.loads(source_json)
        if src.get("kind") == "inline":                 # the bucket came with this request
            names = [n for n, _ in tensors]
            if names != list(src.get("names", names)):
                raise UpdateRejected(f"bucket arrived garbled: {len(names)} tensors, {len(src['names'])} announced")
            return self.load(tensors)
        if src.get("kind") == "loaded":                 # it came through SGLang's own update path
            got, self.received = self.received, []
            if self.load_error is not None:
                raise self.load_error
            want = [t[0] for t in src.get("tensors", [])]
            if sorted(got) != sorted(want):
                missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
                raise UpdateRejected(f"bucket arrived incomplete: missing {missing[:4]}, unexpected {extra[:4]}")
            return {"rank": self.adapter.rank, "tensors": len(got)}
        raise ValueError(f"unknown bucket source kind {src.get('kind')!r} (SGLang buckets are 'inline' or 'loaded')")

    def grid_state(self) -> dict:
        return {**self.state(), "sglang_weight_version": _sglang_weight_version()}

    def call(self, method: str, args: list, tensors: list):
        from mxfp8_learner_grid.patches import sglang_update_access as access
        from . import compat
        if not access.covers(compat.SGLANG_VERSION):          # its access rules would not be in force
            raise Refused(access.not_covered_message(compat.SGLANG_VERSION))
        if method not in METHODS:
            raise ValueError(f"{method!r} is not a grid method; known: {METHODS}")
        if method == "grid_update_load":
            return self.grid_update_load(*args, tensors=tensors)
        return getattr(self, CALLS.get(method, method))(*args)


def worker_for(model: torch.nn.Module) -> GridWorker:
    """This rank's worker for ``model`` (kept on the model: one per model, for the process's life)."""
    w = vars(model).get("_mxfp8_grid_worker")
    if w is None:
        w = model._mxfp8_grid_worker = GridWorker(model)
    return w


# -- the entry point SGLang calls ------------------------------------------------------------

def reply_roots() -> list[str]:
    env = os.environ.get(REPLY_DIRS_ENV)
    roots = env.split(",") if env else ["/dev/shm", tempfile.gettempdir()]
    return [os.path.realpath(r) for r in roots if r]


def _reply_path_ok(path) -> bool:
    if not isinstance(path, str) or not path.endswith(".json"):
        return False
    d = os.path.realpath(os.path.dirname(path))
    return os.path.basename(d).startswith(REPLY_PREFIX) and os.path.dirname(d) in reply_roots()


def _write_reply(path, results) -> None:
    if not _reply_path_ok(path):
        logger.error("mxfp8-learner-grid: refusing to write a reply to %r (a .json file in an %s* directory "
                     "under %s is required; %s)", path, REPLY_PREFIX, reply_roots(), REPLY_DIRS_ENV)
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, default=str)
    os.replace(tmp, path)


def grid_loader(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom-weight-loader hook: run one grid control message on this rank (module docstring)."""
    named = list(named_tensors)
    if not named or not isinstance(named[0][0], str) or not named[0][0].startswith(CONTROL):
        logger.error("mxfp8-learner-grid: %s called without a control message; nothing loaded", GRID_LOADER)
        return
    rank, world, group = _tp_group()
    msg: dict = {}
    try:
        msg = json.loads(named[0][0][len(CONTROL):])
        out = {"ok": True, "result": worker_for(model).call(msg["method"], list(msg.get("args", [])), named[1:])}
    except Exception as exc:               # noqa: BLE001 -- never into SGLang's scheduler
        out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    out["rank"] = rank
    results = [out]
    if world > 1:
        results = [None] * world
        torch.distributed.all_gather_object(results, out, group=group)
    _write_reply(msg.get("reply"), results)
