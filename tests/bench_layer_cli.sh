#!/bin/sh
# `tilewave bench layer` / `bench dispatch` end to end on a GPU, as a smoke run: the command must
# exit 0 (every point's check passed) and print ROWS table rows.
#   bench_layer_cli.sh TILEWAVE ROWS layer|dispatch [flags...]
# Exits 77 (ctest: skipped) where the tool finds no GPU, 1 when the run or the table fails.
set -u
tool=$1 rows=$2
shift 2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$tool" bench "$@" >"$log" 2>&1
rc=$?
cat "$log"
if [ $rc -ne 0 ] && grep -q "no GPU found" "$log"; then
  echo "no GPU: skipped"
  exit 77
fi
[ $rc -eq 0 ] || { echo "tilewave bench $1 failed (exit $rc)"; exit 1; }
n=$(grep '^| ' "$log" | grep -v -e '---' -e 'tokens/rank' | wc -l)
[ "$n" -eq "$rows" ] || { echo "expected $rows table rows, found $n"; exit 1; }
