#!/usr/bin/env bash
# Builds tilewave and runs every test. GPU tests skip (ctest code 77) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh "$@"
ctest --test-dir build --output-on-failure -j "$(nproc)"
