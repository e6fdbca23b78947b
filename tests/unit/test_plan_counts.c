/*
 * test_plan_counts.c: the plan from the count matrix (tw__plan_create_from_counts, what the
 * dispatch builds from the all-gathered device counts) equals tw_plan_create's from a routing
 * with those counts, field by field, on many random routings (W = 1..8, balanced and skewed,
 * ranks with 0, 1, odd and full token counts, every config the planner takes); and the two
 * per-token rules the device scan follows reproduce the routing plan exactly:
 *   slot_row[i] = slot_base[g] + p          (the owner's reduction map)
 *   rank g / E's row_src[send_row0[g] + p] = (this rank, token, slot)   (the dispatch target)
 * where p is slot i's position among this rank's slots of expert g in (token, slot) order.
 * Bad count matrices are refused with the status that names the problem.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"
#include "tw_test_random.h"

static uint64_t g_rng;

static int32_t rnd_in(int32_t lo, int32_t hi) { /* [lo, hi] */
  return tw_test_rnd_in(&g_rng, lo, hi);
}

static int same_bands(const tw_band* a, const tw_band* b, int32_t n) {
  for (int32_t i = 0; i < n; i++)
    if (a[i].expert != b[i].expert || a[i].row0 != b[i].row0 || a[i].rows != b[i].rows ||
        a[i].valid_rows != b[i].valid_rows || a[i].dest != b[i].dest ||
        a[i].segment != b[i].segment || a[i].dest_offset != b[i].dest_offset)
      return 0;
  return 1;
}

static int same_i32(const int32_t* a, const int32_t* b, int64_t n) {
  return n == 0 || memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
}

/* Every field but the per-token ones equal; b's per-token ones unset. */
static void compare_plans(const struct tw_plan* a, const struct tw_plan* b, const char* what) {
  const int32_t E = a->local_experts, W = a->problem.world_size, ET = a->problem.experts;
  CHECKF(a->rank == b->rank && a->local_experts == b->local_experts && a->tm == b->tm &&
             a->tn == b->tn && a->col_tiles == b->col_tiles && a->rows == b->rows,
         "%s: shape fields differ (rows %d / %d)", what, a->rows, b->rows);
  if (a->rows != b->rows || a->local_experts != b->local_experts) return;
  CHECKF(same_i32(a->expert_row0, b->expert_row0, E) &&
             same_i32(a->expert_rows, b->expert_rows, E) &&
             same_i32(a->expert_real_rows, b->expert_real_rows, E) &&
             same_i32(a->expert_order, b->expert_order, E) &&
             same_i32(a->expert_band0, b->expert_band0, E + 1) &&
             same_i32(a->expert_local_band0, b->expert_local_band0, E),
         "%s: per-expert arrays differ", what);
  int bad_rows = 0;
  for (int32_t r = 0; r < a->rows; r++)
    bad_rows += a->row_src[r].owner != b->row_src[r].owner || b->row_src[r].token != -1 ||
                b->row_src[r].slot != -1;
  CHECKF(bad_rows == 0, "%s: %d rows with another owner (or a token) in the plan from counts", what,
         bad_rows);
  CHECKF(a->schedule == b->schedule && a->schedule_request == b->schedule_request &&
             a->dataflow == b->dataflow && a->tile_group == b->tile_group &&
             a->num_tiles == b->num_tiles && a->num_remote_tiles == b->num_remote_tiles &&
             a->num_bands == b->num_bands && a->coalesce == b->coalesce &&
             a->num_segments == b->num_segments && a->send_bytes == b->send_bytes &&
             a->recv_rows == b->recv_rows,
         "%s: schedule or combine-plan scalars differ", what);
  if (a->num_bands != b->num_bands || a->num_tiles != b->num_tiles ||
      a->num_segments != b->num_segments)
    return;
  CHECKF(memcmp(a->tiles, b->tiles, (size_t)a->num_tiles * sizeof(tw_tile)) == 0,
         "%s: tile lists differ", what);
  CHECKF(same_bands(a->bands, b->bands, a->num_bands) &&
             same_bands(a->layout_bands, b->layout_bands, a->num_bands),
         "%s: bands differ", what);
  CHECKF(a->num_segments == 0 ||
             memcmp(a->segments, b->segments, (size_t)a->num_segments * sizeof(tw_segment)) == 0,
         "%s: segments differ", what);
  CHECKF(same_i32(a->recv_bands, b->recv_bands, W) &&
             same_i32(a->stream_first, b->stream_first, W) &&
             same_i32(a->stream_last, b->stream_last, W),
         "%s: per-rank arrays differ", what);
  CHECKF(same_i32(a->slot_base, b->slot_base, ET) && same_i32(a->send_row0, b->send_row0, ET),
         "%s: slot_base / send_row0 differ", what);
  CHECKF(b->slot_row == NULL, "%s: the plan from counts has a slot_row", what);
  /* The model's decision, to the bit. */
  CHECKF(a->comm_ctas == b->comm_ctas && a->predicted_us == b->predicted_us &&
             a->sequential_us == b->sequential_us && a->gemm_us == b->gemm_us,
         "%s: the model decided otherwise (C %d / %d, T %.17g / %.17g)", what, a->comm_ctas,
         b->comm_ctas, a->predicted_us, b->predicted_us);
  tw_plan_summary sa, sb;
  CHECK_OK(tw_plan_summary_get((tw_plan_t)a, &sa));
  CHECK_OK(tw_plan_summary_get((tw_plan_t)b, &sb));
  sa.solve_us = sb.solve_us = 0; /* a measured time */
  CHECKF(memcmp(&sa, &sb, sizeof sa) == 0, "%s: summaries differ", what);
  double ta = 0, tb = 0;
  CHECK_OK(tw_plan_predict((tw_plan_t)a, 1, a->coalesce, &ta));
  CHECK_OK(tw_plan_predict((tw_plan_t)b, 1, b->coalesce, &tb));
  CHECK(ta == tb);
}

/* The device scan's rules, on the host, against the routing plans of every rank. */
static void check_token_rules(const tw_problem* p, tw_routing_t rt, tw_plan_t* plans) {
  const int32_t W = p->world_size, ET = p->experts, K = p->top_k, E = ET / W;
  int32_t* pos = malloc((size_t)ET * sizeof *pos);
  int bad_slot = 0, bad_dest = 0;
  for (int32_t me = 0; me < W; me++) {
    const struct tw_plan* pl = plans[me];
    int32_t n = 0;
    const int32_t* ids = NULL;
    tw_routing_rank(rt, me, &n, &ids, NULL);
    memset(pos, 0, (size_t)ET * sizeof *pos);
    for (int32_t t = 0; t < n; t++)
      for (int32_t j = 0; j < K; j++) {
        const int64_t i = (int64_t)t * K + j;
        const int32_t g = ids[i], at = pos[g]++;
        bad_slot += pl->slot_row[i] != pl->slot_base[g] + at;
        const struct tw_plan* dst = plans[g / E];
        const int32_t row = pl->send_row0[g] + at;
        if (pl->send_row0[g] < 0 || row >= dst->rows) {
          bad_dest++;
          continue;
        }
        const tw_row_src* s = &dst->row_src[row];
        bad_dest += s->owner != me || s->token != t || s->slot != j;
      }
  }
  free(pos);
  CHECKF(bad_slot == 0, "%d slots whose slot_row is not slot_base + position", bad_slot);
  CHECKF(bad_dest == 0, "%d slots whose dispatch row at the expert's rank holds another row",
         bad_dest);
}

/* A routing of tokens[r] tokens per rank cut from a generated one. */
static void test_counts_plan_equals_routing_plan(void) {
  g_rng = tw_test_seed ^ 0xc0ffee;
  static const int32_t kTn[] = {0, 64, 128, 256};
  int plans_compared = 0;
  for (int it = 0; it < 160; it++) {
    const int32_t W = 1 + it % 8;
    const int32_t E = W * rnd_in(1, 8);
    const int32_t K = rnd_in(1, E < 6 ? E : 6);
    const int32_t max_tokens = rnd_in(1, 300);
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = W;
    p.experts = E;
    p.top_k = K;
    p.hidden = 8 * rnd_in(1, 256);
    p.ffn = 8 * rnd_in(1, 64);
    p.max_tokens = max_tokens;
    p.tile_m = rnd_in(0, 1) ? 64 : 128;
    p.tile_n = kTn[rnd_in(0, 3)];
    if (tw_problem_validate(&p) != TW_SUCCESS) continue;
    /* Token counts: full, 0, 1, odd, random. */
    int32_t tokens[TW_MAX_RANKS];
    tw_test_token_kinds(&g_rng, W, max_tokens, tokens);
    const tw_router router = (tw_router)rnd_in(0, 2);
    tw_routing_t rt = tw_test_router_routing(&p, router, tokens, tw_test_seed + (uint64_t)it);
    CHECKF(rt != NULL, "iteration %d: no routing: %s", it, tw_last_error());
    if (rt == NULL) continue;
    int32_t* counts = tw_test_count_matrix(&p, rt);
    /* Configs: the model's choice, a fixed schedule, a given partition, a budget, the add
     * dataflow where it runs. */
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.dataflow = TW_DATAFLOW_REDUCE;
    switch (it % 5) {
      case 1:
        cfg.schedule = TW_SCHEDULE_EXPERT_MAJOR;
        break;
      case 2:
        cfg.comm_ctas = rnd_in(1, 16);
        cfg.coalesce = rnd_in(1, 4);
        break;
      case 3:
        cfg.sm_budget = rnd_in(8, 132);
        break;
      case 4:
        cfg.dataflow = K <= 2 ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE;
        break;
      default:
        break;
    }
    tw_plan_t* a = calloc((size_t)W, sizeof *a);
    int all = 1;
    uint64_t fp_counts = 0;
    for (int32_t r = 0; r < W; r++) {
      tw_plan_t b = NULL;
      const tw_status sa = tw_plan_create(&p, rt, r, &cfg, &a[r]);
      const tw_status sb = tw__plan_create_from_counts(&p, counts, r, &cfg, &b);
      /* The fingerprint (checked on the device where rows arrive): the same on every rank of
       * one call, for either source of the plan. */
      if (sa == TW_SUCCESS && a[0] != NULL)
        CHECKF(a[r]->fingerprint == a[0]->fingerprint,
               "iteration %d rank %d: routing plans' fingerprints differ across ranks", it, r);
      if (sb == TW_SUCCESS) {
        if (r == 0) fp_counts = b->fingerprint;
        CHECKF(b->fingerprint == fp_counts,
               "iteration %d rank %d: count plans' fingerprints differ across ranks", it, r);
      }
      CHECKF(sa == sb, "iteration %d rank %d: statuses %d (routing) and %d (counts): %s", it, r,
             (int)sa, (int)sb, tw_last_error());
      all &= sa == TW_SUCCESS;
      if (sa == TW_SUCCESS && sb == TW_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "iteration %d (W %d, E %d, k %d) rank %d", it, W, E, K, r);
        compare_plans(a[r], b, what);
        plans_compared++;
      }
      tw_plan_destroy(b);
    }
    if (all) check_token_rules(&p, rt, a);
    for (int32_t r = 0; r < W; r++) tw_plan_destroy(a[r]);
    free(a);
    free(counts);
    tw_routing_destroy(rt);
  }
  printf("  %d plan pairs compared\n", plans_compared);
  CHECK(plans_compared > 300);
}

static void test_bad_counts_refused(void) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.experts = 4;
  p.top_k = 2;
  p.hidden = 64;
  p.ffn = 64;
  p.max_tokens = 10;
  int32_t c[8] = {3, 3, 2, 2, 1, 1, 0, 0};
  tw_plan_t pl = NULL;
  CHECK_OK(tw__plan_create_from_counts(&p, c, 0, NULL, &pl));
  tw_plan_destroy(pl);
  pl = NULL;
  c[0] = -1; /* negative */
  CHECK_STATUS(tw__plan_create_from_counts(&p, c, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  c[0] = 4; /* 11 slots on rank 0: not whole tokens */
  CHECK_STATUS(tw__plan_create_from_counts(&p, c, 1, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  CHECK(strstr(tw_last_error(), "top_k") != NULL);
  c[0] = 6; /* 13 ... */
  c[1] = 5; /* 6 + 5 + 2 + 2 = 15: no */
  CHECK_STATUS(tw__plan_create_from_counts(&p, c, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  c[1] = 0; /* 6 + 0 + 2 + 2 = 10 slots = 5 tokens, 6 of them to expert 0 */
  CHECK_STATUS(tw__plan_create_from_counts(&p, c, 0, NULL, &pl), TW_ERR_DUPLICATE_EXPERT);
  int32_t big[8] = {11, 11, 0, 0, 0, 0, 0, 0}; /* 11 tokens > max_tokens 10 */
  CHECK_STATUS(tw__plan_create_from_counts(&p, big, 0, NULL, &pl), TW_ERR_CAPACITY);
  int32_t ok[8] = {1, 1, 0, 0, 0, 0, 0, 0};
  CHECK_STATUS(tw__plan_create_from_counts(&p, ok, 2, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__plan_create_from_counts(&p, NULL, 0, NULL, &pl), TW_ERR_NULL_POINTER);
  CHECK(pl == NULL);
}

/* Plans of one call that differ (other counts with the same totals, another problem, another
 * dataflow) have other fingerprints, so the device check tells them apart. */
static void test_fingerprints_tell_plans_apart(void) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.experts = 4;
  p.top_k = 2;
  p.hidden = 64;
  p.ffn = 64;
  p.max_tokens = 10;
  int32_t c[8] = {3, 3, 2, 2, 1, 1, 0, 0};
  int32_t moved[8] = {3, 2, 3, 2, 1, 1, 0, 0}; /* one slot of rank 0 to another expert */
  tw_plan_t a = NULL, b = NULL, h = NULL, d = NULL;
  CHECK_OK(tw__plan_create_from_counts(&p, c, 0, NULL, &a));
  CHECK_OK(tw__plan_create_from_counts(&p, moved, 0, NULL, &b));
  tw_problem q = p;
  q.hidden = 128;
  CHECK_OK(tw__plan_create_from_counts(&q, c, 0, NULL, &h));
  tw_plan_config add = TW_PLAN_CONFIG_INIT;
  add.dataflow = TW_DATAFLOW_ADD;
  CHECK_OK(tw__plan_create_from_counts(&p, c, 0, &add, &d));
  if (a != NULL && b != NULL && h != NULL && d != NULL) {
    CHECK(a->fingerprint != b->fingerprint);
    CHECK(a->fingerprint != h->fingerprint);
    CHECK(a->fingerprint != d->fingerprint);
  }
  tw_plan_destroy(a);
  tw_plan_destroy(b);
  tw_plan_destroy(h);
  tw_plan_destroy(d);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_counts_plan_equals_routing_plan),
             TW_TEST(test_bad_counts_refused), TW_TEST(test_fingerprints_tell_plans_apart))
