"""The main job: `vllm serve` with the plugin, one request, and a check that the answer is on the learner's grid.

    python examples/serve_demo.py [--moe] [--json]

1. writes a tiny seeded Qwen3 checkpoint (BF16 weights, no network needed);
2. starts ``vllm serve <it> --quantization mxfp8-learner-grid`` as a real server process;
3. sends ``/v1/completions`` (greedy, with logprobs) and prints the answer;
4. the grid check: the learner -- the same checkpoint in transformers with
   ``apply_learner_grid`` (TE's MXFP8 forward) -- recomputes the logprob of every token the
   server returned; they must agree to accumulation order (the demo runs in float32, where
   that is < 2e-3 nats), while the plain BF16-weight forward is visibly different.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import requests
import torch

PROMPT = "def forward(self, x):\n    return"
TOL = 2e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mxfp8_learner_grid.vllm_plugin.serve", model, "--quantization", "mxfp8-learner-grid",
           "--dtype", "float32", "--max-model-len", "256", "--gpu-memory-utilization", "0.1", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny-grid", "--seed", "0"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc, port: int, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError("vllm serve did not become ready")


def learner_logprobs(model_dir: str, ids: list[int], grid: bool) -> list[float]:
    import transformers
    from mxfp8_learner_grid.common.learner import apply_learner_grid
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if grid:
        apply_learner_grid(m)
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE instead of the dense model")
    ap.add_argument("--json", action="store_true", help="print one JSON line with the results")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from mxfp8_learner_grid.common.tiny_model import save_model

    work = tempfile.mkdtemp(prefix="mxfp8-grid-demo-")
    model = str(save_model(os.path.join(work, "tiny-qwen3" + ("-moe" if args.moe else "")), moe=args.moe))
    port = free_port()
    log_path = os.path.join(work, "server.log")
    print(f"[demo] tiny model: {model}\n[demo] starting vllm serve on 127.0.0.1:{port} (log: {log_path}) ...",
          flush=True)
    with open(log_path, "w") as log:
        proc = start_server(model, port, log)
        try:
            wait_ready(proc, port)
            r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                "model": "tiny-grid", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
                "logprobs": 0, "echo": True, "return_token_ids": True, "skip_special_tokens": False})
            r.raise_for_status()
            choice = r.json()["choices"][0]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ids = list(choice["prompt_token_ids"]) + list(choice["token_ids"])
    served = choice["logprobs"]["token_logprobs"][1:]
    grid = learner_logprobs(model, ids, grid=True)
    plain = learner_logprobs(model, ids, grid=False)
    d_grid = max(abs(a - b) for a, b in zip(served, grid))
    d_plain = sum(abs(a - b) for a, b in zip(served, plain)) / len(served)
    ok = d_grid < TOL and d_plain > 10 * TOL
    answer = choice["text"][len(PROMPT):]
    print(f"[demo] prompt : {PROMPT!r}\n[demo] answer : {answer!r} (token ids {choice['token_ids']}; "
          "a random tiny model, so the words are noise -- the numbers are the point)")
    print(f"[demo] grid check: {len(served)} token logprobs from the server vs the learner's MXFP8 forward: "
          f"max |diff| {d_grid:.2e} (tolerance {TOL}); vs a BF16-weight forward: mean |diff| {d_plain:.3f}")
    print("[demo] GRID CHECK OK" if ok else "[demo] GRID CHECK FAILED")
    if args.json:
        print(json.dumps({"ok": ok, "max_diff_grid": d_grid, "mean_diff_plain": d_plain, "answer": answer,
                          "n_tokens": len(served)}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
