#!/usr/bin/env bash
# Build .carry/humming here (not committed: .carry/ is ignored), for benchmarks/humming_env.sh on the device:
# the crt/ headers of nvidia-cuda-crt 13.0.88, which humming's launcher needs and the H200 image lacks (only the
# skipped nvidia-cuda-nvcc pulls that wheel in).  The image has Python.h, g++, ninja and libcuda (checked on the
# H200, 2026-12-02).  Carry it with every HUMMING_ENV=1 call: run(carry=[..., ".carry/humming"], ...).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 nvidia-cuda-crt==13.0.88 -d "$tmp"
(cd "$tmp" && python3 -m zipfile -e nvidia_cuda_crt-*.whl x)
mkdir -p .carry/humming
tar -czf .carry/humming/cuda-crt-include.tar.gz -C "$tmp/x/nvidia/cu13/include" crt
ls -la .carry/humming
