#!/usr/bin/env bash
# What one H200 lease runs (see BENCHMARKS.md).  Usage on the device, from the repo root:
#   bash benchmarks/device_session.sh gpu            # every GPU test (tests/gpu; GPU_TEST_ARGS: other pytest arguments)
#   bash benchmarks/device_session.sh tiles          # experiment: Marlin MoE's block size / tiles / blocks_per_sm, for the
#        30B experts and for the 8B projections as one expert (benchmarks/exp_marlin_tiles.py; TILES_ARGS)
#   bash benchmarks/device_session.sh w8a16p         # experiment: W8A16 with per-32 FP32 promotion vs Marlin / W8A16 / BF16
#   bash benchmarks/device_session.sh fp8p           # experiment: FP8 MMA (e4m3 x e4m3) with per-32 promotion: is the tensor
#        core's 32-term sum exact (probe), then exactness + time vs BF16 / Marlin / _scaled_mm (FP8P_ARGS)
#   HUMMING_ENV=1 bash benchmarks/device_session.sh humming   # humming band: GPU tests + exp_humming.py -> /tmp/humming_band.json
#   bash benchmarks/device_session.sh kernels        # GPU tests + quantize/GEMM benchmarks
#   bash benchmarks/device_session.sh engine SHAPE LAYERS ARMS [DTYPE]   # vLLM end-to-end check (needs vLLM staged)
#   bash benchmarks/device_session.sh update [LAYERS]  # in-place update timings (cuda_ipc; nccl with 2 GPUs;
#        UPDATE_SHAPE=qwen3-30b-a3b for the MoE shape: 24 layers fit beside the trainer's bf16 and fp8 copies;
#        UPDATE_GRID_OPTIONS='{"moe_single_copy": true}': plugin options, as one argument)
#   bash benchmarks/device_session.sh refresh         # a Marlin layer's refresh: the engine's repack vs the batched one
#   bash benchmarks/device_session.sh replay [LAYERS]  # the write plan's replay alone: host time per write, both paths
#   bash benchmarks/device_session.sh study           # consistency study, dense on GPU 0 and MoE on GPU 1
#   bash benchmarks/device_session.sh study1 KIND [ARMS]   # consistency study of one model (dense|moe) on GPU 0
#   bash benchmarks/device_session.sh amplify [KINDS]  # per-layer code flips / router top-k flips (examples/amplification_study.py)
#   bash benchmarks/device_session.sh qdqfusion       # torch.compile-fused qdq vs the Triton qdq after RMSNorm / SiLU*up
#   bash benchmarks/device_session.sh linear          # new kernel tests + linear benchmark + plot
#   bash benchmarks/device_session.sh fast            # fast-path GPU tests + kernel benchmark (needs vLLM staged)
#   bash benchmarks/device_session.sh layers [GRID_OPTIONS_JSON]   # per-layer exactness inside served models (needs vLLM)
#   bash benchmarks/device_session.sh profile SHAPE ARMS CONC [GRID_OPTIONS]   # kernel time per decode step, by
#        kernel family, per arm (benchmarks/profile_step.py: torch.profiler in vLLM as served; PROFILE_ARGS: more flags)
#   bash benchmarks/device_session.sh e2e SHAPE ARMS [CONC] [GRID_OPTIONS]   # tokens/s vs bf16/fp8/mxfp8
#        (arms: bf16, grid = defaults, grid+ = with GRID_OPTIONS -- a JSON string or a file holding one; REPS=3)
#   bash benchmarks/device_session.sh w8a16          # fast-path GPU tests + kernel benchmark with the W8A16 sweep;
#        writes $OUT/band.json (the rows where W8A16 beats Marlin) for `e2e ... grid+ ... $OUT/band.json`
#   bash benchmarks/device_session.sh fasttests       # tests/gpu/test_fast_path.py only
#   bash benchmarks/device_session.sh gemv            # all GPU tests + kernel benchmark: the decode GEMV (option gemv_rows)
#        vs Marlin vs W8A16, M 1 ... 64; writes $OUT/gemv.json and /tmp/gemv.json for `e2e ... grid+ ... /tmp/gemv.json`
#   bash benchmarks/device_session.sh bf16copy        # fast-path GPU tests + kernel benchmark: Marlin vs the resident
#        bf16 copy (option bf16_weight_rows) vs dequantize + cuBLAS, 8B projections, M 1 ... 256
#   bash benchmarks/device_session.sh tune1           # all GPU tests + the MoE-layer benchmark at decode sizes
#   bash benchmarks/device_session.sh tune2           # decode GEMV vs Marlin per model -> /tmp/gemv_{8b,30b}.json;
#        the W8A16 config sweep at M 32, 64 (W8A16_BEST: what a per-shape config table would reach)
#   bash benchmarks/device_session.sh moe             # MoE-layer benchmark: grid (Triton glue / torch glue) vs BF16 fused experts
#   bash benchmarks/device_session.sh nativeipc       # vLLM 0.26's own ipc weight-transfer backend (CUDA IPC), full + partial, then the seven checks
#   bash benchmarks/device_session.sh native          # a trainer's plain load_weights on the GPU (Marlin bf16 + Triton fp32, graphs on)
# Results go to $OUT.  Name the commit for the JSONL records: GRID_COMMIT=$(git rev-parse --short HEAD), set here
# before the call (the device copy of the tree may carry a stale .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/grid/mxfp8_learner_grid ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/grid . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 2; }
fi
export PYTHONPATH=/tmp/grid${PYTHONPATH:+:$PYTHONPATH}
# HUMMING_ENV=1: let humming-kernels' JIT find one CUDA 13 tree (benchmarks/humming_env.sh; carry .carry/humming)
if [ "${HUMMING_ENV:-0}" = 1 ]; then
  source benchmarks/humming_env.sh "${HUMMING_EXTRAS:-.carry/humming}" >"$OUT/humming_env.log" 2>&1; cat "$OUT/humming_env.log"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
case "${1:-kernels}" in
  gpu)    # every GPU test (GPU_TEST_ARGS: pytest's arguments, split by the shell; GPU_TEST_K: one -k expression)
    python3 -m pytest -q -p no:cacheprovider ${GPU_TEST_ARGS:-tests/gpu} ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -12
    ;;
  humming) # humming-kernels' W8A16 wgmma GEMM, stream-K off (option humming_rows): its GPU tests, then the experiment
    #        (exactness per config, then time against BF16 and Marlin); writes /tmp/humming_band.json for `e2e ... grid+`
    #        (HUMMING_TESTS=0: the experiment only, e.g. when the same lease runs `gpu`, which has these tests too)
    if [ "${HUMMING_TESTS:-1}" != 0 ]; then
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_humming_band.py 2>&1 | tee "$OUT/gpu_humming_tests.log" | tail -12
    fi
    # line by line, no `tail`: a call cut off at its limit kills a buffering tail before it prints (thirteenth
    # session: nothing came back); HUMMING_TIMEOUT ends the experiment first, its stacks dumped past --budget-s + 60
    timeout "${HUMMING_TIMEOUT:-500}" python3 benchmarks/exp_humming.py --out "$OUT/humming.jsonl" \
      --band-out "$OUT/humming_band.json" ${HUMMING_ARGS:-} 2>&1 | tee "$OUT/humming.log" \
      | grep --line-buffered -E "M=|HUMMING|Error|compiled|off the grid|built|copies|^  \[|Thread 0x|File \""
    cp "$OUT/humming_band.json" /tmp/humming_band.json 2>/dev/null || true
    ;;
  tiles)  # experiment: Marlin MoE's launch knobs (benchmarks/exp_marlin_tiles.py), line by line (no tail: see humming)
    #        (writes the rows that beat Marlin's own launch to /tmp/tiles_table.json, for `e2e ... grid+ ... FILE`)
    python3 benchmarks/exp_marlin_tiles.py --out "$OUT/tiles.jsonl" --table-out "$OUT/tiles_table.json" \
      ${TILES_ARGS:-} 2>&1 | tee "$OUT/tiles.log" | grep --line-buffered -E "base|best|budget|Error|vLLM's block|bf16 |TILES"
    cp "$OUT/tiles_table.json" "/tmp/tiles_table_${TILES_TAG:-all}.json" 2>/dev/null || true
    ;;
  w8a16p) # experiment: the W8A16 GEMM with the scales applied to FP32 partial sums per 32-block (benchmarks/exp_w8a16_promote.py)
    python3 benchmarks/exp_w8a16_promote.py --out "$OUT/w8a16p.jsonl" ${W8A16P_ARGS:-} 2>&1 | tee "$OUT/w8a16p.log" \
      | grep -E "M=|W8A16P_SUM|Error|direct" | tail -40
    ;;
  fp8p)   # experiment: FP8 tensor cores with the E8M0 scales applied per 32-block (benchmarks/exp_fp8_promote.py)
    python3 benchmarks/exp_fp8_promote.py --out "$OUT/fp8p.jsonl" ${FP8P_ARGS:-} 2>&1 | tee "$OUT/fp8p.log" \
      | grep -E "PROBE|EXACT|M=|FP8P_SUM|Error" | tail -60
    ;;
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
    tag="${2:-qwen3-8b}_${5:-bfloat16}"
    python3 tests/gpu/vllm_engine_check.py --shape "${2:-qwen3-8b}" --layers "${3:-4}" --arms "${4:-grid,bf16}" \
      --dtype "${5:-bfloat16}" --arm-timeout 400 --out "$OUT/engine_$tag.json" 2>&1 | tee "$OUT/engine_$tag.log" | tail -40
    ;;
  refresh) # a Marlin layer's refresh after an update: the engine's repack (per expert) vs the batched one
    python3 benchmarks/bench_refresh.py --out "$OUT/refresh.jsonl" 2>&1 | grep -v " INFO \| WARNING " | tail -8
    ;;
  replay) # the write plan's replay alone, host time per write: recorder's mode vs the plan's own accounting (no vLLM)
    python3 benchmarks/bench_replay.py --device cuda --layers "${2:-36}" --backup device --out "$OUT/replay.jsonl" \
      2>&1 | tail -3
    ;;
  update)
    # UPDATE_ARGS is split by the shell (no JSON there); plugin options go in UPDATE_GRID_OPTIONS, passed whole
    python3 benchmarks/bench_update.py --shape "${UPDATE_SHAPE:-qwen3-8b}" --layers "${2:-36}" --out "$OUT/update.json" ${UPDATE_ARGS:-} \
      ${UPDATE_GRID_OPTIONS:+--grid-options "$UPDATE_GRID_OPTIONS"} \
      2>&1 | grep -v " INFO \| WARNING " | tee "$OUT/update.log" | tail -30
    ;;
  study)
    for m in dense moe; do
      gpu=$([ $m = dense ] && echo 0 || echo 1)
      CUDA_VISIBLE_DEVICES=$gpu python3 examples/consistency_study.py --model "${MODELS:-models}/qwen3-tiny-$m" \
        --out "$OUT/study-$m" ${STUDY_ARGS:-} >"$OUT/study-$m.log" 2>&1 &
    done
    wait
    tail -12 "$OUT"/study-*.log
    ;;
  study1) # one model's study on one GPU: bash device_session.sh study1 moe bf16,grid_all,grid_all_r32,bf16_r32
    m=${2:-dense}
    python3 examples/consistency_study.py --model "${MODELS:-/tmp/models}/qwen3-tiny-$m" --out "$OUT/study-$m" \
      ${3:+--arms $3} ${STUDY_ARGS:-} 2>&1 | grep -v " INFO \| WARNING " | tee "$OUT/study-$m.log" | tail -16
    ;;
  amplify)
    for m in ${2:-dense moe}; do
      python3 examples/amplification_study.py --model "${MODELS:-/tmp/models}/qwen3-tiny-$m" --out "$OUT/amp-$m" \
        ${AMP_ARGS:-} 2>&1 | grep -v " INFO \| WARNING \|Loading weights" | tee "$OUT/amp-$m.log" | grep -E "router|tokens|FAILED|Error" | tail -8
    done
    ;;
  qdqfusion)
    python3 benchmarks/bench_qdq_fusion.py --out "$OUT/qdq_fusion.jsonl" 2>&1 | tee "$OUT/qdq_fusion.log" | tail -14
    ;;
  fast)   # the fast path: GPU tests (exactness, refresh under graphs, MoE), then the kernel benchmark
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_path.py tests/gpu/test_cuda_gemv_qdq.py \
      tests/gpu/test_cuda_quantize.py 2>&1 | tee "$OUT/gpu_fast_tests.log" | tail -25
    python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path.jsonl" ${FAST_ARGS:-} 2>&1 | tee "$OUT/bench_fast_path.log" \
      | grep -v "^\s*$" | tail -60
    ;;
  layers) # per-layer exactness inside a served model (dense 8B shape, MoE 30B shape; LAYER_SHAPES: fewer)
    for s in ${LAYER_SHAPES:-qwen3-8b qwen3-30b-a3b}; do
      VLLM_ALLOW_INSECURE_SERIALIZATION=1 PYTHONPATH=tests/gpu:$PYTHONPATH timeout 280 python3 tests/gpu/layer_capture.py --shape $s --layers 2 \
        --out "$OUT/layers-$s.json" ${2:+--grid-options "$2"} 2>&1 | grep -E "SUMMARY|LAYERS_|Error|error" | tail -8
    done
    ;;
  bf16copy)   # option bf16_weight_rows: exactness (with every fast-path test), then where the copy beats Marlin
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_path.py 2>&1 | tee "$OUT/gpu_fast_tests.log" | tail -8
    python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path.jsonl" --shapes "${SHAPES:-8b.qkv,8b.o,8b.gate_up,8b.down}" \
      --ms "${MS:-1,16,32,40,48,64,96,128,256}" --arms bf16,grid_marlin,grid_cublas,grid_bf16copy 2>&1 \
      | tee "$OUT/bench_fast_path.log" | grep -E "M=|summed|Error|NOT TIMED" | tail -50
    ;;
  fasttests)   # the fast path's GPU tests only (exactness, graphs, MoE glue vs the torch glue)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_path.py 2>&1 | tee "$OUT/gpu_fast_tests.log" | tail -25
    ;;
  w8a16)  # the W8A16 middle band: exactness (with every fast-path test; W8A16_TESTS=0 skips them), then the kernel
          # benchmark and the config sweep (tiles, split-K, stages); /tmp/band.json, /tmp/w8a16_best.json
    if [ "${W8A16_TESTS:-1}" = 1 ]; then
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_path.py 2>&1 | tee "$OUT/gpu_fast_tests.log" | tail -8
    fi
    python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path.jsonl" --shapes "${SHAPES:-8b.qkv,8b.o,8b.gate_up,8b.down}" \
      --ms "${MS:-1,16,32,48,64,96,128,192,256}" --arms bf16,grid_marlin,grid_cublas,grid_w8a16,marlin_w8a16 \
      --w8a16-sweep --sweep-ms "${SWEEP_MS:-16,64}" --band-out "$OUT/band.json" --best-out "$OUT/w8a16_best.json" 2>&1 \
      | tee "$OUT/bench_fast_path.log" | grep -E "M=|W8A16_BAND|W8A16_BEST|summed|Error" | grep -v " w8a16:" | tail -60
    cp "$OUT/band.json" /tmp/band.json 2>/dev/null || true      # $OUT is new in every call: the e2e call reads /tmp
    cp "$OUT/w8a16_best.json" /tmp/w8a16_best.json 2>/dev/null || true
    ;;
  gemv)   # option gemv_rows: every GPU test (kernels changed), then where the decode GEMV beats Marlin / W8A16
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path.jsonl" \
      --shapes "${SHAPES:-8b.qkv,8b.o,8b.gate_up,8b.down,30b.qkv,30b.o}" --ms "${MS:-1,2,4,8,16,32,48,64}" \
      --arms bf16,grid_marlin,grid_w8a16,grid_gemv,marlin_w8a16 --gemv-out "$OUT/gemv.json" 2>&1 \
      | tee "$OUT/bench_fast_path.log" | grep -E "M=|GEMV_ROWS|summed|Error|NOT TIMED" | tail -60
    cp "$OUT/gemv.json" /tmp/gemv.json 2>/dev/null || true
    ;;
  tune1)  # every GPU test (kernels changed), then the MoE layer benchmark (expert GEMV, Triton MoE, Marlin MoE)
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    python3 benchmarks/bench_moe.py --out "$OUT/moe.jsonl" --ms "${MS:-1,2,4,8,16}" --arms "${MOE_ARMS:-bf16,grid,grid_gemv,triton}" \
      2>&1 | grep -v " INFO \| WARNING " | tee "$OUT/bench_moe.log" | tail -8
    ;;
  tune2)  # the decode GEMV vs Marlin / W8A16, per model; the W8A16 sweep
    for model in 8b 30b; do
      sh=$([ $model = 8b ] && echo 8b.qkv,8b.o,8b.gate_up,8b.down || echo 30b.qkv,30b.o)
      python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path_$model.jsonl" --shapes $sh --ms "${MS:-1,2,4,8,16,32,64}" \
        --arms bf16,grid_marlin,grid_w8a16,grid_gemv,marlin_w8a16 --gemv-out "$OUT/gemv_$model.json" 2>&1 \
        | tee "$OUT/bench_fast_path_$model.log" | grep -E "summed|GEMV_ROWS|Error|NOT TIMED" | tail -6
      cp "$OUT/gemv_$model.json" /tmp/gemv_$model.json 2>/dev/null || true
    done
    python3 benchmarks/bench_fast_path.py --out "$OUT/fast_path_sweep.jsonl" --shapes 8b.qkv,8b.o,8b.gate_up,8b.down \
      --ms "${SWEEP_MS:-32,64}" --arms bf16,grid_marlin,grid_w8a16 --w8a16-sweep --sweep-ms "${SWEEP_MS:-32,64}" 2>&1 \
      | tee "$OUT/bench_sweep.log" | grep -E "best w8a16|W8A16_BEST|Error" | tail -14
    ;;
  moe)    # MoE layer: BF16 fused experts vs Marlin MoE + glue vs the expert GEMV (option moe_gemv_slots) vs Triton
    python3 benchmarks/bench_moe.py --out "$OUT/moe.jsonl" --ms "${MS:-1,2,4,8,16,32,64,256,1024}" \
      --gemv-out "$OUT/moe_gemv.json" 2>&1 | grep -v " INFO \| WARNING " | tee "$OUT/bench_moe.log" | tail -14
    cp "$OUT/moe_gemv.json" /tmp/moe_gemv.json 2>/dev/null || true
    ;;
  native) # issue #17 on the GPU: native collective_rpc + load_weights, full and partial, derived tensors checked
    for kind in ${KINDS:-dense moe}; do
      for dt in ${DTYPES:-bfloat16 float32}; do
        # the parent trains the tiny tokenizers (tokenizers' thread pool) before vLLM starts its engine
        # process: forked, that engine hung after "Using V2 Model Runner" on the H200 -- spawn it
        TOKENIZERS_PARALLELISM=false VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
        timeout 200 python3 tests/engine/native_update.py \
          "{\"kind\": \"$kind\", \"root\": \"/tmp/native-$kind-$dt\", \"dtype\": \"$dt\", \"eager\": false, \"capture_sizes\": [1, 2, 4, 8], \"gpu_memory_utilization\": 0.3}" \
          >"$OUT/native-$kind-$dt.log" 2>&1
        grep "^RESULT" "$OUT/native-$kind-$dt.log" | sed "s/^/$kind $dt /" || tail -20 "$OUT/native-$kind-$dt.log"
      done
    done
    ;;
  nativeipc) # issue #13 on the GPU: vLLM 0.26's own ipc weight-transfer backend (this process is the trainer: CUDA IPC),
    #          full and partial updates, derived tensors checked, then the seven checks of what the trainer sent
    for kind in ${KINDS:-dense}; do
      for pk in ${IPC_PACKED:-0}; do      # 0: one update_weights per update; N > 0: vLLM's packed mode, an N-byte IPC buffer
        log="$OUT/nativeipc-$kind-bfloat16-packed$pk.log"
        TOKENIZERS_PARALLELISM=false VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
        timeout ${IPC_TIMEOUT:-240} python3 tests/engine/native_update.py \
          "{\"kind\": \"$kind\", \"root\": \"/tmp/nativeipc-$kind-$pk\", \"dtype\": \"bfloat16\", \"eager\": false, \"capture_sizes\": [1, 2, 4, 8], \"gpu_memory_utilization\": 0.3, \"path\": \"weight_transfer_ipc\", \"ipc_packed_bytes\": $pk}" \
          >"$log" 2>&1
        echo "$kind bfloat16 ipc packed=$pk: exit $?"
        grep "^RESULT" "$log" | sed "s/^/$kind bfloat16 ipc packed=$pk /" || tail -40 "$log"
        if grep -q '^RESULT.*"error"' "$log"; then grep -E "Error|Traceback" "$log" | grep -v "^RESULT" | tail -15; fi
      done
    done
    ;;
  e2e)    # end to end, arms in the same run: bash device_session.sh e2e SHAPE ARMS [CONC] [GRID_OPTIONS_JSON|FILE]
    opts="${5:-}"
    arms="${3:-bf16,grid}"
    if [ -n "$opts" ] && [ -f "$opts" ]; then opts=$(cat "$opts"); fi
    # grid+ only when its options turn something on: the band writers (--band-out, --gemv-out) write
    # {"w8a16_rows": []}, {"gemv_rows": 0} or {"humming_rows": []} when nothing beat the default
    if ! python3 -c 'import json, sys; sys.exit(0 if any(json.loads(sys.argv[1] or "{}").values()) else 1)' "$opts"; then
      arms=$(echo "$arms" | sed 's/,grid+//; s/grid+,//')
    fi
    echo "arms: $arms; grid+ options: $opts"
    python3 benchmarks/bench_e2e.py --shape "${2:-qwen3-8b}" --arms "$arms" --conc "${4:-1,16,64}" \
      --grid-options "$opts" --reps "${REPS:-3}" --arm-timeout "${ARM_TIMEOUT:-400}" --out "$OUT/e2e-h200.jsonl" 2>&1 \
      | tee "$OUT/e2e.log" | grep --line-buffered -v " INFO \| WARNING \|^\s*$"
    ;;
  profile)  # kernel time per decode step by kernel family: bash device_session.sh profile SHAPE ARMS CONC [GRID_OPTIONS]
    opts="${5:-}"
    if [ -n "$opts" ] && [ -f "$opts" ]; then opts=$(cat "$opts"); fi
    python3 benchmarks/profile_step.py --shape "${2:-qwen3-8b}" --arms "${3:-bf16,grid}" --conc "${4:-64}" \
      --grid-options "$opts" --out "$OUT/step-h200.jsonl" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" \
      | grep -v " INFO \| WARNING "
    ;;
  linear)
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    python3 benchmarks/bench_linear.py --out "$OUT/linear.json" 2>&1 | tee "$OUT/bench_linear.log" | tail -40
    python3 benchmarks/plot_kernels.py "$OUT/linear.json" "$OUT/kernels.png" || true
    ;;
esac
