"""A trainer that never imports this project updates a live engine (run by test_vllm_native_update.py).

    python native_update.py '{"kind": "dense" | "moe", "root": DIR, "kernel": "auto", "dtype": "float32", "eager": true,
                                "capture_sizes": [1, 2, 4, 8],
                                "path": "collective_rpc" | "weight_transfer" | "weight_transfer_ipc",
                                "ipc_packed_bytes": 0, "trainer_device": "cuda"}'

As RL frameworks do it today: ``llm.collective_rpc(fn)`` where ``fn(worker)`` calls
``worker.model_runner.model.load_weights(weights=iter(pairs))`` with HF-named BF16-representable
tensors -- first every tensor of model B (full update), then only decoder layer 0 of model A
(partial update).  ``path`` "weight_transfer" sends the same tensors through vLLM's weight-transfer
API instead (``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, a backend shaped like vLLM's NCCL and IPC engines: a layerwise reload
around ``model.load_weights``; ``layerwise_backend.py``).  ``path`` "weight_transfer_ipc" (vLLM 0.26,
a GPU) uses vLLM's real ``ipc`` backend: this process is the trainer, holding the tensors on the
engine's GPU, and ``IPCWeightTransferEngine.trainer_send_weights`` shares them as CUDA IPC handles
with a callable ``send_mode`` that hands each update info to ``llm.update_weights``; the engine runs
in its own process (V1 multiprocessing on: CUDA IPC needs two processes).  ``ipc_packed_bytes`` > 0
sends through vLLM's packed mode (one reused IPC buffer of that size, one ``update_weights`` per
chunk).  That path then also runs the project's seven checks (``client.verify_weights``) against
what the trainer sent: the mixed model must verify, model B must be refused.  vLLM 0.26's
``ipc_engine.py`` imports ``ray``; without a real Ray, ``stubs/ray`` (which refuses every use) goes
on ``sys.path`` and ``PYTHONPATH`` for this path only.  ``trainer_device`` "cpu" is for a CPU dry
run with a stand-in for CUDA IPC only.  After each update, prompt logprobs are
compared with the learner's grid forward of
the weights the engine should now hold (float32), and the untouched layers' parameter digests
with what they were, and every kernel's derived tensors (packed weights, permuted scales, decoded
copies) with a rebuild from the new bytes.  ``dtype`` bfloat16 runs the GPU's Marlin kernels
(they decline float32); there the logprob distances carry bf16 noise.  Prints one ``RESULT {...}`` line.
"""

import json
import os
import sys


sys.path.insert(0, os.path.dirname(__file__))
from sync_scenarios import learner_fn, load_dir, maxdiff, report_and_exit  # noqa: E402

PATHS = ("collective_rpc", "weight_transfer", "weight_transfer_ipc")
IPC = "weight_transfer_ipc"
STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")


def ray_for_ipc():
    """vLLM 0.26's ``ipc_engine.py`` imports ``ray`` at module top; the H200 image has none.  Without
    a real Ray, ``stubs/ray`` (it refuses every use) goes first on ``sys.path`` here and on ``PYTHONPATH``
    for the engine's processes, which import that module when they load the model."""
    import importlib.util
    if importlib.util.find_spec("ray") is not None:
        return "installed"
    sys.path.insert(0, STUBS)
    os.environ["PYTHONPATH"] = os.pathsep.join([STUBS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])
    import ray
    assert getattr(ray, "MXFP8_GRID_TEST_STUB", False), ray
    return "stub"


def finish_weight_update(llm, version):
    """vLLM 0.32's ``LLM.finish_weight_update`` takes the new weight version; 0.26's takes nothing
    (``vllm/entrypoints/llm.py``) and keeps no version."""
    import inspect
    if "weight_version" in inspect.signature(llm.finish_weight_update).parameters:
        llm.finish_weight_update(weight_version=version)
    else:
        llm.finish_weight_update()


def ipc_pusher(llm, spec):
    """vLLM 0.26's CUDA-IPC backend as a colocated trainer drives it.  Per update: the trainer's tensors
    on the engine's GPU; ``llm.start_weight_update()`` (the workers' layerwise reload begins);
    ``IPCWeightTransferEngine.trainer_send_weights(iterator, IPCTrainerSendWeightsArgs(send_mode=deliver))``
    shares them (``reduce_tensor``: CUDA IPC handles keyed by the GPU's UUID) and calls ``deliver`` with
    each ``IPCWeightTransferUpdateInfo`` (one, or one per chunk when packed), which hands it to
    ``llm.update_weights`` -- what its ``send_mode="ray"`` does through an actor handle, with the
    fields as they are (no ``asdict`` deep copy); the workers map the handles and ``load_weights``
    them; ``llm.finish_weight_update()`` ends the reload.  Returns ``update(pairs, version)`` and
    the log of ``deliver`` calls."""
    import dataclasses
    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
    if not hasattr(IPCWeightTransferEngine, "trainer_send_weights"):
        raise RuntimeError("this vLLM's ipc backend has no IPCWeightTransferEngine.trainer_send_weights "
                           "(the path is written against vLLM 0.26)")
    device = torch.device(spec.get("trainer_device", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("path weight_transfer_ipc needs a GPU (CUDA IPC)")
    packed = int(spec.get("ipc_packed_bytes", 0))
    calls = []

    def deliver(info):
        handles = info.ipc_handles if isinstance(info.ipc_handles, list) else [info.ipc_handles]
        calls.append({"tensors": len(info.names), "packed": bool(info.packed), "handles": len(handles),
                      "gpus": len({k for h in handles for k in h})})
        llm.update_weights({"update_info": {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}})

    def update(pairs, version):
        held = [(n, t.to(device)) for n, t in pairs]      # the trainer's weights, on the engine's GPU
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        args = IPCTrainerSendWeightsArgs(send_mode=deliver, packed=packed > 0,
                                         **({"packed_buffer_size_bytes": packed} if packed else {}))
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(held), args)
        finish_weight_update(llm, version)
        del held
    return update, calls


def verify_case(client, tensors, state):
    """The seven checks against ``tensors`` (what the trainer says the engine holds); the replay is rolled back."""
    before = state()
    rep = client.verify_weights(tensors, format="bf16")
    return {"verified": rep.extra.get("verified"), "failed": rep.failed(), "applied": rep.applied, "error": rep.error,
            "checks": {c.name: c.ok for c in rep.checks},
            "found": [d for c in rep.check("engine_as_found") for d in c.details][:6],
            "unchanged": state() == before}


def push_weight_transfer(llm, pairs, version):
    """vLLM's weight-transfer API, as an RL framework that uses it calls it."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"names": [n for n, _ in pairs], "tensors": [t for _, t in pairs]}})
    llm.finish_weight_update(weight_version=version)


def push(pairs):
    """The function a trainer ships to every worker: the engine's own loader, nothing of ours."""
    def fn(worker):
        model = worker.model_runner.model if hasattr(worker.model_runner, "model") else worker.model_runner.get_model()
        model.load_weights(weights=iter(pairs))
        return True
    return fn


def two_models(spec):
    """Tiny seeded checkpoints A (seed 0) and B (seed 1) of the spec's kind, and their tensors."""
    from mxfp8_learner_grid.common.tiny_model import save_model
    root, moe = spec["root"], spec["kind"] == "moe"
    a = str(save_model(os.path.join(root, "A"), moe=moe, seed=0))
    b = str(save_model(os.path.join(root, "B"), moe=moe, seed=1))
    return a, b, load_dir(a), load_dir(b)


def main():
    spec = json.loads(sys.argv[1])
    path = spec.get("path", "collective_rpc")
    if path not in PATHS:
        raise SystemExit(f"path must be one of {PATHS}; got {path!r}")
    transfer = path == "weight_transfer"
    ipc = path == IPC
    out = {"path": path}
    if transfer:        # the test backend hands tensors over in the request: an in-process engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import layerwise_backend
        layerwise_backend.register()
    if not ipc:
        run(spec, path, transfer, ipc, out)
        return
    # CUDA IPC: the engine in its own process (the trainer's handles cannot be opened by the process
    # that made them); the IPC handles travel inside the update_weights RPC, pickled (types, dtypes)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    out["ray"] = ray_for_ipc()
    out["stage"] = "start"
    try:
        run(spec, path, transfer, ipc, out)
    except BaseException as exc:       # one RESULT line with what was reached, for a run on a scarce GPU
        import traceback
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-4000:]
        print("RESULT " + json.dumps(out, default=str), flush=True)
        sys.stdout.flush()
        try:
            _ENGINE[0].llm_engine.engine_core.shutdown()
        except Exception:
            pass
        os._exit(1)


_ENGINE = [None]        # the live LLM, for the error path's engine shutdown


def run(spec, path, transfer, ipc, out):
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    root = spec["root"]
    a, b, wa, wb = two_models(spec)
    # the mixed model a partial update must produce: B everywhere, layer 0 from A
    mixed = os.path.join(root, "M")
    os.makedirs(mixed, exist_ok=True)
    for f in os.listdir(b):
        if not f.endswith(".safetensors"):
            with open(os.path.join(b, f), "rb") as src, open(os.path.join(mixed, f), "wb") as dst:
                dst.write(src.read())
    layer0 = {n: t for n, t in wa.items() if n.startswith("model.layers.0.")}
    full_b = {}
    for f in sorted(os.listdir(b)):
        if f.endswith(".safetensors"):
            full_b.update(load_file(os.path.join(b, f)))
    for n, t in layer0.items():
        full_b[n] = t.to(full_b[n].dtype)
    for f in os.listdir(mixed):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(mixed, f))
    save_file(full_b, os.path.join(mixed, "model.safetensors"))

    learner = {"A": learner_fn(a), "B": learner_fn(b), "M": learner_fn(mixed)}
    prompts = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]
    overrides = {"quantization_config_dict_json": json.dumps({"kernel": spec.get("kernel", "auto")})}
    extra = {}
    if transfer:
        extra["weight_transfer_config"] = {"backend": "layerwise_local"}
    if ipc:             # vLLM's own CUDA-IPC backend, and the grid RPCs for the seven checks afterwards
        from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER
        extra.update(weight_transfer_config={"backend": "ipc"}, worker_extension_cls=GRID_WORKER)
        out["stage"] = "engine start"
    llm = LLM(model=a, quantization="mxfp8-learner-grid", dtype=spec.get("dtype", "float32"),
              enforce_eager=spec.get("eager", True),
              **({"compilation_config": {"cudagraph_capture_sizes": spec["capture_sizes"]}} if spec.get("capture_sizes") else {}), max_model_len=256,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.1), seed=0, hf_overrides=overrides,
              **extra)
    _ENGINE[0] = llm
    from vllm import SamplingParams

    def engine_lp():
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in res]

    from mxfp8_learner_grid.vllm_plugin import inspect

    def state():
        return llm.apply_model(inspect.param_digests)[0]

    if transfer:
        llm.init_weight_transfer_engine({"init_info": {}})

        def update(pairs, version):
            push_weight_transfer(llm, pairs, version)
    elif ipc:
        import time
        from mxfp8_learner_grid.vllm_plugin.client import connect
        client = connect(llm, digest="full")          # connected before the updates, as a trainer would be
        out["stage"] = "init_weight_transfer_engine"
        llm.init_weight_transfer_engine({"init_info": {}})
        send, out["ipc_sends"] = ipc_pusher(llm, spec)
        out["update_s"] = {}

        def update(pairs, version):
            out["stage"] = f"ipc update {version}"
            t0 = time.perf_counter()
            send(pairs, version)
            out["update_s"][version] = round(time.perf_counter() - t0, 3)
            out["stage"] = f"after ipc update {version}"
    else:
        def update(pairs, version):
            llm.collective_rpc(push(pairs))

    ptrs = llm.apply_model(inspect.derived_ptrs)[0]
    out["start_vs_A"] = maxdiff(engine_lp(), learner["A"](prompts))
    update(list(wb.items()), "B")
    lp = engine_lp()
    out["full_vs_B"], out["full_vs_A"] = maxdiff(lp, learner["B"](prompts)), maxdiff(lp, learner["A"](prompts))
    out["full_stale_derived"] = llm.apply_model(inspect.stale_derived)[0]
    before = state()
    update(list(layer0.items()), "M")
    after = state()
    lp = engine_lp()
    out["partial_vs_M"], out["partial_vs_B"] = maxdiff(lp, learner["M"](prompts)), maxdiff(lp, learner["B"](prompts))
    out["partial_stale_derived"] = llm.apply_model(inspect.stale_derived)[0]
    out["untouched_changed"] = sorted(n for n in before if ".layers.0." not in n and before[n] != after[n])
    out["touched_unchanged"] = sorted(n for n in before if ".layers.0." in n and n.endswith("weight")
                                      and before[n] == after[n])
    out["kernels"] = sorted(set(llm.apply_model(inspect.grid_kernels)[0].values()))
    now = llm.apply_model(inspect.derived_ptrs)[0]
    out["derived_moved"] = sorted(n for n in ptrs if now.get(n) != ptrs[n])      # captured graphs read these
    if transfer:
        out["weight_version"] = llm.get_weight_version()
    if ipc:
        out["weight_version"] = llm.get_weight_version() if hasattr(llm, "get_weight_version") else None
        # the seven checks against what the trainer sent: B, then layer 0 of A (the mixed model M), in the
        # engine's dtype; and B alone, which the engine no longer holds, must be refused
        vdtype = getattr(torch, spec.get("dtype", "float32"))
        out["stage"] = "verify M"
        out["verify_M"] = verify_case(client, load_dir(mixed, vdtype), state)
        out["stage"] = "verify B"
        out["verify_B"] = verify_case(client, load_dir(b, vdtype), state)
        lp = engine_lp()
        out["after_verify_vs_M"] = maxdiff(lp, learner["M"](prompts))
        out["after_verify_stale_derived"] = llm.apply_model(inspect.stale_derived)[0]
        out["stage"] = "done"
    report_and_exit(llm, out)


if __name__ == "__main__":
    main()
