/*
 * bench_common.cu: the device delay of the benchmark commands
 * (see bench_common.h).
 */
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
