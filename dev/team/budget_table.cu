/*
 * budget_table.cu: the producer alone and the whole call against the SM budget on one GPU, as a
 * markdown table. One rank (an in-process team of one: the whole GPU is the rank's, nothing is
 * sent, so the call launches no consumer) at budgets 132, 116, 100 and 66; two in-process ranks
 * (one GPU's memory stands in for NVLink: these numbers do not compare with 2-GPU ones) at 66,
 * 50 and 33. Every row: the model's C for the budget, the producer alone (TW_COMBINE_GEMM_ONLY:
 * P = budget - C CTAs) and the call, medians over timed calls of the slowest rank, each call
 * after the previous one has ended (tw_context_check), inputs of constant bf16 values.
 *
 * Usage: budget_table [iters]   (default 20; writes the table to stdout)
 * Correctness of every budget is tests/gpu/test_overlap.cu's sm_budget case; this only times.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "plan.h"
#include "team.h"
#include "tilewave.h"

typedef struct shape {
  const char* name;
  int hidden, ffn, experts, top_k, tokens; /* tokens per rank */
} shape;

typedef struct job {
  const shape* sh;
  tw_team_t team, sums;
  int world, rank, budget, iters;
  /* out (rank 0): */
  int comm_ctas;
  double gemm_us, call_us;
  tw_status st;
  char why[512];
} job;

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#define TRY(expr)                                                        \
  do {                                                                   \
    tw_status s_ = (expr);                                               \
    if (s_ != TW_SUCCESS) {                                              \
      j->st = s_;                                                        \
      snprintf(j->why, sizeof j->why, "%s: %s", #expr, tw_last_error()); \
      goto done;                                                         \
    }                                                                    \
  } while (0)

/* One timed mode: iters calls, each timed by the context's events; the slowest rank's time. */
static tw_status time_mode(job* j, tw__team* sums, tw_context_t ctx, tw_device_plan_t dp,
                           const void* in, const void* w2, void* out, cudaStream_t s,
                           tw_combine_mode mode, double* us) {
  double* t = (double*)malloc(sizeof(double) * (size_t)j->iters);
  tw_status st = TW_SUCCESS;
  for (int i = -3; i < j->iters && st == TW_SUCCESS; i++) {
    tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
    opt.mode = mode;
    opt.sm_budget = j->budget;
    st = tw_moe_combine_ex(ctx, dp, in, w2, out, &opt, s);
    if (st == TW_SUCCESS) st = tw_context_check(ctx);
    tw_combine_timings tm;
    if (st == TW_SUCCESS) st = tw_context_timings(ctx, &tm);
    int64_t ns = st == TW_SUCCESS ? (int64_t)(tm.total_ms * 1e6) : 0;
    if (st == TW_SUCCESS) st = tw__team_max_i64(sums, &ns, 1);
    if (st == TW_SUCCESS && i >= 0) t[i] = (double)ns / 1e3;
  }
  if (st == TW_SUCCESS) *us = median(t, j->iters);
  free(t);
  return st;
}

static void* rank_main(void* arg) {
  job* j = (job*)arg;
  const shape* sh = j->sh;
  tw_context_t ctx = NULL;
  tw_device_plan_t dp = NULL;
  tw_routing_t rt = NULL;
  tw_plan_t plan = NULL;
  tw__team* sums = NULL;
  void *in = NULL, *w2 = NULL, *out = NULL;
  cudaStream_t s = NULL;
  j->st = TW_SUCCESS;
  cudaSetDevice(0);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  {
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = j->world;
    p.hidden = sh->hidden;
    p.ffn = sh->ffn;
    p.experts = sh->experts;
    p.top_k = sh->top_k;
    p.max_tokens = sh->tokens;
    TRY(tw__team_local_join(j->sums, j->rank, &sums));
    tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
    cc.sm_budget = j->budget;
    cc.timing = 1;
    TRY(tw_context_create_on_team(&p, j->team, j->rank, &cc, &ctx));
    TRY(tw_device_plan_create(ctx, &dp));
    TRY(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, sh->tokens, 1, &rt));
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.sm_budget = j->budget;
    TRY(tw_plan_create(&p, rt, j->rank, &pc, &plan));
    TRY(tw_device_plan_upload(dp, plan, rt, s));
    const size_t E = (size_t)(p.experts / p.world_size);
    const size_t n_in = (size_t)plan->rows * p.ffn, n_w = E * p.hidden * p.ffn;
    const size_t n_out = (size_t)p.max_tokens * p.hidden;
    if (cudaMalloc(&in, n_in * 2 + 16) != cudaSuccess || cudaMalloc(&w2, n_w * 2) != cudaSuccess ||
        cudaMalloc(&out, n_out * 2 + 16) != cudaSuccess) {
      j->st = TW_ERR_OUT_OF_MEMORY;
      snprintf(j->why, sizeof j->why, "device memory");
      goto done;
    }
    TRY(tw__fill_bf16(in, n_in, 0x3c00, s)); /* 2^-7 */
    TRY(tw__fill_bf16(w2, n_w, 0x3c00, s));
    j->comm_ctas = plan->comm_ctas;
    TRY(time_mode(j, sums, ctx, dp, in, w2, out, s, TW_COMBINE_GEMM_ONLY, &j->gemm_us));
    TRY(time_mode(j, sums, ctx, dp, in, w2, out, s, TW_COMBINE_OVERLAP, &j->call_us));
  }
done:
  if (s) cudaStreamSynchronize(s);
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_device_plan_destroy(dp);
  tw_context_destroy(ctx); /* collective: every rank reaches it, failed or not */
  cudaFree(in);
  cudaFree(w2);
  cudaFree(out);
  if (sums) sums->ops->release(sums);
  if (s) cudaStreamDestroy(s);
  return NULL;
}

static int run_row(const shape* sh, int world, int budget, int iters) {
  tw_team_t team = NULL, sums = NULL;
  if (tw_team_create(world, 0, &team) != TW_SUCCESS ||
      tw_team_create(world, 0, &sums) != TW_SUCCESS) {
    fprintf(stderr, "tw_team_create: %s\n", tw_last_error());
    return 1;
  }
  job jobs[8];
  pthread_t th[8];
  for (int r = 0; r < world; r++) {
    memset(&jobs[r], 0, sizeof jobs[r]);
    jobs[r].sh = sh;
    jobs[r].team = team;
    jobs[r].sums = sums;
    jobs[r].world = world;
    jobs[r].rank = r;
    jobs[r].budget = budget;
    jobs[r].iters = iters;
    pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  }
  int bad = 0;
  for (int r = 0; r < world; r++) {
    pthread_join(th[r], NULL);
    if (jobs[r].st != TW_SUCCESS) {
      fprintf(stderr, "%s W %d budget %d rank %d: %s (%s)\n", sh->name, world, budget, r,
              tw_status_string(jobs[r].st), jobs[r].why);
      bad = 1;
    }
  }
  if (!bad)
    printf("| %s | %d | %d | %d | %.1f | %.1f | %.3f |\n", sh->name, world, budget,
           jobs[0].comm_ctas, jobs[0].gemm_us, jobs[0].call_us, jobs[0].call_us / jobs[0].gemm_us);
  else
    printf("| %s | %d | %d | - | failed | failed | - |\n", sh->name, world, budget);
  fflush(stdout);
  tw_team_destroy(team);
  tw_team_destroy(sums);
  return bad;
}

int main(int argc, char** argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* before the first CUDA call */
  const int iters = argc > 1 ? atoi(argv[1]) : 20;
  if (iters < 1 || iters > 10000) {
    fprintf(stderr, "usage: %s [iters 1..10000]\n", argv[0]);
    return 2;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
    fprintf(stderr, "no GPU\n");
    return 77;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  static const shape shapes[] = {
      {"grid: K 2048, N 4096, 16 experts, top-2, 8192 tokens/rank", 4096, 2048, 16, 2, 8192},
      {"qwen1.5-moe-a2.7b, 4096 tokens/rank", 2048, 1408, 60, 4, 4096},
  };
  printf(
      "SM budget on one %s (%d SMs): the producer alone (P = budget - C) and the call, medians "
      "of %d calls, slowest rank; 2 ranks = an in-process team, one GPU's memory standing in "
      "for NVLink (not comparable with 2-GPU numbers)\n\n",
      prop.name, prop.multiProcessorCount, iters);
  printf("| shape | ranks | budget | C | GEMM alone us | call us | call / GEMM |\n");
  printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const int sms = prop.multiProcessorCount;
  const int one[] = {sms, sms * 116 / 132, sms * 100 / 132, sms / 2};
  const int two[] = {sms / 2, sms * 50 / 132, sms / 4};
  int bad = 0;
  for (int s = 0; s < 2; s++) {
    for (int i = 0; i < 4; i++) bad |= run_row(&shapes[s], 1, one[i], iters);
    for (int i = 0; i < 3; i++) bad |= run_row(&shapes[s], 2, two[i], iters);
  }
  return bad;
}
