/*
 * swiglu.h: the unfused GEMM1's second half (internal; tests and benchmarks): SwiGLU as an
 * elementwise kernel over a (rows, 2 ffn) GEMM output whose columns [0, ffn) are the gate
 * projection and [ffn, 2 ffn) the up projection (w13's row order), as vLLM's silu_and_mul.
 * The arithmetic is the fused epilogue's own (src/kernels/swiglu.cuh), so an fp32 input from
 * tw__gemm_f32_launch reproduces tw__gemm1_swiglu_launch's output bit for bit.
 */
#ifndef TW_SWIGLU_H
#define TW_SWIGLU_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* h[r][j] = bf16(silu(gu[r][j]) * gu[r][ffn + j]) for every row r < rows and j < ffn.
 * [in]  gu (rows, 2 ffn): fp32 (gu_f32 = 1) or bf16 (gu_f32 = 0), row-major, 16-byte aligned
 * [out] h  (rows, ffn) bf16, 16-byte aligned
 * ffn must be a multiple of 8 (TW_ERR_ALIGNMENT). On `stream`, no synchronisation. */
tw_status tw__swiglu_launch(const void* gu, int gu_f32, void* h, int64_t rows, int32_t ffn,
                            cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TW_SWIGLU_H */
