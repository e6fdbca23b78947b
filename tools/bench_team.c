/*
 * bench_team.c: `tilewave bench --in-process W`: the points with W ranks as threads of this
 * process on GPU 0, over an in-process team (tw_team_create), instead of one process per GPU over
 * NCCL. One GPU's memory stands in for NVLink, so the table says so and its numbers do not compare
 * with multi-GPU ones; the baselines (cuBLAS + NCCL, the copy-engine pipeline) need NCCL or two
 * GPUs and are not run. Per point: our overlapped call, the unfused call, the producer alone
 * (P = budget - C) and the consumer + reduction alone, medians of --iters calls of the slowest
 * rank after --warmup, each call after the previous has ended (tw_context_check) and
 * --delay-us of idle device; the overlapped output is checked bit for bit against the unfused one
 * on every rank (#wrong). `sweep --in-process W` times the overlapped call at every C from 1 to
 * --c-max instead, each output checked against the unfused one as well.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_common.h"
#include "bench_stats.h"
#include "cli.h"
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "progress.h"
#include "runtime.h"
#include "team.h"
#include "tilewave.h"

/* TWT_TRACED (TW_TRACE=1 only): ours with the context's trace buffer on (src/core/trace.h),
 * cleared before every call; TWT_OVERLAP_AFTER: ours again after it, trace off. */
enum { TWT_OVERLAP, TWT_UNFUSED, TWT_GEMM, TWT_COMM, TWT_TRACED, TWT_OVERLAP_AFTER, TWT_NMODES };

typedef struct twt_rank {
  twb_team_job job; /* first: twb_team_run fills it */
  const twb_opts* o;
  const twb_point* pt;
  /* out (every rank; rank 0's is printed) */
  double us[TWT_NMODES];
  int comm_ctas, coalesce, budget;
  int64_t wrong;
  int64_t traced_wrong, trace_records, trace_dropped; /* TW_TRACE=1: the traced calls */
  /* sweep: sweep_us[c - 1] at C = c for c <= cmax (the overlapped call); #wrong over all C */
  int sweep, cmax;
  double* sweep_us;
} twt_rank;

/* A deterministic bf16 pattern in [-1, 1) (the values do not matter to the timing; they make the
 * bit-for-bit check mean something). */
static uint16_t twt_bf16(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ salt * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 32;
  const float v = (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  uint32_t b;
  memcpy(&b, &v, 4);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

tw_status twb_upload_random(void* dst, size_t n, uint64_t salt) {
  uint16_t* h = (uint16_t*)malloc(n * 2 + 2);
  if (h == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
  for (size_t i = 0; i < n; i++) h[i] = twt_bf16(i, salt);
  const cudaError_t e = cudaMemcpy(dst, h, n * 2, cudaMemcpyHostToDevice);
  free(h);
  return e == cudaSuccess ? TW_SUCCESS
                          : tw__fail(TW_ERR_CUDA, "bench --in-process: %s", cudaGetErrorString(e));
}

/* One mode, timed: warmup + iters calls; the slowest rank's median in us. */
static tw_status twt_time(twt_rank* r, tw__team* sums, tw_context_t ctx, tw_device_plan_t dp,
                          const void* in, const void* w2, void* out, cudaStream_t s, int mode,
                          int comm_ctas, double* us) {
  static const tw_combine_mode kModes[TWT_NMODES] = {TW_COMBINE_OVERLAP,   TW_COMBINE_UNFUSED,
                                                     TW_COMBINE_GEMM_ONLY, TW_COMBINE_COMM_ONLY,
                                                     TW_COMBINE_OVERLAP,   TW_COMBINE_OVERLAP};
  const twb_opts* o = r->o;
  float* t = (float*)malloc(sizeof(float) * (size_t)o->iters);
  if (t == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
  tw_status st = TW_SUCCESS;
  for (int i = -o->warmup; i < o->iters && st == TW_SUCCESS; i++) {
    tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
    opt.mode = kModes[mode];
    opt.comm_ctas = comm_ctas; /* 0: the plan's */
    /* Traced: every call's records from slot 0 (the buffer never fills); outside the timed
     * region, which the context's events bound. */
    if (mode == TWT_TRACED) st = tw__context_trace_clear(ctx, s);
    if (st == TW_SUCCESS && o->delay_us > 0)
      st = tw__bench_delay(s, o->delay_us); /* idle device before the call */
    if (st == TW_SUCCESS) st = tw_moe_combine_ex(ctx, dp, in, w2, out, &opt, s);
    if (st == TW_SUCCESS) st = tw_context_check(ctx);
    tw_combine_timings tm;
    memset(&tm, 0, sizeof tm);
    if (st == TW_SUCCESS) st = tw_context_timings(ctx, &tm);
    int64_t ns = (int64_t)(tm.total_ms * 1e6);
    if (st == TW_SUCCESS) st = tw__team_max_i64(sums, &ns, 1);
    if (st == TW_SUCCESS && i >= 0) t[i] = (float)((double)ns / 1e3);
  }
  if (st == TW_SUCCESS) {
    tw__bench_stats q;
    tw__bench_stats_of(t, o->iters, &q);
    *us = q.median;
  }
  free(t);
  return st;
}

/* The output of the last call, to the host (the add dataflow's lives in the context). */
static tw_status twt_output(tw_context_t ctx, int add, void* out, uint16_t* host, size_t n) {
  void* src = out;
  if (add) TW_TRY(tw_context_output(ctx, &src));
  const cudaError_t e = cudaMemcpy(host, src, n * 2, cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? TW_SUCCESS
                          : tw__fail(TW_ERR_CUDA, "bench --in-process: %s", cudaGetErrorString(e));
}

#define TWT_TRY(expr)                    \
  do {                                   \
    st = (expr);                         \
    if (st != TW_SUCCESS) goto teardown; \
  } while (0)

tw_status twb_team_rank_setup(twb_team_rank* t, const twb_opts* o, const twb_point* pt,
                              const twb_team_job* job, int timing) {
  memset(t, 0, sizeof *t);
  tw_status st = TW_SUCCESS;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaStreamCreateWithFlags(&t->s, cudaStreamNonBlocking) != cudaSuccess) {
    t->s = NULL;
    return tw__fail(TW_ERR_CUDA, "in-process team: rank %d: no stream on GPU 0", job->rank);
  }
  TWT_TRY(tw__team_local_join(job->sums, job->rank, &t->sums));
  t->problem = twb_problem_of(o, pt, job->world);
  const tw_problem* p = &t->problem;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.sm_budget = o->sm_budget;
  cc.timing = timing;
  TWT_TRY(tw_context_create_on_team(p, job->team, job->rank, &cc, &t->ctx));
  TWT_TRY(tw_context_info_get(t->ctx, &t->info));
  TWT_TRY(tw_device_plan_create(t->ctx, &t->dp));
  TWT_TRY(
      tw_routing_generate(p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed, &t->rt));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.comm_ctas = o->comm_ctas;
  pc.coalesce = o->coalesce;
  pc.sm_budget = t->info.sm_budget;
  TWT_TRY(tw_plan_create(p, t->rt, job->rank, &pc, &t->plan));
  TWT_TRY(tw_device_plan_upload(t->dp, t->plan, t->rt, t->s));
  const size_t E = (size_t)(p->experts / p->world_size);
  const size_t n_in = (size_t)t->plan->rows * p->ffn, n_w = E * p->hidden * p->ffn;
  t->n_out = (size_t)p->max_tokens * p->hidden;
  if (cudaMalloc(&t->in, n_in * 2 + 16) != cudaSuccess ||
      cudaMalloc(&t->w2, n_w * 2 + 16) != cudaSuccess ||
      cudaMalloc(&t->out, t->n_out * 2 + 16) != cudaSuccess) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "in-process team: rank %d: device memory", job->rank);
    goto teardown;
  }
  TWT_TRY(twb_upload_random(t->in, n_in, 11 + (uint64_t)job->rank));
  TWT_TRY(twb_upload_random(t->w2, n_w, 1000 + (uint64_t)job->rank));
  t->add = t->info.dataflow == TW_DATAFLOW_ADD;
  t->call_out = t->add ? NULL : t->out;
teardown:
  return st;
}

void twb_team_rank_free(twb_team_rank* t) {
  if (t->s) cudaStreamSynchronize(t->s);
  tw_plan_destroy(t->plan);
  tw_routing_destroy(t->rt);
  tw_device_plan_destroy(t->dp);
  tw_context_destroy(t->ctx); /* collective: every rank gets here, failed or not */
  cudaFree(t->in);
  cudaFree(t->w2);
  cudaFree(t->out);
  if (t->sums) t->sums->ops->release(t->sums);
  if (t->s) cudaStreamDestroy(t->s);
  memset(t, 0, sizeof *t);
}

int twb_trace_env(void) {
  const char* v = getenv("TW_TRACE");
  return v != NULL && strcmp(v, "1") == 0;
}

int64_t twb_trace_capacity(int32_t tiles, int32_t units, int world, int budget) {
  return 2 * (int64_t)tiles + 4 * (int64_t)units + (int64_t)(2 * world + 2) * TW_MAX_COMM_CTAS +
         3 * 16 * (int64_t)budget + 1024;
}

tw_status twb_team_output(const twb_team_rank* t, uint16_t* host) {
  return twt_output(t->ctx, t->add, t->out, host, t->n_out);
}

void twb_team_done(twb_team_job* job, tw_status st) {
  if (st != TW_SUCCESS) snprintf(job->why, sizeof job->why, "%s", tw_last_error());
  job->st = st;
}

int twb_team_failures(const char* cmd, int world, const void* ranks, size_t stride) {
  int failed = 0;
  for (int r = 0; r < world; r++) {
    const twb_team_job* job = (const twb_team_job*)((const char*)ranks + (size_t)r * stride);
    if (job->st == TW_SUCCESS) continue;
    fprintf(stderr, "%s: rank %d: %s: %s\n", cmd, r, tw_status_string(job->st), job->why);
    failed++;
  }
  return failed;
}

tw_status twb_team_run(int world, void* (*fn)(void*), void* ranks, size_t stride) {
  tw_team_t team = NULL, sums = NULL;
  tw_status st = tw_team_create(world, 0, &team);
  if (st == TW_SUCCESS) st = tw_team_create(world, 0, &sums);
  if (st != TW_SUCCESS) {
    tw_team_destroy(team);
    return st;
  }
  pthread_t th[TW_MAX_RANKS];
  int started = 0;
  for (int r = 0; r < world; r++) {
    twb_team_job* job = (twb_team_job*)((char*)ranks + (size_t)r * stride);
    job->team = team, job->sums = sums, job->rank = r, job->world = world;
    if (pthread_create(&th[r], NULL, fn, job) != 0) break;
    started++;
  }
  for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
  tw_team_destroy(team);
  tw_team_destroy(sums);
  if (started < world)
    return tw__fail(TW_ERR_INTERNAL, "in-process team: only %d of %d rank threads started", started,
                    world);
  return TW_SUCCESS;
}

static void* twt_rank_main(void* arg) {
  twt_rank* r = (twt_rank*)arg;
  const twb_opts* o = r->o;
  const twb_point* pt = r->pt;
  tw_status st = TW_SUCCESS;
  twb_team_rank t;
  uint16_t *h_a = NULL, *h_b = NULL;
  TWT_TRY(twb_team_rank_setup(&t, o, pt, &r->job, 1));
  r->budget = t.info.sm_budget;
  r->comm_ctas = t.plan->comm_ctas;
  r->coalesce = t.plan->coalesce;
  h_a = (uint16_t*)malloc(t.n_out * 2 + 2);
  h_b = (uint16_t*)malloc(t.n_out * 2 + 2);
  if (h_a == NULL || h_b == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
    goto teardown;
  }
  {
    tw_context_t ctx = t.ctx;
    tw_device_plan_t dp = t.dp;
    const void *in = t.in, *w2 = t.w2;
    void* call_out = t.call_out;
    cudaStream_t s = t.s;
    tw__team* sums = t.sums;
    /* Unfused first (its output is the reference), then the modes in turn. */
    TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_UNFUSED, 0, &r->us[TWT_UNFUSED]));
    TWT_TRY(twb_team_output(&t, h_a));
    const size_t n_check = (size_t)pt->tokens * t.problem.hidden;
    int64_t wrong = 0;
    /* The plan's C first, then (sweep) every C: each output against the unfused one. */
    for (int c = 0; c <= (r->sweep ? r->cmax : 0); c++) {
      double* us = c == 0 ? &r->us[TWT_OVERLAP] : &r->sweep_us[c - 1];
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_OVERLAP, c, us));
      TWT_TRY(twb_team_output(&t, h_b));
      for (size_t i = 0; i < n_check; i++) wrong += h_a[i] != h_b[i];
    }
    TWT_TRY(tw__team_sum_i64(sums, &wrong, 1));
    r->wrong = wrong;
    if (r->sweep) goto teardown; /* st is TW_SUCCESS */
    TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_GEMM, 0, &r->us[TWT_GEMM]));
    TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_COMM, 0, &r->us[TWT_COMM]));
    if (twb_trace_env()) {
      /* What tracing costs: ours traced, then ours untraced again (drift shows as a difference
       * between the two untraced medians); the traced output checked like the overlapped one. */
      int32_t tiles = 0, units = 0;
      TWT_TRY(tw__device_plan_work(dp, &tiles, &units));
      const int64_t cap = twb_trace_capacity(tiles, units, r->job.world, r->budget);
      TWT_TRY(tw__context_trace(ctx, cap));
      TWT_TRY(tw__team_barrier(sums)); /* every rank's buffer is on before a traced call */
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_TRACED, 0, &r->us[TWT_TRACED]));
      TWT_TRY(twb_team_output(&t, h_b));
      tw_trace_record* rec = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
      if (rec == NULL) {
        st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
        goto teardown;
      }
      st = tw__context_trace_read(ctx, rec, cap, &r->trace_records, &r->trace_dropped);
      free(rec);
      if (st != TW_SUCCESS) goto teardown;
      int64_t tw = 0;
      for (size_t i = 0; i < n_check; i++) tw += h_a[i] != h_b[i];
      TWT_TRY(tw__team_sum_i64(sums, &tw, 1));
      r->traced_wrong = tw;
      TWT_TRY(tw__context_trace(ctx, 0));
      TWT_TRY(tw__team_barrier(sums));
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_OVERLAP_AFTER, 0,
                       &r->us[TWT_OVERLAP_AFTER]));
    }
  }
teardown:
  twb_team_done(&r->job, st);
  twb_team_rank_free(&t);
  free(h_a);
  free(h_b);
  return NULL;
}

/* The progress line of point i on stderr (bench.h; progress.h: from the second point on with an
 * estimate of the time left). */
void twb_point_progress(const twb_progress* pr, int i, const twb_point* pt) {
  twb_progress_start(pr, i, "tokens/rank %d K %d N %d E %d top-%d %s", pt->tokens, pt->ffn,
                     pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router));
}

int twb_in_process(const twb_opts* o, const twb_point* pts, int npoints) {
  const int W = o->in_process;
  /* Every rank's streams need hardware queues of their own (tw_team_create checks); the variable
   * counts only when set before this process's first CUDA call. */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  printf(
      "in-process team: %d rank(s) as threads of one process on GPU 0; one GPU's memory stands in "
      "for NVLink, so these numbers do not compare with multi-GPU ones; the cuBLAS + NCCL and "
      "copy-engine baselines are not run (they need NCCL or two GPUs)\n\n",
      W);
  printf(
      "| tokens/rank | K | N | E | top-k | router | ranks | budget | C | mgb | ours us | unfused "
      "us "
      "| GEMM alone us | comm alone us | ideal us | eff | unfused / ours | #wrong |\n");
  printf(
      "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: |\n");
  fflush(stdout);
  int failed = 0;
  twt_rank ranks[8];
  /* TW_TRACE=1: one row per point of the second table, printed after the first. */
  const int traced = twb_trace_env();
  char* trace_rows = traced ? (char*)calloc((size_t)npoints + 1, 256) : NULL;
  twb_progress pr;
  twb_progress_begin(&pr, "bench --in-process", "point", npoints);
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twb_point_progress(&pr, i, pt);
    memset(ranks, 0, sizeof ranks);
    for (int r = 0; r < W; r++) ranks[r].o = o, ranks[r].pt = pt;
    const tw_status st = twb_team_run(W, twt_rank_main, ranks, sizeof ranks[0]);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tilewave bench: %s: %s\n", tw_status_string(st), tw_last_error());
      return 1;
    }
    const int bad = twb_team_failures("tilewave bench", W, ranks, sizeof ranks[0]) > 0;
    if (bad) {
      failed++;
      continue;
    }
    const twt_rank* r0 = &ranks[0];
    const double* u = r0->us;
    const double ideal = fmax(u[TWT_GEMM], u[TWT_COMM]);
    printf(
        "| %d | %d | %d | %d | %d | %s | %d | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | "
        "%.3f | %.3f | %lld |\n",
        pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router), W,
        r0->budget, r0->comm_ctas, r0->coalesce, u[TWT_OVERLAP], u[TWT_UNFUSED], u[TWT_GEMM],
        u[TWT_COMM], ideal, ideal / u[TWT_OVERLAP], u[TWT_UNFUSED] / u[TWT_OVERLAP],
        (long long)r0->wrong);
    fflush(stdout);
    if (r0->wrong != 0) failed++;
    if (trace_rows != NULL) {
      const double off = 0.5 * (u[TWT_OVERLAP] + u[TWT_OVERLAP_AFTER]);
      snprintf(
          trace_rows + (size_t)i * 256, 256,
          "| %d | %d | %d | %d | %d | %s | %.1f | %.1f | %.1f | %+.2f%% | %lld | %lld | %lld |\n",
          pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router),
          u[TWT_OVERLAP], u[TWT_TRACED], u[TWT_OVERLAP_AFTER], 100.0 * (u[TWT_TRACED] / off - 1.0),
          (long long)r0->trace_records, (long long)r0->trace_dropped, (long long)r0->traced_wrong);
      if (r0->traced_wrong != 0) failed++;
    }
  }
  if (trace_rows != NULL) {
    printf(
        "\nTW_TRACE=1: ours with the trace buffer on (records per call from every producer, "
        "consumer and reduction CTA), between two untraced runs of ours; the cost is against "
        "their mean\n\n");
    printf(
        "| tokens/rank | K | N | E | top-k | router | ours us | traced us | ours again us | "
        "traced cost | records | dropped | #wrong |\n");
    printf(
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "|\n");
    for (int i = 0; i < npoints; i++) fputs(trace_rows + (size_t)i * 256, stdout);
    free(trace_rows);
  }
  if (failed)
    fprintf(stderr, "tilewave bench --in-process: %d point(s) failed (an error or #wrong > 0)\n",
            failed);
  return failed ? 1 : 0;
}

int twb_in_process_sweep(const twb_opts* o, const twb_point* pts, int npoints) {
  const int W = o->in_process;
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* before this process's first CUDA call */
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) sms = 0;
  if (sms < 1) {
    fprintf(stderr, "tilewave sweep --in-process: GPU 0 cannot be used\n");
    return 1;
  }
  const int budget = o->sm_budget > 0 ? o->sm_budget : sms / W;
  /* C leaves the producer at least one SM of the budget. */
  const int cmax = o->c_max < budget - 1 ? o->c_max : budget - 1;
  if (cmax < 1) {
    fprintf(stderr, "tilewave sweep --in-process: a budget of %d SMs leaves no C to sweep\n",
            budget);
    return 1;
  }
  printf(
      "in-process team: %d rank(s) as threads of one process on GPU 0; one GPU's memory stands in "
      "for NVLink, so these numbers do not compare with multi-GPU ones; ours' overlapped call at "
      "every C against the plan's choice\n\n",
      W);
  printf(
      "| tokens/rank | K | N | E | top-k | router | ranks | budget | plan's C | plan's C us | "
      "best C | best us | regret | #wrong |\n");
  printf(
      "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: |\n");
  fflush(stdout);
  int failed = 0;
  twt_rank ranks[8];
  twb_progress pr;
  twb_progress_begin(&pr, "sweep --in-process", "point", npoints);
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twb_point_progress(&pr, i, pt);
    memset(ranks, 0, sizeof ranks);
    int bad = 0;
    for (int r = 0; r < W; r++) {
      ranks[r].o = o, ranks[r].pt = pt, ranks[r].sweep = 1, ranks[r].cmax = cmax;
      ranks[r].sweep_us = (double*)calloc((size_t)cmax, sizeof(double));
      bad |= ranks[r].sweep_us == NULL;
    }
    tw_status st = bad ? tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep --in-process: host memory")
                       : twb_team_run(W, twt_rank_main, ranks, sizeof ranks[0]);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tilewave sweep: %s: %s\n", tw_status_string(st), tw_last_error());
      bad = 1;
    }
    if (!bad) bad = twb_team_failures("tilewave sweep", W, ranks, sizeof ranks[0]) > 0;
    if (!bad) {
      /* The times are the slowest rank's (every rank holds the same): rank 0's are printed. */
      const twt_rank* r0 = &ranks[0];
      int best = 1;
      for (int c = 2; c <= cmax; c++)
        if (r0->sweep_us[c - 1] < r0->sweep_us[best - 1]) best = c;
      const double t_plan = r0->us[TWT_OVERLAP], t_best = r0->sweep_us[best - 1];
      printf("| %d | %d | %d | %d | %d | %s | %d | %d | %d | %.1f | %d | %.1f | %.2f%% | %lld |\n",
             pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
             tw__cli_router_name(pt->router), W, r0->budget, r0->comm_ctas, t_plan, best, t_best,
             100.0 * (t_plan / t_best - 1.0), (long long)r0->wrong);
      printf("\nC:");
      for (int c = 1; c <= cmax; c++) printf(" %d=%.1f", c, r0->sweep_us[c - 1]);
      printf(" (us)\n\n");
      fflush(stdout);
      if (r0->wrong != 0) bad = 1;
    }
    for (int r = 0; r < W; r++) free(ranks[r].sweep_us);
    failed += bad;
  }
  if (failed)
    fprintf(stderr, "tilewave sweep --in-process: %d point(s) failed (an error or #wrong > 0)\n",
            failed);
  return failed ? 1 : 0;
}
