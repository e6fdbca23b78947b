#!/usr/bin/env bash
# grid_oracle.sh: #4's efficiency bar as the issue states it, "with the best C / mgb from sweep":
# `tilewave sweep --oracle` over the grid's N 8192 points of the full matrix (balanced: points 70,
# 73, 76, 79, 82, 100, 103, 106, 109, 112; each moderate_skew point is the next index, each
# stress_skew point the one after), then `tilewave bench` at each point's oracle (C, mgb), which
# times ours there again beside the GEMM alone and the consumer alone (efficiency = max of the
# two / ours). Writes under $OUT: grid-oracle.json (the sweep), grid-oracle-bench-<i>.json / .md
# (the benches) and grid-oracle.md (the table). About 110 s per router on 2 x H200 (run 57).
# Usage (after a build): bench/grid_oracle.sh BUILD [DATAFLOW [ROUTERS]]
#   DATAFLOW: add (default) or reduce; ROUTERS: comma-separated offsets from the balanced point,
#   0 balanced (default), 1 moderate_skew, 2 stress_skew, e.g. 0,1,2 for all three
set -uo pipefail
BUILD=$1
DATAFLOW=${2:-add}
ROUTERS=${3:-0}
points=$(python3 -c 'import sys; print(",".join(str(b + int(r)) for b in (70, 73, 76, 79, 82, 100, 103, 106, 109, 112) for r in sys.argv[1].split(",")))' "$ROUTERS")
OUT=${OUT:-$PWD/grid-oracle-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
TW="$BUILD/tilewave"
timeout 300 "$TW" sweep --oracle --matrix full --dataflow "$DATAFLOW" \
  --points "$points" --json-file "$OUT/grid-oracle.json" \
  >"$OUT/grid-oracle-sweep.md" 2>&1 || { tail -20 "$OUT/grid-oracle-sweep.md"; exit 1; }
python3 - "$OUT/grid-oracle.json" <<'PY' >"$OUT/grid-oracle-points.txt"
import json, sys
for p in json.load(open(sys.argv[1]))["points"]:
    o = p["oracle"]
    print(p["index"], p["tokens_per_rank"], p["hidden"], p["ffn"], p["experts"], p["top_k"],
          p["router"], o["comm_ctas"], o["coalesce"])
PY
while read -r i tokens hidden ffn experts topk router c mgb; do
  timeout 200 "$TW" bench --tokens "$tokens" --hidden "$hidden" --ffn "$ffn" --experts "$experts" \
    --topk "$topk" --router "$router" --dataflow "$DATAFLOW" --comm-ctas "$c" --coalesce "$mgb" --chunks 8192 \
    --iters 30 --json-file "$OUT/grid-oracle-bench-$i.json" >"$OUT/grid-oracle-bench-$i.md" 2>&1
  echo "point $i (C $c, mgb $mgb): exit $?"
done <"$OUT/grid-oracle-points.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/grid-oracle.md"
import glob, json, os, sys
out = sys.argv[1]
sweep = {p["index"]: p for p in json.load(open(os.path.join(out, "grid-oracle.json")))["points"]}
print("| # | tokens/rank | N | E | router | model C, mgb, us (sweep) | oracle C, mgb, us (sweep) | regret |"
      " bench at the oracle: ours us, GEMM alone us, comm alone us, eff |")
print("| ---: | ---: | ---: | ---: | --- | --- | --- | ---: | --- |")
effs = []
for i, p in sorted(sweep.items()):
    m, o = p["model"], p["oracle"]
    f = os.path.join(out, "grid-oracle-bench-%d.json" % i)
    cell = "not run"
    if os.path.exists(f):
        b = json.load(open(f))
        pts = b["points"] if isinstance(b, dict) and "points" in b else b
        r = pts[0]
        ours, gemm, comm = r["ours_us"], r["gemm_us"], r["comm_us"]
        eff = max(gemm, comm) / ours
        effs.append(eff)
        cell = "%.1f, %.1f, %.1f, %.3f" % (ours, gemm, comm, eff)
    print("| %d | %d | %d | %d | %s | %d, %d, %.1f | %d, %d, %.1f | %.2f%% | %s |" % (
        i, p["tokens_per_rank"], p["hidden"], p["experts"], p["router"], m["comm_ctas"], m["coalesce"], m["us"],
        o["comm_ctas"], o["coalesce"], o["us"], 100 * p["regret"], cell))
if effs:
    print("\nefficiency at the oracle: %.3f-%.3f, at or above 0.90 at %d of %d points" % (
        min(effs), max(effs), sum(e >= 0.90 for e in effs), len(effs)))
PY
