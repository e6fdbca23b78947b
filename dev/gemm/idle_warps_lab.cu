/*
 * idle_warps_lab.cu: can the producer's idle warps read memory while the GEMM runs? (lab v11,
 * dev/gemm/NOTES.md). Warps 2-3 of the wgmma kernels' producer warpgroup (64 threads per CTA, 40
 * registers each) do nothing today. With dev/gemm/v11_idle_warps.patch applied they read a share
 * of a buffer (tw_gemm_args.lab_*) during the GEMM. This lab times, on one GPU, the producer on two
 * grid shapes with 0 to 1024 MiB read that way, and the same reads alone (a kernel of the same
 * CTA count and 64 threads per CTA): the question is how much of the owner's reduction (805 MB at
 * 16384 tokens, N 8192) such warps could move inside the GEMM's time, and at what cost to it.
 * The patch no longer applies to the current tree: dev/gemm/PATCHES.md names the commit to check
 * out and how to recover it; then, in that tree:
 *
 *   git apply v11_idle_warps.patch
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Iinclude -Isrc/core -Isrc/plan \
 *     -Isrc/kernels dev/gemm/idle_warps_lab.cu src/kernels/sm90_gemm.cu src/core/status.c \
 *     -o idle_warps_lab && ./idle_warps_lab
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "../reduce/lab_common.cuh" /* CK */
#include "kernels.h"
#include "tilewave.h"

__global__ void fill_random(uint32_t* p, size_t n, uint32_t seed, uint32_t mask) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    p[i] = x & mask; /* mask keeps bf16 pairs small and finite */
  }
}

/* The same reads alone: gridDim.x CTAs of 64 threads, the kernel's loop. */
__global__ void read_alone(const uint4* p, int64_t n, uint32_t* sink) {
  const int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = (int64_t)blockIdx.x * per, hi = min(n, lo + per);
  uint32_t x = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += 4 * 64) {
    uint4 r[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int64_t q = i + (int64_t)j * 64;
      r[j] = q < hi ? __ldcg(p + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; j++) x ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  if (x == 0x9E3779B9u) *sink = x;
}

struct Shape {
  int rows, k, n, experts;
};

int main() {
  const int grid = 125; /* 132 SMs less the 7 consumer CTAs the model picks at these points */
  const int tm = 128, tn = 256, reps = 9;
  const Shape shapes[2] = {{32768, 2048, 8192, 4}, {16384, 2048, 4096, 16}};
  const int64_t mib[5] = {0, 128, 256, 512, 1024};
  const size_t read_bytes = (size_t)1024 << 20;
  uint4* rbuf = nullptr;
  uint32_t* sink = nullptr;
  CK(cudaMalloc(&rbuf, read_bytes));
  CK(cudaMalloc(&sink, 4));
  fill_random<<<1024, 256>>>((uint32_t*)rbuf, read_bytes / 4, 99u, 0xFFFFFFFFu);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# idle warps lab: %s, grid %d, tile %dx%d, variant 0, medians of %d reps, rotated\n\n",
         prop.name, grid, tm, tn, reps);
  printf("| rows | K | N | E | MiB read | GEMM us | vs 0 MiB | reads alone us | alone GB/s | MiB / GEMM us as GB/s |\n");
  printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Shape& s : shapes) {
    void *a, *b, *c;
    uint32_t* counters;
    CK(cudaMalloc(&a, (size_t)s.rows * s.k * 2));
    CK(cudaMalloc(&b, (size_t)s.experts * s.n * s.k * 2));
    CK(cudaMalloc(&c, (size_t)s.rows * s.n * 2));
    fill_random<<<1024, 256>>>((uint32_t*)a, (size_t)s.rows * s.k / 2, 1u, 0x3F3F3F3Fu);
    fill_random<<<1024, 256>>>((uint32_t*)b, (size_t)s.experts * s.n * s.k / 2, 2u, 0x3C3F3C3Fu);
    /* Expert-major tiles, every band's column tiles in order; equal experts. */
    std::vector<tw_tile> tiles;
    const int m = s.rows / s.experts, bands_per = m / tm, ct = s.n / tn;
    for (int e = 0, band = 0; e < s.experts; e++)
      for (int i = 0; i < bands_per; i++, band++)
        for (int j = 0; j < ct; j++) {
          tw_tile t;
          memset(&t, 0, sizeof t);
          t.row0 = e * m + i * tm, t.rows = tm, t.expert = e, t.col0 = j * tn, t.band = band;
          tiles.push_back(t);
        }
    tw_tile* dtiles;
    CK(cudaMalloc(&dtiles, tiles.size() * sizeof(tw_tile)));
    CK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * sizeof(tw_tile), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&counters, 4 * (size_t)s.rows / tm));
    CK(cudaMemset(counters, 0, 4 * (size_t)s.rows / tm));
    tw_gemm_args g;
    memset(&g, 0, sizeof g);
    g.a = a, g.b = b, g.c = c, g.rows = s.rows, g.k = s.k, g.n = s.n, g.experts = s.experts;
    g.tiles = dtiles, g.num_tiles = (int)tiles.size(), g.tm = tm, g.tn = tn, g.grid = grid;
    g.scope = TW_SIGNAL_GPU, g.band_counters = counters, g.epilogue = TW_EPILOGUE_STORE;
    g.lab_sink = sink;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> gemm[5], alone[5];
    for (int rep = 0; rep < reps + 2; rep++)
      for (int q = 0; q < 5; q++) {
        const int i = (q + rep) % 5; /* rotated: each size in every position */
        const int64_t vec = mib[i] * (1 << 20) / 16;
        tw_gemm_args x = g;
        x.lab_read = vec > 0 ? rbuf : nullptr;
        x.lab_vectors = vec;
        float ms = 0;
        CK(cudaEventRecord(e0));
        if (tw__gemm_launch(&x, 0) != TW_SUCCESS) {
          fprintf(stderr, "launch: %s\n", tw_last_error());
          return 1;
        }
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 2) gemm[i].push_back(1000 * ms);
        if (vec > 0) {
          CK(cudaEventRecord(e0));
          read_alone<<<grid, 64>>>(rbuf, vec, sink);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (rep >= 2) alone[i].push_back(1000 * ms);
        }
      }
    CK(cudaGetLastError());
    /* The output with the reads on must equal the output without (bitwise). */
    const size_t cbytes = (size_t)s.rows * s.n * 2;
    std::vector<uint8_t> c0(cbytes), c1(cbytes);
    {
      tw_gemm_args x = g;
      if (tw__gemm_launch(&x, 0) != TW_SUCCESS) return 1;
      CK(cudaMemcpy(c0.data(), c, cbytes, cudaMemcpyDeviceToHost));
      CK(cudaMemset(c, 0xFF, cbytes));
      x.lab_read = rbuf, x.lab_vectors = (int64_t)read_bytes / 16;
      if (tw__gemm_launch(&x, 0) != TW_SUCCESS) return 1;
      CK(cudaMemcpy(c1.data(), c, cbytes, cudaMemcpyDeviceToHost));
    }
    const bool same = memcmp(c0.data(), c1.data(), cbytes) == 0;
    auto med = [](std::vector<float> v) {
      if (v.empty()) return 0.f;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const float g0 = med(gemm[0]);
    for (int i = 0; i < 5; i++) {
      const float gu = med(gemm[i]), au = med(alone[i]);
      const double bytes = (double)mib[i] * (1 << 20);
      printf("| %d | %d | %d | %d | %lld | %.1f | %+.1f%% | %.1f | %.0f | %.0f |\n", s.rows, s.k, s.n,
             s.experts, (long long)mib[i], gu, 100.0 * (gu / g0 - 1), au,
             au > 0 ? bytes / au * 1e-3 : 0.0, gu > 0 ? bytes / gu * 1e-3 : 0.0);
    }
    printf("| output with 1024 MiB read %s the output without |\n", same ? "equals" : "DIFFERS FROM");
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(dtiles), cudaFree(counters);
  }
  return 0;
}
