# Source on the device (after the engine's activate.sh): lets humming-kernels' JIT find one CUDA 13 tree.
#   source benchmarks/humming_env.sh [EXTRAS_DIR]
# EXTRAS_DIR (carried; built here, see BENCHMARKS.md) may hold cuda-crt-include.tar.gz (the crt/ headers of
# nvidia-cuda-crt 13.0.88, which only nvidia-cuda-nvcc pulls in, and the image lacks) and
# python-include.tar.gz (CPython 3.12 headers, used only if the image's Python has none).
# humming looks for cuda.h, crt/host_defines.h, cuda/std/cstdint, nvrtc.h and libnvrtc in ONE tree
# (/usr/local/cuda*, $CUDA_HOME, or a site's nvidia/cu13).  On the H200 image they are split: the image has
# nvidia/cu13 with the runtime and NVRTC, the staged site adds nvidia-cuda-crt and nvidia-cuda-cccl.  This
# links both into /tmp/cuda-13.0 (symlinks only), adds libcuda.so for humming's launcher (built with
# torch.utils.cpp_extension: g++, ninja, -lcuda) and, when the image's Python has no headers, unpacks the
# ones given.  It prints what it found and what is missing; nothing here changes the image.
_he_x=${1:-}
_he_root=/tmp/cuda-13.0
mkdir -p "$_he_root/include" "$_he_root/lib" /tmp/humming-cache
for _he_d in $(python3 -c "import nvidia, sys; print(' '.join(nvidia.__path__))" 2>/dev/null); do
  [ -d "$_he_d/cu13/include" ] && cp -rsn "$_he_d/cu13/include/." "$_he_root/include/" 2>/dev/null
  if [ -d "$_he_d/cu13/lib" ]; then
    for _he_f in "$_he_d"/cu13/lib/*; do ln -sfn "$_he_f" "$_he_root/lib/$(basename "$_he_f")"; done
  fi
done
[ -e "$_he_root/lib/libnvrtc.so" ] || { _he_n=$(ls "$_he_root"/lib/libnvrtc.so.* 2>/dev/null | head -1); [ -n "$_he_n" ] && ln -sfn "$_he_n" "$_he_root/lib/libnvrtc.so"; }
if [ ! -e "$_he_root/include/crt/host_defines.h" ] && [ -f "$_he_x/cuda-crt-include.tar.gz" ]; then
  tar -xzf "$_he_x/cuda-crt-include.tar.gz" -C "$_he_root/include" && echo "[humming_env] crt/ headers from $_he_x"
fi
_he_cuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
[ -n "$_he_cuda" ] && ln -sfn "$_he_cuda" "$_he_root/lib/libcuda.so"
echo '{"cuda": {"version": "13.0"}}' > "$_he_root/version.json"
# humming searches /usr/local/cuda-*: link the tree there rather than exporting CUDA_HOME, which sends
# vLLM's FlashInfer JIT (sampling kernels at engine start) to look for $CUDA_HOME/bin/nvcc and fail
if [ -e /usr/local/cuda-13.0 ] && [ ! -L /usr/local/cuda-13.0 ]; then export CUDA_HOME=$_he_root
elif ! ln -sfn "$_he_root" /usr/local/cuda-13.0 2>/dev/null; then export CUDA_HOME=$_he_root; fi
export LIBRARY_PATH=$_he_root/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export HUMMING_CACHE_DIR=/tmp/humming-cache
_he_pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ ! -f "$_he_pyinc/Python.h" ] && [ -f "$_he_x/python-include.tar.gz" ]; then
  mkdir -p /tmp/pyinc && tar -xzf "$_he_x/python-include.tar.gz" -C /tmp/pyinc
  export CPATH=/tmp/pyinc/python3.12${CPATH:+:$CPATH}
  echo "[humming_env] Python.h from $_he_x"
fi
for _he_h in cuda.h crt/host_defines.h cccl/cuda/std/cstdint nvrtc.h cuda_runtime.h; do
  [ -e "$_he_root/include/$_he_h" ] || echo "[humming_env] MISSING header $_he_h"
done
for _he_b in g++ ninja; do command -v "$_he_b" >/dev/null || echo "[humming_env] MISSING $_he_b"; done
echo "[humming_env] tree=$_he_root ($( [ -L /usr/local/cuda-13.0 ] && echo /usr/local/cuda-13.0 || echo CUDA_HOME)) libcuda=${_he_cuda:-MISSING} g++=$(command -v g++ || echo none) Python.h=$([ -f "$_he_pyinc/Python.h" ] && echo image || echo "${CPATH:-MISSING}")"
unset _he_root _he_d _he_f _he_n _he_cuda _he_pyinc _he_h _he_b _he_x
