/*
 * reduce.cu: the owner's weighted reduction, the last step of the combine:
 *   out[t] = sum_j w[t][j] * row(slot_row[t * k + j])     (fp32 accumulation, bf16 result)
 * where a row index below recv_rows names a row other ranks wrote into this rank's receive
 * window and any other index names a local row of this rank's own GEMM output.
 *
 * Work: blocks of kBlockTokens tokens taken in `order` (tokens sorted by when their local rows
 * are finished: the planner's schedule order of their bands) from a counter shared by every
 * launch of the call. In overlap mode the runtime starts an early launch on the consumer's SMs
 * as soon as the consumer is done, while the producer is still computing local bands: it waits
 * for each block's local bands (acquire .gpu on the band counters) and so reduces tokens as
 * their rows finish; the launch after the producer takes whatever is left, on every SM, without
 * waiting (stream order). Every token is reduced by exactly one CTA with the same arithmetic in
 * every mode, so the split never changes a bit.
 *
 * Each CTA first waits (thread 0, acquire .sys, bounded) until every source rank has announced
 * all of this call's units, then reads. When the last CTA of all launches has finished reading,
 * it hands one credit per call back to every source rank (release .sys into the source's
 * window): the sources may then overwrite the receive buffer in the next call.
 *
 * NOTES: thread 0's acquire of the arrival counters (and each waiting thread's acquire of a band
 * counter), followed by a barrier, makes the peers' stores (released after their own barriers)
 * and the producer's tiles visible to every thread of the CTA. Reads go through L2 only
 * (__ldcg): the rows were written by other GPUs over NVLink or by other SMs in this kernel's
 * lifetime; L1 is not coherent with them. The credits are released only after every CTA's
 * loads: CTA -> barrier -> fence -> completion counter; the last CTA fences again and then
 * releases at system scope, which is cumulative over everything ordered before it.
 */
#include "combine.h"

#include <cuda_bf16.h>
#include <nccl_device.h>

#include "core.h"

namespace {

constexpr int kReduceThreads = 256;
constexpr int kBlockTokens = 16; /* tokens per unit of work */

__device__ __forceinline__ void tw__acc_bf16x8(float* acc, int4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

__global__ void __launch_bounds__(kReduceThreads, 4) tw_reduce_kernel(const tw_reduce_args a) {
  __shared__ int s_ok;
  __shared__ int s_last;
  __shared__ uint32_t s_block;
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

  const int vpr = a.hidden / 8; /* 16-byte vectors per row */
  const uint32_t blocks = (uint32_t)(a.tokens + kBlockTokens - 1) / kBlockTokens;
  const size_t row_bytes = (size_t)a.hidden * 2;
  const char* recv = win + a.lay.data;
  const char* local = reinterpret_cast<const char*>(a.c);
  uint32_t* tags = reinterpret_cast<uint32_t*>(a.local_win + a.lay.tags);
  uint32_t* hits = reinterpret_cast<uint32_t*>(a.local_win + a.lay.hits);
  bool ok = s_ok;
  while (ok) {
    if (threadIdx.x == 0) s_block = atomicAdd(a.next, 1u);
    __syncthreads();
    const uint32_t blk = s_block;
    if (blk >= blocks) break;
    const int t0 = (int)blk * kBlockTokens;
    const int nt = min(kBlockTokens, a.tokens - t0);
    if (a.wait_bands) {
      /* One thread per (token, slot) of the block waits for the slot's local band. */
      bool mine = true;
      for (int i = threadIdx.x; i < nt * a.top_k; i += blockDim.x) {
        const int t = a.order[t0 + i / a.top_k];
        const int b = a.slot_band[(size_t)t * a.top_k + i % a.top_k];
        if (b >= 0 && mine)
          mine = tw_wait_geq(&a.band_counters[b], (uint32_t)a.col_tiles, false, a.timeout_ns, a.err,
                             TW_WAIT_BAND, b, a.rank);
      }
      if (!__syncthreads_and(mine)) break; /* recorded; every thread leaves together */
    }
    for (int it = threadIdx.x; it < nt * vpr; it += blockDim.x) {
      const int t = a.order[t0 + it / vpr], q = it % vpr;
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
    __syncthreads(); /* every thread has read s_block before thread 0 takes the next block */
  }

  /* Credits: only once every CTA of every launch has finished reading (see NOTES). A failed
   * call returns none: the context must be reset, and holding them back keeps late writers out
   * of the buffer. The last CTA also rewinds the block counter for the next call. */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(a.done, 1u) == (uint32_t)a.total_ctas - 1;
    if (s_last) {
      __threadfence();
      *a.done = 0;
      *a.next = 0;
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

int tw__reduce_grid(int32_t tokens, int sm_count) {
  const int64_t blocks = ((int64_t)tokens + kBlockTokens - 1) / kBlockTokens;
  const int64_t cap = (int64_t)(sm_count > 0 ? sm_count : 132) * 4;
  return (int)(blocks < 1 ? 1 : blocks > cap ? cap : blocks);
}

tw_status tw__reduce_launch(const tw_reduce_args* args, int grid, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  if (args->hidden % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "reduce: hidden %d must be a multiple of 8", args->hidden);
  if (args->world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_UNSUPPORTED, "reduce: world size %d > %d", args->world, TW_MAX_RANKS);
  if (grid < 1 || grid > args->total_ctas)
    return tw__fail(TW_ERR_INTERNAL, "reduce: %d CTAs of %d in all", grid, args->total_ctas);
  tw_reduce_kernel<<<(unsigned)grid, kReduceThreads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "reduce: launch of %d CTAs failed: %s", grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}
