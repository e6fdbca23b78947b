/*
 * combine.h: the communication side of GEMM2 + combine (internal, CUDA translation units only):
 * the consumer that forwards finished row bands to their owners' receive windows, and the
 * owner's weighted reduction that consumes them and hands buffer credits back.
 *
 * Counters (all 32-bit, compared wrap-safely):
 *   band counter   local, one per band of this call; the producer adds 1 per finished tile
 *                  (release .gpu); the consumer waits for col_tiles (acquire .gpu). The host
 *                  zeroes them before every call, on the caller's stream before the producer.
 *   arrivals[s]    in the owner's window, one per source rank s; the source's consumer adds
 *                  its sent units, batched (release .sys; per call unit_chunks per band and
 *                  tail_parts times that for the source's last tail_bands bands to this owner);
 *                  cumulative since the last reset; the running target is in the call state
 *                  (below). The owner's reduction waits for it and then checks that no more
 *                  arrived: in call e no source can send units of call e + 1 before this rank's
 *                  credit, so a count above the target is an over-delivery (ranks planned from
 *                  different routings), reported. The add dataflow: the owner's consumer waits
 *                  (not exact: ready lets sources start call e + 1 early).
 *   credits[d]     (reduce dataflow) in the source's window, one per owner rank d; d's
 *                  reduction adds 1 per call once it has finished reading its receive buffer
 *                  (release .sys); a source writes to d in call e (1-based) only after
 *                  credits[d] >= e - 1 (acquire .sys).
 *   ready          the add dataflow's credit, in the owner's own window: call e adds into output
 *                  buffer e % 2, which held call e - 2's output. During call e - 1 (after it
 *                  started: call e - 2's output is valid until then) the owner's producer (or
 *                  its copy engine) zeroes that buffer's written rows and then, in stream order,
 *                  a stream memory write (with its system-scope fence) sets ready = e - 1. A
 *                  source adds into d's buffer in call e only after d's ready >= e - 1 (acquire
 *                  .sys, over NVLink); the owner's own producer is ordered after the zeroing by
 *                  its stream (or an event).
 * Call state   local (tw_call_state): the call count and the running arrival targets, kept on
 *                the device so that a call captured in a CUDA graph replays correctly. The
 *                call's first kernel (tw__call_begin_launch, on the caller's stream before the
 *                producer) advances them and zeroes the band counters and unit claims; every
 *                later kernel of the call reads them (kernel boundaries order the accesses).
 * Debug tags (TW_DEBUG_TAGS_CHECK): per receive row, tags[row] = source rank + 1 and hits[row]
 * += 1 per unit that carried the row (expected: col_tiles); the reduction checks and clears them.
 */
#ifndef TW_COMBINE_H
#define TW_COMBINE_H

#include <stdint.h>

#include "kernels.h"
#include "runtime.h"
#include "sync.cuh"
#include "trace.cuh"

/* Further kinds of device-side failure (tw_dev_error.where), after sync.cuh's TW_WAIT_*. */
enum {
  TW_WAIT_CREDIT = 4,
  TW_CHECK_TAGS = 5,
  TW_WAIT_COPY = 6,
  TW_CHECK_ARRIVALS = 7,
  TW_CHECK_PLAN = 11, /* dispatch.h has 8..10, 12 and 13 */
  TW_CHECK_CONSUMER = 14
};

/* The value a source writes into an owner's plan_fp slot in call `epoch`: its plan's fingerprint
 * and the call, so that a slot left from an earlier call never matches. */
__host__ __device__ __forceinline__ uint64_t tw_plan_fp_of_call(uint64_t fingerprint,
                                                                uint32_t epoch) {
  return fingerprint + (uint64_t)epoch * 0x9e3779b97f4a7c15ull;
}

/* Per-call protocol state on the device (combine.h top: call state). */
typedef struct tw_call_state {
  uint32_t epoch;                       /* calls with communication since the last reset */
  uint32_t arrive_target[TW_MAX_RANKS]; /* cumulative arrivals expected from each source */
  /* What this call's consumer did (the reduction checks it, TW_CHECK_CONSUMER): the units its
   * CTAs took (zeroed by the call's first kernel) and the epoch its CTA 0 read. A consumer that
   * ran outside its call (before the call's first kernel, or beside the next) shows here instead
   * of as a peer's timeout. */
  uint32_t consumer_units;
  uint32_t consumer_epoch;
  /* Units this rank's consumers announced to each owner since the last reset (a running total
   * beside the owner's arrivals from this rank, for diagnosis: tw__context_counters). */
  uint32_t announced[TW_MAX_RANKS];
} tw_call_state;

/* Byte offsets of the regions inside every rank's symmetric window (identical on all ranks). */
typedef struct tw_window_layout {
  uint64_t data;      /* (recv_rows_max, hidden) bf16 receive rows; offset 0 (reduce dataflow) */
  uint64_t out;       /* (2, max_tokens, hidden) bf16 output buffers, used in turn (add dataflow) */
  uint64_t out_bytes; /* bytes of one output buffer (0 under the reduce dataflow) */
  uint64_t zeros;     /* (zeros_bytes) zeros, never written: what peers copy from (add) */
  uint64_t zeros_bytes;
  uint64_t arrive;  /* (W) uint32 arrivals, by source rank */
  uint64_t credit;  /* (W) uint32 credits, by owner rank */
  uint64_t ready;   /* uint32: calls whose output buffer is zero, cumulative (add dataflow) */
  uint64_t plan_fp; /* (W) uint64, by source rank: tw_plan_fp_of_call of the source's plan in
                       its latest call that sent here, written before its arrivals */
  uint64_t tags;    /* (recv_rows_max) uint32 debug tags */
  uint64_t hits;    /* (recv_rows_max) uint32 debug arrival counts */
  uint64_t bytes;   /* total */
} tw_window_layout;

typedef struct tw_consumer_args {
  char* const* peers; /* (world) device array: every rank's window base, as this GPU addresses
                         it (the team's peer pointers; peers[rank] == local_win) */
  tw_window_layout lay;
  char* local_win;      /* this rank's window base (local pointer) */
  const uint16_t* c;    /* (rows, hidden) bf16 GEMM output */
  const tw_band* bands; /* (num_bands) */
  /* (num_bands) device, NULL = off: the live rows of each band this call (the capturable
   * dispatch's mask, dispatch.h); a unit sends only the first min(valid_rows, live) rows of its
   * band, none of a band without live rows (still announced, so the owners' targets hold). */
  const int32_t* band_live;
  const tw_segment* segments;    /* (segments) in schedule order */
  const int32_t* seg_unit0;      /* (segments + 1) first unit of each segment; last = total */
  const int32_t* seg_split0;     /* (segments) first band of a segment cut into row parts */
  int32_t total_units;           /* transfer units (seg_unit0[segments]) */
  uint32_t* unit_next;           /* the next unit no CTA has claimed; 0 at launch */
  const uint32_t* band_counters; /* (num_bands) */
  int32_t wait_bands;            /* 0: data already complete (comm-only mode) */
  int32_t col_tiles, tn, hidden;
  int32_t tiles_per_unit; /* T: column tiles per transfer unit (1..col_tiles) */
  int32_t unit_chunks;    /* ceil(col_tiles / T): units per band */
  int32_t tail_parts;     /* row parts of each band from seg_split0 on (1: whole bands) */
  int32_t copy;           /* TW_CONSUMER_COPY_REGISTERS or _BULK (combine.cu) */
  int32_t rank, world;
  tw_call_state* state;    /* credits (or ready) awaited: state->epoch - 1; consumer_* written */
  const uint64_t* plan_fp; /* device: this rank's plan fingerprint, written with the units into
                              every owner's plan_fp slot; NULL = not written */
  int32_t debug_tags;
  /* The add dataflow (NULL: reduce): each row goes to out_offset + row_token[row] * row bytes of
   * the owner's window, added (bulk or register adds; no debug tags), after the owner's ready word
   * has reached credit_target. */
  const int32_t* row_token;
  uint64_t out_offset;
  /* The add dataflow has no reduction kernel: CTA 0, after its own units, waits until every
   * source rank's arrivals have reached state->arrive_target (as the reduction would), so the
   * consumer's end is the call's end (reduce: the reduction waits instead). */
  int32_t fault, fault_index;
  tw_dev_error* err;
  uint64_t timeout_ns;
  tw_trace* trace; /* device trace buffer (trace.h): every unit's claim, waits, copy and the
                      announcements; NULL = off */
} tw_consumer_args;

typedef struct tw_reduce_args {
  tw_window_layout lay;
  char* const* peers;      /* (world) device array of every rank's window base */
  char* local_win;         /* this rank's window base */
  const uint16_t* c;       /* (rows, hidden) bf16 GEMM output (local rows) */
  const int32_t* slot_row; /* (tokens, top_k) */
  const float* weights;    /* (tokens, top_k) gate weights */
  uint16_t* out;           /* (tokens, hidden) bf16 */
  int32_t tokens, top_k, hidden, recv_rows, rank, world, col_tiles;
  int32_t debug_tags;
  uint32_t* debug_slots;      /* (tokens, top_k) observed (tag << 16 | hits); debug mode only */
  uint32_t* done;             /* CTA completion counter (zero between calls) */
  const tw_call_state* state; /* arrivals awaited: state->arrive_target */
  /* The plan check (NULL = off): after the arrivals, each source that sends here this call
   * (recv_units[s] > 0) must have written tw_plan_fp_of_call(*plan_fp, epoch) into its slot:
   * else the ranks planned differently (TW_CHECK_PLAN), even with equal unit counts. */
  const uint64_t* plan_fp;
  const uint32_t* recv_units; /* (world) device */
  /* The units this rank's consumer takes in the call (0: no consumer check; the TP call). */
  int32_t consumer_units;
  tw_dev_error* err;
  uint64_t timeout_ns;
  tw_trace* trace; /* device trace buffer (trace.h): each CTA's begin, arrivals and end; NULL =
                      off */
} tw_reduce_args;

/* The first kernel of a call (one CTA): zeroes `zero_words` words at `zero` (the unit claims
 * and band counters), then epoch += 1 and arrive_target[s] += recv_units[s] for s < world
 * (recv_units: device memory, the plan's units from each source per call). With band_live
 * (NULL: off), word band_word0 + b is set to `dead` instead of 0 for every band b without live
 * rows: the producer computes no tile of such a band (its live tile list omits them), and the
 * consumer's wait for the band's col_tiles publishes passes at once. */
tw_status tw__call_begin_launch(tw_call_state* state, const uint32_t* recv_units, int world,
                                uint32_t* zero, int64_t zero_words, const int32_t* band_live,
                                int64_t band_word0, uint32_t dead, cudaStream_t stream);
/* Consumer: grid CTAs (1..TW_MAX_COMM_CTAS). after_producer: launched as the programmatic
 * dependent of the producer enqueued just before it on `stream` (both run at once; the consumer's
 * end then also waits for the producer's); 0: a plain launch. */
tw_status tw__consumer_launch(const tw_consumer_args* args, int grid, int after_producer,
                              cudaStream_t stream);
/* Weighted reduction; grid chosen from the work (at least one CTA: it always returns credits),
 * at most `sms` x ctas_per_sm CTAs (ctas_per_sm 0: as many per SM as fit and pay); the grid and
 * that cap are written to grid_out and cap_out. Not launched
 * under the add dataflow (the consumer waits for the arrivals there). */
tw_status tw__reduce_launch(const tw_reduce_args* args, int sms, int ctas_per_sm, int32_t* grid_out,
                            int32_t* cap_out, cudaStream_t stream);

#endif /* TW_COMBINE_H */
