/*
 * bench_cublas.h: the device, stream and cuBLAS handle that `bench gemm` and `bench gemm1` time
 * against (CUDA C++ translation units of tools/ only).
 */
#ifndef TW_BENCH_CUBLAS_H
#define TW_BENCH_CUBLAS_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>

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

#endif /* TW_BENCH_CUBLAS_H */
