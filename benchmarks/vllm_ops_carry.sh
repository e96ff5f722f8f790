#!/usr/bin/env bash
# Build .carry/vops1 and .carry/vops2 here (not committed: .carry/ is ignored): vLLM 0.26.0's two compiled
# extension libraries (_C_stable_libtorch: dense Marlin; _moe_C_stable_libtorch: Marlin MoE), xz-packed, one per
# call (56 + 40 MiB packed: each fits a call's 64 MiB with the checkout, not both).  On the device,
# `bash benchmarks/vllm_ops_env.sh .carry/vopsN` unpacks each into /tmp/vllm-ops; then
# `export MXFP8_GRID_VLLM_OPS=/tmp/vllm-ops` makes the SGLang plugin load them (vllm_plugin/marlin_ops.py):
# vLLM's MXFP8 Marlin under SGLang without vLLM's Python.  The wheel is the one stage.py downloaded
# (~/.cache/engine-stage/wheels), else pip downloads it.
set -euo pipefail
cd "$(dirname "$0")/.."
whl=$(ls ~/.cache/engine-stage/wheels/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "$whl" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    vllm==0.26.0 -d "$tmp"
  whl=$(ls "$tmp"/vllm-0.26.0-*.whl)
fi
(cd "$tmp" && unzip -q -o "$whl" 'vllm/_C_stable_libtorch.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so')
i=1
for lib in _C_stable_libtorch.abi3.so _moe_C_stable_libtorch.abi3.so; do
  mkdir -p .carry/vops$i
  xz -T2 -6 -c "$tmp/vllm/$lib" > .carry/vops$i/$lib.xz
  sha256sum "$tmp/vllm/$lib" | awk '{print $1}' > .carry/vops$i/$lib.sha256
  i=$((i + 1))
done
ls -la .carry/vops1 .carry/vops2
