/*
 * plan.c: tw_plan_create (from a routing), tw__plan_create_from_counts (from the count matrix)
 * and the plan's lifetime: checks the arguments, resolves the schedule, dataflow and tile group
 * the plan is built for, then builds it in three steps, each in its own file and none calling
 * back into this one:
 *
 *   layout.c     the row layout of the rank's local experts, its bands in layout order and the
 *                receive side (tw__plan_layout, tw__plan_layout_counts);
 *   schedule.c   the bands and tiles in the order of a schedule (tw__plan_set_schedule);
 *   model*.c     the partition (C, mgb) and, for TW_SCHEDULE_AUTO, the schedule, which reorders
 *                the plan (schedule.c) and builds its segments (segments.c) as it goes
 *                (tw__model_choose).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"

/* Frees a plan, possibly partly built; keeps the thread's last error (failure paths use it). */
static void tw__plan_free(struct tw_plan* plan) {
  if (plan == NULL) return;
  tw__model_free(plan); /* the model's tables (model.c) */
  free(plan->expert_row0);
  free(plan->expert_rows);
  free(plan->expert_real_rows);
  free(plan->row_src);
  free(plan->tiles);
  free(plan->expert_order);
  free(plan->layout_bands);
  free(plan->expert_band0);
  free(plan->expert_local_band0);
  free(plan->bands);
  free(plan->segments);
  free(plan->slot_row);
  free(plan->recv_bands);
  free(plan->stream_first);
  free(plan->stream_last);
  free(plan->slot_base);
  free(plan->send_row0);
  free(plan);
}

tw_status tw_plan_destroy(tw_plan_t plan) {
  tw__clear_error();
  tw__plan_free(plan);
  return TW_SUCCESS;
}

int32_t tw__schedule_parse(const char* s) {
  /* TW_SCHEDULE's choices (tunables.c) are in tw_schedule order: the index is the value. */
  return tw__tunable_match(TW_TUNE_SCHEDULE, s);
}

tw_status tw__schedule_resolve(const tw_plan_config* config, int32_t* schedule) {
  TW_CHECK_NULL(schedule);
  *schedule = TW_SCHEDULE_AUTO;
  /* Read on every plan (not cached): a process may change it between plans, e.g. a benchmark
   * that measures both schedules. A bad value is an error even when the config decides, so that
   * a typo never goes unnoticed. */
  int32_t from_env = TW_SCHEDULE_AUTO;
  TW_TRY(tw__tunable_choice("tw_plan_create", TW_TUNE_SCHEDULE, &from_env));
  int32_t from_config = TW_SCHEDULE_AUTO;
  if (config != NULL && config->size >= offsetof(tw_plan_config, schedule) + sizeof(int32_t)) {
    from_config = config->schedule;
    if (from_config != TW_SCHEDULE_AUTO && from_config != TW_SCHEDULE_REMOTE_FIRST &&
        from_config != TW_SCHEDULE_EXPERT_MAJOR)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_plan_config.schedule = %d; give 0 (TW_SCHEDULE_AUTO: env TW_SCHEDULE, "
                      "else the model's choice), 1 (TW_SCHEDULE_REMOTE_FIRST) or 2 "
                      "(TW_SCHEDULE_EXPERT_MAJOR)",
                      from_config);
  }
  *schedule = from_config != TW_SCHEDULE_AUTO ? from_config : from_env;
  return TW_SUCCESS;
}

tw_status tw__tile_group_resolve(int32_t* tile_group) {
  TW_CHECK_NULL(tile_group);
  *tile_group = TW_TILE_GROUP_DEFAULT;
  /* Read on every plan, like TW_SCHEDULE. */
  return tw__tunable_int_or("tw_plan_create", TW_TUNE_TILE_GROUP, TW_TILE_GROUP_DEFAULT,
                            tile_group);
}

/* What tw_plan_create resolves from the config before it looks at the routing: the config's
 * header, the schedule, the dataflow (and whether the problem can run it) and the tile group. */
static tw_status tw__plan_config_resolve(const tw_problem* p, const tw_plan_config* config,
                                         int32_t* schedule, int32_t* dataflow,
                                         int32_t* tile_group) {
  /* The config's values are checked by the model (tw__model_choose), against the hardware, and
   * the schedule by tw__schedule_resolve. A config of the size before `schedule` was appended
   * (same magic and version) is a caller built against the earlier tilewave.h: it is read up to
   * `hardware` and plans as TW_SCHEDULE_AUTO, like a NULL config; one that ends before
   * `dataflow` plans for TW_DATAFLOW_DEFAULT. */
  if (config != NULL) {
    const size_t v1_size = offsetof(tw_plan_config, schedule);
    const size_t v2_size = offsetof(tw_plan_config, dataflow);
    const size_t v3_size = offsetof(tw_plan_config, sm_budget);
    const size_t known =
        config->size == v1_size || config->size == v2_size || config->size == v3_size
            ? config->size
            : sizeof(tw_plan_config);
    TW_TRY(tw__check_header("tw_plan_config", config->size, known, config->magic,
                            TW_PLAN_CONFIG_MAGIC, config->version));
  }
  *schedule = TW_SCHEDULE_AUTO;
  TW_TRY(tw__schedule_resolve(config, schedule));
  *dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw__dataflow_resolve("tw_plan_create",
                              config != NULL && config->size > offsetof(tw_plan_config, dataflow)
                                  ? config->dataflow
                                  : TW_DATAFLOW_DEFAULT,
                              dataflow));
  /* The add dataflow sums a token's rows in the order they land: exact for two rows only. */
  if (*dataflow == TW_DATAFLOW_ADD && p->top_k > 2)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_plan_create: the add dataflow runs top_k 1 or 2, this problem has top_k "
                    "%d; plan for TW_DATAFLOW_REDUCE (tw_plan_config.dataflow or "
                    "TW_COMBINE_DATAFLOW=reduce)",
                    p->top_k);
  *tile_group = TW_TILE_GROUP_DEFAULT;
  TW_TRY(tw__tile_group_resolve(tile_group));
  return TW_SUCCESS;
}

/* FNV-1a over 32-bit words. */
static uint64_t tw__fnv_words(uint64_t h, const int32_t* v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    h ^= (uint32_t)v[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/* The plan's fingerprint (plan.h): every rank computes it from the same inputs of a call, so
 * ranks that planned from different routings, problems or counts differ (but for a hash
 * collision, about 2^-64). */
static uint64_t tw__plan_fingerprint(const struct tw_plan* pl, const struct tw_routing* routing,
                                     const int32_t* counts) {
  const tw_problem* p = &pl->problem;
  const int32_t head[] = {p->world_size, p->hidden, p->ffn,       p->experts,     p->top_k,
                          pl->tm,        pl->tn,    pl->dataflow, routing != NULL};
  uint64_t h = tw__fnv_words(0xcbf29ce484222325ull, head, sizeof head / sizeof head[0]);
  if (counts != NULL) return tw__fnv_words(h, counts, (size_t)p->world_size * (size_t)p->experts);
  for (int32_t r = 0; r < p->world_size; r++) {
    const int32_t t = routing->tokens[r];
    h = tw__fnv_words(h, &t, 1);
    h = tw__fnv_words(h, routing->expert_ids[r], (size_t)t * (size_t)p->top_k);
  }
  return h;
}

/* Builds the plan once the inputs are checked: the layout from the routing, or from the count
 * matrix when routing is NULL, then the schedule and the model's partition. */
static tw_status tw__plan_build(const tw_problem* p, const struct tw_routing* routing,
                                const int32_t* counts, int32_t rank, const tw_plan_config* config,
                                int32_t schedule, int32_t dataflow, int32_t tile_group,
                                tw_plan_t* plan) {
  struct tw_plan* pl = calloc(1, sizeof *pl);
  if (pl == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory");
  pl->problem = *p;
  pl->rank = rank;
  pl->local_experts = p->experts / p->world_size;
  pl->tm = tw__resolve_tile_m(p);
  pl->tn = tw__resolve_tile_n(p);
  pl->col_tiles = (int32_t)tw__ceil_div(p->hidden, pl->tn);
  pl->schedule_request = schedule;
  pl->dataflow = dataflow;
  pl->tile_group = tile_group;
  pl->fingerprint = tw__plan_fingerprint(pl, routing, counts);
  tw_status st =
      routing != NULL ? tw__plan_layout(pl, routing) : tw__plan_layout_counts(pl, counts);
  /* The model tabulates an AUTO plan in remote-first order first (tw__model_choose). */
  if (st == TW_SUCCESS)
    st = tw__plan_set_schedule(pl, pl->schedule_request == TW_SCHEDULE_EXPERT_MAJOR
                                       ? TW_SCHEDULE_EXPERT_MAJOR
                                       : TW_SCHEDULE_REMOTE_FIRST);
  if (st == TW_SUCCESS) st = tw__model_choose(pl, config);
  if (st != TW_SUCCESS) {
    tw__plan_free(pl);
    return st;
  }
  *plan = pl;
  return TW_SUCCESS;
}

tw_status tw_plan_create(const tw_problem* problem, tw_routing_t routing, int32_t rank,
                         const tw_plan_config* config, tw_plan_t* plan) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  *plan = NULL;
  TW_TRY(tw_problem_validate(problem));
  TW_CHECK_NULL(routing);
  const tw_problem* p = problem;
  int32_t schedule = TW_SCHEDULE_AUTO, dataflow = TW_DATAFLOW_REDUCE;
  int32_t tile_group = TW_TILE_GROUP_DEFAULT;
  TW_TRY(tw__plan_config_resolve(p, config, &schedule, &dataflow, &tile_group));
  const tw_problem* rp = &routing->problem;
  if (rp->world_size != p->world_size || rp->experts != p->experts || rp->top_k != p->top_k)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "the routing is for world_size %d, experts %d, top_k %d but the problem has "
                    "%d, %d, %d; build the routing from the same problem",
                    rp->world_size, rp->experts, rp->top_k, p->world_size, p->experts, p->top_k);
  for (int32_t r = 0; r < p->world_size; r++)
    if (routing->tokens[r] > p->max_tokens)
      return tw__fail(TW_ERR_CAPACITY,
                      "routing rank %d holds %d tokens, more than the problem's max_tokens (%d); "
                      "raise max_tokens",
                      r, routing->tokens[r], p->max_tokens);
  if (rank < 0 || rank >= p->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "rank %d is outside 0..%d (world_size %d)", rank,
                    p->world_size - 1, p->world_size);
  return tw__plan_build(p, routing, NULL, rank, config, schedule, dataflow, tile_group, plan);
}

tw_status tw__plan_create_from_counts(const tw_problem* problem, const int32_t* counts,
                                      int32_t rank, const tw_plan_config* config, tw_plan_t* plan) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  *plan = NULL;
  TW_TRY(tw_problem_validate(problem));
  TW_CHECK_NULL(counts);
  const tw_problem* p = problem;
  int32_t schedule = TW_SCHEDULE_AUTO, dataflow = TW_DATAFLOW_REDUCE;
  int32_t tile_group = TW_TILE_GROUP_DEFAULT;
  TW_TRY(tw__plan_config_resolve(p, config, &schedule, &dataflow, &tile_group));
  /* What a routing guarantees by construction: each rank's slots are whole tokens, at most
   * max_tokens of them, and a token names an expert at most once. */
  const int32_t ET = p->experts;
  for (int32_t o = 0; o < p->world_size; o++) {
    const int32_t* row = counts + (size_t)o * (size_t)ET;
    int64_t slots = 0;
    int32_t top = 0;
    for (int32_t g = 0; g < ET; g++) {
      if (row[g] < 0)
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "plan from counts: rank %d routes %d slots to expert %d; counts must be "
                        ">= 0",
                        o, row[g], g);
      slots += row[g];
      if (row[g] > top) top = row[g];
    }
    if (slots % p->top_k != 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "plan from counts: rank %d routes %lld slots, not a multiple of top_k %d", o,
                      (long long)slots, p->top_k);
    const int64_t tokens = slots / p->top_k;
    if (tokens > p->max_tokens)
      return tw__fail(TW_ERR_CAPACITY,
                      "plan from counts: rank %d holds %lld tokens, more than the problem's "
                      "max_tokens (%d); raise max_tokens",
                      o, (long long)tokens, p->max_tokens);
    if (top > tokens)
      return tw__fail(TW_ERR_DUPLICATE_EXPERT,
                      "plan from counts: rank %d routes %d of its %lld tokens to one expert; a "
                      "token names each expert at most once",
                      o, top, (long long)tokens);
  }
  if (rank < 0 || rank >= p->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "rank %d is outside 0..%d (world_size %d)", rank,
                    p->world_size - 1, p->world_size);
  return tw__plan_build(p, NULL, counts, rank, config, schedule, dataflow, tile_group, plan);
}

tw_status tw_plan_summary_get(tw_plan_t plan, tw_plan_summary* summary) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(summary);
  int64_t real = 0;
  for (int32_t e = 0; e < plan->local_experts; e++) real += plan->expert_real_rows[e];
  memset(summary, 0, sizeof *summary);
  summary->rank = plan->rank;
  summary->comm_ctas = plan->comm_ctas;
  summary->coalesce = plan->coalesce;
  summary->rows = plan->rows;
  summary->padding_rows = plan->rows - real;
  summary->tiles = plan->num_tiles;
  summary->remote_tiles = plan->num_remote_tiles;
  summary->bands = plan->num_bands;
  summary->segments = plan->num_segments;
  summary->send_bytes = plan->send_bytes;
  summary->predicted_us = plan->predicted_us;
  summary->sequential_us = plan->sequential_us;
  summary->solve_us = plan->solve_us;
  summary->schedule = plan->schedule;
  summary->gemm_us = plan->gemm_us;
  summary->dataflow = plan->dataflow;
  summary->sm_budget = plan->hardware.sm_count;
  return TW_SUCCESS;
}
