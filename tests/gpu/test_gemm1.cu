/*
 * test_gemm1.cu: correctness of GEMM1 + SwiGLU (tw__gemm1_swiglu_launch).
 *
 * h (rows, F) = silu(a w_gate^T) * (a w_up^T) per expert, w13 (E, 2F, H) gate rows first. Every
 * run poisons h with a NaN pattern and then checks EVERY element: rows the tiles cover against a
 * reference within bf16 rounding plus an fp32 accumulation bound, padding rows (zero input) exactly
 * zero, rows no tile covers (gaps between experts) still the poison. References: the double CPU
 * reference (src/reference) on small shapes and on sampled rows of the large ones; cuBLAS (fp32
 * output, N = 2F per expert) with SwiGLU in double on the host for every element of the large
 * ones. And bit for bit: the wgmma variants 3..5 against 2 (one mainloop, one epilogue
 * expression), and all of them against the unfused path through the same kernel family, the fp32
 * GEMM with N = 2F (tw__gemm_f32_launch) followed by the SwiGLU kernel (harness/swiglu.cu), which
 * share the fused epilogue's arithmetic (src/kernels/swiglu.cuh). The lab levers of the 128 x 128
 * kernel (TW_GEMM1_LEVER_*): 3 stages and the one-box stage bit for bit against variant 2,
 * tanh.approx's silu against the reference; unknown lever sets refused.
 * Inputs are fresh seeded random bf16 values in [-1, 1).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <utility>
#include <vector>

#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "reference.h"
#include "swiglu.h"
#include "tw_test_gpu.h"
#include "tw_test_random.h"

namespace {

const uint16_t kPoison = 0xFFFF; /* a NaN in bf16 */

uint64_t g_rng = 1;
uint64_t next_u64() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
float uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((next_u64() >> 40) * (1.0 / 16777216.0));
}
float bf2f(uint16_t h) {
  return tw__ref_bf16_to_f32(h);
}

/* Row kinds of the layout: covered by a tile with data, covered padding (zero input, must give
 * zero), or covered by no tile (must keep the poison). */
enum RowKind : char { kGap = 0, kData = 1, kPad = 2 };

/* A grouped GEMM1 problem in the aligned row layout: expert e's m[e] rows (its data rows, then
 * its padding rows) start at row0[e]; tiles of up to tm rows of one expert by TW_GEMM1_TN
 * output columns. */
struct Problem {
  int experts = 0, hidden = 0, ffn = 0, tm = 128, rows = 0;
  std::vector<int> m, row0;
  std::vector<char> kind;       /* (rows) RowKind */
  std::vector<tw_band> bands;   /* in layout order */
  std::vector<tw_tile> tiles;   /* fused: TW_GEMM1_TN output columns each */
  std::vector<tw_tile> tiles2;  /* unfused: 256 of the 2F GEMM columns each */
  std::vector<uint16_t> a, w13; /* (rows, H) with padding and gap rows zero, (E, 2F, H) */
  std::string what;
};

void fill_inputs(Problem& p) {
  p.a.assign((size_t)p.rows * p.hidden, 0);
  for (int r = 0; r < p.rows; r++)
    if (p.kind[r] == kData)
      for (int d = 0; d < p.hidden; d++)
        p.a[(size_t)r * p.hidden + d] = tw__ref_f32_to_bf16(uniform(-1.f, 1.f));
  p.w13.resize((size_t)p.experts * 2 * p.ffn * p.hidden);
  for (auto& v : p.w13) v = tw__ref_f32_to_bf16(uniform(-1.f, 1.f));
}

/* Both tile lists from the bands: the fused one in groups of `group` bands (the planner's way),
 * the unfused one band by band; shuffled: the bands in a random order first (any order must
 * work). */
void make_tiles(Problem& p, int group, bool shuffled) {
  std::vector<tw_band> b = p.bands;
  for (size_t i = b.size(); shuffled && i > 1; i--) std::swap(b[i - 1], b[next_u64() % i]);
  const int nb = (int)b.size();
  const int cols = (p.ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN, cols2 = (2 * p.ffn + 255) / 256;
  p.tiles.resize((size_t)nb * cols);
  p.tiles2.resize((size_t)nb * cols2);
  tw__tiles_from_bands(b.data(), nb, cols, TW_GEMM1_TN, group, nb - 1, p.tiles.data());
  tw__tiles_from_bands(b.data(), nb, cols2, 256, 1, -1, p.tiles2.data());
}

/* Hand-made layout: expert e has real[e] data rows, then (when pad_to_band) zero rows up to a
 * multiple of tm, as the planner pads remote groups, then `gap` rows no tile covers. */
void build(Problem& p, const std::vector<int>& real, int hidden, int ffn, int tm, int gap,
           bool pad_to_band, int group, bool shuffled) {
  p.experts = (int)real.size();
  p.hidden = hidden;
  p.ffn = ffn;
  p.tm = tm;
  p.m.assign(p.experts, 0);
  p.row0.assign(p.experts, 0);
  p.kind.clear();
  p.bands.clear();
  for (int e = 0; e < p.experts; e++) {
    const int pad = pad_to_band && e % 2 == 0 ? (tm - real[e] % tm) % tm : 0;
    p.row0[e] = (int)p.kind.size();
    p.m[e] = real[e] + pad;
    for (int i = 0; i < real[e]; i++) p.kind.push_back(kData);
    for (int i = 0; i < pad; i++) p.kind.push_back(kPad);
    for (int i = 0; i < gap; i++) p.kind.push_back(kGap);
    for (int i = 0; i < p.m[e]; i += tm) {
      tw_band bd;
      memset(&bd, 0, sizeof bd);
      bd.expert = e;
      bd.row0 = p.row0[e] + i;
      bd.rows = p.m[e] - i < tm ? p.m[e] - i : tm;
      p.bands.push_back(bd);
    }
  }
  if (p.kind.empty()) p.kind.push_back(kGap);
  p.rows = (int)p.kind.size();
  fill_inputs(p);
  make_tiles(p, group, shuffled);
  char w[160];
  snprintf(w, sizeof w, "E=%d rows=%d H=%d F=%d tm=%d", p.experts, p.rows, hidden, ffn, tm);
  p.what = w;
}

/* The planner's layout (padding rows included) and GEMM1's tile list of the plan
 * (tw__plan_gemm1_tiles). */
bool build_from_plan(Problem& p, const struct tw_plan* pl) {
  p.experts = pl->local_experts;
  p.hidden = pl->problem.hidden;
  p.ffn = pl->problem.ffn;
  p.tm = pl->tm;
  p.rows = pl->rows > 0 ? pl->rows : 1;
  p.m.assign(pl->expert_rows, pl->expert_rows + p.experts);
  p.row0.assign(pl->expert_row0, pl->expert_row0 + p.experts);
  p.kind.assign(p.rows, kGap);
  for (int r = 0; r < pl->rows; r++) p.kind[r] = pl->row_src[r].owner < 0 ? kPad : kData;
  const tw_band* lb = pl->layout_bands != nullptr ? pl->layout_bands : pl->bands;
  p.bands.assign(lb, lb + pl->num_bands);
  fill_inputs(p);
  int n = 0, n_short = 0;
  CHECK_OK(tw__plan_gemm1_tiles(pl, TW_GEMM1_TN, nullptr, 0, &n));
  CHECKF(n == pl->num_bands * ((p.ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN), "%d tiles", n);
  p.tiles.resize(n > 0 ? n : 1);
  CHECK_OK(tw__plan_gemm1_tiles(pl, TW_GEMM1_TN, p.tiles.data(), n, &n));
  p.tiles.resize(n);
  if (n > 0)
    CHECK_STATUS(tw__plan_gemm1_tiles(pl, TW_GEMM1_TN, p.tiles.data(), n - 1, &n_short),
                 TW_ERR_INVALID_SIZE);
  /* Every band's columns exactly once. */
  std::vector<int> seen((size_t)pl->num_bands, 0);
  for (const tw_tile& t : p.tiles) {
    CHECK(t.col0 % TW_GEMM1_TN == 0 && t.col0 < p.ffn);
    if (t.band >= 0 && t.band < pl->num_bands) seen[t.band]++;
  }
  for (int b = 0; b < pl->num_bands; b++)
    CHECKF(seen[b] == (p.ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN, "band %d: %d tiles", b, seen[b]);
  const int cols2 = (2 * p.ffn + 255) / 256;
  p.tiles2.resize((size_t)pl->num_bands * cols2);
  tw__tiles_from_bands(p.bands.data(), pl->num_bands, cols2, 256, 1, -1, p.tiles2.data());
  char w[160];
  snprintf(w, sizeof w, "plan E=%d rows=%d H=%d F=%d tm=%d", p.experts, p.rows, p.hidden, p.ffn,
           p.tm);
  p.what = w;
  return n > 0;
}

struct Device {
  void *a = nullptr, *w13 = nullptr, *h = nullptr, *h2 = nullptr;
  float* gu = nullptr; /* (rows, 2F) fp32: the unfused GEMM's output, or cuBLAS's */
  tw_tile *tiles = nullptr, *tiles2 = nullptr;
  ~Device() {
    cudaFree(a);
    cudaFree(w13);
    cudaFree(h);
    cudaFree(h2);
    cudaFree(gu);
    cudaFree(tiles);
    cudaFree(tiles2);
  }
};

bool upload(const Problem& p, Device& d) {
  const size_t h_elems = (size_t)p.rows * p.ffn;
  bool ok = cudaMalloc(&d.a, p.a.size() * 2) == cudaSuccess &&
            cudaMalloc(&d.w13, p.w13.size() * 2) == cudaSuccess &&
            cudaMalloc(&d.h, h_elems * 2) == cudaSuccess &&
            cudaMalloc(&d.h2, h_elems * 2) == cudaSuccess &&
            cudaMalloc(&d.gu, h_elems * 2 * sizeof(float)) == cudaSuccess &&
            cudaMalloc(&d.tiles, (p.tiles.size() + 1) * sizeof(tw_tile)) == cudaSuccess &&
            cudaMalloc(&d.tiles2, (p.tiles2.size() + 1) * sizeof(tw_tile)) == cudaSuccess;
  CHECK(ok);
  if (!ok) return false;
  CHECK_CUDA(cudaMemcpy(d.a, p.a.data(), p.a.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.w13, p.w13.data(), p.w13.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.tiles, p.tiles.data(), p.tiles.size() * sizeof(tw_tile),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.tiles2, p.tiles2.data(), p.tiles2.size() * sizeof(tw_tile),
                        cudaMemcpyHostToDevice));
  return true;
}

tw_gemm1_args make_args(const Problem& p, const Device& d, int grid, int variant) {
  tw_gemm1_args g;
  tw__gemm1_args_init(&g, d.a, d.w13, d.h, p.rows, p.hidden, p.ffn, p.experts, d.tiles,
                      (int)p.tiles.size(), p.tm);
  g.grid = grid;
  g.variant = variant;
  return g;
}

/* The reference of covered data rows: the wanted value and its allowed error, per element. */
struct Reference {
  std::vector<float> want, tol; /* (rows, F) */
};

/* Allowed error of one element with projections g and u (double): the bf16 rounding of the
 * result (half an ulp is 2^-9 relative; 2^-8 leaves room for the fp32 silu) plus the effect of
 * fp32 accumulation on g and u: partial sums of H products of inputs in [-1, 1) stay within a few
 * sqrt(H), so H additions rounded (or truncated) at 2^-23 of them put g and u within ~H 2^-19 of
 * the double sums (the kernel's and cuBLAS's alike); then d(silu(g) u) = silu'(g) u dg +
 * silu(g) du with |silu'| < 1.1. A paired-up wrong column is off by the value itself. */
void set_ref(Reference& ref, size_t i, double g, double u, int hidden) {
  const double s = g / (1.0 + exp(-g)), want = s * u;
  const double dg = hidden * ldexp(1.0, -19);
  ref.want[i] = (float)want;
  ref.tol[i] = (float)(fabs(want) * (1.0 / 256) + (1.1 * fabs(u) + fabs(s)) * dg + 1e-6);
}

/* Double CPU reference of every data row. */
void cpu_reference(const Problem& p, Reference& ref) {
  const size_t n = (size_t)p.rows * p.ffn;
  ref.want.assign(n, 0.f);
  ref.tol.assign(n, 0.f);
  std::vector<double> h, g, u;
  for (int e = 0; e < p.experts; e++) {
    if (p.m[e] == 0) continue;
    h.resize((size_t)p.m[e] * p.ffn);
    g.resize(h.size());
    u.resize(h.size());
    tw__ref_gemm1_swiglu_bf16(p.hidden, p.ffn, p.m[e], &p.a[(size_t)p.row0[e] * p.hidden],
                              &p.w13[(size_t)e * 2 * p.ffn * p.hidden], h.data(), g.data(),
                              u.data());
    for (size_t i = 0; i < h.size(); i++)
      set_ref(ref, (size_t)p.row0[e] * p.ffn + i, g[i], u[i], p.hidden);
  }
}

/* cuBLAS per expert, (m_e, 2F) fp32 = A_e W13_e^T into d.gu, then SwiGLU in double on the host.
 * Then `samples` random data rows against the double CPU reference, which keeps cuBLAS honest. */
bool cublas_reference(const Problem& p, Device& d, Reference& ref, int samples) {
  cublasHandle_t hd;
  if (cublasCreate(&hd) != CUBLAS_STATUS_SUCCESS) {
    CHECK(!"cublasCreate");
    return false;
  }
  const float one = 1.f, zero = 0.f;
  const int n2 = 2 * p.ffn;
  for (int e = 0; e < p.experts; e++) {
    if (p.m[e] == 0) continue;
    /* Row-major (m_e, 2F) = A_e W13_e^T is column-major (2F, m_e) = W13_e^T' A_e^T'. */
    const cublasStatus_t s = cublasGemmEx(
        hd, CUBLAS_OP_T, CUBLAS_OP_N, n2, p.m[e], p.hidden, &one,
        (const uint16_t*)d.w13 + (size_t)e * n2 * p.hidden, CUDA_R_16BF, p.hidden,
        (const uint16_t*)d.a + (size_t)p.row0[e] * p.hidden, CUDA_R_16BF, p.hidden, &zero,
        d.gu + (size_t)p.row0[e] * n2, CUDA_R_32F, n2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CHECK(s == CUBLAS_STATUS_SUCCESS);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  cublasDestroy(hd);
  std::vector<float> gu((size_t)p.rows * n2);
  CHECK_CUDA(cudaMemcpy(gu.data(), d.gu, gu.size() * 4, cudaMemcpyDeviceToHost));
  const size_t n = (size_t)p.rows * p.ffn;
  ref.want.assign(n, 0.f);
  ref.tol.assign(n, 0.f);
  for (int r = 0; r < p.rows; r++) {
    if (p.kind[r] != kData) continue;
    for (int c = 0; c < p.ffn; c++)
      set_ref(ref, (size_t)r * p.ffn + c, gu[(size_t)r * n2 + c], gu[(size_t)r * n2 + p.ffn + c],
              p.hidden);
  }
  /* Sampled rows in double: cuBLAS's values within the same bound. */
  std::vector<int> data_rows;
  std::vector<int> expert_of(p.rows, -1);
  for (int e = 0; e < p.experts; e++)
    for (int i = 0; i < p.m[e]; i++) expert_of[p.row0[e] + i] = e;
  for (int r = 0; r < p.rows; r++)
    if (p.kind[r] == kData) data_rows.push_back(r);
  std::vector<double> h(p.ffn), g(p.ffn), u(p.ffn);
  int bad = 0;
  for (int s = 0; s < samples && !data_rows.empty(); s++) {
    const int r = data_rows[next_u64() % data_rows.size()], e = expert_of[r];
    tw__ref_gemm1_swiglu_bf16(p.hidden, p.ffn, 1, &p.a[(size_t)r * p.hidden],
                              &p.w13[(size_t)e * 2 * p.ffn * p.hidden], h.data(), g.data(),
                              u.data());
    for (int c = 0; c < p.ffn; c++) {
      const size_t i = (size_t)r * p.ffn + c;
      if (!(fabs((double)ref.want[i] - h[c]) <= ref.tol[i])) {
        if (bad++ < 5)
          fprintf(stderr, "  cuBLAS reference (%d, %d) = %g, double %g\n", r, c, ref.want[i], h[c]);
      }
    }
  }
  CHECKF(bad == 0, "%s: %d elements of the cuBLAS reference off the double one", p.what.c_str(),
         bad);
  return true;
}

/* Checks every element of h; returns the number of wrong ones. */
int64_t check_output(const Problem& p, const std::vector<uint16_t>& out, const Reference& ref,
                     const char* what) {
  int64_t bad = 0;
  for (int64_t r = 0; r < p.rows; r++)
    for (int c = 0; c < p.ffn; c++) {
      const size_t i = (size_t)r * p.ffn + c;
      const uint16_t hv = out[i];
      bool ok;
      if (p.kind[r] == kData)
        ok = fabs((double)bf2f(hv) - ref.want[i]) <= ref.tol[i];
      else if (p.kind[r] == kPad)
        ok = bf2f(hv) == 0.f;
      else
        ok = hv == kPoison;
      if (!ok) {
        if (bad < 5)
          fprintf(stderr, "  %s: h[%lld][%d] = %g (0x%04x), want %s %g (+- %g)\n", what,
                  (long long)r, c, bf2f(hv), hv,
                  p.kind[r] == kData ? "" : (p.kind[r] == kPad ? "zero, padding" : "poison"),
                  p.kind[r] == kData ? ref.want[i] : 0.0, p.kind[r] == kData ? ref.tol[i] : 0.0);
        bad++;
      }
    }
  return bad;
}

/* The unfused path into d.h2: tw__gemm_f32_launch (N = 2F, 128 x 256 tiles) then SwiGLU. */
bool run_unfused(const Problem& p, Device& d) {
  const int failures = tw_test_failures_;
  tw_gemm_args g;
  const tw_gemm_shape sh = {p.rows, p.hidden, 2 * p.ffn, p.experts, 128, 256};
  CHECK_OK(tw__gemm_args_init(&g, &sh, d.a, d.w13, d.gu, d.tiles2, (int)p.tiles2.size(), 0,
                              TW_SIGNAL_NONE, nullptr));
  CHECK_OK(tw__gemm_f32_launch(&g, 0));
  CHECK_OK(tw__swiglu_launch(d.gu, 1, d.h2, p.rows, p.ffn, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  return tw_test_failures_ == failures;
}

const int kVariants[] = {1, 2, 3, 4, 5, 0};

/* Counts the covered elements where x and y differ in any bit (prints the first few). */
int64_t count_diff(const Problem& p, const std::vector<uint16_t>& x, const std::vector<uint16_t>& y,
                   const char* what, const char* other) {
  int64_t diff = 0;
  for (int64_t r = 0; r < p.rows; r++) {
    if (p.kind[r] == kGap) continue;
    for (int c = 0; c < p.ffn; c++) {
      const size_t i = (size_t)r * p.ffn + c;
      if (x[i] != y[i] && diff++ < 5)
        fprintf(stderr, "  %s: h[%lld][%d] = 0x%04x, %s 0x%04x\n", what, (long long)r, c, x[i],
                other, y[i]);
    }
  }
  return diff;
}

/* Every variant on every grid: poisoned h, launch, every element against the reference; the
 * wgmma variants (and the default) also bit for bit against variant 2 (the same mainloop and
 * epilogue arithmetic: a difference is a bug of one epilogue) and against the unfused path (the
 * fp32 GEMM's tensor-core sums of the same products in the same K order, its columns elsewhere in
 * a wider tile). */
void run_and_check(const Problem& p, Device& d, const Reference& ref,
                   const std::vector<int>& grids) {
  const size_t elems = (size_t)p.rows * p.ffn;
  std::vector<uint16_t> out(elems), unfused(elems);
  const bool have_unfused = run_unfused(p, d);
  if (have_unfused) CHECK_CUDA(cudaMemcpy(unfused.data(), d.h2, elems * 2, cudaMemcpyDeviceToHost));
  std::vector<uint16_t> v2(elems);
  for (int grid : grids)
    for (int variant : kVariants) {
      char what[256];
      snprintf(what, sizeof what, "v%d %s grid=%d", variant, p.what.c_str(), grid);
      CHECK_OK(tw__fill_bf16(d.h, elems, kPoison, 0));
      const tw_gemm1_args g = make_args(p, d, grid, variant);
      CHECK_OK(tw__gemm1_swiglu_launch(&g, 0));
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemcpy(out.data(), d.h, elems * 2, cudaMemcpyDeviceToHost));
      const int64_t bad = check_output(p, out, ref, what);
      CHECKF(bad == 0, "%s: %lld wrong elements", what, (long long)bad);
      if (variant == 2) v2 = out;
      if (variant != 1 && variant != 2) {
        const int64_t diff = count_diff(p, out, v2, what, "variant 2");
        CHECKF(diff == 0, "%s: %lld elements differ from variant 2", what, (long long)diff);
      }
      if (variant != 1 && have_unfused) {
        const int64_t diff = count_diff(p, out, unfused, what, "unfused");
        CHECKF(diff == 0, "%s: %lld elements differ from the unfused path", what, (long long)diff);
      }
      printf("  checked %s: %lld elements%s\n", what, (long long)elems,
             variant != 1 && have_unfused ? ", and against the unfused path" : "");
    }
  /* The lab levers of the 128 x 128 SwiGLU kernel (variant 5): 3 stages and the one-box stage
   * give variant 2's bits (the same sums in the same order); silu through tanh.approx, alone or
   * with both, is checked against the reference only. */
  if (p.tm != 128) return;
  static const int kLevers[] = {TW_GEMM1_LEVER_STAGES3, TW_GEMM1_LEVER_ONE_BOX, TW_GEMM1_LEVER_TANH,
                                TW_GEMM1_LEVER_ALL};
  for (int lv : kLevers) {
    char what[256];
    snprintf(what, sizeof what, "v5 levers 0x%x %s grid=%d", lv, p.what.c_str(), grids[0]);
    CHECK_OK(tw__fill_bf16(d.h, elems, kPoison, 0));
    tw_gemm1_args g = make_args(p, d, grids[0], 5);
    g.levers = lv;
    CHECK_OK(tw__gemm1_swiglu_launch(&g, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(out.data(), d.h, elems * 2, cudaMemcpyDeviceToHost));
    const int64_t bad = check_output(p, out, ref, what);
    CHECKF(bad == 0, "%s: %lld wrong elements", what, (long long)bad);
    if (!(lv & TW_GEMM1_LEVER_TANH)) {
      const int64_t diff = count_diff(p, out, v2, what, "variant 2");
      CHECKF(diff == 0, "%s: %lld elements differ from variant 2", what, (long long)diff);
    }
    printf("  checked %s: %lld elements\n", what, (long long)elems);
  }
}

std::vector<int> random_m(int experts, int lo, int hi) {
  std::vector<int> m(experts);
  for (auto& v : m) v = lo + (int)(next_u64() % (uint64_t)(hi - lo + 1));
  if (experts > 2) m[1] = 0; /* always one expert without rows */
  return m;
}

/* ---- small shapes against the double CPU reference ------------------------------------------ */

void small_shape(const std::vector<int>& real, int hidden, int ffn, int tm, int gap, bool pad,
                 int group, bool shuffled, const std::vector<int>& grids) {
  Problem p;
  build(p, real, hidden, ffn, tm, gap, pad, group, shuffled);
  Device d;
  if (!upload(p, d)) return;
  Reference ref;
  cpu_reference(p, ref);
  run_and_check(p, d, ref, grids);
}

void test_small(void) {
  g_rng = 0x5EED0001ull;
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) { /* two shapes, one grid: enough for the sanitizers */
    small_shape({130, 0, 77, 1}, 256, 384, 128, 0, true, 8, false, {0});
    small_shape({200, 0, 64}, 128, 200, 64, 3, true, 1, true, {3}); /* the 64-row kernel */
    return;
  }
  /* Zero-row experts, partial last bands, a 1-row expert, back to back; padding rows. */
  small_shape({130, 0, 77, 1}, 512, 384, 128, 0, true, 8, false, {1, 0, 5});
  /* F not a multiple of TW_GEMM1_TN (the last column tile is masked), gaps, shuffled bands. */
  small_shape({200, 0, 129, 64}, 256, 200, 128, 3, true, 1, true, {3, 0});
  /* F below one tile. */
  small_shape({50, 140}, 128, 64, 128, 2, false, 2, false, {0});
  /* 64-row bands (tm 64): the 64 x 128 tiles, F tail too. */
  small_shape({65, 3, 140, 0, 64}, 512, 256, 64, 0, true, 4, false, {2, 0});
  small_shape({130, 1, 70}, 256, 328, 64, 2, false, 1, true, {0});
}

/* ---- large shapes against cuBLAS, and the CPU on sampled rows ------------------------------- */

void large_shape(const std::vector<int>& real, int hidden, int ffn, const std::vector<int>& grids,
                 int group = 8, int tm = 128) {
  Problem p;
  build(p, real, hidden, ffn, tm, 0, true, group, false);
  Device d;
  if (!upload(p, d)) return;
  Reference ref;
  if (!cublas_reference(p, d, ref, 6)) return;
  run_and_check(p, d, ref, grids);
}

void test_large(void) {
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK: large shapes");
  g_rng = 0x5EED0002ull;
  /* The three hidden sizes and the three F of the target models (Qwen, Mixtral-like H 4096 with
   * a DeepSeek-like F, DeepSeek-V3), expert counts 1 to 64 with uneven rows. */
  large_shape(random_m(30, 0, 300), 2048, 1408, {0, 7});
  large_shape(random_m(64, 0, 150), 2048, 768, {0});
  large_shape(random_m(8, 0, 1000), 4096, 1408, {0, 124});
  large_shape(random_m(8, 0, 600), 7168, 2048, {0}, 1);
  large_shape(random_m(1, 3000, 3000), 4096, 2048, {132});
  large_shape(random_m(4, 1, 700), 7168, 768, {0, 66});
  large_shape(random_m(16, 0, 300), 4096, 1408, {0, 5}, 8, 64); /* 64-row bands */
}

/* ---- the planner's layout and tw__plan_gemm1_tiles ------------------------------------------ */

void planned_case(tw_router router, int world, int experts_total, int top_k, int tokens, int hidden,
                  int ffn) {
  tw_problem prob = tw_test_problem(world, hidden, ffn, experts_total, top_k, tokens, 0, 0);
  tw_routing_t rt = nullptr;
  CHECK_OK(tw_routing_generate(&prob, router, 0.0, tokens, next_u64(), &rt));
  if (rt == nullptr) return;
  for (int rank = 0; rank<world; rank += world - 1> 0 ? world - 1 : 1) {
    tw_plan_t pl = nullptr;
    CHECK_OK(tw_plan_create(&prob, rt, rank, nullptr, &pl));
    if (pl == nullptr) break;
    Problem p;
    const bool ok = build_from_plan(p, pl);
    int pad = 0;
    for (char k : p.kind) pad += k == kPad;
    printf("  plan rank %d/%d: %d experts, %d rows (%d padding), %d GEMM1 tiles, tm %d\n", rank,
           world, p.experts, p.rows, pad, (int)p.tiles.size(), p.tm);
    tw_plan_destroy(pl);
    if (!ok) break;
    Device d;
    if (!upload(p, d)) break;
    Reference ref;
    if (!cublas_reference(p, d, ref, 4)) break;
    run_and_check(p, d, ref, {0});
  }
  tw_routing_destroy(rt);
}

void test_planned(void) {
  if (tw__env_int("TW_GEMM_TEST_QUICK", 0)) TW_TEST_SKIP_CASE("TW_GEMM_TEST_QUICK");
  g_rng = 0x5EED0003ull;
  /* Qwen1.5-MoE-A2.7B: 2 ranks, 30 local experts, skewed. */
  planned_case(TW_ROUTER_STRESS_SKEW, 2, 60, 4, 2048, 2048, 1408);
  /* DeepSeek-V3-like widths, 4 ranks: three remote owner groups per expert, each padded. */
  planned_case(TW_ROUTER_MODERATE_SKEW, 4, 32, 8, 256, 7168, 2048);
}

/* ---- refused arguments ------------------------------------------------------------------------
 */

void test_validation(void) {
  g_rng = 0x5EED0004ull;
  Problem p;
  build(p, {100, 30}, 256, 256, 128, 0, false, 1, false);
  Device d;
  if (!upload(p, d)) return;
  const tw_gemm1_args g = make_args(p, d, 0, 0);
  CHECK_STATUS(tw__gemm1_swiglu_launch(nullptr, 0), TW_ERR_NULL_POINTER);
  tw_gemm1_args x = g;
  x.hidden = 200; /* not a multiple of 64 */
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_ALIGNMENT);
  x = g;
  x.ffn = 252; /* not a multiple of 8 */
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_ALIGNMENT);
  x = g;
  x.tm = 96;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x = g;
  x.variant = 6;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_INVALID_ARGUMENT);
  x = g; /* a lever set without an instance, or levers beside another variant */
  x.levers = TW_GEMM1_LEVER_STAGES3 | TW_GEMM1_LEVER_TANH;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x.levers = TW_GEMM1_LEVER_TANH;
  x.variant = 4;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_UNSUPPORTED);
  x = g;
  x.grid = -1;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_INVALID_ARGUMENT);
  x = g;
  x.w13 = nullptr;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_NULL_POINTER);
  x = g;
  x.h = static_cast<char*>(d.h) + 2;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_ALIGNMENT);
  x = g;
  x.experts = 0;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_INVALID_SIZE);
  x = g;
  x.experts = 1 << 20;
  x.ffn = 1 << 12; /* 2^33 weight rows */
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_INVALID_SIZE);
  x = g;
  x.num_tiles = -1;
  CHECK_STATUS(tw__gemm1_swiglu_launch(&x, 0), TW_ERR_INVALID_SIZE);
  x = g;
  x.num_tiles = 0;
  CHECK_OK(tw__gemm1_swiglu_launch(&x, 0));
  /* The unfused path's GEMM: 128 x 256 plain stores only. */
  tw_gemm_args f;
  const tw_gemm_shape sh = {p.rows, p.hidden, 2 * p.ffn, p.experts, 128, 128};
  CHECK_OK(tw__gemm_args_init(&f, &sh, d.a, d.w13, d.gu, d.tiles2, (int)p.tiles2.size(), 0,
                              TW_SIGNAL_NONE, nullptr));
  CHECK_STATUS(tw__gemm_f32_launch(&f, 0), TW_ERR_UNSUPPORTED);
  f.tn = 256;
  f.epilogue = TW_EPILOGUE_SWIGLU;
  CHECK_STATUS(tw__gemm_f32_launch(&f, 0), TW_ERR_UNSUPPORTED);
  CHECK_STATUS(tw__swiglu_launch(d.gu, 1, d.h2, p.rows, 252, 0), TW_ERR_ALIGNMENT);
  CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace

int main(void) {
  tw_test_require_gpus(1);
  static const tw_test_case cases[] = {TW_TEST(test_validation), TW_TEST(test_small),
                                       TW_TEST(test_large), TW_TEST(test_planned)};
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
