/*
 * fill.cu: fills a bf16 buffer with one bit pattern. Tests poison outputs with a NaN pattern
 * before every run so that an element nobody wrote can never pass a check.
 */
#include "kernels.h"
#include "core.h"

__global__ void tw_fill_u16_kernel(uint16_t* dst, size_t n, uint16_t bits) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = bits;
}

extern "C" tw_status tw__fill_bf16(void* dst, size_t n, uint16_t bits, cudaStream_t stream) {
  if (n == 0) return TW_SUCCESS;
  TW_CHECK_NULL(dst);
  unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
  tw_fill_u16_kernel<<<blocks, 256, 0, stream>>>((uint16_t*)dst, n, bits);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__fill_bf16: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}
