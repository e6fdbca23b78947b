/*
 * bench.h: what the parts of `tilewave bench` and `tilewave sweep` share (internal to tools/):
 * the options, the points, the policies, one rank's state, and the functions of each part:
 *   bench_rank.c   one rank's setup and teardown, running, checking and timing policies
 *   bench_grid.c   `tilewave bench`: one point against the baselines, its table row and JSON
 *   bench_sweep.c  `tilewave sweep`: every (C, mgb) of a point; --oracle over a matrix
 *   bench_what_if.c  the planner's choices for the same points, on a machine without GPUs
 *   cmd_bench.c    the command line, the points and the ranks
 * The methodology is described at the top of cmd_bench.c and in docs/bench.md.
 */
#ifndef TW_TOOLS_BENCH_H
#define TW_TOOLS_BENCH_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>

#include "baseline.h"
#include "bench_common.h"
#include "progress.h" /* twb_progress */
#include "team.h"     /* tw__team */
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
  int what_if;        /* bench --what-if: the planner's choices for the points, no GPU */
  int in_process;     /* bench --in-process W: W ranks as threads on GPU 0 (0: off) */
  int sm_budget;      /* bench --in-process: --sm-budget B (0: the team's default) */
  int tp, ep;         /* bench --tp T [--ep E]: the TP x EP call (0: the EP call) */
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

/* Derived numbers of one point. */
typedef struct twb_derived {
  double seq, ours, gemm, comm, ideal, eff, overlap, speedup, unfused, chunk;
  const char* seq_variant; /* the fastest sequential form: "loop", "grouped" or "packed" */
  int chunk_rows;
  double max_err;
  int pass;
} twb_derived;

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

/* ---- bench_rank.c ---- */
/* ---- one rank's setup and teardown ----------------------------------------------------------- */
void twb_rank_free(twb_rank* s);
/* The problem of point `pt` on `world` ranks, with the command line's tile shape (not validated).
 */
tw_problem twb_problem_of(const twb_opts* o, const twb_point* pt, int world);
/* Problem, routing, every rank's plan (explicit --comm-ctas/--coalesce win over the model),
 * context, this rank's device plan(s), baselines, inputs and outputs. `sweep_mgbs` (n > 0) adds one
 * plan and device plan per coalescing factor. */
tw_status twb_setup(twb_rank* s, const twb_opts* o, const twb_point* pt, const int* sweep_mgbs,
                    int n_sweep);
/* ---- running and timing policies ------------------------------------------------------------- */
tw_status twb_run(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st);
/* twb_run for a correctness check: under the add dataflow ours' output is in the context's window
 * until the next call; copy it into the policy's buffer (a timed run does not). */
tw_status twb_run_checked(twb_rank* s, const twb_policy* pol, int set, cudaStream_t st);
tw_status twb_barrier(twb_rank* s);
/* Elementwise max over ranks of n floats (host array, in place). */
tw_status twb_max_over_ranks(twb_rank* s, float* v, size_t n);
/* Runs every output-producing policy once on input set `set` (outputs poisoned first), checks our
 * context, and returns per policy the normwise relative difference to ours' output, max over ranks
 * (err[i] = -1 for policies without an output, 0 for ours). */
tw_status twb_check(twb_rank* s, const twb_policy* pols, int np, int set, int rerun, float* err);
/* Times every policy: warmup + iters rounds, ABBA order, max over ranks per sample. samples: (np,
 * iters) microseconds. */
tw_status twb_time(twb_rank* s, const twb_opts* o, const twb_policy* pols, int np, float* samples,
                   int* last_set);
/* The model's prediction of the call: the largest of the ranks' own predictions under the default
 * config (each rank plans for itself and the slowest bounds the call; rank 0's alone can be far
 * below it on skewed routings, dev/NOTES.md section 15). The caller has already planned
 * `known_rank` (its prediction `known_us`): only the other ranks are planned here. */
tw_status twb_predicted_call(const tw_problem* p, tw_routing_t rt, int known_rank, double known_us,
                             double* us);

/* ---- bench_grid.c ---- */
void twb_print_header(const twb_opts* o);
tw_status twb_bench_point(twb_rank* s, const twb_opts* o, const twb_point* pt, twb_bench_result* r);
void twb_print_json_point(FILE* f, const twb_opts* o, const twb_bench_result* r, int first);
void twb_print_row(const twb_opts* o, const twb_bench_result* r);
void twb_derive(const twb_opts* o, const twb_bench_result* r, twb_derived* d);

/* ---- bench_sweep.c ---- */
/* Rank 0, before the first point: the JSON's opening and the table's header. */
void twb_oracle_begin(const twb_opts* o, int nranks, FILE* js);
int twb_oracle_point(twb_rank* s, const twb_opts* o, const twb_point* pt, int index, int npoints,
                     twb_oracle_acc* acc, FILE* js, tw_status* status);
/* `tilewave sweep` of one point: the measured table with the model's predictions, the oracle, the
 * model's choice and its regret (rank 0 prints). */
tw_status twb_sweep_point(twb_rank* s, const twb_opts* o, const twb_point* pt);
/* The pass over the matrix (all ranks; rank 0 keeps the results in v[0..npoints)): the best fixed
 * (C, mgb) comes from rank 0's summary of the matrix. Returns the points done in *done. */
tw_status twb_versus_pass(twb_rank* s, const twb_opts* o, const twb_point* pts, int npoints,
                          const twb_oracle_acc* acc, twb_versus* v, int* fixed, int* done);
/* The matrix's summary (rank 0): the model's mean and max regret, the best single fixed (C, mgb)
 * and how often the model loses to it, the planning time. Markdown on stdout, JSON to js. */
void twb_oracle_summary(const twb_opts* o, int world, const twb_point* pts,
                        const twb_oracle_acc* acc, const twb_versus* vs, int nvs, const int* vfixed,
                        FILE* js);
/* `sweep --oracle --list`: the matrix and a rough time estimate, host only. Per point: rank 0's
 * plan (default config) gives the model's choice and its predicted time of every candidate; the
 * estimate is rounds (warm-up + timed + the correctness run) x (the sum of the predictions +
 * per sample the device delay and ~100 us of barrier and synchronisation), plus ~2 s of setup
 * (context, inputs) and the solve timing at this machine's planning speed. It is only as good as
 * the model's predictions and overheads (on 2 x H200 the full matrix took 282 s with 15 rounds,
 * under 60% of the estimate). */
int twb_oracle_list(const twb_opts* o, const twb_point* pts, int n);

/* ---- bench_what_if.c ---- */
/* `tilewave bench` without the GPUs it needs (or --what-if): what the planner picks at every
 * point for rank 0 of `world` ranks (C, mgb, schedule, predicted and sequential us) and the
 * slowest rank's prediction, after one line saying `why`; host only. Returns the exit code: 0,
 * 1 (a failure), 2 (a problem the planner rejects). */
int twb_what_if(const twb_opts* o, const twb_point* pts, int n, int world, const char* why);

/* ---- cmd_bench.c ---- */
/* GPUs this process could use, without initialising CUDA in it: none where the machine has no
 * NVIDIA device node (nothing forked), else counted in a short-lived child. */
int twb_gpus_present(void);

/* ---- bench_team.c ---- */
/* `tilewave bench --in-process W`: the points with W ranks as threads on GPU 0 over an
 * in-process team, ours' four modes only (no NCCL baselines), the overlapped output checked
 * against the unfused one bit for bit. Must run before this process's first CUDA call. Returns
 * the exit code: 0, or 1 (a failure or a wrong element). */
int twb_in_process(const twb_opts* o, const twb_point* pts, int npoints);
/* sweep --in-process W: ours at every C from 1 to --c-max (at most the budget - 1) against the
 * plan's choice, per point, W ranks on GPU 0 (the same setup as bench --in-process). */
int twb_in_process_sweep(const twb_opts* o, const twb_point* pts, int npoints);

/* The progress line on stderr as point i (0-based) of pr's run starts: its shape, and from the
 * second point on the time so far and an estimate of the time left (progress.h). */
void twb_point_progress(const twb_progress* pr, int i, const twb_point* pt);

/* bench --tp T --in-process W (bench_tp.c): the TP x EP call, overlapped and unfused, per point,
 * W = tp x ep ranks on GPU 0. */
int twb_in_process_tp(const twb_opts* o, const twb_point* pts, int npoints);

/* What a rank thread of an in-process team gets (the first member of its argument). */
typedef struct twb_team_job {
  tw_team_t team, sums; /* the contexts' team, and one for the harness's own sums */
  int rank, world;
  tw_status st;  /* out: the rank's result (twb_team_done) */
  char why[600]; /* out: tw_last_error() when st failed */
} twb_team_job;

/* A rank thread's last step: records st and, when it failed, the thread's last error. */
void twb_team_done(twb_team_job* job, tw_status st);
/* After twb_team_run: prints "cmd: rank r: status: why" on stderr for each failed rank (ranks +
 * r * stride, a twb_team_job first) and returns how many failed. */
int twb_team_failures(const char* cmd, int world, const void* ranks, size_t stride);

/* Runs fn on `world` threads, thread r on ranks + r * stride, whose first member is a twb_team_job
 * that this fills (two fresh in-process teams of `world` ranks), and joins them. The caller has
 * set CUDA_DEVICE_MAX_CONNECTIONS before the process's first CUDA call (tw_team_create). */
tw_status twb_team_run(int world, void* (*fn)(void*), void* ranks, size_t stride);

/* One in-process rank's state for one point: `bench --in-process` and `tilewave trace`. */
typedef struct twb_team_rank {
  tw__team* sums; /* this rank's view of the job's sums team */
  tw_problem problem;
  tw_context_t ctx;
  tw_context_info info;
  tw_device_plan_t dp;
  tw_routing_t rt;
  tw_plan_t plan;
  void* in;       /* (plan rows, F) bf16, seeded */
  void* w2;       /* (E_local, H, F) bf16, seeded */
  void* out;      /* (max_tokens, H) bf16 */
  void* call_out; /* what tw_moe_combine takes as out: `out`, or NULL under the add dataflow */
  size_t n_out;   /* elements of out */
  cudaStream_t s;
  int add; /* the add dataflow: the output lives in the context (tw_context_output) */
} twb_team_rank;

/* Sets up rank job->rank of job->world for point pt on GPU 0: a stream, the context on the job's
 * team (config.timing = timing, the command line's --sm-budget), the routing from --seed, the
 * plan (--comm-ctas / --coalesce win over the model), the device plan and seeded inputs. Call
 * twb_team_rank_free after it whatever it returns (every rank must: the context's destruction is
 * collective). */
tw_status twb_team_rank_setup(twb_team_rank* t, const twb_opts* o, const twb_point* pt,
                              const twb_team_job* job, int timing);
void twb_team_rank_free(twb_team_rank* t);
/* The last call's output (tokens of this rank x H bf16, the whole of out) to host[0..n_out). */
tw_status twb_team_output(const twb_team_rank* t, uint16_t* host);
/* n bf16 values of a deterministic pattern in [-1, 1) (seeded by salt) copied to device dst. */
tw_status twb_upload_random(void* dst, size_t n, uint64_t salt);
/* TW_TRACE=1 in the environment: `bench --in-process` also times ours traced. */
int twb_trace_env(void);
/* Trace records one call can write (src/core/trace.h), with room to spare: 2 per tile, at most 4
 * per unit, per consumer CTA its announcements (one per owner before each credit wait, once at
 * the end) and its end, 3 per reduction CTA (at most 8 per SM of the budget: 2048 threads of
 * 256). */
int64_t twb_trace_capacity(int32_t tiles, int32_t units, int world, int budget);

#endif /* TW_TOOLS_BENCH_H */
