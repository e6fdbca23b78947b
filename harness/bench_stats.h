/*
 * bench_stats.h: the one statistics helper and the one JSON writer of the measurements
 * (`tilewave bench`, `sweep`, `bench gemm`, `calibrate`, `plan --bench-solve`). Pure host C.
 *
 * Statistics: percentiles interpolate linearly between order statistics (numpy's default), so
 * the median of an even count is the mean of the two middle values, everywhere.
 * JSON: strings escaped one way, and numbers that are not finite written as null (JSON has no
 * NaN or infinity).
 */
#ifndef TW_BENCH_STATS_H
#define TW_BENCH_STATS_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Percentile q in [0, 1] of v[0..n) by linear interpolation between order statistics. Sorts v in
 * place; n < 1 or v NULL gives NaN. */
double tw__stats_percentile(double* v, int n, double q);
/* The median (q = 0.5: the mean of the two middle values for even n). Sorts v in place. */
double tw__stats_median(double* v, int n);
/* The same for float samples, on a copy (v untouched); NaN for n < 1 or no memory. */
double tw__stats_percentile_f(const float* v, int n, double q);

/* Order statistics of one policy's samples (microseconds). */
typedef struct tw__bench_stats {
  double median, p10, p90, min, max, mean;
  int n;
} tw__bench_stats;

/* Fills *s from v[0..n) (a sorted copy; v untouched); n == 0 gives all zeros. */
void tw__bench_stats_of(const float* v, int n, tw__bench_stats* s);

/* ---- JSON ---- */
/* A string value, quotes, backslashes and control characters escaped; NULL writes null. */
void tw__json_str(FILE* f, const char* s);
/* A number with a printf format for one double ("%.3f"); not finite: null. */
void tw__json_num(FILE* f, const char* fmt, double v);
/* The same into buf (for a "%s" in a larger format): buf, or "null" when v is not finite. */
const char* tw__json_fmt(char* buf, size_t size, const char* fmt, double v);
/* "key": then the value's writer follows; `first` 0 writes a ", " before it. */
void tw__json_key(FILE* f, const char* key, int first);
/* true / false. */
void tw__json_bool(FILE* f, int v);

#ifdef __cplusplus
}
#endif

#endif /* TW_BENCH_STATS_H */
