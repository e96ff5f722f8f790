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

The bridge itself -- control message, reply file, update-session bracketing -- is engine-agnostic
(``common.sync.bridge.BridgeTransport``); this module supplies SGLang's calls.
``begin/end_weight_update`` exist from the 0.5.23 update sessions on (0.5.17 has none, and
loads outside any session); where they exist, a grid call made outside an update (the
version query at connect, fingerprints) is wrapped in its own session, since SGLang refuses
tensor updates outside one.  The engine must run with ``--custom-weight-loader
mxfp8_learner_grid.sglang_plugin.updater.grid_loader`` (``connect`` checks), ``dp_size`` and
``pp_size`` 1, no speculative draft model, and share a host with the trainer (the replies are
files under ``/dev/shm``).
"""

from __future__ import annotations

from typing import Optional

import torch

from mxfp8_learner_grid.common.sync.bridge import BridgeTransport
from mxfp8_learner_grid.common.sync.client import GridSyncClient
from mxfp8_learner_grid.common.sync.protocol import JSONClient
from mxfp8_learner_grid.common.sync.transport import run_beside

from .updater import GRID_LOADER

STAGINGS = BridgeTransport.STAGINGS
#: the vLLM plugin's staging names: SGLang's serializer picks by device
ALIASES = {"shm": "tensor", "cuda_ipc": "tensor", "cuda_ipc_tensors": "tensor"}
PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangTransport(BridgeTransport):
    """What every SGLang transport shares: the checks of the engine's configuration, SGLang's
    weight-update group; a subclass supplies the SGLang calls (``common.sync.bridge.BridgeTransport``)
    and ``_init_group``."""

    no_reply_hint = f"is the engine on this host, started with --custom-weight-loader {GRID_LOADER}?"

    def __init__(self, server_info: dict, staging: str = "tensor", pause_mode: str = "abort"):
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
        self.pause_mode = pause_mode
        super().__init__(ALIASES.get(staging, staging))

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

    def _control_tensor(self) -> torch.Tensor:
        """The tensor the control message's name rides on: empty, so it pickles by value (no shared-memory
        handle, which a separately launched server could not open) -- unless SGLang's
        ``monkey_patch_torch_reductions`` is active in this process (its trainer-side helpers apply it):
        that pickles CUDA tensors only."""
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


class HTTPTransport(JSONClient, SGLangTransport):
    """A running ``sglang serve`` / ``python -m sglang.launch_server`` with ``--custom-weight-loader GRID_LOADER``."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600, staging: str = "tensor",
                 pause_mode: str = "abort"):
        JSONClient.__init__(self, base_url, api_key, timeout)
        status, info = self._get("/server_info")                          # 0.5.17 and 0.5.23
        if status >= 400:
            raise RuntimeError(f"/server_info: HTTP {status}: {info}")
        SGLangTransport.__init__(self, info, staging, pause_mode)

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
