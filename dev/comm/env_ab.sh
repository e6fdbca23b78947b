#!/usr/bin/env bash
# Consumer settings side by side, one binary, on a GPU machine: `tilewave bench --phases` over the
# default grid once per arm and again in reverse order (A B C C B A), then a table of each arm's
# median of its two runs against the first arm's. An arm is NAME=ASSIGNMENTS, the assignments
# comma-separated environment variables (empty: the defaults).
# Usage (after a build): dev/comm/env_ab.sh BUILD ARM ARM...; env BENCH_ARGS adds bench options
# (e.g. "--chunks 8192": one chunked size instead of four, a shorter run); env BENCH=gemm runs
# `tilewave bench gemm` instead (the producer alone; the table then compares its "ours" column).
#   e.g. dev/comm/env_ab.sh build-gpu tail2= tail8=TW_CONSUMER_TAIL_BANDS=8
#        BENCH=gemm BENCH_ARGS="--delay-us 300" dev/comm/env_ab.sh build-gpu g1= g4=TW_TILE_GROUP=4
set -uo pipefail
BUILD=$1
shift
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
arms=("$@")
order=("${arms[@]}")
for ((j = ${#arms[@]} - 1; j >= 0; j--)); do order+=("${arms[j]}"); done
i=0
for arm in "${order[@]}"; do
  i=$((i + 1))
  name=${arm%%=*}
  assignments=${arm#*=}
  (
    IFS=, read -ra settings <<<"$assignments"
    for a in "${settings[@]}"; do export "${a?}"; done
    read -ra extra <<<"${BENCH_ARGS:-}"
    if [ "${BENCH:-}" = gemm ]; then
      timeout 200 "$BUILD/tilewave" bench gemm "${extra[@]}" >"$OUT/ab-$i-$name.md" 2>&1
    else
      timeout 200 "$BUILD/tilewave" bench --phases "${extra[@]}" --json-file "$OUT/ab-$i-$name.json" \
        >"$OUT/ab-$i-$name.md" 2>&1
    fi
    echo "run $i ($name: ${assignments:-defaults}): exit $? $(date -u +%T)"
  )
done
if [ "${BENCH:-}" = gemm ]; then
  python3 - "$OUT" "${arms[@]%%=*}" <<'PY'
import glob, math, os, re, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {}  # (rows, K, N, E, tn) -> arm -> [ours us, concat us] per run
for f in sorted(glob.glob(os.path.join(out, "ab-*.md"))):
    arm = os.path.basename(f)[:-3].split("-", 2)[2]
    for l in open(f):
        c = [x.strip() for x in l.strip().strip("|").split("|")]
        if len(c) > 10 and re.fullmatch(r"\d+", c[0]):
            runs.setdefault(tuple(c[:5]), {}).setdefault(arm, []).append(
                (float(c[5].split()[0]), float(c[9].split()[0])))
base = names[0]
print("| rows | K | N | E | tn | " + " | ".join("%s us" % n for n in names) + " | " +
      " | ".join("%s / %s" % (n, base) for n in names[1:]) + " | concat us | best / concat |")
print("|" + " ---: |" * (4 + 2 * len(names)) + " ---: | ---: |")
logs = {n: 0.0 for n in names[1:]}
for key, arms in runs.items():
    if not all(a in arms for a in names):
        continue
    med = {a: statistics.median(x[0] for x in arms[a]) for a in names}
    concat = statistics.median(x[1] for a in names for x in arms[a])
    for a in names[1:]:
        logs[a] += math.log(med[a] / med[base])
    print("| " + " | ".join(key) + " | " + " | ".join("%.1f" % med[a] for a in names) + " | " +
          " | ".join("%.4f" % (med[a] / med[base]) for a in names[1:]) +
          " | %.1f | %.2f |" % (concat, concat / min(med.values())))
for a in names[1:]:
    print("\ngeometric mean %s / %s %.4f over %d shapes" % (a, base, math.exp(logs[a] / len(runs)),
                                                           len(runs)))
PY
  exit 0
fi
python3 - "$OUT" "${arms[@]%%=*}" <<'PY'
import glob, json, math, os, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "ab-*.json"))):
    arm = os.path.basename(f)[:-5].split("-", 2)[2]
    for p in json.load(open(f))["points"]:
        key = (p["tokens_per_rank"], p["hidden"], p["experts"])
        runs.setdefault(key, {}).setdefault(arm, []).append(p)
base = names[0]
missing = [n for n in names if not any(n in a for a in runs.values())]
if missing:
    sys.exit("no results for arm(s) %s: see the ab-*.md files" % ", ".join(missing))
head = "| tokens/rank | N | E | C | " + " | ".join("%s us" % n for n in names)
head += " | " + " | ".join("%s / %s" % (n, base) for n in names[1:])
head += " | producer end, " + " / ".join(names) + " us"
head += " | consumer - producer end, " + " / ".join(names) + " us |"
print(head)
print("|" + " ---: |" * (4 + 2 * len(names) - 1) + " --- | --- |")
logs = {n: 0.0 for n in names[1:]}
for key, arms in runs.items():
    med = {a: statistics.median(q["ours_us"] for q in arms[a]) for a in names}
    gap = {a: statistics.median(q["phases_us"]["consumer_end"] - q["phases_us"]["producer_end"]
                                for q in arms[a]) for a in names}
    pend = {a: statistics.median(q["phases_us"]["producer_end"] for q in arms[a]) for a in names}
    cells = ["%.1f" % med[a] for a in names] + ["%.4f" % (med[a] / med[base]) for a in names[1:]]
    for a in names[1:]:
        logs[a] += math.log(med[a] / med[base])
    print("| %d | %d | %d | %d | " % (*key, arms[base][0]["comm_ctas"]) + " | ".join(cells) +
          " | " + " / ".join("%.1f" % pend[a] for a in names) +
          " | " + " / ".join("%+.1f" % gap[a] for a in names) + " |")
for a in names[1:]:
    print("\ngeometric mean %s / %s %.4f over %d points" % (a, base, math.exp(logs[a] / len(runs)),
                                                           len(runs)))
# Per arm: the bench's own speedup and efficiency (its ideal from its own GEMM-alone and comm-alone
# runs), and the efficiency against the first arm's ideal (the same yardstick for every arm).
print("\n| tokens/rank | N | E | " + " | ".join("%s C, speedup, eff, eff vs %s ideal" % (n, base)
                                             for n in names) + " |")
print("|" + " ---: |" * 3 + " --- |" * len(names))
for key, arms in runs.items():
    ideal = statistics.median(q["ideal_us"] for q in arms[base])
    cells = []
    for a in names:
        q = arms[a]
        cells.append("%d, %.3fx, %.3f, %.3f" % (
            q[0]["comm_ctas"], statistics.median(x["speedup"] for x in q),
            statistics.median(x["efficiency"] for x in q),
            ideal / statistics.median(x["ours_us"] for x in q)))
    print("| %d | %d | %d | " % key + " | ".join(cells) + " |")
PY
