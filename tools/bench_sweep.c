/*
 * bench_sweep.c: `tilewave sweep`: every (C, mgb) of one point against the model's choice, and
 * `sweep --oracle`: the same over a workload matrix (harness/oracle.c) with the regret summary,
 * the confirmation timing and the head-to-head against the best fixed (C, mgb).
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "bench.h"
#include "bench_common.h"
#include "bench_stats.h"
#include "checks.h"
#include "cli.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "progress.h"
#include "runtime.h"
#include "spawn.h"
#include "tilewave.h"

/* ---- sweep ----------------------------------------------------------------------------------- */

/* The coalescing factors a sweep times at every C. */
static const int twb_sweep_mgbs[3] = {1, 2, 4};

/* One sweep point, measured. Policy 0 is the sequential baseline (the correctness reference;
 * timed only in the single-point sweep), policies 1.. are `ours` at every (C, mgb), index
 * 1 + m * cmax + (C - 1) for mgbs[m], then the model's (C, mgb) with the other schedule (other_i),
 * then the model's choice where it lies outside that grid (the last policy). */
typedef struct twb_sweep_result {
  int np, cmax;
  int mgbs[3];
  twb_policy* pols;     /* (np) */
  tw__bench_stats* sts; /* (np) medians etc. of the max-over-ranks samples */
  double* pred;         /* (np) the model's prediction (rank 0's plan); 0 for seq */
  float* err;           /* (np) normwise error vs the sequential baseline, max over ranks */
  float maxerr;
  int best, model_i; /* the oracle's and the model's policy */
  int other_i; /* the model's C and mgb with the other schedule (joins the oracle, never chosen) */
  double t_other;
  int model_c_lo, model_c_hi, model_mgb_lo, model_mgb_hi; /* the model's choices over ranks */
  tw_plan_summary ms;    /* the model's choice on rank 0 (default config) */
  double predicted_call; /* the largest of the ranks' own predictions (twb_predicted_call) */
  double t_oracle, t_model, regret;
  /* --confirm: the model's cell, the other schedule's and the three fastest cells timed again,
   * together, `confirm` rounds: the oracle is then the fastest of those, so that a cell that was
   * fast by chance in the first timing (the minimum over ~100 noisy medians) does not set it.
   * confirmed = 0 when not done. */
  int confirmed;
  double t_oracle_c, t_model_c, regret_c;
  /* The model inside tw_plan_create, `--solve-reps` plans with the launch's config: the plan's
   * own solve_us and the wall time of the whole call, median and p99, max over ranks. */
  double solve_med, solve_p99, create_med, create_p99;
  int solve_reps;
} twb_sweep_result;

static void twb_sweep_result_free(twb_sweep_result* r) {
  free(r->pols), free(r->sts), free(r->pred), free(r->err);
  memset(r, 0, sizeof *r);
}

/* Times this rank's planning as a real launch does it (same problem, routing and default config,
 * so the model runs): `reps` calls of tw_plan_create, each timed whole around the call and by the
 * plan's own solve_us (the decision proper, measured inside the library). Every rank times its
 * own plan at the same time; the result is the worst rank's. */
static tw_status twb_time_solve(twb_rank* s, int reps, twb_sweep_result* r) {
  double* v = (double*)malloc(sizeof(double) * 2 * (size_t)reps);
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
  tw_status st = TW_SUCCESS;
  const tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  for (int i = 0; i < reps && st == TW_SUCCESS; i++) {
    tw_plan_t plan = NULL;
    tw_plan_summary sum;
    const double t0 = tw__now_seconds();
    st = tw_plan_create(&s->problem, s->routing, s->rank, &cfg, &plan);
    const double t1 = tw__now_seconds();
    if (st == TW_SUCCESS) st = tw_plan_summary_get(plan, &sum);
    tw_plan_destroy(plan);
    if (st == TW_SUCCESS) {
      v[i] = sum.solve_us;
      v[reps + i] = 1e6 * (t1 - t0);
    }
  }
  if (st == TW_SUCCESS) {
    float q[4];
    q[0] = (float)tw__stats_percentile(v, reps, 0.5);
    q[1] = (float)tw__stats_percentile(v, reps, 0.99);
    q[2] = (float)tw__stats_percentile(v + reps, reps, 0.5);
    q[3] = (float)tw__stats_percentile(v + reps, reps, 0.99);
    st = twb_max_over_ranks(s, q, 4);
    r->solve_med = q[0], r->solve_p99 = q[1], r->create_med = q[2], r->create_p99 = q[3];
    r->solve_reps = reps;
  }
  free(v);
  return st;
}

/* The confirmation timing of a measured point (twb_sweep_result.confirmed). The cells are chosen
 * from medians that are the same on every rank (samples are reduced over ranks), so every rank
 * times the same collective policies. */
static tw_status twb_sweep_confirm(twb_rank* s, const twb_opts* o, twb_sweep_result* r) {
  enum { kTop = 3, kMax = kTop + 2 };
  int idx[kMax], n = 0;
  idx[n++] = r->model_i; /* never other_i: that policy is only ever the other schedule */
  idx[n++] = r->other_i;
  for (int t = 0; t < kTop; t++) { /* the fastest cells not chosen yet, fastest first */
    int best = -1;
    for (int i = 1; i < r->np; i++) {
      int taken = 0;
      for (int j = 0; j < n; j++) taken |= idx[j] == i;
      if (!taken && (best < 0 || r->sts[i].median < r->sts[best].median)) best = i;
    }
    if (best >= 0) idx[n++] = best;
  }
  twb_policy pols[kMax];
  for (int j = 0; j < n; j++) pols[j] = r->pols[idx[j]];
  twb_opts oc = *o;
  oc.iters = o->confirm;
  float* samples = (float*)calloc((size_t)n * (size_t)oc.iters, sizeof(float));
  if (samples == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
  int last_set = 0;
  tw_status st = twb_time(s, &oc, pols, n, samples, &last_set);
  if (st == TW_SUCCESS) st = tw_context_check(s->ctx);
  if (st == TW_SUCCESS) {
    double t_min = INFINITY;
    for (int j = 0; j < n; j++) {
      tw__bench_stats bs;
      tw__bench_stats_of(samples + (size_t)j * oc.iters, oc.iters, &bs);
      if (j == 0) r->t_model_c = bs.median;
      if (bs.median < t_min) t_min = bs.median;
    }
    r->t_oracle_c = t_min;
    r->regret_c = tw__oracle_regret(r->t_model_c, r->t_oracle_c);
    r->confirmed = 1;
  }
  free(samples);
  return st;
}

/* Measures one point: every (C, mgb) of the grid and the model's choice, each checked once against
 * the sequential baseline, then timed (ABBA rounds, max over ranks); the model's planning time.
 * Every rank ends with the same result (samples and errors are reduced over ranks). */
static tw_status twb_sweep_measure(twb_rank* s, const twb_opts* o, const twb_point* pt,
                                   twb_sweep_result* r) {
  memset(r, 0, sizeof *r);
  memcpy(r->mgbs, twb_sweep_mgbs, sizeof r->mgbs);
  r->solve_med = r->solve_p99 = r->create_med = r->create_p99 = -1; /* not measured */
  int nm = 3;
  TW_TRY(twb_setup(s, o, pt, r->mgbs, nm));
  /* The model's choice: the plan a real launch makes (default config). */
  tw_plan_t model_plan = NULL;
  tw_plan_config mc = TW_PLAN_CONFIG_INIT;
  TW_TRY(tw_plan_create(&s->problem, s->routing, s->rank, &mc, &model_plan));
  tw_plan_summary ms;
  tw_status st = tw_plan_summary_get(model_plan, &ms);
  tw_plan_destroy(model_plan);
  TW_TRY(st);
  r->ms = ms;
  TW_TRY(twb_predicted_call(&s->problem, s->routing, s->rank, ms.predicted_us, &r->predicted_call));
  int model_mgb_index = -1;
  for (int i = 0; i < nm; i++)
    if (r->mgbs[i] == ms.coalesce) model_mgb_index = i;
  if (model_mgb_index < 0) {
    /* One more device plan for the model's factor. */
    tw_plan_config c2 = TW_PLAN_CONFIG_INIT;
    c2.coalesce = ms.coalesce;
    TW_TRY(tw_plan_create(&s->problem, s->routing, s->rank, &c2, &s->mplans[nm]));
    s->mgbs[nm] = ms.coalesce;
    TW_TRY(tw_device_plan_create(s->ctx, &s->dplans[nm]));
    TW_TRY(tw_device_plan_upload(s->dplans[nm], s->mplans[nm], s->routing, s->stream));
    model_mgb_index = nm++;
    s->ndplans = nm;
  }
  /* The model's C and mgb with the schedule it did not choose, so that the oracle covers the
   * schedule decision too (one more device plan, one more policy on every rank). */
  {
    tw_plan_config c2 = TW_PLAN_CONFIG_INIT;
    c2.comm_ctas = ms.comm_ctas;
    c2.coalesce = ms.coalesce;
    c2.schedule = ms.schedule == TW_SCHEDULE_EXPERT_MAJOR ? TW_SCHEDULE_REMOTE_FIRST
                                                          : TW_SCHEDULE_EXPERT_MAJOR;
    TW_TRY(tw_plan_create(&s->problem, s->routing, s->rank, &c2, &s->mplans[nm]));
    s->mgbs[nm] = ms.coalesce;
    TW_TRY(tw_device_plan_create(s->ctx, &s->dplans[nm]));
    TW_TRY(tw_device_plan_upload(s->dplans[nm], s->mplans[nm], s->routing, s->stream));
  }
  const int other_dplan = nm++;
  s->ndplans = nm;
  tw_context_info info;
  TW_TRY(tw_context_info_get(s->ctx, &info));
  const int cmax = o->c_max < info.max_comm_ctas ? o->c_max : info.max_comm_ctas;
  r->cmax = cmax;
  /* Each rank's plan chooses for itself, and a real launch runs every rank at its own choice.
   * Where all ranks chose the same (C, mgb) inside the grid, that grid cell is the launch; else
   * one more policy runs every rank at its own choice (the policy count must agree on all ranks:
   * every policy is collective). */
  float agree[5] = {(float)ms.comm_ctas, -(float)ms.comm_ctas, (float)ms.coalesce,
                    -(float)ms.coalesce, ms.comm_ctas <= cmax && model_mgb_index < 3 ? 0.f : 1.f};
  TW_TRY(twb_max_over_ranks(s, agree, 5));
  r->model_c_lo = (int)-agree[1], r->model_c_hi = (int)agree[0];
  r->model_mgb_lo = (int)-agree[3], r->model_mgb_hi = (int)agree[2];
  const int model_own =
      agree[4] > 0 || r->model_c_lo != r->model_c_hi || r->model_mgb_lo != r->model_mgb_hi;

  /* Policies: seq (reference), every (C, mgb), the other schedule at the model's (C, mgb), and
   * the model's own choices where needed. */
  const int ncfg = cmax * 3 + 1 + (model_own ? 1 : 0);
  const int np = 1 + ncfg;
  r->np = np;
  r->pols = (twb_policy*)calloc((size_t)np, sizeof(twb_policy));
  r->err = (float*)calloc((size_t)np, sizeof(float));
  r->sts = (tw__bench_stats*)calloc((size_t)np, sizeof(tw__bench_stats));
  r->pred = (double*)calloc((size_t)np, sizeof(double));
  float* samples = (float*)calloc((size_t)np * (size_t)o->iters, sizeof(float));
  if (!r->pols || !samples || !r->err || !r->sts || !r->pred) {
    free(samples);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
  }
  twb_policy* pols = r->pols;
  float* err = r->err;
  pols[0].kind = TWB_SEQ;
  pols[0].out = TWB_OUT_SEQ;
  snprintf(pols[0].name, sizeof pols[0].name, "seq");
  int k = 1;
  for (int m = 0; m < 3; m++)
    for (int c = 1; c <= cmax; c++, k++) {
      pols[k].kind = TWB_OURS;
      pols[k].c = c;
      pols[k].dplan = m;
      pols[k].out = TWB_OUT_OURS;
      snprintf(pols[k].name, sizeof pols[k].name, "C%d_mgb%d", c, r->mgbs[m]);
    }
  pols[k].kind = TWB_OURS;
  pols[k].c = ms.comm_ctas;
  pols[k].dplan = other_dplan;
  pols[k].out = TWB_OUT_OURS;
  snprintf(pols[k].name, sizeof pols[k].name, "other_schedule");
  r->other_i = k++;
  if (model_own) {
    pols[k].kind = TWB_OURS;
    pols[k].c = ms.comm_ctas;
    pols[k].dplan = model_mgb_index;
    pols[k].out = TWB_OUT_OURS;
    snprintf(pols[k].name, sizeof pols[k].name, "model");
    k++;
  }
  for (int i = 1; i < np && st == TW_SUCCESS; i++)
    st = tw_plan_predict(s->mplans[pols[i].dplan], pols[i].c, s->mgbs[pols[i].dplan], &r->pred[i]);

  /* Correctness of every configuration against the sequential baseline (once each). */
  if (st == TW_SUCCESS) {
    st = tw__fill_bf16(s->out[TWB_OUT_SEQ], s->out_elems, TWB_POISON, s->stream);
    if (st == TW_SUCCESS) st = twb_barrier(s);
    if (st == TW_SUCCESS) st = twb_run(s, &pols[0], 0, s->stream);
  }
  for (int i = 1; i < np && st == TW_SUCCESS; i++) {
    st = tw__fill_bf16(s->out[TWB_OUT_OURS], s->out_elems, TWB_POISON, s->stream);
    if (st == TW_SUCCESS) st = twb_barrier(s);
    if (st == TW_SUCCESS) st = twb_run_checked(s, &pols[i], 0, s->stream);
    double rel = 0;
    if (st == TW_SUCCESS) st = tw_context_check(s->ctx);
    if (st == TW_SUCCESS)
      st = tw__baseline_rel_diff(s->out[TWB_OUT_OURS], s->out[TWB_OUT_SEQ], s->out_elems,
                                 s->scratch, s->stream, &rel);
    err[i] = isfinite(rel) ? (float)rel : INFINITY;
  }
  if (st == TW_SUCCESS) st = twb_max_over_ranks(s, err, (size_t)np);
  r->maxerr = 0.f;
  for (int i = 1; i < np; i++)
    if (err[i] > r->maxerr || !(err[i] == err[i])) r->maxerr = err[i] == err[i] ? err[i] : INFINITY;
  /* The matrix times only our configurations (the baseline served as the reference above). */
  const int first = o->oracle ? 1 : 0;
  int last_set = 0;
  if (st == TW_SUCCESS)
    st = twb_time(s, o, pols + first, np - first, samples + (size_t)first * o->iters, &last_set);
  if (st == TW_SUCCESS) st = tw_context_check(s->ctx);
  if (st == TW_SUCCESS && o->solve_reps > 0) st = twb_time_solve(s, o->solve_reps, r);
  if (st == TW_SUCCESS) {
    for (int i = first; i < np; i++)
      tw__bench_stats_of(samples + (size_t)i * o->iters, o->iters, &r->sts[i]);
    r->best = 1;
    r->model_i = model_own ? np - 1 : -1;
    for (int i = 1; i < np; i++) {
      if (r->sts[i].median < r->sts[r->best].median) r->best = i;
      if (!model_own && i != r->other_i && pols[i].c == ms.comm_ctas &&
          s->mgbs[pols[i].dplan] == ms.coalesce)
        r->model_i = i;
    }
    r->t_other = r->sts[r->other_i].median;
    r->t_oracle = r->sts[r->best].median;
    r->t_model = r->model_i > 0 ? r->sts[r->model_i].median : NAN;
    r->regret = tw__oracle_regret(r->t_model, r->t_oracle);
  }
  free(samples);
  if (st == TW_SUCCESS && o->oracle && o->confirm > 0 && r->model_i > 0)
    st = twb_sweep_confirm(s, o, r);
  return st;
}

static void twb_range_str(char* buf, size_t n, int lo, int hi) {
  if (lo == hi)
    snprintf(buf, n, "%d", lo);
  else
    snprintf(buf, n, "%d-%d", lo, hi);
}

static void twb_sweep_json_configs(FILE* js, const twb_rank* s, const twb_sweep_result* r) {
  for (int i = 1; i < r->np; i++)
    fprintf(js,
            "%s{\"name\": \"%s\", \"comm_ctas\": %d, \"coalesce\": %d, \"median_us\": %.2f, "
            "\"p10_us\": %.2f, \"p90_us\": %.2f, \"min_us\": %.2f, \"samples\": %d, "
            "\"predicted_us\": %.2f, \"rel_err\": %.3e}",
            i > 1 ? ",\n  " : "", r->pols[i].name, r->pols[i].c, s->mgbs[r->pols[i].dplan],
            r->sts[i].median, r->sts[i].p10, r->sts[i].p90, r->sts[i].min, r->sts[i].n, r->pred[i],
            r->err[i] < 1e30f ? (double)r->err[i] : 1e30);
}

/* `tilewave sweep` of one point: the measured table with the model's predictions, the oracle, the
 * model's choice and its regret (rank 0 prints). */
tw_status twb_sweep_point(twb_rank* s, const twb_opts* o, const twb_point* pt) {
  twb_sweep_result res;
  tw_status st = twb_sweep_measure(s, o, pt, &res);
  const twb_sweep_result* r = &res;
  const twb_policy* pols = r->pols;
  const tw__bench_stats* sts = r->sts;
  const tw_plan_summary ms = r->ms;
  const int best = r->best, cmax = r->cmax;
  const int* mgbs = r->mgbs;
  if (st == TW_SUCCESS && s->rank == 0) {
    FILE* js = o->json ? stdout : s->json_out;
    if (js) {
      char jt[32], jr[32], je[32]; /* numbers that may be NaN or infinite: null in the JSON */
      fprintf(js,
              "{\"command\": \"sweep\", \"world_size\": %d, \"tokens_per_rank\": %d, \"ffn\": %d, "
              "\"hidden\": %d, \"experts\": %d, \"top_k\": %d, \"router\": \"%s\", \"seq_us\": "
              "%.2f,\n \"oracle\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %.2f},\n "
              "\"model\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %s, \"predicted_us\": "
              "%.2f, \"solve_us\": %.3f},\n \"regret\": %s, \"max_rel_err\": %s, \"pass\": "
              "%s,\n \"solve_us\": {\"median\": %.3f, \"p99\": %.3f}, \"plan_create_us\": "
              "{\"median\": %.1f, \"p99\": %.1f}, \"solve_reps\": %d,\n \"configs\": [",
              s->world, pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
              tw__cli_router_name(pt->router), sts[0].median, pols[best].c,
              s->mgbs[pols[best].dplan], r->t_oracle, ms.comm_ctas, ms.coalesce,
              tw__json_fmt(jt, sizeof jt, "%.2f", r->t_model), ms.predicted_us, ms.solve_us,
              tw__json_fmt(jr, sizeof jr, "%.4f", r->regret),
              tw__json_fmt(je, sizeof je, "%.3e", (double)r->maxerr),
              r->maxerr <= o->tol ? "true" : "false", r->solve_med, r->solve_p99, r->create_med,
              r->create_p99, r->solve_reps);
      twb_sweep_json_configs(js, s, r);
      fprintf(js, "]}\n");
    }
    if (!o->json) {
      printf(
          "sweep: tokens/rank %d, K %d, N %d, E %d, top-%d, %s, %d ranks; sequential baseline %.1f "
          "us\n\n",
          pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router),
          s->world, sts[0].median);
      printf("| C | mgb=%d us | mgb=%d us | mgb=%d us | predicted mgb=%d/%d/%d us |\n", mgbs[0],
             mgbs[1], mgbs[2], mgbs[0], mgbs[1], mgbs[2]);
      printf("| ---: | ---: | ---: | ---: | ---: |\n");
      for (int c = 1; c <= cmax; c++) {
        const int i0 = 1 + (c - 1), i1 = 1 + cmax + (c - 1), i2 = 1 + 2 * cmax + (c - 1);
        printf("| %d | %.1f%s | %.1f%s | %.1f%s | %.1f / %.1f / %.1f |\n", c, sts[i0].median,
               i0 == best ? " *" : "", sts[i1].median, i1 == best ? " *" : "", sts[i2].median,
               i2 == best ? " *" : "", r->pred[i0], r->pred[i1], r->pred[i2]);
      }
      printf("\noracle: C=%d mgb=%d %.1f us (speedup over sequential %.2fx)\n", pols[best].c,
             s->mgbs[pols[best].dplan], r->t_oracle, sts[0].median / r->t_oracle);
      printf("model:  C=%d mgb=%d %s measured %.1f us, predicted %.1f us, decided in %.3f us\n",
             ms.comm_ctas, ms.coalesce, tw__cli_schedule_name(ms.schedule), r->t_model,
             ms.predicted_us, ms.solve_us);
      printf("        the other schedule at the same C and mgb: %.1f us\n", r->t_other);
      if (r->model_c_lo != r->model_c_hi || r->model_mgb_lo != r->model_mgb_hi)
        printf("        (the ranks chose C %d..%d, mgb %d..%d; measured with each at its own)\n",
               r->model_c_lo, r->model_c_hi, r->model_mgb_lo, r->model_mgb_hi);
      printf("regret: %.2f%%   correctness: max rel err %.2e vs sequential (%s)\n", 100 * r->regret,
             (double)r->maxerr, r->maxerr <= o->tol ? "pass" : "FAIL");
      if (r->solve_reps > 0)
        printf(
            "planning (%d x tw_plan_create, default config, worst rank): the model's decision "
            "median %.3f us, p99 %.3f us; the whole call median %.1f us, p99 %.1f us\n",
            r->solve_reps, r->solve_med, r->solve_p99, r->create_med, r->create_p99);
    }
    fflush(stdout);
  }
  if (st == TW_SUCCESS && r->maxerr > o->tol)
    st = tw__fail(TW_ERR_INTERNAL, "sweep: an output differs from the sequential baseline by %.3e",
                  (double)r->maxerr);
  twb_sweep_result_free(&res);
  return st;
}

/* ---- sweep --oracle: a workload matrix ------------------------------------------------------- */

/* One point (all ranks): setup, the model's plan as a launch makes it against the plan at the fixed
 * mgb run at the fixed C, both outputs compared once, then timed. */
static tw_status twb_versus_point(twb_rank* s, const twb_opts* o, const twb_point* pt, int fc,
                                  int fm, twb_versus* v) {
  memset(v, 0, sizeof *v);
  v->ratio = v->lo = v->hi = 1.0;
  TW_TRY(twb_setup(s, o, pt, &fm, 1)); /* dplans[0]: the plan at the fixed mgb */
  tw_plan_summary ms;
  TW_TRY(tw_plan_summary_get(s->plans[s->rank], &ms));
  TW_TRY(tw_device_plan_create(s->ctx, &s->dplans[1])); /* the launch's own plan */
  TW_TRY(tw_device_plan_upload(s->dplans[1], s->plans[s->rank], s->routing, s->stream));
  s->ndplans = 2;
  float differs = ms.comm_ctas != fc || ms.coalesce != fm ? 1.f : 0.f;
  TW_TRY(twb_max_over_ranks(s, &differs, 1));
  v->identical = differs == 0.f;
  if (v->identical) return TW_SUCCESS;

  twb_policy pols[2];
  memset(pols, 0, sizeof pols);
  pols[0].kind = pols[1].kind = TWB_OURS;
  pols[0].c = 0; /* the plan's own C: each rank its own choice, as a launch runs it */
  pols[0].dplan = 1;
  pols[0].out = TWB_OUT_OURS;
  snprintf(pols[0].name, sizeof pols[0].name, "model");
  pols[1].c = fc;
  pols[1].dplan = 0;
  pols[1].out = TWB_OUT_SCRATCH;
  snprintf(pols[1].name, sizeof pols[1].name, "C%d_mgb%d", fc, fm);
  for (int i = 0; i < 2; i++) {
    TW_TRY(tw__fill_bf16(s->out[pols[i].out], s->out_elems, TWB_POISON, s->stream));
    TW_TRY(twb_barrier(s));
    TW_TRY(twb_run_checked(s, &pols[i], 0, s->stream));
  }
  TW_TRY(tw_context_check(s->ctx));
  double rel = 0;
  TW_TRY(tw__baseline_rel_diff(s->out[TWB_OUT_SCRATCH], s->out[TWB_OUT_OURS], s->out_elems,
                               s->scratch, s->stream, &rel));
  v->maxerr = isfinite(rel) ? (float)rel : INFINITY;
  TW_TRY(twb_max_over_ranks(s, &v->maxerr, 1));

  twb_opts ov = *o;
  ov.iters = o->versus;
  const int n = ov.iters;
  float* samples = (float*)calloc(2 * (size_t)n, sizeof(float));
  double* ratio = (double*)calloc((size_t)n, sizeof(double));
  tw_status st =
      samples && ratio ? TW_SUCCESS : tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
  int last_set = 0;
  if (st == TW_SUCCESS) st = twb_time(s, &ov, pols, 2, samples, &last_set);
  if (st == TW_SUCCESS) st = tw_context_check(s->ctx);
  if (st == TW_SUCCESS) {
    tw__bench_stats sm, sf;
    tw__bench_stats_of(samples, n, &sm);
    tw__bench_stats_of(samples + n, n, &sf);
    v->model_us = sm.median, v->fixed_us = sf.median;
    for (int i = 0; i < n; i++) ratio[i] = (double)samples[i] / (double)samples[n + i];
    tw__oracle_median_ci(ratio, n, 0.95, &v->ratio, &v->lo, &v->hi);
  }
  free(samples);
  free(ratio);
  return st;
}

/* The pass over the matrix (all ranks; rank 0 keeps the results in v[0..npoints)): the best fixed
 * (C, mgb) comes from rank 0's summary of the matrix. Returns the points done in *done. */
tw_status twb_versus_pass(twb_rank* s, const twb_opts* o, const twb_point* pts, int npoints,
                          const twb_oracle_acc* acc, twb_versus* v, int* fixed, int* done) {
  *done = 0;
  float f[2] = {0.f, 0.f}; /* rank 0's (C, mgb); the others add zeros to the max */
  if (s->rank == 0 && acc->done == npoints) {
    tw__oracle_summary sum;
    if (tw__oracle_summarize(acc->t, acc->done, acc->ncand, acc->t_model, acc->t_other, &sum) ==
            0 &&
        sum.fixed >= 0)
      f[0] = (float)(sum.fixed % o->c_max + 1), f[1] = (float)twb_sweep_mgbs[sum.fixed / o->c_max];
  }
  TW_TRY(twb_max_over_ranks(s, f, 2));
  fixed[0] = (int)f[0], fixed[1] = (int)f[1];
  if (fixed[0] < 1) return TW_SUCCESS; /* no fixed cell measured at every point */
  twb_progress pr;
  twb_progress_begin(&pr, "sweep --versus-fixed", "point", npoints);
  tw_status st = TW_SUCCESS;
  for (int i = 0; i < npoints && st == TW_SUCCESS; i++) {
    twb_versus one;
    st = twb_versus_point(s, o, &pts[i], fixed[0], fixed[1], &one);
    twb_rank_free(s);
    if (st == TW_SUCCESS && one.maxerr > o->tol)
      st = tw__fail(TW_ERR_INTERNAL,
                    "sweep --versus-fixed: point %d: the model's output differs from fixed (%d, "
                    "%d)'s by %.3e",
                    pts[i].index, fixed[0], fixed[1], (double)one.maxerr);
    if (st != TW_SUCCESS) break;
    if (s->rank == 0) {
      v[i] = one;
      if (one.identical)
        twb_progress_end(&pr, i, "#%d %s: the model chose (%d, %d) itself", pts[i].index,
                         pts[i].name, fixed[0], fixed[1]);
      else
        twb_progress_end(&pr, i,
                         "#%d %s: model %.1f us, fixed (%d, %d) %.1f us, model/fixed %.4f [%.4f, "
                         "%.4f]",
                         pts[i].index, pts[i].name, one.model_us, fixed[0], fixed[1], one.fixed_us,
                         one.ratio, one.lo, one.hi);
    }
    *done = i + 1;
  }
  return st;
}

static void twb_oracle_header(void) {
  printf(
      "| # | workload | tokens/rank | K | N | E | top-k | router | schedule | model C | model mgb "
      "| model us | predicted us (rank 0 / slowest rank) | other schedule us | oracle C | oracle "
      "mgb | oracle us | regret "
      "| solve us (median / p99) | tw_plan_create us (median / p99) | max rel err |\n");
  printf(
      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  fflush(stdout);
}

/* Rank 0, before the first point: the JSON's opening and the table's header. */
void twb_oracle_begin(const twb_opts* o, int nranks, FILE* js) {
  if (js)
    fprintf(js,
            "{\"command\": \"sweep_oracle\", \"matrix\": \"%s\", \"world_size\": %d, "
            "\"iters\": %d, \"warmup\": %d, \"c_max\": %d, \"solve_reps\": %d, \"delay_us\": "
            "%d, \"tol\": %.3e, \"seed\": %llu,\n \"points\": [\n",
            o->matrix, nranks, o->iters, o->warmup, o->c_max, o->solve_reps, o->delay_us, o->tol,
            (unsigned long long)o->seed);
  if (!o->json) twb_oracle_header();
}

/* Rank 0: records a measured point for the summary, prints its row (stdout), JSON and progress
 * (stderr). t0: when the point started. */
static void twb_oracle_report(const twb_rank* s, const twb_opts* o, const twb_point* pt, int index,
                              int npoints, twb_oracle_acc* acc, FILE* js, const twb_sweep_result* r,
                              int pass, double t0) {
  const tw_plan_summary* ms = &r->ms;
  const twb_policy* b = &r->pols[r->best];
  double* row = acc->t + (size_t)index * acc->ncand;
  for (int j = 0; j < acc->ncand; j++) row[j] = NAN;
  for (int i = 1; i < 1 + 3 * r->cmax; i++) { /* the grid, not the model's own policy */
    const int m = r->pols[i].dplan;
    if (m < 3 && r->pols[i].c <= o->c_max) row[m * o->c_max + r->pols[i].c - 1] = r->sts[i].median;
  }
  acc->t_model[index] = r->t_model;
  acc->t_other[index] = r->t_other;
  acc->regret_c[index] = r->confirmed ? r->regret_c : NAN;
  char confirmed[48] = "";
  if (r->confirmed) snprintf(confirmed, sizeof confirmed, " (confirmed %.2f%%)", 100 * r->regret_c);
  acc->solve_med[index] = r->solve_med, acc->solve_p99[index] = r->solve_p99;
  acc->create_med[index] = r->create_med, acc->create_p99[index] = r->create_p99;
  acc->done = index + 1;
  if (!pass) acc->failed++;
  /* The ranks' choices: "12" when all agree, "11-13" when they differ. */
  char mc[24], mm[24];
  twb_range_str(mc, sizeof mc, r->model_c_lo, r->model_c_hi);
  twb_range_str(mm, sizeof mm, r->model_mgb_lo, r->model_mgb_hi);
  if (!o->json) {
    printf(
        "| %d | %s | %d | %d | %d | %d | %d | %s | %s | %s | %s | %.1f | %.1f / %.1f | %.1f | %d | "
        "%d | %.1f | %.2f%%%s | %.3f / %.3f | %.1f / %.1f | %.2e%s |\n",
        pt->index, pt->name, pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
        tw__cli_router_name(pt->router), tw__cli_schedule_name(ms->schedule), mc, mm, r->t_model,
        ms->predicted_us, r->predicted_call, r->t_other, b->c, s->mgbs[b->dplan], r->t_oracle,
        100 * r->regret, confirmed, r->solve_med, r->solve_p99, r->create_med, r->create_p99,
        (double)r->maxerr, pass ? "" : " FAIL");
    fflush(stdout);
  }
  if (js) {
    char jt[32], jo[32], jr[32]; /* numbers that may be NaN: null in the JSON */
    fprintf(js,
            "%s  {\"index\": %d, \"workload\": \"%s\", \"tokens_per_rank\": %d, \"ffn\": %d, "
            "\"hidden\": %d, \"experts\": %d, \"top_k\": %d, \"router\": \"%s\",\n   "
            "\"oracle\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %.2f},\n   \"model\": "
            "{\"comm_ctas\": %d, \"coalesce\": %d, \"comm_ctas_min\": %d, \"comm_ctas_max\": "
            "%d, \"coalesce_min\": %d, \"coalesce_max\": %d, \"us\": %s, \"predicted_us\": "
            "%.2f, \"predicted_call_us\": %.2f, \"sequential_predicted_us\": %.2f, "
            "\"schedule\": \"%s\", "
            "\"other_schedule_us\": %s},\n   \"regret\": %s, \"solve_us\": "
            "{\"median\": %.3f, \"p99\": %.3f}, \"plan_create_us\": {\"median\": %.1f, \"p99\": "
            "%.1f}, \"solve_reps\": %d, \"max_rel_err\": %.3e, \"pass\": %s, \"seconds\": %.1f,"
            "\n   \"configs\": [",
            index ? ",\n" : "", pt->index, pt->name, pt->tokens, pt->ffn, pt->hidden, pt->experts,
            pt->topk, tw__cli_router_name(pt->router), b->c, s->mgbs[b->dplan], r->t_oracle,
            ms->comm_ctas, ms->coalesce, r->model_c_lo, r->model_c_hi, r->model_mgb_lo,
            r->model_mgb_hi, tw__json_fmt(jt, sizeof jt, "%.2f", r->t_model), ms->predicted_us,
            r->predicted_call, ms->sequential_us, tw__cli_schedule_name(ms->schedule),
            tw__json_fmt(jo, sizeof jo, "%.2f", r->t_other),
            tw__json_fmt(jr, sizeof jr, "%.5f", r->regret), r->solve_med, r->solve_p99,
            r->create_med, r->create_p99, r->solve_reps,
            r->maxerr < 1e30f ? (double)r->maxerr : 1e30, pass ? "true" : "false",
            tw__now_seconds() - t0);
    twb_sweep_json_configs(js, s, r);
    fprintf(js, "]");
    if (r->confirmed)
      fprintf(js,
              ",\n   \"confirm\": {\"rounds\": %d, \"model_us\": %.2f, \"oracle_us\": %.2f, "
              "\"regret\": %.5f}",
              o->confirm, r->t_model_c, r->t_oracle_c, r->regret_c);
    fprintf(js, "}");
    fflush(js);
  }
  /* The pass's clock started with the oracle (acc->t_start), not with this point. */
  const twb_progress pr = {"oracle", "point", npoints, acc->t_start};
  twb_progress_end(&pr, index,
                   "#%d %s: model C=%s mgb=%s %.1f us, oracle C=%d mgb=%d %.1f us, regret "
                   "%.2f%%%s%s; %.1f s",
                   pt->index, pt->name, mc, mm, r->t_model, b->c, s->mgbs[b->dplan], r->t_oracle,
                   100 * r->regret, confirmed, pass ? "" : ", FAILED the check",
                   tw__now_seconds() - t0);
}

int twb_oracle_point(twb_rank* s, const twb_opts* o, const twb_point* pt, int index, int npoints,
                     twb_oracle_acc* acc, FILE* js, tw_status* status) {
  const double t0 = tw__now_seconds();
  twb_sweep_result res;
  tw_status st = twb_sweep_measure(s, o, pt, &res);
  const int pass = st == TW_SUCCESS && res.maxerr <= o->tol;
  if (st == TW_SUCCESS && s->rank == 0)
    twb_oracle_report(s, o, pt, index, npoints, acc, js, &res, pass, t0);
  twb_sweep_result_free(&res);
  *status = st;
  return pass;
}

/* The matrix's summary (rank 0): the model's mean and max regret, the best single fixed (C, mgb)
 * and how often the model loses to it, the planning time. Markdown on stdout, JSON to js. */
void twb_oracle_summary(const twb_opts* o, int world, const twb_point* pts,
                        const twb_oracle_acc* acc, const twb_versus* vs, int nvs, const int* vfixed,
                        FILE* js) {
  const int n = acc->done;
  tw__oracle_summary sum;
  memset(&sum, 0, sizeof sum);
  sum.fixed = -1;
  const int ok =
      n > 0 && tw__oracle_summarize(acc->t, n, acc->ncand, acc->t_model, acc->t_other, &sum) == 0;
  int fc = -1, fm = -1; /* the best fixed (C, mgb); -1: none */
  if (ok && sum.fixed >= 0) {
    fc = sum.fixed % o->c_max + 1;
    fm = twb_sweep_mgbs[sum.fixed / o->c_max];
  }
  /* Planning time over the matrix: the median and the worst of the per-point medians, the worst
   * per-point p99 (each already the worst rank's). */
  double* tmp = (double*)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  double sm = -1, smax = -1, sp99 = -1, cm = -1, cmaxv = -1, cp99 = -1; /* -1: not measured */
  if (tmp && n > 0 && o->solve_reps > 0) {
    memcpy(tmp, acc->solve_med, sizeof(double) * (size_t)n);
    sm = tw__stats_percentile(tmp, n, 0.5), smax = tmp[n - 1];
    memcpy(tmp, acc->solve_p99, sizeof(double) * (size_t)n);
    sp99 = tw__stats_percentile(tmp, n, 1.0);
    memcpy(tmp, acc->create_med, sizeof(double) * (size_t)n);
    cm = tw__stats_percentile(tmp, n, 0.5), cmaxv = tmp[n - 1];
    memcpy(tmp, acc->create_p99, sizeof(double) * (size_t)n);
    cp99 = tw__stats_percentile(tmp, n, 1.0);
  }
  free(tmp);
  const double slower_pct = n > 0 ? 100.0 * sum.model_slower / n : 0;
  /* The confirmation timing's regret (--confirm), over the points where it ran. */
  int cn = 0, cmax_i = -1;
  double csum = 0;
  for (int i = 0; i < n; i++) {
    const double x = acc->regret_c[i];
    if (!(x == x)) continue; /* NaN: not confirmed */
    cn++, csum += x;
    if (cmax_i < 0 || x > acc->regret_c[cmax_i]) cmax_i = i;
  }
  /* The head-to-head (--versus-fixed) over the points it reached. */
  int v_ident = 0, v_slower = 0, v_slower95 = 0, v_faster95 = 0;
  double v_logsum = 0;
  for (int i = 0; i < nvs; i++) {
    v_ident += vs[i].identical;
    v_slower += vs[i].ratio > 1.0;
    v_slower95 += vs[i].lo > 1.0;
    v_faster95 += vs[i].hi < 1.0;
    v_logsum += log(vs[i].ratio);
  }
  const double v_geo = nvs > 0 ? exp(v_logsum / nvs) : NAN;
  if (!o->json) {
    printf(
        "\nsweep --oracle --matrix %s: %d point(s), %d rank(s); every (C, mgb) with C 1..%d and "
        "mgb 1/2/4: median of %d timed round(s) after %d warm-up, each sample the max over "
        "ranks; %.0f s\n\n",
        o->matrix, n, world, o->c_max, o->iters, o->warmup, tw__now_seconds() - acc->t_start);
    printf("| summary | value | target (2 x H200) |\n| --- | ---: | --- |\n");
    if (ok) {
      printf("| model: mean regret | %.2f%% | <= 2%% |\n", 100 * sum.mean_regret);
      printf("| model: max regret | %.2f%% (point %d, %s) | <= 5%% |\n", 100 * sum.max_regret,
             pts[sum.max_regret_point].index, pts[sum.max_regret_point].name);
      if (cn > 0) {
        printf(
            "| model, confirmed (the model's, the other schedule's and the 3 fastest cells timed "
            "again, %d rounds; %d points): mean / max regret | %.2f%% / %.2f%% (point %d, %s) | "
            "|\n",
            o->confirm, cn, 100 * csum / cn, 100 * acc->regret_c[cmax_i], pts[cmax_i].index,
            pts[cmax_i].name);
      }
      if (sum.fixed >= 0) {
        printf("| best single fixed (C, mgb) over the matrix | (%d, %d) | |\n", fc, fm);
        printf("| fixed (%d, %d): mean regret | %.2f%% | |\n", fc, fm, 100 * sum.fixed_mean_regret);
        printf("| fixed (%d, %d): max regret | %.2f%% | |\n", fc, fm, 100 * sum.fixed_max_regret);
        printf(
            "| points where the model's choice is slower than fixed (%d, %d) | %d of %d (%.1f%%); "
            "%d by more than 1%% | <= 10%% |\n",
            fc, fm, sum.model_slower, n, slower_pct, sum.model_slower_1pct);
      } else {
        printf("| best single fixed (C, mgb) | none measured at every point | |\n");
      }
      if (nvs > 0) {
        printf(
            "| head to head with fixed (%d, %d), %d paired rounds per point (%d points): the model "
            "chose the fixed cell itself | %d | |\n",
            vfixed[0], vfixed[1], o->versus, nvs, v_ident);
        printf(
            "| head to head: the model slower (median of model / fixed > 1) | %d of %d (%.1f%%) | "
            "<= 10%% |\n",
            v_slower, nvs, 100.0 * v_slower / nvs);
        printf(
            "| head to head: the model slower / faster with 95%% confidence (the median's "
            "interval above / below 1) | %d / %d of %d | |\n",
            v_slower95, v_faster95, nvs);
        printf("| head to head: geometric mean of model / fixed | %.4f | |\n", v_geo);
      }
      printf(
          "| points where the other schedule at the model's (C, mgb) was faster | %d of %d; %d "
          "by more than 1%% | |\n",
          sum.other_faster, n, sum.other_faster_1pct);
    } else {
      printf("| model: regret | no point measured | |\n");
    }
    if (o->solve_reps > 0 && n > 0) {
      printf(
          "| the model's decision in tw_plan_create (%d plans per point, worst rank): median / "
          "max of the points' medians; max p99 | %.3f / %.3f us; %.3f us | median <= 1 us |\n",
          o->solve_reps, sm, smax, sp99);
      printf(
          "| the whole tw_plan_create: median / max of the points' medians; max p99 | %.1f / "
          "%.1f us; %.1f us | |\n",
          cm, cmaxv, cp99);
    }
    if (acc->failed)
      printf("\n%d point(s) FAILED the correctness check (max rel err above --tol %.1e)\n",
             acc->failed, o->tol);
    fflush(stdout);
  }
  if (js) {
    char jfm[32], jfx[32]; /* no fixed candidate measured everywhere: NaN, null in the JSON */
    fprintf(js,
            "\n ],\n \"summary\": {\"points\": %d, \"failed\": %d, \"mean_regret\": %.5f, "
            "\"max_regret\": %.5f, \"max_regret_point\": %d, \"fixed\": {\"comm_ctas\": %d, "
            "\"coalesce\": %d, \"mean_regret\": %s, \"max_regret\": %s}, \"model_slower\": %d, "
            "\"model_slower_1pct\": %d, \"other_schedule_faster\": %d, "
            "\"other_schedule_faster_1pct\": %d, \"solve_us\": {\"median_of_medians\": %.3f, "
            "\"max_median\": %.3f, \"max_p99\": %.3f}, \"plan_create_us\": {\"median_of_medians\": "
            "%.1f, \"max_median\": %.1f, \"max_p99\": %.1f}, \"confirmed\": {\"rounds\": %d, "
            "\"points\": %d, \"mean_regret\": %.5f, \"max_regret\": %.5f, \"max_regret_point\": "
            "%d}, \"seconds\": %.1f",
            n, acc->failed, ok ? sum.mean_regret : -1.0, ok ? sum.max_regret : -1.0,
            ok ? pts[sum.max_regret_point].index : 0, fc, fm,
            tw__json_fmt(jfm, sizeof jfm, "%.5f", sum.fixed_mean_regret),
            tw__json_fmt(jfx, sizeof jfx, "%.5f", sum.fixed_max_regret), sum.model_slower,
            sum.model_slower_1pct, sum.other_faster, sum.other_faster_1pct, sm, smax, sp99, cm,
            cmaxv, cp99, o->confirm, cn, cn > 0 ? csum / cn : -1.0,
            cn > 0 ? acc->regret_c[cmax_i] : -1.0, cn > 0 ? pts[cmax_i].index : 0,
            tw__now_seconds() - acc->t_start);
    if (nvs > 0) {
      fprintf(js,
              ",\n  \"versus_fixed\": {\"comm_ctas\": %d, \"coalesce\": %d, \"rounds\": %d, "
              "\"points\": %d, \"identical\": %d, \"slower\": %d, \"slower_95\": %d, "
              "\"faster_95\": %d, \"geomean_ratio\": %.5f,\n   \"per_point\": [",
              vfixed[0], vfixed[1], o->versus, nvs, v_ident, v_slower, v_slower95, v_faster95,
              v_geo);
      for (int i = 0; i < nvs; i++)
        fprintf(js,
                "%s{\"index\": %d, \"identical\": %s, \"model_us\": %.2f, \"fixed_us\": %.2f, "
                "\"ratio\": %.5f, \"lo\": %.5f, \"hi\": %.5f}",
                i ? ",\n    " : "", pts[i].index, vs[i].identical ? "true" : "false",
                vs[i].model_us, vs[i].fixed_us, vs[i].ratio, isfinite(vs[i].lo) ? vs[i].lo : 0.0,
                isfinite(vs[i].hi) ? vs[i].hi : 1e30);
      fprintf(js, "]}");
    }
    fprintf(js, "}}\n");
    fflush(js);
  }
}

/* `sweep --oracle --list`: the matrix and a rough time estimate, host only. Per point: rank 0's
 * plan (default config) gives the model's choice and its predicted time of every candidate; the
 * estimate is rounds (warm-up + timed + the correctness run) x (the sum of the predictions +
 * per sample the device delay and ~100 us of barrier and synchronisation), plus ~2 s of setup
 * (context, inputs) and the solve timing at this machine's planning speed. It is only as good as
 * the model's predictions and overheads (on 2 x H200 the full matrix took 282 s with 15 rounds,
 * under 60% of the estimate). */
int twb_oracle_list(const twb_opts* o, const twb_point* pts, int n) {
  const int world = o->ranks > 0 ? o->ranks : 2;
  printf(
      "sweep --oracle --matrix %s: %d points; estimate for %d ranks, --iters %d --warmup %d, "
      "C 1..%d x mgb 1/2/4, --solve-reps %d\n\n",
      o->matrix, n, world, o->iters, o->warmup, o->c_max, o->solve_reps);
  printf(
      "| # | workload | tokens/rank | K | N | E | top-k | router | model C | model mgb | "
      "predicted us (rank 0 / slowest rank) | estimated s |\n");
  printf("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n");
  double total = 0;
  for (int i = 0; i < n; i++) {
    const twb_point* pt = &pts[i];
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = world;
    p.hidden = pt->hidden, p.ffn = pt->ffn, p.experts = pt->experts, p.top_k = pt->topk;
    p.max_tokens = pt->tokens;
    p.tile_m = o->tile_m, p.tile_n = o->tile_n;
    tw_routing_t rt = NULL;
    tw_plan_t plan = NULL;
    const tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    tw_plan_summary ms;
    double t_create = 0, sum_pred = 0, call_pred = 0;
    tw_status st =
        tw_routing_generate(&p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed, &rt);
    if (st == TW_SUCCESS) {
      const double t0 = tw__now_seconds();
      st = tw_plan_create(&p, rt, 0, &cfg, &plan);
      t_create = tw__now_seconds() - t0;
    }
    if (st == TW_SUCCESS) st = tw_plan_summary_get(plan, &ms);
    if (st == TW_SUCCESS) st = twb_predicted_call(&p, rt, 0, ms.predicted_us, &call_pred);
    int ncand = 0;
    for (int m = 0; m < 3 && st == TW_SUCCESS; m++)
      for (int c = 1; c <= o->c_max && st == TW_SUCCESS; c++) {
        double t = 0;
        st = tw_plan_predict(plan, c, twb_sweep_mgbs[m], &t);
        sum_pred += t;
        ncand++;
      }
    /* The other schedule at the model's (C, mgb): about the model's own time. */
    if (st == TW_SUCCESS) sum_pred += ms.predicted_us, ncand++;
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tilewave sweep: point %d (%s): %s: %s\n", pt->index, pt->name,
              tw_status_string(st), tw_last_error());
      return 1;
    }
    const int rounds = o->warmup + o->iters + 1;
    /* One more launch of about the model's choice, with the delay and ~100 us around it. */
    const double launch_s = (call_pred + o->delay_us + 100.0) * 1e-6;
    /* --confirm: up to 5 cells near the best. */
    const double confirm_s = o->confirm * 5 * launch_s;
    /* --versus-fixed: a second setup (~0.1 s: run 13's pass took 12 s for 114 points) and two
     * launches per round. */
    const double versus_s = o->versus > 0 ? 0.1 + (o->warmup + o->versus) * 2 * launch_s : 0.0;
    const double est = rounds * (sum_pred + ncand * (o->delay_us + 100.0)) * 1e-6 + 2.0 +
                       o->solve_reps * t_create + confirm_s + versus_s;
    total += est;
    printf("| %d | %s | %d | %d | %d | %d | %d | %s | %d | %d | %.1f / %.1f | %.1f |\n", pt->index,
           pt->name, pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
           tw__cli_router_name(pt->router), ms.comm_ctas, ms.coalesce, ms.predicted_us, call_pred,
           est);
  }
  printf("\nestimated total: %.0f s (%.1f min), plus ~10 s to start the ranks\n", total,
         total / 60);
  return 0;
}
