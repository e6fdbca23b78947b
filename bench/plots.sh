#!/usr/bin/env bash
# Regenerates bench/results/plots/*.png from the committed JSON under bench/results/.
# Installs matplotlib (pip, quietly) where it is missing; passes its arguments to plots.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import matplotlib' 2>/dev/null; then
  python3 -m pip install --quiet matplotlib
fi
exec python3 bench/plots.py "$@"
