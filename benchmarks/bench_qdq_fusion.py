"""Can torch.compile fuse the activation quantize-dequantize into the op before it?  (issue #11)

    python benchmarks/bench_qdq_fusion.py [--ms 1,16,64,256,2048] [--k 4096] [--out qdq_fusion.jsonl]

The grid Linear's input is ``qdq(x)``: TE's rowwise MXFP8 cast of x, decoded back to bf16
(exact).  Today it is one Triton launch (``kernels/qdq_triton.qdq_rows``) after the op that
made x.  For the two producers that vLLM compiles with Inductor, three arms, each captured in a
CUDA graph (20 calls per replay, median of replays, µs per call):

* ``op``       -- the producer alone (no quantization): the floor;
* ``triton``   -- the producer (compiled), then ``qdq_rows`` (two launches);
* ``inductor`` -- the producer and a torch-ops qdq (the rules of ``common/format.py``, the
  reference ``quantize_blocks_torch`` + ``dequantize_blocks``) in one ``torch.compile`` region,
  which Inductor may fuse; compiled with ``emulate_precision_casts`` (see ``_emulating``).

Producers: ``rmsnorm`` (vLLM's fused add + RMSNorm in its native torch form: residual add in
fp32, variance, scale, weight; returns the normed x and the new residual) at hidden K, and
``silu_mul`` (SiLU(gate) * up from a [M, 2I] gate_up output) at intermediate K.

Exactness first: the inductor arm's qdq values must equal ``qdq_rows``' bit for bit on every
input (random rows, rows with large / tiny amax, zeros); a mismatch is printed and the arm is
not timed.  One JSON line per (producer, M, arm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
from mxfp8_learner_grid.common.quantize import quantize_blocks_torch
from mxfp8_learner_grid.common.tensor import dequantize_blocks


def qdq_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference qdq in torch ops (what Inductor sees): x's exact grid values, in x's dtype."""
    q, s = quantize_blocks_torch(x)
    return dequantize_blocks(q, s).to(x.dtype)


def rmsnorm(x, residual, weight, eps=1e-6):
    """vLLM's fused_add_rms_norm, native form (RMSNorm.forward_static)."""
    xf = x.to(torch.float32) + residual.to(torch.float32)
    residual = xf.to(x.dtype)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    return (xf.to(x.dtype) * weight), residual


def silu_mul(gu):
    d = gu.shape[-1] // 2
    return torch.nn.functional.silu(gu[..., :d]) * gu[..., d:]


def _emulating(fn):
    """Compile (at first call) with ``emulate_precision_casts``, every arm alike: without it Inductor
    keeps a fused intermediate in fp32 where eager rounds it to bf16 -- SiLU's output before the
    product, and the producer's own bf16 output before a fused qdq -- so the fused qdq would quantize
    other values than the layer would receive (seen on CPU: Inductor's RMSNorm + qdq != qdq(RMSNorm)),
    and a producer compiled alone would differ from one compiled with the qdq (seen on the H200)."""
    import torch._inductor.config as C

    def call(*a):
        with C.patch(emulate_precision_casts=True):
            return fn(*a)
    return call


def make(producer: str, arm: str):
    if producer == "rmsnorm":
        def op(x, r, w):
            return rmsnorm(x, r, w)

        def fused(x, r, w):
            y, r2 = rmsnorm(x, r, w)
            return qdq_torch(y), r2
        base = _emulating(torch.compile(op, fullgraph=True, dynamic=False))
        if arm == "op":
            return base
        if arm == "triton":
            return lambda x, r, w: (lambda y: (qdq_rows(y[0], torch.bfloat16), y[1]))(base(x, r, w))
        return _emulating(torch.compile(fused, fullgraph=True, dynamic=False))
    base = _emulating(torch.compile(silu_mul, fullgraph=True, dynamic=False))
    if arm == "op":
        return lambda gu: (base(gu),)
    if arm == "triton":
        return lambda gu: (qdq_rows(base(gu), torch.bfloat16),)
    fused = _emulating(torch.compile(lambda gu: qdq_torch(silu_mul(gu)), fullgraph=True, dynamic=False))
    return lambda gu: (fused(gu),)


def inputs(producer: str, m: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if producer == "rmsnorm":
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        r = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        rows = torch.arange(m, device="cuda")
        x[rows % 7 == 3] *= 1e4                           # large amax rows
        x[rows % 11 == 5] *= 1e-20                        # tiny (the residual still dominates)
        w = (torch.randn(k, generator=g, device="cuda") * 0.1 + 1).bfloat16()
        return (x, r, w)
    gu = torch.randn(m, 2 * k, generator=g, device="cuda").bfloat16() * 3
    gu[::5, :k] = 0                                       # silu(0) * up = 0 rows
    return (gu,)


def graph_us(fn, args, calls=20, replays=30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(*args)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,256,2048")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=12288)
    ap.add_argument("--out", default="qdq_fusion.jsonl")
    args = ap.parse_args()
    commit = os.environ.get("GRID_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip()
    dev = torch.cuda.get_device_name(0)
    rows = []
    for producer, k in (("rmsnorm", args.k), ("silu_mul", args.inter)):
        fns = {arm: make(producer, arm) for arm in ("op", "triton", "inductor")}
        for m in [int(v) for v in args.ms.split(",")]:
            ok = True
            for seed in range(3):
                a = inputs(producer, m, k, seed)
                want = fns["triton"](*a)[0]
                got = fns["inductor"](*a)[0]
                same = torch.equal(want.view(torch.int16), got.view(torch.int16))
                if not same:
                    bad = (want.view(torch.int16) != got.view(torch.int16)).sum().item()
                    print(f"MISMATCH {producer} M={m} seed={seed}: {bad} of {want.numel()} elements differ")
                    ok = False
            a = inputs(producer, m, k, 0)
            res = {}
            for arm, fn in fns.items():
                if arm == "inductor" and not ok:
                    continue
                res[arm] = graph_us(fn, a)
            line = " ".join(f"{arm} {us:7.2f}" for arm, us in res.items())
            print(f"{producer:8} M={m:5d} K={k}: {line} us   exact={ok}", flush=True)
            for arm, us in res.items():
                rows.append({"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": dev, "bench": "qdq_fusion",
                             "producer": producer, "m": m, "k": k, "arm": arm, "us": round(us, 3), "exact": ok,
                             "torch": torch.__version__})
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
