/*
 * calibrate_measure.c: the measurement steps of `tilewave calibrate` and their fits (what each
 * number means: the top of cmd_calibrate.c and docs/calibrate.md).
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
#include "calibrate.h"
#include "calibrate_fit.h"
#include "checks.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "spawn.h"
#include "tilewave.h"

const int twc_ks[TWC_NK] = {512, 1024, 2048, 4096};
const int twc_cs[TWC_NC] = {1, 2, 4, 8, 16, 32};
/* Same bands, 4x different bytes per band: what separates link_cta from link_latency. */
const int twc_link_hidden[TWC_NPROB] = {4096, 1024};
const int32_t twc_scheds[2] = {TW_SCHEDULE_REMOTE_FIRST, TW_SCHEDULE_EXPERT_MAJOR};

void twc_progress(const twc_state* s, const char* fmt, ...) {
  if (s->rank != 0) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[calibrate %5.1f s] ", tw__now_seconds() - s->t0);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

/* Appends one sentence to a note ("; " between sentences); drops what does not fit. */
void twc_note(char* buf, size_t size, const char* fmt, ...) {
  size_t used = strlen(buf);
  if (used > 0 && used + 2 < size) {
    buf[used++] = ';';
    buf[used++] = ' ';
    buf[used] = '\0';
  }
  if (used + 1 >= size) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + used, size - used, fmt, ap);
  va_end(ap);
}

tw_status twc_barrier(twc_state* s) {
  TW_NCCL_TRY(ncclAllReduce(s->barrier, s->barrier + 1, 1, ncclInt32, ncclSum, s->comm, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  return TW_SUCCESS;
}

/* ---- producer -------------------------------------------------------------------------------- */

/* Every problem calibrate measures: top-2 over `experts` routed experts, `tokens` per rank, and
 * its balanced routing (seed 1). */
static tw_status twc_problem(int world, int hidden, int ffn, int experts, int tokens, tw_problem* p,
                             tw_routing_t* rt) {
  *p = (tw_problem)TW_PROBLEM_INIT;
  p->world_size = world;
  p->hidden = hidden;
  p->ffn = ffn;
  p->experts = experts;
  p->top_k = 2;
  p->max_tokens = tokens;
  return tw_routing_generate(p, TW_ROUTER_BALANCED, 0.0, tokens, 1, rt);
}

/* The balanced one-rank problem of producer point (k, tokens) with tm-row tiles (0: the
 * library's choice): its plan gives the tile list. */
static tw_status twc_producer_plan(const twc_state* s, int k, int tokens, int tm, tw_plan_t* plan) {
  tw_problem p;
  tw_routing_t rt = NULL;
  TW_TRY(twc_problem(1, TWC_PRODUCER_N, k, TWC_PRODUCER_EXPERTS, tokens, &p, &rt));
  p.tile_m = tm;
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
  tw_tile* tiles[TWC_NK + 1][TWC_NSIZES]; /* row TWC_NK: the 64-row tiles */
  cudaEvent_t ev[(TWC_NK + 1) * TWC_NSIZES + 1];
  int nev;
} twc_prod_bufs;

/* One producer launch of plan pl's tile list (uploaded to *dev_tiles) with K = k, N = n on
 * s->grid CTAs, signals on as in overlap mode (the model's per-tile cost includes the release
 * add). The caller sets the buffers and band counters. */
static tw_status twc_gemm_args(const twc_state* s, const struct tw_plan* pl, int k, int n,
                               tw_tile** dev_tiles, tw_gemm_args* a) {
  tw_gemm_shape sh = tw__gemm_shape_of_plan(pl);
  sh.k = k;
  sh.n = n;
  TW_TRY(tw__gemm_args_init(a, &sh, NULL, NULL, NULL, NULL, pl->num_tiles, s->grid, TW_SIGNAL_GPU,
                            NULL));
  const size_t tb = sizeof(tw_tile) * (size_t)pl->num_tiles;
  TW_CUDA_TRY(cudaMalloc((void**)dev_tiles, tb));
  TW_CUDA_TRY(cudaMemcpy(*dev_tiles, pl->tiles, tb, cudaMemcpyHostToDevice));
  a->tiles = *dev_tiles;
  return TW_SUCCESS;
}

/* Times the nrun launches g[0..nrun) back to back per rep, the first one rotated, so that clock
 * drift and the launch gap after the host's wait fall on every run alike (bench gemm does the
 * same). ev: nrun + 1 created events; samples[r][i]: run r's i-th timed rep, us. */
static tw_status twc_time_rotated(const twc_state* s, const tw_gemm_args* g, int nrun, int warmup,
                                  int reps, const cudaEvent_t* ev, double (*samples)[32]) {
  if (reps > 32) return tw__fail(TW_ERR_INTERNAL, "calibrate: %d reps, at most 32", reps);
  for (int rep = 0; rep < warmup + reps; rep++) {
    TW_CUDA_TRY(cudaEventRecord(ev[0], s->stream));
    for (int q = 0; q < nrun; q++) {
      TW_TRY(tw__gemm_launch(&g[(q + rep) % nrun], s->stream));
      TW_CUDA_TRY(cudaEventRecord(ev[q + 1], s->stream));
    }
    TW_CUDA_TRY(cudaEventSynchronize(ev[nrun]));
    for (int q = 0; q < nrun && rep >= warmup; q++) {
      float ms = 0.f;
      TW_CUDA_TRY(cudaEventElapsedTime(&ms, ev[q], ev[q + 1]));
      samples[(q + rep) % nrun][rep - warmup] = 1000.0 * ms;
    }
  }
  return TW_SUCCESS;
}

static tw_status twc_measure_producer_inner(twc_state* s, twc_prod_bufs* b) {
  const int sizes[TWC_NSIZES] = {s->o.quick ? 2048 : 4096, s->o.quick ? 8192 : 16384};
  const int reps = s->o.quick ? 5 : 15, warmup = 2;
  /* Rows 0..TWC_NK-1: the library's tiles at each K; row TWC_NK: 64-row tiles at K
   * twc_ks[TWC_K64] (the model prices them by tile_m64_share). */
  tw_gemm_args g[TWC_NK + 1][TWC_NSIZES];
  size_t a_max = 0, c_max = 0, bands_max = 1;
  s->grid = s->hw.sm_count - TW_DEFAULT_COMM_CTAS;
  for (int i = 0; i <= TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) {
      const int m64 = i == TWC_NK, k = twc_ks[m64 ? TWC_K64 : i];
      tw_plan_t plan = NULL;
      TW_TRY(twc_producer_plan(s, k, sizes[j], m64 ? 64 : 0, &plan));
      const struct tw_plan* pl = plan;
      twc_prod_point* p = m64 ? &s->m64 : &s->prod[i];
      if (m64)
        s->tn64 = pl->tn;
      else
        s->tm = pl->tm, s->tn = pl->tn;
      p->k = k;
      p->tiles[j] = pl->num_tiles;
      p->waves[j] = tw__ceil_div(pl->num_tiles, s->grid);
      tw_gemm_args* a = &g[i][j];
      const size_t nb = (size_t)pl->num_bands;
      const tw_status st = twc_gemm_args(s, pl, k, TWC_PRODUCER_N, &b->tiles[i][j], a);
      tw_plan_destroy(plan);
      TW_TRY(st);
      if (nb > bands_max) bands_max = nb;
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
  for (int i = 0; i <= TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) {
      g[i][j].a = b->a, g[i][j].b = b->w, g[i][j].c = b->c;
      g[i][j].band_counters = b->counters;
    }
  s->copy_bytes = 2.0 * (double)(a_max < c_max ? a_max : c_max); /* bytes of one copy's source */

  /* Every run, run r = i * TWC_NSIZES + j, rotated rep by rep. */
  const int nrun = (TWC_NK + 1) * TWC_NSIZES;
  for (int e = 0; e <= nrun; e++) {
    TW_CUDA_TRY(cudaEventCreate(&b->ev[e]));
    b->nev = e + 1;
  }
  double samples[(TWC_NK + 1) * TWC_NSIZES][32];
  TW_TRY(twc_time_rotated(s, &g[0][0], nrun, warmup, reps, b->ev, samples));
  double x[TWC_NK], y[TWC_NK], r[TWC_NK];
  for (int i = 0; i < TWC_NK; i++) {
    twc_prod_point* p = &s->prod[i];
    for (int j = 0; j < TWC_NSIZES; j++)
      p->us[j] = tw__stats_median(samples[i * TWC_NSIZES + j], reps);
    p->us_per_wave = tw__calib_per_wave(p->us[0], p->waves[0], p->us[1], p->waves[1]);
    x[i] = 2.0 * s->tm * s->tn * p->k;
    y[i] = p->us_per_wave;
  }
  TW_TRY(tw__calib_fit_producer(x + 1, y + 1, TWC_NK - 1, &s->hw.tile_tflops,
                                &s->hw.tile_overhead_us, r + 1));
  if (s->hw.tile_overhead_us < 0) {
    snprintf(s->prod_note, sizeof s->prod_note,
             "fitted overhead %.3f us per tile < 0 (noise): written as 0", s->hw.tile_overhead_us);
    s->hw.tile_overhead_us = 0;
  }
  /* K 512: the floor (per 128 output columns) that makes the model's tile time equal this wave,
   * so its residual is 0. */
  TW_TRY(tw__calib_tile_floor(x[0], s->tn, y[0], s->hw.tile_tflops, s->hw.tile_overhead_us,
                              &s->hw.tile_floor_us));
  r[0] = 0.0;
  for (int i = 0; i < TWC_NK; i++) s->prod[i].resid_us = r[i];
  s->prod_ok = 1;

  /* 64-row tiles: the share of the 128-row rate that makes the model's tile time equal their
   * wave (tile_overhead_us and the floor as just fitted). */
  twc_prod_point* p64 = &s->m64;
  for (int j = 0; j < TWC_NSIZES; j++)
    p64->us[j] = tw__stats_median(samples[TWC_NK * TWC_NSIZES + j], reps);
  p64->us_per_wave = tw__calib_per_wave(p64->us[0], p64->waves[0], p64->us[1], p64->waves[1]);
  double share = 0;
  const tw_status sst =
      tw__calib_tile_share(2.0 * 64 * s->tn64 * p64->k, s->tn64, p64->us_per_wave,
                           s->hw.tile_tflops, s->hw.tile_overhead_us, s->hw.tile_floor_us, &share);
  if (sst == TW_SUCCESS && share > 0 && share <= 1) {
    s->hw.tile_m64_share = share;
    s->m64_ok = 1;
  } else {
    twc_note(s->m64_note, sizeof s->m64_note,
             "64-row tiles: %.3f us per wave gives a share of %.3f of the 128-row rate%s%s; "
             "the default %.2f is kept",
             p64->us_per_wave, share, sst == TW_SUCCESS ? " (outside (0, 1])" : ": ",
             sst == TW_SUCCESS ? "" : tw_last_error(), s->def.tile_m64_share);
  }

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
  s->copy_us = tw__stats_median(samples[0], reps);
  s->hw.mem_gbps = 2.0 * s->copy_bytes / s->copy_us * 1e-3;
  return TW_SUCCESS;
}

tw_status twc_measure_producer(twc_state* s) {
  twc_prod_bufs b;
  memset(&b, 0, sizeof b);
  tw_status st = twc_measure_producer_inner(s, &b);
  cudaStreamSynchronize(s->stream);
  for (int e = 0; e < b.nev; e++) cudaEventDestroy(b.ev[e]);
  for (int i = 0; i <= TWC_NK; i++)
    for (int j = 0; j < TWC_NSIZES; j++) cudaFree(b.tiles[i][j]);
  cudaFree(b.a);
  cudaFree(b.w);
  cudaFree(b.c);
  cudaFree(b.counters);
  return st;
}

/* ---- refetch exposure ------------------------------------------------------------------------ */

typedef struct twc_ref_bufs {
  tw_routing_t routing;
  tw_plan_t plans[2]; /* remote-first, expert-major */
  void *a, *w, *c;
  uint32_t* counters;
  tw_tile* tiles[2];
  cudaEvent_t ev[3];
  int nev;
} twc_ref_bufs;

/* The producer alone, as twc_measure_producer times it, on the same rows in both schedules'
 * tile orders, interleaved rep by rep. Needs s->grid and s->hw.mem_gbps (the producer's
 * measurement runs first). */
static tw_status twc_measure_refetch_inner(twc_state* s, twc_ref_bufs* b) {
  const int reps = s->o.quick ? 7 : 15, warmup = 2;
  tw_problem p;
  TW_TRY(twc_problem(2, TWC_REFETCH_N, TWC_REFETCH_K, TWC_REFETCH_EXPERTS, TWC_REFETCH_TOKENS, &p,
                     &b->routing));
  tw_gemm_args g[2];
  double refetch[2];
  size_t bands_max = 1;
  for (int i = 0; i < 2; i++) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.comm_ctas = TW_DEFAULT_COMM_CTAS; /* the tile order does not depend on C */
    cfg.coalesce = 1;
    cfg.schedule = twc_scheds[i];
    cfg.hardware = &s->def;
    TW_TRY(tw_plan_create(&p, b->routing, 0, &cfg, &b->plans[i]));
    const struct tw_plan* pl = b->plans[i];
    if (pl->schedule != twc_scheds[i])
      return tw__fail(TW_ERR_INTERNAL, "calibrate: asked for schedule %d, the plan has %d",
                      twc_scheds[i], pl->schedule);
    /* Both orders are permutations of the same rows' tiles. */
    if (i == 1 && (pl->rows != b->plans[0]->rows || pl->num_tiles != b->plans[0]->num_tiles))
      return tw__fail(TW_ERR_INTERNAL,
                      "calibrate: the two schedules' plans differ in rows (%d, %d) or tiles (%d, "
                      "%d)",
                      b->plans[0]->rows, pl->rows, b->plans[0]->num_tiles, pl->num_tiles);
    TW_TRY(tw__model_traffic(pl, &s->ref_traffic[i], &refetch[i]));
    TW_TRY(twc_gemm_args(s, pl, TWC_REFETCH_K, TWC_REFETCH_N, &b->tiles[i], &g[i]));
    if ((size_t)pl->num_bands > bands_max) bands_max = (size_t)pl->num_bands;
  }
  const struct tw_plan* pl = b->plans[0];
  s->ref_rows = pl->rows;
  s->ref_experts = pl->local_experts;
  s->ref_tiles = pl->num_tiles;
  s->ref_bytes = refetch[0] - refetch[1];
  const size_t a_el = (size_t)pl->rows * TWC_REFETCH_K, c_el = (size_t)pl->rows * TWC_REFETCH_N;
  const size_t w_el = (size_t)pl->local_experts * TWC_REFETCH_N * TWC_REFETCH_K;
  /* The weights are 1 GiB: say what did not fit rather than a bare CUDA error. */
  const struct {
    void** p;
    size_t bytes;
    const char* what;
  } allocs[3] = {{&b->w, 2 * w_el, "weights"},
                 {&b->a, 2 * a_el, "input rows"},
                 {&b->c, 2 * c_el, "output rows"}};
  for (int i = 0; i < 3; i++) {
    const cudaError_t e = cudaMalloc(allocs[i].p, allocs[i].bytes);
    if (e != cudaSuccess)
      return tw__fail(TW_ERR_OUT_OF_MEMORY,
                      "calibrate: refetch exposure: %.0f MiB of %s (%d experts, %d rows, K %d, N "
                      "%d): %s",
                      (double)allocs[i].bytes / 1048576.0, allocs[i].what, pl->local_experts,
                      pl->rows, TWC_REFETCH_K, TWC_REFETCH_N, cudaGetErrorString(e));
  }
  TW_CUDA_TRY(cudaMalloc((void**)&b->counters, 4 * bands_max));
  TW_CUDA_TRY(cudaMemsetAsync(b->counters, 0, 4 * bands_max, s->stream));
  TW_TRY(tw__baseline_fill_random(b->a, a_el, 17, 1.0f, s->stream));
  TW_TRY(tw__baseline_fill_random(b->w, w_el, 18, 1.0f / 64.0f, s->stream));
  for (int i = 0; i < 2; i++) {
    g[i].a = b->a, g[i].b = b->w, g[i].c = b->c;
    g[i].band_counters = b->counters; /* they only grow; nobody waits on them here */
  }
  for (int e = 0; e < 3; e++) {
    TW_CUDA_TRY(cudaEventCreate(&b->ev[e]));
    b->nev = e + 1;
  }
  /* Both schedules back to back per rep, the first one alternating. */
  double samples[2][32];
  TW_TRY(twc_time_rotated(s, g, 2, warmup, reps, b->ev, samples));
  for (int i = 0; i < 2; i++) s->ref_us[i] = tw__stats_median(samples[i], reps);
  /* What the model already predicts between the two orders with the exposure at 0, under this
   * run's producer and memory numbers: 0 where both are compute-bound, as this problem is meant
   * to be; otherwise the roofline's share of the gap, which the exposure must not count again. */
  tw_hardware h0 = s->hw;
  h0.refetch_exposure = 0.0;
  double gemm_us[2];
  for (int i = 0; i < 2; i++) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.comm_ctas = TW_DEFAULT_COMM_CTAS;
    cfg.coalesce = 1;
    cfg.schedule = twc_scheds[i];
    cfg.hardware = &h0;
    tw_plan_t pl = NULL;
    tw_plan_summary sum;
    TW_TRY(tw_plan_create(&p, b->routing, 0, &cfg, &pl));
    const tw_status st = tw_plan_summary_get(pl, &sum);
    tw_plan_destroy(pl);
    TW_TRY(st);
    gemm_us[i] = sum.gemm_us;
  }
  s->ref_roof_us = gemm_us[0] > gemm_us[1] ? gemm_us[0] - gemm_us[1] : 0.0;
  double exposure = 0;
  TW_TRY(tw__calib_exposure(s->ref_us[0], s->ref_us[1], s->ref_roof_us, s->ref_bytes,
                            s->hw.mem_gbps, &s->ref_raw, &exposure));
  if (exposure != s->ref_raw)
    twc_note(s->ref_note, sizeof s->ref_note, "measured %.3f, clamped to %.0f", s->ref_raw,
             exposure);
  s->hw.refetch_exposure = exposure;
  s->ref_ok = 1;
  return TW_SUCCESS;
}

/* Not fatal: on failure the default is kept and the note says why. */
void twc_measure_refetch(twc_state* s) {
  twc_ref_bufs b;
  memset(&b, 0, sizeof b);
  const tw_status st = twc_measure_refetch_inner(s, &b);
  if (st != TW_SUCCESS) {
    /* Before the clean-up: the destroy calls clear the thread's last error. */
    twc_note(s->ref_note, sizeof s->ref_note, "not measured (%s: %s); the default is kept",
             tw_status_string(st), tw_last_error());
    s->ref_ok = 0;
    s->hw.refetch_exposure = s->def.refetch_exposure;
  }
  cudaStreamSynchronize(s->stream);
  for (int e = 0; e < b.nev; e++) cudaEventDestroy(b.ev[e]);
  for (int i = 0; i < 2; i++) {
    cudaFree(b.tiles[i]);
    tw_plan_destroy(b.plans[i]);
  }
  cudaFree(b.a);
  cudaFree(b.w);
  cudaFree(b.c);
  cudaFree(b.counters);
  tw_routing_destroy(b.routing);
  /* A failed allocation also sets CUDA's last error, which the next launch check would report
   * as its own failure. */
  (void)cudaGetLastError();
}

/* ---- link ------------------------------------------------------------------------------------ */

typedef struct twc_link_bufs {
  tw_routing_t routing;
  tw_plan_t plan;
  tw_context_t ctx;
  tw_device_plan_t dplan;
  void *a, *w, *out;
} twc_link_bufs;

/* Problem pi (hidden twc_link_hidden[pi]) at every C: the consumer alone and beside the
 * producer; fills mine[pi * TWC_NC + ci]. Collective (every rank calls it). */
static tw_status twc_link_problem_inner(twc_state* s, int pi, twc_link_bufs* b,
                                        twc_link_point* mine) {
  const int tokens = s->o.quick ? 4096 : 8192, reps = s->o.quick ? 5 : 11, warmup = 2;
  /* The routing does not depend on the hidden size: both problems send the same rows in the
   * same bands, only the rows' width differs. */
  tw_problem p;
  TW_TRY(twc_problem(s->world, twc_link_hidden[pi], TWC_LINK_FFN, s->world <= 2 ? 16 : 8 * s->world,
                     tokens, &p, &b->routing));
  s->link_tokens = tokens;
  s->link_experts = p.experts;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = TW_DEFAULT_COMM_CTAS; /* every call below passes its own C */
  cfg.coalesce = TWC_LINK_MGB;
  /* Remote-first: every remote band comes first, so a consumer slower than the producer never
   * waits after its first segment (the pool term's assumption). */
  cfg.schedule = TW_SCHEDULE_REMOTE_FIRST;
  cfg.hardware = &s->def;
  TW_TRY(tw_plan_create(&p, b->routing, s->rank, &cfg, &b->plan));
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timing = 1;
  TW_TRY(tw_context_create(&p, s->comm, &cc, &b->ctx));
  tw_context_info info;
  TW_TRY(tw_context_info_get(b->ctx, &info));
  s->unit_tiles[pi] = info.unit_tiles;
  TW_TRY(tw_device_plan_create(b->ctx, &b->dplan));
  TW_TRY(tw_device_plan_upload(b->dplan, b->plan, b->routing, s->stream));
  const struct tw_plan* pl = b->plan;
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
  TW_TRY(tw_moe_combine_ex(b->ctx, b->dplan, b->a, b->w, b->out, &go, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));

  /* C values the context allows (max_comm_ctas is below the SM count). */
  int ncs = 0;
  while (ncs < TWC_NC && twc_cs[ncs] <= info.max_comm_ctas) ncs++;
  if (ncs == 0)
    return tw__fail(TW_ERR_UNSUPPORTED, "calibrate: the context allows no consumer CTA count");
  s->nlink_c = ncs;
  double comm[32], red[32], beside[32], gemm[32];
  for (int ci = 0; ci < ncs; ci++) {
    tw_combine_options co = TW_COMBINE_OPTIONS_INIT;
    co.mode = TW_COMBINE_COMM_ONLY;
    co.comm_ctas = twc_cs[ci];
    for (int rep = 0; rep < warmup + reps; rep++) {
      /* All ranks start together; the delay lets the host finish enqueuing first. */
      TW_TRY(twc_barrier(s));
      TW_TRY(tw__bench_delay(s->stream, 100));
      TW_TRY(tw_moe_combine_ex(b->ctx, b->dplan, NULL, NULL, b->out, &co, s->stream));
      tw_combine_timings t;
      TW_TRY(tw_context_timings(b->ctx, &t));
      if (rep >= warmup) {
        comm[rep - warmup] = 1000.0 * t.comm_ms;
        red[rep - warmup] = 1000.0 * t.reduce_ms;
      }
    }
    /* The same C beside the producer. */
    co.mode = TW_COMBINE_OVERLAP;
    for (int rep = 0; rep < warmup + reps; rep++) {
      TW_TRY(twc_barrier(s));
      TW_TRY(tw__bench_delay(s->stream, 100));
      TW_TRY(tw_moe_combine_ex(b->ctx, b->dplan, b->a, b->w, b->out, &co, s->stream));
      tw_combine_timings t;
      TW_TRY(tw_context_timings(b->ctx, &t));
      if (rep >= warmup) {
        beside[rep - warmup] = 1000.0 * t.comm_ms;
        gemm[rep - warmup] = 1000.0 * t.gemm_ms;
      }
    }
    TW_TRY(tw_context_check(b->ctx));
    /* The producer runs on the SMs the consumer leaves (tw_moe_combine_ex: P = SMs - C). */
    tw__calib_remote rem;
    TW_TRY(tw__calib_plan_remote(pl, info.sm_count - twc_cs[ci], &rem));
    twc_link_point* q = &mine[pi * TWC_NC + ci];
    q->hidden = p.hidden;
    q->c = twc_cs[ci];
    q->bands = rem.bands;
    q->total_bytes = rem.bytes;
    q->us = tw__stats_median(comm, reps);
    q->reduce_us = tw__stats_median(red, reps);
    q->beside_us = tw__stats_median(beside, reps);
    q->gemm_us = tw__stats_median(gemm, reps);
    q->ready_waves = (double)rem.ready_waves;
    q->waves = (double)rem.waves;
    /* The consumer kernel starts with the producer and idles until the first segment is ready,
     * A_0 waves in: the model's pool term starts there. The wave time is this call's own. */
    q->ready_us = rem.waves > 0 ? q->ready_waves * q->gemm_us / q->waves : 0.0;
  }
  if (pi == 0) {
    /* The reduction: what the model charges at mem_gbps, (rows + tokens) x row bytes, against
     * the phase's time at the largest C (it includes waiting for the peers' last arrivals). */
    s->reduce_bytes = (double)my_tokens * (p.top_k + 1) * p.hidden * 2.0;
    s->reduce_us = mine[ncs - 1].reduce_us;
  }
  return TW_SUCCESS;
}

static tw_status twc_link_problem(twc_state* s, int pi, twc_link_point* mine) {
  twc_link_bufs b;
  memset(&b, 0, sizeof b);
  tw_status st = twc_link_problem_inner(s, pi, &b, mine);
  /* The destroy calls clear the thread's last error: keep the failure's detail. */
  char why[512] = "";
  if (st != TW_SUCCESS) snprintf(why, sizeof why, "%s", tw_last_error());
  cudaStreamSynchronize(s->stream);
  cudaFree(b.a);
  cudaFree(b.w);
  cudaFree(b.out);
  tw_device_plan_destroy(b.dplan);
  /* Destroying the context is collective: a rank that failed before every rank created it
   * aborts the communicator instead (twc_rank_main). */
  if (st == TW_SUCCESS) {
    st = tw_context_destroy(b.ctx);
    if (st != TW_SUCCESS) snprintf(why, sizeof why, "%s", tw_last_error());
  }
  tw_plan_destroy(b.plan);
  tw_routing_destroy(b.routing);
  if (why[0]) return tw__fail(st, "%s", why);
  return st;
}

/* Every rank's points on every rank (tiny). */
static tw_status twc_gather_points(twc_state* s, const twc_link_point* mine) {
  const size_t per = sizeof(twc_link_point) / sizeof(double) * TWC_NLINK;
  double* d = NULL;
  cudaError_t e = cudaMalloc((void**)&d, sizeof(double) * per * (size_t)(s->world + 1));
  ncclResult_t nr = ncclSuccess;
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(d, mine, sizeof(double) * per, cudaMemcpyHostToDevice, s->stream);
  if (e == cudaSuccess) nr = ncclAllGather(d, d + per, per, ncclFloat64, s->comm, s->stream);
  if (e == cudaSuccess && nr == ncclSuccess)
    e = cudaMemcpyAsync(s->link, d + per, sizeof(double) * per * (size_t)s->world,
                        cudaMemcpyDeviceToHost, s->stream);
  if (e == cudaSuccess && nr == ncclSuccess) e = cudaStreamSynchronize(s->stream);
  cudaStreamSynchronize(s->stream);
  cudaFree(d);
  if (nr != ncclSuccess)
    return tw__fail(TW_ERR_NCCL, "calibrate: gathering the link points: %s",
                    ncclGetErrorString(nr));
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "calibrate: gathering the link points: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

const twc_link_point* twc_point(const twc_state* s, int r, int pi, int ci) {
  return &s->link[(size_t)r * TWC_NLINK + (size_t)pi * TWC_NC + (size_t)ci];
}

/* The consumer bounds the call at C = twc_cs[ci] on every rank and problem: it runs at least 25%
 * longer than the producer beside it. */
static int twc_bounds(const twc_state* s, int ci) {
  for (int r = 0; r < s->world; r++)
    for (int pi = 0; pi < TWC_NPROB; pi++) {
      const twc_link_point* q = twc_point(s, r, pi, ci);
      if (!(q->beside_us > 1.25 * q->gemm_us)) return 0;
    }
  return 1;
}

/* The pool fit over every rank's and problem's point at C = twc_cs[ci] (the first
 * TW_CALIB_MAX_POINTS of them). */
static tw_status twc_fit_at(const twc_state* s, int ci, twc_pool_fit* f) {
  double bytes[TW_CALIB_MAX_POINTS], bands[TW_CALIB_MAX_POINTS], ctas[TW_CALIB_MAX_POINTS],
      us[TW_CALIB_MAX_POINTS];
  int n = 0;
  for (int r = 0; r < s->world; r++)
    for (int pi = 0; pi < TWC_NPROB && n < TW_CALIB_MAX_POINTS; pi++) {
      const twc_link_point* q = twc_point(s, r, pi, ci);
      bytes[n] = q->total_bytes;
      bands[n] = q->bands;
      ctas[n] = q->c;
      us[n] = q->beside_us - q->ready_us;
      n++;
    }
  memset(f, 0, sizeof *f);
  f->n = n;
  TW_TRY(tw__calib_fit_pool(bytes, bands, ctas, us, n, &f->gbps, &f->latency_us, NULL));
  f->ok = 1;
  return TW_SUCCESS;
}

/* From the gathered points: the plateau alone, the fit's C, the fits, what gets written. */
static tw_status twc_link_summarise(twc_state* s) {
  const int ncs = s->nlink_c;
  /* Aggregate rate per C alone on the hidden-4096 problem, the one the default was measured on
   * (mean over ranks of bytes / time): the plateau is the peak. */
  double peak = 0;
  for (int ci = 0; ci < ncs; ci++) {
    double sum = 0;
    for (int r = 0; r < s->world; r++) {
      const twc_link_point* q = twc_point(s, r, 0, ci);
      sum += q->us > 0 ? q->total_bytes / q->us * 1e-3 : 0.0;
    }
    s->agg_gbps[ci] = sum / s->world;
    if (s->agg_gbps[ci] > peak) peak = s->agg_gbps[ci];
  }
  if (!(peak > 0))
    return tw__fail(TW_ERR_INTERNAL, "calibrate: the consumer moved no bytes (empty plans?)");
  /* The peak is the raw plateau, as the default was measured: taking a latency term out of the
   * short high-C calls would overstate it wherever the CTAs overlap their latencies. */
  s->hw.link_peak_gbps = peak;
  s->link_ok = 1;

  /* The largest C up to which the consumer bounds every call. */
  s->fit_ci = -1;
  for (int ci = 0; ci < ncs && twc_bounds(s, ci); ci++) s->fit_ci = ci;
  s->bound = s->fit_ci >= 0;
  if (!s->bound) s->fit_ci = 0; /* fitted for information only */
  s->fit_c = twc_cs[s->fit_ci];
  /* Every C up to the fit's, for information (the per-CTA rate beside the producer falls as C
   * grows); the fit's own decides. */
  for (int ci = 0; ci < s->fit_ci; ci++) (void)twc_fit_at(s, ci, &s->cfit[ci]);
  twc_pool_fit* f = &s->cfit[s->fit_ci];
  if (twc_fit_at(s, s->fit_ci, f) != TW_SUCCESS) {
    twc_note(s->link_note, sizeof s->link_note,
             "the pool fit at C = %d failed (%s): link_cta_gbps and link_latency_us keep their "
             "defaults",
             s->fit_c, tw_last_error());
    return TW_SUCCESS;
  }
  /* The pool term describes the consumer only where its CTAs bound the call. */
  if (!s->bound) {
    twc_note(s->link_note, sizeof s->link_note,
             "the consumer does not bound every call even at C = 1 (beside < 1.25 x producer "
             "somewhere): the fit (%.3g GB/s, %.3g us) is not written; link_cta_gbps and "
             "link_latency_us keep their defaults",
             f->gbps, f->latency_us);
    return TW_SUCCESS;
  }
  if (tw__calib_in_range(f->gbps, TW_CALIB_CTA_GBPS_MIN, TW_CALIB_CTA_GBPS_MAX)) {
    s->hw.link_cta_gbps = f->gbps;
    s->cta_written = 1;
  } else {
    twc_note(s->link_note, sizeof s->link_note,
             "fitted link_cta_gbps %.3g is outside %.0f..%.0f GB/s: the default is kept", f->gbps,
             TW_CALIB_CTA_GBPS_MIN, TW_CALIB_CTA_GBPS_MAX);
  }
  if (tw__calib_in_range(f->latency_us, TW_CALIB_LATENCY_US_MIN, TW_CALIB_LATENCY_US_MAX)) {
    s->hw.link_latency_us = f->latency_us;
    s->latency_written = 1;
  } else {
    twc_note(s->link_note, sizeof s->link_note,
             "fitted link_latency_us %.3g is outside %.0f..%.0f us: the default is kept",
             f->latency_us, TW_CALIB_LATENCY_US_MIN, TW_CALIB_LATENCY_US_MAX);
  }
  return TW_SUCCESS;
}

tw_status twc_measure_link(twc_state* s) {
  twc_link_point mine[TWC_NLINK];
  memset(mine, 0, sizeof mine);
  for (int pi = 0; pi < TWC_NPROB; pi++) {
    TW_TRY(twc_link_problem(s, pi, mine));
    twc_progress(s, "link: hidden %d, %d C values timed alone and beside the producer",
                 twc_link_hidden[pi], s->nlink_c);
  }
  TW_TRY(twc_gather_points(s, mine));
  return twc_link_summarise(s);
}
