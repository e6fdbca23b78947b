/*
 * test_schedule.c: how a plan's tile schedule is chosen and that either schedule runs right.
 *
 * The schedule comes from tw_plan_config.schedule, else the TW_SCHEDULE environment variable,
 * else the model. Checked here: a config of the size before `schedule` was appended is accepted
 * and plans like a NULL config (whatever lies past its end is never read); a bad schedule value
 * and a bad TW_SCHEDULE are errors naming the fix (the latter even when the config decides);
 * the environment decides only when the config leaves the schedule at TW_SCHEDULE_AUTO; the
 * selector switched off gives TW_DEFAULT_SCHEDULE; the summary reports the schedule. Then plans
 * of both schedules run on the CPU (tw__plan_exec_cpu: producer, consumer and receiver threads
 * per simulated rank, release/acquire counters) and must equal a plain fp32 GEMM2 + combine bit
 * for bit. Seed printed at start; TW_TEST_SEED repeats a run.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "reference.h"
#include "tw_test.h"
#include "tw_test_random.h"

/* A 2-rank routing with many small experts, where the two schedules differ. */
static tw_routing_t small_routing(tw_problem* p, uint64_t* s) {
  *p = tw_test_problem(2, 256, 128, 16, 2, 300, 64, 64);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(p, TW_ROUTER_BALANCED, 0.0, 300, tw_test_rng_next(s), &rt));
  return rt;
}

static void expect_message(const char* needle) {
  CHECKF(strstr(tw_last_error(), needle) != NULL, "message \"%s\" lacks \"%s\"", tw_last_error(),
         needle);
}

static void test_config_sizes_and_values(void) {
  uint64_t s = tw_test_seed ^ 0x5c1;
  tw_problem p;
  tw_routing_t rt = small_routing(&p, &s);
  if (rt == NULL) return;
  unsetenv("TW_SCHEDULE");
  tw_plan_t ref = NULL, pl = NULL;
  CHECK_OK(tw_plan_create(&p, rt, 1, NULL, &ref));
  /* The old size: fields up to `hardware`; a garbage schedule past the end is not read. */
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.size = offsetof(tw_plan_config, schedule);
  cfg.schedule = 77;
  CHECK_OK(tw_plan_create(&p, rt, 1, &cfg, &pl));
  if (pl && ref) {
    CHECK(pl->schedule_request == TW_SCHEDULE_AUTO);
    CHECK(pl->schedule == ref->schedule && pl->predicted_us == ref->predicted_us);
    CHECK(pl->comm_ctas == ref->comm_ctas && pl->coalesce == ref->coalesce);
  }
  tw_plan_destroy(pl);
  pl = NULL;
  /* None of the sizes. */
  cfg.size = offsetof(tw_plan_config, schedule) + 2;
  CHECK_STATUS(tw_plan_create(&p, rt, 1, &cfg, &pl), TW_ERR_CONFIG_VERSION);
  expect_message("tw_plan_config");
  /* Out-of-range schedules. */
  const int32_t bad[3] = {-1, 3, 1 << 30};
  for (int i = 0; i < 3; i++) {
    cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
    cfg.schedule = bad[i];
    tw__clear_error();
    CHECK_STATUS(tw_plan_create(&p, rt, 1, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
    expect_message("TW_SCHEDULE_EXPERT_MAJOR");
    CHECK(pl == NULL);
  }
  /* Explicit schedules, and the summary says which. */
  for (int32_t sch = TW_SCHEDULE_REMOTE_FIRST; sch <= TW_SCHEDULE_EXPERT_MAJOR; sch++) {
    cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
    cfg.schedule = sch;
    CHECK_OK(tw_plan_create(&p, rt, 1, &cfg, &pl));
    tw_plan_summary sum;
    if (pl) {
      CHECK_OK(tw_plan_summary_get(pl, &sum));
      CHECK(pl->schedule == sch && sum.schedule == sch);
      CHECK(sum.gemm_us > 0.0 && sum.sequential_us > sum.gemm_us);
    }
    tw_plan_destroy(pl);
    pl = NULL;
  }
  /* The model's choice is one of the two, reported as such, never AUTO. */
  tw_plan_summary sum;
  if (ref) {
    CHECK_OK(tw_plan_summary_get(ref, &sum));
    CHECK(sum.schedule == TW_SCHEDULE_REMOTE_FIRST || sum.schedule == TW_SCHEDULE_EXPERT_MAJOR);
  }
  /* Selector off: the default schedule unless one is given. */
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.use_model = 0;
  CHECK_OK(tw_plan_create(&p, rt, 1, &cfg, &pl));
  if (pl) CHECK(pl->schedule == TW_DEFAULT_SCHEDULE);
  tw_plan_destroy(pl);
  pl = NULL;
  cfg.schedule = TW_SCHEDULE_EXPERT_MAJOR;
  CHECK_OK(tw_plan_create(&p, rt, 1, &cfg, &pl));
  if (pl) CHECK(pl->schedule == TW_SCHEDULE_EXPERT_MAJOR);
  tw_plan_destroy(pl);
  tw_plan_destroy(ref);
  tw_routing_destroy(rt);
}

static void test_environment(void) {
  uint64_t s = tw_test_seed ^ 0xe27;
  tw_problem p;
  tw_routing_t rt = small_routing(&p, &s);
  if (rt == NULL) return;
  tw_plan_t pl = NULL;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  /* The environment decides when the config (or its absence) leaves the schedule to AUTO. */
  static const struct {
    const char* value;
    int32_t want; /* 0: the model's choice */
  } cases[] = {{"remote-first", TW_SCHEDULE_REMOTE_FIRST},
               {"expert-major", TW_SCHEDULE_EXPERT_MAJOR},
               {"Expert-Major", TW_SCHEDULE_EXPERT_MAJOR},
               {"auto", TW_SCHEDULE_AUTO},
               {"", TW_SCHEDULE_AUTO}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    CHECK(setenv("TW_SCHEDULE", cases[i].value, 1) == 0);
    for (int with_config = 0; with_config < 2; with_config++) {
      CHECK_OK(tw_plan_create(&p, rt, 0, with_config ? &cfg : NULL, &pl));
      if (pl) {
        CHECKF(pl->schedule_request == cases[i].want, "TW_SCHEDULE=\"%s\": request %d, want %d",
               cases[i].value, pl->schedule_request, cases[i].want);
        if (cases[i].want != TW_SCHEDULE_AUTO) CHECK(pl->schedule == cases[i].want);
      }
      tw_plan_destroy(pl);
      pl = NULL;
    }
  }
  /* An explicit config wins over the environment. */
  CHECK(setenv("TW_SCHEDULE", "remote-first", 1) == 0);
  cfg.schedule = TW_SCHEDULE_EXPERT_MAJOR;
  CHECK_OK(tw_plan_create(&p, rt, 0, &cfg, &pl));
  if (pl) CHECK(pl->schedule == TW_SCHEDULE_EXPERT_MAJOR);
  tw_plan_destroy(pl);
  pl = NULL;
  /* A bad value is an error, with or without a config that decides, never ignored. */
  static const char* bad[] = {"expert_major", "remote", "2", "auto "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK(setenv("TW_SCHEDULE", bad[i], 1) == 0);
    tw__clear_error();
    CHECK_STATUS(tw_plan_create(&p, rt, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
    expect_message("TW_SCHEDULE");
    expect_message("expert-major");
    CHECK(pl == NULL);
    CHECK_STATUS(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
    CHECK(pl == NULL);
  }
  unsetenv("TW_SCHEDULE");
  tw_routing_destroy(rt);
}

/* Runs the plans of every rank for one schedule on the CPU and compares with the plain fp32
 * combine, bit for bit. Returns the number of ranks whose plan had remote and local bands
 * interleaved (an expert-major order that differs from remote-first). */
static int exec_one(tw_routing_t rt, int32_t schedule, int32_t comm_ctas, int32_t mgb, uint64_t* s,
                    const char* what) {
  const tw_problem* p = &rt->problem;
  const int32_t W = p->world_size, H = p->hidden, F = p->ffn, K = p->top_k, E = p->experts;
  tw_plan_t plans[4] = {NULL, NULL, NULL, NULL};
  float *h[4] = {NULL}, *out[4] = {NULL}, *ref[4] = {NULL};
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.schedule = schedule;
  cfg.comm_ctas = comm_ctas;
  cfg.coalesce = mgb;
  int ok = 1, interleaved = 0;
  for (int32_t r = 0; r < W; r++) {
    CHECK_OK(tw_plan_create(p, rt, r, &cfg, &plans[r]));
    if (plans[r] == NULL) {
      ok = 0;
      continue;
    }
    CHECK(plans[r]->schedule == schedule);
    int seen_local = 0;
    for (int32_t b = 0; b < plans[r]->num_bands; b++) {
      if (plans[r]->bands[b].dest == r)
        seen_local = 1;
      else if (seen_local)
        interleaved = 1;
    }
  }
  float* w2 = malloc(sizeof(float) * (size_t)E * H * F);
  for (size_t i = 0; i < (size_t)E * H * F; i++) w2[i] = tw_test_rng_sym(s);
  for (int32_t r = 0; r < W; r++) {
    const size_t n = (size_t)rt->tokens[r];
    h[r] = malloc(sizeof(float) * (n * K * F + 1));
    out[r] = malloc(sizeof(float) * (n * H + 1));
    ref[r] = malloc(sizeof(float) * (n * H + 1));
    for (size_t i = 0; i < n * K * F; i++) h[r][i] = 2.0f * tw_test_rng_sym(s);
    memset(out[r], 0xff, sizeof(float) * (n * H + 1)); /* NaN poison */
  }
  if (ok) {
    CHECK_OK(tw__ref_gemm2_combine_f32(rt, (const float* const*)h, w2, ref));
    tw_plan_exec_options opt = TW_PLAN_EXEC_OPTIONS_INIT;
    opt.padding_value = 1000.0f; /* padding rows are computed, never sent or read */
    tw_status st =
        tw__plan_exec_cpu(rt, (const tw_plan_t*)plans, (const float* const*)h, w2, out, &opt);
    CHECKF(st == TW_SUCCESS, "%s: %s (%s)", what, tw_status_string(st), tw_last_error());
    for (int32_t r = 0; r < W && st == TW_SUCCESS; r++) {
      const size_t n = (size_t)rt->tokens[r] * H;
      CHECKF(n == 0 || memcmp(out[r], ref[r], n * sizeof(float)) == 0,
             "%s: rank %d differs from the plain combine", what, r);
    }
  }
  for (int32_t r = 0; r < W; r++) {
    tw_plan_destroy(plans[r]);
    free(h[r]);
    free(out[r]);
    free(ref[r]);
  }
  free(w2);
  return interleaved;
}

static void test_both_schedules_execute(void) {
  uint64_t s = tw_test_seed ^ 0x3e1;
  static const tw_router routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW,
                                       TW_ROUTER_STRESS_SKEW};
  int interleaved = 0, runs = 0;
  for (int iter = 0; iter < 40; iter++) {
    const int32_t W = 2 + iter % 3;
    const int32_t E = W * (2 + (int32_t)(tw_test_rng_next(&s) % 4));
    const int32_t K = 1 + (int32_t)(tw_test_rng_next(&s) % 3);
    const int32_t H = 8 * (4 + (int32_t)(tw_test_rng_next(&s) % 20));
    const int32_t F = 8 * (1 + (int32_t)(tw_test_rng_next(&s) % 6));
    const int32_t tm = iter % 2 ? 64 : 128, tn = (iter / 2) % 2 ? 64 : 128;
    const int32_t T = 50 + (int32_t)(tw_test_rng_next(&s) % 400);
    tw_problem p = tw_test_problem(W, H, F, E, K, 450, tm, tn);
    tw_routing_t rt = NULL;
    CHECK_OK(tw_routing_generate(&p, routers[iter % 3], 0.0, T, tw_test_rng_next(&s), &rt));
    if (rt == NULL) continue;
    const int32_t C = 1 + (int32_t)(tw_test_rng_next(&s) % 5);
    const int32_t mgb = 1 + (int32_t)(tw_test_rng_next(&s) % 4);
    char what[160];
    for (int32_t sch = TW_SCHEDULE_REMOTE_FIRST; sch <= TW_SCHEDULE_EXPERT_MAJOR; sch++) {
      snprintf(what, sizeof what,
               "iter %d schedule %d (W %d E %d k %d H %d F %d tile %dx%d C %d "
               "mgb %d)",
               iter, sch, W, E, K, H, F, tm, tn, C, mgb);
      const int il = exec_one(rt, sch, C, mgb, &s, what);
      if (sch == TW_SCHEDULE_REMOTE_FIRST) CHECK(il == 0); /* remote-first never interleaves */
      if (sch == TW_SCHEDULE_EXPERT_MAJOR) interleaved += il;
      runs++;
    }
    tw_routing_destroy(rt);
  }
  printf("  %d planned executions bit-exact, %d expert-major worlds with interleaved bands\n", runs,
         interleaved);
  CHECK(runs == 80);
  CHECK(interleaved >= 20); /* the expert-major order was really exercised */
}

/* The combine dataflow the model predicts for: config (the size before `dataflow` was appended
 * plans for the default), TW_COMBINE_DATAFLOW, bad values; and the model's terms: with a link too
 * fast to matter and enough CTAs, the two dataflows' predictions differ by the reduction alone;
 * with a slow link, the add form is slower (its adds run at 0.89-0.90 of the stores' rate); at
 * short rows its consumer takes at least TW_ADD_ROW_FLOOR_US a row per CTA; the sequential baseline
 * does not depend on the dataflow. */
static void test_dataflow(void) {
  uint64_t s = tw_test_seed ^ 0xdf1;
  tw_problem p;
  tw_routing_t rt = small_routing(&p, &s);
  if (rt == NULL) return;
  unsetenv("TW_COMBINE_DATAFLOW");
  tw_plan_t pl = NULL;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.size = offsetof(tw_plan_config, dataflow);
  cfg.dataflow = 99; /* past the end: never read */
  CHECK_OK(tw_plan_create(&p, rt, 0, &cfg, &pl));
  if (pl) CHECK(pl->dataflow == TW_DATAFLOW_REDUCE);
  tw_plan_destroy(pl);
  pl = NULL;
  const int32_t bad[3] = {-1, 3, 99};
  for (int i = 0; i < 3; i++) {
    cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
    cfg.dataflow = bad[i];
    CHECK_STATUS(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
    expect_message("TW_DATAFLOW_ADD");
  }
  CHECK(setenv("TW_COMBINE_DATAFLOW", "add", 1) == 0);
  CHECK_OK(tw_plan_create(&p, rt, 0, NULL, &pl));
  if (pl) CHECK(pl->dataflow == TW_DATAFLOW_ADD);
  tw_plan_destroy(pl);
  pl = NULL;
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.dataflow = TW_DATAFLOW_REDUCE; /* the config wins */
  CHECK_OK(tw_plan_create(&p, rt, 0, &cfg, &pl));
  if (pl) CHECK(pl->dataflow == TW_DATAFLOW_REDUCE);
  tw_plan_destroy(pl);
  pl = NULL;
  CHECK(setenv("TW_COMBINE_DATAFLOW", "sum", 1) == 0);
  CHECK_STATUS(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
  expect_message("TW_COMBINE_DATAFLOW");
  unsetenv("TW_COMBINE_DATAFLOW");

  /* The model's terms, on three machines: a link too fast to matter, a slow one, and the fast one
   * at 2 KB rows where the add dataflow's one add per row is what bounds its consumer. */
  tw_problem wide = tw_test_problem(2, 2048, 2048, 16, 2, 4096, 0, 0);
  tw_routing_t wide_rt = NULL;
  CHECK_OK(
      tw_routing_generate(&wide, TW_ROUTER_BALANCED, 0.0, 4096, tw_test_rng_next(&s), &wide_rt));
  for (int machine = 0; machine < 3 && wide_rt != NULL; machine++) {
    const int slow = machine == 1, short_rows = machine == 2;
    tw_hardware hw;
    CHECK_OK(tw_hardware_default(&hw));
    hw.link_cta_gbps = slow ? 0.5 : 1e6;
    hw.link_peak_gbps = slow ? 4.0 : 1e7;
    hw.link_latency_us = slow ? hw.link_latency_us : 0.0;
    hw.c_max = 64;
    tw_plan_t plans[2] = {NULL, NULL};
    for (int add = 0; add < 2; add++) {
      cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
      cfg.hardware = &hw;
      cfg.comm_ctas = short_rows ? 2 : 64;
      cfg.coalesce = 2;
      cfg.schedule = TW_SCHEDULE_REMOTE_FIRST;
      cfg.dataflow = add ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE;
      CHECK_OK(
          tw_plan_create(short_rows ? &p : &wide, short_rows ? rt : wide_rt, 0, &cfg, &plans[add]));
    }
    if (plans[0] && plans[1]) {
      const double t_reduce = plans[0]->predicted_us, t_add = plans[1]->predicted_us;
      CHECK(plans[0]->sequential_us == plans[1]->sequential_us);
      if (machine == 0) {
        /* 4 KB rows at 64 CTAs: the adds' floor (TW_ADD_ROW_FLOOR_US a row) keeps up with the GEMM,
         * and the link moves the bytes in nanoseconds: the two forms differ by the reduction alone,
         * which the sequential prediction also holds (GEMM alone + transfer + reduction). */
        const double reduction = plans[0]->sequential_us - plans[0]->gemm_us -
                                 (double)plans[0]->send_bytes / (hw.link_peak_gbps * 1e3);
        CHECKF(reduction > 0 && fabs((t_reduce - t_add) - reduction) < 1e-6 * t_reduce &&
                   t_add >= plans[1]->gemm_us - 1e-9,
               "fast link: add %.3f us, reduce %.3f us, its reduction %.3f us, GEMM %.3f us", t_add,
               t_reduce, reduction, plans[1]->gemm_us);
      } else if (slow) {
        CHECKF(t_add > t_reduce, "slow link: add %.3f us, reduce %.3f us", t_add, t_reduce);
      } else {
        /* 512-byte rows at 2 CTAs: a row per TW_ADD_ROW_FLOOR_US per CTA, whatever the link. */
        const double remote_rows = (double)plans[1]->send_bytes / (2.0 * p.hidden);
        CHECKF(t_add >= TW_ADD_ROW_FLOOR_US * remote_rows / 2 - 1e-6 && t_add > t_reduce,
               "short rows: add %.3f us for %.0f remote rows, reduce %.3f us", t_add, remote_rows,
               t_reduce);
      }
    }
    tw_plan_destroy(plans[0]);
    tw_plan_destroy(plans[1]);
  }
  tw_routing_destroy(wide_rt);
  tw_routing_destroy(rt);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_config_sizes_and_values),
             TW_TEST(test_environment), TW_TEST(test_dataflow),
             TW_TEST(test_both_schedules_execute))
