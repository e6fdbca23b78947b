#!/usr/bin/env bash
# Per-wave tile time of the producer GEMM by tile width and K, on one GPU: two balanced problems
# per (tn, K) that differ only in their wave count (4 and 8 waves of 132 tiles: 2 experts of 33
# or 66 bands of 128 rows, 8 column tiles), so (T8 - T4) / 4 is one wave, free of launch and
# tail costs. Used to check the model's tau_comp = 2 TM TN K / tile_tflops + tile_overhead_us on
# the narrow (tn 128) tiles of the small presets, which calibrate does not measure.
# Usage: dev/gemm/tile_times.sh [path/to/tilewave]   (prints a markdown table)
#        env VARIANT (producer kernel version, default 0 = the library's), KS (default 512 1024
#        2048 3072)
set -euo pipefail
TW=${1:-build/tilewave}
VARIANT=${VARIANT:-0}
KS=${KS:-512 1024 2048 3072}
echo "| tn | K | 4 waves us | 8 waves us | us per wave | TFLOP/s per SM |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: |"
for tn in 128 256; do
  n=$((8 * tn))
  for k in $KS; do
    t=()
    for rows in 8448 16896; do
      # The "ours" column of bench gemm's table: "| rows | K | N | E | tn | us TF/s | ...".
      us=$("$TW" bench gemm --rows $rows --k $k --n $n --experts 2 --tm 128 --tn $tn --even \
             --variant $VARIANT --reps 20 --no-check | awk -F'|' '$2 ~ /^ *[0-9]+ *$/ {split($7, a, " "); print a[1]; exit}')
      t+=("$us")
    done
    awk -v tn=$tn -v k=$k -v a="${t[0]}" -v b="${t[1]}" 'BEGIN {
      w = (b - a) / 4; printf "| %d | %d | %.1f | %.1f | %.2f | %.2f |\n", tn, k, a, b, w,
      2 * 128 * tn * k / (w * 1e6) }'
  done
done
