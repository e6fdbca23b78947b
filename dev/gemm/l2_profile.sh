#!/usr/bin/env bash
# Why the tile order matters (dev/NOTES.md section 17, lead 2): Nsight Compute on one launch of the
# producer inside `bench gemm`, once per tile group, with the L2 and device-memory counters next to
# the kernel's time. One GPU; about ten seconds per group.
# Usage: dev/gemm/l2_profile.sh [path/to/tilewave]   (env TILE_GROUPS, default "1 8"; SHAPE, default
#        "--rows 16384 --k 2048 --n 8192 --experts 16"; OUT)
set -uo pipefail
TW=${1:-build/tilewave}
TILE_GROUPS=${TILE_GROUPS:-1 8}
SHAPE=${SHAPE:---rows 16384 --k 2048 --n 8192 --experts 16}
OUT=${OUT:-$PWD/l2-out}
mkdir -p "$OUT"
metrics=gpu__time_duration.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,dram__bytes_read.sum
metrics+=,dram__bytes_write.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
read -ra shape <<<"$SHAPE"
for g in $TILE_GROUPS; do
  # The second launch of the producer (the first is a warm-up); caches are flushed before it by
  # ncu's default --cache-control all, as for every kernel it profiles.
  TW_TILE_GROUP=$g timeout 300 ncu --kernel-name regex:tw_gemm_v2 --launch-skip 1 --launch-count 1 \
    --metrics "$metrics" --csv --log-file "$OUT/ncu-group$g.csv" \
    "$TW" bench gemm "${shape[@]}" --reps 1 --warmup 1 --no-check >"$OUT/ncu-group$g.log" 2>&1
  echo "TW_TILE_GROUP=$g: exit $? $(date -u +%T)"
done
python3 - "$OUT" $TILE_GROUPS <<'PY'
import csv, os, sys
out, groups = sys.argv[1], sys.argv[2:]
vals = {}
for g in groups:
    rows = [r for r in csv.reader(open(os.path.join(out, "ncu-group%s.csv" % g))) if len(r) > 3]
    head = next((r for r in rows if "Metric Name" in r), None)
    if head is None:
        sys.exit("no ncu table for group %s: see %s" % (g, os.path.join(out, "ncu-group%s.log" % g)))
    name, unit, value = head.index("Metric Name"), head.index("Metric Unit"), head.index("Metric Value")
    for r in rows[rows.index(head) + 1:]:
        vals.setdefault((r[name], r[unit]), {})[g] = r[value]
print("| metric | unit | " + " | ".join("TW_TILE_GROUP=%s" % g for g in groups) + " |")
print("| --- | --- |" + " ---: |" * len(groups))
for (m, u), by in sorted(vals.items()):
    print("| %s | %s | " % (m, u) + " | ".join(by.get(g, "") for g in groups) + " |")
PY
