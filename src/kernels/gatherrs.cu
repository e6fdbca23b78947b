/*
 * gatherrs.cu: the tensor-parallel consumer (gatherrs.h). Persistent, C CTAs; CTA b takes the
 * comm tiles b, b + C, ... of the rank's block (split-major, so every CTA works through the
 * splits in the order the producers publish them). For a tile of split s it first waits (thread
 * 0, bounded) until segment s is complete on every TP rank of its group, then each thread takes
 * 16-byte column vectors of the tile's rows: it loads the vector from every TP rank's partial sums
 * (all loads first, then the sums), adds them in TP order in fp32 (the first taken as it is, as
 * the CPU reference does), rounds once to bf16 and stores the result at the row's owner. Padding
 * rows are skipped. Before its first store a CTA waits for every owner's credit of the previous
 * call; after its last, the CTA's completion is counted, and the last CTA announces the call to
 * every other rank (one arrival each).
 *
 * NOTES (memory ordering): thread 0's acquire (.sys) of a peer's segment counter, then the
 * barrier, makes the peer producer's stores of that split (released after its tile stores)
 * visible to every thread of the CTA; the partial sums are read through L2 only (__ldcg): they
 * were written by other SMs or GPUs, L1 is not coherent with them. The arrivals are released only
 * after every CTA's stores: stores -> barrier -> fence.sys -> completion counter; the last CTA
 * fences again and releases at system scope, which is cumulative over everything ordered before.
 */
#include "gatherrs.h"

#include <cuda_bf16.h>

#include "core.h"

namespace {

constexpr int kGatherThreads = 256;

/* Waits (thread 0 only) for segment `split` on every TP rank of the group; false on a timeout
 * or an error recorded elsewhere. */
__device__ bool tw__wait_segment(const tw_gatherrs_args& a, int split) {
  for (int q = 0; q < a.tp; q++) {
    const char* win = a.peers[a.group * a.tp + q];
    const uint32_t* seg = reinterpret_cast<const uint32_t*>(win + a.seg_off) + split;
    if (!tw_wait_geq(seg, a.seg_target, true, a.timeout_ns, a.err, TW_WAIT_SEGMENT, split, a.rank))
      return false;
  }
  return true;
}

/* One comm tile: every (row, vector) of it, summed over the TP ranks and stored at the owner. */
__device__ void tw__gather_tile(const tw_gatherrs_args& a, const tw_tp_comm_tile& t) {
  const int vpr = t.cols / 8;
  const int64_t items = (int64_t)t.rows * vpr;
  const size_t row_bytes = (size_t)a.hidden * 2;
  const char* src[TW_MAX_TP];
#pragma unroll
  for (int q = 0; q < TW_MAX_TP; q++)
    src[q] = q < a.tp ? a.peers[a.group * a.tp + q] + a.part_off : nullptr;
  for (int64_t it = threadIdx.x; it < items; it += blockDim.x) {
    const int r = (int)(it / vpr), v = (int)(it - (int64_t)r * vpr);
    const int lr = t.row0 + r - a.block_row0; /* row of the block */
    const int owner = __ldg(&a.dst_rank[lr]);
    if (owner < 0) continue; /* padding: computed, never delivered */
    const size_t off = (size_t)(t.row0 + r) * row_bytes + (size_t)t.col0 * 2 + (size_t)v * 16;
    int4 x[TW_MAX_TP];
#pragma unroll
    for (int q = 0; q < TW_MAX_TP; q++)
      x[q] = q < a.tp ? __ldcg(reinterpret_cast<const int4*>(src[q] + off)) : make_int4(0, 0, 0, 0);
    float acc[8];
    {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x[0]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = f.x;
        acc[2 * i + 1] = f.y;
      }
    }
#pragma unroll
    for (int q = 1; q < TW_MAX_TP; q++) {
      if (q >= a.tp) break;
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x[q]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
      }
    }
    __align__(16) __nv_bfloat162 o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    const size_t dst =
        (size_t)__ldg(&a.dst_row[lr]) * row_bytes + (size_t)t.col0 * 2 + (size_t)v * 16;
    char* base = owner == a.rank ? reinterpret_cast<char*>(a.red) : a.peers[owner] + a.data_off;
    *reinterpret_cast<int4*>(base + dst) = *reinterpret_cast<const int4*>(o);
  }
}

__global__ void __launch_bounds__(kGatherThreads) tw_gatherrs_kernel(const tw_gatherrs_args a) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    /* The owners' reductions of the previous call have read their receive rows. */
    const uint32_t* credits = reinterpret_cast<const uint32_t*>(a.local_win + a.credit_off);
    const uint32_t want = a.state->epoch - 1u;
    bool ok = true;
    for (int d = 0; d < a.world && ok; d++)
      if (d != a.rank)
        ok =
            tw_wait_geq(&credits[d], want, true, a.timeout_ns, a.err, TW_WAIT_TP_CREDIT, d, a.rank);
    s_ok = ok;
  }
  __syncthreads();
  bool ok = s_ok;
  int waited = -1; /* splits up to this one are complete on every TP rank */
  for (int i = blockIdx.x; i < a.num_tiles && ok; i += gridDim.x) {
    const tw_tp_comm_tile t = a.tiles[i];
    if (t.split > waited) {
      /* Every thread reads s_ok between two barriers, so thread 0's next write cannot race a
       * slow reader, and the loop's exit is uniform over the CTA. */
      __syncthreads();
      if (threadIdx.x == 0) s_ok = tw__wait_segment(a, t.split);
      __syncthreads();
      ok = s_ok;
      waited = t.split;
      if (!ok) break;
    }
    tw__gather_tile(a, t);
  }

  /* Arrivals: only once every CTA has stored (see NOTES). A failed call announces nothing: the
   * owners' waits then time out, which every rank reports. */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const bool last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence_system();
      *a.done = 0;
      if (*(volatile int32_t*)&a.err->status == 0)
        for (int d = 0; d < a.world; d++)
          if (d != a.rank)
            tw_red_release_sys(reinterpret_cast<uint32_t*>(a.peers[d] + a.arrive_off) + a.rank, 1u);
    }
  }
}

}  // namespace

tw_status tw__gatherrs_launch(const tw_gatherrs_args* args, int grid, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  if (grid < 1 || grid > TW_MAX_COMM_CTAS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "gatherrs: %d CTAs; must be 1..%d", grid,
                    TW_MAX_COMM_CTAS);
  if (args->tp < 1 || args->tp > TW_MAX_TP || args->world < 1 || args->world > TW_MAX_RANKS ||
      (args->group + 1) * args->tp > args->world)
    return tw__fail(TW_ERR_INTERNAL, "gatherrs: tp %d, group %d, world %d", args->tp, args->group,
                    args->world);
  if (args->hidden % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "gatherrs: hidden %d must be a multiple of 8", args->hidden);
  if (args->state == NULL || args->done == NULL || args->err == NULL || args->peers == NULL)
    return tw__fail(TW_ERR_INTERNAL, "gatherrs: missing state, counter, error word or peers");
  tw_gatherrs_kernel<<<grid, kGatherThreads, 0, stream>>>(*args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "gatherrs: launch of %d CTAs failed: %s", grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}
