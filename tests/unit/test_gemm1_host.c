/*
 * test_gemm1_host.c: the host side of GEMM1 + SwiGLU, without a GPU.
 *
 * tw__ref_gemm1_swiglu_bf16 (the double reference test_gemm1 checks the kernel against): by hand
 * on a tiny case, and bit for bit against the layer reference's tw__ref_expert_gemm1 on the same
 * (bf16-representable) values. tw__plan_gemm1_tiles: every band's ceil(F / tn) column tiles
 * exactly once with the band's rows and expert, F tails, each expert's tiles in one run (layout
 * order), the count-only call and the refusals. Seed printed at start; TW_TEST_SEED repeats it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "reference.h"
#include "tw_test.h"
#include "tw_test_random.h"

static void test_reference_by_hand(void) {
  /* a = (1, 2); gate row (1, 1) -> 3, up row (1, -1) -> -1: h = -silu(3). Second column: gate
   * (0, -1) -> -2, up (2, 0) -> 2: h = 2 silu(-2). */
  const float av[2] = {1.f, 2.f};
  const float wv[8] = {1.f, 1.f, 0.f, -1.f, /* gate rows 0, 1 */ 1.f, -1.f, 2.f, 0.f /* up */};
  uint16_t a[2], w[8];
  for (int i = 0; i < 2; i++) a[i] = tw__ref_f32_to_bf16(av[i]);
  for (int i = 0; i < 8; i++) w[i] = tw__ref_f32_to_bf16(wv[i]);
  double h[2], g[2], u[2];
  tw__ref_gemm1_swiglu_bf16(2, 2, 1, a, w, h, g, u);
  CHECK_NEAR(g[0], 3.0, 0.0);
  CHECK_NEAR(u[0], -1.0, 0.0);
  CHECK_NEAR(h[0], -3.0 / (1.0 + exp(-3.0)), 1e-15);
  CHECK_NEAR(g[1], -2.0, 0.0);
  CHECK_NEAR(h[1], 2.0 * -2.0 / (1.0 + exp(2.0)), 1e-15);
  /* NULL projections are allowed. */
  double h2[2];
  tw__ref_gemm1_swiglu_bf16(2, 2, 1, a, w, h2, NULL, NULL);
  CHECK(h2[0] == h[0] && h2[1] == h[1]);
}

static void test_reference_matches_layer_reference(void) {
  uint64_t s = tw_test_seed ^ 0x6e1;
  enum { H = 72, F = 40, R = 5 };
  static uint16_t a[R * H], w[2 * F * H];
  static float af[R * H], wf[2 * F * H];
  for (int i = 0; i < R * H; i++) {
    a[i] = tw__ref_f32_to_bf16(tw_test_rng_sym(&s));
    af[i] = tw__ref_bf16_to_f32(a[i]);
  }
  for (int i = 0; i < 2 * F * H; i++) {
    w[i] = tw__ref_f32_to_bf16(tw_test_rng_sym(&s));
    wf[i] = tw__ref_bf16_to_f32(w[i]);
  }
  static double h[R * F], want[F];
  tw__ref_gemm1_swiglu_bf16(H, F, R, a, w, h, NULL, NULL);
  int bad = 0;
  for (int r = 0; r < R; r++) {
    tw__ref_expert_gemm1(H, F, af + r * H, wf, want);
    for (int f = 0; f < F; f++) bad += h[r * F + f] != want[f];
  }
  CHECKF(bad == 0, "%d of %d values differ from tw__ref_expert_gemm1", bad, R * F);
}

/* A 2-rank plan with uneven experts and F = 200 (not a multiple of 128). */
static void test_plan_tiles(void) {
  uint64_t s = tw_test_seed ^ 0x6e2;
  tw_problem p = tw_test_problem(2, 256, 200, 16, 2, 3000, 0, 0);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_STRESS_SKEW, 0.0, 3000, tw_test_rng_next(&s), &rt));
  if (rt == NULL) return;
  tw_plan_t pl = NULL;
  CHECK_OK(tw_plan_create(&p, rt, 0, NULL, &pl));
  tw_routing_destroy(rt);
  if (pl == NULL) return;
  const int tn = 128, cols = (200 + tn - 1) / tn; /* 2: the second one 72 columns wide */
  int32_t n = -1;
  CHECK_OK(tw__plan_gemm1_tiles(pl, tn, NULL, 0, &n));
  CHECKF(n == pl->num_bands * cols, "%d tiles for %d bands", n, pl->num_bands);
  tw_tile* t = (tw_tile*)malloc((size_t)(n > 0 ? n : 1) * sizeof(tw_tile));
  int* seen = (int*)calloc((size_t)(pl->num_bands > 0 ? pl->num_bands : 1) * cols, sizeof(int));
  int* done = (int*)calloc((size_t)pl->local_experts, sizeof(int)); /* expert's run ended */
  int32_t n2 = -1;
  CHECK_OK(tw__plan_gemm1_tiles(pl, tn, t, n, &n2));
  CHECK(n2 == n);
  int bad = 0, split = 0;
  for (int i = 0; i < n; i++) {
    const tw_band* b = &pl->layout_bands[t[i].band];
    bad += t[i].row0 != b->row0 || t[i].rows != b->rows || t[i].expert != b->expert;
    bad += t[i].col0 % tn != 0 || t[i].col0 >= 200 || t[i].col0 < 0;
    if (t[i].col0 >= 0 && t[i].col0 < 200) seen[t[i].band * cols + t[i].col0 / tn]++;
    if (i > 0 && t[i].expert != t[i - 1].expert) {
      done[t[i - 1].expert] = 1;
      split += done[t[i].expert]; /* an expert that comes back: its weights read twice */
    }
  }
  CHECKF(bad == 0, "%d tile fields differ from their band's", bad);
  CHECKF(split == 0, "%d experts whose tiles are not one run", split);
  int wrong = 0;
  for (int i = 0; i < pl->num_bands * cols; i++) wrong += seen[i] != 1;
  CHECKF(wrong == 0, "%d (band, column) pairs not covered exactly once", wrong);
  /* Refusals: no room, a bad tile width, NULL arguments. */
  if (n > 0) CHECK_STATUS(tw__plan_gemm1_tiles(pl, tn, t, n - 1, &n2), TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__plan_gemm1_tiles(pl, 0, t, n, &n2), TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__plan_gemm1_tiles(NULL, tn, t, n, &n2), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw__plan_gemm1_tiles(pl, tn, t, n, NULL), TW_ERR_NULL_POINTER);
  free(t);
  free(seen);
  free(done);
  tw_plan_destroy(pl);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_reference_by_hand),
             TW_TEST(test_reference_matches_layer_reference), TW_TEST(test_plan_tiles))
