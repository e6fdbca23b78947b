#!/bin/sh
# The shared library exports the public API and nothing else; the static one carries no harness.
#   check_exports.sh NM libtilewave.so libtilewave.a include/tilewave.h
# Fails when libtilewave.so defines a dynamic symbol that include/tilewave.h does not declare as a
# TW_API function (a tw__ internal, a baseline or spawn symbol, a C++ or CUDA runtime name), when
# a TW_API function is missing from it, when the header declares a function without TW_API, or
# when libtilewave.a defines a symbol of harness/ (baselines, rank spawning, oracle arithmetic).
set -eu
nm=$1 so=$2 archive=$3 header=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

# Public functions: every declaration in the header starts its line with TW_API.
sed -n 's/^TW_API .*[ *]\(tw_[a-z0-9_]*\)(.*/\1/p' "$header" | sort -u >"$tmp/api"
[ -s "$tmp/api" ] || { echo "no TW_API function found in $header" >&2; exit 1; }
if grep -nE '^[A-Za-z_][A-Za-z0-9_ ]*[ *]tw_[a-z0-9_]+\(' "$header" | grep -v ':TW_API ' >"$tmp/bare"; then
  echo "functions declared without TW_API in $header:" >&2
  cat "$tmp/bare" >&2
  fail=1
fi

"$nm" -D --defined-only "$so" | awk 'NF >= 3 { print $3 }' | sed 's/@.*//' | sort -u >"$tmp/exports"
if comm -23 "$tmp/exports" "$tmp/api" | grep . >"$tmp/extra"; then
  echo "$so exports names that are not TW_API functions of $header:" >&2
  cat "$tmp/extra" >&2
  fail=1
fi
if comm -13 "$tmp/exports" "$tmp/api" | grep . >"$tmp/missing"; then
  echo "TW_API functions of $header that $so does not export:" >&2
  cat "$tmp/missing" >&2
  fail=1
fi

"$nm" --defined-only "$archive" 2>/dev/null | awk 'NF >= 3 { print $3 }' |
  grep -E '^(_Z[0-9]+)?tw__(baseline|bl_|spawn|gpu_count_forked|launcher|run_ranks|oracle)' \
  >"$tmp/harness" || true
if [ -s "$tmp/harness" ]; then
  echo "$archive contains harness symbols:" >&2
  sort -u "$tmp/harness" >&2
  fail=1
fi

[ "$fail" -eq 0 ] && echo "$(wc -l <"$tmp/exports") exports, all TW_API functions of $header"
exit "$fail"
