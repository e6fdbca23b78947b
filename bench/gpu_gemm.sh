#!/usr/bin/env bash
# gpu_gemm.sh: build, test, sanitize and benchmark the producer GEMM on a GPU machine, in one go.
# Run from the repository root; logs and tables go to $OUT (default ./gemm-out).
#   bench/gpu_gemm.sh [all|test|bench|sweep]     (default all)
# Env: GEMM_VARIANTS (kernel versions to benchmark, default "4", the shipped one), SWEEP_VARIANTS and SWEEP_GRIDS
# (versions and persistent grids of the sweep, default "4" and "132 128 124 120 112"), BENCH_ARGS
# (extra options for `bench gemm`, e.g. "--reps 10"). Builds with nvcc directly (only the files
# this needs), so it does not depend on the rest of the tree building.
set -uo pipefail
OUT=${OUT:-./gemm-out}
MODE=${1:-all}
mkdir -p "$OUT"
B=$(mktemp -d)
NVCC="nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -Iinclude -Isrc/core -Isrc/plan -Isrc/kernels -Itools -Itests"
S="$OUT/summary.txt"
echo "== $(date -u +%FT%TZ) commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" | tee "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$S"
# Compile each translation unit once, in parallel, then link.
$NVCC -Xptxas -v -c src/kernels/sm90_gemm.cu -o "$B/sm90.o" > "$OUT/ptxas.txt" 2>&1 &
$NVCC -c src/kernels/fill.cu -o "$B/fill.o" &
$NVCC -c src/core/status.c -o "$B/status.o" &
for f in src/plan/*.c; do $NVCC -c "$f" -o "$B/plan_$(basename "$f" .c).o" & done
$NVCC -c tests/gpu/test_gemm.cu -o "$B/test.o" &
$NVCC -c tools/bench_gemm.cu -o "$B/bench.o" &
$NVCC -c dev/gemm/gemm_lab.cu -o "$B/lab.o" &
wait
awk '/Compiling entry/ {match($0, /kernelI[A-Za-z0-9_]*Ev/); k=substr($0, RSTART + 7, RLENGTH - 9)}
     /spill/ {sp=$0; sub(/^ +/, "", sp)} /Used/ {u=$0; sub(/.*: /, "", u); print k ": " u "; " sp}' "$OUT/ptxas.txt" | tee -a "$S"
$NVCC "$B/test.o" "$B/sm90.o" "$B/fill.o" "$B/status.o" "$B"/plan_*.o -lcublas -o "$B/test_gemm" || exit 1
$NVCC "$B/lab.o" "$B/bench.o" "$B/sm90.o" "$B/fill.o" "$B/status.o" "$B"/plan_*.o -lcublas -o "$B/gemm_lab" || exit 1
echo "built $(date -u +%T)" | tee -a "$S"
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  timeout 150 "$B/test_gemm" > "$OUT/test_gemm.txt" 2>&1; rc=$?; echo "test_gemm rc=$rc" | tee -a "$S"
  tail -3 "$OUT/test_gemm.txt" | tee -a "$S"
  if [ $rc = 124 ]; then echo "test_gemm hung: stopping here" | tee -a "$S"; exit 1; fi
  grep -E "passed|FAIL|CHECK failed|wrong|error" "$OUT/test_gemm.txt" | head -20 | tee -a "$S"
  for tool in memcheck racecheck; do
    TW_GEMM_TEST_QUICK=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 "$B/test_gemm" \
      > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')" | tee -a "$S"
  done
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  for v in ${GEMM_VARIANTS:-4}; do
    timeout 120 "$B/gemm_lab" $v ${BENCH_ARGS:-} > "$OUT/bench_v$v.md" 2>&1; echo "bench v$v rc=$?" | tee -a "$S"
    cat "$OUT/bench_v$v.md" | tee -a "$S"
  done
  # Extra points: the small-expert shape with 128-wide tiles, and 64-row tiles.
  for v in ${GEMM_VARIANTS:-4}; do
    for extra in "--tn 128" "--tm 64 --tn 128" "--tm 64 --tn 256"; do
      timeout 60 "$B/gemm_lab" $v --rows 8192 --k 1408 --n 2048 --experts 30 $extra ${BENCH_ARGS:-} 2>&1 | grep -E "^\| +[0-9]" | sed "s/^/v$v $extra /" | tee -a "$S"
    done
  done
fi
if [ "$MODE" = all ] || [ "$MODE" = sweep ]; then
  # Persistent grid P = 132 - C: how ours scales with fewer SMs.
  for v in ${SWEEP_VARIANTS:-4}; do
    for g in ${SWEEP_GRIDS:-132 128 124 120 112}; do
      timeout 60 "$B/gemm_lab" $v --grid $g --rows 16384 --k 2048 --n 4096 --experts 4 ${BENCH_ARGS:-} 2>&1 \
        | grep -E "^\| +[0-9]" | sed "s/^/v$v grid $g /" | tee -a "$S"
    done
  done
fi
echo "done $(date -u +%T)" | tee -a "$S"
