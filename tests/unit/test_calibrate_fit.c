/*
 * test_calibrate_fit.c: the fits of `tilewave calibrate` (tools/calibrate_fit.c) on synthetic data
 * generated from known parameters: exact recovery without noise, recovery within the noise's
 * reach with seeded noise, residuals that add back to the data, the refusals (too few points,
 * collinear regressors, times that do not grow, bad values), and the plans the command measures
 * (their remote bytes and bands, the first segment's ready wave, the second reads of remote-first).
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

/* Synthetic consumer points as the command takes them: `nprob` problems with the same bands and
 * different row widths (hidden 4096 and 1024: 8 KiB and 2 KiB rows), 2 ranks with slightly
 * different traffic, C in {1, 2, 4}; us from the model's pool term with rate gbps and latency
 * lat. Returns the point count. */
static int pool_points(uint64_t* s, double gbps, double lat, double* bytes, double* bands,
                       double* ctas, double* us) {
  const double row_bytes[2] = {8192.0, 2048.0};
  int n = 0;
  for (int rank = 0; rank < 2; rank++) {
    const double nb = (double)(60 + (int)(tw_test_rng_next(s) % 20));
    const double rows = nb * 128.0 - (double)(tw_test_rng_next(s) % 400); /* partial bands */
    for (int p = 0; p < 2; p++)
      for (int c = 1; c <= 4; c *= 2) {
        bytes[n] = rows * row_bytes[p];
        bands[n] = nb;
        ctas[n] = c;
        us[n] = (bytes[n] / (gbps * 1e3) + bands[n] * lat) / c;
        n++;
      }
  }
  return n;
}

/* Exact data: the fit gives rate and latency back to rounding, and the residuals are 0. */
/* The floor is what the model's 4-norm needs to give the measured wave: a synthetic wave built
 * from the model's formula (floor tile_floor_us x tn / 128) gives tile_floor_us back at either
 * tile width; a wave no longer than its compute gives 0. */
static void test_tile_floor(void) {
  const double tflops = 6.275, over = 0.125;
  const double floors[3] = {5.4, 2.0, 9.0};
  for (int tn = 128; tn <= 256; tn *= 2) {
    const double x = 2.0 * 128 * tn * 512; /* c = 2.674 us at tn 128 */
    for (int i = 0; i < 3; i++) {
      const double c = x / (tflops * 1e6), ft = floors[i] * tn / 128.0;
      const double y = pow(pow(c, 4) + pow(ft, 4), 0.25) + over;
      double f = -1;
      CHECK_OK(tw__calib_tile_floor(x, tn, y, tflops, over, &f));
      CHECK_NEAR(f, floors[i], 1e-9);
    }
  }
  const double x = 2.0 * 128 * 128 * 512;
  double f = -1;
  CHECK_OK(tw__calib_tile_floor(x, 128, x / (tflops * 1e6), tflops, over, &f));
  CHECK(f == 0.0);
  CHECK_STATUS(tw__calib_tile_floor(x, 128, 0.0, tflops, over, &f), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_floor(x, 0, 5.0, tflops, over, &f), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_floor(x, 128, 5.0, tflops, -1.0, &f), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_floor(x, 128, 5.0, tflops, over, NULL), TW_ERR_NULL_POINTER);
}

/* The 64-row share round trip: a wave priced by the model at share s gives s back, with and
 * without a floor; a wave inside the floor and overhead, or bad values, are refused. */
static void test_tile_share(void) {
  const double tflops = 6.275, over = 0.125, shares[3] = {0.73, 0.5, 1.0};
  for (int tn = 128; tn <= 256; tn *= 2)
    for (int i = 0; i < 3; i++)
      for (int fl = 0; fl < 2; fl++) {
        const double floor = fl ? 3.1 : 0.0, x = 2.0 * 64 * tn * 2048;
        const double c = x / (tflops * shares[i] * 1e6), ft = floor * tn / 128.0;
        const double y = pow(pow(c, 4) + pow(ft, 4), 0.25) + over;
        double s = -1;
        CHECK_OK(tw__calib_tile_share(x, tn, y, tflops, over, floor, &s));
        CHECK_NEAR(s, shares[i], 1e-9);
      }
  const double x = 2.0 * 64 * 256 * 2048;
  double s = -1;
  /* A faster wave than the 128-row rate allows comes back above 1 for the caller to refuse. */
  CHECK_OK(tw__calib_tile_share(x, 256, 0.5 * x / (6.275e6) + 0.125, 6.275, 0.125, 0.0, &s));
  CHECK_NEAR(s, 2.0, 1e-9);
  CHECK_STATUS(tw__calib_tile_share(x, 256, 6.0, 6.275, 0.125, 3.0, &s), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_share(x, 256, 0.1, 6.275, 0.125, 0.0, &s), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_share(x, 256, 9.0, 6.275, 0.125, -1.0, &s), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_share(x, 0, 9.0, 6.275, 0.125, 0.0, &s), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_share(x, 256, NAN, 6.275, 0.125, 0.0, &s), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_tile_share(x, 256, 9.0, 6.275, 0.125, 0.0, NULL), TW_ERR_NULL_POINTER);
}

static void test_pool_exact(void) {
  uint64_t s = tw_test_seed ^ 0x33;
  for (int trial = 0; trial < 50; trial++) {
    const double gbps = rnd(&s, 5.0, 60.0), lat = rnd(&s, 0.0, 8.0);
    double bytes[16], bands[16], ctas[16], us[16], r[16];
    const int n = pool_points(&s, gbps, lat, bytes, bands, ctas, us);
    double g = 0, l = -1;
    CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, n, &g, &l, r));
    CHECK_NEAR(g / gbps, 1.0, 1e-9);
    CHECK_NEAR(l, lat, 1e-8 * (1.0 + lat));
    for (int i = 0; i < n; i++) CHECK_NEAR(r[i], 0.0, 1e-9 * ctas[i] * us[i]);
  }
}

/* By hand, C x us = bytes / (10 GB/s 1e3) + bands x 2 us, 10 GB/s being 1e4 bytes per us. Point A:
 * 1e6 bytes, 10 bands, C = 2: C us = 100 + 20 = 120, us = 60. Point B: 2.5e5 bytes, 10 bands, C =
 * 1: us = 25 + 20 = 45. */
static void test_pool_by_hand(void) {
  const double bytes[2] = {1e6, 2.5e5}, bands[2] = {10, 10}, ctas[2] = {2, 1}, us[2] = {60, 45};
  double g = 0, l = 0, r[2];
  CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, 2, &g, &l, r));
  CHECK_NEAR(g, 10.0, 1e-9);
  CHECK_NEAR(l, 2.0, 1e-9);
  CHECK_NEAR(r[0], 0.0, 1e-9);
  CHECK_NEAR(r[1], 0.0, 1e-9);
}

/* Noise of +-1% on every time (the command's medians are steadier): the fit stays a least-squares
 * solution (residuals orthogonal to both regressors) and lands near the truth: the rate within 3%,
 * the latency within 0.6 us (at 8 KiB and 2 KiB rows, 1% on a time moves the latency by about
 * 0.2 us; the bound holds for every draw of this noise amplitude). */
static void test_pool_noisy(void) {
  uint64_t s = tw_test_seed ^ 0x44;
  for (int trial = 0; trial < 200; trial++) {
    const double gbps = rnd(&s, 20.0, 40.0), lat = rnd(&s, 0.5, 6.0);
    double bytes[16], bands[16], ctas[16], us[16], r[16];
    const int n = pool_points(&s, gbps, lat, bytes, bands, ctas, us);
    for (int i = 0; i < n; i++) us[i] *= 1.0 + 0.01 * tw_test_rng_sym(&s);
    double g = 0, l = 0;
    CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, n, &g, &l, r));
    CHECKF(fabs(g / gbps - 1.0) < 0.03, "link_cta_gbps %.3f, truth %.3f", g, gbps);
    CHECKF(fabs(l - lat) < 0.6, "link_latency_us %.3f, truth %.3f", l, lat);
    double dot_b = 0, dot_n = 0, sum_y = 0;
    for (int i = 0; i < n; i++) {
      dot_b += r[i] * bytes[i] / 1e6;
      dot_n += r[i] * bands[i] / 100.0;
      sum_y += ctas[i] * us[i];
      CHECK_NEAR(ctas[i] * us[i] - r[i], bytes[i] / (g * 1e3) + bands[i] * l,
                 1e-9 * ctas[i] * us[i]);
    }
    CHECK_NEAR(dot_b, 0.0, 1e-9 * sum_y * 10);
    CHECK_NEAR(dot_n, 0.0, 1e-9 * sum_y);
  }
}

/* What the fit refuses, and what it returns raw for the caller to judge. */
static void test_pool_refusals(void) {
  double bytes[4] = {4e6, 1e6, 4.2e6, 1.05e6}, bands[4] = {64, 64, 67, 67}, ctas[4] = {4, 4, 4, 4};
  double us[4], g = 0, l = 0;
  for (int i = 0; i < 4; i++) us[i] = (bytes[i] / 25e3 + bands[i] * 3.0) / ctas[i];
  CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, 4, &g, &l, NULL));
  CHECK_NEAR(g, 25.0, 1e-9);
  CHECK_NEAR(l, 3.0, 1e-9);
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, us, 1, &g, &l, NULL), TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, us, TW_CALIB_MAX_POINTS + 1, &g, &l, NULL),
               TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__calib_fit_pool(bytes, NULL, ctas, us, 4, &g, &l, NULL), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, us, 4, NULL, &l, NULL), TW_ERR_NULL_POINTER);
  /* One row width: bytes proportional to bands, the two terms cannot be told apart. */
  double same_b[4] = {64e5, 64e5, 67e5, 67e5};
  CHECK_STATUS(tw__calib_fit_pool(same_b, bands, ctas, us, 4, &g, &l, NULL),
               TW_ERR_INVALID_ARGUMENT);
  /* C < 1, a time <= 0 (the first segment's wait larger than the call), a NaN. */
  double c0[4] = {4, 0, 4, 4}, neg[4] = {us[0], -1.0, us[2], us[3]}, nan_us[4] = {us[0], NAN, 1, 1};
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, c0, us, 4, &g, &l, NULL), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, neg, 4, &g, &l, NULL),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, nan_us, 4, &g, &l, NULL),
               TW_ERR_INVALID_ARGUMENT);
  double nan_b[4] = {bytes[0], bytes[1], NAN, bytes[3]};
  CHECK_STATUS(tw__calib_fit_pool(nan_b, bands, ctas, us, 4, &g, &l, NULL),
               TW_ERR_INVALID_ARGUMENT);
  /* The wide problem no slower than the narrow one: no rate. */
  double flat[4] = {100, 100, 103, 103};
  CHECK_STATUS(tw__calib_fit_pool(bytes, bands, ctas, flat, 4, &g, &l, NULL),
               TW_ERR_INVALID_ARGUMENT);
  /* A negative latency comes back as fitted; the range check is what keeps it out of a file. */
  for (int i = 0; i < 4; i++) us[i] = (bytes[i] / 25e3 - bands[i] * 0.3) / ctas[i];
  CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, 4, &g, &l, NULL));
  CHECK_NEAR(l, -0.3, 1e-9);
  CHECK(!tw__calib_in_range(l, TW_CALIB_LATENCY_US_MIN, TW_CALIB_LATENCY_US_MAX));
  CHECK(tw__calib_in_range(g, TW_CALIB_CTA_GBPS_MIN, TW_CALIB_CTA_GBPS_MAX));
  CHECK(tw__calib_in_range(0.0, 0.0, 20.0));
  CHECK(tw__calib_in_range(20.0, 0.0, 20.0));
  CHECK(!tw__calib_in_range(20.000001, 0.0, 20.0));
  CHECK(!tw__calib_in_range(NAN, 0.0, 20.0));
  CHECK(!tw__calib_in_range(INFINITY, 0.0, INFINITY));
}

static void test_lsq2_refusals(void) {
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
  CHECK_NEAR(tw__calib_per_wave(100.0, 4, 340.0, 12), 30.0, 1e-12);
  CHECK_NEAR(tw__calib_per_wave(100.0, 4, 340.0, 4), 0.0, 0);
}

/* A plan of the link measurement: 2 ranks, 8192 tokens, K 2048, 16 experts, top-2, balanced,
 * mgb 4, remote-first, as cmd_calibrate.c plans it. */
static tw_plan_t link_plan(int32_t hidden, tw_routing_t* rt, int32_t rank) {
  tw_problem p = tw_test_problem(2, hidden, 2048, 16, 2, 8192, 0, 0);
  if (*rt == NULL)
    CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 8192, tw_test_seed, rt));
  tw_hardware def;
  CHECK_OK(tw_hardware_default(&def));
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = 8;
  cfg.coalesce = 4;
  cfg.schedule = TW_SCHEDULE_REMOTE_FIRST;
  cfg.hardware = &def;
  tw_plan_t plan = NULL;
  CHECK_OK(tw_plan_create(&p, *rt, rank, &cfg, &plan));
  return plan;
}

/* The link measurement's two problems: each rank's remote bytes are its send_bytes and its bands
 * the segments' (the same for both widths: same routing, same 128-row bands), the bytes are 4x
 * apart, the first segment's ready wave follows from its tiles (a band's column tiles run
 * together), and times made from the pool formula, plus the first segment's wait, give rate and
 * latency back through the fit once the wait is taken off (what the command does). */
static void test_pool_on_real_plans(void) {
  const double gbps = 27.0, lat = 2.7, tau_us = 20.0;
  double bytes[16], bands[16], ctas[16], us[16];
  int n = 0;
  for (int rank = 0; rank < 2; rank++) {
    tw_routing_t rt = NULL;
    tw__calib_remote rem[2];
    for (int pi = 0; pi < 2; pi++) {
      tw_plan_t plan = link_plan(pi == 0 ? 4096 : 1024, &rt, rank);
      if (plan == NULL) continue;
      const struct tw_plan* pl = plan;
      CHECK(pl->schedule == TW_SCHEDULE_REMOTE_FIRST);
      CHECK(pl->num_segments >= 2);
      CHECK_OK(tw__calib_plan_remote(pl, 124, &rem[pi]));
      CHECKF(rem[pi].bytes == (double)pl->send_bytes, "segments carry %.0f bytes, send_bytes %lld",
             rem[pi].bytes, (long long)pl->send_bytes);
      int64_t remote_bands = 0;
      for (int32_t b = 0; b < pl->num_bands; b++) remote_bands += pl->bands[b].dest != rank;
      CHECKF(rem[pi].bands == (double)remote_bands, "segments send %.0f bands; %lld are remote",
             rem[pi].bands, (long long)remote_bands);
      CHECK(rem[pi].waves == (pl->num_tiles + 123) / 124);
      /* Remote-first: the first segment's bands are the first bands of the schedule; its last
       * tile is the last one of those bands in the tile order (tile groups interleave bands). */
      int64_t t0 = -1;
      for (int32_t t = 0; t < pl->num_tiles; t++)
        if (pl->tiles[t].band < pl->segments[0].nbands) t0 = t;
      CHECK(pl->segments[0].band0 == 0 && t0 >= (int64_t)pl->col_tiles - 1);
      CHECK(rem[pi].ready_waves == t0 / 124 + 1);
      tw__calib_remote one, wide;
      CHECK_OK(tw__calib_plan_remote(pl, 1, &one));
      CHECK(one.ready_waves == t0 + 1 && one.waves == pl->num_tiles);
      CHECK_OK(tw__calib_plan_remote(pl, pl->num_tiles, &wide));
      CHECK(wide.ready_waves == 1 && wide.waves == 1);
      CHECK_STATUS(tw__calib_plan_remote(pl, 0, &wide), TW_ERR_INVALID_ARGUMENT);
      for (int c = 1; c <= 4; c *= 2) {
        const double ready = (double)rem[pi].ready_waves * tau_us;
        const double call = ready + (rem[pi].bytes / (gbps * 1e3) + rem[pi].bands * lat) / c;
        bytes[n] = rem[pi].bytes;
        bands[n] = rem[pi].bands;
        ctas[n] = c;
        us[n] = call - ready;
        n++;
      }
      tw_plan_destroy(plan);
    }
    CHECK(rem[0].bands == rem[1].bands);
    CHECK_NEAR(rem[0].bytes / rem[1].bytes, 4.0, 1e-12);
    tw_routing_destroy(rt);
  }
  double g = 0, l = 0;
  CHECK_OK(tw__calib_fit_pool(bytes, bands, ctas, us, n, &g, &l, NULL));
  CHECK_NEAR(g, gbps, 1e-6);
  CHECK_NEAR(l, lat, 1e-6);
}

/* refetch_exposure: exact recovery, the clamps, the refusals. */
static void test_exposure(void) {
  uint64_t s = tw_test_seed ^ 0x55;
  for (int trial = 0; trial < 50; trial++) {
    const double e = rnd(&s, 0.0, 1.0), mem = rnd(&s, 2000.0, 5000.0);
    const double refetch = rnd(&s, 1e8, 2e9), em = rnd(&s, 200.0, 2000.0);
    const double rf = em + e * refetch / (mem * 1e3);
    double raw = -1, x = -1;
    CHECK_OK(tw__calib_exposure(rf, em, 0.0, refetch, mem, &raw, &x));
    CHECK_NEAR(raw, e, 1e-9);
    CHECK_NEAR(x, e, 1e-9);
  }
  /* 1 GiB at 4000 GB/s = 268.435456 us; 110 us of it exposed. */
  double raw = 0, x = 0;
  CHECK_OK(tw__calib_exposure(750.0, 640.0, 0.0, 1073741824.0, 4000.0, &raw, &x));
  CHECK_NEAR(raw, 110.0 / 268.435456, 1e-12);
  CHECK_NEAR(x, raw, 0);
  /* Remote-first faster than expert-major: raw < 0, clamped to 0; slower than a whole read: 1. */
  CHECK_OK(tw__calib_exposure(630.0, 640.0, 0.0, 1073741824.0, 4000.0, &raw, &x));
  CHECK(raw < 0 && x == 0.0);
  CHECK_OK(tw__calib_exposure(1000.0, 640.0, 0.0, 1073741824.0, 4000.0, &raw, &x));
  CHECK(raw > 1 && x == 1.0);
  CHECK_STATUS(tw__calib_exposure(750.0, 640.0, 0.0, 0.0, 4000.0, &raw, &x),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_exposure(750.0, 640.0, 0.0, 1e9, 0.0, &raw, &x), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_exposure(NAN, 640.0, 0.0, 1e9, 4000.0, &raw, &x), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_exposure(750.0, -1.0, 0.0, 1e9, 4000.0, &raw, &x),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_exposure(750.0, 640.0, 0.0, 1e9, 4000.0, NULL, &x), TW_ERR_NULL_POINTER);
  /* The model's own roofline difference is taken off first: 50 of the 110 us are the
   * roofline's, 60 are exposure. */
  CHECK_OK(tw__calib_exposure(750.0, 640.0, 50.0, 1073741824.0, 4000.0, &raw, &x));
  CHECK_NEAR(raw, 60.0 / 268.435456, 1e-12);
  CHECK_STATUS(tw__calib_exposure(750.0, 640.0, -1.0, 1e9, 4000.0, &raw, &x),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__calib_exposure(750.0, 640.0, NAN, 1e9, 4000.0, &raw, &x),
               TW_ERR_INVALID_ARGUMENT);
}

/* The exposure measurement's problem (2 ranks' layout planned for rank 0, 16384 tokens/rank,
 * K 2048, N 4096, 128 experts, top-2, balanced, as cmd_calibrate.c plans it) under each schedule:
 * remote-first reads every one of the 64 local experts' weights twice (each has remote and local
 * rows), expert-major only its last two (remote, remote, local, local at the end), so the second
 * reads remote-first has more are 62 x 4096 x 2048 x 2 bytes, what the command divides by. The
 * command takes the whole measured difference as the exposure because the model's roofline is
 * compute-bound under both schedules there: with the exposure set to 0 the model's GEMM-alone times
 * are equal (on every SM; the command's 8 fewer SMs only add compute). */
static void test_refetch_problem(void) {
  tw_problem p = tw_test_problem(2, 4096, 2048, 128, 2, 16384, 0, 0);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 16384, tw_test_seed, &rt));
  tw_hardware def;
  CHECK_OK(tw_hardware_default(&def));
  def.refetch_exposure = 0.0;
  const int32_t sched[2] = {TW_SCHEDULE_REMOTE_FIRST, TW_SCHEDULE_EXPERT_MAJOR};
  double traffic[2] = {0, 0}, refetch[2] = {-1, -1}, gemm_us[2] = {-1, -2};
  int32_t rows[2] = {0, 0}, tiles[2] = {0, 0};
  for (int i = 0; i < 2 && rt; i++) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.comm_ctas = 8;
    cfg.coalesce = 1;
    cfg.schedule = sched[i];
    cfg.hardware = &def;
    tw_plan_t plan = NULL;
    CHECK_OK(tw_plan_create(&p, rt, 0, &cfg, &plan));
    if (plan == NULL) continue;
    CHECK(plan->schedule == sched[i]);
    CHECK(plan->local_experts == 64);
    CHECK_OK(tw__model_traffic(plan, &traffic[i], &refetch[i]));
    rows[i] = plan->rows;
    tiles[i] = plan->num_tiles;
    gemm_us[i] = plan->gemm_us;
    tw_plan_destroy(plan);
  }
  CHECK(rows[0] == rows[1] && tiles[0] == tiles[1]);
  CHECK_NEAR(refetch[0], 64.0 * 4096 * 2048 * 2, 0);
  CHECK_NEAR(refetch[1], 2.0 * 4096 * 2048 * 2, 0);
  CHECK_NEAR(traffic[0] - traffic[1], refetch[0] - refetch[1], 0);
  CHECKF(gemm_us[0] == gemm_us[1] && traffic[0] / (def.mem_gbps * 1e3) < gemm_us[0],
         "GEMM alone %.1f us (remote-first, traffic %.1f us) and %.1f us (expert-major)",
         gemm_us[0], traffic[0] / (def.mem_gbps * 1e3), gemm_us[1]);
  tw_routing_destroy(rt);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_producer_exact),
             TW_TEST(test_producer_noisy), TW_TEST(test_tile_floor), TW_TEST(test_tile_share),
             TW_TEST(test_pool_exact), TW_TEST(test_pool_by_hand), TW_TEST(test_pool_noisy),
             TW_TEST(test_pool_refusals), TW_TEST(test_lsq2_refusals),
             TW_TEST(test_pool_on_real_plans), TW_TEST(test_exposure),
             TW_TEST(test_refetch_problem))
