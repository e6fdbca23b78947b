#!/bin/sh
# `tilewave trace` end to end on a GPU: one traced call of W in-process ranks, then the file
# through the trace-event validator with what every trace of a call must hold.
#   trace_cli.sh TILEWAVE PYTHON TRACE_CHECK OUT.json [trace flags...] [-- validator flags...]
# Exits 77 (ctest: skipped) where the tool finds no GPU, 1 when the trace or the file fails.
set -u
tool=$1 python=$2 check=$3 out=$4
shift 4
trace_args=
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  trace_args="$trace_args $1"
  shift
done
[ $# -gt 0 ] && shift # the "--"
rm -f "$out"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# shellcheck disable=SC2086 # the flags are words
"$tool" trace $trace_args --out "$out" >"$log" 2>&1
rc=$?
cat "$log"
if [ $rc -ne 0 ] && grep -q "no GPU found" "$log"; then
  echo "no GPU: skipped"
  exit 77
fi
[ $rc -eq 0 ] || { echo "tilewave trace failed (exit $rc)"; exit 1; }
# Every trace names its ranks and shape in the metadata; the callers add what their op records
# (tiles and a producer CTA 0 for a combine, the dispatch's tracks, ...).
exec "$python" "$check" "$out" --require-meta ranks --require-meta hidden --min-events 10 "$@"
