/*
 * seq_layout.h: the row arithmetic of the sequential layer's all-to-all (seq_layer.h), host C
 * only, so that a unit test can run it for every rank of a routing without a GPU.
 *
 * Rank `me` of W, E local experts (global expert g on rank g / E), from the all-gathered count
 * matrix counts (W, W x E): counts[s][g] = slots of rank s naming g. Layouts:
 *   send:  this rank's slots sorted by g (stable), so destination d's rows are one block;
 *   recv:  source-major, then local expert, then the source's token order;
 *   ret:   the send order (GEMM2's rows of every destination come back to their block).
 */
#ifndef TW_SEQ_LAYOUT_H
#define TW_SEQ_LAYOUT_H

#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One call's offsets, in rows. Arrays of W (or W x E for the groups), owned by the caller. */
typedef struct tw__seq_offsets {
  int64_t* send_off;  /* (W) my send block for destination d */
  int64_t* send_rows; /* (W) */
  int64_t* recv_off;  /* (W) my receive block from source s */
  int64_t* recv_from; /* (W) */
  int64_t* at_dest;   /* (W) where my block starts in destination d's receive buffer */
  int64_t* at_src;    /* (W) where source s's rows for me start in its send (= ret) order */
  int32_t* g_e;       /* (W x E) the non-empty (source, expert) groups in receive order: expert */
  int32_t* g_m;       /* (W x E) rows */
  int64_t* g_row0;    /* (W x E) first receive row */
  int32_t ngroups;
  int64_t recv_rows;
} tw__seq_offsets;

/* Fills o for rank me. Checks that my counts add up to slots (else TW_ERR_EXPERT_ID: an id out
 * of range was not counted) and that my receive rows fit recv_max (TW_ERR_CAPACITY). */
tw_status tw__seq_offsets_compute(int32_t world, int32_t local_experts, int32_t me,
                                  const int32_t* counts, int64_t slots, int64_t recv_max,
                                  tw__seq_offsets* o);

#ifdef __cplusplus
}
#endif

#endif /* TW_SEQ_LAYOUT_H */
