"""Trainer-side transports for vLLM: an in-process ``LLM`` or a running ``vllm serve``.

    from mxfp8_learner_grid.vllm_plugin.client import connect
    client = connect(llm)                                      # LLM(..., worker_extension_cls=GRID_WORKER)
    client = connect("http://127.0.0.1:8000", api_key=...)     # vllm serve ... (see vllm_plugin/http.py)
    report = client.update_weights(model.state_dict(), format="bf16", version=7)
    assert report.ok, report.summary()

Bulk bytes travel (``staging=``):

* ``"shm"`` -- safetensors files in shared memory (``/dev/shm``): the CPU path, any host-local trainer;
* ``"cuda_ipc"`` -- CUDA IPC when trainer and engine share a GPU: each bucket packed into one
  staging buffer the trainer keeps (one handle per bucket); ``"cuda_ipc_tensors"`` maps the
  trainer's own tensors instead, one handle each, no copy (in-process only: IPC
  handles are pickles and are never accepted over HTTP);
* ``"nccl"`` -- an NCCL broadcast from the trainer's GPU to every engine worker (in-process or
  over HTTP), over a group formed at connect time: ``connect(llm, staging="nccl",
  nccl={"host": "127.0.0.1", "port": 29555})``.  The trainer is rank 0 on its current CUDA
  device; the workers join with the ``grid_nccl_init`` RPC.  A failed bucket can leave the
  group with unmatched broadcasts: form a new one (another port) after an error.
"""

from __future__ import annotations

import json
from typing import Optional

from mxfp8_learner_grid.common.sync.client import GridSyncClient
from mxfp8_learner_grid.common.sync.protocol import JSONClient, raise_error
from mxfp8_learner_grid.common.sync.rank_service import checked
from mxfp8_learner_grid.common.sync.transport import Stager, run_beside

GRID_WORKER = "mxfp8_learner_grid.vllm_plugin.worker.GridWorkerExtension"
GRID_MIDDLEWARE = "mxfp8_learner_grid.vllm_plugin.http.GridUpdateMiddleware"
STAGINGS = Stager.STAGINGS


class _Staging(Stager):
    """Bucket staging (``common.sync.transport.Stager``) plus vLLM's NCCL group with the workers."""

    def init_nccl(self, host: str = "127.0.0.1", port: int = 29555, device=None) -> None:
        """Form the trainer<->workers NCCL group (the trainer is rank 0 on ``device``)."""
        import torch
        from .compat import nccl_group
        world = 1 + len(self.rpc("grid_state"))
        join = run_beside(self.rpc, "grid_nccl_init", json.dumps({"host": host, "port": int(port),
                                                                   "world_size": world, "rank_offset": 1}))
        self.nccl = nccl_group(host, port, 0, world, device if device is not None else torch.cuda.current_device())
        join()


class LLMTransport(_Staging):
    """An in-process ``vllm.LLM`` built with ``worker_extension_cls=GRID_WORKER``."""

    def __init__(self, llm, staging: str = "shm"):
        super().__init__(staging)
        self.llm = llm

    def rpc(self, method, *args):
        return checked(method, self.llm.collective_rpc(method, args=tuple(args)))

    def pause(self):            # an in-process LLM runs nothing while this thread updates it
        pass

    def resume(self):
        pass

    def reset_prefix_cache(self):
        self.llm.reset_prefix_cache()

    def cached_tokens(self, prompt) -> int:
        """Prompt tokens a plain request (no prompt logprobs: those bypass the cache) got from the prefix cache."""
        from vllm import SamplingParams
        out = self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0),
                                use_tqdm=False)[0]
        return int(out.num_cached_tokens or 0)

    def prompt_logprobs(self, prompts):
        from vllm import SamplingParams
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
        lps = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]
        return lps, [int(o.num_cached_tokens or 0) for o in outs]


class HTTPTransport(JSONClient, _Staging):
    """A running ``vllm serve`` started with the grid worker extension and middleware."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600, model: Optional[str] = None,
                 staging: str = "shm"):
        if staging.startswith("cuda_ipc"):
            raise ValueError("CUDA IPC handles are never accepted over HTTP; use staging='shm' or 'nccl'")
        _Staging.__init__(self, staging)
        JSONClient.__init__(self, base_url, api_key, timeout)
        self.model = model

    def _post(self, path, body=None):
        status, out = JSONClient._post(self, path, body)
        raise_error(status, out, path)        # a refusal's problems by condition come back as data
        return out

    def rpc(self, method, *args):
        return self._post("/grid/rpc", {"method": method, "args": list(args)})["results"]

    def pause(self):
        self._post("/grid/pause")

    def resume(self):
        self._post("/grid/resume")

    def reset_prefix_cache(self):
        self._post("/grid/reset_prefix_cache")

    def cached_tokens(self, prompt) -> int:
        r = self.s.post(self.base + "/v1/completions", timeout=self.timeout, json={
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def prompt_logprobs(self, prompts):
        lps, cached = [], []
        for p in prompts:
            r = self.s.post(self.base + "/v1/completions", timeout=self.timeout, json={
                "model": self.model, "prompt": p, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0})
            r.raise_for_status()
            body = r.json()
            lps.append(body["choices"][0]["logprobs"]["token_logprobs"][1:len(p)])
            cached.append(int((body.get("usage") or {}).get("prompt_tokens_details", {}) and
                              body["usage"]["prompt_tokens_details"].get("cached_tokens") or 0))
        return lps, cached


def connect(target, api_key: Optional[str] = None, staging: str = "shm", nccl: Optional[dict] = None,
            **client_kwargs) -> GridSyncClient:
    """A GridSyncClient over an ``LLM`` object or a server URL.  ``staging="nccl"`` forms the NCCL
    group now (``nccl``: host, port, optional device)."""
    if isinstance(target, str):
        t = HTTPTransport(target, api_key, model=client_kwargs.pop("model", None), staging=staging)
    else:
        t = LLMTransport(target, staging)
    if staging == "nccl":
        t.init_nccl(**(nccl or {}))
    return GridSyncClient(t, **client_kwargs)

