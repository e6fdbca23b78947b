/*
 * test_oracle.c: the summary arithmetic of `tilewave sweep --oracle` (harness/oracle.c) on
 * hand-computed matrices (regret, best fixed candidate, losses, NaN candidates, a model outside the
 * grid, ties), properties on seeded random matrices, and the workload matrices themselves (sizes,
 * valid problems on 2 ranks, quick a subset of full). TW_TEST_SEED replays a run.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "oracle.h"
#include "plan.h" /* tw__preset_from_papers */
#include "tilewave.h"
#include "tw_test.h"

/* 3 points x 3 candidates. Candidate 2 was not measured at point 1 (NaN), so it cannot be the
 * fixed choice; at point 2 the model's choice lies outside the grid and is the oracle.
 *   p0: t = {100, 110, 120}, model 110: oracle 100, regret 0.10
 *   p1: t = {200, 180, NaN}, model 180: oracle 180, regret 0
 *   p2: t = {150, 160, 140}, model 130: oracle 130, regret 0
 * fixed 0: regrets 0, 20/180, 20/130 -> mean 0.0883190, max 0.1538462
 * fixed 1: regrets 0.1, 0, 30/130 -> mean 0.1102564: fixed 0 wins.
 * model slower than fixed 0: p0 only (110 > 100; also by more than 1%). */
static void test_hand_computed(void) {
  const double t[9] = {100, 110, 120, 200, 180, NAN, 150, 160, 140};
  const double tm[3] = {110, 180, 130};
  tw__oracle_summary s;
  CHECK(tw__oracle_summarize(t, 3, 3, tm, NULL, &s) == 0);
  CHECK(s.points == 3);
  CHECK_NEAR(s.mean_regret, 0.1 / 3, 1e-12);
  CHECK_NEAR(s.max_regret, 0.1, 1e-12);
  CHECK(s.max_regret_point == 0);
  CHECK(s.fixed == 0);
  CHECK_NEAR(s.fixed_mean_regret, (0.0 + 20.0 / 180 + 20.0 / 130) / 3, 1e-12);
  CHECK_NEAR(s.fixed_mean_regret, 0.0883190, 1e-7);
  CHECK_NEAR(s.fixed_max_regret, 20.0 / 130, 1e-12);
  CHECK(s.model_slower == 1);
  CHECK(s.model_slower_1pct == 1);
  CHECK_NEAR(tw__oracle_regret(110, 100), 0.1, 1e-12);
  CHECK_NEAR(tw__oracle_regret(96, 80), 0.2, 1e-12);
}

/* Ties between fixed candidates go to the lower index; a loss within 1% counts only as strict.
 *   p0: t = {100, 100}, model 100.5: regret 0.005; p1: t = {100, 100}, model 100: regret 0. */
static void test_ties_and_small_losses(void) {
  const double t[4] = {100, 100, 100, 100};
  const double tm[2] = {100.5, 100};
  tw__oracle_summary s;
  CHECK(tw__oracle_summarize(t, 2, 2, tm, NULL, &s) == 0);
  CHECK_NEAR(s.mean_regret, 0.0025, 1e-12);
  CHECK_NEAR(s.max_regret, 0.005, 1e-12);
  CHECK(s.max_regret_point == 0);
  CHECK(s.fixed == 0);
  CHECK_NEAR(s.fixed_mean_regret, 0.0, 1e-15);
  CHECK(s.model_slower == 1);
  CHECK(s.model_slower_1pct == 0);
}

/* No candidate measured everywhere: no fixed choice, the model's regret still summarised. */
static void test_no_fixed_candidate(void) {
  const double t[4] = {NAN, 90, 120, NAN};
  const double tm[2] = {100, 120};
  tw__oracle_summary s;
  CHECK(tw__oracle_summarize(t, 2, 2, tm, NULL, &s) == 0);
  CHECK(s.fixed == -1);
  CHECK_NEAR(s.mean_regret, (10.0 / 90) / 2, 1e-12);
  CHECK(s.model_slower == 0);
}

/* The other configuration joins the oracle but is no fixed choice; NaN means not measured.
 *   p0: t = {100, 110}, model 105, other 90: oracle 90, regret 15/90; fixed 0 regret 10/90
 *   p1: t = {100, 90}, model 90, other NaN: oracle 90, regret 0; fixed 0 regret 10/90
 * fixed 0: mean 10/90; fixed 1: 20/90 and 0, mean 10/90: the tie goes to fixed 0. */
static void test_other_configuration(void) {
  const double t[4] = {100, 110, 100, 90};
  const double tm[2] = {105, 90};
  const double other[2] = {90, NAN};
  tw__oracle_summary s;
  CHECK(tw__oracle_summarize(t, 2, 2, tm, other, &s) == 0);
  CHECK_NEAR(s.mean_regret, (15.0 / 90) / 2, 1e-12);
  CHECK_NEAR(s.max_regret, 15.0 / 90, 1e-12);
  CHECK(s.fixed == 0);
  CHECK_NEAR(s.fixed_mean_regret, 10.0 / 90, 1e-12);
  CHECK(s.model_slower == 1);                             /* p0: 105 > 100 */
  CHECK(s.other_faster == 1 && s.other_faster_1pct == 1); /* p0: 90 < 105; p1 not measured */
  /* Faster by less than 1%: 104.5 x 1.01 = 105.545 > 105. */
  const double close[2] = {104.5, 95};
  CHECK(tw__oracle_summarize(t, 2, 2, tm, close, &s) == 0);
  CHECK(s.other_faster == 1 && s.other_faster_1pct == 0);
  CHECK(tw__oracle_summarize(t, 2, 2, tm, NULL, &s) == 0);
  CHECK(s.other_faster == 0 && s.other_faster_1pct == 0);
}

/* Order statistics as numpy.percentile: {5, 1, 3, 2, 4}: median 3, p99 = 4 + 0.96 (5 - 4). */
static void test_percentile(void) {
  double v[5] = {5, 1, 3, 2, 4};
  CHECK_NEAR(tw__oracle_percentile(v, 5, 0.5), 3.0, 1e-12);
  CHECK_NEAR(tw__oracle_percentile(v, 5, 0.99), 4.96, 1e-12);
  CHECK(v[0] == 1 && v[4] == 5); /* sorted in place */
  double w[4] = {0.8, 0.2, 0.6, 0.4};
  CHECK_NEAR(tw__oracle_percentile(w, 4, 0.5), 0.5, 1e-12);
  CHECK_NEAR(tw__oracle_percentile(w, 4, 0.0), 0.2, 1e-12);
  CHECK_NEAR(tw__oracle_percentile(w, 4, 1.0), 0.8, 1e-12);
  double one = 7.25;
  CHECK(tw__oracle_percentile(&one, 1, 0.99) == 7.25);
  CHECK(isnan(tw__oracle_percentile(w, 0, 0.5)));
}

/* The median's order-statistic interval: n = 31 at 95% takes the 10th and 22nd values (coverage
 * 1 - 2 P(B(31, 1/2) <= 9) = 0.970551); n = 6 the extremes (0.96875); n = 5 is too few. */
static void test_median_ci(void) {
  double v[31], med, lo, hi;
  for (int i = 0; i < 31; i++) v[i] = (double)((i * 17) % 31); /* 0..30, shuffled */
  CHECK_NEAR(tw__oracle_median_ci(v, 31, 0.95, &med, &lo, &hi), 0.9705506, 1e-6);
  CHECK(med == 15 && lo == 9 && hi == 21);
  double w[6] = {6, 1, 5, 2, 4, 3};
  CHECK_NEAR(tw__oracle_median_ci(w, 6, 0.95, &med, &lo, &hi), 0.96875, 1e-12);
  CHECK(med == 3.5 && lo == 1 && hi == 6);
  double u[5] = {1, 2, 3, 4, 5};
  CHECK(tw__oracle_median_ci(u, 5, 0.95, &med, &lo, &hi) == 1.0);
  CHECK(med == 3 && isinf(lo) && lo < 0 && isinf(hi) && hi > 0);
  /* A lower confidence narrows the interval. */
  for (int i = 0; i < 31; i++) v[i] = i;
  CHECK(tw__oracle_median_ci(v, 31, 0.5, &med, &lo, &hi) < 0.9);
  CHECK(lo > 9 && hi < 21 && lo <= med && med <= hi);
  CHECK(isnan(tw__oracle_median_ci(v, 0, 0.95, &med, &lo, &hi)) && isnan(med));
  CHECK(isnan(tw__oracle_median_ci(v, 31, 1.0, &med, &lo, &hi)));
  CHECK(isnan(tw__oracle_median_ci(NULL, 31, 0.95, &med, &lo, &hi)));
}

static void test_bad_input(void) {
  const double t[2] = {1, 2};
  double tm[1] = {1};
  tw__oracle_summary s;
  CHECK(tw__oracle_summarize(t, 0, 2, tm, NULL, &s) == -1);
  CHECK(tw__oracle_summarize(t, 1, 0, tm, NULL, &s) == -1);
  CHECK(tw__oracle_summarize(NULL, 1, 2, tm, NULL, &s) == -1);
  CHECK(tw__oracle_summarize(t, 1, 2, NULL, NULL, &s) == -1);
  CHECK(tw__oracle_summarize(t, 1, 2, tm, NULL, NULL) == -1);
  tm[0] = NAN;
  CHECK(tw__oracle_summarize(t, 1, 2, tm, NULL, &s) == -1);
  tm[0] = 0;
  CHECK(tw__oracle_summarize(t, 1, 2, tm, NULL, &s) == -1);
}

static uint64_t rng_state;
static double uniform(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}

/* Seeded random matrices: a model that always picks its row's minimum has zero regret and never
 * loses; a model that always picks one column j has exactly that column's regrets, so the best
 * fixed candidate's mean regret is at most the model's, and the model loses on no point where it
 * equals the fixed choice. */
static void test_random_properties(void) {
  const char* env = getenv("TW_TEST_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
  printf("  seed %llu (TW_TEST_SEED replays it)\n", (unsigned long long)seed);
  rng_state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int trial = 0; trial < 200; trial++) {
    const int np = 1 + (int)(uniform() * 20), nc = 1 + (int)(uniform() * 40);
    double* t = malloc(sizeof(double) * (size_t)np * (size_t)nc);
    double* tm = malloc(sizeof(double) * (size_t)np);
    CHECK(t != NULL && tm != NULL);
    if (!t || !tm) return;
    for (int i = 0; i < np * nc; i++) t[i] = 50 + 5000 * uniform();
    for (int p = 0; p < np; p++) {
      tm[p] = INFINITY;
      for (int j = 0; j < nc; j++)
        if (t[p * nc + j] < tm[p]) tm[p] = t[p * nc + j];
    }
    tw__oracle_summary s;
    CHECK(tw__oracle_summarize(t, np, nc, tm, NULL, &s) == 0);
    CHECK(s.mean_regret == 0 && s.max_regret == 0);
    CHECK(s.fixed >= 0 && s.fixed < nc);
    CHECK(s.model_slower == 0);
    CHECK(s.fixed_mean_regret >= 0 && s.fixed_max_regret >= s.fixed_mean_regret);

    const int j = (int)(uniform() * nc);
    double mean = 0, mx = -1;
    for (int p = 0; p < np; p++) {
      tm[p] = t[p * nc + j];
      double o = INFINITY;
      for (int i = 0; i < nc; i++)
        if (t[p * nc + i] < o) o = t[p * nc + i];
      const double r = (tm[p] - o) / o;
      mean += r / np;
      if (r > mx) mx = r;
    }
    CHECK(tw__oracle_summarize(t, np, nc, tm, NULL, &s) == 0);
    CHECK_NEAR(s.mean_regret, mean, 1e-9);
    CHECK_NEAR(s.max_regret, mx, 1e-12);
    CHECK(s.fixed_mean_regret <= s.mean_regret + 1e-12);
    if (s.fixed == j) CHECK(s.model_slower == 0);
    free(t);
    free(tm);
  }
}

static int same_point(const tw__oracle_point* a, const tw__oracle_point* b) {
  return strcmp(a->name, b->name) == 0 && a->hidden == b->hidden && a->ffn == b->ffn &&
         a->experts == b->experts && a->topk == b->topk && a->tokens == b->tokens &&
         a->router == b->router;
}

static void test_matrices(void) {
  static tw__oracle_point full[TW__ORACLE_MAX_POINTS], quick[TW__ORACLE_MAX_POINTS];
  const int nf = tw__oracle_matrix("full", full, TW__ORACLE_MAX_POINTS);
  const int nq = tw__oracle_matrix("quick", quick, TW__ORACLE_MAX_POINTS);
  /* the papers' presets x 3 token counts x 3 routers + the grid's 2 x 2 x 5 x 3 */
  int papers = 0;
  for (int k = 0; k < tw_preset_count(); k++) papers += tw__preset_from_papers(k);
  CHECK(papers == 6 && papers < tw_preset_count());
  CHECK(nf == papers * 9 + 60 && nf == 114);
  CHECK(nq == 14);
  CHECK(tw__oracle_matrix("bogus", full, TW__ORACLE_MAX_POINTS) == -1);
  CHECK(tw__oracle_matrix("full", full, 10) == -1);
  CHECK(tw__oracle_matrix(NULL, full, 10) == -1);
  for (int i = 0; i < nf; i++) {
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = 2;
    p.hidden = full[i].hidden;
    p.ffn = full[i].ffn;
    p.experts = full[i].experts;
    p.top_k = full[i].topk;
    p.max_tokens = full[i].tokens;
    CHECKF(tw_problem_validate(&p) == TW_SUCCESS, "full point %d: %s", i, tw_last_error());
    for (int j = 0; j < i; j++) CHECKF(!same_point(&full[i], &full[j]), "points %d, %d", j, i);
  }
  int routers[3] = {0, 0, 0}, grid = 0;
  for (int i = 0; i < nq; i++) {
    int found = 0;
    for (int j = 0; j < nf; j++) found |= same_point(&quick[i], &full[j]);
    CHECKF(found, "quick point %d is not in the full matrix", i);
    if (quick[i].router >= 0 && quick[i].router < 3) routers[quick[i].router]++;
    grid += strcmp(quick[i].name, "grid") == 0;
  }
  CHECK(routers[0] > 0 && routers[1] > 0 && routers[2] > 0);
  CHECK(grid == 6);
  for (int k = 0; k < tw_preset_count(); k++) {
    if (!tw__preset_from_papers(k)) continue;
    int found = 0;
    for (int i = 0; i < nq; i++) found |= strcmp(quick[i].name, tw_preset_name(k)) == 0;
    CHECKF(found, "preset %s is missing from the quick matrix", tw_preset_name(k));
  }
  /* The second paper's grid is K 2048, top-2, N 4096/8192. */
  for (int i = 0; i < nf; i++)
    if (strcmp(full[i].name, "grid") == 0)
      CHECK(full[i].ffn == 2048 && full[i].topk == 2 &&
            (full[i].hidden == 4096 || full[i].hidden == 8192));
}

TW_TEST_MAIN(TW_TEST(test_hand_computed), TW_TEST(test_ties_and_small_losses),
             TW_TEST(test_other_configuration), TW_TEST(test_no_fixed_candidate),
             TW_TEST(test_percentile), TW_TEST(test_median_ci), TW_TEST(test_bad_input),
             TW_TEST(test_random_properties), TW_TEST(test_matrices))
