#!/usr/bin/env bash
# The producer alone and the whole call against the SM budget on one GPU, as one markdown table,
# through `tilewave bench --in-process` (its protocol: medians of the slowest rank, each call
# after 300 us of idle device). One rank gets the whole GPU (nothing is sent: no consumer) at 132,
# 116, 100 and 66 SMs (scaled to the GPU's SM count); two in-process ranks share it at 66, 50 and
# 33 (one GPU's memory stands in for NVLink: not comparable with 2-GPU numbers). Two shapes: the
# grid point K 2048, N 4096, 16 experts, top-2, 8192 tokens/rank, and qwen1.5-moe-a2.7b at 4096.
# Usage: bench/budget_table.sh [BUILD_DIR] [ITERS]   (defaults build, 20); writes to stdout.
set -euo pipefail
build=${1:-build}
iters=${2:-20}
tw="$build/tilewave"
# The SM count: the default budget of one in-process rank is the whole GPU.
sms=$("$tw" bench --in-process 1 --iters 1 --warmup 0 --tokens 128 --hidden 1024 --ffn 256 \
  --experts 2 --topk 1 2>/dev/null | awk -F'|' '/^\| [0-9]/ { gsub(/ /, "", $9); print $9; exit }' || true)
[ -n "$sms" ] || { echo "budget_table.sh: $tw bench found no GPU" >&2; exit 1; }
one="$sms $((sms * 116 / 132)) $((sms * 100 / 132)) $((sms / 2))"
two="$((sms / 2)) $((sms * 50 / 132)) $((sms / 4))"
echo "SM budget on one GPU ($sms SMs): the producer alone (P = budget - C) and the call, medians of"
echo "$iters calls of the slowest rank; 2 ranks = an in-process team (not comparable with 2-GPU numbers)"
echo
echo "| shape | ranks | budget | C | GEMM alone us | call us | call / GEMM |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
row() { # name, ranks, budget, shape flags...
  local name=$1 w=$2 b=$3
  shift 3
  "$tw" bench --in-process "$w" --sm-budget "$b" --iters "$iters" --warmup 3 "$@" 2>/dev/null |
    awk -F'|' -v name="$name" '/^\| [0-9]/ {
      gsub(/ /, "", $8); gsub(/ /, "", $9); gsub(/ /, "", $10); gsub(/ /, "", $12); gsub(/ /, "", $14)
      printf "| %s | %s | %s | %s | %s | %s | %.3f |\n", name, $8, $9, $10, $14, $12, $12 / $14 }' ||
    echo "| $name | $w | $b | - | failed | failed | - |"
}
for shape in grid qwen; do
  if [ $shape = grid ]; then
    name="grid: K 2048, N 4096, 16 experts, top-2, 8192 tokens/rank"
    flags=(--hidden 4096 --ffn 2048 --experts 16 --topk 2 --tokens 8192)
  else
    name="qwen1.5-moe-a2.7b, 4096 tokens/rank"
    flags=(--model qwen1.5-moe-a2.7b --tokens 4096)
  fi
  for b in $one; do row "$name" 1 "$b" "${flags[@]}"; done
  for b in $two; do row "$name" 2 "$b" "${flags[@]}"; done
done
