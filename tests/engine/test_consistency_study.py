"""The consistency study script runs end to end on CPU (two arms, one small prompt set) and
writes every metric per arm; the numbers themselves are docs/consistency.md's business."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

HERE = os.path.dirname(__file__)
STUDY = os.path.join(HERE, "..", "..", "examples", "consistency_study.py")


def test_study_runs_on_cpu(tmp_path):
    from mxfp8_learner_grid.common.tiny_model import save_model
    model = save_model(tmp_path / "tiny")        # a seeded random model: enough to run the pipeline
    out = tmp_path / "study"
    r = subprocess.run([sys.executable, STUDY, "--model", str(model), "--out", str(out), "--arms", "bf16,grid_all,fp8",
                        "--sets", "1", "--prompts", "4", "--prompt-len", "16", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    rep = json.loads((out / "study.json").read_text())
    assert set(rep["arms"]) == {"bf16", "grid_all"} and "fp8" in rep["errors"]     # fp8 needs CUDA
    for arm in rep["arms"].values():
        m = arm["per_set"][0]
        assert m["tokens"] == 4 * 8 and m["kl_k3"] >= 0 and all(math.isfinite(v) for v in m.values())
    assert rep["arms"]["bf16"]["kl_k3_vs_bf16_sampler"] == 1.0
