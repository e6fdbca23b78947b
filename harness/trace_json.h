/*
 * trace_json.h: a traced call (a GEMM2 + combine, a dispatch or a whole layer: the records of
 * src/core/trace.h, one array per rank) as Chrome trace-event / Perfetto JSON, what `tilewave
 * trace` writes (docs/trace.md). Pure host C, no CUDA, so that the unit tests check it on
 * synthetic records.
 *
 * The file: {"displayTimeUnit": "ns", "metadata": {...}, "traceEvents": [...]}. One process per
 * rank ("rank r"), one thread per (role, CTA) ("producer CTA 12", "consumer CTA 3", "reduce CTA
 * 0"), named by metadata events (ph "M"). Times are microseconds (ns precision) from the earliest
 * record of all ranks: in-process ranks share one GPU's %globaltimer.
 *   producer:  per tile, a complete event "tile" from its begin to its publish (args: tile, band,
 *              expert, row0, col0). The next tile of a CTA can begin before the previous one is
 *              published (the epilogue warp stores it while the math warps go on), so a tile that
 *              would overlap the one before it on its CTA's track goes to a second track of that
 *              CTA ("producer CTA 12 (overlap 1)"): every track nests.
 *   consumer:  per CTA, "consumer CTA" from its first record to its end; in it, per unit, "unit"
 *              from its claim to the end of its copy, and in that "wait bands" (claim to the
 *              bands complete), "wait credit" (where the unit waited for an owner's credit) and
 *              "copy"; instant events "announce" (args owner, units).
 *   reduction: per CTA, "reduce CTA" with "wait arrivals" and "reduce" in it.
 *   gemm1:     per GEMM1 tile, "gemm1 tile" from its begin to its store ("gemm1 CTA 3"; args
 *              tile, expert, row0, col0), on lanes as the producer's.
 *   dispatch:  per scan CTA ("dispatch scan CTA j") its "count" and "place" spans; per copy CTA
 *              ("dispatch send CTA j") "send CTA" (args rows) with "wait credit" and "copy rows"
 *              in it and an instant "arrivals released" (args ranks) on the last one; on
 *              "dispatch wait" a span "wait rows" from the wait kernel's start to the last
 *              source's rows, with an instant "rows arrived" (args source) per source.
 * An event whose other end is missing (a timeout, or a record dropped from a full buffer) is
 * written as an instant event ("tile begin", "unit claim", ...), never as a guessed span.
 */
#ifndef TW_TRACE_JSON_H
#define TW_TRACE_JSON_H

#include <stdint.h>
#include <stdio.h>

#include "plan.h"  /* tw_tile */
#include "trace.h" /* tw_trace_record */

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's traced call: its records and what the plan and the launch were. */
typedef struct tw__trace_rank {
  int32_t rank;
  const tw_trace_record* records; /* (count) in any order */
  int64_t count;
  int64_t dropped; /* records the full buffer did not keep */
  int32_t budget, producer_ctas, consumer_ctas, reduce_ctas; /* the launch (P + C <= budget) */
  int32_t num_tiles, total_units, coalesce;                  /* the plan */
  const char* schedule;                                      /* its name, or NULL */
  double predicted_us;                                       /* the model's time (0: unknown) */
  const tw_tile* tiles;   /* (num_tiles) the plan's tile list, for the tiles' args; or NULL */
  int32_t plan_comm_ctas; /* the plan's C (a dispatch launches no consumer) */
  int32_t num_gemm1_tiles, gemm1_ctas; /* the layer's GEMM1: its tile list and grid (0: none) */
  const tw_tile* gemm1_tiles;          /* (num_gemm1_tiles) or NULL */
} tw__trace_rank;

/* What the whole trace was: the shape and how it ran (strings may be NULL). */
typedef struct tw__trace_info {
  const char* model; /* preset, or NULL for a shape given by flags */
  int32_t hidden, ffn, experts, top_k, tokens, world;
  int32_t tile_m, tile_n;
  const char* router;
  const char* dataflow;
  const char* team; /* "in-process", ... */
  const char* device;
  int32_t warmup; /* untraced calls before the traced one */
  const char* op; /* "combine", "dispatch" or "layer" (NULL: not said) */
} tw__trace_info;

/* One event of the file, before it is written. */
typedef struct tw__trace_event {
  char ph;          /* 'X' (complete), 'i' (instant) or 'M' (metadata) */
  int32_t pid, tid; /* rank, track */
  int64_t ts;       /* ns from the earliest record ('M': 0) */
  int64_t dur;      /* ns, >= 0 ('X') */
  const char* name; /* a static string ('M': "process_name", "thread_name", ...) */
  int nargs;
  const char* key[5];
  int64_t val[5];
  char label[48]; /* 'M': the name given to the process or thread (args.name), or "" */
} tw__trace_event;

/* What the conversion found, beside the events. */
typedef struct tw__trace_stats {
  int64_t tiles, units, reduce_ctas, consumer_ctas;      /* complete spans built */
  int64_t gemm1_tiles, scan_ctas, send_ctas, recv_waits; /* ... of the layer's other kernels */
  int64_t partial;        /* events written as instants (their other end is missing) */
  int64_t duplicates;     /* records of a kind and index seen twice on a rank (ignored) */
  int64_t foreign;        /* records with an unknown kind or an index outside the plan (ignored) */
  int64_t clamped;        /* spans whose end came before their begin (written with dur 0) */
  int64_t overlap_tracks; /* producer tracks beyond the first of a CTA */
  uint64_t t0_ns;         /* the earliest record */
} tw__trace_stats;

/* Track roles, in the order of their tracks. */
enum {
  TW__TRACE_PRODUCER = 0,
  TW__TRACE_CONSUMER = 1,
  TW__TRACE_REDUCE = 2,
  TW__TRACE_GEMM1 = 3,
  TW__TRACE_SCAN = 4,
  TW__TRACE_SEND = 5,
  TW__TRACE_RECV = 6,
  TW__TRACE_ROLES = 7
};

/* Track id of (role, CTA, lane): also their sort order. */
int32_t tw__trace_tid(int role, int cta, int lane);

/* The events of `n` ranks, in file order: the metadata events first, then per rank and track
 * by time (longer spans first at equal times, so that parents precede their children). *events
 * is malloc'd (the caller frees it). Returns 0, or -1 out of memory. */
int tw__trace_build(const tw__trace_rank* ranks, int n, tw__trace_event** events, int64_t* nevents,
                    tw__trace_stats* stats);

/* Writes the JSON file; stats (may be NULL) as tw__trace_build's. Returns 0, or -1 (out of memory
 * or a write error). */
int tw__trace_write_json(FILE* f, const tw__trace_info* info, const tw__trace_rank* ranks, int n,
                         tw__trace_stats* stats);

#ifdef __cplusplus
}
#endif

#endif /* TW_TRACE_JSON_H */
