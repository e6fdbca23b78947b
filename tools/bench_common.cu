/*
 * bench_common.cu: the device delay and number parsing of the benchmark commands
 * (see bench_common.h).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "core.h"

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
