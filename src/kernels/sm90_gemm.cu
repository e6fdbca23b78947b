/*
 * sm90_gemm.cu: the producer, a persistent rank-wide grouped GEMM over a tile list, with tile
 * signalling.
 *
 * C_e[M_e x N] = A_e[M_e x K] * B_e^T for every local expert e, bf16 in, fp32 accumulation, bf16
 * out. The kernel walks the planner's tile list in order: CTA j of P takes tiles j, j+P, j+2P, ...
 * After a tile's output is globally visible, one thread adds 1 to the tile's band counter with a
 * release reduction, so a consumer that acquires the counter and sees col_tiles x epoch may read
 * the whole band.
 *
 * This file holds the simple, portable version (v1: warp-level bf16 tensor-core MMA through WMMA,
 * shared-memory tiles loaded with ordinary loads, st.global epilogue). The lab in dev/gemm/ grows
 * the TMA + wgmma version; it replaces this kernel behind the same launcher once it is faster and
 * passes the same tests.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>

#include "core.h"
#include "kernels.h"
#include "sync.cuh"

namespace {

/* v1 geometry: a CTA of 8 warps computes a 128 x 128 sub-tile per pass (a 4 x 2 grid of warps,
 * each 32 x 64 = 2 x 4 WMMA fragments); a tn = 256 tile is two passes, a tm = 64 tile masks the
 * lower half. K advances 32 at a time. */
constexpr int kV1Threads = 256;
constexpr int kV1BM = 128;
constexpr int kV1BN = 128;
constexpr int kV1BK = 32;
constexpr int kV1Pad = 8; /* bf16 elements of padding per smem row: breaks bank conflicts */

struct V1Smem {
  __nv_bfloat16 a[kV1BM][kV1BK + kV1Pad]; /* (128, 32) A rows of the band, K slice */
  __nv_bfloat16 b[kV1BN][kV1BK + kV1Pad]; /* (128, 32) B rows (output columns), K slice */
  float stage[kV1Threads / 32][16][16];   /* per-warp accumulator fragment on its way out */
};

__device__ __forceinline__ float tw__silu(float x) {
  return x / (1.0f + __expf(-x));
}

/* Loads a (128, 32) bf16 slice: row r of the slice is global row (row0 + r) of a row-major
 * (nrows, k) matrix, or zeros where that row is out of [row_lo, row_hi). */
__device__ __forceinline__ void v1_load_slice(__nv_bfloat16 (*dst)[kV1BK + kV1Pad],
                                              const __nv_bfloat16* src, int64_t row0,
                                              int64_t row_hi, int k, int k0) {
  /* 128 rows x 4 chunks of 8 bf16 = 512 chunks of 16 bytes, two per thread. */
  for (int c = threadIdx.x; c < kV1BM * (kV1BK / 8); c += kV1Threads) {
    const int r = c >> 2, q = c & 3;
    const int64_t gr = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (gr < row_hi) v = *reinterpret_cast<const uint4*>(src + gr * k + k0 + q * 8);
    *reinterpret_cast<uint4*>(&dst[r][q * 8]) = v;
  }
}

template <bool kSwiglu>
__global__ void __launch_bounds__(kV1Threads) tw_gemm_v1_kernel(tw_gemm_args args) {
  using namespace nvcuda;
  __shared__ __align__(128) V1Smem sm;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 1, wn = warp & 1; /* warp's 32 x 64 block in the 128 x 128 pass */
  const __nv_bfloat16* A = static_cast<const __nv_bfloat16*>(args.a);
  const __nv_bfloat16* B = static_cast<const __nv_bfloat16*>(args.b);
  __nv_bfloat16* C = static_cast<__nv_bfloat16*>(args.c);
  const int k = args.k, n = args.n;
  const int64_t n_b = kSwiglu ? 2 * (int64_t)n : n; /* B rows per expert */
  /* Gate and up halves are computed in separate passes of 64 columns each for SwiGLU so that
   * one warp holds the gate and the up value of the same output element. */
  const int out_cols_per_pass = kSwiglu ? kV1BN / 2 : kV1BN;
  const bool signal = args.band_counters != NULL && args.scope != TW_SIGNAL_NONE;

  for (int t = blockIdx.x; t < args.num_tiles; t += gridDim.x) {
    const tw_tile tile = args.tiles[t];
    const int rows = min(tile.rows, args.tm);
    const __nv_bfloat16* Be = B + (int64_t)tile.expert * n_b * k;
    for (int pass = 0; pass * out_cols_per_pass < args.tn; pass++) {
      const int col0 = tile.col0 + pass * out_cols_per_pass;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[i][j], 0.0f);
      for (int k0 = 0; k0 < k; k0 += kV1BK) {
        __syncthreads(); /* previous slice fully consumed */
        /* A: rows of the band; rows past the tensor end read as zeros (rows past tile.rows are
         * computed but never stored). */
        v1_load_slice(sm.a, A, tile.row0, min((int64_t)args.rows, (int64_t)tile.row0 + rows), k,
                      k0);
        if (kSwiglu) {
          /* B rows 0..63: gate columns col0.., rows 64..127: up columns col0.. (B row n + c). */
          for (int c = threadIdx.x; c < kV1BN * (kV1BK / 8); c += kV1Threads) {
            const int r = c >> 2, q = c & 3;
            const int col = col0 + (r & 63);
            uint4 v = make_uint4(0, 0, 0, 0);
            if (col < n) {
              const int64_t br = (r < 64) ? col : (int64_t)n + col;
              v = *reinterpret_cast<const uint4*>(Be + br * k + k0 + q * 8);
            }
            *reinterpret_cast<uint4*>(&sm.b[r][q * 8]) = v;
          }
        } else {
          v1_load_slice(sm.b, Be, col0, n, k, k0);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kV1BK; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[4];
#pragma unroll
          for (int i = 0; i < 2; i++)
            wmma::load_matrix_sync(fa[i], &sm.a[wm * 32 + i * 16][kk], kV1BK + kV1Pad);
#pragma unroll
          for (int j = 0; j < 4; j++)
            wmma::load_matrix_sync(fb[j], &sm.b[wn * 64 + j * 16][kk], kV1BK + kV1Pad);
#pragma unroll
          for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
      }
      /* Epilogue: each warp stages one 16 x 16 fragment at a time and stores the rows < rows
       * and columns < n of it. For SwiGLU, warp column wn = 0 holds gate values and wn = 1 the
       * up values of the same 64 output columns, so the two are combined through smem. */
      if (!kSwiglu) {
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
          for (int j = 0; j < 4; j++) {
            wmma::store_matrix_sync(&sm.stage[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            const int r = lane >> 1, c8 = (lane & 1) * 8;
            const int row = wm * 32 + i * 16 + r;
            const int col = col0 + wn * 64 + j * 16 + c8;
            if (row < rows && col < n) { /* n % 8 == 0: a chunk of 8 is all in or all out */
              __align__(16) __nv_bfloat16 v[8];
#pragma unroll
              for (int e = 0; e < 8; e++) v[e] = __float2bfloat16(sm.stage[warp][r][c8 + e]);
              *reinterpret_cast<uint4*>(C + ((int64_t)tile.row0 + row) * n + col) =
                  *reinterpret_cast<const uint4*>(v);
            }
            __syncwarp();
          }
      } else {
        /* Reuse the B slice area is not possible (too small for fp32): go fragment by fragment,
         * gate warps (wn = 0) write silu(gate) to their stage, up warps (wn = 1) multiply. */
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
          for (int j = 0; j < 4; j++) {
            __syncthreads();
            if (wn == 0)
              wmma::store_matrix_sync(&sm.stage[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
            __syncthreads();
            if (wn == 1) {
              wmma::store_matrix_sync(&sm.stage[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
              __syncwarp();
              const int r = lane >> 1, c8 = (lane & 1) * 8;
              const int row = wm * 32 + i * 16 + r;
              const int col = col0 + j * 16 + c8;
              if (row < rows && col < n) {
                __align__(16) __nv_bfloat16 v[8];
#pragma unroll
                for (int e = 0; e < 8; e++) {
                  const float g = sm.stage[warp - 1][r][c8 + e];
                  v[e] = __float2bfloat16(tw__silu(g) * sm.stage[warp][r][c8 + e]);
                }
                *reinterpret_cast<uint4*>(C + ((int64_t)tile.row0 + row) * n + col) =
                    *reinterpret_cast<const uint4*>(v);
              }
            }
          }
      }
    }
    if (signal) {
      /* NOTES: every thread that stored part of this tile passes this barrier first; bar.sync
       * orders their st.global before thread 0's release below (barriers are cumulative), and
       * the release reduction makes the whole tile visible to any thread that acquires the
       * counter and observes the increment. */
      __syncthreads();
      if (threadIdx.x == 0) {
        if (args.scope == TW_SIGNAL_SYS)
          tw_red_release_sys(args.band_counters + tile.band, 1u);
        else
          tw_red_release_gpu(args.band_counters + tile.band, 1u);
      }
    }
  }
}

/* SM count of the current device, cached per device (the launcher runs on every call). */
int tw__sm_count(int* out) {
  static int cached[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  if (dev < 64 && cached[dev] > 0) {
    *out = cached[dev];
    return 0;
  }
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return (int)e;
  if (dev < 64) cached[dev] = sms;
  *out = sms;
  return 0;
}

}  // namespace

extern "C" tw_status tw__gemm_launch(const tw_gemm_args* args, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  if (args->num_tiles < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__gemm_launch: num_tiles = %d; must be >= 0",
                    args->num_tiles);
  if (args->num_tiles == 0) return TW_SUCCESS;
  TW_CHECK_NULL(args->a);
  TW_CHECK_NULL(args->b);
  TW_CHECK_NULL(args->c);
  TW_CHECK_NULL(args->tiles);
  if (args->rows <= 0 || args->k <= 0 || args->n <= 0 || args->experts <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw__gemm_launch: rows = %d, k = %d, n = %d, experts = %d; all must be > 0",
                    args->rows, args->k, args->n, args->experts);
  if (args->k % 64 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "tw__gemm_launch: k = %d; must be a multiple of 64", args->k);
  if (args->n % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "tw__gemm_launch: n = %d; must be a multiple of 8", args->n);
  if (args->tm != 64 && args->tm != 128)
    return tw__fail(TW_ERR_UNSUPPORTED, "tw__gemm_launch: tm = %d; supported: 64, 128", args->tm);
  if (args->tn != 128 && args->tn != 256)
    return tw__fail(TW_ERR_UNSUPPORTED, "tw__gemm_launch: tn = %d; supported: 128, 256", args->tn);
  if (args->epilogue != TW_EPILOGUE_STORE && args->epilogue != TW_EPILOGUE_SWIGLU)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__gemm_launch: unknown epilogue %d",
                    (int)args->epilogue);
  if (args->scope != TW_SIGNAL_NONE && args->scope != TW_SIGNAL_GPU && args->scope != TW_SIGNAL_SYS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__gemm_launch: unknown signal scope %d",
                    (int)args->scope);
  if (args->grid < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw__gemm_launch: grid = %d; pass 0 (all SMs) or a positive CTA count",
                    args->grid);
  if (((uintptr_t)args->a | (uintptr_t)args->b | (uintptr_t)args->c) % 16 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "tw__gemm_launch: a, b and c must be 16-byte aligned (cudaMalloc'd buffers)");
  int grid = args->grid;
  if (grid == 0) {
    int e = tw__sm_count(&grid);
    if (e != 0)
      return tw__fail(TW_ERR_CUDA, "tw__gemm_launch: cannot query the SM count: %s",
                      cudaGetErrorString((cudaError_t)e));
  }
  if (grid > args->num_tiles) grid = args->num_tiles;
  if (args->epilogue == TW_EPILOGUE_SWIGLU)
    tw_gemm_v1_kernel<true><<<grid, kV1Threads, 0, stream>>>(*args);
  else
    tw_gemm_v1_kernel<false><<<grid, kV1Threads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__gemm_launch: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}
