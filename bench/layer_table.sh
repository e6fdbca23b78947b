#!/usr/bin/env bash
# The whole MoE layer and the dispatch on one GPU, as markdown tables: `tilewave bench layer`
# (tw_moe_layer against the sequential layer: permute + copy all-to-all + cuBLAS GEMM1 + SwiGLU +
# cuBLAS GEMM2 + copy all-to-all + weighted sum) for deepseek-v3, qwen3-235b-a22b, gpt-oss-120b
# and mixtral-8x22b at 1024, 4096 and 16384 tokens per rank, balanced, on one rank and on two
# in-process ranks (plus the stress_skew router at 4096 tokens on two ranks; on two ranks also the
# capturable layer, --capacity auto), then
# `tilewave bench dispatch` (tw_moe_dispatch against permute + copy all-to-all, deepseek-v3's
# shape, 1024..16384 tokens per rank, balanced / stress_skew / hot) on one and two ranks.
# Every point is checked (the tool fails a point whose output or rows are wrong); the script
# prints every table and exits 1 if any point failed. About 3 minutes on one H200.
# Usage: bench/layer_table.sh BUILD_DIR [ITERS]   (ITERS default 10); tables on stdout,
# progress on stderr.
set -uo pipefail
build=${1:?usage: bench/layer_table.sh BUILD_DIR [ITERS]}
iters=${2:-10}
tw="$build/tilewave"
[ -x "$tw" ] || { echo "layer_table.sh: no $tw (build first)" >&2; exit 2; }
# As bench/gpu_all.sh: every kernel loaded up front, none lazily while a peer's kernels spin.
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
n=0
# run NAME FLAGS...: one invocation into $tmp/NAME.N (its stderr passes through).
run() {
  local name=$1
  shift
  n=$((n + 1))
  echo "layer_table.sh: tilewave bench $*" >&2
  "$tw" bench "$@" --iters "$iters" --warmup 2 >"$tmp/$name.$(printf %03d $n)" || failed=1
}
# table NAME: the first header of the NAME runs, then every run's rows, in order.
table() {
  local name=$1 f
  f=$(grep -l '^| .*tokens/rank' "$tmp/$name".* 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "(no $name rows: every run failed)"; return; }
  grep -m1 '^# ' "$f"
  echo
  grep '^| ' "$f" | head -2
  cat "$tmp/$name".* | grep '^| ' | grep -v -e '^| ---' -e 'tokens/rank'
  echo
}
models="deepseek-v3 qwen3-235b-a22b gpt-oss-120b mixtral-8x22b"
for w in 1 2; do
  for m in $models; do
    # Two ranks: the capturable layer beside the eager one too (its bits checked equal).
    cap=(); [ "$w" = 2 ] && cap=(--capacity auto)
    run "layer_w$w" layer --model "$m" --in-process "$w" --tokens 1024,4096,16384 ${cap[@]+"${cap[@]}"}
  done
done
for m in deepseek-v3 qwen3-235b-a22b; do
  run layer_w2 layer --model "$m" --in-process 2 --tokens 4096 --router stress_skew
done
for w in 1 2; do
  run "dispatch_w$w" dispatch --model deepseek-v3 --in-process "$w"
done
# The copy of the tree on a GPU machine may have no .git: the caller can pass TW_COMMIT.
rev=${TW_COMMIT:-$(git -C "$(dirname "$0")/.." rev-parse --short HEAD 2>/dev/null || echo "?")}
echo "## bench layer and bench dispatch, one GPU ($(date -u +%Y-%m-%d), $rev, $iters rounds)"
echo
for t in layer_w1 layer_w2 dispatch_w1 dispatch_w2; do table "$t"; done
if [ "$failed" -ne 0 ]; then
  echo "layer_table.sh: at least one run FAILED (see the messages above)" >&2
  exit 1
fi
