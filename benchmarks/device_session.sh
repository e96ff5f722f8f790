#!/usr/bin/env bash
# What one H200 lease runs (see BENCHMARKS.md).  Usage on the device, from the repo root:
#   bash benchmarks/device_session.sh kernels        # GPU tests + quantize/GEMM benchmarks
#   bash benchmarks/device_session.sh engine SHAPE   # vLLM end-to-end check (needs vLLM staged)
# Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/grid/mxfp8_learner_grid ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/grid . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 2; }
fi
export PYTHONPATH=/tmp/grid${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
case "${1:-kernels}" in
  kernels)
    python3 -m pytest -q -p no:cacheprovider tests/gpu -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    python3 benchmarks/bench_quantize.py --sweep --json "$OUT/bench_quantize.json" 2>&1 | tee "$OUT/bench_quantize.log"
    python3 benchmarks/bench_gemm.py --sweep --json "$OUT/bench_gemm.json" 2>&1 | tee "$OUT/bench_gemm.log"
    ;;
  gemm)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_gemm.py 2>&1 | tee "$OUT/gpu_gemm_tests.log" | tail -5
    python3 benchmarks/bench_gemm.py --shapes 8b.qkv,8b.gate_up,8b.down --ms 1,16,64,2048,8192 \
      --json "$OUT/bench_gemm.json" 2>&1 | tee "$OUT/bench_gemm.log"
    ;;
  engine)
    python3 tests/gpu/vllm_engine_check.py --shape "${2:-qwen3-8b}" --layers "${3:-4}" --arms "${4:-grid,bf16}" \
      --out "$OUT/engine_${2:-qwen3-8b}.json" 2>&1 | tee "$OUT/engine_${2:-qwen3-8b}.log" | tail -60
    ;;
esac
