/*
 * bench_what_if.c: `tilewave bench` on a machine without the GPUs it needs (or with --what-if):
 * the same points planned on the host, with the choice `tilewave plan` would show for each
 * (consumer CTAs C, coalescing mgb, schedule, predicted and sequential time) and the slowest
 * rank's prediction, which bounds the call. Nothing is measured and no GPU is touched.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_stats.h"
#include "cli.h"
#include "core.h"
#include "plan.h"
#include "tilewave.h"

typedef struct twb_wi_row {
  tw_problem problem;
  tw_plan_summary s; /* rank 0 */
  double slowest_us; /* the largest prediction over the ranks */
  int slowest_rank;
} twb_wi_row;

/* Plans every rank of one point as the bench would set it up (twb_setup) and fills *row. */
static tw_status twb_wi_point(const twb_opts* o, const twb_point* pt, int world, twb_wi_row* row) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = world;
  p.hidden = pt->hidden;
  p.ffn = pt->ffn;
  p.experts = pt->experts;
  p.top_k = pt->topk;
  p.max_tokens = pt->tokens;
  p.tile_m = o->tile_m;
  p.tile_n = o->tile_n;
  TW_TRY(tw_problem_validate(&p));
  tw_routing_t rt = NULL;
  tw_status st;
  if (o->routing_file) {
    tw_problem big = p;
    big.max_tokens = 1 << 20;
    st = tw_routing_read(&big, o->routing_file, &rt);
    p.max_tokens = 1;
    for (int r = 0; st == TW_SUCCESS && r < world; r++) {
      int32_t n = 0;
      const int32_t* ids = NULL;
      const float* w = NULL;
      st = tw_routing_rank(rt, r, &n, &ids, &w);
      if (n > p.max_tokens) p.max_tokens = n;
    }
  } else {
    st = tw_routing_generate(&p, (tw_router)pt->router, pt->router_param, pt->tokens, o->seed, &rt);
  }
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = o->comm_ctas;
  cfg.coalesce = o->coalesce;
  row->problem = p;
  row->slowest_us = -1;
  for (int r = 0; st == TW_SUCCESS && r < world; r++) {
    tw_plan_t plan = NULL;
    tw_plan_summary sum;
    st = tw_plan_create(&p, rt, r, &cfg, &plan);
    if (st == TW_SUCCESS) st = tw_plan_summary_get(plan, &sum);
    tw_plan_destroy(plan);
    if (st != TW_SUCCESS) break;
    if (r == 0) row->s = sum;
    if (sum.predicted_us > row->slowest_us)
      row->slowest_us = sum.predicted_us, row->slowest_rank = r;
  }
  tw_routing_destroy(rt);
  return st;
}

static void twb_wi_json(const twb_opts* o, const twb_point* pt, const twb_wi_row* w, int first) {
  const tw_plan_summary* s = &w->s;
  printf(
      "%s  {\"tokens_per_rank\": %d, \"ffn\": %d, \"hidden\": %d, \"experts\": %d, \"top_k\": %d, "
      "\"router\": ",
      first ? "" : ",\n", pt->tokens, w->problem.ffn, w->problem.hidden, w->problem.experts,
      w->problem.top_k);
  tw__json_str(stdout, o->routing_file ? NULL : tw__cli_router_name(pt->router));
  printf(", \"comm_ctas\": %d, \"coalesce\": %d, \"schedule\": ", s->comm_ctas, s->coalesce);
  tw__json_str(stdout, tw__cli_schedule_name(s->schedule));
  printf(", \"predicted_us\": ");
  tw__json_num(stdout, "%.3f", s->predicted_us);
  printf(", \"sequential_us\": ");
  tw__json_num(stdout, "%.3f", s->sequential_us);
  printf(", \"slowest_rank\": %d, \"slowest_predicted_us\": ", w->slowest_rank);
  tw__json_num(stdout, "%.3f", w->slowest_us);
  printf("}");
}

int twb_what_if(const twb_opts* o, const twb_point* pts, int n, int world, const char* why) {
  /* The one line that says why nothing is measured (stdout, so that it stays with the table). */
  printf(
      "tilewave bench: %s; the planner's what-if for the same points instead (rank 0 of %d "
      "ranks, nothing measured)\n",
      why, world);
  if (o->json) {
    printf("{\"command\": \"bench_what_if\", \"reason\": ");
    tw__json_str(stdout, why);
    printf(", \"world_size\": %d, \"points\": [\n", world);
  } else {
    printf(
        "| tokens/rank | K | N | E | top-k | router | C | mgb | schedule | predicted us | "
        "sequential us | speedup | slowest rank: predicted us |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  }
  for (int i = 0; i < n; i++) {
    twb_wi_row w;
    memset(&w, 0, sizeof w);
    const tw_status st = twb_wi_point(o, &pts[i], world, &w);
    if (st != TW_SUCCESS) {
      if (o->json) printf("\n]}\n");
      fflush(stdout);
      fprintf(stderr, "tilewave bench: point %d: %s: %s\n", i + 1, tw_status_string(st),
              tw_last_error());
      return st == TW_ERR_OUT_OF_MEMORY || st == TW_ERR_IO || st == TW_ERR_INTERNAL ? 1 : 2;
    }
    const tw_plan_summary* s = &w.s;
    if (o->json) {
      twb_wi_json(o, &pts[i], &w, i == 0);
      continue;
    }
    printf(
        "| %d | %d | %d | %d | %d | %s | %d | %d | %s | %.1f | %.1f | %.2fx | %.1f (rank %d) |\n",
        pts[i].tokens, w.problem.ffn, w.problem.hidden, w.problem.experts, w.problem.top_k,
        o->routing_file ? "replayed" : tw__cli_router_name(pts[i].router), s->comm_ctas,
        s->coalesce, tw__cli_schedule_name(s->schedule), s->predicted_us, s->sequential_us,
        s->predicted_us > 0 ? s->sequential_us / s->predicted_us : 0.0, w.slowest_us,
        w.slowest_rank);
  }
  if (o->json) printf("\n]}\n");
  fflush(stdout);
  return 0;
}
