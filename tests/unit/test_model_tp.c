/*
 * test_model_tp.c: the first paper's model (tw_tp_select) against T(C) tables computed by hand
 * from equations (2)-(18), plus its input checks and the eq. (18) tie breaker on random
 * workloads.
 */
#include <stdint.h>

#include "tilewave.h"
#include "tw_test.h"

/* A small machine: G = 10 SMs, one CTA per SM for both roles. rho_ref = 1 and the reference
 * K / tile / D make rho = 1 unless a test rescales it. */
static tw_hardware small_hw(int32_t c_max, double rho_ref) {
  tw_hardware hw;
  tw_hardware_default(&hw);
  hw.sm_count = 10;
  hw.occ_comp = 1;
  hw.occ_comm = 1;
  hw.c_max = c_max;
  hw.rho_ref = rho_ref;
  return hw;
}

static tw_tp_workload base_workload(const int64_t* rows, int32_t experts) {
  tw_tp_workload w = {0};
  w.m = 4096;
  w.n = 512;
  w.k = 352;
  w.splits = 2;
  w.ranks = 4;
  w.experts = experts;
  w.expert_rows = rows;
  w.tm = w.tn = 128;
  w.tm_comm = w.tn_comm = 128;
  return w;
}

/* Two splits, a compute-wave boundary that makes large C lose.
 *   N/L = 256 columns: 2 compute column tiles, 2 communication column tiles.
 *   M_e = {1000, 300}: ceil(1000/128) + ceil(300/128) = 8 + 3 = 11 row tiles -> W_comp = 22.
 *   W_comm = ceil(ceil(4096/4)/128) * 2 = 8 * 2 = 16.   rho = 1.
 *   C  P  V_comm=q  A_0=ceil(22/P) A_1=ceil(44/P)  F_0          F_1 = T   V_comp  Delta
 *   1  9  16        3              5               3+16=19      19+16=35  3       27-22=5
 *   2  8   8        3              6               3+8=11       11+8=19   3       24-22=2
 *   3  7   6        4              7               4+6=10       10+6=16   4       28-22=6
 *   4  6   4        4              8               4+4=8        8+4=12    4       24-22=2
 *   5  5   4        5              9               5+4=9        9+4=13    5       25-22=3
 *   6  4   3        6              11              6+3=9        11+3=14   6       24-22=2
 * Best: C = 4 (T = 12). */
static void test_two_splits_table(void) {
  int64_t rows[2] = {1000, 300};
  tw_tp_workload w = base_workload(rows, 2);
  tw_hardware hw = small_hw(6, 1.0);
  double t[6];
  int32_t c = 0;
  CHECK_OK(tw_tp_select(&w, &hw, &c, t));
  const double expect[6] = {35, 19, 16, 12, 13, 14};
  for (int i = 0; i < 6; i++)
    CHECKF(t[i] == expect[i], "T(%d) = %g, expected %g", i + 1, t[i], expect[i]);
  CHECK(c == 4);
  /* Limiting the candidates to C <= 3 moves the choice to the best of those. */
  hw.c_max = 3;
  CHECK_OK(tw_tp_select(&w, &hw, &c, NULL));
  CHECK(c == 3);
}

/* One split, a plateau T = 6 over C = 2..5 that eq. (18) breaks.
 *   N = 128: 1 column tile for both tiles. M_e = 3195: ceil(3195/128) = 25 -> W_comp = 25.
 *   W_comm = ceil(ceil(2048/4)/128) * 1 = 4.  rho = 1.
 *   C  P  A_0=ceil(25/P)  V_comm  T = A_0 + V_comm  Delta = ceil(25/P) P - 25
 *   1  9  3               4       7                 27-25 = 2
 *   2  8  4               2       6                 32-25 = 7
 *   3  7  4               2       6                 28-25 = 3
 *   4  6  5               1       6                 30-25 = 5
 *   5  5  5               1       6                 25-25 = 0
 *   6  4  7               1       8                 28-25 = 3
 * Plateau at 6 for C = 2..5; fewest empty slots: C = 5. */
static void test_plateau_tie_breaker(void) {
  int64_t rows[1] = {3195};
  tw_tp_workload w = base_workload(rows, 1);
  w.m = 2048;
  w.n = 128;
  w.splits = 1;
  tw_hardware hw = small_hw(6, 1.0);
  double t[6];
  int32_t c = 0;
  CHECK_OK(tw_tp_select(&w, &hw, &c, t));
  const double expect[6] = {7, 6, 6, 6, 6, 8};
  for (int i = 0; i < 6; i++)
    CHECKF(t[i] == expect[i], "T(%d) = %g, expected %g", i + 1, t[i], expect[i]);
  CHECK(c == 5);
  /* With C <= 4 the plateau is C = 2..4 with Delta 7, 3, 5: C = 3. */
  hw.c_max = 4;
  CHECK_OK(tw_tp_select(&w, &hw, &c, NULL));
  CHECK(c == 3);
}

/* Equal T and equal Delta: the smaller C wins.
 *   M_e = 3072 -> 24 row tiles, N = 128 -> W_comp = 24; W_comm = 4 as above; rho = 1.
 *   C  P  A_0=ceil(24/P)  V_comm  T   Delta
 *   1  9  3               4       7   27-24 = 3
 *   2  8  3               2       5   24-24 = 0
 *   3  7  4               2       6   28-24 = 4
 *   4  6  4               1       5   24-24 = 0
 * T = 5 at C = 2 and 4, both Delta 0: C = 2. */
static void test_full_tie_smaller_c(void) {
  int64_t rows[1] = {3072};
  tw_tp_workload w = base_workload(rows, 1);
  w.m = 2048;
  w.n = 128;
  w.splits = 1;
  tw_hardware hw = small_hw(4, 1.0);
  double t[4];
  int32_t c = 0;
  CHECK_OK(tw_tp_select(&w, &hw, &c, t));
  const double expect[4] = {7, 5, 6, 5};
  for (int i = 0; i < 4; i++)
    CHECKF(t[i] == expect[i], "T(%d) = %g, expected %g", i + 1, t[i], expect[i]);
  CHECK(c == 2);
}

/* rho rescaling (eq. (15)-(16)): rho_ref 10.05, K = 704, 128x256 tiles, D = 2:
 *   rho = 10.05 * (352/704) * (128*128/(128*256)) * (2/4) = 10.05 / 8 = 1.25625.
 *   M_e = 1152 -> 9 row tiles; N = 256, TN = 256 -> 1 column tile: W_comp = 9.
 *   W_comm = ceil(ceil(1024/2)/128) * ceil(256/128) = 4 * 2 = 8.
 *   C = 1: P = 9, A = 1, V_comm = 8: T = 1 + 8 rho = 11.05
 *   C = 2: P = 8, A = 2, V_comm = 4: T = 2 + 4 rho = 7.025  -> C = 2.
 * Also occupancy: occ_comm = 2, occ_comp = 2 on G = 10 gives R(1) = R(2) = 1, P = 18:
 *   C = 1: A = ceil(9/18) = 1, T = 1 + 8 rho = 11.05; C = 2: A = 1, T = 1 + 4 rho = 6.025. */
static void test_rho_and_occupancy(void) {
  int64_t rows[1] = {1152};
  tw_tp_workload w = base_workload(rows, 1);
  w.m = 1024;
  w.n = 256;
  w.k = 704;
  w.splits = 1;
  w.ranks = 2;
  w.tn = 256;
  tw_hardware hw = small_hw(2, 10.05);
  double t[2];
  int32_t c = 0;
  CHECK_OK(tw_tp_select(&w, &hw, &c, t));
  CHECK_NEAR(t[0], 11.05, 1e-12);
  CHECK_NEAR(t[1], 7.025, 1e-12);
  CHECK(c == 2);
  hw.occ_comp = 2;
  hw.occ_comm = 2;
  CHECK_OK(tw_tp_select(&w, &hw, &c, t));
  CHECK_NEAR(t[0], 11.05, 1e-12);
  CHECK_NEAR(t[1], 6.025, 1e-12);
  CHECK(c == 2);
}

static void test_invalid_inputs(void) {
  int64_t rows[2] = {1000, 300};
  tw_hardware hw = small_hw(4, 1.0);
  int32_t c = 0;
  tw_tp_workload w = base_workload(rows, 2);
  CHECK_STATUS(tw_tp_select(NULL, &hw, &c, NULL), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw_tp_select(&w, NULL, &c, NULL), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw_tp_select(&w, &hw, NULL, NULL), TW_ERR_NULL_POINTER);
  w.m = 0;
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_SIZE);
  w = base_workload(rows, 2);
  w.splits = 0;
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_SIZE);
  w.splits = 513; /* more splits than columns */
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_SIZE);
  w = base_workload(rows, 2);
  w.tn_comm = 0;
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_SIZE);
  w = base_workload(NULL, 2);
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_NULL_POINTER);
  int64_t neg[2] = {1000, -1};
  w = base_workload(neg, 2);
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_SIZE);
  w = base_workload(rows, 2);
  hw.c_max = 10; /* would leave the producer no SM */
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_ARGUMENT);
  hw = small_hw(4, 0.0); /* rho must be positive */
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_INVALID_ARGUMENT);
  hw = small_hw(4, 1.0);
  hw.magic = 0;
  CHECK_STATUS(tw_tp_select(&w, &hw, &c, NULL), TW_ERR_CONFIG_VERSION);
}

/* Random workloads on the H200 description: the choice has the smallest T, and among the
 * candidates within rounding of it, the fewest empty compute slots (recomputed here), then the
 * smallest C. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static void test_random_choice_is_argmin(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  hw.c_max = 16;
  for (int iter = 0; iter < 500; iter++) {
    int64_t rows[64];
    tw_tp_workload w = {0};
    w.experts = 1 + (int32_t)(rng() % 64);
    for (int e = 0; e < w.experts; e++) rows[e] = (int64_t)(rng() % 3000);
    w.expert_rows = rows;
    w.m = 1 + (int64_t)(rng() % 65536);
    w.n = 128 * (1 + (int32_t)(rng() % 64));
    w.k = 64 * (1 + (int32_t)(rng() % 64));
    w.splits = 1 + (int32_t)(rng() % 4);
    w.ranks = 1 + (int32_t)(rng() % 8);
    w.tm = 128;
    w.tn = 128 << (rng() % 2);
    w.tm_comm = w.tn_comm = 128;
    double t[16];
    int32_t c = 0;
    CHECK_OK(tw_tp_select(&w, &hw, &c, t));
    double tmin = t[0];
    for (int i = 1; i < 16; i++) tmin = fmin(tmin, t[i]);
    int64_t wcomp = 0;
    for (int e = 0; e < w.experts; e++) wcomp += (rows[e] + w.tm - 1) / w.tm;
    wcomp *= ((w.n + w.splits - 1) / w.splits + w.tn - 1) / w.tn;
    int32_t expect = 0;
    int64_t best_delta = 0;
    for (int cc = 1; cc <= 16; cc++) {
      if (fabs(t[cc - 1] - tmin) > 1e-12 * tmin) continue;
      int64_t p = (int64_t)hw.occ_comp * (hw.sm_count - (cc + hw.occ_comm - 1) / hw.occ_comm);
      int64_t delta = (wcomp + p - 1) / p * p - wcomp;
      if (expect == 0 || delta < best_delta) {
        expect = cc;
        best_delta = delta;
      }
    }
    CHECKF(c == expect, "iteration %d: chose %d, expected %d", iter, c, expect);
  }
}

/* The plain recurrence of eq. (2)-(13) with 64-bit integer divisions, written as in the paper:
 * tw_tp_select computes its ceilings differently (shifts, floating-point quotients) and must
 * give the same T bit for bit. */
static void plain_t(const tw_tp_workload* w, const tw_hardware* hw, double* t) {
#define CDIV(a, b) (((a) + (b)-1) / (b))
  const int64_t split_cols = CDIV((int64_t)w->n, (int64_t)w->splits);
  int64_t row_tiles = 0;
  for (int e = 0; e < w->experts; e++) row_tiles += CDIV(w->expert_rows[e], (int64_t)w->tm);
  const int64_t w_comp = row_tiles * CDIV(split_cols, (int64_t)w->tn);
  const int64_t w_comm = CDIV(CDIV(w->m, (int64_t)w->ranks), (int64_t)w->tm_comm) *
                         CDIV(split_cols, (int64_t)w->tn_comm);
  const double rho = hw->rho_ref * (352.0 / (double)w->k) *
                     (128.0 * 128.0 / ((double)w->tm * (double)w->tn)) * ((double)w->ranks / 4.0);
  for (int32_t c = 1; c <= hw->c_max; c++) {
    const int64_t p =
        (int64_t)hw->occ_comp * (hw->sm_count - CDIV((int64_t)c, (int64_t)hw->occ_comm));
    const double q = rho * (double)CDIV(w_comm, (int64_t)c);
    double f = 0.0;
    for (int32_t s = 0; s < w->splits; s++)
      f = fmax((double)CDIV((int64_t)(s + 1) * w_comp, p), f) + q;
    t[c - 1] = f;
  }
#undef CDIV
}

/* Random workloads and machines, tile heights that are and are not powers of two, and sizes
 * large enough to take the integer-division fallback: T equals the plain recurrence exactly. */
static void test_random_equals_plain(void) {
  for (int iter = 0; iter < 2000; iter++) {
    tw_hardware hw;
    CHECK_OK(tw_hardware_default(&hw));
    hw.sm_count = 8 + (int32_t)(rng() % 200);
    hw.occ_comp = 1 + (int32_t)(rng() % 4);
    hw.occ_comm = 1 + (int32_t)(rng() % 4);
    hw.c_max = 1 + (int32_t)(rng() % (uint64_t)((hw.sm_count - 1) * hw.occ_comm));
    hw.rho_ref = 0.5 + (double)(rng() % 1000) / 50.0;
    int64_t rows[64];
    tw_tp_workload w = {0};
    w.experts = 1 + (int32_t)(rng() % 64);
    const int big = iter % 50 == 0; /* dividends beyond the floating-point path's range */
    for (int e = 0; e < w.experts; e++)
      rows[e] = big ? (int64_t)(rng() >> 20) : (int64_t)(rng() % 5000);
    w.expert_rows = rows;
    w.m = big ? (int64_t)1 << 55 : 1 + (int64_t)(rng() % 200000);
    w.n = 64 + (int32_t)(rng() % 8192);
    w.k = 16 + (int32_t)(rng() % 8192);
    w.splits = 1 + (int32_t)(rng() % 6);
    w.ranks = 1 + (int32_t)(rng() % 16);
    const int32_t tiles[6] = {64, 128, 256, 96, 80, 192};
    w.tm = tiles[rng() % 6];
    w.tn = tiles[rng() % 6];
    w.tm_comm = big ? 1 : tiles[rng() % 6];
    w.tn_comm = tiles[rng() % 6];
    static double t[4096], want[4096];
    int32_t c = 0;
    CHECK_OK(tw_tp_select(&w, &hw, &c, t));
    plain_t(&w, &hw, want);
    int bad = 0;
    for (int32_t i = 0; i < hw.c_max; i++) bad += t[i] != want[i];
    CHECKF(bad == 0 && c >= 1 && c <= hw.c_max, "iteration %d: %d of %d T values differ (C* %d)",
           iter, bad, hw.c_max, c);
  }
}

TW_TEST_MAIN(TW_TEST(test_two_splits_table), TW_TEST(test_plateau_tie_breaker),
             TW_TEST(test_full_tie_smaller_c), TW_TEST(test_rho_and_occupancy),
             TW_TEST(test_invalid_inputs), TW_TEST(test_random_choice_is_argmin),
             TW_TEST(test_random_equals_plain))
