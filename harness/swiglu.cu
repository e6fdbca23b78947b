/*
 * swiglu.cu: SwiGLU over a GEMM output of gate and up columns (swiglu.h). One thread per 8
 * output columns: two 16-byte (bf16) or four 16-byte (fp32) loads of each half, one 16-byte
 * store; a grid-stride loop over rows x ffn / 8 vectors. Memory-bound by design; it exists as the
 * unfused reference and the cuBLAS baseline's epilogue, not to be fast beyond that.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core.h"
#include "swiglu.cuh"
#include "swiglu.h"

namespace {

template <bool kF32>
__global__ void tw__swiglu_kernel(const void* __restrict__ gu, uint4* __restrict__ h, int64_t rows,
                                  int32_t ffn) {
  const int32_t vecs = ffn / 8; /* 8-column vectors per output row */
  const int64_t n = rows * vecs;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / vecs;
    const int32_t c = (int32_t)(i - r * vecs) * 8;
    float g[8], u[8];
    if (kF32) {
      const float* row = static_cast<const float*>(gu) + r * 2 * ffn;
      const float4* gp = reinterpret_cast<const float4*>(row + c);
      const float4* up = reinterpret_cast<const float4*>(row + ffn + c);
      const float4 g0 = gp[0], g1 = gp[1], u0 = up[0], u1 = up[1];
      g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w;
      g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
      u[0] = u0.x, u[1] = u0.y, u[2] = u0.z, u[3] = u0.w;
      u[4] = u1.x, u[5] = u1.y, u[6] = u1.z, u[7] = u1.w;
    } else {
      const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(gu) + r * 2 * ffn;
      const uint4 gv = *reinterpret_cast<const uint4*>(row + c);
      const uint4 uv = *reinterpret_cast<const uint4*>(row + ffn + c);
      const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
      const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 gf = __bfloat1622float2(g2[j]), uf = __bfloat1622float2(u2[j]);
        g[2 * j] = gf.x, g[2 * j + 1] = gf.y, u[2 * j] = uf.x, u[2 * j + 1] = uf.y;
      }
    }
    uint4 out;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; j++)
      o2[j] = __floats2bfloat162_rn(tw__swiglu(g[2 * j], u[2 * j]),
                                    tw__swiglu(g[2 * j + 1], u[2 * j + 1]));
    h[i] = out; /* (r, c .. c + 8) of h: vector r * vecs + c / 8 = i */
  }
}

}  // namespace

extern "C" tw_status tw__swiglu_launch(const void* gu, int gu_f32, void* h, int64_t rows,
                                       int32_t ffn, cudaStream_t stream) {
  if (rows < 0 || ffn < 1)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__swiglu_launch: rows %lld, ffn %d", (long long)rows,
                    ffn);
  if (ffn % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "tw__swiglu_launch: ffn = %d; must be a multiple of 8", ffn);
  if (rows == 0) return TW_SUCCESS;
  TW_CHECK_NULL(gu);
  TW_CHECK_NULL(h);
  if (((uintptr_t)gu | (uintptr_t)h) % 16 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "tw__swiglu_launch: gu and h must be 16-byte aligned");
  const int64_t vecs = rows * (ffn / 8);
  const int64_t blocks = (vecs + 255) / 256 < 132 * 16 ? (vecs + 255) / 256 : 132 * 16;
  if (gu_f32)
    tw__swiglu_kernel<true>
        <<<(unsigned)blocks, 256, 0, stream>>>(gu, static_cast<uint4*>(h), rows, ffn);
  else
    tw__swiglu_kernel<false>
        <<<(unsigned)blocks, 256, 0, stream>>>(gu, static_cast<uint4*>(h), rows, ffn);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__swiglu_launch: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}
