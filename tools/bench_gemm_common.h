/*
 * bench_gemm_common.h: what `bench gemm` and `bench gemm1` share (CUDA C++ translation units of
 * tools/ only): the device, stream and cuBLAS handle they time against, and the interleaved
 * timing of their calls.
 */
#ifndef TW_BENCH_GEMM_COMMON_H
#define TW_BENCH_GEMM_COMMON_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include <vector>

#include "bench_common.h" /* tw__bench_delay, tw__stats_percentile_f */

/* The current device's properties, a new stream and a cuBLAS handle on it; 0, or 1 after saying
 * on stderr what failed (`cmd` names the command). */
static inline int twb_cublas_setup(const char* cmd, cudaDeviceProp* prop, cudaStream_t* s,
                                   cublasHandle_t* h) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(prop, dev) != cudaSuccess) {
    fprintf(stderr, "%s: no usable CUDA device\n", cmd);
    return 1;
  }
  if (cudaStreamCreate(s) != cudaSuccess || cublasCreate(h) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "%s: cannot create a stream or cuBLAS handle\n", cmd);
    return 1;
  }
  cublasSetStream(*h, *s);
  return 0;
}

/* Times the functions of `fns` (each returns 0 on success) interleaved rep by rep, so that
 * clock and power drift hit all of them alike, and with the starting function rotated every rep
 * (A B C, B C A, C A B, ...): the first call after the host's wait also pays the launch gap,
 * which must not always land on the same function. us[i] gets the median microseconds of
 * fns[i] over reps after warmup rounds. With delay_us > 0 every timed call follows that long a
 * nearly idle device (tw__bench_delay, outside the call's events), as in `tilewave bench`;
 * with 0 the calls run back to back, a sustained load. Returns false on a failure. */
template <typename F>
static bool twb_time_interleaved(const std::vector<F>& fns, int warmup, int reps, int delay_us,
                                 cudaStream_t s, std::vector<double>& us) {
  const size_t n = fns.size();
  for (int i = 0; i < warmup; i++)
    for (size_t f = 0; f < n; f++)
      if (fns[f]() != 0) return false;
  /* ev[2j], ev[2j + 1]: the start and end of the rep's j-th call. */
  std::vector<cudaEvent_t> ev(2 * n);
  for (auto& e : ev) cudaEventCreate(&e);
  std::vector<std::vector<float>> ms(n);
  bool ok = true;
  for (int i = 0; i < reps && ok; i++) {
    for (size_t j = 0; j < n && ok; j++) {
      ok = tw__bench_delay(s, delay_us) == TW_SUCCESS; /* nothing when delay_us is 0 */
      cudaEventRecord(ev[2 * j], s);
      ok = ok && fns[(j + i) % n]() == 0;
      cudaEventRecord(ev[2 * j + 1], s);
    }
    cudaEventSynchronize(ev[2 * n - 1]);
    for (size_t j = 0; j < n; j++) {
      float t = 0;
      cudaEventElapsedTime(&t, ev[2 * j], ev[2 * j + 1]);
      ms[(j + i) % n].push_back(t);
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  us.resize(n);
  for (size_t f = 0; f < n; f++)
    us[f] =
        ms[f].empty() ? 0.0 : tw__stats_percentile_f(ms[f].data(), (int)ms[f].size(), 0.5) * 1000.0;
  return ok;
}

#endif /* TW_BENCH_GEMM_COMMON_H */
