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
 * One file for the whole kernel family (its versions share the tile walk, the signals and the
 * launcher; splitting them would scatter what a reader compares side by side), hence its length.
 *
 * Versions (tw_gemm_args.variant; dev/gemm/NOTES.md has each one's measurements):
 *   1  simple: WMMA bf16 MMA, smem tiles from ordinary loads, st.global epilogue. Any supported
 *      shape; kept as the reference implementation and fallback.
 *   2  TMA + wgmma, warp-specialised (1 producer + 2 consumer warpgroups), persistent, st.global
 *      epilogue straight from registers; signal after a named barrier of the consumers.
 *   3  as 2, but the signal is issued by an epilogue warp of the producer warpgroup, so the
 *      release's wait for the tile's stores no longer stalls the tensor cores.
 *   4  as 3, with the epilogue staged through shared memory: the consumers write bf16 to a
 *      staging tile and go on with the next tile; the epilogue warp writes each valid row with
 *      one bulk copy (cp.async.bulk), waits for completion and publishes. The default for
 *      tn = 256.
 *   5  as 4, with the staging tile in 64-column boxes in the 128-byte swizzle and a full tile
 *      written by one TMA tensor store per box (2 or 4) instead of one bulk copy per row (128):
 *      the row copies set a per-tile floor that short-K tiles hit, and two stores lift it
 *      (dev/gemm/NOTES.md v7, v8). A tile with fewer valid rows (the last band of an expert in
 *      the compact layout; the rows after it belong to the next expert) is stored by the
 *      consumers from registers, masked, as in 3. The default for tn = 128, where it is faster;
 *      at tn = 256 the tile's compute already hides v4's row copies and v5 was slower, so 4
 *      stays (measurements: dev/gemm/NOTES.md v9).
 *
 * GEMM1 + SwiGLU (tw__gemm1_swiglu_launch, kernels.h) is the same family with SWIGLU = true: B is
 * w13 (experts, 2F, H); a stage holds A's 128 rows and 256 B rows, the gate rows of the tile's 128
 * output columns and their up rows (two TMA boxes), each consumer one m64n256k16 accumulator of
 * 64 rows x (128 gate | 128 up) columns, and the epilogue writes silu(gate) * up for 128 columns.
 * For 64-row bands (tm 64) a 64 x 128 tile: the consumers split the columns, each one m64n128k16
 * accumulator of 64 rows x (64 gate | 64 up), from four 64-row boxes a stage. Variants 2..5 give
 * identical bits (one mainloop, one epilogue expression); 5 is the default.
 * tw__gemm_f32_launch (kEpiF32) is the unfused path's GEMM: the fp32 accumulators stored as they
 * are, for the bit-equality test of the fused epilogue.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "core.h"
#include "dispatch.h" /* tw_band_counter, TW_WAIT_BAND_ROWS */
#include "kernels.h"
#include "bulk.cuh"
#include "swiglu.cuh"
#include "sync.cuh"
#include "trace.cuh"

namespace {

/* Kernel used for variant 0 where the wgmma kernels cover the shape: the faster of 4 and 5 for
 * the tile width in the same-run comparison (dev/gemm/NOTES.md v9). */
constexpr int tw__default_variant(int tn) {
  return tn == 128 ? 5 : 4;
}

/* A tile's trace kinds (trace.h): GEMM1's when the kernel computes SwiGLU, else GEMM2's. */
template <bool kSwiglu>
constexpr uint32_t tw__tile_begin_kind() {
  return kSwiglu ? TW_TRACE_GEMM1_BEGIN : TW_TRACE_TILE_BEGIN;
}
template <bool kSwiglu>
constexpr uint32_t tw__tile_publish_kind() {
  return kSwiglu ? TW_TRACE_GEMM1_PUBLISH : TW_TRACE_TILE_PUBLISH;
}

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

/* Loads a (128, 32) bf16 slice: row r of the slice is global row (row0 + r) of a row-major
 * (nrows, k) matrix, or zeros where row0 + r >= row_hi. */
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

/* Tiles a launch runs: the first *live_tiles of the list when the call computes it on the device
 * (the capturable dispatch drops the tiles of bands without live rows, dispatch.cu), else all.
 * A plain load: an earlier kernel on the stream wrote it. Every role of a CTA reads the same. */
__device__ __forceinline__ int tw__tile_count(const tw_gemm_args& a) {
  return a.live_tiles != nullptr ? min(*a.live_tiles, a.num_tiles) : a.num_tiles;
}

/* An overlapped layer's GEMM1 (args.band_arrived set): one thread waits until every row of the
 * tile's band has arrived (tw_gemm_args). The acquire (.sys) makes the sources' stores visible
 * to this thread, the proxy fence orders them before its TMA loads (the async proxy); the v1
 * kernel's ordinary loads follow a CTA barrier after it. Once a wait has failed (timeout or an
 * error recorded anywhere) the rest return at once: the call is failed, the tiles run on. */
__device__ __forceinline__ void tw__wait_band_rows(const tw_gemm_args& a, const tw_tile& tile) {
  const int32_t b = tw_band_counter(tile.row0, tile.expert, a.tm);
  tw_wait_geq(a.band_arrived + b, (uint32_t)tile.rows, true, a.timeout_ns, a.err, TW_WAIT_BAND_ROWS,
              b, a.rank);
  asm volatile("fence.proxy.async.global;" ::: "memory");
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
  /* A consumer launched as this grid's programmatic dependent (a captured combine call,
   * combine_call.cu) may start once every CTA of this grid has run this: it waits for the tiles
   * through the band counters, not for this grid's end. No effect on other launches. */
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t n_b = kSwiglu ? 2 * (int64_t)n : n; /* B rows per expert */
  /* Gate and up halves are computed in separate passes of 64 columns each for SwiGLU so that
   * one warp holds the gate and the up value of the same output element. */
  const int out_cols_per_pass = kSwiglu ? kV1BN / 2 : kV1BN;
  const bool signal = args.band_counters != NULL && args.scope != TW_SIGNAL_NONE;
  const int num_tiles = tw__tile_count(args);

  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const tw_tile tile = args.tiles[t];
    const int rows = min(tile.rows, args.tm);
    const __nv_bfloat16* Be = B + (int64_t)tile.expert * n_b * k;
    /* The k loop's first barrier orders this thread's acquire before every thread's loads. */
    if (threadIdx.x == 0 && args.band_arrived != nullptr) tw__wait_band_rows(args, tile);
    if (threadIdx.x == 0) tw_trace_event(args.trace, tw__tile_begin_kind<kSwiglu>(), blockIdx.x, t);
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
        /* Fragment by fragment: gate warps (wn = 0) write their raw gate fragment to their
         * stage, up warps (wn = 1) write theirs and combine silu(gate) * up from the gate
         * partner's stage (warp - 1, same wm); the two barriers order the handover. */
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
        tw_trace_event(args.trace, TW_TRACE_TILE_PUBLISH, blockIdx.x, t);
      }
    } else if (tw_trace_on(args.trace)) {
      /* No counter to release (GEMM1): the tile is stored once every thread has passed. */
      __syncthreads();
      if (threadIdx.x == 0)
        tw_trace_event(args.trace, tw__tile_publish_kind<kSwiglu>(), blockIdx.x, t);
    }
  }
}

/* D (64 x 64, fp32, 32 registers per thread) += A (64 x 16) * B (64 x 16)^T, both K-major
 * in 128B-swizzled shared memory. */
__device__ __forceinline__ void tw__wgmma_m64n64k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

/* D (64 x 128, fp32, 64 registers per thread) += A (64 x 16) * B (128 x 16)^T, both K-major
 * in 128B-swizzled shared memory. */
__device__ __forceinline__ void tw__wgmma_m64n128k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

/* D (64 x 256, fp32, 128 registers per thread) += A (64 x 16) * B (256 x 16)^T, both K-major
 * in 128B-swizzled shared memory. */
__device__ __forceinline__ void tw__wgmma_m64n256k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

/* ---- v2: TMA + wgmma, warp-specialised, persistent --------------------------------------------
 *
 * NOTES (structure): 3 warpgroups. Warpgroup 0 is the producer: one thread streams 64-wide K
 * slices of A (BM rows of the band) and B (BN rows = output columns of the expert) into a ring
 * of STAGES shared-memory stages with TMA, each stage guarded by a "full" mbarrier (TMA
 * transaction bytes) and an "empty" mbarrier (one arrival per consumer warp). Warpgroups 1
 * and 2 are consumers: for BM = 128 each computes 64 rows x BN columns, for BM = 64 each computes
 * 64 rows x BN/2 columns, with wgmma m64nNk16 reading both operands from 128B-swizzled shared
 * memory, fp32 accumulators in registers. The epilogue converts to bf16; kEpiDirect and
 * kEpiSignalWarp store straight from registers with st.global (masked by tile.rows and n),
 * kEpiStaged writes a staging tile that the epilogue warp copies out row by row (only rows <
 * tile.rows, columns < n), kEpiTma a swizzled one that it writes with one TMA tensor store per
 * 64 columns when the tile is full (partial tiles as kEpiSignalWarp); either way rows past
 * tile.rows, which may belong to the next expert, are never written. The producer runs ahead
 * into the next tile while the consumers store, so loads of tile i+1 overlap the epilogue of
 * tile i.
 *
 * Shared memory layout (dynamic, 1024-byte aligned base, per stage s):
 *   [s * STAGE_BYTES,                 + BM * 128)       A slice: BM rows x 64 bf16, 128B swizzle
 *   [s * STAGE_BYTES + BM * 128,      + B_ROWS * 128)   B slice: B_ROWS rows x 64 bf16, swizzled
 * then the staging tile (kEpiStaged: BM rows x kStagePitch bytes; kEpiTma: BN / 64 boxes of BM
 * rows x 128 bytes, 1024-byte aligned as the stages are), then 2 * STAGES + 2
 * mbarriers (8 bytes each): full[0..STAGES), empty[0..STAGES), epi_ready, epi_done.
 * B_ROWS = BN, or 2 * BN for SwiGLU (gate rows, then up rows; at BM = 64 interleaved by column
 * half, V2Config::kBBoxRows).
 */

/* 2D TMA load of one box at (x = inner K offset, y = row) into shared memory, completing
 * transaction bytes on `bar`. */
__device__ __forceinline__ void tw__tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                int32_t x, int32_t y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(tw__smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(tw__smem_u32(bar)), "r"(x), "r"(y)
      : "memory");
}

/* 3D TMA load of one box at (x, y, z) (TW_GEMM1_LEVER_ONE_BOX's gate and up rows). */
__device__ __forceinline__ void tw__tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                int32_t x, int32_t y, int32_t z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(tw__smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(tw__smem_u32(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

/* 2D TMA tensor store of one box from shared memory to (x = column, y = row) of the tensor
 * (async proxy, tracked by this thread's bulk groups); the tensor's bounds clip it. */
__device__ __forceinline__ void tw__tma_store_2d(const CUtensorMap* map, const void* src, int32_t x,
                                                 int32_t y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(x), "r"(y), "r"(tw__smem_u32(src))
               : "memory");
}

/* wgmma shared-memory matrix descriptor for a K-major operand in 128B swizzle: start address
 * >> 4 (bits 0-13), leading byte offset unused for this layout (1), stride byte offset 1024 B
 * between 8-row groups (bits 32-45, in 16-byte units), swizzle mode 128B (bits 62-63 = 1). */
__device__ __forceinline__ uint64_t tw__wgmma_desc(const void* smem) {
  const uint64_t addr = (tw__smem_u32(smem) & 0x3FFFF) >> 4;
  return addr | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void tw__wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void tw__wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void tw__wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
/* Makes the accumulator registers opaque to the compiler across async wgmma groups. */
__device__ __forceinline__ void tw__fence_regs(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

template <int kRegs>
__device__ __forceinline__ void tw__setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void tw__setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int N>
__device__ __forceinline__ void tw__wgmma(float* d, uint64_t da, uint64_t db) {
  if constexpr (N == 64) tw__wgmma_m64n64k16(d, da, db);
  if constexpr (N == 128) tw__wgmma_m64n128k16(d, da, db);
  if constexpr (N == 256) tw__wgmma_m64n256k16(d, da, db);
}

/* Epilogue modes of the wgmma kernel (variants 2, 3, 4, 5), and kEpiF32: kEpiDirect's stores of
 * the fp32 accumulators unrounded (c is float (rows, n)), no signals; the first half of the unfused
 * GEMM1 (tw__gemm_f32_launch), which the fused one must match bit for bit. */
enum { kEpiDirect = 0, kEpiSignalWarp = 1, kEpiStaged = 2, kEpiTma = 3, kEpiF32 = 4 };

template <int BM, int BN, int STAGES, bool SWIGLU, int EPI>
struct V2Config {
  static constexpr int kBRows = SWIGLU ? 2 * BN : BN;          /* B rows loaded per stage */
  static constexpr int kWgN = BM == 128 ? kBRows : kBRows / 2; /* wgmma N of one consumer */
  static constexpr int kAcc = kWgN / 2;                        /* fp32 accumulators per thread */
  /* SwiGLU at BM = 64 splits the columns between the consumers, so each must hold the gate and
   * the up rows of its own half: the stage's B rows are [gate 0..BN/2 | up 0..BN/2 | gate
   * BN/2..BN | up BN/2..BN) of the tile's columns, four TMA boxes of BN/2 rows, and consumer cw
   * reads kWgN = BN contiguous rows for output columns cw * BN/2... Otherwise B boxes are BN rows
   * (SwiGLU at BM = 128: gate rows, then up rows, two boxes). */
  static constexpr int kBBoxRows = SWIGLU && BM == 64 ? BN / 2 : BN;
  /* Output columns of one consumer (BM = 64: its share of the tile's). */
  static constexpr int kOutCols = SWIGLU ? kWgN / 2 : kWgN;
  static constexpr int kABytes = BM * 128;
  static constexpr int kBBytes = kBRows * 128;
  static constexpr int kStageBytes = kABytes + kBBytes;
  /* EPI = kEpiStaged: a (BM, BN) bf16 staging tile, rows padded by 16 bytes so that the
   * accumulator writes (8 rows x 4 lanes per instruction) hit 32 distinct banks. */
  static constexpr int kStagePitch = BN * 2 + 16;
  /* EPI = kEpiTma: BN / 64 boxes of (BM rows, 64 columns) bf16, each row of a box 128 bytes in
   * the 128-byte swizzle (16-byte chunk q of row r at chunk q ^ (r % 8)): what a TMA tensor
   * store reads, and the same 32 distinct banks for the accumulator writes. */
  static constexpr int kBoxBytes = BM * 128;
  static constexpr int kStagingBytes =
      EPI == kEpiStaged ? BM * kStagePitch : (EPI == kEpiTma ? BN / 64 * kBoxBytes : 0);
  /* Byte offset of tile element (r, c) in the swizzled staging tile (kEpiTma). */
  static __device__ __forceinline__ int swizzled(int r, int c) {
    return (c >> 6) * kBoxBytes + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
  }
  static constexpr int kBarOffset = STAGES * kStageBytes + kStagingBytes;
  static constexpr int kSmemBytes = kBarOffset + (2 * STAGES + 2) * 8 + 1024; /* + align */
  static constexpr int kThreads = 384;
  static_assert(BM == 64 || BM == 128, "BM");
  static_assert(!SWIGLU || BN == 128, "SwiGLU tiles are 128 output columns");
  static_assert(kWgN == 64 || kWgN == 128 || kWgN == 256, "wgmma N");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

/* Named barrier 1 among the 256 consumer threads (barrier 0 is __syncthreads). */
__device__ __forceinline__ void tw__consumer_bar() {
  asm volatile("bar.sync 1, 256;" ::: "memory");
}

template <int BM, int BN, int STAGES, bool SWIGLU, int EPI, int LV = 0>
__global__ void __launch_bounds__(384, 1)
    tw_gemm_v2_kernel(const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b,
                      const __grid_constant__ CUtensorMap map_c, const tw_gemm_args args) {
  using Cfg = V2Config<BM, BN, STAGES, SWIGLU, EPI>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* staging = smem + STAGES * Cfg::kStageBytes; /* kEpiStaged / kEpiTma only */
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOffset);
  uint64_t* empty = full + STAGES;
  /* kEpiSignalWarp / kEpiStaged: the consumers -> epilogue warp hand-off of each tile
   * (epi_ready: one arrival per consumer warp after its part is stored or staged) and back
   * (epi_done: the epilogue warp has published the tile / freed the staging buffer). */
  uint64_t* epi_ready = empty + STAGES;
  uint64_t* epi_done = epi_ready + 1;
  const bool signal = args.band_counters != NULL && args.scope != TW_SIGNAL_NONE;
  /* Whether the epilogue warp takes part (it always does for staged stores). */
  constexpr bool kStaging = EPI == kEpiStaged || EPI == kEpiTma;
  const bool epi_warp = kStaging || (EPI == kEpiSignalWarp && signal);
  const int wg = threadIdx.x / 128;
  const int nk = args.k / 64;
  /* A consumer launched as this grid's programmatic dependent (a captured combine call,
   * combine_call.cu) may start once every CTA of this grid has run this: it waits for the tiles
   * through the band counters, not for this grid's end. No effect on other launches. */
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int num_tiles = tw__tile_count(args);

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) {
      tw__mbar_init(&full[s], 1);  /* the producer's arrive.expect_tx */
      tw__mbar_init(&empty[s], 8); /* one arrival per consumer warp */
    }
    tw__mbar_init(epi_ready, 8);
    tw__mbar_init(epi_done, 1);
    /* Make the initialised barriers visible to the async proxy (TMA completes on them). */
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    /* ---- producer warpgroup: one thread issues every TMA load; warp 1 is the epilogue warp
     * of kEpiSignalWarp / kEpiStaged ---- */
    tw__setmaxnreg_dec<40>();
    if (threadIdx.x >= 64) {
      /* Warps 2-3, idle otherwise: zero the CTA's share of `zero` (the add dataflow's next
       * output buffer), 16 bytes a store, and leave (no later block-wide barrier). */
      if (args.zero != nullptr) {
        const int64_t n = args.zero_vectors, per = (n + gridDim.x - 1) / gridDim.x;
        const int64_t lo = (int64_t)blockIdx.x * per, hi = min(n, lo + per);
        uint4* v = static_cast<uint4*>(args.zero);
        for (int64_t i = lo + threadIdx.x - 64; i < hi; i += 64) v[i] = make_uint4(0, 0, 0, 0);
      }
      return;
    }
    if (EPI != kEpiDirect && threadIdx.x / 32 == 1 && epi_warp) {
      const int lane = threadIdx.x % 32;
      uint32_t it = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x, it++) {
        const tw_tile tile = args.tiles[t];
        tw__mbar_wait(epi_ready, it & 1); /* acquire (CTA): the consumers' part of tile t */
        if (EPI == kEpiStaged) {
          /* Rows < tile.rows and columns < n only: each row is one contiguous bulk write. */
          const int rows = min(tile.rows, BM);
          const uint32_t bytes = (uint32_t)min(BN, args.n - tile.col0) * 2u;
          __nv_bfloat16* C = static_cast<__nv_bfloat16*>(args.c);
          /* The add dataflow: rows of this rank's tokens are added into its output (a band of
           * its own, or the rows past a remote band's valid ones: the local group that shares
           * the band, or padding), the remote ones stored for the consumer. */
          __nv_bfloat16* add_out = static_cast<__nv_bfloat16*>(args.add_out);
          int first_local = BM; /* rows at or past it are this rank's */
          if (add_out != nullptr) {
            const tw_band bd = args.bands[tile.band];
            first_local = bd.dest == args.rank ? 0 : bd.valid_rows;
          }
          for (int r = lane; r < rows; r += 32) {
            const uint8_t* src = staging + r * Cfg::kStagePitch;
            const int64_t row = (int64_t)tile.row0 + r;
            if (r < first_local) {
              tw__bulk_store(C + row * args.n + tile.col0, src, bytes);
            } else {
              const int32_t token = __ldg(&args.row_token[row]);
              if (token >= 0)
                tw__bulk_add_bf16(add_out + (int64_t)token * args.n + tile.col0, src, bytes);
            }
          }
          tw__bulk_commit();
          /* NOTES: wait_group 0, NOT .read: .read only covers the reads of the staging buffer;
           * the release below needs this lane's global writes complete. Completion of a bulk
           * copy includes an implicit generic-async proxy fence, so no fence.proxy.async.global
           * is needed before the (generic) release. */
          tw__bulk_wait_all();
          /* Barrier among every lane that issued writes before lane 0 publishes. */
          __syncwarp();
        }
        if (EPI == kEpiTma) {
          /* A full tile: one tensor store per box; boxes past n are clipped by the map. A tile
           * with fewer rows the consumers stored themselves (kEpiSignalWarp's way, see there):
           * nothing to write here, only to publish. */
          if (tile.rows >= BM) {
            if (lane == 0) {
              for (int b = 0; b < BN / 64 && tile.col0 + b * 64 < args.n; b++)
                tw__tma_store_2d(&map_c, staging + b * Cfg::kBoxBytes, tile.col0 + b * 64,
                                 tile.row0);
              tw__bulk_commit();
              /* NOTES: as for kEpiStaged: wait_group 0 (the writes complete, with the implicit
               * generic-async proxy fence of a completed bulk copy) before the release. */
              tw__bulk_wait_all();
            }
          }
          __syncwarp();
        }
        if (lane == 0) {
          if (signal) {
            /* NOTES: release after the barrier above (kEpiStaged) or after acquiring epi_ready,
             * which every consumer warp arrived on (release, CTA scope) after __syncwarp over
             * its lanes' st.global (kEpiSignalWarp): the release is cumulative, so the whole
             * tile is visible to whoever acquires the counter and sees this increment. */
            if (args.scope == TW_SIGNAL_SYS)
              tw_red_release_sys(args.band_counters + tile.band, 1u);
            else
              tw_red_release_gpu(args.band_counters + tile.band, 1u);
          }
          /* Published (signal) or stored (GEMM1: its stores done above, or the consumers'
           * acquired through epi_ready). */
          tw_trace_event(args.trace, tw__tile_publish_kind<SWIGLU>(), blockIdx.x, t);
          tw__mbar_arrive(epi_done); /* staging buffer free / tile published */
        }
      }
    }
    if (threadIdx.x == 0) {
      const int64_t n_b = SWIGLU ? 2 * (int64_t)args.n : args.n;
      int stage = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const tw_tile tile = args.tiles[t];
        const int32_t brow = (int32_t)(tile.expert * n_b + tile.col0);
        if (args.band_arrived != nullptr) tw__wait_band_rows(args, tile);
        for (int kb = 0; kb < nk; kb++) {
          /* Wait until both consumers released this stage (a fresh barrier passes parity 1). */
          tw__mbar_wait(&empty[stage], phase ^ 1);
          uint8_t* sa = smem + stage * Cfg::kStageBytes;
          uint8_t* sb = sa + Cfg::kABytes;
          tw__mbar_expect_tx(&full[stage], Cfg::kStageBytes);
          tw__tma_load_2d(sa, &map_a, &full[stage], kb * 64, tile.row0);
          if (SWIGLU && BM == 64) { /* gate, up of columns 0..BN/2, then of BN/2..BN */
            constexpr int kHalf = BN / 2;
            for (int q = 0; q < 2; q++) {
              tw__tma_load_2d(sb + 2 * q * kHalf * 128, &map_b, &full[stage], kb * 64,
                              brow + q * kHalf);
              tw__tma_load_2d(sb + (2 * q + 1) * kHalf * 128, &map_b, &full[stage], kb * 64,
                              brow + args.n + q * kHalf);
            }
          } else if (SWIGLU && (LV & TW_GEMM1_LEVER_ONE_BOX)) {
            tw__tma_load_3d(sb, &map_b, &full[stage], kb * 64, tile.col0, 2 * tile.expert);
          } else if (SWIGLU) {
            tw__tma_load_2d(sb, &map_b, &full[stage], kb * 64, brow);
            tw__tma_load_2d(sb + BN * 128, &map_b, &full[stage], kb * 64, brow + args.n);
          } else {
            tw__tma_load_2d(sb, &map_b, &full[stage], kb * 64, brow);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  /* ---- consumer warpgroups ---- */
  tw__setmaxnreg_inc<232>();
  const int cw = wg - 1;                   /* consumer index 0/1 */
  const int warp = (threadIdx.x / 32) % 4; /* warp within the warpgroup */
  const int lane = threadIdx.x % 32;
  /* This consumer's part of the tile: BM = 128: rows cw*64.., all columns; BM = 64: all 64
   * rows, output columns cw*kOutCols.. (B rows cw*kWgN..: kOutCols = kWgN, or for SwiGLU the
   * gate and up rows of kWgN / 2 columns). */
  const int a_off = BM == 128 ? cw * 64 * 128 : 0;
  const int b_off = BM == 128 ? 0 : cw * Cfg::kWgN * 128;
  const int row_base = BM == 128 ? cw * 64 : 0;
  const int col_base = BM == 128 ? 0 : cw * Cfg::kOutCols;
  __nv_bfloat16* C = static_cast<__nv_bfloat16*>(args.c);
  int stage = 0;
  uint32_t phase = 0;
  uint32_t it = 0; /* this CTA's tile count, for the epi_ready / epi_done phases */
  float acc[Cfg::kAcc];

  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x, it++) {
    const tw_tile tile = args.tiles[t];
    if (threadIdx.x == 128)
      tw_trace_event(args.trace, tw__tile_begin_kind<SWIGLU>(), blockIdx.x, t);
#pragma unroll
    for (int i = 0; i < Cfg::kAcc; i++) acc[i] = 0.f;
    int prev_stage = -1;
    for (int kb = 0; kb < nk; kb++) {
      tw__mbar_wait(&full[stage], phase);
      const uint8_t* sa = smem + stage * Cfg::kStageBytes + a_off;
      const uint8_t* sb = smem + stage * Cfg::kStageBytes + Cfg::kABytes + b_off;
      const uint64_t da = tw__wgmma_desc(sa), db = tw__wgmma_desc(sb);
#pragma unroll
      for (int i = 0; i < Cfg::kAcc; i++) tw__fence_regs(acc[i]);
      tw__wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; kk++) /* 16 bf16 = 32 bytes = 2 descriptor units per step */
        tw__wgmma<Cfg::kWgN>(acc, da + 2 * kk, db + 2 * kk);
      tw__wgmma_commit();
#pragma unroll
      for (int i = 0; i < Cfg::kAcc; i++) tw__fence_regs(acc[i]);
      /* Keep one group in flight: once the previous slice's group is complete (this warp's view:
       * every warp arrives, the barrier counts 8) its stage can be refilled. */
      tw__wgmma_wait<1>();
      if (prev_stage >= 0 && lane == 0) tw__mbar_arrive(&empty[prev_stage]);
      prev_stage = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    tw__wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < Cfg::kAcc; i++) tw__fence_regs(acc[i]);
    if (prev_stage >= 0 && lane == 0) tw__mbar_arrive(&empty[prev_stage]);

    /* Epilogue: accumulator (warp, lane, j, i) holds row warp*16 + lane/4 (+8 for i >= 2),
     * columns j*8 + (lane%4)*2 + {0, 1}. */
    const int rows = min(tile.rows, BM);
    const int r0 = row_base + warp * 16 + lane / 4;
    const int lc0 = col_base + (lane % 4) * 2; /* column within the tile */
    constexpr int kOutChunks = SWIGLU ? Cfg::kWgN / 16 : Cfg::kWgN / 8;
    /* kEpiTma: a full tile goes through the staging tile; a partial one (its last rows belong to
     * the next expert) is stored from registers, masked, as kEpiSignalWarp does. */
    const bool staged = EPI == kEpiStaged || (EPI == kEpiTma && tile.rows >= BM);
    if (kStaging) /* the epilogue warp has finished reading the previous tile */
      tw__mbar_wait(epi_done, (it & 1) ^ 1);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int r = r0 + h * 8;
      /* 1 (exact) unless the add dataflow scales rows; rows past the band's weigh nothing. */
      const float w = args.row_weight == nullptr ? 1.f
                      : r < rows                 ? __ldg(&args.row_weight[(int64_t)tile.row0 + r])
                                                 : 0.f;
      if (staged || r < rows) {
        __nv_bfloat16* crow = C + ((int64_t)tile.row0 + r) * args.n + tile.col0;
#pragma unroll
        for (int j = 0; j < kOutChunks; j++) {
          const int col = lc0 + j * 8;
          float v0 = acc[j * 4 + h * 2], v1 = acc[j * 4 + h * 2 + 1];
          if (SWIGLU) { /* the up value of the same element sits kOutChunks chunks later */
            if (LV & TW_GEMM1_LEVER_TANH) {
              v0 = tw__swiglu_tanh(v0, acc[(j + kOutChunks) * 4 + h * 2]);
              v1 = tw__swiglu_tanh(v1, acc[(j + kOutChunks) * 4 + h * 2 + 1]);
            } else {
              v0 = tw__swiglu(v0, acc[(j + kOutChunks) * 4 + h * 2]);
              v1 = tw__swiglu(v1, acc[(j + kOutChunks) * 4 + h * 2 + 1]);
            }
          }
          v0 *= w; /* the add dataflow's gate weight, before the one rounding to bf16 */
          v1 *= w;
          if (EPI == kEpiF32) { /* the accumulators themselves, masked as kEpiDirect's */
            if (tile.col0 + col < args.n)
              *reinterpret_cast<float2*>(static_cast<float*>(args.c) +
                                         ((int64_t)tile.row0 + r) * args.n + tile.col0 + col) =
                  make_float2(v0, v1);
            continue;
          }
          const __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
          if (EPI == kEpiStaged) /* every row and column; the bulk writes mask them */
            *reinterpret_cast<__nv_bfloat162*>(staging + r * Cfg::kStagePitch + col * 2) = v;
          else if (staged) /* kEpiTma, a full tile: the tensor stores clip columns past n */
            *reinterpret_cast<__nv_bfloat162*>(staging + Cfg::swizzled(r, col)) = v;
          else if (tile.col0 + col < args.n) /* masked by tile.rows and n; n even: the pair is
                                                all in or all out */
            *reinterpret_cast<__nv_bfloat162*>(crow + col) = v;
        }
      }
    }
    if (kStaging) {
      /* Make this thread's staging writes visible to the async proxy (the bulk copies), then
       * hand the tile to the epilogue warp: __syncwarp orders the lanes, lane 0's arrive is a
       * release at CTA scope that the epilogue warp acquires (for kEpiTma's partial tiles the
       * same chain orders the lanes' st.global before the epilogue warp's release, as for
       * kEpiSignalWarp below). */
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) tw__mbar_arrive(epi_ready);
    } else if (EPI == kEpiSignalWarp && signal) {
      /* NOTES: every consumer warp's lanes pass __syncwarp after their st.global (bar.warp.sync
       * orders memory among its lanes); lane 0's mbarrier arrive is a release at CTA scope; the
       * epilogue warp acquires epi_ready and then issues the release reduction (cumulative), so
       * the tile is visible to whoever acquires the counter. The wait on epi_done (the previous
       * tile's publication, long done) keeps epi_ready from running a phase ahead. */
      tw__mbar_wait(epi_done, (it & 1) ^ 1);
      __syncwarp();
      if (lane == 0) tw__mbar_arrive(epi_ready);
    } else if (signal) {
      /* NOTES: both consumer warpgroups (every thread that stored part of this tile) pass this
       * named barrier before one thread publishes; bar.sync orders their st.global before that
       * thread's release reduction (cumulativity), so a consumer that acquires the counter and
       * sees the increment also sees the whole tile. */
      tw__consumer_bar();
      if (threadIdx.x == 128) {
        if (args.scope == TW_SIGNAL_SYS)
          tw_red_release_sys(args.band_counters + tile.band, 1u);
        else
          tw_red_release_gpu(args.band_counters + tile.band, 1u);
        tw_trace_event(args.trace, TW_TRACE_TILE_PUBLISH, blockIdx.x, t);
      }
    } else if (tw_trace_on(args.trace)) {
      /* No counter and no epilogue warp (GEMM1 on variants 2, 3): stored once both consumer
       * warpgroups have passed. */
      tw__consumer_bar();
      if (threadIdx.x == 128)
        tw_trace_event(args.trace, tw__tile_publish_kind<SWIGLU>(), blockIdx.x, t);
    }
  }
}

/* ---- v2 host side: tensor maps and launch ---------------------------------------------------- */

/* cuTensorMapEncodeTiled through the runtime's driver entry point, so that nothing has to link
 * libcuda directly. Resolved once per process. */
typedef CUresult (*tw__encode_tiled_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                        const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                        const cuuint32_t*, CUtensorMapInterleave,
                                        CUtensorMapSwizzle, CUtensorMapL2promotion,
                                        CUtensorMapFloatOOBfill);

tw_status tw__get_encode_fn(tw__encode_tiled_fn* fn) {
  static tw__encode_tiled_fn cached = NULL;
  if (cached == NULL) {
    void* p = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                     cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == NULL)
      return tw__fail(TW_ERR_CUDA,
                      "tw__gemm_launch: cuTensorMapEncodeTiled not found in the driver (%s); "
                      "a driver for CUDA 12.0 or newer is required",
                      cudaGetErrorString(e));
    cached = reinterpret_cast<tw__encode_tiled_fn>(p);
  }
  *fn = cached;
  return TW_SUCCESS;
}

/* A bf16 tensor map of `rank` dimensions (innermost first; strides in bytes for dimensions 1..)
 * in 128B swizzle, reads outside the tensor zero-filled. */
tw_status tw__encode_map(CUtensorMap* map, const void* base, cuuint32_t rank,
                         const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
  tw__encode_tiled_fn encode = NULL;
  TW_TRY(tw__get_encode_fn(&encode));
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides,
             box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return tw__fail(TW_ERR_CUDA,
                    "tw__gemm_launch: cuTensorMapEncodeTiled failed (%d) for a %uD tensor (%llu, "
                    "%llu%s) with a (%u, %u) box",
                    (int)r, (unsigned)rank, (unsigned long long)dims[0],
                    (unsigned long long)dims[1], rank > 2 ? ", ..." : "", (unsigned)box[0],
                    (unsigned)box[1]);
  return TW_SUCCESS;
}

/* A 2D map over a row-major (rows, k) matrix with a (64, box_rows) box. */
tw_status tw__make_map(CUtensorMap* map, const void* base, int64_t rows, int64_t k, int box_rows) {
  const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)k * 2}; /* bytes between rows */
  const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
  return tw__encode_map(map, base, 2, dims, strides, box);
}

/* w13 (experts, 2 ffn, k) as a 3D tensor (k, ffn, 2 experts): index z = 2 e + {0 gate, 1 up}, so
 * that one box (64, box_rows, 2) holds a column tile's gate rows, then its up rows, in the
 * layout of the two 2D boxes (TW_GEMM1_LEVER_ONE_BOX); a box past ffn is clipped inside its half
 * (zero-filled) instead of reading the up rows. */
tw_status tw__make_map_gate_up(CUtensorMap* map, const void* base, int64_t experts, int64_t ffn,
                               int64_t k, int box_rows) {
  const cuuint64_t dims[3] = {(cuuint64_t)k, (cuuint64_t)ffn, (cuuint64_t)(2 * experts)};
  const cuuint64_t strides[2] = {(cuuint64_t)k * 2, (cuuint64_t)(ffn * k * 2)};
  const cuuint32_t box[3] = {64, (cuuint32_t)box_rows, 2};
  return tw__encode_map(map, base, 3, dims, strides, box);
}

/* The opt-in shared memory size of a v2 kernel is a per-device function attribute: set once per
 * device. */
template <int BM, int BN, int STAGES, bool SWIGLU, int EPI, int LV = 0>
tw_status tw__v2_enable_smem() {
  using Cfg = V2Config<BM, BN, STAGES, SWIGLU, EPI>;
  static bool attr_set[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && (dev >= 64 || !attr_set[dev])) {
    e = cudaFuncSetAttribute(tw_gemm_v2_kernel<BM, BN, STAGES, SWIGLU, EPI, LV>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (e == cudaSuccess && dev < 64) attr_set[dev] = true;
  }
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__gemm_launch: cannot enable %d bytes of shared memory: %s",
                    Cfg::kSmemBytes, cudaGetErrorString(e));
  return TW_SUCCESS;
}

template <int BM, int BN, int STAGES, bool SWIGLU, int EPI, int LV = 0>
tw_status tw__launch_v2(const tw_gemm_args* args, int grid, cudaStream_t stream) {
  using Cfg = V2Config<BM, BN, STAGES, SWIGLU, EPI>;
  auto kernel = tw_gemm_v2_kernel<BM, BN, STAGES, SWIGLU, EPI, LV>;
  TW_TRY((tw__v2_enable_smem<BM, BN, STAGES, SWIGLU, EPI, LV>()));
  CUtensorMap map_a, map_b;
  const int64_t n_b = SWIGLU ? 2 * (int64_t)args->n : args->n;
  TW_TRY(tw__make_map(&map_a, args->a, args->rows, args->k, BM));
  /* B boxes are BN rows; SwiGLU loads the gate rows and the up rows as two boxes per stage, or
   * (TW_GEMM1_LEVER_ONE_BOX) as one box of a 3D view. */
  if (LV & TW_GEMM1_LEVER_ONE_BOX)
    TW_TRY(tw__make_map_gate_up(&map_b, args->b, args->experts, args->n, args->k, BN));
  else
    TW_TRY(tw__make_map(&map_b, args->b, (int64_t)args->experts * n_b, args->k, Cfg::kBBoxRows));
  /* kEpiTma: C as (rows, n) in boxes of 64 columns x BM rows, 128-byte swizzle (the staging
   * tile's layout); the other epilogues do not read it. */
  CUtensorMap map_c = map_a;
  if (EPI == kEpiTma) TW_TRY(tw__make_map(&map_c, args->c, args->rows, args->n, BM));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_a, map_b, map_c, *args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__gemm_launch: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

/* Pipeline stages per epilogue and tile shape: as many as fit in shared memory beside the
 * epilogue's own buffer (the staging tile of kEpiStaged / kEpiTma). */
template <int EPI>
struct EpiStages {
  static constexpr bool kStaged = EPI == kEpiStaged || EPI == kEpiTma;
  /* 128 x 128 output, gate and up rows (B 256 rows, 48 KiB a stage): kEpiTma's staging tile is
   * 32 KiB (4 stages: 224 KiB + barriers), kEpiStaged's padded one 80 bytes too large for 4. */
  static constexpr int kSwiglu = EPI == kEpiStaged ? 3 : 4;
  /* 64 x 128 output (A 8 KiB + B 32 KiB a stage): 5 beside any staging tile (16-17 KiB). */
  static constexpr int kSwiglu64 = 5;
  static constexpr int k128x256 = kStaged ? 3 : 4;
  static constexpr int k128x128 = kStaged ? 5 : 6;
  static constexpr int k64x256 = kStaged ? 4 : 5;
  static constexpr int k64x128 = 8;
};

/* Runs op on the wgmma kernel with epilogue EPI for a tile shape: op.template run<BM, BN, STAGES,
 * SWIGLU, EPI>() launches it or queries it. */
template <int EPI, class Op>
tw_status tw__with_v2_kernel(int tm, int tn, bool swiglu, const Op& op) {
  using S = EpiStages<EPI>;
  if (swiglu && tm == 64) return op.template run<64, 128, S::kSwiglu64, true, EPI>();
  if (swiglu) return op.template run<128, 128, S::kSwiglu, true, EPI>();
  if (tm == 128 && tn == 256) return op.template run<128, 256, S::k128x256, false, EPI>();
  if (tm == 128) return op.template run<128, 128, S::k128x128, false, EPI>();
  if (tn == 256) return op.template run<64, 256, S::k64x256, false, EPI>();
  return op.template run<64, 128, S::k64x128, false, EPI>();
}

struct tw__v2_launch {
  const tw_gemm_args* args;
  int grid;
  cudaStream_t stream;
  template <int BM, int BN, int STAGES, bool SWIGLU, int EPI>
  tw_status run() const {
    return tw__launch_v2<BM, BN, STAGES, SWIGLU, EPI>(args, grid, stream);
  }
};

struct tw__v2_occupancy {
  int* ctas_per_sm;
  template <int BM, int BN, int STAGES, bool SWIGLU, int EPI>
  tw_status run() const {
    using Cfg = V2Config<BM, BN, STAGES, SWIGLU, EPI>;
    TW_TRY((tw__v2_enable_smem<BM, BN, STAGES, SWIGLU, EPI>()));
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        ctas_per_sm, tw_gemm_v2_kernel<BM, BN, STAGES, SWIGLU, EPI>, Cfg::kThreads,
        Cfg::kSmemBytes);
    if (e != cudaSuccess)
      return tw__fail(TW_ERR_CUDA, "tw__gemm_occupancy: %s", cudaGetErrorString(e));
    return TW_SUCCESS;
  }
};

/* Runs op on the wgmma kernel of variant 2..5 (its epilogue) for a tile shape. */
template <class Op>
tw_status tw__with_variant(int variant, int tm, int tn, bool swiglu, const Op& op) {
  switch (variant) {
    case 2:
      return tw__with_v2_kernel<kEpiDirect>(tm, tn, swiglu, op);
    case 3:
      return tw__with_v2_kernel<kEpiSignalWarp>(tm, tn, swiglu, op);
    case 4:
      return tw__with_v2_kernel<kEpiStaged>(tm, tn, swiglu, op);
    default:
      return tw__with_v2_kernel<kEpiTma>(tm, tn, swiglu, op);
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
  const bool swiglu = args->epilogue == TW_EPILOGUE_SWIGLU;
  /* v2 covers every shape except SwiGLU with tn != 128. */
  const bool v2_ok = !swiglu || args->tn == 128;
  int variant = args->variant;
  const bool adds = args->add_out != NULL || args->row_weight != NULL;
  if (adds) {
    if (variant == 0) variant = TW_GEMM_VARIANT_ADD;
    if (variant != TW_GEMM_VARIANT_ADD || swiglu)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw__gemm_launch: the add dataflow's epilogue (row weights, added rows) runs "
                      "in variant 4 without SwiGLU only (got variant %d%s); unset TW_GEMM_VARIANT "
                      "or set it to 4",
                      args->variant, swiglu ? ", SwiGLU" : "");
    if (args->add_out != NULL && (args->row_token == NULL || args->bands == NULL))
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw__gemm_launch: add_out needs row_token and bands");
    if ((uintptr_t)args->add_out % 16 != 0)
      return tw__fail(TW_ERR_ALIGNMENT, "tw__gemm_launch: add_out must be 16-byte aligned");
  }
  if (variant == 0) variant = v2_ok ? tw__default_variant(args->tn) : 1;
  if (args->zero != NULL &&
      (variant < 2 || (uintptr_t)args->zero % 16 != 0 || args->zero_vectors < 0))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw__gemm_launch: zeroing by the producer needs the wgmma kernels (variant "
                    "2..5, got %d), a 16-byte aligned buffer and a non-negative count",
                    variant);
  if (args->levers != 0) {
    /* The lab levers of GEMM1 + SwiGLU's 128 x 128 kernel (kernels.h), each instance on its own. */
    if (!swiglu || args->tm != 128 || variant != 5 || adds || args->zero != NULL)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw__gemm_launch: levers 0x%x are GEMM1 + SwiGLU's at tm 128, variant 5, "
                      "without the add dataflow or zeroing",
                      (unsigned)args->levers);
    switch (args->levers) {
      case TW_GEMM1_LEVER_STAGES3:
        return tw__launch_v2<128, 128, 3, true, kEpiTma, TW_GEMM1_LEVER_STAGES3>(args, grid,
                                                                                 stream);
      case TW_GEMM1_LEVER_ONE_BOX:
        return tw__launch_v2<128, 128, 4, true, kEpiTma, TW_GEMM1_LEVER_ONE_BOX>(args, grid,
                                                                                 stream);
      case TW_GEMM1_LEVER_TANH:
        return tw__launch_v2<128, 128, 4, true, kEpiTma, TW_GEMM1_LEVER_TANH>(args, grid, stream);
      case TW_GEMM1_LEVER_ALL:
        return tw__launch_v2<128, 128, 3, true, kEpiTma, TW_GEMM1_LEVER_ALL>(args, grid, stream);
      default:
        return tw__fail(TW_ERR_UNSUPPORTED,
                        "tw__gemm_launch: levers 0x%x; give one of 0x1, 0x2, 0x4 or all (0x7)",
                        (unsigned)args->levers);
    }
  }
  if (variant >= 2 && variant <= 5) {
    if (!v2_ok)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw__gemm_launch: the wgmma kernels run SwiGLU only with tn = 128 (got "
                      "%d x %d); use variant 0 or 1",
                      args->tm, args->tn);
    return tw__with_variant(variant, args->tm, args->tn, swiglu, tw__v2_launch{args, grid, stream});
  }
  if (variant != 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__gemm_launch: variant = %d; use 0 to 5",
                    args->variant);
  if (swiglu)
    tw_gemm_v1_kernel<true><<<grid, kV1Threads, 0, stream>>>(*args);
  else
    tw_gemm_v1_kernel<false><<<grid, kV1Threads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__gemm_launch: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

extern "C" tw_status tw__gemm_occupancy(int32_t tm, int32_t tn, int32_t variant, int* ctas_per_sm) {
  TW_CHECK_NULL(ctas_per_sm);
  *ctas_per_sm = 0;
  if ((tm != 64 && tm != 128) || (tn != 128 && tn != 256))
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw__gemm_occupancy: tile %d x %d; supported: 64 or 128 "
                    "x 128 or 256",
                    tm, tn);
  if (variant == 0) variant = tw__default_variant(tn);
  if (variant >= 2 && variant <= 5)
    return tw__with_variant(variant, tm, tn, false, tw__v2_occupancy{ctas_per_sm});
  if (variant != 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__gemm_occupancy: variant = %d; use 0 to 5",
                    variant);
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas_per_sm, tw_gemm_v1_kernel<false>, kV1Threads, 0);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__gemm_occupancy: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

/* ---- GEMM1 + SwiGLU and the unfused path's fp32 GEMM ---------------------------------------- */

namespace {

/* The persistent grid: `requested` CTAs, 0 = one per SM, never more than the tiles. */
tw_status tw__resolve_grid(const char* who, int requested, int num_tiles, int* grid) {
  int g = requested;
  if (g == 0) {
    const int e = tw__sm_count(&g);
    if (e != 0)
      return tw__fail(TW_ERR_CUDA, "%s: cannot query the SM count: %s", who,
                      cudaGetErrorString((cudaError_t)e));
  }
  *grid = g < num_tiles ? g : num_tiles;
  return TW_SUCCESS;
}

}  // namespace

extern "C" tw_status tw__gemm1_swiglu_launch(const tw_gemm1_args* args, cudaStream_t stream) {
  static const char* who = "tw__gemm1_swiglu_launch";
  TW_CHECK_NULL(args);
  if (args->num_tiles < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "%s: num_tiles = %d; must be >= 0", who, args->num_tiles);
  if (args->num_tiles == 0) return TW_SUCCESS;
  TW_CHECK_NULL(args->a);
  TW_CHECK_NULL(args->w13);
  TW_CHECK_NULL(args->h);
  TW_CHECK_NULL(args->tiles);
  if (args->rows <= 0 || args->hidden <= 0 || args->ffn <= 0 || args->experts <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "%s: rows = %d, hidden = %d, ffn = %d, experts = %d; all must be > 0", who,
                    args->rows, args->hidden, args->ffn, args->experts);
  if (args->hidden % 64 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: hidden = %d; GEMM1's K must be a multiple of 64 (the kernels' K slice); "
                    "pad the hidden dimension of a and w13 with zeros",
                    who, args->hidden);
  if (args->ffn % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: ffn = %d; must be a multiple of 8 (16-byte rows of h; any multiple of 8 "
                    "works, %d or not)",
                    who, args->ffn, TW_GEMM1_TN);
  if ((int64_t)args->experts * 2 * args->ffn > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "%s: %d experts x 2 x ffn %d weight rows exceed the tensor map's 2^31 - 1", who,
                    args->experts, args->ffn);
  if (args->tm != 64 && args->tm != 128)
    return tw__fail(TW_ERR_UNSUPPORTED, "%s: tm = %d; supported: 64, 128", who, args->tm);
  if (args->grid < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: grid = %d; pass 0 (all SMs) or a positive CTA count", who, args->grid);
  if (args->variant < 0 || args->variant > 5)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: variant = %d; use 0 to 5", who, args->variant);
  if (((uintptr_t)args->a | (uintptr_t)args->w13 | (uintptr_t)args->h) % 16 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: a, w13 and h must be 16-byte aligned (cudaMalloc'd buffers)", who);
  /* The producer's arguments: B = w13 (2 ffn rows per expert), n = ffn output columns, tm x 128
   * output tiles, no signals. Every check of tw__gemm_launch has been made above in GEMM1's
   * terms. */
  tw_gemm_args g;
  memset(&g, 0, sizeof g);
  g.a = args->a;
  g.b = args->w13;
  g.c = args->h;
  g.rows = args->rows;
  g.k = args->hidden;
  g.n = args->ffn;
  g.experts = args->experts;
  g.tiles = args->tiles;
  g.num_tiles = args->num_tiles;
  g.live_tiles = args->live_tiles;
  g.tm = args->tm;
  g.tn = TW_GEMM1_TN;
  g.grid = args->grid;
  g.scope = TW_SIGNAL_NONE;
  g.epilogue = TW_EPILOGUE_SWIGLU;
  g.variant = args->variant;
  g.trace = args->trace;
  if (args->band_arrived != NULL && args->err == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "%s: band_arrived without an error record", who);
  g.levers = args->levers;
  g.band_arrived = args->band_arrived;
  g.err = args->err;
  g.timeout_ns = args->timeout_ns;
  g.rank = args->rank;
  return tw__gemm_launch(&g, stream);
}

extern "C" tw_status tw__gemm_f32_launch(const tw_gemm_args* args, cudaStream_t stream) {
  static const char* who = "tw__gemm_f32_launch";
  TW_CHECK_NULL(args);
  if (args->num_tiles < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "%s: num_tiles = %d; must be >= 0", who, args->num_tiles);
  if (args->num_tiles == 0) return TW_SUCCESS;
  TW_CHECK_NULL(args->a);
  TW_CHECK_NULL(args->b);
  TW_CHECK_NULL(args->c);
  TW_CHECK_NULL(args->tiles);
  if (args->rows <= 0 || args->k <= 0 || args->n <= 0 || args->experts <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "%s: rows = %d, k = %d, n = %d, experts = %d; all must be > 0", who, args->rows,
                    args->k, args->n, args->experts);
  if (args->k % 64 != 0 || args->n % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "%s: k = %d, n = %d; k must be a multiple of 64, n of 8", who,
                    args->k, args->n);
  if (args->tm != 128 || args->tn != 256)
    return tw__fail(TW_ERR_UNSUPPORTED, "%s: tile %d x %d; only 128 x 256", who, args->tm,
                    args->tn);
  if (args->epilogue != TW_EPILOGUE_STORE || args->scope != TW_SIGNAL_NONE ||
      args->add_out != NULL || args->row_weight != NULL || args->zero != NULL)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "%s: plain stores only (no SwiGLU, signals, add dataflow or zeroing)", who);
  if (args->grid < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: grid = %d; pass 0 (all SMs) or a positive CTA count", who, args->grid);
  if (((uintptr_t)args->a | (uintptr_t)args->b | (uintptr_t)args->c) % 16 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "%s: a, b and c must be 16-byte aligned", who);
  int grid = 0;
  TW_TRY(tw__resolve_grid(who, args->grid, args->num_tiles, &grid));
  /* 4 stages, as kEpiDirect's 128 x 256 kernel (no staging tile). */
  return tw__launch_v2<128, 256, 4, false, kEpiF32>(args, grid, stream);
}
