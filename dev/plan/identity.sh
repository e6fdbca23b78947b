#!/usr/bin/env bash
# identity.sh: checks that the planner of the working tree plans exactly as a base commit does.
#
#   dev/plan/identity.sh BASE [PROBLEMS]
#
# Builds dev/plan/plan_digest.c (of the working tree) twice, against the host sources (src/core,
# src/plan, src/reference) of the working tree and of BASE (checked out with `git worktree add`
# into a directory from mktemp, removed on exit), with the same compiler and flags, runs both on
# the same fixed set of random plans (PROBLEMS problems, default 40, every rank of each, both
# schedules and auto, both dataflows, several TW_TILE_GROUP values, given and fixed partitions,
# the environment's choices and bad values) and diffs the outputs: one line per plan with a
# digest of its arrays and its summary fields to 17 digits. Exit 0 and "identical" when they
# match; the diff and exit 1 when not. Needs a C compiler (cc or $CC) and git; no GPU.
set -euo pipefail
base=${1:?usage: dev/plan/identity.sh BASE [PROBLEMS]}
problems=${2:-40}
root=$(cd "$(dirname "$0")/../.." && pwd)
cc=${CC:-cc}
tmp=$(mktemp -d)
cleanup() {
  git -C "$root" worktree remove --force "$tmp/base" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
git -C "$root" worktree add --detach "$tmp/base" "$base" >/dev/null 2>&1

build() { # tree output
  local tree=$1
  "$cc" -O3 -DNDEBUG -std=gnu11 -w -I"$tree/include" -I"$tree/src/core" -I"$tree/src/plan" \
    -I"$tree/src/reference" "$root/dev/plan/plan_digest.c" "$tree"/src/core/*.c \
    "$tree"/src/plan/*.c "$tree"/src/reference/*.c -lm -lpthread -o "$2"
}
build "$tmp/base" "$tmp/digest_base"
build "$root" "$tmp/digest_head"
"$tmp/digest_base" "$problems" >"$tmp/base.txt"
"$tmp/digest_head" "$problems" >"$tmp/head.txt"
summary=$(tail -n 1 "$tmp/head.txt")
if diff -u "$tmp/base.txt" "$tmp/head.txt"; then
  echo "identical to $(git -C "$root" rev-parse --short "$base"): $summary"
else
  echo "DIFFERENT from $base ($summary)" >&2
  exit 1
fi
