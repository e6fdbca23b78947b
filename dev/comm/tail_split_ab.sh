#!/usr/bin/env bash
# The consumer's tail split side by side with whole-band units, one binary, on a GPU machine (run
# 18): `tilewave bench --phases` over the default grid, TW_CONSUMER_TAIL_BANDS=0 (every band one
# unit) and the default, in the order A B B A, then the medians of the two runs of each.
# Usage (after a build): dev/comm/tail_split_ab.sh [BUILD]. Now a case of env_ab.sh (run 18's
# script also tabulated the reduction's time, which env_ab.sh leaves out).
exec "$(dirname "$0")/env_ab.sh" "${1:-build-gpu}" whole=TW_CONSUMER_TAIL_BANDS=0 split=
