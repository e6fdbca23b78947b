/*
 * idle_warps.cu: how fast can a few SMs' spare warps do the owner's weighted reduction?
 *
 * The streaming-reduction design (dev/NOTES.md section 12) would reduce tokens on the consumer
 * CTAs' idle warps while the producer runs: C (7-8 on the grid) SMs, warp 0 of each busy sending,
 * warps 1-15 free, no shared memory to spare (the bulk ring holds 192 KB). This lab measures the
 * data part alone on such a grid: `ctas` CTAs of 512 threads, one per SM (forced by a dynamic
 * shared-memory request), warp 0 idle, warps 1-15 doing out[t] = sum_j w[t][j] row(slot[t k + j])
 * with the integrated kernel's arithmetic (src/kernels/reduce.cu: fp32 fmaf in slot order) and
 * `u` (token, vector) items per thread per step, so u x k 16-byte loads in flight per thread.
 * No sender runs beside it: an upper bound for the design.
 *
 * Build: part of the CMake build (target idle_warps), or
 *   nvcc -O3 -arch=sm_90a -std=c++17 dev/reduce/idle_warps.cu -o idle_warps
 * Run:   ./idle_warps     prints a markdown table: GB/s moved (k rows read + 1 written per token)
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lab_common.cuh"

constexpr int kThreads = 512;
constexpr int kK = 2;             /* top-k of the grid */
constexpr int kFreeThreads = 480; /* warps 1..15 */

/* Items (token, vector) i = base + j * stride for j < U per step; all U x k row loads first. */
template <int U>
__global__ void __launch_bounds__(kThreads, 1)
    reduce_idle(const char* rows, const int* slot, const float* wt, __nv_bfloat16* out, int tokens,
                int hidden) {
  if (threadIdx.x < 32) return; /* the sender's warp: idle here */
  const int vpr = hidden / 8;
  const long long items = (long long)tokens * vpr;
  const long long stride = (long long)gridDim.x * kFreeThreads;
  const size_t row_bytes = (size_t)hidden * 2;
  for (long long base = (long long)blockIdx.x * kFreeThreads + (threadIdx.x - 32); base < items;
       base += stride * U) {
    int4 x[U][kK];
    float w[U][kK];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const long long it = base + u * stride;
      const int t = it < items ? (int)(it / vpr) : 0,
                q = it < items ? (int)(it - (long long)t * vpr) : 0;
#pragma unroll
      for (int j = 0; j < kK; j++) {
        const int r = __ldg(&slot[t * kK + j]);
        w[u][j] = __ldg(&wt[t * kK + j]);
        x[u][j] = it < items
                      ? __ldcg(reinterpret_cast<const int4*>(rows + (size_t)r * row_bytes) + q)
                      : make_int4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const long long it = base + u * stride;
      if (it >= items) continue;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < kK; j++) tw__acc_bf16x8(acc, x[u][j], w[u][j]);
      __align__(16) __nv_bfloat162 o[4];
#pragma unroll
      for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      reinterpret_cast<int4*>(out)[it] = *reinterpret_cast<int4*>(o);
    }
  }
}

template <int U>
float time_one(int ctas, const char* rows, const int* slot, const float* wt, __nv_bfloat16* out,
               int tokens, int hidden, char* flush, size_t flush_bytes, cudaEvent_t a,
               cudaEvent_t b) {
  constexpr int kPadSmem = 120 * 1024;
  CK(cudaFuncSetAttribute(reduce_idle<U>, cudaFuncAttributeMaxDynamicSharedMemorySize, kPadSmem));
  std::vector<float> ms;
  for (int rep = 0; rep < 23; rep++) {
    CK(cudaMemsetAsync(flush, rep & 0xff, flush_bytes)); /* cold L2, as the producer leaves it */
    CK(cudaEventRecord(a));
    /* The dynamic shared memory is never touched: it only keeps one CTA per SM. */
    reduce_idle<U><<<ctas, kThreads, kPadSmem>>>(rows, slot, wt, out, tokens, hidden);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float m = 0;
    CK(cudaEventElapsedTime(&m, a, b));
    if (rep >= 3) ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  const int shapes[][2] = {{8192, 4096}, {8192, 8192}};
  printf("| tokens | hidden | CTAs (SMs) | items per thread | us | GB/s | GB/s per SM |\n");
  printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (auto& sh : shapes) {
    const int tokens = sh[0], hidden = sh[1];
    const size_t nrows = (size_t)tokens * kK, row_bytes = (size_t)hidden * 2;
    char* rows;
    int* slot;
    float* wt;
    __nv_bfloat16* out;
    char* flush;
    const size_t flush_bytes = 256u << 20;
    CK(cudaMalloc(&rows, nrows * row_bytes));
    CK(cudaMalloc(&slot, nrows * 4));
    CK(cudaMalloc(&wt, nrows * 4));
    CK(cudaMalloc(&out, (size_t)tokens * row_bytes));
    CK(cudaMalloc(&flush, flush_bytes));
    CK(cudaMemset(rows, 0x3c, nrows * row_bytes));
    std::vector<int> hs(nrows);
    std::vector<float> hw(nrows, 0.5f);
    for (size_t i = 0; i < nrows; i++) hs[i] = (int)i;
    srand(1);
    for (size_t i = nrows - 1; i > 0; i--) std::swap(hs[i], hs[(size_t)rand() % (i + 1)]);
    CK(cudaMemcpy(slot, hs.data(), nrows * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(wt, hw.data(), nrows * 4, cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const double bytes = (double)tokens * (kK + 1) * row_bytes;
    for (int ctas : {4, 8, 16, 32, 132}) {
      for (int u : {1, 2, 4}) {
        const float ms =
            u == 1
                ? time_one<1>(ctas, rows, slot, wt, out, tokens, hidden, flush, flush_bytes, a, b)
            : u == 2
                ? time_one<2>(ctas, rows, slot, wt, out, tokens, hidden, flush, flush_bytes, a, b)
                : time_one<4>(ctas, rows, slot, wt, out, tokens, hidden, flush, flush_bytes, a, b);
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        printf("| %d | %d | %d | %d | %.1f | %.0f | %.1f |\n", tokens, hidden, ctas, u, ms * 1e3,
               gbs, gbs / ctas);
      }
    }
    CK(cudaFree(rows));
    CK(cudaFree(slot));
    CK(cudaFree(wt));
    CK(cudaFree(out));
    CK(cudaFree(flush));
  }
  return 0;
}
