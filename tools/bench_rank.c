/*
 * bench_rank.c: one rank of `tilewave bench` / `sweep`: setting up a point (problem, routing,
 * plans, context, baselines, input sets), running and checking a policy, and timing a set of
 * policies (ABBA rounds, the max over ranks per sample); see cmd_bench.c for the methodology.
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
#include "checks.h"
#include "cli.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "runtime.h"
#include "spawn.h"
#include "tilewave.h"

/* ---- one rank's setup and teardown ----------------------------------------------------------- */

void twb_rank_free(twb_rank* s) {
  if (s->stream) cudaStreamSynchronize(s->stream);
  for (int i = 0; i < TWB_NOUT; i++) cudaFree(s->out[i]);
  for (int i = 0; i < 4; i++) {
    cudaFree(s->a[i]);
    cudaFree(s->w[i]);
  }
  tw__baseline_destroy(s->baseline);
  for (int i = 0; i < TWB_MAX_DPLANS; i++) tw_device_plan_destroy(s->dplans[i]);
  tw_context_destroy(s->ctx);
  for (int i = 0; i < TWB_MAX_DPLANS; i++) tw_plan_destroy(s->mplans[i]);
  if (s->plans) {
    for (int r = 0; r < s->world; r++) tw_plan_destroy(s->plans[r]);
    free(s->plans);
  }
  tw_routing_destroy(s->routing);
  memset(s->a, 0, sizeof s->a);
  memset(s->w, 0, sizeof s->w);
  memset(s->out, 0, sizeof s->out);
  memset(s->mplans, 0, sizeof s->mplans);
  memset(s->dplans, 0, sizeof s->dplans);
  s->baseline = NULL;
  s->ctx = NULL;
  s->plans = NULL;
  s->routing = NULL;
  s->ndplans = 0;
}

/* Problem, routing, every rank's plan (explicit --comm-ctas/--coalesce win over the model),
 * context, this rank's device plan(s), baselines, inputs and outputs. `sweep_mgbs` (n > 0) adds one
 * plan and device plan per coalescing factor. */
tw_problem twb_problem_of(const twb_opts* o, const twb_point* pt, int world) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = world;
  p.hidden = pt->hidden;
  p.ffn = pt->ffn;
  p.experts = pt->experts;
  p.top_k = pt->topk;
  p.max_tokens = pt->tokens > 0 ? pt->tokens : 1;
  p.tile_m = o->tile_m;
  p.tile_n = o->tile_n;
  return p;
}

tw_status twb_setup(twb_rank* s, const twb_opts* o, const twb_point* pt, const int* sweep_mgbs,
                    int n_sweep) {
  tw_problem p = twb_problem_of(o, pt, s->world);
  TW_TRY(tw_problem_validate(&p));
  if (o->routing_file) {
    /* Read with a generous capacity, then size the problem to the busiest rank of the file. */
    tw_problem big = p;
    big.max_tokens = 1 << 20;
    TW_TRY(tw_routing_read(&big, o->routing_file, &s->routing));
    p.max_tokens = 1;
    for (int r = 0; r < s->world; r++) {
      int32_t n = 0;
      const int32_t* i0 = NULL;
      const float* w0 = NULL;
      TW_TRY(tw_routing_rank(s->routing, r, &n, &i0, &w0));
      if (n > p.max_tokens) p.max_tokens = n;
    }
  } else
    TW_TRY(tw_routing_generate(&p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed,
                               &s->routing));
  if (o->write_routing && s->rank == 0) TW_TRY(tw_routing_write(s->routing, o->write_routing));
  const int32_t* ids = NULL;
  const float* gw = NULL;
  TW_TRY(tw_routing_rank(s->routing, s->rank, &s->tokens, &ids, &gw));
  s->problem = p;

  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = o->comm_ctas;
  cfg.coalesce = o->coalesce;
  s->plans = (tw_plan_t*)calloc((size_t)s->world, sizeof(tw_plan_t));
  if (s->plans == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  for (int r = 0; r < s->world; r++) TW_TRY(tw_plan_create(&p, s->routing, r, &cfg, &s->plans[r]));
  for (int i = 0; i < n_sweep; i++) {
    tw_plan_config c2 = TW_PLAN_CONFIG_INIT;
    c2.coalesce = sweep_mgbs[i];
    TW_TRY(tw_plan_create(&p, s->routing, s->rank, &c2, &s->mplans[i]));
    s->mgbs[i] = sweep_mgbs[i];
  }

  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timing = o->phases;
  TW_TRY(tw_context_create(&p, s->comm, &cc, &s->ctx));
  s->add = o->add;
  s->ndplans = n_sweep > 0 ? n_sweep : 1;
  for (int i = 0; i < s->ndplans; i++) {
    TW_TRY(tw_device_plan_create(s->ctx, &s->dplans[i]));
    TW_TRY(tw_device_plan_upload(s->dplans[i], n_sweep > 0 ? s->mplans[i] : s->plans[s->rank],
                                 s->routing, s->stream));
  }
  TW_TRY(tw__baseline_create((const struct tw_plan* const*)s->plans, s->world, s->rank, s->routing,
                             s->comm, &s->baseline));

  /* Inputs: enough sets that the cycled inputs exceed L2 twice (at most 4). */
  const struct tw_plan* mine = s->plans[s->rank];
  const size_t a_elems = (size_t)mine->rows * (size_t)p.ffn;
  const size_t w_elems = (size_t)mine->local_experts * (size_t)p.hidden * (size_t)p.ffn;
  const size_t set_bytes = 2 * (a_elems + w_elems);
  s->nsets =
      set_bytes >= 2 * TWB_L2_BYTES ? 1 : (int)((2 * TWB_L2_BYTES + set_bytes - 1) / set_bytes);
  if (s->nsets > 4) s->nsets = 4;
  const float w_scale = 1.0f / sqrtf((float)p.ffn);
  for (int i = 0; i < s->nsets; i++) {
    TW_CUDA_TRY(cudaMalloc(&s->a[i], 2 * a_elems + 256));
    TW_CUDA_TRY(cudaMalloc(&s->w[i], 2 * w_elems + 256));
    const uint64_t sd = o->seed * 1000003u + (uint64_t)s->rank * 64u + (uint64_t)i * 2u;
    TW_TRY(tw__baseline_fill_random(s->a[i], a_elems, sd, 1.0f, s->stream));
    TW_TRY(tw__baseline_fill_random(s->w[i], w_elems, sd + 1, w_scale, s->stream));
  }
  s->out_elems = (size_t)s->tokens * (size_t)p.hidden;
  for (int i = 0; i < TWB_NOUT; i++) TW_CUDA_TRY(cudaMalloc(&s->out[i], 2 * s->out_elems + 256));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  return TW_SUCCESS;
}

/* ---- running and timing policies ------------------------------------------------------------- */

tw_status twb_run(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st) {
  void* out = s->out[pol->out >= 0 ? pol->out : TWB_OUT_SCRATCH];
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.comm_ctas = pol->c;
  switch (pol->kind) {
    case TWB_OURS:
      opt.mode = TW_COMBINE_OVERLAP;
      break;
    case TWB_UNFUSED:
      opt.mode = TW_COMBINE_UNFUSED;
      break;
    case TWB_GEMM_ONLY:
      opt.mode = TW_COMBINE_GEMM_ONLY;
      break;
    case TWB_COMM_ONLY:
      opt.mode = TW_COMBINE_COMM_ONLY;
      break;
    case TWB_SEQ:
      return tw__baseline_sequential(s->baseline, s->a[set], s->w[set], out, st);
    case TWB_SEQ_GROUPED:
      return tw__baseline_sequential_grouped(s->baseline, s->a[set], s->w[set], out, st);
    case TWB_SEQ_PACKED:
      return tw__baseline_sequential_packed(s->baseline, s->a[set], s->w[set], out, st);
    case TWB_CHUNKED:
      return tw__baseline_chunked(s->baseline, s->a[set], s->w[set], out, pol->chunk, st);
    case TWB_CUBLAS:
      return tw__baseline_gemm(s->baseline, s->a[set], s->w[set], st);
    case TWB_NCCL:
      return tw__baseline_exchange(s->baseline, st);
    case TWB_NCCL_PACKED:
      return tw__baseline_exchange_packed(s->baseline, st);
    default:
      return tw__fail(TW_ERR_INTERNAL, "bench: unknown policy kind %d", pol->kind);
  }
  return tw_moe_combine_ex(s->ctx, s->dplans[pol->dplan], s->a[set], s->w[set], s->add ? NULL : out,
                           &opt, st);
}

/* twb_run for a correctness check: under the add dataflow ours' output is in the context's window
 * until the next call; copy it into the policy's buffer (a timed run does not). */
tw_status twb_run_checked(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st) {
  TW_TRY(twb_run(s, pol, set, st));
  if (!s->add || pol->kind > TWB_COMM_ONLY || pol->out < 0 || s->tokens == 0) return TW_SUCCESS;
  void* added = NULL;
  TW_TRY(tw_context_output(s->ctx, &added));
  TW_CUDA_TRY(
      cudaMemcpyAsync(s->out[pol->out], added, 2 * s->out_elems, cudaMemcpyDeviceToDevice, st));
  return TW_SUCCESS;
}

tw_status twb_barrier(twb_rank* s) {
  TW_NCCL_TRY(ncclAllReduce(s->barrier, s->barrier + 1, 1, ncclInt32, ncclSum, s->comm, s->stream));
  return TW_SUCCESS;
}

/* Elementwise max over ranks of n floats (host array, in place). */
tw_status twb_max_over_ranks(twb_rank* s, float* v, size_t n) {
  if (s->world == 1 || n == 0) return TW_SUCCESS;
  float* d = NULL;
  TW_CUDA_TRY(cudaMalloc((void**)&d, sizeof(float) * n));
  tw_status st = TW_SUCCESS;
  cudaError_t e = cudaMemcpyAsync(d, v, sizeof(float) * n, cudaMemcpyHostToDevice, s->stream);
  ncclResult_t r = ncclSuccess;
  if (e == cudaSuccess) r = ncclAllReduce(d, d, n, ncclFloat32, ncclMax, s->comm, s->stream);
  if (e == cudaSuccess && r == ncclSuccess)
    e = cudaMemcpyAsync(v, d, sizeof(float) * n, cudaMemcpyDeviceToHost, s->stream);
  if (e == cudaSuccess && r == ncclSuccess) e = cudaStreamSynchronize(s->stream);
  cudaFree(d);
  if (r != ncclSuccess)
    st = tw__fail(TW_ERR_NCCL, "bench: gathering samples failed: %s", ncclGetErrorString(r));
  else if (e != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "bench: gathering samples failed: %s", cudaGetErrorString(e));
  return st;
}

/* Runs every output-producing policy once on input set `set` (outputs poisoned first), checks our
 * context, and returns per policy the normwise relative difference to ours' output, max over ranks
 * (err[i] = -1 for policies without an output, 0 for ours). */
tw_status twb_check(twb_rank* s, const twb_policy* pols, int np, int set, int rerun, float* err) {
  /* The add dataflow keeps only the last call's output: run every policy again, copying it. */
  if (rerun || s->add) {
    for (int i = 0; i < TWB_NOUT; i++)
      TW_TRY(tw__fill_bf16(s->out[i], s->out_elems, TWB_POISON, s->stream));
    for (int i = 0; i < np; i++) {
      if (pols[i].out < 0) continue;
      TW_TRY(twb_barrier(s));
      TW_TRY(twb_run_checked(s, &pols[i], set, s->stream));
    }
    TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  }
  TW_TRY(tw_context_check(s->ctx));
  for (int i = 0; i < np; i++) {
    err[i] = -1.f;
    if (pols[i].out < 0) continue;
    double rel = 0;
    TW_TRY(tw__baseline_rel_diff(s->out[pols[i].out], s->out[TWB_OUT_OURS], s->out_elems,
                                 s->scratch, s->stream, &rel));
    err[i] = isfinite(rel) ? (float)rel : INFINITY;
  }
  return twb_max_over_ranks(s, err, (size_t)np);
}

/* Times every policy: warmup + iters rounds, ABBA order, max over ranks per sample. samples: (np,
 * iters) microseconds. */
tw_status twb_time(twb_rank* s, const twb_opts* o, const twb_policy* pols, int np, float* samples,
                   int* last_set) {
  cudaEvent_t e0, e1;
  TW_CUDA_TRY(cudaEventCreate(&e0));
  TW_CUDA_TRY(cudaEventCreate(&e1));
  tw_status st = TW_SUCCESS;
  const int rounds = o->warmup + o->iters;
  for (int round = 0; round < rounds && st == TW_SUCCESS; round++) {
    const int set = round % s->nsets;
    *last_set = set;
    for (int j = 0; j < np && st == TW_SUCCESS; j++) {
      const int i = (round % 2 == 0) ? j : np - 1 - j;
      if ((st = twb_barrier(s)) != TW_SUCCESS) break;
      if ((st = tw__bench_delay(s->stream, o->delay_us)) != TW_SUCCESS) break;
      cudaError_t e = cudaEventRecord(e0, s->stream);
      if (e == cudaSuccess && (st = twb_run(s, &pols[i], set, s->stream)) != TW_SUCCESS) break;
      if (e == cudaSuccess) e = cudaEventRecord(e1, s->stream);
      if (e == cudaSuccess) e = cudaEventSynchronize(e1);
      float ms = 0.f;
      if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
      if (e != cudaSuccess) {
        st = tw__fail(TW_ERR_CUDA, "bench: timing %s failed: %s", pols[i].name,
                      cudaGetErrorString(e));
        break;
      }
      if (round >= o->warmup) samples[(size_t)i * o->iters + (round - o->warmup)] = ms * 1000.f;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  TW_TRY(st);
  return twb_max_over_ranks(s, samples, (size_t)np * (size_t)o->iters);
}

/* The model's prediction of the call: the largest of the ranks' own predictions under the default
 * config (each rank plans for itself and the slowest bounds the call; rank 0's alone can be far
 * below it on skewed routings, dev/NOTES.md section 15). The caller has already planned
 * `known_rank` (its prediction `known_us`): only the other ranks are planned here. */
tw_status twb_predicted_call(const tw_problem* p, tw_routing_t rt, int known_rank, double known_us,
                             double* us) {
  *us = known_us;
  for (int r = 0; r < p->world_size; r++) {
    if (r == known_rank) continue;
    tw_plan_t plan = NULL;
    const tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    tw_plan_summary sum;
    tw_status st = tw_plan_create(p, rt, r, &cfg, &plan);
    if (st == TW_SUCCESS) st = tw_plan_summary_get(plan, &sum);
    tw_plan_destroy(plan);
    TW_TRY(st);
    if (sum.predicted_us > *us) *us = sum.predicted_us;
  }
  return TW_SUCCESS;
}
