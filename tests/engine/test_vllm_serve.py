"""`vllm serve --quantization mxfp8-learner-grid` as a real server process, queried over HTTP.

Runs the README's main job (examples/serve_demo.py): the server's /v1/completions logprobs
(echo + greedy continuation) must equal the learner's MXFP8 forward of the same tokens to
accumulation order (float32: < 2e-3 nats), and differ from a BF16-weight forward.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serve_demo.py")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_serve_over_http_is_on_the_learners_grid(moe):
    r = subprocess.run([sys.executable, DEMO, "--json"] + (["--moe"] if moe else []), capture_output=True,
                       text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res["ok"] and res["max_diff_grid"] < 2e-3 and res["mean_diff_plain"] > 0.02
    assert res["n_tokens"] >= 16
