#!/usr/bin/env bash
# The Hugging Face model run (one H200, world 1): tests/python/test_torch.py --gpu (the
# module's GPU tests), then tests/python/test_hf_model.py --gpu: transformers MoE models
# (Qwen1.5-MoE and Mixtral layers, random weights, bf16) with their experts on tilewave's
# layer, the logits against the unmodified model and the prefill of each timed; prints the
# markdown table. Needs torch with CUDA and transformers 5.x installed, and a built library.
# Usage: bench/hf_model.sh BUILD_DIR   (BUILD_DIR holds libtilewave.so)
#        TW_HF_MODELS=qwen2_moe,mixtral TW_HF_SHAPES=1x512,4x4096 pick models and shapes
# Output goes to $OUT/hf_model.log (and $OUT/hf_model.md, the table alone) when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: bench/hf_model.sh BUILD_DIR}
LIB=$BUILD/libtilewave.so
[ -f "$LIB" ] || { echo "no $LIB: build first (cmake --build $BUILD)"; exit 2; }
export TILEWAVE_LIBRARY=$(cd "$(dirname "$LIB")" && pwd)/libtilewave.so
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
LOG=${OUT:-.}/hf_model.log
rc=0
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "== tests/python/test_torch.py --gpu ($(date -u +%T))"
  timeout 300 python3 tests/python/test_torch.py --gpu 2>&1 | tail -25
  echo "test_torch rc=${PIPESTATUS[0]}"
  echo "== tests/python/test_hf_model.py --gpu ($(date -u +%T))"
  timeout 480 python3 tests/python/test_hf_model.py --gpu
  echo "test_hf_model rc=$?"
  echo "== done ($(date -u +%T))"
} 2>&1 | tee "$LOG"
grep -q "^test_torch rc=0$" "$LOG" || rc=1
grep -q "^test_hf_model rc=0$" "$LOG" || rc=1
[ -n "${OUT:-}" ] && grep "^|" "$LOG" > "$OUT/hf_model.md"
exit $rc
