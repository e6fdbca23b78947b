/*
 * reduce.cu: the owner's weighted reduction, the last step of the combine:
 *   out[t] = sum_j w[t][j] * row(slot_row[t * k + j])     (fp32 accumulation, bf16 result)
 * where a row index below recv_rows names a row other ranks wrote into this rank's receive
 * window and any other index names a local row of this rank's own GEMM output.
 *
 * Work: one thread per (token, 16-byte column vector), grid-stride. A thread loads the token's k
 * slot rows and weights first, then the k row loads, then sums (at least two row loads in flight
 * per thread, not one dependent index-then-row round trip per slot); the (token, vector) pair
 * advances by a precomputed stride (no 64-bit division per vector). The grid is every CTA that
 * fits, up to about 144 KB of row loads in flight per SM. Occupancy was the main limit: in the
 * lab (dev/reduce/README.md) this ran at 0.95-0.97 of a device copy for k = 2-6 where the former
 * kernel (4 CTAs per SM, one load in flight) ran at 0.76-0.79.
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

#include "bf16x8.cuh"
#include "core.h"

namespace {

constexpr int kReduceThreads = 256;
/* Slots whose row loads one thread keeps in flight at once; larger top_k goes in chunks of it. */
constexpr int kMaxSlotsInFlight = 8;
/* Most row bytes in flight per SM the grid aims for (see tw__reduce_ctas_per_sm). */
constexpr int kRowBytesInFlightPerSm = 144 * 1024;

/* Debug tags: one thread per (token, slot) checks that the row came exactly once per column
 * tile, records what it saw, and clears it for the next call (before the credits go back). A
 * separate grid-stride pass, so the data loop carries none of it (registers). */
__device__ void tw__check_tags(const tw_reduce_args& a) {
  uint32_t* tags = reinterpret_cast<uint32_t*>(a.local_win + a.lay.tags);
  uint32_t* hits = reinterpret_cast<uint32_t*>(a.local_win + a.lay.hits);
  const int64_t slots = (int64_t)a.tokens * a.top_k;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < slots;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int r = a.slot_row[i];
    uint32_t seen = 0xFFFF0000u; /* local row: never transported */
    if (r < a.recv_rows) {
      const uint32_t h = __ldcg(&hits[r]), tag = __ldcg(&tags[r]);
      seen = (tag << 16) | (h & 0xFFFFu);
      if (h != (uint32_t)a.col_tiles)
        tw_report_error(a.err, TW_ERR_INTERNAL, TW_CHECK_TAGS, (int32_t)i, h, (uint32_t)a.col_tiles,
                        a.rank);
      hits[r] = 0;
      tags[r] = 0;
    }
    a.debug_slots[i] = seen;
  }
}

/* The data part. K = top_k (1..kMaxSlotsInFlight), or 0 for any top_k (chunks of
 * kMaxSlotsInFlight slots, the sums still in slot order). */
template <int K>
__device__ __forceinline__ void tw__reduce_rows(const tw_reduce_args& a) {
  constexpr int KC = K > 0 ? K : kMaxSlotsInFlight;
  const int k = K > 0 ? K : a.top_k;
  const int vpr = a.hidden / 8; /* 16-byte vectors per row */
  const size_t row_bytes = (size_t)a.hidden * 2;
  /* Row r's address is base + r * row_bytes with base = the receive window below recv_rows and
   * the GEMM output shifted down by recv_rows rows above (a select per slot, no branch). Integer
   * arithmetic: the shifted base lies outside any allocation. */
  const uintptr_t recv_base = (uintptr_t)(a.local_win + a.lay.data);
  const uintptr_t local_base = (uintptr_t)a.c - (uintptr_t)a.recv_rows * row_bytes;
  /* This thread's first (token t, vector q) and the grid stride in the same terms: one division
   * per thread; q carries into t at most once per step (sq < vpr). */
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int t = (int)(first / vpr), q = (int)(first - (int64_t)t * vpr);
  const int st = (int)(stride / vpr), sq = (int)(stride - (int64_t)st * vpr);
  for (; t < a.tokens; t += st, q += sq, t += q >= vpr, q -= q >= vpr ? vpr : 0) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < k; j0 += KC) { /* one pass when K > 0 */
      const int n = K > 0 ? K : min(KC, k - j0);
      int r[KC];
      float w[KC];
      int4 x[KC];
      /* slot_row and weights are not written while this kernel runs: read-only path. */
#pragma unroll
      for (int j = 0; j < KC; j++) {
        r[j] = j < n ? __ldg(&a.slot_row[(size_t)t * k + j0 + j]) : 0;
        w[j] = j < n ? __ldg(&a.weights[(size_t)t * k + j0 + j]) : 0.f;
      }
      /* The row loads, independent of each other (the sums come after). */
#pragma unroll
      for (int j = 0; j < KC; j++) {
        const uintptr_t row =
            (r[j] < a.recv_rows ? recv_base : local_base) + (uintptr_t)r[j] * row_bytes;
        x[j] = j < n ? __ldcg(reinterpret_cast<const int4*>(row) + q) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < KC; j++)
        if (j < n) tw__acc_bf16x8(acc, x[j], w[j]);
    }
    __align__(16) __nv_bfloat162 o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden)[q] = *reinterpret_cast<int4*>(o);
  }
}

template <int K>
__global__ void __launch_bounds__(kReduceThreads) tw_reduce_kernel(const tw_reduce_args a) {
  __shared__ int s_ok;
  __shared__ int s_last;
  const char* win = a.local_win;
  const uint32_t* arrivals = reinterpret_cast<const uint32_t*>(win + a.lay.arrive);
  if (threadIdx.x == 0) {
    tw_trace_event(a.trace, TW_TRACE_REDUCE_BEGIN, blockIdx.x, 0);
    bool ok = true;
    for (int s = 0; s < a.world && ok; s++)
      if (s != a.rank)
        ok = tw_wait_arrivals_exact(&arrivals[s], a.state->arrive_target[s], a.timeout_ns, a.err, s,
                                    a.rank);
    /* Every source that sent here planned this call as this rank did: its word arrived before
     * its last arrivals (tw__announce), which the acquire above has seen. */
    if (ok && a.plan_fp != nullptr) {
      const uint64_t mine = *a.plan_fp;
      const uint64_t want = tw_plan_fp_of_call(mine, a.state->epoch);
      const volatile uint64_t* slot =
          reinterpret_cast<const volatile uint64_t*>(win + a.lay.plan_fp);
      for (int s = 0; s < a.world && ok; s++) {
        if (s == a.rank || a.recv_units[s] == 0) continue;
        const uint64_t got = slot[s];
        if (got != want) {
          tw_report_error(a.err, TW_ERR_INVALID_ARGUMENT, TW_CHECK_PLAN, s,
                          (uint32_t)(got - (want - mine)), (uint32_t)mine, a.rank);
          ok = false;
        }
      }
    }
    /* This rank's consumer ended before this kernel (stream order): it must have taken every
     * unit of this call, in this call. */
    if (ok && a.consumer_units > 0 && blockIdx.x == 0) {
      const volatile tw_call_state* st = a.state;
      if (st->consumer_units != (uint32_t)a.consumer_units || st->consumer_epoch != st->epoch) {
        tw_report_error(a.err, TW_ERR_INTERNAL, TW_CHECK_CONSUMER, (int32_t)st->consumer_epoch,
                        st->consumer_units, (uint32_t)a.consumer_units, a.rank);
        ok = false;
      }
    }
    if (ok) tw_trace_event(a.trace, TW_TRACE_REDUCE_ARRIVED, blockIdx.x, 0);
    s_ok = ok;
  }
  __syncthreads();

  if (s_ok) {
    if (a.debug_tags) tw__check_tags(a);
    tw__reduce_rows<K>(a);
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
          char* peer = a.peers[s];
          tw_red_release_sys(reinterpret_cast<uint32_t*>(peer + a.lay.credit) + a.rank, 1u);
        }
      }
    }
    tw_trace_event(a.trace, TW_TRACE_REDUCE_END, blockIdx.x, 0);
  }
}

typedef void (*tw__reduce_fn)(const tw_reduce_args);

/* Index K (0..kMaxSlotsInFlight) -> kernel; 0 = any top_k. */
const tw__reduce_fn kReduceKernels[kMaxSlotsInFlight + 1] = {
    tw_reduce_kernel<0>, tw_reduce_kernel<1>, tw_reduce_kernel<2>,
    tw_reduce_kernel<3>, tw_reduce_kernel<4>, tw_reduce_kernel<5>,
    tw_reduce_kernel<6>, tw_reduce_kernel<7>, tw_reduce_kernel<8>};

/* CTAs per SM for kernel index K: every CTA that fits (registers limit it), but at most about
 * 144 KB of row loads in flight per SM (CTAs x 256 threads x K x 16 bytes). Lab on H200: at
 * k = 8, 4 CTAs per SM ran 5% faster than 5; at k = 6, 6 ran 11% faster than 4; at k = 2, 8 ran
 * 10% faster than 4. Queried once (function-local statics are initialised once, thread-safely). */
int tw__reduce_ctas_per_sm(int K) {
  struct table {
    int n[kMaxSlotsInFlight + 1];
    table() {
      for (int i = 0; i <= kMaxSlotsInFlight; i++) {
        const int slots = i > 0 ? i : kMaxSlotsInFlight;
        int fit = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kReduceKernels[i], kReduceThreads,
                                                          0) != cudaSuccess ||
            fit < 1)
          fit = 4; /* the former fixed cap; launch errors still surface at the launch */
        int cap = kRowBytesInFlightPerSm / (kReduceThreads * 16 * slots);
        if (cap < 1) cap = 1;
        n[i] = fit < cap ? fit : cap;
      }
    }
  };
  static const table tab;
  return tab.n[K];
}

}  // namespace

tw_status tw__reduce_launch(const tw_reduce_args* args, int sms, int ctas_per_sm, int32_t* grid_out,
                            int32_t* cap_out, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  TW_CHECK_NULL(grid_out);
  TW_CHECK_NULL(cap_out);
  if (args->hidden <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "reduce: hidden %d must be positive", args->hidden);
  if (args->hidden % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "reduce: hidden %d must be a multiple of 8", args->hidden);
  if (args->world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_UNSUPPORTED, "reduce: world size %d > %d", args->world, TW_MAX_RANKS);
  if (args->state == NULL) return tw__fail(TW_ERR_INTERNAL, "reduce: no call state");
  if (args->top_k < 1)
    return tw__fail(TW_ERR_TOPK_RANGE, "reduce: top_k %d must be at least 1", args->top_k);
  const int K = args->top_k <= kMaxSlotsInFlight ? args->top_k : 0;
  const int64_t items = (int64_t)args->tokens * (args->hidden / 8);
  int64_t grid = (items + kReduceThreads - 1) / kReduceThreads;
  if (sms < 1 || ctas_per_sm < 0)
    return tw__fail(TW_ERR_INTERNAL, "reduce: %d SMs, %d CTAs per SM", sms, ctas_per_sm);
  const int64_t cap = (int64_t)sms * (ctas_per_sm > 0 ? ctas_per_sm : tw__reduce_ctas_per_sm(K));
  if (grid > cap) grid = cap;
  if (grid < 1) grid = 1;
  *grid_out = (int32_t)grid;
  *cap_out = (int32_t)cap;
  kReduceKernels[K]<<<(unsigned)grid, kReduceThreads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "reduce: launch of %lld CTAs failed: %s", (long long)grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}
