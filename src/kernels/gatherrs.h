/*
 * gatherrs.h: the tensor-parallel consumer (internal, CUDA translation units only). GatherRS
 * sums, for every row of this rank's block of a TP plan (plan_tp.h), the partial GEMM2 outputs
 * of the TP group's ranks and stores the reduced row where the owner's weighted reduction
 * (reduce.cu) reads it: into the owner's receive rows over the peer pointers, or into this
 * rank's own reduced rows for its own tokens. So the EP part's send is fused into the GatherRS
 * store; the owners' weighted reduction, unchanged, then sums the k slots.
 *
 * Counters (32-bit, compared wrap-safely), all in the TP window (tp_context.cu):
 *   segment[s]   one per split, in the producing rank's window; the producer adds 1 per finished
 *                tile of split s (the device plan sets each tile's `band` to its split; release
 *                .sys). Cumulative since the context was created: the host passes the running
 *                target (every TP rank of a group has the same tiles per split, plan_tp.h).
 *   arrivals[s]  in the owner's window, one per source rank s: every rank's GatherRS adds 1 to
 *                every other rank's word once per call, after all its CTAs have stored (release
 *                .sys). The owner's reduction waits for exactly one more per call from every rank
 *                (tw_reduce_args.state->arrive_target), then reads.
 *   credits[d]   in the source's window, one per owner d: d's reduction adds 1 per call once it
 *                has read its receive rows (reduce.cu). A GatherRS of call e writes no row before
 *                credits[d] >= e - 1 for every d.
 * The partial sums need no credit of their own: a rank's next call starts after its reduction,
 * which waited for every rank's arrivals, which come after every GatherRS CTA of the call has
 * finished reading its peers' partials.
 */
#ifndef TW_GATHERRS_H
#define TW_GATHERRS_H

#include <stdint.h>

#include "combine.h"
#include "plan_tp.h"
#include "sync.cuh"

/* Device-side failures of GatherRS (tw_dev_error.where), after combine.h's and dispatch.h's. */
enum { TW_WAIT_SEGMENT = 16, TW_WAIT_TP_CREDIT = 17 };

typedef struct tw_gatherrs_args {
  char* const* peers; /* (world) device array: every rank's TP window base as this GPU sees it */
  char* local_win;    /* this rank's window base (peers[rank]) */
  uint64_t part_off;  /* (rows, hidden) bf16 partial sums, in every window */
  uint64_t seg_off;   /* (splits) uint32 segment counters, in every window */
  uint64_t data_off;  /* receive rows (hidden bf16 each), in every window */
  uint64_t arrive_off, credit_off; /* (world) uint32 each */
  const tw_tp_comm_tile* tiles;    /* (num_tiles) split-major */
  int32_t num_tiles;
  const int32_t* dst_rank; /* (block rows) the owner (world rank) of each row; -1 for padding */
  const int32_t* dst_row;  /* (block rows) its row at the owner: a receive row, or for this
                              rank's own tokens a row of `red` */
  int32_t block_row0;      /* first layout row of this rank's block */
  uint16_t* red;           /* (block rows, hidden) bf16: reduced rows of this rank's tokens */
  int32_t hidden, tp, group, rank, world;
  uint32_t seg_target;        /* segment counts every TP peer must reach (cumulative) */
  const tw_call_state* state; /* epoch of this call: credits awaited are epoch - 1 */
  uint32_t* done;             /* CTA completion counter, zero between launches */
  tw_dev_error* err;
  uint64_t timeout_ns;
} tw_gatherrs_args;

/* GatherRS on `grid` CTAs (1..TW_MAX_COMM_CTAS); CTA b takes comm tiles b, b + grid, ... */
tw_status tw__gatherrs_launch(const tw_gatherrs_args* args, int grid, cudaStream_t stream);

#endif /* TW_GATHERRS_H */
