/*
 * lab_common.cuh: what the reduction labs (reduce_lab.cu, idle_warps.cu) share: a CUDA error
 * check that stops the lab (dev/gemm/idle_warps_lab.cu uses it too), and the library's reduction
 * arithmetic (src/kernels/bf16x8.cuh), so that every lab sums exactly like the library.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "../../src/kernels/bf16x8.cuh"

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
