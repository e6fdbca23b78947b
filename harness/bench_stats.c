/*
 * bench_stats.c: percentiles, medians, sample summaries and JSON values of the measurements (see
 * bench_stats.h).
 */
#include "bench_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int tw__stats_cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

double tw__stats_percentile(double* v, int n, double q) {
  if (v == NULL || n < 1) return NAN;
  qsort(v, (size_t)n, sizeof *v, tw__stats_cmp);
  const double pos = q * (double)(n - 1);
  const int lo = (int)pos, hi = lo + 1 < n ? lo + 1 : lo;
  return v[lo] + (pos - lo) * (v[hi] - v[lo]);
}

double tw__stats_median(double* v, int n) {
  return tw__stats_percentile(v, n, 0.5);
}

double tw__stats_percentile_f(const float* v, int n, double q) {
  if (v == NULL || n < 1) return NAN;
  double* t = (double*)malloc(sizeof(double) * (size_t)n);
  if (t == NULL) return NAN;
  for (int i = 0; i < n; i++) t[i] = v[i];
  const double r = tw__stats_percentile(t, n, q);
  free(t);
  return r;
}

void tw__bench_stats_of(const float* v, int n, tw__bench_stats* s) {
  memset(s, 0, sizeof *s);
  if (v == NULL || n <= 0) return;
  double* t = (double*)malloc(sizeof(double) * (size_t)n);
  if (t == NULL) return;
  double sum = 0;
  for (int i = 0; i < n; i++) t[i] = v[i], sum += v[i];
  qsort(t, (size_t)n, sizeof *t, tw__stats_cmp);
  s->n = n;
  s->min = t[0];
  s->max = t[n - 1];
  s->mean = sum / n;
  /* Sorted already: the percentile's own sort is then cheap. */
  s->median = tw__stats_percentile(t, n, 0.5);
  s->p10 = tw__stats_percentile(t, n, 0.1);
  s->p90 = tw__stats_percentile(t, n, 0.9);
  free(t);
}

void tw__json_str(FILE* f, const char* s) {
  if (s == NULL) {
    fputs("null", f);
    return;
  }
  fputc('"', f);
  for (const unsigned char* c = (const unsigned char*)s; *c; c++) {
    if (*c == '"' || *c == '\\')
      fprintf(f, "\\%c", *c);
    else if (*c < 0x20)
      fprintf(f, "\\u%04x", *c);
    else
      fputc(*c, f);
  }
  fputc('"', f);
}

void tw__json_num(FILE* f, const char* fmt, double v) {
  if (!isfinite(v))
    fputs("null", f);
  else
    fprintf(f, fmt, v);
}

const char* tw__json_fmt(char* buf, size_t size, const char* fmt, double v) {
  if (!isfinite(v)) return "null";
  snprintf(buf, size, fmt, v);
  return buf;
}

void tw__json_key(FILE* f, const char* key, int first) {
  if (!first) fputs(", ", f);
  tw__json_str(f, key);
  fputs(": ", f);
}

void tw__json_bool(FILE* f, int v) {
  fputs(v ? "true" : "false", f);
}
