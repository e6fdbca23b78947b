/*
 * bench_layer.c: `tilewave bench layer` and `tilewave bench dispatch` on one GPU: W ranks (1..8)
 * as threads of this process over an in-process team (W = 1 without --in-process), each rank with
 * its own tokens, timed against the sequential layer of harness/seq_layer.h on the same inputs.
 *
 * bench layer, per point (a model or shape, tokens per rank, a router):
 *   ours         tw_moe_layer (dispatch, GEMM1 + SwiGLU, GEMM2 + combine, weighted sum), and
 *                beside it the same with the dispatch before GEMM1 (TW_LAYER_DISPATCH_SEQUENTIAL)
 *                and, with --capacity, the capturable layer (a second context with that
 *                dispatch capacity; the same bits required)
 *   sequential   permute + copy all-to-all (one GPU) + cuBLAS GEMM1 + SwiGLU + cuBLAS GEMM2 +
 *                copy all-to-all + weighted sum, the GEMMs per (source, expert) group in a loop
 *                and grouped (cublasGemmGroupedBatchedEx); the table shows the faster form
 *   ours' parts  GEMM1 + SwiGLU alone (tw__layer_gemm1), GEMM2 alone (the producer on its P SMs,
 *                TW_COMBINE_GEMM_ONLY), the dispatch alone (tw_moe_dispatch), the combine alone
 *                (consumer + reduction, TW_COMBINE_COMM_ONLY); ideal = max(GEMM1 + GEMM2,
 *                dispatch + combine), efficiency = ideal / ours
 * bench dispatch, per point: tw_moe_dispatch against the sequential layer's permute + copy
 * all-to-all; every row of both receive buffers is checked, bit for bit, against the token row
 * it must hold (and tilewave's padding rows against zero).
 * Measurement: --warmup untimed rounds, then --iters rounds that run every policy once, forward
 * on even rounds and backward on odd ones (ABBA); each sample starts after a team barrier and
 * --delay-us of idle device, is timed with CUDA events on each rank's stream (the host's wait for
 * the counts in eager mode included) and is the slowest rank's; medians are reported. Outputs
 * are checked before and after timing: a point whose sequential output differs from ours by more
 * than --tol (normwise, max over ranks), or with a wrong dispatched row, fails the command.
 * TFLOP/s and GB/s are the GPU's: every rank's FLOPs or bytes over the slowest rank's time, each
 * routed (token, k) row counted once (tokens x top-k x hidden x 2 bytes per rank for a transfer).
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h" /* tw__baseline_fill_random, tw__baseline_rel_diff */
#include "bench.h"
#include "bench_common.h"
#include "bench_stats.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h" /* tw__fill_bf16 */
#include "plan.h"
#include "runtime.h" /* tw__layer_gemm1, tw__context_layer_h */
#include "seq_layer.h"
#include "team.h"
#include "tilewave.h"

enum {
  TWL_OURS,
  TWL_SEQ_LOOP,
  TWL_SEQ_GROUPED,
  TWL_GEMM1,
  TWL_GEMM2,
  TWL_DISPATCH,
  TWL_COMBINE,
  TWL_OURS_SEQ, /* tw_moe_layer with TW_LAYER_DISPATCH_SEQUENTIAL */
  TWL_OURS_CAPT /* tw_moe_layer on a context with a dispatch capacity (--capacity) */
};
enum {
  TWL_NPOLICIES = 9,
  TWL_NLAYER = 8,
  TWL_NDISPATCH = 2
}; /* bench dispatch: TWL_OURS, _SEQ_LOOP */

typedef struct twl_opts {
  int dispatch; /* 1: bench dispatch */
  const char* model;
  int hidden, ffn, experts, topk;
  int tokens[TWB_MAX_TOKENS_LIST], ntokens;
  tw_cli_router router; /* router.router -1: the command's default */
  int world, iters, warmup, delay_us, sm_budget;
  int dispatch_ctas; /* tw_layer_options.dispatch_ctas of "ours" (0: the model's) */
  int capacity;      /* bench layer: > 0 also times a capturable context of this capacity; -1: the
                        routing's largest (expert, source) group */
  double tol;
  int64_t seed;
} twl_opts;

typedef struct twl_rank {
  twb_team_job job; /* first: twb_team_run fills it */
  const twl_opts* o;
  const twb_point* pt;
  /* out: the same on every rank after the team's maxima and sums */
  double us[TWL_NPOLICIES];
  double err[4];    /* layer: the loop's and the grouped form's difference to ours (max), and
                       ours with the dispatch before GEMM1 and the capturable context's (must be
                       0: the same bits) */
  int64_t wrong[2]; /* dispatch: wrong rows of ours and of the sequential one (sums) */
  int64_t ours_bytes, seq_bytes; /* device memory of one rank (max over ranks) */
  int copy_ctas;                 /* ours' copy CTAs beside GEMM1 (rank 0's last call) */
  double r_expert;
  int budget;
} twl_rank;

/* One rank's state for one point. */
typedef struct twl_state {
  tw__team* sums;
  tw_problem p;
  tw_context_t ctx;
  tw_context_info info;
  tw_device_plan_t dp;
  tw_context_t ctx_capt; /* --capacity: the capturable context and its (static) device plan */
  tw_device_plan_t dp_capt;
  tw_routing_t rt;
  tw__seq_layer_t seq;
  tw_plan_config pc;
  int dispatch_ctas; /* twl_opts.dispatch_ctas */
  int copy_ctas;     /* out: ours' copy CTAs in the last check */
  cudaStream_t s;
  cudaEvent_t e0, e1;
  void *x, *w13, *w2, *out[4]; /* out: ours, loop, grouped, scratch (the parts' output) */
  int32_t* ids;
  float* gw;
  uint32_t* scratch;
  int32_t* src[2]; /* bench dispatch: (rows, 2) the row sources of ours and seq */
  int64_t src_rows[2];
  void** x_ranks;            /* (W) device: every rank's x */
  unsigned long long* wrong; /* (1) device */
  int32_t tokens;
} twl_state;

#define TWL_TRY(expr)                    \
  do {                                   \
    st = (expr);                         \
    if (st != TW_SUCCESS) goto teardown; \
  } while (0)

#define TWL_CUDA(expr)                                                                         \
  do {                                                                                         \
    const cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      st = tw__fail(TW_ERR_CUDA, "bench layer: %s failed: %s", #expr, cudaGetErrorString(e_)); \
      goto teardown;                                                                           \
    }                                                                                          \
  } while (0)

/* ---- routings -------------------------------------------------------------------------------- */

/* The point's routing on every rank (the same on each: the same seed). The hot router is
 * balanced with every token's first choice replaced by expert 0 (unless the token picked it
 * already): one expert receives every token of every rank. */
static tw_status twl_routing(const tw_problem* p, const twb_point* pt, uint64_t seed,
                             tw_routing_t* out) {
  const int hot = pt->router == TWB_ROUTER_HOT;
  const tw_router r = hot ? TW_ROUTER_BALANCED : (tw_router)pt->router;
  tw_routing_t rt = NULL;
  TW_TRY(tw_routing_generate(p, r, pt->router_param, pt->tokens, seed, &rt));
  if (!hot) {
    *out = rt;
    return TW_SUCCESS;
  }
  const int W = p->world_size, K = p->top_k;
  int32_t tokens[TW_MAX_RANKS];
  int32_t* ids[TW_MAX_RANKS];
  const float* ws[TW_MAX_RANKS];
  tw_status st = TW_SUCCESS;
  memset(ids, 0, sizeof ids);
  for (int q = 0; q < W && st == TW_SUCCESS; q++) {
    const int32_t* i0 = NULL;
    st = tw_routing_rank(rt, q, &tokens[q], &i0, &ws[q]);
    if (st != TW_SUCCESS) break;
    ids[q] = (int32_t*)malloc((size_t)tokens[q] * K * 4 + 4);
    if (ids[q] == NULL) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: host memory");
      break;
    }
    memcpy(ids[q], i0, (size_t)tokens[q] * K * 4);
    for (int32_t t = 0; t < tokens[q]; t++) {
      int32_t* row = ids[q] + (size_t)t * K;
      int has = 0;
      for (int j = 0; j < K; j++) has |= row[j] == 0;
      if (!has) row[0] = 0;
    }
  }
  if (st == TW_SUCCESS)
    st = tw_routing_create(p, tokens, (const int32_t* const*)ids, (const float* const*)ws, out);
  for (int q = 0; q < W; q++) free(ids[q]);
  tw_routing_destroy(rt);
  return st;
}

/* ---- setup ----------------------------------------------------------------------------------- */

/* The routing's largest (expert, source) group: the rows one source sends one expert (at least
 * 1), the capacity --capacity auto asks for. */
static int32_t twl_largest_group(const tw_problem* p, tw_routing_t rt) {
  const int32_t W = p->world_size, ET = p->experts, K = p->top_k;
  int32_t* c = (int32_t*)calloc((size_t)ET, sizeof *c);
  int32_t most = 1;
  for (int32_t o = 0; c != NULL && o < W; o++) {
    int32_t n = 0;
    const int32_t* ids = NULL;
    memset(c, 0, (size_t)ET * sizeof *c);
    if (tw_routing_rank(rt, o, &n, &ids, NULL) != TW_SUCCESS) continue;
    for (int64_t i = 0; i < (int64_t)n * K; i++)
      if (++c[ids[i]] > most) most = c[ids[i]];
  }
  free(c);
  return most;
}

/* Everything of one rank but the sequential layer (tw__seq_layer_create, collective, follows
 * once every rank has agreed that this part worked). */
static tw_status twl_setup(twl_state* t, const twl_opts* o, const twb_point* pt,
                           const twb_team_job* job) {
  tw_status st = TW_SUCCESS;
  const int layer = !o->dispatch;
  TWL_CUDA(cudaSetDevice(0));
  TWL_CUDA(cudaStreamCreateWithFlags(&t->s, cudaStreamNonBlocking));
  TWL_CUDA(cudaEventCreate(&t->e0));
  TWL_CUDA(cudaEventCreate(&t->e1));
  TWL_TRY(tw__team_local_join(job->sums, job->rank, &t->sums));
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = job->world;
  p.hidden = pt->hidden, p.ffn = pt->ffn, p.experts = pt->experts, p.top_k = pt->topk;
  p.max_tokens = pt->tokens;
  t->p = p;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dataflow = TW_DATAFLOW_REDUCE; /* the dispatch and the layer run the reduce dataflow */
  cc.sm_budget = o->sm_budget;
  cc.dispatch = 1;
  cc.layer = layer;
  TWL_TRY(tw_context_create_on_team(&t->p, job->team, job->rank, &cc, &t->ctx));
  TWL_TRY(tw_context_info_get(t->ctx, &t->info));
  TWL_TRY(tw_device_plan_create(t->ctx, &t->dp));
  TWL_TRY(twl_routing(&t->p, pt, (uint64_t)o->seed, &t->rt));
  if (layer && o->capacity != 0) {
    /* Every rank generates the same routing, so "auto" gives every rank the same capacity. */
    tw_context_config cc2 = cc;
    cc2.dispatch_capacity = o->capacity > 0 ? o->capacity : twl_largest_group(&t->p, t->rt);
    TWL_TRY(tw_context_create_on_team(&t->p, job->team, job->rank, &cc2, &t->ctx_capt));
    TWL_TRY(tw_device_plan_create(t->ctx_capt, &t->dp_capt));
  }
  /* The plan config both calls plan with, so that bench dispatch's expected layout (the host
   * plan of the same routing) is the one the dispatch builds. */
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.dataflow = TW_DATAFLOW_REDUCE;
  pc.sm_budget = t->info.sm_budget;
  t->pc = pc;
  const int32_t* ids = NULL;
  const float* ws = NULL;
  TWL_TRY(tw_routing_rank(t->rt, job->rank, &t->tokens, &ids, &ws));
  const size_t T = (size_t)t->tokens, K = (size_t)p.top_k, H = (size_t)p.hidden;
  const size_t F = (size_t)p.ffn, E = (size_t)(p.experts / p.world_size);
  TWL_CUDA(cudaMalloc(&t->x, T * H * 2 + 16));
  TWL_CUDA(cudaMalloc((void**)&t->ids, T * K * 4 + 4));
  TWL_CUDA(cudaMalloc((void**)&t->gw, T * K * 4 + 4));
  TWL_CUDA(cudaMalloc((void**)&t->scratch, 256));
  TWL_CUDA(cudaMalloc((void**)&t->wrong, 256));
  TWL_CUDA(cudaMemcpy(t->ids, ids, T * K * 4, cudaMemcpyHostToDevice));
  TWL_CUDA(cudaMemcpy(t->gw, ws, T * K * 4, cudaMemcpyHostToDevice));
  TWL_TRY(
      tw__baseline_fill_random(t->x, T * H, 7000 + (uint64_t)o->seed * 131 + job->rank, 1.f, t->s));
  if (layer) {
    TWL_CUDA(cudaMalloc(&t->w13, E * 2 * F * H * 2 + 16));
    TWL_CUDA(cudaMalloc(&t->w2, E * H * F * 2 + 16));
    for (int i = 0; i < 4; i++) TWL_CUDA(cudaMalloc(&t->out[i], T * H * 2 + 16));
    /* Projections of order 1 (x in [-1, 1)), where SwiGLU is neither linear nor zero. */
    TWL_TRY(tw__baseline_fill_random(t->w13, E * 2 * F * H, 9100 + job->rank, 2.f / sqrtf((float)H),
                                     t->s));
    TWL_TRY(
        tw__baseline_fill_random(t->w2, E * H * F, 9200 + job->rank, 2.f / sqrtf((float)F), t->s));
  }
  TWL_CUDA(cudaStreamSynchronize(t->s));
teardown:
  return st;
}

static void twl_free(twl_state* t) {
  if (t->s) cudaStreamSynchronize(t->s);
  tw__seq_layer_destroy(t->seq); /* collective: every rank gets here */
  tw_routing_destroy(t->rt);
  tw_device_plan_destroy(t->dp);
  tw_context_destroy(t->ctx); /* collective */
  tw_device_plan_destroy(t->dp_capt);
  tw_context_destroy(t->ctx_capt); /* collective; NULL without --capacity */
  void* dev[] = {t->x,   t->w13, t->w2,      t->out[0], t->out[1], t->out[2], t->out[3],
                 t->ids, t->gw,  t->scratch, t->wrong,  t->src[0], t->src[1], t->x_ranks};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  if (t->e0) cudaEventDestroy(t->e0);
  if (t->e1) cudaEventDestroy(t->e1);
  if (t->sums) t->sums->ops->release(t->sums);
  if (t->s) cudaStreamDestroy(t->s);
  memset(t, 0, sizeof *t);
}

/* ---- policies -------------------------------------------------------------------------------- */

/* Enqueues policy `pol` once on t->s (its output into t->out[out]). */
static tw_status twl_enqueue(twl_state* t, int dispatch_bench, int pol, int out) {
  const int32_t T = t->tokens;
  tw_combine_options co = TW_COMBINE_OPTIONS_INIT;
  void* h = NULL;
  void* expert_in = NULL;
  tw_dispatch_options d = TW_DISPATCH_OPTIONS_INIT;
  d.plan_config = &t->pc;
  switch (pol) {
    case TWL_OURS:
      if (dispatch_bench)
        return tw_moe_dispatch_ex(t->ctx, t->dp, t->x, t->ids, TW_INDEX_INT32, t->gw, T, &expert_in,
                                  &d, t->s);
    /* fall through */
    case TWL_OURS_SEQ: {
      tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
      lo.plan_config = &t->pc;
      lo.dispatch_ctas = pol == TWL_OURS_SEQ ? TW_LAYER_DISPATCH_SEQUENTIAL : t->dispatch_ctas;
      return tw_moe_layer_ex(t->ctx, t->dp, t->x, t->ids, TW_INDEX_INT32, t->gw, T, t->w13, t->w2,
                             t->out[out], &lo, t->s);
    }
    case TWL_OURS_CAPT: /* the static plan: no per-call config */
      return tw_moe_layer_ex(t->ctx_capt, t->dp_capt, t->x, t->ids, TW_INDEX_INT32, t->gw, T,
                             t->w13, t->w2, t->out[out], NULL, t->s);
    case TWL_SEQ_LOOP:
    case TWL_SEQ_GROUPED:
      if (dispatch_bench) return tw__seq_dispatch(t->seq, t->x, t->ids, T, t->s);
      return tw__seq_layer_run(t->seq, t->x, t->ids, t->gw, T, t->w13, t->w2, t->out[out],
                               pol == TWL_SEQ_LOOP ? TW__SEQ_LOOP : TW__SEQ_GROUPED, t->s);
    case TWL_GEMM1:
      TW_TRY(tw_context_dispatch_buffer(t->ctx, &expert_in, NULL));
      return tw__layer_gemm1(t->ctx, t->dp, expert_in, t->w13, NULL, 0, t->s);
    case TWL_GEMM2:
    case TWL_COMBINE:
      TW_TRY(tw__context_layer_h(t->ctx, &h));
      co.mode = pol == TWL_GEMM2 ? TW_COMBINE_GEMM_ONLY : TW_COMBINE_COMM_ONLY;
      return tw_moe_combine_ex(t->ctx, t->dp, h, t->w2, t->out[3], &co, t->s);
    case TWL_DISPATCH:
      return tw_moe_dispatch_ex(t->ctx, t->dp, t->x, t->ids, TW_INDEX_INT32, t->gw, T, NULL, &d,
                                t->s);
  }
  return tw__fail(TW_ERR_INTERNAL, "bench layer: policy %d", pol);
}

/* Runs policy `pol` once: enqueued, `done` (when not NULL) recorded right after it, then for a
 * call on the context the context's check (collective; outside the timed region). */
static tw_status twl_run(twl_state* t, int dispatch_bench, int pol, int out, cudaEvent_t done) {
  TW_TRY(twl_enqueue(t, dispatch_bench, pol, out));
  if (done != NULL && cudaEventRecord(done, t->s) != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "bench layer: cudaEventRecord failed");
  const int on_context = pol == TWL_OURS || pol == TWL_OURS_SEQ || pol == TWL_GEMM2 ||
                         pol == TWL_COMBINE || pol == TWL_DISPATCH;
  if (pol == TWL_OURS_CAPT) return tw_context_check(t->ctx_capt);
  return on_context ? tw_context_check(t->ctx) : TW_SUCCESS;
}

/* Policy pol's output against ours' (normwise, both ways so that a NaN in either counts), the
 * largest over ranks. */
static tw_status twl_err(twl_state* t, int pol_out, double* err) {
  const size_t n = (size_t)t->tokens * t->p.hidden;
  double a = 0, b = 0;
  TW_TRY(tw__baseline_rel_diff(t->out[pol_out], t->out[0], n, t->scratch, t->s, &a));
  TW_TRY(tw__baseline_rel_diff(t->out[0], t->out[pol_out], n, t->scratch, t->s, &b));
  double e = a > b ? a : b;
  if (!(e >= 0)) e = INFINITY; /* NaN */
  /* The bit patterns of non-negative doubles (+Inf included) order as their values. */
  int64_t bits;
  memcpy(&bits, &e, 8);
  TW_TRY(tw__team_max_i64(t->sums, &bits, 1));
  memcpy(err, &bits, 8);
  return TW_SUCCESS;
}

/* bench layer's check: ours, then both sequential forms, on poisoned outputs. */
static tw_status twl_check_layer(twl_state* t, double* err) {
  const size_t n = (size_t)t->tokens * t->p.hidden;
  for (int i = 0; i < 3; i++) TW_TRY(tw__fill_bf16(t->out[i], n, TWB_POISON, t->s));
  TW_TRY(twl_run(t, 0, TWL_OURS, 0, NULL));
  tw__launch_record lr;
  TW_TRY(tw__context_last_launch(t->ctx, &lr));
  t->copy_ctas = lr.dispatch_ctas;
  TW_TRY(twl_run(t, 0, TWL_SEQ_LOOP, 1, NULL));
  TW_TRY(twl_run(t, 0, TWL_SEQ_GROUPED, 2, NULL));
  TW_TRY(tw__fill_bf16(t->out[3], n, TWB_POISON, t->s));
  TW_TRY(twl_run(t, 0, TWL_OURS_SEQ, 3, NULL));
  if (cudaStreamSynchronize(t->s) != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "bench layer: the stream failed");
  double e1 = 0, e2 = 0, e3 = 0;
  TW_TRY(twl_err(t, 1, &e1));
  TW_TRY(twl_err(t, 2, &e2));
  TW_TRY(twl_err(t, 3, &e3));
  if (e3 > err[2] || !(e3 == e3)) err[2] = e3;
  if (t->ctx_capt != NULL) { /* the same bits as the eager layer (test_capture's rule) */
    TW_TRY(tw__fill_bf16(t->out[3], n, TWB_POISON, t->s));
    TW_TRY(twl_run(t, 0, TWL_OURS_CAPT, 3, NULL));
    if (cudaStreamSynchronize(t->s) != cudaSuccess)
      return tw__fail(TW_ERR_CUDA, "bench layer: the stream failed");
    double e4 = 0;
    TW_TRY(twl_err(t, 3, &e4));
    if (e4 > err[3] || !(e4 == e4)) err[3] = e4;
  }
  if (e1 > err[0] || !(e1 == e1)) err[0] = e1;
  if (e2 > err[1] || !(e2 == e2)) err[1] = e2;
  return TW_SUCCESS;
}

/* bench dispatch: where every row of ours' and the sequential receive buffer comes from, on the
 * host from the routing: (source rank, token) per row, -1 for tilewave's padding rows. */
static tw_status twl_row_sources(twl_state* t, int rank) {
  tw_status st = TW_SUCCESS;
  const int W = t->p.world_size, K = t->p.top_k, E = t->p.experts / W;
  tw_plan_t plan = NULL;
  int32_t* h = NULL;
  int64_t* fill = NULL;
  TWL_TRY(tw_plan_create(&t->p, t->rt, rank, &t->pc, &plan));
  t->src_rows[0] = plan->rows;
  h = (int32_t*)malloc((size_t)plan->rows * 8 + 8);
  if (h == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench dispatch: host memory");
    goto teardown;
  }
  for (int32_t r = 0; r < plan->rows; r++) {
    h[2 * r] = plan->row_src[r].owner;
    h[2 * r + 1] = plan->row_src[r].owner >= 0 ? plan->row_src[r].token : 0;
  }
  TWL_CUDA(cudaMalloc((void**)&t->src[0], (size_t)plan->rows * 8 + 8));
  TWL_CUDA(cudaMemcpy(t->src[0], h, (size_t)plan->rows * 8, cudaMemcpyHostToDevice));
  free(h);
  h = NULL;
  /* The sequential buffer: source-major, then local expert, then token order. */
  int64_t rows = 0;
  for (int q = 0; q < W; q++) {
    int32_t n = 0;
    const int32_t* ids = NULL;
    const float* ws = NULL;
    TWL_TRY(tw_routing_rank(t->rt, q, &n, &ids, &ws));
    for (int64_t i = 0; i < (int64_t)n * K; i++) rows += ids[i] / E == rank;
  }
  t->src_rows[1] = rows;
  h = (int32_t*)malloc((size_t)rows * 8 + 8);
  fill = (int64_t*)calloc((size_t)E + 1, sizeof(int64_t));
  if (h == NULL || fill == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench dispatch: host memory");
    goto teardown;
  }
  int64_t base = 0;
  for (int q = 0; q < W; q++) {
    int32_t n = 0;
    const int32_t* ids = NULL;
    const float* ws = NULL;
    TWL_TRY(tw_routing_rank(t->rt, q, &n, &ids, &ws));
    memset(fill, 0, sizeof(int64_t) * ((size_t)E + 1));
    for (int64_t i = 0; i < (int64_t)n * K; i++)
      if (ids[i] / E == rank) fill[ids[i] % E + 1]++;
    for (int e = 0; e < E; e++) fill[e + 1] += fill[e]; /* fill[e]: expert e's first row */
    const int64_t total = fill[E];
    for (int32_t tok = 0; tok < n; tok++)
      for (int j = 0; j < K; j++) {
        const int32_t g = ids[(size_t)tok * K + j];
        if (g / E != rank) continue;
        const int64_t r = base + fill[g % E]++;
        h[2 * r] = q, h[2 * r + 1] = tok;
      }
    base += total;
  }
  TWL_CUDA(cudaMalloc((void**)&t->src[1], (size_t)rows * 8 + 8));
  TWL_CUDA(cudaMemcpy(t->src[1], h, (size_t)rows * 8, cudaMemcpyHostToDevice));
  /* Every rank's x, for the check kernel (one address space). */
  {
    void* all[TW_MAX_RANKS];
    TWL_TRY(t->sums->ops->allgather(t->sums, &t->x, all, sizeof(void*)));
    TWL_CUDA(cudaMalloc((void**)&t->x_ranks, sizeof(void*) * (size_t)W));
    TWL_CUDA(cudaMemcpy(t->x_ranks, all, sizeof(void*) * (size_t)W, cudaMemcpyHostToDevice));
  }
teardown:
  free(h);
  free(fill);
  tw_plan_destroy(plan);
  return st;
}

/* Rows of buffer `which` (0 ours, 1 sequential) that differ from their sources on this rank. */
static tw_status twl_wrong_rows(twl_state* t, int which, const void* rows, int64_t nrows,
                                int64_t* wrong) {
  tw_status st = TW_SUCCESS;
  unsigned long long h = 0;
  if (nrows != t->src_rows[which]) {
    *wrong += nrows > t->src_rows[which] ? nrows : t->src_rows[which];
    return TW_SUCCESS;
  }
  TWL_CUDA(cudaMemsetAsync(t->wrong, 0, 8, t->s));
  TWL_TRY(tw__seq_check_rows(rows, nrows, t->src[which], (const void* const*)t->x_ranks,
                             t->p.hidden, t->wrong, t->s));
  TWL_CUDA(cudaMemcpyAsync(&h, t->wrong, 8, cudaMemcpyDeviceToHost, t->s));
  TWL_CUDA(cudaStreamSynchronize(t->s));
  *wrong += (int64_t)h;
teardown:
  return st;
}

/* bench dispatch's check: each buffer right after its call (peers overwrite it in the next). */
static tw_status twl_check_dispatch(twl_state* t, int64_t* wrong) {
  int64_t w[2] = {0, 0};
  TW_TRY(twl_run(t, 1, TWL_OURS, 0, NULL));
  void* buf = NULL;
  TW_TRY(tw_context_dispatch_buffer(t->ctx, &buf, NULL));
  tw_plan_summary sum;
  TW_TRY(tw_device_plan_summary_get(t->dp, &sum));
  TW_TRY(twl_wrong_rows(t, 0, buf, sum.rows, &w[0]));
  TW_TRY(twl_run(t, 1, TWL_SEQ_LOOP, 0, NULL));
  const void* recv = NULL;
  int64_t rows = 0;
  TW_TRY(tw__seq_recv_rows(t->seq, &recv, &rows));
  TW_TRY(twl_wrong_rows(t, 1, recv, rows, &w[1]));
  TW_TRY(tw__team_sum_i64(t->sums, w, 2));
  wrong[0] += w[0], wrong[1] += w[1];
  return TW_SUCCESS;
}

/* The policies timed, ABBA rounds; us[pol] the median of the slowest rank's samples. */
static tw_status twl_time(twl_state* t, const twl_opts* o, const int* pols, int np, double* us) {
  tw_status st = TW_SUCCESS;
  float* smp = (float*)calloc((size_t)np * o->iters + 1, sizeof(float));
  if (smp == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench layer: host memory");
  for (int round = -o->warmup; round < o->iters; round++) {
    for (int k = 0; k < np; k++) {
      const int i = (round & 1) ? np - 1 - k : k;
      TWL_TRY(tw__team_barrier(t->sums));
      TWL_TRY(tw__bench_delay(t->s, o->delay_us));
      const int out = pols[i] == TWL_SEQ_GROUPED ? 2 : pols[i] == TWL_SEQ_LOOP ? 1 : 0;
      TWL_CUDA(cudaEventRecord(t->e0, t->s));
      TWL_TRY(twl_run(t, o->dispatch, pols[i], out, t->e1));
      TWL_CUDA(cudaEventSynchronize(t->e1));
      float ms = 0.f;
      TWL_CUDA(cudaEventElapsedTime(&ms, t->e0, t->e1));
      int64_t ns = (int64_t)((double)ms * 1e6);
      TWL_TRY(tw__team_max_i64(t->sums, &ns, 1));
      if (round >= 0) smp[(size_t)i * o->iters + round] = (float)((double)ns / 1e3);
    }
  }
  for (int i = 0; i < np; i++) {
    tw__bench_stats q;
    tw__bench_stats_of(smp + (size_t)i * o->iters, o->iters, &q);
    us[pols[i]] = q.median;
  }
teardown:
  free(smp);
  return st;
}

static void* twl_rank_main(void* arg) {
  twl_rank* r = (twl_rank*)arg;
  const twl_opts* o = r->o;
  twl_state t;
  memset(&t, 0, sizeof t);
  tw_status st = twl_setup(&t, o, r->pt, &r->job);
  /* Every rank agrees that every rank is set up before anything collective runs. */
  int64_t bad = st != TW_SUCCESS;
  if (t.sums != NULL) {
    const tw_status st2 = tw__team_max_i64(t.sums, &bad, 1);
    if (st == TW_SUCCESS && st2 != TW_SUCCESS) st = st2;
    if (st == TW_SUCCESS && bad) st = tw__fail(TW_ERR_INTERNAL, "another rank's setup failed");
  }
  if (st != TW_SUCCESS) goto teardown;
  /* Collective, with an agreement of its own. */
  TWL_TRY(tw__seq_layer_create(&t.p, t.sums, o->dispatch ? 0 : t.p.ffn, &t.seq));
  r->budget = t.info.sm_budget;
  t.dispatch_ctas = o->dispatch_ctas;
  {
    tw_context_memory m = TW_CONTEXT_MEMORY_INIT;
    TWL_TRY(tw_context_memory_get(t.ctx, &m));
    int64_t mem[2] = {m.total_bytes, tw__seq_layer_bytes(t.seq)};
    TWL_TRY(tw__team_max_i64(t.sums, mem, 2));
    r->ours_bytes = mem[0], r->seq_bytes = mem[1];
    tw_routing_stats rs;
    TWL_TRY(tw_routing_stats_get(t.rt, &rs));
    r->r_expert = rs.r_expert;
  }
  if (o->dispatch) {
    static const int pols[TWL_NDISPATCH] = {TWL_OURS, TWL_SEQ_LOOP};
    TWL_TRY(twl_row_sources(&t, r->job.rank));
    TWL_TRY(twl_check_dispatch(&t, r->wrong));
    TWL_TRY(twl_time(&t, o, pols, TWL_NDISPATCH, r->us));
    TWL_TRY(twl_check_dispatch(&t, r->wrong));
  } else {
    static const int pols[TWL_NPOLICIES] = {TWL_OURS,    TWL_SEQ_LOOP, TWL_SEQ_GROUPED,
                                            TWL_GEMM1,   TWL_GEMM2,    TWL_DISPATCH,
                                            TWL_COMBINE, TWL_OURS_SEQ, TWL_OURS_CAPT};
    TWL_TRY(twl_check_layer(&t, r->err));
    TWL_TRY(twl_time(&t, o, pols, t.ctx_capt != NULL ? TWL_NPOLICIES : TWL_NLAYER, r->us));
    TWL_TRY(twl_check_layer(&t, r->err)); /* after timing as well */
    r->copy_ctas = t.copy_ctas;
  }
teardown:
  twb_team_done(&r->job, st);
  twl_free(&t);
  return NULL;
}

/* ---- the table ------------------------------------------------------------------------------- */

static void twl_header(const twl_opts* o) {
  struct cudaDeviceProp prop;
  memset(&prop, 0, sizeof prop);
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) snprintf(prop.name, sizeof prop.name, "?");
  printf(
      "# bench %s on %s (%d SMs): %d rank(s) as threads of one process on GPU 0 (in-process team; "
      "one GPU's memory stands in for NVLink, the sequential layer's all-to-all is a copy "
      "all-to-all (one GPU): cudaMemcpyAsync between the ranks' buffers); median of %d rounds, "
      "%d us idle before each call; TFLOP/s and GB/s over all ranks' work\n\n",
      o->dispatch ? "dispatch" : "layer", prop.name, prop.multiProcessorCount, o->world, o->iters,
      o->delay_us);
  if (o->dispatch) {
    printf(
        "| H | E | top-k | ranks | tokens/rank | router | R_expert | ours us | ours GB/s | "
        "permute + copy all-to-all us | its GB/s | speedup | #wrong ours | #wrong seq |\n");
    printf(
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: |\n");
  } else {
    printf(
        "| model | ranks | tokens/rank | router | ours us | sequential us (form) | speedup | "
        "ours, dispatch then GEMM1 us | overlap gain (copy CTAs) | capturable us (/ ours) | GEMM1 "
        "us (TF/s) | GEMM2 us (TF/s) | dispatch us (GB/s) | combine us (GB/s) | ideal us | eff | "
        "ours MiB/rank | seq MiB/rank | err |\n");
    printf("|");
    for (int c = 0; c < 19; c++) printf(c == 0 || c == 3 ? " --- |" : " ---: |");
    printf("\n");
  }
  fflush(stdout);
}

/* Prints the point's row; 1 when it failed its check. */
static int twl_row(const twl_opts* o, const twb_point* pt, const twl_rank* r0) {
  const double* u = r0->us;
  const double rows = (double)o->world * pt->tokens * pt->topk; /* every rank's routed rows */
  const double bytes = rows * pt->hidden * 2.0;
  if (o->dispatch) {
    const int bad = r0->wrong[0] != 0 || r0->wrong[1] != 0;
    printf(
        "| %d | %d | %d | %d | %d | %s | %.2f | %.1f | %.0f | %.1f | %.0f | %.2fx | %lld | "
        "%lld |\n",
        pt->hidden, pt->experts, pt->topk, o->world, pt->tokens, tw__cli_router_name(pt->router),
        r0->r_expert, u[TWL_OURS], bytes / u[TWL_OURS] * 1e-3, u[TWL_SEQ_LOOP],
        bytes / u[TWL_SEQ_LOOP] * 1e-3, u[TWL_SEQ_LOOP] / u[TWL_OURS], (long long)r0->wrong[0],
        (long long)r0->wrong[1]);
    fflush(stdout);
    return bad;
  }
  const int grouped = u[TWL_SEQ_GROUPED] < u[TWL_SEQ_LOOP];
  const double seq = grouped ? u[TWL_SEQ_GROUPED] : u[TWL_SEQ_LOOP];
  const double f1 = 2.0 * rows * 2.0 * pt->ffn * pt->hidden, f2 = 2.0 * rows * pt->ffn * pt->hidden;
  const double gemms = u[TWL_GEMM1] + u[TWL_GEMM2], comm = u[TWL_DISPATCH] + u[TWL_COMBINE];
  const double ideal = gemms > comm ? gemms : comm;
  const double err = r0->err[0] > r0->err[1] ? r0->err[0] : r0->err[1];
  const int bad = !(err <= o->tol) || r0->err[2] != 0.0 || r0->err[3] != 0.0;
  char capt[48] = "-";
  if (u[TWL_OURS_CAPT] > 0)
    snprintf(capt, sizeof capt, "%.1f (%.3fx)", u[TWL_OURS_CAPT], u[TWL_OURS_CAPT] / u[TWL_OURS]);
  printf(
      "| %s | %d | %d | %s | %.1f | %.1f (%s) | %.2fx | %.1f | %.3fx (%d) | %s | %.1f (%.0f) | "
      "%.1f (%.0f) | %.1f (%.0f) | %.1f (%.0f) | %.1f | %.3f | %.0f | %.0f | %.1e%s |\n",
      pt->name, o->world, pt->tokens, tw__cli_router_name(pt->router), u[TWL_OURS], seq,
      grouped ? "grouped" : "loop", seq / u[TWL_OURS], u[TWL_OURS_SEQ],
      u[TWL_OURS_SEQ] / u[TWL_OURS], r0->copy_ctas, capt, u[TWL_GEMM1], f1 / u[TWL_GEMM1] * 1e-6,
      u[TWL_GEMM2], f2 / u[TWL_GEMM2] * 1e-6, u[TWL_DISPATCH], bytes / u[TWL_DISPATCH] * 1e-3,
      u[TWL_COMBINE], bytes / u[TWL_COMBINE] * 1e-3, ideal, ideal / u[TWL_OURS],
      (double)r0->ours_bytes / 1048576.0, (double)r0->seq_bytes / 1048576.0, err,
      bad ? " FAIL" : "");
  fflush(stdout);
  return bad;
}

static int twl_run_points(const twl_opts* o, const twb_point* pts, int npoints) {
  const int W = o->world;
  /* Every rank's streams need hardware queues of their own (tw_team_create checks); the variable
   * counts only when set before this process's first CUDA call. */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (twb_gpus_present() < 1) {
    fprintf(stderr, "tilewave bench %s: no GPU found\n", o->dispatch ? "dispatch" : "layer");
    return 1;
  }
  twl_header(o);
  const char* cmd = o->dispatch ? "bench dispatch" : "bench layer";
  twl_rank ranks[8];
  int failed = 0;
  twb_progress pr;
  twb_progress_begin(&pr, cmd, "point", npoints);
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twb_point_progress(&pr, i, pt);
    memset(ranks, 0, sizeof ranks);
    for (int r = 0; r < W; r++) ranks[r].o = o, ranks[r].pt = pt;
    const double t0 = tw__now_seconds();
    const tw_status st = twb_team_run(W, twl_rank_main, ranks, sizeof ranks[0]);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tilewave %s: %s: %s\n", cmd, tw_status_string(st), tw_last_error());
      return 1;
    }
    char who[64];
    snprintf(who, sizeof who, "tilewave %s", cmd);
    int bad = twb_team_failures(who, W, ranks, sizeof ranks[0]) > 0;
    if (!bad && twl_row(o, pt, &ranks[0])) {
      if (o->dispatch)
        fprintf(stderr,
                "tilewave %s: WRONG ROWS at tokens/rank %d %s: ours %lld, sequential %lld\n", cmd,
                pt->tokens, tw__cli_router_name(pt->router), (long long)ranks[0].wrong[0],
                (long long)ranks[0].wrong[1]);
      else
        fprintf(stderr,
                "tilewave %s: WRONG OUTPUT at %s tokens/rank %d %s: ours against the sequential "
                "layer %.3e (loop) / %.3e (grouped), above --tol %.1e\n",
                cmd, pt->name, pt->tokens, tw__cli_router_name(pt->router), ranks[0].err[0],
                ranks[0].err[1], o->tol);
      bad = 1;
    }
    if (!bad)
      fprintf(stderr, "[%s %d/%d] ours %.1f us, sequential %.1f us, %.1f s\n", cmd, i + 1, npoints,
              ranks[0].us[TWL_OURS],
              o->dispatch ? ranks[0].us[TWL_SEQ_LOOP]
                          : fmin(ranks[0].us[TWL_SEQ_LOOP], ranks[0].us[TWL_SEQ_GROUPED]),
              tw__now_seconds() - t0);
    failed += bad;
  }
  if (failed)
    fprintf(stderr, "tilewave %s: %d of %d point(s) FAILED (an error, a wrong row or output)\n",
            cmd, failed, npoints);
  return failed ? 1 : 0;
}

/* ---- command line ---------------------------------------------------------------------------- */

static const char* twl_parse_router(const char* v, void* dst) {
  tw_cli_router* r = (tw_cli_router*)dst;
  r->name = v;
  if (v != NULL && strcmp(v, "hot") == 0) {
    r->router = TWB_ROUTER_HOT, r->param = 0.0;
    return NULL;
  }
  if (tw__cli_parse_router(v, &r->router, &r->param)) return NULL;
  return "balanced, moderate_skew, stress_skew, target:R_EXPERT (R_EXPERT >= 1) or hot";
}

static const char* twl_parse_capacity(const char* v, void* dst) {
  int* c = (int*)dst;
  if (v != NULL && strcmp(v, "auto") == 0) {
    *c = -1;
    return NULL;
  }
  char* end = NULL;
  const long n = v != NULL ? strtol(v, &end, 10) : -1;
  if (v != NULL && end != v && *end == '\0' && n >= 0 && n <= (1 << 24)) {
    *c = (int)n;
    return NULL;
  }
  return "rows per (expert, source) group, 0..16777216, or auto";
}

static void twl_usage(FILE* f, void* ctx) {
  const int dispatch = *(const int*)ctx;
  if (dispatch)
    fprintf(
        f,
        "usage: tilewave bench dispatch [--in-process W] [--model NAME | --hidden H --experts E\n"
        "                               --topk K [--ffn F]] [--tokens T[,T...]] [--router R]\n\n"
        "Latency and GB/s of tw_moe_dispatch against the sequential layer's permute (counts,\n"
        "stable sort, row scatter) + copy all-to-all (one GPU: cudaMemcpyAsync between the\n"
        "ranks' buffers) on the same inputs, W ranks (default 1) as threads on GPU 0. Every\n"
        "row of both receive buffers is checked bit for bit against the token row it must\n"
        "hold (#wrong columns; any wrong row fails the command). Default: the deepseek-v3\n"
        "shape, tokens/rank 1024,2048,4096,8192,16384, routers balanced, stress_skew, hot.\n\n");
  else
    fprintf(
        f,
        "usage: tilewave bench layer [--in-process W] (--model NAME | --hidden H --ffn F\n"
        "                            --experts E --topk K) [--tokens T[,T...]] [--router R]\n\n"
        "The whole MoE layer, tw_moe_layer, against the sequential layer in the same process\n"
        "on the same inputs: permute + copy all-to-all (one GPU) + cuBLAS GEMM1 (per-group\n"
        "loop or grouped, the faster shown) + SwiGLU + cuBLAS GEMM2 + copy all-to-all +\n"
        "weighted sum; W ranks (default 1) as threads on GPU 0. Columns: ours, sequential,\n"
        "speedup, ours' GEMM1 + SwiGLU alone and GEMM2 alone (us, TFLOP/s), dispatch alone and\n"
        "combine alone (us, GB/s), ideal = max(GEMM1 + GEMM2, dispatch + combine), eff = ideal\n"
        "/ ours, each rank's device memory (tw_context_memory_get; the sequential layer's\n"
        "buffers, both sized for the worst case of the batch), and err: the normwise\n"
        "difference of the sequential outputs to ours (max over ranks and both forms, before\n"
        "and after timing); above --tol the point FAILS and the command exits 1.\n"
        "Default tokens/rank 4096, router balanced.\n\n");
  fprintf(f,
          "  --model NAME        preset (tilewave plan --list-models: deepseek-v3,\n"
          "                      qwen3-235b-a22b, gpt-oss-120b, mixtral-8x22b, ...); shape flags\n"
          "                      given with it override its fields\n"
          "  --hidden H --ffn F --experts E --topk K   the shape (E routed experts in all)\n"
          "  --tokens T[,T...]   tokens per rank\n"
          "  --router R          balanced | moderate_skew | stress_skew | target:R_EXPERT | hot\n"
          "                      (hot: balanced with expert 0 in every token's choices)\n"
          "  --in-process W      W ranks (1..8) on GPU 0 (default 1); experts must divide by W\n"
          "  --sm-budget B       SMs each rank's calls may occupy (default the GPU's SMs / W)\n"
          "  --dispatch-ctas N   bench layer: ours' copy CTAs beside GEMM1 (default 0: the\n"
          "                      model's; -1: the dispatch before GEMM1)\n"
          "  --capacity N|auto   bench layer: also the capturable layer (a context with\n"
          "                      dispatch_capacity N rows per expert and source; auto: the\n"
          "                      routing's largest group), its bits checked against ours\n"
          "                      (default 0: not run)\n"
          "  --iters N           timed rounds (default 20)\n"
          "  --warmup N          untimed rounds (default 3)\n"
          "  --delay-us U        device delay before each sample (default 300)\n"
          "  --seed S            routing and input seed (default 1)\n"
          "  --tol X             largest normwise difference that passes (default 2e-2)\n");
}

static int twl_main(int argc, char** argv, int dispatch) {
  const char* cmd = dispatch ? "tilewave bench dispatch" : "tilewave bench layer";
  twl_opts o;
  memset(&o, 0, sizeof o);
  o.dispatch = dispatch;
  o.router.router = -1;
  o.world = 1;
  o.iters = 20, o.warmup = 3, o.delay_us = 300, o.tol = 2e-2, o.seed = 1;
  tw_cli_arg args[] = {
      tw__cli_string("--model", &o.model),
      tw__cli_hidden(&o.hidden),
      tw__cli_ffn(&o.ffn),
      tw__cli_experts(&o.experts),
      tw__cli_topk(&o.topk),
      tw__cli_tokens_list(o.tokens, TWB_MAX_TOKENS_LIST, &o.ntokens),
      tw__cli_custom("--router", &o.router, twl_parse_router),
      tw__cli_int("--in-process", &o.world, 1, 8),
      tw__cli_int("--sm-budget", &o.sm_budget, 2, 100000),
      tw__cli_int("--dispatch-ctas", &o.dispatch_ctas, -1, 100000),
      tw__cli_custom("--capacity", &o.capacity, twl_parse_capacity),
      tw__cli_iters(&o.iters),
      tw__cli_warmup(&o.warmup),
      tw__cli_delay_us(&o.delay_us),
      tw__cli_seed(&o.seed),
      tw__cli_double("--tol", &o.tol, 0.0, INFINITY, 1),
  };
  const int rc = tw__cli_parse(cmd, argc, argv, args, (int)(sizeof args / sizeof args[0]),
                               twl_usage, &dispatch);
  if (rc != 0) return rc == 1 ? 0 : rc;
  twb_point base;
  memset(&base, 0, sizeof base);
  const char* model = o.model ? o.model : dispatch && !o.hidden ? "deepseek-v3" : NULL;
  if (model) {
    tw_problem p = TW_PROBLEM_INIT;
    if (tw_problem_preset(model, &p) != TW_SUCCESS)
      return tw__cli_usage_error(cmd, "--model: %s", tw_last_error());
    base.hidden = p.hidden, base.ffn = p.ffn, base.experts = p.experts, base.topk = p.top_k;
    snprintf(base.name, sizeof base.name, "%s", model);
  } else {
    snprintf(base.name, sizeof base.name, "-");
    if (dispatch && o.ffn == 0) base.ffn = 64; /* the dispatch does not use F */
  }
  if (o.hidden) base.hidden = o.hidden;
  if (o.ffn) base.ffn = o.ffn;
  if (o.experts) base.experts = o.experts;
  if (o.topk) base.topk = o.topk;
  if (!base.hidden || !base.ffn || !base.experts || !base.topk)
    return tw__cli_usage_error(
        cmd, dispatch ? "a shape needs --hidden, --experts and --topk (or --model)"
                      : "give --model NAME or all of --hidden, --ffn, --experts "
                        "and --topk");
  /* The layer's kernels: GEMM1's K slice and the producer's K are 64 columns. */
  if (!dispatch && (base.hidden % 64 != 0 || base.ffn % 64 != 0))
    return tw__cli_usage_error(cmd, "hidden %d and ffn %d must be multiples of 64 for the layer",
                               base.hidden, base.ffn);
  if (dispatch && base.ffn % 64 != 0)
    return tw__cli_usage_error(cmd, "ffn %d must be a multiple of 64 (the context's producer)",
                               base.ffn);
  static const int dispatch_tokens[5] = {1024, 2048, 4096, 8192, 16384};
  static const int layer_tokens[1] = {4096};
  const int* toks = o.ntokens ? o.tokens : dispatch ? dispatch_tokens : layer_tokens;
  const int ntoks = o.ntokens ? o.ntokens : dispatch ? 5 : 1;
  int routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_STRESS_SKEW, TWB_ROUTER_HOT};
  int nrouters = dispatch ? 3 : 1;
  if (o.router.router >= 0) { /* given (TWB_ROUTER_HOT included) */
    routers[0] = o.router.router;
    nrouters = 1;
  }
  twb_point* pts = (twb_point*)calloc((size_t)ntoks * 3, sizeof(twb_point));
  if (pts == NULL) return 1;
  int n = 0;
  for (int ti = 0; ti < ntoks; ti++)
    for (int ri = 0; ri < nrouters; ri++) {
      twb_point pt = base;
      pt.tokens = toks[ti];
      pt.router = routers[ri];
      pt.router_param = routers[ri] == TW_ROUTER_TARGET ? o.router.param : 0.0;
      pt.index = n + 1;
      tw_problem p = TW_PROBLEM_INIT;
      p.world_size = o.world;
      p.hidden = pt.hidden, p.ffn = pt.ffn, p.experts = pt.experts, p.top_k = pt.topk;
      p.max_tokens = pt.tokens;
      if (tw_problem_validate(&p) != TW_SUCCESS) {
        free(pts);
        return tw__cli_usage_error(cmd, "%s", tw_last_error());
      }
      pts[n++] = pt;
    }
  const int ret = twl_run_points(&o, pts, n);
  free(pts);
  return ret;
}

int tw_cli_bench_layer(int argc, char** argv) {
  return twl_main(argc, argv, 0);
}

int tw_cli_bench_dispatch(int argc, char** argv) {
  return twl_main(argc, argv, 1);
}
