/*
 * plan_tp.c: the TP x EP description (tw_parallel_validate) and the plan of one rank's GEMM2 +
 * GatherRS (tw_tp_plan_create): its row layout, bands, split-major tile list, segments and
 * GatherRS tiles, the first paper's choice of C for the GatherRS (tw_tp_select) and, through
 * tw_plan_create, the EP part that takes reduced rows to their owners.
 *
 * The layout is built from EP plans rather than beside them: block q' of rank (g, q) is the EP
 * layout of EP rank g in the EP world of the owners with TP index q' (a routing view over those
 * owners' arrays, nothing copied), so the rows rank (g, q') reduces are exactly the GEMM2 output
 * its EP plan (block q') sends. tp = 1 is then the EP plan itself and ep = 1 the first paper's
 * operator (the reducer is the owner; the EP world of one rank sends nothing). The other blocks'
 * EP plans are built with the model off (only their layouts are used) and freed at once.
 * Cost: O(rows + tiles) plus tp EP layouts and one EP model run.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "plan_tp.h"

/* The producer's K slice: GEMM2's K (= ffn / tp) must be a multiple of it (sm90_gemm.cu). */
#define TW__TP_K_SLICE 64

/* Lists the tp in 1..TW_MAX_TP that divide the world and give ffn / tp a multiple of the K slice,
 * for messages. */
static void tw__tp_choices(const tw_problem* p, char* buf, size_t n) {
  size_t k = 0;
  buf[0] = '\0';
  for (int32_t tp = 1; tp <= TW_MAX_TP && k < n; tp++)
    if (p->world_size % tp == 0 && p->ffn % (TW__TP_K_SLICE * tp) == 0)
      k += (size_t)snprintf(buf + k, n - k, "%s%d", k ? ", " : "", tp);
  if (buf[0] == '\0') snprintf(buf, n, "none");
}

/* Checks problem and parallel and fills `out` with the resolved description (plan_tp.h). */
tw_status tw__parallel_resolve(const tw_problem* problem, const tw_parallel* parallel,
                               tw_parallel* out) {
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(parallel);
  TW_TRY(tw__check_header("tw_parallel", parallel->size, sizeof(tw_parallel), parallel->magic,
                          TW_PARALLEL_MAGIC, parallel->version));
  TW_TRY(tw__check_header("tw_problem", problem->size, sizeof(tw_problem), problem->magic,
                          TW_PROBLEM_MAGIC, problem->version));
  tw_parallel r = *parallel;
  const int32_t W = problem->world_size;
  if (r.tp < 1)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw_parallel.tp = %d; give the TP ranks per EP group, 1..%d (TW_MAX_TP)", r.tp,
                    TW_MAX_TP);
  if (r.tp > TW_MAX_TP)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_parallel.tp = %d: a TP group reads its peers' partial sums over NVLink, so "
                    "it must fit one NVLink domain (at most %d ranks, TW_MAX_TP); use tp <= %d "
                    "and more EP groups",
                    r.tp, TW_MAX_TP, TW_MAX_TP);
  if (W < 1 || W > TW_MAX_TP * TW_MAX_RANKS)
    return tw__fail(TW_ERR_INVALID_SIZE, "world_size (%d) must be tp x ep, 1..%d", W,
                    TW_MAX_TP * TW_MAX_RANKS);
  if (r.ep == 0) {
    if (W % r.tp != 0)
      return tw__fail(TW_ERR_INVALID_SIZE,
                      "world_size %d is not a multiple of tp %d; the world is tp x ep ranks: use "
                      "a tp that divides it or set world_size = tp x ep",
                      W, r.tp);
    r.ep = W / r.tp;
  }
  if (r.ep < 1 || r.ep > TW_MAX_RANKS)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw_parallel.ep = %d; give the EP groups, 1..%d (TW_MAX_RANKS), or 0 for "
                    "world_size / tp",
                    r.ep, TW_MAX_RANKS);
  if ((int64_t)r.tp * r.ep != W)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tp %d x ep %d = %d ranks but world_size is %d; set world_size to tp x ep "
                    "(or ep to 0: world_size / tp)",
                    r.tp, r.ep, r.tp * r.ep, W);
  if (problem->experts >= 1 && problem->experts % r.ep != 0)
    return tw__fail(TW_ERR_INDIVISIBLE,
                    "experts (%d) is not divisible by ep (%d); each EP group holds experts / ep "
                    "experts: use an ep that divides the expert count",
                    problem->experts, r.ep);
  /* Everything else as for an EP problem over the ep groups. */
  tw_problem pep = *problem;
  pep.world_size = r.ep;
  TW_TRY(tw_problem_validate(&pep));
  if (problem->ffn % (TW__TP_K_SLICE * r.tp) != 0) {
    char ok[64];
    tw__tp_choices(problem, ok, sizeof ok);
    return tw__fail(TW_ERR_ALIGNMENT,
                    "ffn (%d) / tp (%d) is not a multiple of %d: each rank's F slice is GEMM2's K, "
                    "which the producer reads in %d-wide slices; use tp in {%s} for this "
                    "problem, or pad ffn to a multiple of %d",
                    problem->ffn, r.tp, TW__TP_K_SLICE, TW__TP_K_SLICE, ok, TW__TP_K_SLICE * r.tp);
  }
  /* A TP rank holds tp blocks, each at most an EP rank's worst case: bound their sum by int32. */
  const int64_t tm = tw__resolve_tile_m(problem);
  const int64_t assignments = (int64_t)problem->max_tokens * problem->top_k;
  const int64_t block_worst = ((int64_t)r.ep + 1) * assignments +
                              (int64_t)(problem->experts / r.ep) * ((int64_t)r.ep - 1) * (tm - 1);
  if (block_worst * r.tp > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "worst-case rows per TP rank (%lld for tp %d, ep %d, max_tokens %d) exceed "
                    "2^31-1; lower max_tokens and split the batch into several calls",
                    (long long)(block_worst * r.tp), r.tp, r.ep, problem->max_tokens);
  const int32_t tn = tw__resolve_tile_n(problem);
  const int32_t col_tiles = (int32_t)tw__ceil_div(problem->hidden, tn);
  if (r.splits == 0) r.splits = col_tiles % TW_TP_DEFAULT_SPLITS == 0 ? TW_TP_DEFAULT_SPLITS : 1;
  if (r.splits < 1 || r.splits > col_tiles || col_tiles % r.splits != 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_parallel.splits = %d must divide the %d GEMM2 column tiles (hidden %d / "
                    "TN %d), so that every split is whole tiles; use a divisor of %d, or 0",
                    r.splits, col_tiles, problem->hidden, tn, col_tiles);
  if (r.comm_tile_m == 0) r.comm_tile_m = TW_TP_DEFAULT_COMM_TILE_M;
  if (r.comm_tile_n == 0) r.comm_tile_n = TW_TP_DEFAULT_COMM_TILE_N;
  if (r.comm_tile_m < 1 || r.comm_tile_m > 4096)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_parallel.comm_tile_m = %d; give 1..4096 rows, or 0 for %d", r.comm_tile_m,
                    TW_TP_DEFAULT_COMM_TILE_M);
  if (r.comm_tile_n < 8 || r.comm_tile_n > TW_MAX_HIDDEN || r.comm_tile_n % 8 != 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_parallel.comm_tile_n = %d; give a multiple of 8 in 8..%d (16-byte rows), "
                    "or 0 for %d",
                    r.comm_tile_n, TW_MAX_HIDDEN, TW_TP_DEFAULT_COMM_TILE_N);
  *out = r;
  return TW_SUCCESS;
}

tw_status tw_parallel_validate(const tw_problem* problem, const tw_parallel* parallel) {
  tw__clear_error();
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(parallel);
  tw_parallel r;
  return tw__parallel_resolve(problem, parallel, &r);
}

static void tw__tp_plan_free(struct tw_tp_plan* pl) {
  if (pl == NULL) return;
  free(pl->block_row0);
  free(pl->row_src);
  free(pl->row_expert);
  free(pl->bands);
  free(pl->tiles);
  free(pl->segments);
  free(pl->comm_tiles);
  tw_plan_destroy(pl->ep_plan);
  free(pl);
}

tw_status tw_tp_plan_destroy(tw_tp_plan_t plan) {
  tw__clear_error();
  tw__tp_plan_free(plan);
  return TW_SUCCESS;
}

/* The EP plan of block q': EP rank `group` in the EP world of the owners with TP index q', over a
 * view of their routing arrays. */
static tw_status tw__tp_block_plan(const tw_problem* pep, const struct tw_routing* rt, int32_t tp,
                                   int32_t q, int32_t group, const tw_plan_config* cfg,
                                   tw_plan_t* out) {
  int32_t tokens[TW_MAX_RANKS];
  int32_t* ids[TW_MAX_RANKS];
  float* weights[TW_MAX_RANKS];
  for (int32_t g = 0; g < pep->world_size; g++) {
    tokens[g] = rt->tokens[g * tp + q];
    ids[g] = rt->expert_ids[g * tp + q];
    weights[g] = rt->weights[g * tp + q];
  }
  struct tw_routing view = {*pep, tokens, ids, weights};
  return tw_plan_create(pep, &view, group, cfg, out);
}

/* One producer tile's time with K = the rank's F slice: the EP model's tau_comp (model.c), the
 * unit of the first paper's waves. */
static double tw__tp_wave_us(const tw_hardware* hw, int32_t tm, int32_t tn, int32_t k) {
  const double tflops = hw->tile_tflops * (tm < 128 ? hw->tile_m64_share : 1.0);
  const double c = 2.0 * (double)tm * (double)tn * (double)k / (tflops * 1e6);
  const double f = hw->tile_floor_us * (double)tn / 128.0;
  return sqrt(sqrt(c * c * c * c + f * f * f * f)) + hw->tile_overhead_us;
}

/* Lays out the blocks, bands, tiles, segments and GatherRS tiles from the tp block plans. */
static tw_status tw__tp_build(struct tw_tp_plan* pl, tw_plan_t* blk) {
  const int32_t tp = pl->par.tp, E = pl->local_experts, L = pl->par.splits;
  pl->block_row0 = calloc((size_t)tp + 1, sizeof(int32_t));
  int64_t rows = 0, bands = 0;
  for (int32_t q = 0; q < tp; q++) {
    pl->block_row0[q] = (int32_t)rows;
    rows += blk[q]->rows;
    for (int32_t e = 0; e < E; e++) bands += tw__ceil_div(blk[q]->expert_rows[e], pl->tm);
  }
  if (pl->block_row0 == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tp plan: out of host memory");
  pl->block_row0[tp] = (int32_t)rows;
  pl->rows = (int32_t)rows;
  pl->num_bands = (int32_t)bands;
  pl->num_tiles = (int32_t)(bands * pl->col_tiles);
  const int32_t R0 = pl->block_row0[pl->tp_index], R1 = pl->block_row0[pl->tp_index + 1];
  int64_t ncomm = 0;
  for (int32_t s = 0; s < L; s++) {
    const int32_t c0 = s * pl->split_tiles * pl->tn;
    const int32_t c1 = (int32_t)fmin((double)(c0 + pl->split_tiles * pl->tn), pl->problem.hidden);
    ncomm +=
        tw__ceil_div(R1 - R0, pl->par.comm_tile_m) * tw__ceil_div(c1 - c0, pl->par.comm_tile_n);
  }
  pl->num_comm_tiles = (int32_t)ncomm;
  pl->num_segments = L;
  pl->row_src = malloc(((size_t)rows + 1) * sizeof *pl->row_src);
  pl->row_expert = malloc(((size_t)rows + 1) * sizeof *pl->row_expert);
  pl->bands = malloc(((size_t)bands + 1) * sizeof *pl->bands);
  pl->tiles = malloc(((size_t)pl->num_tiles + 1) * sizeof *pl->tiles);
  pl->segments = malloc((size_t)L * sizeof *pl->segments);
  pl->comm_tiles = malloc(((size_t)ncomm + 1) * sizeof *pl->comm_tiles);
  if (!pl->row_src || !pl->row_expert || !pl->bands || !pl->tiles || !pl->segments ||
      !pl->comm_tiles)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tp plan: out of host memory for %lld rows",
                    (long long)rows);
  /* Rows and bands, block by block; block q''s owners are the world ranks g' tp + q'. */
  int32_t nb = 0;
  for (int32_t q = 0; q < tp; q++) {
    const struct tw_plan* b = blk[q];
    const int32_t base = pl->block_row0[q];
    for (int32_t i = 0; i < b->rows; i++) {
      tw_row_src s = b->row_src[i];
      if (s.owner >= 0) s.owner = s.owner * tp + q;
      pl->row_src[base + i] = s;
    }
    for (int32_t e = 0; e < E; e++) {
      for (int32_t i = 0; i < b->expert_rows[e]; i++)
        pl->row_expert[base + b->expert_row0[e] + i] = e;
      for (int32_t r = 0; r < b->expert_rows[e]; r += pl->tm) {
        tw_tp_band* bd = &pl->bands[nb++];
        bd->block = q;
        bd->expert = e;
        bd->row0 = base + b->expert_row0[e] + r;
        bd->rows = b->expert_rows[e] - r < pl->tm ? b->expert_rows[e] - r : pl->tm;
      }
    }
  }
  /* Tiles split by split (the paper's global tile sequence), band by band inside a split. */
  int32_t nt = 0, ncm = 0;
  for (int32_t s = 0; s < L; s++) {
    tw_tp_segment* sg = &pl->segments[s];
    sg->split = s;
    sg->col0 = s * pl->split_tiles * pl->tn;
    sg->cols = (int32_t)fmin((double)(pl->split_tiles * pl->tn), pl->problem.hidden - sg->col0);
    sg->tile0 = nt;
    for (int32_t b = 0; b < nb; b++)
      for (int32_t c = 0; c < pl->split_tiles; c++) {
        tw_tile* t = &pl->tiles[nt++];
        memset(t, 0, sizeof *t);
        t->row0 = pl->bands[b].row0;
        t->rows = pl->bands[b].rows;
        t->expert = pl->bands[b].expert;
        t->col0 = sg->col0 + c * pl->tn;
        t->band = b;
      }
    sg->ntiles = nt - sg->tile0;
    sg->ready_tiles = nt;
    for (int32_t r = R0; r < R1; r += pl->par.comm_tile_m)
      for (int32_t c = 0; c < sg->cols; c += pl->par.comm_tile_n) {
        tw_tp_comm_tile* ct = &pl->comm_tiles[ncm++];
        ct->split = s;
        ct->row0 = r;
        ct->rows = R1 - r < pl->par.comm_tile_m ? R1 - r : pl->par.comm_tile_m;
        ct->col0 = sg->col0 + c;
        ct->cols = sg->cols - c < pl->par.comm_tile_n ? sg->cols - c : pl->par.comm_tile_n;
      }
  }
  if (nb != pl->num_bands || nt != pl->num_tiles || ncm != pl->num_comm_tiles)
    return tw__fail(TW_ERR_INTERNAL,
                    "tp plan: %d bands, %d tiles, %d comm tiles built; %d, %d, %d "
                    "counted",
                    nb, nt, ncm, pl->num_bands, pl->num_tiles, pl->num_comm_tiles);
  return TW_SUCCESS;
}

/* The first paper's choice of C for the GatherRS over this rank's tiles (model_tp.c). Workload:
 * N = hidden, K = the F slice, L splits, D = tp (the reduce-scatter's ranks), one GEMM group per
 * (block, expert) with its rows (so W_comp is this plan's tiles per split exactly). The
 * communication work: with ep = 1 the paper's own, M = every token of the world (each owner
 * reduces about M / D of them, all its slots at once); with ep > 1 the rows of this rank's block,
 * M = tp x those rows (ceil(M / D) = the rows it reduces). */
static tw_status tw__tp_choose(struct tw_tp_plan* pl, tw_plan_t* blk, const tw_routing_t rt) {
  pl->tp_comm_ctas = 0;
  pl->tp_waves = 0.0;
  pl->tp_wave_us = tw__tp_wave_us(&pl->hw, pl->tm, pl->tn, pl->ffn_slice);
  const int32_t tp = pl->par.tp, E = pl->local_experts;
  const int64_t reduce_rows = pl->block_row0[pl->tp_index + 1] - pl->block_row0[pl->tp_index];
  if (tp == 1 || pl->rows == 0) return TW_SUCCESS; /* nothing to reduce, or nothing computed */
  int64_t m = 0;
  if (pl->par.ep == 1)
    for (int32_t r = 0; r < pl->problem.world_size; r++) m += rt->tokens[r];
  else
    m = reduce_rows * tp;
  if (m < 1) m = 1; /* an empty block still takes the split's publication into account */
  int64_t* grp = malloc((size_t)tp * (size_t)E * sizeof *grp);
  double* t = malloc((size_t)pl->hw.c_max * sizeof *t);
  if (grp == NULL || t == NULL) {
    free(grp);
    free(t);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tp plan: out of host memory");
  }
  for (int32_t q = 0; q < tp; q++)
    for (int32_t e = 0; e < E; e++) grp[q * E + e] = blk[q]->expert_rows[e];
  tw_tp_workload w = {0};
  w.m = m;
  w.n = pl->problem.hidden;
  w.k = pl->ffn_slice;
  w.splits = pl->par.splits;
  w.ranks = tp;
  w.experts = tp * E;
  w.expert_rows = grp;
  w.tm = pl->tm;
  w.tn = pl->tn;
  w.tm_comm = pl->par.comm_tile_m;
  w.tn_comm = pl->par.comm_tile_n;
  int32_t c = 0;
  tw_status st = tw_tp_select(&w, &pl->hw, &c, t);
  if (st == TW_SUCCESS) {
    pl->tp_comm_ctas = c;
    pl->tp_waves = t[c - 1];
  }
  free(grp);
  free(t);
  return st;
}

tw_status tw_tp_plan_create(const tw_problem* problem, const tw_parallel* parallel,
                            tw_routing_t routing, int32_t rank, const tw_plan_config* config,
                            tw_tp_plan_t* plan) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  *plan = NULL;
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(parallel);
  tw_parallel par;
  TW_TRY(tw__parallel_resolve(problem, parallel, &par));
  TW_CHECK_NULL(routing);
  const tw_problem* p = problem;
  const tw_problem* rp = &routing->problem;
  if (rp->world_size != p->world_size || rp->experts != p->experts || rp->top_k != p->top_k)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "the routing is for world_size %d, experts %d, top_k %d but the problem has "
                    "%d, %d, %d; build the routing from the same problem (world_size tp x ep)",
                    rp->world_size, rp->experts, rp->top_k, p->world_size, p->experts, p->top_k);
  if (rank < 0 || rank >= p->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "rank %d is outside 0..%d (world_size %d)", rank,
                    p->world_size - 1, p->world_size);
  const double t0 = tw__now_seconds();
  struct tw_tp_plan* pl = calloc(1, sizeof *pl);
  tw_plan_t* blk = calloc((size_t)par.tp, sizeof *blk);
  if (pl == NULL || blk == NULL) {
    free(pl);
    free(blk);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tp plan: out of host memory");
  }
  pl->problem = *p;
  pl->par = par;
  pl->rank = rank;
  pl->group = rank / par.tp;
  pl->tp_index = rank % par.tp;
  pl->local_experts = p->experts / par.ep;
  pl->ffn_slice = p->ffn / par.tp;
  pl->tm = tw__resolve_tile_m(p);
  pl->tn = tw__resolve_tile_n(p);
  pl->col_tiles = (int32_t)tw__ceil_div(p->hidden, pl->tn);
  pl->split_tiles = pl->col_tiles / par.splits;
  tw_problem pep = *p;
  pep.world_size = par.ep;
  /* The EP part first, with the caller's config (which it checks); then the other blocks'
   * layouts, with the model off. */
  tw_status st =
      tw__tp_block_plan(&pep, routing, par.tp, pl->tp_index, pl->group, config, &blk[pl->tp_index]);
  if (st == TW_SUCCESS && par.tp > 1 && blk[pl->tp_index]->dataflow == TW_DATAFLOW_ADD)
    st = tw__fail(TW_ERR_UNSUPPORTED,
                  "tw_tp_plan_create: tp %d with the add dataflow: reduced rows reach their owner "
                  "only after the TP sum, which the add dataflow's producer cannot do; plan for "
                  "TW_DATAFLOW_REDUCE (tw_plan_config.dataflow or TW_COMBINE_DATAFLOW=reduce)",
                  par.tp);
  /* The hardware the EP part resolved (config's, else TW_CALIBRATION, else built-in), with the
   * config's SM budget applied: the TP model plans for the same SMs. */
  if (st == TW_SUCCESS) pl->hw = blk[pl->tp_index]->hardware;
  tw_plan_config fixed = TW_PLAN_CONFIG_INIT;
  fixed.use_model = 0;
  fixed.hardware = &pl->hw;
  fixed.schedule = TW_SCHEDULE_REMOTE_FIRST;
  fixed.dataflow = TW_DATAFLOW_REDUCE;
  for (int32_t q = 0; q < par.tp && st == TW_SUCCESS; q++)
    if (q != pl->tp_index)
      st = tw__tp_block_plan(&pep, routing, par.tp, q, pl->group, &fixed, &blk[q]);
  if (st == TW_SUCCESS) st = tw__tp_build(pl, blk);
  if (st == TW_SUCCESS) st = tw__tp_choose(pl, blk, routing);
  if (st == TW_SUCCESS) {
    pl->ep_plan = blk[pl->tp_index];
    blk[pl->tp_index] = NULL;
  }
  for (int32_t q = 0; q < par.tp; q++) tw_plan_destroy(blk[q]);
  free(blk);
  if (st != TW_SUCCESS) {
    tw__tp_plan_free(pl);
    return st;
  }
  pl->solve_us = 1e6 * (tw__now_seconds() - t0);
  *plan = pl;
  return TW_SUCCESS;
}

tw_status tw_tp_plan_summary_get(tw_tp_plan_t plan, tw_tp_plan_summary* summary) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(summary);
  TW_TRY(tw__check_header("tw_tp_plan_summary", summary->size, sizeof(tw_tp_plan_summary),
                          summary->magic, TW_TP_PLAN_SUMMARY_MAGIC, summary->version));
  const struct tw_tp_plan* pl = plan;
  tw_tp_plan_summary s = TW_TP_PLAN_SUMMARY_INIT;
  s.rank = pl->rank;
  s.tp = pl->par.tp;
  s.ep = pl->par.ep;
  s.group = pl->group;
  s.tp_index = pl->tp_index;
  s.local_experts = pl->local_experts;
  s.ffn_slice = pl->ffn_slice;
  s.splits = pl->par.splits;
  s.comm_tile_m = pl->par.comm_tile_m;
  s.comm_tile_n = pl->par.comm_tile_n;
  s.rows = pl->rows;
  int64_t real = 0;
  for (int32_t i = 0; i < pl->rows; i++) real += pl->row_src[i].owner >= 0;
  s.padding_rows = pl->rows - real;
  s.bands = pl->num_bands;
  s.tiles = pl->num_tiles;
  s.tiles_per_split = pl->num_segments > 0 ? pl->segments[0].ntiles : 0;
  s.reduce_rows = pl->block_row0[pl->tp_index + 1] - pl->block_row0[pl->tp_index];
  for (int32_t c = 0; c < pl->num_comm_tiles && pl->comm_tiles[c].split == 0; c++)
    s.comm_tiles_per_split++; /* split 0's (the last split may be narrower) */
  /* The producer stores its partial sums as bf16, like every GEMM2 output. */
  s.reduce_read_bytes = (int64_t)(pl->par.tp - 1) * s.reduce_rows * pl->problem.hidden * 2;
  s.tp_comm_ctas = pl->tp_comm_ctas;
  s.tp_predicted_waves = pl->tp_waves;
  s.tp_wave_us = pl->tp_wave_us;
  s.tp_predicted_us = pl->tp_waves * pl->tp_wave_us;
  tw_plan_summary es;
  TW_TRY(tw_plan_summary_get(pl->ep_plan, &es));
  s.ep_comm_ctas = es.comm_ctas;
  s.ep_coalesce = es.coalesce;
  s.ep_send_bytes = es.send_bytes;
  s.ep_predicted_us = es.predicted_us;
  s.solve_us = pl->solve_us;
  *summary = s;
  return TW_SUCCESS;
}

tw_status tw__tp_plan_destinations(const struct tw_tp_plan* pl, int64_t recv_rows_max,
                                   int32_t* dst_rank, int32_t* dst_row) {
  TW_CHECK_NULL(pl);
  const struct tw_plan* ep = pl->ep_plan;
  const int32_t R0 = pl->block_row0[pl->tp_index], n = ep->rows, tp = pl->par.tp;
  const int64_t row_bytes = (int64_t)pl->problem.hidden * 2;
  if (n != pl->block_row0[pl->tp_index + 1] - R0)
    return tw__fail(TW_ERR_INTERNAL, "tp plan: block of %d rows, EP plan of %d",
                    pl->block_row0[pl->tp_index + 1] - R0, n);
  if (n > 0) {
    TW_CHECK_NULL(dst_rank);
    TW_CHECK_NULL(dst_row);
  }
  /* Own tokens stay (their EP layout row), padding goes nowhere, the rest from the bands. */
  for (int32_t i = 0; i < n; i++) {
    const int32_t owner = pl->row_src[R0 + i].owner;
    dst_rank[i] = owner < 0 ? -1 : owner == pl->rank ? pl->rank : -2;
    dst_row[i] = owner == pl->rank ? i : 0;
  }
  for (int32_t b = 0; b < ep->num_bands; b++) {
    const tw_band* bd = &ep->bands[b];
    if (bd->dest_offset < 0) continue; /* a local band */
    const int32_t owner = bd->dest * tp + pl->tp_index;
    const int64_t first = bd->dest_offset / row_bytes;
    for (int32_t r = 0; r < bd->valid_rows; r++) {
      const int32_t i = bd->row0 + r;
      if (i < 0 || i >= n || dst_rank[i] != -2 || pl->row_src[R0 + i].owner != owner ||
          first + r >= recv_rows_max || bd->dest_offset % row_bytes != 0)
        return tw__fail(TW_ERR_INTERNAL,
                        "tp plan: EP band %d sends block row %d to rank %d, which the TP plan "
                        "does not give that rank (or past its %lld receive rows)",
                        b, i, owner, (long long)recv_rows_max);
      dst_rank[i] = owner;
      dst_row[i] = (int32_t)(first + r);
    }
  }
  for (int32_t i = 0; i < n; i++)
    if (dst_rank[i] == -2)
      return tw__fail(TW_ERR_INTERNAL, "tp plan: block row %d (owner %d) is in no EP band", i,
                      pl->row_src[R0 + i].owner);
  return TW_SUCCESS;
}
