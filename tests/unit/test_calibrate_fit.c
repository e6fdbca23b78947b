/*
 * test_calibrate_fit.c: the fits of `tilewave calibrate` (tools/calibrate_fit.c) on synthetic data
 * generated from known parameters: exact recovery without noise, recovery within the noise's
 * reach with seeded noise, residuals that add back to the data, and the refusals (too few points,
 * collinear regressors, times that do not grow).
 */
#include <math.h>
#include <stdint.h>

#include "calibrate_fit.h"
#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"
#include "tw_test_random.h"

/* A random value in [lo, hi). */
static double rnd(uint64_t* s, double lo, double hi) {
  return lo + (hi - lo) * 0.5 * ((double)tw_test_rng_sym(s) + 1.0);
}

/* Producer: us per wave = 2 TM TN K / (tflops 1e6) + overhead, K over the presets' sizes; the fit
 * must give the parameters back to rounding, and the residuals must be y - fit. */
static void test_producer_exact(void) {
  uint64_t s = tw_test_seed ^ 0x11;
  for (int trial = 0; trial < 50; trial++) {
    const double tflops = rnd(&s, 2.0, 9.0), over = rnd(&s, 0.0, 3.0);
    const int tm = (tw_test_rng_next(&s) & 1) ? 128 : 64,
              tn = (tw_test_rng_next(&s) & 1) ? 256 : 128;
    const int n = 3 + (int)(tw_test_rng_next(&s) % 6);
    double x[16], y[16], r[16];
    for (int i = 0; i < n; i++) {
      const int k = 512 * (1 + (int)(tw_test_rng_next(&s) % 16)) + 256 * i; /* distinct K */
      x[i] = 2.0 * tm * tn * k;
      y[i] = x[i] / (tflops * 1e6) + over;
    }
    double t = 0, o = 0;
    CHECK_OK(tw__calib_fit_producer(x, y, n, &t, &o, r));
    CHECK_NEAR(t / tflops, 1.0, 1e-9);
    CHECK_NEAR(o, over, 1e-9 * (1 + y[n - 1]));
    for (int i = 0; i < n; i++) CHECK_NEAR(r[i], 0.0, 1e-9 * y[i]);
  }
}

/* With noise of amplitude a on every point, the fit is still a least-squares solution: its
 * residuals are orthogonal to both regressors, and its parameters are close to the truth. */
static void test_producer_noisy(void) {
  uint64_t s = tw_test_seed ^ 0x22;
  const double tflops = 6.0, over = 0.5;
  const int ks[5] = {1024, 1536, 2048, 3072, 4096};
  double x[5], y[5], r[5];
  for (int i = 0; i < 5; i++) {
    x[i] = 2.0 * 128 * 256 * ks[i];
    y[i] = x[i] / (tflops * 1e6) + over + 0.01 * tw_test_rng_sym(&s); /* +-10 ns per wave */
  }
  double t = 0, o = 0;
  CHECK_OK(tw__calib_fit_producer(x, y, 5, &t, &o, r));
  CHECKF(fabs(t - tflops) < 0.05, "tile_tflops %.4f, truth %.1f", t, tflops);
  CHECKF(fabs(o - over) < 0.05, "tile_overhead_us %.4f, truth %.2f", o, over);
  double dot_x = 0, dot_1 = 0, sum_y = 0;
  for (int i = 0; i < 5; i++) {
    dot_x += r[i] * x[i] / x[4];
    dot_1 += r[i];
    sum_y += fabs(y[i]);
    CHECK_NEAR(y[i] - r[i], x[i] / (t * 1e6) + o, 1e-9 * y[i]);
  }
  CHECK_NEAR(dot_x, 0.0, 1e-9 * sum_y);
  CHECK_NEAR(dot_1, 0.0, 1e-9 * sum_y);
}

/* Consumer: plans with random segment sizes, C in {1, 2, 4} and two coalescing factors; times from
 * the fit's formula (busiest CTA's bytes, per-segment latency) with known rate and latency; the
 * fit gives them back. */
static void test_link_exact(void) {
  uint64_t s = tw_test_seed ^ 0x33;
  for (int trial = 0; trial < 30; trial++) {
    const double gbps = rnd(&s, 5.0, 60.0), lat = rnd(&s, 0.2, 5.0);
    double bx[16], seg[16], us[16], r[16];
    int n = 0;
    for (int mgb = 1; mgb <= 4; mgb *= 4) {
      int64_t units[80];
      double bytes[80];
      const int nseg = (40 + (int)(tw_test_rng_next(&s) % 40)) / mgb;
      double total = 0;
      for (int k = 0; k < nseg; k++) {
        units[k] = 16 * (1 + (int64_t)(tw_test_rng_next(&s) % (uint64_t)mgb));
        bytes[k] = (double)units[k] * (double)(65536 - (int)(tw_test_rng_next(&s) % 4096));
        total += bytes[k];
      }
      for (int c = 1; c <= 4; c *= 2) {
        bx[n] = tw__calib_busiest_bytes(units, bytes, nseg, c);
        CHECK(bx[n] >= total / c - 1e-6 && bx[n] <= total);
        seg[n] = nseg;
        us[n] = bx[n] / (gbps * 1e3) + nseg * lat;
        n++;
      }
    }
    double g = 0, l = 0;
    CHECK_OK(tw__calib_fit_link(bx, seg, us, n, &g, &l, r));
    CHECK_NEAR(g / gbps, 1.0, 1e-9);
    CHECK_NEAR(l / lat, 1.0, 1e-8);
  }
}

/* busiest_bytes by hand: segments of 3 and 5 units, 300 and 1000 bytes. */
static void test_busiest_bytes(void) {
  const int64_t u[3] = {3, 5, 0};
  const double b[3] = {300, 1000, 777};
  CHECK_NEAR(tw__calib_busiest_bytes(u, b, 3, 1), 1300.0, 0);
  CHECK_NEAR(tw__calib_busiest_bytes(u, b, 3, 2), 2 * 100.0 + 3 * 200.0, 0);
  CHECK_NEAR(tw__calib_busiest_bytes(u, b, 3, 4), 100.0 + 2 * 200.0, 0);
  CHECK_NEAR(tw__calib_busiest_bytes(u, b, 3, 64), 100.0 + 200.0, 0);
  CHECK_NEAR(tw__calib_busiest_bytes(u, b, 3, 0), 0.0, 0);
  CHECK_NEAR(tw__calib_per_wave(100.0, 4, 340.0, 12), 30.0, 1e-12);
  CHECK_NEAR(tw__calib_per_wave(100.0, 4, 340.0, 4), 0.0, 0);
}

static void test_refusals(void) {
  double x[3] = {1e8, 2e8, 3e8}, one[3] = {1, 1, 1}, y[3] = {10, 20, 30}, c[2], t, o;
  CHECK_STATUS(tw__calib_lsq2(x, one, y, 1, c, NULL), TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__calib_lsq2(x, one, y, TW_CALIB_MAX_POINTS + 1, c, NULL), TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__calib_lsq2(x, NULL, y, 3, c, NULL), TW_ERR_NULL_POINTER);
  /* x2 proportional to x1: no unique answer. */
  double x2[3] = {2, 4, 6};
  CHECK_STATUS(tw__calib_lsq2(x, x2, y, 3, c, NULL), TW_ERR_INVALID_ARGUMENT);
  /* One K measured three times: slope and intercept are not separable. */
  double same[3] = {1e8, 1e8, 1e8};
  CHECK_STATUS(tw__calib_fit_producer(same, y, 3, &t, &o, NULL), TW_ERR_INVALID_ARGUMENT);
  /* Times that fall as K grows: refused, not turned into a negative throughput. */
  double down[3] = {30, 20, 10};
  CHECK_STATUS(tw__calib_fit_producer(x, down, 3, &t, &o, NULL), TW_ERR_INVALID_ARGUMENT);
  double nan_y[3] = {10, NAN, 30};
  CHECK_STATUS(tw__calib_lsq2(x, one, nan_y, 3, c, NULL), TW_ERR_INVALID_ARGUMENT);
  /* A valid call after the refusals still works. */
  CHECK_OK(tw__calib_lsq2(x, one, y, 3, c, NULL));
  CHECK_NEAR(c[0], 1e-7, 1e-18);
  CHECK_NEAR(c[1], 0.0, 1e-9);
}

/* The link measurement's own problem (2 ranks, 8192 tokens, K 2048, N 4096, 16 experts, top-2,
 * balanced, a random seed): the segments' bytes add up to the plan's send_bytes, mgb 4 has fewer
 * segments than mgb 1, and times made with the fit's formula at C <= 2 give the rate and the
 * latency back through the same fit the command runs. */
static void test_link_on_real_plans(void) {
  tw_problem p = tw_test_problem(2, 4096, 2048, 16, 2, 8192, 0, 0);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 8192, tw_test_seed, &rt));
  tw_hardware def;
  CHECK_OK(tw_hardware_default(&def));
  const double gbps = 16.0, lat = 2.7;
  double bx[16], sg[16], us[16];
  int n = 0;
  for (int rank = 0; rank < 2 && rt; rank++) {
    int32_t nseg[2] = {0, 0};
    for (int m = 0; m < 2; m++) {
      tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
      cfg.comm_ctas = 8;
      cfg.coalesce = m == 0 ? 1 : 4;
      cfg.hardware = &def;
      tw_plan_t plan = NULL;
      CHECK_OK(tw_plan_create(&p, rt, rank, &cfg, &plan));
      if (plan == NULL) continue;
      int64_t* units = NULL;
      double* bytes = NULL;
      double total = -1;
      CHECK_OK(tw__calib_plan_segments(plan, &units, &bytes, &total));
      CHECKF(total == (double)plan->send_bytes, "segments carry %.0f bytes, send_bytes %lld", total,
             (long long)plan->send_bytes);
      CHECK(total > 0);
      nseg[m] = plan->num_segments;
      for (int c = 1; c <= 2; c++) {
        bx[n] = tw__calib_busiest_bytes(units, bytes, plan->num_segments, c);
        sg[n] = plan->num_segments;
        us[n] = bx[n] / (gbps * 1e3) + sg[n] * lat;
        n++;
      }
      free(units);
      free(bytes);
      tw_plan_destroy(plan);
    }
    CHECKF(nseg[1] < nseg[0], "rank %d: %d segments at mgb 4, %d at mgb 1", rank, nseg[1], nseg[0]);
  }
  double g = 0, l = 0;
  CHECK_OK(tw__calib_fit_link(bx, sg, us, n, &g, &l, NULL));
  CHECK_NEAR(g, gbps, 1e-6);
  CHECK_NEAR(l, lat, 1e-6);
  tw_routing_destroy(rt);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_producer_exact),
             TW_TEST(test_producer_noisy), TW_TEST(test_link_exact),
             TW_TEST(test_link_on_real_plans), TW_TEST(test_busiest_bytes), TW_TEST(test_refusals))
