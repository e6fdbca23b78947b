/*
 * reduce.cu: the owner's weighted reduction, the last step of the combine:
 *   out[t] = sum_j w[t][j] * row(slot_row[t * k + j])     (fp32 accumulation, bf16 result)
 * where a row index below recv_rows names a row other ranks wrote into this rank's receive
 * window and any other index names a local row of this rank's own GEMM output.
 *
 * Each CTA first waits (thread 0, acquire .sys, bounded) until every source rank has announced
 * all of this call's units, then reads. When the last CTA has finished reading, it hands one
 * credit per call back to every source rank (release .sys into the source's window): the
 * sources may then overwrite the receive buffer in the next call.
 *
 * NOTES: thread 0's acquire of the arrival counters, followed by the barrier, makes the peers'
 * stores (released after their own barriers) visible to every thread of the CTA. Reads go
 * through L2 only (__ldcg): the rows were written by other GPUs over NVLink, L1 is not coherent
 * with them. The credits are released only after every CTA's loads: CTA -> barrier -> fence ->
 * completion counter; the last CTA fences again and then releases at system scope, which is
 * cumulative over everything ordered before it.
 */
#include "combine.h"

#include <cuda_bf16.h>
#include <nccl_device.h>

#include "core.h"

namespace {

constexpr int kReduceThreads = 256;

__device__ __forceinline__ void tw__acc_bf16x8(float* acc, int4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

__global__ void __launch_bounds__(kReduceThreads) tw_reduce_kernel(const tw_reduce_args a) {
  __shared__ int s_ok;
  __shared__ int s_last;
  const char* win = a.local_win;
  const uint32_t* arrivals = reinterpret_cast<const uint32_t*>(win + a.lay.arrive);
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int s = 0; s < a.world && ok; s++)
      if (s != a.rank)
        ok = tw_wait_geq(&arrivals[s], a.arrive_target[s], true, a.timeout_ns, a.err,
                         TW_WAIT_ARRIVAL, s, a.rank);
    s_ok = ok;
  }
  __syncthreads();

  if (s_ok) {
    const int vpr = a.hidden / 8; /* 16-byte vectors per row */
    const int64_t items = (int64_t)a.tokens * vpr;
    const size_t row_bytes = (size_t)a.hidden * 2;
    const char* recv = win + a.lay.data;
    const char* local = reinterpret_cast<const char*>(a.c);
    uint32_t* tags = reinterpret_cast<uint32_t*>(a.local_win + a.lay.tags);
    uint32_t* hits = reinterpret_cast<uint32_t*>(a.local_win + a.lay.hits);
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
         it += (int64_t)gridDim.x * blockDim.x) {
      const int t = (int)(it / vpr), q = (int)(it - (int64_t)t * vpr);
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < a.top_k; j++) {
        const int r = a.slot_row[(size_t)t * a.top_k + j];
        const float w = a.weights[(size_t)t * a.top_k + j];
        const char* row = r < a.recv_rows ? recv + (size_t)r * row_bytes
                                          : local + (size_t)(r - a.recv_rows) * row_bytes;
        tw__acc_bf16x8(acc, __ldcg(reinterpret_cast<const int4*>(row) + q), w);
        if (a.debug_tags && q == 0) {
          /* One thread per (token, slot) checks that the row came exactly once per column tile,
           * records what it saw, and clears it for the next call (before the credits go back). */
          uint32_t seen = 0xFFFF0000u; /* local row: never transported */
          if (r < a.recv_rows) {
            const uint32_t h = __ldcg(&hits[r]), tag = __ldcg(&tags[r]);
            seen = (tag << 16) | (h & 0xFFFFu);
            if (h != (uint32_t)a.col_tiles)
              tw_report_error(a.err, TW_ERR_INTERNAL, TW_CHECK_TAGS, t * a.top_k + j, h,
                              (uint32_t)a.col_tiles, a.rank);
            hits[r] = 0;
            tags[r] = 0;
          }
          a.debug_slots[(size_t)t * a.top_k + j] = seen;
        }
      }
      __align__(16) __nv_bfloat162 o[4];
#pragma unroll
      for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden)[q] = *reinterpret_cast<int4*>(o);
    }
  }

  /* Credits: only once every CTA has finished reading (see NOTES). A failed call returns none:
   * the context must be reset, and holding them back keeps late writers out of the buffer. */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    if (s_last) {
      __threadfence();
      *a.done = 0;
      if (*(volatile int32_t*)&a.err->status == 0) {
        for (int s = 0; s < a.world; s++) {
          if (s == a.rank) continue;
          char* peer = static_cast<char*>(ncclGetPeerPointer(a.win, 0, s));
          tw_red_release_sys(reinterpret_cast<uint32_t*>(peer + a.lay.credit) + a.rank, 1u);
        }
      }
    }
  }
}

}  // namespace

tw_status tw__reduce_launch(const tw_reduce_args* args, int sm_count, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  if (args->hidden % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "reduce: hidden %d must be a multiple of 8", args->hidden);
  if (args->world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_UNSUPPORTED, "reduce: world size %d > %d", args->world, TW_MAX_RANKS);
  const int64_t items = (int64_t)args->tokens * (args->hidden / 8);
  int64_t grid = (items + kReduceThreads - 1) / kReduceThreads;
  const int64_t cap = (int64_t)(sm_count > 0 ? sm_count : 132) * 4;
  if (grid > cap) grid = cap;
  if (grid < 1) grid = 1;
  tw_reduce_kernel<<<(unsigned)grid, kReduceThreads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "reduce: launch of %lld CTAs failed: %s", (long long)grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}
