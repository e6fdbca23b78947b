/*
 * test_plan_exec.c: runs the planner's plans on the CPU (tw__plan_exec_cpu: producer, consumer
 * and receiver threads per simulated rank, release/acquire counters) and checks the result.
 *
 * This is the proof that every row goes to the right place: for many random routings (the three
 * generated routers and hand-made ones with zero-token ranks), world sizes 1..4, tile shapes,
 * consumer counts C and coalescing factors mgb, the planned execution must equal a plain fp32
 * GEMM2 + combine (same summation orders, no plan) bit for bit, and the double reference within
 * the proven fp32 bound. It also checks that a missing publish ends in TW_ERR_TIMEOUT quickly,
 * that a misplaced band offset is caught, and that the bitwise comparison does see a plan that
 * swaps two rows of a token. Seed printed at start; TW_TEST_SEED repeats a run.
 */
#include "core.h"
#include "reference.h"
#include "tw_test.h"
#include "tw_test_random.h"

/* Everything one run needs: routing, plans, inputs and outputs of all ranks. */
typedef struct world {
  tw_problem p;
  tw_routing_t rt;
  tw_plan_t plans[4];
  float* h[4];   /* (tokens, k, F) */
  float* w2;     /* (E, H, F) */
  float* out[4]; /* (tokens, H) planned execution */
  float* ref[4]; /* (tokens, H) plain fp32 */
  double* od[4]; /* (tokens, H) double */
  double* mag[4];
} world;

/* Plans for every rank, inputs, and both references. Returns 0 if setup failed. */
static int world_setup(world* wd, tw_routing_t rt, int32_t C, int32_t mgb, uint64_t* s) {
  const tw_problem* p = &rt->problem;
  memset(wd, 0, sizeof *wd);
  wd->p = *p;
  wd->rt = rt;
  const int32_t W = p->world_size, H = p->hidden, F = p->ffn, K = p->top_k, E = p->experts;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = C;
  cfg.coalesce = mgb;
  for (int32_t r = 0; r < W; r++) {
    tw_status st = tw_plan_create(p, rt, r, &cfg, &wd->plans[r]);
    CHECK_OK(st);
    if (st != TW_SUCCESS) return 0;
  }
  wd->w2 = (float*)malloc(sizeof(float) * (size_t)E * H * F);
  for (size_t i = 0; i < (size_t)E * H * F; i++) wd->w2[i] = tw_test_rng_sym(s);
  for (int32_t r = 0; r < W; r++) {
    size_t n = (size_t)rt->tokens[r];
    wd->h[r] = (float*)malloc(sizeof(float) * (n * K * F + 1));
    for (size_t i = 0; i < n * K * F; i++) wd->h[r][i] = 2.0f * tw_test_rng_sym(s);
    wd->out[r] = (float*)malloc(sizeof(float) * (n * H + 1));
    wd->ref[r] = (float*)malloc(sizeof(float) * (n * H + 1));
    wd->od[r] = (double*)malloc(sizeof(double) * (n * H + 1));
    wd->mag[r] = (double*)malloc(sizeof(double) * (n * H + 1));
    memset(wd->out[r], 0xff, sizeof(float) * (n * H + 1)); /* NaN poison */
  }
  CHECK_OK(tw__ref_gemm2_combine_f32(rt, (const float* const*)wd->h, wd->w2, wd->ref));
  CHECK_OK(tw__ref_gemm2_combine(rt, (const float* const*)wd->h, wd->w2, wd->od, wd->mag));
  return 1;
}

static void world_free(world* wd) {
  for (int32_t r = 0; r < wd->p.world_size; r++) {
    if (wd->plans[r]) tw_plan_destroy(wd->plans[r]);
    free(wd->h[r]);
    free(wd->out[r]);
    free(wd->ref[r]);
    free(wd->od[r]);
    free(wd->mag[r]);
  }
  free(wd->w2);
  tw_routing_destroy(wd->rt);
}

static tw_status world_exec(world* wd, const tw_plan_exec_options* opt) {
  return tw__plan_exec_cpu(wd->rt, (const tw_plan_t*)wd->plans, (const float* const*)wd->h, wd->w2,
                           wd->out, opt);
}

/* Compares the planned result with both references; returns 1 when bitwise equal. */
static int world_compare(world* wd, const char* what, double* worst_rel) {
  int same = 1;
  double bound = tw__ref_fp32_error_bound(wd->p.ffn, wd->p.top_k);
  for (int32_t r = 0; r < wd->p.world_size; r++) {
    size_t n = (size_t)wd->rt->tokens[r] * wd->p.hidden;
    if (n == 0) continue;
    if (memcmp(wd->out[r], wd->ref[r], n * sizeof(float)) != 0) {
      same = 0;
      for (size_t i = 0; i < n; i++)
        if (memcmp(&wd->out[r][i], &wd->ref[r][i], sizeof(float)) != 0) {
          fprintf(stderr, "  %s: rank %d token %zu col %zu: planned %.9g, plain %.9g\n", what, r,
                  i / wd->p.hidden, i % wd->p.hidden, wd->out[r][i], wd->ref[r][i]);
          break;
        }
    }
    for (size_t i = 0; i < n; i++) {
      double err = fabs((double)wd->out[r][i] - wd->od[r][i]);
      if (!(err <= bound * wd->mag[r][i])) {
        same = 0;
        fprintf(stderr, "  %s: rank %d elem %zu: |fp32 - double| %.3g > bound %.3g\n", what, r, i,
                err, bound * wd->mag[r][i]);
        break;
      }
      if (wd->mag[r][i] > 0 && err / wd->mag[r][i] > *worst_rel) *worst_rel = err / wd->mag[r][i];
    }
  }
  return same;
}

/* The main sweep: generated routers over W = 1..4 and hand-made routings with empty ranks. */
static void test_random_routings_bit_exact(void) {
  uint64_t s = tw_test_seed ^ 0xabc;
  static const tw_router routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW,
                                       TW_ROUTER_STRESS_SKEW};
  int runs = 0, remote_runs = 0, multi_band = 0;
  double worst = 0.0;
  double t0 = tw__now_seconds();
  for (int iter = 0; iter < 240; iter++) {
    int32_t W = 1 + iter % 4;
    int32_t EL = 1 + (int32_t)(tw_test_rng_next(&s) % 3);
    int32_t E = W * EL * (W == 1 ? 4 : 1);
    int32_t K = 1 + (int32_t)(tw_test_rng_next(&s) % (uint64_t)(E < 4 ? E : 4));
    int32_t H =
        8 * (4 + (int32_t)(tw_test_rng_next(&s) % 24)); /* 32..216, often not a multiple of TN */
    int32_t F = 8 * (1 + (int32_t)(tw_test_rng_next(&s) % 6));
    int32_t tm = (iter / 4) % 2 ? 64 : 128;
    int32_t tn = (iter / 8) % 2 ? 64 : 128;
    int32_t C =
        iter % 5 == 4 ? 0 : 1 + (int32_t)(tw_test_rng_next(&s) % 6); /* 0: the model picks */
    int32_t mgb = iter % 5 == 4 ? 0 : 1 + (int32_t)(tw_test_rng_next(&s) % 3);
    int32_t T = 1 + (int32_t)(tw_test_rng_next(&s) % 120);
    /* Every sixth run is large enough (several bands per destination) for multi-band segments. */
    if (iter % 6 == 5) {
      T = 400 + (int32_t)(tw_test_rng_next(&s) % 400);
      if (W > 1) E = W;
      K = 1 + (int32_t)(tw_test_rng_next(&s) % (uint64_t)(E < 2 ? E : 2));
    }
    tw_problem p = tw_test_problem(W, H, F, E, K, 840, tm, tn); /* T + 40 at most */
    tw_routing_t rt = NULL;
    if (iter % 3 != 2) {
      CHECK_OK(tw_routing_generate(&p, routers[iter % 3], 0.0, T, tw_test_rng_next(&s), &rt));
    } else {
      int32_t tokens[4];
      for (int32_t r = 0; r < W; r++)
        tokens[r] = (tw_test_rng_next(&s) % 3 == 0)
                        ? 0
                        : 1 + (int32_t)(tw_test_rng_next(&s) % (uint64_t)(T + 40));
      if (W > 1) tokens[iter % W] = 0; /* always at least one empty rank */
      rt = tw_test_random_routing(&p, tokens, &s, iter % 2);
    }
    if (rt == NULL) continue;
    world wd;
    if (!world_setup(&wd, rt, C, mgb, &s)) {
      world_free(&wd);
      continue;
    }
    char what[160];
    snprintf(what, sizeof what, "iter %d (W %d H %d F %d E %d k %d tm %d tn %d C %d mgb %d)", iter,
             W, H, F, E, K, tm, tn, wd.plans[0]->comm_ctas, wd.plans[0]->coalesce);
    /* Half the runs give padding rows a large input: it must never reach an output. */
    tw_plan_exec_options opt = TW_PLAN_EXEC_OPTIONS_INIT;
    opt.padding_value = iter % 2 ? 1000.0f : 0.0f;
    tw_status st = world_exec(&wd, &opt);
    CHECKF(st == TW_SUCCESS, "%s: %s (%s)", what, tw_status_string(st), tw_last_error());
    if (st == TW_SUCCESS) CHECKF(world_compare(&wd, what, &worst), "%s", what);
    runs++;
    for (int32_t r = 0; r < W; r++) {
      remote_runs += wd.plans[r]->num_segments > 0;
      for (int32_t g = 0; g < wd.plans[r]->num_segments; g++)
        multi_band += wd.plans[r]->segments[g].nbands > 1;
    }
    world_free(&wd);
  }
  printf(
      "  %d planned executions (%d rank-plans with remote segments, %d multi-band segments) "
      "in %.1f s, bit-exact; worst |err|/mag vs double %.3g (bound %.3g at F=48, k=4)\n",
      runs, remote_runs, multi_band, tw__now_seconds() - t0, worst,
      tw__ref_fp32_error_bound(48, 4));
  CHECK(runs == 240);
  CHECK(remote_runs > 200);
  CHECK(multi_band > 0);
}

/* Finds a band of the given kind (remote or local) on some rank; returns 0 if none. */
static int find_band(world* wd, int remote, int32_t* rank, int32_t* band) {
  for (int32_t r = 0; r < wd->p.world_size; r++)
    for (int32_t b = 0; b < wd->plans[r]->num_bands; b++)
      if ((wd->plans[r]->bands[b].dest != r) == remote) {
        *rank = r;
        *band = b;
        return 1;
      }
  return 0;
}

/* A band whose publish is skipped must end the execution with TW_ERR_TIMEOUT, promptly. */
static void test_missing_publish_times_out(void) {
  uint64_t s = tw_test_seed ^ 0xdef;
  /* ~97 local rows per expert: more than a band of 64, so that some band holds only local rows
   * (with ~30, every expert's local rows could share the band its last remote group ends in). */
  tw_problem p = tw_test_problem(3, 96, 16, 6, 2, 300, 64, 64);
  for (int remote = 1; remote >= 0; remote--) {
    tw_routing_t rt = NULL;
    CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 290, tw_test_rng_next(&s), &rt));
    world wd;
    if (!world_setup(&wd, rt, 3, 2, &s)) {
      world_free(&wd);
      return;
    }
    tw_plan_exec_options opt = TW_PLAN_EXEC_OPTIONS_INIT;
    opt.timeout_ms = 200;
    CHECK(find_band(&wd, remote, &opt.skip_rank, &opt.skip_band));
    double t0 = tw__now_seconds();
    CHECK_STATUS(world_exec(&wd, &opt), TW_ERR_TIMEOUT);
    double dt = tw__now_seconds() - t0;
    printf("  %s band %d of rank %d unpublished: TW_ERR_TIMEOUT after %.2f s: %s\n",
           remote ? "remote" : "local", opt.skip_band, opt.skip_rank, dt, tw_last_error());
    CHECK(dt < 5.0);
    /* Either waiter may time out first: the consumer waiting for the band, or (remote case)
     * the owner's receiver waiting for the band's units; both messages name what is missing. */
    CHECK(strstr(tw_last_error(), "band") != NULL || strstr(tw_last_error(), "units") != NULL);
    /* The same world without the fault runs clean (the hook, not the data, caused it). */
    opt.skip_rank = -1;
    CHECK_OK(world_exec(&wd, &opt));
    double worst = 0.0;
    CHECK(world_compare(&wd, "after fault", &worst));
    world_free(&wd);
  }
}

/* Misplaced rows are caught: a wrong band offset by the cross-checks, two swapped receive rows
 * of one token (which no structural check can see) by the bitwise comparison. */
static void test_corrupted_plans_are_caught(void) {
  uint64_t s = tw_test_seed ^ 0x777;
  tw_problem p = tw_test_problem(2, 64, 16, 4, 2, 120, 64, 64);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 100, tw_test_rng_next(&s), &rt));
  world wd;
  if (!world_setup(&wd, rt, 2, 1, &s)) {
    world_free(&wd);
    return;
  }
  int32_t r = 0, b = 0;
  CHECK(find_band(&wd, 1, &r, &b));
  tw_band* band = &wd.plans[r]->bands[b];
  int64_t saved = band->dest_offset;
  band->dest_offset += (int64_t)p.hidden * 2 * 1000000; /* far outside the receive buffer */
  CHECK_STATUS(world_exec(&wd, NULL), TW_ERR_INTERNAL);
  band->dest_offset = saved;

  /* Plans in the wrong rank order. */
  tw_plan_t swapped[2] = {wd.plans[1], wd.plans[0]};
  CHECK_STATUS(tw__plan_exec_cpu(rt, swapped, (const float* const*)wd.h, wd.w2, wd.out, NULL),
               TW_ERR_INVALID_ARGUMENT);

  /* Two remote slots of one token exchanged on the owner. */
  int swapped_one = 0;
  for (int32_t o = 0; o < 2 && !swapped_one; o++)
    for (int32_t t = 0; t < rt->tokens[o] && !swapped_one; t++) {
      int32_t* sr = wd.plans[o]->slot_row + (size_t)t * 2;
      if (sr[0] < wd.plans[o]->recv_rows && sr[1] < wd.plans[o]->recv_rows) {
        int32_t tmp = sr[0];
        sr[0] = sr[1];
        sr[1] = tmp;
        swapped_one = 1;
        CHECK_OK(world_exec(&wd, NULL));
        double worst = 0.0;
        CHECK(!world_compare(&wd, "swapped slots (expected to differ)", &worst));
        sr[1] = sr[0];
        sr[0] = tmp;
      }
    }
  CHECK(swapped_one);
  CHECK_OK(world_exec(&wd, NULL));
  double worst = 0.0;
  CHECK(world_compare(&wd, "restored", &worst));
  world_free(&wd);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_random_routings_bit_exact),
             TW_TEST(test_missing_publish_times_out), TW_TEST(test_corrupted_plans_are_caught))
