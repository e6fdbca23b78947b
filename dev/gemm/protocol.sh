#!/usr/bin/env bash
# The producer against cuBLAS under two timing protocols, on one GPU: `bench gemm` over the default
# grid with its calls back to back (--delay-us 0, a sustained load) and each call after DELAYS us
# of a nearly idle device (as `tilewave bench` times), while nvidia-smi samples the SM clock, power
# and temperature every 100 ms. Run 25 measured cuBLAS at 705.8 us inside bench where bench gemm
# had 849.2 us at the same shape, our producer at ~823 us in both (dev/NOTES.md section 16): this
# says which protocol moves which kernel, and whether clocks or power move with it.
# Usage: dev/gemm/protocol.sh [path/to/tilewave]   (env DELAYS, default "0 300 1000"; OUT)
set -uo pipefail
TW=${1:-build/tilewave}
DELAYS=${DELAYS:-0 300 1000}
OUT=${OUT:-$PWD/protocol-out}
mkdir -p "$OUT"
for d in $DELAYS; do
  nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -lms 100 >"$OUT/smi-$d.csv" 2>/dev/null &
  smi=$!
  timeout 120 "$TW" bench gemm --delay-us "$d" >"$OUT/gemm-$d.md" 2>&1
  echo "bench gemm --delay-us $d: exit $? $(date -u +%T)"
  kill $smi 2>/dev/null
  wait $smi 2>/dev/null
done
python3 - "$OUT" $DELAYS <<'PY'
import os, re, statistics, sys
out, delays = sys.argv[1], sys.argv[2:]
def rows(d):
    r = {}
    for l in open(os.path.join(out, "gemm-%s.md" % d)):
        c = [x.strip() for x in l.strip().strip("|").split("|")]
        if len(c) > 10 and re.fullmatch(r"\d+", c[0]):
            us = lambda s: float(s.split()[0])
            r[(c[0], c[1], c[2], c[3], c[4])] = (us(c[5]), us(c[7]), us(c[9]))  # ours, loop, concat
    return r
def smi(d):
    v = [l.split(",") for l in open(os.path.join(out, "smi-%s.csv" % d)) if l.count(",") == 3]
    f = lambda i: statistics.median(float(x[i]) for x in v) if v else float("nan")
    return len(v), f(1), f(2), f(3)
tabs = {d: rows(d) for d in delays}
print("| delay us | samples | SM MHz (median) | power W (median) | temp C (median) |")
print("| ---: | ---: | ---: | ---: | ---: |")
for d in delays:
    print("| %s | %d | %.0f | %.0f | %.0f |" % ((d,) + smi(d)))
print()
print("| rows | K | N | E | tn | " + " | ".join("ours / loop / concat us, %s us idle" % d for d in delays) +
      " | " + " | ".join("ours / concat TFLOP/s, %s" % d for d in delays) + " |")
print("|" + " ---: |" * 5 + " --- |" * len(delays) + " ---: |" * len(delays))
for k in tabs[delays[0]]:
    if not all(k in tabs[d] for d in delays):
        continue
    cells = ["%.1f / %.1f / %.1f" % tabs[d][k] for d in delays]
    cells += ["%.2f" % (tabs[d][k][2] / tabs[d][k][0]) for d in delays]
    print("| " + " | ".join(k) + " | " + " | ".join(cells) + " |")
PY
