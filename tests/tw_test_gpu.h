/*
 * tw_test_gpu.h: GPU-test helpers. Tests that need N GPUs call tw_test_require_gpus(N) first; it
 * exits with ctest's skip code where fewer exist, so CI (no GPU) skips them cleanly.
 */
#ifndef TW_TEST_GPU_H
#define TW_TEST_GPU_H

#include <cuda_runtime.h>

#include "tw_test.h"

static inline int tw_test_gpu_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

static inline void tw_test_require_gpus(int needed) {
  int n = tw_test_gpu_count();
  if (n < needed) {
    printf("needs %d GPU(s), found %d: skipped\n0 passed, 0 failed\n", needed, n);
    exit(TW_TEST_SKIP);
  }
}

#define CHECK_CUDA(expr)                                                            \
  do {                                                                              \
    cudaError_t tw_e_ = (expr);                                                     \
    if (tw_e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "  CUDA error at %s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
              cudaGetErrorString(tw_e_));                                           \
      tw_test_failures_++;                                                          \
    }                                                                               \
  } while (0)

#endif /* TW_TEST_GPU_H */
