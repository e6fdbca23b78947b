/*
 * cmd_calibrate.c: `tilewave calibrate`, which measures the numbers of the resource model's
 * machine description (tw_hardware) on the GPUs present and writes the calibration file that
 * TW_CALIBRATION points the planner at.
 *
 * Each number is fitted to the formula the model charges it in (src/plan/model.c), so that the
 * file means what the model reads, except the consumer's, fitted to the model's earlier
 * per-segment form (fits: calibrate_fit.c; method and caveats: docs/calibrate.md):
 *   sm_count          the device's multiprocessor count
 *   tile_tflops,      the producer GEMM alone (kernels API, band signals on, no consumer) on
 *                     P = SMs - 8 CTAs (a typical C beside it), on
 *   tile_overhead_us  two balanced problems per K that differ only in their wave count: the time
 *                     difference over the wave difference is one wave's time without the launch
 *                     and the kernel's fixed costs; least squares of it against 2 TM TN K over
 *                     K in {1024, 2048, 4096} gives the per-SM rate (slope) and the per-tile
 *                     fixed cost (intercept)
 *   link_cta_gbps,    the consumer BESIDE the producer (TW_COMBINE_OVERLAP: it shares memory
 *   link_latency_us   with the GEMM, which costs it a quarter to a third of its rate alone) at C
 *                     in {1, 2, 4, 8, 16, 32} and mgb in {1, 4} on one problem, timed by the
 *                     context's per-phase events (comm_ms: the consumer kernel; gemm_ms: the
 *                     producer). Where the consumer bounds the call (it ends well after the
 *                     producer) the fit takes busiest_bytes(C) / link_cta + segments *
 *                     latency (the bytes term is the model's pool term on this problem; the
 *                     model's latency is per band over C, so only the rate is written: see
 *                     docs/calibrate.md); the per-CTA rate falls as C grows, so the fit takes the
 *                     largest such C, the edge of the range where the model makes its choice;
 *                     its two mgb give two segment counts for the same bytes, which separates the
 *                     rate from the per-segment term
 *   link_peak_gbps    the consumer alone (TW_COMBINE_COMM_ONLY): the plateau of the aggregate
 *                     rate (bytes / time) over C
 *   mem_gbps          a device-to-device copy: (read + write bytes) / time, as the default was
 *                     measured (the reduction's own rate is printed beside it)
 * occ_comp and occ_comm keep their defaults: the library does not expose its kernels'
 * occupancy (no cudaOccupancyMaxActiveBlocksPerMultiprocessor hook), which the table says.
 *
 * One process per GPU (tw__run_ranks, as `tilewave bench`); rank 0 measures the producer and the
 * copy while the others wait, then every rank takes part in the link measurement; rank 0 prints
 * and writes everything. With one GPU the link numbers stay at their defaults.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "bench_common.h"
#include "calibrate_fit.h"
#include "checks.h"
#include "cli.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "spawn.h"
#include "tilewave.h"

#define TWC_NK 3
#define TWC_NSIZES 2
#define TWC_NC 6
#define TWC_NMGB 2
#define TWC_NLINK (TWC_NC * TWC_NMGB)
#define TWC_PRODUCER_N 4096
#define TWC_PRODUCER_EXPERTS 8

static const int twc_ks[TWC_NK] = {1024, 2048, 4096};
static const int twc_cs[TWC_NC] = {1, 2, 4, 8, 16, 32};
static const int twc_mgbs[TWC_NMGB] = {1, 4};

typedef struct twc_opts {
  const char* out;
  const char* json;
  int quick, ranks, timeout_s;
} twc_opts;

/* One producer point: one K at two token counts. */
typedef struct twc_prod_point {
  int k;
  int64_t tiles[TWC_NSIZES], waves[TWC_NSIZES];
  double us[TWC_NSIZES]; /* median kernel time */
  double us_per_wave, resid_us;
} twc_prod_point;

/* One link point of one rank. */
typedef struct twc_link_point {
  double c, mgb, segments, total_bytes, busiest_bytes;
  double us;        /* consumer alone (COMM_ONLY) */
  double reduce_us; /* the owner's reduction after it */
  double beside_us; /* consumer beside the producer (OVERLAP) */
  double gemm_us;   /* the producer in that call */
} twc_link_point;

typedef struct twc_state {
  twc_opts o;
  int rank, world;
  ncclComm_t comm;
  cudaStream_t stream;
  int32_t* barrier; /* (2) device */
  char device_name[256];
  double t0;
  tw_hardware def, hw;
  /* producer */
  int tm, tn, grid, prod_ok;
  twc_prod_point prod[TWC_NK];
  /* memory */
  double copy_bytes, copy_us;
  /* link: every rank's points, gathered on rank 0 (rank-major) */
  int link_ok, nlink_c, link_tokens, link_experts, unit_tiles;
  twc_link_point* link;    /* (world * TWC_NLINK) */
  double agg_gbps[TWC_NC]; /* mean over ranks and mgb of bytes / us */
  int fit_c, nfit;         /* the link fit took the points with C = fit_c (beside the producer) */
  double fit_latency;      /* the fit's per-segment term (printed, not written) */
  double reduce_us, reduce_bytes;
  char link_note[200], prod_note[200];
} twc_state;

static void twc_progress(const twc_state* s, const char* fmt, ...) TW__PRINTF(2, 3);
static void twc_progress(const twc_state* s, const char* fmt, ...) {
  if (s->rank != 0) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[calibrate %5.1f s] ", tw__now_seconds() - s->t0);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

/* Median of v[0..n) (sorts v). */
static double twc_median(double* v, int n) {
  return tw__oracle_percentile(v, n, 0.5);
}

static tw_status twc_barrier(twc_state* s) {
  TW_NCCL_TRY(ncclAllReduce(s->barrier, s->barrier + 1, 1, ncclInt32, ncclSum, s->comm, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  return TW_SUCCESS;
}

/* ---- producer -------------------------------------------------------------------------------- */

/* The balanced one-rank problem of producer point (k, tokens): its plan gives the tile list. */
static tw_status twc_producer_plan(const twc_state* s, int k, int tokens, tw_plan_t* plan) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 1;
  p.hidden = TWC_PRODUCER_N;
  p.ffn = k;
  p.experts = TWC_PRODUCER_EXPERTS;
  p.top_k = 2;
  p.max_tokens = tokens;
  tw_routing_t rt = NULL;
  TW_TRY(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, tokens, 1, &rt));
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = TW_DEFAULT_COMM_CTAS; /* the tile list does not depend on C */
  cfg.coalesce = 1;
  cfg.hardware = &s->def;
  tw_status st = tw_plan_create(&p, rt, 0, &cfg, plan);
  tw_routing_destroy(rt);
  return st;
}

typedef struct twc_prod_bufs {
  void *a, *w, *c;
  uint32_t* counters; /* (most bands of any point) band counters the producer signals */
  tw_tile* tiles[TWC_NK][TWC_NSIZES];
  cudaEvent_t ev[TWC_NK * TWC_NSIZES + 1];
  int nev;
} twc_prod_bufs;

static tw_status twc_measure_producer_inner(twc_state* s, twc_prod_bufs* b) {
  const int sizes[TWC_NSIZES] = {s->o.quick ? 2048 : 4096, s->o.quick ? 8192 : 16384};
  const int reps = s->o.quick ? 5 : 15, warmup = 2;
  tw_gemm_args g[TWC_NK][TWC_NSIZES];
  size_t a_max = 0, c_max = 0, bands_max = 1;
  s->grid = s->hw.sm_count - TW_DEFAULT_COMM_CTAS;
  for (int i = 0; i < TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) {
      tw_plan_t plan = NULL;
      TW_TRY(twc_producer_plan(s, twc_ks[i], sizes[j], &plan));
      const struct tw_plan* pl = plan;
      s->tm = pl->tm, s->tn = pl->tn;
      s->prod[i].k = twc_ks[i];
      s->prod[i].tiles[j] = pl->num_tiles;
      s->prod[i].waves[j] = tw__ceil_div(pl->num_tiles, s->grid);
      tw_gemm_args* a = &g[i][j];
      memset(a, 0, sizeof *a);
      a->rows = pl->rows;
      a->k = twc_ks[i];
      a->n = TWC_PRODUCER_N;
      a->experts = pl->local_experts;
      a->num_tiles = pl->num_tiles;
      a->tm = pl->tm;
      a->tn = pl->tn;
      a->grid = s->grid;
      /* Signals on, as in overlap mode: the model's per-tile cost includes the release add. */
      a->scope = TW_SIGNAL_GPU;
      a->epilogue = TW_EPILOGUE_STORE;
      const size_t tb = sizeof(tw_tile) * (size_t)pl->num_tiles;
      cudaError_t e = cudaMalloc((void**)&b->tiles[i][j], tb);
      if (e == cudaSuccess) e = cudaMemcpy(b->tiles[i][j], pl->tiles, tb, cudaMemcpyHostToDevice);
      tw_plan_destroy(plan);
      if (e != cudaSuccess)
        return tw__fail(TW_ERR_CUDA, "calibrate: uploading a tile list failed: %s",
                        cudaGetErrorString(e));
      a->tiles = b->tiles[i][j];
      if ((size_t)pl->num_bands > bands_max) bands_max = (size_t)pl->num_bands;
      const size_t ae = (size_t)a->rows * (size_t)a->k, ce = (size_t)a->rows * (size_t)a->n;
      if (ae > a_max) a_max = ae;
      if (ce > c_max) c_max = ce;
    }
  const size_t w_max = (size_t)TWC_PRODUCER_EXPERTS * TWC_PRODUCER_N * twc_ks[TWC_NK - 1];
  TW_CUDA_TRY(cudaMalloc(&b->a, 2 * a_max));
  TW_CUDA_TRY(cudaMalloc(&b->w, 2 * w_max));
  TW_CUDA_TRY(cudaMalloc(&b->c, 2 * c_max));
  /* Counters only ever grow by col_tiles per launch (kernels.h); nobody waits on them here. */
  TW_CUDA_TRY(cudaMalloc((void**)&b->counters, 4 * bands_max));
  TW_CUDA_TRY(cudaMemsetAsync(b->counters, 0, 4 * bands_max, s->stream));
  /* Random, nonzero inputs (the tensor cores' time does not depend on values, but a zero input
   * could let a future kernel skip work). */
  TW_TRY(tw__baseline_fill_random(b->a, a_max, 7, 1.0f, s->stream));
  TW_TRY(tw__baseline_fill_random(b->w, w_max, 8, 1.0f / 64.0f, s->stream));
  for (int i = 0; i < TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) {
      g[i][j].a = b->a, g[i][j].b = b->w, g[i][j].c = b->c;
      g[i][j].band_counters = b->counters;
    }
  s->copy_bytes = 2.0 * (double)(a_max < c_max ? a_max : c_max); /* bytes of one copy's source */

  /* All six runs back to back per rep, the first one rotated, so that clock drift and the
   * launch gap after the host's wait fall on every run alike (bench gemm does the same). */
  const int nrun = TWC_NK * TWC_NSIZES;
  for (int e = 0; e <= nrun; e++) {
    TW_CUDA_TRY(cudaEventCreate(&b->ev[e]));
    b->nev = e + 1;
  }
  double samples[TWC_NK * TWC_NSIZES][32];
  for (int rep = 0; rep < warmup + reps; rep++) {
    TW_CUDA_TRY(cudaEventRecord(b->ev[0], s->stream));
    for (int q = 0; q < nrun; q++) {
      const int r = (q + rep) % nrun;
      TW_TRY(tw__gemm_launch(&g[r / TWC_NSIZES][r % TWC_NSIZES], s->stream));
      TW_CUDA_TRY(cudaEventRecord(b->ev[q + 1], s->stream));
    }
    TW_CUDA_TRY(cudaEventSynchronize(b->ev[nrun]));
    for (int q = 0; q < nrun && rep >= warmup; q++) {
      float ms = 0.f;
      TW_CUDA_TRY(cudaEventElapsedTime(&ms, b->ev[q], b->ev[q + 1]));
      samples[(q + rep) % nrun][rep - warmup] = 1000.0 * ms;
    }
  }
  double x[TWC_NK], y[TWC_NK], r[TWC_NK];
  for (int i = 0; i < TWC_NK; i++) {
    twc_prod_point* p = &s->prod[i];
    for (int j = 0; j < TWC_NSIZES; j++) p->us[j] = twc_median(samples[i * TWC_NSIZES + j], reps);
    p->us_per_wave = tw__calib_per_wave(p->us[0], p->waves[0], p->us[1], p->waves[1]);
    x[i] = 2.0 * s->tm * s->tn * p->k;
    y[i] = p->us_per_wave;
  }
  TW_TRY(tw__calib_fit_producer(x, y, TWC_NK, &s->hw.tile_tflops, &s->hw.tile_overhead_us, r));
  for (int i = 0; i < TWC_NK; i++) s->prod[i].resid_us = r[i];
  if (s->hw.tile_overhead_us < 0) {
    snprintf(s->prod_note, sizeof s->prod_note,
             "fitted overhead %.3f us per tile < 0 (noise): written as 0", s->hw.tile_overhead_us);
    s->hw.tile_overhead_us = 0;
  }
  s->prod_ok = 1;

  /* Device memory: one copy between the two largest buffers, read + write counted. */
  const size_t cb = (size_t)(s->copy_bytes);
  for (int rep = 0; rep < warmup + reps; rep++) {
    TW_CUDA_TRY(cudaEventRecord(b->ev[0], s->stream));
    TW_CUDA_TRY(cudaMemcpyAsync(b->c, b->a, cb, cudaMemcpyDeviceToDevice, s->stream));
    TW_CUDA_TRY(cudaEventRecord(b->ev[1], s->stream));
    TW_CUDA_TRY(cudaEventSynchronize(b->ev[1]));
    float ms = 0.f;
    TW_CUDA_TRY(cudaEventElapsedTime(&ms, b->ev[0], b->ev[1]));
    if (rep >= warmup) samples[0][rep - warmup] = 1000.0 * ms;
  }
  s->copy_us = twc_median(samples[0], reps);
  s->hw.mem_gbps = 2.0 * s->copy_bytes / s->copy_us * 1e-3;
  return TW_SUCCESS;
}

static tw_status twc_measure_producer(twc_state* s) {
  twc_prod_bufs b;
  memset(&b, 0, sizeof b);
  tw_status st = twc_measure_producer_inner(s, &b);
  cudaStreamSynchronize(s->stream);
  for (int e = 0; e < b.nev; e++) cudaEventDestroy(b.ev[e]);
  for (int i = 0; i < TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) cudaFree(b.tiles[i][j]);
  cudaFree(b.a);
  cudaFree(b.w);
  cudaFree(b.c);
  cudaFree(b.counters);
  return st;
}

/* ---- link ------------------------------------------------------------------------------------ */

typedef struct twc_link_bufs {
  tw_routing_t routing;
  tw_plan_t plans[TWC_NMGB];
  tw_context_t ctx;
  tw_device_plan_t dplans[TWC_NMGB];
  void *a, *w, *out;
  double* d_points; /* device (world * TWC_NLINK * 7) */
} twc_link_bufs;

static tw_status twc_measure_link_inner(twc_state* s, twc_link_bufs* b) {
  const int tokens = s->o.quick ? 4096 : 8192, reps = s->o.quick ? 5 : 11, warmup = 2;
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = s->world;
  p.hidden = 4096;
  p.ffn = 2048;
  p.experts = s->world <= 2 ? 16 : 8 * s->world;
  p.top_k = 2;
  p.max_tokens = tokens;
  s->link_tokens = tokens;
  s->link_experts = p.experts;
  TW_TRY(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, tokens, 1, &b->routing));
  for (int m = 0; m < TWC_NMGB; m++) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.comm_ctas = TW_DEFAULT_COMM_CTAS; /* every call below passes its own C */
    cfg.coalesce = twc_mgbs[m];
    cfg.hardware = &s->def;
    TW_TRY(tw_plan_create(&p, b->routing, s->rank, &cfg, &b->plans[m]));
  }
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timing = 1;
  TW_TRY(tw_context_create(&p, s->comm, &cc, &b->ctx));
  tw_context_info info;
  TW_TRY(tw_context_info_get(b->ctx, &info));
  s->unit_tiles = info.unit_tiles;
  for (int m = 0; m < TWC_NMGB; m++) {
    TW_TRY(tw_device_plan_create(b->ctx, &b->dplans[m]));
    TW_TRY(tw_device_plan_upload(b->dplans[m], b->plans[m], b->routing, s->stream));
  }
  const struct tw_plan* pl = b->plans[0];
  const size_t a_el = (size_t)pl->rows * (size_t)p.ffn;
  const size_t w_el = (size_t)pl->local_experts * (size_t)p.hidden * (size_t)p.ffn;
  int32_t my_tokens = 0;
  const int32_t* ids = NULL;
  const float* gw = NULL;
  TW_TRY(tw_routing_rank(b->routing, s->rank, &my_tokens, &ids, &gw));
  const size_t out_el = (size_t)(my_tokens > 0 ? my_tokens : 1) * (size_t)p.hidden;
  TW_CUDA_TRY(cudaMalloc(&b->a, 2 * a_el));
  TW_CUDA_TRY(cudaMalloc(&b->w, 2 * w_el));
  TW_CUDA_TRY(cudaMalloc(&b->out, 2 * out_el));
  TW_TRY(tw__baseline_fill_random(b->a, a_el, 11 + (uint64_t)s->rank, 1.0f, s->stream));
  TW_TRY(tw__baseline_fill_random(b->w, w_el, 97 + (uint64_t)s->rank, 1.0f / 45.0f, s->stream));
  /* COMM_ONLY sends the GEMM output of an earlier call: make one, so that real values move. */
  tw_combine_options go = TW_COMBINE_OPTIONS_INIT;
  go.mode = TW_COMBINE_GEMM_ONLY;
  TW_TRY(tw_moe_combine_ex(b->ctx, b->dplans[0], b->a, b->w, b->out, &go, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));

  /* C values the context allows (max_comm_ctas is below the SM count). */
  int ncs = 0;
  while (ncs < TWC_NC && twc_cs[ncs] <= info.max_comm_ctas) ncs++;
  s->nlink_c = ncs;
  twc_link_point mine[TWC_NLINK];
  memset(mine, 0, sizeof mine);
  double comm[32], red[32], beside[32], gemm[32];
  for (int ci = 0; ci < ncs; ci++)
    for (int m = 0; m < TWC_NMGB; m++) {
      tw_combine_options co = TW_COMBINE_OPTIONS_INIT;
      co.mode = TW_COMBINE_COMM_ONLY;
      co.comm_ctas = twc_cs[ci];
      for (int rep = 0; rep < warmup + reps; rep++) {
        /* All ranks start together; the delay lets the host finish enqueuing first. */
        TW_TRY(twc_barrier(s));
        TW_TRY(tw__bench_delay(s->stream, 100));
        TW_TRY(tw_moe_combine_ex(b->ctx, b->dplans[m], NULL, NULL, b->out, &co, s->stream));
        tw_combine_timings t;
        TW_TRY(tw_context_timings(b->ctx, &t));
        if (rep >= warmup) {
          comm[rep - warmup] = 1000.0 * t.comm_ms;
          red[rep - warmup] = 1000.0 * t.reduce_ms;
        }
      }
      /* The same C and mgb beside the producer. */
      co.mode = TW_COMBINE_OVERLAP;
      for (int rep = 0; rep < warmup + reps; rep++) {
        TW_TRY(twc_barrier(s));
        TW_TRY(tw__bench_delay(s->stream, 100));
        TW_TRY(tw_moe_combine_ex(b->ctx, b->dplans[m], b->a, b->w, b->out, &co, s->stream));
        tw_combine_timings t;
        TW_TRY(tw_context_timings(b->ctx, &t));
        if (rep >= warmup) {
          beside[rep - warmup] = 1000.0 * t.comm_ms;
          gemm[rep - warmup] = 1000.0 * t.gemm_ms;
        }
      }
      TW_TRY(tw_context_check(b->ctx));
      twc_link_point* q = &mine[ci * TWC_NMGB + m];
      int64_t* units = NULL;
      double* bytes = NULL;
      tw_status st = tw__calib_plan_segments(b->plans[m], &units, &bytes, &q->total_bytes);
      if (st == TW_SUCCESS) {
        q->c = twc_cs[ci];
        q->mgb = twc_mgbs[m];
        q->segments = b->plans[m]->num_segments;
        q->busiest_bytes =
            tw__calib_busiest_bytes(units, bytes, b->plans[m]->num_segments, twc_cs[ci]);
        q->us = twc_median(comm, reps);
        q->reduce_us = twc_median(red, reps);
        q->beside_us = twc_median(beside, reps);
        q->gemm_us = twc_median(gemm, reps);
      }
      free(units);
      free(bytes);
      TW_TRY(st);
    }
  twc_progress(s, "link: %d C values x %d mgb timed", ncs, TWC_NMGB);

  /* Gather every rank's points on every rank (tiny). */
  const size_t per = sizeof(twc_link_point) / sizeof(double) * TWC_NLINK;
  TW_CUDA_TRY(cudaMalloc((void**)&b->d_points, sizeof(double) * per * (size_t)(s->world + 1)));
  TW_CUDA_TRY(cudaMemcpyAsync(b->d_points, mine, sizeof mine, cudaMemcpyHostToDevice, s->stream));
  TW_NCCL_TRY(ncclAllGather(b->d_points, b->d_points + per, per, ncclFloat64, s->comm, s->stream));
  TW_CUDA_TRY(cudaMemcpyAsync(s->link, b->d_points + per, sizeof(double) * per * (size_t)s->world,
                              cudaMemcpyDeviceToHost, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));

  /* The reduction: what the model charges at mem_gbps, (rows + tokens) x row bytes, against the
   * phase's time at the largest C (it includes waiting for the peers' last arrivals). */
  s->reduce_bytes = (double)my_tokens * (p.top_k + 1) * p.hidden * 2.0;
  s->reduce_us = mine[(ncs - 1) * TWC_NMGB].reduce_us;

  /* Aggregate rate per C alone (mean over ranks and mgb of bytes / time): the plateau is the
   * peak. */
  double peak = 0;
  for (int ci = 0; ci < ncs; ci++) {
    double sum = 0;
    for (int r = 0; r < s->world; r++)
      for (int m = 0; m < TWC_NMGB; m++) {
        const twc_link_point* q = &s->link[r * TWC_NLINK + ci * TWC_NMGB + m];
        sum += q->us > 0 ? q->total_bytes / q->us * 1e-3 : 0.0;
      }
    s->agg_gbps[ci] = sum / (s->world * TWC_NMGB);
    if (s->agg_gbps[ci] > peak) peak = s->agg_gbps[ci];
  }
  if (!(peak > 0))
    return tw__fail(TW_ERR_INTERNAL, "calibrate: the consumer moved no bytes (empty plans?)");
  /* Beside the producer: the largest C at which the consumer bounds the call on every rank and
   * mgb (it runs at least 25% longer than the producer), at least C = 1. */
  s->fit_c = twc_cs[0];
  for (int ci = 1; ci < ncs; ci++) {
    int bound = 1;
    for (int r = 0; r < s->world; r++)
      for (int m = 0; m < TWC_NMGB; m++) {
        const twc_link_point* q = &s->link[r * TWC_NLINK + ci * TWC_NMGB + m];
        bound &= q->beside_us > 1.25 * q->gemm_us;
      }
    if (!bound) break;
    s->fit_c = twc_cs[ci];
  }
  double bx[TW_CALIB_MAX_POINTS], sg[TW_CALIB_MAX_POINTS], us[TW_CALIB_MAX_POINTS];
  int n = 0;
  for (int r = 0; r < s->world; r++)
    for (int i = 0; i < ncs * TWC_NMGB; i++) {
      const twc_link_point* q = &s->link[r * TWC_NLINK + i];
      if (q->c == s->fit_c && n < TW_CALIB_MAX_POINTS) {
        bx[n] = q->busiest_bytes;
        sg[n] = q->segments;
        us[n] = q->beside_us;
        n++;
      }
    }
  s->nfit = n;
  /* The fit separates the bytes term from a per-segment term; only the bytes term goes into the
   * file. The model charges its latency per band, shared by the C CTAs (model.c), which one
   * problem with one band size cannot separate from the bytes: it keeps the description's value. */
  TW_TRY(tw__calib_fit_link(bx, sg, us, n, &s->hw.link_cta_gbps, &s->fit_latency, NULL));
  s->hw.link_latency_us = s->def.link_latency_us;
  snprintf(s->link_note, sizeof s->link_note,
           "the fit's per-segment term, %.3f us, is not written: the model's link_latency_us is "
           "per band over C; it keeps %.3f us",
           s->fit_latency, s->hw.link_latency_us);
  /* The peak is the raw plateau, as the default was measured: taking a latency term out of the
   * short high-C calls would overstate it wherever the CTAs overlap their latencies. */
  s->hw.link_peak_gbps = peak;
  s->link_ok = 1;
  return TW_SUCCESS;
}

static tw_status twc_measure_link(twc_state* s) {
  twc_link_bufs b;
  memset(&b, 0, sizeof b);
  tw_status st = twc_measure_link_inner(s, &b);
  cudaStreamSynchronize(s->stream);
  cudaFree(b.d_points);
  cudaFree(b.a);
  cudaFree(b.w);
  cudaFree(b.out);
  for (int m = 0; m < TWC_NMGB; m++) tw_device_plan_destroy(b.dplans[m]);
  /* Destroying the context is collective: a rank that failed before every rank created it
   * aborts the communicator instead (twc_rank_main). */
  if (st == TW_SUCCESS) st = tw_context_destroy(b.ctx);
  for (int m = 0; m < TWC_NMGB; m++) tw_plan_destroy(b.plans[m]);
  tw_routing_destroy(b.routing);
  return st;
}

/* ---- report ---------------------------------------------------------------------------------- */

static void twc_print(const twc_state* s) {
  const tw_hardware *d = &s->def, *h = &s->hw;
  printf("# tilewave calibrate: %d x %s, %d SMs\n\n", s->world, s->device_name, h->sm_count);
  if (s->prod_ok) {
    printf("producer GEMM alone: N %d, %d experts, top-2, balanced, tile %dx%d, P = %d CTAs\n",
           TWC_PRODUCER_N, TWC_PRODUCER_EXPERTS, s->tm, s->tn, s->grid);
    printf("| K | tiles | waves | us | tiles | waves | us | us/wave | fit | residual |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < TWC_NK; i++) {
      const twc_prod_point* p = &s->prod[i];
      printf("| %d | %lld | %lld | %.1f | %lld | %lld | %.1f | %.3f | %.3f | %+.3f |\n", p->k,
             (long long)p->tiles[0], (long long)p->waves[0], p->us[0], (long long)p->tiles[1],
             (long long)p->waves[1], p->us[1], p->us_per_wave, p->us_per_wave - p->resid_us,
             p->resid_us);
    }
    printf(
        "fit: us/wave = 2 TM TN K / (%.3f TFLOP/s x 1e6) + %.3f us  (%.0f TFLOP/s over %d SMs)\n",
        h->tile_tflops, h->tile_overhead_us, h->tile_tflops * h->sm_count, h->sm_count);
    if (s->prod_note[0]) printf("note: %s\n", s->prod_note);
    printf("\n");
  }
  if (s->link_ok) {
    printf(
        "consumer alone (COMM_ONLY) and beside the producer (OVERLAP): %d tokens/rank, N 4096, "
        "%d experts, top-2, balanced, consumer unit %d column tile(s) (the fit counts the "
        "model's one-tile units); median us per rank\n",
        s->link_tokens, s->link_experts, s->unit_tiles);
    printf(
        "| C | mgb | rank | segments | MiB sent | busiest CTA MiB | alone us | GB/s alone | "
        "beside us | producer us | fit us | in fit |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < s->world; r++)
      for (int i = 0; i < s->nlink_c * TWC_NMGB; i++) {
        const twc_link_point* q = &s->link[r * TWC_NLINK + i];
        const double fit =
            q->busiest_bytes / (h->link_cta_gbps * 1e3) + q->segments * s->fit_latency;
        printf(
            "| %.0f | %.0f | %d | %.0f | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %s |\n",
            q->c, q->mgb, r, q->segments, q->total_bytes / 1048576.0, q->busiest_bytes / 1048576.0,
            q->us, q->total_bytes / q->us * 1e-3, q->beside_us, q->gemm_us, fit,
            q->c == s->fit_c ? "yes" : "no");
      }
    printf(
        "fit beside the producer at C = %d (%d points; the largest C at which the consumer runs "
        ">= 1.25x as long as the producer): us = busiest bytes / (%.2f GB/s x 1e3) + segments x "
        "%.3f us\n",
        s->fit_c, s->nfit, h->link_cta_gbps, s->fit_latency);
    printf("aggregate rate alone (bytes / time), mean over ranks and mgb:");
    for (int ci = 0; ci < s->nlink_c; ci++) printf(" C=%d %.0f", twc_cs[ci], s->agg_gbps[ci]);
    printf(" GB/s\n");
    if (s->link_note[0]) printf("note: %s\n", s->link_note);
    if (s->reduce_us > 0)
      printf(
          "owner's reduction (rank 0, largest C): %.1f us for %.1f MiB, %.0f GB/s effective "
          "(includes waiting for the peers' last arrivals)\n",
          s->reduce_us, s->reduce_bytes / 1048576.0, s->reduce_bytes / s->reduce_us * 1e-3);
    printf("\n");
  }
  printf("| parameter | default | measured | how |\n|---|---|---|---|\n");
  printf("| sm_count | %d | %d | cudaDevAttrMultiProcessorCount |\n", d->sm_count, h->sm_count);
  printf(
      "| occ_comp | %d | - | default kept: the library does not expose its kernels' occupancy |\n",
      d->occ_comp);
  printf("| occ_comm | %d | - | default kept: as occ_comp |\n", d->occ_comm);
  printf("| c_max | %d | %d | default, capped at (sm_count - 1) x occ_comm |\n", d->c_max,
         h->c_max);
  if (s->prod_ok) {
    printf("| tile_tflops | %.3f | %.3f | producer alone, slope of us/wave vs 2 TM TN K |\n",
           d->tile_tflops, h->tile_tflops);
    printf("| tile_overhead_us | %.3f | %.3f | producer alone, intercept of the same fit |\n",
           d->tile_overhead_us, h->tile_overhead_us);
    printf("| mem_gbps | %.0f | %.0f | device-to-device copy of %.0f MiB, read + write |\n",
           d->mem_gbps, h->mem_gbps, s->copy_bytes / 1048576.0);
  }
  if (s->link_ok) {
    printf(
        "| link_cta_gbps | %.2f | %.2f | consumer beside the producer, C = %d, bytes term of the "
        "fit |\n",
        d->link_cta_gbps, h->link_cta_gbps, s->fit_c);
    printf(
        "| link_latency_us | %.3f | - | default kept: the model charges it per band over C, which "
        "one band size cannot separate from the bytes (the fit's per-segment term: %.3f us) |\n",
        d->link_latency_us, s->fit_latency);
    printf("| link_peak_gbps | %.1f | %.1f | consumer alone, largest aggregate rate over C |\n",
           d->link_peak_gbps, h->link_peak_gbps);
  } else {
    printf("| link_cta_gbps | %.2f | - | default kept: needs 2 GPUs |\n", d->link_cta_gbps);
    printf("| link_latency_us | %.3f | - | default kept: needs 2 GPUs |\n", d->link_latency_us);
    printf("| link_peak_gbps | %.1f | - | default kept: needs 2 GPUs |\n", d->link_peak_gbps);
  }
  printf("| rho_ref | %.2f | - | default kept: the first paper's reference (TP model) |\n",
         d->rho_ref);
  if (!s->link_ok)
    printf(
        "\none GPU: the NVLink numbers (link_*) are the built-in H200 defaults; run on 2+ GPUs "
        "to measure them\n");
  fflush(stdout);
}

static void twc_json_hw(FILE* f, const char* name, const tw_hardware* h) {
  fprintf(f,
          "  \"%s\": {\"sm_count\": %d, \"occ_comp\": %d, \"occ_comm\": %d, \"c_max\": %d, "
          "\"tile_tflops\": %.6g, \"tile_overhead_us\": %.6g, \"link_cta_gbps\": %.6g, "
          "\"link_peak_gbps\": %.6g, \"link_latency_us\": %.6g, \"mem_gbps\": %.6g, "
          "\"rho_ref\": %.6g}",
          name, h->sm_count, h->occ_comp, h->occ_comm, h->c_max, h->tile_tflops,
          h->tile_overhead_us, h->link_cta_gbps, h->link_peak_gbps, h->link_latency_us, h->mem_gbps,
          h->rho_ref);
}

static tw_status twc_write_json(const twc_state* s, const char* path) {
  FILE* f = fopen(path, "w");
  if (f == NULL) return tw__fail(TW_ERR_IO, "calibrate: cannot write %s", path);
  fprintf(f,
          "{\"command\": \"calibrate\", \"device\": \"%s\", \"world_size\": %d, \"quick\": %d,\n",
          s->device_name, s->world, s->o.quick);
  twc_json_hw(f, "defaults", &s->def);
  fprintf(f, ",\n");
  twc_json_hw(f, "measured", &s->hw);
  fprintf(f, ",\n  \"measured_fields\": [\"sm_count\"%s%s],\n",
          s->prod_ok ? ", \"tile_tflops\", \"tile_overhead_us\", \"mem_gbps\"" : "",
          s->link_ok ? ", \"link_cta_gbps\", \"link_peak_gbps\"" : "");
  fprintf(f, "  \"producer\": {\"tm\": %d, \"tn\": %d, \"grid\": %d, \"n\": %d, \"points\": [",
          s->tm, s->tn, s->grid, TWC_PRODUCER_N);
  for (int i = 0; s->prod_ok && i < TWC_NK; i++) {
    const twc_prod_point* p = &s->prod[i];
    fprintf(f,
            "%s\n    {\"k\": %d, \"tiles\": [%lld, %lld], \"waves\": [%lld, %lld], \"us\": [%.3f, "
            "%.3f], \"us_per_wave\": %.4f, \"residual_us\": %.4f}",
            i ? "," : "", p->k, (long long)p->tiles[0], (long long)p->tiles[1],
            (long long)p->waves[0], (long long)p->waves[1], p->us[0], p->us[1], p->us_per_wave,
            p->resid_us);
  }
  fprintf(f, "]},\n  \"copy\": {\"bytes\": %.0f, \"us\": %.3f},\n", s->copy_bytes, s->copy_us);
  fprintf(f,
          "  \"link\": {\"tokens\": %d, \"experts\": %d, \"unit_tiles\": %d, \"fit_c\": %d, "
          "\"fit_segment_latency_us\": %.4f, \"points\": [",
          s->link_tokens, s->link_experts, s->unit_tiles, s->fit_c, s->fit_latency);
  int first = 1;
  for (int r = 0; s->link_ok && r < s->world; r++)
    for (int i = 0; i < s->nlink_c * TWC_NMGB; i++) {
      const twc_link_point* q = &s->link[r * TWC_NLINK + i];
      fprintf(f,
              "%s\n    {\"rank\": %d, \"c\": %.0f, \"mgb\": %.0f, \"segments\": %.0f, "
              "\"bytes\": %.0f, \"busiest_bytes\": %.0f, \"us\": %.3f, \"reduce_us\": %.3f, "
              "\"beside_us\": %.3f, \"producer_us\": %.3f, \"in_fit\": %s}",
              first ? "" : ",", r, q->c, q->mgb, q->segments, q->total_bytes, q->busiest_bytes,
              q->us, q->reduce_us, q->beside_us, q->gemm_us, q->c == s->fit_c ? "true" : "false");
      first = 0;
    }
  fprintf(f, "]}\n}\n");
  const int bad = ferror(f);
  if (fclose(f) != 0 || bad) return tw__fail(TW_ERR_IO, "calibrate: writing %s failed", path);
  return TW_SUCCESS;
}

/* Comments after the keys: what measured the file and which values are defaults. */
static tw_status twc_append_provenance(const twc_state* s) {
  FILE* f = fopen(s->o.out, "a");
  if (f == NULL) return tw__fail(TW_ERR_IO, "calibrate: cannot append to %s", s->o.out);
  fprintf(f,
          "# measured by `tilewave calibrate%s` on %d x %s\n"
          "# measured: sm_count, tile_tflops, tile_overhead_us, mem_gbps%s\n"
          "# built-in defaults: occ_comp, occ_comm, c_max (capped by sm_count), rho_ref, "
          "link_latency_us%s\n",
          s->o.quick ? " --quick" : "", s->world, s->device_name,
          s->link_ok ? ", link_cta_gbps, link_peak_gbps" : "",
          s->link_ok ? "" : ", link_cta_gbps, link_peak_gbps (one GPU)");
  const int bad = ferror(f);
  if (fclose(f) != 0 || bad) return tw__fail(TW_ERR_IO, "calibrate: writing %s failed", s->o.out);
  return TW_SUCCESS;
}

/* ---- ranks ----------------------------------------------------------------------------------- */

static tw_status twc_run(twc_state* s) {
  int dev = 0, sms = 0;
  TW_CUDA_TRY(cudaGetDevice(&dev));
  TW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  struct cudaDeviceProp prop;
  TW_CUDA_TRY(cudaGetDeviceProperties(&prop, dev));
  snprintf(s->device_name, sizeof s->device_name, "%s", prop.name);
  if (sms <= TW_DEFAULT_COMM_CTAS + 1)
    return tw__fail(TW_ERR_UNSUPPORTED, "calibrate: %d SMs; need more than %d", sms,
                    TW_DEFAULT_COMM_CTAS + 1);
  s->hw.sm_count = sms;
  if (s->hw.c_max > (sms - 1) * s->hw.occ_comm) s->hw.c_max = (sms - 1) * s->hw.occ_comm;
  twc_progress(s, "%d x %s, %d SMs", s->world, s->device_name, sms);

  /* Rank 0 measures the producer and the copy alone; the others wait at the barrier, so that no
   * other GPU's traffic shares anything with it. */
  tw_status st = TW_SUCCESS;
  if (s->rank == 0) {
    st = twc_measure_producer(s);
    if (st == TW_SUCCESS)
      twc_progress(s, "producer: %.3f TFLOP/s per SM, %.3f us per tile; copy %.0f GB/s",
                   s->hw.tile_tflops, s->hw.tile_overhead_us, s->hw.mem_gbps);
    else
      fprintf(stderr, "tilewave calibrate: producer: %s: %s\n", tw_status_string(st),
              tw_last_error());
  }
  /* Every rank learns whether rank 0 succeeded (a failed rank 0 must not leave the others
   * inside the link measurement's collectives). */
  int32_t ok_h = st == TW_SUCCESS ? 1 : 0;
  int32_t* ok_d = s->barrier;
  TW_CUDA_TRY(cudaMemcpyAsync(ok_d, &ok_h, 4, cudaMemcpyHostToDevice, s->stream));
  TW_NCCL_TRY(ncclAllReduce(ok_d, ok_d, 1, ncclInt32, ncclMin, s->comm, s->stream));
  TW_CUDA_TRY(cudaMemcpyAsync(&ok_h, ok_d, 4, cudaMemcpyDeviceToHost, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  TW_CUDA_TRY(cudaMemsetAsync(s->barrier, 0, 8, s->stream));
  if (!ok_h) return st != TW_SUCCESS ? st : tw__fail(TW_ERR_INTERNAL, "calibrate: rank 0 failed");

  if (s->world >= 2) {
    twc_progress(s, "link: consumer alone over %d ranks", s->world);
    TW_TRY(twc_measure_link(s));
    twc_progress(s, "link: %.2f GB/s per CTA, %.1f GB/s peak, %.3f us per band (kept)",
                 s->hw.link_cta_gbps, s->hw.link_peak_gbps, s->hw.link_latency_us);
  } else {
    twc_progress(s, "one GPU: link numbers stay at their defaults");
  }
  if (s->rank != 0) return TW_SUCCESS;

  twc_print(s);
  TW_TRY(tw_hardware_write(&s->hw, s->o.out));
  TW_TRY(twc_append_provenance(s));
  if (s->o.json) TW_TRY(twc_write_json(s, s->o.json));
  printf(
      "\nwrote %s%s%s (%.1f s). Use it with:\n  TW_CALIBRATION=%s tilewave plan ...   (or any "
      "program that plans with tw_plan_config.hardware = NULL)\n",
      s->o.out, s->o.json ? " and " : "", s->o.json ? s->o.json : "", tw__now_seconds() - s->t0,
      s->o.out);
  fflush(stdout);
  return TW_SUCCESS;
}

static int twc_rank_main(int rank, int nranks, const ncclUniqueId* id, void* arg) {
  twc_state s;
  memset(&s, 0, sizeof s);
  s.o = *(const twc_opts*)arg;
  s.rank = rank;
  s.world = nranks;
  s.t0 = tw__now_seconds();
  tw_hardware_default(&s.def);
  s.hw = s.def;
  s.link = (twc_link_point*)calloc((size_t)nranks * TWC_NLINK, sizeof(twc_link_point));
  if (s.link == NULL) return TW_ERR_OUT_OF_MEMORY;
  ncclResult_t nr = ncclCommInitRank(&s.comm, nranks, *id, rank);
  if (nr != ncclSuccess) {
    fprintf(stderr, "tilewave calibrate: rank %d: ncclCommInitRank failed: %s\n", rank,
            ncclGetErrorString(nr));
    free(s.link);
    return TW_ERR_NCCL;
  }
  tw_status st = TW_SUCCESS;
  if (cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc((void**)&s.barrier, 256) != cudaSuccess ||
      cudaMemset(s.barrier, 0, 256) != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "calibrate: rank %d: CUDA setup failed", rank);
  if (st == TW_SUCCESS) st = twc_run(&s);
  if (st != TW_SUCCESS)
    fprintf(stderr, "tilewave calibrate: rank %d: %s: %s\n", rank, tw_status_string(st),
            tw_last_error());
  cudaFree(s.barrier);
  if (s.stream) cudaStreamDestroy(s.stream);
  /* A failed rank may leave peers inside a collective; abort rather than wait for them. */
  if (st != TW_SUCCESS)
    ncclCommAbort(s.comm);
  else
    ncclCommDestroy(s.comm);
  free(s.link);
  return (int)st;
}

/* ---- command line ---------------------------------------------------------------------------- */

static void twc_usage(FILE* f) {
  fprintf(f,
          "usage: tilewave calibrate [--out FILE] [--json FILE] [--quick] [--ranks N] "
          "[--timeout S]\n\n"
          "Measures the resource model's machine description on the GPUs present (one process\n"
          "per GPU) and writes it as a calibration file; plans read it when TW_CALIBRATION\n"
          "names it. Takes well under a minute on 2 GPUs. See docs/calibrate.md.\n"
          "  1 GPU:   sm_count, producer tile rate and overhead (tile_tflops,\n"
          "           tile_overhead_us), device memory rate (mem_gbps); link values stay default\n"
          "  2+ GPUs: also the consumer's per-CTA and saturated NVLink rates (link_cta_gbps,\n"
          "           link_peak_gbps); link_latency_us keeps its value\n\n"
          "  --out FILE     calibration file to write (default tilewave-calibration.txt)\n"
          "  --json FILE    also write every measurement and fit as JSON\n"
          "  --quick        smaller problems and fewer repetitions (noisier)\n"
          "  --ranks N      GPUs to use (default: every visible GPU; 1 = producer only)\n"
          "  --timeout S    kill the run after S seconds (default 300)\n");
}

int tw_cli_calibrate(int argc, char** argv) {
  twc_opts o;
  memset(&o, 0, sizeof o);
  o.out = "tilewave-calibration.txt";
  o.timeout_s = 300;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    long n = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      twc_usage(stdout);
      return 0;
    } else if (strcmp(a, "--quick") == 0) {
      o.quick = 1;
    } else if (strcmp(a, "--out") == 0 && v != NULL && *v != '\0') {
      o.out = v, i++;
    } else if (strcmp(a, "--json") == 0 && v != NULL && *v != '\0') {
      o.json = v, i++;
    } else if (strcmp(a, "--ranks") == 0 && tw__bench_parse_int(v, 1, TW_MAX_RANKS, &n)) {
      o.ranks = (int)n, i++;
    } else if (strcmp(a, "--timeout") == 0 && tw__bench_parse_int(v, 0, 1 << 30, &n)) {
      o.timeout_s = (int)n, i++;
    } else {
      fprintf(stderr,
              "tilewave calibrate: unknown option, or missing or bad value: %s (--help lists "
              "them)\n",
              a);
      return 2;
    }
  }
  int nranks = o.ranks;
  tw_launcher l;
  if (tw__launcher_detect(&l)) {
    nranks = l.nranks;
  } else {
    /* Counted in a child: this process must not initialise CUDA before it forks the ranks. */
    const int gpus = tw__gpu_count_forked();
    if (gpus <= 0) {
      fprintf(stderr, "tilewave calibrate: calibrate needs a CUDA GPU (none found)\n");
      return 1;
    }
    if (nranks == 0) nranks = gpus;
    if (nranks > gpus) {
      fprintf(stderr, "tilewave calibrate: --ranks %d but only %d GPU(s) visible\n", nranks, gpus);
      return 2;
    }
  }
  tw_status st = tw__run_ranks(nranks, twc_rank_main, &o, o.timeout_s);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tilewave calibrate: %s: %s\n", tw_status_string(st), tw_last_error());
    return 1;
  }
  return 0;
}
