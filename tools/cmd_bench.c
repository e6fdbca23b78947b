/*
 * cmd_bench.c: `tilewave bench` and `tilewave sweep`, the measurements behind every speedup
 * tilewave reports.
 *
 * Both spawn one process per visible GPU (or run as one rank under mpirun/torchrun), build the
 * same routing on every rank from a seed, plan every rank, and time, on identical inputs:
 *   ours         tw_moe_combine, tile-level overlap (C and mgb from the model unless given)
 *   unfused      the same kernels, transfer after the GEMM (TW_COMBINE_UNFUSED)
 *   gemm         the producer alone on the SMs it gets during overlap (TW_COMBINE_GEMM_ONLY)
 *   comm         the consumer and reduction alone (TW_COMBINE_COMM_ONLY)
 *   seq[_form]   cuBLAS per expert, NCCL send/recv, the same reduction (baseline.h); the table
 *                shows the fastest of the loop, grouped and packed forms
 *   chunkR       cuBLAS over R-row chunks of remote rows, copy-engine push per chunk
 * Measurement: warm-up rounds, then rounds that run every policy once, in forward order on even
 * rounds and reverse order on odd ones (ABBA), on input sets rotated so that the inputs cycled
 * exceed L2. Every sample starts after a cross-rank barrier and a short device delay (so that the
 * host has finished enqueuing when the timed region starts), is timed with CUDA events on each
 * rank, and the sample's latency is the MAXIMUM over ranks (an allreduce of the samples). Medians
 * and p10/p90 are reported. Every output is compared with ours before and after timing.
 * `tilewave sweep` times every (C, mgb) of one point against the model's choice; `sweep --oracle`
 * does so over a workload matrix (tools/oracle.c) and summarises the model's regret, the best
 * single fixed (C, mgb) and the model's solve time inside tw_plan_create.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "bench_common.h"
#include "checks.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "runtime.h"
#include "spawn.h"
#include "tilewave.h"

#define TWB_MAX_TOKENS_LIST 8
#define TWB_MAX_CHUNKS 8
#define TWB_MAX_ONLY 64
#define TWB_L2_BYTES (60ull << 20)
#define TWB_POISON 0x7FC1u /* a bf16 NaN: an element nobody wrote fails the check */

typedef struct twb_opts {
  int sweep;
  const char* model;
  int hidden, ffn, experts, topk; /* 0 = not given */
  int tokens[TWB_MAX_TOKENS_LIST];
  int ntokens;
  int router; /* tw_router, -1 = not given */
  double router_param;
  const char* routing_file;
  const char* write_routing;
  uint64_t seed;
  int comm_ctas, coalesce;
  int iters, warmup;
  int json, full, ranks, timeout_s, delay_us, c_max;
  const char* json_file; /* JSON written here (rank 0) besides the table on stdout */
  int chunks[TWB_MAX_CHUNKS];
  int nchunks;
  double tol;
  int oracle;             /* sweep --oracle: a workload matrix instead of one point */
  const char* matrix;     /* "quick" or "full" */
  int list;               /* --list: print the matrix and a time estimate, measure nothing */
  int solve_reps;         /* tw_plan_create calls timed per point (0 = none) */
  int confirm;            /* sweep: rounds of the confirmation timing (0 = none) */
  int versus;             /* sweep --oracle: rounds of the head-to-head with the best fixed */
  int only[TWB_MAX_ONLY]; /* --points: 1-based matrix indices to measure; nonly = 0: all */
  int nonly;
  int phases;         /* bench --phases: time ours' phases with the context's events */
  int tile_m, tile_n; /* GEMM2 tile (0: the library's choice) */
  int add;            /* the add dataflow (--dataflow / TW_COMBINE_DATAFLOW, resolved once) */
} twb_opts;

typedef struct twb_point {
  int hidden, ffn, experts, topk, tokens, router;
  double router_param;
  char name[32]; /* sweep --oracle: the preset, or "grid" */
  int index;     /* sweep --oracle: 1-based index in the matrix (as --list numbers it) */
} twb_point;

enum twb_kind { /* ours' modes first (twb_run_checked relies on it), then the baselines */
                TWB_OURS,
                TWB_UNFUSED,
                TWB_GEMM_ONLY,
                TWB_COMM_ONLY,
                TWB_SEQ,
                TWB_SEQ_GROUPED,
                TWB_SEQ_PACKED,
                TWB_CHUNKED,
                TWB_CUBLAS,
                TWB_NCCL,
                TWB_NCCL_PACKED
};

typedef struct twb_policy {
  int kind;
  int c;     /* comm CTAs for our modes; 0 = the plan's */
  int dplan; /* which uploaded plan (sweep: one per mgb) */
  int chunk; /* rows per chunk for TWB_CHUNKED */
  int out;   /* output buffer index; -1 = none (no checkable output) */
  char name[24];
} twb_policy;

#define TWB_MAX_DPLANS 5
enum {
  TWB_OUT_OURS,
  TWB_OUT_UNFUSED,
  TWB_OUT_SEQ,
  TWB_OUT_SEQ_GROUPED,
  TWB_OUT_SEQ_PACKED,
  TWB_OUT_CHUNKED,
  TWB_OUT_SCRATCH,
  TWB_NOUT
};

/* One rank's state for one point. */
typedef struct twb_rank {
  int rank, world;
  ncclComm_t comm;
  cudaStream_t stream;
  int32_t* barrier;  /* (2) device */
  uint32_t* scratch; /* (2) device, for tw__baseline_rel_diff */
  tw_problem problem;
  tw_routing_t routing;
  tw_plan_t* plans;                 /* (world) */
  tw_plan_t mplans[TWB_MAX_DPLANS]; /* sweep: plans per mgb, this rank */
  int mgbs[TWB_MAX_DPLANS];
  int ndplans;
  tw_context_t ctx;
  tw_device_plan_t dplans[TWB_MAX_DPLANS];
  tw_baseline_t baseline;
  int nsets;
  void* a[4];          /* (rows, F) bf16 per input set */
  void* w[4];          /* (E, H, F) bf16 per input set */
  void* out[TWB_NOUT]; /* (tokens, H) bf16 */
  size_t out_elems;
  int32_t tokens;
  FILE* json_out; /* rank 0: the --json-file stream, else NULL */
  int add;        /* the add dataflow: ours' output lives in the context (tw_context_output) */
} twb_rank;

/* ---- one rank's setup and teardown ----------------------------------------------------------- */

static void twb_rank_free(twb_rank* s) {
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
static tw_status twb_setup(twb_rank* s, const twb_opts* o, const twb_point* pt,
                           const int* sweep_mgbs, int n_sweep) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = s->world;
  p.hidden = pt->hidden;
  p.ffn = pt->ffn;
  p.experts = pt->experts;
  p.top_k = pt->topk;
  p.max_tokens = pt->tokens;
  p.tile_m = o->tile_m;
  p.tile_n = o->tile_n;
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

static tw_status twb_run(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st) {
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
static tw_status twb_run_checked(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st) {
  TW_TRY(twb_run(s, pol, set, st));
  if (!s->add || pol->kind > TWB_COMM_ONLY || pol->out < 0 || s->tokens == 0) return TW_SUCCESS;
  void* added = NULL;
  TW_TRY(tw_context_output(s->ctx, &added));
  TW_CUDA_TRY(
      cudaMemcpyAsync(s->out[pol->out], added, 2 * s->out_elems, cudaMemcpyDeviceToDevice, st));
  return TW_SUCCESS;
}

static tw_status twb_barrier(twb_rank* s) {
  TW_NCCL_TRY(ncclAllReduce(s->barrier, s->barrier + 1, 1, ncclInt32, ncclSum, s->comm, s->stream));
  return TW_SUCCESS;
}

/* Elementwise max over ranks of n floats (host array, in place). */
static tw_status twb_max_over_ranks(twb_rank* s, float* v, size_t n) {
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
static tw_status twb_check(twb_rank* s, const twb_policy* pols, int np, int set, int rerun,
                           float* err) {
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
static tw_status twb_time(twb_rank* s, const twb_opts* o, const twb_policy* pols, int np,
                          float* samples, int* last_set) {
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
static tw_status twb_predicted_call(const tw_problem* p, tw_routing_t rt, int known_rank,
                                    double known_us, double* us) {
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

/* ---- bench ----------------------------------------------------------------------------------- */

typedef struct twb_bench_result {
  twb_point pt;
  int c, mgb;
  double predicted_us, model_seq_us;
  int np;
  twb_policy pols[24];
  tw__bench_stats st[24];
  float err[24];
  /* --phases: medians of ours' total, producer end, consumer end (both from the call's start),
   * join (from the later of the two ends to the reduction's start) and the reduction's own time
   * (with the wait for the peers' consumers), each sample the max over ranks; phase_n = 0 when
   * not measured */
  double phase_total, phase_gemm, phase_comm, phase_join, phase_reduce;
  double phase_zero; /* add dataflow: the next buffer's zeroing copies end (0: reduce) */
  int phase_n;
  /* --phases, the sequential loop (0) and the fastest chunked size (1): medians of the GEMMs'
   * end, the exchange's (last copy's) end, the reduction's start and the total, from the call's
   * start, each sample the max over ranks (tw__baseline_timeline); bphase_rows: the chunk size */
  double bphase[2][4];
  int bphase_rows;
} twb_bench_result;

static int twb_policy_index(const twb_bench_result* r, int kind, int chunk) {
  for (int i = 0; i < r->np; i++)
    if (r->pols[i].kind == kind && (kind != TWB_CHUNKED || r->pols[i].chunk == chunk)) return i;
  return -1;
}

static void twb_add(twb_bench_result* r, int kind, int c, int chunk, int out, const char* name) {
  twb_policy* p = &r->pols[r->np++];
  memset(p, 0, sizeof *p);
  p->kind = kind;
  p->c = c;
  p->chunk = chunk;
  p->out = out;
  snprintf(p->name, sizeof p->name, "%s", name);
}

/* --phases for the baselines: the sequential loop and the fastest chunked size (by the timed
 * rounds' medians), o->iters more calls each with the baseline's phase events, as for ours. */
static tw_status twb_time_baseline_phases(twb_rank* s, const twb_opts* o, twb_bench_result* r) {
  int best = -1;
  for (int i = 0; i < r->np; i++)
    if (r->pols[i].kind == TWB_CHUNKED && (best < 0 || r->st[i].median < r->st[best].median))
      best = i;
  const int pol[2] = {twb_policy_index(r, TWB_SEQ, 0), best};
  r->bphase_rows = best >= 0 ? r->pols[best].chunk : 0;
  const int n = o->iters;
  float* v = (float*)calloc(4 * (size_t)n, sizeof(float));
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  tw_status st = tw__baseline_set_timing(s->baseline, 1);
  for (int b = 0; b < 2 && st == TW_SUCCESS; b++) {
    if (pol[b] < 0) continue;
    for (int i = 0; i < n && st == TW_SUCCESS; i++) {
      tw__bl_timeline t;
      if ((st = twb_barrier(s)) != TW_SUCCESS) break;
      if ((st = tw__bench_delay(s->stream, o->delay_us)) != TW_SUCCESS) break;
      if ((st = twb_run(s, &r->pols[pol[b]], i % s->nsets, s->stream)) != TW_SUCCESS) break;
      if ((st = tw__baseline_timeline(s->baseline, &t)) != TW_SUCCESS) break;
      v[i] = 1e3f * t.gemm_end_ms;
      v[n + i] = 1e3f * t.comm_end_ms;
      v[2 * n + i] = 1e3f * t.reduce_start_ms;
      v[3 * n + i] = 1e3f * t.total_ms;
    }
    if (st == TW_SUCCESS) st = twb_max_over_ranks(s, v, 4 * (size_t)n);
    for (int k = 0; k < 4 && st == TW_SUCCESS; k++) {
      tw__bench_stats q;
      tw__bench_stats_of(v + (size_t)k * n, n, &q);
      r->bphase[b][k] = q.median;
    }
  }
  const tw_status off = tw__baseline_set_timing(s->baseline, 0);
  free(v);
  return st != TW_SUCCESS ? st : off;
}

/* --phases: runs ours o->iters more times with the context's phase events (tw__context_timeline;
 * each call waited for), after the same device delay as the timed rounds so
 * that the start event does not count host launch time. Per call and rank: when the producer
 * and the consumer end, the reduction's kernel time, and the gap between the later of the two
 * ends and the reduction's start (the cross-stream join and the launch); each the max over ranks
 * per call, then the median over calls. */
static tw_status twb_time_phases(twb_rank* s, const twb_opts* o, twb_bench_result* r) {
  const int n = o->iters;
  float* v = (float*)calloc(6 * (size_t)n, sizeof(float));
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  const twb_policy* ours = &r->pols[twb_policy_index(r, TWB_OURS, 0)];
  tw_status st = TW_SUCCESS;
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    tw_combine_timings t;
    if ((st = twb_barrier(s)) != TW_SUCCESS) break;
    if ((st = tw__bench_delay(s->stream, o->delay_us)) != TW_SUCCESS) break;
    if ((st = twb_run(s, ours, i % s->nsets, s->stream)) != TW_SUCCESS) break;
    float comm_end = 0, red_start = 0, zero_end = 0;
    if ((st = tw__context_timeline(s->ctx, &t, &comm_end, &red_start, &zero_end)) != TW_SUCCESS)
      break;
    v[i] = 1e3f * t.total_ms;
    v[n + i] = 1e3f * t.gemm_ms;
    v[2 * n + i] = 1e3f * comm_end;
    v[3 * n + i] = 1e3f * t.reduce_ms;
    v[4 * n + i] = 1e3f * (red_start - (t.gemm_ms > comm_end ? t.gemm_ms : comm_end));
    v[5 * n + i] = 1e3f * zero_end;
  }
  if (st == TW_SUCCESS) st = twb_max_over_ranks(s, v, 6 * (size_t)n);
  if (st == TW_SUCCESS) {
    tw__bench_stats q[6];
    for (int k = 0; k < 6; k++) tw__bench_stats_of(v + (size_t)k * n, n, &q[k]);
    r->phase_zero = q[5].median;
    r->phase_total = q[0].median, r->phase_gemm = q[1].median;
    r->phase_comm = q[2].median, r->phase_reduce = q[3].median;
    r->phase_join = q[4].median;
    r->phase_n = n;
  }
  free(v);
  if (st == TW_SUCCESS) st = twb_time_baseline_phases(s, o, r);
  return st;
}

static tw_status twb_bench_point(twb_rank* s, const twb_opts* o, const twb_point* pt,
                                 twb_bench_result* r) {
  memset(r, 0, sizeof *r);
  r->pt = *pt;
  TW_TRY(twb_setup(s, o, pt, NULL, 0));
  r->pt.tokens = s->problem.max_tokens; /* a replayed routing's busiest rank */
  tw_plan_summary sum;
  TW_TRY(tw_plan_summary_get(s->plans[s->rank], &sum));
  r->c = sum.comm_ctas;
  r->mgb = sum.coalesce;
  r->predicted_us = sum.predicted_us;
  r->model_seq_us = sum.sequential_us;

  twb_add(r, TWB_OURS, 0, 0, TWB_OUT_OURS, "ours");
  twb_add(r, TWB_SEQ, 0, 0, TWB_OUT_SEQ, "seq");
  {
    /* The grouped form needs a cuBLAS that supports it for bf16: probe once, agree on all ranks,
     * and leave the policy out (the loop form remains) where any rank cannot run it. */
    float unsupported = 0.f;
    if (tw__baseline_gemm_grouped(s->baseline, s->a[0], s->w[0], s->stream) != TW_SUCCESS ||
        cudaStreamSynchronize(s->stream) != cudaSuccess) {
      fprintf(stderr, "tilewave: rank %d: grouped cuBLAS GEMM unavailable (%s); left out\n",
              s->rank, tw_last_error());
      unsupported = 1.f;
    }
    TW_TRY(twb_max_over_ranks(s, &unsupported, 1));
    if (unsupported == 0.f) twb_add(r, TWB_SEQ_GROUPED, 0, 0, TWB_OUT_SEQ_GROUPED, "seq_grouped");
  }
  twb_add(r, TWB_SEQ_PACKED, 0, 0, TWB_OUT_SEQ_PACKED, "seq_packed");
  twb_add(r, TWB_UNFUSED, 0, 0, TWB_OUT_UNFUSED, "unfused");
  for (int i = 0; i < o->nchunks; i++) {
    char name[24];
    snprintf(name, sizeof name, "chunk%d", o->chunks[i]);
    twb_add(r, TWB_CHUNKED, 0, o->chunks[i], TWB_OUT_CHUNKED, name);
  }
  twb_add(r, TWB_GEMM_ONLY, 0, 0, -1, "gemm");
  twb_add(r, TWB_COMM_ONLY, 0, 0, -1, "comm");
  twb_add(r, TWB_CUBLAS, 0, 0, -1, "cublas");
  twb_add(r, TWB_NCCL, 0, 0, -1, "nccl");
  twb_add(r, TWB_NCCL_PACKED, 0, 0, -1, "nccl_packed");

  /* Correctness before timing: every policy on set 0 against ours; the chunked policies share an
   * output buffer, so check each on its own. */
  float err[24], err2[24];
  for (int i = 0; i < r->np; i++) r->err[i] = -1.f;
  twb_policy one[2];
  one[0] = r->pols[0];
  for (int i = 1; i < r->np; i++) {
    if (r->pols[i].out < 0) continue;
    one[1] = r->pols[i];
    TW_TRY(twb_check(s, one, 2, 0, 1, err));
    r->err[i] = err[1];
  }
  r->err[0] = 0.f;

  float* samples = (float*)calloc((size_t)r->np * (size_t)o->iters, sizeof(float));
  if (samples == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  int last_set = 0;
  tw_status st = twb_time(s, o, r->pols, r->np, samples, &last_set);
  /* Correctness after timing: the last round ran every policy on one input set. */
  if (st == TW_SUCCESS) st = twb_check(s, r->pols, r->np, last_set, 0, err2);
  if (st == TW_SUCCESS) {
    for (int i = 0; i < r->np; i++) {
      if (err2[i] > r->err[i] && r->pols[i].kind != TWB_CHUNKED) r->err[i] = err2[i];
      tw__bench_stats_of(samples + (size_t)i * o->iters, o->iters, &r->st[i]);
    }
    /* The last chunked policy of the last round wrote the shared buffer; fold its check in. */
    const int lastc = (o->warmup + o->iters - 1) % 2 == 0
                          ? twb_policy_index(r, TWB_CHUNKED, o->chunks[o->nchunks - 1])
                          : twb_policy_index(r, TWB_CHUNKED, o->chunks[0]);
    if (lastc >= 0 && err2[lastc] > r->err[lastc]) r->err[lastc] = err2[lastc];
  }
  free(samples);
  if (st == TW_SUCCESS && o->phases) st = twb_time_phases(s, o, r);
  return st;
}

/* The add dataflow's zeroing in the phases line (its copies run beside the call). */
static const char* twb_zero_note(const twb_bench_result* r) {
  static char note[96];
  note[0] = '\0';
  if (r->phase_zero > 0)
    snprintf(note, sizeof note, "; the next buffer's zeroing (copy engine) ends at %.1f us",
             r->phase_zero);
  return note;
}

static void twb_print_header(const twb_opts* o) {
  printf("Combine dataflow: %s.\n\n",
         tw__dataflow_name(o->add ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE));
  printf(
      "| tokens/rank | K | N | E | router | seq us (form) | ours us (p10-p90) | speedup | gemm us "
      "| comm us | ideal us | eff | overlap | C | mgb | unfused us | chunked us (rows) | max rel "
      "err | check |\n");
  printf(
      "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: | --- |\n");
}

/* Derived numbers of one point. */
typedef struct twb_derived {
  double seq, ours, gemm, comm, ideal, eff, overlap, speedup, unfused, chunk;
  const char* seq_variant; /* the fastest sequential form: "loop", "grouped" or "packed" */
  int chunk_rows;
  double max_err;
  int pass;
} twb_derived;

static void twb_derive(const twb_opts* o, const twb_bench_result* r, twb_derived* d) {
  memset(d, 0, sizeof *d);
  d->ours = r->st[twb_policy_index(r, TWB_OURS, 0)].median;
  /* The sequential baseline is the fastest of its forms at this point. */
  static const struct {
    int kind;
    const char* name;
  } forms[] = {{TWB_SEQ, "loop"}, {TWB_SEQ_GROUPED, "grouped"}, {TWB_SEQ_PACKED, "packed"}};
  d->seq = INFINITY;
  d->seq_variant = "none";
  for (int i = 0; i < 3; i++) {
    const int k = twb_policy_index(r, forms[i].kind, 0);
    if (k >= 0 && r->st[k].median < d->seq) {
      d->seq = r->st[k].median;
      d->seq_variant = forms[i].name;
    }
  }
  d->gemm = r->st[twb_policy_index(r, TWB_GEMM_ONLY, 0)].median;
  d->comm = r->st[twb_policy_index(r, TWB_COMM_ONLY, 0)].median;
  d->unfused = r->st[twb_policy_index(r, TWB_UNFUSED, 0)].median;
  d->ideal = d->gemm > d->comm ? d->gemm : d->comm;
  d->eff = d->ours > 0 ? d->ideal / d->ours : 0;
  d->speedup = d->ours > 0 ? d->seq / d->ours : 0;
  const double shorter = d->gemm < d->comm ? d->gemm : d->comm;
  d->overlap = shorter > 0 ? (d->gemm + d->comm - d->ours) / shorter : 0;
  d->chunk = INFINITY;
  for (int i = 0; i < o->nchunks; i++) {
    const int k = twb_policy_index(r, TWB_CHUNKED, o->chunks[i]);
    if (r->st[k].median < d->chunk) {
      d->chunk = r->st[k].median;
      d->chunk_rows = o->chunks[i];
    }
  }
  d->max_err = 0;
  for (int i = 0; i < r->np; i++)
    if (r->err[i] > d->max_err) d->max_err = r->err[i];
  d->pass = d->max_err <= o->tol;
}

static void twb_print_row(const twb_opts* o, const twb_bench_result* r) {
  twb_derived d;
  twb_derive(o, r, &d);
  const tw__bench_stats* so = &r->st[twb_policy_index(r, TWB_OURS, 0)];
  printf(
      "| %d | %d | %d | %d | %s | %.1f (%s) | %.1f (%.1f-%.1f) | %.2fx | %.1f | %.1f | %.1f | %.2f "
      "| %.2f | %d | %d | %.1f | %.1f (%d) | %.2e | %s |\n",
      r->pt.tokens, r->pt.ffn, r->pt.hidden, r->pt.experts, tw__cli_router_name(r->pt.router),
      d.seq, d.seq_variant, d.ours, so->p10, so->p90, d.speedup, d.gemm, d.comm, d.ideal, d.eff,
      d.overlap, r->c, r->mgb, d.unfused, d.chunk, d.chunk_rows, d.max_err,
      d.pass ? "pass" : "FAIL");
  if (r->phase_n > 0 && o->add) /* no reduction: the consumer waited for the peers' adds */
    printf(
        "|  | phases of ours (median of %d, max over ranks): producer ends at %.1f us, "
        "consumer at %.1f us (incl. waiting for the peers' adds); the call ends %.1f us after "
        "both (the join and the timing events); total %.1f us%s |\n",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join + r->phase_reduce, r->phase_total,
        twb_zero_note(r));
  else if (r->phase_n > 0)
    printf(
        "|  | phases of ours (median of %d, max over ranks): producer ends at %.1f us, "
        "consumer at %.1f us; the reduction starts %.1f us after both and takes %.1f us "
        "(incl. waiting for the peers); total %.1f us%s |\n",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join, r->phase_reduce, r->phase_total,
        twb_zero_note(r));
  if (r->phase_n > 0)
    printf(
        "|  | phases of the baselines (from each call's start): sequential GEMMs end at %.1f us, "
        "its exchange at %.1f, its reduction runs %.1f-%.1f us; chunked (%d rows) GEMMs end at "
        "%.1f us, copies at %.1f, reduction %.1f-%.1f us |\n",
        r->bphase[0][0], r->bphase[0][1], r->bphase[0][2], r->bphase[0][3], r->bphase_rows,
        r->bphase[1][0], r->bphase[1][1], r->bphase[1][2], r->bphase[1][3]);
  fflush(stdout);
}

static void twb_print_json_point(FILE* f, const twb_opts* o, const twb_bench_result* r, int first) {
  twb_derived d;
  twb_derive(o, r, &d);
  fprintf(f,
          "%s  {\"dataflow\": \"%s\", \"tokens_per_rank\": %d, \"ffn\": %d, \"hidden\": %d, "
          "\"experts\": %d, \"top_k\": "
          "%d, \"router\": \"%s\", \"comm_ctas\": %d, \"coalesce\": %d, \"model_predicted_us\": "
          "%.2f, \"model_sequential_us\": %.2f,\n",
          first ? "" : ",\n", tw__dataflow_name(o->add ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE),
          r->pt.tokens, r->pt.ffn, r->pt.hidden, r->pt.experts, r->pt.topk,
          tw__cli_router_name(r->pt.router), r->c, r->mgb, r->predicted_us, r->model_seq_us);
  fprintf(f,
          "   \"seq_us\": %.2f, \"seq_variant\": \"%s\", \"ours_us\": %.2f, \"speedup\": %.4f, "
          "\"gemm_us\": %.2f, \"comm_us\": %.2f, \"ideal_us\": %.2f, \"efficiency\": %.4f, "
          "\"overlap_ratio\": %.4f, \"unfused_us\": %.2f, \"chunked_us\": %.2f, \"chunked_rows\": "
          "%d, \"max_rel_err\": %.3e, \"pass\": %s,\n   \"policies\": [",
          d.seq, d.seq_variant, d.ours, d.speedup, d.gemm, d.comm, d.ideal, d.eff, d.overlap,
          d.unfused, d.chunk, d.chunk_rows, d.max_err < 1e30 ? d.max_err : 1e30,
          d.pass ? "true" : "false");
  for (int i = 0; i < r->np; i++)
    fprintf(f,
            "%s{\"name\": \"%s\", \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f, "
            "\"min_us\": %.2f, \"samples\": %d, \"rel_err\": %.3e}",
            i ? ",\n     " : "", r->pols[i].name, r->st[i].median, r->st[i].p10, r->st[i].p90,
            r->st[i].min, r->st[i].n, r->err[i] < 1e30f ? (double)r->err[i] : 1e30);
  fprintf(f, "]");
  if (r->phase_n > 0)
    fprintf(
        f,
        ",\n   \"phases_us\": {\"samples\": %d, \"producer_end\": %.2f, \"consumer_end\": %.2f, "
        "\"join\": %.2f, \"reduce\": %.2f, \"total\": %.2f, \"zeroing_end\": %.2f}",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join, r->phase_reduce, r->phase_total,
        r->phase_zero);
  if (r->phase_n > 0)
    for (int b = 0; b < 2; b++)
      fprintf(f,
              ",\n   \"%s_phases_us\": {\"rows\": %d, \"gemm_end\": %.2f, \"comm_end\": %.2f, "
              "\"reduce_start\": %.2f, \"total\": %.2f}",
              b == 0 ? "seq" : "chunked", b == 0 ? 0 : r->bphase_rows, r->bphase[b][0],
              r->bphase[b][1], r->bphase[b][2], r->bphase[b][3]);
  fprintf(f, "}");
}

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
static tw_status twb_sweep_point(twb_rank* s, const twb_opts* o, const twb_point* pt) {
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
      fprintf(js,
              "{\"command\": \"sweep\", \"world_size\": %d, \"tokens_per_rank\": %d, \"ffn\": %d, "
              "\"hidden\": %d, \"experts\": %d, \"top_k\": %d, \"router\": \"%s\", \"seq_us\": "
              "%.2f,\n \"oracle\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %.2f},\n "
              "\"model\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %.2f, \"predicted_us\": "
              "%.2f, \"solve_us\": %.3f},\n \"regret\": %.4f, \"max_rel_err\": %.3e, \"pass\": "
              "%s,\n \"solve_us\": {\"median\": %.3f, \"p99\": %.3f}, \"plan_create_us\": "
              "{\"median\": %.1f, \"p99\": %.1f}, \"solve_reps\": %d,\n \"configs\": [",
              s->world, pt->tokens, pt->ffn, pt->hidden, pt->experts, pt->topk,
              tw__cli_router_name(pt->router), sts[0].median, pols[best].c,
              s->mgbs[pols[best].dplan], r->t_oracle, ms.comm_ctas, ms.coalesce, r->t_model,
              ms.predicted_us, ms.solve_us, r->regret, (double)r->maxerr,
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

/* What rank 0 keeps over the matrix for the summary: per point, the measured median of every
 * fixed (C, mgb) candidate, index m * c_max + (C - 1) (NaN where not measured), the model's
 * measured time, and the planning times. */
typedef struct twb_oracle_acc {
  int npoints, ncand, done, failed;
  double* t;        /* (npoints, ncand) */
  double* t_model;  /* (npoints) */
  double* t_other;  /* (npoints) the model's (C, mgb) with the other schedule */
  double* regret_c; /* (npoints) the regret of the confirmation timing; NaN where not done */
  double* solve_med;
  double* solve_p99;
  double* create_med;
  double* create_p99;
  double t_start;
} twb_oracle_acc;

/* ---- sweep --oracle --versus-fixed: the model against the best fixed (C, mgb) ------------- */

/* Whether the model's choice beats a static partition is decided cell by cell in the matrix by
 * medians timed among ~100 other cells; where the two are within a fraction of a percent that is a
 * coin toss. This pass times the two launches back to back instead (ABBA), `versus` rounds, after
 * the matrix has named the best fixed cell, and gives per point the median of the paired ratios
 * model / fixed with a distribution-free 95% interval. */
typedef struct twb_versus {
  int identical; /* every rank's choice is the fixed cell itself: nothing timed, ratio 1 */
  double model_us, fixed_us;
  double ratio, lo, hi; /* median of model / fixed over the rounds, its 95% interval */
  float maxerr;         /* the two outputs against each other (bit-identical expected) */
} twb_versus;

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
static tw_status twb_versus_pass(twb_rank* s, const twb_opts* o, const twb_point* pts, int npoints,
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
  const double t_start = tw__now_seconds();
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
      const double el = tw__now_seconds() - t_start;
      if (one.identical)
        fprintf(stderr, "[versus %d/%d] #%d %s: the model chose (%d, %d) itself\n", i + 1, npoints,
                pts[i].index, pts[i].name, fixed[0], fixed[1]);
      else
        fprintf(stderr,
                "[versus %d/%d] #%d %s: model %.1f us, fixed (%d, %d) %.1f us, model/fixed %.4f "
                "[%.4f, %.4f]; elapsed %.0f s, ETA %.0f s\n",
                i + 1, npoints, pts[i].index, pts[i].name, one.model_us, fixed[0], fixed[1],
                one.fixed_us, one.ratio, one.lo, one.hi, el, el / (i + 1) * (npoints - i - 1));
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
static void twb_oracle_begin(const twb_opts* o, int nranks, FILE* js) {
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
    fprintf(js,
            "%s  {\"index\": %d, \"workload\": \"%s\", \"tokens_per_rank\": %d, \"ffn\": %d, "
            "\"hidden\": %d, \"experts\": %d, \"top_k\": %d, \"router\": \"%s\",\n   "
            "\"oracle\": {\"comm_ctas\": %d, \"coalesce\": %d, \"us\": %.2f},\n   \"model\": "
            "{\"comm_ctas\": %d, \"coalesce\": %d, \"comm_ctas_min\": %d, \"comm_ctas_max\": "
            "%d, \"coalesce_min\": %d, \"coalesce_max\": %d, \"us\": %.2f, \"predicted_us\": "
            "%.2f, \"predicted_call_us\": %.2f, \"sequential_predicted_us\": %.2f, "
            "\"schedule\": \"%s\", "
            "\"other_schedule_us\": %.2f},\n   \"regret\": %.5f, \"solve_us\": "
            "{\"median\": %.3f, \"p99\": %.3f}, \"plan_create_us\": {\"median\": %.1f, \"p99\": "
            "%.1f}, \"solve_reps\": %d, \"max_rel_err\": %.3e, \"pass\": %s, \"seconds\": %.1f,"
            "\n   \"configs\": [",
            index ? ",\n" : "", pt->index, pt->name, pt->tokens, pt->ffn, pt->hidden, pt->experts,
            pt->topk, tw__cli_router_name(pt->router), b->c, s->mgbs[b->dplan], r->t_oracle,
            ms->comm_ctas, ms->coalesce, r->model_c_lo, r->model_c_hi, r->model_mgb_lo,
            r->model_mgb_hi, r->t_model, ms->predicted_us, r->predicted_call, ms->sequential_us,
            tw__cli_schedule_name(ms->schedule), r->t_other, r->regret, r->solve_med, r->solve_p99,
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
  const double el = tw__now_seconds() - acc->t_start;
  fprintf(stderr,
          "[oracle %d/%d] #%d %s: model C=%s mgb=%s %.1f us, oracle C=%d mgb=%d %.1f us, regret "
          "%.2f%%%s%s; %.1f s; elapsed %.0f s, ETA %.0f s\n",
          index + 1, npoints, pt->index, pt->name, mc, mm, r->t_model, b->c, s->mgbs[b->dplan],
          r->t_oracle, 100 * r->regret, confirmed, pass ? "" : ", FAILED the check",
          tw__now_seconds() - t0, el, el / (index + 1) * (npoints - index - 1));
}

static int twb_oracle_point(twb_rank* s, const twb_opts* o, const twb_point* pt, int index,
                            int npoints, twb_oracle_acc* acc, FILE* js, tw_status* status) {
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
static void twb_oracle_summary(const twb_opts* o, int world, const twb_point* pts,
                               const twb_oracle_acc* acc, const twb_versus* vs, int nvs,
                               const int* vfixed, FILE* js) {
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
    fprintf(js,
            "\n ],\n \"summary\": {\"points\": %d, \"failed\": %d, \"mean_regret\": %.5f, "
            "\"max_regret\": %.5f, \"max_regret_point\": %d, \"fixed\": {\"comm_ctas\": %d, "
            "\"coalesce\": %d, \"mean_regret\": %.5f, \"max_regret\": %.5f}, \"model_slower\": %d, "
            "\"model_slower_1pct\": %d, \"other_schedule_faster\": %d, "
            "\"other_schedule_faster_1pct\": %d, \"solve_us\": {\"median_of_medians\": %.3f, "
            "\"max_median\": %.3f, \"max_p99\": %.3f}, \"plan_create_us\": {\"median_of_medians\": "
            "%.1f, \"max_median\": %.1f, \"max_p99\": %.1f}, \"confirmed\": {\"rounds\": %d, "
            "\"points\": %d, \"mean_regret\": %.5f, \"max_regret\": %.5f, \"max_regret_point\": "
            "%d}, \"seconds\": %.1f",
            n, acc->failed, ok ? sum.mean_regret : -1.0, ok ? sum.max_regret : -1.0,
            ok ? pts[sum.max_regret_point].index : 0, fc, fm, sum.fixed_mean_regret,
            sum.fixed_max_regret, sum.model_slower, sum.model_slower_1pct, sum.other_faster,
            sum.other_faster_1pct, sm, smax, sp99, cm, cmaxv, cp99, o->confirm, cn,
            cn > 0 ? csum / cn : -1.0, cn > 0 ? acc->regret_c[cmax_i] : -1.0,
            cn > 0 ? pts[cmax_i].index : 0, tw__now_seconds() - acc->t_start);
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
static int twb_oracle_list(const twb_opts* o, const twb_point* pts, int n) {
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

/* ---- ranks ----------------------------------------------------------------------------------- */

typedef struct twb_job {
  twb_opts o;
  twb_point* points;
  int npoints;
} twb_job;

static int twb_rank_main(int rank, int nranks, const ncclUniqueId* id, void* arg) {
  const twb_job* job = (const twb_job*)arg;
  const twb_opts* o = &job->o;
  twb_rank s;
  memset(&s, 0, sizeof s);
  s.rank = rank;
  s.world = nranks;
  tw_status st = TW_SUCCESS;
  ncclResult_t nr = ncclCommInitRank(&s.comm, nranks, *id, rank);
  if (nr != ncclSuccess) {
    fprintf(stderr, "tilewave: rank %d: ncclCommInitRank failed: %s\n", rank,
            ncclGetErrorString(nr));
    return TW_ERR_NCCL;
  }
  if (cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc((void**)&s.barrier, 256) != cudaSuccess ||
      cudaMalloc((void**)&s.scratch, 256) != cudaSuccess ||
      cudaMemset(s.barrier, 0, 256) != cudaSuccess) {
    fprintf(stderr, "tilewave: rank %d: CUDA setup failed\n", rank);
    ncclCommDestroy(s.comm);
    return TW_ERR_CUDA;
  }
  if (rank == 0 && o->json_file) {
    s.json_out = fopen(o->json_file, "w");
    if (s.json_out == NULL) fprintf(stderr, "tilewave: cannot write %s\n", o->json_file);
  }
  FILE* js = rank == 0 ? (o->json ? stdout : s.json_out) : NULL;
  if (js && !o->sweep)
    fprintf(js, "{\"command\": \"bench\", \"world_size\": %d, \"points\": [\n", nranks);
  if (!o->json && rank == 0 && !o->sweep) twb_print_header(o);
  twb_bench_result* res = (twb_bench_result*)calloc(1, sizeof(twb_bench_result));
  int failures = 0;
  /* sweep --oracle: rank 0 keeps every point's candidates for the summary. */
  twb_oracle_acc acc;
  memset(&acc, 0, sizeof acc);
  double* acc_buf = NULL;
  if (o->oracle && rank == 0) {
    acc.npoints = job->npoints;
    acc.ncand = 3 * o->c_max;
    acc.t_start = tw__now_seconds();
    const size_t n = (size_t)job->npoints;
    acc_buf = (double*)calloc(n * (size_t)acc.ncand + 7 * n, sizeof(double));
    if (acc_buf == NULL) st = tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
    acc.t = acc_buf;
    acc.t_model = acc_buf + n * (size_t)acc.ncand;
    acc.solve_med = acc.t_model + n, acc.solve_p99 = acc.t_model + 2 * n;
    acc.create_med = acc.t_model + 3 * n, acc.create_p99 = acc.t_model + 4 * n;
    acc.t_other = acc.t_model + 5 * n;
    acc.regret_c = acc.t_model + 6 * n;
    twb_oracle_begin(o, nranks, js);
  }
  for (int i = 0; i < job->npoints && st == TW_SUCCESS && res; i++) {
    const twb_point* pt = &job->points[i];
    if (rank == 0)
      fprintf(stderr, "[%s %d/%d] tokens/rank %d K %d N %d E %d top-%d %s\n",
              o->sweep ? "sweep" : "bench", i + 1, job->npoints, pt->tokens, pt->ffn, pt->hidden,
              pt->experts, pt->topk, tw__cli_router_name(pt->router));
    const double t0 = tw__now_seconds();
    if (o->oracle) {
      if (!twb_oracle_point(&s, o, pt, i, job->npoints, &acc, js, &st)) failures++;
    } else if (o->sweep) {
      st = twb_sweep_point(&s, o, pt);
    } else {
      st = twb_bench_point(&s, o, pt, res);
      if (st == TW_SUCCESS && rank == 0) {
        if (js) twb_print_json_point(js, o, res, i == 0);
        if (!o->json) twb_print_row(o, res);
        twb_derived d;
        twb_derive(o, res, &d);
        if (!d.pass) failures++;
        fprintf(stderr,
                "[bench %d/%d] seq %.1f us, ours %.1f us (C=%d mgb=%d), %.2fx, err %.2e, %.1f s\n",
                i + 1, job->npoints, d.seq, d.ours, res->c, res->mgb, d.speedup, d.max_err,
                tw__now_seconds() - t0);
      }
    }
    twb_rank_free(&s);
  }
  if (res == NULL) st = tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  if (js && !o->sweep) fprintf(js, "\n]}\n");
  /* The summary covers the points measured, also when a point stopped the run. */
  twb_versus* vs = NULL;
  int nvs = 0, vfixed[2] = {0, 0};
  if (o->oracle && o->versus > 0 && st == TW_SUCCESS) {
    vs = (twb_versus*)calloc((size_t)job->npoints, sizeof(twb_versus));
    if (vs == NULL)
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "sweep: out of host memory");
    else
      st = twb_versus_pass(&s, o, job->points, job->npoints, &acc, vs, vfixed, &nvs);
  }
  if (o->oracle && rank == 0 && acc_buf)
    twb_oracle_summary(o, nranks, job->points, &acc, vs, nvs, vfixed, js);
  free(vs);
  free(acc_buf);
  if (s.json_out) fclose(s.json_out);
  fflush(stdout);
  free(res);
  if (st != TW_SUCCESS)
    fprintf(stderr, "tilewave: rank %d: %s: %s\n", rank, tw_status_string(st), tw_last_error());
  cudaFree(s.barrier);
  cudaFree(s.scratch);
  cudaStreamDestroy(s.stream);
  /* A failed rank may leave peers inside a collective; abort rather than wait for them. */
  if (st != TW_SUCCESS)
    ncclCommAbort(s.comm);
  else
    ncclCommDestroy(s.comm);
  if (st == TW_SUCCESS && failures > 0) {
    if (rank == 0)
      fprintf(stderr, "tilewave %s: %d point(s) failed the correctness check\n",
              o->sweep ? "sweep" : "bench", failures);
    return TW_ERR_INTERNAL;
  }
  return (int)st;
}

/* ---- command line ---------------------------------------------------------------------------- */

static void twb_usage(FILE* f, int sweep) {
  fprintf(f, "usage: tilewave %s [options]\n\n", sweep ? "sweep" : "bench");
  fprintf(f,
          "Times tilewave's overlapped GEMM2 + combine against the sequential (cuBLAS + NCCL),\n"
          "unfused and chunked copy-engine baselines, one process per visible GPU (or one rank\n"
          "under mpirun/torchrun). Every output is checked against ours on every point.\n");
  if (sweep)
    fprintf(
        f,
        "For one point, measures every C in 1..32 and mgb in {1,2,4}; prints the table, the\n"
        "oracle, the model's choice and its regret, and the model's time inside\n"
        "tw_plan_create.\n\n"
        "workload matrix (instead of one point; no shape flags):\n"
        "  --oracle            measure a workload matrix: per point the model's choice, the\n"
        "                      oracle and the regret (T_model - T_oracle) / T_oracle; then mean\n"
        "                      and max regret, the best single fixed (C, mgb) over the matrix\n"
        "                      and on how many points the model is slower than it, and the\n"
        "                      model's solve time; defaults --iters 15 --warmup 2; the\n"
        "                      sequential baseline is run once per point as the correctness\n"
        "                      reference, not timed\n"
        "  --matrix M          quick (default; 14 points) or full (every preset at tokens/rank\n"
        "                      1024/4096/16384 and the second paper's grid, x 3 routers: 114\n"
        "                      points); implies --oracle\n"
        "  --list              print the matrix and a time estimate from the model's own\n"
        "                      predictions (rank 0's plan; no GPU needed), measure nothing\n"
        "  --solve-reps N      tw_plan_create calls timed per point for the solve time\n"
        "                      (median, p99; default 200, 0 = none)\n"
        "  --points I[,I...]   only these points of the matrix (1-based, as --list numbers\n"
        "                      them; e.g. to resume after a point that stopped the run)\n"
        "  --confirm R         then time the model's cell, the other schedule's and the 3\n"
        "                      fastest cells again together, R rounds, and report the regret\n"
        "                      against the fastest of those as well (the first timing's\n"
        "                      oracle is the minimum over ~100 noisy medians; default 0: off)\n"
        "  --versus-fixed R    after the matrix, time the model's launch and the best fixed\n"
        "                      (C, mgb) back to back at every point, R rounds, and count where\n"
        "                      the model is slower (median of the paired ratios, and with 95%%\n"
        "                      confidence); default 0: off\n\n"
        "shape (GEMM2 K = F, N = H; default: tokens/rank 8192, F 2048, H 4096, E 16, top-2,\n"
        "balanced):\n");
  else
    fprintf(f,
            "`tilewave bench gemm ...` runs the GEMM benchmark (tools/bench_gemm.cu).\n\n"
            "shape (GEMM2 K = F, N = H; default: the grid tokens/rank {8192,16384} x\n"
            "       H {4096,8192} x E {4,8,16,32,64}, F 2048, top-2, balanced):\n");
  fprintf(f,
          "  --model NAME        preset (tilewave plan --help lists them)\n"
          "  --hidden H --ffn F --experts E --topk K\n"
          "  --tile-m TM --tile-n TN  GEMM2 tile (default 128 x chosen from H)\n"
          "  --tokens T[,T...]   tokens per rank (default 8192 with --model or shape flags)\n"
          "  --router R          balanced | moderate_skew | stress_skew | target:R_EXPERT\n"
          "  --routing FILE      replay a routing file instead (docs/routing-format.md)\n"
          "  --write-routing F   write the routing used (rank 0), e.g. for bench/torch_peer.py\n"
          "  --seed S            routing and input seed (default 1)\n"
          "policy:\n"
          "  --dataflow D        reduce (rows land, then a weighted reduction; the default)\n"
          "                      or add (rows scaled and added into the owner's output; top-2\n"
          "                      at most); sets TW_COMBINE_DATAFLOW\n"
          "  --comm-ctas C       force C (default: the model's choice)\n"
          "  --coalesce MGB      force mgb (default: the model's choice)\n"
          "measurement:\n"
          "  --iters N           timed rounds (default %d%s)\n"
          "  --warmup N          untimed rounds (default %d%s)\n"
          "  --chunks R[,R...]   chunked baseline rows per chunk (default 1024,2048,4096,8192)\n"
          "  --delay-us U        device delay before each sample (default 300; 0 = count host\n"
          "                      launch time)\n",
          sweep ? 20 : 50, sweep ? "; 15 with --oracle" : "", sweep ? 3 : 5,
          sweep ? "; 2 with --oracle" : "");
  if (sweep)
    fprintf(f, "  --c-max C           largest C swept (default 32)\n");
  else
    fprintf(f,
            "  --full              the grid with all three routers\n"
            "  --phases            also time ours' phases (producer end, consumer end,\n"
            "                      reduction) with the context's events, --iters more calls\n");
  fprintf(f,
          "  --tol X             largest normwise relative error that passes (default 2e-2)\n"
          "  --ranks N           ranks to spawn (default: every visible GPU; alias --gpus)\n"
          "  --timeout S         kill the run after S seconds (default 1800)\n"
          "  --json              JSON on stdout instead of the markdown table\n"
          "  --json-file F       also write the JSON to F (the table stays on stdout)\n");
}

static void twb_usage_cb(FILE* f, void* sweep) {
  twb_usage(f, *(const int*)sweep);
}

/* Fills *o from the command line: 0 parsed, 1 help printed, 2 usage error. *shape_given: a
 * flag that sets the shape (or replays a routing) was given. */
static int twb_parse(int argc, char** argv, int sweep, twb_opts* o, int* shape_given) {
  memset(o, 0, sizeof *o);
  o->sweep = sweep;
  o->seed = 1;
  o->iters = -1; /* defaults below, once --oracle is known */
  o->warmup = -1;
  o->solve_reps = 200;
  o->timeout_s = 1800;
  o->delay_us = 300;
  o->c_max = 32;
  o->tol = 2e-2;
  o->chunks[0] = 1024, o->chunks[1] = 2048, o->chunks[2] = 4096, o->chunks[3] = 8192;
  o->nchunks = 4;
  tw_cli_router router = {-1, 0.0, NULL};
  int64_t seed = 1;
  int dataflow = -1, matrix = -1;
  static const char* const matrices[] = {"quick", "full"};
  const char* cmd = sweep ? "tilewave sweep" : "tilewave bench";
  enum { NSHAPE = 6 }; /* the first NSHAPE entries set the shape */
  tw_cli_arg args[48];
  int n = 0;
  args[n++] = tw__cli_string("--model", &o->model);
  args[n++] = tw__cli_hidden(&o->hidden);
  args[n++] = tw__cli_ffn(&o->ffn);
  args[n++] = tw__cli_experts(&o->experts);
  args[n++] = tw__cli_topk(&o->topk);
  args[n++] = tw__cli_string("--routing", &o->routing_file);
  args[n++] = tw__cli_tokens_list(o->tokens, TWB_MAX_TOKENS_LIST, &o->ntokens);
  args[n++] = tw__cli_tile_m(&o->tile_m);
  args[n++] = tw__cli_tile_n(&o->tile_n);
  args[n++] = tw__cli_router_arg(&router);
  args[n++] = tw__cli_string("--write-routing", &o->write_routing);
  args[n++] = tw__cli_seed(&seed);
  args[n++] = tw__cli_dataflow(&dataflow);
  args[n++] = tw__cli_comm_ctas(&o->comm_ctas);
  args[n++] = tw__cli_coalesce(&o->coalesce);
  args[n++] = tw__cli_iters(&o->iters);
  args[n++] = tw__cli_warmup(&o->warmup);
  args[n++] = tw__cli_int_list("--chunks", o->chunks, TWB_MAX_CHUNKS, &o->nchunks, 1, 1 << 24);
  args[n++] = tw__cli_delay_us(&o->delay_us);
  args[n++] = tw__cli_double("--tol", &o->tol, 0.0, INFINITY, 1);
  args[n++] = tw__cli_ranks(&o->ranks);
  args[n++] = tw__cli_timeout(&o->timeout_s);
  args[n++] = tw__cli_json(&o->json);
  args[n++] = tw__cli_json_file(&o->json_file);
  if (sweep) {
    args[n++] = tw__cli_int("--c-max", &o->c_max, 1, TW_MAX_COMM_CTAS);
    args[n++] = tw__cli_bool("--oracle", &o->oracle);
    args[n++] = tw__cli_choice("--matrix", &matrix, 2, matrices, NULL);
    args[n++] = tw__cli_bool("--list", &o->list);
    args[n++] = tw__cli_int("--solve-reps", &o->solve_reps, 0, 1000000);
    args[n++] = tw__cli_int_list("--points", o->only, TWB_MAX_ONLY, &o->nonly, 1,
                                 TW__ORACLE_MAX_POINTS);
    args[n++] = tw__cli_int("--confirm", &o->confirm, 0, TW_CLI_ITERS_MAX);
    args[n++] = tw__cli_int("--versus-fixed", &o->versus, 0, TW_CLI_ITERS_MAX);
  } else {
    args[n++] = tw__cli_bool("--full", &o->full);
    args[n++] = tw__cli_bool("--phases", &o->phases);
  }
  const int rc = tw__cli_parse(cmd, argc, argv, args, n, twb_usage_cb, &sweep);
  if (rc != 0) return rc;
  *shape_given = 0;
  for (int i = 0; i < NSHAPE; i++) *shape_given |= args[i].seen > 0;
  o->router = router.router;
  o->router_param = router.param;
  o->seed = (uint64_t)seed;
  if (matrix >= 0) o->matrix = matrices[matrix], o->oracle = 1;
  if (o->nonly > 0) o->oracle = 1;
  /* The library reads it at every plan and context (plan.h, tw__dataflow_resolve); the ranks
   * spawned below inherit it. */
  if (dataflow >= 0) setenv("TW_COMBINE_DATAFLOW", tw__dataflow_name(dataflow), 1);
  return 0;
}

static int twb_main(int argc, char** argv, int sweep) {
  twb_opts o;
  int shape_given = 0;
  {
    const int rc = twb_parse(argc, argv, sweep, &o, &shape_given);
    if (rc != 0) return rc == 1 ? 0 : rc;
  }

  if (o.list) o.oracle = 1;
  /* The oracle is a minimum over ~100 medians: with 5 rounds an outlier cell biased it low (run 8:
   * max regret 7.23% with 5 rounds, 4.85% with 15, same code; bench/results/2026-11-30-run8.md). */
  if (o.iters < 0) o.iters = o.oracle ? 15 : sweep ? 20 : 50;
  if (o.warmup < 0) o.warmup = o.oracle ? 2 : sweep ? 3 : 5;
  if (o.versus > 0 && !o.oracle) {
    fprintf(stderr, "tilewave sweep: --versus-fixed needs a matrix (--oracle)\n");
    return 2;
  }
  /* The confirmation re-times a matrix point's best cells: without --oracle there are none, and
   * silently timing nothing would read as a confirmed result. */
  if (o.confirm > 0 && !o.oracle) {
    fprintf(stderr,
            "tilewave %s: --confirm R re-times the cells of an oracle matrix; use it with "
            "`tilewave sweep --oracle`\n",
            argv[0]);
    return 2;
  }
  if (o.oracle) {
    if (o.matrix == NULL) o.matrix = "quick";
    const char* conflict = shape_given       ? "--model/--hidden/--ffn/--experts/--topk/--routing"
                           : o.ntokens       ? "--tokens"
                           : o.router >= 0   ? "--router"
                           : o.write_routing ? "--write-routing"
                           : o.comm_ctas     ? "--comm-ctas"
                           : o.coalesce      ? "--coalesce"
                                             : NULL;
    if (conflict) {
      fprintf(stderr,
              "tilewave sweep: --oracle measures its own workload matrix (--matrix quick|full); "
              "drop %s\n",
              conflict);
      return 2;
    }
  }

  /* Points. */
  twb_job job;
  memset(&job, 0, sizeof job);
  if (o.oracle) {
    tw__oracle_point* m =
        (tw__oracle_point*)calloc(TW__ORACLE_MAX_POINTS, sizeof(tw__oracle_point));
    job.points = (twb_point*)calloc(TW__ORACLE_MAX_POINTS, sizeof(twb_point));
    const int n = m && job.points ? tw__oracle_matrix(o.matrix, m, TW__ORACLE_MAX_POINTS) : -1;
    for (int i = 0; i < n; i++) {
      twb_point* pt = &job.points[i];
      pt->hidden = m[i].hidden, pt->ffn = m[i].ffn, pt->experts = m[i].experts;
      pt->topk = m[i].topk, pt->tokens = m[i].tokens, pt->router = m[i].router;
      snprintf(pt->name, sizeof pt->name, "%s", m[i].name);
      pt->index = i + 1;
    }
    free(m);
    if (n < 0) {
      free(job.points);
      fprintf(stderr, "tilewave sweep: cannot build the %s matrix\n", o.matrix);
      return 1;
    }
    job.npoints = n;
    if (o.nonly > 0) {
      /* --points: a subset, in the order given (indices as --list numbers them). */
      twb_point* sub = (twb_point*)calloc((size_t)o.nonly, sizeof(twb_point));
      if (sub == NULL) {
        free(job.points);
        return 1;
      }
      for (int i = 0; i < o.nonly; i++) {
        if (o.only[i] > n) {
          fprintf(stderr, "tilewave sweep: --points %d: the %s matrix has %d points\n", o.only[i],
                  o.matrix, n);
          free(sub);
          free(job.points);
          return 2;
        }
        sub[i] = job.points[o.only[i] - 1];
      }
      free(job.points);
      job.points = sub;
      job.npoints = o.nonly;
    }
    if (o.list) {
      const int rc = twb_oracle_list(&o, job.points, job.npoints);
      free(job.points);
      return rc;
    }
  } else {
    twb_point base = {4096, 2048, 16, 2, 8192, TW_ROUTER_BALANCED, 0.0, "", 0};
    if (o.model) {
      tw_problem p = TW_PROBLEM_INIT;
      if (tw_problem_preset(o.model, &p) != TW_SUCCESS) {
        fprintf(stderr, "tilewave: %s\n", tw_last_error());
        return 2;
      }
      base.hidden = p.hidden, base.ffn = p.ffn, base.experts = p.experts, base.topk = p.top_k;
    }
    if (o.hidden) base.hidden = o.hidden;
    if (o.ffn) base.ffn = o.ffn;
    if (o.experts) base.experts = o.experts;
    if (o.topk) base.topk = o.topk;
    if (o.router >= 0) base.router = o.router, base.router_param = o.router_param;
    const int routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
    const int nrouters = o.full && o.router < 0 ? 3 : 1;
    int default_tokens[2] = {8192, 16384};
    const int* toks = o.ntokens ? o.tokens : default_tokens;
    int ntoks = o.ntokens ? o.ntokens : (shape_given || sweep ? 1 : 2);
    const int grid = !shape_given && !sweep;
    const int hs[2] = {4096, 8192}, es[5] = {4, 8, 16, 32, 64};
    job.points = (twb_point*)calloc(64 + (size_t)ntoks * 2 * 5 * 3, sizeof(twb_point));
    if (job.points == NULL) return 1;
    for (int t = 0; t < ntoks; t++)
      for (int h = 0; h < (grid ? 2 : 1); h++)
        for (int e = 0; e < (grid ? 5 : 1); e++)
          for (int r = 0; r < nrouters; r++) {
            twb_point pt = base;
            pt.tokens = toks[t];
            if (grid) pt.hidden = hs[h], pt.experts = es[e];
            if (nrouters > 1) pt.router = routers[r], pt.router_param = 0.0;
            job.points[job.npoints++] = pt;
          }
  }
  /* The add dataflow sums at most two rows per token (top-1 or top-2): other points are left
   * out, said so, rather than failing the whole run at their context. */
  int32_t dataflow = TW_DATAFLOW_REDUCE;
  if (tw__dataflow_resolve("tilewave", TW_DATAFLOW_DEFAULT, &dataflow) != TW_SUCCESS) {
    fprintf(stderr, "tilewave: %s\n", tw_last_error());
    free(job.points);
    return 2;
  }
  o.add = dataflow == TW_DATAFLOW_ADD;
  if (o.add) {
    int kept = 0;
    for (int i = 0; i < job.npoints; i++) {
      if (job.points[i].topk <= 2) {
        job.points[kept++] = job.points[i];
        continue;
      }
      fprintf(
          stderr,
          "tilewave %s: point %d (top-%d) left out: the add dataflow runs top-1 and top-2 only\n",
          argv[0], job.points[i].index > 0 ? job.points[i].index : i + 1, job.points[i].topk);
    }
    if (kept == 0) {
      fprintf(stderr, "tilewave %s: no point is top-1 or top-2; use --dataflow reduce\n", argv[0]);
      free(job.points);
      return 2;
    }
    job.npoints = kept;
  }
  if (sweep && !o.oracle && job.npoints > 1) job.npoints = 1;
  job.o = o;

  int nranks = o.ranks;
  if (nranks == 0) {
    tw_launcher l;
    if (tw__launcher_detect(&l)) {
      nranks = l.nranks;
    } else {
      nranks = tw__gpu_count_forked();
      if (nranks <= 0) {
        fprintf(stderr, "tilewave %s: no CUDA device found; this command needs GPUs\n", argv[0]);
        free(job.points);
        return 1;
      }
    }
  }
  tw_status st = tw__run_ranks(nranks, twb_rank_main, &job, o.timeout_s);
  free(job.points);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tilewave %s: %s: %s\n", argv[0], tw_status_string(st), tw_last_error());
    return 1;
  }
  return 0;
}

int tw_cli_bench(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "gemm") == 0) {
    return tw_cli_bench_gemm(argc - 1, argv + 1); /* tools/bench_gemm.cu */
  }
  return twb_main(argc, argv, 0);
}

int tw_cli_sweep(int argc, char** argv) {
  return twb_main(argc, argv, 1);
}
