/*
 * test_bad_input.c: every planner entry point rejects bad input with its specific status code and
 * a non-empty tw_last_error() that names the problem (and, for routing files, the line).
 * The library's WARN log of each expected failure is silenced unless TW_DEBUG is set.
 */
#define _POSIX_C_SOURCE 200809L /* setenv, mkstemp */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"

/* The call fails with `code` and leaves a detail message of its own (the previous one is cleared
 * first: internal entry points do not clear it themselves). */
#define EXPECT_FAIL(expr, code)                                              \
  do {                                                                       \
    tw__clear_error();                                                       \
    CHECK_STATUS(expr, code);                                                \
    CHECKF(tw_last_error()[0] != '\0', "%s left no tw_last_error()", #expr); \
  } while (0)

/* The last error message contains `needle`. */
#define EXPECT_MESSAGE(needle)                                                                    \
  CHECKF(strstr(tw_last_error(), needle) != NULL, "message \"%s\" lacks \"%s\"", tw_last_error(), \
         needle)

static tw_problem good_problem(void) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.hidden = 256;
  p.ffn = 128;
  p.experts = 8;
  p.top_k = 2;
  p.max_tokens = 4;
  return p;
}

/* A valid 2-rank routing of good_problem(): rank 0 has 3 tokens, rank 1 has 2. */
static int32_t g_tokens[2] = {3, 2};
static int32_t g_ids0[6] = {0, 5, 7, 1, 2, 3}, g_ids1[4] = {4, 6, 0, 7};
static float g_w0[6] = {0.25f, 0.75f, 0.5f, 0.5f, 0.1f, 0.9f}, g_w1[4] = {0.3f, 0.7f, 1.f, 0.f};

static tw_status create_with(const tw_problem* p, const int32_t* ids0, const float* w0,
                             tw_routing_t* rt) {
  const int32_t* ids[2] = {ids0, g_ids1};
  const float* ws[2] = {w0, g_w1};
  return tw_routing_create(p, g_tokens, ids, ws, rt);
}

static void test_null_pointers(void) {
  tw_problem p = good_problem();
  tw_routing_t rt = NULL;
  tw_plan_t pl = NULL;
  const int32_t* ids[2] = {g_ids0, g_ids1};
  const float* ws[2] = {g_w0, g_w1};
  EXPECT_FAIL(tw_problem_validate(NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_problem_preset(NULL, &p), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_problem_preset("m-gpt", NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_create(NULL, g_tokens, ids, ws, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_create(&p, NULL, ids, ws, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_create(&p, g_tokens, NULL, ws, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_create(&p, g_tokens, ids, NULL, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_create(&p, g_tokens, ids, ws, NULL), TW_ERR_NULL_POINTER);
  const int32_t* ids_hole[2] = {g_ids0, NULL};
  EXPECT_FAIL(tw_routing_create(&p, g_tokens, ids_hole, ws, &rt), TW_ERR_NULL_POINTER);
  EXPECT_MESSAGE("rank 1");
  EXPECT_FAIL(tw_routing_generate(NULL, TW_ROUTER_BALANCED, 0, 1, 1, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0, 1, 1, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_read(&p, NULL, &rt), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_read(&p, "x", NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_write(NULL, "x"), TW_ERR_NULL_POINTER);
  tw_routing_stats st;
  int64_t loads[8];
  EXPECT_FAIL(tw_routing_stats_get(NULL, &st), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_expert_loads(NULL, loads), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_rank(NULL, 0, NULL, NULL, NULL), TW_ERR_NULL_POINTER);
  CHECK_OK(tw_routing_create(&p, g_tokens, ids, ws, &rt));
  EXPECT_FAIL(tw_routing_write(rt, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_stats_get(rt, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_routing_expert_loads(rt, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_plan_create(NULL, rt, 0, NULL, &pl), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_plan_create(&p, NULL, 0, NULL, &pl), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, NULL, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw_plan_summary_get(NULL, NULL), TW_ERR_NULL_POINTER);
  CHECK_OK(tw_plan_create(&p, rt, 0, NULL, &pl));
  EXPECT_FAIL(tw_plan_summary_get(pl, NULL), TW_ERR_NULL_POINTER);
  EXPECT_FAIL(tw__plan_build_segments(NULL, 2), TW_ERR_NULL_POINTER);
  /* Destroying NULL is a no-op, as free(NULL). */
  CHECK_OK(tw_plan_destroy(NULL));
  CHECK_OK(tw_routing_destroy(NULL));
  tw_plan_destroy(pl);
  tw_routing_destroy(rt);
}

static void test_zero_or_negative_sizes(void) {
  static const struct {
    size_t offset; /* of an int32_t field of tw_problem */
    int32_t value;
  } cases[] = {
      {offsetof(tw_problem, world_size), 0},    {offsetof(tw_problem, world_size), -2},
      {offsetof(tw_problem, world_size), 4096}, {offsetof(tw_problem, hidden), 0},
      {offsetof(tw_problem, hidden), -8},       {offsetof(tw_problem, ffn), 0},
      {offsetof(tw_problem, ffn), -16},         {offsetof(tw_problem, experts), 0},
      {offsetof(tw_problem, max_tokens), 0},    {offsetof(tw_problem, max_tokens), -1},
  };
  tw_problem p;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    p = good_problem();
    memcpy((char*)&p + cases[i].offset, &cases[i].value, sizeof(int32_t));
    EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_SIZE);
  }
  /* Upper bounds (before, hidden 2^30 made tw_plan_create take 10 s and 6 GB). */
  p = good_problem();
  p.hidden = 1 << 30;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_SIZE);
  EXPECT_MESSAGE("TW_MAX_HIDDEN");
  p = good_problem();
  p.ffn = TW_MAX_HIDDEN + 8;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_SIZE);
  p = good_problem();
  p.experts = TW_MAX_EXPERTS + 2;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_SIZE);
  p = good_problem();
  p.experts = 256, p.top_k = TW_MAX_TOP_K + 1;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_TOPK_RANGE);
  p = good_problem();
  p.hidden = TW_MAX_HIDDEN, p.ffn = TW_MAX_HIDDEN, p.experts = TW_MAX_EXPERTS / 2 * 2;
  p.top_k = TW_MAX_TOP_K;
  CHECK_OK(tw_problem_validate(&p)); /* the bounds themselves are accepted */
  /* Worst-case rows beyond int32. */
  p = good_problem();
  p.world_size = 8, p.experts = 64, p.top_k = 8, p.max_tokens = 40000000;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_SIZE);
  EXPECT_MESSAGE("max_tokens");
  /* Negative token counts. */
  p = good_problem();
  tw_routing_t rt = NULL;
  int32_t neg[2] = {-1, 2};
  const int32_t* ids[2] = {g_ids0, g_ids1};
  const float* ws[2] = {g_w0, g_w1};
  EXPECT_FAIL(tw_routing_create(&p, neg, ids, ws, &rt), TW_ERR_INVALID_SIZE);
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0, -1, 1, &rt), TW_ERR_INVALID_SIZE);
  CHECK(rt == NULL);
}

static void test_indivisible_experts(void) {
  tw_problem p = good_problem();
  p.world_size = 8;
  p.experts = 60;
  p.top_k = 4;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INDIVISIBLE);
  EXPECT_MESSAGE("experts (60) is not divisible by world_size (8)");
  tw_routing_t rt = NULL;
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0, 1, 1, &rt), TW_ERR_INDIVISIBLE);
}

static void test_topk_range(void) {
  tw_problem p = good_problem();
  p.top_k = 0;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_TOPK_RANGE);
  p.top_k = -3;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_TOPK_RANGE);
  p.top_k = 9;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_TOPK_RANGE);
  EXPECT_MESSAGE("top_k (9)");
  p.top_k = 8; /* == experts is fine */
  CHECK_OK(tw_problem_validate(&p));
}

static void test_expert_id_out_of_range(void) {
  tw_problem p = good_problem();
  tw_routing_t rt = NULL;
  int32_t ids[6];
  memcpy(ids, g_ids0, sizeof ids);
  ids[3] = 8; /* token 1, slot 1 */
  EXPECT_FAIL(create_with(&p, ids, g_w0, &rt), TW_ERR_EXPERT_ID);
  EXPECT_MESSAGE("rank 0 token 1 slot 1: expert id 8");
  ids[3] = -1;
  EXPECT_FAIL(create_with(&p, ids, g_w0, &rt), TW_ERR_EXPERT_ID);
  CHECK(rt == NULL);
}

static void test_repeated_expert(void) {
  tw_problem p = good_problem();
  tw_routing_t rt = NULL;
  int32_t ids[6];
  memcpy(ids, g_ids0, sizeof ids);
  ids[5] = 2; /* token 2 names expert 2 twice */
  EXPECT_FAIL(create_with(&p, ids, g_w0, &rt), TW_ERR_DUPLICATE_EXPERT);
  EXPECT_MESSAGE("rank 0 token 2 slot 1");
  CHECK(rt == NULL);
}

static void test_nonfinite_weight(void) {
  tw_problem p = good_problem();
  const float bad[3] = {NAN, INFINITY, -INFINITY};
  for (int i = 0; i < 3; i++) {
    tw_routing_t rt = NULL;
    float w[6];
    memcpy(w, g_w0, sizeof w);
    w[4] = bad[i];
    EXPECT_FAIL(create_with(&p, g_ids0, w, &rt), TW_ERR_NONFINITE_WEIGHT);
    EXPECT_MESSAGE("token 2 slot 0");
    CHECK(rt == NULL);
  }
}

static void test_capacity(void) {
  tw_problem p = good_problem();
  p.max_tokens = 2; /* rank 0 holds 3 */
  tw_routing_t rt = NULL;
  EXPECT_FAIL(create_with(&p, g_ids0, g_w0, &rt), TW_ERR_CAPACITY);
  EXPECT_MESSAGE("rank 0 holds 3 tokens");
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0, 3, 1, &rt), TW_ERR_CAPACITY);
  /* A routing built for a larger capacity does not fit a plan of a smaller one. */
  tw_problem big = good_problem();
  CHECK_OK(create_with(&big, g_ids0, g_w0, &rt));
  tw_plan_t pl = NULL;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, NULL, &pl), TW_ERR_CAPACITY);
  CHECK(pl == NULL);
  tw_routing_destroy(rt);
}

static void test_alignment(void) {
  tw_problem p = good_problem();
  p.hidden = 1020;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_ALIGNMENT);
  EXPECT_MESSAGE("hidden (1020)");
  p = good_problem();
  p.ffn = 1412;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_ALIGNMENT);
  EXPECT_MESSAGE("ffn (1412)");
}

static void test_other_ranges(void) {
  tw_problem p = good_problem();
  p.tile_m = 96;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_ARGUMENT);
  p = good_problem();
  p.tile_n = 512;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_INVALID_ARGUMENT);
  p = good_problem();
  p.dtype = TW_FP16;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_UNSUPPORTED);
  EXPECT_MESSAGE("only TW_BF16");
  p = good_problem();
  EXPECT_FAIL(tw_problem_preset("gpt-5", &p), TW_ERR_INVALID_ARGUMENT);
  tw_routing_t rt = NULL;
  EXPECT_FAIL(tw_routing_generate(&p, (tw_router)7, 0, 1, 1, &rt), TW_ERR_INVALID_ARGUMENT);
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_TARGET, 0.5, 1, 1, &rt), TW_ERR_INVALID_ARGUMENT);
  EXPECT_FAIL(tw_routing_generate(&p, TW_ROUTER_TARGET, NAN, 1, 1, &rt), TW_ERR_INVALID_ARGUMENT);
  /* Plan: rank out of range; routing of another shape; bad coalesce. */
  CHECK_OK(create_with(&p, g_ids0, g_w0, &rt));
  tw_plan_t pl = NULL;
  EXPECT_FAIL(tw_plan_create(&p, rt, 2, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  EXPECT_FAIL(tw_plan_create(&p, rt, -1, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  tw_problem other = good_problem();
  other.experts = 16;
  EXPECT_FAIL(tw_plan_create(&other, rt, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  EXPECT_MESSAGE("experts 8");
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.coalesce = -1;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = 1 << 20; /* rejected by the model after the plan is built: freed, detail kept */
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_INVALID_ARGUMENT);
  CHECK(pl == NULL);
  CHECK_OK(tw_plan_create(&p, rt, 0, NULL, &pl));
  EXPECT_FAIL(tw__plan_build_segments(pl, 0), TW_ERR_INVALID_ARGUMENT);
  tw_plan_destroy(pl);
  tw_routing_destroy(rt);
}

static void test_config_header(void) {
  tw_problem p = good_problem();
  p.size = sizeof(tw_problem) - 4;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_CONFIG_VERSION);
  p = good_problem();
  p.magic = 0x12345678u;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_CONFIG_VERSION);
  p = good_problem();
  p.version = TW_API_VERSION + 1;
  EXPECT_FAIL(tw_problem_validate(&p), TW_ERR_CONFIG_VERSION);
  EXPECT_MESSAGE("tw_problem");
  /* Plan config. */
  p = good_problem();
  tw_routing_t rt = NULL;
  CHECK_OK(create_with(&p, g_ids0, g_w0, &rt));
  tw_plan_t pl = NULL;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.size = sizeof(tw_plan_config) + 8;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_CONFIG_VERSION);
  EXPECT_MESSAGE("tw_plan_config");
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.magic = TW_PROBLEM_MAGIC;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_CONFIG_VERSION);
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.version = 0;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_CONFIG_VERSION);
  CHECK(pl == NULL);
  tw_routing_destroy(rt);
}

/* Writes `text` to a fresh temporary file; returns its path in `path`. */
static void write_file(char* path, size_t cap, const char* text) {
  const char* dir = getenv("TMPDIR");
  snprintf(path, cap, "%s/tw_bad_routing_XXXXXX", dir && *dir ? dir : "/tmp");
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  if (fd < 0) return;
  FILE* f = fdopen(fd, "w");
  fputs(text, f);
  fclose(f);
}

static void test_bad_routing_file(void) {
  tw_problem p = good_problem();
  const char* head = "tilewave-routing 1 world_size 2 experts 8 top_k 2\n";
  struct {
    const char* body; /* appended to head unless it starts with '!' (then used whole) */
    tw_status code;
    const char* needle; /* line mention expected in the message */
  } cases[] = {
      {"!", TW_ERR_IO, ":1:"},
      {"!tilewave-routing 2 world_size 2 experts 8 top_k 2\n", TW_ERR_IO, ":1:"},
      {"!# comment\nrouting 1 world_size 2 experts 8 top_k 2\n", TW_ERR_IO, ":2:"},
      {"!tilewave-routing 1 world_size 2 experts 16 top_k 2\n", TW_ERR_INVALID_ARGUMENT, ":1:"},
      {"rank 0 tokens 1\n0 1 0.5\n", TW_ERR_IO, ":3:"},       /* one weight short */
      {"rank 0 tokens 1\n0 1 0.5 0.5 7\n", TW_ERR_IO, ":3:"}, /* one field too many */
      {"rank 0 tokens 1\n0 x 0.5 0.5\n", TW_ERR_IO, ":3:"},   /* not a number */
      {"rank 1 tokens 0\n", TW_ERR_IO, ":2:"},                /* ranks out of order */
      {"rank 0 tokens 5\n", TW_ERR_CAPACITY, ":2:"},          /* max_tokens is 4 */
      {"rank 0 tokens -1\n", TW_ERR_INVALID_SIZE, ":2:"},     /* negative */
      {"rank 0 tokens 2\n0 1 0.5 0.5\n\n0 9 0.5 0.5\n", TW_ERR_EXPERT_ID, ":5:"},
      {"rank 0 tokens 1\n3 3 0.5 0.5\n", TW_ERR_DUPLICATE_EXPERT, ":3:"},
      {"rank 0 tokens 1\n3 4 nan 0.5\n", TW_ERR_NONFINITE_WEIGHT, ":3:"},
      {"rank 0 tokens 1\n3 4 0.5 inf\n", TW_ERR_NONFINITE_WEIGHT, ":3:"},
      {"rank 0 tokens 2\n3 4 0.5 0.5\n", TW_ERR_IO, ":4:"}, /* truncated */
      {"rank 0 tokens 0\n", TW_ERR_IO, ":3:"},              /* rank 1 missing */
      {"rank 0 tokens 0\nrank 1 tokens 0\nrank 2 tokens 0\n", TW_ERR_IO, ":4:"}, /* extra */
  };
  char path[512];
  char text[512];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (cases[i].body[0] == '!')
      snprintf(text, sizeof text, "%s", cases[i].body + 1);
    else
      snprintf(text, sizeof text, "%s%s", head, cases[i].body);
    write_file(path, sizeof path, text);
    tw_routing_t rt = NULL;
    EXPECT_FAIL(tw_routing_read(&p, path, &rt), cases[i].code);
    EXPECT_MESSAGE(cases[i].needle);
    CHECK(rt == NULL);
    remove(path);
  }
  /* The same file, fixed, reads fine (comments and blank lines allowed). */
  snprintf(text, sizeof text, "%s# rank 0\nrank 0 tokens 1\n\n3 4 0.5 0.5\nrank 1 tokens 0\n",
           head);
  write_file(path, sizeof path, text);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_read(&p, path, &rt));
  tw_routing_destroy(rt);
  remove(path);
  /* Input that never ends or is no text returns at once (before, /dev/zero was read forever). */
  EXPECT_FAIL(tw_routing_read(&p, "/dev/zero", &rt), TW_ERR_IO);
  EXPECT_MESSAGE("NUL byte");
  {
    FILE* f = fopen(path, "w");
    CHECK(f != NULL);
    if (f != NULL) {
      fputs(head, f);
      for (int i = 0; i < 70000; i++) fputc('1', f); /* one line beyond the limit */
      fclose(f);
      EXPECT_FAIL(tw_routing_read(&p, path, &rt), TW_ERR_IO);
      EXPECT_MESSAGE(":2: a line of more than");
      remove(path);
    }
  }
  /* A file that does not exist, and a directory that cannot be written. */
  EXPECT_FAIL(tw_routing_read(&p, "/nonexistent-dir/routing.txt", &rt), TW_ERR_IO);
  EXPECT_MESSAGE("/nonexistent-dir/routing.txt");
  CHECK_OK(create_with(&p, g_ids0, g_w0, &rt));
  EXPECT_FAIL(tw_routing_write(rt, "/nonexistent-dir/routing.txt"), TW_ERR_IO);
  tw_routing_destroy(rt);
}

/* A bounded integer environment switch (TW_GEMM_VARIANT is one): unset or empty gives the
 * fallback, a value in range is taken, anything else fails naming the variable and the range. */
static void test_env_switch(void) {
  const char* name = "TW_TEST_ENV_SWITCH";
  int v = -1;
  unsetenv(name);
  CHECK_OK(tw__env_int_in("test", name, 0, 5, 3, &v));
  CHECK(v == 3);
  setenv(name, "", 1);
  CHECK_OK(tw__env_int_in("test", name, 0, 5, 3, &v));
  CHECK(v == 3);
  setenv(name, "5", 1);
  CHECK_OK(tw__env_int_in("test", name, 0, 5, 3, &v));
  CHECK(v == 5);
  const char* bad[] = {"6", "-1", "4x", "x", " 4", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv(name, bad[i], 1);
    v = -1;
    EXPECT_FAIL(tw__env_int_in("test", name, 0, 5, 3, &v), TW_ERR_INVALID_ARGUMENT);
    EXPECT_MESSAGE(name);
    EXPECT_MESSAGE("0..5");
    CHECK(v == -1); /* untouched on failure */
  }
  EXPECT_FAIL(tw__env_int_in("test", name, 0, 5, 3, NULL), TW_ERR_NULL_POINTER);
  unsetenv(name);
}

/* The add dataflow is exact for top_k 1 or 2 only: a plan for it with top_k 3 is refused at
 * once (before, only the context refused it, after the plan had been built). */
static void test_add_dataflow_top_k(void) {
  tw_problem p = good_problem();
  p.top_k = 3;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0, 4, 1, &rt));
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.dataflow = TW_DATAFLOW_ADD;
  tw_plan_t pl = NULL;
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, &cfg, &pl), TW_ERR_UNSUPPORTED);
  EXPECT_MESSAGE("TW_DATAFLOW_REDUCE");
  CHECK(pl == NULL);
  setenv("TW_COMBINE_DATAFLOW", "add", 1);
  EXPECT_FAIL(tw_plan_create(&p, rt, 0, NULL, &pl), TW_ERR_UNSUPPORTED);
  unsetenv("TW_COMBINE_DATAFLOW");
  cfg.dataflow = TW_DATAFLOW_REDUCE;
  CHECK_OK(tw_plan_create(&p, rt, 0, &cfg, &pl));
  tw_plan_destroy(pl);
  tw_routing_destroy(rt);
}

int main(void) {
  setenv("TW_DEBUG", "NONE", 0); /* expected failures would log a WARN each */
  static const tw_test_case cases[] = {
      TW_TEST(test_null_pointers),
      TW_TEST(test_zero_or_negative_sizes),
      TW_TEST(test_indivisible_experts),
      TW_TEST(test_topk_range),
      TW_TEST(test_expert_id_out_of_range),
      TW_TEST(test_repeated_expert),
      TW_TEST(test_nonfinite_weight),
      TW_TEST(test_capacity),
      TW_TEST(test_alignment),
      TW_TEST(test_config_header),
      TW_TEST(test_other_ranges),
      TW_TEST(test_bad_routing_file),
      TW_TEST(test_env_switch),
      TW_TEST(test_add_dataflow_top_k),
  };
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
