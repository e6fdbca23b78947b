#!/usr/bin/env bash
# GPU correctness run of the overlapped GEMM2 + combine (2 GPUs): builds the two multi-rank
# tests against the NCCL that PyTorch ships (the one loaded at run time), runs them, then
# compute-sanitizer memcheck on a quick pass. Output goes to $OUT/overlap_tests.log when OUT
# is set. Usage: bench/gpu_overlap_tests.sh [build-dir]
set -o pipefail
BUILD=${1:-build-gpu-runtime}
LOG=${OUT:-.}/overlap_tests.log
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])')
{
  echo "== configure + build ($(date -u +%H:%M:%S))"
  cmake -S . -B "$BUILD" -G Ninja -DTW_NCCL_ROOT="$NCCL_ROOT" -DTW_PTXAS_VERBOSE=OFF >/dev/null &&
    ninja -C "$BUILD" test_overlap test_timeout 2>&1 | grep -Ev "ptxas info|bytes stack frame" | tail -5
  echo "== test_overlap ($(date -u +%H:%M:%S))"
  timeout 240 "$BUILD/test_overlap"; echo "test_overlap rc=$?"
  echo "== test_timeout ($(date -u +%H:%M:%S))"
  timeout 120 "$BUILD/test_timeout"; echo "test_timeout rc=$?"
  echo "== memcheck, quick pass ($(date -u +%H:%M:%S))"
  TW_TEST_QUICK=1 TW_TIMEOUT_MS=60000 timeout 200 compute-sanitizer --tool memcheck \
    --target-processes all --report-api-errors no --print-limit 20 "$BUILD/test_overlap" \
    > "${OUT:-.}/memcheck.log" 2>&1
  echo "memcheck rc=$?"
  grep -E "ERROR SUMMARY|Invalid|out of bounds|passed, |FAIL" "${OUT:-.}/memcheck.log" | head -40
  echo "== done ($(date -u +%H:%M:%S))"
} 2>&1 | tee "$LOG"
