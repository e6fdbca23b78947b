#!/usr/bin/env bash
# A change side by side with what it replaces, on a GPU machine, in one go: builds the tree as it
# is (build-gpu) and an old one (OLD: a kernel file that replaces src/kernels/sm90_gemm.cu in a
# copy of this tree, or a .tgz of a whole older tree, e.g. `git archive REV | gzip`), then
#   tests:  ctest (GPU tests included) and compute-sanitizer racecheck / synccheck on test_gemm
#           (small shapes), new build only;
#   gputests: the GPU tests only (ctest -R gpu), new build only;
#   gemm:   `tilewave bench gemm` (the default grid), old, new, old, new;
#   points: `tilewave bench` at the given shapes (POINTS: "N:E ..." at tokens 8192,16384), each
#           old then new.
# Usage: dev/gemm/ab_kernel.sh OLD [tests|gputests] [gemm] [points]   results under $OUT
set -uo pipefail
OLD=$1; shift
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
# ptxas -v on: the new build's register and spill lines go to ptxas-new.txt.
cfg() { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTW_PTXAS_VERBOSE=ON \
  ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT}; }
OLDTREE=$(mktemp -d)
if [[ $OLD == *.tgz ]]; then
  tar -xzf "$OLD" -C "$OLDTREE"
else
  cp -r CMakeLists.txt include src harness tools tests python bench dev scripts "$OLDTREE"/ &&
    cp "$OLD" "$OLDTREE/src/kernels/sm90_gemm.cu"
fi
{ cfg . build-gpu && cmake --build build-gpu -j "$(nproc)"; } >"$OUT/build-new.log" 2>&1 || { tail -30 "$OUT/build-new.log"; exit 1; }
{ cfg "$OLDTREE" "$OLDTREE/build" && cmake --build "$OLDTREE/build" -j "$(nproc)" --target tilewave_cli; } \
  >"$OUT/build-old.log" 2>&1 || { tail -30 "$OUT/build-old.log"; exit 1; }
grep -E "Used [0-9]+ registers|spill stores" "$OUT/build-new.log" | sort | uniq -c >"$OUT/ptxas-new.txt"
NEW_TW=build-gpu/tilewave OLD_TW=$OLDTREE/build/tilewave
echo "built $(date -u +%T); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for what in "$@"; do
  case $what in
    tests)
      ctest --test-dir build-gpu --output-on-failure --timeout 300 >"$OUT/ctest.log" 2>&1
      echo "ctest exit $?: $(grep -E 'tests passed' "$OUT/ctest.log")"
      grep -E "Failed|\*\*\*|Not Run" "$OUT/ctest.log" | head
      for tool in racecheck synccheck; do
        TW_GEMM_TEST_QUICK=1 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
          build-gpu/test_gemm >"$OUT/sanitizer-gemm-$tool.txt" 2>&1
        echo "test_gemm $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-gemm-$tool.txt" | tr '\n' ' ')"
      done ;;
    gputests)
      ctest --test-dir build-gpu -R '^gpu\.' --output-on-failure --timeout 300 >"$OUT/ctest-gpu.log" 2>&1
      rc=$?
      echo "ctest (GPU tests) exit $rc: $(grep -E 'tests passed|tests failed' "$OUT/ctest-gpu.log")"
      grep -E "Failed|\*\*\*|CHECK failed" "$OUT/ctest-gpu.log" | head
      [ $rc = 0 ] || { echo "stopping: a GPU test failed"; break; } ;;
    gemm)
      for round in 1 2; do
        for v in old new; do
          tw=$NEW_TW; [ $v = old ] && tw=$OLD_TW
          timeout 150 "$tw" bench gemm >"$OUT/gemm-$v-$round.md" 2>&1
          echo "bench gemm $v round $round: exit $? ($(date -u +%T))"
        done
      done ;;
    points)
      for pt in ${POINTS:-4096:32 4096:64 8192:32 8192:64}; do
        for v in old new; do
          tw=$NEW_TW; [ $v = old ] && tw=$OLD_TW
          timeout 150 "$tw" bench --tokens 8192,16384 --hidden "${pt%%:*}" --ffn 2048 --topk 2 \
            --experts "${pt##*:}" --json-file "$OUT/points-${pt/:/-}-$v.json" >"$OUT/points-${pt/:/-}-$v.md" 2>&1
          echo "bench N ${pt%%:*} E ${pt##*:} $v: exit $? ($(date -u +%T))"
        done
      done ;;
  esac
done
# Only a few files come back from a GPU host: everything in one archive, named to sort first.
tar -czf "$OUT/../00-ab.tgz" -C "$OUT" . && mv "$OUT/../00-ab.tgz" "$OUT/00-ab.tgz"
