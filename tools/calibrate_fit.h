/*
 * calibrate_fit.h: the arithmetic of `tilewave calibrate` (tools/cmd_calibrate.c), kept pure (no
 * CUDA, no I/O) so that a unit test can check it on synthetic data with a known answer.
 *
 * Each number is fitted to the formula the resource model (src/plan/model.c) charges it in:
 *   producer  us per wave     = flop_per_tile / (tile_tflops 1e6) + tile_overhead_us
 *   consumer  C x us          = bytes / (link_cta_gbps 1e3) + bands link_latency_us
 *   schedules T_rf - T_em     = refetch_exposure x refetch_bytes / (mem_gbps 1e3)
 * The consumer's is the model's pool term Q_0 where the C CTAs bound it (bytes and bands of the
 * plan's whole remote traffic, every segment ready; us counted from the first segment's ready
 * time). The schedules' is the measured difference the model adds to remote-first's GEMM; it is
 * the whole difference only where the model's roofline is compute-bound under both schedules (the
 * problem calibrate measures it on is; test_calibrate_fit checks that).
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

/* Plausible ranges of the consumer's fitted values: outside them, calibrate keeps the default of
 * that field and says so (noise or a consumer that does not follow the pool form). */
#define TW_CALIB_CTA_GBPS_MIN 5.0
#define TW_CALIB_CTA_GBPS_MAX 200.0
#define TW_CALIB_LATENCY_US_MIN 0.0
#define TW_CALIB_LATENCY_US_MAX 20.0

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

/* Producer floor: one wave of short tiles tn columns wide (flop_per_tile, small K) took
 * us_per_wave; the model charges (c^4 + f^4)^(1/4) + tile_overhead_us with c = flop_per_tile /
 * (tile_tflops 1e6) and f = tile_floor_us tn / 128, so tile_floor_us = 128 / tn x ((us_per_wave -
 * tile_overhead_us)^4 - c^4)^(1/4), or 0 where the tile took no longer than its compute (no floor
 * to see). TW_ERR_INVALID_ARGUMENT for a value that is not finite or not positive
 * (tile_overhead_us: negative). */
tw_status tw__calib_tile_floor(double flop_per_tile, int tn, double us_per_wave, double tile_tflops,
                               double tile_overhead_us, double* tile_floor_us);

/* 64-row tiles: one wave of them (flop_per_tile = 2 64 TN K) took us_per_wave. The model charges
 * (c^4 + f^4)^(1/4) + tile_overhead_us with c = flop_per_tile / (tile_tflops tile_m64_share 1e6)
 * and f = tile_floor_us tn / 128 (the 128-row fit's values), so tile_m64_share = flop_per_tile /
 * (tile_tflops 1e6 ((us_per_wave - tile_overhead_us)^4 - f^4)^(1/4)). The value comes back as
 * computed, also above 1 (the caller checks it). TW_ERR_INVALID_ARGUMENT for a value that is not
 * finite or not positive (tile_overhead_us, tile_floor_us: negative) and where the wave took no
 * longer than the floor and the overhead (no compute to see). */
tw_status tw__calib_tile_share(double flop_per_tile, int tn, double us_per_wave, double tile_tflops,
                               double tile_overhead_us, double tile_floor_us, double* share);

/* Consumer in the model's pool form where its CTAs bound it: a call with ctas[i] consumer CTAs
 * that sends bytes[i] in bands[i] bands took us[i] from its first segment's ready time to its end.
 * Least squares of ctas x us against bytes and bands (no intercept):
 *   ctas us = bytes / (link_cta_gbps 1e3) + bands link_latency_us
 * (bytes / (GB/s) = 1e-9 s per byte = 1e-3 us per byte: the slope in us per byte is
 * 1 / (link_cta_gbps 1e3)). The values come back as fitted, a negative latency included: the
 * caller checks them against TW_CALIB_*. resid (n, may be NULL) gets ctas us - fit. Points whose
 * bytes per band are all equal cannot separate the two terms (TW_ERR_INVALID_ARGUMENT: measure a
 * second hidden size); TW_ERR_INVALID_ARGUMENT also for ctas < 1, us <= 0, a value that is not
 * finite, or times that do not grow with the bytes (slope <= 0, no rate). */
tw_status tw__calib_fit_pool(const double* bytes, const double* bands, const double* ctas,
                             const double* us, int n, double* link_cta_gbps,
                             double* link_latency_us, double* resid);

/* 1 when v is finite and lo <= v <= hi. */
int tw__calib_in_range(double v, double lo, double hi);

/* The model's view of a plan's consumer work on a producer of `grid` CTAs (model.c). */
typedef struct tw__calib_remote {
  double bytes;        /* bytes the remote segments send, valid rows x hidden x 2 (send_bytes) */
  double bands;        /* bands they send: sum of the segments' nbands */
  int64_t ready_waves; /* A_0 = floor(t_0 / grid) + 1: producer waves until the first segment is
                          ready, t_0 the largest schedule index among its tiles; 0 if none */
  int64_t waves;       /* ceil(num_tiles / grid) */
} tw__calib_remote;

/* Fills *out for plan (its current segments and tile order) and grid >= 1. */
tw_status tw__calib_plan_remote(const struct tw_plan* plan, int32_t grid, tw__calib_remote* out);

/* refetch_exposure from one pair of producer times of the same rows under remote-first (rf_us)
 * and expert-major (em_us), less the difference the model already predicts between them with the
 * exposure at 0 (roofline_us: its memory roofline; 0 where both are compute-bound):
 * *raw = (rf_us - em_us - roofline_us) / (refetch_bytes / (mem_gbps 1e3)), the fraction of the
 * second reads' memory time that remote-first did not hide beyond the roofline; *exposure =
 * *raw clamped to [0, 1] (the caller says when they differ). TW_ERR_INVALID_ARGUMENT when a
 * time, refetch_bytes or mem_gbps is not positive and finite, or roofline_us is negative or not
 * finite. */
tw_status tw__calib_exposure(double rf_us, double em_us, double roofline_us, double refetch_bytes,
                             double mem_gbps, double* raw, double* exposure);

/* Per-wave time from two runs of the same kernel that differ only in their wave count: the
 * difference cancels the launch and the kernel's fixed start and end costs. 0 when waves are
 * equal. */
double tw__calib_per_wave(double us_small, int64_t waves_small, double us_large,
                          int64_t waves_large);

#ifdef __cplusplus
}
#endif

#endif /* TW_CALIBRATE_FIT_H */
