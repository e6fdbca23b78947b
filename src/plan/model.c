/*
 * model.c: the analytical resource manager for the expert-parallel return path.
 *
 * Before each launch it picks how many consumer CTAs (C) forward finished row bands and how many
 * bands a middle segment coalesces (mgb), from the plan's real schedule and segments, and, when
 * the caller leaves the schedule to it, which schedule (remote-first or expert-major) the plan
 * keeps. It generalises the first paper's wave recurrence (model_tp.c) from splits to segments:
 *
 *   tau_comp        = (c^4 + f^4)^(1/4) + tile_overhead_us                  (one producer tile),
 *                     c = 2 TM TN K / (tile_tflops s_TM 1e12): the compute (s_128 = 1, s_64 =
 *                     tile_m64_share: 64-row tiles run at a lower rate), and f = tile_floor_us x
 *                     TN / 128 a floor that short tiles (small K) do not go below; it grows with
 *                     the tile's width (hardware.c has the measurements)
 *   P(C)            = occ_comp (G - ceil(C / occ_comm))                   (producer CTAs)
 *   waves(C)        = ceil(num_tiles / P)
 *   mem_us          = (weight bytes x runs + A bytes + C bytes) / mem_gbps (the schedule's traffic)
 *   exposed_us      = refetch_exposure x weight bytes of second runs / mem_gbps
 *   m_tile          = mem_us / num_tiles                  (a tile's share of the traffic)
 *   tau_tile(C)     = max(tau_comp, min(P, num_tiles) m_tile) + exposed_us / waves  (full wave)
 *   E(C)            = (waves - 1) tau_tile + max(tau_comp, r m_tile) + exposed_us / waves
 *                     (the compute end: the last wave, of r tiles, ends there)
 *   A_s(C)          = w_s tau_tile, or E where w_s = waves; w_s = floor(t_s / P) + 1 the wave of
 *                     t_s, the schedule index of segment s's last tile
 *   Q_s(C)          = max(bytes_{>=s} / (C link_cta_gbps) + nbands_{>=s} link_latency_us / C,
 *                         bytes_{>=s} / link_peak_gbps)       (the consumer's pool from s on)
 *   F               = max_s (A_s + Q_s(C))
 *   T(C, mgb)       = max(F, E) + reduce_us
 *
 * where bytes_{>=s} and nbands_{>=s} are what segments s, s+1, ... send, link_latency_us is the
 * consumer's fixed cost per band it sends (poll, first load, store issue: paid by the CTA that
 * moves the band, so C CTAs share them), and reduce_us is the owner's weighted reduction (reads
 * every (token, k) row, writes every token) at mem_gbps. Under the add dataflow reduce_us = 0, and
 * the consumer's rates are those of its bulk adds: 0.89 and 0.90 of the stores' per CTA and at the
 * plateau, and per CTA at most one row per TW_ADD_ROW_FLOOR_US (plan.h). The decision takes the
 * argmin of T, then walks up its plateau: to the largest C whose T stays within TW_MODEL_PLATEAU
 * of it at the same wave count (plan.h and tw__plateau_end say why).
 *
 * The consumer is one pool: its CTAs claim units of every ready segment from one counter, so from
 * the moment segment s is ready, what is left (s and every later segment) takes the longer of what
 * the C CTAs need (bytes at C per-CTA rates plus the per-band costs they share) and what the
 * link needs (bytes at its plateau). Past the plateau the per-band costs hide under other CTAs'
 * transfers, so more CTAs stop paying off and the SMs they take from the GEMM decide (an
 * earlier form added the per-band costs to bytes / min(C rate, plateau) and took 32 CTAs at every
 * top-8 point where 13-20 were measured best; before that, each segment was served only by the
 * CTAs that held one of its units, with a serial latency per segment: oracle matrix mean regret
 * 3.83%, then 2.01%; bench/results/2026-11-30-run3.md).
 *
 * The memory term: the producer cannot finish before it has moved its bytes through device
 * memory, each expert's hidden x ffn weights once per run of consecutive bands of that expert in
 * the schedule (2 runs under remote-first for an expert with remote and local rows, 1 under
 * expert-major but for its last two experts), the input rows and the output rows once; the traffic
 * is spread over the tiles, so a wave lasts the longer of its tiles' compute and their share of the
 * traffic, and a last wave with few tiles is short (tw__model_traffic, tw__compute_end,
 * docs/model.md). Spread evenly over the waves instead, a partial last wave took a full wave's
 * share, and the model saw three waves of 124 + 124 + 8 tiles as fast as two of 128 (m-bert at 1024
 * tokens: measured 109 against 92 us). A second read of an expert's weights costs more than the
 * roofline says: measured, remote-first takes refetch_exposure (0.30) x those bytes / mem_gbps
 * longer than expert-major beyond the roofline's own difference, also where both are
 * compute-bound, so that part is added to the waves. Where all local experts' weights fit in
 * half the L2 (l2_mib), a second run finds them there: each expert counts once, nothing is
 * exposed, and remote-first wins the ties (tw__table_key). With the schedule left to the model,
 * both schedules' tables are built and searched together, and the plan is rebuilt in the winner's
 * order.
 *
 * Evaluating F segment by segment costs O(S) per candidate. Replacing t_s by its running
 * maximum t'_s = max_{j <= s} t_j leaves the maximum unchanged (a term whose A_s was raised is
 * dominated by the earlier term it was raised to, Q being non-increasing in s). With t'
 * non-decreasing, only the first segment of each wave can attain the maximum, so a candidate
 * costs one term per wave, and Q_s needs only the suffix sums of bytes and bands.
 * tw__model_choose therefore tabulates, once per candidate mgb and before the decision is timed,
 * the running last-tile index t'_s, the first segment at or after each tile index, and the
 * suffix sums of bytes and bands. The decision then runs without allocating: an exact lower
 * bound per candidate (first wave's term, compute end) over only the C range that can win (the
 * compute end's suffix minimum only grows with C, the first term only falls), the best-ranked bound
 * of one table evaluated first (often it is the answer), the other candidates taken best-ranked
 * bound first, each bound raised by two exact probe terms (the last wave's and the one where the
 * first evaluation's maximum fell; lazily while the probes leave the best-ranked bound as it was),
 * only while their bound lets them win; an evaluation starts from its probes, skips the waves
 * whose terms cannot raise its maximum (tw__eval, tw__solve say why each step is exact).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"

/* The add dataflow's consumer rates as shares of the store's (tw__model_prepare). */
#define TW__ADD_CTA_SHARE 0.89
#define TW__ADD_PEAK_SHARE 0.90

/* Candidate coalescing factors the model searches when the caller leaves coalesce = 0; mgb 1
 * last, so that its tables are the last of each schedule (the search starts from the last table,
 * and mgb 1 wins the ties: tw__table_key). */
static const int32_t tw__mgb_candidates[] = {4, 2, 1};
#define TW__NUM_MGB_CANDIDATES ((int32_t)(sizeof tw__mgb_candidates / sizeof tw__mgb_candidates[0]))
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

static void tw__table_free(tw__seg_table* tb) {
  free(tb->seg);
  free(tb->first_seg);
  memset(tb, 0, sizeof *tb);
}

void tw__model_free(struct tw_plan* plan) {
  if (plan == NULL || plan->model_tables == NULL) return;
  tw__model_tables* m = (tw__model_tables*)plan->model_tables;
  for (int32_t i = 0; i < m->ntables; i++) tw__table_free(&m->t[i]);
  free(m->prod);
  free(m->tau_us);
  free(m->inv_tau);
  free(m->comp_us);
  free(m->comp_min);
  free(m->waves);
  free(m->inv_cta);
  free(m->lat_c);
  free(m->first);
  free(m);
  plan->model_tables = NULL;
}

static int32_t tw__producers(const tw_hardware* hw, int32_t c) {
  return hw->occ_comp * (hw->sm_count - (int32_t)tw__ceil_div(c, hw->occ_comm));
}

/* The producer's waves at P CTAs: the end of the last wave (the compute end), and in *wave_us how
 * long a full wave takes. Each wave lasts the longer of its tiles' compute and its share of the
 * traffic, spread over the tiles (m_tile = mem_us / tiles per tile): a full wave of P tiles moves
 * P m_tile, the last wave only its own r tiles' share, so it can be short while still costing
 * one tile's compute. The part of a second weight read that the GEMM does not hide
 * (exposed_us) is spread over the waves. With one wave the two times are the same value, bit
 * for bit (r = tiles = min(P, tiles)); without tiles a wave is one tile's compute and the end 0.
 * wave_us may be NULL. */
static double tw__compute_end(int64_t tiles, int32_t p, double tau, double mem_us,
                              double exposed_us, double* wave_us) {
  if (tiles <= 0) {
    if (wave_us) *wave_us = tau;
    return exposed_us;
  }
  const int64_t waves = tw__ceil_div(tiles, p);
  const double m_tile = mem_us / (double)tiles;
  const int64_t full = p < tiles ? p : tiles, last = tiles - (waves - 1) * (int64_t)p;
  const double spread = exposed_us / (double)waves;
  const double wave = fmax(tau, (double)full * m_tile) + spread;
  if (wave_us) *wave_us = wave;
  return (double)(waves - 1) * wave + (fmax(tau, (double)last * m_tile) + spread);
}

/* Captures plan->segments (built for plan->coalesce) as a table. band_last: (num_bands) largest
 * schedule index among each band's tiles. */
static tw_status tw__table_build(const struct tw_plan* plan, const int32_t* band_last,
                                 tw__seg_table* tb) {
  memset(tb, 0, sizeof *tb);
  tb->mgb = plan->coalesce;
  const int32_t S = plan->num_segments;
  tb->nseg = S;
  tb->last_tile = -1;
  if (S == 0) return TW_SUCCESS;
  tb->seg = malloc((size_t)(S + 1) * sizeof *tb->seg);
  if (!tb->seg) goto oom;
  const double row_bytes = 2.0 * (double)plan->problem.hidden; /* bf16 / fp16 */
  int32_t run = -1;
  for (int32_t s = 0; s < S; s++) {
    const tw_segment* sg = &plan->segments[s];
    if (sg->nbands < 1 || sg->band0 < 0 || sg->band0 + sg->nbands > plan->num_bands)
      return tw__fail(TW_ERR_INTERNAL,
                      "model: segment %d covers bands %d..%d of %d; the planner built an "
                      "inconsistent combine plan",
                      s, sg->band0, sg->band0 + sg->nbands - 1, plan->num_bands);
    for (int32_t b = sg->band0; b < sg->band0 + sg->nbands; b++)
      if (band_last[b] > run) run = band_last[b];
    if (run < 0) return tw__fail(TW_ERR_INTERNAL, "model: segment %d has no scheduled tile", s);
    tb->seg[s].run_last = run;
  }
  tb->seg[S].suffix_bytes = 0.0;
  tb->seg[S].suffix_bands = 0;
  tb->seg[S].run_last = INT32_MAX;
  for (int32_t s = S - 1; s >= 0; s--) {
    const tw_segment* sg = &plan->segments[s];
    tb->seg[s].suffix_bytes = tb->seg[s + 1].suffix_bytes + (double)sg->valid_rows * row_bytes;
    tb->seg[s].suffix_bands = tb->seg[s + 1].suffix_bands + sg->nbands;
  }
  tb->total_bytes = tb->seg[0].suffix_bytes;
  tb->last_tile = run;
  tb->first_seg = malloc((size_t)(run + 1) * sizeof *tb->first_seg);
  if (!tb->first_seg) goto oom;
  for (int32_t t = 0, s = 0; t <= run; t++) {
    while (tb->seg[s].run_last < t) s++; /* ends: run_last of S-1 = run >= t */
    tb->first_seg[t] = s;
  }
  return TW_SUCCESS;
oom:
  return tw__fail(TW_ERR_OUT_OF_MEMORY,
                  "model: out of host memory for the segment tables of a "
                  "plan with %d segments",
                  S);
}

/* The decision compares lower bounds with T values exactly (no margin), which needs the shared
 * quantity, the first wave's term, to have the same bits wherever it is computed. A compiler
 * that fuses multiply-adds (-ffp-contract=fast, the GNU default on targets with FMA) may fuse
 * an inlined copy differently from another, so these two functions are kept out of line: one
 * copy of the arithmetic serves the decision and tw_plan_predict alike. */
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

/* For C in [c_lo, c_hi]: out[C - c_lo] = tau(C) + Q(0), the term of wave 1 taken with every segment
 * (the fast form's term for s = 0, w = 1; 0 when there is no segment). The one copy of this
 * arithmetic that the decision and tw_plan_predict share. */
static TW__NOINLINE void tw__first_terms(const tw__model_tables* m, const tw__seg_table* tb,
                                         int32_t c_lo, int32_t c_hi, double* out) {
  if (tb->nseg == 0) {
    for (int32_t c = c_lo; c <= c_hi; c++) out[c - c_lo] = 0.0;
    return;
  }
  const double* tau = m->tau_us + (size_t)tb->slot * ((size_t)m->hw.c_max + 1);
  for (int32_t c = c_lo; c <= c_hi; c++)
    out[c - c_lo] = tau[c] + tw__service(tb, 0, m->lat_c[c], m->inv_cta[c], m->inv_peak);
}

/* When wave `wave` of `waves` ends: the full waves take tau each, and the last one ends at the
 * compute end, which is earlier where it has fewer tiles (its share of the traffic is smaller).
 * With one wave both forms are the same value. */
static inline double tw__wave_end(int64_t wave, int64_t waves, double tau, double comp_end) {
  return wave < waves ? (double)wave * tau : comp_end;
}

/* The term of a wave that ends at `end`, taken from segment s on: end + Q(s). Out of line, so
 * that a probe of tw__solve and the same probe in tw__eval have the same bits whatever the
 * compiler fuses: tw__eval folds the probe into its maximum, so the probe is a lower bound of T
 * exactly. */
static TW__NOINLINE double tw__wave_term(const tw__seg_table* tb, int32_t s, double end,
                                         double lat_c, double inv_cta_c, double inv_peak) {
  return end + tw__service(tb, s, lat_c, inv_cta_c, inv_peak);
}

/* T(C, mgb) of one table, in microseconds (the fast form; identical in value to the plain
 * reference's maximum up to floating-point association). first = tw__first_terms' value at C.
 * Once T is known to exceed `cutoff` (or, with `strict`, to reach it) it returns early with a
 * value above (at) `cutoff` (not T); DBL_MAX gives T exactly. probe_wave (0: none) names a wave
 * whose term is taken first; argmax_tile (may be NULL) receives the running last-tile index of
 * the segment whose term is the maximum (-1: the compute end is). floor: the maximum starts at the
 * larger of it and the compute end (0 gives T; a band's floor answers only whether T is within
 * the band: the value is T where T is above the floor, the floor where it is not).
 *
 * The maximum starts at the compute end (T = max(F, compute end) + reduce, and max is exact in
 * floating point, so folding it in first changes no bit of T), then takes the last wave's term
 * and probe_wave's (see below). Waves are skipped when they cannot raise it: the term of wave w
 * is w tau(C) + Q(s_w) (the last wave's end is at most that: its tiles are no more than a full
 * wave's), and Q is non-increasing in s (suffix sums of non-negative bytes and
 * bands) while s_w is non-decreasing in w. So every wave w' in (w, w + k] has a term at most
 * term(w) + k tau, and once the running maximum f is at least that (with TW__SKIP_SLACK against
 * rounding), those k waves need not be evaluated. When the link is the bottleneck the service
 * drains faster than tau per wave and the skips grow geometrically: a handful of terms instead
 * of one per wave. Skipping only leaves out terms that are <= f, so the maximum, and hence T,
 * is bit for bit the one the full loop gives. */
static TW__NOINLINE double tw__eval(const tw__model_tables* m, const tw__seg_table* tb, int32_t c,
                                    double first, double cutoff, int strict, int32_t probe_wave,
                                    int32_t* argmax_tile, double floor) {
  const int32_t p = m->prod[c];
  const size_t at = (size_t)tb->slot * ((size_t)m->hw.c_max + 1) + (size_t)c;
  const double tau = m->tau_us[at];
  const double comp_end = m->comp_us[at];
  const double reduce = m->reduce_us;
  if (argmax_tile) *argmax_tile = -1;
  if (tb->nseg == 0) return comp_end + reduce;
  const double lat_c = m->lat_c[c], inv_cta_c = m->inv_cta[c], inv_peak = m->inv_peak;
  const double inv_tau = m->inv_tau[at];
  const int32_t* first_seg = tb->first_seg;
  const tw__seg_entry* seg = tb->seg;
  const int64_t last_wave = (int64_t)tb->last_tile / p + 1; /* wave of the last segment */
  const int64_t waves = m->waves[c];
  double f = comp_end > floor ? comp_end : floor;
  int32_t arg = -1;
  if (f + reduce > cutoff || (strict && f + reduce == cutoff)) return f + reduce;
  /* Probes: the last wave's term (the consumer's tail, the maximum on most compute-bound
   * shapes) and the term of `probe_wave` (where another candidate's maximum fell) first, so that
   * a loser stops at once and the skipping below starts from a maximum close to the final one.
   * Each is the term of the first segment not finished before that wave, taken in that wave,
   * which is <= that segment's own term (it finishes in that wave or later), so <= F: starting
   * from them changes nothing in the result. */
  for (int32_t pass = 0; pass < 2; pass++) {
    const int64_t pw = pass == 0 ? last_wave : probe_wave;
    if (pw <= 1 || pw > last_wave || (pass == 1 && pw == last_wave)) continue;
    const int32_t s = first_seg[(pw - 1) * p];
    const double term =
        tw__wave_term(tb, s, tw__wave_end(pw, waves, tau, comp_end), lat_c, inv_cta_c, inv_peak);
    if (term > f) {
      f = term, arg = seg[s].run_last;
      if (f + reduce > cutoff || (strict && f + reduce == cutoff)) goto done;
    }
  }
  /* One term per wave: its first ready segment s, A = w tau plus all later service. Wave 1's
   * segment is s = 0 and its term is `first`, computed by tw__first_terms. */
  int64_t w = 1, start = 0; /* start = (w - 1) P: first tile index of wave w */
  double term = first;
  int32_t s = 0;
  if (seg[0].run_last >= p) goto next; /* nothing is ready in wave 1 */
  for (;;) {
    if (term > f) {
      f = term, arg = seg[s].run_last;
      /* Already worse than the best candidate: the rest cannot make T smaller. */
      if (f + reduce > cutoff || (strict && f + reduce == cutoff)) break;
    } else {
      /* Waves w + 1 .. w + k have terms <= term + k tau <= f (see above); when term > f the
       * room is negative and nothing is skipped. */
      const double room = (f * TW__SKIP_SLACK - term) * inv_tau;
      if (room >= (double)(last_wave - w)) break; /* no later wave can raise f */
      if (room >= 1.0) {
        const int64_t k = (int64_t)room;
        w += k;
        start += k * p;
      }
    }
  next:
    do { /* the next wave in which a segment becomes ready */
      if (++w > last_wave) goto done;
      start += p;
      s = first_seg[start];
    } while (seg[s].run_last >= start + p);
    term = tw__wave_end(w, waves, tau, comp_end) + tw__service(tb, s, lat_c, inv_cta_c, inv_peak);
  }
done:
  if (argmax_tile) *argmax_tile = arg;
  return f + reduce;
}

/* Reference: F = max_s (A_s + Q_s) segment by segment on the plan's current segments and
 * order, each A_s from a scan of the tiles (tests compare the fast form against it). The memory
 * term is recomputed from the plan's current band order, not read from the tables. */
tw_status tw__model_eval_plain(const struct tw_plan* plan, int32_t c, double* t_us) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(t_us);
  const tw__model_tables* m = (const tw__model_tables*)plan->model_tables;
  if (m == NULL)
    return tw__fail(TW_ERR_STATE, "model: the plan has no model tables; create it first");
  const tw_hardware* hw = &m->hw;
  const int32_t p = tw__producers(hw, c);
  const int64_t waves = tw__ceil_div(plan->num_tiles, p);
  double bytes = 0.0, refetch = 0.0;
  TW_TRY(tw__model_traffic(plan, &bytes, &refetch));
  const double mem_us = bytes / (hw->mem_gbps * 1e3);
  const double exposed_us = hw->refetch_exposure * refetch / (hw->mem_gbps * 1e3);
  double tau = 0.0;
  const double comp_end =
      tw__compute_end(plan->num_tiles, p, m->tau_comp_us, mem_us, exposed_us, &tau);
  const double row_bytes = 2.0 * (double)plan->problem.hidden;
  /* F = max_s (A_s + Q_s), segments walked from the last, summing what s.. send. */
  double f = 0.0, sum_bytes = 0.0, sum_bands = 0.0;
  for (int32_t s = plan->num_segments - 1; s >= 0; s--) {
    const tw_segment* sg = &plan->segments[s];
    int32_t last = -1;
    for (int32_t i = 0; i < plan->num_tiles; i++) {
      const int32_t b = plan->tiles[i].band;
      if (b >= sg->band0 && b < sg->band0 + sg->nbands) last = i;
    }
    sum_bytes += (double)sg->valid_rows * row_bytes;
    sum_bands += (double)sg->nbands;
    const double ctas = sum_bytes / ((double)c * hw->link_cta_gbps * 1e3) +
                        sum_bands * hw->link_latency_us / (double)c;
    const double link = sum_bytes / (hw->link_peak_gbps * 1e3);
    const int64_t w = last / p + 1;
    f = fmax(f, (w < waves ? (double)w * tau : comp_end) + fmax(ctas, link));
  }
  *t_us = fmax(f, comp_end) + m->reduce_us;
  return TW_SUCCESS;
}

/* Candidate ordering: smaller T; on equal T the smaller C, then the larger key (the smaller mgb,
 * then a schedule: tw__table_key) (bc = 0: no best yet). Applied to a lower bound lb <= T, it
 * says whether the candidate may still win. */
static int tw__better(double t, int32_t c, int32_t key, double bt, int32_t bc, int32_t bkey) {
  if (bc == 0 || t < bt) return 1;
  if (t > bt) return 0;
  return c < bc || (c == bc && key > bkey);
}

/* Whether the weights of all local experts fit in half the L2 cache, so that a second run of an
 * expert finds them there: neither schedule then reads any expert's weights from device memory
 * more than once (the other half: the activations and outputs streaming through). */
static int tw__weights_stay_in_l2(const struct tw_plan* plan) {
  const double w = 2.0 * (double)(plan->local_experts > 0 ? plan->local_experts : 1) *
                   (double)plan->problem.hidden * (double)plan->problem.ffn; /* bf16 / fp16 */
  return w <= 0.5 * plan->hardware.l2_mib * 1048576.0;
}

/* Tie rank of a table: the smaller mgb wins a tie, then a schedule. A coarser segment is never
 * ready earlier and its per-band costs are the same, so T(mgb) >= T(1) in the model: mgb > 1 can
 * only tie. Measured, it loses: at the model's C, mgb 1 was 0.2-0.4% faster than mgb 4 on average
 * over the oracle matrix (runs 6, 6c, 6d), up to 3.3% at N 8192, 16384 tokens, where a segment
 * of four 2 MB bands waits for its last band (dev/NOTES.md section 11). (It used to go the other
 * way, on the guess that fewer segments meant fewer latencies the model underestimates.)
 * On a tie between schedules the model cannot tell them apart.
 * Usually expert-major wins it: it reads each expert's weights once but two (what a second read
 * costs the model sees only in part: refetch_exposure). Where the weights stay in L2 there is no
 * second read to pay, and remote-first wins it: its remote bands are all computed first, so its
 * consumer ends before the producer, and the reduction reads the local rows computed last while
 * they are in L2. Measured with bench --phases (2 x H200, granite at 1024-16384 tokens, C 17):
 * expert-major's consumer ended 3-8 us after its producer and the call took 2.4-7.2% longer
 * (dev/NOTES.md section 10); the model has no term for either effect. */
static int32_t tw__table_key(int32_t mgb, int32_t schedule, int weights_in_l2) {
  const int32_t wins = weights_in_l2 ? TW_SCHEDULE_REMOTE_FIRST : TW_SCHEDULE_EXPERT_MAJOR;
  return -2 * mgb + (schedule == wins);
}

/* The probe term tw__eval takes first for wave `wave` (> 1) of C: the term of the first segment
 * not finished before that wave, with the same bits (tw__wave_term). */
static inline double tw__probe_term(const tw__model_tables* m, const tw__seg_table* tb, int32_t c,
                                    double tau, int32_t wave) {
  const int32_t s = tb->first_seg[(int64_t)(wave - 1) * m->prod[c]];
  const double comp_end = m->comp_us[(size_t)tb->slot * ((size_t)m->hw.c_max + 1) + (size_t)c];
  return tw__wave_term(tb, s, tw__wave_end(wave, m->waves[c], tau, comp_end), m->lat_c[c],
                       m->inv_cta[c], m->inv_peak);
}

/* A candidate left for step 4: its bound (raised by the probes once probed), its first term,
 * and the wave of the hint for tw__eval (0: none). */
typedef struct tw__cand {
  double lb, first;
  int32_t c, table, key, wave;
} tw__cand;
/* Raises x's bound by its probes (exact terms tw__eval takes first, so lower bounds of its T):
 * the last wave's term and, while x may still win against (bt, bc, bkey), the term of the wave
 * holding tile `hint` (where step 1's maximum fell; -1: none), which x->wave then names. */
static inline void tw__probe(const tw__model_tables* m, tw__cand* x, int32_t hint, double reduce,
                             double bt, int32_t bc, int32_t bkey) {
  const tw__seg_table* tb = &m->t[x->table];
  const double tau = m->tau_us[(size_t)tb->slot * ((size_t)m->hw.c_max + 1) + (size_t)x->c];
  const int32_t p = m->prod[x->c];
  const int32_t last_wave = tb->last_tile / p + 1;
  x->wave = 0;
  if (last_wave > 1) {
    const double term = tw__probe_term(m, tb, x->c, tau, last_wave) + reduce;
    if (term > x->lb) x->lb = term;
    if (!tw__better(x->lb, x->c, x->key, bt, bc, bkey)) return;
  }
  if (hint >= 0) {
    const int32_t t = hint < tb->last_tile ? hint : tb->last_tile;
    const int32_t wave = tb->seg[tb->first_seg[t]].run_last / p + 1;
    if (wave > 1 && wave < last_wave) {
      const double term = tw__probe_term(m, tb, x->c, tau, wave) + reduce;
      if (term > x->lb) x->lb = term;
      x->wave = wave;
    }
  }
}

/* Candidates step 4 orders; more are evaluated as they come (the same answer, found slower). */
#define TW__MAX_CANDS 64
/* Longest candidate list step 4 starts lazily (tw__solve). */
#define TW__LAZY_MAX 16

/* The last C in [c_lo, c_hi] up to which some compute end + reduce stays within bt (below it if
 * `below`), c_lo - 1 if none, by bisection on the suffix minimum comp_min, which is
 * non-decreasing in C (tw__model_slot); beyond it every compute end exceeds bt. */
static int32_t tw__c_end(const double* comp_min, double reduce, double bt, int below, int32_t c_lo,
                         int32_t c_hi) {
  int32_t lo = c_lo - 1, hi = c_hi; /* the answer lies in [lo, hi] */
  while (hi > lo) {
    const double x = comp_min[hi] + reduce;
    if (!(x > bt || (below && x == bt))) break; /* hi itself qualifies */
    const int32_t mid = lo + (hi - lo + 1) / 2;
    const double y = comp_min[mid] + reduce;
    if (y > bt || (below && y == bt))
      hi = mid - 1;
    else
      lo = mid;
  }
  return hi;
}

/* The last C a table's scan needs: beyond it every compute end + reduce exceeds bt, or equals it
 * at a C above bc (a tie it loses). The two ends are cached per slot for the bt given. */
static inline int32_t tw__scan_end(const double* comp_min, double reduce, double bt, int32_t bc,
                                   int32_t c_lo, int32_t c_hi, double* cached_bt, int32_t* le,
                                   int32_t* lt) {
  if (*cached_bt != bt) {
    *le = tw__c_end(comp_min, reduce, bt, 0, c_lo, c_hi);
    *lt = bt == DBL_MAX ? *le : tw__c_end(comp_min, reduce, bt, 1, c_lo, *le);
    *cached_bt = bt;
  }
  const int32_t tie_end = bc > 0 && bc < *le ? bc : *le;
  return *lt > tie_end ? *lt : tie_end;
}

/* The decision: the best (C, mgb, schedule) over C in [c_lo, c_hi] and the tables of `use` (bit
 * i = table i; one table per mgb and schedule), by T, then the smaller C, then the larger key
 * (the smaller mgb, then a schedule); the same answer as evaluating every candidate, found by
 * best-first branch and bound on lb = max(first term, compute end) + reduce:
 *
 *   1. one table (the last: mgb 1 of the last schedule tabulated, usually the winner)
 *      is scanned from the smallest C up to its best-ranked bound (the suffix minimum of the
 *      compute end only grows with C: the scan stops where it reaches the best bound so far)
 *      and that candidate's exact T is evaluated: an upper bound bt of the optimum;
 *   2. every table is scanned from the last C whose compute end + reduce stays within bt (by
 *      bisection on the suffix minimum) down to the first C whose first term + reduce exceeds
 *      bt (the first term only grows as C falls): what lies outside cannot win. Where the first
 *      term + reduce equals bt at a C above bc, the scan goes on at bc (those C tie at best and
 *      lose). The candidates inside are kept, and the best-ranked bound over all tables is
 *      tracked;
 *   3. if the candidate evaluated in 1 holds the best-ranked bound by (lb, C, -key) and its T
 *      equals its bound (T is the first wave's term on link-bound shapes, the compute end on
 *      compute-bound ones), it is the answer, since no bound is below it and equal bounds rank
 *      after it: the search ends here;
 *   4. otherwise the candidates are evaluated best-ranked bound first, each bound raised by two
 *      probe terms (the last wave's, and the one of the wave holding the tile where step 1's
 *      maximum fell), while the best-ranked bound still lets one win (tw__better). The probes
 *      are taken lazily, for the best-ranked candidate only, while they leave its bound as it
 *      was (it then still ranks first and is evaluated; if its T equals that bound, it is the
 *      answer); at the first bound they raise, every candidate left is probed.
 *      Each evaluation starts from its probes and stops at its first term above the best T (or
 *      reaching it, when a tie would lose).
 *
 * The first-term bound is exact in floating point, lb <= T bit for bit, so it is compared
 * without margin and no candidate that could win or tie is skipped: T = max(f, compute end) +
 * reduce where f is the maximum of the wave terms; the first wave with a ready segment has s =
 * 0 and A_0 >= 1; when A_0 = 1 its term is the very value tw__first_terms gave (tw__eval reuses
 * it), and when A_0 > 1 it exceeds that value by at least tau, far beyond rounding. max and the
 * same + reduce keep the order. The first term is non-increasing in C bit for bit (tau(C) and
 * the service's per-C rates are, and rounding is monotone), which the scan of step 2 relies on.
 * A probe is computed by the one out-of-line copy (tw__wave_term) that tw__eval also uses for
 * the same probe and folds into its maximum, so it is <= T bit for bit whatever the compiler
 * fuses, and is compared without margin too: a tie of a probed bound with bt is decided by C and
 * key, never by a slack. */
static void tw__solve(const tw__model_tables* m, int32_t c_lo, int32_t c_hi, unsigned use,
                      int32_t* best_c, int32_t* best_table, double* best_t) {
  const size_t stride = (size_t)m->hw.c_max + 1;
  const double reduce = m->reduce_us;
  double bt = DBL_MAX; /* best evaluated candidate */
  int32_t bc = 0, bi = -1, bkey = 0;
  double bl = DBL_MAX; /* best-ranked bound */
  int32_t lc = 0, li = -1, lkey = 0;
  int32_t hint = -1;             /* schedule index where step 1's maximum fell */
  int32_t c_end[TW__MAX_TABLES]; /* candidates C in [c_lo, c_end[i]] are left */
  unsigned lazy = 0;             /* tables whose scan waits for step 4 (bit i) */
  /* Per schedule slot, for the bt they were found with: the last C whose compute end + reduce
   * is within bt and below it (C beyond the latter tie at best: only C <= bc may still win). */
  double slot_bt[TW__MAX_SCHED] = {-1.0, -1.0};
  int32_t slot_le[TW__MAX_SCHED] = {0, 0}, slot_lt[TW__MAX_SCHED] = {0, 0};
  tw__cand cand[TW__MAX_CANDS];
  int32_t n = 0;
  unsigned rows = 0; /* rows of m->first begun for this decision (bit r) */
  int32_t row_hi[TW__MAX_SCHED + TW__MAX_TABLES];
  for (int32_t pass = 0; pass < 2; pass++) { /* pass 0: steps 1-2; pass 1: lazy tables */
    for (int32_t i = m->ntables - 1; i >= 0; i--) {
      if (pass == 0) c_end[i] = c_lo - 1;
      if (!(use & (1u << i)) || (pass == 1 && !(lazy & (1u << i)))) continue;
      const tw__seg_table* tb = &m->t[i];
      const double* comp_us = m->comp_us + (size_t)tb->slot * stride;
      const double* comp_min = m->comp_min + (size_t)tb->slot * stride;
      if (pass == 0) {
        c_end[i] = tw__scan_end(comp_min, reduce, bt, bc, c_lo, c_hi, &slot_bt[tb->slot],
                                &slot_le[tb->slot], &slot_lt[tb->slot]);
        if (c_end[i] < c_lo) continue;
        /* Dominated by a twin whose bounds are known at every C left here (its compute end is
         * no larger, so its c_end is no smaller): every bound of this table ranks after the
         * twin's bound at the same C, so it cannot hold the best-ranked bound unless a twin's
         * bound does; step 3 holds without it, step 4 scans it. */
        if (tb->twin >= 0 && (use & (1u << tb->twin)) && c_end[tb->twin] >= c_end[i]) {
          lazy |= 1u << i;
          continue;
        }
      }
      /* The first terms of a row are computed in runs of C (a short loop the compiler
       * vectorises), each C once per row, and only as far as the scans reach: from c_lo up to
       * the C step 1 stops at, in runs of 8, and up to c_end for step 2. */
      double* firsts = m->first + (size_t)tb->first_row * stride;
      int32_t* filled = &row_hi[tb->first_row]; /* firsts[c_lo..*filled] hold values */
      if (!(rows & (1u << tb->first_row))) {
        *filled = c_lo - 1;
        rows |= 1u << tb->first_row;
      }
      if (bi < 0) { /* step 1: up to the best-ranked bound, which is evaluated */
        double tl = DBL_MAX, tf = 0.0;
        int32_t tc = 0;
        for (int32_t c = c_lo; c <= c_end[i]; c++) {
          if (tc > 0 && comp_min[c] + reduce >= tl) break; /* here and beyond: lb >= tl */
          const double comp = comp_us[c] + reduce;
          if (c > *filled) {
            const int32_t e = c_end[i] - c > 7 ? c + 7 : c_end[i];
            tw__first_terms(m, tb, *filled + 1, e, firsts + *filled + 1);
            *filled = e;
          }
          const double first = firsts[c];
          const double lb = first + reduce > comp ? first + reduce : comp;
          if (tc == 0 || lb < tl) tl = lb, tc = c, tf = first;
        }
        bl = tl, lc = tc, li = i, lkey = tb->key;
        bt = tw__eval(m, tb, tc, tf, DBL_MAX, 0, 0, &hint, 0.0);
        bc = tc, bi = i, bkey = tb->key;
        c_end[i] = tw__scan_end(comp_min, reduce, bt, bc, c_lo, c_hi, &slot_bt[tb->slot],
                                &slot_le[tb->slot], &slot_lt[tb->slot]);
      }
      /* Step 2: from the last C within bt down to the first whose first term exceeds it. */
      if (c_end[i] > *filled) {
        tw__first_terms(m, tb, *filled + 1, c_end[i], firsts + *filled + 1);
        *filled = c_end[i];
      }
      for (int32_t c = c_end[i]; c >= c_lo; c--) {
        const double first = firsts[c];
        if (first + reduce > bt) break;
        if (first + reduce == bt && c > bc) {
          /* A tie at a C above bc loses, and so does every C down to bc + 1 (their first
           * terms are no smaller): go on at bc. */
          c = bc + 1;
          continue;
        }
        const double comp = comp_us[c];
        const double lb = (first > comp ? first : comp) + reduce;
        if (pass == 0 && tw__better(lb, c, tb->key, bl, lc, lkey))
          bl = lb, lc = c, li = i, lkey = tb->key;
        if ((i == bi && c == bc) || !tw__better(lb, c, tb->key, bt, bc, bkey)) continue;
        if (n < TW__MAX_CANDS) {
          cand[n++] = (tw__cand){lb, first, c, i, tb->key, 0};
        } else { /* no room to order it: evaluate it now */
          const double t = tw__eval(m, tb, c, first, bt, 0, 0, NULL, 0.0);
          if (tw__better(t, c, tb->key, bt, bc, bkey)) bt = t, bc = c, bi = i, bkey = tb->key;
        }
      }
    }
    if (bi < 0) {
      *best_c = 0, *best_table = -1, *best_t = 0.0;
      return;
    }
    if (pass == 0 && li == bi && lc == bc && bt == bl) break; /* step 3 */
  }
  /* Step 4: the probes raise bounds; the candidates that can still win are evaluated, best-ranked
   * bound first. First lazily: the best-ranked candidate is probed, and evaluated at once while
   * the probes leave its bound as it was (it still ranks first: probes only raise the others);
   * most decisions end here, most candidates unprobed. At the first bound the probes raise (or
   * rule out), every candidate left is probed and they are evaluated in order: each lazy step
   * costs a scan of the list, so that is cheaper once the probes start to tell candidates apart,
   * and from the start where the list is long (TW__LAZY_MAX). */
  int done = li == bi && lc == bc && bt == bl;
  int32_t j = -1; /* the candidate whose raised bound ended the lazy phase */
  while (!done && n > 0 && n <= TW__LAZY_MAX) {
    j = 0;
    for (int32_t q = 1; q < n; q++)
      if (tw__better(cand[q].lb, cand[q].c, cand[q].key, cand[j].lb, cand[j].c, cand[j].key)) j = q;
    tw__cand x = cand[j];
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) { /* the best-ranked cannot win: none can */
      done = 1;
      break;
    }
    const double lb = x.lb;
    tw__probe(m, &x, hint, reduce, bt, bc, bkey);
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) {
      cand[j] = cand[--n], j = -1;
      break;
    }
    if (x.lb != lb) {
      cand[j] = x;
      break;
    }
    cand[j] = cand[--n], j = -1;
    /* A candidate that loses ties stops at a term that reaches bt. */
    const int strict = !tw__better(bt, x.c, x.key, bt, bc, bkey);
    const double t = tw__eval(m, &m->t[x.table], x.c, x.first, bt, strict, x.wave, NULL, 0.0);
    if (tw__better(t, x.c, x.key, bt, bc, bkey)) {
      bt = t, bc = x.c, bi = x.table, bkey = x.key;
      done = t == lb; /* T at its bound, which ranked first: no other can win */
    }
  }
  int32_t k = 0;
  for (int32_t q = 0; q < n && !done; q++) {
    tw__cand x = cand[q];
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) continue;
    if (q != j) {
      tw__probe(m, &x, hint, reduce, bt, bc, bkey);
      if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) continue;
    }
    cand[k++] = x;
  }
  n = done ? 0 : k;
  while (n > 0) {
    j = 0;
    for (int32_t q = 1; q < n; q++)
      if (tw__better(cand[q].lb, cand[q].c, cand[q].key, cand[j].lb, cand[j].c, cand[j].key)) j = q;
    const tw__cand x = cand[j];
    /* The best-ranked bound left cannot win: none can. */
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) break;
    cand[j] = cand[--n];
    /* A candidate that loses ties stops at a term that reaches bt. */
    const int strict = !tw__better(bt, x.c, x.key, bt, bc, bkey);
    const double t = tw__eval(m, &m->t[x.table], x.c, x.first, bt, strict, x.wave, NULL, 0.0);
    if (tw__better(t, x.c, x.key, bt, bc, bkey)) bt = t, bc = x.c, bi = x.table, bkey = x.key;
  }
  *best_c = bc;
  *best_table = bi;
  *best_t = bt;
}

/* The plateau walk (plan.h, TW_MODEL_PLATEAU): from the best candidate (*c, *t) up through the
 * C of its table whose T stays within the band and whose next C still has the best's wave count
 * (a wave step's place is uncertain by a C: ranks differ by a few tiles), so the walk never takes
 * the last C before a step. *c and *t become the last one reached. Each step stops at its first
 * term above the band; the compute end's suffix minimum ends the walk where no larger C can be
 * within it. */
static void tw__plateau_end(const tw__model_tables* m, int32_t table, int32_t c_hi, int32_t* c,
                            double* t) {
  const tw__seg_table* tb = &m->t[table];
  const double* comp_min = m->comp_min + (size_t)tb->slot * ((size_t)m->hw.c_max + 1);
  const double reduce = m->reduce_us;
  const double band = *t * (1.0 + TW_MODEL_PLATEAU);
  const int32_t waves = m->waves[*c];
  int32_t top = *c;
  double top_first = 0.0;
  for (int32_t x = *c + 1; x < c_hi && m->waves[x + 1] == waves; x++) {
    if (comp_min[x] + reduce > band) break; /* here and beyond */
    double first;
    tw__first_terms(m, tb, x, x, &first);
    if (first + reduce > band) break;
    /* Whether T <= band, not T itself: the maximum starts at the band (less the reduction), so
     * that the terms below it are skipped. */
    if (tw__eval(m, tb, x, first, band, 0, 0, NULL, (band - reduce) * TW__SKIP_SLACK) > band) break;
    top = x, top_first = first;
  }
  if (top != *c) {
    *c = top;
    *t = tw__eval(m, tb, top, top_first, DBL_MAX, 0, 0, NULL, 0.0);
  }
}

/* The table of (schedule, mgb), or -1. */
static int32_t tw__find_table(const tw__model_tables* m, int32_t schedule, int32_t mgb) {
  for (int32_t i = 0; i < m->ntables; i++)
    if (m->t[i].mgb == mgb && m->sched[m->t[i].slot] == schedule) return i;
  return -1;
}

tw_status tw__model_traffic(const struct tw_plan* plan, double* bytes, double* refetch) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(bytes);
  TW_CHECK_NULL(refetch);
  /* A run is a maximal stretch of consecutive bands of one expert in the schedule: its tiles
   * run at about the same time, so each weight column slice is fetched from device memory once
   * and served from L2 to the run's other bands. Between two runs of an expert under
   * remote-first lie the other experts' remote bands (tens of MB of weights each at the
   * shapes this matters for), so the second run fetches the weights again. */
  const int32_t e_count = plan->local_experts > 0 ? plan->local_experts : 1;
  unsigned char* seen = calloc((size_t)e_count, 1);
  if (seen == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "model: out of host memory");
  int64_t runs = 0, repeats = 0;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    const int32_t e = plan->bands[i].expert;
    if (i > 0 && e == plan->bands[i - 1].expert) continue;
    runs++;
    if (e < 0 || e >= e_count) {
      free(seen);
      return tw__fail(TW_ERR_INTERNAL, "model: band %d names expert %d of %d", i, e, e_count);
    }
    repeats += seen[e];
    seen[e] = 1;
  }
  free(seen);
  /* Weights that stay in L2 come from device memory once per expert, whatever the runs. */
  if (tw__weights_stay_in_l2(plan)) runs -= repeats, repeats = 0;
  const double h = (double)plan->problem.hidden, k = (double)plan->problem.ffn;
  *bytes = 2.0 * ((double)runs * h * k + (double)plan->rows * (k + h)); /* bf16 / fp16 */
  *refetch = 2.0 * (double)repeats * h * k;
  return TW_SUCCESS;
}

/* The schedule-dependent constants of slot `slot` for the plan's current order. */
static tw_status tw__model_slot(tw__model_tables* m, const struct tw_plan* plan, int32_t slot) {
  const tw_hardware* hw = &m->hw;
  const size_t stride = (size_t)hw->c_max + 1;
  const double tau = m->tau_comp_us;
  double bytes = 0.0, refetch = 0.0;
  TW_TRY(tw__model_traffic(plan, &bytes, &refetch));
  const double mem_us = bytes / (hw->mem_gbps * 1e3);
  /* The part of a second read of an expert's weights the GEMM does not hide under its compute
   * (a measured fraction, refetch_exposure), spread over the waves like the traffic. */
  const double exposed_us = hw->refetch_exposure * refetch / (hw->mem_gbps * 1e3);
  m->sched[slot] = plan->schedule;
  m->gemm_us[slot] =
      tw__compute_end(plan->num_tiles, hw->occ_comp * hw->sm_count, tau, mem_us, exposed_us, NULL);
  double* tau_us = m->tau_us + (size_t)slot * stride;
  double* inv_tau = m->inv_tau + (size_t)slot * stride;
  double* comp_us = m->comp_us + (size_t)slot * stride;
  double* comp_min = m->comp_min + (size_t)slot * stride;
  for (int32_t c = 1; c <= hw->c_max; c++) {
    comp_us[c] = tw__compute_end(plan->num_tiles, m->prod[c], tau, mem_us, exposed_us, &tau_us[c]);
    inv_tau[c] = 1.0 / tau_us[c];
  }
  /* The compute end is not monotone in C: a last wave that gains tiles as P shrinks carries
   * more of the traffic while the full waves carry less (m-bert at 1024 tokens: 256 tiles, the
   * GEMM alone measured 109 us at P 124 and 100 us at P 100, three waves each). The search
   * bounds every larger C by the suffix minimum. */
  comp_min[hw->c_max] = comp_us[hw->c_max];
  for (int32_t c = hw->c_max - 1; c >= 1; c--)
    comp_min[c] = comp_us[c] < comp_min[c + 1] ? comp_us[c] : comp_min[c + 1];
  return TW_SUCCESS;
}

/* Whether table a's bound is >= table b's at every C, bit for bit: the same first-term inputs
 * (segment count, band count, bytes; hence the same arithmetic) with a per-wave time and a
 * compute end no smaller at any C. Rounding is monotone, so the sums and maxima keep the
 * order. */
static int tw__bounds_dominated(const tw__model_tables* m, const tw__seg_table* a,
                                const tw__seg_table* b) {
  if (a->nseg != b->nseg || a->total_bytes != b->total_bytes ||
      (a->nseg > 0 && a->seg[0].suffix_bands != b->seg[0].suffix_bands))
    return 0;
  const size_t stride = (size_t)m->hw.c_max + 1;
  const double* ta = m->tau_us + (size_t)a->slot * stride;
  const double* tb = m->tau_us + (size_t)b->slot * stride;
  const double* ca = m->comp_us + (size_t)a->slot * stride;
  const double* cb = m->comp_us + (size_t)b->slot * stride;
  for (int32_t c = 1; c <= m->hw.c_max; c++)
    if (ta[c] < tb[c] || ca[c] < cb[c]) return 0;
  return 1;
}

/* Gives each table of an earlier slot the later slot's table of the same mgb as twin when its
 * bounds are dominated by it and it loses ties to it (tw__solve searches later tables first),
 * and its row of first terms: shared by the tables of a slot whose first-term inputs are the
 * same (then the values are, bit for bit). */
static void tw__find_twins(tw__model_tables* m) {
  for (int32_t i = 0; i < m->ntables; i++) {
    tw__seg_table* a = &m->t[i];
    a->twin = -1;
    for (int32_t j = i + 1; j < m->ntables && a->twin < 0; j++) {
      const tw__seg_table* b = &m->t[j];
      if (b->mgb == a->mgb && b->slot != a->slot && b->key > a->key &&
          tw__bounds_dominated(m, a, b))
        a->twin = j;
    }
    const tw__seg_table* r = NULL; /* the slot's first table */
    for (int32_t j = 0; j < m->ntables && r == NULL; j++)
      if (m->t[j].slot == a->slot) r = &m->t[j];
    const int same = (a->nseg > 0) == (r->nseg > 0) &&
                     (a->nseg == 0 || (a->total_bytes == r->total_bytes &&
                                       a->seg[0].suffix_bands == r->seg[0].suffix_bands));
    a->first_row = same ? a->slot : TW__MAX_SCHED + i;
  }
}

/* The reduce dataflow's weighted reduction at mem_gbps. The owner reads each of its (token, k)
 * rows (received or local) and writes each token. Its local rows: every row of its local bands,
 * and in a band that sends its first rows to another rank, the rows of its own after them (the
 * band a remote group shares with the local group; elsewhere those rows are padding). */
static double tw__reduce_us(const struct tw_plan* plan) {
  const int64_t top_k = plan->problem.top_k;
  int64_t own_rows = plan->recv_rows;
  for (int32_t b = 0; b < plan->num_bands; b++) {
    const tw_band* bd = &plan->bands[b];
    if (bd->dest == plan->rank) {
      own_rows += bd->valid_rows;
      continue;
    }
    for (int32_t r = bd->row0 + bd->valid_rows; r < bd->row0 + bd->rows; r++)
      own_rows += plan->row_src[r].owner == plan->rank;
  }
  const double row_bytes = 2.0 * (double)plan->problem.hidden;
  return (double)(own_rows + own_rows / top_k) * row_bytes / (plan->hardware.mem_gbps * 1e3);
}

/* Builds the per-plan constants and, for each schedule of `scheds` (the plan's bands and tiles
 * reordered for each), one table per candidate mgb (rebuilding the plan's segments for each).
 * Leaves the plan in the last schedule's order with the segments of its last table. */
static tw_status tw__model_prepare(struct tw_plan* plan, int32_t explicit_mgb,
                                   const int32_t* scheds, int32_t nsched) {
  tw__model_free(plan);
  tw__model_tables* m = calloc(1, sizeof *m);
  if (m == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "model: out of host memory");
  plan->model_tables = m;
  m->hw = plan->hardware;
  if (plan->dataflow == TW_DATAFLOW_ADD) {
    /* The consumer adds rows instead of storing them: measured at these shares of the store's
     * rates (run 39, 2 x H200, rows of 8 and 16 KB: 40-42 against 44-50 GB/s per CTA, 302-312
     * against 336-351 at the NVLink plateau). */
    m->hw.link_cta_gbps *= TW__ADD_CTA_SHARE;
    m->hw.link_peak_gbps *= TW__ADD_PEAK_SHARE;
    /* One bulk add per row: short rows are bound by the adds' rate, not the bytes (the SM's
     * bulk-copy unit; TW_ADD_ROW_FLOOR_US a row per CTA, plan.h). */
    const double row_bytes = 2.0 * (double)plan->problem.hidden;
    if (row_bytes / (TW_ADD_ROW_FLOOR_US * 1e3) < m->hw.link_cta_gbps)
      m->hw.link_cta_gbps = row_bytes / (TW_ADD_ROW_FLOOR_US * 1e3);
  }
  const int in_l2 = tw__weights_stay_in_l2(plan);
  const double k = (double)plan->problem.ffn;
  const double tflops = m->hw.tile_tflops * (plan->tm < 128 ? m->hw.tile_m64_share : 1.0);
  const double c = 2.0 * (double)plan->tm * (double)plan->tn * k / (tflops * 1e6);
  const double f = m->hw.tile_floor_us * (double)plan->tn / 128.0; /* the floor grows with tn */
  m->tau_comp_us = sqrt(sqrt(c * c * c * c + f * f * f * f)) + m->hw.tile_overhead_us;
  m->seq_reduce_us = tw__reduce_us(plan);
  /* The add dataflow has no reduction: its rows were added where they were computed or sent (the
   * producer's local adds cost it 0.5-3% alone, run 40; not modelled). */
  m->reduce_us = plan->dataflow == TW_DATAFLOW_ADD ? 0.0 : m->seq_reduce_us;
  const tw_hardware* hw = &m->hw;
  const size_t stride = (size_t)hw->c_max + 1;
  m->prod = malloc(stride * sizeof *m->prod);
  m->tau_us = malloc((size_t)nsched * stride * sizeof *m->tau_us);
  m->inv_tau = malloc((size_t)nsched * stride * sizeof *m->inv_tau);
  m->comp_us = malloc((size_t)nsched * stride * sizeof *m->comp_us);
  m->comp_min = malloc((size_t)nsched * stride * sizeof *m->comp_min);
  m->waves = malloc(stride * sizeof *m->waves);
  m->inv_cta = malloc(stride * sizeof *m->inv_cta);
  m->lat_c = malloc(stride * sizeof *m->lat_c);
  m->first = malloc((size_t)(TW__MAX_SCHED + TW__MAX_TABLES) * stride * sizeof *m->first);
  if (!m->prod || !m->tau_us || !m->inv_tau || !m->comp_us || !m->comp_min || !m->waves ||
      !m->inv_cta || !m->lat_c || !m->first)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "model: out of host memory");
  for (int32_t c = 1; c <= hw->c_max; c++) {
    m->prod[c] = tw__producers(hw, c);
    m->waves[c] = (int32_t)tw__ceil_div(plan->num_tiles, m->prod[c]);
    m->inv_cta[c] = 1.0 / ((double)c * hw->link_cta_gbps * 1e3);
    m->lat_c[c] = hw->link_latency_us / (double)c;
  }
  m->inv_peak = 1.0 / (hw->link_peak_gbps * 1e3);

  int32_t mgbs[TW__NUM_MGB_CANDIDATES + 1], n = 0;
  int explicit_new = explicit_mgb > 0;
  for (int32_t i = 0; i < TW__NUM_MGB_CANDIDATES; i++) {
    mgbs[n++] = tw__mgb_candidates[i];
    if (tw__mgb_candidates[i] == explicit_mgb) explicit_new = 0;
  }
  if (explicit_new) mgbs[n++] = explicit_mgb;
  int32_t* band_last =
      malloc((size_t)(plan->num_bands > 0 ? plan->num_bands : 1) * sizeof *band_last);
  if (band_last == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "model: out of host memory");
  tw_status st = TW_SUCCESS;
  for (int32_t slot = 0; slot < nsched && st == TW_SUCCESS; slot++) {
    if (plan->schedule != scheds[slot]) st = tw__plan_set_schedule(plan, scheds[slot]);
    if (st != TW_SUCCESS) break;
    st = tw__model_slot(m, plan, slot);
    if (st != TW_SUCCESS) break;
    for (int32_t b = 0; b < plan->num_bands; b++) band_last[b] = -1;
    for (int32_t i = 0; i < plan->num_tiles && st == TW_SUCCESS; i++) {
      const int32_t b = plan->tiles[i].band;
      if (b < 0 || b >= plan->num_bands)
        st = tw__fail(TW_ERR_INTERNAL, "model: tile %d names band %d of %d", i, b, plan->num_bands);
      else
        band_last[b] = i; /* ascending i: the last write is the largest index */
    }
    for (int32_t i = 0; i < n && st == TW_SUCCESS; i++) {
      st = tw__plan_build_segments(plan, mgbs[i]);
      if (st == TW_SUCCESS) {
        tw__seg_table* tb = &m->t[m->ntables++]; /* counted even if partly built: freed later */
        st = tw__table_build(plan, band_last, tb);
        tb->slot = slot;
        tb->key = tw__table_key(mgbs[i], scheds[slot], in_l2);
      }
    }
  }
  free(band_last);
  if (st == TW_SUCCESS) tw__find_twins(m);
  return st;
}

tw_status tw__model_choose(struct tw_plan* plan, const tw_plan_config* config) {
  TW_CHECK_NULL(plan);
  TW_TRY(tw__hardware_resolve(config ? config->hardware : NULL, &plan->hardware));
  const tw_hardware* hw = &plan->hardware;
  int32_t fixed_c = 0, fixed_mgb = 0, use_model = 1;
  /* Only the fields before `schedule` are read: an old-size config ends there. */
  if (config != NULL) {
    if (config->comm_ctas < 0 || config->comm_ctas > hw->c_max)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "comm_ctas = %d; give 0 (chosen by the model) or 1..%d (c_max of the "
                      "hardware description)",
                      config->comm_ctas, hw->c_max);
    if (config->coalesce < 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "coalesce = %d; give 0 (chosen by the model) or a band count >= 1",
                      config->coalesce);
    if (config->use_model != 0 && config->use_model != 1)
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "use_model = %d; give 1 (model) or 0 (defaults)",
                      config->use_model);
    fixed_c = config->comm_ctas;
    fixed_mgb = config->coalesce;
    use_model = config->use_model;
  }
  if (!use_model) {
    /* The selector is off: fixed defaults, unless the caller fixed a value. */
    if (fixed_c == 0) fixed_c = TW_DEFAULT_COMM_CTAS < hw->c_max ? TW_DEFAULT_COMM_CTAS : hw->c_max;
    if (fixed_mgb == 0) fixed_mgb = TW_DEFAULT_COALESCE;
  }
  /* Schedules to compare: the one asked for, or both. Expert-major is tabulated last, so the
   * search starts from its tables: it wins most plans (it reads each expert's weights once), and
   * where it is compute-bound its first evaluated T equals its bound, which remote-first's
   * larger compute end cannot undercut, so the search ends at step 3 (on the full oracle
   * matrix's plans, rank 0, with tile groups: 1.7 exact evaluations and 25 bounds per decision
   * on average). The planner builds an AUTO plan in remote-first order, so that
   * tabulating reorders it once. */
  const int32_t req = plan->schedule_request;
  if (req != TW_SCHEDULE_AUTO && req != TW_SCHEDULE_REMOTE_FIRST && req != TW_SCHEDULE_EXPERT_MAJOR)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "model: schedule request %d; give 0, 1 or 2", req);
  int32_t scheds[TW__MAX_SCHED], nsched = 1;
  if (req != TW_SCHEDULE_AUTO) {
    scheds[0] = req;
  } else if (!use_model) {
    scheds[0] = TW_DEFAULT_SCHEDULE;
  } else {
    scheds[0] = TW_SCHEDULE_REMOTE_FIRST;
    scheds[1] = TW_SCHEDULE_EXPERT_MAJOR;
    nsched = 2;
  }
  TW_TRY(tw__model_prepare(plan, fixed_mgb, scheds, nsched));
  const tw__model_tables* m = (const tw__model_tables*)plan->model_tables;

  /* The decision proper: tables are built, nothing is allocated from here on. */
  const double t0 = tw__now_seconds();
  /* With mgb free only the mgb 1 tables are searched: the answer is the same as over every
   * candidate mgb. A coarser segment is a run of consecutive one-band segments, ready when the
   * last of them is, and serves the suffix from its first band, so each band's term at mgb 1 is
   * at most its segment's term at mgb > 1 (the suffix sums are exact integers in doubles, the
   * same bits at the same band); hence T(C, mgb) >= T(C, 1) exactly, and mgb 1 wins the ties
   * (tw__table_key). Searching the six tables of both schedules instead of two cost 1.9x the
   * instructions on the full oracle matrix once tile groups made the first-term bounds loose. */
  unsigned use = 0;
  for (int32_t i = 0; i < m->ntables; i++)
    if (m->t[i].mgb == (fixed_mgb ? fixed_mgb : 1)) use |= 1u << i;
  const int32_t c_lo = fixed_c ? fixed_c : 1, c_hi = fixed_c ? fixed_c : hw->c_max;
  int32_t c = 0, ti = -1;
  double t = 0.0;
  tw__solve(m, c_lo, c_hi, use, &c, &ti, &t);
  if (c > 0 && ti >= 0 && !fixed_c) tw__plateau_end(m, ti, c_hi, &c, &t);
  const double t1 = tw__now_seconds();

  if (c == 0 || ti < 0)
    return tw__fail(TW_ERR_INTERNAL, "model: no candidate (C in %d..%d) was evaluated", c_lo, c_hi);
  const int32_t mgb = m->t[ti].mgb, slot = m->t[ti].slot;
  if (plan->schedule != m->sched[slot]) TW_TRY(tw__plan_set_schedule(plan, m->sched[slot]));
  if (plan->coalesce != mgb || plan->num_segments == 0) TW_TRY(tw__plan_build_segments(plan, mgb));
  plan->comm_ctas = c;
  plan->predicted_us = t;
  plan->gemm_us = m->gemm_us[slot];
  /* The sequential baseline (cuBLAS, NCCL, the reduction) is the same whatever dataflow ours runs:
   * the store's plateau and the reduction of the reduce dataflow. */
  plan->sequential_us =
      m->gemm_us[slot] + (double)plan->send_bytes / (hw->link_peak_gbps * 1e3) + m->seq_reduce_us;
  plan->solve_us = 1e6 * (t1 - t0);
  return TW_SUCCESS;
}

tw_status tw__model_predict(const struct tw_plan* plan, int32_t schedule, int32_t comm_ctas,
                            int32_t coalesce, double* t_us) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(t_us);
  const tw__model_tables* m = (const tw__model_tables*)plan->model_tables;
  if (m == NULL)
    return tw__fail(TW_ERR_STATE,
                    "tw_plan_predict: the plan has no model tables; pass a plan from "
                    "tw_plan_create");
  if (comm_ctas < 1 || comm_ctas > m->hw.c_max)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw_plan_predict: comm_ctas = %d; give 1..%d",
                    comm_ctas, m->hw.c_max);
  const int32_t i = tw__find_table(m, schedule, coalesce);
  if (i < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_plan_predict: coalesce = %d, schedule %d; the plan has predictions for "
                    "1, 2, 4 and its own coalesce (%d), for its schedule (%d) and, when the model "
                    "chose it, the other one",
                    coalesce, schedule, plan->coalesce, plan->schedule);
  double first[1];
  tw__first_terms(m, &m->t[i], comm_ctas, comm_ctas, first);
  *t_us = tw__eval(m, &m->t[i], comm_ctas, first[0], DBL_MAX, 0, 0, NULL, 0.0);
  return TW_SUCCESS;
}

tw_status tw_plan_predict(tw_plan_t plan, int32_t comm_ctas, int32_t coalesce, double* t_us) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  return tw__model_predict(plan, plan->schedule, comm_ctas, coalesce, t_us);
}
