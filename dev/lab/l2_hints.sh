#!/usr/bin/env bash
# lab: L2 hints; one GPU pair
B=build-gpu/tilewave
for pt in "--tokens 16384 --hidden 8192 --ffn 2048 --experts 32 --topk 2" "--tokens 8192 --hidden 8192 --ffn 2048 --experts 8 --topk 2" "--tokens 16384 --hidden 8192 --ffn 2048 --experts 64 --topk 2"; do
  for h in 0 1 4 8 5 13 0; do
    echo "## hints $h: $pt"
    TW_L2_HINTS=$h timeout 60 $B bench $pt --iters 30 --warmup 3 --chunks 4096 --phases 2>&1 | grep -E "^\| [0-9]|phases of ours"
  done
done
