/*
 * bf16x8.cuh: the owner's reduction arithmetic on one 16-byte vector (8 bf16 values), shared by
 * the reduction kernel and the labs that must sum exactly like it (dev/reduce/).
 */
#pragma once

#include <cuda_bf16.h>

/* acc[0..8) += w * the 8 bf16 values of v: fp32 fmaf per element, the order the output's bits
 * depend on. */
__device__ __forceinline__ void tw__acc_bf16x8(float* acc, int4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}
