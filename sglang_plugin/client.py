"""Trainer-side transports for SGLang: an in-process ``sglang.Engine`` or a running server (HTTP).

    from mxfp8_learner_grid.sglang_plugin.client import GRID_LOADER, connect
    engine = sgl.Engine(model_path=..., quantization="mxfp8-learner-grid", custom_weight_loader=[GRID_LOADER])
    client = connect(engine)                              # or connect("http://127.0.0.1:30000", api_key=...)
    report = client.update_weights(model.state_dict(), format="bf16", version=7)
    assert report.ok, report.summary()

The client is the vLLM plugin's (``common.sync.client.GridSyncClient``: the same
``update_weights`` and report); this module maps its transport calls onto SGLang's own
weight-update machinery:

    client                      SGLang
    pause()                     pause_generation(mode=pause_mode); begin_weight_update()
    rpc("grid_...", args)       update_weights_from_tensor(load_format=GRID_LOADER, flush_cache=False):
                                a control message run on every TP rank (sglang_plugin/updater.py),
                                results read back from the reply file the ranks write
    bucket, staging="tensor"    the bucket's tensors ride in that same request (SGLang's serializer:
                                CUDA IPC handles on a GPU, shared memory on the CPU)
    bucket, staging="nccl"      update_weights_from_distributed(names, dtypes, shapes, group) while the
                                trainer broadcasts over the group SGLang's init_weights_update_group
                                formed; then a control message collects each rank's outcome
    commit, accepted            the commit request carries weight_version=str(version): SGLang's
                                weight_version moves with the commit, and only if it succeeds
    reset_prefix_cache()        flush_cache() (a refused flush is an error, never silent)
    resume()                    end_weight_update(); continue_generation()

``begin/end_weight_update`` exist from the 0.5.23 update sessions on (0.5.17 has none, and
loads outside any session); where they exist, a grid call made outside an update (the
version query at connect, fingerprints) is wrapped in its own session, since SGLang refuses
tensor updates outside one.  The engine must run with ``--custom-weight-loader
mxfp8_learner_grid.sglang_plugin.updater.grid_loader`` (``connect`` checks), ``dp_size`` and
``pp_size`` 1, no speculative draft model, and share a host with the trainer (the replies are
files under ``/dev/shm``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Optional

import torch

from mxfp8_learner_grid.common.sync.client import GridSyncClient
from mxfp8_learner_grid.common.sync.rank_service import checked
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected
from mxfp8_learner_grid.common.sync.transport import run_beside, staging_dir

from .updater import CONTROL, GRID_LOADER, REPLY_PREFIX

STAGINGS = ("tensor", "nccl")
ALIASES = {"shm": "tensor", "cuda_ipc": "tensor"}    # the vLLM plugin's names: SGLang's serializer picks by device
PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangTransport:
    """What every SGLang transport shares; a subclass supplies the SGLang calls (``_update_from_tensor``,
    ``_update_from_distributed``, ``_session_call``, ``_pause_generation``, ``_continue_generation``,
    ``_flush``, ``_init_group``)."""

    def __init__(self, server_info: dict, staging: str = "tensor", pause_mode: str = "abort"):
        staging = ALIASES.get(staging, staging)
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}; got {staging!r}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}; got {pause_mode!r}")
        loaders = server_info.get("custom_weight_loader") or []
        if GRID_LOADER not in loaders:
            raise ValueError(f"the SGLang engine must be started with --custom-weight-loader {GRID_LOADER} "
                             f"(Engine(custom_weight_loader=[...])); it has {loaders}")
        for key in ("dp_size", "pp_size"):
            if int(server_info.get(key) or 1) != 1:
                raise ValueError(f"grid weight updates need {key}=1 (SGLang's tensor updates are per TP group); "
                                 f"got {server_info[key]}")
        self.tp_size = int(server_info.get("tp_size") or 1)
        self.staging, self.pause_mode = staging, pause_mode
        self.reply_dir = tempfile.mkdtemp(prefix=REPLY_PREFIX, dir=staging_dir())
        self.close = weakref.finalize(self, shutil.rmtree, self.reply_dir, True)   # also at exit
        self.sessions: Optional[bool] = None        # has begin/end_weight_update (0.5.23); None: not yet known
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
                if src["kind"] == "loaded":               # the bytes go SGLang's broadcast way first
                    names, dtypes, shapes = (list(x) for x in zip(*src["tensors"]))
                    ok, msg = self._update_from_distributed(names, dtypes, shapes, self.group_name)
                    if not ok:
                        raise RuntimeError(f"update_weights_from_distributed failed: {msg}")
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
            return {"kind": "loaded",
                    "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in bucket]}
        self._bucket = [(n, t.detach().contiguous()) for n, t in bucket]
        return {"kind": "inline", "names": [n for n, _ in bucket]}

    @property
    def send(self):
        """Push a staged bucket while SGLang's receiving request runs (nccl only; None: nothing to push)."""
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
            raise RuntimeError("SGLang refused to flush its prefix cache (requests still running or queued): "
                               "KV computed with the old weights would be reused")

    def init_group(self, host: str = "127.0.0.1", port: int = 29555, group_name: str = "mxfp8_grid",
                   backend: str = "nccl") -> None:
        """Form SGLang's weight-update group: the trainer is rank 0, TP rank r is 1 + r."""
        from sglang.srt.utils import init_custom_process_group
        world = 1 + self.tp_size
        join = run_beside(self._init_group, host, int(port), 1, world, group_name, backend)
        self.group = init_custom_process_group(backend=backend, init_method=f"tcp://{host}:{port}",
                                               world_size=world, rank=0, group_name=group_name)
        ok, msg = join()
        if not ok:
            raise RuntimeError(f"init_weights_update_group failed: {msg}")
        self.group_name = group_name

    # -- the bridge --------------------------------------------------------------------------
    def _control(self, method: str, args, extra: list, weight_version: Optional[str]) -> list:
        reply = os.path.join(self.reply_dir, f"{method}-{uuid.uuid4().hex}.json")
        ctl = CONTROL + json.dumps({"method": method, "args": list(args), "reply": reply})
        ok, msg = self._update_from_tensor([(ctl, _control_tensor())] + list(extra), weight_version)
        try:
            if not ok:
                raise RuntimeError(f"{method}: SGLang refused the request: {msg}")
            try:
                with open(reply) as f:
                    results = json.load(f)
            except FileNotFoundError:
                raise RuntimeError(f"{method}: no reply from the engine's workers in {self.reply_dir} (is the "
                                   f"engine on this host, started with --custom-weight-loader {GRID_LOADER}?)") \
                    from None
        finally:
            try:
                os.unlink(reply)
            except FileNotFoundError:
                pass
        bad = [r for r in results if not r["ok"]]
        if bad:
            e = bad[0]
            more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
            if e["type"] == "UpdateRejected":
                raise UpdateRejected(e["error"] + more)
            raise RuntimeError((e["error"] if e["type"] == "RuntimeError" else f"{e['type']}: {e['error']}") + more)
        return [r["result"] for r in sorted(results, key=lambda r: r["rank"])]

    def _begin(self) -> None:
        if self.sessions is False or self.in_session:
            return
        r = self._session_call("begin")
        if r is None:                                    # 0.5.17: no update sessions
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


def _control_tensor() -> torch.Tensor:
    """The tensor the control message's name rides on: empty, so it pickles by value (no shared-memory
    handle, which a separately launched server could not open) -- unless SGLang's
    ``monkey_patch_torch_reductions`` is active in this process (its trainer-side helpers apply it): that
    pickles CUDA tensors only."""
    from torch.multiprocessing import reductions
    if hasattr(reductions, "_reduce_tensor_original") and torch.cuda.is_available():
        return torch.zeros(1, dtype=torch.uint8, device="cuda")
    return torch.empty(0, dtype=torch.uint8)


def _generate_args(prompt_logprobs: bool) -> dict:
    kw = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if prompt_logprobs:
        kw.update(return_logprob=True, logprob_start_len=0)
    return kw


def _prompt_lps(meta: dict) -> list[float]:
    return [float(x[0]) for x in meta["input_token_logprobs"][1:]]


class EngineTransport(SGLangTransport):
    """An in-process ``sglang.Engine`` started with ``custom_weight_loader=[GRID_LOADER]``."""

    def __init__(self, engine, staging: str = "tensor", pause_mode: str = "abort"):
        self.engine = engine
        super().__init__(engine.get_server_info(), staging, pause_mode)

    def _run(self, coro):
        return self.engine.loop.run_until_complete(coro)

    def _update_from_tensor(self, named, weight_version):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)],
            load_format=GRID_LOADER, flush_cache=False, weight_version=weight_version)
        return self._run(self.engine.tokenizer_manager.update_weights_from_tensor(obj, None))

    def _update_from_distributed(self, names, dtypes, shapes, group_name):
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name=group_name,
                                                           flush_cache=False)

    def _session_call(self, which):
        fn = getattr(self.engine, f"{which}_weight_update", None)
        return None if fn is None else fn()

    def _pause_generation(self):
        from sglang.srt.managers.io_struct import PauseGenerationReqInput
        self._run(self.engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=self.pause_mode)))

    def _continue_generation(self):
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput
        self._run(self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput()))

    def _flush(self) -> bool:
        return bool(self.engine.flush_cache().success)

    def _init_group(self, host, port, rank_offset, world, group_name, backend):
        return self.engine.init_weights_update_group(host, port, rank_offset, world, group_name, backend=backend)

    def cached_tokens(self, prompt) -> int:
        out = self.engine.generate(input_ids=list(prompt), **_generate_args(False))
        return int(out["meta_info"].get("cached_tokens") or 0)

    def prompt_logprobs(self, prompts):
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], **_generate_args(True))
        return [_prompt_lps(o["meta_info"]) for o in outs], [int(o["meta_info"].get("cached_tokens") or 0)
                                                              for o in outs]


class HTTPTransport(SGLangTransport):
    """A running ``sglang serve`` / ``python -m sglang.launch_server`` with ``--custom-weight-loader GRID_LOADER``."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600, staging: str = "tensor",
                 pause_mode: str = "abort"):
        import requests
        self.s = requests.Session()
        self.base, self.timeout = base_url.rstrip("/"), timeout
        if api_key:
            self.s.headers["Authorization"] = f"Bearer {api_key}"
        r = self.s.get(self.base + "/server_info", timeout=timeout)      # 0.5.17 and 0.5.23
        r.raise_for_status()
        super().__init__(r.json(), staging, pause_mode)

    def _post(self, path, body=None):
        """(status, JSON body or text) of a POST."""
        r = self.s.post(self.base + path, json=body or {}, timeout=self.timeout)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def _ok(self, path, body=None):
        status, out = self._post(path, body)
        if isinstance(out, dict) and "success" in out:
            return bool(out["success"]), str(out.get("message", ""))
        return status < 400, str(out)

    def _update_from_tensor(self, named, weight_version):
        from sglang.srt.utils import MultiprocessingSerializer
        payload = [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(self.tp_size)]
        return self._ok("/update_weights_from_tensor", {
            "serialized_named_tensors": payload, "load_format": GRID_LOADER, "flush_cache": False,
            "weight_version": weight_version})

    def _update_from_distributed(self, names, dtypes, shapes, group_name):
        return self._ok("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": False})

    def _session_call(self, which):
        status, out = self._post(f"/{which}_weight_update")
        if status == 404:
            return None
        return (bool(out.get("success")), str(out.get("message"))) if isinstance(out, dict) else (False, str(out))

    def _pause_generation(self):
        status, out = self._post("/pause_generation", {"mode": self.pause_mode})
        if status >= 400:
            raise RuntimeError(f"pause_generation: HTTP {status}: {out}")

    def _continue_generation(self):
        status, out = self._post("/continue_generation")
        if status >= 400:
            raise RuntimeError(f"continue_generation: HTTP {status}: {out}")

    def _flush(self) -> bool:
        return self._post("/flush_cache")[0] == 200

    def _init_group(self, host, port, rank_offset, world, group_name, backend):
        return self._ok("/init_weights_update_group", {
            "master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world,
            "group_name": group_name, "backend": backend})

    def _generate(self, input_ids, prompt_logprobs: bool):
        status, out = self._post("/generate", {"input_ids": input_ids, **_generate_args(prompt_logprobs)})
        if status >= 400:
            raise RuntimeError(f"/generate: HTTP {status}: {out}")
        return out

    def cached_tokens(self, prompt) -> int:
        return int(self._generate(list(prompt), False)["meta_info"].get("cached_tokens") or 0)

    def prompt_logprobs(self, prompts):
        outs = [self._generate(list(p), True) for p in prompts]
        return [_prompt_lps(o["meta_info"]) for o in outs], [int(o["meta_info"].get("cached_tokens") or 0)
                                                              for o in outs]


def connect(target, api_key: Optional[str] = None, staging: str = "tensor", nccl: Optional[dict] = None,
            pause_mode: str = "abort", **client_kwargs) -> GridSyncClient:
    """A GridSyncClient over an ``sglang.Engine`` or a server URL (the vLLM plugin's ``connect``).
    ``staging="nccl"`` forms SGLang's weight-update group now (``nccl``: host, port, group_name)."""
    if isinstance(target, str):
        t = HTTPTransport(target, api_key, staging=staging, pause_mode=pause_mode)
    else:
        t = EngineTransport(target, staging, pause_mode)
    if t.staging == "nccl":
        t.init_group(**(nccl or {}))
    return GridSyncClient(t, **client_kwargs)
