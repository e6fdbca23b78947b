/*
 * trace_json.h: a traced GEMM2 + combine call (the records of src/core/trace.h, one array per
 * rank) as Chrome trace-event / Perfetto JSON, what `tilewave trace` writes (docs/trace.md). Pure
 * host C, no CUDA, so that the unit tests check it on synthetic records.
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
  const tw_tile* tiles; /* (num_tiles) the plan's tile list, for the tiles' args; or NULL */
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
  int64_t tiles, units, reduce_ctas, consumer_ctas; /* complete spans built */
  int64_t partial;        /* events written as instants (their other end is missing) */
  int64_t duplicates;     /* records of a kind and index seen twice on a rank (ignored) */
  int64_t foreign;        /* records with an unknown kind or an index outside the plan (ignored) */
  int64_t clamped;        /* spans whose end came before their begin (written with dur 0) */
  int64_t overlap_tracks; /* producer tracks beyond the first of a CTA */
  uint64_t t0_ns;         /* the earliest record */
} tw__trace_stats;

/* Track id of (role 0 producer / 1 consumer / 2 reduction, CTA, lane): also their sort order. */
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
