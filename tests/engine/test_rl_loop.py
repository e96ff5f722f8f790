"""The RL loop example runs on CPU: sampler on the grid, learner recomputes, mismatch metrics,
a training step, and a checked in-place sync each step (both update formats)."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_loop.py")


@pytest.mark.parametrize("fmt,sampler", [("bf16", "grid"), ("mxfp8", "grid"), ("bf16", "bf16")])
def test_rl_loop_runs_and_syncs(tmp_path, fmt, sampler):
    """The grid sampler with either update format, and the BF16 control sampler (the plugin with
    no module selected, whose plain weights stay updatable in place)."""
    out = tmp_path / "steps.jsonl"
    r = subprocess.run([sys.executable, EXAMPLE, "--steps", "2", "--prompts", "4", "--format", fmt, "--sampler", sampler,
                        "--json", str(out)], capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    steps = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync_ok"] and not s["sync_failed"]
        assert s["tokens"] == 4 * 16 and all(math.isfinite(s[k]) for k in ("kl_k1", "kl_k3", "abs_diff"))
        assert s["kl_k3"] >= 0 and s["token_mult_prob_err"] >= 1.0 and s["sampler"] == sampler
