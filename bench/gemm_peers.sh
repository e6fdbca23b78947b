#!/usr/bin/env bash
# gemm_peers.sh: on a GPU machine, the producer's grouped GEMM side by side with DeepGEMM and
# torch._grouped_mm on identical inputs (bench/gemm_peers.py), GEMM1 + SwiGLU and GEMM2, over the
# model x EP x tokens x router grid, in one go:
#   1. unpacks and builds DeepGEMM 2.6.1 (.peers/deepgemm-2.6.1-src.tgz, the source tarball of
#      the project's peer list; about 90 s) into BUILD_DIR/DeepGEMM in the background, as its
#      develop.sh does (skipped when a build is there);
#   2. meanwhile builds libtw_gemm_peer.so and libtilewave.so in BUILD_DIR (configured here
#      against PyTorch's NCCL if BUILD_DIR has no build yet);
#   3. runs the grid with the levers' A/B (--ab) and prints the markdown tables; DeepGEMM's
#      kernels are compiled ahead by parallel processes (their JIT cache is then warm).
# Usage, from anywhere:  bench/gemm_peers.sh BUILD_DIR [--quick] [more gemm_peers.py options]
# The tarball goes into the tree's ignored .peers/ (mkdir -p .peers; copy it there) so that it
# travels with the tree. Without it, the DeepGEMM columns print "-". Output: $OUT (default
# ./gemm-peers-out): gemm-peers.md (the tables), gemm-peers.json, the build logs. The whole grid
# is meant to take under 6 minutes on one H200, build included (--quick: about 3).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: bench/gemm_peers.sh BUILD_DIR [--quick] [gemm_peers.py options]}
shift
export OUT=${OUT:-$PWD/gemm-peers-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
t0=$(date +%s)
say() { echo "== $* ($(($(date +%s) - t0)) s)"; }

say "environment: commit ${TW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

# 1. DeepGEMM (its JIT needs LD_PRELOAD of the system libstdc++: without it std::regex segfaults),
# built and JIT-cached inside BUILD_DIR, which a later call on the same machine finds again.
mkdir -p "$BUILD"
DG_SRC=.peers/deepgemm-2.6.1-src.tgz DG_DIR=$(cd "$BUILD" && pwd)/DeepGEMM dg_pid=
if [ -f "$DG_SRC" ]; then
  if ! ls "$DG_DIR"/deep_gemm/_C*.so >/dev/null 2>&1; then
    (tar xzf "$DG_SRC" -C "$BUILD" && bash "$DG_DIR/develop.sh") >"$OUT/deepgemm-build.log" 2>&1 &
    dg_pid=$!
  fi
else
  echo "no $DG_SRC: running without DeepGEMM (copy the tarball into .peers/ to include it)"
fi

# 2. Our two libraries (the rest of the tree is not needed here).
if [ ! -f "$BUILD/build.ninja" ]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    ${NCCL_ROOT:+-DTW_NCCL_ROOT=$NCCL_ROOT} >"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
cmake --build "$BUILD" -j "$(nproc)" --target tw_gemm_peer tilewave >>"$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
say "built libtw_gemm_peer.so"
if [ -n "$dg_pid" ]; then
  if wait "$dg_pid"; then say "DeepGEMM built"; else
    echo "DeepGEMM build failed (running without it):"; tail -20 "$OUT/deepgemm-build.log"
  fi
fi
PEER_ENV=()
if ls "$DG_DIR"/deep_gemm/_C*.so >/dev/null 2>&1; then
  PEER_ENV=(env "PYTHONPATH=$DG_DIR${PYTHONPATH:+:$PYTHONPATH}"
            LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 "DG_JIT_CACHE_DIR=$DG_DIR-jit")
fi

# 3. The grid (or --quick), with the levers beside ours' default.
# The tables (stdout) into gemm-peers.md; progress and errors (stderr) shown and kept in a log.
"${PEER_ENV[@]}" python3 bench/gemm_peers.py --build "$BUILD" --ab --json "$OUT/gemm-peers.json" \
  "$@" 2> >(tee "$OUT/gemm-peers.log" >&2) | tee "$OUT/gemm-peers.md"
rc=${PIPESTATUS[0]}
say "done, exit $rc"
exit "$rc"
