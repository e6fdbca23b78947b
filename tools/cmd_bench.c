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
 * does so over a workload matrix (harness/oracle.c) and summarises the model's regret, the best
 * single fixed (C, mgb) and the model's solve time inside tw_plan_create.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "baseline.h"
#include "bench.h"
#include "bench_common.h"
#include "checks.h"
#include "cli.h"
#include "progress.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "runtime.h"
#include "spawn.h"
#include "tilewave.h"

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
  twb_progress pr;
  twb_progress_begin(&pr,
                     o->oracle  ? "sweep --oracle"
                     : o->sweep ? "sweep"
                                : "bench",
                     "point", job->npoints);
  for (int i = 0; i < job->npoints && st == TW_SUCCESS && res; i++) {
    const twb_point* pt = &job->points[i];
    const double t0 = tw__now_seconds();
    if (rank == 0)
      twb_progress_start(&pr, i, "tokens/rank %d K %d N %d E %d top-%d %s", pt->tokens, pt->ffn,
                         pt->hidden, pt->experts, pt->topk, tw__cli_router_name(pt->router));
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
        twb_progress_end(&pr, i, "seq %.1f us, ours %.1f us (C=%d mgb=%d), %.2fx, err %.2e, %.1f s",
                         d.seq, d.ours, res->c, res->mgb, d.speedup, d.max_err,
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
            "`tilewave bench gemm ...` runs the GEMM benchmark (tools/bench_gemm.cu);\n"
            "`tilewave bench gemm1 ...` GEMM1 + SwiGLU against cuBLAS (tools/bench_gemm1.cu).\n"
            "`tilewave bench layer ...` the whole layer against the sequential one, and\n"
            "`tilewave bench dispatch ...` the dispatch against permute + copy all-to-all, on\n"
            "one GPU (tools/bench_layer.c).\n"
            "Without GPUs (or fewer than 2, or than --ranks), or with --what-if, shows what the\n"
            "planner would pick at every point instead (C, mgb, schedule, predicted and\n"
            "sequential us; tilewave plan's choice for rank 0) and exits 0.\n\n"
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
            "                      reduction) with the context's events, --iters more calls\n"
            "  --what-if           plan the points on the host and show the planner's choices\n"
            "                      (no GPU is touched; what runs without GPUs anyway)\n"
            "  --tp T [--ep E]     with --in-process W (W = T x E): the tensor-parallel call\n"
            "                      (GEMM2 over F slices + GatherRS), overlapped vs unfused\n");
  fprintf(f,
          "  --in-process W      W ranks (1..8) as threads of this process on GPU 0, over an\n"
          "                      in-process team: %s; one GPU's memory\n"
          "                      stands in for NVLink (not comparable with multi-GPU numbers)\n"
          "  --sm-budget B       with --in-process: SMs each rank's call may occupy (default\n"
          "                      the GPU's SMs / W)\n",
          sweep ? "one point's C sweep, no oracle" : "ours' modes only, no NCCL baselines");
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
    args[n++] =
        tw__cli_int_list("--points", o->only, TWB_MAX_ONLY, &o->nonly, 1, TW__ORACLE_MAX_POINTS);
    args[n++] = tw__cli_int("--confirm", &o->confirm, 0, TW_CLI_ITERS_MAX);
    args[n++] = tw__cli_int("--versus-fixed", &o->versus, 0, TW_CLI_ITERS_MAX);
  } else {
    args[n++] = tw__cli_bool("--full", &o->full);
    args[n++] = tw__cli_bool("--phases", &o->phases);
    args[n++] = tw__cli_bool("--what-if", &o->what_if);
    args[n++] = tw__cli_tp(&o->tp);
    args[n++] = tw__cli_int("--ep", &o->ep, 1, TW_MAX_RANKS);
  }
  args[n++] = tw__cli_int("--in-process", &o->in_process, 1, 8);
  args[n++] = tw__cli_int("--sm-budget", &o->sm_budget, 2, 100000);
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

/* The combinations of flags that parse but make no sense: 0, or 2 (usage error, said why). */
static int twb_check_opts(twb_opts* o, int sweep, int shape_given, const char* cmd) {
  if (o->list) o->oracle = 1;
  /* The oracle is a minimum over ~100 medians: with 5 rounds an outlier cell biased it low (run 8:
   * max regret 7.23% with 5 rounds, 4.85% with 15, same code; bench/results/2026-11-30-run8.md). */
  if (o->iters < 0) o->iters = o->oracle ? 15 : sweep ? 20 : 50;
  if (o->warmup < 0) o->warmup = o->oracle ? 2 : sweep ? 3 : 5;
  if (o->sm_budget > 0 && o->in_process == 0)
    return tw__cli_usage_error(cmd, "--sm-budget B runs with --in-process W (W ranks on one GPU)");
  if (o->in_process > 0 &&
      (o->routing_file || o->write_routing || o->phases || o->json || o->json_file || o->full))
    return tw__cli_usage_error(cmd,
                               "--in-process times ours' modes only: drop --routing, "
                               "--write-routing, --phases, --json, --json-file and --full");
  if (sweep && o->in_process > 0 && o->oracle)
    return tw__cli_usage_error(cmd,
                               "sweep --in-process times one point's C sweep; the oracle matrix "
                               "(--oracle, --matrix, --points, --list) runs on one GPU per rank");
  if (o->ep > 0 && o->tp == 0)
    return tw__cli_usage_error(cmd, "--ep E sizes the TP x EP world; give it with --tp T");
  if (o->tp > 0) {
    /* The TP call runs in-process only so far (bench_tp.c). */
    if (o->in_process == 0 || o->what_if)
      return tw__cli_usage_error(cmd,
                                 "--tp T times the TP x EP call with --in-process W (W = tp x ep "
                                 "ranks on one GPU); its NCCL run and the cuBLAS + NCCL "
                                 "reduce-scatter baseline are not built yet (for the plan alone: "
                                 "`tilewave plan --tp T --ep E`)");
    if (o->ep == 0 && o->in_process % o->tp != 0)
      return tw__cli_usage_error(cmd, "--in-process %d is not a multiple of --tp %d", o->in_process,
                                 o->tp);
    if (o->ep == 0) o->ep = o->in_process / o->tp;
    if (o->tp * o->ep != o->in_process)
      return tw__cli_usage_error(cmd,
                                 "--tp %d x --ep %d = %d ranks but --in-process %d; the world is "
                                 "tp x ep",
                                 o->tp, o->ep, o->tp * o->ep, o->in_process);
  }
  if (o->versus > 0 && !o->oracle)
    return tw__cli_usage_error(cmd, "--versus-fixed needs a matrix (--oracle)");
  /* The confirmation re-times a matrix point's best cells: without --oracle there are none, and
   * silently timing nothing would read as a confirmed result. */
  if (o->confirm > 0 && !o->oracle)
    return tw__cli_usage_error(cmd,
                               "--confirm R re-times the cells of an oracle matrix; use it with "
                               "`tilewave sweep --oracle`");
  if (o->oracle) {
    if (o->matrix == NULL) o->matrix = "quick";
    const char* conflict = shape_given        ? "--model/--hidden/--ffn/--experts/--topk/--routing"
                           : o->ntokens       ? "--tokens"
                           : o->router >= 0   ? "--router"
                           : o->write_routing ? "--write-routing"
                           : o->comm_ctas     ? "--comm-ctas"
                           : o->coalesce      ? "--coalesce"
                                              : NULL;
    if (conflict)
      return tw__cli_usage_error(
          cmd, "--oracle measures its own workload matrix (--matrix quick|full); drop %s",
          conflict);
  }
  return 0;
}

/* sweep --oracle: the matrix's points, or the --points subset of it. 0, 1 failure, 2 usage. */
static int twb_matrix_points(const twb_opts* o, twb_job* job) {
  tw__oracle_point* m = (tw__oracle_point*)calloc(TW__ORACLE_MAX_POINTS, sizeof(tw__oracle_point));
  job->points = (twb_point*)calloc(TW__ORACLE_MAX_POINTS, sizeof(twb_point));
  const int n = m && job->points ? tw__oracle_matrix(o->matrix, m, TW__ORACLE_MAX_POINTS) : -1;
  for (int i = 0; i < n; i++) {
    twb_point* pt = &job->points[i];
    pt->hidden = m[i].hidden, pt->ffn = m[i].ffn, pt->experts = m[i].experts;
    pt->topk = m[i].topk, pt->tokens = m[i].tokens, pt->router = m[i].router;
    snprintf(pt->name, sizeof pt->name, "%s", m[i].name);
    pt->index = i + 1;
  }
  free(m);
  if (n < 0) {
    fprintf(stderr, "tilewave sweep: cannot build the %s matrix\n", o->matrix);
    return 1;
  }
  job->npoints = n;
  if (o->nonly == 0) return 0;
  /* --points: a subset, in the order given (indices as --list numbers them). */
  twb_point* sub = (twb_point*)calloc((size_t)o->nonly, sizeof(twb_point));
  if (sub == NULL) return 1;
  for (int i = 0; i < o->nonly; i++) {
    if (o->only[i] > n) {
      free(sub);
      return tw__cli_usage_error("tilewave sweep", "--points %d: the %s matrix has %d points",
                                 o->only[i], o->matrix, n);
    }
    sub[i] = job->points[o->only[i] - 1];
  }
  free(job->points);
  job->points = sub;
  job->npoints = o->nonly;
  return 0;
}

/* bench and sweep of one shape: the grid (bench without a shape), or the shape at each --tokens.
 * 0, 1 failure, 2 usage. */
static int twb_shape_points(const twb_opts* o, int sweep, int shape_given, twb_job* job) {
  twb_point base = {4096, 2048, 16, 2, 8192, TW_ROUTER_BALANCED, 0.0, "", 0};
  if (o->model) {
    tw_problem p = TW_PROBLEM_INIT;
    if (tw_problem_preset(o->model, &p) != TW_SUCCESS) {
      fprintf(stderr, "tilewave: %s\n", tw_last_error());
      return 2;
    }
    base.hidden = p.hidden, base.ffn = p.ffn, base.experts = p.experts, base.topk = p.top_k;
  }
  if (o->hidden) base.hidden = o->hidden;
  if (o->ffn) base.ffn = o->ffn;
  if (o->experts) base.experts = o->experts;
  if (o->topk) base.topk = o->topk;
  if (o->router >= 0) base.router = o->router, base.router_param = o->router_param;
  const int routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
  const int nrouters = o->full && o->router < 0 ? 3 : 1;
  static const int default_tokens[2] = {8192, 16384};
  const int* toks = o->ntokens ? o->tokens : default_tokens;
  const int ntoks = o->ntokens ? o->ntokens : (shape_given || sweep ? 1 : 2);
  const int grid = !shape_given && !sweep;
  const int hs[2] = {4096, 8192}, es[5] = {4, 8, 16, 32, 64};
  job->points = (twb_point*)calloc(64 + (size_t)ntoks * 2 * 5 * 3, sizeof(twb_point));
  if (job->points == NULL) return 1;
  for (int t = 0; t < ntoks; t++)
    for (int h = 0; h < (grid ? 2 : 1); h++)
      for (int e = 0; e < (grid ? 5 : 1); e++)
        for (int r = 0; r < nrouters; r++) {
          twb_point pt = base;
          pt.tokens = toks[t];
          if (grid) pt.hidden = hs[h], pt.experts = es[e];
          if (nrouters > 1) pt.router = routers[r], pt.router_param = 0.0;
          job->points[job->npoints++] = pt;
        }
  return 0;
}

/* The add dataflow sums at most two rows per token (top-1 or top-2): other points are left out,
 * said so, rather than failing the whole run at their context. Sets o->add. 0, or 2 (usage). */
static int twb_keep_dataflow_points(twb_opts* o, twb_job* job, const char* cmd) {
  int32_t dataflow = TW_DATAFLOW_REDUCE;
  if (tw__dataflow_resolve("tilewave", TW_DATAFLOW_DEFAULT, &dataflow) != TW_SUCCESS) {
    fprintf(stderr, "tilewave: %s\n", tw_last_error());
    return 2;
  }
  o->add = dataflow == TW_DATAFLOW_ADD;
  if (!o->add) return 0;
  int kept = 0;
  for (int i = 0; i < job->npoints; i++) {
    if (job->points[i].topk <= 2) {
      job->points[kept++] = job->points[i];
      continue;
    }
    fprintf(stderr, "%s: point %d (top-%d) left out: the add dataflow runs top-1 and top-2 only\n",
            cmd, job->points[i].index > 0 ? job->points[i].index : i + 1, job->points[i].topk);
  }
  if (kept == 0) {
    fprintf(stderr, "%s: no point is top-1 or top-2; use --dataflow reduce\n", cmd);
    return 2;
  }
  job->npoints = kept;
  return 0;
}

int twb_gpus_present(void) {
  if (access("/dev/nvidiactl", F_OK) != 0 && access("/dev/nvidia0", F_OK) != 0 &&
      access("/dev/dxg", F_OK) != 0)
    return 0;
  const int n = tw__gpu_count_forked();
  return n < 0 ? 0 : n;
}

/* The points of the command line (job->points, job->npoints): 0, 1 failure, 2 usage; on 0 with
 * *done set the command has finished (sweep --oracle --list). */
static int twb_points(twb_opts* o, int sweep, int shape_given, twb_job* job, const char* cmd,
                      int* done) {
  *done = 0;
  int rc = o->oracle ? twb_matrix_points(o, job) : twb_shape_points(o, sweep, shape_given, job);
  if (rc == 0 && o->oracle && o->list) {
    *done = 1;
    return twb_oracle_list(o, job->points, job->npoints);
  }
  if (rc == 0) rc = twb_keep_dataflow_points(o, job, cmd);
  if (rc == 0 && sweep && !o->oracle && job->npoints > 1) job->npoints = 1;
  return rc;
}

static int twb_main(int argc, char** argv, int sweep) {
  const char* cmd = sweep ? "tilewave sweep" : "tilewave bench";
  twb_opts o;
  int shape_given = 0;
  int rc = twb_parse(argc, argv, sweep, &o, &shape_given);
  if (rc != 0) return rc == 1 ? 0 : rc;
  rc = twb_check_opts(&o, sweep, shape_given, cmd);
  if (rc != 0) return rc;

  twb_job job;
  memset(&job, 0, sizeof job);
  int done = 0;
  rc = twb_points(&o, sweep, shape_given, &job, cmd, &done);
  if (rc != 0 || done) {
    free(job.points);
    return rc;
  }
  job.o = o;

  /* W ranks on one GPU, threads of this process (before anything touches CUDA here). */
  if (o.in_process > 0 && !o.what_if) {
    if (twb_gpus_present() < 1) {
      fprintf(stderr, "%s --in-process: no GPU found\n", cmd);
      free(job.points);
      return 1;
    }
    rc = sweep      ? twb_in_process_sweep(&o, job.points, job.npoints)
         : o.tp > 0 ? twb_in_process_tp(&o, job.points, job.npoints)
                    : twb_in_process(&o, job.points, job.npoints);
    free(job.points);
    return rc;
  }
  /* bench without the GPUs it needs (checked before anything forks or touches CUDA), or with
   * --what-if: the planner's choices for the same points instead. */
  int nranks = o.ranks;
  tw_launcher l;
  const int launched = tw__launcher_detect(&l);
  if (!sweep && (o.what_if || !launched)) {
    const int need = o.ranks ? o.ranks : 2;
    const int gpus = o.what_if ? -1 : twb_gpus_present();
    if (o.what_if || gpus < need) {
      char why[160];
      if (o.what_if)
        snprintf(why, sizeof why, "--what-if: no GPU is used");
      else if (gpus == 0)
        snprintf(why, sizeof why, "no GPU found");
      else
        snprintf(why, sizeof why, "%d GPU(s) found, the bench needs %d", gpus, need);
      rc = twb_what_if(&o, job.points, job.npoints, need, why);
      free(job.points);
      return rc;
    }
    if (nranks == 0) nranks = gpus;
  }
  if (nranks == 0) {
    if (launched) {
      nranks = l.nranks;
    } else {
      nranks = twb_gpus_present();
      if (nranks <= 0) {
        fprintf(stderr, "%s: no CUDA device found; this command needs GPUs\n", cmd);
        free(job.points);
        return 1;
      }
    }
  }
  const tw_status st = tw__run_ranks(nranks, twb_rank_main, &job, o.timeout_s);
  free(job.points);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "%s: %s: %s\n", cmd, tw_status_string(st), tw_last_error());
    return 1;
  }
  return 0;
}

int tw_cli_bench(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "gemm") == 0) {
    return tw_cli_bench_gemm(argc - 1, argv + 1); /* tools/bench_gemm.cu */
  }
  if (argc > 1 && strcmp(argv[1], "gemm1") == 0) {
    return tw_cli_bench_gemm1(argc - 1, argv + 1); /* tools/bench_gemm1.cu */
  }
  if (argc > 1 && strcmp(argv[1], "layer") == 0) {
    return tw_cli_bench_layer(argc - 1, argv + 1); /* tools/bench_layer.c */
  }
  if (argc > 1 && strcmp(argv[1], "dispatch") == 0) {
    return tw_cli_bench_dispatch(argc - 1, argv + 1); /* tools/bench_layer.c */
  }
  return twb_main(argc, argv, 0);
}

int tw_cli_sweep(int argc, char** argv) {
  return twb_main(argc, argv, 1);
}
