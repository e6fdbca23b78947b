/*
 * plan_tp.h: the TP x EP plan's data, as plain structs (internal; tw_tp_plan_create in plan_tp.c).
 *
 * One rank (EP group g, TP index q) of a world of tp x ep ranks. Its GEMM2 rows are laid out in tp
 * blocks: block q' is the remote-owner-aligned EP layout (layout.c) of "EP rank g" in the EP world
 * of the owners with TP index q' (world ranks g' tp + q', g' = 0..ep-1), so the layout is the same
 * on every TP rank of g. The rank computes partial sums of every row over its F slice; GatherRS
 * is a reduce-scatter over the TP group: rank (g, q') sums block q' over the tp ranks of g, which
 * gives exactly the GEMM2 output its EP plan (ep_plan) expects, and the EP part then takes every
 * reduced row to its owner (with ep = 1 the reducer is the owner itself and nothing is sent).
 *
 * Words as in plan.h, plus:
 *   split    the first paper's L column ranges of the output: split s is column tiles
 *            [s T, (s + 1) T) with T = ceil(hidden / TN) / L; the producer's tile list runs split
 *            by split (every band's tiles of split 0, then split 1, ...);
 *   segment  split s's output over all rows of the layout: published when its tiles are done,
 *            the unit of readiness GatherRS waits for on every TP peer (the paper's Fig. 2);
 *   comm tile  TM_comm rows x TN_comm columns of one split of the rank's own block: the unit of
 *            GatherRS work (read the tile of the block from each TP peer, sum, store).
 */
#ifndef TW_PLAN_TP_H
#define TW_PLAN_TP_H

#include <stdint.h>

#include "plan.h"
#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One row band of the layout: TM rows (fewer at an expert's end) of one expert in one block. */
typedef struct tw_tp_band {
  int32_t block;  /* TP index of the rows' owners (the reducer's TP index) */
  int32_t expert; /* local expert, 0..experts/ep - 1 */
  int32_t row0;   /* first row in the rank's layout */
  int32_t rows;
} tw_tp_band;

/* Split s's output: its tiles are tiles[tile0 .. tile0 + ntiles) of the schedule. */
typedef struct tw_tp_segment {
  int32_t split;
  int32_t col0, cols;  /* output columns */
  int32_t tile0;       /* first tile in the schedule */
  int32_t ntiles;      /* W_comp */
  int32_t ready_tiles; /* tiles of the schedule up to and including this split's: (s + 1) W_comp */
} tw_tp_segment;

/* One GatherRS tile of the rank's block: sum over the tp peers of rows [row0, row0 + rows) x
 * columns [col0, col0 + cols) of their partial outputs, once segment `split` is published on each
 * of them. */
typedef struct tw_tp_comm_tile {
  int32_t split;
  int32_t row0, rows; /* rows of the layout, inside block tp_index */
  int32_t col0, cols;
} tw_tp_comm_tile;

struct tw_tp_plan {
  tw_problem problem; /* world_size = tp x ep */
  tw_parallel par;    /* resolved: ep, splits and comm tiles set */
  tw_hardware hw;     /* what the TP model used */
  int32_t rank, group, tp_index;
  int32_t local_experts; /* experts / ep */
  int32_t ffn_slice;     /* ffn / tp */
  int32_t tm, tn, col_tiles, split_tiles;

  int32_t rows;        /* rows of all blocks */
  int32_t* block_row0; /* (tp + 1) block q' is rows [block_row0[q'], block_row0[q' + 1]) */
  tw_row_src* row_src; /* (rows) owner as a world rank, token, slot; owner -1 for padding */
  int32_t* row_expert; /* (rows) local expert of each row */
  int32_t num_bands;
  tw_tp_band* bands; /* (num_bands) in layout order: block, expert, band */
  int32_t num_tiles;
  tw_tile* tiles; /* (num_tiles) split-major; tile.band indexes bands */
  int32_t num_segments;
  tw_tp_segment* segments; /* (splits) */
  int32_t num_comm_tiles;
  tw_tp_comm_tile* comm_tiles; /* (num_comm_tiles) split-major, rows then columns */

  tw_plan_t ep_plan; /* the EP part: block tp_index's EP plan (EP rank group) */

  int32_t tp_comm_ctas;
  double tp_waves, tp_wave_us, solve_us;
};

/* Checks problem and parallel as tw_parallel_validate does and fills `out` with the resolved
 * description (ep, splits and comm tiles set); the TP context sizes itself from it. */
tw_status tw__parallel_resolve(const tw_problem* problem, const tw_parallel* parallel,
                               tw_parallel* out);

/* Where the GatherRS of the plan's rank stores each row of its block (tp_context.cu): dst_rank[i]
 * = the owner (world rank) of block row i, -1 for padding; dst_row[i] = its receive row at that
 * owner (the EP plan's band dest_offset), or for the rank's own tokens i itself (the EP layout's
 * local row, which the owner's reduction reads past recv_rows). Both arrays hold the block's rows
 * (ep_plan->rows). TW_ERR_INTERNAL where rows and bands disagree or a receive row is at or past
 * recv_rows_max. */
tw_status tw__tp_plan_destinations(const struct tw_tp_plan* pl, int64_t recv_rows_max,
                                   int32_t* dst_rank, int32_t* dst_row);

#ifdef __cplusplus
}
#endif

#endif /* TW_PLAN_TP_H */
