#!/usr/bin/env bash
# gpu_bench.sh: the benchmark tables of tilewave on a multi-GPU machine, in one command.
#
# Builds the tool against the NCCL that PyTorch ships (the one loaded at run time), checks the
# baselines against the double-precision reference (test_baseline), then runs, writing each
# table under $OUT (default ./bench-out):
#   bench.md / bench.json        tilewave bench: the main grid (overlap vs sequential, unfused,
#                                chunked copy-engine, ours' phases), correctness checked on every
#                                point
#   bench-add.md / .json         the same grid with the add dataflow (TW_DATAFLOW_ADD)
#   bench-gemm.md                tilewave bench gemm: producer GEMM vs cuBLAS (calls back to back)
#   bench-gemm-idle.md           the same with 300 us of idle device before each call, as in
#                                tilewave bench (cuBLAS measured 17% faster that way at one point)
#   bench-gemm1.md               tilewave bench gemm1: GEMM1 + SwiGLU vs cuBLAS + SwiGLU, roofline
#   bench-gemm1-tm64.md          the same in 64-row bands (the 64 x 128 SwiGLU tiles)
#   sweep.md / sweep.json        tilewave sweep: every C x mgb of one point, oracle, model, regret
#   oracle.md / oracle.json      tilewave sweep --oracle: the model's regret over a workload matrix
#                                (ORACLE_MATRIX, default quick) and the best fixed (C, mgb);
#                                oracle-add.md / .json: the quick matrix's top-2 points, add
#                                dataflow
#   calibrate.md, calibration.txt  tilewave calibrate: this machine's description for the model
#   launcher-rank*.md            tilewave bench started as two processes by a torchrun-style env
#   bench-gemm-<schedule>.md, bench-<schedule>.md   the two schedules side by side (only with
#                                BENCH_SCHEDULES=1)
#   bench-gemm-tiles.md          bench gemm at the many-small-experts point: one row each for tm
#                                128 x tn 256, 128 x 128, 64 x 256, 64 x 128, in that order
#   torch_peer.md                PyTorch per-expert matmul + all_to_all_single on the same routing
#   log.txt                      everything printed, with timings
# Usage: bench/gpu_bench.sh [quick]   (quick: tokens/rank 8192 only, fewer samples, no GEMM bench)
# Time: 111 s in full on 2 x H200 at commit 67fbb54 (build 20 s, bench 37 s; docs/bench.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-out}
BUILD=${BUILD:-build-gpubench}
mode=${1:-full}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1

step() { echo; echo "=== $* ($(date -u +%T))"; }
rc_all=0
note() { echo "$1: exit $2"; [ "$2" -eq 0 ] || [ "$2" -eq 77 ] || rc_all=1; }

step environment
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
echo "commit ${TW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; NCCL ${NCCL_ROOT:-toolkit}"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader

step build
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTW_PTXAS_VERBOSE=OFF \
  ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT} >"$BUILD/cmake.log" 2>&1 &&
  ninja -C "$BUILD" tilewave_cli libtilewave.so test_baseline >"$BUILD/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  tail -40 "$BUILD/cmake.log" "$BUILD/build.log"
  note build $rc
  exit 1
fi
TW="$BUILD/tilewave"

step "baselines vs the reference (test_baseline)"
timeout 180 "$BUILD/test_baseline"
note test_baseline $?

if [ "$mode" = quick ]; then
  bench_args=(--tokens 8192 --iters 15 --warmup 3)
  sweep_args=(--iters 10 --warmup 2)
else
  bench_args=()
  sweep_args=()
fi

step "tilewave bench (default grid)"
timeout 330 "$TW" bench "${bench_args[@]}" --phases --json-file "$OUT/bench.json" | tee "$OUT/bench.md"
note "tilewave bench" $?

step "tilewave bench --dataflow add (default grid; the same baselines)"
timeout 330 "$TW" bench "${bench_args[@]}" --dataflow add --phases --json-file "$OUT/bench-add.json" |
  tee "$OUT/bench-add.md"
note "tilewave bench --dataflow add" $?

step "tilewave bench gemm"
if [ "$mode" = quick ]; then
  echo "skipped in quick mode"
elif "$TW" bench gemm --help >/dev/null 2>&1; then
  timeout 90 "$TW" bench gemm | tee "$OUT/bench-gemm.md"
  note "tilewave bench gemm" $?
  step "tilewave bench gemm --delay-us 300 (each call after 300 us of idle device)"
  timeout 90 "$TW" bench gemm --delay-us 300 | tee "$OUT/bench-gemm-idle.md"
  note "tilewave bench gemm --delay-us 300" $?
  if "$TW" bench gemm1 --help >/dev/null 2>&1; then
    step "tilewave bench gemm1 (GEMM1 + SwiGLU)"
    timeout 120 "$TW" bench gemm1 | tee "$OUT/bench-gemm1.md"
    note "tilewave bench gemm1" $?
    timeout 120 "$TW" bench gemm1 --tile-m 64 | tee "$OUT/bench-gemm1-tm64.md"
    note "tilewave bench gemm1 --tile-m 64" $?
  fi
else
  echo "this build has no GEMM benchmark"
fi

if [ "$mode" != quick ]; then
  step "bench gemm: tile shapes at the many-small-experts point (rows 8192, K 1408, N 2048, E 30)"
  for tm in 128 64; do
    for tn in 256 128; do
      echo "tm $tm tn $tn:"
      timeout 60 "$TW" bench gemm --rows 8192 --k 1408 --n 2048 --experts 30 --tm $tm --tn $tn |
        grep -E "^\| +[0-9]" | tee -a "$OUT/bench-gemm-tiles.md"
    done
  done
fi

step "tilewave sweep (tokens/rank 8192, K 2048, N 4096, E 16, top-2, balanced)"
timeout 120 "$TW" sweep "${sweep_args[@]}" --json-file "$OUT/sweep.json" | tee "$OUT/sweep.md"
note "tilewave sweep" $?

# The schedules side by side (two bench gemm grids and 16 overlapped points) run only when asked
# for (BENCH_SCHEDULES=1; last in run 36), so that the script with the add dataflow's tables stays
# well inside a 10-minute call (run 46: 424.5 s without them).
if [ "$mode" != quick ] && [ "${BENCH_SCHEDULES:-0}" = 1 ]; then
  step "schedules: remote-first vs expert-major (bench gemm grid; bench at 16-128 experts)"
  for sch in remote-first expert-major; do
    TW_SCHEDULE=$sch timeout 150 "$TW" bench gemm >"$OUT/bench-gemm-$sch.md"
    note "bench gemm $sch" $?
    for e in 16 32 64 128; do
      for n in 4096 8192; do
        TW_SCHEDULE=$sch timeout 60 "$TW" bench --tokens 8192 --hidden $n --ffn 2048 --experts $e \
          --topk 2 --iters 15 --warmup 3 | grep -E "^\| 8192 " >>"$OUT/bench-$sch.md"
      done
    done
    cat "$OUT/bench-$sch.md"
  done
fi

if [ "$mode" != quick ]; then
  # The producer's variants 4 and 5 side by side in one run (the default takes 5 at tn 128, 4 at
  # tn 256; dev/gemm/NOTES.md v9): the GEMM alone at granite's short tiles and on the grid's K
  # 2048, then the whole overlapped call.
  step "producer variants 4 and 5 side by side (bench gemm; bench with TW_GEMM_VARIANT)"
  for v in 4 5; do
    for shape in "--rows 65536 --k 512 --n 1024 --experts 32 --tn 128" \
                 "--rows 16384 --k 2048 --n 8192 --experts 16" \
                 "--rows 16384 --k 2048 --n 4096 --experts 64"; do
      timeout 60 "$TW" bench gemm $shape --variant $v | grep -E "^\| +[0-9]" | sed "s/^/v$v /"
    done
  done | tee "$OUT/bench-gemm-variants.md"
  for v in 4 5; do
    for args in "--model granite-3.1-1b-a400m --tokens 4096,16384" \
                "--tokens 8192 --hidden 8192 --ffn 2048 --experts 16 --topk 2" \
                "--tokens 16384 --hidden 4096 --ffn 2048 --experts 64 --topk 2"; do
      TW_GEMM_VARIANT=$v timeout 90 "$TW" bench $args --iters 20 --warmup 3 --chunks 4096 |
        grep -E "^\| [0-9]" | sed "s/^/v$v /"
    done
  done | tee "$OUT/bench-variants.md"
  note "producer variants" $?
fi

step "tilewave calibrate"
timeout 120 "$TW" calibrate --out "$OUT/calibration.txt" --json "$OUT/calibration.json" \
  | tee "$OUT/calibrate.md"
note "tilewave calibrate" $?

if [ "$mode" != quick ]; then
  step "tilewave sweep --oracle --matrix ${ORACLE_MATRIX:-quick}"
  timeout 500 "$TW" sweep --oracle --matrix "${ORACLE_MATRIX:-quick}" \
    --json-file "$OUT/oracle.json" | tee "$OUT/oracle.md"
  note "tilewave sweep --oracle" $?
  step "tilewave sweep --oracle --matrix quick --dataflow add (its top-2 points)"
  timeout 200 "$TW" sweep --oracle --matrix quick --dataflow add --json-file "$OUT/oracle-add.json" |
    tee "$OUT/oracle-add.md"
  note "tilewave sweep --oracle --dataflow add" $?
fi

step "external launcher: one process per GPU from RANK / WORLD_SIZE / LOCAL_RANK (torchrun style)"
idf="$OUT/launcher-unique-id"
rm -f "$idf"
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r TW_UNIQUE_ID_FILE="$idf" timeout 120 "$TW" bench --tokens 4096 \
    --hidden 4096 --ffn 2048 --experts 16 --topk 2 --iters 5 --warmup 1 >"$OUT/launcher-rank$r.md" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}"
  note "launcher rank $r" $?
done
tail -2 "$OUT/launcher-rank0.md"

step "PyTorch peer (bench/torch_peer.py)"
TILEWAVE_LIBRARY="$PWD/$BUILD/libtilewave.so" timeout 180 python3 bench/torch_peer.py \
  | tee "$OUT/torch_peer.md"
note torch_peer $?

step done
exit $rc_all
