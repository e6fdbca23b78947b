/*
 * calibrate_fit.h: the arithmetic of `tilewave calibrate` (tools/cmd_calibrate.c), kept pure (no
 * CUDA, no I/O) so that a unit test can check it on synthetic data with a known answer.
 *
 * Each fit is a least-squares fit of measured times to a linear formula:
 *   producer  us per wave      = flop_per_tile / (tile_tflops 1e6) + tile_overhead_us
 *   consumer  us of one call   = busiest_bytes / (link_cta_gbps 1e3) + segments latency
 * where busiest_bytes = sum_s ceil(U_s / C) bytes_s / U_s is what the most loaded of C CTAs moves
 * when every segment is ready at once. The producer's is the resource model's own formula
 * (src/plan/model.c). The consumer's is the model's earlier per-segment form: the model now
 * charges total bytes / min(C link_cta_gbps, peak) + bands link_latency_us / C, whose bytes term
 * busiest_bytes / link_cta equals whenever C divides every U_s (docs/calibrate.md); its latency
 * is per band, not per segment, so the fitted latency is not the model's link_latency_us.
 */
#ifndef TW_CALIBRATE_FIT_H
#define TW_CALIBRATE_FIT_H

#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most points any fit takes. */
#define TW_CALIB_MAX_POINTS 64

/* Least squares y ~ coef[0] x1 + coef[1] x2 over n points (no implicit intercept: pass x2 = 1 for
 * one). The columns are scaled to unit norm before the 2x2 normal equations are solved, so that
 * x1 ~ 1e9 and x2 ~ 1 do not lose precision. resid (n, may be NULL) gets y - fit.
 * TW_ERR_INVALID_SIZE when n < 2 or n > TW_CALIB_MAX_POINTS; TW_ERR_INVALID_ARGUMENT when the
 * columns are (numerically) collinear or a value is not finite. */
tw_status tw__calib_lsq2(const double* x1, const double* x2, const double* y, int n, double coef[2],
                         double* resid);

/* Producer: us_per_wave[i] measured at flop_per_tile[i] = 2 TM TN K_i. Fits slope and intercept and
 * converts: tile_tflops = 1 / (slope 1e6) (per-SM TFLOP/s), tile_overhead_us = intercept.
 * TW_ERR_INVALID_ARGUMENT when the slope is not positive (times that do not grow with K). */
tw_status tw__calib_fit_producer(const double* flop_per_tile, const double* us_per_wave, int n,
                                 double* tile_tflops, double* tile_overhead_us, double* resid);

/* Consumer below the link's saturation: us[i] of a call whose busiest CTA moves busiest_bytes[i]
 * over segments[i] segments. Fits link_cta_gbps = 1 / (slope 1e3) and seg_latency_us = the
 * per-segment coefficient (not the model's per-band link_latency_us). TW_ERR_INVALID_ARGUMENT
 * when the bandwidth term is not positive. */
tw_status tw__calib_fit_link(const double* busiest_bytes, const double* segments, const double* us,
                             int n, double* link_cta_gbps, double* seg_latency_us, double* resid);

/* sum_s ceil(units[s] / c) * bytes[s] / units[s]: bytes the busiest of c CTAs moves when the
 * units of each segment are dealt round-robin (segments with units[s] <= 0 are skipped). */
double tw__calib_busiest_bytes(const int64_t* units, const double* bytes, int nseg, int c);

struct tw_plan;
/* The model's view of a plan's remote segments: units[s] = nbands_s col_tiles (one band x one
 * column tile per unit, as model.c counts them, whatever unit width the consumer uses) and
 * bytes[s] = valid_rows_s hidden 2; *total = sum of bytes (the plan's send_bytes). The arrays
 * (plan->num_segments, at least 1) are malloc'ed; the caller frees them, also on failure. */
tw_status tw__calib_plan_segments(const struct tw_plan* plan, int64_t** units, double** bytes,
                                  double* total);

/* Per-wave time from two runs of the same kernel that differ only in their wave count: the
 * difference cancels the launch and the kernel's fixed start and end costs. 0 when waves are
 * equal. */
double tw__calib_per_wave(double us_small, int64_t waves_small, double us_large,
                          int64_t waves_large);

#ifdef __cplusplus
}
#endif

#endif /* TW_CALIBRATE_FIT_H */
