/*
 * combine.cu: the consumer of GEMM2 + combine. A persistent kernel of C CTAs, on SMs the producer
 * leaves free, forwards every finished row band of the GEMM output to the rank that owns its
 * tokens, straight into that rank's symmetric NCCL window (NVLink; bulk copies or ordinary
 * stores, below), and
 * announces each piece with a release reduction on the owner's arrival counter.
 *
 * Work is cut into units of (band, T consecutive column tiles) of the plan's segments, in
 * schedule order (the order in which the producer finishes bands, either schedule). The CTAs
 * claim units in that order from one counter (atomicAdd), so the C CTAs are one pool: a CTA that
 * finishes early takes the next unit instead of leaving it to a CTA still busy with a long one
 * (with a fixed unit-to-CTA assignment, u mod C, units queued behind a busy CTA while others
 * waited for bands the producer had not finished). A CTA claims its next unit when it has
 * issued the copy of the current one: the atomic's round trip overlaps the drain of that unit's
 * bulk stores, and no unit waits behind a busy CTA (claiming while a whole unit was still to be
 * copied held the last units back behind CTAs with a band of up to 2 MB in front of them). A
 * unit may leave once every band of its segment is complete, so a coalesced segment goes out
 * as one burst of contiguous remote rows. T defaults to a whole band with bulk copies and to 1
 * with register copies.
 *
 * The last tail_bands bands of each destination stream are also cut into tail_parts row parts
 * (defaults and why: src/plan/plan.h): at the end of the call they are all that is left, and whole
 * they would be one CTA's copy each while the others idle (measured: dev/NOTES.md, the consumer's
 * tail). Units are announced on the owner's arrival counter; the owner
 * counts them from the bands it receives (src/plan/units.c), so T and the split must be the same on
 * every rank (the context checks).
 *
 * A system-scope release waits until the CTA's NVLink stores are acknowledged (a round trip of
 * microseconds), so a CTA does not release after every unit: it counts finished units per
 * owner and releases them with one reduction per owner when it runs out of units (and before
 * its first wait for an owner's credit, at most W times). The owner's reduction waits for all
 * units anyway. (Also releasing before blocking on a band that is not ready changed no measured
 * time.)
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
 * Two ways to move a unit (tw_consumer_args.copy):
 *  registers: all 512 threads load 16-byte vectors (8 in flight each) and store them to the
 *    peer; a unit's loads and stores do not overlap, so one CTA moves only ~17-22 GB/s.
 *  bulk: thread 0 streams the unit through a ring of shared-memory stages with bulk copies
 *    (cp.async.bulk: global -> shared with an mbarrier, shared -> peer global in bulk groups),
 *    loads of later pieces in flight while earlier pieces are stored; stores stay in flight
 *    across units and are only waited for before an announcement. The add dataflow's bulk adds
 *    (one per row) are issued by the 32 lanes of warp 0, thread 0 still loading.
 *  Bulk ordering, on top of 1-3 above: after thread 0's acquires (band counters, credit),
 *  `fence.proxy.async.global` orders them before its bulk loads and stores (async proxy); the
 *  other lanes, after the barrier, fence likewise before their adds. Before each announcement,
 *  `cp.async.bulk.wait_group 0` (not .read) completes the peer writes, whose completion makes
 *  them visible to thread 0, which then releases (the other lanes complete theirs at the end of
 *  each unit, before the barrier that precedes thread 0's next announcement).
 * Every wait is bounded (tw_wait_geq, tw__bulk_wait_piece); on a timeout the CTA records the
 * error and stops, and the others stop at their next wait.
 */
#include "combine.h"

#include "bulk.cuh"
#include "core.h"

namespace {

constexpr int kConsumerThreads = 512;
constexpr int kUnroll = 8; /* independent 16-byte loads in flight per thread: 64 KiB per CTA */

/* dst[0..7] += v's 8 bf16, each rounded once to nearest even, where dst lives (its L2; a peer's
 * over NVLink): the register path's counterpart of tw__bulk_add_bf16, the same sum bit for bit. */
__device__ __forceinline__ void tw__red_add_bf16x8(void* dst, int4 v) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

/* Copies rows x (8 * vpr) bf16 from src (row stride src_ld elements) to dst (row stride dst_ld
 * elements) with 16-byte loads and stores; src through L2 only (the producer wrote it in this
 * kernel's lifetime, and L1 is not coherent). row_token (the add dataflow): row r is added into
 * dst + row_token[r] * dst_ld instead. */
__device__ __forceinline__ void tw__copy_rows(char* dst, size_t dst_ld_bytes, const char* src,
                                              size_t src_ld_bytes, int rows, int vpr,
                                              const int32_t* row_token) {
  const int total = rows * vpr;
  for (int i0 = threadIdx.x; i0 < total; i0 += kUnroll * blockDim.x) {
    int4 v[kUnroll];
    int4* to[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; k++) {
      const int i = i0 + k * blockDim.x;
      if (i < total) {
        const int r = i / vpr, q = i - r * vpr;
        v[k] = __ldcg(reinterpret_cast<const int4*>(src + r * src_ld_bytes) + q);
        /* row_token is not written while the kernel runs: read-only path. */
        const size_t row = row_token == nullptr ? (size_t)r : (size_t)__ldg(&row_token[r]);
        to[k] = reinterpret_cast<int4*>(dst + row * dst_ld_bytes) + q;
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; k++) {
      const int i = i0 + k * blockDim.x;
      if (i < total) {
        if (row_token == nullptr)
          *to[k] = v[k];
        else
          tw__red_add_bf16x8(to[k], v[k]);
      }
    }
  }
}

/* ---- bulk copies: thread 0 (adds: warp 0) streams a unit through shared memory ---------- */

constexpr int kBulkStages = 6;
constexpr uint32_t kBulkStageBytes = 32u << 10;
constexpr int kBulkSmemBytes = kBulkStages * (int)kBulkStageBytes + kBulkStages * 8;

/* One unit as the bulk path sees it: `rows` rows of `width` bytes at row stride `ld` on both
 * sides, cut into pieces of at most one stage: several whole rows per piece when rows are
 * narrow, several pieces per row when they are wide. A unit of whole rows (width == ld) is one
 * contiguous run: the caller passes it as a single row. */
struct tw__unit_shape {
  const char* src;
  char* dst;
  size_t ld;
  size_t width;
  /* The add dataflow: row r goes to dst + row_token[r] * ld (a token of the owner), added; NULL:
   * to dst + r * ld, stored. */
  const int32_t* row_token;
  int rows;
  int rows_per_piece; /* >= 1 when width <= stage, else 0 */
  int pieces_per_row; /* >= 1 when width > stage, else 0 */
  int pieces;
};

__device__ __forceinline__ tw__unit_shape tw__unit_shape_make(const char* src, char* dst, size_t ld,
                                                              size_t width, int rows,
                                                              const int32_t* row_token) {
  if (width == ld && row_token == nullptr) { /* contiguous at both ends */
    width *= (size_t)rows;
    rows = 1;
  }
  tw__unit_shape u = {src, dst, ld, width, row_token, rows, 0, 0, 0};
  if (width <= kBulkStageBytes) {
    /* Rows per piece: a power of two (no integer division on the device), at least half full. */
    const int width_log2 = 32 - __clz((int)width - 1); /* ceil(log2(width)) */
    u.rows_per_piece = (int)(kBulkStageBytes >> width_log2);
    u.pieces = (rows + u.rows_per_piece - 1) / u.rows_per_piece;
  } else {
    u.pieces_per_row = (int)((width + kBulkStageBytes - 1) / kBulkStageBytes);
    u.pieces = rows * u.pieces_per_row;
  }
  return u;
}

/* Piece p of a unit: `nsub` rows from `row` on, `bytes` each from byte `col` of the row: from
 * src + (row + i) * ld + col, packed back to back in the stage. */
struct tw__piece {
  int row;
  size_t col;
  int nsub;
  uint32_t bytes;
};

__device__ __forceinline__ tw__piece tw__unit_piece(const tw__unit_shape& u, int p) {
  if (u.rows_per_piece > 0) {
    const int r0 = p * u.rows_per_piece;
    return {r0, 0, min(u.rows_per_piece, u.rows - r0), (uint32_t)u.width};
  }
  const int r = p / u.pieces_per_row;
  const size_t c = (size_t)(p - r * u.pieces_per_row) * kBulkStageBytes;
  return {r, c, 1, (uint32_t)min((size_t)kBulkStageBytes, u.width - c)};
}

/* Thread 0's copy engine: a ring of kBulkStages stages, each with a full barrier. Piece g (a
 * count over the CTA's whole life) uses stage g % kBulkStages in phase (g / kBulkStages) & 1. */
struct tw__bulk_pipe {
  char* stage;    /* (kBulkStages, kBulkStageBytes) shared */
  uint64_t* full; /* (kBulkStages) shared mbarriers */
  uint32_t next;  /* pieces loaded so far */
};

__device__ __forceinline__ void tw__bulk_load_piece(tw__bulk_pipe& pp, const tw__unit_shape& u,
                                                    int p, uint32_t g) {
  const tw__piece pc = tw__unit_piece(u, p);
  char* stage = pp.stage + (size_t)(g % kBulkStages) * kBulkStageBytes;
  uint64_t* full = &pp.full[g % kBulkStages];
  tw__mbar_expect_tx(full, (uint32_t)pc.nsub * pc.bytes);
  const char* src = u.src + (size_t)pc.row * u.ld + pc.col;
  for (int i = 0; i < pc.nsub; i++)
    tw__bulk_load(stage + (size_t)i * pc.bytes, src + (size_t)i * u.ld, pc.bytes, full);
}

/* The add dataflow's bulk adds come from the lanes of warp 0, a piece's rows spread over them,
 * each lane with its own bulk groups: one thread issuing them all pays a fixed cost per add of
 * a small row, which the lanes share (dev/NOTES.md, the add dataflow's lanes).
 * Stores (the reduce dataflow) move a contiguous piece in one instruction: thread 0 alone. */
constexpr int kAddLanes = 32;

/* Called by the unit's lanes (1, or kAddLanes for adds); lane i takes rows i, i + lanes, ... */
__device__ __forceinline__ void tw__bulk_store_piece(tw__bulk_pipe& pp, const tw__unit_shape& u,
                                                     int p, uint32_t g, int lanes) {
  const tw__piece pc = tw__unit_piece(u, p);
  const char* stage = pp.stage + (size_t)(g % kBulkStages) * kBulkStageBytes;
  for (int i = (int)threadIdx.x; i < pc.nsub; i += lanes) {
    const char* from = stage + (size_t)i * pc.bytes;
    if (u.row_token == nullptr) {
      tw__bulk_store(u.dst + (size_t)(pc.row + i) * u.ld + pc.col, from, pc.bytes);
    } else {
      /* Not written while the kernel runs: read-only path. */
      const int32_t token = __ldg(&u.row_token[pc.row + i]);
      tw__bulk_add_bf16(u.dst + (size_t)token * u.ld + pc.col, from, pc.bytes);
    }
  }
  tw__bulk_commit();
}

/* Waits for piece g's load, bounded like every other wait (a load that never lands would be a
 * bug or a dead GPU, but the host must hear of it, not hang). */
__device__ __forceinline__ bool tw__bulk_wait_piece(tw__bulk_pipe& pp, uint32_t g,
                                                    const tw_consumer_args& a) {
  uint64_t* full = &pp.full[g % kBulkStages];
  const uint32_t parity = (g / kBulkStages) & 1u;
  if (tw__mbar_try_wait(full, parity)) return true;
  const uint64_t start = tw_globaltimer_ns();
  while (!tw__mbar_try_wait(full, parity)) {
    if (tw_globaltimer_ns() - start > a.timeout_ns) {
      tw_report_error(a.err, TW_ERR_TIMEOUT, TW_WAIT_COPY, (int32_t)g, 0, 0, a.rank);
      return false;
    }
  }
  return true;
}

/* Copies one unit: thread 0, or for the add dataflow the kAddLanes lanes of warp 0 together.
 * Lane 0 loads, S - 1 loads ahead of the piece whose writes are being issued; a stage is reloaded
 * once every lane's writes that read it (issued one step earlier) have finished reading. The
 * other lanes drain their writes at the end of the unit (wait_group 0), so that thread 0's later
 * announcement, after a barrier, covers them; thread 0's own are drained before it announces. */
__device__ __forceinline__ bool tw__bulk_copy_unit(tw__bulk_pipe& pp, const tw__unit_shape& u,
                                                   const tw_consumer_args& a) {
  const int lanes = u.row_token != nullptr ? kAddLanes : 1;
  const uint32_t g0 = pp.next;
  const int lane = (int)threadIdx.x;
  const int ahead = min(kBulkStages - 1, u.pieces);
  /* Thread 0's acquires reach this lane through the barrier before the copy (generic proxy);
   * its adds run in the async proxy (thread 0 fenced after its acquires). */
  if (lane != 0) asm volatile("fence.proxy.async.global;" ::: "memory");
  tw__bulk_wait_read<0>(); /* earlier units' stores have read every stage */
  if (lanes > 1) __syncwarp();
  if (lane == 0)
    for (int j = 0; j < ahead; j++) tw__bulk_load_piece(pp, u, j, g0 + j);
  for (int j = 0; j < u.pieces; j++) {
    /* Lane 0 waits (bounded) and tells the others, so that all return together. */
    bool ok = lane != 0 || tw__bulk_wait_piece(pp, g0 + j, a);
    if (lanes > 1) {
      ok = __shfl_sync(0xffffffffu, ok, 0);
      /* Each lane's own acquire of the completed phase, whose data its bulk reads will read (the
       * phase cannot have moved on: lane 0 re-arms this barrier only after a later refill). */
      if (ok && lane != 0)
        (void)tw__mbar_try_wait(&pp.full[(g0 + j) % kBulkStages], ((g0 + j) / kBulkStages) & 1u);
    }
    if (!ok) return false;
    tw__bulk_store_piece(pp, u, j, g0 + j, lanes);
    const int refill = j + kBulkStages - 1; /* goes to the stage piece j - 1 used */
    if (refill < u.pieces) {
      tw__bulk_wait_read<1>(); /* all but the newest store (piece j) have read their stage */
      if (lanes > 1) __syncwarp();
      if (lane == 0) tw__bulk_load_piece(pp, u, refill, g0 + refill);
    }
  }
  pp.next = g0 + (uint32_t)u.pieces;
  if (lanes > 1) {
    if (lane != 0) tw__bulk_wait_all();
    __syncwarp();
  }
  return true;
}

/* Thread 0 only: adds each owner's finished units to its arrival counter (one system-scope
 * release per owner: it waits until this CTA's NVLink stores are acknowledged) and clears them.
 * With bulk copies, the peer writes must have completed first (wait_group 0, not .read). */
template <bool kBulk>
__device__ __forceinline__ void tw__announce(uint32_t* const* arrive, int world, uint32_t* pending,
                                             uint64_t* const* fp_slot, uint64_t fp,
                                             uint32_t* announced, tw_trace* trace) {
  if (kBulk) tw__bulk_wait_all();
  for (int d = 0; d < world; d++) {
    if (pending[d] == 0) continue;
    /* The plan check's word, before the release below, which orders it for the owner's acquire
     * of the arrivals (every announcing CTA writes the same value). */
    if (fp_slot != nullptr) *reinterpret_cast<volatile uint64_t*>(fp_slot[d]) = fp;
    tw_red_release_sys(arrive[d], pending[d]);
    atomicAdd(&announced[d], pending[d]);
    tw_trace_event(trace, TW_TRACE_ANNOUNCE, blockIdx.x, TW_TRACE_ANNOUNCE_INDEX(d, pending[d]));
    pending[d] = 0;
  }
}

template <bool kBulk>
__global__ void __launch_bounds__(kConsumerThreads, 1)
    tw_consumer_kernel(const tw_consumer_args a) {
  extern __shared__ __align__(128) char s_bulk[]; /* bulk: stages, then their barriers */
  __shared__ int s_ok;
  __shared__ int s_unit;              /* the unit this CTA works on (claimed by thread 0) */
  __shared__ int s_copied;            /* bulk: thread 0's copy of the unit did not time out */
  __shared__ uint32_t s_pending[64];  /* (world) finished, not yet announced units per owner */
  __shared__ uint32_t* s_arrive[64];  /* (world) our arrival counter in each owner's window */
  __shared__ char* s_peer[64];        /* (world) every owner's window base */
  __shared__ uint64_t* s_fp_slot[64]; /* (world) our plan_fp slot in each owner's window */
  __shared__ uint64_t s_fp;           /* the value for them (tw_plan_fp_of_call) */
  const size_t row_bytes = (size_t)a.hidden * 2;
  const uint32_t* credits = reinterpret_cast<const uint32_t*>(a.local_win + a.lay.credit);
  const bool add = a.row_token != nullptr;
  int seg = 0;
  int ready_seg = -1;    /* segment whose bands thread 0 has already seen complete */
  uint64_t credited = 0; /* owners whose credit this CTA has already waited for (W <= 64) */
  /* This call's credit target: the call state was advanced by the call's first kernel. */
  const uint32_t credit_target = a.state->epoch - 1u;
  for (int d = threadIdx.x; d < a.world; d += blockDim.x) {
    s_pending[d] = 0;
    s_peer[d] = a.peers[d];
    s_arrive[d] = reinterpret_cast<uint32_t*>(s_peer[d] + a.lay.arrive) + a.rank;
    s_fp_slot[d] = reinterpret_cast<uint64_t*>(s_peer[d] + a.lay.plan_fp) + a.rank;
  }
  uint64_t* const* fp_slot = a.plan_fp != nullptr ? s_fp_slot : nullptr;
  int taken = 0; /* units this CTA took (thread 0's count, for the call state) */
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) a.state->consumer_epoch = a.state->epoch;
    s_fp = a.plan_fp != nullptr ? tw_plan_fp_of_call(*a.plan_fp, a.state->epoch) : 0;
    s_copied = 1;
    s_unit = (int)atomicAdd(a.unit_next, 1u);
    tw_trace_event(a.trace, TW_TRACE_UNIT_CLAIM, blockIdx.x, (uint32_t)s_unit);
  }
  tw__bulk_pipe pipe = {s_bulk, reinterpret_cast<uint64_t*>(s_bulk + kBulkStages * kBulkStageBytes),
                        0};
  if (kBulk && threadIdx.x == 0) {
    for (int i = 0; i < kBulkStages; i++) tw__mbar_init(&pipe.full[i], 1);
    /* Make the initialised barriers visible to the async proxy (the bulk loads complete them). */
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  /* Claims only grow, so each CTA's units come in schedule order and seg only moves forward. */
  for (int u = s_unit; u < a.total_units; u = s_unit) {
    while (a.seg_unit0[seg + 1] <= u) seg++;
    const tw_segment sg = a.segments[seg];
    /* Unit -> (band, column chunk, row part): bands before seg_split0 are unit_chunks units
     * each; the segment's later bands (the stream's last, see combine.h) unit_chunks x
     * tail_parts, consecutive units being different row parts so that CTAs share a band. */
    int local = u - a.seg_unit0[seg];
    const int split0 = a.seg_split0[seg];
    int band_local, chunk, part = 0, parts = 1;
    if (local < split0 * a.unit_chunks) {
      band_local = local / a.unit_chunks;
      chunk = local - band_local * a.unit_chunks;
    } else {
      local -= split0 * a.unit_chunks;
      parts = a.tail_parts;
      const int per_band = a.unit_chunks * parts;
      const int k = local / per_band;
      band_local = split0 + k;
      chunk = (local - k * per_band) / parts;
      part = local - k * per_band - chunk * parts;
    }
    const int band_i = sg.band0 + band_local;
    const int ct0 = chunk * a.tiles_per_unit;
    const int unit_tiles =
        a.col_tiles - ct0 < a.tiles_per_unit ? a.col_tiles - ct0 : a.tiles_per_unit;
    const int dest = sg.dest;
    const bool fault_here = a.fault != TW_FAULT_NONE && u == a.fault_index;

    if (threadIdx.x == 0) {
      bool ok = true;
      if (a.wait_bands && (ready_seg != seg || fault_here)) {
        const uint32_t target =
            (uint32_t)a.col_tiles + (fault_here && a.fault == TW_FAULT_BAND_STUCK ? 1u : 0u);
        /* No announcement before blocking here: the band depends on this rank's producer only,
         * never on an owner, so nothing waits on what this CTA holds back (see the top). */
        for (int b = 0; b < sg.nbands && ok; b++)
          ok = tw_wait_geq(&a.band_counters[sg.band0 + b], target, false, a.timeout_ns, a.err,
                           TW_WAIT_BAND, sg.band0 + b, a.rank);
      }
      if (ok) tw_trace_event(a.trace, TW_TRACE_UNIT_BANDS, blockIdx.x, (uint32_t)u);
      if (ok && !((credited >> dest) & 1u)) {
        /* The credit wait may block: announce first (this happens at most W times). */
        tw__announce<kBulk>(s_arrive, a.world, s_pending, fp_slot, s_fp, a.state->announced,
                            a.trace);
        /* The add dataflow waits for the owner's own word instead: its output buffer of this
         * call is zero (combine.h). */
        const uint32_t* credit =
            add ? reinterpret_cast<const uint32_t*>(s_peer[dest] + a.lay.ready) : &credits[dest];
        ok = tw_wait_geq(credit, credit_target, true, a.timeout_ns, a.err, TW_WAIT_CREDIT, dest,
                         a.rank);
        if (ok) tw_trace_event(a.trace, TW_TRACE_UNIT_CREDIT, blockIdx.x, (uint32_t)u);
        credited |= 1ull << dest;
      }
      /* The acquires above are generic-proxy loads; the bulk copies that depend on them run in
       * the async proxy. */
      if (kBulk) asm volatile("fence.proxy.async.global;" ::: "memory");
      s_ok = ok;
    }
    __syncthreads();
    if (!s_ok) break; /* error recorded; every thread leaves together */
    ready_seg = seg;

    const bool skip = fault_here && a.fault == TW_FAULT_SKIP_UNIT;
    const tw_band band = a.bands[band_i];
    const int c0 = ct0 * a.tn;
    const int ncols = a.hidden - c0 < unit_tiles * a.tn ? a.hidden - c0 : unit_tiles * a.tn;
    /* The capturable dispatch's mask: only the band's live rows leave (the rest of a static
     * plan's band holds no token this call). Written before the call's first kernel. */
    const int valid = a.band_live == nullptr ? band.valid_rows
                                             : min(band.valid_rows, max(0, a.band_live[band_i]));
    /* This part's rows of the band's valid ones: [r0, r0 + nrows). */
    const int part_rows = (valid + parts - 1) / parts;
    const int r0 = part * part_rows;
    const int nrows = max(0, min(part_rows, valid - r0));
    char* peer = s_peer[dest];
    if (!skip && nrows > 0) {
      const size_t at = (size_t)r0 * row_bytes + (size_t)c0 * 2;
      const char* src = reinterpret_cast<const char*>(a.c) + (size_t)band.row0 * row_bytes + at;
      /* Reduce: the band's rows, consecutive, into the receive rows; add: each into its token's
       * row of the owner's output buffer of this call. */
      char* dst = add ? peer + a.out_offset + (size_t)c0 * 2
                      : peer + a.lay.data + (size_t)band.dest_offset + at;
      if (!kBulk) {
        tw__copy_rows(dst, row_bytes, src, row_bytes, nrows, ncols / 8,
                      add ? a.row_token + band.row0 + r0 : nullptr);
      } else if ((int)threadIdx.x < (add ? kAddLanes : 1)) {
        const tw__unit_shape us = tw__unit_shape_make(src, dst, row_bytes, (size_t)ncols * 2, nrows,
                                                      add ? a.row_token + band.row0 + r0 : nullptr);
        const bool ok = tw__bulk_copy_unit(pipe, us, a);
        if (threadIdx.x == 0) s_copied = ok;
      }
      if (a.debug_tags) {
        /* One tag per row and one count per (row, column tile): the owner expects exactly
         * col_tiles hits. */
        const size_t row0 = (size_t)band.dest_offset / row_bytes + (size_t)r0;
        uint32_t* tags = reinterpret_cast<uint32_t*>(peer + a.lay.tags) + row0;
        uint32_t* hits = reinterpret_cast<uint32_t*>(peer + a.lay.hits) + row0;
        for (int r = threadIdx.x; r < nrows; r += blockDim.x) {
          if (ct0 == 0) tags[r] = (uint32_t)a.rank + 1;
          atomicAdd_system(&hits[r], (uint32_t)unit_tiles);
        }
      }
    }
    /* Every thread's stores above happen-before thread 0's later release (see NOTES, 3). The
     * barrier also publishes the next unit (every thread has read the current one). */
    if (threadIdx.x == 0) {
      taken++;
      tw_trace_event(a.trace, TW_TRACE_UNIT_COPY, blockIdx.x, (uint32_t)u);
      s_unit = (int)atomicAdd(a.unit_next, 1u);
      tw_trace_event(a.trace, TW_TRACE_UNIT_CLAIM, blockIdx.x, (uint32_t)s_unit);
    }
    __syncthreads();
    if (kBulk && !s_copied) break; /* a load timed out (recorded) */
    if (threadIdx.x == 0 && !skip) s_pending[dest]++;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(&a.state->consumer_units, (uint32_t)taken);
    tw__announce<kBulk>(s_arrive, a.world, s_pending, fp_slot, s_fp, a.state->announced, a.trace);
    /* The add dataflow's end of the call: the sources' adds into this rank's output. Our own
     * units are announced above, so no peer's CTA 0 waits on anything this wait holds back. The
     * acquire makes the peers' adds (complete before their release) visible, and the stream's
     * order after this kernel passes that on to whatever reads the output. Not exact, unlike the
     * reduction's wait: a source may add call e + 1's rows once this rank's ready word allows it,
     * which can be before this wait has seen call e's. */
    if (add && blockIdx.x == 0) {
      const uint32_t* arrivals = reinterpret_cast<const uint32_t*>(a.local_win + a.lay.arrive);
      bool ok = true;
      for (int s = 0; s < a.world && ok; s++)
        if (s != a.rank)
          ok = tw_wait_geq(&arrivals[s], a.state->arrive_target[s], true, a.timeout_ns, a.err,
                           TW_WAIT_ARRIVAL, s, a.rank);
    }
    tw_trace_event(a.trace, TW_TRACE_CONSUMER_END, blockIdx.x, 0);
  }
  /* Launched as the producer's programmatic dependent (after_producer in the launcher), this
   * grid can end before the producer's local tiles are done: wait for the producer's end (and
   * its writes' visibility), so that the reduction, ordered after this grid's end only, reads
   * finished rows. Returns at once for a plain launch. */
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

/* The bulk kernel's opt-in shared memory size is a per-device function attribute: set once per
 * device. */
cudaError_t tw__consumer_enable_smem() {
  static bool attr_set[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && (dev >= 64 || !attr_set[dev])) {
    e = cudaFuncSetAttribute(tw_consumer_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kBulkSmemBytes);
    if (e == cudaSuccess && dev < 64) attr_set[dev] = true;
  }
  return e;
}

}  // namespace

__global__ void __launch_bounds__(1024)
    tw_call_begin_kernel(tw_call_state* state, const uint32_t* recv_units, int world,
                         uint32_t* zero, int64_t zero_words, const int32_t* band_live,
                         int64_t band_word0, uint32_t dead) {
  for (int64_t i = threadIdx.x; i < zero_words; i += blockDim.x) {
    const int64_t b = i - band_word0;
    /* A band without live rows is complete from the start (combine.h, tw__call_begin_launch). */
    zero[i] = band_live != nullptr && b >= 0 && band_live[b] <= 0 ? dead : 0u;
  }
  if (threadIdx.x == 0) {
    state->epoch += 1u;
    state->consumer_units = 0u;
    for (int s = 0; s < world; s++) state->arrive_target[s] += recv_units[s];
  }
}

tw_status tw__call_begin_launch(tw_call_state* state, const uint32_t* recv_units, int world,
                                uint32_t* zero, int64_t zero_words, const int32_t* band_live,
                                int64_t band_word0, uint32_t dead, cudaStream_t stream) {
  TW_CHECK_NULL(state);
  TW_CHECK_NULL(recv_units);
  TW_CHECK_NULL(zero);
  if (world < 1 || world > TW_MAX_RANKS || zero_words < 0)
    return tw__fail(TW_ERR_INTERNAL, "call begin: world %d, %lld words", world,
                    (long long)zero_words);
  const int threads = zero_words >= 1024 ? 1024 : zero_words >= 256 ? 256 : 32;
  tw_call_begin_kernel<<<1, threads, 0, stream>>>(state, recv_units, world, zero, zero_words,
                                                  band_live, band_word0, dead);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "call begin: launch failed: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

tw_status tw__consumer_launch(const tw_consumer_args* args, int grid, int after_producer,
                              cudaStream_t stream) {
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
  if (args->copy != TW_CONSUMER_COPY_REGISTERS && args->copy != TW_CONSUMER_COPY_BULK)
    return tw__fail(TW_ERR_INTERNAL, "consumer: copy mode %d", args->copy);
  if (args->state == NULL) return tw__fail(TW_ERR_INTERNAL, "consumer: no call state");
  if (args->row_token != NULL && args->debug_tags)
    return tw__fail(TW_ERR_INTERNAL, "consumer: the add dataflow has no debug tags");
  if (args->hidden % 8 != 0 || args->tn % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT, "consumer: hidden %d and tile_n %d must be multiples of 8",
                    args->hidden, args->tn);
  const bool bulk = args->copy == TW_CONSUMER_COPY_BULK;
  cudaError_t e = bulk ? tw__consumer_enable_smem() : cudaSuccess;
  if (e == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)grid);
    cfg.blockDim = dim3(kConsumerThreads);
    cfg.dynamicSmemBytes = bulk ? kBulkSmemBytes : 0;
    cfg.stream = stream;
    /* after_producer: a programmatic dependent of the producer just launched on this stream,
     * so that both run at once from one stream (hence one hardware queue, whatever a graph
     * does with its branches); the producer triggers at its start. */
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = after_producer ? 1 : 0;
    e = bulk ? cudaLaunchKernelEx(&cfg, tw_consumer_kernel<true>, *args)
             : cudaLaunchKernelEx(&cfg, tw_consumer_kernel<false>, *args);
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "consumer: launch of %d CTAs failed: %s", grid,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}

tw_status tw__consumer_occupancy(int copy, int* ctas_per_sm) {
  TW_CHECK_NULL(ctas_per_sm);
  *ctas_per_sm = 0;
  if (copy != TW_CONSUMER_COPY_DEFAULT && copy != TW_CONSUMER_COPY_REGISTERS &&
      copy != TW_CONSUMER_COPY_BULK)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__consumer_occupancy: copy mode %d", copy);
  const bool bulk = copy != TW_CONSUMER_COPY_REGISTERS;
  cudaError_t e = bulk ? tw__consumer_enable_smem() : cudaSuccess;
  if (e == cudaSuccess)
    e = bulk ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, tw_consumer_kernel<true>,
                                                             kConsumerThreads, kBulkSmemBytes)
             : cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, tw_consumer_kernel<false>,
                                                             kConsumerThreads, 0);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw__consumer_occupancy: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}
