/*
 * dispatch.cu: the dispatch kernels (dispatch.h): the two passes of the stable scan over a rank's
 * (token, slot) expert ids and the offsets between them, the copy of every token row to its
 * experts' ranks with its arrivals, the credits before it and the wait for the peers' rows.
 *
 * The scan keeps one running count per global expert per warp in shared memory (experts x 4
 * bytes a warp), so a CTA holds as many warps as fit in 48 KB, at most 8. Nothing in the scan
 * waits for anything; only the copy kernel (thread 0 of each CTA, for the destinations' credits)
 * and the one-CTA wait kernel (for the sources' arrivals) spin, each bounded by the timeout,
 * recording in the context's error word and returning (never trapping).
 *
 * NOTES: ordering.
 *  - Credits: a destination raises its credit with red.release.sys at the start of its call; a
 *    source's thread 0 acquires it (.sys) before its CTA's barrier and the CTA's stores, so no
 *    row lands before the destination's earlier reads of its buffer (previous kernels on its
 *    stream) are done.
 *  - Arrivals (as the reduction's credits, reduce.cu): each copy CTA's stores -> barrier ->
 *    thread 0's fence.sc.sys -> the CTA completion counter; the last CTA fences again and then
 *    release-adds (.sys) on every destination's arrival counter, cumulative over every CTA's
 *    stores ordered before it. The destination's wait kernel acquires (.sys) and then fences
 *    the async proxy (the GEMM reads the rows with TMA) before it ends; the GEMM starts after it
 *    in stream order.
 *  - Band counters (the banded copy of an overlapped layer): per unit, every warp's stores ->
 *    barrier -> thread 0's red.release.sys of the unit's rows on the destination's counter; the
 *    destination's GEMM1 acquires it (.sys) and fences the async proxy before its TMA loads.
 *    The per-CTA completion and the arrivals below follow as in the slot-order copy.
 *  - Live counts (the capturable mode): CTA 0's threads store them into the destinations'
 *    windows with its rows, after the credit, so the same chain (barrier, fence.sc.sys, the
 *    completion counter, the last CTA's release) publishes them; the destination's mask kernel
 *    reads them after its wait kernel's acquire, across a kernel boundary. A source writes them
 *    in call e only after the destination's credit of call e, raised after the destination's
 *    mask kernel of call e - 1 read them (stream order).
 *
 * Trace (trace.h; the args' trace pointer, NULL = off): each scan CTA's begin and end, each copy
 * CTA's begin, the end of its credit wait and the end of its stores (with the rows it sent), the
 * release of the arrivals, and in the wait kernel its begin and each source's arrival.
 */
#include "dispatch.h"

#include "core.h"
#include "trace.cuh"

namespace {

constexpr int kScanMaxWarps = 8;
constexpr int kScanSmemBytes = 48 * 1024;
constexpr int kCopyThreads = 512;
constexpr int kOffsetsThreads = 256;

/* One warp's copy of a row of vpr 16-byte vectors. Each lane loads kRowBatch vectors before it
 * stores any: with a store after each load the loads would go one at a time (the compiler does
 * not move a load past a store that may alias it), and a warp would copy at one load latency
 * per 512 bytes. */
constexpr int kRowBatch = 8;
__device__ __forceinline__ void tw__copy_row(int4* dst, const int4* src, int vpr, int lane) {
  for (int base = lane; base < vpr; base += 32 * kRowBatch) {
    int4 v[kRowBatch];
#pragma unroll
    for (int b = 0; b < kRowBatch; b++)
      if (base + 32 * b < vpr) v[b] = __ldg(src + base + 32 * b);
#pragma unroll
    for (int b = 0; b < kRowBatch; b++)
      if (base + 32 * b < vpr) dst[base + 32 * b] = v[b];
  }
}

__device__ __forceinline__ int64_t tw__load_id(const void* ids, int id64, int64_t i) {
  return id64 ? (int64_t)__ldg(static_cast<const long long*>(ids) + i)
              : (int64_t)__ldg(static_cast<const int32_t*>(ids) + i);
}

/* One warp's walk of chunk c (see dispatch.h). kPlace: from the chunk's prefix, writing each
 * slot's maps; else from zero, checking every id and writing the chunk's histogram. */
template <bool kPlace>
__device__ void tw__scan_chunk(const tw_dispatch_scan_args& a, int32_t* s_cnt, int c, int lane) {
  const int ET = a.experts;
  for (int g = lane; g < ET; g += 32) s_cnt[g] = kPlace ? a.chunk_hist[(size_t)c * ET + g] : 0;
  __syncwarp();
  const int64_t begin = (int64_t)c * a.chunk_slots;
  const int64_t end = begin + a.chunk_slots < a.slots ? begin + a.chunk_slots : a.slots;
  /* The loop bounds are the same for every lane: all 32 take part in each match. */
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    int32_t g = -1;
    if (i < end) {
      const int64_t v = tw__load_id(a.ids, a.id64, i);
      if (v >= 0 && v < ET) {
        g = (int32_t)v;
        if (!kPlace) { /* a token names an expert once: compare with its earlier slots */
          const int64_t j = i % a.top_k;
          for (int64_t jj = 1; jj <= j; jj++)
            if (tw__load_id(a.ids, a.id64, i - jj) == v)
              tw_report_error(a.err, TW_ERR_DUPLICATE_EXPERT, TW_CHECK_ID, (int32_t)i, (uint32_t)v,
                              (uint32_t)(i - jj), a.rank);
        }
      } else {
        /* Out of range: never counted or placed. The place pass runs only after every rank's
         * count pass found no bad id, so there it would be a bug. */
        tw_report_error(a.err, kPlace ? TW_ERR_INTERNAL : TW_ERR_EXPERT_ID, TW_CHECK_ID, (int32_t)i,
                        (uint32_t)(uint64_t)v, (uint32_t)ET, a.rank);
      }
      /* A NaN or infinite weight would spread through the owner's weighted sum. */
      if (!kPlace && a.weights_in != nullptr) {
        const float w = __ldg(&a.weights_in[i]);
        if (!isfinite(w))
          tw_report_error(a.err, TW_ERR_INVALID_ARGUMENT, TW_CHECK_WEIGHT, (int32_t)i,
                          __float_as_uint(w), 0u, a.rank);
      }
    }
    /* Lanes without an expert get keys no other lane has. */
    const unsigned same = __match_any_sync(0xffffffffu, g >= 0 ? g : ET + lane);
    const int32_t pos = g >= 0 ? s_cnt[g] + __popc(same & ((1u << lane) - 1u)) : 0;
    __syncwarp();
    /* One lane per expert of this step (its highest) advances the expert's count. */
    if (g >= 0 && lane == 31 - __clz(same)) s_cnt[g] += __popc(same);
    __syncwarp();
    if (kPlace && g >= 0 && (a.capacity == 0 || pos < a.capacity)) {
      a.slot_row[i] = a.slot_base[g] + pos;
      a.send_row[i] = a.send_row0[g] + pos;
      a.weights_out[i] = __ldg(&a.weights_in[i]);
      if (a.send_slot != nullptr) a.send_slot[a.send_off[g] + pos] = (int32_t)i;
    } else if (kPlace && i < end && a.capacity > 0) {
      /* Not sent: past its group's capacity (the call fails, naming the token and the fix) or
       * a bad id (already recorded by the count pass). Row 0 keeps the reduction in bounds. */
      if (g >= 0)
        tw_report_error(a.err, TW_ERR_CAPACITY, TW_CHECK_CAPACITY, (int32_t)i, (uint32_t)g,
                        (uint32_t)a.capacity, a.rank);
      a.slot_row[i] = 0;
      a.send_row[i] = -1;
      a.weights_out[i] = 0.f;
    }
  }
  if (!kPlace)
    for (int g = lane; g < ET; g += 32) a.chunk_hist[(size_t)c * ET + g] = s_cnt[g];
  __syncwarp();
}

template <bool kPlace>
__global__ void tw_dispatch_scan_kernel(const tw_dispatch_scan_args a) {
  extern __shared__ int32_t s_scan[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  int32_t* s_cnt = s_scan + (size_t)warp * a.experts;
  if (threadIdx.x == 0) tw_trace_event(a.trace, TW_TRACE_SCAN_BEGIN, blockIdx.x, kPlace);
  for (int c = blockIdx.x * warps + warp; c < a.chunks; c += gridDim.x * warps)
    tw__scan_chunk<kPlace>(a, s_cnt, c, lane);
  if (tw_trace_on(a.trace)) { /* the warps are independent: the end is after all of them */
    __syncthreads();
    if (threadIdx.x == 0) tw_trace_event(a.trace, TW_TRACE_SCAN_END, blockIdx.x, kPlace);
  }
}

/* Per expert: exclusive prefix of the chunk histograms, in place, and the total. */
__global__ void tw_dispatch_offsets_kernel(const tw_dispatch_scan_args a) {
  const int ET = a.experts;
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < ET; g += gridDim.x * blockDim.x) {
    int32_t off = 0;
    for (int c = 0; c < a.chunks; c++) {
      const int32_t h = a.chunk_hist[(size_t)c * ET + g];
      a.chunk_hist[(size_t)c * ET + g] = off;
      off += h;
    }
    a.counts[g] = (uint32_t)off;
  }
}

__global__ void tw_dispatch_credit_kernel(const tw_dispatch_signal_args a) {
  const int d = threadIdx.x;
  /* NOTES: the band counters are zeroed before the credits: no source writes them until it has
   * acquired this rank's credit, and each credit's release (after the barrier) is cumulative
   * over every thread's zeroing stores. */
  if (a.world > 0 && a.lay.band_words > 0) {
    uint32_t* band = reinterpret_cast<uint32_t*>(a.peers[a.rank] + a.lay.band_arrive);
    for (uint32_t b = threadIdx.x; b < a.lay.band_words; b += blockDim.x) band[b] = 0u;
    __syncthreads();
  }
  if (d < a.world)
    tw_red_release_sys(reinterpret_cast<uint32_t*>(a.peers[d] + a.lay.credit) + a.rank, 1u);
  /* This call's credit target; the kernels after this one in stream order read it. */
  if (d == 0 && a.epochs != NULL) a.epochs[0] += 1u;
}

__global__ void tw_dispatch_copy_kernel(const tw_dispatch_copy_args a) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    tw_trace_event(a.trace, TW_TRACE_SEND_BEGIN, blockIdx.x, 0);
    bool ok = true;
    /* Nothing leaves this rank otherwise (the capturable mode always sends its live counts). */
    if ((a.slots > 0 || a.capacity > 0) && a.epochs != NULL) {
      const uint32_t target = a.epochs[0];
      const uint32_t* credits = reinterpret_cast<const uint32_t*>(a.peers[a.rank] + a.lay.credit);
      for (int d = 0; d < a.world && ok; d++)
        ok = tw_wait_geq(&credits[d], target, true, a.timeout_ns, a.err, TW_WAIT_DISPATCH_CREDIT, d,
                         a.rank);
    }
    if (ok) tw_trace_event(a.trace, TW_TRACE_SEND_CREDIT, blockIdx.x, 0);
    s_ok = ok;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  const int vpr = a.hidden / 8; /* 16-byte vectors per row */
  const size_t row_bytes = (size_t)a.hidden * 2;
  if (s_ok && a.units != nullptr) {
    /* The banded copy: a CTA's warps share one unit's rows, then (barrier) thread 0 announces
     * them on the destination's band counter. */
    const int cta_warp = threadIdx.x / 32, cta_warps = blockDim.x / 32;
    for (int u = blockIdx.x; u < a.num_units; u += gridDim.x) {
      if (u == a.skip_unit) continue; /* a test's fault; the same for the whole CTA */
      const tw_copy_unit un = a.units[u];
      char* base = a.peers[un.dest] + a.lay.rows;
      for (int j = cta_warp; j < un.rows; j += cta_warps) {
        int4* dst = reinterpret_cast<int4*>(base + (size_t)(un.row0 + j) * row_bytes);
        if (un.slot0 >= 0) {
          const int64_t i = a.send_slot[un.slot0 + j];
          const int4* src = reinterpret_cast<const int4*>(a.x + (i / a.top_k) * (int64_t)a.hidden);
          tw__copy_row(dst, src, vpr, lane);
        } else {
          for (int v = lane; v < vpr; v += 32) dst[v] = make_int4(0, 0, 0, 0);
        }
      }
      /* NOTES: every warp's stores, the barrier, then one thread's release (.sys, cumulative):
       * whoever acquires the counter at or past this unit's rows sees them. */
      __syncthreads();
      if (threadIdx.x == 0)
        tw_red_release_sys(
            reinterpret_cast<uint32_t*>(a.peers[un.dest] + a.lay.band_arrive) + un.band,
            (uint32_t)un.rows);
    }
  } else if (s_ok) {
    /* One warp per (token, slot): its token row to the slot's row at the expert's rank. x is
     * not written while the kernel runs (read-only path); the k reads of a row mostly hit L2. */
    for (int64_t i = warp; i < a.slots; i += warps) {
      const int32_t row = a.send_row[i];
      if (row < 0) continue; /* the capturable mode's unsent slots (warp-uniform) */
      const int32_t g = (int32_t)tw__load_id(a.ids, a.id64, i);
      const int4* src = reinterpret_cast<const int4*>(a.x + (i / a.top_k) * (int64_t)a.hidden);
      int4* dst = reinterpret_cast<int4*>(a.peers[g / a.local_experts] + a.lay.rows +
                                          (size_t)row * row_bytes);
      tw__copy_row(dst, src, vpr, lane);
    }
    /* The capturable mode: this rank's live rows of every group, into the expert's rank's window
     * beside the rows, so that the arrival release below covers them as it covers the rows. */
    if (a.capacity > 0 && blockIdx.x == 0)
      for (int g = threadIdx.x; g < a.experts; g += blockDim.x) {
        const int d = g / a.local_experts, e = g - d * a.local_experts;
        uint32_t* live = reinterpret_cast<uint32_t*>(a.peers[d] + a.lay.live);
        live[(size_t)e * a.world + a.rank] = min(a.counts[g], (uint32_t)a.capacity);
      }
    /* This rank's own padding rows, zero (computed by the GEMM, never sent). */
    const int n = a.pads[0];
    char* own = a.peers[a.rank] + a.lay.rows;
    for (int r = 0; r < n; r++) {
      const int32_t row0 = a.pads[1 + 2 * r], rows = a.pads[2 + 2 * r];
      for (int64_t w = warp; w < rows; w += warps) {
        int4* dst = reinterpret_cast<int4*>(own + (size_t)(row0 + w) * row_bytes);
        for (int v = lane; v < vpr; v += 32) dst[v] = make_int4(0, 0, 0, 0);
      }
    }
  }
  /* Arrivals: every CTA counts itself done after its stores (see NOTES); the last one
   * announces this rank's rows to every rank, unless the call has failed (its peers then time
   * out instead of reading partial rows). Every CTA counts, failed or not, so that the counter
   * is back at zero after every launch. */
  __syncthreads();
  if (threadIdx.x == 0) {
    if (tw_trace_on(a.trace)) {
      /* The token rows this CTA's warps sent: warp w takes slots w, w + warps, ... */
      const int64_t wpc = blockDim.x / 32, w0 = (int64_t)blockIdx.x * wpc;
      int64_t rows = 0;
      for (int u = blockIdx.x; s_ok && a.units != nullptr && u < a.num_units; u += gridDim.x)
        if (u != a.skip_unit && a.units[u].slot0 >= 0) rows += a.units[u].rows; /* its units */
      for (int64_t w = w0; s_ok && a.units == nullptr && w < w0 + wpc && w < a.slots; w++)
        rows += (a.slots - 1 - w) / warps + 1;
      tw_trace_event(a.trace, TW_TRACE_SEND_END, blockIdx.x, (uint32_t)rows);
    }
    __threadfence_system();
    if (atomicAdd(a.done, 1u) == gridDim.x - 1) {
      __threadfence_system();
      *a.done = 0;
      if (a.epochs != NULL) a.epochs[1] += 1u; /* the wait kernel's target, failed call or not */
      if (*(volatile int32_t*)&a.err->status == 0) {
        for (int d = 0; d < a.world; d++)
          tw_red_release_sys(reinterpret_cast<uint32_t*>(a.peers[d] + a.lay.arrive) + a.rank, 1u);
        tw_trace_event(a.trace, TW_TRACE_SEND_ARRIVE, blockIdx.x, (uint32_t)a.world);
      }
    }
  }
}

/* Waits (one thread per source) until every rank's rows for this call have arrived. */
__global__ void tw_dispatch_wait_kernel(const tw_dispatch_signal_args a) {
  const int s = threadIdx.x;
  if (s == 0) tw_trace_event(a.trace, TW_TRACE_RECV_BEGIN, 0, 0);
  if (s < a.world && a.epochs != NULL) {
    const uint32_t target = a.epochs[1];
    const uint32_t* arrivals = reinterpret_cast<const uint32_t*>(a.peers[a.rank] + a.lay.arrive);
    /* The GEMM after this kernel reads the rows with TMA (the async proxy). */
    if (tw_wait_geq(&arrivals[s], target, true, a.timeout_ns, a.err, TW_WAIT_DISPATCH_ARRIVAL, s,
                    a.rank)) {
      asm volatile("fence.proxy.async.global;" ::: "memory");
      tw_trace_event(a.trace, TW_TRACE_RECV_ARRIVED, 0, (uint32_t)s);
    }
  }
}

constexpr int kMaskThreads = 1024;

/* Stable compaction of the tiles whose band has live rows (one CTA, kMaskThreads threads): a
 * pass of kMaskThreads tiles at a time, each tile's slot from its warp's ballot and the warps'
 * totals before it. Returns the count (every thread). */
__device__ int tw__compact_tiles(const tw_tile* in, int n, const int32_t* band_live, tw_tile* out,
                                 int* s_warp) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int total = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int t = base + threadIdx.x;
    tw_tile tile;
    bool keep = false;
    if (t < n) {
      tile = in[t];
      keep = band_live[tile.band] > 0;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < warps; w++) {
      before += w < warp ? s_warp[w] : 0;
      sum += s_warp[w];
    }
    if (keep) out[total + before + __popc(ballot & ((1u << lane) - 1u))] = tile;
    total += sum;
    __syncthreads(); /* s_warp is rewritten by the next pass */
  }
  return total;
}

/* The capturable mode's mask (dispatch.h). The live words were written by the sources before
 * their arrival releases, which the wait kernel before this one acquired (.sys): the kernel
 * boundary orders those acquires before the plain loads here. */
__global__ void __launch_bounds__(kMaskThreads)
    tw_dispatch_mask_kernel(const tw_dispatch_mask_args a) {
  __shared__ int s_warp[kMaskThreads / 32];
  for (int b = threadIdx.x; b < a.num_bands; b += blockDim.x) {
    const int32_t n = (int32_t)a.live[a.band_group[b]] - a.band_first[b];
    a.band_live[b] = max(0, min(n, a.bands[b].rows));
  }
  __syncthreads(); /* band_live (global) is read by every thread below: bar.sync orders it */
  const int n2 = tw__compact_tiles(a.tiles, a.num_tiles, a.band_live, a.live_tiles, s_warp);
  const int n1 = a.tiles1 != nullptr
                     ? tw__compact_tiles(a.tiles1, a.num_tiles1, a.band_live, a.live_tiles1, s_warp)
                     : 0;
  if (threadIdx.x == 0) {
    a.live_counts[0] = n2;
    a.live_counts[1] = n1;
  }
}

/* Warps per scan CTA for `experts` running counts each. */
int tw__scan_warps(int experts) {
  int w = kScanSmemBytes / (experts * 4);
  return w < 1 ? 1 : w > kScanMaxWarps ? kScanMaxWarps : w;
}

tw_status tw__check_launch(const char* what, unsigned grid) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "dispatch: launch of the %s kernel (%u CTAs) failed: %s", what,
                    grid, cudaGetErrorString(e));
  return TW_SUCCESS;
}

template <bool kPlace>
tw_status tw__scan_launch(const tw_dispatch_scan_args* a, int sms, cudaStream_t stream) {
  if (a->experts < 1 || a->experts > TW_MAX_EXPERTS || a->top_k < 1 || a->slots < 0 ||
      a->chunks < 0 || a->chunks > TW_DISPATCH_MAX_CHUNKS || a->chunk_slots % 32 != 0 ||
      (int64_t)a->chunks * a->chunk_slots < a->slots || sms < 1)
    return tw__fail(TW_ERR_INTERNAL,
                    "dispatch: scan of %d slots in %d chunks of %d, %d experts, %d SMs", a->slots,
                    a->chunks, a->chunk_slots, a->experts, sms);
  if (a->chunks == 0) return TW_SUCCESS;
  const int warps = tw__scan_warps(a->experts);
  int grid = (a->chunks + warps - 1) / warps;
  if (grid > sms) grid = sms;
  const size_t smem = (size_t)warps * a->experts * 4;
  tw_dispatch_scan_kernel<kPlace><<<(unsigned)grid, warps * 32, smem, stream>>>(*a);
  return tw__check_launch(kPlace ? "place" : "count", (unsigned)grid);
}

}  // namespace

void tw__dispatch_chunks(int32_t slots, int32_t* chunks, int32_t* chunk_slots) {
  /* At least 32 slots (one step) per chunk, and every chunk but the last full. */
  const int64_t steps = ((int64_t)slots + 31) / 32;
  int64_t n = steps < TW_DISPATCH_MAX_CHUNKS ? steps : TW_DISPATCH_MAX_CHUNKS;
  const int64_t per = n > 0 ? (steps + n - 1) / n * 32 : 32;
  n = slots > 0 ? ((int64_t)slots + per - 1) / per : 0;
  *chunks = (int32_t)n;
  *chunk_slots = (int32_t)per;
}

tw_status tw__dispatch_count_launch(const tw_dispatch_scan_args* a, int sms, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  TW_TRY(tw__scan_launch<false>(a, sms, stream));
  int grid = (a->experts + kOffsetsThreads - 1) / kOffsetsThreads;
  if (grid > sms) grid = sms;
  if (grid < 1) grid = 1;
  tw_dispatch_offsets_kernel<<<(unsigned)grid, kOffsetsThreads, 0, stream>>>(*a);
  return tw__check_launch("offsets", (unsigned)grid);
}

tw_status tw__dispatch_place_launch(const tw_dispatch_scan_args* a, int sms, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  return tw__scan_launch<true>(a, sms, stream);
}

tw_status tw__dispatch_credit_launch(const tw_dispatch_signal_args* a, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  if (a->world < 0 || a->world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_INTERNAL, "dispatch: credits for %d ranks", a->world);
  tw_dispatch_credit_kernel<<<1, 256, 0, stream>>>(*a); /* >= TW_MAX_RANKS */
  return tw__check_launch("credit", 1);
}

tw_status tw__dispatch_copy_launch(const tw_dispatch_copy_args* a, int sms, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  TW_CHECK_NULL(a->pads);
  TW_CHECK_NULL(a->done);
  TW_CHECK_NULL(a->err);
  if (a->hidden < 8 || a->hidden % 8 != 0 || a->slots < 0 || a->top_k < 1 || a->local_experts < 1 ||
      a->world < 0 || a->world > TW_MAX_RANKS || sms < 1 || ((uintptr_t)a->x & 15) != 0)
    return tw__fail(TW_ERR_INTERNAL, "dispatch: copy of %d slots, hidden %d, %d ranks, %d SMs",
                    a->slots, a->hidden, a->world, sms);
  if (a->units != NULL && (a->send_slot == NULL || a->capacity > 0 || a->num_units < 0))
    return tw__fail(TW_ERR_INTERNAL, "dispatch: banded copy of %d units (capacity %d)",
                    a->num_units, a->capacity);
  /* One warp per slot (or padding row), or one CTA per unit; every CTA of the budget when there
   * is that much work. */
  const int64_t warps_per_cta = kCopyThreads / 32;
  const int64_t work = a->slots > a->pad_rows ? a->slots : a->pad_rows;
  int64_t grid = a->units != NULL ? a->num_units : (work + warps_per_cta - 1) / warps_per_cta;
  if (grid < 1) grid = 1;
  if (grid > sms) grid = sms;
  tw_dispatch_copy_kernel<<<(unsigned)grid, kCopyThreads, 0, stream>>>(*a);
  return tw__check_launch("copy", (unsigned)grid);
}

tw_status tw__dispatch_mask_launch(const tw_dispatch_mask_args* a, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  if (a->live == NULL || a->band_group == NULL || a->band_first == NULL || a->bands == NULL ||
      a->tiles == NULL || a->live_tiles == NULL || a->band_live == NULL || a->live_counts == NULL ||
      (a->tiles1 != NULL && a->live_tiles1 == NULL) || a->num_bands < 0 || a->num_tiles < 0 ||
      a->num_tiles1 < 0)
    return tw__fail(TW_ERR_INTERNAL, "dispatch: mask of %d bands, %d + %d tiles", a->num_bands,
                    a->num_tiles, a->num_tiles1);
  tw_dispatch_mask_kernel<<<1, kMaskThreads, 0, stream>>>(*a);
  return tw__check_launch("mask", 1);
}

tw_status tw__dispatch_wait_launch(const tw_dispatch_signal_args* a, cudaStream_t stream) {
  TW_CHECK_NULL(a);
  if (a->world < 0 || a->world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_INTERNAL, "dispatch: arrival wait for %d ranks", a->world);
  tw_dispatch_wait_kernel<<<1, TW_MAX_RANKS, 0, stream>>>(*a);
  return tw__check_launch("arrival wait", 1);
}
