/*
 * combine.cu: the consumer of GEMM2 + combine. A persistent kernel of C CTAs, on SMs the producer
 * leaves free, forwards every finished row band of the GEMM output to the rank that owns its
 * tokens, with ordinary stores straight into that rank's symmetric NCCL window (NVLink), and
 * announces each piece with a release reduction on the owner's arrival counter.
 *
 * Work is cut into units of (band, T consecutive column tiles) of the plan's segments, in
 * schedule order (the remote-first schedule makes this the order in which bands finish); unit u
 * belongs to CTA u mod C. A unit may leave once every band of its segment is complete, so a
 * coalesced segment goes out as one burst of contiguous remote rows. Units are
 * announced on the owner's arrival counter; the owner expects recv_bands * ceil(col_tiles / T)
 * per call, so T must be the same on every rank (the context checks). T = 1 by default.
 * A system-scope release waits until the CTA's NVLink stores are acknowledged (a round trip of
 * microseconds), so a CTA does not release after every unit: it counts finished units per
 * owner and releases them with one reduction per owner only when it is about to block on a
 * band that is not ready yet, and when it runs out of units. The owner waits for all units
 * anyway, so deferring an announcement to the next moment the CTA would idle costs nothing.
 *
 * NOTES: ordering, per unit:
 *  1. thread 0 acquires (.gpu) the band counters of the segment: the producer released them
 *     after its tile stores were complete, so the tile data is visible to thread 0; the barrier
 *     that follows extends this to every thread of the CTA (bar.sync orders thread 0's acquire
 *     before the other threads' loads);
 *  2. before the first write to an owner in this call, thread 0 acquires (.sys) the owner's
 *     credit for the previous call: the owner's reduction has finished reading its receive
 *     buffer, so our stores cannot overwrite rows it still needs;
 *  3. all threads store their part of the unit to the peer, then __syncthreads(); later (see
 *     above) thread 0 adds the owner's finished units to its arrival counter with
 *     red.release.sys. The barriers make every thread's stores happen-before thread 0's release,
 *     and release is cumulative, so an owner that acquires the counter sees all those units'
 *     rows, not just thread 0's.
 * Every wait is bounded (tw_wait_geq); on a timeout the CTA records the error and stops, and
 * the others stop at their next wait.
 */
#include "combine.h"

#include <nccl_device.h>

#include "core.h"

namespace {

constexpr int kConsumerThreads = 512;
constexpr int kUnroll = 8; /* independent 16-byte loads in flight per thread: 64 KiB per CTA */

/* Copies rows x (8 * vpr) bf16 from src (row stride src_ld elements) to dst (row stride dst_ld
 * elements) with 16-byte loads and stores; src through L2 only (the producer wrote it in this
 * kernel's lifetime, and L1 is not coherent). */
__device__ __forceinline__ void tw__copy_rows(char* dst, size_t dst_ld_bytes, const char* src,
                                              size_t src_ld_bytes, int rows, int vpr) {
  const int total = rows * vpr;
  for (int i0 = threadIdx.x; i0 < total; i0 += kUnroll * blockDim.x) {
    int4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; k++) {
      const int i = i0 + k * blockDim.x;
      if (i < total) {
        const int r = i / vpr, q = i - r * vpr;
        v[k] = __ldcg(reinterpret_cast<const int4*>(src + r * src_ld_bytes) + q);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; k++) {
      const int i = i0 + k * blockDim.x;
      if (i < total) {
        const int r = i / vpr, q = i - r * vpr;
        reinterpret_cast<int4*>(dst + r * dst_ld_bytes)[q] = v[k];
      }
    }
  }
}

/* Thread 0 only: adds each owner's finished units to its arrival counter (one system-scope
 * release per owner: it waits until this CTA's NVLink stores are acknowledged) and clears them. */
__device__ __forceinline__ void tw__announce(uint32_t* const* arrive, int world,
                                             uint32_t* pending) {
  for (int d = 0; d < world; d++) {
    if (pending[d] == 0) continue;
    tw_red_release_sys(arrive[d], pending[d]);
    pending[d] = 0;
  }
}

__global__ void __launch_bounds__(kConsumerThreads) tw_consumer_kernel(const tw_consumer_args a) {
  __shared__ int s_ok;
  __shared__ int s_last;
  __shared__ uint32_t s_pending[64]; /* (world) finished, not yet announced units per owner */
  __shared__ uint32_t* s_arrive[64]; /* (world) our arrival counter in each owner's window */
  const size_t row_bytes = (size_t)a.hidden * 2;
  const uint32_t* credits = reinterpret_cast<const uint32_t*>(a.local_win + a.lay.credit);
  int seg = 0;
  int ready_seg = -1;    /* segment whose bands thread 0 has already seen complete */
  uint64_t credited = 0; /* owners whose credit this CTA has already waited for (W <= 64) */
  for (int d = threadIdx.x; d < a.world; d += blockDim.x) {
    s_pending[d] = 0;
    s_arrive[d] = reinterpret_cast<uint32_t*>(static_cast<char*>(ncclGetPeerPointer(a.win, 0, d)) +
                                              a.lay.arrive) +
                  a.rank;
  }
  __syncthreads();

  for (int u = blockIdx.x; u < a.total_units; u += gridDim.x) {
    while (a.seg_unit0[seg + 1] <= u) seg++;
    const tw_segment sg = a.segments[seg];
    const int local = u - a.seg_unit0[seg];
    const int band_local = local / a.unit_chunks;
    const int band_i = sg.band0 + band_local;
    const int ct0 = (local - band_local * a.unit_chunks) * a.tiles_per_unit;
    const int unit_tiles =
        a.col_tiles - ct0 < a.tiles_per_unit ? a.col_tiles - ct0 : a.tiles_per_unit;
    const int dest = sg.dest;
    const bool fault_here = a.fault != TW_FAULT_NONE && u == a.fault_index;

    if (threadIdx.x == 0) {
      bool ok = true;
      if (a.wait_bands && (ready_seg != seg || fault_here)) {
        const uint32_t target =
            (uint32_t)a.col_tiles + (fault_here && a.fault == TW_FAULT_BAND_STUCK ? 1u : 0u);
        /* About to block: announce what is finished first, so an owner never waits on a CTA
         * that is itself waiting. The barrier after the last unit's stores ordered them. */
        bool ready = true;
        for (int b = 0; b < sg.nbands && ready; b++)
          ready = (int32_t)(tw_ld_acquire_gpu(&a.band_counters[sg.band0 + b]) - target) >= 0;
        if (!ready) tw__announce(s_arrive, a.world, s_pending);
        for (int b = 0; b < sg.nbands && ok; b++)
          ok = tw_wait_geq(&a.band_counters[sg.band0 + b], target, false, a.timeout_ns, a.err,
                           TW_WAIT_BAND, sg.band0 + b, a.rank);
      }
      if (ok && !((credited >> dest) & 1u)) {
        /* The credit wait may block: announce first (this happens at most W times). */
        tw__announce(s_arrive, a.world, s_pending);
        ok = tw_wait_geq(&credits[dest], a.credit_target, true, a.timeout_ns, a.err, TW_WAIT_CREDIT,
                         dest, a.rank);
        credited |= 1ull << dest;
      }
      s_ok = ok;
    }
    __syncthreads();
    if (!s_ok) break; /* error recorded; every thread leaves together */
    ready_seg = seg;

    const bool skip = fault_here && a.fault == TW_FAULT_SKIP_UNIT;
    const tw_band band = a.bands[band_i];
    const int c0 = ct0 * a.tn;
    const int ncols = a.hidden - c0 < unit_tiles * a.tn ? a.hidden - c0 : unit_tiles * a.tn;
    char* peer = static_cast<char*>(ncclGetPeerPointer(a.win, 0, dest));
    if (!skip && band.valid_rows > 0) {
      const char* src =
          reinterpret_cast<const char*>(a.c) + (size_t)band.row0 * row_bytes + (size_t)c0 * 2;
      char* dst = peer + a.lay.data + (size_t)band.dest_offset + (size_t)c0 * 2;
      tw__copy_rows(dst, row_bytes, src, row_bytes, band.valid_rows, ncols / 8);
      if (a.debug_tags) {
        /* One tag per row and one count per (row, column tile): the owner expects exactly
         * col_tiles hits. */
        const size_t row0 = (size_t)band.dest_offset / row_bytes;
        uint32_t* tags = reinterpret_cast<uint32_t*>(peer + a.lay.tags) + row0;
        uint32_t* hits = reinterpret_cast<uint32_t*>(peer + a.lay.hits) + row0;
        for (int r = threadIdx.x; r < band.valid_rows; r += blockDim.x) {
          if (ct0 == 0) tags[r] = (uint32_t)a.rank + 1;
          atomicAdd_system(&hits[r], (uint32_t)unit_tiles);
        }
      }
    }
    /* Every thread's stores above happen-before thread 0's later release (see NOTES, 3). */
    __syncthreads();
    if (threadIdx.x == 0 && !skip) s_pending[dest]++;
  }
  __syncthreads();
  if (threadIdx.x == 0) tw__announce(s_arrive, a.world, s_pending);

  /* The last CTA to finish zeroes the band counters. Every CTA's acquire loads of them precede
   * its increment of `done` (fence, then atomic). NOTES: in overlap mode the producer may still
   * publish local bands after this (nobody waits for them), so this reset alone does not leave
   * clean counters; the host zeroes them again before every call (context.cu), which is what
   * the next call relies on. */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    if (s_last) __threadfence();
  }
  __syncthreads();
  if (s_last) {
    for (int b = threadIdx.x; b < a.num_bands; b += blockDim.x) a.band_counters[b] = 0;
    if (threadIdx.x == 0) *a.done = 0;
  }
}

}  // namespace

tw_status tw__consumer_launch(const tw_consumer_args* args, int grid, cudaStream_t stream) {
  TW_CHECK_NULL(args);
  if (grid < 1 || grid > TW_MAX_COMM_CTAS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "consumer: %d CTAs; must be 1..%d", grid,
                    TW_MAX_COMM_CTAS);
  if (args->world > 64)
    return tw__fail(TW_ERR_UNSUPPORTED, "consumer: world size %d > 64", args->world);
  if (args->tiles_per_unit < 1 || args->tiles_per_unit > args->col_tiles ||
      args->unit_chunks != (args->col_tiles + args->tiles_per_unit - 1) / args->tiles_per_unit)
    return tw__fail(TW_ERR_INTERNAL, "consumer: tiles_per_unit %d, unit_chunks %d, col_tiles %d",
                    args->tiles_per_unit, args->unit_chunks, args->col_tiles);
  if (args->hidden % 8 != 0 || args->tn % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "consumer: hidden %d and tile_n %d must be multiples of 8",
                    args->hidden, args->tn);
  tw_consumer_kernel<<<grid, kConsumerThreads, 0, stream>>>(*args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "consumer: launch of %d CTAs failed: %s", grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}
