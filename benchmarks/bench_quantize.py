"""Bandwidth of the Triton MXFP8 quantize kernel on a GPU, against a device copy measured in the same run.

    python benchmarks/bench_quantize.py [--json out.json] [--sweep]

For each shape and usage (rowwise; rowwise+columnwise) it times the kernel with
``triton.testing.do_bench`` (median, fresh inputs rotated to defeat the L2) and counts the
fewest bytes the job must move: input read once, each fp8 copy written once, the scales
written once.  Bandwidth = bytes / time.  The ceiling is a device-to-device copy of a
tensor of the same total size in the same run (bytes read + written), and the datasheet
HBM3e rate of the H200 (4.8 TB/s) is shown too.  ``--sweep`` also times every tile
config and prints the best one per usage.  Also checks bytes against the torch path.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from mxfp8_learner_grid.common import quantize_mxfp8, quantize_rows
from mxfp8_learner_grid.common.kernels import quantize_triton as K

SHAPES = [(8192, 4096), (8192, 12288), (16384, 8192), (4096, 14336), (32768, 2048), (2048, 4096)]
DATASHEET_TBPS = 4.8
CONFIGS = [(bm, bk, w) for bm in (32, 64, 128) for bk in (64, 128, 256) for w in (2, 4, 8) if bm * bk <= 16384]


def median_ms(fn, inputs):
    it = iter(range(1 << 30))
    return triton.testing.do_bench(lambda: fn(inputs[next(it) % len(inputs)]), warmup=50, rep=300,
                                   return_mode="median")


def bytes_moved(m, k, in_bytes, rowwise, columnwise):
    b = m * k * in_bytes
    if rowwise:
        b += m * k + (m * k) // 32
    if columnwise:
        b += m * k + (m * k) // 32
    return b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "dtype": args.dtype, "rows": [], "sweep": {}}

    if args.sweep:
        m, k = 16384, 8192
        xs = [torch.randn(m, k, device=dev, dtype=dt) for _ in range(3)]
        for usage in ((True, False), (True, True)):
            timings = []
            for cfg in CONFIGS:
                try:
                    t = median_ms(lambda x: K.quantize_mxfp8_triton(x, *usage, config=cfg), xs)
                except Exception as exc:  # a config Triton cannot compile
                    print("config", cfg, "failed:", type(exc).__name__)
                    continue
                timings.append((t, cfg))
            timings.sort()
            gbps = bytes_moved(m, k, xs[0].element_size(), *usage) / (timings[0][0] * 1e-3) / 1e9
            print(f"sweep {usage}: best {timings[0][1]} {timings[0][0]:.3f} ms ({gbps:.0f} GB/s); "
                  f"worst {timings[-1][1]} {timings[-1][0]:.3f} ms")
            results["sweep"][str(usage)] = [(t, list(c)) for t, c in timings]

    hdr = f"{'M':>6} {'K':>6} {'usage':>9} {'ms':>8} {'GB/s':>7} {'copy GB/s':>9} {'vs copy':>7} {'vs 4.8TB/s':>10} {'torch ms':>8}"
    print(hdr)
    for m, k in SHAPES:
        xs = [torch.randn(m, k, device=dev, dtype=dt) * 3 for _ in range(3)]
        for usage, name in (((True, False), "row"), ((True, True), "row+col")):
            # correctness first: bytes equal the torch reference path on the GPU
            a = quantize_mxfp8(xs[0], *usage, backend="triton")
            b = quantize_mxfp8(xs[0], *usage, backend="torch")
            for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
                if getattr(a, f) is not None and not torch.equal(getattr(a, f).view(torch.uint8),
                                                                 getattr(b, f).view(torch.uint8)):
                    print("MISMATCH", m, k, name, f)
                    sys.exit(1)
            nbytes = bytes_moved(m, k, xs[0].element_size(), *usage)
            t = median_ms(lambda x: K.quantize_mxfp8_triton(x, *usage), xs)
            # ceiling: copy of the same total bytes (half read, half written)
            src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(3)]
            dst = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
            tc = median_ms(lambda s: dst.copy_(s), src)
            tt = median_ms(lambda x: quantize_mxfp8(x, *usage, backend="torch"), xs[:1])
            gbps, cgbps = nbytes / (t * 1e-3) / 1e9, nbytes / (tc * 1e-3) / 1e9
            row = dict(m=m, k=k, usage=name, ms=t, gbps=gbps, copy_gbps=cgbps, frac_copy=gbps / cgbps,
                       frac_datasheet=gbps / (DATASHEET_TBPS * 1e3), torch_ms=tt)
            results["rows"].append(row)
            print(f"{m:>6} {k:>6} {name:>9} {t:>8.3f} {gbps:>7.0f} {cgbps:>9.0f} {gbps / cgbps:>7.2f} "
                  f"{gbps / (DATASHEET_TBPS * 1e3):>10.2f} {tt:>8.3f}")
        del xs
    # decode-sized activation quantization (latency, not bandwidth)
    for m in (1, 16, 64, 256):
        xs = [torch.randn(m, 4096, device=dev, dtype=dt) for _ in range(3)]
        t = median_ms(lambda x: quantize_rows(x, backend="triton"), xs)
        results["rows"].append(dict(m=m, k=4096, usage="rows-small", ms=t))
        print(f"{m:>6} {4096:>6} {'rows':>9} {t * 1e3:>7.1f}us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
