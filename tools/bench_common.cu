/*
 * bench_common.cu: sample statistics, the device delay and number parsing of the benchmark commands
 * (see bench_common.h).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "core.h"

static int tw__bench_cmp_float(const void* a, const void* b) {
  const float x = *(const float*)a, y = *(const float*)b;
  return x < y ? -1 : x > y ? 1 : 0;
}

/* Linear interpolation between order statistics, as numpy's default percentile. */
static double tw__bench_pct(const float* sorted, int n, double q) {
  const double pos = q * (double)(n - 1);
  const int lo = (int)pos;
  const int hi = lo + 1 < n ? lo + 1 : lo;
  return (double)sorted[lo] + (pos - lo) * ((double)sorted[hi] - (double)sorted[lo]);
}

extern "C" void tw__bench_stats_of(const float* v, int n, tw__bench_stats* s) {
  memset(s, 0, sizeof *s);
  if (n <= 0) return;
  float* t = (float*)malloc(sizeof(float) * (size_t)n);
  if (t == NULL) return;
  memcpy(t, v, sizeof(float) * (size_t)n);
  qsort(t, (size_t)n, sizeof(float), tw__bench_cmp_float);
  double sum = 0;
  for (int i = 0; i < n; i++) sum += t[i];
  s->n = n;
  s->min = t[0];
  s->mean = sum / n;
  s->median = tw__bench_pct(t, n, 0.5);
  s->p10 = tw__bench_pct(t, n, 0.1);
  s->p90 = tw__bench_pct(t, n, 0.9);
  free(t);
}

__global__ void tw__bench_delay_kernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

extern "C" tw_status tw__bench_delay(cudaStream_t stream, int us) {
  if (us <= 0) return TW_SUCCESS;
  tw__bench_delay_kernel<<<1, 1, 0, stream>>>((uint64_t)us * 1000u);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "bench: delay kernel launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

extern "C" int tw__bench_parse_int(const char* s, long lo, long hi, long* out) {
  if (s == NULL || *s == '\0') return 0;
  char* end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

extern "C" int tw__bench_parse_double(const char* s, double* out) {
  if (s == NULL || *s == '\0') return 0;
  char* end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || *end != '\0') return 0;
  *out = v;
  return 1;
}
