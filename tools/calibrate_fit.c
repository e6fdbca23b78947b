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

tw_status tw__calib_fit_link(const double* busiest_bytes, const double* segments, const double* us,
                             int n, double* link_cta_gbps, double* seg_latency_us, double* resid) {
  TW_CHECK_NULL(link_cta_gbps);
  TW_CHECK_NULL(seg_latency_us);
  double c[2];
  TW_TRY(tw__calib_lsq2(busiest_bytes, segments, us, n, c, resid));
  if (!(c[0] > 0))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "calibrate: consumer time does not grow with the bytes per CTA (slope %.3g "
                    "us per byte)",
                    c[0]);
  /* slope: us per byte; bytes per us = 1e6 B/s = 1e-3 GB/s. */
  *link_cta_gbps = 1.0 / (c[0] * 1e3);
  *seg_latency_us = c[1];
  return TW_SUCCESS;
}

double tw__calib_busiest_bytes(const int64_t* units, const double* bytes, int nseg, int c) {
  if (units == NULL || bytes == NULL || c < 1) return 0.0;
  double sum = 0;
  for (int s = 0; s < nseg; s++)
    if (units[s] > 0) sum += (double)tw__ceil_div(units[s], c) * bytes[s] / (double)units[s];
  return sum;
}

double tw__calib_per_wave(double us_small, int64_t waves_small, double us_large,
                          int64_t waves_large) {
  if (waves_large == waves_small) return 0.0;
  return (us_large - us_small) / (double)(waves_large - waves_small);
}

tw_status tw__calib_plan_segments(const struct tw_plan* plan, int64_t** units, double** bytes,
                                  double* total) {
  TW_CHECK_NULL(units);
  TW_CHECK_NULL(bytes);
  *units = NULL;
  *bytes = NULL;
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(total);
  const int32_t n = plan->num_segments;
  *units = (int64_t*)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
  *bytes = (double*)calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  if (*units == NULL || *bytes == NULL)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "calibrate: out of host memory");
  *total = 0;
  for (int32_t i = 0; i < n; i++) {
    (*units)[i] = (int64_t)plan->segments[i].nbands * plan->col_tiles;
    (*bytes)[i] = (double)plan->segments[i].valid_rows * plan->problem.hidden * 2.0;
    *total += (*bytes)[i];
  }
  return TW_SUCCESS;
}
