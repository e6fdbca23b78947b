/*
 * cmd_trace.c: `tilewave trace`: one call recorded with device timestamps and written as Chrome
 * trace-event / Perfetto JSON (docs/trace.md): a GEMM2 + combine (--op combine, the default), a
 * dispatch (--op dispatch) or a whole layer (--op layer: dispatch, GEMM1 + SwiGLU, GEMM2 +
 * combine). W ranks run as threads of this process on GPU 0 over an in-process team (the pieces
 * of `bench --in-process`, bench_team.c): each rank makes --warmup untraced calls, then one traced
 * call (its context's trace buffer on, src/core/trace.h), whose output (the combine's and the
 * layer's out, the dispatch's expert-input rows) must equal the untraced one bit for bit; the
 * records of every rank become one file (harness/trace_json.h), times relative to the earliest
 * record, the ranks sharing the GPU's clock.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h" /* TW_GEMM1_TN */
#include "plan.h"
#include "runtime.h"
#include "team.h"
#include "tilewave.h"
#include "trace_json.h"

enum { TWTR_COMBINE = 0, TWTR_DISPATCH = 1, TWTR_LAYER = 2 };
static const char* const kOpName[3] = {"combine", "dispatch", "layer"};

typedef struct twtr_rank {
  twb_team_job job; /* first: twb_team_run fills it */
  const twb_opts* o;
  const twb_point* pt;
  int op;           /* TWTR_* */
  int64_t capacity; /* --capacity, 0: from the plan */
  /* out */
  tw_trace_record* records;
  int64_t count, dropped;
  tw__launch_record launch;
  int32_t num_tiles, total_units, coalesce, schedule, tm, tn;
  int64_t capacity_used;
  double predicted_us, call_us;
  tw_tile* tiles; /* (num_tiles) the plan's list, copied */
  int32_t num_gemm1_tiles, plan_c;
  tw_tile* gemm1_tiles; /* (num_gemm1_tiles) the layer's GEMM1 list, copied */
  int64_t wrong;        /* elements where the traced output differs from the untraced one */
  char device[256];
} twtr_rank;

#define TWTR_TRY(expr)                   \
  do {                                   \
    st = (expr);                         \
    if (st != TW_SUCCESS) goto teardown; \
  } while (0)

/* One call of the rank (the default options: the overlapped call), after --delay-us of idle
 * device, then the collective check. */
static tw_status twtr_call(const twb_team_rank* t, const twb_opts* o) {
  if (o->delay_us > 0) TW_TRY(tw__bench_delay(t->s, o->delay_us));
  TW_TRY(tw_moe_combine(t->ctx, t->dp, t->in, t->w2, t->call_out, t->s));
  return tw_context_check(t->ctx);
}

static void* twtr_rank_main(void* arg) {
  twtr_rank* r = (twtr_rank*)arg;
  const twb_opts* o = r->o;
  tw_status st = TW_SUCCESS;
  twb_team_rank t;
  uint16_t *h_ref = NULL, *h_tr = NULL;
  TWTR_TRY(twb_team_rank_setup(&t, o, r->pt, &r->job, 1));
  TWTR_TRY(tw__device_plan_work(t.dp, &r->num_tiles, &r->total_units));
  r->coalesce = t.plan->coalesce;
  r->plan_c = t.plan->comm_ctas;
  r->tm = t.plan->tm, r->tn = t.plan->tn;
  r->schedule = t.plan->schedule;
  r->predicted_us = t.plan->predicted_us;
  r->tiles = (tw_tile*)malloc(sizeof(tw_tile) * (size_t)(r->num_tiles + 1));
  h_ref = (uint16_t*)malloc(t.n_out * 2 + 2);
  h_tr = (uint16_t*)malloc(t.n_out * 2 + 2);
  if (r->tiles == NULL || h_ref == NULL || h_tr == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: host memory");
    goto teardown;
  }
  if (r->num_tiles > 0) memcpy(r->tiles, t.plan->tiles, sizeof(tw_tile) * (size_t)r->num_tiles);
  if (r->job.rank == 0) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
      snprintf(r->device, sizeof r->device, "%s", prop.name);
  }
  /* Untraced calls: lazy loading, caches and clocks settle; the last one's output is the
   * reference. */
  for (int i = 0; i < o->warmup; i++) TWTR_TRY(twtr_call(&t, o));
  TWTR_TRY(twb_team_output(&t, h_ref));
  const int64_t cap = r->capacity > 0 ? r->capacity
                                      : twb_trace_capacity(r->num_tiles, r->total_units,
                                                           r->job.world, t.info.sm_budget);
  r->capacity_used = cap;
  TWTR_TRY(tw__context_trace(t.ctx, cap));
  TWTR_TRY(tw__context_trace_clear(t.ctx, t.s));
  TWTR_TRY(tw__team_barrier(t.sums)); /* every rank's buffer is on before any traced call */
  TWTR_TRY(twtr_call(&t, o));
  tw_combine_timings tm;
  TWTR_TRY(tw_context_timings(t.ctx, &tm));
  r->call_us = (double)tm.total_ms * 1e3;
  TWTR_TRY(tw__context_last_launch(t.ctx, &r->launch));
  r->records = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
  if (r->records == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: host memory for %lld records",
                  (long long)cap);
    goto teardown;
  }
  TWTR_TRY(tw__context_trace_read(t.ctx, r->records, cap, &r->count, &r->dropped));
  TWTR_TRY(twb_team_output(&t, h_tr));
  const size_t n_check = (size_t)r->pt->tokens * t.problem.hidden;
  for (size_t i = 0; i < n_check; i++) r->wrong += h_ref[i] != h_tr[i];
  TWTR_TRY(tw__context_trace(t.ctx, 0));
teardown:
  twb_team_done(&r->job, st);
  twb_team_rank_free(&t);
  free(h_ref);
  free(h_tr);
  return NULL;
}

/* A rank of a dispatch or layer trace: the engine's inputs on the device (token rows x, the
 * routing's ids and weights, the local experts' w13 and w2), the context (dispatch or layer) and
 * the host plan the call will build (the layer's config: its budget, --comm-ctas, --coalesce). */
typedef struct twtr_engine {
  tw__team* sums;
  tw_problem problem;
  tw_context_t ctx;
  tw_context_info info;
  tw_device_plan_t dp;
  tw_routing_t rt;
  tw_plan_t plan;
  tw_plan_config pc;
  int32_t tokens;
  void *x, *ids, *w, *w13, *w2, *out;
  cudaStream_t s;
} twtr_engine;

static tw_status twtr_engine_setup(twtr_engine* e, const twtr_rank* r) {
  memset(e, 0, sizeof *e);
  const twb_opts* o = r->o;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaStreamCreateWithFlags(&e->s, cudaStreamNonBlocking) != cudaSuccess) {
    e->s = NULL;
    return tw__fail(TW_ERR_CUDA, "tilewave trace: rank %d: no stream on GPU 0", r->job.rank);
  }
  TW_TRY(tw__team_local_join(r->job.sums, r->job.rank, &e->sums));
  e->problem = twb_problem_of(o, r->pt, r->job.world);
  const tw_problem* p = &e->problem;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.sm_budget = o->sm_budget;
  cc.timing = 1;
  cc.dispatch = 1;
  cc.layer = r->op == TWTR_LAYER;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw_context_create_on_team(p, r->job.team, r->job.rank, &cc, &e->ctx));
  TW_TRY(tw_context_info_get(e->ctx, &e->info));
  TW_TRY(tw_device_plan_create(e->ctx, &e->dp));
  TW_TRY(tw_routing_generate(p, (tw_router)r->pt->router, r->pt->router_param, r->pt->tokens,
                             o->seed, &e->rt));
  const int32_t* ids = NULL;
  const float* ws = NULL;
  TW_TRY(tw_routing_rank(e->rt, r->job.rank, &e->tokens, &ids, &ws));
  e->pc = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  e->pc.comm_ctas = o->comm_ctas;
  e->pc.coalesce = o->coalesce;
  e->pc.sm_budget = e->info.sm_budget;
  e->pc.dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw_plan_create(p, e->rt, r->job.rank, &e->pc, &e->plan));
  const size_t T = (size_t)p->max_tokens, H = (size_t)p->hidden, F = (size_t)p->ffn;
  const size_t K = (size_t)p->top_k, E = (size_t)(p->experts / p->world_size);
  if (cudaMalloc(&e->x, T * H * 2 + 16) != cudaSuccess ||
      cudaMalloc(&e->ids, T * K * 4 + 16) != cudaSuccess ||
      cudaMalloc(&e->w, T * K * 4 + 16) != cudaSuccess ||
      cudaMalloc(&e->w13, E * 2 * F * H * 2 + 16) != cudaSuccess ||
      cudaMalloc(&e->w2, E * H * F * 2 + 16) != cudaSuccess ||
      cudaMalloc(&e->out, T * H * 2 + 16) != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: rank %d: device memory", r->job.rank);
  TW_TRY(twb_upload_random(e->x, T * H, 31 + (uint64_t)r->job.rank));
  TW_TRY(twb_upload_random(e->w13, E * 2 * F * H, 2000 + (uint64_t)r->job.rank));
  TW_TRY(twb_upload_random(e->w2, E * H * F, 3000 + (uint64_t)r->job.rank));
  const size_t n_ids = (size_t)e->tokens * K;
  if (n_ids > 0 && (cudaMemcpy(e->ids, ids, n_ids * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
                    cudaMemcpy(e->w, ws, n_ids * 4, cudaMemcpyHostToDevice) != cudaSuccess))
    return tw__fail(TW_ERR_CUDA, "tilewave trace: rank %d: uploading the routing", r->job.rank);
  return TW_SUCCESS;
}

static void twtr_engine_free(twtr_engine* e) {
  if (e->s) cudaStreamSynchronize(e->s);
  tw_plan_destroy(e->plan);
  tw_routing_destroy(e->rt);
  tw_device_plan_destroy(e->dp);
  tw_context_destroy(e->ctx); /* collective: every rank gets here, failed or not */
  void* dev[] = {e->x, e->ids, e->w, e->w13, e->w2, e->out};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  if (e->sums) e->sums->ops->release(e->sums);
  if (e->s) cudaStreamDestroy(e->s);
  memset(e, 0, sizeof *e);
}

/* One dispatch or layer call after --delay-us of idle device, then the collective check; its
 * output (the layer's out, or the dispatch's rows of this rank's plan) to `host` (n elements). */
static tw_status twtr_engine_call(twtr_engine* e, const twtr_rank* r, uint16_t* host, size_t* n) {
  const twb_opts* o = r->o;
  if (o->delay_us > 0) TW_TRY(tw__bench_delay(e->s, o->delay_us));
  const void* src = e->out;
  if (r->op == TWTR_LAYER) {
    tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
    lo.plan_config = &e->pc;
    TW_TRY(tw_moe_layer_ex(e->ctx, e->dp, e->x, e->ids, TW_INDEX_INT32, (const float*)e->w,
                           e->tokens, e->w13, e->w2, e->out, &lo, e->s));
    *n = (size_t)e->tokens * e->problem.hidden;
  } else {
    tw_dispatch_options dopt = TW_DISPATCH_OPTIONS_INIT;
    dopt.plan_config = &e->pc;
    void* rows = NULL;
    TW_TRY(tw_moe_dispatch_ex(e->ctx, e->dp, e->x, e->ids, TW_INDEX_INT32, (const float*)e->w,
                              e->tokens, &rows, &dopt, e->s));
    tw_plan_summary sum;
    TW_TRY(tw_device_plan_summary_get(e->dp, &sum));
    *n = (size_t)sum.rows * e->problem.hidden;
    src = rows;
  }
  TW_TRY(tw_context_check(e->ctx));
  if (*n > 0 && cudaMemcpy(host, src, *n * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tilewave trace: reading the call's output");
  return TW_SUCCESS;
}

static void* twtr_engine_main(void* arg) {
  twtr_rank* r = (twtr_rank*)arg;
  const twb_opts* o = r->o;
  tw_status st = TW_SUCCESS;
  twtr_engine e;
  uint16_t *h_ref = NULL, *h_tr = NULL;
  size_t n_ref = 0, n_tr = 0;
  TWTR_TRY(twtr_engine_setup(&e, r));
  {
    int64_t rows_max = 0;
    TWTR_TRY(tw_context_dispatch_buffer(e.ctx, NULL, &rows_max));
    const size_t cap = (size_t)rows_max > (size_t)e.problem.max_tokens
                           ? (size_t)rows_max
                           : (size_t)e.problem.max_tokens;
    h_ref = (uint16_t*)malloc(cap * e.problem.hidden * 2 + 2);
    h_tr = (uint16_t*)malloc(cap * e.problem.hidden * 2 + 2);
  }
  if (h_ref == NULL || h_tr == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: host memory");
    goto teardown;
  }
  if (r->job.rank == 0) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
      snprintf(r->device, sizeof r->device, "%s", prop.name);
  }
  for (int i = 0; i < (o->warmup > 0 ? o->warmup : 1); i++)
    TWTR_TRY(twtr_engine_call(&e, r, h_ref, &n_ref));
  {
    /* Room for the combine's records of the plan, GEMM1's two per tile (bands x column tiles at
     * most) and the dispatch's: per scan CTA 2 per pass, per copy CTA 4, the wait 1 + W. */
    const struct tw_plan* hp = e.plan;
    const int64_t g1 = (int64_t)hp->num_bands * ((e.problem.ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN);
    int32_t tiles = 0, units = 0;
    TWTR_TRY(tw__device_plan_work(e.dp, &tiles, &units));
    const int64_t cap = r->capacity > 0
                            ? r->capacity
                            : twb_trace_capacity(tiles, units, r->job.world, e.info.sm_budget) +
                                  2 * g1 + 8 * (int64_t)e.info.sm_budget + 1 + r->job.world;
    r->capacity_used = cap;
    TWTR_TRY(tw__context_trace(e.ctx, cap));
    TWTR_TRY(tw__context_trace_clear(e.ctx, e.s));
    TWTR_TRY(tw__team_barrier(e.sums)); /* every rank's buffer is on before any traced call */
    TWTR_TRY(twtr_engine_call(&e, r, h_tr, &n_tr));
    TWTR_TRY(tw__context_last_launch(e.ctx, &r->launch));
    if (r->op == TWTR_DISPATCH) { /* no combine ran: its P, C, reduction are not this call's */
      r->launch.producer_ctas = r->launch.consumer_ctas = r->launch.reduce_ctas = 0;
      r->launch.gemm1_ctas = 0;
    }
    r->records = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
    if (r->records == NULL) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: host memory for %lld records",
                    (long long)cap);
      goto teardown;
    }
    TWTR_TRY(tw__context_trace_read(e.ctx, r->records, cap, &r->count, &r->dropped));
    tw_plan_summary sum;
    TWTR_TRY(tw_device_plan_summary_get(e.dp, &sum));
    r->plan_c = sum.comm_ctas;
    r->coalesce = sum.coalesce;
    r->schedule = sum.schedule;
    r->predicted_us = sum.predicted_us;
    r->tm = hp->tm, r->tn = hp->tn;
    /* The call's device time: its first record to its last (the delay before it records
     * nothing). */
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int64_t i = 0; i < r->count; i++) {
      if (r->records[i].ns < lo) lo = r->records[i].ns;
      if (r->records[i].ns > hi) hi = r->records[i].ns;
    }
    r->call_us = r->count > 0 ? (double)(hi - lo) / 1e3 : 0.0;
    /* The combine's tiles and units exist only where the layer ran it. */
    if (r->op == TWTR_LAYER) {
      TWTR_TRY(tw__device_plan_work(e.dp, &r->num_tiles, &r->total_units));
      const tw_tile* g1t = NULL;
      TWTR_TRY(tw__device_plan_gemm1_tiles(e.dp, &g1t, &r->num_gemm1_tiles));
      r->tiles = (tw_tile*)malloc(sizeof(tw_tile) * (size_t)(r->num_tiles + 1));
      r->gemm1_tiles = (tw_tile*)malloc(sizeof(tw_tile) * (size_t)(r->num_gemm1_tiles + 1));
      if (r->tiles == NULL || r->gemm1_tiles == NULL) {
        st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tilewave trace: host memory");
        goto teardown;
      }
      /* The call's plan is the host planner's from the same counts and config (test_layer
       * checks it): its tile list gives the tiles' args, where the counts agree. */
      if (hp->num_tiles == r->num_tiles && r->num_tiles > 0)
        memcpy(r->tiles, hp->tiles, sizeof(tw_tile) * (size_t)r->num_tiles);
      else {
        free(r->tiles);
        r->tiles = NULL;
      }
      if (r->num_gemm1_tiles > 0)
        memcpy(r->gemm1_tiles, g1t, sizeof(tw_tile) * (size_t)r->num_gemm1_tiles);
    }
  }
  if (n_tr != n_ref) {
    st = tw__fail(TW_ERR_INTERNAL,
                  "tilewave trace: rank %d: the traced call's output has %zu "
                  "elements, the untraced one's %zu",
                  r->job.rank, n_tr, n_ref);
    goto teardown;
  }
  for (size_t i = 0; i < n_tr; i++) r->wrong += h_ref[i] != h_tr[i];
  TWTR_TRY(tw__context_trace(e.ctx, 0));
teardown:
  twb_team_done(&r->job, st);
  twtr_engine_free(&e);
  free(h_ref);
  free(h_tr);
  return NULL;
}

static void twtr_usage(FILE* f, void* unused) {
  (void)unused;
  fprintf(f,
          "usage: tilewave trace --out FILE.json [options]\n\n"
          "Records one call with device timestamps (%%globaltimer) and writes it as Chrome\n"
          "trace-event / Perfetto JSON: a process per rank, a track per CTA of each role; per\n"
          "producer tile its begin and publish, per transfer unit its claim, band wait,\n"
          "credit wait and copy, the announcements, per reduction CTA its wait for the\n"
          "arrivals and its end; for a dispatch per scan CTA its count and place passes, per\n"
          "copy CTA its credit wait and the rows it sent, the arrivals, the wait for every\n"
          "source's rows; for a layer also per GEMM1 tile its begin and store. The plan's C,\n"
          "P, budget, schedule and shape are in the file's metadata. W ranks run as threads\n"
          "of this process on GPU 0 (an in-process team, as `bench --in-process`): --warmup\n"
          "untraced calls, then one traced call, whose output is checked against the untraced\n"
          "one bit for bit. Open the file in https://ui.perfetto.dev or chrome://tracing\n"
          "(docs/trace.md). Needs one GPU.\n\n"
          "  --out FILE          the JSON file to write (required)\n"
          "  --op OP             combine (default: GEMM2 + combine), dispatch, or layer\n"
          "                      (dispatch, GEMM1 + SwiGLU, GEMM2 + combine; reduce dataflow)\n"
          "shape (GEMM2 K = F, N = H; default: tokens/rank 8192, F 2048, H 4096, E 16, top-2,\n"
          "       balanced):\n"
          "  --model NAME        preset (tilewave plan --help lists them)\n"
          "  --hidden H --ffn F --experts E --topk K\n"
          "  --tile-m TM --tile-n TN  GEMM2 tile (default 128 x chosen from H)\n"
          "  --tokens T          tokens per rank\n"
          "  --router R          balanced | moderate_skew | stress_skew | target:R_EXPERT\n"
          "  --seed S            routing and input seed (default 1)\n"
          "policy:\n"
          "  --dataflow D        reduce (default) or add; sets TW_COMBINE_DATAFLOW\n"
          "  --comm-ctas C       force C (default: the model's choice)\n"
          "  --coalesce MGB      force mgb (default: the model's choice)\n"
          "  --in-process W      ranks (1..8, default 2) as threads on GPU 0\n"
          "  --sm-budget B       SMs each rank's call may occupy (default the GPU's SMs / W)\n"
          "measurement:\n"
          "  --warmup N          untraced calls before the traced one (default 5)\n"
          "  --delay-us U        device delay before each call (default 300), so that every\n"
          "                      kernel of the call is enqueued before it starts\n"
          "  --capacity N        trace records per rank (default: enough for the plan); a\n"
          "                      full buffer drops records and the file says how many\n");
}

int tw_cli_trace(int argc, char** argv) {
  const char* cmd = "tilewave trace";
  twb_opts o;
  memset(&o, 0, sizeof o);
  o.seed = 1;
  o.warmup = 5;
  o.delay_us = 300;
  o.in_process = 2;
  const char* out = NULL;
  int tokens = 8192, dataflow = -1;
  int64_t seed = 1, capacity = 0;
  tw_cli_router router = {-1, 0.0, NULL};
  tw_cli_arg args[24];
  int n = 0;
  const char* op_name = "combine";
  args[n++] = tw__cli_string("--out", &out);
  args[n++] = tw__cli_string("--op", &op_name);
  args[n++] = tw__cli_string("--model", &o.model);
  args[n++] = tw__cli_hidden(&o.hidden);
  args[n++] = tw__cli_ffn(&o.ffn);
  args[n++] = tw__cli_experts(&o.experts);
  args[n++] = tw__cli_topk(&o.topk);
  args[n++] = tw__cli_tokens(&tokens);
  args[n++] = tw__cli_tile_m(&o.tile_m);
  args[n++] = tw__cli_tile_n(&o.tile_n);
  args[n++] = tw__cli_router_arg(&router);
  args[n++] = tw__cli_seed(&seed);
  args[n++] = tw__cli_dataflow(&dataflow);
  args[n++] = tw__cli_comm_ctas(&o.comm_ctas);
  args[n++] = tw__cli_coalesce(&o.coalesce);
  args[n++] = tw__cli_int("--in-process", &o.in_process, 1, 8);
  args[n++] = tw__cli_int("--sm-budget", &o.sm_budget, 2, 100000);
  args[n++] = tw__cli_warmup(&o.warmup);
  args[n++] = tw__cli_delay_us(&o.delay_us);
  args[n++] = tw__cli_i64("--capacity", &capacity, 1, (long long)1 << 28);
  const int rc = tw__cli_parse(cmd, argc, argv, args, n, twtr_usage, NULL);
  if (rc != 0) return rc == 1 ? 0 : rc;
  if (out == NULL) return tw__cli_usage_error(cmd, "--out FILE.json is required");
  int op = -1;
  for (int i = 0; i < 3; i++)
    if (strcmp(op_name, kOpName[i]) == 0) op = i;
  if (op < 0) return tw__cli_usage_error(cmd, "--op %s; give combine, dispatch or layer", op_name);
  if (op != TWTR_COMBINE && dataflow == TW_DATAFLOW_ADD)
    return tw__cli_usage_error(cmd, "--op %s runs the reduce dataflow only; drop --dataflow add",
                               op_name);
  o.seed = (uint64_t)seed;
  if (dataflow >= 0) setenv("TW_COMBINE_DATAFLOW", tw__dataflow_name(dataflow), 1);

  twb_point pt = {4096, 2048, 16, 2, tokens, TW_ROUTER_BALANCED, 0.0, "", 0};
  if (o.model) {
    tw_problem p = TW_PROBLEM_INIT;
    if (tw_problem_preset(o.model, &p) != TW_SUCCESS) {
      fprintf(stderr, "%s: %s\n", cmd, tw_last_error());
      return 2;
    }
    pt.hidden = p.hidden, pt.ffn = p.ffn, pt.experts = p.experts, pt.topk = p.top_k;
  }
  if (o.hidden) pt.hidden = o.hidden;
  if (o.ffn) pt.ffn = o.ffn;
  if (o.experts) pt.experts = o.experts;
  if (o.topk) pt.topk = o.topk;
  if (router.router >= 0) pt.router = router.router, pt.router_param = router.param;
  const int W = o.in_process;
  /* The shape planned on the host first: a problem the planner rejects is a usage error, found
   * before any GPU is looked for. */
  {
    const tw_problem p = twb_problem_of(&o, &pt, W);
    tw_routing_t rt = NULL;
    tw_plan_t plan = NULL;
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.comm_ctas = o.comm_ctas;
    pc.coalesce = o.coalesce;
    tw_status ps =
        tw_routing_generate(&p, (tw_router)pt.router, pt.router_param, pt.tokens, o.seed, &rt);
    if (ps == TW_SUCCESS) ps = tw_plan_create(&p, rt, 0, &pc, &plan);
    char why[600];
    snprintf(why, sizeof why, "%s", tw_last_error()); /* before the destroys clear it */
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
    if (ps != TW_SUCCESS) {
      fprintf(stderr, "%s: %s: %s\n", cmd, tw_status_string(ps), why);
      return 2;
    }
  }

  /* Nothing has touched CUDA yet: the GPU check forks, and the team needs its queues. */
  if (twb_gpus_present() < 1) {
    fprintf(stderr,
            "%s: no GPU found; a trace records a call on the GPU (W ranks on GPU 0): run it on a "
            "machine with a GPU\n",
            cmd);
    return 1;
  }
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  FILE* f = fopen(out, "w");
  if (f == NULL) {
    fprintf(stderr, "%s: cannot write %s\n", cmd, out);
    return 1;
  }
  fprintf(stderr, "[trace] %s, %d rank(s) on GPU 0: tokens/rank %d K %d N %d E %d top-%d %s\n",
          kOpName[op], W, pt.tokens, pt.ffn, pt.hidden, pt.experts, pt.topk,
          tw__cli_router_name(pt.router));
  twtr_rank ranks[8];
  memset(ranks, 0, sizeof ranks);
  for (int r = 0; r < W; r++)
    ranks[r].o = &o, ranks[r].pt = &pt, ranks[r].capacity = capacity, ranks[r].op = op;
  tw_status st = twb_team_run(W, op == TWTR_COMBINE ? twtr_rank_main : twtr_engine_main, ranks,
                              sizeof ranks[0]);
  int failed = 0;
  if (st != TW_SUCCESS) {
    fprintf(stderr, "%s: %s: %s\n", cmd, tw_status_string(st), tw_last_error());
    failed = 1;
  }
  if (!failed) failed = twb_team_failures(cmd, W, ranks, sizeof ranks[0]) > 0;
  tw__trace_rank tr[8];
  memset(tr, 0, sizeof tr);
  for (int r = 0; r < W && !failed; r++) {
    const twtr_rank* x = &ranks[r];
    tr[r].rank = r;
    tr[r].records = x->records;
    tr[r].count = x->count;
    tr[r].dropped = x->dropped;
    tr[r].budget = x->launch.budget;
    tr[r].producer_ctas = x->launch.producer_ctas;
    tr[r].consumer_ctas = x->launch.consumer_ctas;
    tr[r].reduce_ctas = x->launch.reduce_ctas;
    tr[r].num_tiles = x->num_tiles;
    tr[r].total_units = x->total_units;
    tr[r].coalesce = x->coalesce;
    tr[r].schedule = tw__cli_schedule_name(x->schedule);
    tr[r].predicted_us = x->predicted_us;
    tr[r].tiles = x->tiles;
    tr[r].plan_comm_ctas = x->plan_c;
    tr[r].num_gemm1_tiles = x->num_gemm1_tiles;
    tr[r].gemm1_tiles = x->gemm1_tiles;
    tr[r].gemm1_ctas = x->launch.gemm1_ctas;
  }
  if (!failed) {
    tw__trace_info info;
    memset(&info, 0, sizeof info);
    info.model = o.model;
    info.hidden = pt.hidden, info.ffn = pt.ffn, info.experts = pt.experts, info.top_k = pt.topk;
    info.tokens = pt.tokens, info.world = W;
    info.tile_m = ranks[0].tm, info.tile_n = ranks[0].tn;
    info.router = tw__cli_router_name(pt.router);
    int32_t df = TW_DATAFLOW_REDUCE;
    info.dataflow = op != TWTR_COMBINE ? tw__dataflow_name(TW_DATAFLOW_REDUCE)
                    : tw__dataflow_resolve(cmd, TW_DATAFLOW_DEFAULT, &df) == TW_SUCCESS
                        ? tw__dataflow_name(df)
                        : NULL;
    info.team = "in-process";
    info.device = ranks[0].device;
    info.warmup = o.warmup;
    info.op = kOpName[op];
    tw__trace_stats ts;
    if (tw__trace_write_json(f, &info, tr, W, &ts) != 0) {
      fprintf(stderr, "%s: writing %s failed\n", cmd, out);
      failed = 1;
    } else {
      printf("trace of one %s call, %d rank(s) on GPU 0 (%s), written to %s\n", kOpName[op], W,
             info.device, out);
      printf(
          "| rank | budget | P | C | plan C | reduce CTAs | GEMM1 CTAs | tiles | units | GEMM1 "
          "tiles | records | dropped | call us |\n");
      printf(
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
          "---: |\n");
      for (int r = 0; r < W; r++)
        printf("| %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %lld | %lld | %.1f |\n", r,
               tr[r].budget, tr[r].producer_ctas, tr[r].consumer_ctas, tr[r].plan_comm_ctas,
               tr[r].reduce_ctas, tr[r].gemm1_ctas, tr[r].num_tiles, tr[r].total_units,
               tr[r].num_gemm1_tiles, (long long)tr[r].count, (long long)tr[r].dropped,
               ranks[r].call_us);
      printf(
          "spans: %lld tiles, %lld units, %lld consumer and %lld reduction CTAs; %lld GEMM1 "
          "tiles, %lld scan, %lld send CTAs, %lld waits for rows; %lld partial\n",
          (long long)ts.tiles, (long long)ts.units, (long long)ts.consumer_ctas,
          (long long)ts.reduce_ctas, (long long)ts.gemm1_tiles, (long long)ts.scan_ctas,
          (long long)ts.send_ctas, (long long)ts.recv_waits, (long long)ts.partial);
      printf("call us: %s\n", op == TWTR_COMBINE ? "the combine's events (tw_context_timings)"
                                                 : "from the rank's first record to its last");
      printf("open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load)\n");
    }
    for (int r = 0; r < W; r++) {
      if (ranks[r].dropped > 0)
        fprintf(stderr,
                "%s: rank %d: %lld records did not fit in %lld (--capacity): the trace is "
                "incomplete\n",
                cmd, r, (long long)ranks[r].dropped, (long long)ranks[r].capacity_used);
      if (ranks[r].wrong != 0) {
        fprintf(stderr,
                "%s: rank %d: the traced call's output differs from the untraced one in "
                "%lld elements\n",
                cmd, r, (long long)ranks[r].wrong);
        failed = 1;
      }
    }
  }
  if (fclose(f) != 0) failed = 1;
  if (failed) remove(out); /* no half-written file that looks like a trace */
  for (int r = 0; r < W; r++) {
    free(ranks[r].records);
    free(ranks[r].tiles);
    free(ranks[r].gemm1_tiles);
  }
  return failed ? 1 : 0;
}
