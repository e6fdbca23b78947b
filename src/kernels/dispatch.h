/*
 * dispatch.h: the dispatch side of the MoE layer (internal, CUDA translation units only): the
 * kernels that count a rank's routed slots per global expert, place every (token, slot) in its
 * group by a stable device-side scan, and write each token row into the expert-input buffer of
 * the rank that holds the expert, in tilewave's aligned row layout (src/plan/layout.c).
 *
 * The scan: the rank's slots (token, slot) in row-major order are cut into `chunks` runs of
 * `chunk_slots` slots; one warp walks a run 32 slots at a time, keeping a running count per
 * global expert in shared memory, and takes a slot's rank among the lanes of its step that name
 * the same expert from __match_any_sync. Pass 1 (count) writes each chunk's histogram; the
 * offsets kernel turns the histograms into exclusive prefixes over the chunks, expert by expert,
 * and sums them into the rank's counts; pass 2 (place) walks again from those prefixes, which
 * gives every slot its position p among the rank's slots of its expert g in (token, slot) order:
 *   slot_row[i] = slot_base[g] + p     the owner's reduction map (plan.h)
 *   send_row[i] = send_row0[g] + p     the row at g's rank that the slot's token row goes to
 * exactly the values the host planner gives a routing (tests/unit/test_plan_counts.c checks the
 * rules, tests/gpu/test_dispatch.cu the kernels).
 *
 * Counters of the dispatch window (every rank's, same layout; all 32-bit, cumulative since the
 * last reset; their targets are two epochs in the rank's device memory, advanced by the kernels
 * themselves, so that no per-call host value is a kernel argument):
 *   credits[d]   in the source's window, one per destination rank d; d adds 1 at the start of
 *                each dispatch call (release .sys), after its earlier calls (the GEMM that read
 *                its expert-input rows) are done in stream order; a source writes rows into d in
 *                call e only after credits[d] >= e (acquire .sys).
 *   arrivals[s]  in the destination's window, one per source rank s; s's copy kernel adds 1 once
 *                all its CTAs have written their rows for the call (its last CTA, after
 *                system-scope fences); the destination's call ends with a wait for arrivals[s]
 *                >= e from every s, so the GEMM that follows it in stream order sees every row.
 *   band_arrive[b] in the destination's window (layer contexts), one per band of its layout
 *                (tw_band_counter): the rows of band b that have arrived this call. Not
 *                cumulative: the destination's credit kernel zeroes them before it raises its
 *                credits, when no source may write (every source waits for that credit) and its
 *                own earlier GEMM1, their last reader, is done (stream order). The banded copy
 *                release-adds each unit's rows after storing them; an overlapped layer's GEMM1
 *                waits per tile until its band's counter reaches the band's rows (every row of a
 *                band, routed or padding, is written by exactly one unit of one source).
 *
 * The capturable mode (tw_context_config.dispatch_capacity > 0): the plan is static, every group
 * (local expert e, source s) `capacity` rows (a multiple of TM) whatever the routing, so
 * slot_base and send_row0 never change and no count leaves the device. The place pass fails a
 * slot whose position p reaches the capacity (TW_CHECK_CAPACITY in the context's record; the
 * slot is not sent). Each source's copy kernel (its CTA 0, with its rows, so before its arrival
 * release) writes its live rows min(count, capacity) of every group into the expert's rank's
 * `live` words; after the arrival wait, the mask kernel turns them into the live rows of every
 * band and the lists of GEMM2's and GEMM1's tiles whose band has live rows (stable: the
 * schedule's order), which the producers, the consumer and the call's first kernel read.
 */
#ifndef TW_DISPATCH_H
#define TW_DISPATCH_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "plan.h" /* tw_band, tw_tile */
#include "sync.cuh"
#include "tilewave.h"
#include "trace.h"

/* Further kinds of device-side failure (tw_dev_error.where), after combine.h's. */
enum {
  TW_WAIT_DISPATCH_CREDIT = 8,
  TW_WAIT_DISPATCH_ARRIVAL = 9,
  TW_CHECK_ID = 10,
  TW_CHECK_WEIGHT = 12,   /* a gate weight that is NaN or infinite (count pass); 11 in combine.h */
  TW_CHECK_CAPACITY = 13, /* the capturable mode: a slot past its group's capacity */
  TW_WAIT_BAND_ROWS = 15  /* an overlapped layer's GEMM1: a band's dispatched rows */
};

/* Most chunks of the scan (the histograms are (chunks, experts) int32). */
#define TW_DISPATCH_MAX_CHUNKS 256

/* Byte offsets inside every rank's dispatch window (identical on all ranks). */
typedef struct tw_dispatch_layout {
  uint64_t rows;        /* (rows_max, hidden) bf16 expert-input rows; offset 0 */
  uint64_t credit;      /* (W) uint32 credits, by destination rank */
  uint64_t arrive;      /* (W) uint32 arrivals, by source rank */
  uint64_t live;        /* (E, W) uint32: the capturable mode's live rows of group (local expert e,
                           source s) this call, written by s with its rows (below) */
  uint64_t band_arrive; /* (band_words) uint32 rows arrived per band this call (layer contexts;
                           tw_band_counter), zeroed by the credit kernel */
  uint32_t band_words;  /* 0 without a layer */
  uint64_t bytes;       /* total */
} tw_dispatch_layout;

typedef struct tw_dispatch_scan_args {
  const void* ids; /* (slots) expert ids, (tokens, top_k) row-major, int32 or int64 */
  int32_t id64;    /* 1: int64 ids */
  int32_t slots;   /* tokens * top_k */
  int32_t top_k, experts;
  int32_t chunks;      /* 0..TW_DISPATCH_MAX_CHUNKS; 0 only with no slots */
  int32_t chunk_slots; /* slots per chunk, a multiple of 32 */
  int32_t* chunk_hist; /* (chunks, experts): histograms (count), then exclusive prefixes */
  uint32_t* counts;    /* (experts) the rank's slots per global expert (offsets kernel) */
  /* Place pass (NULL in the count pass). */
  const int32_t* slot_base; /* (experts) plan.h */
  const int32_t* send_row0; /* (experts) plan.h */
  const float* weights_in;  /* (slots) the caller's gate weights; the count pass checks that each
                               is finite (NULL: no check) */
  int32_t* slot_row;        /* (slots) out */
  float* weights_out;       /* (slots) out: the device plan's copy */
  int32_t* send_row;        /* (slots) out */
  /* The banded copy (NULL: off): send_slot[send_off[g] + p] = the slot at position p of group g,
   * the slots of each group in order. */
  const int32_t* send_off; /* (experts) */
  int32_t* send_slot;      /* (slots) out */
  tw_dev_error* err;       /* count pass: bad ids (TW_CHECK_ID), weights (TW_CHECK_WEIGHT); place
                              pass: internal */
  int32_t rank;
  /* The capturable mode's rows per group (0: eager): the place pass fails positions p >=
   * capacity (TW_CHECK_CAPACITY) and gives every slot it does not send (a bad id, an overflow)
   * send_row -1 and an in-bounds slot_row. */
  int32_t capacity;
  tw_trace* trace; /* device trace buffer (trace.h): each CTA's begin and end; NULL = off */
} tw_dispatch_scan_args;

typedef struct tw_dispatch_copy_args {
  char* const* peers; /* (world) device array: every rank's dispatch window base */
  tw_dispatch_layout lay;
  const uint16_t* x; /* (tokens, hidden) bf16, 16-byte aligned */
  const void* ids;   /* as in the scan */
  int32_t id64;
  const int32_t* send_row; /* (slots) */
  const int32_t* pads;     /* pads[0] = n, then n (first row, rows) ranges of this rank's
                              layout that are padding: zero-filled here */
  int64_t pad_rows;        /* sum of the ranges' rows (sizes the grid only) */
  int32_t slots, top_k, hidden;
  int32_t local_experts; /* E: global expert g lives on rank g / E */
  int32_t rank, world;   /* world 0: no credit wait, no arrivals (the context's warm-up) */
  uint32_t* epochs;      /* (2) device: [0] the calls that raised credits, the credit target;
                            [1] the calls that sent rows, advanced by the last CTA (NULL in the
                            warm-up) */
  uint32_t* done;        /* CTA completion counter, zero between launches */
  tw_dev_error* err;
  uint64_t timeout_ns;
  /* The capturable mode (capacity 0: eager): CTA 0 writes min(counts[g], capacity) into the
   * live words of g's rank for every global expert g, also when this rank has no slots (so the
   * credit wait is then not skipped). Slots with send_row < 0 are never sent. */
  const uint32_t* counts; /* (experts) this rank's slots per global expert */
  int32_t experts;
  int32_t capacity;
  /* The banded copy (eager only; NULL: the slot-order copy above): CTAs take the units in order,
   * each unit's rows then one release-add of its rows on the destination's band counter; the
   * padding comes as units too (pads is not read). The arrivals follow as above. */
  const tw_copy_unit* units;
  int32_t num_units;
  const int32_t* send_slot; /* (slots) the place pass's */
  int32_t skip_unit;        /* a test's fault: this unit is neither copied nor announced (-1) */
  tw_trace* trace; /* device trace buffer (trace.h): each CTA's begin, credit wait and stores,
                      the arrivals' release; NULL = off */
} tw_dispatch_copy_args;

typedef struct tw_dispatch_signal_args {
  char* const* peers;
  tw_dispatch_layout lay;
  int32_t rank, world; /* world 0: nothing (warm-up) */
  uint32_t* epochs;    /* (2) as in the copy: the credit kernel advances [0], the wait kernel
                          waits for [1] arrivals from every rank; NULL in the warm-up */
  tw_dev_error* err;
  uint64_t timeout_ns;
  tw_trace* trace; /* device trace buffer (trace.h): the wait kernel's begin and each source's
                      arrival (the credit kernel records nothing); NULL = off */
} tw_dispatch_signal_args;

/* The capturable mode's mask (one CTA), after the arrival wait: band_live[b] = the live rows of
 * band b (its group's live count less the band's first row in the group, clamped to 0..rows),
 * and the tiles of bands with live rows, in list order, for GEMM2 and (tiles1 non-NULL) GEMM1;
 * their counts in live_counts[0] and [1]. Every tile's band indexes `bands`. */
typedef struct tw_dispatch_mask_args {
  const uint32_t* live;      /* (E, W) this rank's window: live rows of group (e, s) */
  const int32_t* band_group; /* (num_bands) e * W + s of each band's group */
  const int32_t* band_first; /* (num_bands) the band's first row within its group */
  const tw_band* bands;      /* (num_bands) schedule order */
  int32_t num_bands;
  const tw_tile* tiles; /* (num_tiles) GEMM2's list */
  int32_t num_tiles;
  tw_tile* live_tiles;
  const tw_tile* tiles1; /* (num_tiles1) GEMM1's list, band = a schedule band; NULL: none */
  int32_t num_tiles1;
  tw_tile* live_tiles1;
  int32_t* band_live;   /* (num_bands) out */
  int32_t* live_counts; /* (2) out */
} tw_dispatch_mask_args;

/* Chunks and slots per chunk of the scan for `slots` slots on at most `sms` CTAs. */
void tw__dispatch_chunks(int32_t slots, int32_t* chunks, int32_t* chunk_slots);
/* Pass 1 and the offsets kernel (counts), on at most `sms` CTAs each. */
tw_status tw__dispatch_count_launch(const tw_dispatch_scan_args* args, int sms,
                                    cudaStream_t stream);
/* Pass 2 (slot_row, send_row, weights), on at most `sms` CTAs. */
tw_status tw__dispatch_place_launch(const tw_dispatch_scan_args* args, int sms,
                                    cudaStream_t stream);
/* Zeroes this rank's band counters, then raises its credit in every rank's window (one CTA). */
tw_status tw__dispatch_credit_launch(const tw_dispatch_signal_args* args, cudaStream_t stream);
/* The rows (and this rank's padding rows), then this rank's arrivals at every rank, on at
 * most `sms` CTAs. */
tw_status tw__dispatch_copy_launch(const tw_dispatch_copy_args* args, int sms, cudaStream_t stream);
/* Waits until every rank's rows for this call have arrived (one CTA). */
tw_status tw__dispatch_wait_launch(const tw_dispatch_signal_args* args, cudaStream_t stream);
/* The capturable mode's mask (one CTA). */
tw_status tw__dispatch_mask_launch(const tw_dispatch_mask_args* args, cudaStream_t stream);

#endif /* TW_DISPATCH_H */
