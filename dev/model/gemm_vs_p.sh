#!/usr/bin/env bash
# The producer alone against its CTA count P at one shape: does a wave get shorter when fewer
# tiles run at once (bandwidth-like, the time set by bytes) or stay at the tile's compute
# (compute-like, the time set by the wave count)? dev/NOTES.md section 22: #5's worst point (m-bert
# 4096 tokens, stress skew) measured 216 us at C 4 and 205 at C 20, seven waves of the hot rank's
# ~780 tiles at every C up to 20, where the model's curve is flat. The default shape stands for
# that rank: 10270 rows, K 4096, N 1024, 64 experts (32 local, balanced: bench gemm plans rank 0
# of a balanced routing), 128 x 128 tiles.
# Usage (one GPU, after a build): dev/model/gemm_vs_p.sh [BUILD [SHAPE FLAGS...]]
#   e.g. dev/model/gemm_vs_p.sh build-gpu --rows 8192 --k 3072 --n 768 --experts 64
# Writes $OUT/gemm-vs-p.md: bench gemm rows at P = 104, 108, ..., 128 (300 us idle before each
# call, as tilewave bench times).
set -uo pipefail
BUILD=${1:-build-gpu}
shift || true
shape=("$@")
[ ${#shape[@]} -eq 0 ] && shape=(--rows 10270 --k 4096 --n 1024 --experts 64)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
for p in 104 108 112 116 120 124 128; do
  echo "P $p: $("$BUILD/tilewave" bench gemm "${shape[@]}" --tn 128 --grid "$p" --delay-us 300 \
    --reps 30 2>&1 | grep -E '^\| +[0-9]+ \|')"
done | tee "$OUT/gemm-vs-p.md"
