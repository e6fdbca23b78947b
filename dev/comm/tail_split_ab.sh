#!/usr/bin/env bash
# The consumer's tail split side by side with whole-band units, one binary, on a GPU machine:
# `tilewave bench --phases` over the default grid, TW_CONSUMER_TAIL_BANDS=0 (every band one unit,
# the behaviour before the split) and the default, in the order A B B A, then a table of the
# medians of the two runs of each. Usage (after a build): dev/comm/tail_split_ab.sh [BUILD]
set -uo pipefail
BUILD=${1:-build-gpu}
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
i=0
for arm in whole split split whole; do
  i=$((i + 1))
  if [ $arm = whole ]; then export TW_CONSUMER_TAIL_BANDS=0; else unset TW_CONSUMER_TAIL_BANDS; fi
  timeout 200 "$BUILD/tilewave" bench --phases --json-file "$OUT/tail-$i-$arm.json" >"$OUT/tail-$i-$arm.md" 2>&1
  echo "run $i ($arm): exit $? $(date -u +%T)"
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "tail-*.json"))):
    arm = f.rsplit("-", 1)[1][:-5]
    for p in json.load(open(f))["points"]:
        key = (p["tokens_per_rank"], p["hidden"], p["experts"])
        runs.setdefault(key, {}).setdefault(arm, []).append(p)
print("| tokens/rank | N | E | C | whole us | split us | split / whole | consumer - producer end, whole / split us | reduction whole / split us |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
ratios = []
for key, arms in runs.items():
    med = {a: statistics.median(q["ours_us"] for q in v) for a, v in arms.items()}
    gap = {a: statistics.median(q["phases_us"]["consumer_end"] - q["phases_us"]["producer_end"] for q in v) for a, v in arms.items()}
    red = {a: statistics.median(q["phases_us"]["reduce"] for q in v) for a, v in arms.items()}
    r = med["split"] / med["whole"]
    ratios.append(r)
    print("| %d | %d | %d | %d | %.1f | %.1f | %.4f | %+.1f / %+.1f | %.1f / %.1f |" % (
        *key, arms["split"][0]["comm_ctas"], med["whole"], med["split"], r, gap["whole"], gap["split"],
        red["whole"], red["split"]))
g = 1.0
for r in ratios: g *= r
print("\ngeometric mean split / whole %.4f over %d points; min %.4f, max %.4f" % (g ** (1 / len(ratios)), len(ratios), min(ratios), max(ratios)))
PY
