/*
 * cmd_plan.c: `tilewave plan`, the planner and resource model from the command line. It needs no
 * GPU: it builds (or replays) a routing, plans one rank or every rank, and shows the layout cost
 * (padding), the model's choice of consumer CTAs C and coalescing mgb, the predicted time of
 * every candidate, the sequential estimate and the time the decision took. --bench-solve times
 * the decision alone, for the expert-parallel model and for the first paper's tensor-parallel
 * form. With --tp T (and --ep E) it plans the tensor-parallel operator instead, GEMM2 + GatherRS
 * of a TP x EP world (tw_tp_plan_create): the TP configuration, the first paper's C for the
 * GatherRS with its predicted time, and the EP part's choice. Only the public API (tilewave.h) is
 * used, as an application would.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_stats.h"
#include "cli.h"
#include "core.h"
#include "cli_args.h"
#include "plan.h" /* the dataflow and schedule names, the dataflow the plans were predicted for */
#include "tilewave.h"

#define PLAN_MAX_MGB 4

typedef struct plan_opts {
  const char* model;
  int32_t hidden, ffn, experts, topk;
  int32_t tokens, gpus, rank, all_ranks;
  tw_router router;
  double router_param;
  const char* router_name;
  uint64_t seed;
  int32_t tile_m, tile_n, comm_ctas, coalesce;
  int32_t schedule; /* tw_schedule; 0 = TW_SCHEDULE env, else the model's choice */
  int32_t dataflow; /* tw_combine_dataflow; 0 = TW_COMBINE_DATAFLOW env, else reduce */
  const char* calibration;
  const char* routing_file;
  int json;
  int bench_solve; /* repetitions, 0 = off */
  int32_t tp, ep;  /* TP x EP mode when tp > 0 (ep resolved) */
  int32_t splits;  /* L of the GatherRS; 0 = the library's default */
} plan_opts;

static void plan_usage(FILE* f) {
  fprintf(f,
          "usage: tilewave plan [options]\n"
          "  --model NAME          preset (see --list-models), or give the shape with:\n"
          "  --hidden H --ffn F --experts E --topk K\n"
          "  --tokens T            tokens per rank (default 8192)\n"
          "  --ranks N             ranks, the world size (default 2; alias --gpus)\n"
          "  --router R            balanced | moderate_skew | stress_skew | target:RATIO "
          "(default balanced)\n"
          "  --seed S              routing seed (default 1)\n"
          "  --routing FILE        replay a routing file instead of generating one\n"
          "  --rank R              rank to show (default 0); --all-ranks shows every rank\n"
          "  --tile-m TM --tile-n TN   GEMM2 tile (default 128 x chosen from H)\n"
          "  --comm-ctas C --coalesce MGB   fix the partition instead of the model's choice\n"
          "  --schedule S          auto | remote-first | expert-major (default: TW_SCHEDULE, else "
          "auto)\n"
          "  --dataflow D          reduce | add: the combine dataflow predicted (default:\n"
          "                        TW_COMBINE_DATAFLOW, else reduce; add: top-1/2 only)\n"
          "  --tp T --ep E         plan the tensor-parallel operator (GEMM2 + GatherRS) of a\n"
          "                        TP x EP world: T ranks share each expert (F / T each), E\n"
          "                        groups split the experts; --ranks = T x E (give two of them)\n"
          "  --splits L            GatherRS column splits (default 2 where they divide);\n"
          "                        with --tp, --comm-ctas / --coalesce fix the EP part's C / mgb\n"
          "  --calibration FILE    hardware description (default: TW_CALIBRATION, else H200)\n"
          "  --json                machine-readable output\n"
          "  --bench-solve [N]     time the decision N times (default 200): median, p99\n"
          "  --list-models         list the presets\n");
}

static void plan_usage_cb(FILE* f, void* ctx) {
  (void)ctx;
  plan_usage(f);
}

static void list_models(void) {
  for (int p = 0; p < tw_preset_count(); p++) {
    tw_problem pr = TW_PROBLEM_INIT;
    if (tw_problem_preset(tw_preset_name(p), &pr) != TW_SUCCESS) continue;
    printf("%-22s hidden %5d  ffn %5d  experts %3d  top-k %d\n", tw_preset_name(p), pr.hidden,
           pr.ffn, pr.experts, pr.top_k);
  }
}

/* 0: parsed; 1: done (help or the model list printed); 2: usage error. */
static int parse_args(int argc, char** argv, plan_opts* o) {
  memset(o, 0, sizeof *o);
  o->tokens = 8192;
  o->gpus = 2;
  int64_t seed = 1;
  int list = 0;
  tw_cli_router router = {TW_ROUTER_BALANCED, 0.0, "balanced"};
  tw_cli_arg args[] = {
      tw__cli_string("--model", &o->model),
      tw__cli_hidden(&o->hidden),
      tw__cli_ffn(&o->ffn),
      tw__cli_experts(&o->experts),
      tw__cli_topk(&o->topk),
      tw__cli_tokens(&o->tokens),
      tw__cli_ranks(&o->gpus),
      tw__cli_router_arg(&router),
      tw__cli_seed(&seed),
      tw__cli_string("--routing", &o->routing_file),
      tw__cli_int("--rank", &o->rank, 0, TW_MAX_RANKS - 1),
      tw__cli_bool("--all-ranks", &o->all_ranks),
      tw__cli_tile_m(&o->tile_m),
      tw__cli_tile_n(&o->tile_n),
      tw__cli_comm_ctas(&o->comm_ctas),
      tw__cli_coalesce(&o->coalesce),
      tw__cli_schedule(&o->schedule),
      tw__cli_dataflow(&o->dataflow),
      tw__cli_string("--calibration", &o->calibration),
      tw__cli_json(&o->json),
      tw__cli_int("--bench-solve", &o->bench_solve, 1, 1000000),
      tw__cli_bool("--list-models", &list),
      tw__cli_tp(&o->tp),
      tw__cli_ep(&o->ep),
      tw__cli_splits(&o->splits),
  };
  const int nargs = (int)(sizeof args / sizeof args[0]);
  args[nargs - 5].has_optional = 1, args[nargs - 5].optional_value = 200;
  int rc = tw__cli_parse("tilewave plan", argc, argv, args, nargs, plan_usage_cb, NULL);
  if (rc != 0) return rc;
  if (list) {
    list_models();
    return 1;
  }
  o->seed = (uint64_t)seed;
  o->router = (tw_router)router.router;
  o->router_param = router.param;
  o->router_name = router.name;
  if (o->model == NULL && (o->hidden == 0 || o->ffn == 0 || o->experts == 0 || o->topk == 0))
    return tw__cli_usage_error(
        "tilewave plan",
        "no problem shape: give --model NAME, or all of --hidden, --ffn, --experts "
        "and --topk");
  /* TP x EP: the world is tp x ep; of --ranks, --tp and --ep any two decide the third. */
  int ranks_seen = 0;
  for (int i = 0; i < nargs; i++)
    if (args[i].dst == &o->gpus) ranks_seen = args[i].seen;
  if (o->tp == 0 && o->ep == 0 && o->splits != 0)
    return tw__cli_usage_error("tilewave plan", "--splits is the GatherRS's; give it with --tp T");
  if (o->tp != 0 || o->ep != 0) {
    if (o->tp == 0) o->tp = 1;
    if (o->ep != 0) {
      if (ranks_seen && o->gpus != o->tp * o->ep)
        return tw__cli_usage_error("tilewave plan",
                                   "--ranks %d but --tp %d x --ep %d = %d ranks; give two of the "
                                   "three (the world is tp x ep)",
                                   o->gpus, o->tp, o->ep, o->tp * o->ep);
      o->gpus = o->tp * o->ep;
    } else {
      if (!ranks_seen) o->gpus = o->tp;
      if (o->gpus % o->tp != 0)
        return tw__cli_usage_error("tilewave plan",
                                   "--ranks %d is not a multiple of --tp %d; give --ep E for a "
                                   "world of tp x ep ranks",
                                   o->gpus, o->tp);
      o->ep = o->gpus / o->tp;
    }
    if (o->gpus > TW_MAX_RANKS)
      return tw__cli_usage_error("tilewave plan", "--tp %d x --ep %d = %d ranks; at most %d", o->tp,
                                 o->ep, o->gpus, TW_MAX_RANKS);
    if (o->bench_solve)
      return tw__cli_usage_error("tilewave plan",
                                 "--bench-solve times the EP plan; leave out --tp / --ep");
  }
  if (o->rank >= o->gpus)
    return tw__cli_usage_error(
        "tilewave plan", "--rank %d must be below --ranks %d (ranks are 0..N-1)", o->rank, o->gpus);
  return 0;
}

/* A tilewave failure: name the status and the library's detail (which says what to change). */
static int plan_fail(const char* what, tw_status st) {
  fprintf(stderr, "tilewave plan: %s: %s\n  %s\n", what, tw_status_string(st), tw_last_error());
  return st == TW_ERR_NULL_POINTER || st == TW_ERR_OUT_OF_MEMORY || st == TW_ERR_IO ||
                 st == TW_ERR_INTERNAL
             ? 1
             : 2;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Median and 99th percentile of n samples (harness/bench_stats.h: interpolated); sorts them. */
static void med_p99(double* v, int n, double* med, double* p99) {
  *med = tw__stats_median(v, n);
  *p99 = tw__stats_percentile(v, n, 0.99);
}

typedef struct rank_result {
  tw_plan_summary s;
  int32_t layer_copy_ctas; /* tw_moe_layer's choice: the dispatch's copy CTAs beside GEMM1, 0:
                              before it (tw__model_copy_ctas, one rank per GPU) */
  int ncol;
  int32_t mgbs[PLAN_MAX_MGB];
  double* table; /* (c_max, ncol) predicted us */
} rank_result;

static tw_status plan_rank(const tw_problem* prob, tw_routing_t rt, int32_t rank,
                           const tw_plan_config* cfg, int32_t c_max, rank_result* out) {
  tw_plan_t plan = NULL;
  tw_status st = tw_plan_create(prob, rt, rank, cfg, &plan);
  if (st != TW_SUCCESS) return st;
  st = tw_plan_summary_get(plan, &out->s);
  /* The layer's dispatch: this rank's rows to its own experts and to the others'. */
  {
    int32_t n = 0;
    const int32_t* ids = NULL;
    tw_routing_rank(rt, rank, &n, &ids, NULL);
    const int32_t E = plan->local_experts;
    int64_t own = 0, sent = (int64_t)n * prob->top_k;
    for (int64_t i = 0; i < sent; i++) own += ids[i] / E == rank;
    tw_copy_model_in in;
    in.gemm1_flops = 4.0 * plan->rows * (double)prob->hidden * prob->ffn;
    in.weight_bytes = 4.0 * E * (double)prob->hidden * prob->ffn;
    in.local_bytes = 2.0 * prob->hidden * (double)own;
    in.remote_bytes = 2.0 * prob->hidden * (double)(sent - own);
    in.local_experts = E;
    in.budget = cfg != NULL && cfg->sm_budget > 0 ? cfg->sm_budget : plan->hardware.sm_count;
    in.ranks_per_gpu = 1;
    out->layer_copy_ctas = tw__model_copy_ctas(&plan->hardware, &in);
  }
  out->ncol = 0;
  const int32_t base[3] = {1, 2, 4};
  for (int i = 0; i < 3; i++) out->mgbs[out->ncol++] = base[i];
  if (out->s.coalesce != 1 && out->s.coalesce != 2 && out->s.coalesce != 4)
    out->mgbs[out->ncol++] = out->s.coalesce;
  out->table = malloc((size_t)c_max * (size_t)out->ncol * sizeof *out->table);
  if (out->table == NULL) st = TW_ERR_OUT_OF_MEMORY;
  for (int32_t c = 1; st == TW_SUCCESS && c <= c_max; c++)
    for (int j = 0; st == TW_SUCCESS && j < out->ncol; j++)
      st = tw_plan_predict(plan, c, out->mgbs[j], &out->table[(size_t)(c - 1) * out->ncol + j]);
  tw_plan_destroy(plan);
  return st;
}

/* Times the EP decision: each tw_plan_create runs it once and records its own duration. */
static tw_status bench_ep(const tw_problem* prob, tw_routing_t rt, int32_t rank,
                          const tw_plan_config* cfg, int n, double* med, double* p99) {
  double* v = malloc((size_t)n * sizeof *v);
  if (v == NULL) return TW_ERR_OUT_OF_MEMORY;
  tw_status st = TW_SUCCESS;
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    tw_plan_t plan = NULL;
    tw_plan_summary s;
    st = tw_plan_create(prob, rt, rank, cfg, &plan);
    if (st == TW_SUCCESS) st = tw_plan_summary_get(plan, &s);
    if (st == TW_SUCCESS) v[i] = s.solve_us;
    tw_plan_destroy(plan);
  }
  if (st == TW_SUCCESS) med_p99(v, n, med, p99);
  free(v);
  return st;
}

/* Times the first paper's selection (16 candidates) for the tensor-parallel form of the same
 * layer: M = all tokens, N = H, K = F / W (the TP shard), L = 2 splits, D = W ranks, every
 * expert local with its routed load. Calls are timed in batches of 64 so that the clock's own
 * cost (tens of ns) does not dominate; median and p99 are over batches. */
static tw_status bench_tp(const tw_problem* prob, tw_routing_t rt, const tw_hardware* hw0, int n,
                          double* med, double* p99, int32_t* best_c, int32_t* candidates) {
  int64_t* loads = malloc((size_t)prob->experts * sizeof *loads);
  double* v = malloc((size_t)n * sizeof *v);
  tw_status st = (loads && v) ? TW_SUCCESS : TW_ERR_OUT_OF_MEMORY;
  tw_routing_stats rs;
  if (st == TW_SUCCESS) st = tw_routing_expert_loads(rt, loads);
  if (st == TW_SUCCESS) st = tw_routing_stats_get(rt, &rs);
  tw_hardware hw = *hw0;
  /* The first paper's 16 candidates, fewer where the machine leaves the producer no SM. */
  const int32_t c_fit = (hw.sm_count - 1) * hw.occ_comm;
  hw.c_max = c_fit < 16 ? c_fit : 16;
  *candidates = hw.c_max;
  tw_tp_workload w = {0};
  w.m = rs.total_tokens > 0 ? rs.total_tokens : 1;
  w.n = prob->hidden;
  w.k = prob->ffn / prob->world_size > 0 ? prob->ffn / prob->world_size : 1;
  w.splits = 2;
  w.ranks = prob->world_size;
  w.experts = prob->experts;
  w.expert_rows = loads;
  w.tm = w.tn = w.tm_comm = w.tn_comm = 128;
  enum { BATCH = 64 };
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    double t0 = now_s();
    for (int b = 0; b < BATCH && st == TW_SUCCESS; b++) st = tw_tp_select(&w, &hw, best_c, NULL);
    v[i] = 1e6 * (now_s() - t0) / BATCH;
  }
  if (st == TW_SUCCESS) med_p99(v, n, med, p99);
  free(v);
  free(loads);
  return st;
}

static void print_problem(const plan_opts* o, const tw_problem* p) {
  printf("problem: %s: H %d, F %d, %d experts, top-%d; %d ranks; ", o->model ? o->model : "custom",
         p->hidden, p->ffn, p->experts, p->top_k, p->world_size);
  if (o->routing_file)
    printf("routing replayed from %s", o->routing_file);
  else
    printf("%d tokens/rank, router %s, seed %llu", o->tokens, o->router_name,
           (unsigned long long)o->seed);
  printf("; tile %d x ", p->tile_m ? p->tile_m : 128);
  if (p->tile_n)
    printf("%d\n", p->tile_n);
  else
    printf("auto (%d)\n", p->hidden >= 2048 ? 256 : 128);
}

/* What tw_cli_plan computed, for its two printers. */
typedef struct plan_out {
  const plan_opts* o;
  tw_problem prob;
  tw_hardware hw;
  const char* calib; /* the calibration file read, or NULL */
  tw_routing_stats rs;
  const int64_t* rank_rows;
  const rank_result* res; /* (nr) ranks r0.. */
  int32_t nr, r0;
  const char* dataflow_name;
  double ep_med, ep_p99, tp_med, tp_p99; /* --bench-solve */
  int32_t tp_c, tp_n;
} plan_out;

static void print_json(const plan_out* p) {
  const plan_opts* o = p->o;
  printf("{\"problem\": {\"model\": ");
  tw__json_str(stdout, o->model ? o->model : "custom");
  printf(
      ", \"hidden\": %d, \"ffn\": %d, \"experts\": %d, "
      "\"top_k\": %d, \"world_size\": %d, \"dataflow\": \"%s\", ",
      p->prob.hidden, p->prob.ffn, p->prob.experts, p->prob.top_k, p->prob.world_size,
      p->dataflow_name);
  /* A replayed routing has its own token counts; router and seed do not apply. */
  if (o->routing_file)
    printf("\"tokens_per_rank\": null, \"router\": null, \"seed\": null, ");
  else {
    printf("\"tokens_per_rank\": %d, \"router\": ", o->tokens);
    tw__json_str(stdout, o->router_name);
    printf(", \"seed\": %llu, ", (unsigned long long)o->seed);
  }
  printf("\"routing_file\": ");
  tw__json_str(stdout, o->routing_file);
  printf("},\n");
  printf(
      " \"routing\": {\"r_expert\": %.6f, \"total_tokens\": %lld, \"max_expert_load\": %lld, "
      "\"min_expert_load\": %lld, \"rows_per_rank\": [",
      p->rs.r_expert, (long long)p->rs.total_tokens, (long long)p->rs.max_expert_load,
      (long long)p->rs.min_expert_load);
  for (int32_t r = 0; r < p->prob.world_size; r++)
    printf("%s%lld", r ? ", " : "", (long long)p->rank_rows[r]);
  printf("]},\n \"hardware\": {\"sm_count\": %d, \"c_max\": %d, \"calibration\": ", p->hw.sm_count,
         p->hw.c_max);
  tw__json_str(stdout, p->calib);
  printf("},\n");
  printf(" \"ranks\": [");
  for (int32_t i = 0; i < p->nr; i++) {
    const rank_result* x = &p->res[i];
    const tw_plan_summary* s = &x->s;
    const int64_t real = s->rows - s->padding_rows;
    printf(
        "%s\n  {\"rank\": %d, \"rows\": %lld, \"padding_rows\": %lld, \"padding_pct\": %.4f, "
        "\"tiles\": %lld, \"remote_tiles\": %lld, \"bands\": %lld, \"segments\": %lld, "
        "\"send_bytes\": %lld, \"comm_ctas\": %d, \"coalesce\": %d, \"predicted_us\": %.6f, "
        "\"sequential_us\": %.6f, \"speedup\": %.6f, \"solve_us\": %.6f, \"schedule\": \"%s\", "
        "\"gemm_us\": %.6f, \"layer_dispatch_ctas\": %d,\n   \"mgb\": [",
        i ? "," : "", s->rank, (long long)s->rows, (long long)s->padding_rows,
        real > 0 ? 100.0 * (double)s->padding_rows / (double)real : 0.0, (long long)s->tiles,
        (long long)s->remote_tiles, (long long)s->bands, (long long)s->segments,
        (long long)s->send_bytes, s->comm_ctas, s->coalesce, s->predicted_us, s->sequential_us,
        s->predicted_us > 0 ? s->sequential_us / s->predicted_us : 0.0, s->solve_us,
        tw__cli_schedule_name(s->schedule), s->gemm_us, x->layer_copy_ctas);
    for (int j = 0; j < x->ncol; j++) printf("%s%d", j ? ", " : "", x->mgbs[j]);
    printf("], \"predicted_us_by_c\": [");
    for (int32_t c = 0; c < p->hw.c_max; c++) {
      printf("%s[", c ? ", " : "");
      for (int j = 0; j < x->ncol; j++)
        printf("%s%.6f", j ? ", " : "", x->table[(size_t)c * x->ncol + j]);
      printf("]");
    }
    printf("]}");
  }
  printf("]");
  if (o->bench_solve > 0)
    printf(
        ",\n \"bench_solve\": {\"repetitions\": %d, \"ep_median_us\": %.6f, \"ep_p99_us\": "
        "%.6f, \"tp_candidates\": 16, \"tp_median_us\": %.6f, \"tp_p99_us\": %.6f, "
        "\"tp_choice\": %d}",
        o->bench_solve, p->ep_med, p->ep_p99, p->tp_med, p->tp_p99, p->tp_c);
  printf("}\n");
}

static void print_text(const plan_out* p) {
  const plan_opts* o = p->o;
  print_problem(o, &p->prob);
  printf("routing: R_expert %.3f, expert load max %lld min %lld (fair %.1f), rows per rank:",
         p->rs.r_expert, (long long)p->rs.max_expert_load, (long long)p->rs.min_expert_load,
         (double)p->rs.total_tokens * p->prob.top_k / p->prob.experts);
  for (int32_t r = 0; r < p->prob.world_size && r < 16; r++)
    printf(" %lld", (long long)p->rank_rows[r]);
  printf("%s\n", p->prob.world_size > 16 ? " ..." : "");
  printf("hardware: %s (G %d, c_max %d); combine dataflow: %s\n",
         p->calib ? p->calib : "built-in H200", p->hw.sm_count, p->hw.c_max, p->dataflow_name);
  for (int32_t i = 0; i < p->nr; i++) {
    const rank_result* x = &p->res[i];
    const tw_plan_summary* s = &x->s;
    const int64_t real = s->rows - s->padding_rows;
    printf(
        "\nrank %d: rows %lld (padding %lld, %.2f%% over %lld routed), tiles %lld (%lld "
        "remote), bands %lld, segments %lld, sends %.3f MB\n",
        s->rank, (long long)s->rows, (long long)s->padding_rows,
        real > 0 ? 100.0 * (double)s->padding_rows / (double)real : 0.0, (long long)real,
        (long long)s->tiles, (long long)s->remote_tiles, (long long)s->bands,
        (long long)s->segments, (double)s->send_bytes / 1e6);
    printf(
        "choice: C = %d consumer CTAs, mgb = %d%s; predicted %.2f us, sequential %.2f us, "
        "speedup %.3fx; decided in %.3f us\n",
        s->comm_ctas, s->coalesce,
        (o->comm_ctas || o->coalesce) ? " (partly or fully fixed by flags)" : "", s->predicted_us,
        s->sequential_us, s->predicted_us > 0 ? s->sequential_us / s->predicted_us : 0.0,
        s->solve_us);
    printf("schedule: %s%s; GEMM alone on all SMs %.2f us (model)\n",
           tw__cli_schedule_name(s->schedule), o->schedule ? " (fixed by --schedule)" : "",
           s->gemm_us);
    if (x->layer_copy_ctas > 0)
      printf(
          "layer (tw_moe_layer, a GPU per rank): GEMM1 beside the dispatch, its copy on %d CTAs\n",
          x->layer_copy_ctas);
    else
      printf(
          "layer (tw_moe_layer, a GPU per rank): the dispatch before GEMM1 (overlap not "
          "predicted 5%% faster)\n");
    printf("predicted T (us), C rows x mgb columns, * = choice:\n    C");
    for (int j = 0; j < x->ncol; j++) printf("     mgb %-3d", x->mgbs[j]);
    printf("\n");
    for (int32_t c = 1; c <= p->hw.c_max; c++) {
      printf("  %3d", c);
      for (int j = 0; j < x->ncol; j++) {
        int mark = c == s->comm_ctas && x->mgbs[j] == s->coalesce;
        printf("  %10.2f%c", x->table[(size_t)(c - 1) * x->ncol + j], mark ? '*' : ' ');
      }
      printf("\n");
    }
  }
  if (o->bench_solve > 0) {
    printf("\nsolve time per decision, %d repetitions:\n", o->bench_solve);
    printf("  EP model (rank %d, C 1..%d x mgb {1,2,4}): median %.3f us, p99 %.3f us\n", p->r0,
           p->hw.c_max, p->ep_med, p->ep_p99);
    printf(
        "  TP model (first paper, %d candidates, L 2): median %.3f us, p99 %.3f us (C* %d; "
        "batches of 64 calls)\n",
        p->tp_n, p->tp_med, p->tp_p99, p->tp_c);
  }
}

/* ---- TP x EP: `tilewave plan --tp T --ep E` ------------------------------------------------ */

static void print_tp_json(const plan_opts* o, const tw_problem* p, const tw_parallel* par,
                          const tw_hardware* hw, const char* calib, const tw_tp_plan_summary* s,
                          int32_t n) {
  printf("{\"problem\": {\"model\": ");
  tw__json_str(stdout, o->model ? o->model : "custom");
  printf(", \"hidden\": %d, \"ffn\": %d, \"experts\": %d, \"top_k\": %d, \"world_size\": %d, ",
         p->hidden, p->ffn, p->experts, p->top_k, p->world_size);
  if (o->routing_file)
    printf("\"tokens_per_rank\": null, \"router\": null, \"seed\": null, ");
  else {
    printf("\"tokens_per_rank\": %d, \"router\": ", o->tokens);
    tw__json_str(stdout, o->router_name);
    printf(", \"seed\": %llu, ", (unsigned long long)o->seed);
  }
  printf("\"routing_file\": ");
  tw__json_str(stdout, o->routing_file);
  printf(
      "},\n \"parallel\": {\"tp\": %d, \"ep\": %d, \"ffn_slice\": %d, \"local_experts\": %d, "
      "\"splits\": %d, \"comm_tile_m\": %d, \"comm_tile_n\": %d},\n",
      par->tp, par->ep, s[0].ffn_slice, s[0].local_experts, s[0].splits, s[0].comm_tile_m,
      s[0].comm_tile_n);
  printf(" \"hardware\": {\"sm_count\": %d, \"c_max\": %d, \"calibration\": ", hw->sm_count,
         hw->c_max);
  tw__json_str(stdout, calib);
  printf("},\n \"ranks\": [");
  for (int32_t i = 0; i < n; i++) {
    const tw_tp_plan_summary* x = &s[i];
    printf(
        "%s\n  {\"rank\": %d, \"group\": %d, \"tp_index\": %d, \"rows\": %lld, "
        "\"padding_rows\": %lld, \"bands\": %lld, \"tiles\": %lld, \"tiles_per_split\": %lld, "
        "\"reduce_rows\": %lld, \"comm_tiles_per_split\": %lld, \"reduce_read_bytes\": %lld,\n"
        "   \"tp\": {\"comm_ctas\": %d, \"predicted_waves\": %.6f, \"wave_us\": %.6f, "
        "\"predicted_us\": %.6f},\n"
        "   \"ep\": {\"comm_ctas\": %d, \"coalesce\": %d, \"send_bytes\": %lld, "
        "\"predicted_us\": %.6f}, \"solve_us\": %.6f}",
        i ? "," : "", x->rank, x->group, x->tp_index, (long long)x->rows,
        (long long)x->padding_rows, (long long)x->bands, (long long)x->tiles,
        (long long)x->tiles_per_split, (long long)x->reduce_rows,
        (long long)x->comm_tiles_per_split, (long long)x->reduce_read_bytes, x->tp_comm_ctas,
        x->tp_predicted_waves, x->tp_wave_us, x->tp_predicted_us, x->ep_comm_ctas, x->ep_coalesce,
        (long long)x->ep_send_bytes, x->ep_predicted_us, x->solve_us);
  }
  printf("]}\n");
}

static void print_tp_text(const plan_opts* o, const tw_problem* p, const tw_parallel* par,
                          const tw_hardware* hw, const char* calib, const tw_tp_plan_summary* s,
                          int32_t n) {
  print_problem(o, p);
  const tw_tp_plan_summary* a = &s[0];
  printf(
      "TP x EP: tp %d x ep %d = %d ranks (rank = group x %d + TP index); each EP group holds "
      "%d experts, each rank the F slice %d of %d of every one of them\n",
      par->tp, par->ep, p->world_size, par->tp, a->local_experts, a->ffn_slice, p->ffn);
  printf(
      "GatherRS: L = %d splits of the %d columns, tiles %d x %d; hardware: %s (G %d, c_max "
      "%d)\n",
      a->splits, p->hidden, a->comm_tile_m, a->comm_tile_n, calib ? calib : "built-in H200",
      hw->sm_count, hw->c_max);
  for (int32_t i = 0; i < n; i++) {
    const tw_tp_plan_summary* x = &s[i];
    printf(
        "\nrank %d (group %d, TP index %d): rows %lld (padding %lld) in %d blocks, bands %lld, "
        "tiles %lld (%lld per split)\n",
        x->rank, x->group, x->tp_index, (long long)x->rows, (long long)x->padding_rows, x->tp,
        (long long)x->bands, (long long)x->tiles, (long long)x->tiles_per_split);
    if (x->tp > 1)
      printf(
          "  TP part (first paper's model, tw_tp_select): C = %d GatherRS CTAs; T = %.3f waves "
          "x %.3f us = %.2f us; reduces %lld rows (%lld tiles per split), reads %.3f MB from "
          "%d TP peer%s\n",
          x->tp_comm_ctas, x->tp_predicted_waves, x->tp_wave_us, x->tp_predicted_us,
          (long long)x->reduce_rows, (long long)x->comm_tiles_per_split,
          (double)x->reduce_read_bytes / 1e6, x->tp - 1, x->tp > 2 ? "s" : "");
    else
      printf("  TP part: none (tp = 1: every row is whole on its rank)\n");
    if (x->ep > 1)
      printf(
          "  EP part (our model, tw_plan_create): C = %d, mgb = %d; predicted %.2f us, sends "
          "%.3f MB to owners in other groups\n",
          x->ep_comm_ctas, x->ep_coalesce, x->ep_predicted_us, (double)x->ep_send_bytes / 1e6);
    else
      printf("  EP part: none (ep = 1: every reduced row is its reducer's own token)\n");
    printf("  planned in %.3f us (layouts and both decisions)\n", x->solve_us);
  }
}

/* Plans every asked rank of the TP x EP world of `prob` (world_size set here). */
static int plan_tp_main(const plan_opts* o, tw_problem* prob, const tw_hardware* hw,
                        const char* calib, const tw_plan_config* cfg) {
  tw_parallel par = TW_PARALLEL_INIT;
  par.tp = o->tp;
  par.ep = o->ep;
  par.splits = o->splits;
  tw_status st = tw_parallel_validate(prob, &par);
  if (st != TW_SUCCESS)
    return tw__cli_usage_error("tilewave plan", "--tp %d --ep %d: %s", o->tp, o->ep,
                               tw_last_error());
  tw_routing_t rt = NULL;
  if (o->routing_file)
    st = tw_routing_read(prob, o->routing_file, &rt);
  else
    st = tw_routing_generate(prob, o->router, o->router_param, o->tokens, o->seed, &rt);
  if (st != TW_SUCCESS) {
    if (prob->experts % prob->world_size != 0)
      return tw__cli_usage_error("tilewave plan",
                                 "--tp %d --ep %d: routings are still built over the world's "
                                 "ranks and need experts (%d) divisible by tp x ep (%d); choose "
                                 "a world that divides them",
                                 o->tp, o->ep, prob->experts, prob->world_size);
    return plan_fail("building the routing", st);
  }
  const int32_t r0 = o->all_ranks ? 0 : o->rank;
  const int32_t r1 = o->all_ranks ? prob->world_size - 1 : o->rank;
  const int32_t n = r1 - r0 + 1;
  tw_tp_plan_summary* s = calloc((size_t)n, sizeof *s);
  if (s == NULL) st = TW_ERR_OUT_OF_MEMORY;
  for (int32_t r = r0; st == TW_SUCCESS && r <= r1; r++) {
    tw_tp_plan_t plan = NULL;
    st = tw_tp_plan_create(prob, &par, rt, r, cfg, &plan);
    tw_tp_plan_summary x = TW_TP_PLAN_SUMMARY_INIT;
    if (st == TW_SUCCESS) st = tw_tp_plan_summary_get(plan, &x);
    s[r - r0] = x;
    tw_tp_plan_destroy(plan);
  }
  int rc = 0;
  if (st != TW_SUCCESS)
    rc = plan_fail("planning", st);
  else {
    par.ep = s[0].ep;
    if (o->json)
      print_tp_json(o, prob, &par, hw, calib, s, n);
    else
      print_tp_text(o, prob, &par, hw, calib, s, n);
  }
  free(s);
  tw_routing_destroy(rt);
  return rc;
}

int tw_cli_plan(int argc, char** argv) {
  plan_opts o;
  int rc = parse_args(argc, argv, &o);
  if (rc != 0) return rc == 1 ? 0 : rc;

  tw_problem prob = TW_PROBLEM_INIT;
  tw_status st;
  if (o.model != NULL) {
    st = tw_problem_preset(o.model, &prob);
    if (st != TW_SUCCESS)
      return tw__cli_usage_error(
          "tilewave plan", "--model: '%s' is not a preset; tilewave plan --list-models lists them",
          o.model);
  }
  if (o.hidden) prob.hidden = o.hidden;
  if (o.ffn) prob.ffn = o.ffn;
  if (o.experts) prob.experts = o.experts;
  if (o.topk) prob.top_k = o.topk;
  prob.world_size = o.gpus;
  prob.max_tokens = o.tokens;
  prob.tile_m = o.tile_m;
  prob.tile_n = o.tile_n;
  /* A TP x EP problem divides its experts by ep, not by the world: tw_parallel_validate checks
   * it (below, once the hardware is known). */
  st = o.tp > 0 ? TW_SUCCESS : tw_problem_validate(&prob);
  if (st != TW_SUCCESS) return plan_fail("invalid problem", st);

  /* The hardware the plans use, resolved here so that the table spans its c_max. */
  tw_hardware hw;
  const char* calib = o.calibration ? o.calibration : tw__tunable_string(TW_TUNE_CALIBRATION);
  if (calib != NULL && calib[0] != '\0') {
    st = tw_hardware_read(calib, &hw);
    if (st != TW_SUCCESS) return plan_fail("reading the hardware description", st);
  } else {
    tw_hardware_default(&hw);
  }
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.hardware = &hw;
  cfg.comm_ctas = o.comm_ctas;
  cfg.coalesce = o.coalesce;
  cfg.schedule = o.schedule;
  cfg.dataflow = o.dataflow;

  if (o.tp > 0) return plan_tp_main(&o, &prob, &hw, calib, &cfg);

  tw_routing_t rt = NULL;
  if (o.routing_file)
    st = tw_routing_read(&prob, o.routing_file, &rt);
  else
    st = tw_routing_generate(&prob, o.router, o.router_param, o.tokens, o.seed, &rt);
  if (st != TW_SUCCESS) return plan_fail("building the routing", st);
  const int32_t r0 = o.all_ranks ? 0 : o.rank;
  const int32_t r1 = o.all_ranks ? prob.world_size - 1 : o.rank;
  const int32_t nr = r1 - r0 + 1;
  tw_routing_stats rs;
  int64_t* loads = malloc((size_t)prob.experts * sizeof *loads);
  int64_t* rank_rows = calloc((size_t)prob.world_size, sizeof *rank_rows);
  rank_result* res = calloc((size_t)nr, sizeof *res);
  if (loads == NULL || rank_rows == NULL || res == NULL) {
    rc = plan_fail("allocating the tables", TW_ERR_OUT_OF_MEMORY);
    goto done;
  }
  st = tw_routing_stats_get(rt, &rs);
  if (st == TW_SUCCESS) st = tw_routing_expert_loads(rt, loads);
  if (st != TW_SUCCESS) {
    rc = plan_fail("routing statistics", st);
    goto done;
  }
  /* Expert e lives on rank e / (experts / W). */
  const int32_t el = prob.experts / prob.world_size;
  for (int32_t e = 0; e < prob.experts; e++) rank_rows[e / el] += loads[e];

  for (int32_t r = r0; st == TW_SUCCESS && r <= r1; r++)
    st = plan_rank(&prob, rt, r, &cfg, hw.c_max, &res[r - r0]);
  double ep_med = 0, ep_p99 = 0, tp_med = 0, tp_p99 = 0;
  int32_t tp_c = 0, tp_n = 0;
  if (st == TW_SUCCESS && o.bench_solve > 0) {
    st = bench_ep(&prob, rt, r0, &cfg, o.bench_solve, &ep_med, &ep_p99);
    if (st == TW_SUCCESS)
      st = bench_tp(&prob, rt, &hw, o.bench_solve, &tp_med, &tp_p99, &tp_c, &tp_n);
  }
  if (st != TW_SUCCESS) {
    rc = plan_fail("planning", st);
    goto done;
  }

  plan_out out = {&o, prob, hw,     calib,  rs,     rank_rows, res,  nr,
                  r0, NULL, ep_med, ep_p99, tp_med, tp_p99,    tp_c, tp_n};
  int32_t dataflow = TW_DATAFLOW_REDUCE; /* resolved as tw_plan_create did (it succeeded) */
  tw__dataflow_resolve("tilewave plan", o.dataflow, &dataflow);
  out.dataflow_name = tw__dataflow_name(dataflow);
  if (o.json)
    print_json(&out);
  else
    print_text(&out);
  rc = 0;
done:
  if (res)
    for (int32_t i = 0; i < nr; i++) free(res[i].table);
  free(res);
  free(rank_rows);
  free(loads);
  tw_routing_destroy(rt);
  return rc;
}
