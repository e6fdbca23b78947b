/*
 * plan.h: the planner's data, as plain structs (internal).
 *
 * A plan is everything one rank needs to run GEMM2 + combine without a device-to-host sync:
 * where each (token, k) row sits in the rank's GEMM input, in which order the producer computes
 * the tiles, and where each finished row band goes. The arrays are flat so that the runtime can
 * copy them to the device as they are.
 *
 * Words used throughout:
 *   row      one (token, k-slot) assignment, H values wide, or a zero padding row;
 *   group    the rows of one local expert owned by one rank (contiguous in the layout);
 *   band     TM consecutive rows of one local expert, starting at a multiple of TM from the
 *            expert's first row; the rows a band sends (its first valid_rows) belong to one
 *            group, hence one owner; after them come padding rows, or, in the band where the
 *            expert's last remote group ends, rows of the local group (layout.c);
 *   tile     one band x TN columns: the producer's unit of work;
 *   segment  one or more consecutive bands of one group, sent as one contiguous remote write.
 */
#ifndef TW_PLAN_H
#define TW_PLAN_H

#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A routing: for each rank r, tokens[r] tokens, each with top_k (expert id, gate weight). */
struct tw_routing {
  tw_problem problem;
  int32_t* tokens;      /* (W) tokens held by each rank */
  int32_t** expert_ids; /* (W) -> (tokens[r], top_k) global expert ids */
  float** weights;      /* (W) -> (tokens[r], top_k) gate weights */
};

/* Source of one layout row: the token it belongs to, or owner = -1 for a padding row. */
typedef struct tw_row_src {
  int32_t owner; /* rank that holds the token; -1 for padding */
  int32_t token; /* token index on the owner */
  int32_t slot;  /* which of the token's top_k choices (0..k-1) */
} tw_row_src;

/* One producer tile; the schedule is an array of these in execution order. */
typedef struct tw_tile {
  int32_t row0;   /* first row of the band in the rank's layout */
  int32_t rows;   /* rows of the band to compute (< TM only in an expert's last band) */
  int32_t expert; /* local expert index (selects the weight matrix) */
  int32_t col0;   /* first output column */
  int32_t band;   /* band index (its counter) */
  int32_t pad_[3];
} tw_tile;

#ifdef __CUDACC__
#define TW_HOST_DEVICE __host__ __device__
#else
#define TW_HOST_DEVICE
#endif

/* The band counter of a layout band: its first row / TM plus its local expert. Bands are TM rows
 * counted from each expert's first row and every expert's rows follow the last one's, so this
 * never repeats (expert e + 1 starts at or past the end of e's last band) and stays below
 * rows_max / TM + E + 1. A remote source's groups start a whole number of bands into the
 * expert (layout.c), so it can name the counter from its send row alone. */
TW_HOST_DEVICE static inline int32_t tw_band_counter(int32_t band_row0, int32_t expert,
                                                     int32_t tm) {
  return band_row0 / tm + expert;
}

/* One unit of the banded copy (an overlapped layer): `rows` rows of one (expert, source) group
 * that land in one band of the destination, then `rows` added to that band's counter there. The
 * units of a call come in the order of the destinations' GEMM1 (local expert, then the layout's
 * group order), so that the first experts' bands are complete first. */
typedef struct tw_copy_unit {
  int32_t dest;  /* destination rank */
  int32_t row0;  /* first destination row */
  int32_t slot0; /* first entry of send_slot (the slots in group order); -1: padding rows of
                    this rank, zero-filled */
  int32_t rows;
  int32_t band; /* the destination's band counter (tw_band_counter) */
  int32_t pad_[3];
} tw_copy_unit;

/* The banded copy's units of rank `plan->rank` (its plan from the count matrix `counts` (W,
 * experts), tw__plan_create_from_counts) and each group's first entry in the slots' group-order
 * list (send_off, experts), for padding ranges `pads` ((first row, rows) x npads of its own
 * layout): for each local expert e in index order (the destinations' GEMM1 order), this rank's
 * group of e at every rank in the layout's group order (rank + 1, ..., rank), cut at the
 * destination's band boundaries, then its padding ranges of e. A remote group starts a whole
 * number of bands into its expert (layout.c), so its bands are every TM rows from its send row;
 * the local group starts where the last remote group ends, inside a band, and is cut by this
 * rank's own layout. TW_ERR_INVALID_SIZE when more than `capacity` units (tw__copy_units_max). */
tw_status tw__plan_copy_units(const struct tw_plan* plan, const int32_t* counts,
                              const int32_t* pads, int32_t npads, int32_t* send_off,
                              tw_copy_unit* units, int32_t capacity, int32_t* num_units);
/* The most units a rank of this problem can have for tile height tm. */
int64_t tw__copy_units_max(const tw_problem* problem, int32_t tm);

/* One row band of the rank's output. */
typedef struct tw_band {
  int32_t expert;      /* local expert */
  int32_t row0;        /* first row in the layout */
  int32_t rows;        /* rows in the band (TM except an expert's last band) */
  int32_t valid_rows;  /* rows sent to dest (all rows of a local band); the rest are padding or,
                          in the band a remote group shares with the local group, local rows */
  int32_t dest;        /* owner rank of every valid row */
  int32_t segment;     /* segment index, -1 for local bands */
  int64_t dest_offset; /* byte offset of the band's first valid row in dest's receive buffer;
                          -1 for local bands */
} tw_band;

/* One transfer: bands [band0, band0 + nbands) of one group, contiguous at the source and the
 * destination. */
typedef struct tw_segment {
  int32_t band0;
  int32_t nbands;
  int32_t dest;
  int32_t src_row0;    /* first source row in the layout */
  int32_t valid_rows;  /* rows sent */
  int32_t ready_tiles; /* tiles that must be published before the segment is sent */
  int64_t dest_offset; /* bytes, in dest's receive buffer */
} tw_segment;

struct tw_plan {
  tw_problem problem;
  tw_hardware hardware;
  int32_t rank;
  int32_t local_experts; /* E = experts / W */
  int32_t tm, tn;        /* resolved tile shape */
  int32_t col_tiles;     /* ceil(hidden / tn) */

  /* Layout of this rank's GEMM2 input/output rows. */
  int32_t rows;              /* total rows, padding included */
  int32_t* expert_row0;      /* (E) first row of each local expert */
  int32_t* expert_rows;      /* (E) rows of each local expert, padding included */
  int32_t* expert_real_rows; /* (E) M_e: rows that carry tokens */
  tw_row_src* row_src;       /* (rows) source of each row */

  /* Schedule: bands in the order of `schedule`, their tiles in groups of tile_group bands:
   * remote-first (all experts' remote bands, then all local bands) or expert-major (expert by
   * expert, each its remote bands then its local bands, but the last two experts' remote parts
   * before their local parts); experts in expert_order either way. */
  int32_t schedule;         /* TW_SCHEDULE_REMOTE_FIRST or TW_SCHEDULE_EXPERT_MAJOR: the order of
                               bands and tiles now */
  int32_t schedule_request; /* the caller's: TW_SCHEDULE_AUTO (the model picks) or one of them */
  int32_t dataflow;         /* TW_DATAFLOW_REDUCE or TW_DATAFLOW_ADD: what the model predicts */
  int32_t tile_group; /* bands whose tiles go column by column together (tw__plan_set_schedule) */
  int32_t num_tiles;
  int32_t num_remote_tiles;    /* tiles whose band is remote; they are tiles[0..num_remote_tiles)
                                  only under remote-first */
  tw_tile* tiles;              /* (num_tiles) */
  int32_t* expert_order;       /* (E) local experts, descending remote band count */
  tw_band* layout_bands;       /* (num_bands) the bands in layout (row) order, segment -1: each
                                  schedule is a permutation of it; NULL in a plan built by hand,
                                  which then keeps its one order */
  int32_t* expert_band0;       /* (E + 1) expert e's bands are layout_bands[expert_band0[e] ..
                                  expert_band0[e + 1]): remote ones first (the layout puts the
                                  local group last) */
  int32_t* expert_local_band0; /* (E) first local band of e in layout_bands (expert_band0[e + 1]
                                  when e has no local rows) */

  /* Combine plan. */
  int32_t num_bands;
  tw_band* bands;   /* (num_bands) in schedule order */
  int32_t coalesce; /* mgb used to build the segments */
  int32_t num_segments;
  tw_segment* segments; /* (num_segments) in schedule order */
  int64_t send_bytes;   /* sum of valid rows x row bytes over remote bands */

  /* Receive side of this rank (as owner): where each of its (token, slot) rows lands. */
  int32_t recv_rows;     /* rows other ranks send here */
  int32_t* slot_row;     /* (tokens[rank], top_k) row index: < recv_rows is the receive
                            buffer, >= recv_rows is row (value - recv_rows) of the
                            local layout; NULL in a plan from counts (the device scans) */
  int32_t* recv_bands;   /* (W) bands this rank receives from each source per call (0
                            for itself) */
  int32_t* stream_first; /* (W) schedule index of the first remote band bound for each
                            rank, -1 if none (segment building) */
  int32_t* stream_last;  /* (W) schedule index of the last remote band bound for each
                            rank, -1 if none */
  /* The bases of the per-token maps, functions of the count matrix (layout.c): slot i of this
   * rank's tokens that names global expert g has slot_row[i] = slot_base[g] + p, and its row
   * goes to row send_row0[g] + p of the GEMM input of g's rank (g / E), where p is the slot's
   * position among this rank's slots of g in (token, slot) order. */
  int32_t* slot_base; /* (E_total) */
  int32_t* send_row0; /* (E_total) -1 where it would not fit int32 */

  /* What every rank's plan of one call must agree on, hashed (tw__plan_build): the problem, the
   * tile shape, the dataflow and the count matrix, and for a plan from a routing every rank's
   * expert ids too. Checked on the device where rows arrive (combine.h, plan_fp). */
  uint64_t fingerprint;

  /* Partition decision. */
  int32_t comm_ctas;
  double predicted_us;
  double sequential_us;
  double solve_us;
  double gemm_us; /* the GEMM alone on every SM, this schedule (compute waves vs memory) */

  /* Resource-model tables (model.c): per candidate coalescing factor, the segments' ready tiles
   * and suffix sums of bytes and bands, built by tw__model_choose and read by the decision and
   * tw_plan_predict. Owned by the plan: tw_plan_destroy calls tw__model_free. NULL until the
   * model runs (the plan must start zeroed). */
  void* model_tables;
};

/* The combine dataflow a plan or context runs: `requested` (a tw_combine_dataflow) when it names
 * one, else env TW_COMBINE_DATAFLOW (`reduce` or `add`) when set, else TW_DATAFLOW_REDUCE. A bad
 * value in either is TW_ERR_INVALID_ARGUMENT naming the fix (`what` leads the message). */
tw_status tw__dataflow_resolve(const char* what, int32_t requested, int32_t* dataflow);
/* Names as the environment and the command line spell them (case-blind): TW_DATAFLOW_REDUCE /
 * TW_DATAFLOW_ADD for `reduce` / `add`, TW_SCHEDULE_* for `auto` / `remote-first` /
 * `expert-major`; -1 for anything else. */
int32_t tw__dataflow_parse(const char* name);
int32_t tw__schedule_parse(const char* name);
/* `add` or `reduce`. */
const char* tw__dataflow_name(int32_t dataflow);

/* Internal helpers shared by plan sources. */
int32_t tw__resolve_tile_n(const tw_problem* p);
/* 1 when preset `index` (tw_preset_name) is a shape from the two papers, 0 for the large models
 * added for the layer benchmark (and for an index out of range). */
int tw__preset_from_papers(int index);
int32_t tw__resolve_tile_m(const tw_problem* p);
/* Builds the rank's row layout from the routing (layout.c): expert_row0 / rows / real_rows,
 * row_src, expert_order, layout_bands with expert_band0 / expert_local_band0, num_bands,
 * send_bytes, num_tiles, the receive side (recv_rows, recv_bands, slot_row), and allocates bands,
 * tiles and segments for the worst case; the bands' order is left to tw__plan_set_schedule. The
 * plan holds problem, rank, local_experts, tm, tn and col_tiles; on failure the caller frees it. */
tw_status tw__plan_layout(struct tw_plan* plan, const struct tw_routing* routing);
/* The same from the count matrix alone (layout.c): counts (W, E_total) row-major, counts[o][g]
 * = rank o's token slots routed to global expert g. Everything as tw__plan_layout, with every
 * row_src's token and slot -1 (owners and padding set) and no slot_row: those are per-token. */
tw_status tw__plan_layout_counts(struct tw_plan* plan, const int32_t* counts);
/* tw_plan_create from the count matrix instead of a routing (plan.c): the same checks of problem,
 * config and rank, then the same layout, schedule, segments and partition, so that the plan
 * equals tw_plan_create's for any routing with these counts but in the per-token fields (row_src
 * token and slot -1, slot_row NULL). Checks the counts: non-negative, each rank's row sum a
 * multiple of top_k giving at most max_tokens tokens, no count above the rank's tokens (a token
 * names an expert once). */
tw_status tw__plan_create_from_counts(const tw_problem* problem, const int32_t* counts,
                                      int32_t rank, const tw_plan_config* config, tw_plan_t* plan);
/* The capturable dispatch's static plan (plan.c): tw__plan_create_from_counts of the count
 * matrix whose every entry is `capacity` (a positive multiple of the tile height), without the
 * checks that make a count matrix a routing's (whole tokens, max_tokens, one expert per token):
 * every group (local expert, source rank) is `capacity` rows, whatever the routing, so layout,
 * bands, tiles, segments and receive offsets stay valid for every call. */
tw_status tw__plan_create_static(const tw_problem* problem, int32_t capacity, int32_t rank,
                                 const tw_plan_config* config, tw_plan_t* plan);
/* Builds plan->segments for a coalescing factor (replaces any previous ones; the array is sized
 * for the worst case at plan creation, so rebuilding never allocates). Planner (segments.c). */
tw_status tw__plan_build_segments(struct tw_plan* plan, int32_t coalesce);
/* Puts plan->bands and plan->tiles in the order of `schedule` (TW_SCHEDULE_REMOTE_FIRST or
 * TW_SCHEDULE_EXPERT_MAJOR) from layout_bands, and recomputes num_remote_tiles and stream_first /
 * stream_last; clears the segments (num_segments 0, every band's segment -1), which the caller
 * rebuilds. O(tiles), never allocates. A plan without layout_bands can only keep its schedule
 * (TW_ERR_STATE otherwise). Planner (schedule.c). */
tw_status tw__plan_set_schedule(struct tw_plan* plan, int32_t schedule);
/* The producer's tile list (nb x cols tiles) for bands in schedule order: groups of up to
 * tile_group consecutive bands of one expert and one destination (bands up to span_end may mix
 * destinations; -1: none), each group column by column (every band's column-0 tile, then column
 * 1, ...), so that neighbouring CTAs read one weight column tile at the same time (the producer
 * measured 5% faster, TW_TILE_GROUP_DEFAULT); the columns' direction alternates from one group to
 * the next of the same expert, so that a group starts on the columns its predecessor read last.
 * tile_group 1: band by band, columns ascending. */
void tw__tiles_from_bands(const tw_band* bands, int32_t nb, int32_t cols, int32_t tn,
                          int32_t tile_group, int32_t span_end, tw_tile* tiles);
/* GEMM1's tile list for a plan's layout (GEMM1 + SwiGLU over the same rows, F output columns):
 * the bands in layout order (each expert's rows in one pass over its weights; plan->bands when
 * the plan has no layout_bands), ceil(ffn / tn) column tiles of tn output columns each, in groups
 * of plan->tile_group bands of one expert taken column by column (tw__tiles_from_bands; groups may
 * mix destinations, GEMM1 publishes nothing); a tile's band indexes that band array. With tiles
 * NULL only *num_tiles is set; otherwise capacity must hold them (TW_ERR_INVALID_SIZE). The
 * launcher's tn is TW_GEMM1_TN (kernels.h). */
tw_status tw__plan_gemm1_tiles(const struct tw_plan* plan, int32_t tn, tw_tile* tiles,
                               int32_t capacity, int32_t* num_tiles);
/* Bands whose tiles the producer walks column by column together (tw__plan_set_schedule): G CTAs
 * with adjacent indices then read one weight column tile while it is in L2, which made the
 * producer about 5% faster over the grid, and 8 was the best group measured (docs/model.md; the
 * measurements: dev/NOTES.md, "Moved from code comments"). */
#define TW_TILE_GROUP_DEFAULT 8
/* The add dataflow's consumer takes at least this long per row and CTA: one bulk add per row,
 * so the SM's bulk-copy unit bounds rows below ~8 KB (model.c, tw__model_prepare). The value is
 * the one measured with warp 0's lanes issuing the adds, which also fit the add oracle best
 * (dev/NOTES.md, "Moved from code comments"). */
#define TW_ADD_ROW_FLOOR_US 0.18
/* The decision's plateau: from the best candidate, the model goes up in C while T stays within
 * this share of the best's and the next C keeps the best's wave count, and takes the last C
 * reached (model_search.c, tw__plateau_end). Where T is flat the call measured faster with more
 * consumer CTAs (a shorter consumer tail, fewer bandwidth-bound tiles at once), and the last C
 * before a wave step is never taken because the ranks' steps differ by a C. 0.02 had the lowest
 * replayed regret (docs/model.md; the numbers: dev/NOTES.md, "Moved from code comments"). */
#define TW_MODEL_PLATEAU 0.02
/* The tile group (plan->tile_group): env TW_TILE_GROUP (1 to 64), else TW_TILE_GROUP_DEFAULT.
 * Planner (plan.c). */
tw_status tw__tile_group_resolve(int32_t* tile_group);
/* Resolves the schedule a plan is built for: config->schedule when the config has the field and
 * sets it, else env TW_SCHEDULE (remote-first | expert-major | auto) when set, else
 * TW_SCHEDULE_AUTO. A bad value in either is TW_ERR_INVALID_ARGUMENT naming the fix; the
 * environment is read on every call and checked even when the config decides. Planner (plan.c). */
tw_status tw__schedule_resolve(const tw_plan_config* config, int32_t* schedule);

/* Chooses the partition: sets plan->comm_ctas, coalesce (rebuilding the segments),
 * predicted_us, sequential_us, gemm_us and solve_us, and the schedule: plan->schedule_request
 * when it names one, else (TW_SCHEDULE_AUTO) the faster prediction of the two, with the plan's
 * bands, tiles and segments rebuilt in that order (TW_DEFAULT_SCHEDULE when use_model is 0). An
 * explicit config->comm_ctas / coalesce wins; config->use_model == 0 gives
 * TW_DEFAULT_COMM_CTAS / TW_DEFAULT_COALESCE. Reads only the config fields before `schedule`
 * (an old-size config has no more). Model (model.c). */
tw_status tw__model_choose(struct tw_plan* plan, const tw_plan_config* config);

/* The consumer's tail split (defaults; the context reads the environment over them): the last
 * TW_DEFAULT_TAIL_BANDS bands of every destination stream go in row parts (below). Whole, a band is
 * one CTA's copy (2 MB at hidden 8192: ~57 us, about 2.5 producer waves), so a band finished in the
 * GEMM's last waves would still be in one CTA's hands after the GEMM has ended; 8 bands per stream
 * cover those waves at hidden 4096 and 8192 (docs/runtime.md; the measurements: dev/NOTES.md,
 * "Moved from code comments"). */
#define TW_DEFAULT_TAIL_BANDS 8
/* Row parts per tail band: by default TW_TAIL_MAX_PARTS when each part holds at least
 * TW_TAIL_PART_MIN_BYTES, else the band stays whole (tw__tail_parts_default; 128-row bands:
 * 4 parts from hidden 1024 up, whole at 512). A unit has a fixed cost of a few microseconds (poll,
 * claim, first load: link_latency_us ~3 us), which a short band's copy does not amortise over
 * parts (the measurements: dev/NOTES.md, "Moved from code comments"). */
#define TW_TAIL_PART_MIN_BYTES (64 << 10)
#define TW_TAIL_MAX_PARTS 4

/* The default row parts of a tail band of tm rows of `hidden` bf16 columns (units.c):
 * TW_TAIL_MAX_PARTS when each part holds at least TW_TAIL_PART_MIN_BYTES, else 1 (whole). */
int32_t tw__tail_parts_default(int32_t tm, int32_t hidden);

/* The consumer's transfer units of a plan (units.c): unit_chunks per band, tail_parts times that
 * for the last tail_bands bands of each destination stream (row parts). Fills seg_unit0
 * (num_segments + 1: each segment's first unit, then the total) and seg_split0 (num_segments:
 * each segment's first band cut into parts) and returns the total; -1 for bad arguments or a
 * segment without bands or with a destination outside the world. tw__owner_units: the units an
 * owner receives from a source that sends it `bands` bands, by the same rule. */
int64_t tw__consumer_units(const struct tw_plan* plan, int32_t tail_bands, int32_t tail_parts,
                           int32_t unit_chunks, int32_t* seg_unit0, int32_t* seg_split0);
int64_t tw__owner_units(int64_t bands, int32_t tail_bands, int32_t tail_parts, int32_t unit_chunks);

/* What the copy CTAs of an overlapped layer's dispatch are chosen from (tw__model_copy_ctas). */
typedef struct tw_copy_model_in {
  double gemm1_flops;  /* this rank's GEMM1 (4 rows H F) */
  double weight_bytes; /* its w13, read once */
  double local_bytes;  /* rows this rank sends to its own experts */
  double remote_bytes; /* rows it sends to the other ranks' */
  int32_t local_experts;
  int32_t budget;        /* P: the call's SMs; GEMM1 gets P - C */
  int32_t ranks_per_gpu; /* 1: a GPU of its own; W: an in-process team sharing one */
} tw_copy_model_in;

/* The copy CTAs C: the C in 1..P/2 with the least predicted time, or 0 (the dispatch, then
 * GEMM1) where no C is predicted to beat that; 0 for P < 2 or a NULL argument (model_copy.c has
 * the model). */
int32_t tw__model_copy_ctas(const tw_hardware* hw, const tw_copy_model_in* in);

/* Hardware description (hardware.c). validate: checks header and ranges. resolve: copies `given`
 * when non-NULL (validated), else the TW_CALIBRATION file (read once per process) if set, else
 * the built-in defaults; a bad calibration file is an error, never a silent fallback. */
tw_status tw__hardware_validate(const tw_hardware* hw);
tw_status tw__hardware_resolve(const tw_hardware* given, tw_hardware* out);
/* Frees plan->model_tables (model.c); safe on a plan without them. tw_plan_destroy calls it. */
void tw__model_free(struct tw_plan* plan);
/* The EP model's T evaluated segment by segment (F = max_s (A_s + Q_s)) on the plan's current
 * segments, for tests against the fast form (model_eval.c). tw_plan_predict is defined in model.c.
 */
tw_status tw__model_eval_plain(const struct tw_plan* plan, int32_t comm_ctas, double* t_us);
/* tw_plan_predict for either schedule the model tabulated (both when it chose between them;
 * TW_ERR_INVALID_ARGUMENT for one it did not). For tests (model.c). */
tw_status tw__model_predict(const struct tw_plan* plan, int32_t schedule, int32_t comm_ctas,
                            int32_t coalesce, double* t_us);
/* Bytes the producer moves through device memory in the plan's current order: each expert's
 * weights (hidden x ffn) once per run of consecutive bands of that expert, the input rows
 * (rows x ffn) and the output rows (rows x hidden), 2 bytes an element; and, of those, the
 * weight bytes of the runs that read an expert a second time (model_eval.c). */
tw_status tw__model_traffic(const struct tw_plan* plan, double* bytes, double* refetch);

#ifdef __cplusplus
}
#endif

#endif /* TW_PLAN_H */
