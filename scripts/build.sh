#!/usr/bin/env bash
# Configures and builds tilewave (library, `tilewave` tool, tests) into build/.
# Installs the build tools from Debian's packages when they are missing (CI starts clean).
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v python3 >/dev/null || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
fi
command -v nvcc >/dev/null || { echo "error: nvcc not found; install the CUDA 13 toolkit or put it on PATH" >&2; exit 1; }

# NCCL: the CUDA toolkit's when it ships nccl.h, else the one PyTorch ships (nvidia-nccl wheel),
# which is also the one loaded at run time next to PyTorch. -DTW_NCCL_ROOT=... overrides both.
nccl=()
cuda_inc="$(dirname "$(dirname "$(command -v nvcc)")")/include"
if [ ! -f "$cuda_inc/nccl.h" ] && [[ " $* " != *" -DTW_NCCL_ROOT="* ]]; then
  root=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
  if [ -n "$root" ] && [ -f "$root/include/nccl.h" ]; then
    echo "using NCCL from $root"
    nccl=("-DTW_NCCL_ROOT=$root")
  fi
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${nccl[@]}" "$@"
cmake --build build -j "$(nproc)"
