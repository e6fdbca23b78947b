/*
 * trace.h: the record format of a traced call (internal; C and CUDA). With a trace buffer in the
 * kernels' arguments (tw_gemm_args.trace, tw_gemm1_args.trace, tw_consumer_args.trace,
 * tw_reduce_args.trace, the dispatch's tw_dispatch_*_args.trace; NULL = off), one thread per event
 * takes a slot with one atomicAdd on the buffer's cursor and writes a 16-byte record: the device's
 * %globaltimer in ns (one clock for every SM of a GPU, so in-process ranks on one GPU share it),
 * the event's kind, the CTA and an index (tile, unit, owner...). A full buffer drops the record;
 * the cursor keeps counting, so cursor - capacity records were dropped and nothing is written out
 * of bounds. `tilewave trace` turns the records into a Chrome trace-event / Perfetto JSON file
 * (harness/trace_json.h, docs/trace.md).
 *
 * Device buffer layout (one allocation, 16-byte aligned):
 *   [0, 16)                    tw_trace header: cursor, capacity, 2 words unused
 *   [16, 16 + 16 * capacity)   tw_trace_record records[capacity], in the order slots were taken
 */
#ifndef TW_TRACE_H
#define TW_TRACE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a record marks, and who writes it (the thread that does the work it marks). */
typedef enum tw_trace_kind {
  /* producer (sm90_gemm.cu), index = position of the tile in the tile list */
  TW_TRACE_TILE_BEGIN = 1,   /* the CTA starts the tile's main loop (its first K slice) */
  TW_TRACE_TILE_PUBLISH = 2, /* the tile's output is stored and its band counter released (or,
                                without counters, the tile is stored) */
  /* consumer (combine.cu), index = unit */
  TW_TRACE_UNIT_CLAIM = 3,   /* thread 0 has claimed the unit */
  TW_TRACE_UNIT_BANDS = 4,   /* the unit's bands are complete (the wait on them ended) */
  TW_TRACE_UNIT_CREDIT = 5,  /* the wait for the owner's credit ended (only where there was one:
                                a CTA's first unit to each owner) */
  TW_TRACE_UNIT_COPY = 6,    /* the unit's copy is issued and this CTA's part of it done (bulk:
                                stores may still be in flight until the next announcement) */
  TW_TRACE_ANNOUNCE = 7,     /* units released on an owner's arrival counter; index = owner |
                                units << 8 */
  TW_TRACE_CONSUMER_END = 8, /* the CTA's last announcement (and, under the add dataflow, CTA
                                0's wait for the arrivals) is done; index 0 */
  /* reduction (reduce.cu), index 0 */
  TW_TRACE_REDUCE_BEGIN = 9,    /* the CTA starts */
  TW_TRACE_REDUCE_ARRIVED = 10, /* thread 0's wait for every source's arrivals ended */
  TW_TRACE_REDUCE_END = 11,     /* the CTA has reduced its rows (and, the last, sent credits) */
  /* GEMM1 + SwiGLU of the layer (sm90_gemm.cu with SwiGLU), index = position of the tile in
   * GEMM1's tile list */
  TW_TRACE_GEMM1_BEGIN = 12,   /* the CTA starts the tile's main loop */
  TW_TRACE_GEMM1_PUBLISH = 13, /* the tile's h is stored (GEMM1 signals nothing) */
  /* dispatch (dispatch.cu), thread 0 of a CTA unless said otherwise */
  TW_TRACE_SCAN_BEGIN = 14,   /* a scan CTA starts; index = pass (0 count, 1 place) */
  TW_TRACE_SCAN_END = 15,     /* every warp of the scan CTA is done; index = pass */
  TW_TRACE_SEND_BEGIN = 16,   /* a copy CTA starts; index 0 */
  TW_TRACE_SEND_CREDIT = 17,  /* its wait for every destination's credit ended (or there was none
                                 to wait for); index 0 */
  TW_TRACE_SEND_END = 18,     /* every row of the CTA is stored (its barrier); index = the token
                                 rows the CTA sent */
  TW_TRACE_SEND_ARRIVE = 19,  /* the last copy CTA released this rank's arrivals at every rank;
                                 index = the ranks */
  TW_TRACE_RECV_BEGIN = 20,   /* the wait kernel starts; index 0 */
  TW_TRACE_RECV_ARRIVED = 21, /* thread s: every row from source rank s has arrived; index = s */
  TW_TRACE_KIND_COUNT = 22
} tw_trace_kind;

/* One event: 16 bytes. */
typedef struct tw_trace_record {
  uint64_t ns;    /* %globaltimer */
  uint16_t kind;  /* tw_trace_kind */
  uint16_t cta;   /* blockIdx.x */
  uint32_t index; /* see tw_trace_kind */
} tw_trace_record;

/* The buffer's header; the records follow it (tw_trace_records). */
typedef struct tw_trace {
  uint32_t cursor;   /* slots taken so far (may pass capacity: the excess was dropped) */
  uint32_t capacity; /* records the buffer holds */
  uint32_t unused_[2];
} tw_trace;

#define TW_TRACE_ANNOUNCE_INDEX(owner, units) ((uint32_t)(owner) | ((uint32_t)(units) << 8))

#ifdef __cplusplus
}
#endif

#endif /* TW_TRACE_H */
