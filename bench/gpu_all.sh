#!/usr/bin/env bash
# The one script for the GPU machine: builds everything against the NCCL that PyTorch ships (the
# one loaded at run time), runs every test (GPU tests included), compute-sanitizer on small cases,
# then the benchmark tables (bench/gpu_bench.sh), all under $OUT (default ./gpu-out).
# Usage: bench/gpu_all.sh [quick|tests]   quick: tests + a reduced benchmark grid; tests: build and
#        ctest only (for lab runs that add their own measurements after it)
# Takes about 8 minutes on 2 x H200 with the quick oracles (460 s for the whole call in run 58,
# build included, the add dataflow's grid and oracle too; BENCH_SCHEDULES=1 adds the schedules'
# side by side). Run `tilewave sweep --oracle --matrix full`
# (281 s with 15 rounds, run 13) in a call of its own: with it the script would pass a 10-minute
# call limit.
# Everything it writes is also archived as $OUT/00-gpu-results.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-out}
export BUILD=${BUILD:-build-gpu}
mode=${1:-full}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date -u +%T))"; }

step environment
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  # The copy of the tree on a GPU machine may have no .git: the caller can pass TW_COMMIT.
  echo "commit: ${TW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader
  echo "nccl: ${NCCL_ROOT:-toolkit}"
} | tee "$OUT/env.txt"

step build
# ptxas -v on: its register and spill lines are collected into ptxas.txt below.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTW_PTXAS_VERBOSE=ON \
  ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT} >"$OUT/build.log" 2>&1 &&
  cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
grep -E "Used [0-9]+ registers|spill stores" "$OUT/build.log" | sort | uniq -c >"$OUT/ptxas.txt"

step "tests (ctest, GPU tests included)"
ctest --test-dir "$BUILD" --output-on-failure --timeout 600 >"$OUT/ctest.log" 2>&1
echo "ctest exit $?"
grep -E "tests passed|Passed|Failed|\*\*\*|Not Run|Skipped" "$OUT/ctest.log" | tail -45
grep -E "^[0-9]+ passed, [0-9]+ failed" "$OUT/ctest.log" | sort | uniq -c

[ "$mode" = tests ] && exit 0

# One call's timeline (docs/trace.md) on GPU 0, checked by the validator, then what the trace costs
# when on (TW_TRACE=1: traced beside untraced calls) and memcheck on the traced calls' buffer.
step "tilewave trace: one call of 2 in-process ranks, and the trace's cost"
timeout 180 "$BUILD/tilewave" trace --in-process 2 --hidden 4096 --ffn 2048 --topk 2 --tokens 8192 \
  --out "$OUT/trace-in-process-2.json" >"$OUT/trace.md" 2>&1
echo "trace exit $?"; cat "$OUT/trace.md"
python3 tests/python/trace_check.py "$OUT/trace-in-process-2.json" && gzip -f "$OUT/trace-in-process-2.json"
TW_TRACE=1 timeout 400 "$BUILD/tilewave" bench --in-process 2 --hidden 4096 --ffn 2048 --topk 2 \
  --tokens 8192 --iters 20 --warmup 3 >"$OUT/bench-trace-cost.md" 2>"$OUT/bench-trace-cost.err"
echo "TW_TRACE=1 bench --in-process 2 exit $?"; cat "$OUT/bench-trace-cost.md"
TW_TIMEOUT_MS=300000 TW_TEAM_TIMEOUT_MS=1500000 timeout 600 compute-sanitizer --tool memcheck \
  --report-api-errors no --error-exitcode 9 "$BUILD/test_trace" --in-process 2 \
  >"$OUT/sanitizer-trace-memcheck.txt" 2>&1
echo "test_trace --in-process 2 memcheck: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-trace-memcheck.txt" | tr '\n' ' ')"

# One GPU: the multi-rank protocol runs in-process (ctest above ran those tests); the 2-GPU
# benchmarks below cannot run, so the one-GPU tables instead, then the sanitizers in-process.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
  step "one GPU: the SM budget table (bench/budget_table.sh)"
  timeout 300 bench/budget_table.sh "$BUILD" 20 >"$OUT/budget-table.md" 2>"$OUT/budget-table.err"
  echo "budget_table exit $?"; cat "$OUT/budget-table.md"
  step "one GPU: tilewave bench --in-process 2 (8192 tokens/rank, K 2048, N 4096, 16 experts)"
  timeout 400 "$BUILD/tilewave" bench --in-process 2 --hidden 4096 --ffn 2048 --topk 2 \
    --tokens 8192 --iters 20 --warmup 3 >"$OUT/bench-in-process-2.md" 2>"$OUT/bench-in-process-2.err"
  echo "bench --in-process 2 exit $?"; cat "$OUT/bench-in-process-2.md"
  step "one GPU: tilewave sweep --in-process 2 (the same point, C 1..16)"
  timeout 300 "$BUILD/tilewave" sweep --in-process 2 --hidden 4096 --ffn 2048 --topk 2 \
    --tokens 8192 --iters 10 --warmup 2 --c-max 16 >"$OUT/sweep-in-process-2.md" 2>"$OUT/sweep-in-process-2.err"
  echo "sweep --in-process 2 exit $?"; cat "$OUT/sweep-in-process-2.md"
  step "one GPU: the full soak (10^4 calls per dataflow), W = 2 and 4"
  for w in 2 4; do
    TW_SOAK_CALLS=10000 timeout 600 "$BUILD/test_soak" --in-process $w >"$OUT/soak-in-process-$w.txt" 2>&1
    echo "soak --in-process $w: exit $? $(grep -E '^soak total' "$OUT/soak-in-process-$w.txt")"
  done
  # The soak's first 20 calls, a check after each, under memcheck (both dataflows, every plan
  # kind; more than 150 s under the tool, run 82).
  TW_SOAK_CHECK_EVERY=1 TW_SOAK_CALLS=20 TW_TIMEOUT_MS=300000 TW_TEAM_TIMEOUT_MS=1500000 \
    timeout 600 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$BUILD/test_soak" --in-process 2 >"$OUT/sanitizer-soak-memcheck.txt" 2>&1
  echo "test_soak 20 calls memcheck: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-soak-memcheck.txt" | tr '\n' ' ')"
  step "one GPU: memcheck on the dispatch and the layer, in-process"
  for t in test_dispatch test_layer; do
    TW_TIMEOUT_MS=300000 TW_TEAM_TIMEOUT_MS=1500000 timeout 600 compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 9 "$BUILD/$t" --in-process 2 \
      >"$OUT/sanitizer-$t-in-process-memcheck.txt" 2>&1
    echo "$t --in-process 2 memcheck: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-$t-in-process-memcheck.txt" | tr '\n' ' ')"
  done
  step "one GPU: the layer and dispatch tables (bench/layer_table.sh)"
  timeout 400 bench/layer_table.sh "$BUILD" 10 >"$OUT/layer-table.md" 2>"$OUT/layer-table.err"
  echo "layer_table exit $?"; cat "$OUT/layer-table.md"
  step "one GPU: the trace's cost when off (a build with the hooks compiled out)"
  cmake -S . -B "$BUILD-nohooks" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTW_TRACE_HOOKS=OFF \
    ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT} >"$OUT/build-nohooks.log" 2>&1 &&
    cmake --build "$BUILD-nohooks" -j "$(nproc)" --target tilewave_cli >>"$OUT/build-nohooks.log" 2>&1 &&
    timeout 300 bench/trace_cost.sh "$BUILD" "$BUILD-nohooks" 7 >"$OUT/trace-cost.md" 2>&1
  echo "trace_cost exit $?"; cat "$OUT/trace-cost.md"
  step "one GPU: initcheck on the consumer's register path alone (are the bulk-row reports async-proxy writes?)"
  TW_TEST_COPY=registers TW_TEST_CASE=overlap_matches TW_TEST_QUICK=1 TW_TIMEOUT_MS=300000 \
    TW_TEAM_TIMEOUT_MS=1500000 timeout 300 compute-sanitizer --tool initcheck --report-api-errors no \
    --error-exitcode 9 --print-limit 100000 "$BUILD/test_overlap" --in-process 2 \
    >"$OUT/sanitizer-initcheck-registers.txt" 2>&1
  echo "initcheck, register copies: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-initcheck-registers.txt" | tr '\n' ' ')"
  grep -E "^=========     at " "$OUT/sanitizer-initcheck-registers.txt" | sed 's/+0x.*//' | sort | uniq -c | head
  step "one GPU: the grouped GEMMs beside DeepGEMM and torch._grouped_mm (bench/gemm_peers.sh)"
  OUT="$OUT/gemm-peers" timeout 400 bench/gemm_peers.sh "$BUILD" --quick >"$OUT/gemm-peers.txt" 2>&1
  echo "gemm_peers exit $?"; grep "^|" "$OUT/gemm-peers.txt" | head -40
  step "one GPU: a Hugging Face MoE model with its experts on the layer (bench/hf_model.sh)"
  timeout 500 bench/hf_model.sh "$BUILD" >"$OUT/hf-model.txt" 2>&1
  echo "hf_model exit $?"; tail -30 "$OUT/hf-model.txt"
  step "one GPU: compute-sanitizer on the in-process overlap test, full size"
  for tool in memcheck racecheck synccheck initcheck; do
    TW_TIMEOUT_MS=300000 TW_TEAM_TIMEOUT_MS=1500000 timeout 900 compute-sanitizer --tool $tool \
      --report-api-errors no --error-exitcode 9 "$BUILD/test_overlap" --in-process 2 \
      >"$OUT/sanitizer-overlap-in-process-$tool.txt" 2>&1
    echo "test_overlap --in-process 2 $tool: exit $? $(grep -E 'SUMMARY' "$OUT/sanitizer-overlap-in-process-$tool.txt" | tr '\n' ' ')"
  done
  step "one GPU: compute-sanitizer on the add-dataflow and timeout tests, in-process, full size"
  for t in test_combine_add test_timeout; do
    for tool in memcheck racecheck synccheck initcheck; do
      # The timeout test needs its own short device timeouts; only the host side is widened.
      if [ $t = test_timeout ]; then tmo=""; else tmo="TW_TIMEOUT_MS=300000"; fi
      env $tmo TW_TEAM_TIMEOUT_MS=1500000 timeout 600 compute-sanitizer --tool $tool \
        --report-api-errors no --error-exitcode 9 "$BUILD/$t" --in-process 2 \
        >"$OUT/sanitizer-$t-in-process-$tool.txt" 2>&1
      echo "$t --in-process 2 $tool: exit $? $(grep -E 'SUMMARY' "$OUT/sanitizer-$t-in-process-$tool.txt" | tr '\n' ' ')"
    done
  done
  exit 0
fi

step "compute-sanitizer (small cases)"
for tool in memcheck racecheck; do
  TW_GEMM_TEST_QUICK=1 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$BUILD/test_gemm" >"$OUT/sanitizer-gemm-$tool.txt" 2>&1
  echo "test_gemm $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-gemm-$tool.txt" | tr '\n' ' ')"
  TW_GEMM_TEST_QUICK=1 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$BUILD/test_gemm1" >"$OUT/sanitizer-gemm1-$tool.txt" 2>&1
  echo "test_gemm1 $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-gemm1-$tool.txt" | tr '\n' ' ')"
done
# NCCL probes kernel images at communicator setup; those API errors are not ours.
TW_TEST_QUICK=1 TW_TIMEOUT_MS=60000 timeout 200 compute-sanitizer --tool memcheck --report-api-errors no \
  --error-exitcode 9 \
  "$BUILD/test_overlap" >"$OUT/sanitizer-overlap-memcheck.txt" 2>&1
echo "test_overlap memcheck: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-overlap-memcheck.txt" | tr '\n' ' ')"
TW_TEST_QUICK=1 TW_TIMEOUT_MS=60000 timeout 200 compute-sanitizer --tool memcheck --report-api-errors no \
  --error-exitcode 9 "$BUILD/test_combine_add" >"$OUT/sanitizer-combine-add-memcheck.txt" 2>&1
echo "test_combine_add memcheck: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-combine-add-memcheck.txt" | tr '\n' ' ')"
grep -m 3 -A 12 "^========= Invalid\|^========= Program hit\|^========= Error" "$OUT/sanitizer-overlap-memcheck.txt" | head -45
# The default runs v5 at tn 128 and v4 at tn 256: each of the two at every tile width as well.
for v in 4 5; do
  for t in test_overlap test_timeout; do
    TW_GEMM_VARIANT=$v timeout 300 "$BUILD/$t" >"$OUT/$t-gemm-v$v.txt" 2>&1
    echo "$t with TW_GEMM_VARIANT=$v: exit $? $(tail -1 "$OUT/$t-gemm-v$v.txt")"
  done
done

step "benchmarks (bench/gpu_bench.sh)"
if [ "$mode" = quick ]; then bench/gpu_bench.sh quick; else bench/gpu_bench.sh; fi

if [ "$mode" != quick ]; then
  step "tilewave sweep, a second point (tokens/rank 16384, K 2048, N 8192, 64 experts, top-2)"
  timeout 150 "$BUILD/tilewave" sweep --tokens 16384 --hidden 8192 --ffn 2048 --experts 64 --topk 2 \
    --iters 10 --warmup 2 | tee "$OUT/sweep2.md"
fi

# Everything under $OUT in one archive as well, named to sort first: some transports of results
# bring back only the first few files of a run, in name order.
step "archive"
tar czf "$OUT/../00-gpu-results.tgz" -C "$OUT" . &&
  mv "$OUT/../00-gpu-results.tgz" "$OUT/00-gpu-results.tgz" && ls -la "$OUT/00-gpu-results.tgz"
