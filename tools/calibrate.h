/*
 * calibrate.h: what the parts of `tilewave calibrate` share (internal to tools/): the problem
 * sizes, one rank's state and the measurement and report steps.
 *   calibrate_measure.c  the steps: producer alone, refetch exposure, link (consumer alone and
 *                        beside the producer) and their fits
 *   calibrate_report.c   the tables, the JSON record and the calibration file's provenance
 *   cmd_calibrate.c      the command: what each number means, the ranks, the command line
 */
#ifndef TW_TOOLS_CALIBRATE_H
#define TW_TOOLS_CALIBRATE_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>

#include "core.h"
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

extern const int twc_ks[TWC_NK]; /* producer K points */
extern const int twc_cs[TWC_NC]; /* link: consumer CTA counts */
/* Same bands, 4x different bytes per band: what separates link_cta from link_latency. */
extern const int twc_link_hidden[TWC_NPROB];
extern const int32_t twc_scheds[2]; /* remote-first, expert-major */

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

/* ---- calibrate_measure.c ---- */
/* Rank 0 only: a progress line on stderr with the time since the start. */
void twc_progress(const twc_state* s, const char* fmt, ...) TW__PRINTF(2, 3);
/* Appends one sentence to a note ("; " between sentences); drops what does not fit. */
void twc_note(char* buf, size_t size, const char* fmt, ...) TW__PRINTF(3, 4);
tw_status twc_barrier(twc_state* s);
/* Rank 0, alone: the producer's rate, overhead, floor, 64-row share and the copy's mem_gbps. */
tw_status twc_measure_producer(twc_state* s);
/* Rank 0, after the producer: refetch_exposure (a failure keeps the default, with a note). */
void twc_measure_refetch(twc_state* s);
/* Every rank: the consumer alone and beside the producer, and the pool fit. */
tw_status twc_measure_link(twc_state* s);
/* Rank r's link point of problem pi at C index ci. */
const twc_link_point* twc_point(const twc_state* s, int r, int pi, int ci);

/* ---- calibrate_report.c ---- */
/* Rank 0: every measurement and the parameter table on stdout. */
void twc_print(const twc_state* s);
tw_status twc_write_json(const twc_state* s, const char* path);
/* Comments after the keys: what measured the file and which values are defaults. */
tw_status twc_append_provenance(const twc_state* s);

#endif /* TW_TOOLS_CALIBRATE_H */
