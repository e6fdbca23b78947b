#!/usr/bin/env bash
# Where the time of the small, memory-heavy calls goes (dev/NOTES.md sections 14 and 18): `bench
# --phases` at a few C on the points whose measured time falls with C where the model predicts a
# plateau.
# Usage (GPU machine, after a build): dev/model/phases_small.sh [BUILD [NAME:C:FLAGS ...]]
#   each point: a name, the C to force, and bench's shape flags, e.g.
#   "mbert-bal:8:--model m-bert --tokens 1024 --router balanced"; without points, the m-gpt and
#   granite points of section 14. Writes $OUT/01-phases-table.md and $OUT/00-phases.tgz.
set -uo pipefail
BUILD=${1:-build-gpu}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
run() { # name, then bench flags
  local name=$1; shift
  "$BUILD/tilewave" bench "$@" --phases --chunks 2048 --json-file "$OUT/phases-$name.json" \
    >"$OUT/phases-$name.md" 2>"$OUT/phases-$name.err" || { echo "$name: failed"; tail -3 "$OUT/phases-$name.err"; }
}
if [ $# -gt 1 ]; then
  shift
  for point in "$@"; do
    IFS=: read -r name c flags <<<"$point"
    read -ra shape <<<"$flags"
    run "$name-c$c" "${shape[@]}" --comm-ctas "$c" --coalesce 1
  done
else
for c in 4 8 16 32; do run mgpt-mod-c$c --model m-gpt --tokens 1024 --router moderate_skew --comm-ctas $c --coalesce 1; done
for c in 4 16; do run mgpt-bal-c$c --model m-gpt --tokens 1024 --router balanced --comm-ctas $c --coalesce 1; done
for c in 18 32; do run granite-bal-c$c --model granite-3.1-1b-a400m --tokens 1024 --router balanced --comm-ctas $c --coalesce 1; done
fi
{
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| point | C | ours us | gemm alone us | comm alone us | producer end | consumer end | join | reduction | seq us |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "phases-*.json"))):
    p = json.load(open(f))["points"][0]
    ph = p.get("phases_us", {})
    print("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |" % (
        os.path.basename(f)[7:-5], p["comm_ctas"], p["ours_us"], p["gemm_us"], p["comm_us"],
        ph.get("producer_end", -1), ph.get("consumer_end", -1), ph.get("join", -1),
        ph.get("reduce", -1), p["seq_us"]))
PY
} | tee "$OUT/01-phases-table.md"
# Only a few files come back from a GPU host: everything in one archive.
tar -czf "$OUT/00-phases.tgz" -C "$OUT" $(cd "$OUT" && ls phases-*) && rm -f "$OUT"/phases-*
