#!/usr/bin/env bash
# Where the producer and cuBLAS's concatenated GEMM spend their time, shape by shape (issue #3's
# misses at 32-64 experts): Nsight Compute on one launch of each (`bench gemm --only`), the L2,
# device-memory and tensor-pipe counters side by side. One GPU; a few seconds per launch.
# Usage: dev/gemm/l2_vs_concat.sh [path/to/tilewave]
#        env SHAPES (";"-separated `bench gemm` shape options), OUT
set -uo pipefail
TW=${1:-build/tilewave}
SHAPES=${SHAPES:-"--rows 16384 --k 2048 --n 4096 --experts 4;--rows 16384 --k 2048 --n 4096 --experts 64"}
OUT=${OUT:-$PWD/l2-out}
mkdir -p "$OUT"
metrics=gpu__time_duration.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
# The tensor pipe's activity, under a name this ncu knows (a metric it does not know fails the run).
known=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_cycles_active; do
  grep -qx "$m" <<<"$known" && { metrics+=,$m.avg.pct_of_peak_sustained_elapsed; break; }
done
IFS=';' read -ra shapes <<<"$SHAPES"
i=0
for shape in "${shapes[@]}"; do
  read -ra opts <<<"$shape"
  # Ours: the producer's second launch (the first is the warm-up). Concat: every launch of
  # `--only concat` (the two input fills, then cuBLAS's calls); the table keeps the longest one
  # that is not the bench's own. ncu flushes the caches before each profiled launch (its default
  # --cache-control all). --clock-control none: the clocks the application gets (ncu's default locks
  # them at base, where the device memory is relatively faster and the many-expert points look
  # better than in bench gemm: run 64).
  timeout 300 ncu --clock-control none --kernel-name regex:tw_gemm --launch-skip 1 --launch-count 1 --metrics "$metrics" \
    --section LaunchStats \
    --csv --log-file "$OUT/ncu-$i-ours.csv" "$TW" bench gemm "${opts[@]}" --only ours --reps 1 \
    --warmup 1 --no-check >"$OUT/ncu-$i-ours.log" 2>&1
  echo "shape $i ($shape) ours: exit $? $(date -u +%T)"
  timeout 300 ncu --clock-control none --metrics "$metrics" --section LaunchStats --csv \
    --log-file "$OUT/ncu-$i-concat.csv" "$TW" bench gemm "${opts[@]}" --only concat --reps 1 \
    --warmup 1 --no-check >"$OUT/ncu-$i-concat.log" 2>&1
  echo "shape $i ($shape) concat: exit $? $(date -u +%T)"
  i=$((i + 1))
done
python3 - "$OUT" "$SHAPES" <<'PY'
import csv, os, re, sys
out, shapes = sys.argv[1], sys.argv[2].split(";")
def label(shape):
    """'--rows 16384 --k 2048 --n 4096 --experts 64 --even' -> '16384 2048 4096 64 even'."""
    return re.sub(r"--(rows|k|n|experts) ", "", shape).replace("--", "").strip()
def longest_launch(path):
    """The metrics of the longest profiled launch that is not the bench's own (bench_*) in one
    ncu --csv log: kernel name, {(metric, unit): value}, how many such launches there were."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 3]
    head = next((r for r in rows if "Metric Name" in r), None)
    if head is None:
        sys.exit("no ncu table in %s: see the .log beside it" % path)
    ids, kname = head.index("ID"), head.index("Kernel Name")
    name, unit, value = head.index("Metric Name"), head.index("Metric Unit"), head.index("Metric Value")
    body = [r for r in rows[rows.index(head) + 1:] if "bench_" not in r[kname]]
    launches, kernels = {}, {}
    for r in body:
        launches.setdefault(r[ids], {})[(r[name], r[unit])] = r[value]
        kernels[r[ids]] = r[kname]
    def ns(i):
        return float(launches[i].get(("gpu__time_duration.sum", "ns"), "0").replace(",", ""))
    best = max(launches, key=ns)
    return kernels[best], launches[best], len(launches)
cols, table = [], {}
for i, shape in enumerate(shapes):
    for who in ("ours", "concat"):
        kernel, vals, n = longest_launch(os.path.join(out, "ncu-%d-%s.csv" % (i, who)))
        col = "%s: %s" % (label(shape), who)
        cols.append(col)
        print("%s = %s (of %d launches)" % (col, kernel[:90], n), file=sys.stderr)
        for k, v in vals.items():
            table.setdefault(k, {})[col] = v
print("columns: rows K N E (and any other bench gemm option), then whose kernel\n")
print("| metric | unit | " + " | ".join(cols) + " |")
print("| --- | --- |" + " ---: |" * len(cols))
for (m, u), by in sorted(table.items()):
    print("| %s | %s | " % (m, u) + " | ".join(by.get(c, "") for c in cols) + " |")

# The split of ours / concat (time) into the rows our tiles compute (bench gemm's `tile rows /
# rows`, read from ours' own output) and how busy each kernel keeps the tensor pipe.
def num(col, metric):
    v = next((x for (m, u), x in table.items() if m == metric), {}).get(col, "")
    return float(v.replace(",", "")) if v else float("nan")
def tile_rows(i):
    rows = [l for l in open(os.path.join(out, "ncu-%d-ours.log" % i)) if l.startswith("| ")]
    return float(rows[-1].split("|")[12]) if rows and len(rows[-1].split("|")) > 12 else float("nan")
pipe = next((m for (m, u) in table if m.startswith("sm__pipe_tensor")), None)
print("\n| rows K N E | ours / concat (time) | tile rows / rows | tensor pipe busy, concat / ours "
      "| product | time / product |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for i, shape in enumerate(shapes):
    o, c = cols[2 * i], cols[2 * i + 1]
    t = num(o, "gpu__time_duration.sum") / num(c, "gpu__time_duration.sum")
    busy = num(c, pipe) / num(o, pipe) if pipe else float("nan")
    tr = tile_rows(i)
    print("| %s | %.3f | %.3f | %.3f | %.3f | %.3f |" % (label(shape), t, tr, busy, tr * busy,
                                                         t / (tr * busy)))
PY
