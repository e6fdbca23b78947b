/*
 * bench_tp.c: `tilewave bench --tp T [--ep E] --in-process W`: the tensor-parallel call
 * (tw_moe_combine_tp: GEMM2 over each rank's F slice, GatherRS over the TP group, the owners'
 * weighted reduction) with W = T x E ranks as threads of this process on GPU 0. Per point, in the
 * same run and interleaved call by call: the overlapped call, and the unfused one (the same
 * producer, then the same GatherRS and reduction without overlap), medians over --iters calls of
 * the slowest rank after --warmup, each call after the previous has ended (tw_tp_context_check)
 * and --delay-us of idle device, timed with events on the rank's stream around the call. The
 * last overlapped output is checked bit for bit against the last unfused one on every rank
 * (#wrong). C is the TP model's (tw_tp_plan_summary.tp_comm_ctas), or --comm-ctas. One GPU's
 * memory stands in for NVLink: the numbers do not compare with multi-GPU ones. The cuBLAS + NCCL
 * reduce-scatter baseline needs NCCL and is not run here.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_common.h"
#include "bench_stats.h"
#include "cli.h"
#include "core.h"
#include "team.h"
#include "tilewave.h"

enum { TWP_OVERLAP, TWP_UNFUSED, TWP_NMODES };

typedef struct twp_rank {
  twb_team_job job; /* first: twb_team_run fills it */
  const twb_opts* o;
  const twb_point* pt;
  double us[TWP_NMODES]; /* slowest rank's medians */
  int comm_ctas, budget;
  int64_t wrong;
} twp_rank;

/* A deterministic bf16 pattern in [-1, 1) (bench_team.c's). */
static uint16_t twp_bf16(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ salt * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 32;
  const float v = (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  uint32_t b;
  memcpy(&b, &v, 4);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static tw_status twp_upload_random(void* dst, size_t n, uint64_t salt) {
  uint16_t* h = (uint16_t*)malloc(n * 2 + 2);
  if (h == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --tp: host memory");
  for (size_t i = 0; i < n; i++) h[i] = twp_bf16(i, salt);
  const cudaError_t e = cudaMemcpy(dst, h, n * 2, cudaMemcpyHostToDevice);
  free(h);
  return e == cudaSuccess ? TW_SUCCESS
                          : tw__fail(TW_ERR_CUDA, "bench --tp: %s", cudaGetErrorString(e));
}

#define TWP_TRY(expr)                    \
  do {                                   \
    st = (expr);                         \
    if (st != TW_SUCCESS) goto teardown; \
  } while (0)

#define TWP_CUDA(expr)                                                                     \
  do {                                                                                     \
    const cudaError_t twp_e_ = (expr);                                                     \
    if (twp_e_ != cudaSuccess) {                                                           \
      st = tw__fail(TW_ERR_CUDA, "bench --tp: %s: %s", #expr, cudaGetErrorString(twp_e_)); \
      goto teardown;                                                                       \
    }                                                                                      \
  } while (0)

static void* twp_rank_main(void* arg) {
  twp_rank* r = (twp_rank*)arg;
  const twb_opts* o = r->o;
  const twb_point* pt = r->pt;
  const int rank = r->job.rank, W = r->job.world;
  tw_status st = TW_SUCCESS;
  cudaStream_t s = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  tw__team* sums = NULL;
  tw_tp_context_t ctx = NULL;
  tw_tp_device_plan_t dp = NULL;
  tw_routing_t rt = NULL;
  tw_tp_plan_t plan = NULL;
  void *in = NULL, *w2 = NULL, *out = NULL;
  uint16_t* h_out[TWP_NMODES] = {NULL, NULL};
  float* t[TWP_NMODES] = {NULL, NULL};
  size_t n_out = 0;
  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) {
    s = NULL;
    st = tw__fail(TW_ERR_CUDA, "bench --tp: rank %d: no stream on GPU 0", rank);
    goto teardown;
  }
  /* The delay kernel's first launch before any rank spins (docs/hardware.md, lazy loading). */
  TWP_TRY(tw__bench_delay(s, 1));
  TWP_CUDA(cudaStreamSynchronize(s));
  TWP_CUDA(cudaEventCreate(&e0));
  TWP_CUDA(cudaEventCreate(&e1));
  TWP_TRY(tw__team_local_join(r->job.sums, rank, &sums));
  {
    const tw_problem p = twb_problem_of(o, pt, W);
    tw_parallel par = TW_PARALLEL_INIT;
    par.tp = o->tp;
    par.ep = W / o->tp;
    int sms = 0;
    TWP_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    r->budget = o->sm_budget > 0 ? o->sm_budget : sms / W;
    tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
    cc.sm_budget = o->sm_budget;
    TWP_TRY(tw_tp_context_create_on_team(&p, &par, r->job.team, rank, &cc, &ctx));
    TWP_TRY(tw_tp_device_plan_create(ctx, &dp));
    TWP_TRY(
        tw_routing_generate(&p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed, &rt));
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.dataflow = TW_DATAFLOW_REDUCE;
    pc.sm_budget = r->budget; /* the TP model plans C for the SMs the call gets */
    pc.coalesce = o->coalesce;
    TWP_TRY(tw_tp_plan_create(&p, &par, rt, rank, &pc, &plan));
    tw_tp_plan_summary sum = TW_TP_PLAN_SUMMARY_INIT;
    TWP_TRY(tw_tp_plan_summary_get(plan, &sum));
    r->comm_ctas = o->comm_ctas > 0 ? o->comm_ctas : sum.tp_comm_ctas > 0 ? sum.tp_comm_ctas : 1;
    TWP_TRY(tw_tp_device_plan_upload(dp, plan, rt, s));
    const size_t n_in = (size_t)sum.rows * sum.ffn_slice;
    const size_t n_w = (size_t)sum.local_experts * p.hidden * sum.ffn_slice;
    n_out = (size_t)p.max_tokens * p.hidden;
    if (cudaMalloc(&in, n_in * 2 + 16) != cudaSuccess ||
        cudaMalloc(&w2, n_w * 2 + 16) != cudaSuccess ||
        cudaMalloc(&out, n_out * 2 + 16) != cudaSuccess) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --tp: rank %d: device memory", rank);
      goto teardown;
    }
    TWP_TRY(twp_upload_random(in, n_in, 11 + (uint64_t)rank));
    TWP_TRY(twp_upload_random(w2, n_w, 1000 + (uint64_t)rank));
    for (int m = 0; m < TWP_NMODES; m++) {
      h_out[m] = (uint16_t*)malloc(n_out * 2 + 2);
      t[m] = (float*)malloc(sizeof(float) * (size_t)o->iters + 4);
      if (h_out[m] == NULL || t[m] == NULL) {
        st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench --tp: host memory");
        goto teardown;
      }
    }
    for (int i = -o->warmup; i < o->iters; i++)
      for (int m = 0; m < TWP_NMODES; m++) {
        tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
        opt.mode = m == TWP_OVERLAP ? TW_COMBINE_OVERLAP : TW_COMBINE_UNFUSED;
        opt.comm_ctas = o->comm_ctas; /* 0: the plan's */
        if (o->delay_us > 0) TWP_TRY(tw__bench_delay(s, o->delay_us));
        TWP_CUDA(cudaEventRecord(e0, s));
        TWP_TRY(tw_moe_combine_tp(ctx, dp, in, w2, out, &opt, s));
        TWP_CUDA(cudaEventRecord(e1, s));
        TWP_TRY(tw_tp_context_check(ctx));
        float ms = 0.0f;
        TWP_CUDA(cudaEventSynchronize(e1));
        TWP_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        int64_t ns = (int64_t)((double)ms * 1e6);
        TWP_TRY(tw__team_max_i64(sums, &ns, 1));
        if (i >= 0) t[m][i] = (float)((double)ns / 1e3);
        if (i == o->iters - 1)
          TWP_CUDA(cudaMemcpy(h_out[m], out, n_out * 2, cudaMemcpyDeviceToHost));
      }
    int64_t wrong = 0;
    const size_t n_check = (size_t)pt->tokens * p.hidden;
    for (size_t i = 0; i < n_check && o->iters > 0; i++)
      wrong += h_out[TWP_OVERLAP][i] != h_out[TWP_UNFUSED][i];
    TWP_TRY(tw__team_sum_i64(sums, &wrong, 1));
    r->wrong = wrong;
    for (int m = 0; m < TWP_NMODES; m++) {
      tw__bench_stats q;
      tw__bench_stats_of(t[m], o->iters, &q);
      r->us[m] = q.median;
    }
  }
teardown:
  twb_team_done(&r->job, st);
  if (s) cudaStreamSynchronize(s);
  tw_tp_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_tp_device_plan_destroy(dp);
  tw_tp_context_destroy(ctx); /* collective: every rank gets here, failed or not */
  cudaFree(in);
  cudaFree(w2);
  cudaFree(out);
  for (int m = 0; m < TWP_NMODES; m++) {
    free(h_out[m]);
    free(t[m]);
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (sums) sums->ops->release(sums);
  if (s) cudaStreamDestroy(s);
  return NULL;
}

int twb_in_process_tp(const twb_opts* o, const twb_point* pts, int npoints) {
  const int W = o->in_process;
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* see twb_in_process */
  printf(
      "in-process team: tp %d x ep %d = %d rank(s) as threads of one process on GPU 0; one GPU's "
      "memory stands in for NVLink, so these numbers do not compare with multi-GPU ones; the "
      "cuBLAS + NCCL reduce-scatter baseline is not run (it needs NCCL)\n\n",
      o->tp, W / o->tp, W);
  printf(
      "| tokens/rank | K | N | E | top-k | router | tp x ep | budget | C | ours us | unfused us | "
      "unfused / ours | #wrong |\n");
  printf(
      "| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
      "|\n");
  fflush(stdout);
  int failed = 0;
  twp_rank ranks[8];
  twb_progress pr;
  twb_progress_begin(&pr, "bench --tp", "point", npoints);
  for (int i = 0; i < npoints; i++) {
    const twb_point* pt = &pts[i];
    twb_point_progress(&pr, i, pt);
    memset(ranks, 0, sizeof ranks);
    for (int r = 0; r < W; r++) ranks[r].o = o, ranks[r].pt = pt;
    const tw_status st = twb_team_run(W, twp_rank_main, ranks, sizeof ranks[0]);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tilewave bench --tp: %s: %s\n", tw_status_string(st), tw_last_error());
      return 1;
    }
    const int bad = twb_team_failures("tilewave bench --tp", W, ranks, sizeof ranks[0]) > 0;
    if (bad) {
      failed++;
      continue;
    }
    const twp_rank* r0 = &ranks[0];
    printf("| %d | %d | %d | %d | %d | %s | %d x %d | %d | %d | %.1f | %.1f | %.3f | %lld |\n",
           pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router),
           o->tp, W / o->tp, r0->budget, r0->comm_ctas, r0->us[TWP_OVERLAP], r0->us[TWP_UNFUSED],
           r0->us[TWP_UNFUSED] / r0->us[TWP_OVERLAP], (long long)r0->wrong);
    fflush(stdout);
    if (r0->wrong != 0) failed++;
  }
  if (failed)
    fprintf(stderr, "tilewave bench --tp: %d point(s) failed (an error or #wrong > 0)\n", failed);
  return failed ? 1 : 0;
}
