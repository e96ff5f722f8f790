"""Experiment (benchmark only, not shipped): humming-kernels' W8A16 wgmma GEMM as a grid kernel (issue #11).

    source benchmarks/humming_env.sh && python benchmarks/exp_humming.py --out $OUT/humming.jsonl \
        [--shapes 8b.qkv,...] [--ms 16,32,64,128]

humming-kernels 0.1.10 (pinned by vLLM 0.26 and SGLang 0.5.17; docs/humming.md) has a W8A16 schema for
E4M3 weights with E8M0 scales per 32 along K: wgmma, FP32 accumulation, the scales applied to the
dequantized bf16 weights.  Fed ``qdq(x)`` (the TE-exact activation quantize-dequantize), it computes the
grid GEMM -- if it sums in FP32 and rounds once.  Its defaults do not: stream-K adds bf16-rounded partial
sums across CTAs.  So every config here has ``use_stream_k`` off, and each is checked before it is timed:

* on the exact result rounded once (float64 sum, one rounding to bf16): at least 99% of elements equal
  and none further off than one bf16 step plus the FP32 summation bound (the GPU tests' criterion,
  ``tests/gpu/grid_checks.py``), for weights as a model has them (``quantize_rows`` of a
  Gaussian) and for adversarial ones (every non-NaN E4M3 code, E4M3 subnormals included, scale bytes
  100 ... 140);
* run to run: the same bytes twice.

Configs (block_m = M rounded up to 16): ``bn<BLOCK_N>k<BLOCK_K>`` with warp tile (block_m, 32, 64), 4
stages, warp specialization + TMA (the shape of humming's own sm90 configs); BLOCK_K > 64 sums K-warps
inside the CTA in FP32 (order only).  ``bi`` is humming's own batch-invariant heuristic (stream-K off).
``default_sk`` is vLLM's HummingMxfp8LinearKernel setting (heuristics, stream-K on) -- timed for
reference and reported with its exactness, never counted as on the grid.

Arms per (shape, M): ``bf16`` (torch.mm), ``grid_marlin`` (qdq + Marlin, the shipped default) and
``humming:<config>`` (qdq + humming).  Timed as in ``bench_fast_path`` (CUDA graphs over enough weight
copies to defeat the L2).  Exit code 3 with ``HUMMING_UNAVAILABLE`` when humming cannot build its
kernels on this machine (its JIT needs g++, NVRTC and CUDA 13 headers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))

from grid_checks import adversarial_weights, fp32_accumulation_stats  # noqa: E402

from mxfp8_learner_grid.common.grid_kernels import humming as H  # noqa: E402

#: the shipped band's compute config (stream-K off) and vLLM's HummingMxfp8LinearKernel default (stream-K on)
COMPUTE_ON_GRID = json.loads(H.COMPUTE_CONFIG)
COMPUTE_DEFAULT = dict(COMPUTE_ON_GRID, use_batch_invariant=False)


def humming_layer(q: torch.Tensor, s: torch.Tensor):
    """A humming layer over the wire bytes: e4m3 codes [N, K] and E8M0 bytes [N, K/32]."""
    from humming.layer import HummingLayer
    n, k = q.shape
    with torch.device("cuda"):
        lay = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(H.WEIGHT_CONFIG), torch_dtype=torch.bfloat16)
    lay.load_from_tensors({"weight": q.contiguous().view(torch.int32),
                           "weight_scale": s.contiguous().view(torch.float8_e8m0fnu)})
    lay.transform()
    return lay


def tile_config(m: int, bn: int, bk: int) -> dict:
    """The shipped band's config for M rows (block_m = M rounded up to 16) with tile (bn, bk)."""
    return H.tile_config(max(16, -(-m // 16) * 16), (bn, bk))


def configs(lay, m: int) -> dict:
    from humming.tune import get_heuristics_config
    meta = lay.humming_metas[""]
    out = {f"bn{bn}k{bk}": tile_config(m, bn, bk) for bn, bk in H.TILE_CHOICES
           if meta.shape_n % bn == 0 and meta.shape_k % bk == 0}
    bi = dict(get_heuristics_config(meta, shape_m=m, use_batch_invariant=True))
    bi["use_stream_k"] = False
    if list(bi.get("block_shape", [0, 0]))[1] > 64:          # block_n 64 hung on the H200 (fourteenth session)
        out["bi"] = bi
    return out


def precompile(lay, ms) -> float:
    """Build every kernel a shape needs in one call (humming compiles a list of configs in 16 threads):
    the on-grid configs of every M, and the default heuristics' configs (stream-K on)."""
    from humming.kernel.humming import HummingKernel
    t = time.time()
    layer_config = lay.humming_metas[""].to_str()
    tunings = [cfg for m in ms for cfg in configs(lay, m).values()]
    HummingKernel.prepare_kernels(layer_config, json.dumps(COMPUTE_ON_GRID),
                                  json.dumps([[i, i + 1, cfg] for i, cfg in enumerate(tunings)]))
    HummingKernel.prepare_kernels(layer_config, json.dumps(COMPUTE_DEFAULT), None)
    return time.time() - t


def run(lay, xg, tuning, compute=COMPUTE_ON_GRID):
    return lay(xg, compute_config=json.dumps(compute), tuning_config=json.dumps(tuning) if tuning else None)


def finished(limit_s: float) -> bool:
    """Whether the work queued so far finishes within limit_s (an event polled: a hung kernel cannot block us)."""
    ev = torch.cuda.Event()
    ev.record()
    t = time.time()
    while not ev.query():
        if time.time() - t > limit_s:
            return False
        time.sleep(0.01)
    return True


def grid_operands(x, q, s):
    from mxfp8_learner_grid.common import dequantize_blocks, quantize_rows
    return dequantize_blocks(*quantize_rows(x)), dequantize_blocks(q, s)


def check(y, a, w, y2=None) -> dict:
    """y against the exact result rounded once (a, w: the grid operands): the fraction equal, and the worst
    error in units of one bf16 ulp plus the FP32 summation bound (tests/gpu/grid_checks: the GPU tests'
    criterion, >= 99% equal and worst <= 1), and whether a second run gave the same bytes."""
    equal, worst = fp32_accumulation_stats(y, a, w)
    out = {"equal": round(equal, 5), "worst": round(worst, 3), "nan": int(torch.isnan(y).sum())}
    if y2 is not None:
        out["deterministic"] = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16)))
    out["ok"] = equal >= 0.99 and worst <= 1.0 and out["nan"] == 0 and out.get("deterministic", True)
    return out


def best_band(total: dict, shapes: list) -> dict:
    """The option the band's tile table can express: one tile (``bn<N>k<K>``) for every shape and M, and rows
    [lo, hi) where it beats Marlin summed over the shapes.  Only tiles measured on the grid at every shape
    count.  lo: one past the last measured M below the band where Marlin won (or the first winning M);
    hi: one past the last winning M of the run.  Off ({"humming_rows": []}) if it never wins."""
    ms = sorted({k[0] for k in total if isinstance(k[0], int)})
    tiles = {a for (m, a) in (k for k in total if isinstance(k[0], int)) if a.startswith("humming:bn")}
    best = None
    for tile in sorted(tiles):
        if any(sorted(total.get(("shapes", m, tile), [])) != sorted(shapes) for m in ms):
            continue
        wins = [m for m in ms if total[(m, tile)] < total.get((m, "grid_marlin"), 0.0)]
        if not wins:
            continue
        first = ms.index(wins[0])
        run_ = [wins[0]]
        for m in ms[first + 1:]:
            if m not in wins:
                break
            run_.append(m)
        lo = ms[first - 1] + 1 if first > 0 else wins[0]
        gain = sum(total[(m, "grid_marlin")] - total[(m, tile)] for m in run_)
        if best is None or gain > best[0]:
            best = (gain, lo, run_[-1] + 1, tile)
    if best is None:
        return {"humming_rows": []}
    _, lo, hi, tile = best
    bn, bk = tile[len("humming:bn"):].split("k")
    return {"humming_rows": [lo, hi], "humming_tile": [int(bn), int(bk)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="humming.jsonl")
    ap.add_argument("--shapes", default="8b.qkv,8b.o,8b.gate_up,8b.down")
    ap.add_argument("--ms", default="16,32,64,128")
    ap.add_argument("--no-marlin", action="store_true", help="skip the Marlin arm (no vLLM on this machine)")
    ap.add_argument("--budget-s", type=float, default=420, help="start no new (shape, M) after this many seconds")
    ap.add_argument("--band-out", default="", help="write the grid options {humming_rows, humming_tile} where the "
                                                   "best single on-grid tile beats Marlin (summed over the shapes)")
    args = ap.parse_args()
    import faulthandler
    # a hang shows where: on the H200 (twelfth session) this script made no progress for ~290 s after humming's
    # first kernel (37.8 s, cold caches) and printed nothing more; every stack is dumped if it runs this long
    faulthandler.dump_traceback_later(args.budget_s + 60, repeat=True)
    from bench_fast_path import SHAPES, commit, make_layer, time_arms, weight_copies

    from mxfp8_learner_grid.common import quantize_rows
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows
    meta = {"date": __import__("datetime").date.today().isoformat(), "commit": commit(),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out = open(args.out, "w")
    t0 = time.time()
    if not args.no_marlin:
        # vLLM first, as in an engine: on the H200, importing vLLM's ops *after* humming's first kernel left the
        # next Triton module load hanging (benchmarks/humming_diag.py, case exp_steps); vLLM first ran clean
        from mxfp8_learner_grid.vllm_plugin import compat
        compat.register_kernel_providers()
    try:
        import humming
        meta["humming"] = getattr(humming, "__version__", "?")
        # the probe is a shape the GPU tests run exact (1024 x 4096, M = 16), synchronized: a 256 x 256 probe with
        # tile (64, 64) was followed by a hang in the next Triton module load, twice (eleventh, thirteenth session)
        probe = humming_layer(*quantize_rows(torch.randn(1024, 4096, device="cuda") * 0.02))
        run(probe, torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16), tile_config(16, 128, 64))
        if not finished(30.0):
            print("HUMMING_PROBE_HANG: the 1024 x 4096 probe did not finish 30 s after launch", flush=True)
            out.write(json.dumps(dict(meta, arm="probe", ok=False, error="HANG")) + "\n")
            out.close()
            os._exit(4)
    except Exception as exc:
        traceback.print_exc()
        print(f"HUMMING_UNAVAILABLE {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        out.write(json.dumps(dict(meta, arm="probe", ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")) + "\n")
        sys.exit(3)
    print(f"humming {meta['humming']}: first kernel built and ran in {time.time() - t0:.1f} s", flush=True)
    out.write(json.dumps(dict(meta, arm="probe", ok=True, first_kernel_s=round(time.time() - t0, 1))) + "\n")
    out.flush()

    def step(what):
        torch.cuda.synchronize()
        print(f"  [{time.time() - t0:6.1f} s] {what}", flush=True)
    total: dict = {}
    for sname in args.shapes.split(","):
        n, k = SHAPES[sname]
        raw, wb = weight_copies(n, k)
        copies = len(raw)
        step(f"{sname}: {copies} weight copies quantized and dequantized")
        t1 = time.time()
        hums = [humming_layer(q, s) for q, s in raw[:1]]
        step(f"{sname}: first humming layer (its repack kernel)")
        hums += [humming_layer(q, s) for q, s in raw[1:]]
        step(f"{sname}: humming layers")
        lays = [] if args.no_marlin else [make_layer(n, k, i, 1 << 30) for i in range(copies)]
        step(f"{sname}: Marlin layers")
        adv_q, adv_s = adversarial_weights(n, k, 7)
        adv = humming_layer(adv_q, adv_s)
        ms = list(map(int, args.ms.split(",")))
        print(f"{sname}: {copies} copies, humming layers in {time.time() - t1:.1f} s", flush=True)
        try:
            print(f"{sname}: kernels for M {ms} compiled in {precompile(hums[0], ms):.1f} s", flush=True)
        except Exception as exc:
            print(f"{sname}: precompile failed ({type(exc).__name__}: {str(exc)[:300]}); per config instead", flush=True)
        for m in ms:
            if time.time() - t0 > args.budget_s:
                print(f"{sname} M={m}: skipped (time budget {args.budget_s:.0f} s spent)", flush=True)
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xg = qdq_rows(x)
            ops_model = grid_operands(x, *raw[0])
            x_adv = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4.0
            ops_adv = grid_operands(x_adv, adv_q, adv_s)
            xg_adv = qdq_rows(x_adv)
            arms = {"bf16": [lambda w=w: torch.mm(x, w.T) for w in wb]}
            if lays:
                arms["grid_marlin"] = [lambda l=l: l.grid_kernel.apply(l, x) for l in lays]
            t2 = time.time()
            cfgs = configs(hums[0], m)
            for name, cfg in list(cfgs.items()) + [("default_sk", None)]:
                compute = COMPUTE_DEFAULT if cfg is None else COMPUTE_ON_GRID
                row = dict(meta, shape=sname, n=n, k=k, m=m, arm="humming:" + name, config=cfg, kind="check")
                try:
                    y = run(hums[0], xg, cfg, compute)
                    if not finished(20.0):
                        # a kernel that never ends (the 256 x 256 probe of the thirteenth session): say which, keep the rows
                        row["error"] = "HANG: not finished 20 s after launch"
                        print(f"{sname} M={m} humming:{name}: {row['error']} {cfg}", flush=True)
                        out.write(json.dumps(row) + "\n")
                        out.close()
                        os._exit(4)
                    y2, ya = run(hums[0], xg, cfg, compute), run(adv, xg_adv, cfg, compute)
                    row["model_weights"] = check(y, *ops_model, y2)
                    row["adversarial"] = check(ya, *ops_adv)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{sname} M={m} humming:{name}: {row['error']}", flush=True)
                    out.write(json.dumps(row) + "\n")
                    continue
                out.write(json.dumps(row) + "\n")
                on_grid = row["model_weights"]["ok"] and row["adversarial"]["ok"]
                if not on_grid:
                    print(f"{sname} M={m} humming:{name} off the grid: {row['model_weights']} {row['adversarial']}",
                          flush=True)
                if on_grid or cfg is None:
                    arms["humming:" + name] = [lambda h=h, cfg=cfg, compute=compute: run(h, qdq_rows(x), cfg, compute)
                                               for h in hums]
            print(f"{sname} M={m}: configs built and checked in {time.time() - t2:.1f} s", flush=True)
            us = time_arms(arms, f"{sname} M={m}")
            for arm, t in us.items():
                out.write(json.dumps(dict(meta, shape=sname, n=n, k=k, m=m, arm=arm, us=round(t, 2),
                                          vs_bf16=round(us["bf16"] / t, 3), kind="time")) + "\n")
            out.flush()
            exact = {a: t for a, t in us.items() if a.startswith("humming:") and a != "humming:default_sk"}
            best = min(exact, key=exact.get) if exact else None
            for arm in us:
                if not arm.startswith("humming:") or arm == "humming:default_sk" or arm in exact:
                    total[(m, arm)] = total.get((m, arm), 0.0) + us[arm]
                    total.setdefault(("shapes", m, arm), []).append(sname)
            if best:
                total[(m, "humming_best")] = total.get((m, "humming_best"), 0.0) + exact[best]
            print(f"{sname:11s} M={m:4d} bf16 {us['bf16']:.1f} marlin {us.get('grid_marlin', 0):.1f} "
                  f"humming(sk, off grid) {us.get('humming:default_sk', 0):.1f} best on-grid {best} "
                  f"{exact.get(best, 0):.1f} us | " + " ".join(f"{a[8:]}={t:.1f}" for a, t in sorted(exact.items())),
                  flush=True)
        del hums, lays, wb, raw, adv
        torch.cuda.empty_cache()
    if args.band_out:
        band = best_band(total, args.shapes.split(","))
        json.dump(band, open(args.band_out, "w"))
        print(f"HUMMING_BAND {json.dumps(band)}", flush=True)
    for m in sorted({m for m, _ in total}):
        print(f"HUMMING_SUM M={m}: bf16 {total.get((m, 'bf16'), 0):.1f} marlin {total.get((m, 'grid_marlin'), 0):.1f} "
              f"humming default (stream-K, off grid) {total.get((m, 'humming:default_sk'), 0):.1f} "
              f"humming on grid (best per shape) {total.get((m, 'humming_best'), 0):.1f} us", flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
