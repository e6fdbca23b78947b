/*
 * model.c: the analytical resource manager for the expert-parallel return path.
 *
 * Before each launch it picks how many consumer CTAs (C) forward finished row bands and how many
 * bands a middle segment coalesces (mgb), from the plan's real schedule and segments, and, when
 * the caller leaves the schedule to it, which schedule (remote-first or expert-major) the plan
 * keeps: it tabulates the model of model_eval.c for the plan's schedules and candidate mgb
 * (tw__model_prepare), lets model_search.c decide, and leaves the plan in the winner's order with
 * its segments (tw__model_choose). It calls the planner's schedule.c and segments.c, never the
 * other way round.
 */
#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "model_internal.h"
#include "plan.h"

/* The add dataflow's consumer rates as shares of the store's (tw__model_prepare). */
#define TW__ADD_CTA_SHARE 0.89
#define TW__ADD_PEAK_SHARE 0.90

/* Candidate coalescing factors the model searches when the caller leaves coalesce = 0; mgb 1
 * last, so that its tables are the last of each schedule (the search starts from the last table,
 * and mgb 1 wins the ties: tw__table_key). */
static const int32_t tw__mgb_candidates[] = {4, 2, 1};
_Static_assert(sizeof tw__mgb_candidates / sizeof tw__mgb_candidates[0] == TW__NUM_MGB_CANDIDATES,
               "model_internal.h counts the candidates");

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

/* Tie rank of a table: the smaller mgb wins a tie, then a schedule. A coarser segment is never
 * ready earlier and its per-band costs are the same, so T(mgb) >= T(1) in the model: mgb > 1 can
 * only tie, and it measured slower (dev/NOTES.md section 11). Between schedules the model cannot
 * tell a tie apart: expert-major wins it, reading each expert's weights once but two (a second
 * read the model sees only in part: refetch_exposure), except where the weights stay in L2:
 * there remote-first wins it, its consumer ending before its producer and its reduction reading
 * the local rows while they are in L2, effects the model has no term for (dev/NOTES.md section
 * 10). */
static int32_t tw__table_key(int32_t mgb, int32_t schedule, int weights_in_l2) {
  const int32_t wins = weights_in_l2 ? TW_SCHEDULE_REMOTE_FIRST : TW_SCHEDULE_EXPERT_MAJOR;
  return -2 * mgb + (schedule == wins);
}

/* The table of (schedule, mgb), or -1. */
static int32_t tw__find_table(const tw__model_tables* m, int32_t schedule, int32_t mgb) {
  for (int32_t i = 0; i < m->ntables; i++)
    if (m->t[i].mgb == mgb && m->sched[m->t[i].slot] == schedule) return i;
  return -1;
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
    /* The consumer adds rows instead of storing them, at measured shares of the store's rates
     * per CTA and at the NVLink plateau (dev/NOTES.md, "Moved from code comments"). */
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
   * producer's local adds cost it a few percent, not modelled). */
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
  /* An SM budget is a GPU of that many SMs to the model: P = budget - C, and C leaves the
   * producer at least one SM. */
  const int32_t budget =
      config != NULL && config->size > offsetof(tw_plan_config, sm_budget) ? config->sm_budget : 0;
  if (budget != 0) {
    tw_hardware* h = &plan->hardware;
    if (budget < 2 || budget > h->sm_count)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "sm_budget = %d; give 0 (every SM) or 2..%d (the hardware's sm_count: one "
                      "producer and one consumer SM at least)",
                      budget, h->sm_count);
    h->sm_count = budget;
    const int32_t c_fit = (budget - 1) * h->occ_comm;
    if (h->c_max > c_fit) h->c_max = c_fit;
  }
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
  /* Nothing to send: the call launches no consumer (unless C was given) and the producer has
   * every SM; then, under the reduce dataflow, the reduction. */
  if (plan->num_remote_tiles == 0 && (config == NULL || config->comm_ctas == 0)) {
    plan->comm_ctas = 0;
    plan->predicted_us = m->gemm_us[slot] + m->reduce_us;
  }
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
