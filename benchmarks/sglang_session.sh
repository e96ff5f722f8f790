#!/usr/bin/env bash
# What one H200 lease runs for SGLang (issue #12), after staging sglang==0.5.17 (stage.py --engine sglang==0.5.17).
#   bash benchmarks/sglang_session.sh serve MODELS_DIR   # tiny dense + MoE served with the plugin, logprobs vs the learner
#   bash benchmarks/sglang_session.sh layers             # per-layer exactness inside SGLang's model runner (8B / 30B shapes, 2 layers)
#   bash benchmarks/sglang_session.sh e2e SHAPE [ARMS] [CONC] [GRID_OPTIONS]   # tokens/s, grid vs bf16 (REPS=2)
#   bash benchmarks/sglang_session.sh gpu                # GPU tests under SGLang's env (GPU_TEST_ARGS; default: the Marlin
#                                                       #   fast path, with MXFP8_GRID_VLLM_OPS set: vllm_ops_env.sh)
#   bash benchmarks/sglang_session.sh update [KINDS]    # in-place updates + faults through the client (KINDS: "dense moe";
#                                                       #   UPDATE_TIMEOUT=400 for the MoE model; UPDATE_GRID_OPTIONS:
#                                                       #   plugin options as one JSON argument)
# Results go to $OUT.  GRID_COMMIT=<hash> names the commit in the JSONL records.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. /tmp/engine-site/sglang-0.5.17/activate.sh >/dev/null || { echo "SGLang not staged: redo the part calls"; exit 3; }
if [ ! -d /tmp/grid/mxfp8_learner_grid ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/grid . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 2; }
fi
export PYTHONPATH=/tmp/grid:tests/gpu:$PYTHONPATH
[ -n "${MXFP8_GRID_VLLM_OPS:-}" ] && echo "[sglang_session] vLLM's compiled Marlin ops from $MXFP8_GRID_VLLM_OPS"
case "${1:-serve}" in
  gpu)
    python3 -m pytest ${GPU_TEST_ARGS:-tests/gpu/test_fast_path.py -q} -p no:cacheprovider 2>&1 | tee "$OUT/gpu-sglang.log" \
      | grep -E "passed|failed|error|Error|SKIP" | tail -15
    ;;
  serve)
    for m in dense moe; do
      for dt in bfloat16; do          # float32: sgl_kernel's rmsnorm has no fp32 kernel (seen on the H200)
        timeout 280 python3 tests/gpu/sglang_serve_check.py --model "${2:-/tmp/models}/qwen3-tiny-$m" --dtype $dt \
          --out "$OUT/sgl-serve-$m-$dt.json" --log "$OUT/sgl-server-$m-$dt.log" 2>&1 | grep -E "SERVE|Error|error" | tail -4
      done
    done
    ;;
  layers)
    for s in ${SHAPES:-qwen3-8b qwen3-30b-a3b}; do
      timeout 280 python3 tests/gpu/layer_capture_sglang.py --shape $s --layers 2 --out "$OUT/layers-sglang-$s.json" \
        >"$OUT/layers-sglang-$s.log" 2>&1
      grep -E "SUMMARY|LAYERS_" "$OUT/layers-sglang-$s.log" || tail -30 "$OUT/layers-sglang-$s.log"
    done
    ;;
  update)
    # UPDATE_TIMEOUT: seconds per kind (the MoE server alone took 162 s to start on the H200; the
    # check's own deadline, 20 s earlier, prints its RESULT line with what it reached)
    t=${UPDATE_TIMEOUT:-280}
    for k in ${2:-dense}; do
      timeout $t python3 tests/gpu/sglang_update_check.py --kind "$k" --out "$OUT/sgl-update-$k.json" \
        --deadline $((t - 20)) --start-timeout $((t - 80)) --grid-options "${UPDATE_GRID_OPTIONS:-}" \
        --log "$OUT/sgl-update-server-$k.log" >"$OUT/sgl-update-$k.log" 2>&1
      echo "sgl-update $k: exit $?"
      grep -E "^RESULT" "$OUT/sgl-update-$k.log" || tail -30 "$OUT/sgl-update-$k.log"
    done
    ;;
  e2e)
    E2E_ARM_LOGS="$OUT" python3 benchmarks/bench_e2e_sglang.py --shape "${2:-qwen3-8b}" --arms "${3:-bf16,grid}" --conc "${4:-1,16,64}" \
      --grid-options "${5:-}" --reps "${REPS:-2}" \
      --arm-timeout "${ARM_TIMEOUT:-400}" --out "$OUT/e2e-sglang-h200.jsonl" 2>&1 | grep -v " INFO \|^\s*$" | tail -30
    ;;
esac
