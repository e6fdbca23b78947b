/*
 * swiglu.cuh: the SwiGLU arithmetic of one element, shared by the fused GEMM1 epilogue
 * (sm90_gemm.cu) and the unfused path's elementwise kernel (harness/swiglu.cu), so that the two
 * round the same fp32 values to the same bf16 bits.
 */
#pragma once

/* silu(x) = x / (1 + exp(-x)) in fp32: __expf (ex2.approx of x * log2 e) and an IEEE division;
 * a large negative x gives exp(-x) = inf and x / inf = -0, not a NaN. */
__device__ __forceinline__ float tw__silu(float x) {
  return x / (1.0f + __expf(-x));
}

/* One output element of GEMM1 + SwiGLU from its fp32 gate and up accumulators. */
__device__ __forceinline__ float tw__swiglu(float gate, float up) {
  return tw__silu(gate) * up;
}

/* A lab form (TW_GEMM1_LEVER_TANH): silu(x) = 0.5 x (1 + tanh(x / 2)) with tanh.approx.f32, one
 * MUFU operation where __expf and the IEEE division take one each plus the division's
 * refinement; tanh.approx's relative error is about 2^-11, below bf16's 2^-8. Not bit-equal to
 * tw__swiglu. */
__device__ __forceinline__ float tw__swiglu_tanh(float gate, float up) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * gate));
  const float h = 0.5f * gate;
  return fmaf(h, t, h) * up;
}
