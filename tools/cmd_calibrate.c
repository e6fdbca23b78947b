/*
 * cmd_calibrate.c: `tilewave calibrate`, which measures the numbers of the resource model's
 * machine description (tw_hardware) on the GPUs present and writes the calibration file that
 * TW_CALIBRATION points the planner at.
 *
 * Each number is fitted to the formula the model charges it in (src/plan/model.c), so that the
 * file means what the model reads (fits: calibrate_fit.c; method and caveats: docs/calibrate.md):
 *   sm_count          the device's multiprocessor count
 *   l2_mib            the device's L2 cache size
 *   tile_tflops,      the producer GEMM alone (kernels API, band signals on, no consumer) on
 *                     P = SMs - 8 CTAs (a typical C beside it), on
 *   tile_overhead_us  two balanced problems per K that differ only in their wave count: the time
 *                     difference over the wave difference is one wave's time without the launch
 *                     and the kernel's fixed costs; least squares of it against 2 TM TN K over
 *                     K in {1024, 2048, 4096} gives the per-SM rate (slope) and the per-tile
 *                     fixed cost (intercept)
 *   tile_floor_us     the same at K 512, whose tiles take longer than their compute: the floor
 *                     that the model's 4-norm needs for that wave (tw__calib_tile_floor)
 *   tile_m64_share    the same problems at K 2048 with 64-row tiles, timed with the others: the
 *                     share of tile_tflops at which the model's tile time equals their wave
 *                     (tw__calib_tile_share); not written outside (0, 1]
 *   mem_gbps          a device-to-device copy: (read + write bytes) / time, as the default was
 *                     measured (the reduction's own rate is printed beside it)
 *   refetch_exposure  the same producer on one problem whose 64 local experts all have remote
 *                     and local rows, planned under each schedule: (T_remote-first -
 *                     T_expert-major) / (the second reads remote-first has more, 62 experts'
 *                     weights (expert-major reads its last two twice), / mem_gbps), clamped to
 *                     [0, 1]
 *   link_cta_gbps,    the consumer BESIDE the producer (TW_COMBINE_OVERLAP: it shares memory
 *   link_latency_us   with the GEMM) at C in {1, 2, 4, 8, 16, 32} on two problems that send the
 *                     same bands with 4x different bytes (hidden 4096 and 1024), timed by the
 *                     context's per-phase events (comm_ms: the consumer kernel; gemm_ms: the
 *                     producer). Where the consumer bounds the call, the model's pool term says
 *                     C x (time after the first segment is ready) = bytes / link_cta + bands x
 *                     link_latency; least squares over every rank and both problems at the
 *                     largest C at which the consumer bounds every such call gives both (the
 *                     per-CTA rate falls as C grows, so that C, the edge of the range where the
 *                     model makes its choice, is the one that counts). A value outside its
 *                     plausible range (TW_CALIB_*) is not written
 *   link_peak_gbps    the consumer alone (TW_COMBINE_COMM_ONLY, hidden 4096): the plateau of the
 *                     aggregate rate (bytes / time) over C
 *   occ_comp,         cudaOccupancyMaxActiveBlocksPerMultiprocessor of the default producer
 *   occ_comm          kernels (128 x 128 and 128 x 256 tiles; the smaller) and of the bulk
 *                     consumer, each with its shared memory (tw__gemm_occupancy,
 *                     tw__consumer_occupancy)
 *
 * One process per GPU (tw__run_ranks, as `tilewave bench`); rank 0 measures the producer, the
 * copy and the schedules while the others wait, then every rank takes part in the link
 * measurement; rank 0 prints and writes everything. With one GPU the link numbers stay at their
 * defaults.
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
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "spawn.h"
#include "tilewave.h"

#define TWC_NK 4  /* producer K points: the first gives the floor, the others the rate fit */
#define TWC_K64 2 /* the K point (twc_ks index) timed with 64-row tiles too: tile_m64_share */
#define TWC_NSIZES 2
#define TWC_NC 6
#define TWC_PRODUCER_N 4096
#define TWC_PRODUCER_EXPERTS 8
/* Link: two problems (hidden widths) that send the same bands, one plan each. */
#define TWC_NPROB 2
#define TWC_NLINK (TWC_NPROB * TWC_NC)
#define TWC_LINK_FFN 2048
#define TWC_LINK_MGB 4
/* The exposure problem: 2 ranks' layout planned for rank 0, every local expert with remote and
 * local rows, weights (1 GiB) far beyond L2, so that a second read really goes to memory; rows
 * enough (16384 tokens/rank, ~37k rows) that the model's roofline is compute-bound under both
 * schedules, so the whole measured difference is what refetch_exposure stands for (at 8192
 * tokens remote-first's traffic already exceeds its compute in the model, and the roofline's
 * own difference would be counted twice). */
#define TWC_REFETCH_TOKENS 16384
#define TWC_REFETCH_EXPERTS 128
#define TWC_REFETCH_K 2048
#define TWC_REFETCH_N 4096

static const int twc_ks[TWC_NK] = {512, 1024, 2048, 4096};
static const int twc_cs[TWC_NC] = {1, 2, 4, 8, 16, 32};
/* Same bands, 4x different bytes per band: what separates link_cta from link_latency. */
static const int twc_link_hidden[TWC_NPROB] = {4096, 1024};
static const int32_t twc_scheds[2] = {TW_SCHEDULE_REMOTE_FIRST, TW_SCHEDULE_EXPERT_MAJOR};

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

/* One link point of one rank: one problem at one C. Only doubles: the points travel between
 * ranks as ncclFloat64. */
typedef struct twc_link_point {
  double hidden, c;
  double bands;       /* remote bands the plan sends */
  double total_bytes; /* their valid rows' bytes */
  double us;          /* consumer alone (COMM_ONLY) */
  double reduce_us;   /* the owner's reduction after it */
  double beside_us;   /* consumer beside the producer (OVERLAP) */
  double gemm_us;     /* the producer in that call */
  double ready_waves; /* producer waves until the first segment is ready (A_0), and */
  double waves;       /* all of them, on the SMs - C producer CTAs */
  double ready_us;    /* ready_waves x gemm_us / waves: the consumer's wait for its first work */
} twc_link_point;
_Static_assert(sizeof(twc_link_point) % sizeof(double) == 0, "twc_link_point: doubles only");

/* A pool fit over the points at one C. */
typedef struct twc_pool_fit {
  int ok, n;
  double gbps, latency_us;
} twc_pool_fit;

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
  int tn64, m64_ok;   /* 64-row tiles at K twc_ks[TWC_K64] (tile_m64_share written) */
  twc_prod_point m64; /* that point, timed with the others; resid_us unused */
  /* memory */
  double copy_bytes, copy_us;
  /* refetch exposure (rank 0) */
  int ref_ok; /* measured and written */
  int32_t ref_rows, ref_experts;
  int64_t ref_tiles;
  double ref_us[2];      /* median producer time, remote-first and expert-major */
  double ref_traffic[2]; /* the model's device-memory bytes of each schedule */
  double ref_bytes;      /* second-read bytes: remote-first's minus expert-major's */
  double ref_roof_us;    /* the model's own remote-first minus expert-major GEMM time with the
                            exposure at 0 (its memory roofline), this run's numbers */
  double ref_raw;        /* exposure before the clamp */
  char ref_note[400];
  /* link: every rank's points, gathered on every rank (rank-major, then problem, then C) */
  int link_ok, nlink_c, link_tokens, link_experts, unit_tiles[TWC_NPROB];
  twc_link_point* link;      /* (world * TWC_NLINK) */
  double agg_gbps[TWC_NC];   /* hidden 4096 alone: mean over ranks of bytes / us */
  int fit_c, fit_ci;         /* the fit took the points at C = fit_c = twc_cs[fit_ci] */
  int bound;                 /* the consumer bounds every call at fit_c (else nothing is written) */
  twc_pool_fit cfit[TWC_NC]; /* pool fit at each C up to fit_c (the others: information) */
  int cta_written, latency_written;
  double reduce_us, reduce_bytes;
  char link_note[600], prod_note[200], m64_note[400];
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

/* Appends one sentence to a note ("; " between sentences); drops what does not fit. */
static void twc_note(char* buf, size_t size, const char* fmt, ...) TW__PRINTF(3, 4);
static void twc_note(char* buf, size_t size, const char* fmt, ...) {
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

static tw_status twc_barrier(twc_state* s) {
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
  memset(a, 0, sizeof *a);
  a->rows = pl->rows;
  a->k = k;
  a->n = n;
  a->experts = pl->local_experts;
  a->num_tiles = pl->num_tiles;
  a->tm = pl->tm;
  a->tn = pl->tn;
  a->grid = s->grid;
  a->scope = TW_SIGNAL_GPU;
  a->epilogue = TW_EPILOGUE_STORE;
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
    for (int j = 0; j < TWC_NSIZES; j++) p->us[j] = tw__stats_median(samples[i * TWC_NSIZES + j], reps);
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

static tw_status twc_measure_producer(twc_state* s) {
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
static void twc_measure_refetch(twc_state* s) {
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

static const twc_link_point* twc_point(const twc_state* s, int r, int pi, int ci) {
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

static tw_status twc_measure_link(twc_state* s) {
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
        "fit: us/wave = 2 TM TN K / (%.3f TFLOP/s x 1e6) + %.3f us  (%.0f TFLOP/s over %d SMs; "
        "K >= %d)\n",
        h->tile_tflops, h->tile_overhead_us, h->tile_tflops * h->sm_count, h->sm_count, twc_ks[1]);
    printf(
        "floor: K %d's wave = (c^4 + f^4)^(1/4) + %.3f us, c = its compute at that rate, f = "
        "%.3f us x TN / 128\n",
        twc_ks[0], h->tile_overhead_us, h->tile_floor_us);
    const twc_prod_point* p64 = &s->m64;
    printf(
        "64-row tiles (64x%d), K %d: %lld tiles, %lld waves, %.1f us; %lld tiles, %lld waves, "
        "%.1f us; %.3f us/wave",
        s->tn64, p64->k, (long long)p64->tiles[0], (long long)p64->waves[0], p64->us[0],
        (long long)p64->tiles[1], (long long)p64->waves[1], p64->us[1], p64->us_per_wave);
    if (s->m64_ok)
      printf(" = the model's tile at %.3f of the 128-row rate (tile_m64_share)\n",
             s->hw.tile_m64_share);
    else
      printf("\n");
    if (s->prod_note[0]) printf("note: %s\n", s->prod_note);
    if (s->m64_note[0]) printf("note: %s\n", s->m64_note);
    printf("\n");
  }
  if (s->ref_ok) {
    printf(
        "producer alone under both schedules: 2 ranks' layout planned for rank 0, %d tokens/rank, "
        "K %d, N %d, %d of %d experts local, top-2, balanced, %d rows, %lld tiles, P = %d CTAs; "
        "medians, interleaved\n",
        TWC_REFETCH_TOKENS, TWC_REFETCH_K, TWC_REFETCH_N, s->ref_experts, TWC_REFETCH_EXPERTS,
        s->ref_rows, (long long)s->ref_tiles, s->grid);
    printf("| schedule | us | model's memory traffic MiB | traffic / mem_gbps us |\n");
    printf("|---|---|---|---|\n");
    for (int i = 0; i < 2; i++)
      printf("| %s | %.1f | %.0f | %.1f |\n", i == 0 ? "remote-first" : "expert-major",
             s->ref_us[i], s->ref_traffic[i] / 1048576.0, s->ref_traffic[i] / (h->mem_gbps * 1e3));
    printf(
        "exposure = (%.1f - %.1f us - the model's own difference %.1f us) / (second reads %.0f MiB "
        "/ %.0f GB/s = %.1f us) = %.3f\n",
        s->ref_us[0], s->ref_us[1], s->ref_roof_us, s->ref_bytes / 1048576.0, h->mem_gbps,
        s->ref_bytes / (h->mem_gbps * 1e3), s->ref_raw);
  }
  if (s->ref_note[0]) printf("note (refetch_exposure): %s\n", s->ref_note);
  if (s->ref_ok || s->ref_note[0]) printf("\n");
  if (s->link_ok) {
    const twc_pool_fit* f = &s->cfit[s->fit_ci];
    printf(
        "consumer alone (COMM_ONLY) and beside the producer (OVERLAP): %d tokens/rank, K %d, %d "
        "experts, top-2, balanced, mgb %d, remote-first, consumer unit %d and %d column tile(s) "
        "(hidden %d and %d); median us per rank; ready = the producer's time to the first "
        "segment\n",
        s->link_tokens, TWC_LINK_FFN, s->link_experts, TWC_LINK_MGB, s->unit_tiles[0],
        s->unit_tiles[1], twc_link_hidden[0], twc_link_hidden[1]);
    printf(
        "| hidden | C | rank | bands | MiB sent | alone us | GB/s alone | beside us | producer us "
        "| "
        "ready us | C x (beside - ready) | fit | in fit |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int pi = 0; pi < TWC_NPROB; pi++)
      for (int ci = 0; ci < s->nlink_c; ci++)
        for (int r = 0; r < s->world; r++) {
          const twc_link_point* q = twc_point(s, r, pi, ci);
          char fit[32] = "-";
          if (f->ok)
            snprintf(fit, sizeof fit, "%.1f",
                     q->total_bytes / (f->gbps * 1e3) + q->bands * f->latency_us);
          printf(
              "| %.0f | %.0f | %d | %.0f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | "
              "%s |\n",
              q->hidden, q->c, r, q->bands, q->total_bytes / 1048576.0, q->us,
              q->us > 0 ? q->total_bytes / q->us * 1e-3 : 0.0, q->beside_us, q->gemm_us,
              q->ready_us, q->c * (q->beside_us - q->ready_us), fit,
              ci == s->fit_ci ? "yes" : "no");
        }
    if (f->ok && s->bound)
      printf(
          "pool fit beside the producer at C = %d (%d points; the largest C at which the consumer "
          "runs >= 1.25x as long as the producer at every point): C x (us - ready) = bytes / "
          "(%.2f GB/s x 1e3) + bands x %.3f us\n",
          s->fit_c, f->n, f->gbps, f->latency_us);
    else if (f->ok)
      printf(
          "pool fit at C = %d, not written (the consumer does not bound every call): C x (us - "
          "ready) = bytes / (%.2f GB/s x 1e3) + bands x %.3f us\n",
          s->fit_c, f->gbps, f->latency_us);
    if (s->fit_ci > 0) {
      printf("pool fit at each C up to it (information):");
      for (int ci = 0; ci <= s->fit_ci; ci++) {
        if (s->cfit[ci].ok)
          printf(" C=%d %.2f GB/s %.3f us;", twc_cs[ci], s->cfit[ci].gbps, s->cfit[ci].latency_us);
        else
          printf(" C=%d failed;", twc_cs[ci]);
      }
      printf("\n");
    }
    printf("aggregate rate alone (bytes / time), hidden %d, mean over ranks:", twc_link_hidden[0]);
    for (int ci = 0; ci < s->nlink_c; ci++) printf(" C=%d %.0f", twc_cs[ci], s->agg_gbps[ci]);
    printf(" GB/s\n");
    if (s->link_note[0]) printf("note: %s\n", s->link_note);
    if (s->reduce_us > 0)
      printf(
          "owner's reduction (rank 0, hidden %d, largest C): %.1f us for %.1f MiB, %.0f GB/s "
          "effective (includes waiting for the peers' last arrivals)\n",
          twc_link_hidden[0], s->reduce_us, s->reduce_bytes / 1048576.0,
          s->reduce_bytes / s->reduce_us * 1e-3);
    printf("\n");
  }
  printf("| parameter | default | measured | how |\n|---|---|---|---|\n");
  printf("| sm_count | %d | %d | cudaDevAttrMultiProcessorCount |\n", d->sm_count, h->sm_count);
  printf("| l2_mib | %.1f | %.1f | cudaDevAttrL2CacheSize |\n", d->l2_mib, h->l2_mib);
  printf(
      "| occ_comp | %d | %d | resident CTAs per SM of the default producers (128 x 128, 128 x 256; "
      "the smaller), cudaOccupancyMaxActiveBlocksPerMultiprocessor |\n",
      d->occ_comp, h->occ_comp);
  printf("| occ_comm | %d | %d | the same for the bulk consumer |\n", d->occ_comm, h->occ_comm);
  printf("| c_max | %d | %d | default, capped at (sm_count - 1) x occ_comm |\n", d->c_max,
         h->c_max);
  if (s->prod_ok) {
    printf("| tile_tflops | %.3f | %.3f | producer alone, slope of us/wave vs 2 TM TN K |\n",
           d->tile_tflops, h->tile_tflops);
    printf("| tile_overhead_us | %.3f | %.3f | producer alone, intercept of the same fit |\n",
           d->tile_overhead_us, h->tile_overhead_us);
    printf(
        "| tile_floor_us | %.3f | %.3f | producer alone, K %d's wave beyond its compute, per 128 "
        "columns |\n",
        d->tile_floor_us, h->tile_floor_us, twc_ks[0]);
    if (s->m64_ok)
      printf(
          "| tile_m64_share | %.3f | %.3f | producer alone, 64 x %d tiles at K %d: the share of "
          "tile_tflops that prices their wave |\n",
          d->tile_m64_share, h->tile_m64_share, s->tn64, s->m64.k);
    printf("| mem_gbps | %.0f | %.0f | device-to-device copy of %.0f MiB, read + write |\n",
           d->mem_gbps, h->mem_gbps, s->copy_bytes / 1048576.0);
  }
  if (s->ref_ok)
    printf(
        "| refetch_exposure | %.3f | %.3f | producer alone, %d local experts, (remote-first %.1f - "
        "expert-major %.1f - roofline %.1f us) / (%.0f MiB of second reads / mem_gbps = %.1f "
        "us)%s |\n",
        d->refetch_exposure, h->refetch_exposure, s->ref_experts, s->ref_us[0], s->ref_us[1],
        s->ref_roof_us, s->ref_bytes / 1048576.0, s->ref_bytes / (h->mem_gbps * 1e3),
        h->refetch_exposure != s->ref_raw ? "; clamped to [0, 1] (see note)" : "");
  else
    printf("| refetch_exposure | %.3f | - | default kept: %s |\n", d->refetch_exposure,
           s->ref_note[0] ? "not measured (see note)" : "needs the producer's measurement");
  if (s->link_ok) {
    const twc_pool_fit* f = &s->cfit[s->fit_ci];
    if (s->cta_written)
      printf(
          "| link_cta_gbps | %.2f | %.2f | consumer beside the producer at C = %d, hidden %d and "
          "%d: 1 / slope of C x us vs bytes |\n",
          d->link_cta_gbps, h->link_cta_gbps, s->fit_c, twc_link_hidden[0], twc_link_hidden[1]);
    else if (f->ok && s->bound)
      printf("| link_cta_gbps | %.2f | - | default kept: fitted %.3g GB/s is implausible |\n",
             d->link_cta_gbps, f->gbps);
    else if (f->ok)
      printf("| link_cta_gbps | %.2f | - | default kept: the consumer never bounds the call |\n",
             d->link_cta_gbps);
    else
      printf("| link_cta_gbps | %.2f | - | default kept: the pool fit failed (see note) |\n",
             d->link_cta_gbps);
    if (s->latency_written)
      printf(
          "| link_latency_us | %.3f | %.3f | same fit, coefficient of the bands sent (per band) "
          "|\n",
          d->link_latency_us, h->link_latency_us);
    else if (f->ok && s->bound)
      printf(
          "| link_latency_us | %.3f | - | default kept: fitted %.3g us is outside %.0f..%.0f |\n",
          d->link_latency_us, f->latency_us, TW_CALIB_LATENCY_US_MIN, TW_CALIB_LATENCY_US_MAX);
    else if (f->ok)
      printf("| link_latency_us | %.3f | - | default kept: the consumer never bounds the call |\n",
             d->link_latency_us);
    else
      printf("| link_latency_us | %.3f | - | default kept: the pool fit failed (see note) |\n",
             d->link_latency_us);
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

/* The fields this run measured and wrote, in tw_hardware order. */
typedef struct twc_field {
  const char* name;
  int measured;
} twc_field;

static int twc_fields(const twc_state* s, twc_field* f) {
  const twc_field all[] = {
      {"sm_count", 1},
      {"occ_comp", 1},
      {"occ_comm", 1},
      {"c_max", 0},
      {"tile_tflops", s->prod_ok},
      {"tile_overhead_us", s->prod_ok},
      {"link_cta_gbps", s->cta_written},
      {"link_peak_gbps", s->link_ok},
      {"link_latency_us", s->latency_written},
      {"mem_gbps", s->prod_ok},
      {"refetch_exposure", s->ref_ok},
      {"rho_ref", 0},
      {"l2_mib", 1},
      {"tile_floor_us", s->prod_ok},
      {"tile_m64_share", s->m64_ok},
  };
  const int n = (int)(sizeof all / sizeof all[0]);
  for (int i = 0; i < n; i++) f[i] = all[i];
  return n;
}

static void twc_json_hw(FILE* f, const char* name, const tw_hardware* h) {
  fprintf(
      f,
      "  \"%s\": {\"sm_count\": %d, \"occ_comp\": %d, \"occ_comm\": %d, \"c_max\": %d, "
      "\"tile_tflops\": %.6g, \"tile_overhead_us\": %.6g, \"link_cta_gbps\": %.6g, "
      "\"link_peak_gbps\": %.6g, \"link_latency_us\": %.6g, \"mem_gbps\": %.6g, "
      "\"refetch_exposure\": %.6g, \"rho_ref\": %.6g, \"l2_mib\": %.6g, \"tile_floor_us\": %.6g}",
      name, h->sm_count, h->occ_comp, h->occ_comm, h->c_max, h->tile_tflops, h->tile_overhead_us,
      h->link_cta_gbps, h->link_peak_gbps, h->link_latency_us, h->mem_gbps, h->refetch_exposure,
      h->rho_ref, h->l2_mib, h->tile_floor_us);
}

static tw_status twc_write_json(const twc_state* s, const char* path) {
  FILE* f = fopen(path, "w");
  if (f == NULL) return tw__fail(TW_ERR_IO, "calibrate: cannot write %s", path);
  fprintf(f, "{\"command\": \"calibrate\", \"device\": ");
  tw__json_str(f, s->device_name);
  fprintf(f, ", \"world_size\": %d, \"quick\": %d,\n", s->world, s->o.quick);
  twc_json_hw(f, "defaults", &s->def);
  fprintf(f, ",\n");
  twc_json_hw(f, "measured", &s->hw);
  twc_field fields[16];
  const int nf = twc_fields(s, fields);
  fprintf(f, ",\n  \"measured_fields\": [");
  for (int i = 0, first = 1; i < nf; i++)
    if (fields[i].measured) {
      fprintf(f, "%s\"%s\"", first ? "" : ", ", fields[i].name);
      first = 0;
    }
  fprintf(f, "],\n");
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
  const twc_prod_point* p64 = &s->m64;
  fprintf(f,
          "],\n    \"m64\": {\"measured\": %s, \"tm\": 64, \"tn\": %d, \"k\": %d, \"tiles\": "
          "[%lld, %lld], \"waves\": [%lld, %lld], \"us\": [%.3f, %.3f], \"us_per_wave\": %.4f, "
          "\"note\": ",
          s->m64_ok ? "true" : "false", s->tn64, p64->k, (long long)p64->tiles[0],
          (long long)p64->tiles[1], (long long)p64->waves[0], (long long)p64->waves[1], p64->us[0],
          p64->us[1], p64->us_per_wave);
  tw__json_str(f, s->m64_note);
  fprintf(f, "}},\n  \"copy\": {\"bytes\": %.0f, \"us\": %.3f},\n", s->copy_bytes, s->copy_us);
  fprintf(f,
          "  \"refetch\": {\"measured\": %s, \"tokens\": %d, \"experts\": %d, \"local_experts\": "
          "%d, \"k\": %d, \"n\": %d, \"grid\": %d, \"rows\": %d, \"tiles\": %lld, "
          "\"remote_first_us\": %.3f, \"expert_major_us\": %.3f, \"traffic_bytes\": [%.0f, %.0f], "
          "\"refetch_bytes\": %.0f, \"mem_gbps\": %.6g, \"roofline_us\": %.3f, \"raw\": %.6g, "
          "\"exposure\": %.6g, "
          "\"note\": ",
          s->ref_ok ? "true" : "false", TWC_REFETCH_TOKENS, TWC_REFETCH_EXPERTS, s->ref_experts,
          TWC_REFETCH_K, TWC_REFETCH_N, s->grid, s->ref_rows, (long long)s->ref_tiles, s->ref_us[0],
          s->ref_us[1], s->ref_traffic[0], s->ref_traffic[1], s->ref_bytes, s->hw.mem_gbps,
          s->ref_roof_us, s->ref_raw, s->hw.refetch_exposure);
  tw__json_str(f, s->ref_note);
  fprintf(f, "},\n");
  const twc_pool_fit* fit = &s->cfit[s->fit_ci];
  fprintf(f,
          "  \"link\": {\"measured\": %s, \"tokens\": %d, \"experts\": %d, \"ffn\": %d, \"mgb\": "
          "%d, \"schedule\": \"remote-first\", \"hidden\": [%d, %d], \"unit_tiles\": [%d, %d], "
          "\"fit_c\": %d, \"fit_ok\": %s, \"fit_points\": %d, \"fit_link_cta_gbps\": %.6g, "
          "\"fit_link_latency_us\": %.6g, \"link_cta_written\": %s, \"link_latency_written\": %s, "
          "\"note\": ",
          s->link_ok ? "true" : "false", s->link_tokens, s->link_experts, TWC_LINK_FFN,
          TWC_LINK_MGB, twc_link_hidden[0], twc_link_hidden[1], s->unit_tiles[0], s->unit_tiles[1],
          s->fit_c, fit->ok ? "true" : "false", fit->n, fit->gbps, fit->latency_us,
          s->cta_written ? "true" : "false", s->latency_written ? "true" : "false");
  tw__json_str(f, s->link_note);
  fprintf(f, ",\n    \"fits_by_c\": [");
  for (int ci = 0; s->link_ok && ci <= s->fit_ci; ci++)
    fprintf(f,
            "%s{\"c\": %d, \"ok\": %s, \"points\": %d, \"link_cta_gbps\": %.6g, "
            "\"link_latency_us\": %.6g}",
            ci ? ", " : "", twc_cs[ci], s->cfit[ci].ok ? "true" : "false", s->cfit[ci].n,
            s->cfit[ci].gbps, s->cfit[ci].latency_us);
  fprintf(f, "],\n    \"alone_gbps_by_c\": [");
  for (int ci = 0; s->link_ok && ci < s->nlink_c; ci++)
    fprintf(f, "%s{\"c\": %d, \"gbps\": %.6g}", ci ? ", " : "", twc_cs[ci], s->agg_gbps[ci]);
  fprintf(f, "],\n    \"points\": [");
  int first = 1;
  for (int r = 0; s->link_ok && r < s->world; r++)
    for (int pi = 0; pi < TWC_NPROB; pi++)
      for (int ci = 0; ci < s->nlink_c; ci++) {
        const twc_link_point* q = twc_point(s, r, pi, ci);
        fprintf(f,
                "%s\n      {\"rank\": %d, \"hidden\": %.0f, \"c\": %.0f, \"bands\": %.0f, "
                "\"bytes\": %.0f, \"us\": %.3f, \"reduce_us\": %.3f, \"beside_us\": %.3f, "
                "\"producer_us\": %.3f, \"ready_waves\": %.0f, \"waves\": %.0f, \"ready_us\": "
                "%.3f, \"in_fit\": %s}",
                first ? "" : ",", r, q->hidden, q->c, q->bands, q->total_bytes, q->us, q->reduce_us,
                q->beside_us, q->gemm_us, q->ready_waves, q->waves, q->ready_us,
                ci == s->fit_ci ? "true" : "false");
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
  twc_field fields[16];
  const int nf = twc_fields(s, fields);
  fprintf(f, "# measured by `tilewave calibrate%s` on %d x %s\n", s->o.quick ? " --quick" : "",
          s->world, s->device_name);
  for (int m = 1; m >= 0; m--) {
    fprintf(f, "# %s:", m ? "measured" : "built-in defaults");
    for (int i = 0, first = 1; i < nf; i++)
      if (fields[i].measured == m) {
        fprintf(f, "%s %s", first ? "" : ",", fields[i].name);
        first = 0;
      }
    fprintf(f, "\n");
  }
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
  int l2 = 0;
  TW_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  if (l2 > 0) s->hw.l2_mib = l2 / 1048576.0;
  /* Occupancy of each kernel role: the default producers at both tile widths (the smaller
   * counts) and the default (bulk) consumer. */
  int occ128 = 0, occ256 = 0, occ_comm = 0;
  TW_TRY(tw__gemm_occupancy(128, 128, 0, &occ128));
  TW_TRY(tw__gemm_occupancy(128, 256, 0, &occ256));
  TW_TRY(tw__consumer_occupancy(TW_CONSUMER_COPY_DEFAULT, &occ_comm));
  if (occ128 < 1 || occ256 < 1 || occ_comm < 1)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "calibrate: a kernel does not fit on an SM of this GPU (producer %d / %d, "
                    "consumer %d CTAs per SM)",
                    occ128, occ256, occ_comm);
  s->hw.occ_comp = occ128 < occ256 ? occ128 : occ256;
  s->hw.occ_comm = occ_comm;
  if (s->hw.c_max > (sms - 1) * s->hw.occ_comm) s->hw.c_max = (sms - 1) * s->hw.occ_comm;
  twc_progress(s, "%d x %s, %d SMs", s->world, s->device_name, sms);

  /* Rank 0 measures the producer, the copy and the schedules alone; the others wait at the
   * barrier, so that no other GPU's traffic shares anything with it. */
  tw_status st = TW_SUCCESS;
  if (s->rank == 0) {
    st = twc_measure_producer(s);
    if (st == TW_SUCCESS) {
      twc_progress(s, "producer: %.3f TFLOP/s per SM, %.3f us per tile; copy %.0f GB/s",
                   s->hw.tile_tflops, s->hw.tile_overhead_us, s->hw.mem_gbps);
      /* Needs the producer's grid and the copy's mem_gbps; a failure keeps the default. */
      twc_measure_refetch(s);
      if (s->ref_ok)
        twc_progress(s,
                     "schedules: remote-first %.1f us, expert-major %.1f us: refetch_exposure %.3f",
                     s->ref_us[0], s->ref_us[1], s->hw.refetch_exposure);
      else
        twc_progress(s, "schedules: %s", s->ref_note);
    } else {
      fprintf(stderr, "tilewave calibrate: producer: %s: %s\n", tw_status_string(st),
              tw_last_error());
    }
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
    twc_progress(s, "link: consumer alone and beside the producer over %d ranks", s->world);
    TW_TRY(twc_measure_link(s));
    twc_progress(s, "link: %.2f GB/s per CTA (%s), %.3f us per band (%s), %.1f GB/s peak",
                 s->hw.link_cta_gbps, s->cta_written ? "fitted" : "default kept",
                 s->hw.link_latency_us, s->latency_written ? "fitted" : "default kept",
                 s->hw.link_peak_gbps);
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
          "usage: tilewave calibrate [--out FILE] [--json-file FILE] [--quick] [--ranks N] "
          "[--timeout S]\n\n"
          "Measures the resource model's machine description on the GPUs present (one process\n"
          "per GPU) and writes it as a calibration file; plans read it when TW_CALIBRATION\n"
          "names it. Takes well under a minute on 2 GPUs. See docs/calibrate.md.\n"
          "  1 GPU:   sm_count, l2_mib, the kernels' occupancy (occ_comp, occ_comm), producer\n"
          "           tile rate, overhead and floor (tile_tflops, tile_overhead_us,\n"
          "           tile_floor_us), the rate of 64-row tiles (tile_m64_share), device\n"
          "           memory rate (mem_gbps), the\n"
          "           exposed cost of remote-first's second weight reads (refetch_exposure: the\n"
          "           producer under both schedules); link values stay default\n"
          "  2+ GPUs: also the consumer's per-CTA rate and per-band cost (link_cta_gbps,\n"
          "           link_latency_us: beside the producer at small C on hidden 4096 and\n"
          "           1024) and the saturated NVLink rate (link_peak_gbps)\n"
          "A fitted value outside its plausible range is not written (the default stays and\n"
          "the table says why).\n\n"
          "  --out FILE        calibration file to write (default tilewave-calibration.txt)\n"
          "  --json-file FILE  also write every measurement and fit as JSON (alias --json)\n"
          "  --quick           smaller problems and fewer repetitions (noisier)\n"
          "  --ranks N         GPUs to use (default: every visible GPU; 1 = no link values;\n"
          "                    alias --gpus)\n"
          "  --timeout S       kill the run after S seconds (default 300)\n");
}

static void twc_usage_cb(FILE* f, void* ctx) {
  (void)ctx;
  twc_usage(f);
}

int tw_cli_calibrate(int argc, char** argv) {
  twc_opts o;
  memset(&o, 0, sizeof o);
  o.out = "tilewave-calibration.txt";
  o.timeout_s = 300;
  tw_cli_arg args[] = {
      tw__cli_string("--out", &o.out),
      /* --json FILE: the spelling calibrate has always had (docs/calibrate.md) */
      tw__cli_alias(tw__cli_json_file(&o.json), "--json"),
      tw__cli_bool("--quick", &o.quick),
      tw__cli_ranks(&o.ranks),
      tw__cli_timeout(&o.timeout_s),
  };
  const int rc = tw__cli_parse("tilewave calibrate", argc, argv, args,
                               (int)(sizeof args / sizeof args[0]), twc_usage_cb, NULL);
  if (rc != 0) return rc == 1 ? 0 : rc;
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
