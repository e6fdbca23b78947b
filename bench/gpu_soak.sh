#!/usr/bin/env bash
# The soak (tests/gpu/test_soak.cu) on the GPU machine: builds test_soak against the NCCL that
# PyTorch ships, runs it in-process with 2 and 4 ranks on GPU 0 and, with 2 GPUs, over NCCL,
# each with TW_SOAK_CALLS calls per dataflow (default 10000: the full soak), and writes the
# summary lines of every run as a table to $OUT/soak.md (logs beside it).
# Usage: bench/gpu_soak.sh [calls-per-dataflow [team]]   team: in-process-2, in-process-4 or
#        nccl-2 (default: all three, one after the other; under a time limit per call, run one
#        team per call: its time per call is not measured yet)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-out}
BUILD=${BUILD:-build-gpu}
CALLS=${1:-10000}
ONLY=${2:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT} \
  >"$OUT/soak-build.log" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" --target test_soak \
  >>"$OUT/soak-build.log" 2>&1 || { tail -30 "$OUT/soak-build.log"; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
{
  echo "# Soak, $(date -u +%Y-%m-%d), commit ${TW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo
  echo "TW_SOAK_CALLS=$CALLS per dataflow; a check every 100 calls (tests/gpu/test_soak.cu)."
  echo
  echo "| team | exit | summary (rank 0) |"
  echo "| --- | --- | --- |"
} >"$OUT/soak.md"
run() { # name, args...
  local name=$1
  shift
  if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
  TW_SOAK_CALLS=$CALLS timeout 3000 "$BUILD/test_soak" "$@" >"$OUT/soak-$name.log" 2>"$OUT/soak-$name.err"
  local rc=$?
  grep -E '^soak (reduce|add|total):' "$OUT/soak-$name.log" | while read -r line; do
    echo "| $name | $rc | $line |"
  done >>"$OUT/soak.md"
  grep -qE '^soak total:' "$OUT/soak-$name.log" || echo "| $name | $rc | (no summary; see soak-$name.log) |" >>"$OUT/soak.md"
  echo "$name: exit $rc"
}
run in-process-2 --in-process 2
run in-process-4 --in-process 4
if [ "$gpus" -ge 2 ]; then run nccl-2; fi
cat "$OUT/soak.md"
