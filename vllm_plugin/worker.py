"""``--worker-extension-cls mxfp8_learner_grid.vllm_plugin.worker.GridWorkerExtension``

RPC methods every vLLM worker gains (``LLM.collective_rpc`` / ``EngineClient.collective_rpc``).
Arguments and results are strings / JSON-able dicts, so the same calls work in-process and
over HTTP.  The trainer-side client (``vllm_plugin.client``) drives them:

    grid_update_begin(manifest_json, options_json)   validate, snapshot, start recording
    grid_update_load(source_json)                    one bucket through vLLM's own loaders
    grid_update_finish()                             local checks + region fingerprints (report dict)
    grid_update_commit("1" | "0")                    accept (bump version) or roll back
    grid_update_abort()                              roll back now
    grid_state()                                     version, torn flag, on-grid layer count
    grid_fingerprints(names_json)                    fingerprints of named parameters (for tests)
    grid_nccl_init(info_json)                        join the trainer's NCCL group (nccl buckets)
"""

from __future__ import annotations

import dataclasses
import json

from mxfp8_learner_grid.common.sync.digest import fingerprint
from mxfp8_learner_grid.common.sync.manifest import Manifest
from mxfp8_learner_grid.common.sync.security import check_rendezvous
from mxfp8_learner_grid.common.sync.session import UpdateSession
from mxfp8_learner_grid.common.sync.transport import read_source

class GridWorkerExtension:

    adapter_cls = None        # the engine adapter (sync_adapter.VLLMAdapter unless a subclass names another)

    def _grid(self):
        ad = getattr(self, "_grid_adapter_obj", None)
        if ad is None:
            from .sync_adapter import VLLMAdapter
            model = self.model_runner.model if hasattr(self.model_runner, "model") else self.model_runner.get_model()
            rank = int(getattr(self, "rank", 0) or 0)
            ad = (self.adapter_cls or VLLMAdapter)(model, self.vllm_config, rank)
            from .linear_method import register_derived
            register_derived(model, ad.registry)
            self._grid_adapter_obj = ad
        return ad

    def _device(self):
        p = next(self._grid().model().parameters())
        return p.device

    def grid_update_begin(self, manifest_json: str, options_json: str = "{}") -> dict:
        opts = json.loads(options_json)
        ad = self._grid()
        manifest = Manifest.from_json(manifest_json)
        ad.partial = manifest.partial
        prev = getattr(self, "_grid_session", None)
        if prev is not None and not prev.closed:
            prev.abort()                      # a session never committed (client died or gave up): roll it back
        self._grid_session = UpdateSession(ad, manifest, backup=opts.get("backup", True),
                                           digest=opts.get("digest", "sampled"),
                                           fraction=float(opts.get("fraction", 0.05)), seed=int(opts.get("seed", 0)),
                                           verify=bool(opts.get("verify", False)))
        return {"rank": ad.rank, "begun": True}

    def grid_update_load(self, source_json: str) -> dict:
        s = self._grid_session
        tensors = read_source(source_json, self._device(), nccl=getattr(self, "_grid_nccl", None))
        s.load(tensors.items())
        return {"rank": s.adapter.rank, "tensors": len(tensors)}

    def grid_update_finish(self) -> dict:
        r = self._grid_session.finish()
        return dataclasses.asdict(r)

    def grid_update_commit(self, accept: str = "1") -> dict:
        s = self._grid_session
        ad = self._grid()
        ok = s.commit(accept in ("1", "true", "True"))
        return {"rank": ad.rank, "applied": ok, "version": ad.version}

    def grid_update_abort(self) -> dict:
        s = getattr(self, "_grid_session", None)
        check = dataclasses.asdict(s.abort()) if s is not None else None
        return {"rank": self._grid().rank, "version": self._grid().version, "check": check}

    def grid_state(self) -> dict:
        ad = self._grid()
        s = getattr(self, "_grid_session", None)
        return {"rank": ad.rank, "version": ad.version, "torn": bool(s.torn) if s else False,
                "grid_layers": sum(1 for _ in ad.grid_layers()), "derived": len(ad.registry)}

    def grid_fingerprints(self, names_json: str = "[]") -> dict:
        params = dict(self._grid().model().named_parameters())
        names = json.loads(names_json) or list(params)
        return {n: fingerprint(params[n]) for n in names if n in params}

    def grid_nccl_init(self, info_json: str) -> dict:
        """Join the trainer's NCCL group: {"host", "port", "world_size", "rank_offset"}; this worker
        is rank ``rank_offset + its engine rank`` (the trainer is rank 0)."""
        from .compat import nccl_group
        info = json.loads(info_json)
        check_rendezvous(str(info["host"]))       # in-process callers too: loopback or MXFP8_GRID_NCCL_HOSTS
        rank = int(info.get("rank_offset", 1)) + self._grid().rank
        self._grid_nccl = nccl_group(info["host"], info["port"], rank, info["world_size"], self._device())
        return {"rank": self._grid().rank, "nccl_rank": rank}

