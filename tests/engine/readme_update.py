"""The README's update example, verbatim, on the tiny Qwen3-MoE (run by test_vllm_trainer_inputs.py).

The learner is transformers 5 with ``apply_learner_grid``: its ``state_dict()`` holds the experts
fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]), which the client
splits into per-expert views.  Prints ``RESULT {...}``: the report, and the engine's prompt
logprobs against the learner's grid forward (float32).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sync_scenarios import learner_fn, maxdiff, report_and_exit  # noqa: E402


def main():
    spec = json.loads(sys.argv[1])
    import transformers
    from vllm import LLM
    from mxfp8_learner_grid.common.learner import apply_learner_grid
    from mxfp8_learner_grid.common.tiny_model import save_model

    root = spec["root"]
    model = str(save_model(os.path.join(root, "A"), moe=True, seed=0))
    new = str(save_model(os.path.join(root, "B"), moe=True, seed=1))
    learner = transformers.AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    apply_learner_grid(learner)
    step, k_scale, v_scale = 1, 0.05, 0.07
    prompts = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]

    # --- README, "In-place weight updates for RL" (dtype and sizes added for the CPU test engine) ---
    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect

    llm = LLM(model, quantization="mxfp8-learner-grid", worker_extension_cls=GRID_WORKER,
              dtype="float32", enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.1, seed=0)
    client = connect(llm)
    report = client.update_weights(learner.state_dict(), format="bf16", version=step,
                                   kv_scales={layer: (k_scale, v_scale) for layer in (0, 1)})
    assert report.ok, report.summary()
    # --- end of the README example ---

    fused = learner.state_dict()
    bad = {"model.layers.0.mlp.experts.down_proj": fused["model.layers.0.mlp.experts.down_proj"][0]}
    try:
        client.update_weights(bad, format="bf16", partial=True)
        wrong_layout = "accepted"
    except Exception as exc:           # refused before anything reaches the engine
        wrong_layout = f"{type(exc).__name__}: {exc}"
    lp = client.t.prompt_logprobs(prompts)[0]
    out = {"ok": report.ok, "summary": report.summary(), "vs_new": maxdiff(lp, learner_fn(new)(prompts)),
           "vs_old": maxdiff(lp, learner_fn(model)(prompts)), "wrong_layout": wrong_layout,
           "version": client.version}
    report_and_exit(llm, out)


if __name__ == "__main__":
    main()
