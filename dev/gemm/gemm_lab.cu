/*
 * gemm_lab.cu: kernel lab for the producer GEMM (llm.c dev/cuda style), a program of its own:
 *
 *   part of the CMake build (target gemm_lab: this file, the `tilewave` commands' library for
 *   `bench gemm`, and libtilewave.a; docs/build.md)
 *   build/gemm_lab <version> [bench options]     (version: 1 = WMMA, 2..4 = TMA + wgmma)
 *
 * The numbered versions live in src/kernels/sm90_gemm.cu behind tw_gemm_args.variant, so the
 * lab always measures exactly the code the library ships. For the chosen version the lab first
 * checks a small grouped problem (uneven experts, an empty expert, a partial last band, N not a
 * multiple of the tile) element by element against a double-precision CPU reference, then runs
 * the benchmark of tools/bench_gemm.cu (ours vs cuBLAS) with that version. NOTES.md records each
 * version's prediction and measurements.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cli.h"
#include "kernels.h"

static float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Small grouped problem against the CPU; returns the number of wrong elements. */
static long long check_small(int variant, int tm, int tn) {
  const int k = 256, n = 392, experts = 4;
  const int m[experts] = {200, 0, 129, 61};
  int row0[experts], rows = 0;
  std::vector<tw_tile> tiles;
  int bands = 0;
  const int col_tiles = (n + tn - 1) / tn;
  for (int e = 0; e < experts; e++) {
    row0[e] = rows;
    for (int i = 0; i < m[e]; i += tm, bands++)
      for (int c = 0; c < col_tiles; c++) {
        tw_tile t;
        memset(&t, 0, sizeof t);
        t.row0 = rows + i;
        t.rows = m[e] - i < tm ? m[e] - i : tm;
        t.expert = e;
        t.col0 = c * tn;
        t.band = bands;
        tiles.push_back(t);
      }
    rows += m[e];
  }
  std::vector<uint16_t> a((size_t)rows * k), b((size_t)experts * n * k), c((size_t)rows * n);
  uint32_t x = 12345;
  auto rnd = [&]() {
    x = x * 1664525u + 1013904223u;
    return (float)(x >> 8) / 8388608.0f - 1.0f;
  };
  for (auto& v : a) v = f2bf(rnd());
  for (auto& v : b) v = f2bf(rnd());
  void *da, *db, *dc, *dt;
  uint32_t* cnt;
  cudaMalloc(&da, a.size() * 2);
  cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dc, c.size() * 2);
  cudaMalloc(&dt, tiles.size() * sizeof(tw_tile));
  cudaMalloc(&cnt, bands * 4);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dt, tiles.data(), tiles.size() * sizeof(tw_tile), cudaMemcpyHostToDevice);
  cudaMemset(cnt, 0, bands * 4);
  tw__fill_bf16(dc, c.size(), 0xFFFF, 0);
  tw_gemm_args g;
  memset(&g, 0, sizeof g);
  g.a = da;
  g.b = db;
  g.c = dc;
  g.rows = rows;
  g.k = k;
  g.n = n;
  g.experts = experts;
  g.tiles = (const tw_tile*)dt;
  g.num_tiles = (int)tiles.size();
  g.tm = tm;
  g.tn = tn;
  g.grid = 6;
  g.scope = TW_SIGNAL_GPU;
  g.band_counters = cnt;
  g.variant = variant;
  long long bad = 0;
  if (tw__gemm_launch(&g, 0) != TW_SUCCESS || cudaDeviceSynchronize() != cudaSuccess) {
    fprintf(stderr, "launch failed: %s / %s\n", tw_last_error(),
            cudaGetErrorString(cudaGetLastError()));
    return -1;
  }
  cudaMemcpy(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost);
  for (int e = 0; e < experts; e++)
    for (int i = 0; i < m[e]; i++)
      for (int j = 0; j < n; j++) {
        double ref = 0;
        for (int kk = 0; kk < k; kk++)
          ref += (double)bf2f(a[(size_t)(row0[e] + i) * k + kk]) *
                 bf2f(b[((size_t)e * n + j) * k + kk]);
        const double got = bf2f(c[(size_t)(row0[e] + i) * n + j]);
        if (!(fabs(got - ref) <= fabs(ref) / 256 + 1e-2)) bad++;
      }
  std::vector<uint32_t> hc(bands);
  cudaMemcpy(hc.data(), cnt, bands * 4, cudaMemcpyDeviceToHost);
  for (int i = 0; i < bands; i++) bad += hc[i] != (uint32_t)col_tiles;
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cudaFree(dt);
  cudaFree(cnt);
  return bad;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: gemm_lab <version> [bench gemm options]\n");
    return 2;
  }
  const int variant = atoi(argv[1]);
  int fails = 0;
  for (int tm : {64, 128})
    for (int tn : {128, 256}) {
      long long bad = check_small(variant, tm, tn);
      printf("version %d tm %d tn %d: CPU check %s (%lld wrong)\n", variant, tm, tn,
             bad == 0 ? "ok" : "FAILED", bad);
      fails += bad != 0;
    }
  /* Hand the rest to the benchmark with this version. */
  std::vector<char*> args;
  static char name[] = "gemm", vflag[] = "--variant";
  args.push_back(name);
  args.push_back(vflag);
  args.push_back(argv[1]);
  for (int i = 2; i < argc; i++) args.push_back(argv[i]);
  const int rc = tw_cli_bench_gemm((int)args.size(), args.data());
  return fails ? 1 : rc;
}
