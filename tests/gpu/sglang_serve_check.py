"""A real SGLang server with the plugin answers, and its logprobs are the learner's (a script, not a test).

    python tests/gpu/sglang_serve_check.py --model DIR --dtype float32|bfloat16 --out result.json [--port 30123]

Starts ``python -m sglang.launch_server --model-path DIR --quantization mxfp8-learner-grid`` (the
plugin through its entry point; decode CUDA graphs on; the prefill CUDA graph off, whose capture
costs minutes of device time and is not what is checked here), then

* ``/generate`` with token ids, greedy, ``return_logprob`` from the first token: the logprobs of
  the prompt tokens and of the generated ones;
* ``/v1/completions`` with a text prompt and ``logprobs``: the OpenAI route answers too;

stops the server, and runs the learner (``transformers`` + ``apply_learner_grid``, float32, CPU)
on the same token sequences.  Reported: max and mean |engine - learner| over every scored token.
SGLang 0.5.17 cannot serve float32 on the H200 (sgl_kernel's rmsnorm has no fp32 kernel: seen
there), so the check runs in bf16, where the activation quantizer turns bf16 rounding differences
into code flips (~0.05 nats): the number is reported; the exactness of each on-grid layer in
SGLang is ``layer_capture_sglang.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import torch


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--out", default="serve.json")
    ap.add_argument("--log", default="sgl_server.log")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--quantization", "mxfp8-learner-grid",
           "--host", "127.0.0.1", "--port", str(args.port), "--dtype", args.dtype, "--mem-fraction-static", "0.3",
           "--disable-prefill-cuda-graph", "--random-seed", "0"]
    if args.dtype == "float32":
        cmd += ["--attention-backend", "triton"]
    t0 = time.time()
    log = open(args.log, "w")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    res = {"model": os.path.basename(args.model.rstrip("/")), "dtype": args.dtype, "cmd": " ".join(cmd[1:])}
    try:
        for _ in range(400):
            if srv.poll() is not None:
                raise RuntimeError(f"server exited with {srv.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except Exception:
                time.sleep(1)
        else:
            raise RuntimeError("server not healthy after 400 s")
        res["start_s"] = round(time.time() - t0, 1)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 380, (n,), generator=g).tolist() for n in (12, 30, 64, 7)]
        r = post(base + "/generate", {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                                      "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
        seqs, engine = [], []
        for p, o in zip(prompts, r):
            mi = o["meta_info"]
            out_ids = [t[1] for t in mi["output_token_logprobs"]]
            lps = [t[0] for t in mi["input_token_logprobs"][1:]] + [t[0] for t in mi["output_token_logprobs"]]
            seqs.append(p + out_ids)
            engine.append(lps)
        c = post(base + "/v1/completions", {"model": args.model, "prompt": "def merge_sort(items):\n", "max_tokens": 8,
                                            "temperature": 0, "logprobs": 1})
        res["completions_ok"] = bool(c["choices"][0]["logprobs"]["token_logprobs"])
        res["completion_text"] = c["choices"][0]["text"][:80]
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except Exception:
            srv.kill()
        log.close()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "engine"))
    from sync_scenarios import learner_fn
    learner = learner_fn(args.model)(seqs)
    diffs = [abs(a - b) for e, l in zip(engine, learner) for a, b in zip(e, l)]
    res.update(tokens=len(diffs), max_abs=max(diffs), mean_abs=sum(diffs) / len(diffs),
               generated=[s[len(p):] for s, p in zip(seqs, prompts)])
    with open(args.log) as f:
        res["kernels"] = sorted({ln.split("-> kernel", 1)[1].strip()[:100] for ln in f if "-> kernel" in ln})
    print("SERVE " + json.dumps({k: v for k, v in res.items() if k != "generated"}), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
