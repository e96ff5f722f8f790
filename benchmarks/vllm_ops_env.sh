#!/usr/bin/env bash
# On the device: unpack one folder built by benchmarks/vllm_ops_carry.sh into /tmp/vllm-ops and check it.
#   bash benchmarks/vllm_ops_env.sh .carry/vops1     (then, in a later call, .carry/vops2)
# Afterwards: export MXFP8_GRID_VLLM_OPS=/tmp/vllm-ops
set -euo pipefail
mkdir -p /tmp/vllm-ops
for f in "$1"/*.xz; do
  lib=$(basename "$f" .xz)
  xz -dc "$f" > /tmp/vllm-ops/$lib.part
  [ "$(sha256sum /tmp/vllm-ops/$lib.part | awk '{print $1}')" = "$(cat "$1/$lib.sha256")" ] \
    || { echo "[vllm_ops] $lib: checksum mismatch"; exit 2; }
  mv /tmp/vllm-ops/$lib.part /tmp/vllm-ops/$lib
  echo "[vllm_ops] /tmp/vllm-ops/$lib"
done
