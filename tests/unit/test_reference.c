/*
 * test_reference.c: checks of the double-precision MoE references (src/reference).
 *
 * The references are what every other test trusts, so they are checked against numbers worked
 * out by hand on a tiny layer, against their own definition (top-k and softmax properties),
 * against each other (router vs. given routing, double vs. fp32 within a proven bound), and by
 * exact algebraic identities (doubling the gate weights doubles the output bit for bit; the
 * layer is linear in w2; splitting the same tokens over more ranks does not change the result).
 * Inputs are random from a seed printed at start (TW_TEST_SEED overrides it).
 */
#include "reference.h"
#include "tw_test.h"
#include "tw_test_random.h"

static void fill(uint64_t* s, float* a, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) a[i] = scale * tw_test_rng_sym(s);
}

static tw_problem small_problem(int32_t W, int32_t H, int32_t F, int32_t E, int32_t K) {
  return tw_test_problem(W, H, F, E, K, 64, 64, 64);
}

/* H = 2, F = 1, two experts, one rank: every number below is worked out by hand. */
static void test_hand_case(void) {
  tw_problem p = small_problem(1, 2, 1, 2, 2);
  const float x0[2] = {1.0f, 2.0f};
  const float* x[1] = {x0};
  const float router[4] = {1.0f, 0.0f, 0.0f, 1.0f}; /* (H, E): logits = (x0, x1) = (1, 2) */
  /* Expert 0: gate row (1, 0) -> 1, up row (0, 1) -> 2, h = silu(1) * 2, w2 = (1, -1).
   * Expert 1: gate row (1, 1) -> 3, up row (1, -1) -> -1, h = -silu(3), w2 = (2, 0.5). */
  const float w1[8] = {1, 0, 0, 1, /* expert 0: gate; up */ 1, 1, 1, -1 /* expert 1 */};
  const float w2[4] = {1, -1, /* expert 0: (H, F) */ 2, 0.5f};
  double h0 = 2.0 / (1.0 + exp(-1.0)), h1 = -3.0 / (1.0 + exp(-3.0));
  double y0[2] = {h0, -h0}, y1[2] = {2.0 * h1, 0.5 * h1};
  double g0 = 1.0 / (1.0 + exp(1.0)), g1 = 1.0 / (1.0 + exp(-1.0)); /* softmax(1, 2) */

  double o[2] = {NAN, NAN};
  double* out[1] = {o};
  CHECK_OK(tw__ref_moe_layer(&p, (const int32_t[]){1}, x, router, NULL, w1, w2, out));
  CHECK_NEAR(o[0], g0 * y0[0] + g1 * y1[0], 1e-14);
  CHECK_NEAR(o[1], g0 * y0[1] + g1 * y1[1], 1e-14);

  /* top_k = 1: only expert 1 (the larger logit), weight 1. */
  p.top_k = 1;
  CHECK_OK(tw__ref_moe_layer(&p, (const int32_t[]){1}, x, router, NULL, w1, w2, out));
  CHECK_NEAR(o[0], y1[0], 1e-14);
  CHECK_NEAR(o[1], y1[1], 1e-14);

  /* The building blocks alone: expert 0's GEMM1 -> SwiGLU, then GEMM2. */
  double hh[1], f[2];
  tw__ref_expert_gemm1(2, 1, x0, w1, hh);
  CHECK_NEAR(hh[0], h0, 1e-15);
  tw__ref_expert_gemm2(2, 1, hh, w2, f);
  CHECK_NEAR(f[0], y0[0], 1e-15);
  CHECK_NEAR(f[1], y0[1], 1e-15);
  CHECK_NEAR(tw__ref_silu(0.0), 0.0, 0.0);
  CHECK_NEAR(tw__ref_silu(-2.0), -2.0 / (1.0 + exp(2.0)), 1e-16);
}

/* Top-k picks the k largest logits in descending order; weights are their softmax. */
static void test_route_properties(void) {
  uint64_t s = tw_test_seed ^ 0x1111;
  const int32_t H = 24, E = 12, T = 40;
  float* x = (float*)malloc(sizeof(float) * T * H);
  float* router = (float*)malloc(sizeof(float) * H * E);
  fill(&s, x, (size_t)T * H, 1.0f);
  fill(&s, router, (size_t)H * E, 1.0f);
  for (int32_t k = 1; k <= E; k += 3) {
    int32_t ids[40 * 12];
    double w[40 * 12];
    CHECK_OK(tw__ref_route(H, E, k, T, x, router, ids, w));
    for (int32_t t = 0; t < T; t++) {
      double logit[12], sum = 0.0;
      for (int32_t e = 0; e < E; e++) {
        logit[e] = 0.0;
        for (int32_t d = 0; d < H; d++) logit[e] += (double)x[t * H + d] * router[d * E + e];
      }
      double kth = INFINITY;
      for (int32_t j = 0; j < k; j++) {
        int32_t e = ids[t * k + j];
        CHECK(e >= 0 && e < E);
        if (j > 0) CHECK(logit[e] <= logit[ids[t * k + j - 1]]);
        for (int32_t i = 0; i < j; i++) CHECK(ids[t * k + i] != e);
        if (logit[e] < kth) kth = logit[e];
        CHECK(w[t * k + j] > 0.0);
        if (j > 0) CHECK_NEAR(w[t * k + j] / w[t * k], exp(logit[e] - logit[ids[t * k]]), 1e-12);
        sum += w[t * k + j];
      }
      CHECK_NEAR(sum, 1.0, 1e-14);
      int chosen_count = 0;
      for (int32_t e = 0; e < E; e++) {
        int chosen = 0;
        for (int32_t j = 0; j < k; j++) chosen |= ids[t * k + j] == e;
        chosen_count += chosen;
        if (!chosen) CHECK(logit[e] <= kth);
      }
      CHECK(chosen_count == k);
    }
  }
  free(x);
  free(router);
}

/* Routing from the router, then the same ids and (float) weights given as a tw_routing, give the
 * same layer output up to the rounding of the weights to float. */
static void test_router_vs_given_routing(void) {
  uint64_t s = tw_test_seed ^ 0x2222;
  const int32_t W = 2, H = 16, F = 8, E = 8, K = 3;
  tw_problem p = small_problem(W, H, F, E, K);
  int32_t tokens[2] = {7, 0}; /* a rank without tokens too */
  float *x[2], *w1 = (float*)malloc(sizeof(float) * E * 2 * F * H);
  float *w2 = (float*)malloc(sizeof(float) * E * H * F),
        *router = (float*)malloc(sizeof(float) * H * E);
  int32_t* ids[2];
  float* wf[2];
  double *o1[2], *o2[2];
  fill(&s, w1, (size_t)E * 2 * F * H, 0.5f);
  fill(&s, w2, (size_t)E * H * F, 0.5f);
  fill(&s, router, (size_t)H * E, 1.0f);
  for (int r = 0; r < W; r++) {
    x[r] = (float*)malloc(sizeof(float) * (tokens[r] * H + 1));
    fill(&s, x[r], (size_t)tokens[r] * H, 1.0f);
    ids[r] = (int32_t*)malloc(sizeof(int32_t) * (tokens[r] * K + 1));
    wf[r] = (float*)malloc(sizeof(float) * (tokens[r] * K + 1));
    double* wd = (double*)malloc(sizeof(double) * (tokens[r] * K + 1));
    CHECK_OK(tw__ref_route(H, E, K, tokens[r], x[r], router, ids[r], wd));
    for (int32_t i = 0; i < tokens[r] * K; i++) wf[r][i] = (float)wd[i];
    free(wd);
    o1[r] = (double*)malloc(sizeof(double) * (tokens[r] * H + 1));
    o2[r] = (double*)malloc(sizeof(double) * (tokens[r] * H + 1));
  }
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_create(&p, tokens, (const int32_t* const*)ids, (const float* const*)wf, &rt));
  CHECK_OK(tw__ref_moe_layer(&p, tokens, (const float* const*)x, router, NULL, w1, w2, o1));
  CHECK_OK(tw__ref_moe_layer(&p, NULL, (const float* const*)x, NULL, rt, w1, w2, o2));
  double scale = 0.0, diff = 0.0;
  for (int32_t i = 0; i < tokens[0] * H; i++) {
    scale = fmax(scale, fabs(o1[0][i]));
    diff = fmax(diff, fabs(o1[0][i] - o2[0][i]));
  }
  CHECK(scale > 1e-3);
  CHECKF(diff <= 1e-6 * scale, "diff %.3g scale %.3g", diff, scale);
  /* Error mapping. */
  tw_problem bad = p;
  bad.top_k = E + 1;
  CHECK_STATUS(tw__ref_moe_layer(&bad, tokens, (const float* const*)x, router, NULL, w1, w2, o1),
               TW_ERR_TOPK_RANGE);
  bad = p;
  bad.experts = 7;
  CHECK_STATUS(tw__ref_moe_layer(&bad, tokens, (const float* const*)x, router, NULL, w1, w2, o1),
               TW_ERR_INDIVISIBLE);
  CHECK_STATUS(tw__ref_moe_layer(&p, tokens, (const float* const*)x, NULL, NULL, w1, w2, o1),
               TW_ERR_NULL_POINTER);
  tw_routing_destroy(rt);
  for (int r = 0; r < W; r++) {
    free(x[r]);
    free(ids[r]);
    free(wf[r]);
    free(o1[r]);
    free(o2[r]);
  }
  free(w1);
  free(w2);
  free(router);
}

/* Exact identities: gate weights x2 -> output x2 bit for bit; linear in w2; independent of how
 * the tokens are spread over ranks. */
static void test_linearity_and_distribution(void) {
  uint64_t s = tw_test_seed ^ 0x3333;
  const int32_t H = 16, F = 8, E = 8, K = 2, T = 12;
  tw_problem p1 = small_problem(1, H, F, E, K), p4 = small_problem(4, H, F, E, K);
  float* w1 = (float*)malloc(sizeof(float) * E * 2 * F * H);
  float *w2a = (float*)malloc(sizeof(float) * E * H * F),
        *w2b = (float*)malloc(sizeof(float) * E * H * F);
  float* w2s = (float*)malloc(sizeof(float) * E * H * F);
  float* x = (float*)malloc(sizeof(float) * T * H);
  fill(&s, w1, (size_t)E * 2 * F * H, 0.5f);
  fill(&s, x, (size_t)T * H, 1.0f);
  /* Multiples of 2^-10 in [-1, 1): their sums are exact in float. */
  for (int32_t i = 0; i < E * H * F; i++) {
    w2a[i] = ldexpf((float)((int)(tw_test_rng_next(&s) % 2048) - 1024), -10);
    w2b[i] = ldexpf((float)((int)(tw_test_rng_next(&s) % 2048) - 1024), -10);
    w2s[i] = w2a[i] + w2b[i];
  }
  int32_t t1[1] = {T};
  tw_routing_t r1 = tw_test_random_routing(&p1, t1, &s, 0);
  /* Same routing with weights x2 (exact in float). */
  int32_t* ids[1] = {r1->expert_ids[0]};
  float* w2x = (float*)malloc(sizeof(float) * T * K);
  for (int32_t i = 0; i < T * K; i++) w2x[i] = 2.0f * r1->weights[0][i];
  tw_routing_t r1x = NULL;
  CHECK_OK(tw_routing_create(&p1, t1, (const int32_t* const*)ids, (const float* const*)&w2x, &r1x));
  double *oa = (double*)malloc(sizeof(double) * T * H),
         *ob = (double*)malloc(sizeof(double) * T * H);
  double *os = (double*)malloc(sizeof(double) * T * H),
         *ox = (double*)malloc(sizeof(double) * T * H);
  const float* xs[1] = {x};
  CHECK_OK(tw__ref_moe_layer(&p1, NULL, xs, NULL, r1, w1, w2a, &oa));
  CHECK_OK(tw__ref_moe_layer(&p1, NULL, xs, NULL, r1, w1, w2b, &ob));
  CHECK_OK(tw__ref_moe_layer(&p1, NULL, xs, NULL, r1, w1, w2s, &os));
  CHECK_OK(tw__ref_moe_layer(&p1, NULL, xs, NULL, r1x, w1, w2a, &ox));
  int exact2 = 1;
  double scale = 0.0;
  for (int32_t i = 0; i < T * H; i++) {
    exact2 &= ox[i] == 2.0 * oa[i];
    scale = fmax(scale, fabs(os[i]));
    CHECK_NEAR(os[i], oa[i] + ob[i], 1e-13 * (1.0 + fabs(os[i])));
  }
  CHECK(exact2);
  CHECK(scale > 1e-3);

  /* The same T tokens spread over 4 ranks (5, 0, 4, 3 tokens) with the same expert ids. */
  int32_t t4[4] = {5, 0, 4, 3};
  int32_t* ids4[4];
  float* w4[4];
  const float* x4[4];
  double* o4[4];
  int32_t first = 0;
  for (int r = 0; r < 4; r++) {
    ids4[r] = r1->expert_ids[0] + first * K;
    w4[r] = r1->weights[0] + first * K;
    x4[r] = x + first * H;
    o4[r] = (double*)malloc(sizeof(double) * (t4[r] * H + 1));
    first += t4[r];
  }
  tw_routing_t r4 = NULL;
  CHECK_OK(tw_routing_create(&p4, t4, (const int32_t* const*)ids4, (const float* const*)w4, &r4));
  CHECK_OK(tw__ref_moe_layer(&p4, NULL, x4, NULL, r4, w1, w2a, o4));
  first = 0;
  for (int r = 0; r < 4; r++) {
    for (int32_t i = 0; i < t4[r] * H; i++)
      CHECK_NEAR(o4[r][i], oa[first * H + i], 1e-13 * (1.0 + fabs(oa[first * H + i])));
    first += t4[r];
    free(o4[r]);
  }
  tw_routing_destroy(r1);
  tw_routing_destroy(r1x);
  tw_routing_destroy(r4);
  free(w1);
  free(w2a);
  free(w2b);
  free(w2s);
  free(w2x);
  free(x);
  free(oa);
  free(ob);
  free(os);
  free(ox);
}

/* The fp32 GEMM2 + combine stays within the proven bound of the double one, and is not simply
 * equal to it (the comparison can see rounding). */
static void test_fp32_within_bound(void) {
  uint64_t s = tw_test_seed ^ 0x4444;
  const int32_t W = 3, H = 40, F = 64, E = 6, K = 3;
  tw_problem p = small_problem(W, H, F, E, K);
  int32_t tokens[3] = {9, 0, 13};
  tw_routing_t rt = tw_test_random_routing(&p, tokens, &s, 0);
  float* w2 = (float*)malloc(sizeof(float) * E * H * F);
  fill(&s, w2, (size_t)E * H * F, 1.0f);
  float* h[3];
  float* of[3];
  double *od[3], *mag[3];
  for (int r = 0; r < W; r++) {
    h[r] = (float*)malloc(sizeof(float) * (tokens[r] * K * F + 1));
    fill(&s, h[r], (size_t)tokens[r] * K * F, 2.0f);
    of[r] = (float*)malloc(sizeof(float) * (tokens[r] * H + 1));
    od[r] = (double*)malloc(sizeof(double) * (tokens[r] * H + 1));
    mag[r] = (double*)malloc(sizeof(double) * (tokens[r] * H + 1));
  }
  CHECK_OK(tw__ref_gemm2_combine_f32(rt, (const float* const*)h, w2, of));
  CHECK_OK(tw__ref_gemm2_combine(rt, (const float* const*)h, w2, od, mag));
  /* A missing output row of a rank with tokens is an error, not a crash. */
  float* of_missing[3] = {NULL, of[1], of[2]};
  CHECK_STATUS(tw__ref_gemm2_combine_f32(rt, (const float* const*)h, w2, of_missing),
               TW_ERR_NULL_POINTER);
  double bound = tw__ref_fp32_error_bound(F, K), worst = 0.0;
  int differs = 0;
  for (int r = 0; r < W; r++)
    for (int32_t i = 0; i < tokens[r] * H; i++) {
      double err = fabs((double)of[r][i] - od[r][i]);
      differs |= err > 0.0;
      CHECKF(err <= bound * mag[r][i], "rank %d elem %d: err %.3g > %.3g", r, i, err,
             bound * mag[r][i]);
      if (mag[r][i] > 0) worst = fmax(worst, err / mag[r][i]);
    }
  CHECK(differs);
  printf("  fp32 vs double: worst |err|/mag %.3g, bound %.3g\n", worst, bound);
  /* The same h fed through the GEMM2 building block in double agrees with the combine. */
  double hd[64], y[40];
  for (int32_t f = 0; f < F; f++) hd[f] = h[0][f];
  int32_t e0 = rt->expert_ids[0][0];
  tw__ref_expert_gemm2(H, F, hd, w2 + (size_t)e0 * H * F, y);
  /* Token 0's other slots, subtracted, leave slot 0's weighted row. */
  for (int32_t n = 0; n < H; n++) {
    double rest = 0.0;
    for (int32_t j = 1; j < K; j++) {
      int32_t e = rt->expert_ids[0][j];
      double dot = 0.0;
      for (int32_t f = 0; f < F; f++)
        dot += (double)h[0][j * F + f] * w2[((size_t)e * H + n) * F + f];
      rest += (double)rt->weights[0][j] * dot;
    }
    CHECK_NEAR(od[0][n] - rest, (double)rt->weights[0][0] * y[n], 1e-12);
  }
  tw_routing_destroy(rt);
  for (int r = 0; r < W; r++) {
    free(h[r]);
    free(of[r]);
    free(od[r]);
    free(mag[r]);
  }
  free(w2);
}

/* The layer as the kernels round it (tw__ref_moe_token_bf16 / tw__ref_moe_layer_bf16): a hand
 * case whose two roundings are worked out below, then agreement with the unrounded double layer
 * within the roundings' size (and not closer than that: the roundings are there). */
static void test_layer_bf16(void) {
  /* H = 2, F = 1, two experts, one token of weights (0.25, 0.75) on both.
   * Expert 0: gate (1, 0) . x = 1, up (0, 1) . x = 2: h = 2 silu(1) = 1.46211... -> bf16
   * 1.4609375 (59/128 past 1); w2 (1, -1): y = (1.4609375, -1.4609375), exact.
   * Expert 1: gate (1, 1) . x = 3, up (1, -1) . x = -1: h = -silu(3) = -2.85772... -> bf16
   * -2.859375 (55/64 past 2); w2 (2, 0.5): y = (-5.71875, -1.4296875), exact. */
  const float xf[2] = {1.0f, 2.0f};
  const float w13f[8] = {1, 0, 0, 1, /* expert 0: gate; up */ 1, 1, 1, -1 /* expert 1 */};
  const float w2f[4] = {1, -1, /* expert 0: (H, F) */ 2, 0.5f};
  uint16_t x[2], w13[8], w2[4];
  for (int i = 0; i < 2; i++) x[i] = tw__ref_f32_to_bf16(xf[i]);
  for (int i = 0; i < 8; i++) w13[i] = tw__ref_f32_to_bf16(w13f[i]);
  for (int i = 0; i < 4; i++) w2[i] = tw__ref_f32_to_bf16(w2f[i]);
  const int32_t ids[2] = {0, 1};
  const float wts[2] = {0.25f, 0.75f};
  double o[2] = {NAN, NAN};
  CHECK_OK(tw__ref_moe_token_bf16(2, 1, 2, 2, x, ids, wts, w13, w2, o));
  CHECK_NEAR(o[0], 0.25 * 1.4609375 + 0.75 * -5.71875, 1e-15);
  CHECK_NEAR(o[1], 0.25 * -1.4609375 + 0.75 * -1.4296875, 1e-15);
  const int32_t bad_ids[2] = {0, 2};
  CHECK_STATUS(tw__ref_moe_token_bf16(2, 1, 2, 2, x, bad_ids, wts, w13, w2, o), TW_ERR_EXPERT_ID);

  /* Random layer over two ranks: against tw__ref_moe_layer on the same (bf16) values. */
  uint64_t s = tw_test_seed ^ 0x7777;
  const int32_t W = 2, H = 32, F = 16, E = 4, K = 2;
  tw_problem p = small_problem(W, H, F, E, K);
  int32_t tokens[2] = {5, 3};
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 5, tw_test_seed, &rt));
  tw_routing_t rt2 = NULL;
  {
    const int32_t* id_r[2];
    const float* w_r[2];
    for (int r = 0; r < W; r++) {
      int32_t n = 0;
      CHECK_OK(tw_routing_rank(rt, r, &n, &id_r[r], &w_r[r]));
    }
    CHECK_OK(tw_routing_create(&p, tokens, id_r, w_r, &rt2));
  }
  const size_t n13 = (size_t)E * 2 * F * H, n2 = (size_t)E * H * F;
  float* w13r = (float*)malloc(sizeof(float) * n13);
  float* w2r = (float*)malloc(sizeof(float) * n2);
  uint16_t* w13b = (uint16_t*)malloc(2 * n13);
  uint16_t* w2b = (uint16_t*)malloc(2 * n2);
  fill(&s, w13r, n13, 0.5f);
  fill(&s, w2r, n2, 0.5f);
  /* The float operands of the double layer are the bf16 values exactly. */
  for (size_t i = 0; i < n13; i++) {
    w13b[i] = tw__ref_f32_to_bf16(w13r[i]);
    w13r[i] = tw__ref_bf16_to_f32(w13b[i]);
  }
  for (size_t i = 0; i < n2; i++) {
    w2b[i] = tw__ref_f32_to_bf16(w2r[i]);
    w2r[i] = tw__ref_bf16_to_f32(w2b[i]);
  }
  float* xr[2];
  uint16_t* xb[2];
  double *od[2], *ob[2];
  for (int r = 0; r < W; r++) {
    const size_t n = (size_t)tokens[r] * H;
    xr[r] = (float*)malloc(sizeof(float) * n);
    xb[r] = (uint16_t*)malloc(2 * n);
    fill(&s, xr[r], n, 1.0f);
    for (size_t i = 0; i < n; i++) {
      xb[r][i] = tw__ref_f32_to_bf16(xr[r][i]);
      xr[r][i] = tw__ref_bf16_to_f32(xb[r][i]);
    }
    od[r] = (double*)malloc(sizeof(double) * n);
    ob[r] = (double*)malloc(sizeof(double) * n);
  }
  if (rt2 != NULL) {
    CHECK_OK(tw__ref_moe_layer(&p, NULL, (const float* const*)xr, NULL, rt2, w13r, w2r, od));
    CHECK_OK(tw__ref_moe_layer_bf16(rt2, H, F, (const uint16_t* const*)xb, w13b, w2b, ob));
    double num = 0.0, den = 0.0;
    for (int r = 0; r < W; r++)
      for (int32_t i = 0; i < tokens[r] * H; i++) {
        num += (od[r][i] - ob[r][i]) * (od[r][i] - ob[r][i]);
        den += od[r][i] * od[r][i];
      }
    const double rel = sqrt(num / den);
    /* Two roundings of relative size <= 2^-9 each: well below 1e-2, and not zero. */
    CHECKF(den > 0 && rel < 1e-2 && rel > 1e-6, "normwise relative difference %.3e", rel);
    /* The token function is the layer function's row. */
    double row[32];
    const int32_t* id1 = NULL;
    const float* w1 = NULL;
    int32_t n1 = 0;
    CHECK_OK(tw_routing_rank(rt2, 1, &n1, &id1, &w1));
    CHECK_OK(
        tw__ref_moe_token_bf16(H, F, E, K, xb[1] + 2 * H, id1 + 2 * K, w1 + 2 * K, w13b, w2b, row));
    CHECK(memcmp(row, ob[1] + 2 * H, sizeof row) == 0);
  }
  tw_routing_destroy(rt);
  tw_routing_destroy(rt2);
  for (int r = 0; r < W; r++) {
    free(xr[r]);
    free(xb[r]);
    free(od[r]);
    free(ob[r]);
  }
  free(w13r);
  free(w2r);
  free(w13b);
  free(w2b);
}

static void test_bf16_conversions(void) {
  CHECK(tw__ref_f32_to_bf16(1.0f) == 0x3f80);
  CHECK(tw__ref_f32_to_bf16(-2.0f) == 0xc000);
  CHECK(tw__ref_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);            /* tie -> even (down) */
  CHECK(tw__ref_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);        /* tie -> even (up) */
  CHECK(tw__ref_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81); /* above the tie */
  CHECK(tw__ref_f32_to_bf16(INFINITY) == 0x7f80);
  CHECK(isnan(tw__ref_bf16_to_f32(tw__ref_f32_to_bf16(NAN))));
  CHECK(tw__ref_bf16_to_f32(0x3fc0) == 1.5f);
  uint64_t s = tw_test_seed ^ 0x5555;
  for (int i = 0; i < 1000; i++) {
    float v = 100.0f * tw_test_rng_sym(&s);
    float b = tw__ref_bf16_to_f32(tw__ref_f32_to_bf16(v));
    CHECK(fabsf(b - v) <= fabsf(v) * 0x1p-8f);
    CHECK(tw__ref_f32_to_bf16(b) == tw__ref_f32_to_bf16(v)); /* idempotent */
  }
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_hand_case), TW_TEST(test_route_properties),
             TW_TEST(test_router_vs_given_routing), TW_TEST(test_linearity_and_distribution),
             TW_TEST(test_fp32_within_bound), TW_TEST(test_bf16_conversions),
             TW_TEST(test_layer_bf16))
