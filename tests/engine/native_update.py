"""A trainer that never imports this project updates a live engine (run by test_vllm_native_update.py).

    python native_update.py '{"kind": "dense" | "moe", "root": DIR, "kernel": "auto", "dtype": "float32", "eager": true,
                                "capture_sizes": [1, 2, 4, 8], "path": "collective_rpc" | "weight_transfer"}'

As RL frameworks do it today: ``llm.collective_rpc(fn)`` where ``fn(worker)`` calls
``worker.model_runner.model.load_weights(weights=iter(pairs))`` with HF-named BF16-representable
tensors -- first every tensor of model B (full update), then only decoder layer 0 of model A
(partial update).  ``path`` "weight_transfer" sends the same tensors through vLLM's weight-transfer
API instead (``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, a backend shaped like vLLM's NCCL and IPC engines: a layerwise reload
around ``model.load_weights``; ``layerwise_backend.py``).  After each, prompt logprobs are
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
    transfer = spec.get("path", "collective_rpc") == "weight_transfer"
    if transfer:        # the test backend hands tensors over in the request: an in-process engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import layerwise_backend
        layerwise_backend.register()
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
    llm = LLM(model=a, quantization="mxfp8-learner-grid", dtype=spec.get("dtype", "float32"),
              enforce_eager=spec.get("eager", True),
              **({"compilation_config": {"cudagraph_capture_sizes": spec["capture_sizes"]}} if spec.get("capture_sizes") else {}), max_model_len=256,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.1), seed=0, hf_overrides=overrides,
              **({"weight_transfer_config": {"backend": "layerwise_local"}} if transfer else {}))
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
    else:
        def update(pairs, version):
            llm.collective_rpc(push(pairs))

    ptrs = llm.apply_model(inspect.derived_ptrs)[0]
    out = {"start_vs_A": maxdiff(engine_lp(), learner["A"](prompts)), "path": spec.get("path", "collective_rpc")}
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
    report_and_exit(llm, out)


if __name__ == "__main__":
    main()
