/*
 * calibrate_fit.c: least-squares fits and model arithmetic of `tilewave calibrate` (see
 * calibrate_fit.h). Pure host code: the unit test tests/unit/test_calibrate_fit.c compiles it.
 */
#include <math.h>

#include <stdlib.h>

#include "calibrate_fit.h"
#include "core.h"
#include "plan.h"

tw_status tw__calib_lsq2(const double* x1, const double* x2, const double* y, int n, double coef[2],
                         double* resid) {
  TW_CHECK_NULL(x1);
  TW_CHECK_NULL(x2);
  TW_CHECK_NULL(y);
  TW_CHECK_NULL(coef);
  if (n < 2 || n > TW_CALIB_MAX_POINTS)
    return tw__fail(TW_ERR_INVALID_SIZE, "calibrate fit: %d points; need 2..%d", n,
                    TW_CALIB_MAX_POINTS);
  double s1 = 0, s2 = 0;
  for (int i = 0; i < n; i++) {
    if (!isfinite(x1[i]) || !isfinite(x2[i]) || !isfinite(y[i]))
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "calibrate fit: point %d is not finite", i);
    s1 += x1[i] * x1[i];
    s2 += x2[i] * x2[i];
  }
  if (!(s1 > 0) || !(s2 > 0))
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "calibrate fit: a regressor is zero at every point");
  /* Unit-norm columns: the normal matrix is then a correlation matrix [[1, r], [r, 1]], whose
   * determinant 1 - r^2 says directly how far from collinear the data are. */
  s1 = sqrt(s1);
  s2 = sqrt(s2);
  double r = 0, b1 = 0, b2 = 0;
  for (int i = 0; i < n; i++) {
    const double u = x1[i] / s1, v = x2[i] / s2;
    r += u * v;
    b1 += u * y[i];
    b2 += v * y[i];
  }
  const double det = 1.0 - r * r;
  if (!(det > 1e-12))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate fit: the two regressors are collinear (1 - r^2 = %.3g); measure "
                    "at more distinct points",
                    det);
  const double c1 = (b1 - r * b2) / det, c2 = (b2 - r * b1) / det;
  coef[0] = c1 / s1;
  coef[1] = c2 / s2;
  if (resid)
    for (int i = 0; i < n; i++) resid[i] = y[i] - (coef[0] * x1[i] + coef[1] * x2[i]);
  return TW_SUCCESS;
}

tw_status tw__calib_fit_producer(const double* flop_per_tile, const double* us_per_wave, int n,
                                 double* tile_tflops, double* tile_overhead_us, double* resid) {
  TW_CHECK_NULL(tile_tflops);
  TW_CHECK_NULL(tile_overhead_us);
  double one[TW_CALIB_MAX_POINTS];
  for (int i = 0; i < n && i < TW_CALIB_MAX_POINTS; i++) one[i] = 1.0;
  double c[2];
  TW_TRY(tw__calib_lsq2(flop_per_tile, one, us_per_wave, n, c, resid));
  if (!(c[0] > 0))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate: producer time per wave does not grow with K (slope %.3g us per "
                    "flop); the measurement is noise-dominated, use larger problems",
                    c[0]);
  /* slope: us per flop on one SM; flop per us = 1e6 flop/s; TFLOP/s = 1 / (slope 1e6). */
  *tile_tflops = 1.0 / (c[0] * 1e6);
  *tile_overhead_us = c[1];
  return TW_SUCCESS;
}

/* The model's tile time is the 4-norm of two parts, (a^4 + b^4)^(1/4): given the whole t and
 * one part b, the other, or 0 where t is not above b. */
static double tw__norm4_rest(double t, double b) {
  return t > b ? sqrt(sqrt(t * t * t * t - b * b * b * b)) : 0.0;
}

tw_status tw__calib_tile_floor(double flop_per_tile, int tn, double us_per_wave, double tile_tflops,
                               double tile_overhead_us, double* tile_floor_us) {
  TW_CHECK_NULL(tile_floor_us);
  if (!isfinite(flop_per_tile) || !isfinite(us_per_wave) || !isfinite(tile_tflops) ||
      !isfinite(tile_overhead_us) || flop_per_tile <= 0 || tn <= 0 || us_per_wave <= 0 ||
      tile_tflops <= 0 || tile_overhead_us < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate floor: flop %g, tn %d, us/wave %g, tile_tflops %g, overhead %g: "
                    "need finite positive values",
                    flop_per_tile, tn, us_per_wave, tile_tflops, tile_overhead_us);
  const double c = flop_per_tile / (tile_tflops * 1e6);
  /* the model scales it back by tn / 128 */
  *tile_floor_us = tw__norm4_rest(us_per_wave - tile_overhead_us, c) * 128.0 / tn;
  return TW_SUCCESS;
}

tw_status tw__calib_tile_share(double flop_per_tile, int tn, double us_per_wave, double tile_tflops,
                               double tile_overhead_us, double tile_floor_us, double* share) {
  TW_CHECK_NULL(share);
  if (!isfinite(flop_per_tile) || !isfinite(us_per_wave) || !isfinite(tile_tflops) ||
      !isfinite(tile_overhead_us) || !isfinite(tile_floor_us) || flop_per_tile <= 0 || tn <= 0 ||
      us_per_wave <= 0 || tile_tflops <= 0 || tile_overhead_us < 0 || tile_floor_us < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate tile share: flop %g, tn %d, us/wave %g, tile_tflops %g, overhead "
                    "%g, floor %g: need finite positive values",
                    flop_per_tile, tn, us_per_wave, tile_tflops, tile_overhead_us, tile_floor_us);
  const double t = us_per_wave - tile_overhead_us, f = tile_floor_us * tn / 128.0;
  if (t <= f)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate tile share: a wave of %g us is no longer than the overhead %g us "
                    "and the floor %g us: no compute to see (use a larger K)",
                    us_per_wave, tile_overhead_us, f);
  *share = flop_per_tile / (tile_tflops * 1e6 * tw__norm4_rest(t, f));
  return TW_SUCCESS;
}

tw_status tw__calib_fit_pool(const double* bytes, const double* bands, const double* ctas,
                             const double* us, int n, double* link_cta_gbps,
                             double* link_latency_us, double* resid) {
  TW_CHECK_NULL(bytes);
  TW_CHECK_NULL(bands);
  TW_CHECK_NULL(ctas);
  TW_CHECK_NULL(us);
  TW_CHECK_NULL(link_cta_gbps);
  TW_CHECK_NULL(link_latency_us);
  if (n < 2 || n > TW_CALIB_MAX_POINTS)
    return tw__fail(TW_ERR_INVALID_SIZE, "calibrate: consumer fit over %d points; need 2..%d", n,
                    TW_CALIB_MAX_POINTS);
  /* The model's pool term, multiplied by C: the CTAs' work does not depend on how many share it. */
  double y[TW_CALIB_MAX_POINTS];
  for (int i = 0; i < n; i++) {
    if (!(ctas[i] >= 1.0) || !(us[i] > 0.0) || !isfinite(ctas[i]) || !isfinite(us[i]))
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "calibrate: consumer point %d has C = %g and %g us; need C >= 1 and a "
                      "positive time after the first segment was ready",
                      i, ctas[i], us[i]);
    y[i] = ctas[i] * us[i];
  }
  double c[2];
  TW_TRY(tw__calib_lsq2(bytes, bands, y, n, c, resid));
  if (!(c[0] > 0))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate: the consumer's C x time does not grow with the bytes (slope %.3g "
                    "us per byte); no per-CTA rate can be fitted",
                    c[0]);
  /* slope: us per byte; bytes per us = 1e6 B/s = 1e-3 GB/s. */
  *link_cta_gbps = 1.0 / (c[0] * 1e3);
  *link_latency_us = c[1];
  return TW_SUCCESS;
}

int tw__calib_in_range(double v, double lo, double hi) {
  return isfinite(v) && v >= lo && v <= hi;
}

tw_status tw__calib_plan_remote(const struct tw_plan* plan, int32_t grid, tw__calib_remote* out) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(out);
  if (grid < 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "calibrate: producer grid %d; need >= 1", grid);
  out->bytes = 0;
  out->bands = 0;
  out->ready_waves = 0;
  out->waves = tw__ceil_div(plan->num_tiles, grid);
  const double row_bytes = 2.0 * (double)plan->problem.hidden; /* bf16 / fp16 */
  for (int32_t s = 0; s < plan->num_segments; s++) {
    out->bytes += (double)plan->segments[s].valid_rows * row_bytes;
    out->bands += (double)plan->segments[s].nbands;
  }
  if (plan->num_segments < 1) return TW_SUCCESS;
  /* t_0: the last tile of the first segment's bands in schedule order (tiles name their band by
   * its schedule index, as the segments do). */
  const tw_segment* sg = &plan->segments[0];
  int32_t last = -1;
  for (int32_t i = 0; i < plan->num_tiles; i++) {
    const int32_t b = plan->tiles[i].band;
    if (b >= sg->band0 && b < sg->band0 + sg->nbands) last = i;
  }
  if (last < 0) return tw__fail(TW_ERR_INTERNAL, "calibrate: the plan's first segment has no tile");
  out->ready_waves = last / grid + 1;
  return TW_SUCCESS;
}

tw_status tw__calib_exposure(double rf_us, double em_us, double roofline_us, double refetch_bytes,
                             double mem_gbps, double* raw, double* exposure) {
  TW_CHECK_NULL(raw);
  TW_CHECK_NULL(exposure);
  const double v[4] = {rf_us, em_us, refetch_bytes, mem_gbps};
  for (int i = 0; i < 4; i++)
    if (!isfinite(v[i]) || !(v[i] > 0))
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "calibrate: refetch exposure from remote-first %g us, expert-major %g us, "
                      "%g second-read bytes at %g GB/s; each must be positive (a problem whose "
                      "experts have remote and local rows)",
                      rf_us, em_us, refetch_bytes, mem_gbps);
  if (!isfinite(roofline_us) || roofline_us < 0.0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate: refetch exposure: the model's own difference between the schedules "
                    "is %g us; it must be finite and >= 0",
                    roofline_us);
  /* bytes / (GB/s 1e3) = us. */
  const double read_us = refetch_bytes / (mem_gbps * 1e3);
  *raw = (rf_us - em_us - roofline_us) / read_us;
  *exposure = *raw < 0.0 ? 0.0 : *raw > 1.0 ? 1.0 : *raw;
  return TW_SUCCESS;
}

double tw__calib_per_wave(double us_small, int64_t waves_small, double us_large,
                          int64_t waves_large) {
  if (waves_large == waves_small) return 0.0;
  return (us_large - us_small) / (double)(waves_large - waves_small);
}
