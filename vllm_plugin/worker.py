"""``--worker-extension-cls mxfp8_learner_grid.vllm_plugin.worker.GridWorkerExtension``

RPC methods every vLLM worker gains (``LLM.collective_rpc`` / ``EngineClient.collective_rpc``).
Arguments and results are strings / JSON-able dicts, so the same calls work in-process and
over HTTP.  The trainer-side client (``vllm_plugin.client``) drives them:

    grid_update_begin(manifest_json, options_json)   validate, snapshot, start recording
    grid_update_load(source_json)                    one bucket through vLLM's own loaders
    grid_update_finish()                             local checks + region fingerprints (report dict)
    grid_update_commit("1" | "0")                    accept (bump version) or roll back
    grid_update_abort()                              roll back now
    grid_state()                                     version, torn and open flags, on-grid layer count
    grid_fingerprints(names_json)                    fingerprints of named parameters (for tests)
    grid_nccl_init(info_json)                        join the trainer's NCCL group (nccl buckets)
"""

from __future__ import annotations

import json
import time

import torch

from mxfp8_learner_grid.common.sync.rank_service import RankService
from mxfp8_learner_grid.common.sync.security import check_rendezvous
from mxfp8_learner_grid.common.sync.transport import read_source


class GridWorkerExtension:
    """The ``grid_*`` calls of ``common.sync.rank_service.RankService`` as vLLM worker methods; the
    bucket arrives as a source description (``common.sync.transport``: staged file, shared memory,
    CUDA IPC handles or the trainer's NCCL broadcast)."""

    adapter_cls = None        # the engine adapter (sync_adapter.VLLMAdapter unless a subclass names another)

    def _service(self) -> RankService:
        svc = getattr(self, "_grid_service", None)
        if svc is None:
            svc = self._grid_service = RankService(self._make_adapter)
        return svc

    def _make_adapter(self):
        from .linear_method import register_derived
        from .sync_adapter import VLLMAdapter
        model = self.model_runner.model if hasattr(self.model_runner, "model") else self.model_runner.get_model()
        rank = int(getattr(self, "rank", 0) or 0)
        ad = (self.adapter_cls or VLLMAdapter)(model, self.vllm_config, rank)
        register_derived(model, ad.registry)
        return ad

    def _grid(self):
        return self._service().adapter

    def _device(self):
        return next(self._grid().model().parameters()).device

    def grid_update_begin(self, manifest_json: str, options_json: str = "{}") -> dict:
        return self._service().begin(manifest_json, options_json)

    def grid_update_load(self, source_json: str) -> dict:
        # the bytes are received first (an NCCL broadcast must be drained even when it is refused)
        source = json.loads(source_json)
        device = self._device()
        t0 = time.perf_counter()
        tensors = read_source(source, device, nccl=getattr(self, "_grid_nccl", None))
        try:
            return self._service().load(tensors.items(), read_s=time.perf_counter() - t0)
        finally:
            if source.get("kind") == "cuda_ipc":
                del tensors                   # no view of the trainer's buffer outlives this call,
                torch.cuda.current_stream(device).synchronize()   # and every read of it is done

    def grid_update_finish(self) -> dict:
        return self._service().finish()

    def grid_update_commit(self, accept: str = "1") -> dict:
        return self._service().commit(accept)

    def grid_update_abort(self) -> dict:
        return self._service().abort()

    def grid_state(self) -> dict:
        return self._service().state()

    def grid_fingerprints(self, names_json: str = "[]") -> dict:
        return self._service().fingerprints(names_json)

    def grid_nccl_init(self, info_json: str) -> dict:
        """Join the trainer's NCCL group: {"host", "port", "world_size", "rank_offset"}; this worker
        is rank ``rank_offset + its engine rank`` (the trainer is rank 0)."""
        from .compat import nccl_group
        info = json.loads(info_json)
        check_rendezvous(str(info["host"]))       # in-process callers too: loopback or MXFP8_GRID_NCCL_HOSTS
        rank = int(info.get("rank_offset", 1)) + self._grid().rank
        self._grid_nccl = nccl_group(info["host"], info["port"], rank, info["world_size"], self._device())
        return {"rank": self._grid().rank, "nccl_rank": rank}
