/*
 * model_eval.c: the analytical model of the expert-parallel return path in its fast form, what one
 * candidate (C consumer CTAs, mgb bands per middle segment, a schedule) costs; model.c builds the
 * tables it reads and model_search.c searches them. It generalises the first paper's wave
 * recurrence (model_tp.c) from splits to segments:
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
 * transfers, so more CTAs stop paying off and the SMs they take from the GEMM decide (the
 * earlier forms and their regret: dev/NOTES.md, "Moved from code comments").
 *
 * The memory term: the producer cannot finish before it has moved its bytes through device
 * memory, each expert's hidden x ffn weights once per run of consecutive bands of that expert in
 * the schedule (2 runs under remote-first for an expert with remote and local rows, 1 under
 * expert-major but for its last two experts), the input rows and the output rows once; the traffic
 * is spread over the tiles, so a wave lasts the longer of its tiles' compute and their share of the
 * traffic, and a last wave with few tiles is short (tw__model_traffic, tw__compute_end,
 * docs/model.md). Spread evenly over the waves instead, a partial last wave would take a full
 * wave's share (dev/NOTES.md, "Moved from code comments"). A second read of an expert's weights
 * costs more than the roofline says, also where both schedules are compute-bound, so
 * refetch_exposure x those bytes / mem_gbps is added to the waves (hardware.c).
 * Where all local experts' weights fit in half the L2 (l2_mib), a second run finds them there: each
 * expert counts once, nothing is exposed, and remote-first wins the ties (tw__table_key). With the
 * schedule left to the model, both schedules' tables are built and searched together, and the plan
 * is rebuilt in the winner's order.
 *
 * Evaluating F segment by segment costs O(S) per candidate; model_search.c's header says how the
 * tables make it one term per wave.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "model_internal.h"
#include "plan.h"

/* The producer's waves at P CTAs: the end of the last wave (the compute end), and in *wave_us how
 * long a full wave takes. Each wave lasts the longer of its tiles' compute and its share of the
 * traffic, spread over the tiles (m_tile = mem_us / tiles per tile): a full wave of P tiles moves
 * P m_tile, the last wave only its own r tiles' share, so it can be short while still costing
 * one tile's compute. The part of a second weight read that the GEMM does not hide
 * (exposed_us) is spread over the waves. With one wave the two times are the same value, bit
 * for bit (r = tiles = min(P, tiles)); without tiles a wave is one tile's compute and the end 0.
 * wave_us may be NULL. */
double tw__compute_end(int64_t tiles, int32_t p, double tau, double mem_us, double exposed_us,
                       double* wave_us) {
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
tw_status tw__table_build(const struct tw_plan* plan, const int32_t* band_last, tw__seg_table* tb) {
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

/* For C in [c_lo, c_hi]: out[C - c_lo] = tau(C) + Q(0), the term of wave 1 taken with every segment
 * (the fast form's term for s = 0, w = 1; 0 when there is no segment). The one copy of this
 * arithmetic that the decision and tw_plan_predict share. */
TW__NOINLINE void tw__first_terms(const tw__model_tables* m, const tw__seg_table* tb, int32_t c_lo,
                                  int32_t c_hi, double* out) {
  if (tb->nseg == 0) {
    for (int32_t c = c_lo; c <= c_hi; c++) out[c - c_lo] = 0.0;
    return;
  }
  const double* tau = m->tau_us + (size_t)tb->slot * ((size_t)m->hw.c_max + 1);
  for (int32_t c = c_lo; c <= c_hi; c++)
    out[c - c_lo] = tau[c] + tw__service(tb, 0, m->lat_c[c], m->inv_cta[c], m->inv_peak);
}

/* The term of a wave that ends at `end`, taken from segment s on: end + Q(s). Out of line, so
 * that a probe of tw__solve and the same probe in tw__eval have the same bits whatever the
 * compiler fuses: tw__eval folds the probe into its maximum, so the probe is a lower bound of T
 * exactly. */
TW__NOINLINE double tw__wave_term(const tw__seg_table* tb, int32_t s, double end, double lat_c,
                                  double inv_cta_c, double inv_peak) {
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
TW__NOINLINE double tw__eval(const tw__model_tables* m, const tw__seg_table* tb, int32_t c,
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

/* Whether the weights of all local experts fit in half the L2 cache, so that a second run of an
 * expert finds them there: neither schedule then reads any expert's weights from device memory
 * more than once (the other half: the activations and outputs streaming through). */
int tw__weights_stay_in_l2(const struct tw_plan* plan) {
  const double w = 2.0 * (double)(plan->local_experts > 0 ? plan->local_experts : 1) *
                   (double)plan->problem.hidden * (double)plan->problem.ffn; /* bf16 / fp16 */
  return w <= 0.5 * plan->hardware.l2_mib * 1048576.0;
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
