/*
 * test_gemm.cu: correctness of the producer GEMM (tw__gemm_launch).
 *
 * Every run poisons the output with a NaN pattern first and then checks EVERY element: rows that
 * tiles cover (and columns < n) against a reference, every other row (gaps between experts, rows
 * past a tile's `rows`) must still hold the poison. References: a double-precision CPU GEMM on
 * small shapes, cuBLAS (fp32 output) per expert on large ones. Inputs are fresh seeded random
 * bf16 values. Band counters are checked to read exactly epoch x col_tiles after each epoch.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "tw_test_gpu.h"
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "tw_test_random.h"

namespace {

const uint16_t kPoison = 0xFFFF; /* a NaN in bf16 */

uint64_t g_rng = 0x9E3779B97F4A7C15ull;
uint64_t next_u64() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
float uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((next_u64() >> 40) * (1.0 / 16777216.0));
}

uint16_t f2bf(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A grouped problem: expert e's M_e rows start at row0[e] of the layout; rows between experts
 * (gap rows) belong to nobody and must never be written. */
struct Problem {
  int experts = 0, k = 0, n = 0, tm = 128, tn = 128, rows = 0;
  bool swiglu = false;
  std::vector<int> m, row0;
  std::vector<tw_tile> tiles;
  int num_bands = 0, col_tiles = 0;
  std::vector<uint16_t> a, b; /* (rows, k), (experts, n_b, k) */
};

/* Lays experts out with `gap` extra rows after each one (gap 0: back to back, so a partial last
 * band is followed directly by the next expert's rows) and builds the tile list. group 0: bands
 * in a shuffled order (as the remote-first schedule reorders them), all column tiles of a band
 * together; group g > 0: bands in layout order, in groups of up to g bands of one expert taken
 * column by column (the planner's tile groups, without their alternating direction). */
void build(Problem& p, const std::vector<int>& m, int k, int n, int tm, int tn, int gap,
           bool swiglu, int group = 0) {
  p.experts = (int)m.size();
  p.k = k;
  p.n = n;
  p.tm = tm;
  p.tn = tn;
  p.swiglu = swiglu;
  p.m = m;
  p.row0.assign(p.experts, 0);
  int r = 0;
  for (int e = 0; e < p.experts; e++) {
    p.row0[e] = r;
    r += m[e] + gap;
  }
  p.rows = r > 0 ? r : 1;
  p.col_tiles = (n + tn - 1) / tn;
  struct Band {
    int e, row0, rows;
  };
  std::vector<Band> bands;
  for (int e = 0; e < p.experts; e++)
    for (int i = 0; i < m[e]; i += tm)
      bands.push_back({e, p.row0[e] + i, m[e] - i < tm ? m[e] - i : tm});
  for (size_t i = bands.size(); i > 1 && group == 0; i--) {
    size_t j = next_u64() % i;
    Band t = bands[i - 1];
    bands[i - 1] = bands[j];
    bands[j] = t;
  }
  p.num_bands = (int)bands.size();
  p.tiles.clear();
  for (int b0 = 0, g = 1; b0 < p.num_bands; b0 += g) {
    g = 1;
    while (g < group && b0 + g < p.num_bands && bands[b0 + g].e == bands[b0].e) g++;
    for (int c = 0; c < p.col_tiles; c++)
      for (int bi = b0; bi < b0 + g; bi++) {
        tw_tile t;
        memset(&t, 0, sizeof t);
        t.row0 = bands[bi].row0;
        t.rows = bands[bi].rows;
        t.expert = bands[bi].e;
        t.col0 = c * tn;
        t.band = bi;
        p.tiles.push_back(t);
      }
  }
  const int64_t n_b = swiglu ? 2 * (int64_t)n : n;
  p.a.resize((size_t)p.rows * k);
  p.b.resize((size_t)p.experts * n_b * k);
  for (auto& v : p.a) v = f2bf(uniform(-1.f, 1.f));
  for (auto& v : p.b) v = f2bf(uniform(-1.f, 1.f));
}

struct Device {
  void *a = nullptr, *b = nullptr, *c = nullptr;
  tw_tile* tiles = nullptr;
  uint32_t* counters = nullptr;
  float* ref = nullptr;
  ~Device() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(tiles);
    cudaFree(counters);
    cudaFree(ref);
  }
};

bool upload(const Problem& p, Device& d) {
  const size_t c_elems = (size_t)p.rows * p.n;
  bool ok = cudaMalloc(&d.a, p.a.size() * 2) == cudaSuccess &&
            cudaMalloc(&d.b, p.b.size() * 2) == cudaSuccess &&
            cudaMalloc(&d.c, c_elems * 2) == cudaSuccess &&
            cudaMalloc(&d.tiles, (p.tiles.size() + 1) * sizeof(tw_tile)) == cudaSuccess &&
            cudaMalloc(&d.counters, ((size_t)p.num_bands + 1) * 4) == cudaSuccess;
  CHECK(ok);
  if (!ok) return false;
  CHECK_CUDA(cudaMemcpy(d.a, p.a.data(), p.a.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.b, p.b.data(), p.b.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.tiles, p.tiles.data(), p.tiles.size() * sizeof(tw_tile),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d.counters, 0, ((size_t)p.num_bands + 1) * 4));
  return true;
}

tw_gemm_args make_args(const Problem& p, const Device& d, int grid, tw_signal_scope scope,
                       int variant = 0) {
  tw_gemm_args g;
  const tw_gemm_shape sh = {p.rows, p.k, p.n, p.experts, p.tm, p.tn};
  if (tw__gemm_args_init(&g, &sh, d.a, d.b, d.c, d.tiles, (int)p.tiles.size(), grid, scope,
                         scope == TW_SIGNAL_NONE ? nullptr : d.counters) != TW_SUCCESS)
    fprintf(stderr, "make_args: %s\n", tw_last_error()); /* the launch then fails on it */
  g.epilogue = p.swiglu ? TW_EPILOGUE_SWIGLU : TW_EPILOGUE_STORE;
  g.variant = variant;
  return g;
}

/* Reference in double on the CPU: ref[(row, col)] for covered rows. */
void cpu_reference(const Problem& p, std::vector<double>& ref) {
  ref.assign((size_t)p.rows * p.n, 0.0);
  const int64_t n_b = p.swiglu ? 2 * (int64_t)p.n : p.n;
  std::vector<double> arow(p.k);
  for (int e = 0; e < p.experts; e++)
    for (int i = 0; i < p.m[e]; i++) {
      const int64_t r = p.row0[e] + i;
      for (int kk = 0; kk < p.k; kk++) arow[kk] = bf2f(p.a[r * p.k + kk]);
      for (int c = 0; c < p.n; c++) {
        const uint16_t* bg = &p.b[((int64_t)e * n_b + c) * p.k];
        double g = 0;
        for (int kk = 0; kk < p.k; kk++) g += arow[kk] * bf2f(bg[kk]);
        if (p.swiglu) {
          const uint16_t* bu = &p.b[((int64_t)e * n_b + p.n + c) * p.k];
          double u = 0;
          for (int kk = 0; kk < p.k; kk++) u += arow[kk] * bf2f(bu[kk]);
          g = g / (1.0 + exp(-g)) * u;
        }
        ref[r * p.n + c] = g;
      }
    }
}

/* cuBLAS per expert (fp32 output): ref (rows, n) on the device. */
bool cublas_reference(const Problem& p, Device& d, std::vector<float>& ref) {
  const size_t elems = (size_t)p.rows * p.n;
  if (cudaMalloc(&d.ref, elems * 4) != cudaSuccess) {
    CHECK(!"cudaMalloc ref");
    return false;
  }
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    CHECK(!"cublasCreate");
    return false;
  }
  const float one = 1.f, zero = 0.f;
  for (int e = 0; e < p.experts; e++) {
    if (p.m[e] == 0) continue;
    /* Row-major C_e (M_e, n) = A_e B_e^T is column-major C_e^T (n, M_e) = B_e A_e^T. */
    cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m[e], p.k, &one,
                                    (const uint16_t*)d.b + (size_t)e * p.n * p.k, CUDA_R_16BF, p.k,
                                    (const uint16_t*)d.a + (size_t)p.row0[e] * p.k, CUDA_R_16BF,
                                    p.k, &zero, d.ref + (size_t)p.row0[e] * p.n, CUDA_R_32F, p.n,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CHECK(s == CUBLAS_STATUS_SUCCESS);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  cublasDestroy(h);
  ref.resize(elems);
  CHECK_CUDA(cudaMemcpy(ref.data(), d.ref, elems * 4, cudaMemcpyDeviceToHost));
  return true;
}

/* Checks every element of the output; returns the number of mismatches. Covered elements must
 * be within bf16 rounding (2^-8 relative) plus a small absolute term scaled by sqrt(k) for fp32
 * accumulation-order differences; uncovered rows must hold the poison. */
template <typename RefT>
int64_t check_output(const Problem& p, const std::vector<uint16_t>& out, const RefT* ref,
                     const char* what) {
  std::vector<char> covered(p.rows, 0);
  for (int e = 0; e < p.experts; e++)
    for (int i = 0; i < p.m[e]; i++) covered[p.row0[e] + i] = 1;
  const double abs_tol = 1e-3 * sqrt((double)p.k) * (p.swiglu ? sqrt((double)p.k) : 1.0);
  int64_t bad = 0;
  for (int64_t r = 0; r < p.rows; r++)
    for (int c = 0; c < p.n; c++) {
      const uint16_t h = out[r * p.n + c];
      bool ok;
      double want = 0;
      if (covered[r]) {
        want = (double)ref[r * p.n + c];
        const double got = bf2f(h);
        ok = fabs(got - want) <= fabs(want) * (1.0 / 256) + abs_tol;
      } else {
        ok = h == kPoison;
      }
      if (!ok) {
        if (bad < 5)
          fprintf(stderr, "  %s: C[%lld][%d] = %g (0x%04x), want %s%g\n", what, (long long)r, c,
                  bf2f(h), h, covered[r] ? "" : "poison, not ", want);
        bad++;
      }
    }
  return bad;
}

/* Kernel versions every shape runs through: the simple one and the TMA + wgmma ones (the
 * default, variant 0, is one of them). */
const int kVariants[] = {1, 2, 3, 4, 5};

/* Runs each kernel version `epochs` times with poisoned output before each run, checks the
 * output and the counters after each. */
template <typename RefT>
void run_and_check(const Problem& p, Device& d, const RefT* ref, int grid, tw_signal_scope scope,
                   int epochs) {
  const size_t elems = (size_t)p.rows * p.n;
  std::vector<uint16_t> out(elems);
  std::vector<uint32_t> cnt(p.num_bands + 1);
  for (int variant : kVariants) {
    char what[192];
    snprintf(what, sizeof what, "v%d E=%d rows=%d k=%d n=%d tm=%d tn=%d grid=%d scope=%d%s",
             variant, p.experts, p.rows, p.k, p.n, p.tm, p.tn, grid, (int)scope,
             p.swiglu ? " swiglu" : "");
    CHECK_CUDA(cudaMemset(d.counters, 0, ((size_t)p.num_bands + 1) * 4));
    for (int ep = 1; ep <= epochs; ep++) {
      CHECK_OK(tw__fill_bf16(d.c, elems, kPoison, 0));
      tw_gemm_args g = make_args(p, d, grid, scope, variant);
      CHECK_OK(tw__gemm_launch(&g, 0));
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemcpy(out.data(), d.c, elems * 2, cudaMemcpyDeviceToHost));
      const int64_t bad = check_output(p, out, ref, what);
      CHECKF(bad == 0, "%s epoch %d: %lld wrong elements", what, ep, (long long)bad);
      CHECK_CUDA(cudaMemcpy(cnt.data(), d.counters, cnt.size() * 4, cudaMemcpyDeviceToHost));
      const uint32_t want = scope == TW_SIGNAL_NONE ? 0u : (uint32_t)(ep * p.col_tiles);
      int wrong = 0;
      for (int b = 0; b < p.num_bands; b++) wrong += cnt[b] != want;
      CHECKF(wrong == 0, "%s epoch %d: %d band counters != %u", what, ep, wrong, want);
      CHECKF(cnt[p.num_bands] == 0, "%s: counter past the last band written", what);
    }
    printf("  checked %s: %lld elements x %d epochs\n", what, (long long)elems, epochs);
  }
}

std::vector<int> random_m(int experts, int lo, int hi) {
  std::vector<int> m(experts);
  for (auto& v : m) v = lo + (int)(next_u64() % (uint64_t)(hi - lo + 1));
  return m;
}

/* ---- small shapes against the double CPU reference ---------------------------------------- */

void small_shape(const std::vector<int>& m, int k, int n, int tm, int tn, int gap, bool swiglu,
                 const std::vector<int>& grids, int group = 0) {
  Problem p;
  build(p, m, k, n, tm, tn, gap, swiglu, group);
  Device d;
  if (!upload(p, d)) return;
  std::vector<double> ref;
  cpu_reference(p, ref);
  for (size_t i = 0; i < grids.size(); i++)
    run_and_check(p, d, ref.data(), grids[i], i % 2 ? TW_SIGNAL_SYS : TW_SIGNAL_GPU, 2);
}

void test_small_tm128(void) {
  g_rng = 0x1234567ull;
  /* Zero-row experts, partial last bands, 1-row experts, back to back (gap 0). */
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) { /* two shapes: enough for the sanitizers */
    small_shape({300, 0, 129, 1, 77}, 256, 768, 128, 256, 0, false, {6});
    small_shape({300, 0, 129, 1, 77}, 256, 768, 128, 256, 0, false, {6}, 2);
    return;
  }
  small_shape({300, 0, 129, 1, 128, 77}, 512, 1024, 128, 128, 0, false, {1, 7, 0, 6});
  /* Odd column-tile count (5) with even grids: neighbouring CTAs' tiles of a round sometimes
   * share a band and sometimes not, and the last round has a lone tile. */
  small_shape({250, 3, 131}, 512, 640, 128, 128, 0, false, {6, 2, 0});
  small_shape({300, 0, 129, 1, 128, 77}, 512, 1024, 128, 256, 3, false, {7, 132});
  /* Tile groups (the planner's order): groups of 2, 3 (with an odd column-tile count) and 8. */
  small_shape({300, 0, 129, 1, 128, 77}, 512, 1024, 128, 256, 0, false, {6, 2, 0, 7}, 2);
  small_shape({700, 3, 260}, 512, 640, 128, 128, 0, false, {6, 4, 0}, 3);
  small_shape({520, 129, 400}, 512, 1024, 128, 128, 2, false, {8, 1}, 8);
  /* N not a multiple of tn: the last column tile reads the next expert's B rows. */
  small_shape({200, 150, 64}, 576, 1000, 128, 256, 0, false, {1, 124});
  small_shape({200, 150, 64}, 576, 1000, 128, 128, 5, false, {3});
}

void test_small_tm64(void) {
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK");
  g_rng = 0x7654321ull;
  small_shape({65, 0, 200, 64, 3}, 512, 1024, 64, 128, 0, false, {1, 0});
  small_shape({65, 0, 200, 64, 3}, 512, 1000, 64, 256, 2, false, {7});
  small_shape({300, 0, 200, 64, 3}, 512, 1024, 64, 256, 0, false, {6, 0}, 4);
}

void test_small_swiglu(void) {
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK");
  g_rng = 0xABCDEFull;
  small_shape({130, 0, 77}, 512, 512, 128, 128, 0, true, {1, 0, 4});
  small_shape({130, 0, 77}, 512, 520, 128, 128, 4, true, {5});
  small_shape({400, 0, 77}, 512, 512, 128, 128, 0, true, {4, 0}, 2);
}

/* ---- large shapes against cuBLAS per expert ------------------------------------------------ */

void large_shape(const std::vector<int>& m, int k, int n, int tn, const std::vector<int>& grids,
                 int group = 0) {
  Problem p;
  build(p, m, k, n, 128, tn, 0, false, group);
  Device d;
  if (!upload(p, d)) return;
  std::vector<float> ref;
  if (!cublas_reference(p, d, ref)) return;
  for (size_t i = 0; i < grids.size(); i++)
    run_and_check(p, d, ref.data(), grids[i], i % 2 ? TW_SIGNAL_GPU : TW_SIGNAL_SYS, 2);
}

void test_large(void) {
  /* TW_GEMM_TEST_QUICK=1 (used under compute-sanitizer, which is ~100x slower) skips these. */
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK: large shapes");
  g_rng = 0x5151ull;
  large_shape(random_m(8, 0, 1000), 2048, 4096, 256, {0, 124});
  large_shape(random_m(4, 300, 2000), 4096, 8192, 256, {132});
  large_shape(random_m(30, 0, 300), 1408, 2048, 128, {0, 7});
  large_shape(random_m(64, 0, 150), 512, 7168, 256, {0});
  large_shape(random_m(16, 100, 400), 2048, 1024, 128, {124});
  large_shape(random_m(1, 3000, 3000), 2048, 4096, 256, {0});
  large_shape(random_m(8, 0, 2000), 2048, 8192, 256, {0, 124}, 8);
  large_shape(random_m(30, 0, 300), 1408, 2048, 128, {0}, 8);
}

void test_no_signal(void) {
  g_rng = 0x77ull;
  Problem p;
  build(p, {100, 300}, 512, 1024, 128, 256, 1, false);
  Device d;
  if (!upload(p, d)) return;
  std::vector<double> ref;
  cpu_reference(p, ref);
  run_and_check(p, d, ref.data(), 0, TW_SIGNAL_NONE, 1);
}

/* ---- the planner's remote-owner-aligned layout and remote-first schedule ------------------ */

/* Takes the layout and the tile list from a plan: experts' rows (padding included) and the
 * schedule exactly as the runtime will launch them. */
void build_from_plan(Problem& p, const struct tw_plan* pl, int k, int n) {
  p.experts = pl->local_experts;
  p.k = k;
  p.n = n;
  p.tm = pl->tm;
  p.tn = pl->tn;
  p.swiglu = false;
  p.rows = pl->rows > 0 ? pl->rows : 1;
  p.m.assign(pl->expert_rows, pl->expert_rows + p.experts);
  p.row0.assign(pl->expert_row0, pl->expert_row0 + p.experts);
  p.tiles.assign(pl->tiles, pl->tiles + pl->num_tiles);
  p.num_bands = pl->num_bands;
  p.col_tiles = pl->col_tiles;
  p.a.resize((size_t)p.rows * k);
  p.b.resize((size_t)p.experts * n * k);
  for (auto& v : p.a) v = f2bf(uniform(-1.f, 1.f));
  for (auto& v : p.b) v = f2bf(uniform(-1.f, 1.f));
}

void planned_case(tw_router router, int world, int experts_total, int top_k, int tokens, int k,
                  int n, const std::vector<int>& grids) {
  tw_problem prob = tw_test_problem(world, n, k, experts_total, top_k, tokens, 0, 0);
  tw_routing_t rt = nullptr;
  CHECK_OK(tw_routing_generate(&prob, router, 0.0, tokens, next_u64(), &rt));
  if (rt == nullptr) return;
  for (int rank = 0; rank < world; rank++) {
    tw_plan_t pl = nullptr;
    CHECK_OK(tw_plan_create(&prob, rt, rank, nullptr, &pl));
    if (pl == nullptr) break;
    Problem p;
    build_from_plan(p, pl, k, n);
    printf("  plan rank %d/%d: %d experts, %d rows, %d tiles (%d remote), %d bands, tm %d tn %d\n",
           rank, world, p.experts, p.rows, (int)p.tiles.size(), pl->num_remote_tiles, p.num_bands,
           p.tm, p.tn);
    tw_plan_destroy(pl);
    Device d;
    if (!upload(p, d)) break;
    std::vector<float> ref;
    if (!cublas_reference(p, d, ref)) break;
    for (size_t i = 0; i < grids.size(); i++)
      run_and_check(p, d, ref.data(), grids[i], i % 2 ? TW_SIGNAL_SYS : TW_SIGNAL_GPU, 2);
  }
  tw_routing_destroy(rt);
}

void test_planned(void) {
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK");
  g_rng = 0x2468ull;
  /* Qwen1.5-MoE-like down projection (K 1408, N 2048), 2 ranks, 30 local experts, skewed. */
  planned_case(TW_ROUTER_STRESS_SKEW, 2, 60, 4, 2048, 1408, 2048, {0, 124});
  /* Balanced, wide N, 2 ranks x 4 local experts. */
  planned_case(TW_ROUTER_BALANCED, 2, 8, 2, 4096, 2048, 4096, {132, 7});
  /* 4 ranks: three remote owner groups per expert, each padded to the band height. */
  planned_case(TW_ROUTER_MODERATE_SKEW, 4, 32, 2, 1024, 512, 1024, {0});
}

/* ---- argument validation -------------------------------------------------------------------- */

void test_validation(void) {
  Problem p;
  g_rng = 0x99ull;
  build(p, {100}, 512, 1024, 128, 128, 0, false);
  Device d;
  if (!upload(p, d)) return;
  tw_gemm_args g = make_args(p, d, 0, TW_SIGNAL_GPU);
  CHECK_STATUS(tw__gemm_launch(nullptr, 0), TW_ERR_NULL_POINTER);
  tw_gemm_args x = g;
  x.tm = 96;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x = g;
  x.tn = 64;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x = g;
  x.k = 520;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_ALIGNMENT);
  x = g;
  x.grid = -1;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_INVALID_ARGUMENT);
  x = g;
  x.a = nullptr;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_NULL_POINTER);
  x = g;
  x.scope = (tw_signal_scope)7;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_INVALID_ARGUMENT);
  x = g;
  x.variant = 9;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_INVALID_ARGUMENT);
  x = g;
  x.epilogue = TW_EPILOGUE_SWIGLU;
  x.tn = 256;
  x.variant = 2;
  CHECK_STATUS(tw__gemm_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x = g;
  x.num_tiles = 0;
  CHECK_OK(tw__gemm_launch(&x, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace

int main(void) {
  tw_test_require_gpus(1);
  static const tw_test_case cases[] = {
      TW_TEST(test_validation),   TW_TEST(test_small_tm128), TW_TEST(test_small_tm64),
      TW_TEST(test_small_swiglu), TW_TEST(test_no_signal),   TW_TEST(test_large),
      TW_TEST(test_planned),
  };
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
