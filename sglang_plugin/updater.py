"""Worker side of grid weight updates in SGLang: the bridge from the trainer's client to each
TP rank's :class:`~mxfp8_learner_grid.common.sync.session.UpdateSession`.

    --custom-weight-loader mxfp8_learner_grid.sglang_plugin.updater.grid_loader

SGLang has no RPC that runs plugin code on every worker and returns its result (its
``collective_rpc`` calls scheduler methods and returns only success).  It does run a
*custom weight loader* on every TP rank: ``update_weights_from_tensor(...,
load_format=GRID_LOADER)`` deserializes each rank's payload (SGLang's own serializer: CUDA IPC
on a GPU, shared memory on the CPU) and calls ``grid_loader(model, named_tensors)`` on every
rank, in lockstep, inside SGLang's weight-update session.  The bridge:

* the framing -- the control message heading the payload (a bucket's tensors follow it for
  ``grid_update_load``, so the bytes travel SGLang's way), each rank's outcome, the reply
  file -- is ``common.sync.bridge``'s; the ranks all-gather their outcomes over SGLang's TP CPU
  group and each writes the list to the reply file, which the client reads when the request
  returns (SGLang answers after every rank passed its post-load barrier).  So trainer and
  engine share a host (as for the ``/dev/shm`` staging of the vLLM plugin);
* execution: the rank's :class:`GridWorker` runs the method (``common.sync.rank_service``'s
  calls, as ``vllm_plugin/worker.py`` does).  Nothing escapes ``grid_loader``: an exception
  there would stop SGLang's scheduler, so an error is a result.

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

import torch

from mxfp8_learner_grid.common.sync import bridge
from mxfp8_learner_grid.common.sync.bridge import CONTROL, REPLY_DIRS_ENV, REPLY_PREFIX, reply_roots  # noqa: F401
from mxfp8_learner_grid.common.sync.protocol import METHODS
from mxfp8_learner_grid.common.sync.rank_service import RankService
from mxfp8_learner_grid.common.sync.security import Refused

from .sync_adapter import SGLangAdapter

logger = logging.getLogger("mxfp8_learner_grid.sglang")

GRID_LOADER = "mxfp8_learner_grid.sglang_plugin.updater.grid_loader"
#: how an SGLang server is given an API key (what ``check_update_access`` names when one is missing)
API_KEY_FLAGS = "--api-key / --admin-api-key"
#: the RankService call behind each grid_* method name (the others are GridWorker's own)
CALLS = {"grid_update_begin": "begin", "grid_update_finish": "finish", "grid_update_commit": "commit",
         "grid_update_abort": "abort", "grid_fingerprints": "fingerprints"}
_reply_path_ok = bridge.reply_path_ok


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
        self.adapter                        # made now: the shadowed loader needs the model

    # -- the shadowed loader: SGLang's own loads go through the session (RankService.absorb) ----
    def on_open(self) -> None:
        self.adapter.model().load_weights = self._shadowed_load

    def on_close(self) -> None:
        model = self.adapter.model()
        if "load_weights" in vars(model):
            del model.load_weights

    def _shadowed_load(self, weights, *args, **kwargs):
        self.absorb(weights)

    # -- grid_* ---------------------------------------------------------------------------
    def grid_update_load(self, source_json: str, tensors=()) -> dict:
        self.require()
        src = json.loads(source_json)
        if src.get("kind") == "inline":                 # the bucket came with this request
            return self.load_announced(src.get("names", [n for n, _ in tensors]), list(tensors))
        if src.get("kind") == "loaded":                 # it came through SGLang's own update path
            return self.absorbed([t[0] for t in src.get("tensors", [])])
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
def grid_loader(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom-weight-loader hook: run one grid control message on this rank (module docstring)."""
    named = list(named_tensors)
    if not bridge.is_control(named):
        logger.error("mxfp8-learner-grid: %s called without a control message; nothing loaded", GRID_LOADER)
        return
    rank, world, group = _tp_group()
    msg: dict = {}

    def run():
        msg.update(bridge.parse_control(named))
        return worker_for(model).call(msg["method"], list(msg.get("args", [])), named[1:])
    out = dict(bridge.outcome(run), rank=rank)
    results = [out]
    if world > 1:
        results = [None] * world
        torch.distributed.all_gather_object(results, out, group=group)
    bridge.write_reply(msg.get("reply"), results)
