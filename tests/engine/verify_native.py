"""The seven checks after a trainer's own native update (run by test_vllm_native_update.py).

A trainer pushes model B with ``collective_rpc`` + ``model.load_weights`` (no import of this
project); then ``client.verify_weights`` runs the checks against what the trainer says it sent:
(1) B -- verified; (2) A (the engine holds B) -- refused, naming regions; (3) B again after a
test-only fault makes one derived copy stale -- refused, naming the derived tensor.  After each,
the engine's parameters are what they were.  Prints ``RESULT {...}``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from native_update import push, two_models  # noqa: E402
from sync_scenarios import one_process, report_and_exit  # noqa: E402


def stale_one_derived_copy(worker):
    """Test machinery, shipped to the worker: overwrite one layer's derived fp32 weight copy."""
    model = worker.model_runner.model if hasattr(worker.model_runner, "model") else worker.model_runner.get_model()
    for name, m in model.named_modules():
        if hasattr(m, "weight_dequant"):
            m.weight_dequant.mul_(1.01)
            return name
    return None


def main():
    spec = json.loads(sys.argv[1])
    from vllm import LLM
    from mxfp8_learner_grid.vllm_plugin import inspect
    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect

    a, b, wa, wb = two_models(spec)
    llm = LLM(model=a, quantization="mxfp8-learner-grid", dtype="float32", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.1, seed=0, worker_extension_cls=GRID_WORKER, **one_process())
    client = connect(llm, digest="full")
    llm.collective_rpc(push(list(wb.items())))             # the trainer's own native update

    def state():
        return llm.apply_model(inspect.param_digests)[0]

    out = {}
    for case, tensors, fault in (("B", wb, False), ("A", wa, False), ("B_stale_derived", wb, True)):
        if fault:
            out["stale_layer"] = llm.collective_rpc(stale_one_derived_copy)[0]
        before = state()
        rep = client.verify_weights(tensors, format="bf16")
        out[case] = {"verified": rep.extra.get("verified"), "failed": rep.failed(), "applied": rep.applied,
                     "found": [d for c in rep.check("engine_as_found") for d in c.details][:6],
                     "unchanged": state() == before}
    report_and_exit(llm, out)


if __name__ == "__main__":
    main()
