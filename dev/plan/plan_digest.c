/*
 * plan_digest.c: one line per plan of a fixed pseudo-random set, so that two builds of the
 * planner can be compared line by line (dev/plan/identity.sh does so against a base commit).
 *
 * Every line is a plan's inputs (problem, router, rank, schedule request, dataflow, tile group,
 * config), an FNV-1a 64 digest of its layout (expert rows, row_src), tile list, bands, layout
 * bands, segments, slot_row, recv_bands and streams, and its summary fields (comm_ctas,
 * coalesce, schedule, predicted / sequential / GEMM time with %.17g, the model's traffic and a few
 * tw_plan_predict points). A plan that fails prints its status and message instead. The set is the
 * same on every run (fixed seed; argv[1] overrides the number of problems). Host only: builds
 * against the planner's sources (tilewave_host) and reads only fields that the plan struct has
 * had since the base of the restructuring.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "tilewave.h"

static uint64_t rng_state = 0x7113a7e5eedULL;
static uint64_t rng_next(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static int32_t rng_in(int32_t lo, int32_t hi) { /* [lo, hi] */
  return lo + (int32_t)(rng_next() % (uint64_t)(hi - lo + 1));
}

typedef struct digest {
  uint64_t h;
} digest;
static void dg_bytes(digest* d, const void* p, size_t n) {
  const unsigned char* b = (const unsigned char*)p;
  for (size_t i = 0; i < n; i++) {
    d->h ^= b[i];
    d->h *= 0x100000001b3ULL;
  }
}
static void dg_i64(digest* d, int64_t v) {
  dg_bytes(d, &v, sizeof v);
}
static void dg_i32s(digest* d, const int32_t* a, int64_t n) {
  dg_i64(d, a ? n : -1);
  for (int64_t i = 0; a && i < n; i++) dg_i64(d, a[i]);
}
static void dg_bands(digest* d, const tw_band* b, int64_t n) {
  dg_i64(d, b ? n : -1);
  for (int64_t i = 0; b && i < n; i++) {
    dg_i64(d, b[i].expert);
    dg_i64(d, b[i].row0);
    dg_i64(d, b[i].rows);
    dg_i64(d, b[i].valid_rows);
    dg_i64(d, b[i].dest);
    dg_i64(d, b[i].segment);
    dg_i64(d, b[i].dest_offset);
  }
}

static uint64_t plan_digest(const struct tw_plan* pl, const struct tw_routing* rt) {
  digest d = {0xcbf29ce484222325ULL};
  const int32_t E = pl->local_experts, W = pl->problem.world_size;
  dg_i64(&d, pl->rows);
  dg_i64(&d, pl->tm);
  dg_i64(&d, pl->tn);
  dg_i64(&d, pl->col_tiles);
  dg_i32s(&d, pl->expert_row0, E);
  dg_i32s(&d, pl->expert_rows, E);
  dg_i32s(&d, pl->expert_real_rows, E);
  dg_i32s(&d, pl->expert_order, E);
  for (int32_t i = 0; i < pl->rows; i++) {
    dg_i64(&d, pl->row_src[i].owner);
    dg_i64(&d, pl->row_src[i].token);
    dg_i64(&d, pl->row_src[i].slot);
  }
  dg_i64(&d, pl->num_tiles);
  dg_i64(&d, pl->num_remote_tiles);
  for (int32_t i = 0; i < pl->num_tiles; i++) {
    const tw_tile* t = &pl->tiles[i];
    dg_i64(&d, t->row0);
    dg_i64(&d, t->rows);
    dg_i64(&d, t->expert);
    dg_i64(&d, t->col0);
    dg_i64(&d, t->band);
  }
  dg_bands(&d, pl->bands, pl->num_bands);
  dg_bands(&d, pl->layout_bands, pl->num_bands);
  dg_i32s(&d, pl->expert_band0, pl->expert_band0 ? E + 1 : 0);
  dg_i32s(&d, pl->expert_local_band0, E);
  dg_i64(&d, pl->num_segments);
  for (int32_t i = 0; i < pl->num_segments; i++) {
    const tw_segment* s = &pl->segments[i];
    dg_i64(&d, s->band0);
    dg_i64(&d, s->nbands);
    dg_i64(&d, s->dest);
    dg_i64(&d, s->src_row0);
    dg_i64(&d, s->valid_rows);
    dg_i64(&d, s->ready_tiles);
    dg_i64(&d, s->dest_offset);
  }
  dg_i64(&d, pl->send_bytes);
  dg_i64(&d, pl->recv_rows);
  dg_i32s(&d, pl->slot_row, (int64_t)rt->tokens[pl->rank] * pl->problem.top_k);
  dg_i32s(&d, pl->recv_bands, W);
  dg_i32s(&d, pl->stream_first, W);
  dg_i32s(&d, pl->stream_last, W);
  return d.h;
}

static const char* router_name(int r) {
  return r == TW_ROUTER_BALANCED        ? "balanced"
         : r == TW_ROUTER_MODERATE_SKEW ? "moderate"
         : r == TW_ROUTER_STRESS_SKEW   ? "stress"
                                        : "uneven";
}

/* A routing whose ranks hold different token counts (0 and 1 among them), uniform experts. */
static tw_status uneven_routing(const tw_problem* p, tw_routing_t* rt) {
  int32_t tokens[64];
  int32_t* ids[64];
  float* w[64];
  const int32_t K = p->top_k;
  for (int32_t r = 0; r < p->world_size; r++) {
    const int32_t pick = rng_in(0, 3);
    tokens[r] = pick == 0 ? 0 : pick == 1 ? 1 : rng_in(0, p->max_tokens);
    ids[r] = (int32_t*)malloc(sizeof(int32_t) * ((size_t)tokens[r] * K + 1));
    w[r] = (float*)malloc(sizeof(float) * ((size_t)tokens[r] * K + 1));
    for (int32_t t = 0; t < tokens[r]; t++) {
      for (int32_t k = 0; k < K; k++) {
        int32_t e;
        int dup;
        do {
          e = rng_in(0, p->experts - 1);
          dup = 0;
          for (int32_t j = 0; j < k; j++) dup |= ids[r][(size_t)t * K + j] == e;
        } while (dup);
        ids[r][(size_t)t * K + k] = e;
        w[r][(size_t)t * K + k] = 0.25f + 0.125f * (float)k;
      }
    }
  }
  tw_status s =
      tw_routing_create(p, tokens, (const int32_t* const*)ids, (const float* const*)w, rt);
  for (int32_t r = 0; r < p->world_size; r++) {
    free(ids[r]);
    free(w[r]);
  }
  return s;
}

static int64_t plans = 0, failures = 0;

static void one_plan(const tw_problem* p, tw_routing_t rt, int32_t rank, const char* tag,
                     const tw_plan_config* cfg) {
  tw_plan_t pl = NULL;
  plans++;
  tw_status s = tw_plan_create(p, rt, rank, cfg, &pl);
  if (s != TW_SUCCESS) {
    failures++;
    printf("%s fail %d %s\n", tag, (int)s, tw_last_error());
    return;
  }
  double bytes = 0.0, refetch = 0.0;
  if (tw__model_traffic(pl, &bytes, &refetch) != TW_SUCCESS) bytes = refetch = -1.0;
  printf("%s %016" PRIx64
         " c %d mgb %d sched %d/%d flow %d group %d tiles %d/%d bands %d seg %d "
         "T %.17g seq %.17g gemm %.17g traffic %.17g %.17g",
         tag, plan_digest(pl, rt), pl->comm_ctas, pl->coalesce, pl->schedule, pl->schedule_request,
         pl->dataflow, pl->tile_group, pl->num_tiles, pl->num_remote_tiles, pl->num_bands,
         pl->num_segments, pl->predicted_us, pl->sequential_us, pl->gemm_us, bytes, refetch);
  /* A few points of the model's tables: tw_plan_predict, and the other schedule when the model
   * chose between them. */
  static const int32_t cs[] = {1, 5, 12, 32};
  static const int32_t mgbs[] = {1, 2, 4};
  for (int i = 0; i < 4; i++) {
    for (int j = 0; j < 3; j++) {
      double t = 0.0;
      for (int32_t sch = TW_SCHEDULE_REMOTE_FIRST; sch <= TW_SCHEDULE_EXPERT_MAJOR; sch++) {
        s = tw__model_predict(pl, sch, cs[i], mgbs[j], &t);
        if (s == TW_SUCCESS)
          printf(" p%d.%d.%d=%.17g", sch, cs[i], mgbs[j], t);
        else
          printf(" p%d.%d.%d=err%d", sch, cs[i], mgbs[j], (int)s);
      }
    }
  }
  double plain = 0.0;
  s = tw__model_eval_plain(pl, pl->comm_ctas, &plain);
  printf(" plain %.17g\n", s == TW_SUCCESS ? plain : -1.0);
  tw_plan_destroy(pl);
}

int main(int argc, char** argv) {
  const int problems = argc > 1 ? atoi(argv[1]) : 40;
  static const int32_t hiddens[] = {8, 64, 512, 1000, 1024, 2048, 2056, 4096, 7168, 8192};
  static const int32_t ffns[] = {8, 128, 704, 1408, 2048, 4096};
  static const int32_t tms[] = {0, 64, 128};
  static const int32_t tns[] = {0, 0, 64, 128, 256};
  static const char* groups[] = {NULL, "1", "3", "8", "64"};
  static const int32_t flows[] = {TW_DATAFLOW_REDUCE, TW_DATAFLOW_ADD};
  setenv("TW_DEBUG", "NONE", 1); /* the failures print their message here */
  unsetenv("TW_SCHEDULE");
  unsetenv("TW_TILE_GROUP");
  unsetenv("TW_COMBINE_DATAFLOW");
  unsetenv("TW_CALIBRATION");
  for (int n = 0; n < problems; n++) {
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = rng_in(1, 8);
    p.experts = p.world_size * rng_in(1, 8);
    p.top_k = rng_in(1, p.experts < 8 ? p.experts : 8);
    p.hidden = hiddens[rng_in(0, 9)];
    p.ffn = ffns[rng_in(0, 5)];
    p.tile_m = tms[rng_in(0, 2)];
    p.tile_n = tns[rng_in(0, 4)];
    const int32_t pick = rng_in(0, 5);
    const int32_t tokens = pick == 0   ? 0
                           : pick == 1 ? 1
                           : pick == 2 ? 2 * rng_in(0, 400) + 1
                                       : rng_in(2, 4096);
    p.max_tokens = tokens < 1 ? 1 : tokens;
    const int router = rng_in(0, 3);
    tw_routing_t rt = NULL;
    tw_status s = router == 3
                      ? uneven_routing(&p, &rt)
                      : tw_routing_generate(&p, (tw_router)router, 0.0, tokens, rng_next(), &rt);
    printf("problem %d: W %d H %d F %d E %d k %d tokens %d tm %d tn %d router %s\n", n,
           p.world_size, p.hidden, p.ffn, p.experts, p.top_k, tokens, p.tile_m, p.tile_n,
           router_name(router));
    if (s != TW_SUCCESS) {
      printf("  routing fail %d %s\n", (int)s, tw_last_error());
      continue;
    }
    for (int32_t rank = 0; rank < p.world_size; rank++) {
      for (int32_t sch = TW_SCHEDULE_AUTO; sch <= TW_SCHEDULE_EXPERT_MAJOR; sch++) {
        for (int f = 0; f < 2; f++) {
          const char* g = groups[rng_in(0, 4)];
          if (g)
            setenv("TW_TILE_GROUP", g, 1);
          else
            unsetenv("TW_TILE_GROUP");
          tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
          cfg.schedule = sch;
          cfg.dataflow = flows[f];
          char tag[96];
          snprintf(tag, sizeof tag, "  r%d s%d f%d g%s", rank, sch, flows[f], g ? g : "-");
          one_plan(&p, rt, rank, tag, &cfg);
        }
      }
      /* Given partitions, the fixed plan and the environment's schedule / dataflow. */
      unsetenv("TW_TILE_GROUP");
      tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
      char tag[96];
      cfg.comm_ctas = rng_in(1, 40);
      cfg.coalesce = rng_in(0, 6);
      snprintf(tag, sizeof tag, "  r%d given c%d mgb%d", rank, cfg.comm_ctas, cfg.coalesce);
      one_plan(&p, rt, rank, tag, &cfg);
      cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
      cfg.use_model = 0;
      snprintf(tag, sizeof tag, "  r%d fixed", rank);
      one_plan(&p, rt, rank, tag, &cfg);
      setenv("TW_SCHEDULE", rank % 2 ? "expert-major" : "Remote-First", 1);
      setenv("TW_COMBINE_DATAFLOW", p.top_k <= 2 && rank % 3 == 0 ? "ADD" : "reduce", 1);
      snprintf(tag, sizeof tag, "  r%d env", rank);
      one_plan(&p, rt, rank, tag, NULL);
      unsetenv("TW_SCHEDULE");
      unsetenv("TW_COMBINE_DATAFLOW");
    }
    tw_routing_destroy(rt);
  }
  /* Bad values: the messages name the variable and the fix. */
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.hidden = 1024;
  p.ffn = 512;
  p.experts = 8;
  p.top_k = 2;
  p.max_tokens = 256;
  tw_routing_t rt = NULL;
  if (tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 256, 7, &rt) == TW_SUCCESS) {
    static const char* bad[][2] = {
        {"TW_TILE_GROUP", "0"},         {"TW_TILE_GROUP", "65"},        {"TW_TILE_GROUP", " 8"},
        {"TW_TILE_GROUP", "8x"},        {"TW_SCHEDULE", "sideways"},    {"TW_SCHEDULE", "auto"},
        {"TW_COMBINE_DATAFLOW", "sum"}, {"TW_COMBINE_DATAFLOW", "Add"}, {"TW_TILE_GROUP", ""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
      setenv(bad[i][0], bad[i][1], 1);
      char tag[96];
      snprintf(tag, sizeof tag, "  env %s='%s'", bad[i][0], bad[i][1]);
      one_plan(&p, rt, 1, tag, NULL);
      unsetenv(bad[i][0]);
    }
    tw_routing_destroy(rt);
  }
  printf("plans %" PRId64 " failed %" PRId64 "\n", plans, failures);
  return 0;
}
