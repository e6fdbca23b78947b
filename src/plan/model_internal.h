/*
 * model_internal.h: the expert-parallel model's tables and the functions its three files share
 * (internal to src/plan/model*.c; the planner sees plan.h alone).
 *
 *   model_eval.c    the EP form: the compute end, the segment tables, a candidate's T
 *                   (tw__eval) and its plain reference, the producer's memory traffic;
 *   model_search.c  the decision over the tables: best-first branch and bound (tw__solve) and
 *                   the plateau walk (tw__plateau_end);
 *   model.c         the tables' lifetime (tw__model_prepare, tw__model_free) and the entry points
 *                   (tw__model_choose, tw__model_predict, tw_plan_predict).
 *
 * docs/model.md derives the model; model_eval.c's header has its terms.
 */
#ifndef TW_MODEL_INTERNAL_H
#define TW_MODEL_INTERNAL_H

#include <stdint.h>

#include "core.h"
#include "plan.h"

/* Candidate coalescing factors the model searches (tw__mgb_candidates, model.c). */
#define TW__NUM_MGB_CANDIDATES 3
/* Schedules one decision compares (remote-first and expert-major). */
#define TW__MAX_SCHED 2
/* Per schedule: the candidates plus one explicit coalesce value outside that set. */
#define TW__MAX_TABLES (TW__MAX_SCHED * (TW__NUM_MGB_CANDIDATES + 1))

/* One segment s as a wave term reads it: in one 16-byte record, so that a term costs one load
 * after first_seg's. */
typedef struct tw__seg_entry {
  double suffix_bytes;  /* bytes of segments j >= s */
  int32_t suffix_bands; /* bands of segments j >= s */
  int32_t run_last;     /* t'_s, non-decreasing */
} tw__seg_entry;

/* The segments of one coalescing factor, in the form the fast evaluation reads. */
typedef struct tw__seg_table {
  int32_t mgb;
  int32_t slot;       /* schedule slot (tw__model_tables.sched) whose order the segments follow */
  int32_t key;        /* tie rank: among equal T and C the larger wins (the smaller mgb, then a
                         schedule: tw__table_key) */
  int32_t twin;       /* a table searched before this one whose bound is <= this one's at every
                         C and which wins ties: this one's bounds are computed only if the search
                         gets to step 4 (tw__solve); -1 if none */
  int32_t first_row;  /* row of the decision's scratch (tw__model_tables.first) holding its
                         first terms: its slot's when it has the inputs of the slot's other
                         tables (segments, total bytes and bands), else its own */
  int32_t nseg;       /* S */
  int32_t last_tile;  /* t'_{S-1}: running last-tile index of the last segment; -1 if S = 0 */
  tw__seg_entry* seg; /* (S + 1) per segment s, what a wave term reads (entry S: the empty
                         suffix, run_last INT32_MAX) */
  int32_t* first_seg; /* (last_tile + 1) first s with t'_s >= t */
  double total_bytes; /* seg[0].suffix_bytes */
} tw__seg_table;

/* Everything the decision reads, built once per plan by tw__model_choose. */
typedef struct tw__model_tables {
  tw_hardware hw;
  double tau_comp_us;            /* one producer tile's compute */
  double reduce_us;              /* owner's weighted reduction (0 under the add dataflow) */
  double seq_reduce_us;          /* the reduction of the sequential baseline (any dataflow) */
  int32_t sched[TW__MAX_SCHED];  /* TW_SCHEDULE_* of each slot (1, or 2 when the model chooses) */
  double gemm_us[TW__MAX_SCHED]; /* GEMM alone on every SM: the compute end at P = occ_comp G */
  /* Per candidate C (index C, 0 unused): constants of the hardware and the tile count. */
  int32_t* prod;    /* (c_max + 1) P(C) */
  int32_t* waves;   /* (c_max + 1) W(C) = ceil(num_tiles / P(C)) */
  double* tau_us;   /* (slots, c_max + 1) a full wave, tau_tile(C) = max(tau_comp, min(P, tiles)
                       m_tile) + exposed_us / W */
  double* inv_tau;  /* (slots, c_max + 1) 1 / tau_us (wave skipping in tw__eval) */
  double* comp_us;  /* (slots, c_max + 1) compute end: the end of the last wave, (W - 1) tau_tile +
                       max(tau_comp, r m_tile) + exposed_us / W, r its tiles */
  double* comp_min; /* (slots, c_max + 1) min of comp_us over [C, c_max], non-decreasing in C: the
                       search's bound for every larger C (comp_us itself is not monotone) */
  double* inv_cta;  /* (c_max + 1) 1 / (C link_cta) in us per byte: the CTAs' own rate */
  double* lat_c;    /* (c_max + 1) link_latency_us / C: a band's fixed cost shared by C CTAs */
  double* first;    /* (TW__MAX_SCHED + TW__MAX_TABLES, c_max + 1) the decision's scratch: rows of
                       first terms (tw__seg_table.first_row) */
  double inv_peak;  /* 1 / link_peak in us per byte: the link's plateau */
  int32_t ntables;
  tw__seg_table t[TW__MAX_TABLES];
} tw__model_tables;

/* The decision compares lower bounds with T values exactly (no margin), which needs the shared
 * quantity, the first wave's term, to have the same bits wherever it is computed. A compiler
 * that fuses multiply-adds (-ffp-contract=fast, the GNU default on targets with FMA) may fuse
 * an inlined copy differently from another, so tw__first_terms, tw__wave_term and tw__eval are
 * kept out of line: one copy of the arithmetic serves the decision and tw_plan_predict alike. */
#if defined(__GNUC__) || defined(__clang__)
#define TW__NOINLINE __attribute__((noinline))
#else
#define TW__NOINLINE
#endif

/* Relative slack for skipping wave terms: a term is skipped only when its value, computed in
 * floating point, is certain to stay at or below the running maximum. Each term is a sum of three
 * non-negative products, so its rounding error is below 1e-15 relative; 1e-12 covers it with
 * room. */
#define TW__SKIP_SLACK (1.0 - 1e-12)

static inline int32_t tw__producers(const tw_hardware* hw, int32_t c) {
  return hw->occ_comp * (hw->sm_count - (int32_t)tw__ceil_div(c, hw->occ_comm));
}

/* Q(s) at C: the consumer's service of segments s.., the longer of what its C CTAs need (the
 * bands' fixed costs and the bytes at C times the per-CTA rate) and what the link needs (the
 * bytes at its plateau: past it, more CTAs only wait behind one another, and the fixed costs of
 * one CTA hide under the transfers of the others). lat_c = link_latency_us / C, inv_cta_c =
 * 1 / (C link_cta). Non-increasing in s (suffix sums of non-negative terms), which tw__eval's
 * wave skipping relies on. One expression for every caller, so equal inputs give equal bits. */
static inline double tw__service(const tw__seg_table* tb, int32_t s, double lat_c, double inv_cta_c,
                                 double inv_peak) {
  const tw__seg_entry e = tb->seg[s];
  const double ctas = (double)e.suffix_bands * lat_c + e.suffix_bytes * inv_cta_c;
  const double link = e.suffix_bytes * inv_peak;
  return ctas > link ? ctas : link;
}

/* When wave `wave` of `waves` ends: the full waves take tau each, and the last one ends at the
 * compute end, which is earlier where it has fewer tiles (its share of the traffic is smaller).
 * With one wave both forms are the same value. */
static inline double tw__wave_end(int64_t wave, int64_t waves, double tau, double comp_end) {
  return wave < waves ? (double)wave * tau : comp_end;
}

/* model_eval.c (each documented at its definition). */
double tw__compute_end(int64_t tiles, int32_t p, double tau, double mem_us, double exposed_us,
                       double* wave_us);
tw_status tw__table_build(const struct tw_plan* plan, const int32_t* band_last, tw__seg_table* tb);
TW__NOINLINE void tw__first_terms(const tw__model_tables* m, const tw__seg_table* tb, int32_t c_lo,
                                  int32_t c_hi, double* out);
TW__NOINLINE double tw__wave_term(const tw__seg_table* tb, int32_t s, double end, double lat_c,
                                  double inv_cta_c, double inv_peak);
TW__NOINLINE double tw__eval(const tw__model_tables* m, const tw__seg_table* tb, int32_t c,
                             double first, double cutoff, int strict, int32_t probe_wave,
                             int32_t* argmax_tile, double floor);
int tw__weights_stay_in_l2(const struct tw_plan* plan);

/* model_search.c (each documented at its definition). */
void tw__solve(const tw__model_tables* m, int32_t c_lo, int32_t c_hi, unsigned use, int32_t* best_c,
               int32_t* best_table, double* best_t);
void tw__plateau_end(const tw__model_tables* m, int32_t table, int32_t c_hi, int32_t* c, double* t);

#endif /* TW_MODEL_INTERNAL_H */
