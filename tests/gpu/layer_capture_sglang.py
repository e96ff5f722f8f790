"""Per-layer exactness inside SGLang's model runner on the GPU (a script, not a pytest test).

    PYTHONPATH=tests/gpu:$PYTHONPATH python tests/gpu/layer_capture_sglang.py --shape qwen3-8b --layers 2 --out x.json

The SGLang twin of ``layer_capture.py`` (vLLM).  SGLang's own one-batch runner
(``sglang.benchmark.one_batch``, in this process, TP=1) builds the model with
``--quantization mxfp8-learner-grid`` (the plugin through its entry point), ``load_format=dummy``
(the plugin's valid random grid weights, real layer shapes), CUDA graphs off so that Python sees
every call.  The capture wrappers of ``layer_capture.install`` record each on-grid layer's input
and output over the first calls (the warm-up prefill of ``--prefill`` tokens and its decode
steps); ``layer_capture.check`` recomputes each call with the CPU reference from the very input
the layer received.  Same verdict as the vLLM script: dense >= 99 % elements equal to the exact
result rounded once to bf16 and within the FP32 summation bound; MoE relative error < 2e-3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=300)
    ap.add_argument("--out", default="layers-sglang.json")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "benchmarks"))
    from bench_e2e import make_model_dir
    import layer_capture as lc
    from mxfp8_learner_grid.common.tiny_model import make_tokenizer
    import sglang.benchmark.one_batch as ob

    d = make_model_dir(args.shape, args.layers)
    make_tokenizer(Path(d))                # one_batch loads a tokenizer; the inputs are synthetic ids
    holder = {}
    orig = ob.load_model

    def load_and_wrap(*a, **k):
        runner, tok = orig(*a, **k)
        model = runner.torch_runner.model
        holder["model"] = model
        holder["n"] = lc.install(model)
        return runner, tok
    ob.load_model = load_and_wrap
    import argparse as _ap
    from sglang.srt.plugins import load_plugins
    load_plugins()                         # as a server does: the plugin's entry point adds its --quantization name
    from sglang.srt.server_args import ServerArgs
    p = _ap.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ob.BenchArgs.add_cli_args(p)
    ns = p.parse_args(["--model-path", d, "--load-format", "dummy", "--quantization", "mxfp8-learner-grid",
                       "--dtype", "bfloat16", "--disable-cuda-graph", "--mem-fraction-static", "0.5",
                       "--batch-size", "1", "--input-len", str(args.prefill), "--output-len", "4"])
    server_args, bench_args = ServerArgs.from_cli_args(ns), ob.BenchArgs.from_cli_args(ns)
    ob.main(server_args, bench_args)
    data = lc.collect(holder["model"])
    rows = lc.check(data)
    summary, ok = lc.summarize(rows, engine="sglang", shape=args.shape, wrapped_layers=holder["n"])
    print("SUMMARY " + json.dumps(summary), flush=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    print("LAYERS_EXACT" if ok else "LAYERS_NOT_EXACT", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
