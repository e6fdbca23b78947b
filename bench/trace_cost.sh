#!/usr/bin/env bash
# trace_cost.sh: what the kernels' trace hooks cost when tracing is off. The same
# `tilewave bench --in-process 2` point runs from a default build (hooks compiled in, every site
# one branch on a NULL pointer) and from a -DTW_TRACE_HOOKS=OFF build (the sites compiled out),
# alternately, REPS times each (an ON run, then an OFF run, ... so that clock and temperature
# drift hit both alike); each run prints ours' median over --iters calls. The script prints both
# builds' medians of those medians, their ratio ON / OFF and the spread of each, and exits 1 when
# a run fails or its #wrong is not 0. About 2 minutes on one H200 at the default shape.
# Usage: bench/trace_cost.sh BUILD_ON BUILD_OFF [REPS [bench flags...]]
#   e.g. cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build
#        cmake -S . -B build-nohooks -G Ninja -DCMAKE_BUILD_TYPE=Release -DTW_TRACE_HOOKS=OFF
#        cmake --build build-nohooks --target tilewave_cli
#        bench/trace_cost.sh build build-nohooks 7
#   The default point: tokens/rank 8192, K 2048, N 4096, 16 experts, top-2 (flags after REPS
#   replace it, e.g. --model qwen1.5-moe-a2.7b --tokens 4096).
set -uo pipefail
ON=$1
OFF=$2
REPS=${3:-7}
shift $(($# < 3 ? $# : 3))
if [ $# -gt 0 ]; then
  point=("$@")
else
  point=(--tokens 8192 --ffn 2048 --hidden 4096 --experts 16 --topk 2)
fi
export CUDA_MODULE_LOADING=EAGER
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

# One run; prints ours' median (us) of the table's first row, or fails.
run_one() {
  local tw=$1 out=$2
  timeout 120 "$tw/tilewave" bench --in-process 2 --iters 30 --warmup 5 "${point[@]}" >"$out" 2>&1 ||
    { echo "trace_cost: $tw/tilewave bench failed:" >&2; tail -5 "$out" >&2; return 1; }
  python3 - "$out" <<'PY'
import sys
rows = [l for l in open(sys.argv[1]) if l.startswith("|")]
head = [c.strip() for c in rows[0].strip().strip("|").split("|")]
row = [c.strip() for c in rows[2].strip().strip("|").split("|")]
if row[head.index("#wrong")] != "0":
    sys.exit("trace_cost: #wrong %s" % row[head.index("#wrong")])
print(row[head.index("ours us")])
PY
}

for b in "$ON" "$OFF"; do
  [ -x "$b/tilewave" ] || { echo "trace_cost: no $b/tilewave (build it first)"; exit 2; }
done
echo "point: ${point[*]}; $REPS runs per build, alternating; ours' median of 30 calls per run"
on=() off=()
for i in $(seq 1 "$REPS"); do
  a=$(run_one "$ON" "$log/on-$i.txt") || exit 1
  b=$(run_one "$OFF" "$log/off-$i.txt") || exit 1
  on+=("$a") off+=("$b")
  echo "run $i/$REPS: hooks in $a us, hooks out $b us"
done
python3 - "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
on = [float(v) for v in sys.argv[1].split()]
off = [float(v) for v in sys.argv[2].split()]
m_on, m_off = statistics.median(on), statistics.median(off)
print()
print("| build | runs | median us | min us | max us |")
print("| --- | ---: | ---: | ---: | ---: |")
print("| hooks in (tracing off) | %d | %.1f | %.1f | %.1f |" % (len(on), m_on, min(on), max(on)))
print("| hooks compiled out | %d | %.1f | %.1f | %.1f |" % (len(off), m_off, min(off), max(off)))
print()
print("ratio in / out: %.4f (%+.2f%%); spread of the out build: %.2f%%"
      % (m_on / m_off, 100 * (m_on / m_off - 1), 100 * (max(off) - min(off)) / m_off))
PY
