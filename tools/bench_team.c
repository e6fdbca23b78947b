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
#include "team.h"
#include "tilewave.h"

enum { TWT_OVERLAP, TWT_UNFUSED, TWT_GEMM, TWT_COMM, TWT_NMODES };

typedef struct twt_rank {
  const twb_opts* o;
  const twb_point* pt;
  tw_team_t team, sums;
  int rank, world;
  /* out (every rank; rank 0's is printed) */
  double us[TWT_NMODES];
  int comm_ctas, coalesce, budget;
  int64_t wrong;
  /* sweep: us[c - 1] at C = c for c <= cmax (the overlapped call), #wrong over all of them */
  int sweep, cmax;
  double* sweep_us;
  tw_status st;
  char why[600];
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

static tw_status twt_upload_random(void* dst, size_t n, uint64_t salt) {
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
  static const tw_combine_mode kModes[TWT_NMODES] = {TW_COMBINE_OVERLAP, TW_COMBINE_UNFUSED,
                                                     TW_COMBINE_GEMM_ONLY, TW_COMBINE_COMM_ONLY};
  const twb_opts* o = r->o;
  float* t = (float*)malloc(sizeof(float) * (size_t)o->iters);
  if (t == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
  tw_status st = TW_SUCCESS;
  for (int i = -o->warmup; i < o->iters && st == TW_SUCCESS; i++) {
    tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
    opt.mode = kModes[mode];
    opt.comm_ctas = comm_ctas;
    if (o->delay_us > 0) st = tw__bench_delay(s, o->delay_us); /* idle device before the call */
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

static void* twt_rank_main(void* arg) {
  twt_rank* r = (twt_rank*)arg;
  const twb_opts* o = r->o;
  const twb_point* pt = r->pt;
  tw_status st = TW_SUCCESS;
  tw__team* sums = NULL;
  tw_context_t ctx = NULL;
  tw_device_plan_t dp = NULL;
  tw_routing_t rt = NULL;
  tw_plan_t plan = NULL;
  void *in = NULL, *w2 = NULL, *out = NULL;
  uint16_t *h_a = NULL, *h_b = NULL;
  cudaStream_t s = NULL;
  size_t n_out = 0;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    st = tw__fail(TW_ERR_CUDA, "bench --in-process: rank %d: no stream on GPU 0", r->rank);
    goto teardown;
  }
  TWT_TRY(tw__team_local_join(r->sums, r->rank, &sums));
  {
    const tw_problem p = twb_problem_of(o, pt, r->world);
    tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
    cc.sm_budget = o->sm_budget;
    cc.timing = 1;
    TWT_TRY(tw_context_create_on_team(&p, r->team, r->rank, &cc, &ctx));
    tw_context_info info;
    TWT_TRY(tw_context_info_get(ctx, &info));
    r->budget = info.sm_budget;
    TWT_TRY(tw_device_plan_create(ctx, &dp));
    TWT_TRY(
        tw_routing_generate(&p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed, &rt));
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.comm_ctas = o->comm_ctas;
    pc.coalesce = o->coalesce;
    pc.sm_budget = info.sm_budget;
    TWT_TRY(tw_plan_create(&p, rt, r->rank, &pc, &plan));
    r->comm_ctas = plan->comm_ctas;
    r->coalesce = plan->coalesce;
    TWT_TRY(tw_device_plan_upload(dp, plan, rt, s));
    const size_t E = (size_t)(p.experts / p.world_size);
    const size_t n_in = (size_t)plan->rows * p.ffn, n_w = E * p.hidden * p.ffn;
    n_out = (size_t)p.max_tokens * p.hidden;
    if (cudaMalloc(&in, n_in * 2 + 16) != cudaSuccess ||
        cudaMalloc(&w2, n_w * 2 + 16) != cudaSuccess ||
        cudaMalloc(&out, n_out * 2 + 16) != cudaSuccess) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: rank %d: device memory", r->rank);
      goto teardown;
    }
    h_a = (uint16_t*)malloc(n_out * 2 + 2);
    h_b = (uint16_t*)malloc(n_out * 2 + 2);
    if (h_a == NULL || h_b == NULL) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --in-process: host memory");
      goto teardown;
    }
    TWT_TRY(twt_upload_random(in, n_in, 11 + (uint64_t)r->rank));
    TWT_TRY(twt_upload_random(w2, n_w, 1000 + (uint64_t)r->rank));
    const int add = info.dataflow == TW_DATAFLOW_ADD;
    void* call_out = add ? NULL : out;
    /* Unfused first (its output is the reference), then the modes in turn. */
    TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_UNFUSED, 0, &r->us[TWT_UNFUSED]));
    TWT_TRY(twt_output(ctx, add, out, h_a, n_out));
    const size_t n_check = (size_t)pt->tokens * p.hidden;
    int64_t wrong = 0;
    /* The plan's C first, then (sweep) every C: each output against the unfused one. */
    for (int c = 0; c <= (r->sweep ? r->cmax : 0); c++) {
      double* us = c == 0 ? &r->us[TWT_OVERLAP] : &r->sweep_us[c - 1];
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_OVERLAP, c, us));
      TWT_TRY(twt_output(ctx, add, out, h_b, n_out));
      for (size_t i = 0; i < n_check; i++) wrong += h_a[i] != h_b[i];
    }
    TWT_TRY(tw__team_sum_i64(sums, &wrong, 1));
    r->wrong = wrong;
    if (!r->sweep) {
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_GEMM, 0, &r->us[TWT_GEMM]));
      TWT_TRY(twt_time(r, sums, ctx, dp, in, w2, call_out, s, TWT_COMM, 0, &r->us[TWT_COMM]));
    }
  }
teardown:
  if (st != TW_SUCCESS) snprintf(r->why, sizeof r->why, "%s", tw_last_error());
  r->st = st;
  if (s) cudaStreamSynchronize(s);
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_device_plan_destroy(dp);
  tw_context_destroy(ctx); /* collective: every rank gets here, failed or not */
  cudaFree(in);
  cudaFree(w2);
  cudaFree(out);
  free(h_a);
  free(h_b);
  if (sums) sums->ops->release(sums);
  if (s) cudaStreamDestroy(s);
  return NULL;
}

/* One point's W ranks as threads, run to the end; 0 when every rank succeeded. The C sweep runs
 * when cmax > 0 (rank r's times in ranks[r].sweep_us, which the caller allocates). */
static int twt_run_point(const twb_opts* o, const twb_point* pt, int cmax, twt_rank* ranks) {
  const int W = o->in_process;
  const char* cmd = cmax > 0 ? "sweep" : "bench";
  pthread_t th[8];
  tw_team_t team = NULL, sums = NULL;
  tw_status st = tw_team_create(W, 0, &team);
  if (st == TW_SUCCESS) st = tw_team_create(W, 0, &sums);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tilewave %s: %s: %s\n", cmd, tw_status_string(st), tw_last_error());
    tw_team_destroy(team);
    return 1;
  }
  int started = 0;
  for (int r = 0; r < W; r++) {
    ranks[r].o = o, ranks[r].pt = pt, ranks[r].team = team, ranks[r].sums = sums;
    ranks[r].rank = r, ranks[r].world = W;
    ranks[r].sweep = cmax > 0, ranks[r].cmax = cmax;
    if (pthread_create(&th[r], NULL, twt_rank_main, &ranks[r]) != 0) break;
    started++;
  }
  for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
  tw_team_destroy(team);
  tw_team_destroy(sums);
  int bad = started < W;
  for (int r = 0; r < started; r++)
    if (ranks[r].st != TW_SUCCESS) {
      fprintf(stderr, "tilewave %s: rank %d: %s: %s\n", cmd, r, tw_status_string(ranks[r].st),
              ranks[r].why);
      bad = 1;
    }
  return bad;
}

static void twt_progress(const char* cmd, int i, int npoints, const twb_point* pt,
                         double t_begin) {
  const double now = tw__now_seconds();
  char eta[64] = "";
  if (i > 0)
    snprintf(eta, sizeof eta, ", %.0f s so far, about %.0f s left", now - t_begin,
             (now - t_begin) / i * (npoints - i));
  fprintf(stderr, "[%s --in-process %d/%d] tokens/rank %d K %d N %d E %d top-%d %s%s\n", cmd,
          i + 1, npoints, pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
          tw__cli_router_name(pt->router), eta);
}

/* Every rank's streams need hardware queues of their own (tw_team_create checks); the variable
 * counts only when set before this process's first CUDA call. */
static void twt_banner(int W, const char* what) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  printf(
      "in-process team: %d rank(s) as threads of one process on GPU 0; one GPU's memory stands in "
      "for NVLink, so these numbers do not compare with multi-GPU ones; %s\n\n",
      W, what);
}

int twb_in_process(const twb_opts* o, const twb_point* pts, int npoints) {
  const int W = o->in_process;
  twt_banner(W,
             "the cuBLAS + NCCL and copy-engine baselines are not run (they need NCCL or two "
             "GPUs)");
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
  const double t_begin = tw__now_seconds();
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twt_progress("bench", i, npoints, pt, t_begin);
    memset(ranks, 0, sizeof ranks);
    if (twt_run_point(o, pt, 0, ranks) != 0) {
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
  const int budget = o->sm_budget > 0 ? o->sm_budget : sms / W;
  /* C leaves the producer at least one SM of the budget. */
  const int cmax = o->c_max < budget - 1 ? o->c_max : budget - 1;
  if (sms < 1) {
    fprintf(stderr, "tilewave sweep --in-process: GPU 0 cannot be used\n");
    return 1;
  }
  if (cmax < 1) {
    fprintf(stderr, "tilewave sweep --in-process: a budget of %d SMs leaves no C to sweep\n",
            budget);
    return 1;
  }
  twt_banner(W, "ours' overlapped call at every C, against the plan's choice");
  printf("| tokens/rank | K | N | E | top-k | router | ranks | budget | plan's C | plan's C us | "
         "best C | best us | regret | #wrong |\n");
  printf("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | "
         "---: | ---: |\n");
  fflush(stdout);
  int failed = 0;
  twt_rank ranks[8];
  const double t_begin = tw__now_seconds();
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twt_progress("sweep", i, npoints, pt, t_begin);
    memset(ranks, 0, sizeof ranks);
    int bad = 0;
    for (int r = 0; r < W && !bad; r++) {
      ranks[r].sweep_us = (double*)calloc((size_t)cmax, sizeof(double));
      bad = ranks[r].sweep_us == NULL;
    }
    if (!bad) bad = twt_run_point(o, pt, cmax, ranks);
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
